"""What a failed read of stored data means: TensorStore's errors classified once, in the
words every read path (lazy reads, restore, verify, the own shard reader) uses."""

from __future__ import annotations

from . import _store
from ._arrays import MANIFEST
from ._checkpoint import Checkpoint
from ._errors import CorruptCheckpointError, TsckptError

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
