"""save(): the protocol's sequence of steps (see :func:`save`), and the write path.

Each step's pieces live in their own modules: the descriptors ranks send rank 0
in tsckpt/_save/descs.py, the plan in tsckpt/_save/plan.py, the root's claim, commit and
clean-up in tsckpt/_save/commit.py (with the lease in tsckpt/_save/lease.py). Here are the
messages between the steps, the exchange of straddling pieces, and the writes.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from .._base import dtypes as _dtypes
from .._base.types import Box, LazySource, Local
from .._codec import shardwrite
from .._codec.encode import encode_chunk
from .._codec.files import StoredShapes, stored_shapes
from .._codec.route import Place, Route, place, route
from .._codec.route import setting as codec_setting
from .._codec.threads import Workers
from .._coord.protocol import ask_root, phase
from .._coord.torchdist import coordinator_for
from .._errors import DistributedError, LeafTypeError
from .._leaves.kinds import checksum, storage_numpy
from .._leaves.registry import describe, memory
from .._leaves.stateful import expand
from .._ondisk import chunking as _chunking
from .._ondisk.arrays import OCDBT_PREFIX, array_node, chunk_key, data_spec, open_array
from .._ondisk.chunking import intersect, shard_boxes
from .._ondisk.records import LAYOUT_COMPACT, LAYOUT_PLAIN, ROOT_KEY, ArrayRecord, group_metadata
from .._ondisk.stepindex import mark_if_managed
from .._options import WRITE_WINDOW_BYTES, SaveOptions, verb
from .._runtime import devicecopy as _devicecopy
from .._runtime.memory import collector_paused
from .._runtime.progress import Progress
from .._runtime.window import Window
from .._storage import store as _store
from .._storage.store import Directory, Location, resolve
from ..tree import flatten, structure_to_json
from . import lease as _lease

# steps 4 (claim), 7 (commit) and 8 (clean-up) of save()'s protocol, private to this module
from .commit import abandon as _abandon
from .commit import begin as _begin
from .commit import commit as _commit_root
from .commit import merge_databases
from .commit import pending_root as _pending_root
from .descs import ChecksumRequest, Gathered, Payload, gather_descs, shared_regions, with_checksums, without
from .plan import RankPlan, WriteItem, plan_aliases, plan_save, split_plan

# Shard files of a local plain checkpoint written at once by tsckpt's own writer
# (_codec/shardwrite.py; pwritev and large copies release the GIL); 0 leaves shard
# files to TensorStore. 1 GiB on 2 CPUs: 1.9 s with 2 threads, 2.8 s with 1 (medians of 5).
WRITE_THREADS = 2
# Unsharded chunk files (and zarr.json nodes) of such a checkpoint go to the writing threads
# in batches of this many files, or fewer that hold BATCH_BYTES.
BATCH_FILES = 64
BATCH_BYTES = 4 << 20
# Start writing each such file to disk as soon as it is written (sync_data still makes
# them durable): 1.9 s against 2.8 s for 1 GiB with 2 threads (medians of 5).
START_WRITEBACK = True


def _box_sel(lf: Local, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    """Where the global box (``offsets``, ``lengths``) lies in a rank's local data."""
    return tuple(slice(o - lo, o - lo + n) for o, lo, n in zip(offsets, lf.desc.offsets, lengths))


