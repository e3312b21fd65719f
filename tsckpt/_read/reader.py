"""Lazy reads of an opened checkpoint: :class:`LazyArray` (indexing reads only the chunks
the index touches) and the :class:`Reader` mapping of leaf paths to arrays and values."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import optree
import tensorstore as ts

from .._base import dtypes as _dtypes
from .._base.types import ReadItem
from .._formats import lazy
from .._leaves.quantized import SUBCLASS_KEY, Subclass, dequantized, is_subclass_json
from .._ondisk.backing import check_backed
from .._ondisk.checkpoint import Checkpoint, Opening
from .._ondisk.readfaults import corrupt_error, node_error, unchanged
from .._options import READ_ONLY, Copy
from .._runtime import fork as _fork
from ..tree import ROOT_LEAF_PATH, child

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch


def normalize_index(index: Any, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[Any, ...]]:
    """numpy-style basic index -> (bounding box to read, index applied to what was read); raises
    IndexError or TypeError, as numpy would, for an index the shape does not admit."""
    if not isinstance(index, tuple):
        index = (index,)
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in index:
        e = index.index(Ellipsis)
        index = index[:e] + (slice(None),) * (len(shape) - len(index) + 1) + index[e + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices: array is {len(shape)}-dimensional, but {len(index)} were indexed")
    index = index + (slice(None),) * (len(shape) - len(index))
    box: list[slice] = []
    post: list[Any] = []
    for i, n in zip(index, shape):
        if isinstance(i, (int, np.integer)):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {int(i)} is out of bounds for axis with size {n}")
            box.append(slice(j, j + 1))
            post.append(0)
        elif isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step > 0:
                lo, hi = start, max(start, stop)
            else:
                lo, hi = (stop + 1, start + 1) if start > stop else (0, 0)
            box.append(slice(lo, hi))
            post.append(slice(None, None, step))
        else:
            raise TypeError(f"only integers, slices and '...' are valid indices, not {type(i).__name__}")
    return tuple(box), tuple(post)


class LazyArray:
    """A stored array; indexing reads only the chunks the index touches. ``copy`` as
    :func:`tsckpt.open` takes it: False or "read-only" give a read that is exactly one
    chunk stored raw in a local file as a view of its file's mapping (:mod:`.zerocopy`)."""

    def __init__(self, ck: Checkpoint, path: str, *, copy: Copy = True, told: set[str] | None = None) -> None:
        self._ck = ck
        self.path = path
        self.metadata = ck.array_metadata(path)
        self._store: ts.TensorStore | None = None
        self._copy = copy
        self._told = set() if told is None else told  # why reads were copied, each logged once (per reader)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.metadata.shape

    @property
    def dtype(self) -> str:
        return self.metadata.dtype

    def __repr__(self) -> str:
        return f"LazyArray('{self.path}', shape={list(self.shape)}, dtype={self.dtype})"

    def open_future(self) -> Opening:
        return self._ck.open_array_future(self.path)

    def set_store(self, future: Opening) -> None:
        try:
            self._store = future.result()
        except ValueError as e:
            raise node_error(self._ck, self.path, e) from e

    def tensorstore(self) -> ts.TensorStore:
        """The opened TensorStore array (opened on first use). On a local disk it reads the
        checkpoint's files through descriptors this reader holds (docs/security.md): use it
        while the reader (or this array) is alive; after, its files read as missing."""
        if self._store is None:
            self.set_store(self.open_future())
        return cast(ts.TensorStore, self._store)

    def read_box(self, box: tuple[slice, ...], *, writable: bool = False) -> np.ndarray:
        """Read a bounding box (non-negative slices with unit step) in the storage dtype
        (``writable``: a mapped read is writable, copy-on-write, even with copy="read-only")."""
        _fork.enter(f"reading '{self.path}'")
        bounds = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, self.shape))
        whole = bounds + tuple(slice(0, n) for n in self.shape[len(bounds):])
        if self._copy is not True:
            mapped = self._map_box(whole, read_only=self._copy == READ_ONLY and not writable)
            if mapped is not None:
                return mapped
        if self._ck.sources is not None:  # another format's array: only the box's bytes are read
            return lazy.read(self._ck.sources[self.path], tuple(slice(b.start, max(b.start, b.stop)) for b in whole))
        with unchanged(self._ck):  # never data of a checkpoint that replaced the one opened
            check_backed(self._ck, [self.path], whole)
            store = self.tensorstore()
            try:
                data = store[box].read().result() if box else store.read().result()
            except ValueError as e:
                raise corrupt_error(self._ck, self.path, e) from e
        return data

    def _map_box(self, whole: tuple[slice, ...], *, read_only: bool) -> np.ndarray | None:
        """The box ``whole`` as a view of its file's mapping, or None (then logged, once per reason)."""
        from .zerocopy import as_result, map_items, tell  # it reads through the engine, which imports this module

        item = ReadItem(self.path, tuple(b.start for b in whole), tuple(max(0, b.stop - b.start) for b in whole))
        with unchanged(self._ck):  # never data of a checkpoint that replaced the one opened
            if not self._ck.lazy:
                check_backed(self._ck, [self.path], whole)
            got = map_items(self._ck, [item])[0]
        if isinstance(got, str):
            if got not in self._told:
                self._told.add(got)
                what = (
                    f"read of '{self.path}' in {self._ck.location} "
                    "(reads copied for the same reason are not logged again)"
                )
                tell(what, 0, 0, {got: [self.path]})
            return None
        return cast(np.ndarray, as_result(got, self.dtype, got, read_only=read_only))

    def __getitem__(self, index: Any) -> np.ndarray:
        """numpy array in the storage dtype (complex32 comes back as float16 (..., 2) pairs)."""
        return self.read(index)

    def read(self, index: Any, *, writable: bool = False) -> np.ndarray:
        """``self[index]``; ``writable``: a mapped read is writable (copy-on-write) even with copy="read-only"."""
        box, post = normalize_index(index, self.shape)
        data = self.read_box(box, writable=writable)
        if self.dtype == "complex32":
            post = post + (slice(None),)
        out = data[post] if post else data
        if self._copy == READ_ONLY and not writable and isinstance(out, np.ndarray):
            out.flags.writeable = False  # read-only whether mapped or copied (a copy is this read's own)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """numpy's protocol: ``copy=True`` (``np.array``) gives an array of its own, writable
        whatever this reader's ``copy`` option; else the read as it comes (a read of storage
        is no copy of an existing array)."""
        out = self.read(..., writable=copy is True)
        if copy is True:
            return np.array(out, dtype=dtype, copy=True)
        return out if dtype is None else out.astype(dtype)

    @property
    def torch(self) -> _TorchView:
        """``arr.torch[idx]`` returns a torch tensor of the logical dtype."""
        return _TorchView(self)


class _TorchView:
    def __init__(self, arr: LazyArray) -> None:
        self._arr = arr

    def __getitem__(self, index: Any) -> torch.Tensor:
        data = np.asarray(self._arr.read(index, writable=True))  # a full integer index gives a numpy scalar
        if any(s < 0 for s in data.strides):
            data = np.ascontiguousarray(data)
        return _dtypes.numpy_to_tensor(data, self._arr.dtype)


class QuantizedArray:
    """A quantized tensor subclass saved as its parts (tsckpt/_leaves/quantized.py): each part
    a :class:`LazyArray`, the subclass's metadata, and the tensor or its values on request
    (these need torch and torchao)."""

    def __init__(self, reader: Reader, path: str, metadata: Any) -> None:
        self.path = path
        self.info = Subclass.from_json(path, metadata)
        self.parts: dict[str, LazyArray] = {name: reader[f"{path}/{name}"] for name in self.info.parts}

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def subclass(self) -> str:
        """The class's module and name, e.g. ``torchao.prototype.mx_formats.mx_tensor.MXTensor``."""
        return self.info.cls

    @property
    def attributes(self) -> dict[str, Any]:
        """The attributes the class is built with, as stored (JSON: dtypes as ``{"dtype": name}``)."""
        return self.info.attributes

    def to_torch(self) -> Any:
        """The whole tensor as its subclass (every part read whole)."""
        parts = {name: arr.torch[...] for name, arr in self.parts.items()}
        return self.info.build(self.path, parts, self.shape)

    def dequantize(self) -> torch.Tensor:
        """The values, in the dtype the tensor was quantized from (torchao dequantizes)."""
        return dequantized(self.to_torch())

    def __repr__(self) -> str:
        return f"QuantizedArray('{self.path}', {self.subclass.rpartition('.')[2]}, shape={list(self.shape)})"


