"""Save and read plans: pure functions from small descriptors to frozen dataclasses.

Nothing here does I/O or talks to other ranks, so every planning rule is
testable with hand-made descriptors (e.g. 64 "ranks" in one process).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ._errors import LayoutError
from ._format import ArrayRecord, Layout
from ._layout import choose_layout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


@dataclasses.dataclass(frozen=True)
class LeafDesc:
    """What one rank holds for one path: a region of a global array, or a value."""

    path: str
    kind: str  # "torch" | "numpy" | "numpy_scalar" | "value"
    dtype: str = ""
    itemsize: int = 0
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    checksum: int | None = None  # of the local region, compared across replicas
    value: Any = None  # JSON of a plain value


@dataclasses.dataclass(frozen=True)
class WriteItem:
    """Rank ``rank`` writes the global box (``offsets``, ``lengths``) of ``path``
    from its local data starting at ``source_offsets``."""

    rank: int
    path: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    source_offsets: tuple[int, ...]

    @property
    def nbytes_elems(self) -> int:
        return math.prod(self.lengths)


@dataclasses.dataclass(frozen=True)
class SavePlan:
    arrays: tuple[ArrayRecord, ...]
    values: tuple[tuple[str, Any], ...]  # (path, value JSON)
    writes: tuple[WriteItem, ...]

    def writes_for(self, rank: int) -> list[WriteItem]:
        return [w for w in self.writes if w.rank == rank]


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """Read the global box (``storage_offsets``, ``lengths``) of ``path`` into the
    local destination at ``dest_offsets``."""

    path: str
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dest_offsets: tuple[int, ...]


def _fmt_box(box: Box) -> str:
    off, ln = box
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, ln)) + "]"


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]))


def _check_exact_cover(path: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Distinct boxes must not overlap and must tile ``shape`` exactly."""
    for off, ln in boxes:
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(off, ln, shape)) or len(off) != len(shape):
            raise LayoutError(
                f"'{path}': region {_fmt_box((off, ln))} lies outside the global shape {list(shape)}; "
                "fix the offsets or global_shape given for this shard"
            )
    live = sorted((b for b in boxes if math.prod(b[1]) > 0), key=lambda b: b[0])
    if shape:
        active: list[Box] = []
        for box in live:
            active = [a for a in active if a[0][0] + a[1][0] > box[0][0]]
            for other in active:
                if _overlap(other, box):
                    raise LayoutError(
                        f"'{path}': regions {_fmt_box(other)} and {_fmt_box(box)} overlap; "
                        "every element must belong to exactly one shard (replicas must give identical regions)"
                    )
            active.append(box)
    covered = sum(math.prod(b[1]) for b in live)
    total = math.prod(shape)
    if covered != total:
        shown = ", ".join(_fmt_box(b) for b in live[:8])
        raise LayoutError(
            f"'{path}': shards cover {covered} of {total} elements of global shape {list(shape)} "
            f"(regions: {shown}{', ...' if len(live) > 8 else ''}); a shard is missing - every rank "
            "holding part of this array must pass it to save"
        )


