"""Private mappings of a checkpoint's files: the memory of zero-copy restores.

A restore with ``copy=False`` hands out arrays whose memory is the page cache's copy of
a stored file, mapped ``MAP_PRIVATE`` (copy-on-write): reading them costs no copy and no
anonymous memory, and writing one copies only the pages written, into the process; the
file never changes. The file is mapped from a descriptor its reader opened (with no
link followed, :mod:`.beneath`), never reopened by path, and once: the tensors a file
holds are views of its one mapping, which lives as long as any of them (the kernel
bounds the mappings of a process, ``vm.max_map_count``).

What the file may do under a mapping (the price of not copying): a file truncated
while mapped makes a touch of a page past its new end kill the process (SIGBUS); one
rewritten in place shows the new bytes in the pages not yet written here; one replaced
(renamed over) or deleted leaves the mapping as it was. Committed checkpoints are
never rewritten by tsckpt.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

# Linux 5.14+: fault the pages of a mapping in as reads (no copy-on-write break), in one call;
# older kernels refuse it (EINVAL) and the pages are faulted in as they are first read.
MADV_POPULATE_READ = 22


def map_private(fd: int, nbytes: int, *, populate: bool = True) -> np.ndarray:
    """The first ``nbytes`` (> 0) of the open file ``fd`` as a writable uint8 array over a
    copy-on-write private mapping (``populate``: its page tables filled from the page cache
    up front, which makes a first pass over it faster). The descriptor may be closed after;
    the mapping goes with the last array viewing it. Raises OSError or ValueError where the
    file cannot be mapped."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if populate and hasattr(mm, "madvise"):
        with contextlib.suppress(OSError):
            mm.madvise(MADV_POPULATE_READ)
    return np.frombuffer(mm, np.uint8)

