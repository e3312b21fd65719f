"""A local checkpoint as TensorStore reads it: links to descriptors held open (docs/security.md).

TensorStore's file kvstore opens each file by its path and follows links, with no option
not to; a file of a checkpoint swapped for a link between a check and TensorStore's open
would be read from wherever the link leads. So TensorStore never reads a local
checkpoint's own directory: it reads a :class:`Mirror`, a private directory (made by
``mkdtemp`` in :data:`BASE`: only this user may write it) of links this module makes, each to
``/proc/self/fd/N`` (``/dev/fd/N`` elsewhere) of a descriptor of one file of the
checkpoint, opened below the checkpoint's directory with no link followed
(:func:`beneath.open_beneath`) and held open. Opening ``/proc/self/fd/N`` opens the file
that descriptor holds, whatever its name leads to by then, so TensorStore reads only
regular files that were inside the checkpoint when opened, and reads of byte ranges stay
byte ranges (nothing is copied).

Files are added as readers are about to need them (:meth:`Mirror.add`: a file;
:meth:`Mirror.add_tree`: every file below a directory, walked from descriptors), each once;
a missing file stays missing. The descriptors stay open, and the directory stays, until
the mirror is gone; then a thread of this module removes the links first, so that no
link names a reused descriptor, and closes the descriptors (what is left at exit is
removed then). Only the process that made a mirror removes it: a forked child letting
its copy go leaves its parent's mirror be.
"""

from __future__ import annotations

import atexit
import errno
import os
import queue
import shutil
import stat
import tempfile
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from .._errors import CorruptCheckpointError, StorageError
from . import beneath, faults
from .confine import Confined, Root, changed_link, file_kind, open_read

# Where mirrors are made, and how each is named: a memory file system where there is one
# (a link made on a loaded disk's file system took 0.7 ms, on tmpfs 9 us), else the
# temporary directory. A mirror holds links only: its size is a few bytes per file.
BASE = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else tempfile.gettempdir()
PREFIX = "tsckpt-read-"
# Where a process's descriptors are named: opening one of these opens the file held.
FD_DIR = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
# The most descriptors a process is let hold when mirrors need them (Linux's usual hard limit).
_FD_LIMIT = 1 << 20


