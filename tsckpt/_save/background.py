"""save_async(): copy the state to host memory, then save it in the background.

The caller is held only while the leaves are copied into staging buffers
(training mutates its tensors in place, and donates jax arrays to its next
jitted step, so even CPU tensors and jax arrays are copied). Writing,
syncing and the commit then run through the ordinary :func:`tsckpt.save` on the
staged tree, so the on-disk result and the crash guarantees are exactly those of a
synchronous save: in a writer process of its own (``writer="process"``,
tsckpt/_save/writer.py: the staging buffers are then shared memory it reads), or in one
worker thread of the caller's process (``writer="thread"``, and where a state cannot go
to a writer process).

Staging buffers are kept between saves, keyed by leaf path, shape and dtype, so
a training loop that saves the same state repeatedly allocates (and page-faults)
host memory once; buffers for leaves that disappeared are released before new
ones are allocated, so staging never holds more than one copy of the state.
Buffers for CUDA tensors are page-locked host memory made again only when the device
tensors change: views of the writer's shared block (page-locked by writer.py) when saves go
to a writer process, else of one private page-locked slab (tsckpt/_runtime/devicecopy.py);
their device-to-host copies are issued on a side stream, the CPU copies made meanwhile, and
awaited once, in the call. A jax.Array is staged shard by shard (each
distinct device shard this process holds, replicas once; tsckpt/_leaves/jaxarray.py):
the copies of all shards are started before any is awaited; a shard on a CPU device
is copied into a reused buffer, one elsewhere is kept as the host copy jax made
(fresh each save). A state larger than ``max_staging_bytes`` is saved synchronously,
whose copies from the device go through host memory of the write window only. With
``staging="overlapped"`` the tensors an optimizer of the saved objects updates are
copied after the call returns, that optimizer's next step held back until they are
(tsckpt/_save/guard.py).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import datetime
import functools
import logging
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, cast

import numpy as np

from .._base.lazytorch import is_tensor, loaded
from .._base.types import LazySource, ShardedArray
from .._coord.protocol import collective
from .._coord.torchdist import coordinator_for, rank_of, torch_initialized
from .._errors import DistributedError, SaveInProgressError
from .._leaves.jaxarray import JaxRegion, host_copy, is_jax_array, start_host_copy
from .._leaves.registry import describe, memory
from .._leaves.stateful import expand
from .._ondisk.records import LAYOUT_PLAIN
from .._options import (
    WRITE_WINDOW_BYTES,
    WRITERS,
    AsyncOptions,
    BaseDirectory,
    IfBusy,
    Incremental,
    SaveOptions,
    Staging,
    Writer,
    timeout_seconds,
    verb,
)
from .._runtime import devicecopy as _devicecopy
from .._runtime.memory import BACKGROUND_SAVE_THREAD
from .._runtime.threads import lower_priority, run_soon
from .._storage.locations import Directory, resolve
from ..tree import flatten, unflatten
from .guard import Guard

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

log = logging.getLogger("tsckpt")

# Failed saves whose outcome nobody has asked for yet.
_failed: weakref.WeakSet[AsyncSave] = weakref.WeakSet()


@atexit.register
def _report_unchecked_failures() -> None:
    """At exit (after pending saves finished), say which failed unseen: no one else will."""
    for handle in list(_failed):
        if not handle.retrieved:
            err = concurrent.futures.Future.exception(handle)
            sys.stderr.write(
                f"tsckpt: the asynchronous save to {handle.directory} failed and its result() was never "
                f"checked: {type(err).__name__}: {err}\n"
            )


class AsyncSave(concurrent.futures.Future):  # type: ignore[type-arg]
    """Handle of a save that continues in the background: a :class:`concurrent.futures.Future`.

    ``result(timeout)`` waits for the commit and re-raises a background failure
    (``timeout``: a :class:`datetime.timedelta` as on every tsckpt verb, or float
    seconds as on any Future); ``done()`` tells whether it finished. ``blocked_s``
    is how long the call that started it held the caller, ``staged_bytes`` how
    much array data it copied, ``deferred_bytes`` how much of that it copied after
    returning (``staging="overlapped"``), which ``wait_for_staging()`` waits for,
    ``writer_peak_bytes`` the peak resident memory of the writer process that saved
    it, once it is done (None: saved by a thread).
    """

    def __init__(self, directory: str, staged_bytes: int, guard: Guard | None = None) -> None:
        super().__init__()
        self.directory = directory
        self.staged_bytes = staged_bytes
        self.blocked_s = 0.0
        self.writer_peak_bytes: int | None = None
        self.retrieved = False  # result() or exception() has reported the outcome
        self._guard = guard
        self._tidied = threading.Event()  # the save's housekeeping after its outcome is over (tidy)

    @property
    def deferred_bytes(self) -> int:
        """Bytes of the staged arrays copied after the call returned (overlapped staging)."""
        return self._guard.deferred_bytes if self._guard is not None else 0

    def wait_for_staging(self, timeout: datetime.timedelta | float | None = None) -> None:
        """Wait until the save no longer reads the live tensors, so anything may write into them.

        With ``staging="overlapped"``, before code other than the optimizers' own steps
        writes into an optimizer's parameters or state (see tsckpt/_save/guard.py); call it
        from the thread that trains. A failed copy is not raised here but by ``result()``.
        Raises TimeoutError after ``timeout`` (a timedelta, or seconds)."""
        seconds = timeout_seconds(timeout)
        if self._guard is not None and not self._guard.wait(seconds):
            raise TimeoutError(
                f"asynchronous save to {self.directory} still copying the live tensors after {seconds:g} s"
            )

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if super().exception() else "committed")
        return f"AsyncSave({self.directory!r}, {state})"

    def result(self, timeout: datetime.timedelta | float | None = None) -> None:
        """Wait until the checkpoint is committed; re-raise the background error if the save failed.

        Raises TimeoutError if it is still running after ``timeout`` (a timedelta, or
        seconds; None waits as long as it takes)."""
        seconds = timeout_seconds(timeout)
        try:
            super().result(seconds)
        except concurrent.futures.TimeoutError:
            raise self._still_running(seconds) from None
        finally:
            self.retrieved = self.retrieved or self.done()

    def exception(self, timeout: datetime.timedelta | float | None = None) -> BaseException | None:
        """The background error (None on success), waiting up to ``timeout`` (a timedelta, or seconds)."""
        seconds = timeout_seconds(timeout)
        try:
            err = super().exception(seconds)
        except concurrent.futures.TimeoutError:
            raise self._still_running(seconds) from None
        self.retrieved = True
        return err

    def _still_running(self, seconds: float | None) -> TimeoutError:
        return TimeoutError(f"asynchronous save to {self.directory} still running after {seconds:g} s")

    def run(self, job: Callable[[Any], None], tree: Any, behind: Sequence[AsyncSave] = ()) -> None:
        """Run ``job(tree)`` and settle this future with its outcome (in the worker thread), then
        the job's housekeeping (:func:`tidy`). ``behind``: earlier saves whose housekeeping must
        be over first (:data:`TIDY_BEHIND`)."""
        if not self.set_running_or_notify_cancel():
            self.tidied()
            return
        try:
            for earlier in behind:
                earlier.wait_tidied()
            if self._guard is not None:
                self._guard.join()  # the copies left after the call
            job(tree)
        except BaseException as e:  # noqa: BLE001 - delivered through result()
            self.settle(e)
        else:
            self.settle(None)
        run_soon(functools.partial(self._tidy, job), name="tsckpt-tidy", nice=BACKGROUND_NICE)  # beside the next save

    def _tidy(self, job: Any) -> None:
        try:
            tidy(job)
        finally:
            self.tidied()

    def tidied(self) -> None:
        """Mark the save's housekeeping over (run by whoever ran it, or found it will not run)."""
        self._tidied.set()

    def wait_tidied(self, timeout: float | None = None) -> bool:
        """Wait until the save's housekeeping after its outcome is over (:meth:`AsyncSaver.wait`)."""
        return self._tidied.wait(timeout)

    def settle(self, error: BaseException | None) -> None:
        """End the save: committed (``error`` None), or failed with ``error``."""
        if error is None:
            self.set_result(None)
        else:
            self.set_exception(error)
            _failed.add(self)


