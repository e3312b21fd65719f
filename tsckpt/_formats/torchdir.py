"""Hugging Face directories of torch.save files read as a tsckpt source tree.

``save_pretrained(safe_serialization=False)`` writes ``pytorch_model.bin``, or shards
``pytorch_model-0000N-of-0000M.bin`` and ``pytorch_model.bin.index.json`` (a
``weight_map`` of tensor name to file, as a safetensors index has). Each file the
index names must lie inside the directory with no link on the way, and is loaded as
:mod:`.torchfile` loads any torch.save file: with ``weights_only=True`` only, memory-mapped.
The tree is a flat dict by tensor name, as a safetensors directory's is, in the order the
shards hold them (the model's state_dict order), so of tied tensors the one the model
lists first is the one stored (the embedding, not the head). Tensors that shared storage
within one file (a tied embedding and head) still share it, so writers store them once.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Any


from .._base.lazytorch import is_tensor
from .._errors import CorruptCheckpointError, NotACheckpointError, short_repr
from .._storage.confine import Root, confined
from .safetensors import read_index
from .torchfile import read_torch_file

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

INDEX_NAME = "pytorch_model.bin.index.json"
SINGLE_NAME = "pytorch_model.bin"
_INDEX_GLOB = "*.bin.index.json"


def _indexes(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(path), _INDEX_GLOB)))


def is_torch_dir(path: str) -> bool:
    """Whether ``path`` is a Hugging Face directory of torch.save files (an index, or ``pytorch_model.bin``)."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, SINGLE_NAME)) or bool(_indexes(path)))


def read_torch_dir(path: str) -> Any:
    """A Hugging Face directory of torch.save files as a flat dict by tensor name: through its
    index (each shard loaded once; the tensors it maps, in the shards' order), or its one
    ``pytorch_model.bin``."""
    indexes = _indexes(path)
    root = Root(path)  # every file below it is opened from it, with no link followed
    if not indexes:
        if os.path.isfile(os.path.join(path, SINGLE_NAME)):
            return read_torch_file(confined(root, SINGLE_NAME, where=path, field="the weights file"))
        raise NotACheckpointError(
            f"{path}: a directory with no {INDEX_NAME} or {SINGLE_NAME}; give a torch.save file, or a Hugging Face "
            "directory of them"
        )
    index_file = os.path.join(path, INDEX_NAME) if os.path.join(path, INDEX_NAME) in indexes else indexes[0]
    index_file = confined(root, os.path.basename(index_file), where=path, field="the index file")
    weight_map, _ = read_index(index_file)
    index_name = os.path.basename(index_file)
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    tree: dict[str, torch.Tensor] = {}
    for fname in sorted(by_file):  # the shards' order, and each one's own: the state_dict's order
        names = by_file[fname]
        file = confined(root, fname, where=index_file, field=f"weight_map[{names[0]!r}]")
        if not os.path.isfile(file):
            raise CorruptCheckpointError(f"{file}: missing, but {index_name} maps {names[0]!r} to it")
        shard = read_torch_file(file)
        missing = [n for n in names if not isinstance(shard, dict) or n not in shard]
        if missing:
            raise CorruptCheckpointError(f"{file}: holds no tensor {missing[0]!r}, but {index_name} maps it there")
        for name in sorted(names, key=list(shard).index):
            if not is_tensor(shard[name]):
                raise CorruptCheckpointError(
                    f"{file}: {name!r} is {short_repr(shard[name])}, not a tensor, but {index_name} maps it there as one"
                )
            tree[name] = shard[name]
    if not tree:
        raise CorruptCheckpointError(f"{index_file}: its weight_map names no tensor; restore the index")
    return tree
