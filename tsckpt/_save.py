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
from ._coord import gather_phase, phase
from ._dist import coordinator_for
from ._encode import LITTLE_ENDIAN, encode_chunk
from ._errors import CheckpointExistsError, LeafTypeError
from ._format import (
    LAYOUT_COMPACT,
    LAYOUT_PLAIN,
    ArrayRecord,
    ROOT_KEY,
    STATE_COMMITTED,
    STATE_PENDING,
    check_layout,
    format_version,
    group_metadata,
)
from ._arrays import MANIFEST, OCDBT_PREFIX, array_node, data_spec, open_array
from ._kinds import checksum, storage_numpy
from ._leaves import describe, memory
from ._reader import root_state
from ._types import LazySource, Local
from ._progress import Progress
from ._plan import LeafDesc, SavePlan, WriteItem, _intersect, plan_aliases, plan_save, shard_boxes
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


def _exchange(coord: Any, plan: SavePlan, local: dict[str, Local]) -> dict[int, np.ndarray]:
    """Send the pieces of straddling shards to their writers; return what this rank received,
    keyed by transfer index."""
    if not plan.transfers:
        return {}
    me = coord.rank
    sends, recvs = [], []
    for i, t in enumerate(plan.transfers):
        if t.src == me:
            sends.append((t.dst, i, np.ascontiguousarray(_local_box(local[t.path], t.offsets, t.lengths))))
        elif t.dst == me:
            lf = local[t.path]
            nbytes = math.prod(t.lengths) * lf.desc.itemsize
            recvs.append((t.src, i, nbytes))
    return coord.exchange(sends, recvs) if sends or recvs else {}


def _assemble(item: WriteItem, lf: Local, plan: SavePlan, received: dict[int, np.ndarray]) -> np.ndarray:
    """The whole shard of an assembled item: this rank's part plus the pieces sent to it."""
    dtype = lf.desc.dtype
    buf = np.empty(_dtypes.storage_shape(dtype, item.lengths), _dtypes.numpy_dtype(dtype))
    cell = (item.offsets, item.lengths)

    def put(box: tuple[tuple[int, ...], tuple[int, ...]], data: np.ndarray) -> None:
        buf[tuple(slice(o - c, o - c + n) for o, c, n in zip(box[0], item.offsets, box[1]))] = data

    mine = _intersect(cell, (lf.desc.offsets, lf.desc.lengths))
    if mine is not None:
        put(mine, _local_box(lf, *mine))
    for i, t in enumerate(plan.transfers):
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
    data: dict[str, Any], plan: SavePlan, rank: int, local: dict[str, Local], received: dict[int, np.ndarray],
    window: int, *, compact: bool, progress: Progress,
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

    for item in plan.writes_for(rank):
        rec = records[item.path]
        lf = local[item.path]
        for off, ln in shard_boxes(item.offsets, item.lengths, rec.layout):
            src = _assemble(item, lf, plan, received) if item.assembled else _local_box(lf, off, ln)
            key = _chunk_key(rec, off)
            fut: Any
            encoded = _encode_file(rec, off, src)
            if encoded is not None:
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
    return written


def _write_nodes(data: dict[str, Any], plan: SavePlan, *, compact: bool) -> list[str]:
    """zarr.json of every array and of every intermediate group (root excluded), in the
    kvstore ``data`` (one transaction in a compact layout's database)."""
    kv = ts.KvStore.open(data, context=_store.CONTEXT).result()
    txn = ts.Transaction() if compact else None
    if txn is not None:
        kv = kv.with_transaction(txn)
    futures = []
    groups: set[str] = set()
    for rec in plan.arrays:
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
    return [f"{rec.path}/{ROOT_KEY}" for rec in plan.arrays] + [f"{g}/{ROOT_KEY}" for g in groups]


def _root(state: str, extra: dict[str, Any] | None = None, *, layout: str = LAYOUT_PLAIN) -> bytes:
    meta: dict[str, Any] = {"format_version": format_version(layout), "state": state, "library": f"tsckpt {_version()}"}
    if layout != LAYOUT_PLAIN:
        meta["layout"] = layout
    meta.update(extra or {})
    return _store.encode_json(group_metadata({"tsckpt": meta}))


# Generation TensorStore reports for a key that does not exist; a write
# conditioned on it creates the key only if nobody else has.
_NO_KEY = b"\x02"


