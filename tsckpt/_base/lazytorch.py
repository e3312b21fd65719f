"""torch, imported only when a torch object is involved.

JAX and numpy users should not pay torch's import (hundreds of MiB and seconds per
process). Modules that use torch write::

    if TYPE_CHECKING:
        import torch
    else:
        from .._base.lazytorch import torch

so type checkers see torch itself while at run time ``torch`` is a stand-in that
imports torch on its first attribute access. Type tests go through :func:`is_tensor`
and friends instead, which look in ``sys.modules`` first: if torch was never
imported, no object can be a torch tensor, dtype or generator, so the answer is
exact and costs one dictionary lookup.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import torch as _torch


def loaded() -> types.ModuleType | None:
    """torch when some code has imported it, else None (imports nothing)."""
    return sys.modules.get("torch")


def is_tensor(obj: object) -> TypeGuard[_torch.Tensor]:
    t = sys.modules.get("torch")
    return t is not None and isinstance(obj, t.Tensor)


def is_dtype(obj: object) -> TypeGuard[_torch.dtype]:
    t = sys.modules.get("torch")
    return t is not None and isinstance(obj, t.dtype)


def is_generator(obj: object) -> TypeGuard[_torch.Generator]:
    t = sys.modules.get("torch")
    return t is not None and isinstance(obj, t.Generator)


def mark_written(objs: Iterable[object]) -> None:
    """Tell torch that the tensors among ``objs`` were written other than by its own
    operations (a restore writes through numpy views): their version counter moves, as an
    in-place operation's does, so autograd and incremental saves
    (:mod:`tsckpt._save.versions`) see the write. Inference tensors have no counter."""
    t = sys.modules.get("torch")
    if t is None:
        return
    for obj in objs:
        if isinstance(obj, t.Tensor) and not obj.is_inference():
            t.autograd.graph.increment_version(obj)


class _LazyTorch:
    """Stands for the torch module: each attribute read is torch's own (imported at the first),
    so what is patched on torch later is seen too."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        real = sys.modules.get("torch")
        if real is None:
            real = importlib.import_module("torch")
        return getattr(real, name)

    def __repr__(self) -> str:
        return "<torch, imported when first used>"


torch: Any = _LazyTorch()
