"""Leaf kinds: one adapter per type of array leaf.

Each :class:`LeafKind` answers, for the leaves it owns, the four questions
save and restore ask: how to describe the leaf for the save plan (its global
array and local region), where a restore puts its data, which memory it views
(tied weights share it), and how to read its local data. Saving and restoring
never branch on leaf types themselves; they ask :func:`tsckpt._leaves.registry.kind_of`.

This module holds the base class and the kinds that need nothing beyond torch
and numpy; DTensors live in ``_dtensor.py`` (the one home of torch's private
sharding helpers) and jax arrays in ``_jax.py``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.casting import check_cast
from .._base.lazytorch import is_dtype, is_tensor, loaded
from .._base.types import (
    ArraySpec,
    Dest,
    LazySource,
    LeafDesc,
    Local,
    ReadItem,
    ShardedArray,
    TorchRegion,
    box_text,
)
from .._errors import LeafTypeError, ShapeMismatchError, short_repr
from .._ondisk.records import ArrayRecord, extent_problem

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

Memory = tuple[Any, ...]


# ---- checks shared by the kinds ---------------------------------------------------


def check_shape(path: str, want: tuple[int, ...], stored: tuple[int, ...]) -> None:
    if tuple(want) != tuple(stored):
        raise ShapeMismatchError(
            f"'{path}': target shape {list(want)} but the checkpoint stores {list(stored)}; resize the target, "
            "or read a slice with tsckpt.open(...)[path][...] and copy it in yourself"
        )


def check_region(path: str, offsets: tuple[int, ...], lengths: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """A target's region (a ShardedArray's) must lie inside the global array it reads from."""
    if any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
        raise ShapeMismatchError(
            f"'{path}': the target's region {box_text((offsets, lengths))} (offsets {list(offsets)}, local shape "
            f"{list(lengths)}) lies outside the global shape {list(shape)}; fix the target's offsets or local shape"
        )


def writable(arr: np.ndarray, path: str) -> np.ndarray:
    """A numpy destination; numpy assignment casts, so any numeric dtype will do."""
    if not arr.flags.writeable:
        raise LeafTypeError(f"'{path}': target numpy array is read-only; pass a writable array or inplace=False")
    return arr


def extent(t: torch.Tensor) -> int:
    """Bytes of its storage a tensor's elements reach, from its storage's start (0: no elements)."""
    if t.numel() == 0:
        return 0
    last = int(t.storage_offset()) + sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def has_memory(t: torch.Tensor) -> bool:
    """Whether a tensor's elements lie in memory it holds: not on the meta device, and its
    storage neither freed (``untyped_storage().resize_(0)``, as FSDP does to unsharded
    parameters; its data pointer is then 0) nor shrunk below its elements."""
    if t.device.type == "meta":
        return False
    need = extent(t)
    return need == 0 or (t.data_ptr() != 0 and t.untyped_storage().nbytes() >= need)


def writable_tensor(t: torch.Tensor, path: str) -> torch.Tensor:
    """A tensor an in-place restore writes into: refused, naming the leaf, when it has no
    memory to write (a freed or shrunk storage; meta tensors are materialised before this)."""
    if not has_memory(t):
        raise LeafTypeError(
            f"'{path}': the target tensor {_dtypes.torch_name(t.dtype) if _dtypes.is_supported_torch(t.dtype) else t.dtype}"
            f"{list(t.shape)} has no memory to restore into in place: its storage holds "
            f"{t.untyped_storage().nbytes()} bytes and its shape needs {extent(t)} (a storage freed with "
            "untyped_storage().resize_(0), as FSDP does to unsharded parameters); give a tensor with memory, "
            "or restore with inplace=False to get a new tensor"
        )
    return t


def materialise_device(t: torch.Tensor) -> torch.device:
    """Where a restore puts the data of a meta-device target: the CPU (no verb has a device option)."""
    return torch.device("cpu")


def logical_dtype(path: str, dtype: Any) -> str:
    """tsckpt's dtype name for a torch or numpy dtype, or a precise error."""
    if is_dtype(dtype):
        if not _dtypes.is_supported_torch(dtype):
            raise LeafTypeError(
                f"'{path}': torch dtype {dtype} cannot be stored; convert it first "
                "(e.g. dequantize a quantized tensor)"
            )
        return _dtypes.torch_name(dtype)
    name = _dtypes.numpy_name(np.dtype(dtype))
    if name is None:
        raise LeafTypeError(
            f"'{path}': numpy dtype {dtype} cannot be stored (no zarr v3 data type); "
            "convert it to a numeric dtype first"
        )
    return name


