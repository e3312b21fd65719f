"""The stored shapes of an array's files, and the index at the end of a shard file.

A shard file (codec ``sharding_indexed``, docs/format.md) holds its inner chunks, each
its C-order little-endian bytes followed by their crc32c, then the index: per inner
chunk, in C order of the shard's grid of inner chunks, its offset and length in the file
as little-endian uint64 (both ``MISSING_CHUNK`` when it is not stored: TensorStore and
the own writer leave out inner chunks wholly outside the array), followed by the
index's own crc32c. An unsharded chunk file is one chunk, padded to the full chunk
shape at the array's edges, followed by its crc32c.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from .._base import dtypes as _dtypes
from .._ondisk.arrays import CRC_BYTES, INDEX_ENTRY_BYTES, MISSING_CHUNK, array_node, stored_node_problem
from .._ondisk.bounds import NODE_BYTES, stat_problem
from .._ondisk.records import ROOT_KEY, ArrayRecord, Chunking
from .._storage.beneath import open_beneath
from .._storage.durable import encode_json
from . import crc


class StoredShapes(NamedTuple):
    """Shapes of the stored array: complex32 adds a trailing dimension of 2 to each."""

    shard: tuple[int, ...]  # one file's extent
    inner: tuple[int, ...] | None  # an inner chunk's (None: the file is one plain chunk)
    shape: tuple[int, ...]  # the array's

    @property
    def grid(self) -> tuple[int, ...]:
        """Inner chunks per shard, per dimension (the shard itself when unsharded)."""
        return tuple(s // i for s, i in zip(self.shard, self.inner or self.shard))


def stored_shapes(rec: ArrayRecord) -> StoredShapes:
    """The stored shapes of ``rec`` (its record's shapes plus the storage dtype's extra dims)."""
    extra = _dtypes.storage_extra_dims(rec.dtype)
    inner = rec.chunking.chunk_shape
    return StoredShapes(
        (*rec.chunking.shard_shape, *extra), None if inner is None else (*inner, *extra), (*rec.shape, *extra)
    )


def stored_starts(shape: Sequence[int], inner: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Where each inner chunk a shard file stores starts (in elements from the shard's
    start), in C order of the shard's grid of inner chunks: those holding part of the array
    (``shape``: the part of the shard inside the array; the others are not stored)."""
    return itertools.product(*(range(0, n, c) for n, c in zip(shape, inner)))


