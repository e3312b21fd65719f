"""Writing the shard files of a local plain-layout checkpoint, byte for byte as
TensorStore writes them.

Why not TensorStore: its 0.1.86 wheel computes crc32c with a portable table
(about 1 GB/s) and gathers every inner chunk out of the source into a new
buffer before writing it. Here every inner chunk is checksummed by
the crc32c package's hardware crc32c. Where the file system allows direct I/O the
file is packed into an aligned buffer (column pieces of a row-major array and
padded edge chunks are gathered straight into it) whose whole blocks go to
storage with ``O_DIRECT``; elsewhere chunks contiguous in the source are handed
to ``pwritev`` from the source memory and only the others are gathered, into a
small reused buffer. Which arrays are written here is :func:`.route.route`'s
rule; tests/test_encode.py checks every file against TensorStore's own.

The file's format is in :mod:`.files`: inner chunks wholly outside the array
are not stored, those partly outside are padded with the fill value, which is
zero bytes in every dtype tsckpt stores (as TensorStore pads: float8_e8m0fnu,
which has no zero, too).
"""

from __future__ import annotations

import errno
import math
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._base.types import box_slices
from .._ondisk.arrays import CRC_BYTES
from .._storage import native
from .._storage.native import ALIGN, IOV_MAX
from . import contenthash, crc
from .encode import chunk_parts
from .files import ShardIndex, stored_starts
from .pagecache import set_direct

# Bytes of gathered (non-contiguous or padded) chunks staged before a pwritev; small, so
# the kernel copies them out of the CPU cache (measured faster than 8 MiB).
STAGE_BYTES = 2 << 20
# Write shard files with direct I/O where the file system allows it, in writes of this size.
DIRECT = True
DIRECT_BYTES = 4 << 20
_OPEN_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
_local = threading.local()


def _buffer(name: str, nbytes: int, floor: int) -> np.ndarray:
    """This thread's reusable buffer ``name`` of at least ``nbytes``, aligned to ``ALIGN``."""
    buf: np.ndarray | None = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = native.aligned_empty(max(nbytes, floor))
        setattr(_local, name, buf)
    return buf


def _pwritev(fd: int, path: str, bufs: list[Any], at: int) -> int:
    try:
        return os.pwritev(fd, bufs, at)
    except OSError as e:  # name the file, as os.open's errors do (StorageError reports it)
        raise OSError(e.errno, e.strerror, path) from e


class _File:
    """A file written front to back from the source memory by batched ``pwritev`` calls,
    through the page cache. Gathered chunks are staged in a small reused buffer."""

    def __init__(self, path: str, chunk_bytes: int) -> None:
        self.path = path
        self.fd = os.open(path, _OPEN_FLAGS, 0o644)
        self.pos = 0  # bytes written
        self.end = 0  # bytes written or queued
        self.bufs: list[Any] = []
        self.sizes: list[int] = []
        self.stage = _buffer("stage", chunk_bytes, STAGE_BYTES)
        self.used = 0  # bytes of the stage queued

    def space(self, nbytes: int) -> np.ndarray:
        """Memory for the next ``nbytes`` of the file, to be filled before the next call."""
        if self.used + nbytes > self.stage.nbytes or len(self.bufs) >= IOV_MAX:
            self.flush()  # before reserving: a flush frees the whole stage
        view = self.stage[self.used : self.used + nbytes]
        self.used += nbytes
        self.add(view, nbytes)
        return view

    def add(self, buf: Any, nbytes: int) -> None:
        """Queue ``buf`` (kept unchanged until written) as the next ``nbytes`` of the file."""
        if len(self.bufs) >= IOV_MAX:
            self.flush()
        self.bufs.append(buf)
        self.sizes.append(nbytes)
        self.end += nbytes

    def flush(self) -> None:
        """Write the queued buffers; after this their memory may be reused."""
        bufs, sizes = self.bufs, self.sizes
        while bufs:
            done = _pwritev(self.fd, self.path, bufs, self.pos)
            self.pos += done
            while bufs and done >= sizes[0]:  # a short write resumes in the first unwritten buffer
                done -= sizes.pop(0)
                bufs.pop(0)
            if done:
                bufs[0] = memoryview(bufs[0]).cast("B")[done:]
                sizes[0] -= done
        self.bufs, self.sizes, self.used = [], [], 0

    def close(self, *, writeback: bool, stat: bool = False) -> os.stat_result | None:
        """Write what is queued and close; ``writeback`` starts writing the file to disk.
        ``stat``: returns the file's status once written (its size and time are final)."""
        try:
            self.flush()
            st = os.fstat(self.fd) if stat else None
            # Linux's sync_file_range(SYNC_FILE_RANGE_WRITE) starts writing the file's dirty
            # pages to disk without waiting (no journal commit, unlike fsync), so the disk
            # works while later files are encoded and the final fsync finds little left.
            if writeback and native.has_sync_file_range():
                try:
                    native.sync_file_range(self.fd, 0, 0, native.SYNC_FILE_RANGE_WRITE)
                except OSError:
                    pass  # a hint: the final fsync reports errors
            return st
        finally:
            os.close(self.fd)