def region_leaf(
    path: str, data: Any, global_shape: Sequence[int], offsets: Sequence[int], kind: str
) -> Local:
    """A leaf that is the region of a global array starting at ``offsets``; tensors
    without plain readable memory are refused here, before a save claims its directory."""
    if is_tensor(data):
        _check_storable(path, data)
    check_extents(path, global_shape)
    dtype = logical_dtype(path, data.dtype)
    desc = LeafDesc(
        path=path,
        kind=kind,
        dtype=dtype,
        itemsize=_dtypes.itemsize(dtype),
        global_shape=tuple(global_shape),
        offsets=tuple(offsets),
        lengths=tuple(int(s) for s in data.shape),
    )
    return Local(desc, data)


def check_extents(path: str, shape: Sequence[int]) -> None:
    """Refuse, before a save claims its directory, an array restore would refuse (see
    :func:`tsckpt._ondisk.records.extent_problem`), rather than commit a checkpoint nothing reads."""
    problem = extent_problem(shape)
    if problem is not None:
        raise LeafTypeError(
            f"'{path}': an array of shape {list(shape)} has {problem}, so the checkpoint could not be read back; "
            "reshape it (merge dimensions, or give an empty array smaller extents) before saving"
        )


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """A tensor of a wrapper subclass (one ``__tensor_flatten__`` describes: torchao's quantized
    tensors, DTensor), not a plain tensor or parameter: its storage is not its values."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    return callable(getattr(type(t), "__tensor_flatten__", None))


def unknown_subclass(path: str, t: torch.Tensor, where: str = "the leaf") -> LeafTypeError:
    """The refusal of a tensor subclass tsckpt does not store (see tsckpt/_leaves/quantized.py)."""
    cls = type(t)
    return LeafTypeError(
        f"'{path}': {where} is a tensor subclass {cls.__module__}.{cls.__qualname__} that tsckpt does not know "
        "how to store or restore (its storage is not an array of its values); tsckpt stores torchao's MXTensor, "
        "NVFP4Tensor, Float8Tensor, Float8TrainingTensor and WeightWithDynamicFloat8CastTensor; save "
        "t.dequantize() (or its inner tensors) as plain leaves instead"
    )


def _check_storable(path: str, t: torch.Tensor) -> None:
    if is_wrapper_subclass(t):
        raise unknown_subclass(path, t)
    if t.device.type == "meta":
        raise LeafTypeError(
            f"'{path}': a tensor on the meta device has no data to save; materialize the module first "
            "(e.g. module.to_empty(device='cpu') and initialize or load its weights)"
        )
    if t.layout != torch.strided:
        raise LeafTypeError(
            f"'{path}': a {t.layout} tensor cannot be saved (tsckpt stores dense arrays); "
            "save t.to_dense(), or its indices and values as separate leaves"
        )
    if not has_memory(t):
        raise LeafTypeError(
            f"'{path}': the tensor has no data to save: its storage holds {t.untyped_storage().nbytes()} bytes and "
            f"its shape {list(t.shape)} needs {extent(t)} (a storage freed with untyped_storage().resize_(0), as "
            "FSDP does to unsharded parameters); save the sharded parameters (model.state_dict() under FSDP) instead"
        )


def host_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """An uninitialized numpy array in memory from torch's CPU allocator.

    Restores write every byte of a fresh destination once, so its cost is
    dominated by first-touch page faults; torch's allocator asks the kernel for
    transparent huge pages on large blocks (about 5x fewer faults per GiB than
    numpy's allocations where THP is opt-in, as on most distributions). A process that has
    not imported torch (JAX, numpy) gets numpy's allocation instead of importing it."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < (2 << 20) or loaded() is None:
        return np.empty(shape, dtype)
    return torch.empty(nbytes, dtype=torch.uint8).numpy().view(dtype).reshape(shape)


def whole(rec: ArrayRecord, path: str) -> ReadItem:
    return ReadItem(path, (0,) * len(rec.shape), tuple(rec.shape))


NUMBERS = (bool, int, float, complex)


def number_dest(rec: ArrayRecord, path: str, leaf: bool | int | float | complex, casting: str) -> Dest:
    """A plain number target (a Linen ``TrainState.create``'s ``step = 0``) of a stored
    shape-() array (the step a jitted update made a jax scalar): a number of the target's
    type, the cast into it checked as an array's (Orbax, too, gives the target's type)."""
    dtype = np.dtype(type(leaf))
    cast = check_cast(path, rec.dtype, dtype, casting=casting)
    return Dest(whole(rec, path), np.empty((), dtype=dtype), None, finish=lambda a: a.item(), cast=cast)


def storage_numpy(data: Any) -> np.ndarray:
    """Local data as a CPU numpy array in its storage dtype (a view when possible)."""
    if isinstance(data, LazySource):
        data = data[tuple(slice(0, n) for n in data.shape)]
    if is_tensor(data):
        if data.device.type != "cpu":
            data = data.detach().cpu()
        return _dtypes.tensor_to_numpy(data)
    return np.asarray(data)


def checksum(data: Any) -> int:
    """Cheap content checksum of a local region, compared across replicas."""
    if is_tensor(data) and data.device.type != "cpu":
        flat = data.detach().contiguous().view(-1)
        if flat.numel() == 1:  # a size-1 dim may keep any stride, which view(uint8) rejects
            flat = flat.clone(memory_format=torch.contiguous_format)
        flat = flat.view(torch.uint8)
        return int(flat.to(torch.int64).sum().item()) ^ (flat.numel() << 40)
    buf = np.ascontiguousarray(storage_numpy(data)).view(np.uint8).reshape(-1)
    return zlib.crc32(buf.data)


# ---- the kinds ----------------------------------------------------------------------


class LeafKind:
    """Adapter for one type of array leaf (see the module docstring)."""

    def owns(self, leaf: Any) -> bool:
        raise NotImplementedError

    def describe(self, path: str, leaf: Any) -> Local:
        """The leaf's descriptor for the save plan, and its local data."""
        raise LeafTypeError(f"'{path}': a {type(leaf).__name__} is a restore target only; it cannot be saved")

    def destination(self, rec: ArrayRecord, path: str, leaf: Any, inplace: bool, casting: str) -> Dest:
        """Where a restore writes this target leaf's data, and what it returns for the leaf
        (``casting``: see :func:`check_cast`)."""
        raise LeafTypeError(
            f"'{path}': a {type(leaf).__name__} cannot be a restore target; use a tensor, numpy array, "
            "tsckpt.ArraySpec or ShardedArray"
        )

    def from_value(self, path: str, value: Any, leaf: Any, inplace: bool, casting: str) -> tuple[Any, Any]:
        """The restored leaf for a plain value the checkpoint stores where the target has this
        array leaf, and the CastCheck of the value (None: none); refused unless a kind takes it."""
        raise LeafTypeError(
            f"'{path}': the checkpoint stores a plain value ({type(value).__name__}) but the target leaf is "
            f"{type(leaf).__name__}, which takes an array; give a plain value as this target leaf (e.g. the saved "
            f"one, {short_repr(value, 40)}), or restore with target=None to see what is stored"
        )

    def memory(self, leaf: Any) -> Memory | None:
        """Identity of the memory the leaf views (equal for tied leaves, and only for leaves that
        really share memory), None if it has none."""
        return None

    def materialises(self, leaf: Any) -> bool:
        """Whether the leaf has no memory of its own to restore into (a meta-device tensor): a
        restore gives a new array for it, in place or not (see :func:`materialise_device`)."""
        return False


class TorchKind(LeafKind):
    def owns(self, leaf: Any) -> bool:
        return is_tensor(leaf)

    def describe(self, path: str, leaf: torch.Tensor) -> Local:
        return region_leaf(path, leaf, leaf.shape, (0,) * leaf.dim(), "torch")

    def destination(self, rec: ArrayRecord, path: str, leaf: torch.Tensor, inplace: bool, casting: str) -> Dest:
        check_shape(path, tuple(leaf.shape), rec.shape)
        cast = check_cast(path, rec.dtype, leaf.dtype, casting=casting)
        if leaf.device.type == "meta":  # nothing to write into: a new tensor, in place or not
            t = torch.empty(rec.shape, dtype=leaf.dtype, device=materialise_device(leaf))
        else:
            t = writable_tensor(leaf, path) if inplace else torch.empty(rec.shape, dtype=leaf.dtype, device=leaf.device)
        return Dest(whole(rec, path), t, t, cast=cast)

    def memory(self, leaf: torch.Tensor) -> Memory | None:
        return tensor_memory(leaf)

    def materialises(self, leaf: torch.Tensor) -> bool:
        return leaf.device.type == "meta"


def tensor_memory(t: torch.Tensor) -> Memory | None:
    """The memory a tensor views, None where it has none: no elements, or a freed storage (whose
    data pointer is 0 for every such tensor, so it would make unrelated leaves look tied). Meta
    tensors have no memory either; they are tied when they share a storage object (a module's
    tied parameters built on the meta device), which is then named instead of an address."""
    if t.device.type == "meta":
        return ("meta", t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    # data_ptr() is the storage's address plus the offset
    ptr = t.data_ptr()
    if ptr == 0 or t.numel() == 0:
        return None
    return ("torch", t.device, ptr, tuple(t.shape), t.stride(), t.dtype)


class NumpyKind(LeafKind):
    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, (np.ndarray, np.generic))

    def describe(self, path: str, leaf: Any) -> Local:
        if isinstance(leaf, np.generic):
            return region_leaf(path, np.asarray(leaf), (), (), "numpy_scalar")
        if not leaf.dtype.isnative:  # stored little-endian; a byte-swapped copy keeps the values
            leaf = leaf.astype(leaf.dtype.newbyteorder("="))
        return region_leaf(path, leaf, leaf.shape, (0,) * leaf.ndim, "numpy")

    def destination(self, rec: ArrayRecord, path: str, leaf: Any, inplace: bool, casting: str) -> Dest:
        check_shape(path, np.shape(leaf), rec.shape)
        cast = check_cast(path, rec.dtype, leaf.dtype, casting=casting)
        if isinstance(leaf, np.generic):  # immutable: a 0-d buffer, made a scalar after the read
            return Dest(whole(rec, path), np.empty((), dtype=leaf.dtype), None, finish=lambda a: a[()], cast=cast)
        a = leaf if inplace else host_empty(rec.shape, leaf.dtype)
        return Dest(whole(rec, path), writable(a, path), a, cast=cast)

    def memory(self, leaf: Any) -> Memory | None:
        if not isinstance(leaf, np.ndarray) or leaf.size == 0:
            return None
        return ("numpy", leaf.__array_interface__["data"][0], leaf.shape, leaf.strides, leaf.dtype.str)


class ShardedKind(LeafKind):
    """:class:`ShardedArray`: a hand-made region; its local array is a tensor or numpy array
    (a :class:`TorchRegion`'s numpy array is a tensor's elements: saved as the tensor's)."""

    def __init__(self, local_kinds: Sequence[LeafKind]) -> None:
        self._local_kinds = local_kinds

    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, ShardedArray)

    def describe(self, path: str, leaf: ShardedArray) -> Local:
        kind = "torch" if is_tensor(leaf.local) or isinstance(leaf, TorchRegion) else "numpy"
        return region_leaf(path, leaf.local, leaf.global_shape, leaf.offsets, kind)

    def destination(self, rec: ArrayRecord, path: str, leaf: ShardedArray, inplace: bool, casting: str) -> Dest:
        local = leaf.local
        check_shape(path, leaf.global_shape, rec.shape)
        check_region(path, leaf.offsets, tuple(local.shape), rec.shape)
        cast = check_cast(path, rec.dtype, local.dtype, casting=casting)
        item = ReadItem(path, leaf.offsets, tuple(local.shape))
        t: Any
        if is_tensor(local) and local.device.type == "meta":  # a new tensor, in place or not
            t = torch.empty(local.shape, dtype=local.dtype, device=materialise_device(local))
        elif is_tensor(local):
            t = writable_tensor(local, path) if inplace else torch.empty_like(local)
        else:
            t = writable(local if inplace else host_empty(local.shape, local.dtype), path)
        return Dest(item, t, ShardedArray(t, leaf.global_shape, leaf.offsets), cast=cast)

    def memory(self, leaf: ShardedArray) -> Memory | None:
        return next((k.memory(leaf.local) for k in self._local_kinds if k.owns(leaf.local)), None)

    def materialises(self, leaf: ShardedArray) -> bool:
        return is_tensor(leaf.local) and leaf.local.device.type == "meta"