def plan_save(per_rank: Sequence[Sequence[LeafDesc]]) -> SavePlan:
    """Validate what all ranks hold and decide who writes what.

    Identical regions given by several ranks are replicas: each is written by one
    of them, the one with the fewest bytes assigned so far (largest regions are
    placed first). Distinct regions must exactly tile the global array. Shard
    boundaries follow the region starts, so no file has two writers.
    """
    by_path: dict[str, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for rank, leaves in enumerate(per_rank):
        for leaf in leaves:
            by_path[leaf.path].append((rank, leaf))

    arrays: list[ArrayRecord] = []
    values: list[tuple[str, Any]] = []
    regions: list[tuple[int, str, Box, list[tuple[int, LeafDesc]]]] = []
    for path in sorted(by_path):
        holders = by_path[path]
        first_rank, first = holders[0]
        kinds = {leaf.kind for _, leaf in holders}
        if len(kinds) > 1 or (first.kind != "value" and len({(lf.dtype, lf.global_shape) for _, lf in holders}) > 1):
            desc = "; ".join(
                f"rank {r}: {lf.kind} {lf.dtype} {list(lf.global_shape)}" if lf.kind != "value" else f"rank {r}: value"
                for r, lf in holders[:8]
            )
            raise LayoutError(
                f"'{path}': ranks disagree on what this leaf is ({desc}); every rank giving a path must give "
                "the same global shape and dtype"
            )
        if first.kind == "value":
            distinct = {repr(lf.value) for _, lf in holders}
            if len(distinct) > 1:
                ranks = [r for r, lf in holders if repr(lf.value) != repr(first.value)]
                raise LayoutError(
                    f"'{path}': ranks {first_rank} and {ranks[:8]} give different values "
                    f"({first.value!r} vs {holders[[r for r, _ in holders].index(ranks[0])][1].value!r}); "
                    "use a rank-unique path for per-rank state"
                )
            values.append((path, first.value))
            continue
        groups: dict[Box, list[tuple[int, LeafDesc]]] = defaultdict(list)
        for r, lf in holders:
            groups[(lf.offsets, lf.lengths)].append((r, lf))
        for box, members in groups.items():
            sums = {lf.checksum for _, lf in members if lf.checksum is not None}
            if len(sums) > 1:
                by_sum: dict[int | None, list[int]] = defaultdict(list)
                for r, lf in members:
                    by_sum[lf.checksum].append(r)
                parts = " vs ".join(f"ranks {rs}" for rs in by_sum.values())
                raise LayoutError(
                    f"'{path}': replicas of region {_fmt_box(box)} differ in content ({parts}); ranks that give "
                    "the same path must hold the same data. If these are different tensors (e.g. pipeline "
                    "stages with stage-local names), give them distinct global names; to skip this check pass "
                    "check_replicas=False"
                )
        boxes = list(groups)
        _check_exact_cover(path, first.global_shape, boxes)
        cuts = [sorted({b[0][d] for b in boxes}) for d in range(len(first.global_shape))]
        layout = choose_layout(first.global_shape, first.itemsize, cuts)
        arrays.append(ArrayRecord(path, first.global_shape, first.dtype, first.kind, layout))
        for box, members in groups.items():
            regions.append((math.prod(box[1]) * first.itemsize, path, box, members))

    load: dict[int, int] = defaultdict(int)
    writes: list[WriteItem] = []
    for nbytes, path, box, members in sorted(regions, key=lambda x: (-x[0], x[1], x[2])):
        rank, leaf = min(members, key=lambda m: (load[m[0]], m[0]))
        load[rank] += nbytes
        src = tuple(o - lo for o, lo in zip(box[0], leaf.offsets))
        writes.append(WriteItem(rank, path, box[0], box[1], src))
    writes.sort(key=lambda w: (w.rank, w.path, w.offsets))
    return SavePlan(tuple(arrays), tuple(values), tuple(writes))


def shard_boxes(offsets: Sequence[int], lengths: Sequence[int], layout: Layout) -> list[Box]:
    """Split a region into its pieces in each shard (file) it touches, in C order."""
    ranges = []
    for o, n, g in zip(offsets, lengths, layout.shard_shape):
        edges = [o] + list(range((o // g + 1) * g, o + n, g)) + [o + n]
        ranges.append([(a, b - a) for a, b in zip(edges, edges[1:]) if b > a])
    out: list[Box] = [((), ())]
    for dim in ranges:
        out = [(off + (s,), ln + (n,)) for off, ln in out for s, n in dim]
    return out


def plan_read(path: str, want_offsets: Sequence[int], want_lengths: Sequence[int]) -> ReadItem:
    """Read the region a local target needs; the executor slabs it by shard."""
    return ReadItem(path, tuple(want_offsets), tuple(want_lengths), tuple(0 for _ in want_offsets))