def tidy(job: Any) -> None:
    """A save job's housekeeping once its outcome is out (a manager's job: removing the files of
    the steps its retention renamed away), where it has any; a failure there is logged, never
    the save's: the step is committed, and a later save's clean-up removes what is left."""
    done: Callable[[], None] | None = getattr(job, "tidy", None)
    if done is None:
        return
    try:
        done()
    except Exception as e:  # noqa: BLE001
        log.warning("tsckpt: removing the files of expired steps failed (a later save removes them): %s", e)


def _copy_now(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """The copies a call makes, in one call into torch that runs without the interpreter
    (no_grad: a parameter's copy records nothing)."""
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """What :meth:`_Staging.stage` decided for regions of one signature: each region's copy
    (tied regions share one), which are copied in the call and which later, into which buffers."""

    signature: tuple[Any, ...]
    deferred: frozenset[Any] | None  # the guard's deferred memory the decisions were made with
    reserve: Any  # the staging's buffer maker they were made with
    out: list[Any]
    now: list[int]
    now_buffers: list[Any]
    later: list[int]
    later_buffers: list[Any]
    arrays: list[int]  # the numpy arrays', copied in the call
    array_buffers: list[Any]
    addresses: tuple[int, ...]  # where each region's memory was
    held: frozenset[int]  # the regions whose place matters: tied to another, or deferred

    def fits(self, data: list[Any]) -> bool:
        """Whether the decisions hold for ``data``, regions of the plan's signature: every region
        is where it was, or moved (a state made anew at each call, as the RNG states are) where
        no other region is and no deferred memory is, being neither tied nor deferred itself."""
        now = [_address(d) for d in data]
        if now == list(self.addresses):
            return True
        moved = [i for i, (a, b) in enumerate(zip(now, self.addresses)) if a != b]
        if any(i in self.held for i in moved):
            return False
        taken = set(self.addresses)
        taken.update(p for p, _ in self.deferred or ())
        fresh = [now[i] for i in moved if now[i]]
        return len(set(fresh)) == len(fresh) and not any(a in taken for a in fresh)

    def replay(self, data: list[Any]) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        _copy_now(self.now_buffers, [data[i] for i in self.now])
        for buf, i in zip(self.array_buffers, self.arrays):
            np.copyto(buf, data[i], casting="no")
        return list(self.out), [(b, data[i]) for b, i in zip(self.later_buffers, self.later)]


class _Staging:
    """Reusable host buffers, keyed by (path, kind, shape, dtype, pinned)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self._plan: _Plan | None = None  # the last stage()'s decisions, for a next call on the same regions
        # Makes the host arrays' buffers ahead of the copies, all at once, given the buffers
        # and the keys (the writer process's shared block: writer.py); None: each at its copy.
        self.reserve: Callable[[dict[tuple[Any, ...], Any], list[tuple[Any, ...]]], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def release(self) -> None:
        """Drop every buffer: a closed saver keeps no copy of the state."""
        self._buffers = {}
        self._plan = None

    @staticmethod
    def _key(path: Any, data: Any) -> tuple[Any, ...]:
        if is_tensor(data):
            return (path, "torch", tuple(data.shape), data.dtype, data.device.type in _devicecopy.DEVICE_TYPES)
        # the dtype itself: its .str is '<V1' for several float8 formats alike
        if is_jax_array(data):
            return (path, "jax", tuple(data.shape), np.dtype(data.dtype))
        return (path, "numpy", tuple(data.shape), data.dtype)

    def stage(
        self, regions: list[tuple[Any, Any]], *, guard: Guard | None = None, signature: tuple[Any, ...] | None = None
    ) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Copy each ``(path, data)`` into its buffer; returns the copies in order, and the
        ``(buffer, tensor)`` copies left to make: those of CPU tensors the ``guard`` defers.

        ``path`` is unique per region (a jax shard's: the leaf path and its box). Regions
        that are the same memory (tied weights) share one copy, so the
        save that follows still sees them tied and stores them once. Device tensors
        are copied asynchronously into one page-locked slab and awaited once; the
        copies of all jax shards start before the first is awaited.

        ``signature``: what identifies the regions when they are all plain CPU tensors
        (:class:`_Checked`'s keys: path, memory, shape, strides, dtype, device); a call
        with the signature, deferred set and buffers of the last repeats its decisions
        (:class:`_Plan`) without looking at each region again."""
        deferred = guard.deferred if guard is not None else None
        plan = self._plan
        sources = [d for _, d in regions]
        if (
            plan is not None and plan.signature == signature and plan.deferred == deferred
            and plan.reserve is self.reserve and plan.fits(sources)
        ):
            return plan.replay(sources)
        self._plan = None
        keys = [self._key(p, d) for p, d in regions]
        wanted = set(keys)
        # release what this tree no longer has before allocating what it gained
        kept = {k: b for k, b in self._buffers.items() if k in wanted}
        self._buffers = kept
        staged: list[int | None] = []  # per region: None where it is staged, else the region it is tied to
        first: dict[Any, int] = {}  # memory -> index of the region that staged it (tied leaves)
        for i, (_, data) in enumerate(regions):
            mem = memory(data) if _nbytes(data) else None
            staged.append(first.get(mem) if mem is not None else None)
            if mem is not None:
                first.setdefault(mem, i)
        on_device = [k for k, tied in zip(keys, staged) if tied is None and k[1] == "torch" and k[-1]]
        if self.reserve is not None:  # the shared block: host arrays, and device tensors where it can be page-locked
            host = [k for k, tied in zip(keys, staged) if tied is None and _in_host_memory(k)]
            self.reserve(self._buffers, host + on_device)
        self._pin(on_device if self.reserve is None else [k for k in on_device if k not in self._buffers])
        for key, (_, data), tied in zip(keys, regions, staged):
            if tied is None and key[1] == "jax":
                start_host_copy(data)
        out: list[Any] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        now: list[tuple[torch.Tensor, torch.Tensor]] = []  # the CPU tensors' copies, made at once below
        now_at: list[int] = []  # the region of each
        later_at: list[int] = []
        from_device: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device tensor, page-locked buffer)
        for key, (_, data), tied in zip(keys, regions, staged):
            if tied is not None:
                out.append(out[tied])
                continue
            buf = kept.get(key)
            if key[1] == "torch":
                if key[-1]:  # on a device
                    buf = kept[key]  # made by reserve or _pin
                    from_device.append((data.detach(), buf))
                else:
                    if buf is None:
                        buf = torch.empty(data.shape, dtype=data.dtype)
                    if guard is not None and guard.defers(data):
                        later.append((buf, data))
                        later_at.append(len(out))
                    else:
                        now.append((buf, data))
                        now_at.append(len(out))
            elif key[1] == "jax":
                buf, reusable = host_copy(data, buf)
                if not reusable:  # jax's own host copy: this save's alone, never kept for the next
                    kept.pop(key, None)
                    out.append(buf)
                    continue
            else:
                if buf is None:
                    buf = np.empty(data.shape, dtype=data.dtype)
                np.copyto(buf, data, casting="no")
            kept[key] = buf
            out.append(buf)
        if later:
            ranked = Guard.order([src.nbytes for _, src in later])
            later, later_at = [later[j] for j in ranked], [later_at[j] for j in ranked]
        started = _devicecopy.ops().to_host_all(from_device) if from_device else None
        if signature is not None and not from_device and all(k[1] in ("torch", "numpy") for k in keys):
            numpy_at = [i for i, k in enumerate(keys) if k[1] == "numpy" and staged[i] is None]
            bound = {i for i, t in enumerate(staged) if t is not None} | {t for t in staged if t is not None}
            self._plan = _Plan(
                signature, deferred, self.reserve, out, now_at, [b for b, _ in now], later_at, [b for b, _ in later],
                numpy_at, [out[i] for i in numpy_at], tuple(_address(d) for d in sources), frozenset(bound | set(later_at)),
            )
        _copy_now([b for b, _ in now], [d for _, d in now])  # while the device copies run
        if started is not None:
            _devicecopy.ops().wait(started)  # once, before the call returns (see guard.py: never deferred)
        return out, later

    def _pin(self, keys: list[tuple[Any, ...]]) -> None:
        """Buffers for the device tensors that ``reserve`` did not place (all of them without a
        writer process, or where its shared block could not be page-locked): kept from the last
        save when every one of them is, else all made again in one page-locked slab (the old ones
        released first, so staging never holds the device tensors twice; a slab is freed only
        with all its buffers)."""
        if not keys or all(k in self._buffers for k in keys):
            return
        for k in keys:
            self._buffers.pop(k, None)
        slab = _devicecopy.PinnedSlab([(k[3], k[2]) for k in keys])
        self._buffers.update(zip(keys, slab.views()))


