"""Plain data types shared by saving, restoring, planning and the leaf kinds.

This module imports nothing of tsckpt, so any other module (``tree`` and the
planner included) can use these types without an import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

# A region of a global array: (offsets, lengths), one of each per dimension.
Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_text(box: Box) -> str:
    """A region as messages show it: ``[0:4, 0:8]``."""
    off, ln = box
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, ln)) + "]"


def box_slices(
    offsets: Sequence[int], lengths: Sequence[int], origin: Sequence[int] | None = None
) -> tuple[slice, ...]:
    """The index of the box (``offsets``, ``lengths``) in an array whose element 0 sits at
    ``origin`` (default: at 0): the one way a region becomes slices."""
    if origin is None:
        return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
    return tuple(slice(o - z, o - z + n) for o, z, n in zip(offsets, origin, lengths))


def span_slices(lo: Sequence[int], hi: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    """The index of the span from corner ``lo`` to corner ``hi`` (exclusive) in an array
    whose element 0 sits at ``origin``."""
    return tuple(slice(a - z, b - z) for a, b, z in zip(lo, hi, origin))


class LeafDesc(NamedTuple):
    """What one rank holds for one path: a region of a global array, or a value.

    A tuple: ranks send their descriptors packed field by field (``_descs.Descs``),
    and the planner builds, reads and compares a million of them (1,000 leaves x
    1,024 ranks) far faster than it would dataclasses.
    """

    path: str
    kind: str  # "torch" | "numpy" | "numpy_scalar" | "value"
    dtype: str = ""
    itemsize: int = 0
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    checksum: int | None = None  # of the local region, compared across replicas
    value: Any = None  # JSON of a plain value
    # The rank holds its region as separate pieces (a jax.Array's device shards): per
    # dimension, the offsets inside the region where pieces begin; the pieces are the cells
    # of that grid. () when the region is one piece. The planner cuts shard files there too.
    cuts: tuple[tuple[int, ...], ...] = ()
    # The rank holds only these pieces of its region (a jax.Array whose process's device
    # shards do not form one box: an interleaved device order); the region is then their
    # bounding box, and nothing outside them is read or written. () when it holds all of it.
    held: tuple[Box, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """Read the global box (``storage_offsets``, ``lengths``) of ``path`` into the whole
    local destination."""

    path: str
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ShardedArray:
    """A rank's region of a global array, for tensors sharded by hand.

    ``local`` holds the elements ``[offsets[d] : offsets[d] + local.shape[d]]`` of a
    global array of ``global_shape``. Regions given by all ranks under one path must
    tile the global array exactly (identical regions are replicas).
    """

    local: Any  # torch.Tensor or numpy array
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        if len(self.global_shape) != len(self.offsets) or len(self.offsets) != len(self.local.shape):
            raise ValueError(
                f"ShardedArray: local shape {list(self.local.shape)}, global_shape {list(self.global_shape)} "
                f"and offsets {list(self.offsets)} must have the same number of dimensions"
            )


@dataclasses.dataclass(frozen=True)
class TorchRegion(ShardedArray):
    """A :class:`ShardedArray` whose ``local`` numpy array holds a torch tensor's elements,
    byte for byte (the numpy or ml_dtypes dtype of the same name), saved as that tensor's
    region is: a ``kind: "torch"`` record. save_async's writer process saves the staged
    copies of tensors so, without importing torch (a whole tensor is the region at offset 0
    of its own shape)."""


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """A restore target leaf that only names the shape and dtype to produce.

    A torch dtype yields a torch tensor (on ``device``), a numpy dtype a numpy array.
    ``shape=None`` accepts whatever shape is stored.
    """

    shape: tuple[int, ...] | None
    dtype: Any
    device: Any = None


@dataclasses.dataclass(frozen=True)
class Local:
    """A leaf ready to save: its descriptor and the data of its local region
    (a torch tensor, a numpy array, or a :class:`LazySource`)."""

    desc: LeafDesc
    data: Any = None


@dataclasses.dataclass(frozen=True)
class Dest:
    """Where one target leaf's data goes, and what restore returns for it."""

    item: ReadItem
    tensor: Any  # torch.Tensor or np.ndarray: the destination memory, in the target's dtype
    result: Any
    finish: Any = None  # called with ``tensor`` after the read, returns the result (jax arrays, numpy scalars)
    cast: Any = None  # a CastCheck of the values read, when casting into ``tensor`` may lose some
    # A leaf read as several regions (a jax.Array's device slices): each part is read as a
    # destination of its own, and ``finish`` (which knows the parts) builds the result.
    parts: tuple[Dest, ...] = ()

    def restored(self) -> Any:
        return self.result if self.finish is None else self.finish(self.tensor)


class LazySource:
    """An array leaf whose data is read only when it is written (imports of other formats).

    ``read(box)`` returns the elements of ``box`` (a tuple of unit-step slices) as a
    CPU torch tensor or numpy array of ``dtype``; ``save`` calls it shard by shard,
    so converting a file never holds more of it than the write window. A source that
    can read straight into memory also has ``fill(box, out)``, which writes the box's
    elements into ``out`` (a C-contiguous numpy array of the box's shape in the storage
    dtype), so a restore reads into its destination without a buffer. A source whose
    bytes lie raw in a file also has ``map()``, which returns the whole array in the
    storage dtype viewing a copy-on-write mapping of the file, or why it cannot (a phrase),
    for zero-copy restores (``copy=False``).
    """

    def __init__(
        self, shape: tuple[int, ...], dtype: Any, read: Any, *, kind: str = "torch", fill: Any = None,
        map: Any = None,  # noqa: A002 - the source's own verb, as ``read`` and ``fill`` are
    ) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype  # torch.dtype or numpy dtype
        self.kind = kind  # what a restore with as_saved=True gives back: "torch" or "numpy"
        self._read = read
        self.fill = fill
        self.map = map

    def __getitem__(self, box: tuple[slice, ...]) -> Any:
        return self._read(box)

    def __repr__(self) -> str:
        return f"LazySource(shape={list(self.shape)}, dtype={self.dtype})"