def _begin(loc: Location, overwrite: bool, layout: str = LAYOUT_PLAIN) -> None:
    """Refuse or clear an existing checkpoint, then claim the directory.

    The pending root is created with a conditional write that succeeds only if
    no root exists, so of several savers racing for one directory exactly one
    proceeds; the others raise CheckpointExistsError and touch nothing. A failed
    condition is reported by TensorStore as an empty generation, not an error.
    On object stores the create is a PUT with ``If-None-Match: *``.
    """
    with _store.storage_errors(loc):
        _claim(loc, overwrite, layout)


def _claim(loc: Location, overwrite: bool, layout: str) -> None:
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
    claimed = durable.write(ROOT_KEY, _root(STATE_PENDING, layout=layout), if_equal=_NO_KEY).result()
    if not claimed.generation:
        raise CheckpointExistsError(
            f"{loc}: another save into this directory started at the same time and claimed it first; "
            "nothing was written. Save each checkpoint from one job, or use distinct directories"
        )


def _with_replica_checksums(coord: Any, per_rank: list[list[LeafDesc]], local: list[Local]) -> list[list[LeafDesc]]:
    """Checksum only the regions more than one rank holds (a second, small exchange),
    so fully sharded state is never hashed."""
    holders = collections.Counter((d.path, d.offsets, d.lengths) for descs in per_rank for d in descs if d.kind != "value")
    if all(n == 1 for n in holders.values()):  # every rank knows this: all skip the exchange
        return per_rank

    def mine_sums() -> dict[str, int]:
        return {
            lf.desc.path: checksum(lf.data)
            for lf in local
            if lf.desc.kind != "value" and holders[(lf.desc.path, lf.desc.offsets, lf.desc.lengths)] > 1
        }

    _, sums = gather_phase(coord, "save (replica checksums)", lambda: (None, mine_sums()))
    return [
        [dataclasses.replace(d, checksum=sums[r][d.path]) if d.path in sums[r] else d for d in descs]
        for r, descs in enumerate(per_rank)
    ]


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
    layout: str = LAYOUT_PLAIN,
    progress: bool | None = None,
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
    ``layout="compact"`` stores the arrays in one OCDBT database per writing
    rank, merged at the commit, so the file count does not grow with the
    number of leaves (docs/format.md, "Layouts"); every rank must pass the same.
    ``progress`` shows a bar of bytes written on rank 0 (default: when stderr is
    a terminal); each rank logs bytes, files and throughput at the end.

    Protocol (every rank calls save with its local tree):

    1. All ranks flatten their tree and describe each leaf (path, global shape,
       dtype, local region, replica checksum); the descriptors are gathered on
       every rank, and every rank computes the same plan (validation errors are
       therefore raised identically everywhere).
    2. Rank 0 refuses or clears an existing checkpoint and writes the root
       ``zarr.json`` with state "pending".
    3. Every rank writes its planned regions; rank 0 also writes the array and
       group ``zarr.json`` nodes. Each rank then syncs its data to storage.
       (Compact layout: each rank writes into its own database.)
    4. Once all ranks report success, rank 0 (compact layout: after merging
       the ranks' databases into the root one) rewrites the root ``zarr.json``
       with state "committed" and the tree metadata: a single atomic object
       write, so readers see either no checkpoint or a complete one.

    After each step all ranks exchange a status, so a failure on one rank makes
    every rank raise and nothing is committed.
    """
    check_layout(layout)
    coord = coordinator_for(group, timeout)
    loc = resolve(directory)
    job = _plan_job(coord, _describe(coord, tree, max_inflight_bytes), check_replicas)
    phase(coord, "save (begin)", lambda: _begin(loc, overwrite, layout), ranks={0})
    received: dict[int, np.ndarray] = {}
    if job.plan.transfers:  # identical plan on every rank: all skip this round together
        received = phase(coord, "save (exchange)", lambda: _exchange(coord, job.plan, job.local)) or {}
    with Progress("save", loc, show=progress, rank=coord.rank) as bar:
        phase(coord, "save (write)", lambda: _write(loc, coord.rank, job, received, layout, bar))
        phase(coord, "save (commit)", lambda: _commit(loc, coord.world_size, job, layout), ranks={0})


@dataclasses.dataclass(frozen=True)
class _Described:
    """Step 1's result: this rank's leaves, and what every rank holds."""

    paths: list[str]
    structure: Any
    local: list[Local]
    per_rank: list[list[LeafDesc]]  # descriptors of every rank's leaves
    gathered: list[tuple[Any, ...]]  # every rank's (descs, paths, structure, tied links, window)


@dataclasses.dataclass(frozen=True)
class _Job:
    """Step 1's plan: what to write, where, and the metadata to commit."""

    plan: SavePlan
    local: dict[str, Local]  # this rank's leaves to write, by path
    leaves: list[str]
    structure: Any  # None when ranks gave different trees
    aliases: dict[str, str]
    window: int  # bytes of source data in flight while writing


def _describe(coord: Any, tree: Any, window: int) -> _Described:
    """Flatten and describe this rank's leaves; gather every rank's descriptors and write
    window (all ranks)."""

    def prepare() -> tuple[tuple[Any, list[Local], Any], tuple[Any, ...]]:
        flat = flatten(tree)
        local = [describe(p, leaf) for p, leaf in zip(flat.paths, flat.leaves)]
        structure = structure_to_json(flat.spec)
        gathered = ([lf.desc for lf in local], flat.paths, structure, _links(local), window)
        return (flat.paths, local, structure), gathered

    (paths, local, structure), gathered = gather_phase(coord, "save (describe)", prepare)
    return _Described(paths, structure, local, [g[0] for g in gathered], gathered)


def _plan_job(coord: Any, d: _Described, check_replicas: bool) -> _Job:
    """The same plan on every rank: tied leaves written once, replicas checked, regions assigned."""
    per_rank, local = d.per_rank, d.local
    # leaves that are the same memory on every rank (tied weights) are written once
    aliases = plan_aliases(per_rank, [g[3] for g in d.gathered])
    if aliases:
        per_rank = [[desc for desc in descs if desc.path not in aliases] for descs in per_rank]
        local = [lf for lf in local if lf.desc.path not in aliases]
    if coord.world_size > 1 and check_replicas:
        per_rank = _with_replica_checksums(coord, per_rank, local)
    same_tree = all(g[1] == d.paths and g[2] == d.structure for g in d.gathered)
    leaves = d.paths if same_tree else sorted({p for g in d.gathered for p in g[1]})
    window = min(g[4] for g in d.gathered)  # the same on every rank, so is the plan
    return _Job(
        plan_save(per_rank, shard_bytes=min(_layout.SHARD_BYTES, window)), {lf.desc.path: lf for lf in local}, leaves,
        d.structure if same_tree else None, aliases, window,
    )


def _write(
    loc: Location, rank: int, job: _Job, received: dict[int, np.ndarray], layout: str, progress: Progress
) -> None:
    """Write this rank's regions (rank 0 also the zarr.json nodes), then sync them to storage."""
    compact = layout == LAYOUT_COMPACT
    data = data_spec(loc, layout, writer=rank)
    writes = job.plan.writes_for(rank)
    progress.set_total(sum(math.prod(w.lengths) * job.local[w.path].desc.itemsize for w in writes))
    with _store.storage_errors(loc):
        keys = _write_regions(data, job.plan, rank, job.local, received, job.window, compact=compact, progress=progress)
        if rank == 0:
            keys += _write_nodes(data, job.plan, compact=compact)
    if compact:
        _store.sync_paths(loc, [f"{OCDBT_PREFIX}{rank}"])
    else:
        _store.sync_data(loc, keys)


def _merge_databases(loc: Location, plan: SavePlan) -> None:
    """Rank 0, compact layout: link every writing rank's database into the root one.

    OCDBT copies B-tree references, not data: the root database points into the
    ranks' data files, so readers open one database and outside TensorStore
    users see one zarr hierarchy.
    """
    root = ts.KvStore.open(data_spec(loc, LAYOUT_COMPACT), context=_store.CONTEXT).result()
    txn = ts.Transaction(atomic=True)
    for rank in sorted({0} | {w.rank for w in plan.writes}):
        db = ts.KvStore.open(data_spec(loc, LAYOUT_COMPACT, writer=rank), context=_store.CONTEXT).result()
        db.experimental_copy_range_to(root.with_transaction(txn)).result()
    txn.commit_async().result()
    _store.sync_paths(loc, [MANIFEST, "d"])


def _commit(loc: Location, world_size: int, job: _Job, layout: str) -> None:
    """Rank 0: the one atomic write that makes the checkpoint visible."""
    if layout == LAYOUT_COMPACT:
        with _store.storage_errors(loc):
            _merge_databases(loc, job.plan)
    meta = {
        "structure": job.structure,
        "leaves": job.leaves,
        "arrays": [a.to_json() for a in job.plan.arrays],
        "values": dict(job.plan.values),
        **({"aliases": job.aliases} if job.aliases else {}),
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with _store.storage_errors(loc):
        _store.write_durable(loc, ROOT_KEY, _root(STATE_COMMITTED, meta, layout=layout))
