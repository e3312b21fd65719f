"""The write engine of a save: one rank's part of the plan executed.

Steps 5 and 6 of :func:`tsckpt._save.protocol.save` run here: the pieces of regions
that straddle shard files are exchanged between ranks (:func:`exchange`), then each
rank writes its shard files (:func:`write_regions`: the own codec's shard and chunk
files where :mod:`tsckpt._codec.route` says so, TensorStore for the rest, device
tensors copied to the host piece by piece) and rank 0 the arrays' ``zarr.json``
nodes (:func:`write_nodes`), all within the save's window of bytes in flight.
"""

from __future__ import annotations

import collections
import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from .._base import dtypes as _dtypes
from .._base.types import Box, LazySource, Local, box_slices
from .._codec import shardwrite
from .._codec.encode import encode_chunk
from .._codec.files import StoredShapes, stored_shapes
from .._codec.route import Place, Route, place, regular_shards, route
from .._codec.threads import Workers, cpus
from .._errors import LeafTypeError
from .._leaves.kinds import storage_numpy
from .._ondisk.arrays import chunk_key, node_bytes, open_array, stored_size
from .._ondisk.chunking import intersect, shard_boxes
from .._ondisk.records import LAYOUT_COMPACT, LAYOUT_PLAIN, ROOT_KEY, ArrayRecord, group_metadata
from .._runtime import devicecopy as _devicecopy
from .._runtime.progress import Progress
from .._runtime.window import Window
from .._storage import durable as _durable
from .._storage import locations as _locations
from .._storage.s3copy import etag_of
from .plan import RankPlan, WriteItem
from .share import ObjectSharer, Proof, Sharer

# Shard files of a local plain checkpoint written at once by tsckpt's own writer
# (_codec/shardwrite.py; pwritev and large copies release the GIL), by this many threads:
# two, or four where the CPUs allow (benchmarks/RESULTS.md, "Threads by CPUs": more than
# four gained nothing on 16 CPUs).
WRITE_THREADS = max(2, min(4, cpus()))
# Whether tsckpt's own writer writes the shard files of a local plain checkpoint at all
# (off: TensorStore writes them, as it does everywhere else).
OWN_SHARD_FILES = True
# An incremental save's files on an object store are hashed, then copied or written, by this
# many threads, each waiting on its request: as many requests at once as TensorStore's s3
# driver sends by default (its ``s3_request_concurrency``).
OBJECT_THREADS = 32
# A shard file of an incremental save on an object store at least this large is written by
# TensorStore from its source and its ETag read back by one request (reading none of its
# bytes), rather than encoded in memory for one write: the memory buffer is copied once more
# on its way to TensorStore, which cost more than the request (benchmarks/RESULTS.md).
OBJECT_IN_MEMORY_BYTES = 4 << 20
# Unsharded chunk files (and zarr.json nodes) of such a checkpoint go to the writing threads
# in batches of this many files, or fewer that hold BATCH_BYTES.
BATCH_FILES = 64
BATCH_BYTES = 4 << 20
# Start writing each shard file that went through the page cache (a file system without
# direct I/O) to disk as soon as it is written; sync_data still makes them durable. Files
# written with direct I/O leave nothing to write back. (Measured before direct I/O, when
# every file went through the cache: 1.9 s against 2.8 s for 1 GiB with 2 threads.)
START_WRITEBACK = True