class SpecKind(LeafKind):
    """:class:`ArraySpec`: a restore target that names only shape, dtype and device."""

    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, ArraySpec)

    def destination(self, rec: ArrayRecord, path: str, leaf: ArraySpec, inplace: bool, casting: str) -> Dest:
        if leaf.shape is not None:
            check_shape(path, tuple(leaf.shape), rec.shape)
        if is_dtype(leaf.dtype):
            cast = check_cast(path, rec.dtype, leaf.dtype, casting=casting)
            t = torch.empty(rec.shape, dtype=leaf.dtype, device=leaf.device or "cpu")
            return Dest(whole(rec, path), t, t, cast=cast)
        if leaf.dtype is None:  # the stored dtype (complex32, which numpy lacks, is a torch dtype above)
            a = host_empty(rec.shape, _dtypes.numpy_dtype(rec.dtype))
            return Dest(whole(rec, path), a, a)
        dtype = np.dtype(leaf.dtype)
        cast = check_cast(path, rec.dtype, dtype, casting=casting)
        a = host_empty(rec.shape, dtype)
        return Dest(whole(rec, path), a, a, cast=cast)


class LazyKind(LeafKind):
    """:class:`LazySource`: data read from another file only when written."""

    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, LazySource)

    def describe(self, path: str, leaf: LazySource) -> Local:
        return region_leaf(path, leaf, leaf.shape, (0,) * len(leaf.shape), leaf.kind)

    def memory(self, leaf: LazySource) -> Memory:
        return ("lazy", id(leaf))  # one source given under several paths is stored once (tied)
