"""Overlapped staging: the copies ``save_async`` leaves until after it returns, and the hooks
that keep the checkpoint at the values of the call.

With ``staging="overlapped"`` a background save returns before it has copied the tensors
that an optimizer among the saved objects updates in place: that optimizer's parameters
and its state (moments). Those are copied in a thread of their own, smallest first, in
batches that each are one call into torch run without the interpreter, while training goes on, and the next ``step()`` of such an optimizer is held back by a step
pre-hook until its own tensors are copied. Everything else is copied before the call
returns, as with ``staging="blocking"``: buffers (the forward that updates them follows
the call at once, so holding it back would only move the wait), tensors that no optimizer
of the saved objects holds (given in a plain dict, or a module's own without its optimizer),
tensors smaller than :data:`DEFER_MIN_BYTES`, non-contiguous views, numpy arrays, device tensors
and jax arrays; plain values and stateful objects' states are taken at the call in both
modes.

Device (CUDA) tensors are copied in the call, on a side stream awaited once: deferring them
would need the optimizer's hook to order the training stream after the copies, and every
other write into them on any stream (a forward's buffers, the caching allocator reusing a
freed source) ordered too, which no hook sees; into page-locked memory the copies run at
the device's transfer rate, so the call is held for little more than that.

What no hook sees: a write into such a parameter or state that is not that optimizer's
step (an EMA or weight clipping written into the parameters, a module's
``load_state_dict``, ``tsckpt.restore`` in place (the manager's ``restore`` waits by
itself), moments reset by hand, another optimizer over the same parameters). Code that
does this calls ``AsyncSave.wait_for_staging()`` first.

torch runs an optimizer's step pre-hooks by iterating their dict live, so a hook may not be
removed while they run: neither by itself nor by the copying thread, which finishes while
the training thread waits inside the hook. The hooks are therefore removed by calls the
training thread makes (``wait_for_staging()``, the next save, ``wait()`` and ``close()`` of
the saver); until then a hook whose copies are done returns at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .._base.lazytorch import is_tensor, loaded
from .._leaves.dtensor import is_dtensor
from .._leaves.stateful import is_stateful, is_whole_state
from .._runtime.threads import run_soon
from ..tree import leaves

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# The name of the thread that makes the deferred copies.
STAGING_THREAD = "tsckpt-staging"

# Tensors smaller than this are copied in the call even when overlapped. None are: since the
# deferred copies are batched (COPY_BATCH_BYTES), deferring a small tensor costs the copying
# thread no per-tensor work holding the interpreter, and the call saves its copy
# (benchmarks/RESULTS.md, "save_async call time"); kept as the one place to change it.
DEFER_MIN_BYTES = 0

Span = tuple[int, int]  # (address, bytes) of a contiguous CPU tensor's memory


# The deferred copies are made in batches of about this many bytes, each one call into torch
# that runs without the interpreter (a copy per call would hold it once per tensor, beside a
# training loop that needs it); a batch has one tensor at least.
COPY_BATCH_BYTES = 4 << 20


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """One batch of deferred copies (a function of its own: tests slow it down so that training races it)."""
    with torch.no_grad():
        torch._foreach_copy_(dst, src)


def _batches(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Where each batch of ``copies`` ends (exclusive indices, the last ``len(copies)``): runs of
    up to :data:`COPY_BATCH_BYTES`, one copy at least each."""
    ends: list[int] = []
    size = 0
    for i, (_, src) in enumerate(copies):
        size += src.nbytes
        if size >= COPY_BATCH_BYTES:
            ends.append(i + 1)
            size = 0
    if not ends or ends[-1] != len(copies):
        ends.append(len(copies))
    return ends


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory a save copies: a DTensor's local shard, else the tensor."""
    return cast(torch.Tensor, t.to_local()) if is_dtensor(t) else t  # type: ignore[attr-defined]