def _box_sel(lf: Local, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    """Where the global box (``offsets``, ``lengths``) lies in a rank's local data."""
    return box_slices(offsets, lengths, lf.desc.offsets)


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


def exchange(coord: Any, plan: RankPlan, local: dict[str, Local]) -> dict[int, np.ndarray]:
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
        buf[box_slices(box[0], box[1], item.offsets)] = data

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
            own = how is not Route.TENSORSTORE and whole_shard(rec, off, ln)
            yield _ShardWrite(item, rec, shapes, off, ln, chunk_key(rec, off), how if own else Route.TENSORSTORE)


def whole_shard(rec: ArrayRecord, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Whether the box is all of the shard at ``offsets`` that lies in the array."""
    for o, n, g, s in zip(offsets, lengths, rec.chunking.shard_shape, rec.shape):
        if o % g or n != min(g, s - o):
            return False
    return True


def write_place(data: dict[str, Any], compact: bool) -> Place:
    """What the own codec writes into the kvstore ``data`` (no shard files without :data:`OWN_SHARD_FILES`)."""
    return place(data, LAYOUT_COMPACT if compact else LAYOUT_PLAIN, shard_files=OWN_SHARD_FILES)


class _Batch:
    """Unsharded chunk files of a local plain checkpoint written by one worker task (a
    task per file cost more Python, in a future, a lock and a thread switch, than the
    file's own three system calls), their directories made by that task, and the zarr.json
    of each one-file array among them where this rank writes the nodes (so each array's
    directory is made and filled by one task, while the main thread reads the next
    sources). Every write of the batch shares this handle as its future: waiting on it
    hands the batch to the workers if it is still being filled."""

    def __init__(self, pool: Workers, directory: str, made: set[str], sharer: Sharer | None) -> None:
        self.pool, self.directory, self.made, self.sharer = pool, directory, made, sharer
        self.files: list[tuple[str, np.ndarray, tuple[int, ...], ArrayRecord, Proof | None]] = []
        self.nodes: list[tuple[str, bytes]] = []
        self.nbytes = 0
        self.future: Any = None

    def add(
        self, key: str, src: np.ndarray, chunk: tuple[int, ...], rec: ArrayRecord, proof: Proof | None,
        node: tuple[str, bytes] | None,
    ) -> None:
        self.files.append((key, src, chunk, rec, proof))
        if node is not None:
            self.nodes.append(node)
        self.nbytes += src.nbytes

    def submit(self) -> None:
        """Hand the batch to the workers (once); nothing may be added after."""
        if self.future is None:
            self.future = self.pool.submit(
                _write_chunk_files, self.directory, self.files, self.nodes, self.made, self.sharer
            )

    def result(self) -> None:
        """Wait until every file of the batch is written; raise the first failure."""
        self.submit()
        self.future.result()


def _write_chunk_files(
    directory: str, files: list[tuple[str, np.ndarray, tuple[int, ...], ArrayRecord, Proof | None]],
    nodes: list[tuple[str, bytes]], made: set[str], sharer: Sharer | None,
) -> None:
    """One batch: the directories of its files not yet made (on this worker, so that the
    directories are made while the main thread reads the next sources), then the files
    (an incremental save's shared with its base where ``sharer`` proves them equal) and
    the ``nodes`` (key, bytes) among them."""
    shardwrite.make_parents(directory, (key for key, _, _, _, _ in files), made)
    for key, src, chunk, rec, proof in files:
        path = os.path.join(directory, key)
        if sharer is None:
            shardwrite.write_chunk(path, src, chunk)
        else:
            sharer.put(key, rec, src, functools.partial(shardwrite.write_chunk, path, src, chunk, stat=True), proof)
    for key, body in nodes:
        shardwrite.write_bytes(os.path.join(directory, key), body)


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
    ``made`` holds those known to exist. ``nodes``: the zarr.json nodes this rank writes
    (key -> bytes); a batch takes those of its one-file arrays out of it."""

    def __init__(
        self, data: dict[str, Any], where: Place, progress: Progress, *, compact: bool, made: set[str] | None = None,
        context: ts.Context | None = None, sharer: Sharer | None = None, nodes: dict[str, bytes] | None = None,
    ) -> None:
        self.data, self.directory, self.progress, self.sharer = data, where.directory, progress, sharer
        self.own = where.own
        self.nodes = {} if nodes is None else nodes
        self.made: set[str] = set() if made is None else made
        self.context = context or write_context()
        self.kv = ts.KvStore.open(data, context=self.context).result()
        self.txn = ts.Transaction() if compact else None
        self.stores: dict[str, ts.TensorStore] = {}
        self.pool = Workers(WRITE_THREADS, "tsckpt-write")
        self.objects = Workers(OBJECT_THREADS, "tsckpt-write")  # an object store's files (ObjectSharer)
        self.batch: _Batch | None = None  # unsharded chunk files not yet handed to the workers

    def make_dirs(self, files: Iterable[_ShardWrite]) -> None:
        """Create the directories of the shard files the own writer writes (TensorStore
        makes its own; unsharded chunk files' are made by their batch)."""
        if self.directory is not None:
            shardwrite.make_parents(self.directory, (w.key for w in files if w.route is Route.SHARD), self.made)

    def start(
        self, w: _ShardWrite, src: np.ndarray, done: Callable[[], None] | None = None, proof: Proof | None = None
    ) -> _Started:
        """Start writing ``src``; ``done`` runs once the write has finished with it. ``proof``:
        where the file's hash may be known without reading ``src`` (:meth:`Sharer.proof`)."""
        if isinstance(self.sharer, ObjectSharer):
            fut = self._object(self.sharer, w, src, proof)
        elif w.route is Route.SHARD:
            fut = self._shard_file(w, src, proof)
        elif w.route is Route.CHUNK and self.directory is not None:
            fut = self._chunk_file(self.directory, w, src, proof)
        elif w.route is Route.CHUNK:
            kv = self.kv if self.txn is None else self.kv.with_transaction(self.txn)
            fut = kv.write(w.key, encode_chunk(src, w.shapes.shard))
        else:
            fut = self._tensorstore(w, src)
        return fut, src.nbytes, done

    def share_known(self, w: _ShardWrite, proof: Proof, nbytes: int) -> bool:
        """Share the own codec's file of ``w`` (``nbytes`` of data) with the base where ``proof``
        shows it unchanged (:meth:`Sharer.share_known`), here, its data never read: True when done."""
        if self.sharer is None or self.directory is None or w.route is Route.TENSORSTORE:
            return False
        shardwrite.make_parents(self.directory, (w.key,), self.made)
        if not self.sharer.share_known(w.key, w.rec, proof):
            return False
        self.progress.update(nbytes, 1)
        return True

    def _chunk_file(self, directory: str, w: _ShardWrite, src: np.ndarray, proof: Proof | None) -> _Batch:
        batch = self.batch
        if batch is None or batch.future is not None:
            batch = self.batch = _Batch(self.pool, directory, self.made, self.sharer)
        node = f"{w.rec.path}/{ROOT_KEY}"
        batch.add(
            w.key, src, w.shapes.shard, w.rec, proof, (node, self.nodes.pop(node)) if node in self.nodes else None
        )
        if batch.nbytes >= BATCH_BYTES or len(batch.files) >= BATCH_FILES:
            batch.submit()
        return batch

    def _shard_file(self, w: _ShardWrite, src: np.ndarray, proof: Proof | None) -> Any:
        shapes = w.shapes
        path = os.path.join(str(self.directory), w.key)
        inner = shapes.inner or shapes.shard
        sharer = self.sharer

        def write() -> None:
            digests = shardwrite.write_shard(
                path, src, shapes.shard, inner, writeback=START_WRITEBACK, hashes=sharer is not None
            )
            if sharer is not None:
                sharer.wrote_chunks(w.key, digests)

        return self.pool.submit(write if sharer is None else lambda: sharer.put(w.key, w.rec, src, write, proof))

    def _object(self, sharer: ObjectSharer, w: _ShardWrite, src: np.ndarray, proof: Proof | None) -> Any:
        """An incremental save's file on an object store, on the write threads: hashed, copied
        from the base where proven equal (:class:`ObjectSharer`), else written; either way
        its object's ETag is recorded, from the write's response (the own codec's files,
        encoded in memory) or, for a file TensorStore wrote, one request reading none of
        its bytes."""

        def write() -> tuple[str | None, int]:
            if w.route is Route.CHUNK:
                data = encode_chunk(src, w.shapes.shard)
            elif (
                self.own and regular_shards(w.rec) and whole_shard(w.rec, w.offsets, w.lengths)
                and src.nbytes < OBJECT_IN_MEMORY_BYTES
            ):
                digests: list[str] = []
                data = shardwrite.shard_bytes(src, w.shapes.shard, w.shapes.inner or w.shapes.shard, digests)
                sharer.wrote_chunks(w.key, digests)
            else:  # TensorStore's (a large shard file, or TSCKPT_CODEC=tensorstore): its ETag read back, reading none of its bytes
                self._tensorstore(w, src).result()
                stamp = self.kv.read(w.key, byte_range=slice(0, 0)).result().stamp
                return etag_of(stamp.generation), stored_size(w.rec, box_slices(w.offsets, w.lengths)).nbytes
            return etag_of(self.kv.write(w.key, data).result().generation), len(data)

        return self.objects.submit(sharer.put, w.key, w.rec, src, write, proof)

    def _tensorstore(self, w: _ShardWrite, src: np.ndarray) -> Any:
        if w.rec.path not in self.stores:
            self.stores[w.rec.path] = open_array(self.data, w.rec, write=True, context=self.context)
        store = self.stores[w.rec.path] if self.txn is None else self.stores[w.rec.path].with_transaction(self.txn)
        dst = store[box_slices(w.offsets, w.lengths)] if w.offsets else store
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
        self.objects.shutdown()


def write_regions(
    data: dict[str, Any], plan: RankPlan, local: dict[str, Local], received: dict[int, np.ndarray], window: int,
    *, compact: bool, progress: Progress, made: set[str] | None = None, context: ts.Context | None = None,
    sharer: Sharer | None = None, nodes: dict[str, bytes] | None = None,
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
    ``sharer`` (an incremental save's, local plain layout): the own codec's files are
    hashed, and shared with its base where proven equal. ``nodes`` (rank 0: :func:`node_files`):
    the zarr.json of each one-file array whose chunk file goes in a batch is written by
    that batch and taken out of it; :func:`write_nodes` writes the rest.
    """
    writes = plan.writes  # built from the plan's groups on each access
    progress.set_total(sum(math.prod(w.lengths) * local[w.path].desc.itemsize for w in writes))
    where = write_place(data, compact)
    writers = _Writers(data, where, progress, compact=compact, made=made, context=context, sharer=sharer, nodes=nodes)
    files = list(_shard_writes(writes, {a.path: a for a in plan.arrays}, where))
    writers.make_dirs(files)
    in_flight: Window[_Started] = (
        Window(window, batch=writers.commit) if compact else Window(window, writers.settle)
    )
    device = DeviceSources(window, writers, in_flight)
    written: list[str] = []
    try:
        for w in files:
            lf = local[w.item.path]
            if not w.item.assembled and _devicecopy.on_device(lf.data):
                device.add(w, lf.data[_box_sel(lf, w.offsets, w.lengths)])
            else:
                proof = None
                if w.item.assembled:
                    src = _assemble(w.item, lf, plan, received)
                else:
                    if sharer is not None:  # before the data is read
                        proof = sharer.proof(lf.data, (lf.desc.dtype, lf.desc.offsets), w.offsets, w.lengths)
                        if proof is not None and writers.share_known(w, proof, math.prod(w.lengths) * lf.desc.itemsize):
                            written.append(w.key)
                            continue
                    src = _local_box(lf, w.offsets, w.lengths)
                in_flight.add(writers.start(w, src, proof=proof), src.nbytes)
            written.append(w.key)
        device.flush()
        in_flight.drain()
    finally:
        device.close()
        writers.close()
    return written


class DeviceSources:
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


def node_files(arrays: tuple[ArrayRecord, ...]) -> dict[str, bytes]:
    """zarr.json of every array and of every intermediate group (root excluded), by key."""
    nodes = {f"{rec.path}/{ROOT_KEY}": node_bytes(rec) for rec in arrays}
    groups: set[str] = set()
    for rec in arrays:
        parts = rec.path.split("/")
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    body = _durable.encode_json(group_metadata())
    nodes.update((f"{g}/{ROOT_KEY}", body) for g in sorted(groups))
    return nodes


def write_nodes(
    data: dict[str, Any], nodes: dict[str, bytes], *, compact: bool, made: set[str], context: ts.Context | None = None,
) -> list[str]:
    """Write ``nodes`` (:func:`node_files`, less those :func:`write_regions` wrote) into the
    kvstore ``data``: on a local plain checkpoint as the own codec writes chunk files
    (``made``: the directories known to exist, as :func:`write_regions` takes them),
    elsewhere by kvstore writes (one transaction in a compact layout's database). Returns
    their keys."""
    if not nodes:
        return []
    where = write_place(data, compact)
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


def write_context() -> ts.Context:
    """A context for one save's writes (and one for its merge): the process's
    (:data:`tsckpt._storage.locations.CONTEXT`: its thread pools, its s3 retries), with a
    cache pool of its own that keeps nothing. TensorStore keeps one OCDBT driver per spec and
    cache pool, and a driver remembers the database it wrote: a compact save that failed
    after some of its windows were committed leaves a driver (still referenced by the failed
    transaction) that believes in the database its clean-up removed, so a save again in its
    place through the same pool failed with NOT_FOUND reading the removed files, however
    often it was retried. Each save's drivers are its own, so a retry starts from what is
    on disk."""
    return ts.Context({_locations.WRITE_CACHE_POOL: {"total_bytes_limit": 0}}, parent=_locations.CONTEXT)
