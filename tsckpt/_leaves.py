"""Turning user leaves into descriptors plus local data, and back.

A leaf is one of: a torch.Tensor, a numpy array or scalar, a
:class:`ShardedArray` (a region of a larger global array), or a plain value
(int, float, bool, str, bytes). Anything else is rejected with its path.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import _dtypes
from ._errors import LeafTypeError
from ._format import encode_value
from ._plan import LeafDesc


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
class ArraySpec:
    """A restore target leaf that only names the shape and dtype to produce.

    A torch dtype yields a torch tensor (on ``device``), a numpy dtype a numpy array.
    ``shape=None`` accepts whatever shape is stored.
    """

    shape: tuple[int, ...] | None
    dtype: Any
    device: Any = None


@dataclasses.dataclass
class Local:
    """A leaf ready to save: its descriptor and the data of its local region."""

    desc: LeafDesc
    data: Any = None  # torch.Tensor or np.ndarray of the local region


def logical_dtype(path: str, data: Any) -> str:
    if isinstance(data, torch.Tensor):
        if not _dtypes.is_supported_torch(data.dtype):
            raise LeafTypeError(
                f"'{path}': torch dtype {data.dtype} cannot be stored; convert it first "
                "(e.g. dequantize a quantized tensor)"
            )
        return _dtypes.torch_name(data.dtype)
    name = _dtypes.numpy_name(data.dtype)
    if name is None:
        raise LeafTypeError(
            f"'{path}': numpy dtype {data.dtype} cannot be stored (no zarr v3 data type); "
            "convert it to a numeric dtype first"
        )
    return name


def checksum(data: Any) -> int:
    """Cheap content checksum of a region, compared across replicas."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            flat = data.detach().contiguous().view(-1)
            if flat.numel() == 1:  # a size-1 dim may keep any stride, which view(uint8) rejects
                flat = flat.clone(memory_format=torch.contiguous_format)
            flat = flat.view(torch.uint8)
            return int(flat.to(torch.int64).sum().item()) ^ (flat.numel() << 40)
        data = _dtypes.tensor_to_numpy(data)
    buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return zlib.crc32(buf.data)


def region_leaf(
    path: str, data: Any, global_shape: Sequence[int], offsets: Sequence[int], kind: str
) -> Local:
    """A leaf that is the region of a global array starting at ``offsets``."""
    dtype = logical_dtype(path, data)
    itemsize = data.element_size() if isinstance(data, torch.Tensor) else data.dtype.itemsize
    if dtype == "complex32":
        itemsize = 4
    desc = LeafDesc(
        path=path,
        kind=kind,
        dtype=dtype,
        itemsize=itemsize,
        global_shape=tuple(global_shape),
        offsets=tuple(offsets),
        lengths=tuple(int(s) for s in data.shape),
    )
    return Local(desc, data)


def describe(path: str, leaf: Any) -> Local:
    """Descriptor and local data for one leaf about to be saved."""
    from ._dtensor import describe_dtensor, is_dtensor

    if is_dtensor(leaf):
        return describe_dtensor(path, leaf)
    if isinstance(leaf, ShardedArray):
        local = leaf.local
        kind = "torch" if isinstance(local, torch.Tensor) else "numpy"
        return region_leaf(path, local, leaf.global_shape, leaf.offsets, kind)
    if isinstance(leaf, torch.Tensor):
        return region_leaf(path, leaf, leaf.shape, (0,) * leaf.dim(), "torch")
    if isinstance(leaf, np.ndarray):
        if not leaf.dtype.isnative:  # stored little-endian; a byte-swapped copy keeps the values
            leaf = leaf.astype(leaf.dtype.newbyteorder("="))
        return region_leaf(path, leaf, leaf.shape, (0,) * leaf.ndim, "numpy")
    if isinstance(leaf, np.generic):
        return region_leaf(path, np.asarray(leaf), (), (), "numpy_scalar")
    value = encode_value(leaf)
    if value is None:
        raise LeafTypeError(
            f"'{path}': leaf of type {type(leaf).__module__}.{type(leaf).__qualname__} cannot be stored; "
            "supported leaves are torch.Tensor, numpy arrays and scalars, tsckpt.ShardedArray, "
            "int, float, bool, str, bytes and None (register containers with tsckpt.tree.register_node)"
        )
    return Local(LeafDesc(path=path, kind="value", value=value))


def storage_numpy(data: Any) -> np.ndarray:
    """The local data as a CPU numpy array in its storage dtype (a view when possible)."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            data = data.detach().cpu()
        return _dtypes.tensor_to_numpy(data)
    return np.asarray(data)
