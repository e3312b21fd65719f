"""A checkpoint seen through a :class:`~tsckpt._base.mapping.Rules`: the target leaves the
rules make, as restore and ``open`` see them, and each target region's reads of the stored
arrays (:meth:`MappedCheckpoint.dests`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.mapping import Mapped, MappingError, Rules, place, plan
from .._base.types import Dest, ReadItem
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import Chunking
from .._ondisk.records import ArrayRecord
from .._runtime.progress import logger
from .reader import LazyArray, Reader


@dataclasses.dataclass(frozen=True)
class MappedCheckpoint:
    """``view``: the checkpoint with the mapping's target leaves (arrays, values, the tree
    built from their paths); ``stored``: the checkpoint as opened, which every read uses."""

    stored: Checkpoint
    view: Checkpoint
    leaves: dict[str, Mapped]

    def sources(self, paths: list[str]) -> list[str]:
        """The stored arrays the target leaves ``paths`` read."""
        return sorted({s for p in paths if p in self.leaves for s in self.leaves[p].sources} & self.stored.arrays.keys())

    def explained(self, path: str, error: Exception) -> Exception:
        """``error`` about the target leaf ``path``, of the same class, naming the rule and the
        stored leaves it maps from (unchanged for a leaf no rule maps)."""
        leaf = self.leaves.get(path)
        if leaf is None or leaf.rule is None:
            return error
        return type(error)(f"{error} (the leaf as mapped by {leaf.where()}: shape {list(leaf.shape)}, {leaf.dtype})")

    def dests(self, path: str, parts: tuple[Dest, ...]) -> list[Dest]:
        """The reads of the stored arrays that fill the target regions ``parts`` of ``path``:
        one per stored box, into a view of the region's memory."""
        leaf = self.leaves[path]
        if leaf.rule is None:  # under its own name (a tied leaf: its stored array's)
            stored = leaf.sources[0]
            return [p if p.item.path == stored else dataclasses.replace(p, item=dataclasses.replace(p.item, path=stored))
                    for p in parts]
        out = []
        for part in parts:
            for piece in plan(leaf, part.item.storage_offsets, part.item.lengths):
                try:
                    memory = place(part.tensor, piece.ops)
                except ValueError as e:
                    raise MappingError(
                        f"{leaf.where()}: the target's memory cannot take the view the rule needs without a "
                        f"copy ({e}); restore into contiguous memory (inplace=False, or a contiguous target)"
                    ) from e
                item = ReadItem(piece.source, piece.offsets, piece.lengths)
                out.append(dataclasses.replace(part, item=item, tensor=memory, parts=()))
        return out


# Above this ratio of stored bytes touched to bytes needed, a mapped read is reported.
AMPLIFICATION_LIMIT = 1.1