class Reader(Mapping[str, Any]):
    """Mapping from leaf path to :class:`LazyArray` (arrays) or the saved value (``copy``:
    as :func:`tsckpt.open` takes it)."""

    def __init__(self, ck: Checkpoint, *, copy: Copy = True) -> None:
        self.checkpoint = ck
        self.copy = copy
        self._told: set[str] = set()  # why its arrays' reads were copied, each logged once

    def __getitem__(self, path: str) -> Any:
        ck = self.checkpoint
        if path == "" and ROOT_LEAF_PATH in ck.arrays:
            path = ROOT_LEAF_PATH
        path = ck.aliases.get(path, path)  # a tied leaf reads its stored array
        if path in ck.arrays:
            return LazyArray(ck, path, copy=self.copy, told=self._told)
        if path in ck.values:
            return ck.values[path]
        marker = f"{path.rstrip('/')}/{SUBCLASS_KEY}"
        if marker in ck.values and path and is_subclass_json(ck.values[marker]):
            return QuantizedArray(self, path.rstrip("/"), ck.values[marker])
        close = [p for p in ck.leaves if p.startswith(path.rstrip("/") + "/")][:5]
        hint = f"; leaves below it: {close}" if close else "; `tsckpt ls` lists the paths"
        raise KeyError(f"'{path}' is not a leaf of {ck.location}{hint}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.leaves)

    def __len__(self) -> int:
        return len(self.checkpoint.leaves)

    def metadata(self) -> Any:
        ck = self.checkpoint
        return ck.build([ck.array_metadata(p) if ck.is_array(p) else ck.values[p] for p in ck.leaves])


def read_subtree(ck: Checkpoint, prefix: str) -> Any:
    """The saved subtree at ``prefix``: values as saved, arrays read whole (numpy), containers
    as saved; None when there is no such subtree."""
    node = ck.build(list(ck.leaves))
    for component in (c for c in prefix.strip("/").split("/") if c):
        try:
            node = child(node, component)
        except (KeyError, IndexError):
            return None

    def read_whole(path: str) -> Any:
        stored = ck.aliases.get(path, path)
        return ck.values[stored] if stored in ck.values else LazyArray(ck, stored)[...]

    return optree.tree_map(read_whole, node, none_is_leaf=False)
