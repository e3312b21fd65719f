"""Save and read plans: pure functions from small descriptors to frozen dataclasses.

Nothing here does I/O or talks to other ranks, so every planning rule is
testable with hand-made descriptors (e.g. 64 "ranks" in one process).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
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
    """Rank ``rank`` writes the global box (``offsets``, ``lengths``) of ``path``.

    Normally the box lies in the rank's own region and is read from its local
    data at ``source_offsets``. An ``assembled`` item is one whole shard that
    straddles regions of an irregular split: the rank fills it from its own
    data plus the :class:`Transfer` pieces other ranks send it.
    """

    rank: int
    path: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    source_offsets: tuple[int, ...] = ()
    assembled: bool = False


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rank ``src`` sends the global box (``offsets``, ``lengths``) of ``path`` to ``dst``."""

    path: str
    src: int
    dst: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SavePlan:
    arrays: tuple[ArrayRecord, ...]
    values: tuple[tuple[str, Any], ...]  # (path, value JSON)
    writes: tuple[WriteItem, ...]
    transfers: tuple[Transfer, ...] = ()

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


def plan_save(per_rank: Sequence[Sequence[LeafDesc]], *, shard_bytes: int | None = None) -> SavePlan:
    """Validate what all ranks hold and decide who writes what.

    Identical regions given by several ranks are replicas: each is written by one
    of them, the one with the fewest bytes assigned so far (largest regions are
    placed first). Distinct regions must exactly tile the global array. Every
    shard (file) has exactly one writer (see :func:`_plan_array`). ``shard_bytes``
    caps the size of a shard (default: the layout's ``SHARD_BYTES``).
    """
    by_path: dict[str, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for rank, leaves in enumerate(per_rank):
        for leaf in leaves:
            by_path[leaf.path].append((rank, leaf))

    values: list[tuple[str, Any]] = []
    array_groups: list[tuple[str, LeafDesc, dict[Box, list[tuple[int, LeafDesc]]]]] = []
    for path in sorted(by_path):
        holders = by_path[path]
        _check_agreement(path, holders)
        first = holders[0][1]
        if first.kind == "value":
            values.append((path, _agreed_value(path, holders)))
            continue
        groups = _replica_groups(path, holders)
        _check_exact_cover(path, first.global_shape, list(groups))
        array_groups.append((path, first, groups))

    writer = _assign_writers(array_groups)
    arrays: list[ArrayRecord] = []
    writes: list[WriteItem] = []
    transfers: list[Transfer] = []
    for path, first, groups in array_groups:
        owned = [(box, writer[(path, box)]) for box in groups if math.prod(box[1]) > 0]
        layout, items, moves = _plan_array(path, first, owned, shard_bytes)
        arrays.append(ArrayRecord(path, first.global_shape, first.dtype, first.kind, layout))
        writes += items
        transfers += moves
    writes.sort(key=lambda w: (w.rank, w.path, w.offsets))
    return SavePlan(tuple(arrays), tuple(values), tuple(writes), tuple(transfers))


def _check_agreement(path: str, holders: list[tuple[int, LeafDesc]]) -> None:
    """Every rank giving ``path`` gives the same kind of leaf, global shape and dtype."""
    first = holders[0][1]
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


def _agreed_value(path: str, holders: list[tuple[int, LeafDesc]]) -> Any:
    """The value every rank giving ``path`` gives (a plain value is never per-rank)."""
    first_rank, first = holders[0]
    differ = [(r, lf) for r, lf in holders if repr(lf.value) != repr(first.value)]
    if differ:
        raise LayoutError(
            f"'{path}': ranks {first_rank} and {[r for r, _ in differ][:8]} give different values "
            f"({first.value!r} vs {differ[0][1].value!r}); use a rank-unique path for per-rank state"
        )
    return first.value


def _replica_groups(path: str, holders: list[tuple[int, LeafDesc]]) -> dict[Box, list[tuple[int, LeafDesc]]]:
    """Holders grouped by region; replicas of a region must agree on their checksum."""
    groups: dict[Box, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for r, lf in holders:
        groups[(lf.offsets, lf.lengths)].append((r, lf))
    for box, members in groups.items():
        if len({lf.checksum for _, lf in members if lf.checksum is not None}) > 1:
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
    return groups


def _assign_writers(
    array_groups: list[tuple[str, LeafDesc, dict[Box, list[tuple[int, LeafDesc]]]]],
) -> dict[tuple[str, Box], tuple[int, LeafDesc]]:
    """One writer per region: among its replicas, the rank with the fewest bytes so far,
    placing the largest regions first."""
    regions = [
        (math.prod(box[1]) * first.itemsize, path, box, members)
        for path, first, groups in array_groups
        for box, members in groups.items()
    ]
    load: dict[int, int] = defaultdict(int)
    writer: dict[tuple[str, Box], tuple[int, LeafDesc]] = {}
    for nbytes, path, box, members in sorted(regions, key=lambda x: (-x[0], x[1], x[2])):
        writer[(path, box)] = min(members, key=lambda m: (load[m[0]], m[0]))
        load[writer[(path, box)][0]] += nbytes
    return writer


def plan_aliases(per_rank: Sequence[Sequence[LeafDesc]], links: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Leaves written once: ``{alias path: stored path}``.

    ``links[r]`` maps a path to the smallest path whose local data rank ``r``
    found to be the very same memory (storage pointer, offset, shape, strides,
    dtype); empty regions prove nothing and are never linked. A path is an alias
    of ``s`` when some rank links it to ``s`` and every rank holding it agrees:
    it links it to ``s`` too, or its region is empty and it holds ``s`` with the
    identical region. One rank holding the two as different memory keeps both.
    """
    held = [{d.path: d for d in descs} for descs in per_rank]
    out: dict[str, str] = {}
    for alias in sorted({a for rank_links in links for a in rank_links}):
        stored = next(rank_links[alias] for rank_links in links if alias in rank_links)
        agreed = True
        for descs, rank_links in zip(held, links):
            if alias not in descs:
                continue
            if alias in rank_links:
                agreed = rank_links[alias] == stored
            else:
                a, s = descs[alias], descs.get(stored)
                agreed = (
                    math.prod(a.lengths) == 0
                    and s is not None
                    and (a.kind, a.dtype, a.global_shape, a.offsets, a.lengths)
                    == (s.kind, s.dtype, s.global_shape, s.offsets, s.lengths)
                )
            if not agreed:
                break
        if agreed:
            out[alias] = stored
    return out


def _n_shards(shape: Sequence[int], layout: Layout) -> int:
    return math.prod(-(-max(1, n) // g) for n, g in zip(shape, layout.shard_shape))


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _plan_array(
    path: str, first: LeafDesc, owned: list[tuple[Box, tuple[int, LeafDesc]]], shard_bytes: int | None = None
) -> tuple[Layout, list[WriteItem], list[Transfer]]:
    """Layout and write items of one array.

    Shards follow the region starts when that keeps them reasonably large. An
    irregular split (e.g. rows 3,3,2,2, or 12565,12564,... from array_split)
    would need shards as thin as the gcd of the starts; instead shards are cut
    no longer than the shortest region, each is written by the rank owning most
    of it, and the thin pieces of straddling shards are sent to that rank.
    """
    shape = first.global_shape
    cuts = [sorted({box[0][d] for box, _ in owned}) for d in range(len(shape))]
    aligned = choose_layout(shape, first.itemsize, cuts, shard_bytes=shard_bytes)
    # shards no longer than the shortest region, so most lie inside one region
    shortest = [[min(box[1][d] for box, _ in owned)] if len(cuts[d]) > 1 else [] for d in range(len(shape))]
    natural = choose_layout(shape, first.itemsize, shortest, shard_bytes=shard_bytes)
    if _n_shards(shape, aligned) <= 2 * _n_shards(shape, natural):
        items = [
            WriteItem(rank, path, box[0], box[1], tuple(o - lo for o, lo in zip(box[0], leaf.offsets)))
            for box, (rank, leaf) in owned
        ]
        return aligned, items, []
    items, moves = [], []
    for cell in shard_boxes((0,) * len(shape), shape, natural):
        parts = [(part, rank) for box, (rank, _) in owned if (part := _intersect(cell, box)) is not None]
        dst = max(parts, key=lambda p: (math.prod(p[0][1]), -p[1]))[1]
        items.append(WriteItem(dst, path, cell[0], cell[1], assembled=True))
        moves += [Transfer(path, rank, dst, part[0], part[1]) for part, rank in parts if rank != dst]
    return natural, items, moves


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
