"""Freed heap memory of worker threads goes back to the system; the cyclic collector
is paused while a save or restore runs in the caller's thread."""

from __future__ import annotations

import gc
import sys
import threading

import psutil
import pytest
import torch

import tsckpt
from tsckpt import _save
from tsckpt._memory import collector_paused, release_free_memory


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