class _DirectFile:
    """A file written front to back with direct I/O: bytes are packed into an aligned
    buffer whose whole blocks go straight to storage; the last partial block is
    written through the page cache at close (direct I/O writes whole blocks only).

    Why: through the page cache the kernel copies every byte and then writes it
    back, which cost most of a save's CPU here; packing costs one memcpy.
    """

    def __init__(self, fd: int, path: str, chunk_bytes: int) -> None:
        self.fd, self.path = fd, path
        self.buf = _buffer("direct", chunk_bytes + 2 * ALIGN, DIRECT_BYTES)
        self.fill = 0  # bytes of buf not yet written
        self.pos = 0  # bytes written
        self.direct = True
        self.end = 0  # bytes written or packed

    def space(self, nbytes: int) -> np.ndarray:
        """Memory for the next ``nbytes`` of the file, to be filled before the next call."""
        if self.fill + nbytes > self.buf.nbytes:
            self._drain()
            if self.fill + nbytes > self.buf.nbytes:  # bigger than the buffer: only add() takes it
                raise ValueError(f"{nbytes} bytes do not fit a {self.buf.nbytes}-byte buffer")
        view = self.buf[self.fill : self.fill + nbytes]
        self.fill += nbytes
        self.end += nbytes
        return view

    def add(self, buf: Any, nbytes: int) -> None:
        """Copy ``buf`` in as the next ``nbytes`` of the file."""
        src = np.frombuffer(buf, np.uint8, count=nbytes)
        while src.nbytes:
            if self.fill == self.buf.nbytes:
                self._drain()
            n = min(src.nbytes, self.buf.nbytes - self.fill)
            self.space(n)[...] = src[:n]
            src = src[n:]

    def _drain(self) -> None:
        """Write the buffer's whole blocks and move the partial one to its start."""
        whole = self.fill - self.fill % ALIGN
        self._write(self.buf[:whole])
        rest = self.fill - whole
        self.buf[:rest] = self.buf[whole : self.fill]
        self.fill = rest

    def _write(self, data: np.ndarray) -> None:
        while data.nbytes:
            try:
                done = _pwritev(self.fd, self.path, [data], self.pos)
            except OSError as e:  # the file system took O_DIRECT at open but refuses its writes
                if e.errno != errno.EINVAL or not self.direct or not set_direct(self.fd, on=False):
                    raise
                self.direct = False
                continue
            self.pos += done
            data = data[done:]

    def close(self, *, writeback: bool) -> None:
        """Write what is left and close (nothing to start writing back: direct writes are done)."""
        try:
            self._drain()
            if self.fill:
                self.direct = not set_direct(self.fd, on=False)
                self._write(self.buf[: self.fill])
        finally:
            os.close(self.fd)


def _open(path: str, chunk_bytes: int) -> _File | _DirectFile:
    """The file at ``path``, created empty, written with direct I/O where the file system has it."""
    if DIRECT and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            return _DirectFile(fd, path, chunk_bytes)
    return _File(path, chunk_bytes)


def write_chunk(path: str, src: np.ndarray, chunk: tuple[int, ...], *, stat: bool = False) -> os.stat_result | None:
    """The unsharded chunk file whose in-bounds part is ``src`` (:func:`.encode.chunk_parts`),
    written from the source memory: one open, one ``pwritev``, one close, where
    TensorStore's file kvstore takes about 13 system calls (a lock file, a temporary
    file, a rename); its parent directory exists (:func:`make_parents`). ``stat``: returns
    the file's status as written (an ``fstat``, cheaper than a later look-up by path)."""
    data, checksum = chunk_parts(src, chunk)
    f = _File(path, 0)
    try:
        f.add(data, data.nbytes)
        f.add(checksum, len(checksum))
    except BaseException:
        f.close(writeback=False)
        raise
    return f.close(writeback=False, stat=stat)


