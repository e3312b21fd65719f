"""save(): planning, writing regions, syncing, and the atomic commit."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from . import _dtypes, _chunking, _lease, _store
from ._codec import shardwrite
from ._coord import ask_root, phase
from ._dist import coordinator_for
from ._codec.encode import LITTLE_ENDIAN, encode_chunk
from ._errors import CheckpointExistsError, DistributedError, LeafTypeError, SaveInProgressError, TsckptError
from ._format import (
    LAYOUT_COMPACT,
    LAYOUT_PLAIN,
    ArrayRecord,
    ROOT_KEY,
    STATE_COMMITTED,
    STATE_PENDING,
    format_version,
    group_metadata,
)
from ._arrays import MANIFEST, OCDBT_PREFIX, array_node, chunk_key, data_spec, open_array
from ._kinds import checksum, storage_numpy
from ._leaves import describe, memory
from ._root import root_state
from ._types import LazySource, Local
from ._plan import (
    Gathered,
    RankPlan,
    WriteItem,
    _intersect,
    gather_descs,
    pack_descs,
    plan_aliases,
    plan_save,
    shard_boxes,
    shared_regions,
    split_plan,
    with_checksums,
    without,
)
from ._options import WRITE_WINDOW_BYTES, SaveOptions, verb
from ._progress import Progress
from ._codec.threads import Workers
from ._store import Directory, Location, resolve
from .tree import flatten, structure_to_json

# Shard files of a local plain checkpoint written at once by tsckpt's own writer
# (_shardwrite; pwritev and large copies release the GIL); 0 leaves every file to
# TensorStore. 1 GiB on 2 CPUs: 1.9 s with 2 threads, 2.8 s with 1 (medians of 5).
WRITE_THREADS = 2
# Start writing each such file to disk as soon as it is written (sync_data still makes
# them durable): 1.9 s against 2.8 s for 1 GiB with 2 threads (medians of 5).
START_WRITEBACK = True


def _version() -> str:
    from . import __version__

    return __version__


def _local_box(lf: Local, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> np.ndarray:
    """Storage-dtype numpy of the global box (``offsets``, ``lengths``) from a rank's local data."""
    sel = tuple(slice(o - lo, o - lo + n) for o, lo, n in zip(offsets, lf.desc.offsets, lengths))
    if not isinstance(lf.data, LazySource):
        return storage_numpy(lf.data[sel] if sel else lf.data)
    got = storage_numpy(lf.data[sel])
    want = (_dtypes.storage_shape(lf.desc.dtype, lengths), _dtypes.numpy_dtype(lf.desc.dtype))
    if (got.shape, got.dtype) != want:
        raise LeafTypeError(
            f"'{lf.desc.path}': its source returned {got.dtype}{list(got.shape)} for a {want[1]}{list(want[0])} "
            "region; the file it reads may have changed"
        )
    return got


def _exchange(coord: Any, plan: RankPlan, local: dict[str, Local]) -> dict[int, np.ndarray]:
    """Send the pieces of straddling shards to their writers; return what this rank received,
    keyed by transfer tag."""
    me = coord.rank
    sends, recvs = [], []
    for i, t in plan.transfers:
        if t.src == me:
            sends.append((t.dst, i, np.ascontiguousarray(_local_box(local[t.path], t.offsets, t.lengths))))
        elif t.dst == me:
            lf = local[t.path]
            nbytes = math.prod(t.lengths) * lf.desc.itemsize
            recvs.append((t.src, i, nbytes))
    return coord.exchange(sends, recvs) if sends or recvs else {}


def _assemble(item: WriteItem, lf: Local, plan: RankPlan, received: dict[int, np.ndarray]) -> np.ndarray:
    """The whole shard of an assembled item: this rank's part plus the pieces sent to it."""
    dtype = lf.desc.dtype
    buf = np.empty(_dtypes.storage_shape(dtype, item.lengths), _dtypes.numpy_dtype(dtype))
    cell = (item.offsets, item.lengths)

    def put(box: tuple[tuple[int, ...], tuple[int, ...]], data: np.ndarray) -> None:
        buf[tuple(slice(o - c, o - c + n) for o, c, n in zip(box[0], item.offsets, box[1]))] = data

    mine = _intersect(cell, (lf.desc.offsets, lf.desc.lengths))
    if mine is not None:
        put(mine, _local_box(lf, *mine))
    for i, t in plan.transfers:
        if t.dst == item.rank and t.path == item.path and _intersect(cell, (t.offsets, t.lengths)) is not None:
            put((t.offsets, t.lengths), received[i].view(buf.dtype).reshape(_dtypes.storage_shape(dtype, t.lengths)))
    return buf


