"""safetensors files: a tsckpt tree to one file and back (mapping in docs/format.md).

A file written here carries the tree's structure, leaf kinds and plain values
as JSON under the metadata key ``tsckpt``, so it converts back to the same
tree; a plain safetensors file reads as a flat dict of tensors, names as keys.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from . import _dtypes
from ._errors import CheckpointExistsError, CorruptCheckpointError, LeafTypeError, NotACheckpointError
from ._format import decode_value
from ._leaves import describe
from .tree import flatten, from_paths, structure_from_json, structure_to_json

# Metadata key under which the tree is stored in a .safetensors file.
METADATA_KEY = "tsckpt"


def read_file(src: str) -> Any:
    """The tree stored in a safetensors file (tensors are read into memory)."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(src):
        raise NotACheckpointError(f"{src}: no such file")
    try:
        with safe_open(src, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise NotACheckpointError(f"{src}: not a readable safetensors file ({e})") from None
    info = meta.get(METADATA_KEY)
    if info is None:
        return dict(sorted(tensors.items()))  # a plain file: a flat dict, names kept as keys
    try:
        info = json.loads(info)
        leaves: list[Any] = []
        for p in info["leaves"]:
            if p in info["values"]:
                leaves.append(decode_value(info["values"][p]))
                continue
            t: torch.Tensor = tensors[p]
            kind = info["kinds"].get(p, "torch")
            if kind in ("numpy", "numpy_scalar"):
                a = _dtypes.tensor_to_numpy(t).copy()
                leaves.append(a[()] if kind == "numpy_scalar" else a)
            else:
                leaves.append(t)
        if info.get("structure") is not None:
            return structure_from_json(info["structure"], leaves)
        return from_paths(info["leaves"], leaves)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{src}: its '{METADATA_KEY}' metadata is malformed ({type(e).__name__}: {e})"
        ) from None


def safetensors_dtypes() -> set[torch.dtype]:
    from safetensors import torch as st

    return set(getattr(st, "_TYPES", {}).values())


def as_cpu_tensor(path: str, local_data: Any, dtype_name: str) -> torch.Tensor:
    """A contiguous CPU tensor of a leaf's data, refused if safetensors has no such dtype."""
    data = local_data
    if not isinstance(data, torch.Tensor):  # np.ascontiguousarray would make 0-d arrays 1-d
        data = _dtypes.numpy_to_tensor(np.require(data, requirements="C"), dtype_name)
    supported = safetensors_dtypes()
    if supported and data.dtype not in supported:
        raise LeafTypeError(f"'{path}': dtype {dtype_name} has no safetensors equivalent; keep it in a tsckpt checkpoint")
    return data.detach().cpu().contiguous()


def write_file(dst: str, tree: Any, *, overwrite: bool = False) -> tuple[int, int, int]:
    """Write ``tree`` to one safetensors file (atomically); returns (arrays, bytes, values)."""
    from safetensors import SafetensorError
    from safetensors import torch as st

    if os.path.exists(dst) and not overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    flat = flatten(tree)
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    nbytes = 0
    for path, leaf in zip(flat.paths, flat.leaves):
        local = describe(path, leaf)
        if local.desc.kind == "value":
            values[path] = local.desc.value
            continue
        t = as_cpu_tensor(path, local.data, local.desc.dtype)
        tensors[path] = t
        kinds[path] = local.desc.kind
        nbytes += t.numel() * t.element_size()
    info = {
        "format_version": 1,
        "structure": structure_to_json(flat.spec),
        "leaves": flat.paths,
        "kinds": kinds,
        "values": values,
    }
    tmp = dst + ".tmp"
    try:
        st.save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(info, separators=(",", ":"))})
        os.replace(tmp, dst)
    except SafetensorError as e:
        raise OSError(f"{dst}: cannot write ({e})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return len(tensors), nbytes, len(values)
