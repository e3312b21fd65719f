"""One block of host memory that two processes share: ``save_async``'s staging slab, which
the training process fills and its writer process reads.

The block is an anonymous memory file (Linux ``memfd_create``): it has no name in any file
system, so nothing is left behind when both processes die, however they die, and it is
not bound by the size of ``/dev/shm`` (small in containers). It is handed to the writer
once, as a file descriptor over a Unix socket; each save then names its buffers by offset.
Its pages are reserved when it is made (``posix_fallocate``), so a machine without the
memory refuses here, with an error, rather than killing the process on first touch.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from typing import Any

import numpy as np

# Every buffer starts at a multiple of this: aligned for any dtype and for SIMD copies.
ALIGN = 64


def supported() -> bool:
    """Whether this platform has anonymous shared memory files (Linux)."""
    return hasattr(os, "memfd_create")


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` bytes packed in one block, each aligned; and the block's size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


class SharedBlock:
    """``size`` bytes of shared memory, mapped here; ``fd`` hands it to another process."""

    def __init__(self, size: int, *, fd: int | None = None) -> None:
        self.size = size
        if fd is None:
            fd = os.memfd_create("tsckpt-staging", getattr(os, "MFD_CLOEXEC", 0))
            try:
                os.ftruncate(fd, size)
                _reserve(fd, size)
            except BaseException:
                os.close(fd)
                raise
        self.fd = fd
        self._map: mmap.mmap | None = mmap.mmap(fd, size)
        self.base = np.frombuffer(self._map, dtype=np.uint8)  # every view is a slice of this
        self._start: int = self.base.__array_interface__["data"][0]

    @property
    def pointer(self) -> int:
        """Where the block is mapped in this process (for page-locking it)."""
        return self._start

    def address(self, view: Any) -> int | None:
        """The offset in this block of the memory ``view`` (a tensor or numpy array) starts at, or
        None if it is not in the block."""
        ptr = view.data_ptr() if hasattr(view, "data_ptr") else view.__array_interface__["data"][0]
        offset = ptr - self._start
        return offset if 0 <= offset < self.size else None

    def numpy(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over the block at ``offset``."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.base[offset : offset + count].view(dtype).reshape(shape)

    def torch(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        """A torch tensor over the block at ``offset`` (any torch dtype, those numpy lacks too)."""
        import torch

        count = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        raw = torch.from_numpy(self.base[offset : offset + count])
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        """Give the block up here: the memory is freed once no process maps it any more (views
        still alive keep their pages)."""
        self.base = np.empty(0, dtype=np.uint8)
        mapped, self._map = self._map, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # views outlive this: unmapped when they go
                mapped.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _reserve(fd: int, size: int) -> None:
    """Reserve the block's pages now, so that too little memory is an error here (where
    reservations are not supported, pages come on first touch)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except AttributeError:
        return
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise MemoryError(
                f"no host memory for {size} bytes of shared staging buffers ({os.strerror(e.errno)}): free memory, "
                "bound the staging with max_staging_bytes, or save with writer='thread'"
            ) from e
