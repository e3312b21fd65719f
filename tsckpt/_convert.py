"""convert(): copy a checkpoint between tsckpt and other formats."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import _safetensors
from ._reader import load
from ._restore import restore
from ._save import save
from ._store import Directory


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What :func:`convert` wrote."""

    src: str
    dst: str
    n_arrays: int
    nbytes: int
    n_values: int


def _is_safetensors(path: str) -> bool:
    return path.endswith(".safetensors") and not os.path.isdir(path)


def _read(src: str) -> Any:
    if _is_safetensors(src):
        return _safetensors.read_file(src)
    return restore(src, as_saved=True)


def convert(src: Directory, dst: Directory, *, overwrite: bool = False) -> ConvertReport:
    """Re-save ``src`` as ``dst``; either may be a checkpoint or a ``.safetensors`` file."""
    src_s, dst_s = os.fspath(src) if not isinstance(src, dict) else str(src), os.fspath(dst) if not isinstance(dst, dict) else str(dst)
    if os.path.abspath(src_s) == os.path.abspath(dst_s):
        raise ValueError(f"convert: source and destination are the same ({src_s}); convert writes a new copy")
    tree = _read(src_s)
    if _is_safetensors(dst_s):
        n_arrays, nbytes, n_values = _safetensors.write_file(dst_s, tree, overwrite=overwrite)
    else:
        save(dst, tree, overwrite=overwrite)
        ck = load(dst)
        n_arrays, n_values = len(ck.arrays), len(ck.values)
        nbytes = sum(ck.array_metadata(p).nbytes for p in ck.arrays)
    return ConvertReport(src_s, dst_s, n_arrays, nbytes, n_values)