def read_amplification(ck: Checkpoint, dests: list[Dest]) -> float:
    """The bytes of the stored chunks that the reads ``dests`` touch over the bytes they
    need; above :data:`AMPLIFICATION_LIMIT` the stored arrays whose chunking makes it so
    are logged (INFO, the ``tsckpt`` logger): their chunks are larger than the regions read,
    as when a whole-array chunk is read by each rank for its column block."""
    needed = touched = 0
    worst: dict[str, tuple[int, int]] = {}
    for d in dests:
        rec = ck.arrays[d.item.path]
        chunk = rec.chunking.chunk_shape or rec.chunking.shard_shape or rec.shape
        n = math.prod(d.item.lengths)
        t = math.prod(
            min(size, -(-(o + ln) // c) * c) - (o // c) * c if ln else 0
            for o, ln, c, size in zip(d.item.storage_offsets, d.item.lengths, chunk, rec.shape)
        )
        needed, touched = needed + n, touched + t
        a, b = worst.get(d.item.path, (0, 0))
        worst[d.item.path] = (a + n, b + t)
    ratio = touched / needed if needed else 1.0
    if ratio > AMPLIFICATION_LIMIT:
        over = sorted(((b / a, p) for p, (a, b) in worst.items() if a and b / a > AMPLIFICATION_LIMIT), reverse=True)
        listed = ", ".join(f"'{p}' {r:.2f}x (chunks {list(ck.arrays[p].chunking.chunk_shape or ck.arrays[p].chunking.shard_shape)})"
                           for r, p in over[:5])
        logger.info(
            "%s: the mapped reads touch %.2fx the stored bytes their regions need: the stored chunks are larger "
            "than the regions read (%s%s); saving with smaller chunks along the axes the targets are sharded on "
            "reads less", ck.location, ratio, listed, f" and {len(over) - 5} more" if len(over) > 5 else "",
        )
    return ratio


def mapped_checkpoint(ck: Checkpoint, mapping: Rules) -> MappedCheckpoint:
    """``ck`` through ``mapping``: raises :class:`MappingError` (or ShapeMismatchError) naming
    the rule, the stored path and the target path where the rules do not fit."""
    arrays = {p: (r.shape, r.dtype) for p, r in ck.arrays.items()}
    for alias, stored in ck.aliases.items():  # a tied leaf: its stored array under its own name
        arrays[alias] = arrays[stored]
    values = [p for p in ck.leaves if p in ck.values]
    resolved = mapping.resolve({p: arrays[p] for p in ck.leaves if p in arrays}, values)
    leaves = {t: dataclasses.replace(leaf, sources=tuple(ck.aliases.get(s, s) for s in leaf.sources))
              for t, leaf in resolved.items()}
    records = {}
    for target, leaf in leaves.items():
        if leaf.is_value:
            continue
        rec = ck.arrays[leaf.sources[0]]
        if leaf.rule is not None and rec.dtype == "complex32" and (leaf.pre_views or leaf.post_views or leaf.concat is not None):
            raise MappingError(f"{leaf.where()}: complex32 arrays cannot be viewed; save them as complex64")
        chunking = rec.chunking if leaf.rule is None else Chunking(leaf.shape, None)
        records[target] = ArrayRecord(target, leaf.shape, leaf.dtype, rec.kind, chunking, rec.slash_keys)
    view = dataclasses.replace(
        ck,
        leaves=tuple(leaves),
        arrays=records,
        values={t: ck.values[leaf.sources[0]] for t, leaf in leaves.items() if leaf.is_value},
        aliases={},
        structure=None,
    )
    return MappedCheckpoint(ck, view, leaves)


class MappedArray(LazyArray):
    """A target leaf of a mapping, read lazily: indexing reads only the stored boxes that
    the index's region needs."""

    def __init__(self, mapped: MappedCheckpoint, path: str) -> None:
        super().__init__(mapped.view, path)
        self._mapped = mapped

    def read_box(self, box: tuple[slice, ...]) -> np.ndarray:
        bounds = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, self.shape))
        whole = bounds + tuple(slice(0, n) for n in self.shape[len(bounds) :])
        offsets = tuple(b.start for b in whole)
        lengths = tuple(max(0, b.stop - b.start) for b in whole)
        out = np.empty(lengths, dtype=_dtypes.numpy_dtype(self.dtype))
        stored = self._mapped.stored
        part = Dest(ReadItem(self.path, offsets, lengths), out, None)
        for dest in self._mapped.dests(self.path, (part,)):
            if math.prod(dest.item.lengths):
                box = tuple(slice(o, o + n) for o, n in zip(dest.item.storage_offsets, dest.item.lengths))
                dest.tensor[...] = LazyArray(stored, dest.item.path).read_box(box)
        return out


class MappedReader(Reader):
    """The :class:`Reader` of a checkpoint through a mapping: target paths, shapes and dtypes."""

    def __init__(self, mapped: MappedCheckpoint) -> None:
        super().__init__(mapped.view)
        self.mapped = mapped

    def __getitem__(self, path: str) -> Any:
        leaf = self.mapped.leaves.get(path)
        if leaf is not None and not leaf.is_value:
            return LazyArray(self.mapped.stored, leaf.sources[0]) if leaf.rule is None else MappedArray(self.mapped, path)
        return super().__getitem__(path)
