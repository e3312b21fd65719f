"""Exception hierarchy. Every class also derives from the builtin a caller would catch."""

from __future__ import annotations

import os


class TsckptError(Exception):
    """Base class of every error tsckpt raises on purpose."""


class CheckpointNotFoundError(TsckptError, FileNotFoundError):
    """The directory does not exist, or holds no checkpoint at all."""


class NotACheckpointError(TsckptError, ValueError):
    """The location holds data, but not a tsckpt checkpoint."""


class CheckpointIncompleteError(TsckptError, RuntimeError):
    """A save started here but never committed (crashed or still running)."""


class CheckpointExistsError(TsckptError, FileExistsError):
    """Saving over an existing checkpoint without ``overwrite=True``."""


class FormatVersionError(TsckptError, ValueError):
    """The checkpoint was written by a newer, incompatible format version."""


class StructureMismatchError(TsckptError, KeyError):
    """Target tree and checkpoint disagree on which leaf paths exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(TsckptError, ValueError):
    """A leaf's shape in the target differs from the stored one."""


class LeafTypeError(TsckptError, TypeError):
    """A leaf has a type tsckpt cannot store or restore into."""


class CheckpointReplacedError(TsckptError, RuntimeError):
    """The checkpoint being read was replaced (another save with ``overwrite=True``) or
    deleted (retention, a clean-up) while it was being read: what was read may mix two
    checkpoints, so none of it is returned. Open or restore it again."""


class CorruptCheckpointError(TsckptError, OSError):
    """Stored bytes fail their checksum, are truncated, or are missing."""


class LinkRefusedError(TsckptError, PermissionError):
    """The checkpoint holds a symbolic link, which tsckpt does not follow (docs/security.md: a
    link could lead anywhere, so a checkpoint must hold its own files; the one exception, a
    Hugging Face cache snapshot's links into its own repository's ``blobs/``, is read). Nothing
    is damaged: read a copy that holds the files themselves (``hf download REPO --local-dir
    DIR``). ``link`` is the link's path, ``target`` where it points."""

    def __init__(self, message: str, *, link: str | None = None, target: str | None = None) -> None:
        super().__init__(message)
        self.link = link
        self.target = target

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]
        return (type(self), (str(self),), {"link": self.link, "target": self.target})


class LayoutError(TsckptError, ValueError):
    """Shards given for one global array overlap, leave holes, or disagree; or the ranks of
    one save disagree on what it is (its checkpoint, tree or options)."""


class DistributedError(TsckptError, RuntimeError):
    """Another rank failed or disagreed during a collective save or restore."""

    lost: tuple[int, ...] = ()  # the ranks found gone (process or host), when a peer was lost


class SaveInProgressError(TsckptError, RuntimeError):
    """A save is still running: an asynchronous save the caller asked not to wait for, or
    another process's save into the directory being overwritten or cleaned up."""


class WriterLostError(TsckptError, RuntimeError):
    """The writer process of an asynchronous save died (killed, out of memory) before the
    save committed: nothing of it is listed as a checkpoint, and the next save starts a new
    writer."""


class ForkedProcessError(TsckptError, RuntimeError):
    """This process was forked (``fork()``, multiprocessing's default start method on Linux)
    from one that had used tsckpt: TensorStore's threads do not survive a fork."""


class LossyCastError(TsckptError, ValueError):
    """Values read would not survive the cast into the target's dtype (overflow, lost integer
    bits) under a casting policy that checks them."""


class StorageError(TsckptError, OSError):
    """The storage failed a request: an object store refused or could not be reached (no
    such bucket, access denied, endpoint unreachable), or the operating system reported an
    error (no space left, permission denied, read-only file system, I/O error).

    ``errno`` is set when the cause has one, ``filename`` names the file (or the
    checkpoint), and ``leaf`` is the leaf path being read or written, when known.
    """

    def __init__(self, message: str, *, errno: int | None = None, filename: str | None = None,
                 leaf: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = os.strerror(errno) if errno else None
        self.filename = filename
        self.leaf = leaf

    def __str__(self) -> str:  # OSError would format errno and filename instead of the message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple:  # type: ignore[type-arg]
        state = {"errno": self.errno, "strerror": self.strerror, "filename": self.filename, "leaf": self.leaf}
        return (type(self), (str(self),), state)


class StorageFullError(StorageError):
    """No space is left on the device, or the disk quota is used up (``errno`` ENOSPC or
    EDQUOT): free space, then save again."""


__all__ = [
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointReplacedError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedError",
    "FormatVersionError",
    "LayoutError",
    "LeafTypeError",
    "LinkRefusedError",
    "LossyCastError",
    "NotACheckpointError",
    "SaveInProgressError",
    "ShapeMismatchError",
    "StorageError",
    "StorageFullError",
    "StructureMismatchError",
    "TsckptError",
    "WriterLostError",
]


def count_and_list(items: list[str], limit: int = 5) -> str:
    """``3 ('a', 'b', 'c')``: how many, and the first few, for error messages."""
    shown = ", ".join(repr(x) for x in items[:limit])
    return f"{len(items)} ({shown}{', ...' if len(items) > limit else ''})"


def short_repr(value: object, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters: values quoted from a damaged file can be huge,
    and objects unpickled from one may not even have a repr."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - e.g. a torch.Size holding an int beyond 64 bits
        text = f"<a {type(value).__name__} without a repr>"
    return text if len(text) <= width else text[: width - 3] + "..."


def amend(err: BaseException, text: str) -> None:
    """Add ``text`` to the message of ``err`` (a note where the message cannot be changed):
    what a failed save did about its partial checkpoint, said in the error the caller gets."""
    if isinstance(err, TsckptError) and len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}; {text}",)
    elif hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(text)