def _storage_layout(rec: ArrayRecord) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple[int, ...]]:
    """(shard shape, inner chunk shape, array shape) of the stored array (complex32 adds a dim of 2)."""
    extra = _dtypes.storage_extra_dims(rec.dtype)
    inner = rec.chunking.chunk_shape
    return (*rec.chunking.shard_shape, *extra), None if inner is None else (*inner, *extra), (*rec.shape, *extra)


def _encode_file(rec: ArrayRecord, offsets: tuple[int, ...], src: np.ndarray) -> bytes | None:
    """The encoded file of an unsharded chunk that ``src`` fills whole, else None
    (TensorStore then encodes the write)."""
    shard, inner, shape = _storage_layout(rec)
    full = tuple(min(g, n - o) for o, g, n in zip((*offsets, 0), shard, shape))
    if not LITTLE_ENDIAN or src.shape != full[: src.ndim] or any(o % g for o, g in zip(offsets, shard)):
        return None
    return encode_chunk(src) if inner is None and src.shape == shard else None


def _file_writer(rec: ArrayRecord, offsets: tuple[int, ...], src: np.ndarray) -> Callable[[str], None] | None:
    """What writes the shard file at ``offsets`` from ``src`` (all of the shard that lies in
    the array) with tsckpt's own writer (_shardwrite), or None when it does not apply."""
    shard, inner, shape = _storage_layout(rec)
    full = tuple(min(g, n - o) for o, g, n in zip((*offsets, *(0 for _ in shard[len(offsets):])), shard, shape))
    if (
        not LITTLE_ENDIAN
        or _dtypes.storage_dtype(rec.dtype) not in shardwrite.DTYPES
        or src.shape != full
        or src.dtype.byteorder == ">"
        or any(o % g for o, g in zip(offsets, shard))
    ):
        return None
    if inner is None:  # one small chunk: _encode_file's single kvstore write (measured faster for 10k files)
        return None
    return functools.partial(shardwrite.write_shard, src=src, shard=shard, inner=inner, writeback=START_WRITEBACK)


def _local_root(data: dict[str, Any], compact: bool) -> str | None:
    """The directory of a plain checkpoint on a local disk (whose files tsckpt writes itself), else None."""
    if WRITE_THREADS < 1 or compact or data.get("driver") != "file" or set(data) - {"driver", "path"}:
        return None
    return str(data["path"])


def _write_regions(
    data: dict[str, Any], plan: RankPlan, local: dict[str, Local], received: dict[int, np.ndarray], window: int,
    *, compact: bool, progress: Progress,
) -> list[str]:
    """Write this rank's items into the kvstore ``data`` shard by shard, keeping a bounded
    window in flight.

    Returns the keys written. TensorStore may encode straight from the source
    memory (no staging copy): save() waits for every write before it returns,
    so the caller cannot change the data underneath. The compact layout's
    database gets one transaction per window, so each window becomes a few
    large files rather than a commit (and files) per write.
    """
    records = {a.path: a for a in plan.arrays}
    root = _local_root(data, compact)
    pool = Workers(WRITE_THREADS, "tsckpt-write")
    made: set[str] = set()
    pending: collections.deque[tuple[Any, int]] = collections.deque()
    in_flight = 0
    written: list[str] = []
    stores: dict[str, ts.TensorStore] = {}
    kv = ts.KvStore.open(data, context=_store.CONTEXT).result()
    txn = ts.Transaction() if compact else None

    def settle(keep: int) -> None:
        nonlocal in_flight, txn
        if txn is not None:  # a window is written by committing its transaction
            for fut, _ in pending:
                fut.result()
            txn.commit_async().result()
            txn = ts.Transaction()
            progress.update(in_flight, len(pending))
            pending.clear()
            in_flight = 0
        while in_flight > keep and pending:
            fut, n = pending.popleft()
            fut.result()
            in_flight -= n
            progress.update(n, 1)

    writes = plan.writes  # built from the plan's groups on each access
    progress.set_total(sum(math.prod(w.lengths) * local[w.path].desc.itemsize for w in writes))
    try:
        for item in writes:
            rec = records[item.path]
            lf = local[item.path]
            for off, ln in shard_boxes(item.offsets, item.lengths, rec.chunking):
                src = _assemble(item, lf, plan, received) if item.assembled else _local_box(lf, off, ln)
                key = chunk_key(rec, off)
                fut: Any
                writer = _file_writer(rec, off, src) if root is not None else None
                encoded = _encode_file(rec, off, src) if writer is None else None
                if writer is not None:
                    path = os.path.join(root or "", key)
                    parent = os.path.dirname(path)
                    if parent not in made:
                        os.makedirs(parent, exist_ok=True)
                        made.add(parent)
                    fut = pool.submit(writer, path)
                elif encoded is not None:
                    fut = (kv if txn is None else kv.with_transaction(txn)).write(key, encoded)
                else:
                    if item.path not in stores:
                        stores[item.path] = open_array(data, rec, write=True)
                    store = stores[item.path] if txn is None else stores[item.path].with_transaction(txn)
                    dst = store[tuple(slice(o, o + n) for o, n in zip(off, ln))] if off else store
                    w = dst.write(src, can_reference_source_data_indefinitely=True)
                    fut = w.commit if txn is None else w.copy
                pending.append((fut, src.nbytes))
                in_flight += src.nbytes
                written.append(key)
                if in_flight > window:
                    settle(window)
        settle(0)
    finally:
        pool.shutdown()  # no file is being written once this returns or raises
    return written


