"""PyTorch bridge: model, optimizer and training state as pytrees, saved and resumed exactly.

``get_state_dict`` / ``set_state_dict`` mirror ``torch.distributed.checkpoint.state_dict``
and work with or without torch.distributed (plain, DDP, FSDP2, torch.compile models).
``TrainState`` holds a whole training state (model, optimizers, LR schedulers and other
stateful objects, step counters, per-rank data samplers and values, RNG states) as one
object that ``tsckpt.save``, ``save_async``, ``restore`` and ``CheckpointManager`` save
and restore in place. ``save`` / ``save_async`` / ``restore`` take its parts as arguments,
with the options of :func:`tsckpt.save`, :func:`tsckpt.save_async` and
:func:`tsckpt.restore` under the same names. ``StorageWriter`` / ``StorageReader``
(``_dcp_storage``) are torch.distributed.checkpoint storage: ``dcp.save`` and
``dcp.async_save`` write a tsckpt checkpoint, ``dcp.load`` reads any checkpoint tsckpt reads.
``restore_fp8_blocks`` (``_fp8blocks``) reads a Hugging Face checkpoint of block-scaled fp8
weights (``weight`` + ``weight_scale_inv``) into torchao float8 or bf16 targets, region by region.

    import tsckpt, tsckpt.torch
    manager = tsckpt.CheckpointManager("ckpt", keep_last=3)
    state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched}, per_rank={"sampler": sampler})
    manager.save_async(step, state)           # every rank; returns once the state is staged
    step = manager.restore(target=state)      # the latest complete step, into the live objects

    tsckpt.torch.save("ckpt/100", model, opt, extra={"scheduler": sched, "step": 100},
                      per_rank={"sampler": sampler, "seen": seen})
    out = tsckpt.torch.restore("ckpt/100", model, opt, extra={"scheduler": sched, "step": 0},
                               per_rank={"sampler": sampler, "seen": 0})
    step, seen = out["step"], out.per_rank["seen"]
"""

from __future__ import annotations

from typing import Any

from ._fp8blocks import restore_fp8_blocks
from ._state import get_state_dict, set_state_dict
from ._train import RestoreResult, TrainState, get_rng_state, restore, save, save_async, set_rng_state

__all__ = [
    "RestoreResult",
    "StorageReader",
    "StorageWriter",
    "TrainState",
    "get_rng_state",
    "get_state_dict",
    "restore",
    "restore_fp8_blocks",
    "save",
    "save_async",
    "set_rng_state",
    "set_state_dict",
]


def __getattr__(name: str) -> Any:
    """``StorageWriter`` and ``StorageReader`` (torch.distributed.checkpoint storage), imported on
    first use: importing DCP takes most of a second, which ``import tsckpt.torch`` does not pay."""
    if name in ("StorageReader", "StorageWriter"):
        from . import _dcp_storage

        return getattr(_dcp_storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
