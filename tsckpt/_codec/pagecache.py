"""How much of a file range is in the page cache, to choose how to read it.

A restore from storage the page cache does not hold reads faster and with a
fraction of the CPU through direct I/O (storage straight into user memory; the
kernel's copy out of the cache, and its cache upkeep, were most of a cold
restore's CPU); a range the cache holds reads fastest as usual. Python exposes
no ``mincore`` (:mod:`tsckpt._storage.native` calls it); where that or ``O_DIRECT`` is
missing, :func:`resident_fraction` answers None and reads stay buffered.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np

from .._storage import native
from .._storage.beneath import open_beneath


def resident_fraction(fd: int, start: int, stop: int) -> float | None:
    """The fraction of the pages of bytes [start, stop) of ``fd`` that the page cache holds
    (:func:`native.page_residency`). None when the platform cannot tell (no ``mincore``, no
    ``O_DIRECT`` to choose), or the range cannot be mapped.
    """
    if not native.has_mincore() or not hasattr(os, "O_DIRECT") or stop <= start:
        return None
    first = start - start % mmap.PAGESIZE
    try:
        vec = native.page_residency(fd, first, stop - first)
    except OSError:
        return None
    return float(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1)) / len(vec)


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
