"""The planner's checks of what ranks give for one path (LayoutError otherwise).

Each check takes the path, the ranks giving it and their descriptors, in rank
order, and either returns what it found agreed or raises a LayoutError naming
the path, the regions or ranks at fault and the fix. Pure functions: the
planner (tsckpt/_save/plan.py) calls them on rank 0, once per way of giving an
array where the answer cannot differ.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .._base.types import Box, LeafDesc, box_text
from .._errors import LayoutError


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]))


def check_exact_cover(path: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Distinct regions ``boxes`` must lie in ``shape``, not overlap, and tile it exactly."""
    for off, ln in boxes:
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(off, ln, shape)) or len(off) != len(shape):
            raise LayoutError(
                f"'{path}': region {box_text((off, ln))} lies outside the global shape {list(shape)}; "
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
                        f"'{path}': regions {box_text(other)} and {box_text(box)} overlap; "
                        "every element must belong to exactly one shard (replicas must give identical regions)"
                    )
            active.append(box)
    covered = sum(math.prod(b[1]) for b in live)
    total = math.prod(shape)
    if covered != total:
        shown = ", ".join(box_text(b) for b in live[:8])
        raise LayoutError(
            f"'{path}': shards cover {covered} of {total} elements of global shape {list(shape)} "
            f"(regions: {shown}{', ...' if len(live) > 8 else ''}); a shard is missing - every rank "
            "holding part of this array must pass it to save"
        )


def check_agreement(path: str, ranks: Sequence[int], descs: Sequence[LeafDesc]) -> None:
    """Every rank giving ``path`` gives the same kind of leaf, global shape and dtype."""
    kinds = {d.kind for d in descs}
    if len(kinds) > 1 or (kinds != {"value"} and len({(d.dtype, d.global_shape) for d in descs}) > 1):
        desc = "; ".join(
            f"rank {r}: {d.kind} {d.dtype} {list(d.global_shape)}" if d.kind != "value" else f"rank {r}: value"
            for r, d in list(zip(ranks, descs))[:8]
        )
        raise LayoutError(
            f"'{path}': ranks disagree on what this leaf is ({desc}); every rank giving a path must give "
            "the same global shape and dtype"
        )


def agreed_value(path: str, ranks: Sequence[int], values: Sequence[Any]) -> Any:
    """The value every rank giving ``path`` gives (a plain value is never per-rank)."""
    first = values[0]
    shown = repr(first)
    differ = [(r, v) for r, v in zip(ranks, values) if repr(v) != shown]
    if differ:
        raise LayoutError(
            f"'{path}': ranks {ranks[0]} and {[r for r, _ in differ][:8]} give different values "
            f"({first!r} vs {differ[0][1]!r}); use a rank-unique path for per-rank state"
        )
    return first


def replica_groups(
    path: str, ranks: Sequence[int], boxes: Sequence[Box], checksums: Sequence[int | None]
) -> dict[Box, list[int]]:
    """Holder ranks grouped by region (``boxes``, one per rank); replicas of a region must
    agree on their checksum (None: not computed)."""
    groups: dict[Box, list[tuple[int, int | None]]] = defaultdict(list)
    for r, box, c in zip(ranks, boxes, checksums):
        groups[box].append((r, c))
    for box, members in groups.items():
        if len({c for _, c in members if c is not None}) > 1:
            by_sum: dict[int | None, list[int]] = defaultdict(list)
            for r, c in members:
                by_sum[c].append(r)
            parts = " vs ".join(f"ranks {rs}" for rs in by_sum.values())
            raise LayoutError(
                f"'{path}': replicas of region {box_text(box)} differ in content ({parts}); ranks that give "
                "the same path must hold the same data. If these are different tensors (e.g. pipeline "
                "stages with stage-local names), give them distinct global names; to skip this check pass "
                "check_replicas=False"
            )
    return {box: [r for r, _ in members] for box, members in groups.items()}
