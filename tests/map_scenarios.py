"""Multi-rank scenarios of transforms on read (tests/test_mappings.py), on gloo ranks: torch
only, so that the ranks import no JAX."""

from __future__ import annotations

from typing import Any

import torch

import tsckpt
from tests.dist_scenarios import mesh
from tsckpt._read import restore as restore_module


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.l2 = torch.nn.Linear(8, 4)


def restore_flax_into_fsdp2(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Restore a Flax-layout checkpoint into an FSDP2 model through flax_to_torch; returns the
    full restored tensors and the stored boxes this rank read."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)
    model = MLP()
    fully_shard(model, mesh=mesh((world,)))
    reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    real = restore_module.read_into

    def counting(ck: Any, dests: list[Any], *args: Any, **kwargs: Any) -> None:
        reads.extend((d.item.path, d.item.storage_offsets, d.item.lengths) for d in dests)
        real(ck, dests, *args, **kwargs)

    restore_module.read_into = counting
    try:
        tsckpt.restore(directory, model.state_dict(), inplace=True, mapping=tsckpt.mappings.flax_to_torch(stored_prefix="params/"))
    finally:
        restore_module.read_into = real
    full = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
    return {"full": full, "reads": sorted(reads)}
