"""Restore's reads of unsharded chunk files (:mod:`.encode`) into CPU memory.

Each array's zarr.json is read once and checked against its root record, as TensorStore
would check it, and each chunk file is one kvstore read, checked by its crc32c and
copied into the destination: opening a TensorStore array per leaf dominated restores of
thousands of small leaves. Works in any kvstore (local, object stores, memory, the
compact layout's database). In the local directory of a plain checkpoint, a whole array
stored as one chunk file is read with one positional read straight into its memory
instead (:func:`read_local_chunks`). Which arrays are read here is :func:`.route.route`'s rule.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._base.types import Dest, box_slices
from .._ondisk.arrays import (
    CACHED,
    CRC_BYTES,
    chunk_key,
    chunk_size_problem,
    stored_node_problem,
)
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import shard_boxes
from .._ondisk.records import ArrayRecord
from .._runtime.memory import prefaulted
from .._runtime.progress import Progress
from .._runtime.window import Window
from .._storage.beneath import open_beneath
from .._storage.faults import UNDECODABLE
from . import crc
from .encode import decode_chunk
from .files import node_agrees, opened_directory, stored_shapes
from .pagecache import PROBES, files_cached
from .threads import Workers, cpus


class _Read(NamedTuple):  # a NamedTuple: made 10,000 times in a restore of 10,000 small leaves
    """One chunk file's part of one destination, its read started."""

    dest: Dest
    view: np.ndarray  # the destination memory in the stored dtype and shape
    chunk: tuple[int, ...]  # the stored chunk shape
    key: str  # the chunk file
    read: Any  # its kvstore read
    src: tuple[slice, ...]  # the part wanted, in the chunk (complex32's pair dim: all of it)
    dst: tuple[slice, ...]  # where it goes, in the destination
    nbytes: int


def read_chunks(
    ck: Checkpoint,
    dests: Sequence[Dest],
    view_of: Callable[[Dest], np.ndarray],
    progress: Progress | None,
    window: int,
    *,
    directory: str | None = None,
) -> list[Dest]:
    """Read each destination of ``dests``, an array without inner chunks, into its memory
    as a writable view in the stored dtype and shape (``view_of``); returns those left for
    TensorStore: any whose zarr.json or chunk is not exactly as expected, so that
    TensorStore reports the damage as usual, but for a chunk file of another size than its
    record gives it, which raises CorruptCheckpointError (TensorStore reads a file with bytes
    after its crc32c, which zarr readers refuse). ``window`` bounds the bytes of reads in flight.
    ``directory``: the local directory of a plain checkpoint, whose whole one-chunk arrays
    are read with positional reads (:func:`read_local_chunks`); the rest through the kvstore."""
    if directory is not None:
        dests = read_local_chunks(ck, directory, dests, view_of, progress)
        if not dests:
            return []
    kv = ck.kvstore()
    nodes: dict[str, Any] = {}  # path: the read of its zarr.json (None once checked, so its memory goes)
    node_ok: dict[str, bool] = {}
    left: dict[int, Dest] = {}

    def settle(r: _Read) -> None:
        path = r.dest.item.path
        if id(r.dest) in left:
            return
        try:
            if path not in node_ok:
                node = nodes[path].result()
                nodes[path] = None
                node_ok[path] = node.state == "value" and stored_node_problem(node.value, ck.arrays[path]) is None
            chunk = r.read.result()
        except ValueError:  # unreadable: TensorStore says why
            node_ok.setdefault(path, False)
            chunk = None
        data = None
        if node_ok[path] and chunk is not None and chunk.state == "value":
            problem = chunk_size_problem(ck.arrays[path], r.key, len(chunk.value))
            if problem is not None:
                raise ck.damaged(path, UNDECODABLE, problem)
            data = decode_chunk(chunk.value, r.view.dtype, r.chunk)
        if data is None:
            left[id(r.dest)] = r.dest
            return
        r.view[r.dst] = data[r.src]
        if progress is not None:
            progress.update(r.nbytes, 1)

    in_flight: Window[_Read] = Window(window, settle)
    for dest in dests:
        item = dest.item
        rec = ck.arrays[item.path]
        view = view_of(dest)
        if rec.path not in nodes:
            nodes[rec.path] = ck.read_node(rec.path)
        chunk = stored_shapes(rec).shard
        element = view.dtype.itemsize * math.prod(view.shape[len(item.lengths) :])  # complex32: a float16 pair
        for off, ln, src, dst in _pieces(rec, item.storage_offsets, item.lengths):
            nbytes = math.prod(ln) * element
            key = chunk_key(rec, off)
            ck.hold([key], leaf=rec.path)
            read = kv.read(key, staleness_bound=CACHED)
            in_flight.add(_Read(dest, view, chunk, key, read, src, dst, nbytes), nbytes)
    in_flight.drain()
    return list(left.values())


