"""tsckpt: checkpoints of pytrees as zarr v3 global arrays, written through TensorStore."""

from __future__ import annotations

from ._base.types import ArraySpec, ShardedArray
from ._convert import ConvertReport, convert
from ._errors import (
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    DistributedError,
    ForkedProcessError,
    FormatVersionError,
    LayoutError,
    LeafTypeError,
    LinkRefusedError,
    LossyCastError,
    NotACheckpointError,
    SaveInProgressError,
    ShapeMismatchError,
    StorageError,
    StorageFullError,
    StructureMismatchError,
    TsckptError,
    WriterLostError,
)
from ._manager import CheckpointManager
from ._ondisk.checkpoint import ArrayMetadata
from ._read.diff import DiffReport, LeafDiff, diff
from ._read.open import metadata, open
from ._read.reader import LazyArray, Reader
from ._read.restore import RestoreWarning, restore
from ._read.verify import VerifyReport, verify
from ._save.background import AsyncSave, save_async
from ._save.protocol import save
from ._version import __version__
from . import mappings
from .tree import register_node

__all__ = [
    "ArrayMetadata",
    "ArraySpec",
    "AsyncSave",
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReplacedError",
    "ConvertReport",
    "CorruptCheckpointError",
    "DiffReport",
    "DistributedError",
    "ForkedProcessError",
    "FormatVersionError",
    "LayoutError",
    "LazyArray",
    "LeafDiff",
    "LeafTypeError",
    "LinkRefusedError",
    "LossyCastError",
    "NotACheckpointError",
    "Reader",
    "RestoreWarning",
    "SaveInProgressError",
    "ShapeMismatchError",
    "ShardedArray",
    "StorageError",
    "StorageFullError",
    "StructureMismatchError",
    "TsckptError",
    "WriterLostError",
    "VerifyReport",
    "convert",
    "diff",
    "metadata",
    "open",
    "register_node",
    "restore",
    "save",
    "save_async",
    "verify",
]