def storage_box(rec: ArrayRecord, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A box of the logical array as a box of the stored one (complex32: the whole pair dim)."""
    extra = _dtypes.storage_extra_dims(rec.dtype)
    return (*offsets, *(0 for _ in extra)), (*lengths, *extra)


@dataclasses.dataclass(frozen=True, eq=False)
class ShardIndex:
    """The index of one shard file: ``entries[cell]`` is (offset, length) of inner chunk
    ``cell`` in the file, both ``MISSING_CHUNK`` for a chunk the file does not store."""

    entries: np.ndarray  # (*grid, 2) little-endian uint64

    @staticmethod
    def nbytes(grid: Sequence[int]) -> int:
        """Bytes of the stored index of a shard with ``grid`` inner chunks, its crc32c included."""
        return math.prod(grid) * INDEX_ENTRY_BYTES + CRC_BYTES

    @classmethod
    def missing(cls, grid: Sequence[int]) -> ShardIndex:
        """An index in which no chunk is stored yet (the writer fills it in)."""
        return cls(np.full((*grid, 2), MISSING_CHUNK, dtype="<u8"))

    @classmethod
    def parse(cls, stored: bytes, grid: Sequence[int]) -> ShardIndex | None:
        """The index stored as ``stored`` (:meth:`nbytes` long), or None when it fails its crc32c."""
        if len(stored) != cls.nbytes(grid) or not crc.intact(stored):
            return None
        return cls(np.frombuffer(stored, "<u8", count=2 * math.prod(grid)).reshape(*grid, 2))

    def put(self, cell: tuple[int, ...], offset: int, length: int) -> None:
        """Record that inner chunk ``cell`` is the ``length`` bytes at ``offset``."""
        self.entries[cell] = (offset, length)

    def entry(self, cell: tuple[int, ...]) -> tuple[int, int] | None:
        """(offset, length) of inner chunk ``cell``, or None when the shard does not store it."""
        start, length = (int(v) for v in self.entries[cell])
        return None if start == MISSING_CHUNK and length == MISSING_CHUNK else (start, length)

    def stored(self) -> tuple[np.ndarray, bytes]:
        """The index as stored: its bytes (a view, no copy), then their crc32c."""
        raw = np.ascontiguousarray(self.entries).reshape(-1).view(np.uint8)
        return raw, crc.encoded(raw)


@contextlib.contextmanager
def opened_directory(directory: str) -> Iterator[int | None]:
    """A descriptor of the local checkpoint ``directory`` while the block runs (which may be
    a link: the checkpoint itself may be one), for :func:`open_beneath`; None when it cannot
    be opened, and its readers then leave every file to the usual path, which reports why."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def node_agrees(dir_fd: int, rec: ArrayRecord) -> bool:
    """The array's zarr.json below the open checkpoint directory ``dir_fd`` exists and agrees
    with its root record (as TensorStore's open checks: a root record edited to another dtype
    of the same size would otherwise misread the data silently). A node byte for byte as
    tsckpt writes it (:func:`written_node`) agrees without being parsed, read with one
    ``read`` of one byte more than it (a longer file is not as written); any other is read
    whole, parsed and compared field by field (:func:`stored_node_problem`). Opened with
    :func:`open_beneath`: a link on the way is a failed open."""
    try:
        fd = open_beneath(dir_fd, f"{rec.path}/{ROOT_KEY}")
    except OSError:
        return False
    expected = written_node(rec)
    try:
        raw = os.read(fd, 1 << 16 if expected is None else len(expected) + 1)
        if raw == expected:
            return True
        if stat_problem(os.fstat(fd), NODE_BYTES, "an array's zarr.json") is not None:
            return False  # a FIFO, a device, a huge file: not read whole here (the usual path says which)
        raw += b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
    except OSError:
        return False
    finally:
        os.close(fd)
    return stored_node_problem(raw, rec) is None


def written_node(rec: ArrayRecord) -> bytes | None:
    """The bytes of the zarr.json tsckpt writes for ``rec`` (``encode_json(array_node(rec))``),
    made from a template per dtype, kind and rank when the array is one chunk file (most small
    leaves: building and encoding the node per leaf cost as much as reading it); None for other
    arrays."""
    shape, chunking = rec.shape, rec.chunking
    if chunking.chunk_shape is not None or tuple(chunking.shard_shape) != tuple(shape):
        return None
    parts = _one_chunk_template(rec.dtype, rec.kind, len(shape), rec.slash_keys)
    if parts is None:
        return None
    # the JSON of a list of ints, as encode_json writes it (no spaces), without its per-call cost
    dims = f"[{','.join(map(str, _dtypes.storage_shape(rec.dtype, shape)))}]".encode()
    return dims.join(parts)


_SENTINEL = 7_654_321_987  # a length no real array has: marks where a template's shape goes


@functools.lru_cache(maxsize=256)
def _one_chunk_template(dtype: str, kind: str, ndim: int, slash_keys: bool) -> list[bytes] | None:
    """The node of a one-chunk array of this dtype, kind and rank (and key encoding, see
    :attr:`ArrayRecord.slash_keys`), split around its two shape lists (the array's, and its chunk
    grid's, which is the same); None when the split does not find exactly those two (a rank-0
    array's ``[]``)."""
    shape = tuple(_SENTINEL + i for i in range(ndim))
    raw = encode_json(array_node(ArrayRecord("", shape, dtype, kind, Chunking(shape, None), slash_keys)))
    parts = raw.split(encode_json(list(_dtypes.storage_shape(dtype, shape))))
    return parts if len(parts) == 3 and ndim > 0 else None
