"""DTensor leaves: the local shard of a global array on a DeviceMesh.

The global offset of a rank's shard comes from torch's own
``compute_local_shape_and_global_offset`` (what DCP uses), which knows uneven
``torch.chunk`` splits, multi-dimensional meshes and the strided sharding FSDP2
uses on top of tensor parallelism. This module is the only place tsckpt uses
that private helper.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any


from .._base.casting import check_cast
from .._base.types import Dest, Local, ReadItem
from .._errors import LayoutError
from .._ondisk.records import ArrayRecord
from .kinds import LeafKind, Memory, check_shape, region_leaf, tensor_memory, writable_tensor

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch


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


class DTensorKind(LeafKind):
    def owns(self, leaf: Any) -> bool:
        return is_dtensor(leaf)

    def describe(self, path: str, leaf: Any) -> Local:
        offsets, _ = region(path, leaf)
        return region_leaf(path, leaf.to_local(), tuple(leaf.shape), offsets, "torch")

    def destination(self, rec: ArrayRecord, path: str, leaf: Any, inplace: bool, casting: str) -> Dest:
        """Read this rank's region straight into (a copy of) the DTensor's local shard."""
        from torch.distributed.tensor import DTensor

        check_shape(path, tuple(leaf.shape), rec.shape)
        local = leaf.to_local()
        cast = check_cast(path, rec.dtype, local.dtype, casting=casting)
        offsets, lengths = region(path, leaf)
        item = ReadItem(path, offsets, lengths)
        meta = local.device.type == "meta"  # nothing to write into: a new local shard, in place or not
        if inplace and not meta:
            return Dest(item, writable_tensor(local, path), leaf, cast=cast)
        if meta:
            fresh = torch.empty(local.shape, dtype=local.dtype, device=_mesh_device(leaf.device_mesh))
        else:
            fresh = torch.empty_like(local)
        result = DTensor.from_local(
            fresh, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
        )
        return Dest(item, fresh, result, cast=cast)

    def memory(self, leaf: Any) -> Memory | None:
        return tensor_memory(leaf.to_local())

    def materialises(self, leaf: Any) -> bool:
        return bool(leaf.to_local().device.type == "meta")


def _mesh_device(mesh: Any) -> torch.device:
    """Where the local shard of a meta DTensor goes: its mesh's device type (a DTensor's local
    tensor must live there), the current device of that type (CUDA: torch.cuda.current_device())."""
    kind = str(mesh.device_type)
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "current_device"):
        return torch.device(kind)
    return torch.device(kind, int(module.current_device()))
