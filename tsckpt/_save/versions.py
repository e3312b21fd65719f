"""Which parts of a save provably hold what an earlier save of this process hashed, so
that their content hash is known without reading them again.

An incremental save hashes every file it would write (:mod:`tsckpt._save.share`); for a
frozen base that is most of a save's time, spent to prove what did not change. torch
counts the in-place writes to a tensor: every in-place operation (``add_``, ``copy_``,
indexed assignment, an optimizer's step, ``torch.no_grad`` and ``torch.inference_mode``
included, through any view or ``detach()`` of it) increments the version counter its
views share. So a tensor that is the object hashed before, over the same storage (a weak
reference to the storage, never keeping it alive; not to the tensor, which
``torch.utils.swap_tensors`` would then refuse to swap), at the same address, offset,
shape, strides and dtype, with the same version, holds the bytes that were hashed, and the
hash recorded then is this box's.

A fused optimizer (torch.optim's ``fused=True``) updates its parameters and state in one
native kernel that does not move the counters: once a hash is remembered, a global
optimizer step post-hook moves the counters of every tensor of a fused optimizer's groups
and state after each of its steps (:func:`_after_fused_step`).

What the counter cannot see, and what is therefore excluded or must be declared:

- tensors in shared memory (``share_memory_()``: other processes write them), non-CPU,
  sparse, inference-mode, conjugate or negative-bit tensors, tensor subclasses other than
  ``nn.Parameter``, numpy arrays: always hashed;
- writes through ``tensor.data`` (a new tensor with a counter of its own), through a numpy
  view (``tensor.numpy()``, or the array a ``torch.from_numpy`` tensor views), through the
  storage (``untyped_storage()``), from native code other than torch's fused optimizers
  (an extension's optimizer kernel), or to a memory-mapped file under a tensor
  (``torch.load(mmap=True)``): invisible. This is why the counters are trusted
  only where a save asks (``incremental="versions"``): a program that never writes its
  tensors that way between saves. tsckpt's own restores tell torch of their writes
  (:func:`tsckpt._base.lazytorch.mark_written`).

A ``save_async`` saves staged copies: tsckpt fills its reused staging tensors with
``copy_`` (their version moves at every staging) and a writer process's views are new
tensors at every save, so such saves hash every file, as they must.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._base.lazytorch import is_tensor

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# What must be unchanged: (data_ptr, storage_offset, shape, stride, dtype, version,
# storage address, storage bytes).
State = tuple[Any, ...]
# One file's part of a leaf: (stored dtype, the leaf's region offsets, the box's offsets, its lengths).
Box = tuple[Any, ...]


class _Seen:
    __slots__ = ("ref", "state", "digests")

    def __init__(self, tensor: torch.Tensor, state: State) -> None:
        self.ref = weakref.ref(tensor.untyped_storage())  # torch keeps one storage object per storage
        self.state = state
        self.digests: dict[Box, str] = {}

    def holds(self, tensor: Any, state: State) -> bool:
        """Whether ``tensor``, whose state is ``state``, is over the storage seen, as it was then."""
        storage = self.ref()
        return storage is not None and self.state == state and storage is tensor.untyped_storage()


_lock = threading.Lock()
_seen: dict[int, _Seen] = {}
_pruned_at = 64  # entries at which dead ones are next dropped
_hooked = False  # the fused optimizers' hook registered


def state(data: Any) -> State | None:
    """What proves ``data`` unchanged later, taken before a save reads it; None where no
    proof is possible (see the module's docstring): such data is always hashed."""
    if not is_tensor(data) or type(data) not in (torch.Tensor, torch.nn.Parameter):
        return None
    t = data
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_inference() or t.is_conj() or t.is_neg():
        return None
    storage = t.untyped_storage()
    if storage.is_shared():  # other processes may write it
        return None
    return (
        t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version,
        storage.data_ptr(), storage.nbytes(),
    )


def known(tensor: Any, now: State, box: Box) -> str | None:
    """The content hash of ``box`` of ``tensor`` remembered from an earlier save, if the
    tensor is the one hashed then and ``now`` (its :func:`state` taken before this save
    read it) is the state it had then; else None."""
    with _lock:
        seen = _seen.get(id(tensor))
        if seen is None or not seen.holds(tensor, now):
            return None
        return seen.digests.get(box)


def remember(tensor: Any, before: State, box: Box, digest: str) -> None:
    """Remember ``digest``, the hash of ``box`` of ``tensor`` read after its state was
    ``before`` (a write during the save changes the version, so the entry is never used)."""
    global _pruned_at, _hooked
    with _lock:
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(_after_fused_step)
            _hooked = True
        seen = _seen.get(id(tensor))
        if seen is None or not seen.holds(tensor, before):
            seen = _seen[id(tensor)] = _Seen(tensor, before)
        seen.digests[box] = digest
        if len(_seen) >= _pruned_at:
            for key in [k for k, s in _seen.items() if s.ref() is None]:
                del _seen[key]
            _pruned_at = 2 * len(_seen) + 64


def forget() -> None:
    """Drop every remembered hash (tests; a process that wants every file hashed again)."""
    with _lock:
        _seen.clear()


def _after_fused_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Move the version counters of every tensor of ``optimizer``'s fused groups (their
    parameters and state) after its step: its fused kernel wrote them unseen."""
    tensors: list[Any] = []
    for group in optimizer.param_groups:
        if group.get("fused"):
            for p in group["params"]:
                tensors.append(p)
                tensors.extend(v for v in optimizer.state.get(p, {}).values() if is_tensor(v))
    if tensors:
        from torch.autograd.graph import increment_version

        increment_version(tensors)