def write_bytes(path: str, data: bytes) -> None:
    """A small file (a node's zarr.json) written as :func:`write_chunk` writes a chunk file."""
    f = _File(path, 0)
    try:
        f.add(data, len(data))
    finally:
        f.close(writeback=False)


def make_parents(root: str, keys: Iterable[str], made: set[str]) -> None:
    """Create the directories below ``root`` that hold the files at ``keys`` ('/'-separated,
    relative to ``root``), each once, parents first. ``made`` holds the directories
    known to exist (relative to ``root``); those created are added to it.

    One pass over the distinct directories of a rank's files: creating them as each
    file is written (``os.makedirs`` per file, or TensorStore's ``mkdir`` of every
    level on every write) asked for each directory once per file below it. A
    directory another rank made meanwhile is fine; a file where a directory belongs
    raises (FileExistsError)."""
    dirs: set[str] = set()
    for key in keys:
        d = key.rpartition("/")[0]
        while d and d not in dirs and d not in made:
            dirs.add(d)
            d = d.rpartition("/")[0]
    for d in sorted(dirs):  # a parent sorts before its children
        path = os.path.join(root, d)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
        except FileNotFoundError:  # ``root`` itself is missing: make it too
            os.makedirs(path, exist_ok=True)
        made.add(d)


class _Memory:
    """A shard file built in memory (:func:`shard_bytes`), as :class:`_File` takes it: the
    chunks contiguous in the source are referenced, the others gathered."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.end = 0

    def space(self, nbytes: int) -> np.ndarray:
        view = np.empty(nbytes, np.uint8)
        self.add(view, nbytes)
        return view

    def add(self, buf: Any, nbytes: int) -> None:
        self.parts.append(buf)
        self.end += nbytes


def write_shard(
    path: str, src: np.ndarray, shard: Sequence[int], inner: Sequence[int], *, writeback: bool = False,
    hashes: bool = False,
) -> list[str] | None:
    """The shard file whose in-bounds part is ``src`` (the shard clipped to the array's
    end), with inner chunks of shape ``inner``; ``shard`` is a multiple of ``inner``.
    ``hashes``: returns the content hash of each inner chunk's data (:func:`.contenthash.chunk_digests`),
    hashed as the chunk is written."""
    f = _open(path, math.prod(inner) * src.dtype.itemsize)
    digests: list[str] | None = [] if hashes else None
    try:
        _encode_shard(f, src, shard, inner, digests)
    finally:
        f.close(writeback=writeback)
    return digests


def shard_bytes(
    src: np.ndarray, shard: Sequence[int], inner: Sequence[int], digests: list[str] | None = None
) -> bytes:
    """The bytes of the shard file :func:`write_shard` writes, for one object-store write
    (whose response carries the object's ETag); the inner chunks' hashes appended to
    ``digests`` where given."""
    f = _Memory()
    _encode_shard(f, src, shard, inner, digests)
    return b"".join(f.parts)


def _encode_shard(
    f: _File | _DirectFile | _Memory, src: np.ndarray, shard: Sequence[int], inner: Sequence[int],
    digests: list[str] | None = None,
) -> None:
    """The inner chunks of ``src``, then the shard's index, appended to ``f``; each inner
    chunk's content hash appended to ``digests`` where given, from the memory it is written
    from (the part of a chunk at the array's end inside the array: copied to be hashed)."""
    inner = tuple(inner)
    grid = tuple(s // i for s, i in zip(shard, inner))
    chunk_bytes = math.prod(inner) * src.dtype.itemsize
    index = ShardIndex.missing(grid)
    for lo in stored_starts(src.shape, inner):
        cell = tuple(a // i for a, i in zip(lo, inner))
        box = src[box_slices(lo, inner)]
        index.put(cell, f.end, chunk_bytes + CRC_BYTES)
        if box.shape == inner and box.flags.c_contiguous:
            flat = box.reshape(-1).view(np.uint8)
            f.add(flat, chunk_bytes)
            whole = box
        else:
            flat = f.space(chunk_bytes)
            chunk = flat.view(src.dtype).reshape(inner)
            if box.shape != inner:  # partly outside: the rest is the fill value, zero bytes
                flat[...] = 0
                chunk[tuple(slice(0, k) for k in box.shape)] = box
                whole = box
            else:
                np.copyto(chunk, box)
                whole = chunk
        if digests is not None:
            digests.append(contenthash.digest(whole))
        f.add(crc.encoded(flat), CRC_BYTES)
    for part in index.stored():
        f.add(part, len(part))
