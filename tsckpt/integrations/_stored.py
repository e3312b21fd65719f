"""What a checkpoint stores under a key, as a restore target: for states whose shape only the
checkpoint knows (a framework's dict of counters and callback states, another rank's data
loader)."""

from __future__ import annotations

from typing import Any

import torch

from .._base.dtypes import torch_dtype
from .._ondisk.checkpoint import ArrayMetadata
from ..tree import leaves, unflatten


def stored_target(metadata: Any) -> Any:
    """A restore target shaped like ``metadata`` (a subtree of :func:`tsckpt.metadata`): its plain
    values as they are, an empty CPU tensor of each array's shape and dtype for the restore to fill."""
    found, spec = leaves(metadata, stop=lambda x: isinstance(x, ArrayMetadata))
    return unflatten(spec, [_empty(x) if isinstance(x, ArrayMetadata) else x for x in found])


def _empty(meta: ArrayMetadata) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))
