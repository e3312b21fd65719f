"""PyTorch bridge: model, optimizer and training state as pytrees, saved and resumed exactly.

``get_state_dict`` / ``set_state_dict`` mirror ``torch.distributed.checkpoint.state_dict``
and work with or without torch.distributed (plain, DDP, FSDP2, torch.compile models).
``save`` / ``restore`` handle a whole training state in place: model, optimizers,
LR schedulers and other stateful objects, step counters, per-rank data samplers,
values and RNG states. They take the options of :func:`tsckpt.save` and
:func:`tsckpt.restore` under the same names.

    import tsckpt.torch
    tsckpt.torch.save("ckpt/100", model, opt, extra={"scheduler": sched, "step": 100},
                      per_rank={"sampler": sampler, "seen": seen})
    ...
    out = tsckpt.torch.restore("ckpt/100", model, opt, extra={"scheduler": sched, "step": 0},
                               per_rank={"sampler": sampler, "seen": 0})
    step, seen = out["step"], out.per_rank["seen"]
"""

from __future__ import annotations

from ._state import get_state_dict, set_state_dict
from ._train import RestoreResult, TrainState, get_rng_state, restore, save, save_async, set_rng_state

__all__ = [
    "RestoreResult",
    "TrainState",
    "get_rng_state",
    "get_state_dict",
    "restore",
    "save",
    "save_async",
    "set_rng_state",
    "set_state_dict",
]
