"""torch.save files (``.pt``, ``.pth``, ``.bin``) read as a tsckpt source tree.

Files are loaded only with ``torch.load(weights_only=True)``: full unpickling can
run any code the file names, so a file that needs it is refused, never trusted.
Zip-format files (every torch.save since 1.6) are memory-mapped, so tensors are
paged in by the OS while ``save`` writes them and a file larger than RAM still
converts; legacy (non-zip) files cannot be mapped and are read into memory.
Tensors that shared storage when saved share it when loaded, so tied weights
stay tied and ``save`` stores them once.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import stat
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.lazytorch import is_tensor
from .._errors import CheckpointNotFoundError, CorruptCheckpointError, LeafTypeError, NotACheckpointError
from .._storage.confine import Confined, file_kind, open_read
from .._storage.hfcache import Blob
from ..tree import ROOT_LEAF_PATH, flatten, unflatten
from .safetensors import is_safetensors_file

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

_ZIP_MAGIC = b"PK\x03\x04"  # every torch.save since 1.6 writes a zip archive
_PICKLE_PROTO = 0x80  # a legacy file is a pickle stream, which starts with the PROTO opcode
_LEGACY_START = bytes([_PICKLE_PROTO, 2])  # torch.save's legacy format pickles with protocol 2
_PLAIN = (bool, int, float, str, bytes, bytearray)


def is_torch_file(head: bytes) -> bool:
    """Whether a file starting with ``head`` was written by torch.save (a zip archive, or a
    legacy protocol-2 pickle); reading accepts a pickle of any protocol."""
    return head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_START)


def _head(path: str) -> bytes:
    """The first bytes of the file ``path``, opened without waiting; NotACheckpointError for
    a FIFO, a socket or a device (torch.load would wait on a FIFO forever, or read a device
    without end)."""
    fd = open_read(path)  # a Hugging Face cache snapshot's file: from its blobs/, no link followed
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(mode):
            raise NotACheckpointError(
                f"{path}: is {file_kind(mode)}, not a regular file: no torch.save file; give the file torch.save wrote"
            )
        return os.read(fd, 9)
    finally:
        os.close(fd)


def read_torch_file(path: str) -> Any:
    """The object ``torch.save`` stored at ``path``: its dicts, lists and tuples with
    CPU tensors (memory-mapped when the format allows) and plain values as leaves."""
    try:
        head = _head(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file; give the path of a file written by torch.save") from None
    except IsADirectoryError:
        raise NotACheckpointError(f"{path}: is a directory, not a torch.save file; give the file itself") from None
    if not head:
        raise NotACheckpointError(f"{path}: is empty (0 bytes), not a torch.save file; save it again")
    if is_safetensors_file(head):
        raise NotACheckpointError(f"{path}: is a safetensors file, not a torch.save file; convert it as a .safetensors file")
    zipped = head.startswith(_ZIP_MAGIC)
    if not zipped and head[0] != _PICKLE_PROTO:
        raise NotACheckpointError(
            f"{path}: not a torch.save file (found neither a zip archive nor a pickle stream at its start); "
            "give a file written by torch.save"
        )
    with _opened(path) as (source, mappable):
        obj = _load(path, source, zipped and mappable)
    return plain_tree(obj, path)


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple[Any, bool]]:
    """(what torch.load is given, whether it can map it) for the file at ``path``: the path the
    caller named, or for a file of a checkpoint (:class:`Confined`, opened below its
    directory) or of a Hugging Face cache snapshot (:class:`Blob`, opened in its repository's
    blobs/) the descriptor opened with no link followed, through ``/proc/self/fd`` (mapped:
    that path reopens the file the descriptor holds, whatever its name leads to since) or as
    a file."""
    if not isinstance(path, (Blob, Confined)):
        yield path, True
        return
    fd = open_read(path)
    try:
        proc = f"/proc/self/fd/{fd}"
        if os.path.exists(proc):
            yield proc, True
        else:
            with os.fdopen(os.dup(fd), "rb") as f:
                yield f, False
    finally:
        os.close(fd)


def _load(path: str, source: Any, mmap: bool) -> Any:
    """``torch.load`` of ``source`` (the file at ``path``) with ``weights_only=True``, its
    failures as tsckpt errors naming ``path``."""
    try:
        with warnings.catch_warnings():  # torch's notes on a damaged file's pickle protocol: the error says it
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        refused = weights_only_refusal(e)
        if refused is None:
            raise CorruptCheckpointError(f"{path}: corrupt torch.save file ({reason(e)}); save or copy it again") from None
        raise NotACheckpointError(
            f"{path}: torch.load(weights_only=True) refuses it ({refused}); "
            "tsckpt only loads torch.save files with weights_only=True because full unpickling can run code. "
            "Re-save the state_dict with plain tensors, e.g. torch.save(model.state_dict(), path)"
        ) from None
    except Exception as e:  # noqa: BLE001 - unpickling damaged bytes raises almost anything
        raise CorruptCheckpointError(
            f"{path}: truncated or corrupt torch.save file ({reason(e)}); save or copy it again"
        ) from None


def plain_tree(tree: Any, where: str) -> Any:
    """``tree`` with each ``torch.Size`` made a tuple; LeafTypeError (naming ``where`` and the
    leaf path) for a leaf that is neither a dense tensor, a numpy array nor a plain value."""
    try:
        flat = flatten(tree)
    except LeafTypeError as e:
        raise LeafTypeError(f"{where}: {e}") from None
    leaves: list[Any] = []
    for p, leaf in zip(flat.paths, flat.leaves):
        at = where if p == ROOT_LEAF_PATH else f"{where}: leaf '{p}'"
        if isinstance(leaf, torch.Size):
            leaf = tuple(int(n) for n in leaf)
        elif is_tensor(leaf):
            if leaf.layout != torch.strided:
                raise LeafTypeError(f"{at} is a {leaf.layout} tensor; only dense tensors are stored, save it .to_dense()")
            _check_view(leaf, at)
        elif not isinstance(leaf, (*_PLAIN, np.ndarray, np.generic)):
            raise LeafTypeError(
                f"{at} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which is neither a tensor nor a plain "
                "value (int, float, bool, str, bytes, None); convert it (e.g. to a list or str) in the source and save again"
            )
        leaves.append(leaf)
    return unflatten(flat.spec, leaves)


def _check_view(t: torch.Tensor, at: str) -> None:
    """Refuse a tensor with more elements than its storage holds: a view with stride 0 or
    overlapping strides (``expand``), which a file of a kilobyte can make claim any size.
    Written out, every element takes its own bytes, so the output is bounded by what the
    file stores only if such views are refused (docs/security.md)."""
    need = t.numel() * t.element_size()
    held = t.untyped_storage().nbytes()
    if need > held:
        raise LeafTypeError(
            f"{at}: its {t.numel()} elements {list(t.shape)} (strides {list(t.stride())}) view a storage of {held} "
            f"bytes, so written out they would take {need}: a view with stride 0 or overlapping strides "
            "(e.g. from expand()) is refused; save tensor.clone() in the source instead"
        )


def _unpickler_detail(e: BaseException) -> str | None:
    found = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\. |\n|$)", str(e))
    return found.group(1) if found else None


def weights_only_refusal(e: pickle.UnpicklingError) -> str | None:
    """What ``torch.load(weights_only=True)`` refused to unpickle (a class or function outside its
    allowlist), or None when ``e`` reports damaged bytes (an unknown pickle opcode) instead."""
    detail = _unpickler_detail(e) or "content outside its allowlist"
    if not str(e).startswith("Weights only load failed") or detail.startswith("Unsupported operand"):
        return None
    return detail


def reason(e: BaseException) -> str:
    """The exception's type and gist (its first sentence), for a one-line message."""
    text = _unpickler_detail(e) or (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
