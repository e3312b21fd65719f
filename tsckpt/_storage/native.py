"""Every call into the C library that Python's ``os`` module lacks, declared once; the
system's limits on positional and direct I/O, and the aligned memory direct I/O needs.

The C library is loaded once (:data:`LIBC`: the process's own symbols, where libc is
already loaded). Each call below is bound once with its argument and result types, has
ONE availability probe (``has_<call>()``) that its callers ask instead of catching errors
of their own, and reports a failure as the ``os`` module does: ``OSError(errno, strerror,
filename)`` (a FileNotFoundError for ENOENT, ...). Calling one that is not available here
raises OSError ENOSYS.

=====================  ==========================================  ====================
call                   what for                                    where
=====================  ==========================================  ====================
``mmap``, ``mincore``  how much of a file the page cache holds     any POSIX system
``madvise``            faulting fresh memory in ahead of the reads Linux
``malloc_trim``        giving freed heap pages back to the system  Linux with glibc
``mallopt``            keeping freed heap pages from piling up     Linux with glibc
``syncfs``             one flush of a whole file system            Linux
``sync_file_range``    starting a file's writeback without waiting Linux
``openat2``            opens that refuse a symbolic link           Linux 5.6
=====================  ==========================================  ====================

``preadv``, ``pwritev``, ``fsync`` and ``fcntl`` come from Python's ``os`` and ``fcntl``
modules and are used from there.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
from typing import Any

import numpy as np

LINUX = sys.platform.startswith("linux")


def _load() -> ctypes.CDLL | None:
    """The C library: the process's own symbols (libc is loaded in every CPython on POSIX)."""
    if os.name != "posix":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


LIBC = _load()


def _bind(name: str, restype: Any, *argtypes: Any, linux: bool = True) -> Any:
    """libc's function ``name`` with these types (errno kept for :func:`error`), or None
    where libc lacks it (or, with ``linux``, where this is not Linux). Each binding is its
    own function object: declaring one never changes another user's ``LIBC.name``."""
    if LIBC is None or (linux and not LINUX):
        return None
    try:
        return ctypes.CFUNCTYPE(restype, *argtypes, use_errno=True)((name, LIBC))
    except AttributeError:
        return None


def error(filename: str | None = None) -> OSError:
    """The failure of the call just made, as the ``os`` module raises it (from errno)."""
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code), filename)


def _missing(name: str) -> OSError:
    return OSError(errno.ENOSYS, f"{name} is not available here")


# ---- limits and aligned memory ----------------------------------------------------------

# O_DIRECT's alignment of offsets, lengths and memory (a multiple of every common block
# size); also of pieces of page-locked host memory, so that every dtype is aligned there.
ALIGN = 4096


def _iov_max() -> int:
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return min(1024, limit) if limit > 0 else 1024