def _in_host_memory(key: tuple[Any, ...]) -> bool:
    """Whether a staging key's buffer is plain host memory: a numpy array or a CPU tensor's."""
    return key[1] == "numpy" or (key[1] == "torch" and not key[-1])


class _Checked:
    """The plain tensors and numpy arrays a previous save of the same saver found storable: a
    training loop saves the same tensors every time, and checking each again is most of the
    per-leaf work of a ``save_async`` call. A leaf's key holds what its check looks at (path,
    type, shape, strides, dtype, device) but not its address, so that it also names the
    regions of a save (:class:`_Plan`); a tensor is known by its key and address (a freed
    storage has none). Only the leaves of this save are kept for the next.

    Where a save's array leaves were all plain, the verdict on its whole leaf list is kept too
    (:class:`_Verdict`): a next call whose leaves have the same paths and types, and whose
    arrays the same shapes, strides, dtypes and devices, takes it with one look at each array
    (:meth:`replay`) instead of a check per leaf; its other leaves are checked as always."""

    def __init__(self) -> None:
        self._last: set[tuple[Any, ...]] = set()
        self._now: set[tuple[Any, ...]] = set()
        self._types: tuple[type, ...] = ()
        self._strided: Any = None
        self.verdict: _Verdict | None = None

    def key(self, path: str, leaf: Any) -> tuple[Any, ...] | None:
        """The leaf's key where it is a plain tensor (a torch.Tensor or Parameter, no subclass) or
        numpy array, else None."""
        cls = type(leaf)
        if cls is np.ndarray:  # a byte-swapped array is saved through a native copy: checked in full
            return (path, cls, leaf.shape, leaf.strides, leaf.dtype) if leaf.dtype.isnative else None
        if not self._types:
            t = loaded()
            if t is None:  # no tensor exists
                return None
            self._types, self._strided = (t.Tensor, t.nn.Parameter), t.strided
        if cls not in self._types or leaf.layout is not self._strided:  # sparse: checked in full
            return None
        return (path, cls, leaf.shape, leaf.stride(), leaf.dtype, leaf.device)

    def known(self, key: tuple[Any, ...], leaf: Any) -> bool:
        """Whether the last save checked this leaf; remembered for the next."""
        entry = (key, _address(leaf)) if type(leaf) is not np.ndarray else key
        self._now.add(entry)
        return entry in self._last

    def turn(self) -> None:
        """End of a save: what it checked is what the next may skip."""
        self._last, self._now = self._now, set()

    def replay(self, paths: list[str], leaves: list[Any]) -> _Regions | None:
        """The last verdict where it holds for these leaves (class docstring), else None."""
        v = self.verdict
        if v is None or len(leaves) != len(v.types) or list(map(type, leaves)) != v.types or paths != v.paths:
            return None
        try:
            looks = [_look(leaves[i]) for i in v.arrays]
        except Exception:  # noqa: BLE001 - a tensor without strides or memory now: checked in full
            return None
        if looks != v.looks:
            return None
        out: list[Any] = [None] * len(leaves)
        for i in v.others:
            out[i] = _settled(paths[i], leaves[i])
        regions = [(i, paths[i], leaves[i], None) for i in v.arrays]
        return _Regions(out, regions, v.signature, v.nbytes)

    def remember(self, paths: list[str], leaves: list[Any], found: _Regions) -> None:
        """Keep ``found``'s verdict for :meth:`replay` where every region is a whole plain array."""
        self.verdict = None
        if found.signature is None:
            return
        arrays = [i for i, _, _, _ in found.regions]
        whole = set(arrays)
        self.verdict = _Verdict(
            list(paths), list(map(type, leaves)), arrays, [_look(leaves[i]) for i in arrays],
            [i for i in range(len(leaves)) if i not in whole], found.signature, found.nbytes,
        )


