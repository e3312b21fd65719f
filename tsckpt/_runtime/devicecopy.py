"""Copies between device (CUDA) memory and host memory through reused page-locked buffers,
in bounded pieces that overlap with the reads and writes they feed.

A save copies each shard box of a device tensor into host memory just before its write
(:class:`ToHost`), one copy ahead of the writes, so the copy of the next box runs on the
device while the previous one is written; a restore into device targets reads pieces of
each destination into host memory and copies them to the device
(:class:`ToDevice`), so the read of the next pieces runs while the device copies the
previous ones. Both lend their host memory from one :class:`HostRing` of the verb's
``max_inflight_bytes``: at no time is more host memory held for the copies, whatever the
size of the state (a single piece larger than that, as a save's shard of one inner
chunk can be, runs alone in a ring of its size), and the ring's memory is reused piece
after piece. ``save_async``
stages a whole state at once (:meth:`DeviceOps.to_host_all`: on a side stream, awaited
once) into one :class:`PinnedSlab`, or into the writer process's shared block, which
tsckpt/_save/writer.py page-locks with :meth:`DeviceOps.register`; either is registered
once and reused by the saves that follow.

The steps that need a device are the methods of :class:`DeviceOps` (allocate page-locked
host memory, start a copy, wait for it); everything else (the ring, the pieces, the
order of the copies, the bound) is plain code, which the tests run on the CPU with
ordinary tensors and synchronous copies standing in for those steps.
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any


from .._base.lazytorch import is_tensor
from .._base.types import Box
from .._storage.native import aligned_size

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# Offsets of the pieces in host memory (and of the tensors in a slab) are multiples of
# ALIGN (page-aligned, :func:`align`), so every dtype is aligned and direct I/O could use them.

# Tensors on these device types go through this module; CPU tensors never do.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def on_device(data: Any) -> bool:
    """Whether ``data`` is a tensor in device memory, which needs a copy to reach the host."""
    return is_tensor(data) and data.device.type in DEVICE_TYPES


align = aligned_size  # n rounded up to a multiple of ALIGN


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DeviceOps:
    """The steps that need a CUDA device; nothing else in this module touches one."""

    def pinned(self, size: int) -> torch.Tensor:
        """``size`` bytes of page-locked host memory, from torch's caching host allocator,
        which keeps freed blocks for the next request of their size (the rings of the
        next save or restore reuse them)."""
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def registered(self, size: int) -> torch.Tensor:
        """``size`` bytes of host memory page-locked by registering it (exactly ``size``:
        the caching allocator rounds a block up to a power of two, up to twice the state
        for a slab of it); unregistered when its storage is freed. As DCP's stager does."""
        t = torch.empty(size, dtype=torch.uint8)
        if size:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            self.register(ptr, size)
            weakref.finalize(storage, self.unregister, ptr).atexit = False  # not after CUDA is torn down
        return t

    def register(self, ptr: int, size: int) -> None:
        """Page-lock ``size`` bytes of host memory at ``ptr`` (memory this process mapped, such
        as a shared block), so that copies from the device into it run asynchronously; raises
        RuntimeError where CUDA refuses. Registered portable: pinned for every device."""
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1))  # 1: cudaHostRegisterPortable
        if err:
            raise RuntimeError(f"page-locking {size} bytes of host memory failed with CUDA error {err}")

    def unregister(self, ptr: int) -> None:
        """Undo :meth:`register` of the memory at ``ptr`` (before that memory is unmapped)."""
        torch.cuda.cudart().cudaHostUnregister(ptr)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Start copying device ``src`` into host ``dst`` after the work queued on its
        stream; returns what :meth:`wait` takes."""
        with torch.no_grad():  # sources may be parameters that require grad
            dst.copy_(src, non_blocking=True)
        return self._record(src.device)

    def to_host_all(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Start copying each device source into its page-locked host buffer (``(source,
        buffer)`` pairs) on one side stream per device, reused by every call, after the work
        queued so far on the device's current stream (so the copies hold the values of the
        call, and the training stream is not held behind them); returns what :meth:`wait`
        takes, which waits for all of them at once (one event per device). The caller waits
        before a source may be freed or written (the sources are not recorded on the side stream)."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for src, dst in copies:
            by_device.setdefault(src.device, []).append((src, dst))
        events = []
        with torch.no_grad():  # sources may be parameters that require grad
            for device, pairs in by_device.items():
                side = self.side_stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.device(device), torch.cuda.stream(side):
                    for src, dst in pairs:
                        dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
                events.append(event)
        return _AllOf(events)

    def side_stream(self, device: torch.device) -> Any:
        """The stream of ``device`` that staging copies run on: made once, then reused."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = _SIDE_STREAMS.get(index)
        if stream is None:
            stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
        return stream

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Start copying host ``src`` into device ``dst``; returns what :meth:`wait` takes."""
        with torch.no_grad():  # targets may be parameters that require grad
            dst.copy_(src, non_blocking=True)
        return self._record(dst.device)

    def wait(self, started: Any) -> None:
        """Wait until the copies started by :meth:`to_host`, :meth:`to_host_all` or :meth:`to_device` are done."""
        started.synchronize()

    @staticmethod
    def _record(device: torch.device) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event


# Staging's side stream of each device (by index), made at its first use.
_SIDE_STREAMS: dict[int, Any] = {}


class _AllOf:
    """Events waited for together (:meth:`DeviceOps.wait` takes it as one)."""

    __slots__ = ("events",)

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


OPS = DeviceOps()


def ops() -> DeviceOps:
    """The device steps in use (the tests replace them with CPU stand-ins)."""
    return OPS


class Loan:
    """Bytes ``[start, end)`` of a ring, lent until given back."""

    __slots__ = ("start", "end", "returned")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.returned = start, end, False


class HostRing:
    """Host memory lent in allocation order from one buffer of ``capacity`` bytes, made on
    the first loan. Loans may come back in any order; their memory is lent again once
    every older loan is back (copies and writes finish about in the order they started).
    ``held`` is the memory of the loans not yet reusable, ``peak`` its largest value."""

    def __init__(self, capacity: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.capacity = capacity
        self._allocate = allocate
        self._buffer: torch.Tensor | None = None
        self._loans: collections.deque[Loan] = collections.deque()
        self.held = 0
        self.peak = 0

    def take(self, size: int) -> Loan | None:
        """A loan of ``size`` bytes at an aligned offset, None while the ring has no room."""
        start = self._fit(size)
        if start is None:
            return None
        loan = Loan(start, start + size)
        self._loans.append(loan)
        self.held += size
        self.peak = max(self.peak, self.held)
        return loan

    def _fit(self, size: int) -> int | None:
        if size > self.capacity:
            return None
        if not self._loans:
            return 0
        tail, last = self._loans[0].start, self._loans[-1]
        head = aligned_size(last.end)
        if last.start >= tail:  # not wrapped: room after the newest loan, else from the start
            if head + size <= self.capacity:
                return head
            return 0 if size <= tail else None
        return head if head + size <= tail else None

    def grow(self, capacity: int) -> None:
        """Make the (empty) ring hold ``capacity`` bytes: a piece larger than the ring waits
        until nothing else holds ring memory, then has a ring of its size (as a write
        window lets an item larger than its limit run alone)."""
        if self._loans:
            raise RuntimeError(f"a ring with {len(self._loans)} loans out cannot grow")
        if capacity > self.capacity:
            self.capacity, self._buffer = capacity, None

    def view(self, loan: Loan, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The loan's memory as a tensor of ``dtype`` and ``shape``."""
        if self._buffer is None:
            self._buffer = self._allocate(self.capacity)
        return self._buffer[loan.start : loan.end].view(dtype).view(tuple(shape))

    def give(self, loan: Loan) -> None:
        """Take a loan back."""
        loan.returned = True
        self.held -= loan.end - loan.start
        while self._loans and self._loans[0].returned:
            self._loans.popleft()

    def __len__(self) -> int:
        return len(self._loans)


