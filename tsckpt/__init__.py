"""tsckpt: checkpoints of pytrees as zarr v3 global arrays, written through TensorStore."""

from __future__ import annotations

from ._version import __version__

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
    LossyCastError,
    NotACheckpointError,
    SaveInProgressError,
    ShapeMismatchError,
    StorageError,
    StorageFullError,
    StructureMismatchError,
    TsckptError,
)
from ._async import AsyncSave, save_async
from ._formats.convert import ConvertReport, convert
from ._manager import CheckpointManager
from ._checkpoint import ArrayMetadata
from ._open import metadata, open
from ._reader import LazyArray, Reader
from ._restore import RestoreWarning, restore
from ._save import save
from ._types import ArraySpec, ShardedArray
from ._verify import VerifyReport, verify
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
    "DistributedError",
    "ForkedProcessError",
    "FormatVersionError",
    "LayoutError",
    "LazyArray",
    "LeafTypeError",
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
    "VerifyReport",
    "convert",
    "metadata",
    "open",
    "register_node",
    "restore",
    "save",
    "save_async",
    "verify",
]
