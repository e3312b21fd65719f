"""Turning user leaves into descriptors plus local data, and back.

A leaf is an array of one of the kinds below (torch.Tensor, DTensor, numpy
array or scalar, :class:`ShardedArray`, :class:`LazySource`; jax.Array when jax
is installed), a restore-only :class:`ArraySpec`, or a plain value (int, float,
bool, str, bytes). Anything else is rejected with its path.
"""

from __future__ import annotations

from typing import Any

from .._base.types import Dest, LeafDesc, Local
from .._errors import LeafTypeError
from .._ondisk.records import ArrayRecord, encode_value
from .dtensor import DTensorKind
from .jaxarray import JaxKind
from .kinds import NUMBERS, LazyKind, LeafKind, Memory, NumpyKind, ShardedKind, SpecKind, TorchKind, number_dest

_TORCH, _NUMPY = TorchKind(), NumpyKind()
# DTensor before torch: a DTensor is also a torch.Tensor.
KINDS: tuple[LeafKind, ...] = (
    DTensorKind(), ShardedKind((_TORCH, _NUMPY)), _TORCH, _NUMPY, JaxKind(), SpecKind(), LazyKind()
)


_BY_TYPE: dict[type, LeafKind | None] = {}  # every kind's owns() looks at the leaf's type only


def kind_of(leaf: Any) -> LeafKind | None:
    """The adapter of an array leaf, None for anything else (plain values). Remembered per
    type: a restore of 10,000 leaves asked each kind in turn several times per leaf."""
    t = type(leaf)
    try:
        return _BY_TYPE[t]
    except KeyError:
        kind = _BY_TYPE[t] = next((k for k in KINDS if k.owns(leaf)), None)
        return kind


def describe(path: str, leaf: Any) -> Local:
    """Descriptor and local data for one leaf about to be saved."""
    kind = kind_of(leaf)
    if kind is not None:
        return kind.describe(path, leaf)
    value = encode_value(leaf)
    if value is None:
        raise LeafTypeError(
            f"'{path}': leaf of type {type(leaf).__module__}.{type(leaf).__qualname__} cannot be stored; "
            "supported leaves are torch.Tensor, numpy arrays and scalars, tsckpt.ShardedArray, "
            "int, float, bool, str, bytes and None, and objects with state_dict() and load_state_dict() "
            "(register containers with tsckpt.tree.register_node)"
        )
    return Local(LeafDesc(path=path, kind="value", value=value))


def destination(rec: ArrayRecord, path: str, leaf: Any, inplace: bool, *, casting: str = "same_kind") -> Dest:
    """Where restore puts the stored array ``rec`` for the target leaf ``leaf``, cast as
    ``casting`` allows (see :func:`tsckpt._base.casting.check_cast`)."""
    kind = kind_of(leaf)
    if kind is None and isinstance(leaf, NUMBERS) and tuple(rec.shape) == ():
        return number_dest(rec, path, leaf, casting)
    if kind is None:
        raise LeafTypeError(
            f"'{path}': the checkpoint stores an array {rec.dtype}{list(rec.shape)} but the target leaf is "
            f"{type(leaf).__name__}; use a tensor, numpy array, tsckpt.ArraySpec or ShardedArray target (a plain "
            "number takes a shape-() array only)"
        )
    return kind.destination(rec, path, leaf, inplace, casting)


def memory(x: Any) -> Memory | None:
    """Identity of the memory an array leaf (or local data) views; tied leaves share it. None
    where it views none (no elements, a freed storage): such leaves are never tied."""
    kind = kind_of(x)
    return None if kind is None else kind.memory(x)


def materialises(leaf: Any) -> bool:
    """Whether a restore gives a new array for this target leaf even in place: it has no memory
    to write into (a tensor, DTensor or ShardedArray on the meta device)."""
    kind = kind_of(leaf)
    return kind is not None and kind.materialises(leaf)