def _look(leaf: Any) -> tuple[Any, ...]:
    """What a plain array's check depends on besides its type (:meth:`_Checked.replay`)."""
    if type(leaf) is np.ndarray:
        return (leaf.shape, leaf.strides, leaf.dtype)
    return (leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.data_ptr() == 0)  # 0: freed, or empty


@dataclasses.dataclass(frozen=True, eq=False)
class _Verdict:
    """:func:`_array_regions`' result for a leaf list whose array leaves were all plain."""

    paths: list[str]
    types: list[type]
    arrays: list[int]  # the array leaves' indices
    looks: list[tuple[Any, ...]]  # each one's :func:`_look`
    others: list[int]  # the other leaves' indices: checked at every call
    signature: tuple[Any, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Regions:
    """:func:`_array_regions`' result: the leaves with plain values final (None at the
    arrays), each array region ``(index, path, data, where)``, their signature for
    :meth:`_Staging.stage` (None unless all are plain tensors or numpy arrays) and their bytes."""

    out: list[Any]
    regions: list[tuple[int, Any, Any, Any]]
    signature: tuple[Any, ...] | None
    nbytes: int


def _address(data: Any) -> int:
    """Where a tensor's or numpy array's memory starts."""
    return int(data.data_ptr()) if type(data) is not np.ndarray else int(data.__array_interface__["data"][0])


def _settled(path: str, leaf: Any) -> Any:
    """A leaf that is not an array region, checked (LeafTypeError for unsupported leaves), as
    the staged tree holds it: plain values final, numpy scalars and lazy sources as they are
    (immutable)."""
    describe(path, leaf)
    return _final(leaf)


def _final(value: Any) -> Any:
    """A plain value as the staged tree holds it (a bytearray may change after the call)."""
    return bytes(value) if isinstance(value, bytearray) else value


def _array_regions(paths: list[str], leaves: list[Any], checked: _Checked | None = None) -> _Regions:
    """Validate every leaf (errors surface in the caller) and pick out the array data to copy.

    The regions: for each array leaf ``(index, path, data, where)``; ``where`` is None for a
    whole array, the ``(global_shape, offsets)`` of a region (ShardedArray, DTensor shard),
    or for a jax.Array its :class:`JaxRegion`, one entry per distinct shard this process
    holds (``path``: the leaf path and the shard's box). ``checked``: plain tensors a
    previous call checked are not checked again (:class:`_Checked`)."""
    if checked is not None:
        again = checked.replay(paths, leaves)
        if again is not None:
            return again
    out: list[Any] = []
    regions: list[tuple[int, Any, Any, Any]] = []
    keys: list[Any] = []  # per region: its key where it is a plain tensor, else None
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        key = checked.key(path, leaf) if checked is not None else None
        if key is not None and cast(_Checked, checked).known(key, leaf):
            out.append(None)
            regions.append((i, path, leaf, None))
            keys.append(key)
            continue
        if is_jax_array(leaf):  # donated or deleted by the next step: its shards are copied
            leaf = JaxRegion.of(path, leaf)
        local = describe(path, leaf)  # raises LeafTypeError for unsupported leaves
        if local.desc.kind == "value":
            out.append(_final(leaf))
            continue
        if isinstance(leaf, (np.generic, LazySource)):  # immutable
            out.append(leaf)
            continue
        out.append(None)
        if isinstance(leaf, JaxRegion):
            regions.extend((i, (path, box), data, leaf) for box, data in leaf.shards.items())
        elif local.data is leaf:  # a whole tensor or numpy array
            regions.append((i, path, leaf, None))
            keys.append(key)
        else:  # ShardedArray, DTensor: a region, kept at its place in the global array
            regions.append((i, path, local.data, (local.desc.global_shape, local.desc.offsets)))
    keys.extend([None] * (len(regions) - len(keys)))  # jax shards and regions: never keyed
    found = _Regions(
        out, regions, tuple(keys) if None not in keys else None, sum(_nbytes(data) for _, _, data, _ in regions)
    )
    if checked is not None:
        checked.turn()
        checked.remember(paths, leaves, found)
    return found


def _place(leaves: list[Any], regions: list[tuple[int, Any, Any, Any]], copies: list[Any]) -> None:
    """Put the staged copies where their leaves were (a jax.Array's shards: one region of host copies)."""
    shards: dict[int, tuple[JaxRegion, list[Any]]] = {}
    for (i, _, _, where), copy in zip(regions, copies):
        if where is None:
            leaves[i] = copy
        elif isinstance(where, JaxRegion):
            shards.setdefault(i, (where, []))[1].append(copy)
        else:
            leaves[i] = ShardedArray(copy, *where)
    for i, (region, host) in shards.items():
        leaves[i] = region.on_host(host)


class AsyncSaver:
    """One background worker with its staging buffers; at most one save in flight.

    ``max_staging_bytes`` bounds every save it stages (None: no bound); a call may
    bound its own save further."""

    def __init__(self, *, max_staging_bytes: int | None = None) -> None:
        self.max_staging_bytes = max_staging_bytes
        self._staging = _Staging()
        self._checked = _Checked()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._inflight: AsyncSave | None = None
        self._untidied: list[AsyncSave] = []  # saves whose housekeeping may still run (wait() waits for it)
        self._process: Any = None  # writer.WriterSlot, made at the first save by a writer process

    @property
    def staging_bytes(self) -> int:
        """Host memory currently held by staging buffers."""
        return self._staging.nbytes

    def wait(self) -> None:
        """Wait for the save in flight, if any, and its housekeeping (its result is out at the
        commit; a manager's retention removes the files of expired steps after), and re-raise its
        failure, unless its ``result()`` or ``exception()`` reported it already (a ``close()`` in a
        ``finally`` would otherwise raise it again over the code that handled it)."""
        inflight = self._inflight
        try:
            if inflight is not None:
                inflight.wait_for_staging()
                if not inflight.retrieved:
                    inflight.result()
        finally:
            for handle in self._untidied:
                handle.wait_tidied()
            self._untidied = []

    def wait_for_staging(self) -> None:
        """Wait until the save in flight, if any, no longer reads the live tensors."""
        inflight = self._inflight
        if inflight is not None:
            inflight.wait_for_staging()

    def _settle(self, if_busy: IfBusy, job: Any = None, *, agreed_later: bool = False) -> str | None:
        """Wait for (or refuse next to) the save in flight; warn about an unchecked failure.
        Under torch.distributed ``if_busy="error"`` refuses on every rank of ``job``'s group
        when a save is still running on any (:func:`_busy_ranks`): a rank refusing alone would
        leave the others' save waiting for it, then paired with its next one. ``agreed_later``
        (a save_async call, whose agreement at its end decides this with the rest:
        :func:`_agree_call`): under torch.distributed nothing is refused here, and the label of
        the save still running on this rank under "error" is returned (it is not waited for)."""
        if if_busy not in ("wait", "error"):
            raise ValueError(f"if_busy must be 'wait' or 'error', not {if_busy!r}")
        prev = self._inflight
        busy = prev is not None and not prev.done()
        if agreed_later and _calls(job) is not None:
            if if_busy == "error" and busy and prev is not None:
                return prev.directory
        else:
            ranks = _busy_ranks(busy, if_busy, job)
            if if_busy == "error" and ranks:
                raise _refused_busy(prev.directory if busy and prev is not None else None, ranks)
        if prev is None:
            return None
        if not prev.done():
            concurrent.futures.wait([prev])
        prev.wait_for_staging()  # its copies into the buffers this save reuses; its hooks removed
        err = concurrent.futures.Future.exception(prev)
        if err is not None and not prev.retrieved:
            warnings.warn(
                f"the asynchronous save to {prev.directory} failed and its result() was never checked: "
                f"{type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=4,
            )
        prev.retrieved = True
        self._inflight = None
        return None

    def run(self, fn: Callable[[], None], *, if_busy: IfBusy = "wait", job: Any = None) -> None:
        """Run a synchronous save in the caller, after (or refusing) the one in flight (``job``:
        the save's job, whose options name the ranks that refuse together)."""
        with self._lock:
            self._settle(if_busy, job)
            fn()

    def submit(
        self,
        label: str,
        tree: Any,
        job: Callable[[Any], None],
        *,
        if_busy: IfBusy = "wait",
        prepare: Callable[[], None] | None = None,
        max_staging_bytes: int | None = None,
        staging: Staging = "blocking",
        rank: int = 0,
        writer: Writer = "thread",
    ) -> AsyncSave:
        """Stage ``tree``, then run ``job(staged_tree)`` in the worker thread, or with
        ``writer="process"`` the job's ``in_writer()`` in the writer process (writer.py;
        where the state or the job cannot go there, in the thread).

        ``prepare`` runs in the caller once any previous save has finished (for
        checks whose errors belong to the caller, and collective setup). Stateful
        objects in ``tree`` give their state then, in the caller (``rank``: this
        process's rank, for a whole state's per-rank part). A state
        with more array bytes than ``max_staging_bytes`` or the saver's own bound
        (the smaller applies) is saved in the caller instead, with a RuntimeWarning.
        ``staging="overlapped"``: the tensors an optimizer among the objects updates are
        copied after the call returns (tsckpt/_save/guard.py)."""
        limit = _least(self.max_staging_bytes, max_staging_bytes)
        start = time.perf_counter()
        with self._lock:
            busy_with = self._settle(if_busy, job, agreed_later=True)
            untidied = [h for h in self._untidied if not h.wait_tidied(0)]  # earlier saves' housekeeping still running
            failed: BaseException | None = None  # a KeyboardInterrupt too: the other ranks must learn of it
            try:
                if prepare is not None:
                    prepare()
                guard = Guard.of(tree) if staging == "overlapped" else None
                tree = expand(tree, rank=rank).tree
                flat = flatten(tree)
                found = _array_regions(flat.paths, flat.leaves, self._checked)
            except BaseException as e:  # noqa: BLE001 - every rank learns of it first (_agree_call)
                failed = e
            over = _agree_call(
                label, failed, failed is None and limit is not None and found.nbytes > limit, job, writer=writer,
                if_busy=if_busy, busy_with=busy_with,
            )
            leaves, regions, signature, nbytes = found.out, found.regions, found.signature, found.nbytes
            if over:
                why = (
                    f"the state has {nbytes} bytes of arrays, more than max_staging_bytes={limit}"
                    if limit is not None and nbytes > limit
                    else f"rank(s) {over} hold more array bytes than max_staging_bytes={limit} (every rank saves alike)"
                )
                warnings.warn(
                    f"saving to {label} synchronously: {why}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                handle = AsyncSave(label, 0)
                handle.run(job, tree)
                handle.retrieved = True
                handle.result()
            else:
                if writer == "process" and self._process is None:
                    from .writer import WriterSlot

                    self._process = WriterSlot()
                if writer == "process":
                    self._process.share(self._staging)
                copies, later = self._staging.stage(
                    [(path, data) for _, path, data, _ in regions], guard=guard, signature=signature
                )
                if later and guard is not None:
                    guard.start(later)
                else:
                    guard = None
                handle = AsyncSave(label, nbytes, guard)
                sent = writer == "process" and self._process.send(
                    handle, job, flat, leaves, regions, copies, ready=guard.join if guard is not None else None
                )
                if not sent:
                    _place(leaves, regions, copies)
                    del regions, copies  # no reference to the device arrays outlives the call
                    staged = unflatten(flat.spec, leaves)
                    if self._executor is None:
                        self._executor = concurrent.futures.ThreadPoolExecutor(
                            1, thread_name_prefix=BACKGROUND_SAVE_THREAD, initializer=_yield_to_training
                        )
                    behind = untidied[: max(0, len(untidied) - TIDY_BEHIND)]
                    self._executor.submit(handle.run, job, staged, behind)
            self._inflight = handle
            self._untidied = untidied + [handle]
        handle.blocked_s = time.perf_counter() - start
        return handle

    @property
    def writer_pid(self) -> int | None:
        """The process id of the writer process, while one runs."""
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Wait for the save in flight (re-raising a failure not reported yet: :meth:`wait`) and
        stop the workers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._staging.release()  # its views of the shared block first, then the block itself
            if self._process is not None:
                self._process.give_up()


# The saves whose housekeeping (retention's removals) may still run beside a save: one, the
# save before it. A save waits, before it starts, for the housekeeping of those before that
# (in its worker, never in the call): back-to-back saves whose removals lag behind their
# writes would pile up expired steps on disk without bound.
TIDY_BEHIND = 1

# The nice value of the background save's thread, and so of the writer threads it starts
# (Linux threads inherit it): where the CPUs are busy, the training loop goes first. Measured
# by benchmarks/bench_train.py (RESULTS.md, "Training loop").
BACKGROUND_NICE = 10


def _calls(job: Any) -> Any:
    """The coordinator of ``job``'s ranks (its save options' group) on a group of the save
    calls' own (a save in a background thread runs its protocol over the "background" one
    meanwhile), under torch.distributed with several ranks; else None."""
    options = getattr(job, "options", None)
    if options is None or not torch_initialized():
        return None
    coord = coordinator_for(options.group, options.timeout, channel="calls")
    return None if coord.world_size == 1 else coord


AGREEMENT = "save_async (the ranks' agreement)"  # the exchange every save_async call ends with, as errors name it
IF_BUSY_DIFFERS = (
    "ranks passed different if_busy options ('error' on some, 'wait' on others); every rank must pass the same"
)


def _refused_busy(running: str | None, ranks: list[int]) -> SaveInProgressError:
    """The refusal of a save under ``if_busy="error"``: ``running``, the save still running on
    this rank (None: on other ranks only), ``ranks`` those where one is."""
    what = f"an asynchronous save to {running}" if running is not None else "an asynchronous save"
    where = "" if ranks == [0] and running is not None else f" on rank(s) {ranks}, so every rank refuses this one"
    return SaveInProgressError(f"{what} is still running{where}; wait for it with .result(), or pass if_busy='wait'")


def _busy_ranks(busy: bool, if_busy: IfBusy, job: Any) -> list[int]:
    """With ``if_busy="error"``, the ranks where a save is still running (``busy``: on this
    one), asked of every rank (:func:`_calls`; one process: ``[0]`` or ``[]``), so that all
    refuse together; else ``[]``. Every rank takes part whatever its ``if_busy``, and ranks
    passing different ones all raise ValueError (those with "error" would wait for the others
    in this exchange, the others for them in the next). One small reduction; the ranks are
    gathered only when one is busy under "error"."""
    error = if_busy == "error"
    coord = _calls(job)
    if coord is None:
        return [0] if busy and error else []
    flags = (int(busy), int(error), int(not error))
    any_busy, any_error, no_error = collective(coord, AGREEMENT, lambda: coord.most(flags))
    if any_error and no_error:
        raise ValueError(IF_BUSY_DIFFERS)
    if not (error and any_busy):
        return []
    return [r for r, b in enumerate(collective(coord, AGREEMENT, lambda: coord.all_gather(busy))) if b]


def _agree_call(
    label: str, failed: BaseException | None, over: bool, job: Any, *, writer: Writer = "thread",
    if_busy: IfBusy = "wait", busy_with: str | None = None,
) -> list[int]:
    """Raise on every rank when the call failed on any (this rank's own error where it failed,
    else a DistributedError naming the ranks and their errors), so the ranks' saves stay in step
    (a rank failing alone before the protocol left the others' save to be paired with its
    next one), when the ranks passed different ``writer`` or ``if_busy`` options (their saves
    would run different protocols), or under ``if_busy="error"`` when a save is still running
    on any rank (``busy_with``: this rank's, :meth:`AsyncSaver._settle`); else the ranks over
    ``max_staging_bytes`` (``over``: this one's). Usually one small reduction (any failed, any
    over, any busy, the least and largest ``writer`` and ``if_busy``); every rank's details are
    gathered only when one of those calls for them."""
    coord = _calls(job)
    if coord is None:
        if failed is not None:
            raise failed
        return [0] if over else []
    code, error = WRITERS.index(writer), int(if_busy == "error")
    mine = (int(failed is not None), int(over), int(busy_with is not None), -code, code, -error, error)
    any_failed, any_over, any_busy, least, largest, least_error, most_error = collective(
        coord, AGREEMENT, lambda: coord.most(mine)
    )
    if not (any_failed or any_over or any_busy or -least != largest or -least_error != most_error):
        return []
    text = None if failed is None else f"{type(failed).__name__}: {failed}"
    found = collective(coord, AGREEMENT, lambda: coord.all_gather((text, over, writer, busy_with is not None)))
    errors = {r: t for r, (t, _, _, _) in enumerate(found) if t is not None}
    if failed is not None:
        raise failed
    writers = [w for _, _, w, _ in found]
    if len(set(writers)) > 1:
        odd = next(r for r, w in enumerate(writers) if w != writers[0])
        raise ValueError(
            f"the asynchronous save to {label}: ranks passed different writer options (rank 0 {writers[0]!r}, "
            f"rank {odd} {writers[odd]!r}); every rank must pass the same"
        )
    if -least_error != most_error:
        raise ValueError(IF_BUSY_DIFFERS)
    if errors:
        first = min(errors)
        raise DistributedError(
            f"the asynchronous save to {label} failed in the call on rank(s) {sorted(errors)} (rank {first}: "
            f"{errors[first]}); every rank raises, so the next save is again one save on every rank"
        )
    busy = [r for r, (_, _, _, b) in enumerate(found) if b]
    if busy:
        raise _refused_busy(busy_with, busy)
    return [r for r, (_, o, _, _) in enumerate(found) if o]


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority (Linux: per thread); elsewhere, nothing."""
    lower_priority(BACKGROUND_NICE)


def _least(*limits: int | None) -> int | None:
    """The smallest of the bounds given (None: no bound)."""
    given = [n for n in limits if n is not None]
    return min(given) if given else None


def _nbytes(data: Any) -> int:
    if is_tensor(data):
        return data.numel() * data.element_size()
    return int(data.nbytes)


def prepare_group(group: Any, timeout: datetime.timedelta | None) -> None:
    """Under torch.distributed, create the gloo group save() coordinates over now, in the
    caller's thread: creating a group is a collective on the default group, which must
    never run in the background next to the training loop's own collectives."""
    if torch_initialized():
        coordinator_for(group, timeout, channel="background")


_default = AsyncSaver()


@verb("tsckpt.save_async")
def save_async(
    directory: Directory,
    tree: Any,
    *,
    overwrite: bool = False,
    group: Any = None,
    check_replicas: bool = True,
    timeout: datetime.timedelta | None = None,
    max_inflight_bytes: int = WRITE_WINDOW_BYTES,
    layout: str = LAYOUT_PLAIN,
    inner_chunks: bool = True,
    progress: bool | None = None,
    incremental: Incremental = True,
    base: BaseDirectory = None,
    if_busy: IfBusy = "wait",
    max_staging_bytes: int | None = None,
    staging: Staging = "overlapped",
    writer: Writer = "process",
) -> AsyncSave:
    """Start saving ``tree`` and return as soon as it is copied to host memory.

    Writing, syncing and the commit continue in the background: by default in a
    writer process (started at the first call and reused; the staging buffers are
    shared memory it reads), with ``writer="thread"`` in a thread of this
    process (docs/architecture.md, "Asynchronous saves", says which states always
    go to the thread, and why). The result
    is the same checkpoint :func:`tsckpt.save` writes, with the same options
    (``overwrite``, ``group``, ``check_replicas``, ``timeout``,
    ``max_inflight_bytes``, ``layout``, ``progress``: see there; a bad value
    raises here, in the caller), and the returned handle's ``result()`` waits
    for it and re-raises a failure. A save still in flight from an earlier call
    is waited for first (``if_busy="error"`` raises SaveInProgressError
    instead). Every array of the tree (with ``staging="overlapped"``, the default, all but
    the optimizers' tensors below) is copied before the call returns (a
    jax.Array: each distinct shard this process holds, all copies started
    before any is awaited), so tensors may change in place and jax arrays be
    donated to the next step at once. Staging buffers are reused between calls;
    a state with more array bytes to stage than ``max_staging_bytes`` is saved
    synchronously instead, with a RuntimeWarning. With ``staging="overlapped"`` the
    parameters and state of the optimizers among the saved objects (a TrainState's, or
    optimizers in the tree) are copied after the call returns, each optimizer's next
    ``step()`` held back until its own are: the checkpoint still holds the values at the
    call; code that writes into them otherwise first calls the handle's
    ``wait_for_staging()``. Under torch.distributed every rank calls save_async; the
    background commit talks over a gloo group of its own (the writer processes' own
    group), never the training loop's group nor the one a synchronous tsckpt.save or
    restore uses meanwhile. A pending save is finished at interpreter exit.
    """
    options, refused = SaveOptions.checked(locals())  # a bad option raises on every rank (_agree_call)
    background, refused_too = AsyncOptions.checked(locals())
    return save_async_with(directory, tree, options, background, refused=refused or refused_too)


def save_async_with(
    directory: Directory, tree: Any, options: SaveOptions, background: AsyncOptions, *,
    refused: Exception | None = None,
) -> AsyncSave:
    """:func:`save_async` with its options gathered; ``refused``: a bad option's error
    (SaveOptions.checked), raised in the call on every rank, as is a bad directory; at once
    without torch.distributed, before waiting for a save in flight."""
    if refused is not None and not torch_initialized():
        raise refused

    try:
        label = str(resolve(directory))
    except Exception as e:  # noqa: BLE001 - raised in the call on every rank
        if not torch_initialized():
            raise
        label, refused = str(directory), refused or e
    found = refused

    def prepare() -> None:
        prepare_group(options.group, options.timeout)
        if found is not None:
            raise found

    return _default.submit(
        label, tree, SaveJob(directory, options), if_busy=background.if_busy,
        max_staging_bytes=background.max_staging_bytes, staging=background.staging, writer=background.writer,
        prepare=prepare, rank=rank_of(options.group),
    )


@dataclasses.dataclass(frozen=True)
class SaveJob:
    """save_async's job: :func:`tsckpt.save` of the staged tree, in a thread or a writer process."""

    directory: Directory
    options: SaveOptions

    def __call__(self, staged: Any) -> None:
        from .protocol import save

        save(self.directory, staged, **self.options.kwargs())

    def in_writer(self) -> SaveJob | None:
        """The job a writer process runs (its group: the writers' own), None where it cannot
        run there (see :func:`runs_in_writer`)."""
        if not runs_in_writer(self.directory):
            return None
        return dataclasses.replace(self, options=dataclasses.replace(self.options, group=None))


def runs_in_writer(directory: Directory) -> bool:
    """Whether a save to ``directory`` can run in another process: not to a ``memory://``
    location, which lives in one process's memory."""
    return resolve(directory).spec.get("driver") != "memory"
