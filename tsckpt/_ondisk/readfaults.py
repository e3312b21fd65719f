"""What a failed read of stored data means, in the words every read path (lazy reads,
restore, verify, the own shard reader) uses, with TensorStore's errors classified by
:data:`tsckpt._storage.faults.TABLE`; and whether the checkpoint read is still the one
that was opened (:func:`unchanged`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

from .._errors import CheckpointReplacedError, CorruptCheckpointError, TsckptError
from .._storage import faults as _faults
from .._storage.confine import confined
from .._storage.faults import UNDECODABLE
from .._storage.locations import Location
from .arrays import MANIFEST
from .bounds import ROOT_BYTES, file_problem, read_file
from .checkpoint import Checkpoint
from .records import ROOT_KEY


def _classify_read_error(err: Exception) -> tuple[str, str]:
    """(what a failed chunk read means, TensorStore's message)."""
    msg = _faults.one_line(err)
    return _faults.classify(_faults.CHUNK_READ, msg, UNDECODABLE), msg


def describe_read_error(err: Exception) -> str:
    """A failed chunk read in one phrase, with TensorStore's message in parentheses."""
    what, msg = _classify_read_error(err)
    return f"{what} ({msg})"


def corrupt_error(ck: Checkpoint, path: str, err: Exception) -> TsckptError:
    """The error of a failed chunk read of array ``path``: the storage, or damaged data."""
    unreachable = _faults.storage_problem(ck.location, err, leaf=path)
    if unreachable is not None:
        return unreachable
    what, msg = _classify_read_error(err)
    return CorruptCheckpointError(f"'{path}' in {ck.location}: {what}; restore from another checkpoint. ({msg})")


def node_error(ck: Checkpoint, path: str, err: Exception) -> TsckptError:
    """Opening an array failed: its zarr.json is missing, unreadable, or disagrees with the root metadata."""
    unreachable = _faults.storage_problem(ck.location, err, leaf=path)
    if unreachable is not None:
        return unreachable
    msg = _faults.without_spec(str(err))
    fault = _faults.classify(_faults.ARRAY_OPEN, msg)
    if fault == _faults.DATABASE_DAMAGED:
        what = (
            f"the checkpoint's database could not be read for {path}/zarr.json ({MANIFEST} or a file under d/ "
            "or ocdbt.r*/d/ is damaged or missing)"
        )
    elif fault == _faults.ARRAY_MISSING:
        what = f"the array is missing ({path}/zarr.json does not exist)"
    elif fault == _faults.BEYOND_LIMITS:
        what = "TensorStore cannot open the array its record describes ('shard_shape' or 'chunk_shape' beyond its limits)"
    elif fault == _faults.NODE_MISMATCH:
        what = f"{path}/zarr.json does not match the root metadata (shape, dtype or chunking differ)"
    else:
        what = f"{path}/zarr.json cannot be read"
    return CorruptCheckpointError(f"'{path}' in {ck.location}: {what}; restore from another checkpoint. ({msg})")


def replaced(loc: Location, generation: bytes | None) -> CheckpointReplacedError | None:
    """The error of a checkpoint at ``loc`` whose root is no longer the one of ``generation``
    that was opened (None: it still is, or cannot be told). One conditional read of the
    root: nothing is transferred while it is unchanged (an object store answers 304)."""
    if generation is None:
        return None
    problem = file_problem(os.path.join(loc.local, ROOT_KEY), ROOT_BYTES, "a root zarr.json") if loc.local else None
    if problem is not None:  # not read (a FIFO, a device, a huge file): it is no longer the root opened
        now = f" (its root zarr.json now {problem})"
    else:
        try:
            found = loc.kvstore().read(ROOT_KEY, if_not_equal=generation).result()
        except ValueError:  # the storage fails: the read's own error stands
            return None
        if found.state == "unspecified":
            return None
        now = _now(_root_now(loc, bytes(found.value))) if found.state == "value" else " (its root zarr.json is gone)"
    return CheckpointReplacedError(
        f"{loc}: the checkpoint was replaced or deleted while it was being read (by another save with "
        "overwrite=True, or a manager's retention or clean-up); nothing read since it was opened is "
        f"returned, as it could mix two checkpoints{now}. Open or restore it again (a manager: pick the "
        "step again), and keep steps being read out of retention"
    )


def _root_now(loc: Location, value: bytes) -> bytes:
    """The root that replaced the opened one, for the message: ``value`` as read, but on a
    local disk read again with no link followed (TensorStore's read follows one, and what a
    link leads to is never shown), refused if it is one."""
    if loc.local is None:
        return value
    path = confined(loc.local, ROOT_KEY, where=str(loc), field="the root metadata")
    return read_file(path, ROOT_BYTES, "a root zarr.json", fix="restore from another checkpoint")


def _now(value: bytes) -> str:
    """What the root that replaced the opened one says, for the message."""
    try:
        state = json.loads(value)["attributes"]["tsckpt"]["state"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return ""
    return f" (its root now says {state!r})" if isinstance(state, str) else ""


@contextlib.contextmanager
def unchanged(ck: Checkpoint) -> Iterator[None]:
    """Reads of ``ck`` inside the block come from the checkpoint that was opened, or raise
    CheckpointReplacedError. Checked after the reads: a save replacing a checkpoint, and a
    deletion, remove its root before any of its data (tsckpt/_save/commit.py, tsckpt/_manager.py),
    so a root unchanged after the reads was unchanged during them. A read that fails while
    the root changed (a file gone, a database replaced) raises the same error, from it."""
    try:
        yield
    except (OSError, ValueError) as e:
        err = replaced(ck.location, ck.root_generation)
        if err is not None:
            raise err from e
        raise
    err = replaced(ck.location, ck.root_generation)
    if err is not None:
        raise err
