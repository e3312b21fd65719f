"""Giving freed heap memory back to the operating system.

TensorStore decodes chunks on its own worker threads, and glibc gives each
thread its own malloc arena; memory freed there stays in the arena, so a
restore's resident memory grows by up to a window's worth per worker thread
even though the bytes in flight are bounded. glibc's ``malloc_trim`` returns
the free pages of every arena to the system. No library wraps it, hence
ctypes; elsewhere (musl, macOS) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        _libc = None


def release_free_memory() -> None:
    """Return free heap pages of every malloc arena to the system (glibc); cheap, no effect on live data."""
    if _libc is not None:
        _libc.malloc_trim(0)