def _write_nodes(data: dict[str, Any], arrays: tuple[ArrayRecord, ...], *, compact: bool) -> list[str]:
    """zarr.json of every array and of every intermediate group (root excluded), in the
    kvstore ``data`` (one transaction in a compact layout's database)."""
    kv = ts.KvStore.open(data, context=_store.CONTEXT).result()
    txn = ts.Transaction() if compact else None
    if txn is not None:
        kv = kv.with_transaction(txn)
    futures = []
    groups: set[str] = set()
    for rec in arrays:
        futures.append(kv.write(f"{rec.path}/{ROOT_KEY}", _store.encode_json(array_node(rec))))
        parts = rec.path.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    body = _store.encode_json(group_metadata())
    futures += [kv.write(f"{g}/{ROOT_KEY}", body) for g in sorted(groups)]
    for f in futures:
        f.result()
    if txn is not None:
        txn.commit_async().result()
    return [f"{rec.path}/{ROOT_KEY}" for rec in arrays] + [f"{g}/{ROOT_KEY}" for g in groups]


def _root(state: str, extra: dict[str, Any] | None = None, *, layout: str = LAYOUT_PLAIN) -> bytes:
    meta: dict[str, Any] = {"format_version": format_version(layout), "state": state, "library": f"tsckpt {_version()}"}
    if layout != LAYOUT_PLAIN:
        meta["layout"] = layout
    meta.update(extra or {})
    return _store.encode_json(group_metadata({"tsckpt": meta}))


# Generation TensorStore reports for a key that does not exist; a write
# conditioned on it creates the key only if nobody else has.
_NO_KEY = b"\x02"


def _pending_root(layout: str) -> Callable[[dict[str, Any]], bytes]:
    return lambda claim: _root(STATE_PENDING, {"claim": claim}, layout=layout)


def _begin(loc: Location, overwrite: bool, layout: str = LAYOUT_PLAIN, lease: _lease.Lease | None = None) -> None:
    """Refuse or clear an existing checkpoint, then claim the directory.

    The pending root is created with a conditional write that succeeds only if
    no root exists, so of several savers racing for one directory exactly one
    proceeds; the others raise CheckpointExistsError and touch nothing. A failed
    condition is reported by TensorStore as an empty generation, not an error.
    On object stores the create is a PUT with ``If-None-Match: *``. The pending
    root records ``lease``'s claim, which is renewed from then on; without a
    lease (tests) the claim is one of no running save.
    """
    with _store.storage_errors(loc, doing="writing"):
        _claim(loc, overwrite, layout, lease)