class Staged:
    """A copy in flight through host memory: its host tensor, the copy to wait for, and
    the loan to give back once the host memory is no longer needed."""

    __slots__ = ("host", "started", "loan")

    def __init__(self, host: torch.Tensor, started: Any, loan: Loan) -> None:
        self.host, self.started, self.loan = host, started, loan


class _Copier:
    """What both directions share: host memory from the ring, waiting for room."""

    def __init__(self, capacity: int, device_ops: DeviceOps | None = None) -> None:
        self.ops = device_ops or ops()
        self.ring = HostRing(capacity, self.ops.pinned)

    def host(self, dtype: torch.dtype, shape: Sequence[int], make_room: Callable[[], bool]) -> tuple[torch.Tensor, Loan]:
        """Host memory for a tensor of ``dtype`` and ``shape``: from the ring, calling
        ``make_room`` (which finishes the oldest work holding ring memory, False when none
        is left) until it fits; a piece larger than the ring grows it once it is empty."""
        size = math.prod(shape) * dtype.itemsize
        while True:
            loan = self.ring.take(size)
            if loan is not None:
                return self.ring.view(loan, dtype, shape), loan
            if not make_room():
                self.ring.grow(size)

    def give(self, staged: Staged) -> None:
        self.ring.give(staged.loan)


