"""Training frameworks' checkpoint seams, filled by tsckpt: each module plugs tsckpt into one
framework where that framework expects its checkpoint backend, so a user adds a line or two
and keeps the framework's own loop.

Owns:

- :mod:`.lightning`: ``TsckptCheckpointIO``, a Lightning ``CheckpointIO`` plugin
  (single device and DDP): a Trainer checkpoint saved as a tsckpt checkpoint directory;
  ``TsckptModelParallelStrategy``, Lightning's FSDP2 / tensor-parallel strategy saving and
  loading through tsckpt on every rank.
- :mod:`.accelerate`: ``save_state`` / ``save_state_async`` / ``load_state`` of an
  ``Accelerator`` as one tsckpt checkpoint, and ``train_state`` (its state as a TrainState).
- :mod:`.torchtitan`: ``TsckptCheckpointManager``, torchtitan's checkpoint manager
  (``BaseCheckpointManager`` and its ``Config``) over a :class:`tsckpt.CheckpointManager`.
- :mod:`._stored`: what a checkpoint stores under a key, as a restore target.

Each module imports its framework when it is imported itself; importing tsckpt, or this
package, imports no framework.

May import: every layer below it (``tsckpt.torch`` and down); nothing imports it.
"""
