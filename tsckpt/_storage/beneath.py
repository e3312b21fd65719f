"""Opens below an open directory that follow no symbolic link (docs/security.md).

Every file of a local checkpoint is opened from a descriptor of the checkpoint's
directory, never by a path the system resolves anew: where ``openat2`` works (Linux
5.6), one call with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (the kernel refuses a link
anywhere on the way and any path leading above the directory); elsewhere one ``openat``
per component with ``O_NOFOLLOW`` (``O_DIRECTORY`` for the directories), from the
descriptor of the one before, so no link is followed there either. A link met fails the
open (OSError ELOOP, EXDEV or ENOTDIR), as a missing file fails it (FileNotFoundError).
"""

from __future__ import annotations

import errno
import os

from . import native

# Opens for reading never wait: O_NONBLOCK makes a FIFO planted in a checkpoint open at
# once (its read then fails, or the caller's fstat refuses it) rather than wait for a
# writer forever; it changes nothing for a regular file.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_RESOLVE = native.RESOLVE_NO_SYMLINKS | native.RESOLVE_NO_MAGICLINKS | native.RESOLVE_BENEATH
# openat2's struct per kind of open, made once: each open passes the same one.
_HOW = native.OpenHow(READ_FLAGS, 0, _RESOLVE)
_HOW_DIR = native.OpenHow(_DIR_FLAGS, 0, _RESOLVE)
# The errors of an open that met a link: ELOOP (a link where none may be), EXDEV (a path
# leading out of the directory), ENOTDIR (O_DIRECTORY|O_NOFOLLOW on a link, on some systems).
LINK_ERRNOS = frozenset({errno.ELOOP, errno.EXDEV, errno.ENOTDIR})


def refuses_links() -> bool:
    """Whether :func:`open_beneath` refuses every link here: ``openat2`` or ``O_NOFOLLOW``."""
    return native.has_openat2() or bool(_NOFOLLOW and os.open in os.supports_dir_fd)


def open_beneath(dir_fd: int, rel: str, *, directory: bool = False) -> int:
    """A descriptor, for reading (without waiting: :data:`READ_FLAGS`), of ``rel``
    (``/``-separated) below the open directory ``dir_fd``, following no symbolic link on
    the way nor at its end (``directory``: a directory, opened as one). Errors are raised
    as ``os.open`` raises them (ENOENT: a FileNotFoundError; a link: :data:`LINK_ERRNOS`)."""
    if native.has_openat2():
        return native.openat2(dir_fd, rel, _HOW_DIR if directory else _HOW)
    *dirs, name = rel.split("/")
    fd = dir_fd
    try:
        for part in dirs:
            nxt = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(name, (_DIR_FLAGS if directory else READ_FLAGS) | _NOFOLLOW, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_directory(path: str) -> int:
    """A descriptor of the directory ``path``, which may itself be a link (the checkpoint the
    caller names may be one): every file below it is then opened from it (:func:`open_beneath`)."""
    return os.open(path, _DIR_FLAGS)
