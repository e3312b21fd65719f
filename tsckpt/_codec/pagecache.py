"""How much of a file range is in the page cache, to choose how to read it.

A restore from storage the page cache does not hold reads faster and with a
fraction of the CPU through direct I/O (storage straight into user memory; the
kernel's copy out of the cache, and its cache upkeep, were most of a cold
restore's CPU); a range the cache holds reads fastest as usual. Python exposes
no ``mincore``, so it is called through ctypes; where that or ``O_DIRECT`` is
missing, :func:`resident_fraction` answers None and reads stay buffered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Sequence

import numpy as np

from .._storage.confine import open_beneath

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory (a multiple of every common block size)
_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def resident_fraction(fd: int, start: int, stop: int) -> float | None:
    """The fraction of the pages of bytes [start, stop) of ``fd`` that the page cache holds.

    Maps the range without touching it (no I/O) and asks ``mincore``. None when
    the platform cannot tell.
    """
    if _LIBC is None or stop <= start:
        return None
    page = mmap.PAGESIZE
    first = start - start % page
    length = stop - first
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
    if addr is None or addr == _FAILED:
        return None
    try:
        pages = -(-length // page)
        vec = ctypes.create_string_buffer(pages)
        if _LIBC.mincore(addr, length, vec) != 0:
            return None
        return float(np.count_nonzero(np.frombuffer(vec.raw, np.uint8) & 1)) / pages
    finally:
        _LIBC.munmap(addr, length)


PROBES = 8  # files looked up by :func:`files_cached`


def files_cached(dir_fd: int, keys: Sequence[str]) -> bool:
    """Whether the page cache holds the files ``keys`` (below the open checkpoint directory
    ``dir_fd``) whole, judged by up to :data:`PROBES` of them spread over the list
    (:func:`resident_fraction` of each). False where that cannot be told or a probe fails
    for any reason: readers then read as from storage. It only chooses how many threads
    read: a wrong guess costs time, never a result."""
    if not keys:
        return False
    for key in dict.fromkeys(keys[i * len(keys) // PROBES] for i in range(PROBES)):
        try:
            fd = open_beneath(dir_fd, key)
        except OSError:
            return False
        try:
            whole = resident_fraction(fd, 0, os.fstat(fd).st_size)
        except OSError:
            return False
        finally:
            os.close(fd)
        if whole is None or whole < 1.0:
            return False
    return True


def set_direct(fd: int, *, on: bool = True) -> bool:
    """Switch direct I/O of ``fd`` on or off; False where that fails (file systems without it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    import fcntl  # POSIX only, like O_DIRECT

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True
