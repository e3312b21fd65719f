"""What a failed read of stored data means: TensorStore's errors classified once, in the
words every read path (lazy reads, restore, verify, the own shard reader) uses; and
whether the checkpoint read is still the one that was opened (:func:`unchanged`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

from .._errors import CheckpointReplacedError, CorruptCheckpointError, TsckptError
from .._storage import store as _store
from .._storage.store import Location
from .arrays import MANIFEST
from .bounds import ROOT_BYTES, file_problem
from .checkpoint import Checkpoint
from .records import ROOT_KEY

# What a failed chunk read means.
CHECKSUM_MISMATCH = "checksum mismatch: stored bytes were altered"
CHUNK_MISSING = "a chunk file is missing"
UNDECODABLE = "stored data could not be decoded (truncated or damaged file)"


def _classify_read_error(err: Exception) -> tuple[str, str]:
    """(what a failed chunk read means, TensorStore's message): the one place that reads it."""
    msg = " ".join(str(err).split())
    low = msg.lower()
    if "digest mismatch" in low or "crc32c" in low or "checksum" in low:
        return CHECKSUM_MISMATCH, msg
    if "not_found" in low or "missing" in low or "not found" in low:
        return CHUNK_MISSING, msg
    return UNDECODABLE, msg


def describe_read_error(err: Exception) -> str:
    """A failed chunk read in one phrase, with TensorStore's message in parentheses."""
    what, msg = _classify_read_error(err)
    return f"{what} ({msg})"


def corrupt_error(ck: Checkpoint, path: str, err: Exception) -> TsckptError:
    """The error of a failed chunk read of array ``path``: the storage, or damaged data."""
    unreachable = _store.storage_problem(ck.location, err, leaf=path)
    if unreachable is not None:
        return unreachable
    what, msg = _classify_read_error(err)
    return CorruptCheckpointError(f"'{path}' in {ck.location}: {what}; restore from another checkpoint. ({msg})")


def node_error(ck: Checkpoint, path: str, err: Exception) -> TsckptError:
    """Opening an array failed: its zarr.json is missing, unreadable, or disagrees with the root metadata."""
    unreachable = _store.storage_problem(ck.location, err, leaf=path)
    if unreachable is not None:
        return unreachable
    msg = str(err).split(" [tensorstore_spec=")[0]
    low = msg.lower()
    if "ocdbt database" in low and any(s in low for s in ("manifest", "byte range", "error decoding", "invalid json")):
        what = (
            f"the checkpoint's database could not be read for {path}/zarr.json ({MANIFEST} or a file under d/ "
            "or ocdbt.r*/d/ is damaged or missing)"
        )
    elif "does not exist" in msg or "not found" in low:
        what = f"the array is missing ({path}/zarr.json does not exist)"
    elif "Cannot create using specified" in msg:
        what = "TensorStore cannot open the array its record describes ('shard_shape' or 'chunk_shape' beyond its limits)"
    elif "Expected" in msg or "Mismatch" in msg or "Incompatible" in msg:
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
        now = _now(bytes(found.value)) if found.state == "value" else " (its root zarr.json is gone)"
    return CheckpointReplacedError(
        f"{loc}: the checkpoint was replaced or deleted while it was being read (by another save with "
        "overwrite=True, or a manager's retention or clean-up); nothing read since it was opened is "
        f"returned, as it could mix two checkpoints{now}. Open or restore it again (a manager: pick the "
        "step again), and keep steps being read out of retention"
    )


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
