"""Zero-copy reads of unsharded chunk files: a region that is exactly one stored chunk,
given as a view of a private mapping of its file (:mod:`tsckpt._storage.filemap`).

A chunk file of tsckpt's format is the chunk's raw bytes (C order, little endian, no
compression) followed by their crc32c (:mod:`.encode`), so its data starts at the start
of the file, which a mapping places on a page boundary: every dtype is aligned there.
Each file is checked as the copying reader checks it before its array is handed out: the
array's zarr.json against its root record, the file's size, and the crc32c of every byte
(read through the mapping, which brings the pages into the page cache once; the files'
checks run on the reading threads, one per CPU, as the crc32c releases the interpreter).
Anything not exactly as expected is left to the copying path, which reports the damage
as usual. Which arrays the own codec reads at all is :func:`.route.route`'s rule.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from stat import S_ISREG

import numpy as np

from .._base import dtypes as _dtypes
from .._base.types import ReadItem
from .._ondisk.arrays import CRC_BYTES, chunk_file_bytes, chunk_key
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.records import ArrayRecord
from .._storage.beneath import open_beneath
from .._storage.filemap import map_private
from . import crc
from .files import node_agrees, opened_directory, stored_shapes
from .route import Place, Route, route
from .threads import Workers, cpus, shared

# Threads checking mapped files: one per CPU (the pages are cached; they never wait for storage).
CHECK_THREADS = min(8, cpus())
SPLIT_BYTES = 16 << 20  # fewer bytes are checked by the calling thread alone (a thread's hand-off costs more)

# Why a region is copied rather than mapped (a phrase after the leaf's name in the log).
NOT_LOCAL = "the checkpoint is not a plain one on a local file system (object storage, the compact layout)"
INNER = "it is stored in shard files of inner chunks, none of which is the whole region"
NOT_ONE_CHUNK = "the region is not one whole stored chunk (a resharded region, or a chunk padded at the array's edge)"
NOT_AS_WRITTEN = "its files are not exactly as written (the copying read reports what is wrong)"


def whole_chunk(rec: ArrayRecord, item: ReadItem) -> bool:
    """Whether the region ``item`` is exactly one chunk file's chunk (no padding in it)."""
    grid = rec.chunking.shard_shape
    return tuple(item.lengths) == tuple(grid) and all(o % g == 0 and o + g <= n for o, g, n in zip(item.storage_offsets, grid, rec.shape))


def map_chunks(ck: Checkpoint, where: Place, items: Sequence[ReadItem]) -> list[np.ndarray | str]:
    """Per region of ``items``: its stored array (storage dtype and shape, complex32 as float16
    pairs) viewing a writable private mapping of its chunk file, its crc32c checked; or why it
    is to be copied instead (a phrase). ``where``: the own codec's place for this checkpoint."""
    out: list[np.ndarray | str] = []
    if where.directory is None:
        return [where.why or NOT_LOCAL for _ in items]
    with opened_directory(where.directory) as dir_fd:
        agrees: dict[str, bool] = {}
        first: dict[str, int] = {}  # chunk file -> the item that maps it (a region asked for twice: one mapping)
        for item in items:
            rec = ck.arrays[item.path]
            why = _unmappable(rec, item, where)
            if why is None and dir_fd is not None:
                key = chunk_key(rec, item.storage_offsets)
                if key in first:
                    out.append(out[first[key]])
                    continue
                if rec.path not in agrees:
                    agrees[rec.path] = node_agrees(dir_fd, rec)
                first[key] = len(out)
                out.append(_map_one(dir_fd, rec, key) if agrees[rec.path] else NOT_AS_WRITTEN)
            else:
                out.append(why or NOT_LOCAL)
    files = {id(m): m for m in out if not isinstance(m, str)}
    intact = dict(zip(files, _checked(list(files.values()))))
    done: dict[int, np.ndarray | str] = {}
    for i, m in enumerate(out):
        if not isinstance(m, str):
            if id(m) not in done:
                done[id(m)] = _data(ck.arrays[items[i].path], m) if intact[id(m)] else NOT_AS_WRITTEN
            out[i] = done[id(m)]
    return out


def _checked(files: list[np.ndarray]) -> list[bool]:
    """Whether each mapped chunk file ends in the crc32c of its data: the files split among
    the reading threads (one per CPU) when they hold more than :data:`SPLIT_BYTES`."""
    threads = min(CHECK_THREADS, len(files))
    if threads < 2 or sum(f.nbytes for f in files) < SPLIT_BYTES:
        return _check_all(files)
    pool = shared(CHECK_THREADS, "tsckpt-read")
    futures = [pool.submit(_check_all, files[k::threads]) for k in range(1, threads)]
    try:
        parts = [_check_all(files[::threads]), *(f.result() for f in futures)]
    finally:
        Workers.settle(futures)
    out = [False] * len(files)
    for k, part in enumerate(parts):
        out[k::threads] = part
    return out


def _check_all(files: list[np.ndarray]) -> list[bool]:
    return [crc.intact(f) for f in files]


def _unmappable(rec: ArrayRecord, item: ReadItem, where: Place) -> str | None:
    """Why the region ``item`` of ``rec`` cannot be one mapped chunk file, or None."""
    if math.prod(rec.shape) == 0:
        return "it is empty (no file)"
    kind = route(rec, where)
    if kind is Route.SHARD or rec.chunking.chunk_shape is not None:
        return INNER
    if kind is not Route.CHUNK:
        return where.why or NOT_LOCAL
    if not whole_chunk(rec, item):
        return NOT_ONE_CHUNK
    return None


def _map_one(dir_fd: int, rec: ArrayRecord, key: str) -> np.ndarray | str:
    """The chunk file ``key`` of ``rec`` mapped whole (data and crc32c, not yet checked); or why
    not: it is missing, behind a link, not a regular file of the expected size
    (:data:`NOT_AS_WRITTEN`), or cannot be mapped (past the process's limit of mappings)."""
    size = chunk_file_bytes(rec)
    try:
        fd = open_beneath(dir_fd, key)
    except OSError:
        return NOT_AS_WRITTEN
    try:
        st = os.fstat(fd)
        if not S_ISREG(st.st_mode) or st.st_size != size:
            return NOT_AS_WRITTEN
        return map_private(fd, size)
    except (OSError, ValueError) as e:
        return f"its file cannot be mapped ({e}; vm.max_map_count bounds a process's mappings)"
    finally:
        os.close(fd)


def _data(rec: ArrayRecord, mapped: np.ndarray) -> np.ndarray:
    """A mapped chunk file's data as the stored chunk (storage dtype and shape; complex32: float16 pairs)."""
    shapes = stored_shapes(rec)
    return mapped[: mapped.nbytes - CRC_BYTES].view(_dtypes.numpy_dtype(rec.dtype)).reshape(shapes.shard)