def _claim(loc: Location, overwrite: bool, layout: str, lease: _lease.Lease | None) -> None:
    kv = loc.kvstore()
    current = kv.read(ROOT_KEY).result()
    if current.state == "value" or _store.has_any_key(loc):
        root = root_state(current.value if current.state == "value" else None)
        claim = root.meta.get("claim") if root.state == STATE_PENDING and root.meta is not None else None
        alive = root.state == STATE_PENDING and _lease.running(claim)
        if alive and overwrite:
            raise SaveInProgressError(
                f"{loc}: another save into this directory is still running ({_lease.describe(claim)}); "
                "overwrite=True never removes a running save. Wait for it to finish, or save elsewhere; if its "
                f"process is gone, save again once its lease has expired ({_lease_s(claim)} s after its last renewal)"
            )
        if not overwrite:
            if alive:
                what = f"another save into this directory is still running ({_lease.describe(claim)})"
            elif root.state == STATE_PENDING:
                what = (
                    "another save into this directory is running, or one crashed (its root zarr.json says "
                    f"'pending'; written by {_lease.describe(claim)})"
                )
            else:
                what = "a checkpoint (or other data) already exists here"
            raise CheckpointExistsError(
                f"{loc}: {what}; pass overwrite=True to replace it, or save to a new directory"
            )
        if current.state == "value":
            # uncommit first, so a crash below leaves no valid checkpoint; conditional,
            # so a saver that replaced the root since we read it is not undone
            if not kv.write(ROOT_KEY, None, if_equal=current.stamp.generation).result().generation:
                raise CheckpointExistsError(f"{loc}: another save claimed this directory first; nothing was changed")
        _store.delete_all(loc)
    body = lease.root() if lease is not None else _pending_root(layout)(_lease.new_claim())
    claimed = _store.durable_kvstore(loc).write(ROOT_KEY, body, if_equal=_NO_KEY).result()
    if not claimed.generation:
        raise CheckpointExistsError(
            f"{loc}: another save into this directory started at the same time and claimed it first; "
            "nothing was written. Save each checkpoint from one job, or use distinct directories"
        )
    if lease is not None:
        lease.start(bytes(claimed.generation))


def _lease_s(claim: Any) -> Any:
    lease_s = claim.get("lease_s") if isinstance(claim, dict) else None
    return f"{lease_s:g}" if isinstance(lease_s, (int, float)) else "?"


def _links(local: list[Local]) -> dict[str, str]:
    """Path -> the smallest other path of this rank whose leaf is the same memory (tied weights)."""
    groups: dict[tuple[Any, ...], list[str]] = collections.defaultdict(list)
    for lf in local:
        mem = memory(lf.data) if lf.desc.kind != "value" and math.prod(lf.desc.lengths) > 0 else None
        if mem is not None:  # empty regions prove nothing
            groups[(lf.desc.kind, lf.desc.global_shape, lf.desc.offsets) + mem].append(lf.desc.path)
    return {p: min(paths) for paths in groups.values() if len(paths) > 1 for p in paths if p != min(paths)}


