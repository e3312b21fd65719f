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

import os
from collections.abc import Callable
from typing import Any, NoReturn

from .. import _dtypes, _root
from . import dcp, orbax, safetensors, torchfile
from .._checkpoint import TSCKPT, Checkpoint
from .._errors import CheckpointNotFoundError, NotACheckpointError
from .._format import ROOT_KEY
from .._reader import LazyArray
from .._store import Directory, Location, resolve, storage_errors
from .._types import LazySource

FORMATS = (TSCKPT, "safetensors", "torch", "dcp", "orbax")

# Opens a detected checkpoint at a location (keep_bad: as verify reads it, bad leaves listed
# rather than raised) for the read verbs.
Opener = Callable[[Location, bool], Checkpoint]


def detect(src: str) -> str | None:
    """The format of the checkpoint at ``src`` (one of :data:`FORMATS`), from its own marker
    files or leading bytes; None when they show none, or nothing is there. A kvstore URL
    holds a tsckpt checkpoint."""
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


def _open_tsckpt(loc: Location, keep_bad: bool) -> Checkpoint:
    return _root.load(loc, keep_bad=keep_bad)


def _open_orbax(loc: Location, keep_bad: bool) -> Checkpoint:
    return orbax.as_checkpoint(loc)  # its metadata is checked as it is parsed: nothing is kept bad


# The formats the read verbs open, one opener each.
OPENERS: dict[str, Opener] = {TSCKPT: _open_tsckpt, "orbax": _open_orbax}


def open_checkpoint(directory: Directory | Location, *, keep_bad: bool = False) -> Checkpoint:
    """The committed checkpoint at ``directory`` as the read verbs read it: its format
    detected, then parsed and validated by that format's opener, raising a precise error
    when it cannot be read. A location whose format has no opener is opened as tsckpt,
    whose error says what is missing. ``keep_bad`` (verify): leaves whose entries are
    invalid are left out and listed in ``Checkpoint.bad`` instead of raising."""
    loc = directory if isinstance(directory, Location) else resolve(directory)
    with storage_errors(loc):
        fmt = detect(loc.local) if loc.local is not None else TSCKPT
        return OPENERS.get(fmt or TSCKPT, _open_tsckpt)(loc, keep_bad)


# ---- convert: a source tree -------------------------------------------------------------


def checkpoint_tree(ck: Checkpoint) -> Any:
    """An opened checkpoint's tree, arrays as lazy sources read chunk by chunk."""
    made: dict[str, LazySource] = {}

    def leaf(path: str) -> Any:
        stored = ck.aliases.get(path, path)
        if stored in ck.values:
            return ck.values[stored]
        if stored not in made:
            rec = ck.arrays[stored]
            dtype: Any = _dtypes.torch_dtype(rec.dtype) if rec.kind == "torch" else _dtypes.numpy_dtype(rec.dtype)
            made[stored] = LazySource(rec.shape, dtype, LazyArray(ck, stored).read_box, kind=rec.kind)
        return made[stored]

    return ck.build([leaf(p) for p in ck.leaves])


def open_source(src: Directory, fmt: str | None = None, *, allow_pickle: bool = False) -> tuple[str, Any]:
    """(format, source tree) of ``src``: a path or URL (any format), or a kvstore spec dict (a
    format the read verbs open, through TensorStore); ``fmt`` overrides detection and is checked.
    ``allow_pickle``: a format whose metadata is a pickle (DCP) may be unpickled, which can run
    code; without it such a source is refused, saying how to opt in."""
    if isinstance(src, dict):
        if fmt is not None and fmt not in OPENERS:
            raise ValueError(
                f"a kvstore spec source must be a tsckpt or Orbax checkpoint, not {fmt}: {fmt} sources are read "
                "from a local path; pass the path instead of the spec"
            )
        return _checkpoint_source(src, fmt)
    path = os.fspath(src)
    fmt = fmt or detect(path) or _unknown(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown source format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt in OPENERS:
        return _checkpoint_source(path, fmt)
    if fmt == "safetensors":
        if os.path.isdir(path):
            return fmt, safetensors.read_dir(path)
        return fmt, safetensors.read_file(path)
    if fmt == "torch":
        return fmt, torchfile.read_torch_file(path)
    return fmt, dcp.read_dcp(path, allow_pickle=allow_pickle)


def _checkpoint_source(src: str | dict[str, Any], fmt: str | None) -> tuple[str, Any]:
    """(format, source tree) of a checkpoint the read verbs open, which must be of ``fmt`` when given."""
    ck = open_checkpoint(src)
    if fmt is not None and ck.format != fmt:
        if isinstance(src, dict):
            where, hint = str(ck.location), f"from_format={ck.format!r}"
        else:
            where, hint = src, f"--from {ck.format}"
        raise NotACheckpointError(f"{where}: a {ck.format} checkpoint, not {fmt}; pass {hint}")
    ck.check_links()
    return ck.format, checkpoint_tree(ck)


def _unknown(src: str) -> NoReturn:
    """Raise why the format of ``src`` cannot be told."""
    if os.path.isdir(src):
        raise NotACheckpointError(
            f"{src}: cannot tell what this directory holds (no zarr.json, Orbax metadata, DCP .metadata or "
            "*.safetensors); pass the format with --from"
        )
    if not os.path.isfile(src):
        raise CheckpointNotFoundError(f"{src}: no such file or directory")
    raise NotACheckpointError(
        f"{src}: cannot tell the file's format (neither safetensors nor a torch.save file); pass it with --from"
    )
