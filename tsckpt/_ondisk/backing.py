"""Whether the shard files a read touches hold the bytes their array's record says they
do, checked before anything is allocated or decoded for the read: TensorStore allocates
a chunk at the size the record gives it before it reads the file, so a damaged record
could otherwise claim any amount of memory (docs/format.md, "Validation")."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from .._errors import CorruptCheckpointError, short_repr
from .._runtime.window import Window
from .._storage import faults as _faults
from .arrays import stored_files, stored_size
from .checkpoint import Checkpoint
from .records import ArrayRecord

# A read whose files the record says hold at most this many bytes, counting TensorStore's
# bookkeeping of about CHUNK_OVERHEAD bytes for each chunk it decodes, is not checked first:
# whatever a damaged record claims, a read allocates at most this much more than the
# checkpoint stores (docs/format.md, "Validation").
UNCHECKED_BYTES = 64 << 20
CHUNK_OVERHEAD = 1 << 10
_PROBES_IN_FLIGHT = 64
_MAX_FILE_BYTES = 2**62


Box = tuple[slice, ...]


@dataclasses.dataclass(frozen=True)
class _Probe:
    """A 1-byte read at the expected end of one shard file of array ``path``."""

    path: str
    key: str
    size: int  # bytes the record gives the file
    fields: str  # the record's fields that give it, for the message
    files: int  # files the read touches
    whole: bool  # the read is of the whole array
    future: Any


def backing_problems(ck: Checkpoint, reads: Iterable[tuple[str, Box | None]]) -> dict[str, str]:
    """Array path -> why the shard files a read (path, box; None: the whole array) touches do
    not hold the bytes its record says they do, for each read that fails. One 1-byte read
    at each file's expected end (which fails when the file is shorter) proves the file holds
    its chunks, index and checksums. The reads of all arrays are in flight together; files
    are probed in order and an array's first missing or short one ends its probes, however
    many files its record claims. Arrays read whole are remembered in ``ck.backed``."""
    found: dict[str, str] = {}
    whole: list[str] = []
    window: Window[_Probe] = Window(_PROBES_IN_FLIGHT, lambda probe: _settle(ck, probe, found))
    for path, box in reads:
        if ck.foreign or (box is None and path in ck.backed):
            continue
        rec = ck.arrays[path]
        files, chunks, nbytes = stored_size(rec, box)
        if nbytes + chunks * CHUNK_OVERHEAD <= UNCHECKED_BYTES:
            continue
        fields = _fields(rec)
        for key, size in stored_files(rec, box):
            if path in found:
                break
            if size > _MAX_FILE_BYTES:
                found[path] = f"{key} cannot hold the {size} bytes that {fields} give it (no file holds 2**62 bytes)"
                break
            kv = ck.kvstore()
            ck.hold([key], leaf=path)
            future = kv.read(key, byte_range=slice(size - 1, size))
            window.add(_Probe(path, key, size, fields, files, box is None, future))
        if box is None:
            whole.append(path)
    window.drain()
    ck.backed.update(p for p in whole if p not in found)
    return found


def _fields(rec: ArrayRecord) -> str:
    """The record's fields that give its files their sizes, as a message names them."""
    chunking = rec.chunking
    chunk = None if chunking.chunk_shape is None else list(chunking.chunk_shape)
    return (
        f"its record's 'shape' {short_repr(list(rec.shape))}, 'shard_shape' "
        f"{short_repr(list(chunking.shard_shape))}, 'chunk_shape' {short_repr(chunk)} and 'dtype' {rec.dtype!r}"
    )


def _settle(ck: Checkpoint, probe: _Probe, found: dict[str, str]) -> None:
    """Wait for one probe; a missing or short file goes to ``found`` (the array's first only)."""
    try:
        got = probe.future.result()
    except ValueError as e:
        unreachable = _faults.storage_problem(ck.location, e)
        if unreachable is not None:
            raise unreachable from e
        msg = _faults.without_response(_faults.one_line(e))
        if _faults.classify(_faults.FILE_END, msg) == _faults.SHORT_FILE:
            found.setdefault(
                probe.path, f"{probe.key} holds fewer than the {probe.size} bytes that {probe.fields} give it ({msg})"
            )
        else:
            found.setdefault(probe.path, f"{probe.key} cannot be read ({msg})")
        return
    if got.state != "value":
        part = "the array" if probe.whole else "the part read"
        why = f"{probe.key} does not exist; {probe.fields} give {part} {probe.files} such files"
        found.setdefault(probe.path, f"a chunk file is missing ({why})")


def check_backed(ck: Checkpoint, paths: Iterable[str], box: Box | None = None) -> None:
    """Raise the first of :func:`backing_problems` for reads of ``box`` (default: all) of
    each array of ``paths``, as a CorruptCheckpointError naming the leaf."""
    paths = list(paths)
    found = backing_problems(ck, [(p, box) for p in paths])
    for path in paths:
        if path in found:
            raise CorruptCheckpointError(f"'{path}' in {ck.location}: {found[path]}; restore from another checkpoint")