@verb("tsckpt.save")
def save(
    directory: Directory,
    tree: Any,
    *,
    overwrite: bool = False,
    group: Any = None,
    check_replicas: bool = True,
    timeout: datetime.timedelta | None = None,
    max_inflight_bytes: int = WRITE_WINDOW_BYTES,
    layout: str = LAYOUT_PLAIN,
    progress: bool | None = None,
) -> None:
    """Save a pytree as a committed zarr v3 checkpoint.

    Under torch.distributed every rank of ``group`` (default: the default group)
    calls save with its local tree; leaves are DTensors, ShardedArrays, plain
    tensors (replicas when several ranks give the same path) or values.
    ``check_replicas`` compares replica contents by checksum; ``timeout`` (a
    :class:`datetime.timedelta`, default 10 minutes) bounds every wait on other
    ranks. ``overwrite=True`` replaces an existing checkpoint (never one whose
    save is still running). ``max_inflight_bytes`` bounds the source data
    handed to storage but not yet written (host memory a save needs beyond the
    state itself, e.g. when the leaves are read lazily from another file); no
    shard file is made larger than the smallest window of any rank.
    ``layout="compact"`` stores the arrays in one OCDBT database per writing
    rank, merged at the commit, so the file count does not grow with the
    number of leaves (docs/format.md, "Layouts"); every rank must pass the same.
    ``progress`` shows a bar of bytes written on rank 0 (default: when stderr is
    a terminal); each rank logs bytes, files and throughput at the end.

    Protocol (every rank calls save with its local tree; rank 0 coordinates):

    1. Describe (all ranks): each rank flattens its tree and describes each leaf
       (path, global shape, dtype, local region) and sends the descriptors, its
       tree paths, tied-leaf links, write window and layout to rank 0 only.
    2. Plan (rank 0): finds tied leaves (written once), the regions several
       ranks hold, and either
       a. when no region has several holders (or check_replicas=False), goes
          straight to step 4, or
       b. sends each rank the paths of its replicated regions to checksum.
    3. Replica checksums (all ranks, only in 2b): each rank checksums those
       regions and sends the checksums to rank 0.
    4. Rank 0 validates and plans the whole save (errors such as overlapping
       regions or differing replicas are sent to every rank, which raises the
       same error), refuses or clears an existing checkpoint (never one whose
       save is still running) and writes the root ``zarr.json`` with state
       "pending" and its claim, whose lease a thread of rank 0 renews until
       the save ends (tsckpt/_lease.py). It then sends each rank only its
       part of the plan: its writes, the records of the arrays it writes and
       the transfers it sends or receives.
    5. Exchange (ranks with transfers; skipped by all when there are none):
       pieces of shards that straddle irregular regions go to their writer.
    6. Write (all ranks): every rank writes its planned regions; rank 0 also
       the array and group ``zarr.json`` nodes. Each rank syncs its files.
       (Compact layout: each rank writes into its own database.)
    7. Commit (rank 0): once all ranks report success, rank 0 (compact
       layout: after merging the ranks' databases into the root one) rewrites
       the root ``zarr.json`` with state "committed" and the tree metadata: a
       single atomic object write, conditional on the pending root being still
       this save's, so readers see either no checkpoint or a complete one.
    8. Clean-up (rank 0, only after a failure once every rank knows of it):
       the partial checkpoint is removed (the pending root first, if still
       this save's), so saving again needs no ``overwrite=True``.

    Every step ends with every rank knowing the outcome (steps 1-4 through the
    replies of rank 0, the others by exchanging a status), so a failure on one
    rank makes every rank raise and nothing is committed. Storage faults raise
    StorageError (an OSError with ``errno``, ``filename`` and ``leaf``).
    """
    SaveOptions.of(locals())  # a bad option raises here, before any work
    coord = coordinator_for(group, timeout)
    loc = resolve(directory)
    lease = _lease.Lease(loc, _pending_root(layout)) if coord.rank == 0 else None
    own: list[BaseException] = []  # this rank's own failures, re-raised by phase() once every rank knows

    def mine(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            try:
                return fn()
            except BaseException as e:
                own.append(e)
                raise

        return run

    try:
        job = _plan_job(coord, loc, tree, overwrite, check_replicas, max_inflight_bytes, layout, lease)
        received: dict[int, np.ndarray] = {}
        if job.plan.exchange:  # every rank's part says whether any rank exchanges: all skip together
            received = phase(coord, "save (exchange)", mine(lambda: _exchange(coord, job.plan, job.local))) or {}
        with Progress("save", loc, show=progress, rank=coord.rank) as bar:
            phase(coord, "save (write)", mine(lambda: _write(loc, coord.rank, job, received, layout, bar)))
            phase(coord, "save (commit)", mine(lambda: _commit(loc, coord.world_size, job, layout, lease)), ranks={0})
    except BaseException as e:
        if lease is not None and lease.generation is not None:
            agreed = coord.world_size == 1 or isinstance(e, DistributedError) or any(e is o for o in own)
            _abandon(loc, lease, e, agreed)
        raise
    finally:
        if lease is not None:
            lease.end()


def _amend(err: BaseException, text: str) -> None:
    """Add ``text`` to the message of ``err`` (a note where the message cannot be changed)."""
    if isinstance(err, TsckptError) and len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}; {text}",)
    elif hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(text)


