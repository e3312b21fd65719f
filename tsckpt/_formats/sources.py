"""Checkpoints of any format tsckpt reads, opened as trees of lazy sources.

A *source tree* is the checkpoint's pytree with every array as a
:class:`LazySource` (or a tensor that the OS maps lazily), read only when it is
written somewhere else, and plain values as they are. Tied arrays are one
source object under several paths, so writers store them once.
"""

from __future__ import annotations

import os
from typing import Any

from .. import _dtypes
from . import orbax
from .._errors import CheckpointNotFoundError, NotACheckpointError
from .._reader import Checkpoint, LazyArray, load
from .._types import LazySource

FORMATS = ("tsckpt", "safetensors", "torch", "dcp", "orbax")
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO2 = b"\x80\x02"  # torch.save's legacy (non-zip) format starts with a pickle


def detect(src: str) -> str:
    """The format of ``src``, from its own marker files or leading bytes."""
    from . import safetensors

    if "://" in src:
        return "tsckpt"
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, "zarr.json")):
            return "tsckpt"
        if orbax.detect(src):
            return "orbax"
        if os.path.isfile(os.path.join(src, ".metadata")):
            return "dcp"
        if safetensors.is_hf_dir(src):
            return "safetensors"
        raise NotACheckpointError(
            f"{src}: cannot tell what this directory holds (no zarr.json, Orbax metadata, DCP .metadata or "
            "*.safetensors); pass the format with --from"
        )
    if not os.path.isfile(src):
        raise CheckpointNotFoundError(f"{src}: no such file or directory")
    with open(src, "rb") as f:
        head = f.read(9)
    if head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_PROTO2):
        return "torch"
    if head[8:9] == b"{" or src.endswith(".safetensors"):
        return "safetensors"
    raise NotACheckpointError(
        f"{src}: cannot tell the file's format (neither safetensors nor a torch.save file); pass it with --from"
    )


def checkpoint_tree(ck: Checkpoint) -> Any:
    """A tsckpt (or Orbax) checkpoint's tree, arrays as lazy sources read chunk by chunk."""
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


def open_source(src: str, fmt: str | None = None) -> tuple[str, Any]:
    """(format, source tree) of ``src``; ``fmt`` overrides detection and is checked."""
    fmt = fmt or detect(src)
    if fmt not in FORMATS:
        raise ValueError(f"unknown source format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt in ("tsckpt", "orbax"):
        ck = load(src)
        if ck.format != fmt:
            raise NotACheckpointError(f"{src}: a {ck.format} checkpoint, not {fmt}; pass --from {ck.format}")
        ck.check_links()
        return fmt, checkpoint_tree(ck)
    if fmt == "safetensors":
        from . import safetensors

        if os.path.isdir(src):
            return fmt, safetensors.read_dir(src)
        return fmt, safetensors.read_file(src)
    if fmt == "torch":
        from .torchfile import read_torch_file

        return fmt, read_torch_file(src)
    from .dcp import read_dcp

    return fmt, read_dcp(src)