class ToHost(_Copier):
    """A save's device sources, copied into host memory in the order they are written:
    :meth:`start` a box's copy, :meth:`ready` waits for it before its write starts, and
    :meth:`done` gives its memory back once its write has finished."""

    def start(self, src: torch.Tensor, make_room: Callable[[], bool]) -> Staged:
        host, loan = self.host(src.dtype, tuple(src.shape), make_room)
        return Staged(host, self.ops.to_host(src, host), loan)

    def ready(self, staged: Staged) -> torch.Tensor:
        self.ops.wait(staged.started)
        return staged.host

    def done(self, staged: Staged) -> None:
        self.give(staged)


class ToDevice(_Copier):
    """A restore's device destinations: host memory for each piece (:meth:`host`), filled
    by the caller's read, then copied to the device (:meth:`upload`); ring memory comes
    back as those copies finish (waited for, oldest first, when the ring needs room, and
    all of them in :meth:`finish`)."""

    def __init__(self, capacity: int, device_ops: DeviceOps | None = None) -> None:
        super().__init__(capacity, device_ops)
        self._uploads: collections.deque[Staged] = collections.deque()

    def take(self, dtype: torch.dtype, shape: Sequence[int]) -> tuple[torch.Tensor, Loan]:
        return self.host(dtype, shape, self._settle_oldest)

    def upload(self, host: torch.Tensor, loan: Loan, dst: torch.Tensor) -> None:
        self._uploads.append(Staged(host, self.ops.to_device(host, dst), loan))

    def finish(self) -> None:
        while self._settle_oldest():
            pass

    def _settle_oldest(self) -> bool:
        if not self._uploads:
            return False
        staged = self._uploads.popleft()
        self.ops.wait(staged.started)
        self.give(staged)
        return True


def pieces(offsets: Sequence[int], lengths: Sequence[int], itemsize: int, limit: int, *, rows: int = 1) -> list[Box]:
    """The box (``offsets``, ``lengths``) split into pieces of at most ``limit`` bytes, in C
    order: runs of whole rows along the first dimension, a row itself split the same way
    along the next when it alone is larger (each piece is contiguous in a C-contiguous
    array). A single element larger than ``limit`` is a piece of its own. Runs of rows
    are a multiple of ``rows`` where ``limit`` holds that many (a box starting on the inner
    chunk grid is then cut on it, so no two pieces read the same chunk)."""
    if 0 in lengths:
        return []
    if not lengths or math.prod(lengths) * itemsize <= limit:
        return [(tuple(offsets), tuple(lengths))]
    row = math.prod(lengths[1:]) * itemsize
    o0, n0 = offsets[0], lengths[0]
    if row <= limit:
        step = max(1, limit // row)
        if step >= rows:
            step -= step % rows
        return [((o0 + i, *offsets[1:]), (min(step, n0 - i), *lengths[1:])) for i in range(0, n0, step)]
    out: list[Box] = []
    for i in range(n0):
        out += [((o0 + i, *off), (1, *ln)) for off, ln in pieces(offsets[1:], lengths[1:], itemsize, limit)]
    return out


def batches(items: Iterable[Any], size: Callable[[Any], int], limit: int) -> Iterator[list[Any]]:
    """Consecutive items grouped while their sizes sum to at most ``limit`` (an item larger
    than ``limit`` alone)."""
    batch: list[Any] = []
    total = 0
    for item in items:
        n = size(item)
        if batch and total + n > limit:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch


class PinnedSlab:
    """Page-locked host memory for many tensors at once (``save_async``'s staging): one
    registration of exactly the bytes needed, each tensor at an aligned offset. Views of
    it keep it alive; it is unregistered when the last one is freed."""

    def __init__(self, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], device_ops: DeviceOps | None = None) -> None:
        self.offsets: list[int] = []
        end = 0
        for dtype, shape in specs:
            self.offsets.append(end)
            end = aligned_size(end + math.prod(shape) * dtype.itemsize)
        self.nbytes = end
        self._specs = list(specs)
        self._buffer = (device_ops or ops()).registered(end)

    def views(self) -> list[torch.Tensor]:
        """One host tensor per spec, in order."""
        out = []
        for off, (dtype, shape) in zip(self.offsets, self._specs):
            size = math.prod(shape) * dtype.itemsize
            out.append(self._buffer[off : off + size].view(dtype).view(shape))
        return out