def read_local_chunks(
    ck: Checkpoint,
    directory: str,
    dests: Sequence[Dest],
    view_of: Callable[[Dest], np.ndarray],
    progress: Progress | None,
) -> list[Dest]:
    """Read each destination of ``dests`` that is a whole array stored as one chunk file of
    the plain checkpoint in the local ``directory`` (most small leaves) with one positional
    read straight into its memory, then check the crc32c there; returns the destinations
    left for :func:`read_chunks` (other boxes, and any file not exactly as expected, so that
    the usual path reports the damage).

    Why not a kvstore read: for thousands of small leaves the per-read machinery (a future,
    a buffer handed to Python, a copy out of it) cost more than the read itself; here a leaf
    is an open, one ``preadv`` (data into the destination, crc32c after it) and a close.
    The array's zarr.json is still checked against its root record (:func:`node_agrees`).
    The leaves are split among :data:`LOCAL_THREADS` threads (the opens and reads release the GIL)
    when some of their files may be on the disk only (:func:`_cached`); one thread reads files
    the page cache holds, as a second only contends with it, while a spare CPU faults in the
    destinations' fresh memory ahead of the reads (:func:`.._memory.prefaulted`).
    """
    threads = LOCAL_THREADS if len(dests) >= _SPLIT_FROM and not _cached(directory, ck, dests) else 1
    parts = [list(dests[i::threads]) for i in range(threads)]
    pool = Workers(len(parts) - 1, "tsckpt-read") if len(parts) > 1 else None
    spare = threads == 1 and len(dests) >= _SPLIT_FROM and cpus() > 1  # a CPU the one reading thread leaves idle
    try:
        with prefaulted([_memory_of(d) for d in dests] if spare else []):
            started = [pool.submit(_read_locals, ck, directory, part, view_of) for part in parts[1:]] if pool else []
            done = [_read_locals(ck, directory, parts[0], view_of), *(f.result() for f in started)]
    finally:
        if pool is not None:
            pool.shutdown()
    if progress is not None:  # one update per file read, as the other readers report
        for _, sizes in done:
            for nbytes in sizes:
                progress.update(nbytes, 1)
    return [dest for left, _ in done for dest in left]


# Threads reading one-chunk arrays whose files are not all in the page cache, and the fewest
# leaves worth a second thread. 10,000 leaves of 1-64 KiB on 2 CPUs: cold, 2 threads took
# 2.1-2.3 s against 2.7-2.9 s for one (the second reads while the first waits for the disk);
# warm, one took 0.88-0.91 s and 0.87-0.90 CPU-s against 1.07-1.09 s and 1.30-1.37 CPU-s for
# two (nothing to wait for: the threads only contend for the interpreter and the page tables).
LOCAL_THREADS = 2
_SPLIT_FROM = 64


