"""save(): planning, writing regions, syncing, and the atomic commit."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import time
from typing import Any

import numpy as np
import tensorstore as ts

from . import _dtypes, _layout, _store
from ._coord import ask_root, phase
from ._dist import coordinator_for
from ._encode import LITTLE_ENDIAN, encode_chunk
from ._errors import CheckpointExistsError, LeafTypeError
from ._format import (
    ArrayRecord,
    FORMAT_VERSION,
    ROOT_KEY,
    STATE_COMMITTED,
    STATE_PENDING,
    group_metadata,
)
from ._arrays import array_node, open_array
from ._kinds import checksum, storage_numpy
from ._leaves import describe, memory
from ._reader import root_state
from ._types import LazySource, Local
from ._plan import (
    Gathered,
    RankPlan,
    WriteItem,
    _intersect,
    gather_descs,
    plan_aliases,
    plan_save,
    shard_boxes,
    shared_regions,
    split_plan,
    with_checksums,
    without,
)
from ._store import Directory, Location, resolve
from .tree import flatten, structure_to_json

# Bytes of source data handed to TensorStore but not yet written; bounds the
# extra host memory a save needs beyond the state itself.
WRITE_WINDOW_BYTES = 512 << 20


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


def _chunk_key(rec: ArrayRecord, offsets: tuple[int, ...]) -> str:
    """Key of the file holding the shard that starts at ``offsets`` (default chunk key encoding)."""
    cell = [str(o // g) for o, g in zip(offsets, rec.layout.shard_shape)]
    cell += ["0" for _ in _dtypes.storage_extra_dims(rec.dtype)]  # complex32's (re, im) dim
    return "/".join([rec.path, "c", *cell])


def _storage_layout(rec: ArrayRecord) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple[int, ...]]:
    """(shard shape, inner chunk shape, array shape) of the stored array (complex32 adds a dim of 2)."""
    extra = _dtypes.storage_extra_dims(rec.dtype)
    inner = rec.layout.chunk_shape
    return (*rec.layout.shard_shape, *extra), None if inner is None else (*inner, *extra), (*rec.shape, *extra)


def _encode_file(rec: ArrayRecord, offsets: tuple[int, ...], src: np.ndarray) -> bytes | None:
    """The encoded file of an unsharded chunk that ``src`` fills whole, else None
    (TensorStore then encodes the write)."""
    shard, inner, shape = _storage_layout(rec)
    full = tuple(min(g, n - o) for o, g, n in zip((*offsets, 0), shard, shape))
    if not LITTLE_ENDIAN or src.shape != full[: src.ndim] or any(o % g for o, g in zip(offsets, shard)):
        return None
    return encode_chunk(src) if inner is None and src.shape == shard else None


def _write_regions(
    loc: Location, plan: RankPlan, local: dict[str, Local], received: dict[int, np.ndarray], window: int
) -> list[str]:
    """Write this rank's items shard by shard, keeping a bounded window in flight.

    Returns the keys of the files written. TensorStore may encode straight from
    the source memory (no staging copy): save() waits for every write before it
    returns, so the caller cannot change the data underneath.
    """
    records = {a.path: a for a in plan.arrays}
    pending: collections.deque[tuple[Any, int]] = collections.deque()
    in_flight = 0
    written: list[str] = []
    stores: dict[str, ts.TensorStore] = {}
    kv = loc.kvstore()
    for item in plan.writes:
        rec = records[item.path]
        lf = local[item.path]
        for off, ln in shard_boxes(item.offsets, item.lengths, rec.layout):
            src = _assemble(item, lf, plan, received) if item.assembled else _local_box(lf, off, ln)
            key = _chunk_key(rec, off)
            fut: Any
            encoded = _encode_file(rec, off, src)
            if encoded is not None:
                fut = kv.write(key, encoded)
            else:
                if item.path not in stores:
                    stores[item.path] = open_array(loc, rec, write=True)
                store = stores[item.path]
                dst = store[tuple(slice(o, o + n) for o, n in zip(off, ln))] if off else store
                fut = dst.write(src, can_reference_source_data_indefinitely=True).commit
            pending.append((fut, src.nbytes))
            in_flight += src.nbytes
            written.append(key)
            while in_flight > window and pending:
                done, n = pending.popleft()
                done.result()
                in_flight -= n
    for done, _ in pending:
        done.result()
    return written


def _write_nodes(kv: ts.KvStore, arrays: tuple[ArrayRecord, ...]) -> list[str]:
    """zarr.json of every array and of every intermediate group (root excluded)."""
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
    return [f"{rec.path}/{ROOT_KEY}" for rec in arrays] + [f"{g}/{ROOT_KEY}" for g in groups]


def _root(state: str, extra: dict[str, Any] | None = None) -> bytes:
    meta = {"format_version": FORMAT_VERSION, "state": state, "library": f"tsckpt {_version()}"}
    meta.update(extra or {})
    return _store.encode_json(group_metadata({"tsckpt": meta}))


# Generation TensorStore reports for a key that does not exist; a write
# conditioned on it creates the key only if nobody else has.
_NO_KEY = b"\x02"


def _begin(loc: Location, overwrite: bool) -> None:
    """Refuse or clear an existing checkpoint, then claim the directory.

    The pending root is created with a conditional write that succeeds only if
    no root exists, so of several savers racing for one directory exactly one
    proceeds; the others raise CheckpointExistsError and touch nothing. A failed
    condition is reported by TensorStore as an empty generation, not an error.
    """
    kv = loc.kvstore()
    current = kv.read(ROOT_KEY).result()
    if current.state == "value" or _store.has_any_key(loc):
        if not overwrite:
            pending = root_state(current.value if current.state == "value" else None).state == STATE_PENDING
            what = (
                "another save into this directory is running, or one crashed (its root zarr.json says "
                "'pending')"
                if pending
                else "a checkpoint (or other data) already exists here"
            )
            raise CheckpointExistsError(
                f"{loc}: {what}; pass overwrite=True to replace it, or save to a new directory"
            )
        if current.state == "value":
            # uncommit first, so a crash below leaves no valid checkpoint; conditional,
            # so a saver that replaced the root since we read it is not undone
            if not kv.write(ROOT_KEY, None, if_equal=current.stamp.generation).result().generation:
                raise CheckpointExistsError(f"{loc}: another save claimed this directory first; nothing was changed")
        _store.delete_all(loc)
    spec = dict(loc.spec)
    if spec.get("driver") == "file":
        spec["file_io_sync"] = True  # as _store.write_durable: temp file, fsync, rename
    durable = ts.KvStore.open(spec, context=_store.CONTEXT).result()
    claimed = durable.write(ROOT_KEY, _root(STATE_PENDING), if_equal=_NO_KEY).result()
    if not claimed.generation:
        raise CheckpointExistsError(
            f"{loc}: another save into this directory started at the same time and claimed it first; "
            "nothing was written. Save each checkpoint from one job, or use distinct directories"
        )


def _links(local: list[Local]) -> dict[str, str]:
    """Path -> the smallest other path of this rank whose leaf is the same memory (tied weights)."""
    groups: dict[tuple[Any, ...], list[str]] = collections.defaultdict(list)
    for lf in local:
        mem = memory(lf.data) if lf.desc.kind != "value" and math.prod(lf.desc.lengths) > 0 else None
        if mem is not None:  # empty regions prove nothing
            groups[(lf.desc.kind, lf.desc.global_shape, lf.desc.offsets) + mem].append(lf.desc.path)
    return {p: min(paths) for paths in groups.values() if len(paths) > 1 for p in paths if p != min(paths)}


def save(
    directory: Directory,
    tree: Any,
    *,
    overwrite: bool = False,
    group: Any = None,
    check_replicas: bool = True,
    timeout: datetime.timedelta | None = None,
    max_inflight_bytes: int = WRITE_WINDOW_BYTES,
) -> None:
    """Save a pytree as a committed zarr v3 checkpoint.

    Under torch.distributed every rank of ``group`` (default: the default group)
    calls save with its local tree; leaves are DTensors, ShardedArrays, plain
    tensors (replicas when several ranks give the same path) or values.
    ``check_replicas`` compares replica contents by checksum; ``timeout`` bounds
    every wait on other ranks. ``max_inflight_bytes`` bounds the source data
    handed to storage but not yet written (host memory a save needs beyond the
    state itself, e.g. when the leaves are read lazily from another file); no
    shard file is made larger than the smallest window of any rank.

    Protocol (every rank calls save with its local tree; rank 0 coordinates):

    1. Describe (all ranks): each rank flattens its tree and describes each leaf
       (path, global shape, dtype, local region) and sends the descriptors, its
       tree paths, tied-leaf links and write window to rank 0 only.
    2. Plan (rank 0): finds tied leaves (written once), the regions several
       ranks hold, and either
       a. when no region has several holders (or check_replicas=False), goes
          straight to step 4, or
       b. sends each rank the paths of its replicated regions to checksum.
    3. Replica checksums (all ranks, only in 2b): each rank checksums those
       regions and sends the checksums to rank 0.
    4. Rank 0 validates and plans the whole save (errors such as overlapping
       regions or differing replicas are sent to every rank, which raises the
       same error), refuses or clears an existing checkpoint and writes the
       root ``zarr.json`` with state "pending". It then sends each rank only
       its part of the plan: its writes, the records of the arrays it writes
       and the transfers it sends or receives.
    5. Exchange (ranks with transfers; skipped by all when there are none):
       pieces of shards that straddle irregular regions go to their writer.
    6. Write (all ranks): every rank writes its planned regions; rank 0 also
       the array and group ``zarr.json`` nodes. Each rank syncs its files.
    7. Commit (rank 0): once all ranks report success, rank 0 rewrites the
       root ``zarr.json`` with state "committed" and the tree metadata: a
       single atomic object write, so readers see either no checkpoint or a
       complete one.

    Every step ends with every rank knowing the outcome (steps 1-4 through the
    replies of rank 0, the others by exchanging a status), so a failure on one
    rank makes every rank raise and nothing is committed.
    """
    coord = coordinator_for(group, timeout)
    loc = resolve(directory)
    job = _plan_job(coord, loc, tree, overwrite, check_replicas, max_inflight_bytes)
    received: dict[int, np.ndarray] = {}
    if job.plan.exchange:  # every rank's part says whether any rank exchanges: all skip together
        received = phase(coord, "save (exchange)", lambda: _exchange(coord, job.plan, job.local)) or {}
    phase(coord, "save (write)", lambda: _write(loc, coord.rank, job, received))
    phase(coord, "save (commit)", lambda: _commit(loc, coord.world_size, job), ranks={0})


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


def _describe(tree: Any, window: int) -> tuple[dict[str, Local], tuple[Any, ...]]:
    """This rank's leaves by path, and what rank 0 needs of them: descriptors as plain
    tuples, tree paths and structure, tied-leaf links, write window."""
    flat = flatten(tree)
    local = [describe(p, leaf) for p, leaf in zip(flat.paths, flat.leaves)]
    payload = ([tuple(lf.desc) for lf in local], flat.paths, structure_to_json(flat.spec), _links(local), window)
    return {lf.desc.path: lf for lf in local}, payload


def _plan_job(
    coord: Any, loc: Location, tree: Any, overwrite: bool, check_replicas: bool, window: int
) -> _Job:
    """Steps 1-4 of the protocol: one round trip through rank 0, two when replicas are checked."""
    state: dict[str, Any] = {}  # rank 0, between the two round trips

    def first(payloads: list[tuple[Any, ...]]) -> list[Any]:
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
        plan = plan_save(g, shard_bytes=min(_layout.SHARD_BYTES, least))
        paths, structure = payloads[0][1], payloads[0][2]
        same_tree = all(p[1] == paths and p[2] == structure for p in payloads)
        commit = _Commit(
            plan.arrays, plan.values, paths if same_tree else sorted({q for p in payloads for q in p[1]}),
            structure if same_tree else None, state["aliases"],
        )
        parts = split_plan(plan)
        _begin(loc, overwrite)
        return [_Part(part, least, commit if r == 0 else None) for r, part in enumerate(parts)]

    local, reply = ask_root(coord, "save (describe)", lambda: _describe(tree, window), first)
    if isinstance(reply, _Checksums):
        asked = reply.paths

        def sums() -> tuple[None, dict[str, int]]:
            return None, {p: checksum(local[p].data) for p in asked}

        _, reply = ask_root(coord, "save (replica checksums)", sums, lambda got: finish(with_checksums(state["gathered"], got)))
    return _Job(reply.plan, local, reply.window, reply.commit)


def _write(loc: Location, rank: int, job: _Job, received: dict[int, np.ndarray]) -> None:
    """Write this rank's regions (rank 0 also the zarr.json nodes), then sync them to storage."""
    keys = _write_regions(loc, job.plan, job.local, received, job.window)
    if rank == 0:
        keys += _write_nodes(loc.kvstore(), job.plan.arrays)
    _store.sync_data(loc, keys)


def _commit(loc: Location, world_size: int, job: _Job) -> None:
    """Rank 0: the one atomic write that makes the checkpoint visible."""
    c = job.commit
    if c is None:
        raise RuntimeError("only rank 0 commits a save")
    meta = {
        "structure": c.structure,
        "leaves": c.leaves,
        "arrays": [a.to_json() for a in c.arrays],
        "values": dict(c.values),
        **({"aliases": c.aliases} if c.aliases else {}),
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _store.write_durable(loc, ROOT_KEY, _root(STATE_COMMITTED, meta))
