"""Reading sharded arrays of a local plain-layout checkpoint into CPU memory with
positional reads, each inner chunk verified by crc32c at memory speed.

Why not TensorStore here: its wheel (0.1.86) checks crc32c with a portable
table at about 1 GB/s and pays per-array open costs, which made it the
bottleneck of large restores. Here each shard file's index is read and checked
once, and runs of adjacent inner chunks are read with one ``os.preadv`` (no
extra copy, the GIL released) straight into the destination where a chunk's
region of it is contiguous (whole-row chunks, 1-D arrays), else into a reused
buffer from which numpy copies the needed block. crc32c verifies each
chunk (about 13 GB/s); the destination holds unverified bytes only until its
check, and a mismatch fails the restore.

A shard file that is mostly not in the page cache is read with direct I/O
(``O_DIRECT``: storage straight into an aligned buffer, then verified and copied
in): cold, that took a quarter less time and a fraction of the kernel CPU of
buffered reads. A shard file the page cache holds entirely is read through a
read-only mapping instead (``mmap``): each chunk is checked where it lies in the cache
and copied into the destination once, where a read would first copy it into a buffer
(the chunks of the default layout are column pieces, not contiguous in the destination).
Files partly cached are read through the cache as above. (A file truncated by another
process while mapped would fault the reader, as any mapped read; checkpoint files are
never rewritten once committed.)

Which arrays are read here is :func:`.route.route`'s rule (the same the writer
follows); the file format is in :mod:`.files`. :func:`read_stored` gives inner chunks as
stored instead, unplaced, for comparing two checkpoints chunk by chunk (diff).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import itertools
import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from stat import S_ISREG
from typing import Any, NamedTuple

import numpy as np

from .._base import dtypes as _dtypes
from .._base.types import Dest, span_slices
from .._errors import CorruptCheckpointError
from .._ondisk.arrays import CRC_BYTES, chunk_key
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import shard_boxes
from .._ondisk.records import ArrayRecord
from .._runtime.progress import Progress
from .._runtime.window import Window
from .._storage import native
from .._storage.beneath import open_beneath
from .._storage.faults import CHECKSUM_MISMATCH, CHUNK_MISSING, UNDECODABLE
from .._storage.native import ALIGN, IOV_MAX
from . import crc
from .files import ShardIndex, StoredShapes, node_agrees, opened_directory, storage_box, stored_shapes
from .pagecache import files_cached, resident_fraction, set_direct
from .threads import Workers, cpus, shared

# Threads reading shard files, and how many of them may copy or check bytes at once (a
# buffered read is a copy too). On 2 CPUs, 1 GiB in 64 shard files: warm, 1, 2 and 4 busy
# threads used the same CPU time and 8 were slower (0.41-0.53 s against 0.39-0.40 s);
# cold, 8 threads with 4 MiB direct reads waited less (0.77-0.96 s against 1.0-1.3 s with 4).
# On 16 CPUs, warm, 8 threads were as fast as 16 and faster than 2 or 4 (benchmarks/RESULTS.md,
# "Threads by CPUs"), so the count stays 8 rather than one per CPU.
READ_THREADS = 8
BUSY_THREADS = 4
# Threads reading files the page cache holds whole (:func:`.pagecache.files_cached`): one per
# CPU, as they never wait for storage. On 2 CPUs, 512 MiB in 32 arrays of 2048 x 2048 read
# through mappings, in place into untouched memory, 5 alternating runs: 2 threads 0.25-0.27 s
# (0.46-0.48 CPU-s) against 0.29-0.31 s (0.51-0.54 CPU-s) for 8: more threads than CPUs only
# contend for the process's page tables (each mapping and unmapping).
CACHED_THREADS = min(READ_THREADS, cpus())
RUN_BYTES = 4 << 20  # most bytes one preadv reads (measured: 16 MiB used ~10% more CPU than 1-4 MiB)
DIRECT_BELOW = 0.5  # a file whose wanted bytes are less cached than this is read with direct I/O
MAPPED_FROM = 1.0  # a file cached at least this much is read through a mapping (:func:`_read_mapped`)
_CRC = np.dtype("<u4")  # a stored crc32c (CRC_BYTES)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page of the span at once


@dataclasses.dataclass(frozen=True)
class _Job:
    """One shard file's part of one destination, in the coordinates of the stored array
    (complex32: with its trailing pair dimension)."""

    dest: Dest
    view: np.ndarray  # the destination memory in the stored dtype and shape
    rec: ArrayRecord
    shapes: StoredShapes
    key: str  # the shard file's key: its path in the checkpoint directory
    offsets: tuple[int, ...]  # the box of the stored array read from this file
    lengths: tuple[int, ...]
    base: tuple[int, ...]  # where the destination starts in the stored array

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * self.view.dtype.itemsize


class _Fallback(Exception):
    """A file could not be read for a reason other than damage: TensorStore reads it."""


def read_sharded(
    ck: Checkpoint,
    directory: str,
    dests: Sequence[Dest],
    view_of: Callable[[Dest], np.ndarray],
    progress: Progress | None,
    window: int,
    *,
    threads: int | None = None,
) -> list[Dest]:
    """Read each destination of ``dests``, a sharded array of the plain checkpoint in the
    local ``directory``, into its memory as a writable view in the stored dtype and shape
    (``view_of``); returns those left for TensorStore.

    Left for TensorStore: arrays whose zarr.json is missing or disagrees with the root
    record, so that TensorStore reports it as usual, and files that cannot be read for a
    reason other than damage. Damaged shard data raises CorruptCheckpointError.
    """
    with opened_directory(directory) as dir_fd:
        if dir_fd is None:
            return list(dests)
        rest: list[Dest] = []
        jobs: list[_Job] = []
        node_ok: dict[str, bool] = {}
        for dest in dests:
            item = dest.item
            rec = ck.arrays[item.path]
            if rec.path not in node_ok:
                node_ok[rec.path] = node_agrees(dir_fd, rec)
            if not node_ok[rec.path]:
                rest.append(dest)
                continue
            view = view_of(dest)
            shapes = stored_shapes(rec)
            base, _ = storage_box(rec, item.storage_offsets, item.lengths)
            for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.chunking):
                jobs.append(_Job(dest, view, rec, shapes, chunk_key(rec, off), *storage_box(rec, off, ln), base))
        if threads is None:
            threads = CACHED_THREADS if files_cached(dir_fd, [job.key for job in jobs]) else READ_THREADS
        fell_back = _run(ck, dir_fd, jobs, progress, window, max(1, threads))
    return rest + [dest for dest in dests if id(dest) in fell_back]


@dataclasses.dataclass(frozen=True)
class _Room:
    """What one reading thread works with."""

    scratch: np.ndarray  # aligned to ALIGN, cap + 2 * ALIGN bytes
    cap: int  # bytes of scratch one read may fill
    busy: threading.Semaphore  # held while copying or checking bytes (shared by the threads)


def _run(
    ck: Checkpoint, dir_fd: int, jobs: list[_Job], progress: Progress | None, window: int, threads: int
) -> set[int]:
    """Run the jobs on ``threads`` threads, opening files below ``dir_fd``; returns ids of
    destinations to leave to TensorStore."""
    fell_back: set[int] = set()
    local = threading.local()
    busy = threading.Semaphore(BUSY_THREADS)

    def work(job: _Job) -> bool:
        """Read one job; False when TensorStore is to read its destination instead."""
        chunk_bytes = math.prod(job.shapes.inner or ()) * job.view.dtype.itemsize + CRC_BYTES
        cap = max(chunk_bytes, min(RUN_BYTES, window // threads))  # scratch held per thread
        room: _Room | None = getattr(local, "room", None)
        if room is None or room.cap < cap:
            scratch = native.aligned_empty(cap + 2 * ALIGN)  # room for a direct read's aligned ends
            room = local.room = _Room(scratch, cap, busy)
        try:
            _read_shard(ck, dir_fd, job, dataclasses.replace(room, cap=cap))
        except _Fallback:
            return False
        return True

    def settle(job: _Job, ok: bool) -> None:
        if not ok:
            fell_back.add(id(job.dest))
        elif progress is not None:
            progress.update(job.nbytes, 1)

    if threads == 1 or len(jobs) <= 1:
        for job in jobs:
            settle(job, work(job))
        return fell_back
    pool = shared(threads, "tsckpt-read")
    futures: list[concurrent.futures.Future[bool]] = []

    def finish(started: tuple[_Job, concurrent.futures.Future[bool]]) -> None:
        settle(started[0], started[1].result())

    in_flight: Window[tuple[_Job, concurrent.futures.Future[bool]]] = Window(2 * threads, finish)  # jobs queued
    try:
        for job in jobs:
            futures.append(pool.submit(work, job))
            in_flight.add((job, futures[-1]))
        in_flight.drain()
    finally:
        Workers.settle(futures)
    return fell_back


def _read_shard(ck: Checkpoint, dir_fd: int, job: _Job, room: _Room) -> None:
    """Read the part ``job`` needs of one shard file into its destination, verifying every
    chunk. Opened with :func:`open_beneath`: a link on the way is left to TensorStore's
    path, whose walk for links reports it."""
    try:
        fd = open_beneath(dir_fd, job.key)
    except FileNotFoundError:
        raise ck.damaged(job.rec.path, CHUNK_MISSING, f"{job.key} does not exist") from None
    except OSError as e:
        raise _Fallback(str(e)) from e
    try:
        _read_open_shard(ck, job, fd, room)
    except OSError as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise _Fallback(str(e)) from e
    finally:
        os.close(fd)


class _Chunk(NamedTuple):
    start: int  # offset in the file
    cell: tuple[int, ...]  # position in the shard's grid of inner chunks
    first: tuple[int, ...]  # its first element in the array
    lo: tuple[int, ...]  # the part of the array wanted from it: [lo, hi)
    hi: tuple[int, ...]
    direct: np.ndarray | None  # its destination as flat bytes, when the whole chunk lands contiguously


def _read_open_shard(ck: Checkpoint, job: _Job, fd: int, room: _Room) -> None:
    key, shapes = job.key, job.shapes
    chunk = shapes.inner or ()
    data_bytes = math.prod(chunk) * job.view.dtype.itemsize
    stride = data_bytes + CRC_BYTES  # a stored inner chunk
    index, size, cached = _open_index(ck, job.rec.path, key, fd, shapes.grid)

    origin = tuple((o // s) * s for o, s in zip(job.offsets, shapes.shard))
    ends = tuple(o + n for o, n in zip(job.offsets, job.lengths))
    ranges = [range((o - g) // c, -(-(e - g) // c)) for o, e, g, c in zip(job.offsets, ends, origin, chunk)]
    plan: list[_Chunk] = []
    for cell in itertools.product(*ranges):
        start = _chunk_start(ck, job.rec.path, key, index, cell, stride, size)
        first = tuple(g + k * c for g, k, c in zip(origin, cell, chunk))
        lo = tuple(max(f, o) for f, o in zip(first, job.offsets))
        hi = tuple(min(f + c, e) for f, c, e in zip(first, chunk, ends))
        whole = all(b - a == c for a, b, c in zip(lo, hi, chunk))  # not when it overhangs the array's end
        direct = _contiguous(job.view[_dest_box(job, lo, hi)]) if whole else None
        plan.append(_Chunk(start, cell, first, lo, hi, direct))
    plan.sort(key=lambda c: c.start)
    if cached is not None and cached >= MAPPED_FROM and _read_mapped(ck, job, fd, plan, room, data_bytes):
        return
    direct_io = cached is not None and cached < DIRECT_BELOW and set_direct(fd)

    run: list[_Chunk] = []  # chunks adjacent in the file: one preadv
    scratch_used = 0
    for c in plan:
        need = stride if direct_io else 0 if c.direct is not None else data_bytes
        if run and (
            c.start != run[-1].start + stride
            or (len(run) + 1) * stride > max(room.cap, RUN_BYTES)
            or scratch_used + need > room.cap
            or 2 * len(run) + 2 > IOV_MAX  # two buffers per chunk
        ):
            direct_io = _read_run(ck, job, fd, run, room, data_bytes, direct_io)
            run, scratch_used = [], 0
        run.append(c)
        scratch_used += need
    if run:
        _read_run(ck, job, fd, run, room, data_bytes, direct_io)


def _open_index(ck: Checkpoint, path: str, key: str, fd: int, grid: tuple[int, ...]) -> tuple[ShardIndex, int, float | None]:
    """The index of the open shard file ``key`` of array ``path``, the file's size, and the
    fraction of its chunks' bytes the page cache holds (measured before reading the index
    brings its pages in; None where that cannot be told)."""
    stat = os.fstat(fd)
    if not S_ISREG(stat.st_mode):
        raise _Fallback(f"{key} is not a regular file")
    size = stat.st_size
    index_bytes = ShardIndex.nbytes(grid)
    if size < index_bytes:
        raise ck.damaged(path, UNDECODABLE, f"{key} is {size} bytes, shorter than its shard index of {index_bytes}")
    cached = resident_fraction(fd, 0, size - index_bytes)
    tail = os.pread(fd, index_bytes, size - index_bytes)
    if len(tail) != index_bytes:
        raise ck.damaged(path, UNDECODABLE, f"{key} shrank while being read")
    index = ShardIndex.parse(tail, grid)
    if index is None:
        raise ck.damaged(path, CHECKSUM_MISMATCH, f"{key}: the shard index fails its crc32c")
    return index, size, cached


def _chunk_start(ck: Checkpoint, path: str, key: str, index: ShardIndex, cell: tuple[int, ...], stride: int,
                 size: int) -> int:
    """Where inner chunk ``cell`` (``stride`` bytes with its crc32c) starts in the shard file
    ``key`` of ``size`` bytes, as its index says; damage when it is missing or lies outside."""
    entry = index.entry(cell)
    if entry is None:
        raise ck.damaged(path, CHUNK_MISSING, f"{key}: inner chunk {list(cell)} is missing from the shard index")
    start, nbytes = entry
    if nbytes != stride or start > size or nbytes > size - start:
        raise ck.damaged(
            path,
            UNDECODABLE,
            f"{key}: the shard index gives inner chunk {list(cell)} bytes [{start}, {start + nbytes}) "
            f"of a {size}-byte file; expected {stride} bytes inside the file",
        )
    return start


def _read_mapped(ck: Checkpoint, job: _Job, fd: int, plan: list[_Chunk], room: _Room, data_bytes: int) -> bool:
    """Verify and copy the chunks straight out of the page cache through read-only mappings of
    the file; False when the file cannot be mapped (the caller reads it instead).

    For a file the page cache holds entirely: a read into a buffer copies every byte once more
    (the kernel's copy out of the cache) before a chunk that is not contiguous in the
    destination is copied in; through a mapping each chunk is checked where it lies and
    copied once. Each mapping spans at most ``room.cap`` bytes of wanted chunks (mapped
    pages count in the process's resident memory while mapped, so the window still bounds
    what a restore adds) and is populated up front (no faults, and no I/O: every page is cached).
    """
    stride = data_bytes + CRC_BYTES
    limit = max(room.cap, stride + mmap.ALLOCATIONGRANULARITY)
    group: list[_Chunk] = []
    for c in plan:
        if group and c.start + stride - _mapped_from(group[0].start) > limit:
            if not _map_and_copy(ck, job, fd, group, room, data_bytes):
                return False
            group = []
        group.append(c)
    return _map_and_copy(ck, job, fd, group, room, data_bytes)


def _mapped_from(start: int) -> int:
    """Where a mapping that starts with the chunk at file offset ``start`` begins (mmap's offsets are aligned)."""
    return start - start % mmap.ALLOCATIONGRANULARITY


def _map_and_copy(ck: Checkpoint, job: _Job, fd: int, group: list[_Chunk], room: _Room, data_bytes: int) -> bool:
    """Map the span of ``group`` (chunks in file order), check and copy each in; False when it cannot be mapped."""
    first = _mapped_from(group[0].start)
    end = group[-1].start + data_bytes + CRC_BYTES
    try:
        mm = mmap.mmap(fd, end - first, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=first)
    except (OSError, ValueError):
        return False
    try:
        with room.busy:
            _copy_mapped(ck, job, np.frombuffer(mm, np.uint8), first, group, data_bytes)
    finally:
        with contextlib.suppress(BufferError):  # an error's traceback still views it: unmapped when freed
            mm.close()
    return True


def _copy_mapped(ck: Checkpoint, job: _Job, mapped: np.ndarray, first: int, plan: list[_Chunk], data_bytes: int) -> None:
    """Check each chunk of ``plan`` in the mapping (file offset ``first`` onwards), then copy it in."""
    stride = data_bytes + CRC_BYTES
    chunk = job.shapes.inner or ()
    for c in plan:
        at = c.start - first
        if not crc.intact(mapped[at : at + stride]):
            raise ck.damaged(job.rec.path, CHECKSUM_MISMATCH, f"{job.key}: inner chunk {list(c.cell)} fails its crc32c")
        data = mapped[at : at + data_bytes]
        if c.direct is not None:
            c.direct[:] = data
        else:
            block = data.view(job.view.dtype).reshape(chunk)
            job.view[_dest_box(job, c.lo, c.hi)] = block[span_slices(c.lo, c.hi, c.first)]


def _dest_box(job: _Job, lo: tuple[int, ...], hi: tuple[int, ...]) -> tuple[slice, ...]:
    """Where the stored array's box [lo, hi) goes in the destination."""
    return span_slices(lo, hi, job.base)


def _contiguous(region: np.ndarray) -> np.ndarray | None:
    """``region`` as flat writable bytes when it is one C-contiguous block, else None."""
    return region.reshape(-1).view(np.uint8) if region.flags.c_contiguous else None


def _read_run(
    ck: Checkpoint, job: _Job, fd: int, run: list[_Chunk], room: _Room, data_bytes: int, direct_io: bool
) -> bool:
    """Read chunks adjacent in the file with one read; verify each, then copy in what is not in place.

    Returns whether later runs of this file may use direct I/O (False once the
    file system refused it at read time).
    """
    datas: list[np.ndarray] | None = None
    if direct_io:  # waits on storage without holding room.busy
        try:
            datas, crcs = _preadv_direct(ck, job, fd, run, room.scratch, data_bytes)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            direct_io = not set_direct(fd, on=False)
    with room.busy:
        if datas is None:
            datas, crcs = _preadv_buffered(ck, job, fd, run, room.scratch, data_bytes)
        for data, c, stored in zip(datas, run, crcs):
            if crc.value(data) != stored:
                raise ck.damaged(job.rec.path, CHECKSUM_MISMATCH, f"{job.key}: inner chunk {list(c.cell)} fails its crc32c")
        chunk = job.shapes.inner or ()
        for data, c in zip(datas, run):
            if c.direct is None:
                block = data.view(job.view.dtype).reshape(chunk)
                src = span_slices(c.lo, c.hi, c.first)
                job.view[_dest_box(job, c.lo, c.hi)] = block[src]
            elif data is not c.direct:
                c.direct[:] = data
    return direct_io


def _preadv_buffered(
    ck: Checkpoint, job: _Job, fd: int, run: list[_Chunk], scratch: np.ndarray, data_bytes: int
) -> tuple[list[np.ndarray], list[int]]:
    """One preadv through the page cache: chunks whose place is contiguous land there, others in ``scratch``."""
    crcs = np.empty(len(run), _CRC)
    buffers: list[Any] = []  # numpy arrays: writable buffers (not typed as such before Python 3.12)
    datas: list[np.ndarray] = []
    used = 0
    for i, c in enumerate(run):
        data = c.direct
        if data is None:
            data = scratch[used : used + data_bytes]
            used += data_bytes
        datas.append(data)
        buffers += [data, crcs[i : i + 1]]
    total = len(run) * (data_bytes + CRC_BYTES)
    got = os.preadv(fd, buffers, run[0].start)
    if got != total:
        raise ck.damaged(job.rec.path, UNDECODABLE, f"{job.key} ended {total - got} bytes early while being read")
    return datas, crcs.tolist()


def _preadv_direct(
    ck: Checkpoint, job: _Job, fd: int, run: list[_Chunk], scratch: np.ndarray, data_bytes: int
) -> tuple[list[np.ndarray], list[int]]:
    """One direct read of the run's bytes, widened to ``ALIGN``, into the aligned ``scratch``."""
    stride = data_bytes + CRC_BYTES
    start = run[0].start
    end = start + len(run) * stride
    first = start - start % ALIGN
    buf = scratch[: native.aligned_size(end - first)]
    buffers: list[Any] = [buf]  # a numpy array: a writable buffer (not typed as such before Python 3.12)
    got = os.preadv(fd, buffers, first)
    if got < end - first:
        raise ck.damaged(job.rec.path, UNDECODABLE, f"{job.key} ended {end - first - got} bytes early while being read")
    at = [start - first + i * stride for i in range(len(run))]
    crcs = [int.from_bytes(buf[a + data_bytes : a + stride].tobytes(), "little") for a in at]
    return [buf[a : a + data_bytes] for a in at], crcs


# ---- inner chunks as stored, for comparisons ---------------------------------------------


class StoredChunk(NamedTuple):
    """One inner chunk of a shard file as stored, read by :func:`read_stored` (its crc32c not
    yet checked: :func:`check_stored`)."""

    key: str  # the shard file's key
    cell: tuple[int, ...]  # its position in the shard's grid of inner chunks
    stored: np.ndarray  # its bytes, then their crc32c (uint8): a view of the reader's buffer

    @property
    def data(self) -> np.ndarray:
        return self.stored[:-CRC_BYTES]


def read_stored(
    ck: Checkpoint,
    dir_fd: int,
    rec: ArrayRecord,
    shard: tuple[int, ...],
    cells: Sequence[tuple[int, ...]],
    buffer: Callable[[int], np.ndarray],
) -> list[StoredChunk] | None:
    """The inner chunks ``cells`` of one shard file of ``rec`` (a sharded array of the plain
    checkpoint whose directory is open as ``dir_fd``; the file of the shard that starts at
    element ``shard``) as stored, in the order of ``cells``, unchecked: for comparing two
    checkpoints chunk by chunk without decoding or placing any. As :func:`read_sharded`
    reads: a file the page cache holds whole is mapped (the chunks are views of the mapping,
    unmapped once none is left), else runs of chunks adjacent in the file are read with one
    positional read each, with direct I/O where the page cache holds less than
    :data:`DIRECT_BELOW` of the file, into the memory ``buffer(n)`` gives (``n`` bytes or
    more, starting at a multiple of ALIGN).

    None when the file cannot be read here for a reason other than damage (a link on the
    way, not a regular file): the read engine reads it. Damage raises CorruptCheckpointError.
    """
    key = chunk_key(rec, shard)
    shapes = stored_shapes(rec)
    stride = math.prod(shapes.inner or shapes.shard) * _dtypes.numpy_dtype(rec.dtype).itemsize + CRC_BYTES
    try:
        fd = open_beneath(dir_fd, key)
    except FileNotFoundError:
        raise ck.damaged(rec.path, CHUNK_MISSING, f"{key} does not exist") from None
    except OSError:
        return None
    try:
        index, size, cached = _open_index(ck, rec.path, key, fd, shapes.grid)
        starts = [_chunk_start(ck, rec.path, key, index, (*cell, *(0 for _ in shapes.shape[len(cell):])), stride, size)
                  for cell in cells]
        if cached is not None and cached >= MAPPED_FROM:
            mapped = _map_stored(key, fd, list(cells), starts, stride)
            if mapped is not None:
                return mapped
        direct = cached is not None and cached < DIRECT_BELOW and set_direct(fd)
        return _read_stored_runs(ck, rec.path, key, fd, list(cells), starts, stride, buffer, direct)
    except _Fallback:
        return None
    except OSError as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        return None
    finally:
        os.close(fd)


def _map_stored(
    key: str, fd: int, cells: list[tuple[int, ...]], starts: list[int], stride: int
) -> list[StoredChunk] | None:
    """The chunks starting at ``starts`` of the open file ``key`` as views of one read-only
    mapping of their span, populated up front (every page is cached); None when it cannot be
    mapped. The mapping is unmapped when the last view of it is freed."""
    first = _mapped_from(min(starts))
    try:
        mm = mmap.mmap(fd, max(starts) + stride - first, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ,
                       offset=first)
    except (OSError, ValueError):
        return None
    view = np.frombuffer(mm, np.uint8)
    return [StoredChunk(key, cell, view[start - first : start - first + stride]) for cell, start in zip(cells, starts)]


def _read_stored_runs(
    ck: Checkpoint, path: str, key: str, fd: int, cells: list[tuple[int, ...]], starts: list[int], stride: int,
    buffer: Callable[[int], np.ndarray], direct: bool,
) -> list[StoredChunk]:
    """Read the chunks starting at ``starts`` (``stride`` bytes each) of the open file ``key``,
    each run of adjacent ones with one read at a multiple of ALIGN in the buffer (widened to
    ALIGN at both ends in the file for direct I/O)."""
    order = sorted(range(len(starts)), key=starts.__getitem__)
    runs: list[list[int]] = []
    for i in order:
        if runs and starts[i] == starts[runs[-1][-1]] + stride:
            runs[-1].append(i)
        else:
            runs.append([i])
    spans = [(starts[run[0]], starts[run[-1]] + stride) for run in runs]
    buf = buffer(sum(native.aligned_size(end - start) + ALIGN for start, end in spans))
    found: list[StoredChunk | None] = [None] * len(starts)
    at = 0
    for run, (start, end) in zip(runs, spans):
        first = start - start % ALIGN if direct else start  # where in the file the read starts
        room = native.aligned_size(end - first)  # at most the run's slot: aligned_size(end - start) + ALIGN
        got = -1
        if direct:
            try:
                got = os.preadv(fd, _buffers(buf[at : at + room]), first)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct = not set_direct(fd, on=False)
                first = start
        if got < 0:
            got = os.preadv(fd, _buffers(buf[at : at + end - first]), first)
        if got < end - first:
            raise ck.damaged(path, UNDECODABLE, f"{key} ended {end - first - got} bytes early while being read")
        for i in run:
            lo = at + starts[i] - first
            found[i] = StoredChunk(key, cells[i], buf[lo : lo + stride])
        at += native.aligned_size(end - start) + ALIGN
    return [c for c in found if c is not None]


def _buffers(*arrays: np.ndarray) -> list[Any]:
    """Numpy arrays as preadv's buffers (writable buffers, not typed as such before Python 3.12)."""
    return list(arrays)


def check_stored(ck: Checkpoint, path: str, chunk: StoredChunk) -> None:
    """Raise CorruptCheckpointError when ``chunk`` of the array ``path`` fails its crc32c."""
    if not crc.intact(chunk.stored):
        raise ck.damaged(path, CHECKSUM_MISMATCH, f"{chunk.key}: inner chunk {list(chunk.cell)} fails its crc32c")
