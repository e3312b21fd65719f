"""Freed heap memory of worker threads goes back to the system; the cyclic collector
is paused while a save or restore runs in the caller's thread; fresh memory is faulted
in beside the reads, its data unchanged."""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import sys
import threading

import numpy as np
import psutil
import pytest
import torch

import tsckpt
from tsckpt._runtime import memory as _memory
from tsckpt._save import protocol as _save
from tsckpt._storage import native
from tsckpt._runtime.memory import collector_paused, page_spans, prefaulted, release_free_memory


@pytest.mark.parametrize("user", [None, ("MALLOC_TRIM_THRESHOLD_", "1048576"),
                                  ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576")])
def test_bound_heap_pins_the_trim_threshold_once_unless_the_user_set_it(monkeypatch, user):
    calls = []
    monkeypatch.setattr(native, "has_mallopt", lambda: True)
    monkeypatch.setattr(native, "mallopt", lambda param, value: calls.append((param, value)))
    monkeypatch.setattr(_memory, "_heap_bounded", [False])
    for var in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(var, raising=False)
    if user is not None:
        monkeypatch.setenv(*user)
    _memory.bound_heap()
    _memory.bound_heap()
    assert calls == ([] if user else [(native.M_TRIM_THRESHOLD, 128 << 10)])


@pytest.mark.skipif(not native.has_mallopt(), reason="glibc's mallopt")
def test_mallopt_takes_the_trim_threshold():
    native.mallopt(native.M_TRIM_THRESHOLD, _memory.TRIM_THRESHOLD_BYTES)  # the value bound_heap sets: no OSError


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_arena_memory_is_returned():
    kept: list[bytearray] = []

    def churn() -> None:
        blocks = [bytearray(64 << 10) for _ in range(800)]  # 50 MiB in 64 KiB blocks, in this thread's arena
        kept.extend(blocks[::50])  # a few survivors pin the arena's heap, as live decode buffers do
        blocks.clear()

    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    before = rss()
    release_free_memory()
    assert before - rss() > 100 << 20  # of ~200 MiB freed in four arenas
    assert len(kept) == 4 * 16 and all(len(b) == 64 << 10 for b in kept)  # live data untouched


def test_nested_pauses_enable_the_collector_again_only_at_the_last():
    """Restores or saves in several threads: the collector comes back when the last one ends."""
    assert gc.isenabled()
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_save_pauses_the_collector_but_not_in_the_background(tmp_path, monkeypatch):
    """tsckpt.save pauses it while it runs, also when it fails; save_async's worker, which runs
    beside the caller's training loop, leaves it alone."""
    seen: list[tuple[str, bool]] = []
    real = _save._parts

    def spy(*args, **kwargs):
        seen.append((threading.current_thread().name.split("_")[0], gc.isenabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(_save, "_parts", spy)
    tsckpt.save(tmp_path / "a", {"w": torch.arange(4.0)})
    assert seen == [("MainThread", False)] and gc.isenabled()
    with pytest.raises(tsckpt.CheckpointExistsError):
        tsckpt.save(tmp_path / "a", {"w": torch.arange(4.0)})
    assert gc.isenabled()
    tsckpt.save_async(tmp_path / "b", {"w": torch.arange(4.0)}).result()
    assert seen[-1] == ("tsckpt-save", True) and gc.isenabled()
    assert torch.equal(tsckpt.restore(tmp_path / "b", {"w": torch.empty(4)})["w"], torch.arange(4.0))


P = mmap.PAGESIZE


def test_page_spans_join_buffers_whose_pages_touch_in_their_order():
    """Only pages holding some buffer's bytes are in a span; a span grows while the next
    buffer starts on its pages or the one after, and keeps the buffers' order."""
    assert page_spans([(3 * P + 10, P + 900), (5 * P + 1, 10), (100 * P + 1, 1), (7 * P, 0)]) == [
        (3 * P, 3 * P),
        (100 * P, P),
    ]
    assert page_spans([(8 * P, 10), (0, 10)]) == [(8 * P, P), (0, P)]  # in order, not sorted
    assert page_spans([(0, 2 * P), (100, 50), (2 * P - 1, 2)]) == [(0, 3 * P)]
    assert page_spans([(5 * P, 1), (7 * P, 1)]) == [(5 * P, P), (7 * P, P)]  # an untouched page between
    assert page_spans([]) == []


def _resident_pages(address: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(length // P)
    if libc.mincore(address, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_POPULATE_WRITE)")
def test_prefaulted_memory_is_resident_with_its_data_unchanged():
    region = mmap.mmap(-1, 64 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = np.frombuffer(region, dtype=np.uint8)
    address = data.ctypes.data
    data[5 * P : 5 * P + 3] = [7, 8, 9]  # one page written before
    assert _resident_pages(address, 64 * P) == 1
    with prefaulted([(address + P + 1, 10 * P), (address + 40 * P, 1)]):
        pass
    if not _memory._prefault_works[0]:
        pytest.skip("this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")
    assert _resident_pages(address, 64 * P) == 12  # pages 1-11 and 40: only those holding the buffers' bytes
    assert _resident_pages(address + P, 11 * P) == 11 and _resident_pages(address + 40 * P, P) == 1
    assert list(data[5 * P : 5 * P + 4]) == [7, 8, 9, 0] and not data[: 5 * P].any() and not data[5 * P + 3 :].any()
    del data
    region.close()


def test_prefaulting_stops_for_good_on_a_kernel_without_it(monkeypatch):
    """madvise refused as unknown (EINVAL, before Linux 5.14): no helper is started again, and
    the body runs all the same. Any other failure only leaves the pages to the reads."""
    calls: list[tuple[int, int, int]] = []
    failing = [errno.ENOMEM]

    def refusing(start, length, advice):
        calls.append((start, length, advice))
        raise OSError(failing[0], os.strerror(failing[0]))

    monkeypatch.setattr(native, "has_madvise", lambda: True)
    monkeypatch.setattr(native, "madvise", refusing)
    monkeypatch.setattr(_memory, "_prefault_works", [True])
    with prefaulted([(0, 1), (5 * P, 1)]):
        ran = True
    assert ran and len(calls) == 2 and _memory._prefault_works == [True]  # ENOMEM: the next span is tried
    failing[0] = errno.EINVAL
    with prefaulted([(0, 1), (5 * P, 1)]):
        pass
    assert len(calls) == 3 and _memory._prefault_works == [False]  # EINVAL: stops at once
    started = threading.active_count()
    with prefaulted([(0, 1)]):
        assert threading.active_count() == started  # no helper
    assert len(calls) == 3