class Mirror:
    """A private directory of links to held descriptors of the files of the local checkpoint
    at ``root`` (``where``: how messages name the checkpoint), for TensorStore to read."""

    def __init__(self, root: str, where: str) -> None:
        if not os.path.isdir(FD_DIR):
            raise StorageError(
                f"{where}: TensorStore reads a local checkpoint through links to the descriptors of its files, "
                f"named in {FD_DIR}, which this system lacks (is /proc mounted?); reading through TensorStore "
                "by path could follow a link planted in the checkpoint (docs/security.md): mount /proc, or "
                "read the checkpoint where it is",
                errno=errno.ENOENT, filename=FD_DIR,
            )
        self._root = Root(root)
        self._where = where
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=BASE)
        faults.stand_in(self.path, root)  # messages name the checkpoint's files, not the links
        self._fds: list[int] = []
        self._done: set[str] = set()  # files and directories added (or found missing)
        self._sizes: dict[str, int] = {}  # file -> its size when opened
        self._dirs = {""}  # the mirror's own directories made
        self._lock = threading.Lock()
        _raise_fd_limit()
        weakref.finalize(self, _release, self.path, self._fds, os.getpid())

    def spec(self) -> dict[str, Any]:
        """The file kvstore spec TensorStore reads the checkpoint through."""
        return {"driver": "file", "path": f"{self.path}/"}

    def size(self, rel: str) -> int | None:
        """The size of the checkpoint's file ``rel`` when the mirror opened it (from the ``fstat``
        every file added gets: no system call here); None when it is not in the mirror."""
        return self._sizes.get(rel)

    def add(self, rels: Iterable[str], *, field: str = "the file") -> None:
        """Link each file of ``rels`` (paths below the checkpoint) into the mirror, opened
        now with no link followed: LinkRefusedError if a link is on the way (``field``: what
        the message calls the file), and CorruptCheckpointError for a file that is no regular
        file; a missing one stays missing."""
        with self._lock:
            for rel in rels:
                if rel in self._done:
                    continue
                try:
                    fd = open_read(Confined(self._root, rel, self._where, field))
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    self._done.add(rel)
                    continue
                self._link(rel, fd)

    def add_tree(self, rel: str, *, field: str = "the file") -> None:
        """Link every file below the directory ``rel`` of the checkpoint ("": all of it),
        walked from descriptors opened with no link followed; a link met is refused
        (``field``: what the message calls the file)."""
        with self._lock:
            if rel in self._done:
                return
            try:
                top = beneath.open_beneath(self._root.fd, rel, directory=True) if rel else os.dup(self._root.fd)
            except OSError as e:
                if e.errno in beneath.LINK_ERRNOS:
                    path = Confined(self._root, rel, self._where, field)
                    os.close(open_read(path))  # names the link
                    raise changed_link(path) from None  # a link when opened, no more
                self._done.add(rel)  # missing (or a file): nothing below it
                return
            try:
                self._walk(top, rel, field)
            finally:
                os.close(top)
            self._done.add(rel)

    def _walk(self, dir_fd: int, rel: str, field: str) -> None:
        """Link the files below the open directory ``dir_fd`` (the checkpoint's ``rel``)."""
        for entry in list(os.scandir(dir_fd)):
            sub = f"{rel}/{entry.name}" if rel else entry.name
            if sub in self._done:
                continue
            flags = beneath.READ_FLAGS | os.O_NOFOLLOW
            if entry.is_dir(follow_symlinks=False):
                flags |= os.O_DIRECTORY
            try:
                fd = os.open(entry.name, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # gone since it was listed
            except OSError as e:
                if e.errno in beneath.LINK_ERRNOS:
                    path = Confined(self._root, sub, self._where, field)
                    os.close(open_read(path))  # names the link
                    raise changed_link(path) from None  # a link when opened, no more
                raise
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                try:
                    self._walk(fd, sub, field)
                finally:
                    os.close(fd)
            else:
                self._link(sub, fd, st)

    def _link(self, rel: str, fd: int, st: os.stat_result | None = None) -> None:
        """Hold ``fd`` (of the checkpoint's file ``rel``, whose ``fstat`` is ``st`` when known)
        and link it into the mirror as ``rel``, noting its size (:meth:`size`)."""
        if st is None:
            st = os.fstat(fd)
        mode = st.st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                self._done.add(rel)
                return
            raise CorruptCheckpointError(
                f"{self._where}: {rel} is {file_kind(mode)}, not a regular file; a checkpoint holds only "
                "directories and regular files: replace it with a copy of its file"
            )
        self._fds.append(fd)
        self._sizes[rel] = st.st_size
        self._make_dir(rel.rpartition("/")[0])
        os.symlink(f"{FD_DIR}/{fd}", f"{self.path}/{rel}")
        self._done.add(rel)

    def _make_dir(self, rel: str) -> None:
        """The mirror's directory ``rel`` ("": its top), made once."""
        if rel in self._dirs:
            return
        self._make_dir(rel.rpartition("/")[0])
        os.mkdir(f"{self.path}/{rel}")
        self._dirs.add(rel)


def _release(path: str, fds: list[int], owner: int) -> None:
    """Let a mirror go: in the process ``owner`` that made it, handed to the thread that
    removes mirrors (:func:`_remove`; a restore of 10,000 leaves read through TensorStore
    would otherwise wait 2 s for it to remove their links); in a forked child letting its
    copy go, only its own descriptors are closed, and the parent's mirror is left be."""
    if os.getpid() != owner:
        _close(fds)
        return
    faults.stand_in(path, None)
    global _remover
    with _remover_lock:
        _removals.put((path, fds))
        if _remover is None or not _remover.is_alive():
            _remover = threading.Thread(target=_remove_all, name="tsckpt-mirror-removal", daemon=True)
            _remover.start()


def _remove(path: str, fds: list[int]) -> None:
    """Remove a mirror's links, then close the descriptors they named (no link is left to
    name a descriptor number that is reused)."""
    shutil.rmtree(path, ignore_errors=True)
    _close(fds)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# Mirrors let go, removed in order by one thread; what is left at exit is removed then.
_removals: queue.SimpleQueue[tuple[str, list[int]] | None] = queue.SimpleQueue()
_remover: threading.Thread | None = None
_remover_lock = threading.Lock()


def _remove_all() -> None:
    while (item := _removals.get()) is not None:
        _remove(*item)


@atexit.register
def _remove_left() -> None:
    """At exit (after the mirrors still alive were let go): let the thread finish its
    removal, then remove the rest here."""
    remover = _remover
    if remover is not None and remover.is_alive():
        _removals.put(None)
        remover.join(timeout=10)
    while True:
        try:
            item = _removals.get_nowait()
        except queue.Empty:
            return
        if item is not None:
            _remove(*item)


def _raise_fd_limit() -> None:
    """Let the process hold as many descriptors as the system allows it (the soft limit up to
    the hard one): a mirror holds one per file TensorStore reads."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, _FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass

