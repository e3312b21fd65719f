"""Private mappings of a checkpoint's files: the memory of zero-copy restores.

A restore with ``copy=False`` hands out arrays whose memory is the page cache's copy of
a stored file, mapped ``MAP_PRIVATE`` (copy-on-write): reading them costs no copy and no
anonymous memory, and writing one copies only the pages written, into the process; the
file never changes. The file is mapped from a descriptor its reader opened (with no
link followed, :mod:`.beneath`), never reopened by path, and once: the tensors a file
holds are views of its one mapping, which lives as long as any of them (the kernel
bounds the mappings of a process, ``vm.max_map_count``).

The mapping is made by the C library's ``mmap`` itself, not Python's :class:`mmap.mmap`,
which keeps a duplicate of the descriptor open for the mapping's life (to resize it): a
restore of thousands of one-chunk leaves would hold as many descriptors and run the
process out of them (``ulimit -n``). A mapping needs no descriptor once made.

What the file may do under a mapping (the price of not copying): a file truncated
while mapped makes a touch of a page past its new end kill the process (SIGBUS); one
rewritten in place shows the new bytes in the pages not yet written here; one replaced
(renamed over) or deleted leaves the mapping as it was. Committed checkpoints are
never rewritten by tsckpt.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

# Linux 5.14+: fault the pages of a mapping in as reads (no copy-on-write break), in one call;
# older kernels refuse it (EINVAL) and the pages are faulted in as they are first read.
MADV_POPULATE_READ = 22
MADV_RANDOM = 1  # no read-around on a fault: a mapping read in parts brings in those parts only
MADV_WILLNEED = 3  # read a range into the page cache ahead (one large read, not a fault per page)
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """One mapping, unmapped when the last array viewing it goes (numpy keeps this object as
    the arrays' base)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}

    def __del__(self) -> None:
        _libc.munmap(self.address, self.nbytes)


def map_private(fd: int, nbytes: int, *, populate: bool = True) -> np.ndarray:
    """The first ``nbytes`` (> 0) of the open file ``fd`` as a writable uint8 array over a
    copy-on-write private mapping (``populate``: its page tables filled from the page cache
    up front, which makes a first pass over it faster; else the parts read are brought in by
    :func:`populate`, and a fault elsewhere reads its page only, not the pages around it).
    The descriptor may be closed after (the mapping holds none); the mapping goes with the
    last array viewing it. Raises OSError or ValueError where the file cannot be mapped."""
    if nbytes <= 0:
        raise ValueError(f"cannot map {nbytes} bytes")
    address = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    out = np.asarray(_Mapping(address, nbytes))
    if populate:
        _advise(address, nbytes, MADV_POPULATE_READ)
    else:
        _advise(address, nbytes, MADV_RANDOM)
    return out


def populate(mapped: np.ndarray, start: int, stop: int) -> None:
    """Fill the page tables of bytes ``start:stop`` of ``mapped`` (an array of
    :func:`map_private`, made with ``populate=False``) from the page cache, reading the
    storage for those pages only; nothing where the kernel cannot."""
    address = mapped.__array_interface__["data"][0] + start
    first = address - address % PAGE
    for advice in (MADV_WILLNEED, MADV_POPULATE_READ):
        _advise(first, address + (stop - start) - first, advice)


def _advise(address: int, nbytes: int, advice: int) -> None:
    if nbytes > 0:
        _libc.madvise(address, nbytes, advice)  # a refusal (an older kernel: EINVAL) leaves it to the faults
