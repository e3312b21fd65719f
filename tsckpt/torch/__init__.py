"""PyTorch bridge: model, optimizer and training state as pytrees, saved and resumed exactly.

``get_state_dict`` / ``set_state_dict`` mirror ``torch.distributed.checkpoint.state_dict``
and work with or without torch.distributed (plain, DDP, FSDP2, torch.compile models).
``save`` / ``restore`` handle a whole training state in place: model, optimizers,
LR schedulers and other stateful objects, step counters, per-rank data samplers
and RNG states.

    import tsckpt.torch
    tsckpt.torch.save("ckpt/100", model, opt, extra={"scheduler": sched, "step": 100})
    ...
    out = tsckpt.torch.restore("ckpt/100", model, opt, extra={"scheduler": sched, "step": 0})
    step = out["step"]
"""

from __future__ import annotations

from ._state import get_state_dict, set_state_dict
from ._train import get_rng_state, restore, save, set_rng_state

__all__ = ["get_rng_state", "get_state_dict", "restore", "save", "set_rng_state", "set_state_dict"]
