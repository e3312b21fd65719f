"""Freed heap memory of worker threads goes back to the system."""

from __future__ import annotations

import sys
import threading

import psutil
import pytest

from tsckpt._memory import release_free_memory


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