def hookable(optim: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose step pre-hooks run when ``optim`` steps: ``optim`` when its class's
    ``step`` runs torch's hooks, else the optimizer a wrapper steps (its ``optimizer``, as
    accelerate's wrapper holds); None where there is none (its tensors are then copied at the call)."""
    seen: set[int] = set()
    t = loaded()  # no optimizer exists before torch is imported
    while t is not None and isinstance(optim, t.optim.Optimizer) and id(optim) not in seen:
        seen.add(id(optim))
        if getattr(type(optim).step, "hooked", False) and isinstance(
            getattr(optim, "_optimizer_step_pre_hooks", None), dict
        ):
            return optim
        optim = getattr(optim, "optimizer", None)
    return None


def saved_objects(tree: Any) -> list[Any]:
    """The stateful objects a save of ``tree`` asks for their state: those in the tree, and a
    whole state's own (``__tsckpt_objects__()``, where it says which)."""
    if is_whole_state(tree):
        own: Callable[[], list[Any]] | None = getattr(tree, "__tsckpt_objects__", None)
        return [o for part in (own() if own is not None else []) for o in saved_objects(part)]
    if is_stateful(tree):
        return [tree]
    found, _ = leaves(tree, stop=lambda node: is_stateful(node) or is_whole_state(node))
    return [o for o in found if is_stateful(o)]


def _span(t: Any) -> Span | None:
    """The memory of ``t`` where overlapped staging may copy it later: a plain, dense,
    contiguous CPU tensor (or parameter) of at least :data:`DEFER_MIN_BYTES`; else None
    (tensor subclasses, sparse tensors and views are copied at the call). Runs once per
    tensor per save, hence torch's types looked up once."""
    plain, strided = _torch_types()
    if type(t) not in plain or not t.is_cpu or t.layout is not strided:
        return None
    n = t.nbytes
    if n == 0 or n < DEFER_MIN_BYTES or not t.is_contiguous():
        return None
    ptr = t.data_ptr()
    return (ptr, n) if ptr else None


_TYPES: tuple[tuple[type, ...], Any] | None = None


def _torch_types() -> tuple[tuple[type, ...], Any]:
    """(torch.Tensor and nn.Parameter exactly, torch.strided), looked up once torch is imported."""
    global _TYPES
    if _TYPES is None:
        t = loaded()
        if t is None:  # no tensor exists: nothing is deferred
            return (), None
        _TYPES = ((t.Tensor, t.nn.Parameter), t.strided)
    return _TYPES


# Per optimizer, the spans :func:`_updated_by` found last, with the tensors' identities and
# addresses they were found for: a training loop's optimizer keeps its tensors between saves.
_SPANS: weakref.WeakKeyDictionary[Any, tuple[Any, set[Span]]] = weakref.WeakKeyDictionary()


def _updated_by(optim: torch.optim.Optimizer) -> set[Span]:
    """The memory of the tensors ``optim.step()`` writes that may be copied later: its
    parameters and state. Found again only when a tensor is another object or moved: a span
    found for a tensor that since changed its size or strides in place is harmless, since
    :meth:`Guard.defers` defers only a region whose own span is among them."""
    tensors = [p for g in optim.param_groups for p in g["params"]]
    tensors += [v for s in optim.state.values() for v in s.values() if is_tensor(v)]
    try:
        # a DTensor's own address is 0: its local shard's is what moves
        seen = (DEFER_MIN_BYTES, [(id(t), t.data_ptr() or _local(t).data_ptr()) for t in tensors])
    except RuntimeError:  # a tensor without an address (a fake tensor): found at every save
        seen = None
    kept = _SPANS.get(optim)
    if seen is not None and kept is not None and kept[0] == seen:
        return kept[1]
    spans = {m for m in (_span(_local(t)) for t in tensors) if m is not None}
    if seen is not None:
        _SPANS[optim] = (seen, spans)
    return spans


class Guard:
    """The deferred copies of one save and the hooks that hold back the optimizers' steps."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._updates = {id(o): (o, _updated_by(o)) for o in optimizers}
        self._deferred: set[Span] = set().union(*(m for _, m in self._updates.values()))
        self._cond = threading.Condition()
        self._done = 0  # copies made, in order (counted where a held-back step waits for one)
        self._needed: set[int] = set()  # the copies after which a held-back step may go on
        self._finished = False  # every copy made, or one failed
        self._error: BaseException | None = None
        self._handles: list[Any] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._running: concurrent.futures.Future[Any] | None = None
        self.deferred_bytes = 0

    @classmethod
    def of(cls, tree: Any) -> Guard | None:
        """The guard of a save of ``tree``; None where it holds no optimizer whose step can be held back."""
        found = {id(o): o for o in (hookable(obj) for obj in saved_objects(tree)) if o is not None}
        return cls(list(found.values())) if found else None

    @property
    def deferred(self) -> frozenset[Span]:
        """The memory this guard's optimizers update, which :meth:`defers` takes."""
        return frozenset(self._deferred)

    def defers(self, data: Any) -> bool:
        """Whether ``data`` (a region a save stages) may be copied after the call returns."""
        return _span(data) in self._deferred

    @staticmethod
    def order(sizes: list[int]) -> list[int]:
        """The order in which :meth:`start` takes copies of ``sizes`` bytes (indices into them):
        smallest first, so that the steps of small optimizers go on soonest (the staging
        orders a loop's copies once, and replays them in this order)."""
        return sorted(range(len(sizes)), key=sizes.__getitem__)

    def start(self, order: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hook the optimizers, then make the copies ``order`` ((staging buffer, source) pairs,
        each source one :meth:`defers` took, in :meth:`order`) in a thread of their own, in
        batches; each optimizer's next step waits for the copies of its own tensors."""
        position = {src.data_ptr(): i for i, (_, src) in enumerate(order)}  # each a span defers() took
        self.deferred_bytes = sum(src.nbytes for _, src in order)
        for optim, memories in self._updates.values():
            need = max((position[p] for p, _ in memories if p in position), default=-1)
            if need >= 0:
                self._needed.add(need)
                self._handles.append(optim.register_step_pre_hook(self._hold(need)))
        self._copies = order
        self._running = run_soon(self._run, name=STAGING_THREAD)

    def _hold(self, need: int) -> Callable[..., None]:
        def hook(optim: Any, args: Any, kwargs: Any) -> None:
            with self._cond:
                self._cond.wait_for(lambda: self._finished or self._done > need)

        return hook

    def _run(self) -> None:
        try:
            start = 0
            for end in _batches(self._copies):
                batch = self._copies[start:end]
                _copy([dst for dst, _ in batch], [src for _, src in batch])
                if any(i in self._needed for i in range(start, end)):  # a step may wait for one: wake it
                    with self._cond:
                        self._done = end
                        self._cond.notify_all()
                start = end
        except BaseException as e:  # noqa: BLE001 - raised by join(), in the save
            self._error = e
        finally:
            self._copies = []  # no reference to the live tensors outlives the copies
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    @property
    def finished(self) -> bool:
        """Whether every copy is made (or one failed): nothing is held back any more."""
        return self._finished

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every copy is made (or one failed), then remove the hooks: from the thread
        that trains, never inside an optimizer's step. False if still copying after ``timeout`` seconds."""
        if not self._over(timeout):
            return False
        self.release()
        return True

    def join(self) -> None:
        """Wait until every copy is made; re-raise the failure of one (in the save's worker)."""
        self._over(None)
        if self._error is not None:
            raise self._error

    def _over(self, timeout: float | None) -> bool:
        """Wait for the copying thread to end (False: still running after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished, timeout):
                return False
        if self._running is not None:
            self._running.result()  # it has nothing left to do but return
        return True

    def release(self) -> None:
        """Remove the hooks once the copies are over (see the module docstring for who may)."""
        if self._finished:
            handles, self._handles = self._handles, []
            for h in handles:
                h.remove()