def _abandon(loc: Location, lease: _lease.Lease, err: BaseException, agreed: bool) -> None:
    """Step 8, rank 0 after a failed save that claimed ``loc``: remove the partial
    checkpoint (best effort) and say in ``err`` whether saving again needs overwrite=True."""
    lease.end()
    if not agreed:
        _amend(err, (
            f"the partial checkpoint at {loc} was left in place, as other ranks may still be writing to it; "
            "once the job has stopped, save again with overwrite=True"
        ))
        return
    if lease.lost:
        _amend(err, f"{loc} was taken over by another save meanwhile and was left to it")
        return
    try:
        with _store.storage_errors(loc, doing="writing"):
            if not _store.write_durable(loc, ROOT_KEY, None, if_equal=lease.generation):
                _amend(err, f"{loc} was taken over by another save meanwhile and was left to it")
                return
            _store.delete_all(loc)
        if loc.local is not None:
            with contextlib.suppress(OSError):  # the directory itself, when nothing else is in it
                os.rmdir(loc.local)
    except Exception as cleanup:  # noqa: BLE001 - reported in the save's own error
        _amend(err, (
            f"the partial checkpoint at {loc} could not be removed ({cleanup}); pass overwrite=True when saving again"
        ))
        return
    _amend(err, "the partial checkpoint was removed, so saving again needs no overwrite=True")


@dataclasses.dataclass(frozen=True)
class _Checksums:
    """Rank 0 to one rank: checksum your regions of these paths (others hold them too)."""

    paths: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Commit:
    """What rank 0 records in the committed root."""

    arrays: tuple[ArrayRecord, ...]
    values: tuple[tuple[str, Any], ...]
    leaves: list[str]
    structure: Any  # None when ranks gave different trees
    aliases: dict[str, str]
    writers: tuple[int, ...]  # ranks with data to write (the compact layout's databases)


@dataclasses.dataclass(frozen=True)
class _Part:
    """Rank 0 to one rank: its part of the plan."""

    plan: RankPlan
    window: int  # bytes of source data in flight while writing: the least of any rank's
    commit: _Commit | None = None  # rank 0 only; never sent


@dataclasses.dataclass(frozen=True)
class _Job:
    """This rank's leaves and its part of the plan."""

    plan: RankPlan
    local: dict[str, Local]  # this rank's leaves, by path
    window: int
    commit: _Commit | None


def _describe(tree: Any, window: int, layout: str) -> tuple[dict[str, Local], tuple[Any, ...]]:
    """This rank's leaves by path, and what rank 0 needs of them (see :func:`_payload`)."""
    flat = flatten(tree)
    local = [describe(p, leaf) for p, leaf in zip(flat.paths, flat.leaves)]
    payload = _payload([lf.desc for lf in local], flat.paths, structure_to_json(flat.spec), _links(local), window, layout)
    return {lf.desc.path: lf for lf in local}, payload


def _payload(
    descs: list[Any], paths: Sequence[str], structure: Any, links: dict[str, str], window: int, layout: str
) -> tuple[Any, ...]:
    """What a rank sends rank 0: its descriptors packed field by field, tree paths, the
    tree structure as JSON text, tied-leaf links, write window and layout. Few objects,
    so rank 0 unpickles every rank's payload fast, and compares trees as strings."""
    return pack_descs(descs), tuple(paths), json.dumps(structure, separators=(",", ":")), links, window, layout


def _plan_job(
    coord: Any, loc: Location, tree: Any, overwrite: bool, check_replicas: bool, window: int, layout: str,
    lease: _lease.Lease | None = None,
) -> _Job:
    """Steps 1-4 of the protocol: one round trip through rank 0, two when replicas are checked."""
    state: dict[str, Any] = {}  # rank 0, between the two round trips

    def first(payloads: list[tuple[Any, ...]]) -> list[Any]:
        layouts = sorted({p[5] for p in payloads})
        if len(layouts) > 1:
            raise ValueError(
                f"ranks passed different layouts ({', '.join(map(repr, layouts))}); every rank must save with the same"
            )
        per_rank = [p[0] for p in payloads]
        aliases = plan_aliases(per_rank, [p[3] for p in payloads])
        state.update(payloads=payloads, aliases=aliases)
        g = without(gather_descs(per_rank), aliases)
        shared = shared_regions(g) if check_replicas and coord.world_size > 1 else []
        if any(shared):
            state["gathered"] = g
            return [_Checksums(tuple(paths)) for paths in shared]
        return finish(g)

    def finish(g: Gathered) -> list[_Part]:
        payloads = state["payloads"]
        least = min(p[4] for p in payloads)
        plan = plan_save(g, shard_bytes=min(_chunking.SHARD_BYTES, least))
        paths, structure = payloads[0][1], payloads[0][2]
        same_tree = all(p[1] == paths and p[2] == structure for p in payloads)
        structure = json.loads(structure) if same_tree else None
        parts = split_plan(plan)
        commit = _Commit(
            plan.arrays, plan.values, list(paths) if same_tree else sorted({q for p in payloads for q in p[1]}),
            structure, state["aliases"], tuple(r for r, part in enumerate(parts) if part.writes_anything),
        )
        _begin(loc, overwrite, layout, lease)
        return [_Part(part, least, commit if r == 0 else None) for r, part in enumerate(parts)]

    local, reply = ask_root(coord, "save (describe)", lambda: _describe(tree, window, layout), first)
    if isinstance(reply, _Checksums):
        asked = reply.paths

        def sums() -> tuple[None, dict[str, int]]:
            return None, {p: checksum(local[p].data) for p in asked}

        _, reply = ask_root(coord, "save (replica checksums)", sums, lambda got: finish(with_checksums(state["gathered"], got)))
    return _Job(reply.plan, local, reply.window, reply.commit)


