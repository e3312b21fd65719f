"""Another library's checkpoint as a :class:`Checkpoint` of lazy sources, and reading them.

safetensors files and Hugging Face directories, ``torch.save`` files and DCP directories
are parsed by their format modules into a *source tree* (see ``sources.open_source``):
arrays as :class:`LazySource` objects (or tensors the OS maps lazily), plain values as
they are. :func:`as_checkpoint` turns such a tree into the :class:`Checkpoint` every
read verb works from, its arrays kept in ``Checkpoint.sources``; :func:`read` and
:func:`fill` are the one way any reader (restore, ``open``, verify, convert) gets a
region of one, so each reads only the byte ranges of the region it asks for:

- safetensors: positional reads of the byte runs the region covers (no mapping);
- ``torch.save`` (zip, loaded with ``mmap=True``): slicing the mapped storage, which
  pages in only what the slice touches;
- DCP: its ``FileSystemReader``, region by region (only the saved chunks the region overlaps).

These formats store no checksums: nothing read here is checked against one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.lazytorch import is_dtype, is_tensor
from .._base.types import LazySource
from .._leaves.kinds import logical_dtype
from .._leaves.registry import memory
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.records import ArrayRecord, Chunking
from .._storage.locations import Location
from ..tree import flatten, structure_to_json

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# Bytes of one block a reader asks a source for: restore and verify read an array's region
# block by block (the "shards" of its record), so a read that needs a buffer holds one block.
BLOCK_BYTES = 32 << 20


def as_source(leaf: Any) -> LazySource | None:
    """An array leaf of a source tree as a lazy source (a mapped tensor or a numpy array is
    sliced when read); None for a plain value."""
    if isinstance(leaf, LazySource):
        return leaf
    if is_tensor(leaf):
        return LazySource(tuple(leaf.shape), leaf.dtype, leaf.__getitem__, kind="torch")
    if isinstance(leaf, (np.ndarray, np.generic)):
        arr = np.asarray(leaf)
        return LazySource(arr.shape, arr.dtype, arr.__getitem__, kind="numpy" if isinstance(leaf, np.ndarray) else "numpy_scalar")
    return None


def chunking(shape: tuple[int, ...], itemsize: int) -> Chunking:
    """The blocks readers ask for: whole trailing dimensions, rows of the first in about
    :data:`BLOCK_BYTES` (a single block when the array has no dimensions)."""
    if not shape:
        return Chunking((), None)
    row = max(1, math.prod(shape[1:]) * itemsize)
    return Chunking((max(1, BLOCK_BYTES // row), *(max(1, n) for n in shape[1:])), None)


def as_checkpoint(loc: Location, fmt: str, tree: Any) -> Checkpoint:
    """The source tree ``tree`` of the ``fmt`` checkpoint at ``loc`` as a :class:`Checkpoint`:
    an array record and a source per stored array, plain values as they are. Leaves that are
    the same source or view the same memory (tied weights) are stored once, the later ones as
    aliases of the first, as tsckpt stores ties."""
    flat = flatten(tree)
    arrays: dict[str, ArrayRecord] = {}
    values: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    sources: dict[str, LazySource] = {}
    first: dict[Any, str] = {}
    for path, leaf in zip(flat.paths, flat.leaves):
        src = as_source(leaf)
        if src is None:
            values[path] = leaf
            continue
        # a scalar or an empty array views no memory of its own (empty tensors all have address 0)
        key = memory(leaf) if not isinstance(leaf, np.generic) and 0 not in src.shape else None
        if key is not None and key in first:
            aliases[path] = first[key]
            continue
        if key is not None:
            first[key] = path
        dtype = logical_dtype(path, src.dtype)
        arrays[path] = ArrayRecord(path, src.shape, dtype, src.kind, chunking(src.shape, _dtypes.itemsize(dtype)))
        sources[path] = src
    return Checkpoint(
        loc, tuple(flat.paths), arrays, values, structure_to_json(flat.spec), {}, aliases, format=fmt, sources=sources
    )


def storage(block: Any) -> np.ndarray:
    """A block a source returned (a torch tensor or numpy array) as numpy in its storage dtype
    (complex32 as float16 pairs); a view where it can be."""
    if is_tensor(block):
        return _dtypes.tensor_to_numpy(block)
    return np.asarray(block)


def read(src: LazySource, box: tuple[slice, ...]) -> np.ndarray:
    """The elements of ``box`` (unit-step slices, one per dimension) of ``src``, as numpy in the
    storage dtype; only that region is read."""
    if src.fill is not None:
        return storage(src.fill(box, np.empty(_lengths(box), _storage_dtype(src))))
    return storage(src[box])


def fill(src: LazySource, box: tuple[slice, ...], out: np.ndarray) -> None:
    """Write the elements of ``box`` of ``src`` into ``out`` (the box's shape, the storage
    dtype): straight into it when the source can and ``out`` is contiguous, else through
    :func:`read` and a copy."""
    if src.fill is not None and out.flags.c_contiguous and out.flags.writeable:
        src.fill(box, out)
        return
    out[...] = read(src, box)


def _lengths(box: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(max(0, b.stop - b.start) for b in box)


def _storage_dtype(src: LazySource) -> np.dtype[Any]:
    name = _dtypes.torch_name(src.dtype) if is_dtype(src.dtype) else _dtypes.numpy_name(np.dtype(src.dtype))
    return np.dtype(_dtypes.numpy_dtype(str(name)))
