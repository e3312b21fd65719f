"""accelerate: ``Accelerator.save_state`` / ``load_state`` through tsckpt.

accelerate's own ``save_state`` writes one file per object (safetensors for the weights,
pickles for the rest), and its hooks (``register_save_state_pre_hook``) run beside that
writing without replacing it. These helpers save and load the same state as one tsckpt
checkpoint instead: the prepared models and optimizers (by parameter name; under FSDP2 each
rank its shards), the LR schedulers, the objects given to ``register_for_checkpointing``,
the GradScaler, ``accelerator.step``, and per process the RNG states and stateful
dataloaders' positions. docs/accelerate.md has the lines a user adds.
"""

from __future__ import annotations

from typing import Any

import accelerate
import torch
from accelerate.utils import DistributedType

from .._errors import LeafTypeError
from .._ondisk.records import LAYOUT_PLAIN
from .._save.background import AsyncSave, save_async
from .._save.protocol import save
from ..torch import TrainState
from ..torch import restore as restore_train_state

STEP = "step"


def train_state(accelerator: accelerate.Accelerator) -> TrainState:
    """The accelerator's whole training state as a :class:`tsckpt.torch.TrainState`, for any tsckpt
    verb or a :class:`tsckpt.CheckpointManager` (``manager.save_async(step, train_state(acc))``).

    Built from what ``accelerator.prepare`` and ``register_for_checkpointing`` were given:
    one model is saved under ``model/<name>``, several under ``model/<i>.<name>``. The value of
    ``accelerator.step`` is taken now; after a restore, :func:`load_state` sets it back.
    """
    _check_supported(accelerator)
    models = list(accelerator._models)
    if not models:
        raise LeafTypeError(
            "the accelerator has no prepared model: call accelerator.prepare(model, optimizer, ...) before "
            "saving or loading its state"
        )
    model = models[0] if len(models) == 1 else torch.nn.ModuleDict({str(i): m for i, m in enumerate(models)})
    optimizers = [getattr(o, "optimizer", o) for o in accelerator._optimizers]  # AcceleratedOptimizer's own
    extra: dict[str, Any] = {
        "schedulers": list(accelerator._schedulers),
        "custom": list(accelerator._custom_objects),
        STEP: accelerator.step,
    }
    if accelerator.scaler is not None:
        extra["scaler"] = accelerator.scaler
    loaders = [d for d in accelerator._dataloaders if getattr(d, "use_stateful_dataloader", False)]
    return TrainState(model, optimizers, extra=extra, per_rank={"dataloaders": loaders}, rng=True)


def save_state(
    accelerator: accelerate.Accelerator,
    directory: Any,
    *,
    overwrite: bool = False,
    layout: str = LAYOUT_PLAIN,
    progress: bool | None = None,
) -> None:
    """Save what ``accelerator.save_state`` saves as one tsckpt checkpoint; every process calls it.
    The options are :func:`tsckpt.save`'s of the same names."""
    save(directory, train_state(accelerator), overwrite=overwrite, layout=layout, progress=progress)


def save_state_async(
    accelerator: accelerate.Accelerator,
    directory: Any,
    *,
    overwrite: bool = False,
    layout: str = LAYOUT_PLAIN,
    progress: bool | None = None,
) -> AsyncSave:
    """:func:`save_state` returning once the state is copied to host memory (``result()`` waits
    for the commit), as :func:`tsckpt.save_async`."""
    return save_async(directory, train_state(accelerator), overwrite=overwrite, layout=layout, progress=progress)


def load_state(accelerator: accelerate.Accelerator, directory: Any, *, strict: bool = True) -> None:
    """Load a :func:`save_state` checkpoint in place, as ``accelerator.load_state`` does; every
    process calls it. Models, optimizers and objects are filled where they are (each rank its
    shards, from a checkpoint of any sharding or world size), the RNG states of this process
    are set and ``accelerator.step`` is the saved one. ``strict`` is :func:`tsckpt.restore`'s."""
    state = train_state(accelerator)
    out = restore_train_state(
        directory, state.model, state.optimizers, extra=state.extra, per_rank=state.per_rank, rng=True,
        strict=strict,
    )
    accelerator.step = int(out[STEP])


def _check_supported(accelerator: accelerate.Accelerator) -> None:
    """Refuse what a TrainState cannot hold: engines that keep their own checkpoints, and FSDP1's
    flat parameters."""
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise LeafTypeError(
            f"accelerate runs {kind.value}, which saves its own engine's checkpoint; use accelerator.save_state "
            "there (tsckpt saves plain, DDP and FSDP2 models)"
        )
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if kind == DistributedType.FSDP and getattr(plugin, "fsdp_version", 1) != 2:
        raise LeafTypeError(
            "accelerate runs FSDP version 1, whose flat parameters tsckpt does not read or write; use FSDP2 "
            "(FullyShardedDataParallelPlugin(fsdp_version=2)), or accelerator.save_state"
        )