def _write(
    loc: Location, rank: int, job: _Job, received: dict[int, np.ndarray], layout: str, progress: Progress
) -> None:
    """Write this rank's regions (rank 0 also the zarr.json nodes), then sync them to storage."""
    compact = layout == LAYOUT_COMPACT
    data = _write_spec(loc, layout, writer=rank)
    with _store.storage_errors(loc, doing="writing"):
        keys = _write_regions(data, job.plan, job.local, received, job.window, compact=compact, progress=progress)
        if job.commit is not None:
            keys += _write_nodes(data, job.commit.arrays, compact=compact)
        if compact:
            _store.sync_paths(loc, [f"{OCDBT_PREFIX}{rank}"])
        else:
            _store.sync_data(loc, keys)


def _write_spec(loc: Location, layout: str, writer: int | None = None) -> dict[str, Any]:
    """:func:`data_spec` for writing: a compact database through the cache pool that keeps
    nothing between saves (see _store.CONTEXT)."""
    spec = data_spec(loc, layout, writer=writer)
    return {**spec, "cache_pool": _store.WRITE_CACHE_POOL} if layout == LAYOUT_COMPACT else spec


def _merge_databases(loc: Location, writers: tuple[int, ...]) -> None:
    """Rank 0, compact layout: link every writing rank's database into the root one.

    OCDBT copies B-tree references, not data: the root database points into the
    ranks' data files, so readers open one database and outside TensorStore
    users see one zarr hierarchy.
    """
    root = ts.KvStore.open(_write_spec(loc, LAYOUT_COMPACT), context=_store.CONTEXT).result()
    txn = ts.Transaction(atomic=True)
    for rank in sorted({0, *writers}):
        db = ts.KvStore.open(_write_spec(loc, LAYOUT_COMPACT, writer=rank), context=_store.CONTEXT).result()
        db.experimental_copy_range_to(root.with_transaction(txn)).result()
    txn.commit_async().result()
    _store.sync_paths(loc, [MANIFEST, "d"])


def _commit(loc: Location, world_size: int, job: _Job, layout: str, lease: _lease.Lease | None = None) -> None:
    """Rank 0: the one atomic write that makes the checkpoint visible, if the pending root
    is still this save's (``lease``: its renewals stop first)."""
    c = job.commit
    if c is None:
        raise RuntimeError("only rank 0 commits a save")
    if layout == LAYOUT_COMPACT:
        with _store.storage_errors(loc):
            _merge_databases(loc, c.writers)
    if lease is not None:
        lease.stop_renewals()
    meta = {
        "structure": c.structure,
        "leaves": c.leaves,
        "arrays": [a.to_json() for a in c.arrays],
        "values": dict(c.values),
        **({"aliases": c.aliases} if c.aliases else {}),
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    body = _root(STATE_COMMITTED, meta, layout=layout)
    with _store.storage_errors(loc):
        if lease is None:
            _store.write_durable(loc, ROOT_KEY, body)
        elif lease.lost or not _store.write_durable(loc, ROOT_KEY, body, if_equal=lease.generation):
            lease.lost = True
            raise CheckpointExistsError(
                f"{loc}: the pending root of this save was replaced or removed by another process while it ran "
                "(a save with overwrite=True, or a manager's clean-up, that judged this save dead); nothing was "
                "committed. Save again, to a directory no other job uses"
            )
