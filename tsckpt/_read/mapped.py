"""A checkpoint seen through a :class:`~tsckpt._base.mapping.Rules`: the target leaves the
rules make, as restore and ``open`` see them, and each target region's reads of the stored
arrays (:meth:`MappedCheckpoint.dests`)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.casting import CastCheck, check_cast, level
from .._base.lazytorch import is_dtype
from .._base.mapping import Mapped, MappingError, Rules, place, plan
from .._base.types import Dest, ReadItem
from .._errors import LeafTypeError
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

    def dests(self, path: str, parts: tuple[Dest, ...], *, casting: str = "same_kind") -> list[Dest]:
        """The reads of the stored arrays that fill the target regions ``parts`` of ``path``:
        one per stored box, into a view of the region's memory. Where the rule casts, the
        stored values are cast into the target under ``casting`` (:meth:`cast`)."""
        leaf = self.leaves[path]
        if leaf.rule is None:  # under its own name (a tied leaf: its stored array's)
            stored = leaf.sources[0]
            return [p if p.item.path == stored else dataclasses.replace(p, item=dataclasses.replace(p.item, path=stored))
                    for p in parts]
        out = []
        casts: dict[Any, CastCheck | None] = {}  # one check per target dtype, shared by the parts
        for part in parts:
            if part.tensor.dtype not in casts:
                casts[part.tensor.dtype] = self.cast(path, part.tensor.dtype, part.cast, casting)
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
                out.append(dataclasses.replace(part, item=item, tensor=memory, parts=(), cast=casts[part.tensor.dtype]))
        return out

    def cast(self, path: str, target: Any, given: CastCheck | None, casting: str) -> CastCheck | None:
        """The check of the cast from the stored dtype into a ``target`` dtype (numpy or torch)
        of the target leaf ``path``, whose rule casts (``given``, the check of the rule's dtype
        into the target, where it does not). The stored values go into the target at once: a
        target of the rule's dtype, or one the rule's dtype goes into as the stored dtype would
        (the rule's cast keeps every stored value). Refusals raise LeafTypeError naming the rule,
        the stored and the target path."""
        leaf = self.leaves[path]
        if leaf.cast_from is None:
            return given
        name = _dtypes.torch_name(target) if is_dtype(target) else _dtypes.numpy_name(np.dtype(target))
        try:
            check = check_cast(path, leaf.cast_from, _dtypes.numpy_dtype(leaf.dtype), casting=casting)
            if name == leaf.dtype:
                return check
            if level(leaf.cast_from, leaf.dtype) not in ("no", "safe"):
                raise LeafTypeError(
                    f"'{path}': the rule casts stored {leaf.cast_from} into {leaf.dtype}, which rounds or drops "
                    f"values, but the target is {target}; restore into a {leaf.dtype} target, or give the rule the "
                    "target's dtype"
                )
            return check_cast(path, leaf.cast_from, target, casting=casting)
        except LeafTypeError as e:
            raise self.explained(path, e) from e


# Above this ratio of stored bytes touched to bytes needed, a read is reported.
AMPLIFICATION_LIMIT = 1.1
# The most cells :func:`_union` walks to count chunks several reads touch once; past it
# (thousands of scattered pieces) each read's chunks are counted as if it were alone.
_UNION_CELLS = 1 << 16


def read_amplification(ck: Checkpoint, dests: list[Dest]) -> float:
    """The elements of the stored chunks that the reads ``dests`` touch (each chunk once,
    as the read engine decodes it once for all of them) over the elements they need;
    above :data:`AMPLIFICATION_LIMIT` the stored arrays whose chunking makes it so are
    logged (INFO, the ``tsckpt`` logger): their chunks are larger than the regions read,
    as when row chunks are read for a column block, or a whole-array chunk by each rank."""
    needed: dict[str, int] = {}
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for d in dests:
        rec = ck.arrays[d.item.path]
        chunk = rec.chunking.chunk_shape or rec.chunking.shard_shape or rec.shape
        needed[d.item.path] = needed.get(d.item.path, 0) + math.prod(d.item.lengths)
        if math.prod(d.item.lengths):
            lo = tuple((o // c) * c for o, c in zip(d.item.storage_offsets, chunk))
            hi = tuple(min(size, -(-(o + n) // c) * c) for o, n, c, size in zip(d.item.storage_offsets, d.item.lengths,
                                                                                  chunk, rec.shape))
            boxes.setdefault(d.item.path, []).append((lo, hi))
    touched = {p: _union(bs) for p, bs in boxes.items()}
    total = sum(needed.values())
    ratio = sum(touched.values()) / total if total else 1.0
    if ratio > AMPLIFICATION_LIMIT:
        over = sorted(((t / needed[p], p) for p, t in touched.items() if t / needed[p] > AMPLIFICATION_LIMIT), reverse=True)
        listed = ", ".join(f"'{p}' {r:.2f}x (chunks {list(ck.arrays[p].chunking.chunk_shape or ck.arrays[p].chunking.shard_shape)})"
                           for r, p in over[:5])
        logger.info(
            "%s: the reads touch %.2fx the stored bytes their regions need: the stored chunks are larger "
            "than the regions read (%s%s); saving with smaller chunks along the axes the targets are sharded on "
            "reads less", ck.location, ratio, listed, f" and {len(over) - 5} more" if len(over) > 5 else "",
        )
    return ratio


def _union(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """The elements of the union of boxes (lo, hi): the cells between their edges, counted
    once (each box's own size summed where there are too many cells)."""
    if len(boxes) == 1 or len(set(boxes)) == 1:
        return math.prod(h - l for l, h in zip(*boxes[0]))
    edges = [sorted({b[0][d] for b in boxes} | {b[1][d] for b in boxes}) for d in range(len(boxes[0][0]))]
    if math.prod(len(e) - 1 for e in edges) > _UNION_CELLS:
        return sum(math.prod(h - l for l, h in zip(lo, hi)) for lo, hi in boxes)
    total = 0
    for cell in itertools.product(*(range(len(e) - 1) for e in edges)):
        lo = tuple(e[i] for e, i in zip(edges, cell))
        if any(all(bl <= x < bh for x, bl, bh in zip(lo, blo, bhi)) for blo, bhi in boxes):
            total += math.prod(e[i + 1] - e[i] for e, i in zip(edges, cell))
    return total


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

    def read_box(self, box: tuple[slice, ...], *, writable: bool = False) -> np.ndarray:
        """The box read through the rules into new memory (never mapped: ``writable`` is moot)."""
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
                raw = LazyArray(stored, dest.item.path).read_box(box)
                if dest.cast is not None:  # the rule's cast, checked as a restore checks it
                    dest.cast.check(raw, dest.item.storage_offsets)
                dest.tensor[...] = raw
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
