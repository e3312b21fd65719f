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

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .. import _dtypes
from .._arrays import CRC_BYTES, INDEX_ENTRY_BYTES, MISSING_CHUNK
from .._format import ArrayRecord
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
