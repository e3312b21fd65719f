"""Metadata files read within bounds (docs/security.md, "Special and huge files").

Every metadata file tsckpt reads from a local disk (a root or array ``zarr.json``, a
Hugging Face index, another format's metadata) is looked at before it is read: it must
be a regular file (a FIFO would make a read wait for a writer forever, a device such as
``/dev/zero`` never ends) of at most a limit of its kind (a sparse file claims gigabytes
while holding a few blocks: read whole, it exhausts memory, and TensorStore aborts the
process). A file that is not is refused with an error naming it, what it is or its size,
and the limit; nothing of it is read.

- :func:`file_problem`: the check made before TensorStore reads a file (TensorStore opens
  without ``O_NONBLOCK`` and reads whole files): one ``stat``, nothing is opened.
- :func:`read_file`: tsckpt's own reads: opened without waiting (``O_NONBLOCK``), checked
  on the descriptor (``fstat``), then read up to its size, and never past the limit
  however the file grows meanwhile.

On object stores an object is never a special file, and a large one is as large as the
bytes it holds; their reads are not checked this way.
"""

from __future__ import annotations

import os
import stat

from .._errors import CorruptCheckpointError
from .._storage.confine import file_kind, open_read

# The largest root zarr.json read: its array records take about 300-500 bytes per leaf,
# so this holds several hundred thousand leaves.
ROOT_BYTES = 256 << 20
# The largest array or group zarr.json read (tsckpt writes about 1 KiB).
NODE_BYTES = 16 << 20
# The largest metadata file of another format read (a Hugging Face index, Orbax's JSON,
# DCP's pickled .metadata), and a compact checkpoint's OCDBT manifest.
METADATA_BYTES = 256 << 20

# Opens for reading never wait: a FIFO opens at once (and is then refused), a regular file
# is unchanged by O_NONBLOCK.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def size_text(n: int) -> str:
    """``6.0 GiB (6442450944 bytes)``: a size for messages."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _limit(n: int) -> str:
    """A limit for messages: ``256 MiB``."""
    return f"{n >> 20} MiB" if n and n % (1 << 20) == 0 else f"{n} bytes"


def stat_problem(st: os.stat_result, limit: int, what: str) -> str | None:
    """Why a file with status ``st`` is not read as ``what`` (e.g. "a root zarr.json") of at
    most ``limit`` bytes, as a phrase after its name; None when it may be read."""
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a regular file"
    if st.st_size > limit:
        return (
            f"is {size_text(st.st_size)}, more than tsckpt reads of {what} ({_limit(limit)}; a sparse file "
            "can claim that size on a few blocks)"
        )
    return None


def file_problem(path: str, limit: int, what: str) -> str | None:
    """Why the local file ``path`` may not be read as ``what`` of at most ``limit`` bytes
    (:func:`stat_problem`), checked with one ``stat`` (a link followed, as TensorStore
    follows it; nothing is opened); None when it may be, or when there is no such file
    (the read itself then says what is missing or unreadable)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return stat_problem(st, limit, what)


def refused(name: str, problem: str, fix: str) -> CorruptCheckpointError:
    """The error of the metadata file ``name`` refused for ``problem`` (:func:`file_problem`)."""
    return CorruptCheckpointError(f"{name} {problem}; nothing of it was read: {fix}")


def read_file(path: str, limit: int, what: str, *, fix: str) -> bytes:
    """The bytes of the local file ``path``, read as ``what`` of at most ``limit`` bytes:
    opened without waiting (a file of a checkpoint below its directory, with no link
    followed: :func:`open_read`), then read as :func:`read_fd` reads. A failed open raises
    its OSError (FileNotFoundError for a missing file)."""
    return read_fd(open_read(path), path, limit, what, fix=fix)


def read_fd(fd: int, name: str, limit: int, what: str, *, fix: str) -> bytes:
    """The bytes of the opened file ``fd`` (named ``name``; closed here), read as ``what`` of
    at most ``limit`` bytes: refused (CorruptCheckpointError naming it, what it is or its
    size, the limit and ``fix``) unless the descriptor is of a regular file within the limit,
    and read up to its size (never more than ``limit``, however it grows meanwhile)."""
    try:
        problem = stat_problem(os.fstat(fd), limit, what)
        if problem is not None:
            raise refused(name, problem, fix)
        chunks, n = [], 0
        while block := os.read(fd, min(1 << 20, limit + 1 - n)):
            chunks.append(block)
            n += len(block)
            if n > limit:
                raise refused(name, f"grew past {_limit(limit)} while it was read, more than tsckpt reads of {what}", fix)
        return b"".join(chunks)
    finally:
        os.close(fd)
