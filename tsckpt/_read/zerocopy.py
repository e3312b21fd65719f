"""Zero-copy reads (``copy=False``): leaves given as views of copy-on-write mappings of
the stored files instead of copies, where a stored chunk is exactly the region asked for.

Who maps what: tsckpt's own one-chunk files (:mod:`tsckpt._codec.chunkmap`, each crc32c
checked through the mapping before anything is returned) and the tensors of safetensors
files and Hugging Face directories (a source's ``map``, one mapping per file). Every
other leaf is read by the copying path, per leaf, and :func:`tell` logs which and why
(INFO on the ``tsckpt`` logger). What a file may do under a mapping:
:mod:`tsckpt._storage.filemap`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.lazytorch import is_tensor
from .._base.types import Dest, ReadItem
from .._codec.chunkmap import map_chunks
from .._codec.route import place
from .._leaves.registry import materialises
from .._ondisk.checkpoint import Checkpoint
from .._runtime.progress import human_bytes, logger
from .engine import viewable

# Leaves named per reason in the log line; the rest are counted.
NAMED = 3


def map_items(ck: Checkpoint, items: Sequence[ReadItem]) -> list[np.ndarray | str]:
    """Per region of ``items``: the stored array (storage dtype and shape) viewing a writable
    copy-on-write mapping of its file, checked as a copying read checks it; or why it is to
    be copied instead (a phrase)."""
    if ck.lazy:
        sources = ck.sources or {}
        return [_map_source(ck, sources[item.path], item) for item in items]
    if ck.foreign:
        return [f"{ck.format} checkpoints' arrays are encoded by their own codecs (compression), not mapped"] * len(items)
    return map_chunks(ck, place(ck.data(), ck.layout, foreign=ck.foreign), items)


def _map_source(ck: Checkpoint, src: Any, item: ReadItem) -> np.ndarray | str:
    """Another format's array mapped whole (a safetensors tensor), or why not."""
    if getattr(src, "map", None) is None:
        return f"{ck.format} checkpoints' arrays are read, not mapped (of other formats, only safetensors files map)"
    if any(item.storage_offsets) or tuple(item.lengths) != tuple(src.shape):
        return "the region is not the whole stored tensor (a resharded region)"
    mapped: np.ndarray | str = src.map()
    return mapped


def as_result(stored: np.ndarray, dtype: str, like: Any, *, read_only: bool) -> Any:
    """A mapped stored array as the kind of ``like`` (a torch tensor: a view of it; numpy: itself,
    made read-only when asked; torch tensors cannot be read-only, and stay copy-on-write)."""
    if is_tensor(like):
        return _dtypes.numpy_to_tensor(stored, dtype)
    if read_only:
        stored = stored.view()
        stored.flags.writeable = False
    return stored


def map_leaves(
    ck: Checkpoint, dests: list[tuple[int, Dest]], leaves: list[Any], paths: list[str], *, inplace: bool, read_only: bool
) -> tuple[dict[int, Any], list[tuple[int, Dest]]]:
    """Map the leaves of ``dests`` (index of the target leaf, destination) that a mapping can
    serve: returns the mapped results by leaf index and the destinations left to copy. Logs
    which leaves are copied and why (:func:`tell`)."""
    parts: dict[int, int] = {}
    for i, _ in dests:
        parts[i] = parts.get(i, 0) + 1
    candidates: list[tuple[int, Dest]] = []
    copied: dict[str, list[str]] = {}
    left: list[tuple[int, Dest]] = []
    for i, dest in dests:
        why = _why_not(ck, dest, leaves[i], inplace, parts[i])
        if why is None:
            candidates.append((i, dest))
        else:
            copied.setdefault(why, []).append(paths[i])
            left.append((i, dest))
    mapped: dict[int, Any] = {}
    nbytes = 0
    results = map_items(ck, [d.item for _, d in candidates])
    holder: dict[tuple[int, int], int] = {}  # mapped bytes -> the leaf given them
    for (i, dest), got in zip(candidates, results):
        if not isinstance(got, str):
            got = _untied(got, i, holder, leaves, paths)
        if isinstance(got, str):
            copied.setdefault(got, []).append(paths[i])
            left.append((i, dest))
            continue
        dtype = ck.arrays[dest.item.path].dtype
        mapped[i] = as_result(got, dtype, dest.tensor, read_only=read_only)
        if holder[_span(got)] == i:
            nbytes += got.nbytes
    tell(f"restore {ck.location}", len(mapped), nbytes, copied)
    return mapped, left


def _span(stored: np.ndarray) -> tuple[int, int]:
    return stored.__array_interface__["data"][0], stored.nbytes


def _untied(got: np.ndarray, i: int, holder: dict[tuple[int, int], int], leaves: list[Any], paths: list[str]) -> np.ndarray | str:
    """``got`` for leaf ``i``, unless another leaf was already given the same mapped bytes (the
    leaves were one tensor when saved: aliases, tied weights) and the target does not hold the
    two as one object: a view of one mapping would tie leaves the target keeps apart (a write
    to one showing in the other), so this one is copied instead (a phrase why)."""
    first = holder.setdefault(_span(got), i)
    if first == i or (leaves[i] is not None and leaves[i] is leaves[first]):
        return got
    return f"it was saved as the same tensor as {paths[first]!r}, which holds the mapping (a view would tie the two)"


def _why_not(ck: Checkpoint, dest: Dest, leaf: Any, inplace: bool, parts: int) -> str | None:
    """Why the destination's leaf is copied whatever its files hold, or None."""
    if inplace and not materialises(leaf):
        return "in place: it is copied into the target's own memory"
    if parts > 1 or dest.finish is not None or dest.result is not dest.tensor:
        kind = type(dest.result if dest.result is not None else leaf).__name__
        return f"its result (a {kind}) is built around the memory a read fills (its kind, or a mapping rule's view)"
    t = dest.tensor
    if is_tensor(t) and t.device.type != "cpu":
        return f"its target is on {t.device}"
    stored = ck.arrays[dest.item.path].dtype
    if not viewable(dest, stored):
        target = _dtypes.torch_name(t.dtype) if is_tensor(t) else str(t.dtype)
        return f"a cast from {stored} to {target}"
    return None


def tell(what: str, mapped: int, nbytes: int, copied: dict[str, list[str]]) -> None:
    """Log how many leaves ``what`` mapped, and each reason a leaf was copied with the leaves it applies to."""
    if not copied:
        logger.info("%s: %d leaves mapped from their files (%s), none copied", what, mapped, human_bytes(nbytes))
        return
    reasons = []
    for why, paths in copied.items():
        named = ", ".join(repr(p) for p in paths[:NAMED])
        more = f" and {len(paths) - NAMED} more" if len(paths) > NAMED else ""
        reasons.append(f"{named}{more}: {why}")
    total = sum(len(p) for p in copied.values())
    logger.info(
        "%s: %d leaves mapped from their files (%s); %d copied instead: %s",
        what, mapped, human_bytes(nbytes), total, "; ".join(reasons),
    )