def _memory_of(dest: Dest) -> tuple[int, int]:
    """(address, nbytes) of a destination's host memory when contiguous, else (0, 0) (none)."""
    t = dest.tensor
    if isinstance(t, np.ndarray):
        return (t.__array_interface__["data"][0], t.nbytes) if t.flags.c_contiguous else (0, 0)
    if t.device.type != "cpu" or not t.is_contiguous():
        return (0, 0)
    return t.data_ptr(), t.numel() * t.element_size()


def _cached(directory: str, ck: Checkpoint, dests: Sequence[Dest]) -> bool:
    """Whether the page cache holds the chunk files of ``dests`` (:func:`.pagecache.files_cached`)."""
    picked = [ck.arrays[dests[i * len(dests) // PROBES].item.path] for i in range(PROBES)]
    with opened_directory(directory) as dir_fd:
        return dir_fd is not None and files_cached(dir_fd, [chunk_key(rec, (0,) * len(rec.shape)) for rec in picked])


def _read_locals(
    ck: Checkpoint, directory: str, dests: list[Dest], view_of: Callable[[Dest], np.ndarray]
) -> tuple[list[Dest], list[int]]:
    """:func:`read_local_chunks` of ``dests`` in one thread: those left, and the bytes of each file read."""
    sizes: list[int] = []
    tail = bytearray(CRC_BYTES + 1)  # the crc32c, and one byte more: a longer file is not as written
    with opened_directory(directory) as dir_fd:
        if dir_fd is None:
            return list(dests), sizes
        left: list[Dest] = []
        for dest in dests:
            rec = ck.arrays[dest.item.path]
            flat = _whole_chunk(rec, dest, view_of(dest))
            if flat is None or not node_agrees(dir_fd, rec) or not _read_whole(dir_fd, rec, flat, tail):
                left.append(dest)
            else:
                sizes.append(flat.nbytes)
    return left, sizes


def _whole_chunk(rec: ArrayRecord, dest: Dest, view: np.ndarray) -> np.ndarray | None:
    """The destination as flat bytes when it is the whole array, the array is one chunk file
    with no padding, and the memory is contiguous; else None."""
    item = dest.item
    if tuple(rec.chunking.shard_shape) != tuple(rec.shape) or tuple(item.lengths) != tuple(rec.shape):
        return None
    if any(item.storage_offsets) or not view.flags.c_contiguous or view.size == 0:
        return None
    return view.reshape(-1).view(np.uint8)


def _read_whole(dir_fd: int, rec: ArrayRecord, flat: np.ndarray, tail: bytearray) -> bool:
    """Read the array's one chunk file into ``flat`` and check its crc32c; False when the file
    is missing, of another length, behind a link, or fails its check (``flat`` then holds
    unverified bytes, which the caller's fallback overwrites)."""
    try:
        fd = open_beneath(dir_fd, chunk_key(rec, (0,) * len(rec.shape)))
    except OSError:
        return False
    buffers: list[Any] = [flat, tail]  # a numpy array: a writable buffer (not typed as such before Python 3.12)
    try:
        got = os.preadv(fd, buffers, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return got == flat.nbytes + CRC_BYTES and crc.value(flat) == int.from_bytes(tail[:CRC_BYTES], "little")


def _pieces(
    rec: ArrayRecord, offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...], tuple[slice, ...]]]:
    """Per chunk file the box [offsets, offsets + lengths) touches: the file's part of the
    box (its offsets and lengths), where that part lies in the chunk and in the box."""
    shard = rec.chunking.shard_shape
    if 0 in lengths:
        return
    if all(g >= n for g, n in zip(shard, rec.shape)):  # the whole array is one chunk: most small leaves
        yield offsets, lengths, box_slices(offsets, lengths), ()
        return
    for off, ln in shard_boxes(offsets, lengths, rec.chunking):
        src = tuple(slice(o % g, o % g + n) for o, g, n in zip(off, shard, ln))
        dst = box_slices(off, ln, offsets)
        yield off, ln, src, dst
