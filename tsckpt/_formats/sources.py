"""Checkpoints of any format tsckpt reads: which format a location holds, and opening it.

:func:`detect` is the one place that asks which library wrote a checkpoint; each
format module only knows its own marker files or leading bytes. The read verbs
(open, metadata, restore, verify, the CLI) call :func:`open_checkpoint`, which opens
a detected format with its opener in :data:`OPENERS` as a :class:`Checkpoint`.
convert calls :func:`open_source`, which opens any format as a *source tree*: the
checkpoint's pytree with every array as a :class:`LazySource` (or a tensor that the
OS maps lazily), read only when it is written somewhere else, and plain values as
they are. Tied arrays are one source object under several paths, so writers store
them once.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import NoReturn

from .._errors import CheckpointNotFoundError, NotACheckpointError
from .._ondisk import root as _root
from .._ondisk.checkpoint import TSCKPT, Checkpoint
from .._ondisk.records import ROOT_KEY
from .._storage.faults import storage_errors
from .._storage.hfcache import SCHEME
from .._storage.locations import Directory, Location, resolve
from . import dcp, lazy, orbax, safetensors, torchdir, torchfile

FORMATS = (TSCKPT, "safetensors", "torch", "dcp", "orbax")
# The formats read through TensorStore, which a kvstore spec or URL may hold.
KVSTORE_FORMATS = (TSCKPT, "orbax")


def detect(src: str) -> str | None:
    """The format of the checkpoint at ``src`` (one of :data:`FORMATS`), from its own marker
    files or leading bytes; None when they show none, or nothing is there. A kvstore URL
    holds a tsckpt checkpoint; ``hf://ORG/NAME[@REVISION]``, what its snapshot in the local
    Hugging Face cache holds."""
    if src.startswith(SCHEME):
        return detect(str(resolve(src)))
    if "://" in src:
        return TSCKPT
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, ROOT_KEY)):
            return TSCKPT
        # formats read without unpickling first: a .metadata file never makes one of them DCP
        if orbax.detect(src):
            return "orbax"
        if safetensors.is_hf_dir(src):
            return "safetensors"
        if torchdir.is_torch_dir(src):
            return "torch"
        if dcp.is_dcp_dir(src):
            return "dcp"
        return None
    if not os.path.isfile(src):
        return None
    with open(src, "rb") as f:
        head = f.read(9)
    if torchfile.is_torch_file(head):
        return "torch"
    if safetensors.is_safetensors_file(head) or src.endswith(".safetensors"):
        return "safetensors"
    return None


# ---- the read verbs: a checkpoint -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reading:
    """How the read verbs open a checkpoint: ``keep_bad`` (verify) lists bad leaves rather than
    raising; ``allow_pickle`` lets a format whose metadata is a Python pickle (DCP) be unpickled."""

    keep_bad: bool = False
    allow_pickle: bool = False


# Opens a detected (or named) checkpoint at a location for the read verbs.
Opener = Callable[[Location, Reading], Checkpoint]


def _open_tsckpt(loc: Location, how: Reading) -> Checkpoint:
    return _root.load(loc, keep_bad=how.keep_bad)


def _open_orbax(loc: Location, how: Reading) -> Checkpoint:
    return orbax.as_checkpoint(loc)  # its metadata is checked as it is parsed: nothing is kept bad


def _local(loc: Location, fmt: str) -> str:
    """The local path of a checkpoint of a format read from local files only."""
    if loc.local is None:
        raise NotACheckpointError(f"{loc}: {fmt} checkpoints are read from a local path; copy it to one")
    return loc.local


def _open_safetensors(loc: Location, how: Reading) -> Checkpoint:
    path = _local(loc, "safetensors")
    tree = safetensors.read_dir(path) if os.path.isdir(path) else safetensors.read_file(path)
    return lazy.as_checkpoint(loc, "safetensors", tree)


def _open_torch(loc: Location, how: Reading) -> Checkpoint:
    path = _local(loc, "torch.save")
    tree = torchdir.read_torch_dir(path) if os.path.isdir(path) else torchfile.read_torch_file(path)
    return lazy.as_checkpoint(loc, "torch", tree)


def _open_dcp(loc: Location, how: Reading) -> Checkpoint:
    path = _local(loc, "torch.distributed.checkpoint")
    return lazy.as_checkpoint(loc, "dcp", dcp.read_dcp(path, allow_pickle=how.allow_pickle))


# The formats the read verbs open, one opener each: tsckpt and Orbax through TensorStore,
# the others as lazy sources (_formats/lazy.py).
OPENERS: dict[str, Opener] = {
    TSCKPT: _open_tsckpt, "orbax": _open_orbax, "safetensors": _open_safetensors, "torch": _open_torch,
    "dcp": _open_dcp,
}


def open_checkpoint(
    directory: Directory | Location,
    *,
    keep_bad: bool = False,
    format: str | None = None,  # noqa: A002 - the read verbs' option
    allow_pickle: bool = False,
) -> Checkpoint:
    """The committed checkpoint at ``directory`` as the read verbs read it: its format
    detected (or ``format``, which overrides detection), then parsed and validated by that
    format's opener, raising a precise error when it cannot be read. A location whose format
    is not told is opened as tsckpt, whose error says what is missing (a local file: an error
    saying its format cannot be told). ``keep_bad`` (verify): leaves whose entries are invalid
    are left out and listed in ``Checkpoint.bad`` instead of raising. ``allow_pickle``: a DCP
    directory's pickled metadata may be unpickled (refused otherwise)."""
    loc = directory if isinstance(directory, Location) else resolve(directory)
    if format is not None and format not in OPENERS:
        raise ValueError(f"unknown checkpoint format {format!r}; choose one of {', '.join(FORMATS)}")
    with storage_errors(loc):
        fmt = format or (detect(loc.local) if loc.local is not None else TSCKPT)
        if fmt is None and loc.local is not None and os.path.isfile(loc.local):
            unknown_format(loc.local)
        return OPENERS[fmt or TSCKPT](loc, Reading(keep_bad, allow_pickle))


def unknown_format(src: str) -> NoReturn:
    """Raise why the format of ``src`` cannot be told."""
    if os.path.isdir(src):
        raise NotACheckpointError(
            f"{src}: cannot tell what this directory holds (no zarr.json, Orbax metadata, *.safetensors, "
            f"{torchdir.INDEX_NAME} or {torchdir.SINGLE_NAME}, or DCP .metadata); pass the format with --from"
        )
    if not os.path.isfile(src):
        raise CheckpointNotFoundError(f"{src}: no such file or directory")
    raise NotACheckpointError(
        f"{src}: cannot tell the file's format (neither safetensors nor a torch.save file); pass it with --from"
    )
