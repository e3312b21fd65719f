"""Memory upkeep around saves and restores: giving freed heap memory back to the
operating system, pausing Python's cyclic garbage collector, and faulting in a
restore's fresh destination memory on a spare CPU.

TensorStore decodes chunks on its own worker threads, and glibc gives each
thread its own malloc arena; memory freed there stays in the arena, so a
restore's resident memory grows by up to a window's worth per worker thread
even though the bytes in flight are bounded. glibc's ``malloc_trim`` returns
the free pages of every arena to the system. No library wraps it
(:mod:`tsckpt._storage.native` calls it); elsewhere (musl, macOS) this is a no-op. The
same goes for ``madvise`` (:func:`prefaulted`), which Python offers only on its own
mappings. ``malloc_trim`` does not shrink the top of a thread's arena, which glibc keeps
up to its trim threshold: :func:`bound_heap` pins that threshold before TensorStore
decodes another library's chunks.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import gc
import mmap
import os
import threading
from collections.abc import Iterator, Sequence

from .._storage import native

_PAGE = mmap.PAGESIZE  # madvise takes page-aligned spans (4 KiB on x86-64, up to 64 KiB on arm64)


def release_free_memory() -> None:
    """Return free heap pages of every malloc arena to the system (glibc); cheap, no effect on live data."""
    if native.has_malloc_trim():
        native.malloc_trim()


# glibc's trim threshold as it starts: an arena whose free top grows past it gives it back.
# glibc raises it (to twice the largest block freed) once a block of a few MiB is freed,
# and malloc_trim never shrinks the top of a thread's arena, so after TensorStore decoded
# chunks of a few MiB on its worker threads each of their arenas kept up to that much
# free, resident for good (README, "Orbax checkpoints").
TRIM_THRESHOLD_BYTES = 128 << 10
# What tells glibc's malloc a setting of the user's own, which tsckpt leaves alone.
_USER_MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")
_heap_bounded = [False]


def bound_heap() -> None:
    """Keep freed heap memory from staying resident in the arenas of reading threads: pin
    glibc's trim threshold at its starting value (:data:`TRIM_THRESHOLD_BYTES`), once per
    process, before reads whose buffers TensorStore allocates and frees on its own threads
    (another library's compressed chunks). A process-wide setting of the allocator, so it is
    left alone where the user chose one (``MALLOC_*`` variables or a malloc tunable in
    ``GLIBC_TUNABLES``); a no-op without glibc."""
    if _heap_bounded[0]:
        return
    _heap_bounded[0] = True
    chosen = any(os.environ.get(v) for v in _USER_MALLOC_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    if chosen or not native.has_mallopt():
        return
    try:
        native.mallopt(native.M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except OSError:
        pass  # an allocator that takes no such setting: its memory is what it is


# The name save_async's worker threads start with: a save there runs beside the caller's
# training loop, so it leaves the collector alone (see :func:`collector_paused`).
BACKGROUND_SAVE_THREAD = "tsckpt-save"

_paused_lock = threading.Lock()
_paused = [0, False]  # saves and restores running with the collector paused; whether it was enabled before the first


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the body runs, then restore its setting.

    Why: a save or restore allocates a few long-lived objects per leaf (descriptors, plan
    entries and records, destinations and results) and makes no reference cycles, yet those
    objects trigger full collections, each walking every object of the process (torch's
    modules, the caller's model). Measured on 10,000 small leaves: one to two full
    collections of 0.11-0.15 s each per restore, 10-25% of it; planning a save of them took
    0.83-0.88 s with the collector, 0.46-0.48 s without. Reference counting still frees
    everything they drop; the collector runs again as soon as the last save or restore in
    progress (threads may run several) ends. Not in save_async's worker thread
    (:data:`BACKGROUND_SAVE_THREAD`): that save runs beside the caller's training loop, whose
    collector it would pause for the whole save."""
    if threading.current_thread().name.startswith(BACKGROUND_SAVE_THREAD):
        yield
        return
    with _paused_lock:
        if _paused[0] == 0:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused[0] -= 1
            if _paused[0] == 0 and _paused[1]:
                gc.enable()


# The most spans :func:`prefaulted` takes: one madvise each, and each call takes the
# interpreter lock to start, beside the reading thread. Fresh destinations lie mostly side
# by side: those of 10,000 small leaves came in 128 (torch) to 325 (numpy) spans; scattered
# memory past this many spans is faulted in by the reads, as without a helper.
PREFAULT_SPANS = 1024
_prefault_works = [True]  # False once the kernel refused MADV_POPULATE_WRITE (before Linux 5.14)


def page_spans(buffers: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pages holding the bytes [address, address + nbytes) of each of ``buffers``, as
    (start, length) spans in the buffers' order, a span joined to the one before when their
    pages touch or overlap (memory allocated one after another). Only pages that hold some
    buffer's bytes are in a span."""
    spans: list[list[int]] = []
    for address, nbytes in buffers:
        if nbytes <= 0:
            continue
        lo, hi = address & -_PAGE, (address + nbytes + _PAGE - 1) & -_PAGE
        if spans and spans[-1][0] <= lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in spans]


def _populate(spans: Sequence[tuple[int, int]]) -> None:
    for start, length in spans:
        try:
            native.madvise(start, length, native.MADV_POPULATE_WRITE)
        except OSError as e:
            if e.errno == errno.EINVAL:
                _prefault_works[0] = False  # a kernel without it; any other failure only leaves the pages to the reads
                return


@contextlib.contextmanager
def prefaulted(buffers: Sequence[tuple[int, int]]) -> Iterator[None]:
    """While the body runs, a helper thread faults in the pages of ``buffers`` ((address,
    nbytes) of writable host memory the body is about to fill, in the order it fills them),
    at most :data:`PREFAULT_SPANS` spans of them (:func:`page_spans`).

    Why: a restore into fresh memory (a fresh target, ``target=None``, an untouched
    ``empty_like``) spends a third of its time in the kernel's first-touch faults of that
    memory, taken one 4 KiB page at a time inside the reads. One reading thread (files the
    page cache holds) leaves the other CPUs idle; ``MADV_POPULATE_WRITE`` on one of them
    faults the same pages in ahead of the reads, which then only copy. Measured on 2 CPUs,
    restoring 10,000 small leaves (319 MiB) warm, helper on and off in turn: fresh target
    0.67-0.72 s against 0.79-0.84 s, ``target=None`` 0.50-0.51 s against 0.61-0.62 s (the
    faults move to the other CPU; the CPU time stays). The data is unchanged: populating a
    page present already does nothing, and only pages holding the buffers' bytes are touched.
    Without the call (not Linux 5.14+) the body runs alone, as before."""
    spans = page_spans(buffers)[:PREFAULT_SPANS] if native.has_madvise() and _prefault_works[0] else []
    if not spans:
        yield
        return
    helper = threading.Thread(target=_populate, args=(spans,), name="tsckpt-prefault", daemon=True)
    helper.start()
    try:
        yield
    finally:
        helper.join()


def _writable_mappings() -> list[tuple[int, int, bool]] | None:
    """This process's mappings as (start, end, writable), by address (Linux ``/proc/self/maps``);
    None where they cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read()
    except OSError:
        return None
    out = []
    for line in text.splitlines():
        fields = line.split(None, 2)
        if len(fields) < 2:
            continue
        lo, _, hi = fields[0].partition(b"-")
        try:
            out.append((int(lo, 16), int(hi, 16), fields[1][1:2] == b"w"))
        except ValueError:
            continue
    out.sort()
    return out


def unwritable(spans: Sequence[tuple[int, int]]) -> list[int]:
    """The indices of the ``spans`` ((address, nbytes) of host memory about to be written) that
    do not lie wholly in writable mappings of this process: memory mapped read-only (a file
    mapped for reading, a read-only ``mmap``), where a write would kill the process with
    SIGSEGV, or no mapping at all. One read of ``/proc/self/maps`` for all of them; where it
    cannot be read (not Linux) nothing is reported. Empty spans are never reported."""
    wanted = [(i, a, n) for i, (a, n) in enumerate(spans) if n > 0]
    if not wanted:
        return []
    maps = _writable_mappings()
    if maps is None:
        return []
    starts = [m[0] for m in maps]
    bad = []
    for i, address, nbytes in wanted:
        at, end = address, address + nbytes
        k = bisect.bisect_right(starts, at) - 1
        while at < end:
            if k < 0 or k >= len(maps) or not (maps[k][0] <= at < maps[k][1]) or not maps[k][2]:
                bad.append(i)
                break
            at, k = maps[k][1], k + 1
    return bad