# Buffers one preadv or pwritev takes (Linux's IOV_MAX, 1024; never more).
IOV_MAX = _iov_max()


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` of uninitialised memory (uint8) starting at a multiple of :data:`ALIGN`."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


# ---- mmap, munmap, mincore: what the page cache holds ------------------------------------

_MMAP = _bind("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
              ctypes.c_int64, linux=False)
_MUNMAP = _bind("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, linux=False)
_MINCORE = _bind("mincore", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, linux=False)
_MAP_FAILED = ctypes.c_void_p(-1).value


def has_mincore() -> bool:
    """Whether :func:`page_residency` can tell here."""
    return _MMAP is not None and _MUNMAP is not None and _MINCORE is not None


def page_residency(fd: int, offset: int, length: int) -> bytes:
    """One byte per page of bytes [offset, offset + length) of ``fd`` (``offset`` a multiple
    of the page size), whose lowest bit says whether the page cache holds that page. Maps
    the range without touching it (no I/O) and asks ``mincore``."""
    if not has_mincore():
        raise _missing("mincore")
    addr = _MMAP(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        raise error()
    try:
        vec = ctypes.create_string_buffer(-(-length // mmap.PAGESIZE))
        if _MINCORE(addr, length, vec) != 0:
            raise error()
        return vec.raw
    finally:
        _MUNMAP(addr, length)


# ---- madvise: fault memory in ahead of its use ------------------------------------------

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in as if written, without writing them (EINVAL before)
_MADVISE = _bind("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def has_madvise() -> bool:
    """Whether :func:`madvise` can be called here (Linux; whether the kernel knows an advice
    is told by the call: EINVAL)."""
    return _MADVISE is not None


def madvise(address: int, length: int, advice: int) -> None:
    """``madvise`` of the page-aligned span [address, address + length)."""
    if _MADVISE is None:
        raise _missing("madvise")
    if _MADVISE(address, length, advice) != 0:
        raise error()


# ---- malloc_trim: free heap pages back to the system ------------------------------------

_MALLOC_TRIM = _bind("malloc_trim", ctypes.c_int, ctypes.c_size_t)  # glibc only


def has_malloc_trim() -> bool:
    """Whether :func:`malloc_trim` can be called here (glibc; not musl, not macOS)."""
    return _MALLOC_TRIM is not None


def malloc_trim() -> None:
    """Return the free pages of every malloc arena to the system; no effect on live data."""
    if _MALLOC_TRIM is None:
        raise _missing("malloc_trim")
    _MALLOC_TRIM(0)


# ---- mallopt: malloc's thresholds -------------------------------------------------------

_MALLOPT = _bind("mallopt", ctypes.c_int, ctypes.c_int, ctypes.c_int)  # glibc (musl has none)
M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>


def has_mallopt() -> bool:
    """Whether :func:`mallopt` can be called here (glibc)."""
    return _MALLOPT is not None


def mallopt(param: int, value: int) -> None:
    """Set one of malloc's parameters (``M_*``); glibc returns 0 for a value it refuses."""
    if _MALLOPT is None:
        raise _missing("mallopt")
    if _MALLOPT(param, value) == 0:
        raise OSError(errno.EINVAL, f"mallopt refused parameter {param} = {value}")


# ---- syncfs: flush a whole file system ---------------------------------------------------

_SYNCFS = _bind("syncfs", ctypes.c_int, ctypes.c_int)


def has_syncfs() -> bool:
    """Whether :func:`syncfs` can be called here (Linux)."""
    return _SYNCFS is not None


def syncfs(fd: int, filename: str | None = None) -> None:
    """Flush the whole file system holding the open ``fd`` (``filename``: its name, for the error)."""
    if _SYNCFS is None:
        raise _missing("syncfs")
    if _SYNCFS(fd) != 0:
        raise error(filename)


# ---- sync_file_range: start writeback ----------------------------------------------------

SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages, without waiting
_SYNC_FILE_RANGE = _bind("sync_file_range", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_uint)


def has_sync_file_range() -> bool:
    """Whether :func:`sync_file_range` can be called here (Linux)."""
    return _SYNC_FILE_RANGE is not None


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """``sync_file_range`` of bytes [offset, offset + nbytes) of ``fd`` (0 bytes: to the end)."""
    if _SYNC_FILE_RANGE is None:
        raise _missing("sync_file_range")
    if _SYNC_FILE_RANGE(fd, offset, nbytes, flags) != 0:
        raise error()


# ---- openat2: opens that refuse links ----------------------------------------------------

# openat2(2)'s number (the same on every Linux architecture), called through libc's
# ``syscall`` (glibc has no wrapper), and struct open_how's resolve flags.
SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02  # no /proc magic link
RESOLVE_NO_SYMLINKS = 0x04  # no symbolic link anywhere on the path
RESOLVE_BENEATH = 0x08  # never above the directory the path is resolved from
_SYSCALL_OPENAT2 = _bind("syscall", ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                         ctypes.c_size_t)


class OpenHow(ctypes.Structure):
    """openat2's ``struct open_how``: made once per kind of open, passed to every one."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_OPEN_HOW_BYTES = ctypes.sizeof(OpenHow)


@functools.lru_cache(maxsize=1)
def has_openat2() -> bool:
    """Whether :func:`openat2` works here, refusing links (not on another system, a kernel
    before 5.6, or a sandbox that filters the call): found by opening ``/`` through it once,
    with every resolve flag tsckpt uses."""
    if _SYSCALL_OPENAT2 is None:
        return False
    try:
        root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        how = OpenHow(os.O_RDONLY | os.O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH)
        fd = _SYSCALL_OPENAT2(SYS_OPENAT2, root, b".", ctypes.byref(how), _OPEN_HOW_BYTES)
    finally:
        os.close(root)
    if fd < 0:
        return False
    os.close(fd)
    return True


def openat2(dir_fd: int, path: str, how: OpenHow) -> int:
    """A descriptor of ``path`` below the open directory ``dir_fd``, opened as ``how`` says;
    a failure raises as ``os.open`` does (naming ``path``)."""
    if _SYSCALL_OPENAT2 is None:
        raise _missing("openat2")
    fd = _SYSCALL_OPENAT2(SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), _OPEN_HOW_BYTES)
    if fd < 0:
        raise error(path)
    return int(fd)