def _local_box(lf: Local, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> np.ndarray:
    """Storage-dtype numpy of the global box (``offsets``, ``lengths``) from a rank's local data."""
    sel = _box_sel(lf, offsets, lengths)
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

    def put(box: Box, data: np.ndarray) -> None:
        buf[tuple(slice(o - c, o - c + n) for o, c, n in zip(box[0], item.offsets, box[1]))] = data

    mine = intersect(cell, (lf.desc.offsets, lf.desc.lengths))
    if mine is not None:
        put(mine, _local_box(lf, *mine))
    for i, t in plan.transfers:
        if t.dst == item.rank and t.path == item.path and intersect(cell, (t.offsets, t.lengths)) is not None:
            put((t.offsets, t.lengths), received[i].view(buf.dtype).reshape(_dtypes.storage_shape(dtype, t.lengths)))
    return buf


class _ShardWrite(NamedTuple):  # a NamedTuple: made once per file, 10,000 times for 10,000 small leaves
    """One shard file of this rank's writes, and who writes it (:func:`route`)."""

    item: WriteItem
    rec: ArrayRecord
    shapes: StoredShapes
    offsets: tuple[int, ...]  # the box of the array the file holds
    lengths: tuple[int, ...]
    key: str
    route: Route


def _shard_writes(writes: Sequence[WriteItem], records: dict[str, ArrayRecord], where: Place) -> Iterator[_ShardWrite]:
    """The plan of a rank's writes: each shard file, in order, with its writer (pure; no
    source is read here, only when its file is written). The own codec encodes
    whole files only; a box that is not a whole shard (the planner gives none) would be
    left to TensorStore."""
    for item in writes:
        rec = records[item.path]
        shapes, how = stored_shapes(rec), route(rec, where)
        for off, ln in shard_boxes(item.offsets, item.lengths, rec.chunking):
            own = how is not Route.TENSORSTORE and _whole_shard(rec, off, ln)
            yield _ShardWrite(item, rec, shapes, off, ln, chunk_key(rec, off), how if own else Route.TENSORSTORE)


def _whole_shard(rec: ArrayRecord, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Whether the box is all of the shard at ``offsets`` that lies in the array."""
    for o, n, g, s in zip(offsets, lengths, rec.chunking.shard_shape, rec.shape):
        if o % g or n != min(g, s - o):
            return False
    return True


def _write_place(data: dict[str, Any], compact: bool) -> Place:
    """What the own codec writes into the kvstore ``data`` (WRITE_THREADS = 0: no shard files)."""
    return place(data, LAYOUT_COMPACT if compact else LAYOUT_PLAIN, shard_files=WRITE_THREADS >= 1)


class _Batch:
    """Unsharded chunk files of a local plain checkpoint written by one worker task (a
    task per file cost more Python, in a future, a lock and a thread switch, than the
    file's own three system calls), their directories made by that task. Every write of
    the batch shares this handle as its future: waiting on it hands the batch to the
    workers if it is still being filled."""

    def __init__(self, pool: Workers, directory: str, made: set[str]) -> None:
        self.pool, self.directory, self.made = pool, directory, made
        self.files: list[tuple[str, np.ndarray, tuple[int, ...]]] = []
        self.nbytes = 0
        self.future: Any = None

    def add(self, key: str, src: np.ndarray, chunk: tuple[int, ...]) -> None:
        self.files.append((key, src, chunk))
        self.nbytes += src.nbytes

    def submit(self) -> None:
        """Hand the batch to the workers (once); nothing may be added after."""
        if self.future is None:
            files = self.files
            self.future = self.pool.submit(_write_chunk_files, self.directory, files, self.made)

    def result(self) -> None:
        """Wait until every file of the batch is written; raise the first failure."""
        self.submit()
        self.future.result()


def _write_chunk_files(directory: str, files: list[tuple[str, np.ndarray, tuple[int, ...]]], made: set[str]) -> None:
    """One batch: the directories of its files not yet made (on this worker, so that the
    directories are made while the main thread reads the next sources), then the files."""
    shardwrite.make_parents(directory, (key for key, _, _ in files), made)
    for key, src, chunk in files:
        shardwrite.write_chunk(os.path.join(directory, key), src, chunk)


def _write_small_files(files: list[tuple[str, bytes]]) -> None:
    for path, data in files:
        shardwrite.write_bytes(path, data)


# A write started: its future, its bytes, and what to run once it has finished with its source.
_Started = tuple[Any, int, "Callable[[], None] | None"]


class _Writers:
    """Starts each shard file's write with its writer: on a local plain checkpoint the own
    codec's file writers on worker threads (shard files, and unsharded chunk files), else
    one kvstore write of an own-encoded chunk, or a TensorStore array write (compact
    layout: all in the window's transaction). Started writes are (future, bytes).

    The directories of the files are made once each: those of shard files before any is
    written (:meth:`make_dirs`), those of unsharded chunk files by their batch's task;
    ``made`` holds those known to exist."""

    def __init__(
        self, data: dict[str, Any], where: Place, progress: Progress, *, compact: bool, made: set[str] | None = None,
        context: ts.Context | None = None,
    ) -> None:
        self.data, self.directory, self.progress = data, where.directory, progress
        self.made: set[str] = set() if made is None else made
        self.context = context or write_context()
        self.kv = ts.KvStore.open(data, context=self.context).result()
        self.txn = ts.Transaction() if compact else None
        self.stores: dict[str, ts.TensorStore] = {}
        self.pool = Workers(WRITE_THREADS, "tsckpt-write")
        self.batch: _Batch | None = None  # unsharded chunk files not yet handed to the workers

    def make_dirs(self, files: Iterable[_ShardWrite]) -> None:
        """Create the directories of the shard files the own writer writes (TensorStore
        makes its own; unsharded chunk files' are made by their batch)."""
        if self.directory is not None:
            shardwrite.make_parents(self.directory, (w.key for w in files if w.route is Route.SHARD), self.made)

    def start(self, w: _ShardWrite, src: np.ndarray, done: Callable[[], None] | None = None) -> _Started:
        """Start writing ``src``; ``done`` runs once the write has finished with it."""
        if w.route is Route.SHARD:
            fut = self._shard_file(w, src)
        elif w.route is Route.CHUNK and self.directory is not None:
            fut = self._chunk_file(self.directory, w.key, src, w.shapes.shard)
        elif w.route is Route.CHUNK:
            kv = self.kv if self.txn is None else self.kv.with_transaction(self.txn)
            fut = kv.write(w.key, encode_chunk(src, w.shapes.shard))
        else:
            fut = self._tensorstore(w, src)
        return fut, src.nbytes, done

    def _chunk_file(self, directory: str, key: str, src: np.ndarray, chunk: tuple[int, ...]) -> _Batch:
        batch = self.batch
        if batch is None or batch.future is not None:
            batch = self.batch = _Batch(self.pool, directory, self.made)
        batch.add(key, src, chunk)
        if batch.nbytes >= BATCH_BYTES or len(batch.files) >= BATCH_FILES:
            batch.submit()
        return batch

    def _shard_file(self, w: _ShardWrite, src: np.ndarray) -> Any:
        shapes = w.shapes
        path = os.path.join(str(self.directory), w.key)
        inner = shapes.inner or shapes.shard
        return self.pool.submit(
            lambda: shardwrite.write_shard(path, src, shapes.shard, inner, writeback=START_WRITEBACK)
        )

    def _tensorstore(self, w: _ShardWrite, src: np.ndarray) -> Any:
        if w.rec.path not in self.stores:
            self.stores[w.rec.path] = open_array(self.data, w.rec, write=True, context=self.context)
        store = self.stores[w.rec.path] if self.txn is None else self.stores[w.rec.path].with_transaction(self.txn)
        dst = store[tuple(slice(o, o + n) for o, n in zip(w.offsets, w.lengths))] if w.offsets else store
        written = dst.write(src, can_reference_source_data_indefinitely=True)
        return written.commit if self.txn is None else written.copy

    def settle(self, started: _Started) -> None:
        """Wait for one write."""
        fut, nbytes, done = started
        fut.result()
        if done is not None:
            done()
        self.progress.update(nbytes, 1)

    def commit(self, window: list[_Started]) -> None:
        """Compact layout: wait for a window's writes and commit its transaction."""
        for fut, _, _ in window:
            fut.result()
        if self.txn is not None:
            self.txn.commit_async().result()
            self.txn = ts.Transaction()
        for _, _, done in window:
            if done is not None:
                done()
        self.progress.update(sum(n for _, n, _ in window), len(window))

    def close(self) -> None:
        """Wait for the shard files being written (none is being written once this returns)."""
        self.pool.shutdown()


def _write_regions(
    data: dict[str, Any], plan: RankPlan, local: dict[str, Local], received: dict[int, np.ndarray], window: int,
    *, compact: bool, progress: Progress, made: set[str] | None = None, context: ts.Context | None = None,
) -> list[str]:
    """Write this rank's items into the kvstore ``data`` shard by shard, keeping a bounded
    window in flight: plan each file's writer (:func:`_shard_writes`), then start each
    write as its source is read. Each directory of the files is made once (``made``:
    those known to exist, to which the new ones are added). Returns the keys
    written.

    TensorStore may encode straight from the source memory (no staging copy): save()
    waits for every write before it returns, so the caller cannot change the data
    underneath. The compact layout's database gets one transaction per window, so each
    window becomes a few large files rather than a commit (and files) per write.
    """
    writes = plan.writes  # built from the plan's groups on each access
    progress.set_total(sum(math.prod(w.lengths) * local[w.path].desc.itemsize for w in writes))
    where = _write_place(data, compact)
    writers = _Writers(data, where, progress, compact=compact, made=made, context=context)
    files = list(_shard_writes(writes, {a.path: a for a in plan.arrays}, where))
    writers.make_dirs(files)
    in_flight: Window[_Started] = (
        Window(window, batch=writers.commit) if compact else Window(window, writers.settle)
    )
    device = _DeviceSources(window, writers, in_flight)
    written: list[str] = []
    try:
        for w in files:
            lf = local[w.item.path]
            if not w.item.assembled and _devicecopy.on_device(lf.data):
                device.add(w, lf.data[_box_sel(lf, w.offsets, w.lengths)])
            else:
                src = _assemble(w.item, lf, plan, received) if w.item.assembled else _local_box(lf, w.offsets, w.lengths)
                in_flight.add(writers.start(w, src), src.nbytes)
            written.append(w.key)
        device.flush()
        in_flight.drain()
    finally:
        device.close()
        writers.close()
    return written


class _DeviceSources:
    """Writes whose source is in device memory: each box is copied into the host memory of
    a :class:`_devicecopy.ToHost` ring of the write window's bytes, one box ahead of the
    writes, so the next box's copy runs while the previous one is written; the ring's
    memory comes back as the writes finish (the window settles its oldest write when
    the ring needs room). CPU sources never come here."""

    def __init__(self, window: int, writers: _Writers, in_flight: Window[_Started]) -> None:
        self.window, self.writers, self.in_flight = window, writers, in_flight
        self.copier: _devicecopy.ToHost | None = None
        self.ahead: collections.deque[tuple[_ShardWrite, _devicecopy.Staged]] = collections.deque()

    def add(self, w: _ShardWrite, box: Any) -> None:
        """Start copying ``box`` to the host; start the write of the box before it."""
        if self.copier is None:
            self.copier = _devicecopy.ToHost(self.window)
        self.ahead.append((w, self.copier.start(box, self._make_room)))
        if len(self.ahead) > 1:
            self._start_oldest()

    def flush(self) -> None:
        """Start the writes of the boxes still being copied."""
        while self.ahead:
            self._start_oldest()

    def close(self) -> None:
        """After a failure: wait for the copies still running into host memory."""
        for _, staged in self.ahead:
            if self.copier is not None:
                self.copier.ready(staged)
        self.ahead.clear()

    def _start_oldest(self) -> None:
        copier = self.copier
        if copier is None:
            return
        w, staged = self.ahead.popleft()
        src = storage_numpy(copier.ready(staged))
        self.in_flight.add(self.writers.start(w, src, lambda: copier.done(staged)), src.nbytes)

    def _make_room(self) -> bool:
        """Finish the oldest work holding ring memory: a write, else a box still to write."""
        if self.in_flight.settle_oldest():
            return True
        if self.ahead:
            self._start_oldest()
            return True
        return False


def _nodes(arrays: tuple[ArrayRecord, ...]) -> dict[str, bytes]:
    """zarr.json of every array and of every intermediate group (root excluded), by key."""
    nodes = {f"{rec.path}/{ROOT_KEY}": _store.encode_json(array_node(rec)) for rec in arrays}
    groups: set[str] = set()
    for rec in arrays:
        parts = rec.path.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    body = _store.encode_json(group_metadata())
    nodes.update((f"{g}/{ROOT_KEY}", body) for g in sorted(groups))
    return nodes


def _write_nodes(
    data: dict[str, Any], arrays: tuple[ArrayRecord, ...], *, compact: bool, made: set[str], context: ts.Context | None = None,
) -> list[str]:
    """Write :func:`_nodes` into the kvstore ``data``: on a local plain checkpoint as the
    own codec writes chunk files (``made``: the directories known to exist, as
    :func:`_write_regions` takes them), elsewhere by kvstore writes (one transaction
    in a compact layout's database). Returns their keys."""
    nodes = _nodes(arrays)
    where = _write_place(data, compact)
    if where.directory is not None:
        directory = where.directory
        shardwrite.make_parents(directory, nodes, made)
        pool = Workers(WRITE_THREADS, "tsckpt-write")
        files = [(os.path.join(directory, key), body) for key, body in nodes.items()]
        try:
            batches = [files[i : i + BATCH_FILES] for i in range(0, len(files), BATCH_FILES)]
            for written in [pool.submit(_write_small_files, b) for b in batches]:
                written.result()
        finally:
            pool.shutdown()
        return list(nodes)
    kv = ts.KvStore.open(data, context=context or write_context()).result()
    txn = ts.Transaction() if compact else None
    if txn is not None:
        kv = kv.with_transaction(txn)
    futures = [kv.write(key, body) for key, body in nodes.items()]
    for fut in futures:
        fut.result()
    if txn is not None:
        txn.commit_async().result()
    return list(nodes)


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
       the save ends (tsckpt/_save/lease.py). It then sends each rank only its
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
    8. Clean-up (rank 0, only after a failure once every rank knows of it;
       the lowest surviving rank when rank 0 was lost): the partial checkpoint
       is removed (the pending root first, if still this save's), so saving
       again needs no ``overwrite=True``.

    Every step ends with every rank knowing the outcome (steps 1-4 through the
    replies of rank 0, the others by exchanging a status), so a failure on one
    rank makes every rank raise and nothing is committed. Storage faults raise
    StorageError (an OSError with ``errno``, ``filename`` and ``leaf``).
    """
    save_with(directory, tree, SaveOptions.of(locals()))  # a bad option raises here, before any work


def save_with(
    directory: Directory, tree: Any, options: SaveOptions, *, before_claim: Callable[[], None] | None = None
) -> None:
    """:func:`save` with its options gathered. ``before_claim`` (a CheckpointManager's clearing
    of its step) runs on rank 0 right before the claim (step 4), so that what it judges and
    removes is judged as late as possible, and its failure reaches every rank as any other
    failure of rank 0's planning does."""
    overwrite, group, check_replicas, timeout = options.overwrite, options.group, options.check_replicas, options.timeout
    max_inflight_bytes, layout, progress = options.max_inflight_bytes, options.layout, options.progress
    codec_setting()  # a bad TSCKPT_CODEC is refused before the claim
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

    with collector_paused():  # why: see there
        job: _Job | None = None
        try:
            job = _plan_job(coord, loc, tree, overwrite, check_replicas, max_inflight_bytes, layout, lease, before_claim)
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
            elif job is not None and job.save_id and isinstance(e, DistributedError) and _cleans_for_rank_0(coord, e.lost):
                _lease.abandon_lost(loc, job.save_id, e)
            raise
        finally:
            if lease is not None:
                lease.end()


def _cleans_for_rank_0(coord: Any, lost: tuple[int, ...]) -> bool:
    """Whether this rank cleans up after a save whose rank 0 was lost: the lowest rank not lost."""
    return 0 in lost and coord.rank == min(r for r in range(coord.world_size) if r not in lost)


@dataclasses.dataclass(frozen=True)
class _Commit:
    """What rank 0 records in the committed root."""

    arrays: tuple[ArrayRecord, ...]
    values: tuple[tuple[str, Any], ...]
    leaves: list[str]
    structure: Any  # None when ranks gave different trees
    aliases: dict[str, str]
    writers: tuple[int, ...]  # ranks with data to write (the compact layout's databases)

    def metadata(self, world_size: int) -> dict[str, Any]:
        """The committed root's tsckpt metadata, beyond its state and version."""
        return {
            "structure": self.structure,
            "leaves": self.leaves,
            "arrays": [a.to_json() for a in self.arrays],
            "values": dict(self.values),
            **({"aliases": self.aliases} if self.aliases else {}),
            "world_size": world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }


@dataclasses.dataclass(frozen=True)
class Part:
    """Rank 0 to one rank (step 4): its part of the plan."""

    plan: RankPlan
    window: int  # bytes of source data in flight while writing: the least of any rank's
    commit: _Commit | None = None  # rank 0 only; never sent
    save_id: str | None = None  # its claim's: a survivor removes the pending root if rank 0 is lost


@dataclasses.dataclass(frozen=True)
class _Described:
    """What rank 0 knows after step 2: every rank's payload, the tied leaves (stored once,
    under another path), and the descriptors gathered without them."""

    payloads: tuple[Payload, ...]
    aliases: dict[str, str]
    gathered: Gathered


@dataclasses.dataclass(frozen=True)
class _Job:
    """This rank's leaves and its part of the plan."""

    plan: RankPlan
    local: dict[str, Local]  # this rank's leaves, by path
    window: int
    commit: _Commit | None
    save_id: str | None = None  # the save's claim (Part.save_id)


def _describe(tree: Any, window: int, layout: str) -> tuple[dict[str, Local], Payload]:
    """Step 1, every rank: this rank's leaves by path, and what rank 0 needs of them."""
    flat = flatten(tree)
    local = [describe(p, leaf) for p, leaf in zip(flat.paths, flat.leaves)]
    descs = [lf.desc for lf in local]
    payload = Payload.of(descs, flat.paths, structure_to_json(flat.spec), _links(local), window, layout)
    return {lf.desc.path: lf for lf in local}, payload


def _gather(payloads: Sequence[Payload]) -> _Described:
    """Step 2, rank 0: every rank's descriptors grouped by path, without the tied leaves."""
    layouts = sorted({p.layout for p in payloads})
    if len(layouts) > 1:
        raise ValueError(
            f"ranks passed different layouts ({', '.join(map(repr, layouts))}); every rank must save with the same"
        )
    per_rank = [p.descs for p in payloads]
    aliases = plan_aliases(per_rank, [p.links for p in payloads])
    return _Described(tuple(payloads), aliases, without(gather_descs(per_rank), aliases))


def _parts(d: _Described) -> list[Part]:
    """Step 4, rank 0: plan the save and split it into every rank's part (rank 0's with
    what it records at the commit)."""
    least = min(p.window for p in d.payloads)
    plan = plan_save(d.gathered, shard_bytes=min(_chunking.SHARD_BYTES, least))
    paths, structure = d.payloads[0].paths, d.payloads[0].structure
    same_tree = all(p.paths == paths and p.structure == structure for p in d.payloads)
    parts = split_plan(plan)
    commit = _Commit(
        plan.arrays, plan.values, list(paths) if same_tree else sorted({q for p in d.payloads for q in p.paths}),
        json.loads(structure) if same_tree else None, d.aliases,
        tuple(r for r, part in enumerate(parts) if part.writes_anything),
    )
    return [Part(part, least, commit if r == 0 else None) for r, part in enumerate(parts)]


def _plan_job(
    coord: Any, loc: Location, tree: Any, overwrite: bool, check_replicas: bool, window: int, layout: str,
    lease: _lease.Lease | None = None, before_claim: Callable[[], None] | None = None,
) -> _Job:
    """Steps 1-4 of the protocol: one round trip through rank 0, two when replicas are checked."""
    described: _Described | None = None  # rank 0, between the two round trips

    def first(payloads: list[Payload]) -> list[ChecksumRequest] | list[Part]:
        nonlocal described
        described = _gather(payloads)
        shared = shared_regions(described.gathered) if check_replicas and coord.world_size > 1 else []
        if any(shared):  # step 2b
            return [ChecksumRequest(tuple(paths)) for paths in shared]
        return finish(described)

    def second(sums: list[dict[str, int]]) -> list[Part]:
        if described is None:
            raise RuntimeError("replica checksums arrived before the descriptors")
        return finish(dataclasses.replace(described, gathered=with_checksums(described.gathered, sums)))

    def finish(d: _Described) -> list[Part]:
        parts = _parts(d)
        if before_claim is not None:
            before_claim()
        mark_if_managed(loc)  # a manager's step on an object store: listed before anything is written
        _begin(loc, overwrite, layout, lease)
        return [dataclasses.replace(p, save_id=lease.save_id) for p in parts] if lease is not None else parts

    def describe_mine() -> tuple[dict[str, Local], Payload]:
        return _describe(expand(tree, rank=coord.rank).tree, window, layout)

    local, reply = ask_root(coord, "save (describe)", describe_mine, first)
    if isinstance(reply, ChecksumRequest):  # step 3
        asked = reply.paths

        def sums() -> tuple[None, dict[str, int]]:
            return None, {p: checksum(local[p].data) for p in asked}

        _, reply = ask_root(coord, "save (replica checksums)", sums, second)
    return _Job(reply.plan, local, reply.window, reply.commit, reply.save_id)


def _write(
    loc: Location, rank: int, job: _Job, received: dict[int, np.ndarray], layout: str, progress: Progress
) -> None:
    """Write this rank's regions (rank 0 also the zarr.json nodes), then sync them to storage."""
    compact = layout == LAYOUT_COMPACT
    data = _write_spec(loc, layout, writer=rank)
    context = write_context()  # this save's own: see there
    with _store.storage_errors(loc, doing="writing"):
        made: set[str] = set()  # directories made for the own codec's files, by both steps
        keys = _write_regions(
            data, job.plan, job.local, received, job.window, compact=compact, progress=progress, made=made,
            context=context,
        )
        if job.commit is not None:
            keys += _write_nodes(data, job.commit.arrays, compact=compact, made=made, context=context)
        if compact:
            _store.sync_paths(loc, [f"{OCDBT_PREFIX}{rank}"])
        else:
            _store.sync_data(loc, keys)


def write_context() -> ts.Context:
    """A context for one save's writes (and one for its merge): the process's
    (:data:`_store.CONTEXT`: its thread pools, its s3 retries), with a cache pool of its own
    that keeps nothing. TensorStore keeps one OCDBT driver per spec and cache pool, and a
    driver remembers the database it wrote: a compact save that failed after some of its
    windows were committed leaves a driver (still referenced by the failed transaction) that
    believes in the database its clean-up removed, so a save again in its place through the
    same pool failed with NOT_FOUND reading the removed files, however often it was retried.
    Each save's drivers are its own, so a retry starts from what is on disk."""
    return ts.Context({_store.WRITE_CACHE_POOL: {"total_bytes_limit": 0}}, parent=_store.CONTEXT)


def _write_spec(loc: Location, layout: str, writer: int | None = None) -> dict[str, Any]:
    """:func:`data_spec` for writing: a compact database through the cache pool that keeps
    nothing between saves (see _store.CONTEXT)."""
    spec = data_spec(loc, layout, writer=writer)
    return {**spec, "cache_pool": _store.WRITE_CACHE_POOL} if layout == LAYOUT_COMPACT else spec


def _commit(loc: Location, world_size: int, job: _Job, layout: str, lease: _lease.Lease | None = None) -> None:
    """Step 7, rank 0: merge the ranks' databases (compact layout), then the one atomic
    write that makes the checkpoint visible, if the pending root is still this save's
    (``lease``: its renewals stop first)."""
    c = job.commit
    if c is None:
        raise RuntimeError("only rank 0 commits a save")
    if layout == LAYOUT_COMPACT:
        databases = [_write_spec(loc, layout, writer=rank) for rank in sorted({0, *c.writers})]
        with _store.storage_errors(loc):
            merge_databases(loc, _write_spec(loc, layout), databases, write_context())
    _commit_root(loc, c.metadata(world_size), layout, lease)
