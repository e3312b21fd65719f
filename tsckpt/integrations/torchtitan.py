"""torchtitan: a checkpoint manager that saves the trainer's state through tsckpt.

torchtitan picks its checkpoint manager by its config's class (``checkpoint:
BaseCheckpointManager.Config``); ``TsckptCheckpointManager.Config`` selects this one. It
saves what torchtitan's DCP manager saves (the model parts through ``ModelWrapper``, the
``OptimizersContainer``, the ``LRSchedulersContainer``, the data loader, the trainer's own
state and any other states it is given) as one tsckpt checkpoint per step under
``<dump_folder>/<checkpoint.folder>``, kept by a :class:`tsckpt.CheckpointManager`
(``keep_latest_k``; a crashed save is never listed or loaded). Saves are asynchronous
through tsckpt's own background saves when ``async_mode`` asks for it. docs/torchtitan.md
has the lines a user adds.
"""

from __future__ import annotations

import dataclasses
import warnings
from concurrent.futures import Future
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem

from .._coord.torchdist import rank_of
from .._errors import CheckpointNotFoundError, StructureMismatchError, count_and_list
from .._leaves.stateful import expand, load_state
from .._manager import CheckpointManager
from .._ondisk.records import LAYOUT_PLAIN
from .._read.open import metadata
from .._read.open import open as open_reader
from .._read.restore import RestoreWarning, restore
from ..tree import flatten
from ._stored import stored_target

_EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class TsckptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, fulfilled by tsckpt.

    Built by torchtitan's trainer from its config (``config.checkpoint.build(...)``, with the
    keyword arguments of torchtitan's own managers). Every rank calls ``save`` and ``load``;
    under FSDP2 / tensor parallelism each rank writes and reads only its shards, and a
    checkpoint loads on any other sharding or number of ranks (the data loader's state is
    torchtitan's and needs the same data-parallel degree).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """"async" (or "async_with_pinned_mem", the same here): ``save`` returns once the state
        is copied to host memory and the write continues in the background (tsckpt.save_async)."""

        layout: str = LAYOUT_PLAIN
        """tsckpt's layout of each step: "plain" files, or "compact" (one database per rank)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.last_save_in_hf:
                raise ValueError(
                    "checkpoint.last_save_in_hf: TsckptCheckpointManager saves tsckpt checkpoints only; "
                    "tsckpt.convert(step_directory, out_directory, to_format='safetensors', subtree='model') "
                    "writes a saved step's model as safetensors (under torchtitan's parameter names)"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future | None = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder) if base_folder else config.folder
        self.states = states
        self.states.update(
            {MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers}
        )
        self.sd_adapter = sd_adapter
        self.manager = CheckpointManager(
            self.folder, keep_last=config.keep_latest_k or None, layout=config.layout
        )

    def __del__(self) -> None:
        self.close()

    # ---- saving --------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_model_only:
            # the end of training: the model alone, in the export dtype (as torchtitan's own manager)
            dtype = _EXPORT_DTYPES[self.config.export_dtype]
            model = {
                k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self.states[MODEL].state_dict().items()
            }
            self.manager.save(curr_step, {MODEL: model}, overwrite=True)
            return True
        tree = {k: v for k, v in self.states.items() if v is not None}
        if self.config.async_mode != "disabled" and not last_step:
            self.save_future = self.manager.save_async(curr_step, tree, overwrite=True)
        else:
            self.manager.save(curr_step, tree, overwrite=True)
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an asynchronous save returns once its state is staged."""

    def _wait_for_saving(self) -> None:
        if self.save_future is not None:
            self.save_future.result()
            self.save_future = None

    def _close(self) -> None:
        if hasattr(self, "manager"):
            self.manager.close()

    # ---- loading -------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        steps = self.manager.all_steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint.load_step={step}: {self.folder} has no complete checkpoint of that step "
                f"(complete steps: {steps or 'none'})"
            )
        if step == -1 and steps:
            step = steps[-1]
        if step != -1:  # resume this run (torchtitan's rule: step 0 is a seed checkpoint, model only)
            self._restore(self.manager.directory(step), model_only=step == 0)
            return True
        config = self.config
        if config.initial_load_in_hf:
            directory = config.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not directory:
                raise ValueError(
                    "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path or the model's hf_assets_path"
                )
            self._restore_hf(directory)
            return True
        if config.initial_load_path:
            self._restore(config.initial_load_path, model_only=config.initial_load_model_only)
            return True
        return False

    def _restore(self, directory: Any, *, model_only: bool) -> None:
        """Restore the states this load takes; the data loader from what its rank stored."""
        names = [MODEL] if model_only else [k for k in self.states if k not in self.config.exclude_from_loading]
        unknown = set(self.config.exclude_from_loading) - set(self.states)
        if unknown:
            raise ValueError(f"checkpoint.exclude_from_loading names {sorted(unknown)}, which are not states")
        target = {k: self.states[k] for k in names if self.states[k] is not None}
        loader = target.pop(DATALOADER, None)
        if loader is not None:
            stored = metadata(directory)
            if isinstance(stored, dict) and DATALOADER in stored:
                # every rank's loader state is stored; each loader takes its own rank's
                target[DATALOADER] = _Stored(loader, stored_target(stored[DATALOADER]))
        _check_leaves(directory, target)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*target tree and checkpoint differ", RestoreWarning)
            restore(directory, target, strict=False, inplace=True)  # checked above, left-out states aside

    def _restore_hf(self, directory: str) -> None:
        """The model from a Hugging Face directory, through the model's state-dict adapter."""
        if self.sd_adapter is None:
            raise ValueError("checkpoint.initial_load_in_hf needs the model's state-dict adapter, and it has none")
        wrapper = self.states[MODEL]
        hf = self.sd_adapter.to_hf(wrapper.state_dict())
        hf = restore(directory, hf, inplace=True)
        wrapper.load_state_dict(self.sd_adapter.from_hf(hf))


class _Stored:
    """A data loader as a restore target: the shape of what the checkpoint holds (every rank's
    state), handed to its ``load_state_dict``, which takes its own rank's."""

    def __init__(self, obj: Any, target: Any) -> None:
        self.obj, self.target = obj, target

    def state_dict(self) -> Any:
        return self.target

    def load_state_dict(self, state: Any) -> None:
        load_state(self.obj, state)


def _check_leaves(directory: Any, target: dict[str, Any]) -> None:
    """Every leaf of the states a load takes must be in the checkpoint. Leaves the checkpoint has
    beyond them are left alone, as torch.distributed.checkpoint's loads do: under pipeline
    parallelism each rank loads only its own stages' part of the model and optimizer."""
    live = flatten(expand(target, rank=rank_of()).tree).paths
    stored = set(open_reader(directory))
    missing = [p for p in live if p not in stored]
    if missing:
        raise StructureMismatchError(
            f"{directory}: the checkpoint lacks {count_and_list(missing)} of the trainer's states. A checkpoint of "
            "another model or optimizer setup loads with checkpoint.exclude_from_loading, or from an "
            "initial_load_path with initial_load_model_only"
        )
