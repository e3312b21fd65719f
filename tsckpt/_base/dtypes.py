"""Dtype names and zero-copy conversions between torch, numpy and storage.

A leaf has a *logical* dtype (the torch or numpy name, e.g. ``bfloat16``) and a
*storage* dtype (the zarr v3 ``data_type``). They are equal except for the few
torch dtypes zarr has no type for, which are stored as raw bits (documented in
docs/format.md): ``complex32`` as float16 pairs in an extra trailing dimension,
and packed/bit dtypes as unsigned integers of the same width.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from .lazytorch import is_dtype

if TYPE_CHECKING:
    import torch
else:
    from .lazytorch import torch

# Logical names whose storage dtype is the same zarr data_type.
_NATIVE = {
    "bool": np.dtype(bool),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}
for _name in (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float8_e3m4",
    "float8_e4m3b11fnuz",
    "float4_e2m1fn",
    "int4",  # (ml_dtypes' uint4 is left out: TensorStore's zarr3 driver has no such type)
):
    if hasattr(ml_dtypes, _name):
        _NATIVE[_name] = np.dtype(getattr(ml_dtypes, _name))

# torch dtypes stored as raw unsigned bits of the same width.
_RAW_BITS = {
    "float4_e2m1fn_x2": "uint8",
    "bits8": "uint8",
    "bits16": "uint16",
    "bits1x8": "uint8",
    "bits2x4": "uint8",
    "bits4x2": "uint8",
}
# Every logical dtype name this tsckpt reads (:func:`is_known`).
LOGICAL_NAMES = (*_NATIVE, "complex32", *_RAW_BITS)
_UINT_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_UINT_TORCH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # names: torch is imported when a tensor is met


_TORCH_NAMES: dict[torch.dtype, str] = {}  # filled as dtypes are met: asked several times per leaf


def torch_name(dtype: torch.dtype) -> str:
    name = _TORCH_NAMES.get(dtype)
    if name is None:
        name = _TORCH_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def numpy_name(dtype: np.dtype) -> str | None:
    """Logical name of a numpy dtype, or None if tsckpt cannot store it."""
    for name, dt in _NATIVE.items():
        if dt == dtype:
            return name
    return None


def storage_dtype(logical: str) -> str:
    """zarr v3 ``data_type`` that stores ``logical``."""
    if logical in _NATIVE:
        return logical
    if logical == "complex32":
        return "float16"
    if logical in _RAW_BITS:
        return _RAW_BITS[logical]
    raise KeyError(logical)


def is_known(logical: Any) -> bool:
    """A logical dtype name this tsckpt reads."""
    return isinstance(logical, str) and (logical in _NATIVE or logical == "complex32" or logical in _RAW_BITS)


def storage_shape(logical: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape, 2) if logical == "complex32" else tuple(shape)


def storage_extra_dims(logical: str) -> tuple[int, ...]:
    """Trailing dimensions storage adds to the logical shape: (2,) for complex32's (re, im)."""
    return (2,) if logical == "complex32" else ()


def itemsize(logical: str) -> int:
    """Bytes per logical element (complex32: two float16)."""
    return 4 if logical == "complex32" else numpy_dtype(logical).itemsize


def is_supported_torch(dtype: torch.dtype) -> bool:
    name = torch_name(dtype)
    return name in _NATIVE or name == "complex32" or name in _RAW_BITS


def numpy_twin(logical: str) -> np.dtype | None:
    """The numpy (or ml_dtypes) dtype whose elements are those of the torch dtype named
    ``logical``, byte for byte; None where numpy has none (complex32, the packed and bit dtypes)."""
    return _NATIVE.get(logical)


def numpy_dtype(logical: str) -> np.dtype:
    """numpy dtype of an array read from storage for this logical dtype."""
    return _NATIVE[storage_dtype(logical)]


def _torch_dtype_or_none(logical: str) -> torch.dtype | None:
    dt = getattr(torch, logical, None)
    return dt if is_dtype(dt) else None


def torch_dtype(logical: str) -> torch.dtype:
    dt = _torch_dtype_or_none(logical)
    if dt is None:
        raise KeyError(logical)
    return dt


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """torch's dtype of each logical name that has one (:func:`torch_dtype`), looked up once
    (the first call imports torch)."""
    return {name: dt for name in LOGICAL_NAMES if (dt := _torch_dtype_or_none(name)) is not None}


_TORCH_NUMPY_OK = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                   "float16", "float32", "float64", "complex64", "complex128"}


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, in its storage dtype and shape."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    name = torch_name(t.dtype)
    if name == "complex32":
        t, name = torch.view_as_real(t), "float16"
    if name in _TORCH_NUMPY_OK:
        return t.numpy()
    # dtypes numpy lacks: reinterpret the bits (same element size, any strides)
    return t.view(getattr(torch, _UINT_TORCH[t.element_size()])).numpy().view(_NATIVE[storage_dtype(name)])


def numpy_to_tensor(a: np.ndarray, logical: str) -> torch.Tensor:
    """A tensor view (no copy) of a numpy array read in the storage dtype of ``logical``."""
    if not a.flags.writeable:
        a = a.copy()
    if a.dtype.type.__module__ == "ml_dtypes":
        a = a.view(_UINT_NP[a.dtype.itemsize])
    t = torch.from_numpy(a)
    if logical == "complex32":
        return torch.view_as_complex(t.contiguous())
    return t.view(torch_dtype(logical))
