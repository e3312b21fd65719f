"""Lightning: Trainer checkpoints stored as tsckpt checkpoints.

``Trainer(plugins=[TsckptCheckpointIO()])`` makes every checkpoint the Trainer writes
(``ModelCheckpoint``, ``trainer.save_checkpoint``) a tsckpt checkpoint directory at the path
Lightning chose (``last.ckpt`` is then a directory), and ``fit(ckpt_path=...)`` resumes from
one. Lightning's checkpoint dict is saved as it is: tensors (model, optimizer states) as
arrays, the loops' counters, callbacks' states, LR schedulers and hyperparameters as plain
values. docs/lightning.md has the lines a user adds and the limits.

Lightning hands the checkpoint to rank 0 alone under DDP, and has every rank load it: each
process here saves or restores by itself, through a process group of its own.

Lightning's FSDP2 / tensor-parallel strategy (``ModelParallelStrategy``) bypasses
``CheckpointIO`` and calls torch.distributed.checkpoint itself; ``TsckptModelParallelStrategy``
is that strategy with its save and load done by tsckpt on every rank: the model and
optimizers as a :class:`tsckpt.torch.TrainState` (each rank its shards, restored in place on
any sharding), the rest of Lightning's dict beside them.
"""

from __future__ import annotations

import collections
from typing import Any, cast

import torch
from lightning_fabric.utilities.cloud_io import get_filesystem
from pytorch_lightning.plugins.io import CheckpointIO
from pytorch_lightning.strategies import ModelParallelStrategy

from .._errors import LeafTypeError, StructureMismatchError
from .._ondisk.records import LAYOUT_PLAIN
from .._read.open import metadata
from .._read.restore import restore
from .._save.background import AsyncSave, save_async
from .._save.protocol import save
from ..tree import leaves as tree_leaves
from ..tree import unflatten
from ..torch import restore as restore_train_state
from ..torch import save as save_train_state
from ._stored import stored_target

# the extra name, in a TrainState checkpoint of TsckptModelParallelStrategy, of what Lightning
# keeps beside the model and optimizers (loops, callbacks, schedulers, hyperparameters)
LIGHTNING = "lightning"


class TsckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves each checkpoint as a tsckpt checkpoint directory.

    ``async_save=True`` makes each save a :func:`tsckpt.save_async`: it returns once the
    checkpoint's tensors are copied to host memory, and the plugin waits for it before its
    next save, load or removal and at the end of the fit (use it rather than Lightning's
    ``AsyncCheckpointIO`` wrapper, whose removals of old checkpoints do not wait for the saves
    in flight). ``layout`` and ``progress`` are :func:`tsckpt.save`'s options. A checkpoint
    dict may hold tensors, numpy arrays, ``int``, ``float``, ``bool``, ``str``, ``bytes``,
    ``None`` and containers of them; anything else (a hyperparameter that is a module, a
    ``Namespace``, a ``Path``) is refused with a ``LeafTypeError`` naming it, before anything
    is written. Saving over an existing checkpoint (``last.ckpt``) replaces it, as
    Lightning's own ``torch.save`` does.
    """

    def __init__(self, *, async_save: bool = False, layout: str = LAYOUT_PLAIN, progress: bool | None = None) -> None:
        super().__init__()
        self.async_save = async_save
        self.layout = layout
        self.progress = progress
        self._pending: AsyncSave | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"Trainer.save_checkpoint(..., storage_options={storage_options!r}): TsckptCheckpointIO takes no "
                "storage_options; give its options when building it: TsckptCheckpointIO(layout=..., progress=...)"
            )
        self.wait()
        options = {"overwrite": True, "group": _own_group(), "layout": self.layout, "progress": self.progress}
        try:
            if self.async_save:
                self._pending = save_async(path, _storable(checkpoint), **options)
            else:
                save(path, _storable(checkpoint), **options)
        except LeafTypeError as e:
            raise LeafTypeError(f"Lightning checkpoint {path}: {e}. {_LEAVE_OUT}") from e

    def wait(self) -> None:
        """Wait for the save in flight (``async_save``), re-raising its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        """The end of a fit (Lightning calls it): the last save is committed when it returns."""
        self.wait()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict as saved: tensors on the CPU, or on ``map_location`` when it is a
        device (a function or dict of ``torch.load`` is not applied). ``weights_only`` is moot:
        nothing is unpickled."""
        self.wait()
        tree = restore(path, as_saved=True, group=_own_group())
        if isinstance(map_location, (str, torch.device)):
            tree = _to_device(tree, torch.device(map_location))
        if not isinstance(tree, dict):
            raise StructureMismatchError(
                f"{path}: a Lightning checkpoint is a dict, and this tsckpt checkpoint holds a "
                f"{type(tree).__name__}; resume from a checkpoint the Trainer saved"
            )
        return tree

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint directory (Lightning's own filesystem calls, as its default plugin)."""
        self.wait()
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)


class TsckptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) saving and loading through tsckpt.

    Every rank saves its shards of the model and optimizer states (a
    :class:`tsckpt.torch.TrainState` checkpoint, so each array is one global array whatever
    the sharding) and Lightning's other state under ``extra/lightning``; a load restores the
    model and optimizers in place, from a checkpoint of any sharding or world size, and gives
    Lightning the rest. ``layout`` and ``progress`` are :func:`tsckpt.save`'s; the other
    arguments are ``ModelParallelStrategy``'s (``save_distributed_checkpoint`` has no effect:
    the checkpoint is always the sharded tsckpt one).
    """

    def __init__(self, *args: Any, layout: str = LAYOUT_PLAIN, progress: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout = layout
        self.progress = progress

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"Trainer.save_checkpoint(..., storage_options={storage_options!r}): TsckptModelParallelStrategy "
                "takes no storage_options; give layout= and progress= when building it"
            )
        path = self.broadcast(filepath)  # rank 0's path: ranks may name the file differently
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        try:
            save_train_state(
                path, self._module(), self.optimizers, extra={LIGHTNING: _storable(rest)}, rng=False,
                overwrite=True, layout=self.layout, progress=self.progress,
            )
        except LeafTypeError as e:
            raise LeafTypeError(f"Lightning checkpoint {path}: {e}. {_LEAVE_OUT}") from e

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and optimizers in place; return the rest of Lightning's dict
        (Lightning's strategy loads them here too, and skips them later)."""
        path = self.broadcast(checkpoint_path)
        stored = metadata(path)
        if not isinstance(stored, dict) or LIGHTNING not in stored.get("extra", {}):
            raise StructureMismatchError(
                f"{path}: no '{LIGHTNING}' state under 'extra': TsckptModelParallelStrategy resumes from "
                "checkpoints it saved itself (a tsckpt.torch TrainState with Lightning's state)"
            )
        target = stored_target(stored["extra"][LIGHTNING])
        out = restore_train_state(path, self._module(), self.optimizers, extra={LIGHTNING: target}, rng=False)
        return cast("dict[str, Any]", out[LIGHTNING])

    def _module(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("the strategy has no model yet: Lightning saves and loads after setting it up")
        return self.model


_LEAVE_OUT = (
    "A hyperparameter tsckpt cannot store is left out with self.save_hyperparameters(ignore=[...]); other "
    "states must be tensors and plain values"
)


def _own_group() -> Any:
    """A process group of this process alone when torch.distributed runs with several ranks
    (tsckpt then saves and restores without waiting on the others), else None. Made once per
    default group, by this process only."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.GroupMember.WORLD
    if _own.get("world") is not world:
        rank = dist.get_rank()
        _own["world"] = world
        _own["group"] = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    return _own["group"]


_own: dict[str, Any] = {}


def _storable(obj: Any) -> Any:
    """``obj`` with every dict a plain dict (an OrderedDict stays one): a tree knows no other
    dict subclass (Lightning's AttributeDict of hyperparameters). Tensors are not copied."""
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, _storable(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _storable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_storable(v) for v in obj]
    return obj


def _to_device(tree: Any, device: torch.device) -> Any:
    leaves, spec = tree_leaves(tree)
    return unflatten(spec, [x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves])
