"""Choosing chunk and shard shapes (pure functions, no I/O).

Rule (docs/format.md, "Chunking"):

1. Every dimension has a *step*: the gcd of the offsets where writers' regions
   start in that dimension, or the full extent when one writer covers it. A
   shard (one file) never crosses a step boundary, so each file has exactly one
   writer. A region its writer holds in separate pieces counts as those pieces.
2. Inner chunks (the unit of partial reads) are filled in C order up to
   ``INNER_CHUNK_BYTES``: trailing dimensions whole, then as many rows of the
   next dimension as fit. The last dimension of a 2-D or larger array is first
   cut into ``TRAILING_PIECES`` (4) even pieces when each keeps at least
   ``MIN_PIECE`` elements, so a column (tensor-parallel) slice of a half or a
   quarter reads no rows it does not need, while one row still touches only
   4 chunks (2 MiB). (Whole-row chunks save slightly faster, being written
   from the source in place, but double what a column-half read reads.)
3. Shards are whole multiples of the inner chunk, filled in C order up to
   ``SHARD_BYTES`` within one step, which bounds the memory a single write
   needs and the size of any one file.
4. An array no larger than one inner chunk is stored as a single plain chunk.
5. A save with ``inner_chunks=False`` skips rule 2: each shard is one chunk (a
   writer's region, or a row block of it up to ``SHARD_BYTES``), which
   ``copy=False`` restores map whole, at the price of partial reads reading
   whole shards.

Regions (:data:`tsckpt._base.types.Box`) meet the shard grid in :func:`shard_boxes`
(a region's piece in each shard file) and :func:`intersect` (a shard's piece of
a region). A region a rank holds in separate pieces (a jax.Array's device shards,
:attr:`tsckpt._base.types.LeafDesc.cuts`) is cut into them by :func:`pieces`; the
planner counts each piece as a region, so no shard file spans two pieces and
each file is written from one piece's memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._base.types import Box
from .records import Chunking

INNER_CHUNK_BYTES = 512 << 10
SHARD_BYTES = 256 << 20
TRAILING_PIECES = 4
MIN_PIECE = 256


def largest_divisor_at_most(n: int, limit: int) -> int:
    """Largest divisor of ``n`` that is <= ``limit`` (at least 1)."""
    if limit >= n:
        return n
    best = 1
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            if i <= limit:
                best = max(best, i)
            if n // i <= limit:
                best = max(best, n // i)
    return best


def _fill(limits: Sequence[int], divisible: Sequence[bool], unit_bytes: int, target: int) -> list[int]:
    """C-order fill: trailing dims whole while the block stays under ``target`` bytes."""
    out = [1] * len(limits)
    budget = max(1, target // max(1, unit_bytes))
    for d in reversed(range(len(limits))):
        lim = limits[d]
        v = min(lim, budget)
        if v < lim:  # even pieces: 1024 rows at most 504 a piece -> 342, not 504+504+16
            v = -(-lim // -(-lim // v))
        if divisible[d]:
            v = largest_divisor_at_most(lim, max(1, budget))
        out[d] = max(1, v)
        if v < lim:
            break
        budget //= max(1, v)
    return out


def steps_from_cuts(shape: Sequence[int], cuts: Sequence[Sequence[int]]) -> tuple[list[int], list[bool]]:
    """Per-dim step (gcd of interior region starts) and whether it constrains the dim."""
    steps, constrained = [], []
    for d, n in enumerate(shape):
        interior = [c for c in (cuts[d] if d < len(cuts) else ()) if 0 < c < n]
        if interior:
            steps.append(math.gcd(*interior))
            constrained.append(True)
        else:
            steps.append(max(1, n))
            constrained.append(False)
    return steps, constrained


def choose_chunking(
    shape: Sequence[int],
    itemsize: int,
    cuts: Sequence[Sequence[int]] = (),
    *,
    inner_bytes: int | None = None,
    shard_bytes: int | None = None,
    inner_chunks: bool = True,
) -> Chunking:
    """Shard and inner chunk shapes for an array of ``shape``.

    ``cuts[d]`` lists the offsets along dim ``d`` where writers' regions begin.
    The byte targets default to the module's ``INNER_CHUNK_BYTES`` and
    ``SHARD_BYTES``, read at call time. ``inner_chunks=False``: no inner chunks, each
    shard one chunk (rule 3 without rule 2: whole trailing dimensions, filled in
    C order up to ``shard_bytes``), which a zero-copy restore can map whole.
    """
    inner_bytes = INNER_CHUNK_BYTES if inner_bytes is None else inner_bytes
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    shape = [int(s) for s in shape]
    if not shape:
        return Chunking((), None)
    steps, constrained = steps_from_cuts(shape, cuts)
    if not inner_chunks:
        return Chunking(tuple(_fill(steps, constrained, itemsize, shard_bytes)), None)
    if math.prod(steps) * itemsize <= inner_bytes:
        return Chunking(tuple(steps), None)
    limits = list(steps)
    if len(shape) >= 2 and not constrained[-1]:
        pieces = next((p for p in (TRAILING_PIECES, 2) if limits[-1] // p >= MIN_PIECE), 1)
        limits[-1] = -(-limits[-1] // pieces)
    inner = _fill(limits, constrained, itemsize, inner_bytes)
    # shard = inner * k, k filled in C order in units of whole inner chunks
    k_limits = [s // i if c else -(-s // i) for s, i, c in zip(steps, inner, constrained)]
    k = _fill(k_limits, constrained, math.prod(inner) * itemsize, shard_bytes)
    shard = tuple(i * m for i, m in zip(inner, k))
    if shard == tuple(inner):
        return Chunking(shard, None)
    return Chunking(shard, tuple(inner))


def shard_count(shape: Sequence[int], chunking: Chunking) -> int:
    """How many shards (files) an array of ``shape`` has (an empty array: one)."""
    return math.prod(-(-max(1, n) // g) for n, g in zip(shape, chunking.shard_shape))


def shard_boxes(offsets: Sequence[int], lengths: Sequence[int], chunking: Chunking) -> list[Box]:
    """Split a region into its pieces in each shard (file) it touches, in C order."""
    if 0 in lengths:  # an empty region touches no shard, however long its other extents
        return []
    ranges = []
    for o, n, g in zip(offsets, lengths, chunking.shard_shape):
        edges = [o] + list(range((o // g + 1) * g, o + n, g)) + [o + n]
        ranges.append([(a, b - a) for a, b in zip(edges, edges[1:]) if b > a])
    out: list[Box] = [((), ())]
    for dim in ranges:
        out = [(off + (s,), ln + (n,)) for off, ln in out for s, n in dim]
    return out


def pieces(region: Box, cuts: Sequence[Sequence[int]], itemsize: int) -> list[Box]:
    """The cells of ``region`` cut, in each dimension, at the offsets ``cuts[d]`` (global
    coordinates; those not strictly inside the region are ignored), in C order. No cuts:
    the region itself. A region of at most ``INNER_CHUNK_BYTES`` is kept whole too: it is
    one small file, whose copy out of its pieces costs less than a file for each."""
    if not cuts or math.prod(region[1]) * itemsize <= INNER_CHUNK_BYTES:
        return [region]
    return cells(region, cuts)


def cells(region: Box, cuts: Sequence[Sequence[int]]) -> list[Box]:
    """The cells of ``region`` cut, in each dimension, at the offsets ``cuts[d]`` (global
    coordinates; those not strictly inside the region are ignored), in C order."""
    ranges = []
    for d, (o, n) in enumerate(zip(*region)):
        inner = sorted({c for c in (cuts[d] if d < len(cuts) else ()) if o < c < o + n})
        edges = [o, *inner, o + n]
        ranges.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    out: list[Box] = [((), ())]
    for dim in ranges:
        out = [(off + (s,), ln + (m,)) for off, ln in out for s, m in dim]
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two regions, None when they share no element."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))
