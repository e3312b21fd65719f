"""DTensor leaves: the local shard of a global array on a DeviceMesh.

The global offset of a rank's shard comes from torch's own
``compute_local_shape_and_global_offset`` (what DCP uses), which knows uneven
``torch.chunk`` splits, multi-dimensional meshes and the strided sharding FSDP2
uses on top of tensor parallelism.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ._errors import LayoutError


def is_dtensor(x: Any) -> bool:
    # No DTensor can exist before its module is imported, and importing it costs
    # about a second: look it up instead.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def region(path: str, dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of this rank's shard of ``dt``."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in dt.placements):
        raise LayoutError(
            f"'{path}': DTensor has a Partial placement {tuple(dt.placements)}; its local values are partial "
            "sums, not a region of the array. Call .redistribute(placements=[Replicate()] or [Shard(d)]) "
            "(or .full_tensor()) before saving"
        )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    local = dt.to_local()
    if tuple(local.shape) != tuple(shape):
        raise LayoutError(
            f"'{path}': DTensor local shard has shape {list(local.shape)} but its placements "
            f"{tuple(dt.placements)} imply {list(shape)}; the DTensor is inconsistent"
        )
    if not offset:  # rank outside the mesh
        return tuple(0 for _ in dt.shape), tuple(0 for _ in dt.shape)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def describe_dtensor(path: str, leaf: Any) -> Any:
    from ._leaves import region_leaf

    offsets, _ = region(path, leaf)
    return region_leaf(path, leaf.to_local(), tuple(leaf.shape), offsets, "torch")


def dtensor_destination(rec: Any, path: str, leaf: Any, inplace: bool) -> Any:
    """Read this rank's region straight into (a copy of) the DTensor's local shard."""
    from torch.distributed.tensor import DTensor

    from ._plan import ReadItem
    from ._restore import _check_cast, _check_shape, _Dest

    _check_shape(path, tuple(leaf.shape), rec.shape)
    local = leaf.to_local()
    _check_cast(path, rec.dtype, local.dtype)
    offsets, lengths = region(path, leaf)
    item = ReadItem(path, offsets, lengths, (0,) * len(offsets))
    if inplace:
        return _Dest(item, local, leaf)
    fresh = torch.empty_like(local)
    result = DTensor.from_local(
        fresh, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
    )
    return _Dest(item, fresh, result)
