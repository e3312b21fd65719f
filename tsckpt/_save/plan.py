"""The save plan: who writes which region of which array, and how each array is stored.

Pure functions from the ranks' gathered descriptors (tsckpt/_save/descs.py) to
frozen dataclasses: nothing here does I/O or talks to other ranks, so every
planning rule is testable with hand-made descriptors (e.g. 64 "ranks" in one
process). Rank 0 runs all of it, in the numbering of save()'s protocol
(tsckpt/_save/protocol.py):

2. :func:`plan_aliases`: the tied leaves, stored once under another path (the
   descriptors are then gathered without them).
4. :func:`plan_save`, in three steps of its own:

   a. check (:func:`_check`) what every leaf's holders give: a value must be
      the same on every rank; an array's holders must agree on its kind, dtype
      and shape, its distinct regions must tile it exactly and replicas of a
      region must have equal checksums (the checks: tsckpt/_save/regions.py);
   b. assign writers (:func:`_assign_writers`): each replicated region to one
      of its holders, balancing bytes;
   c. lay out (:func:`_lay_out`): chunking, writes and transfers, once per
      distinct layout, with the arrays stored and written alike in one
      :class:`ArrayGroup`. A region its writer holds in separate pieces
      (:attr:`LeafDesc.cuts`: a jax.Array's device shards) is laid out as
      those pieces, each a region of its own: no shard file spans two, so
      every file is written from one piece's memory, never assembled (a
      region of one inner chunk or less stays whole: :func:`pieces`). A
      rank that holds only some pieces of its region (:attr:`LeafDesc.held`:
      a process whose jax shards are not one box) gives each piece as a
      region of its own (:func:`_held_pieces`), written by one of its holders.

   Then :func:`split_plan`: each rank's part, the only part sent to it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .._base.types import Box, LeafDesc
from .._errors import LayoutError
from .._ondisk.chunking import cells, choose_chunking, intersect, pieces, shard_boxes, shard_count
from .._ondisk.records import ArrayRecord, Chunking
from .descs import Gathered, Holders, gather_descs, pack_descs
from .regions import agreed_value, check_agreement, check_exact_cover, replica_groups

# One write of an ArrayGroup, made to each of its arrays: (rank, offsets, lengths,
# source_offsets, assembled), the fields of WriteItem less the path. Plain tuples:
# rank 0 pickles a plan part with thousands of them for every rank.
GroupWrite = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]


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
class ArrayGroup:
    """Arrays stored and written alike: each of ``paths`` has this shape, dtype, kind
    and chunking, and gets the same ``writes`` (ordered by rank and offsets). A plan
    holds one per such set of arrays (e.g. every layer's weight of one shape, sharded
    the same way), not one row per write."""

    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    kind: str
    chunking: Chunking
    writes: tuple[GroupWrite, ...]

    def records(self) -> list[ArrayRecord]:
        return [ArrayRecord(p, self.shape, self.dtype, self.kind, self.chunking) for p in self.paths]


def _writes_of(groups: Sequence[ArrayGroup], rank: int) -> list[WriteItem]:
    """Rank ``rank``'s writes in ``groups``, ordered by path and offsets."""
    out: list[WriteItem] = []
    for grp in groups:
        mine = [w[1:] for w in grp.writes if w[0] == rank]
        if mine:
            out += [WriteItem(rank, p, *w) for p in grp.paths for w in mine]
    out.sort(key=lambda w: w.path)  # stable: a path's writes stay ordered by offsets
    return out


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """The whole plan, as the coordinator computes it."""

    arrays: tuple[ArrayRecord, ...]  # ordered by path
    values: tuple[tuple[str, Any], ...]  # (path, value JSON)
    groups: tuple[ArrayGroup, ...]  # every array in exactly one
    transfers: tuple[Transfer, ...] = ()
    world: int = 1

    @property
    def writes(self) -> tuple[WriteItem, ...]:
        """Every rank's writes, by rank, each rank's ordered by path and offsets."""
        return tuple(w for r in range(self.world) for w in _writes_of(self.groups, r))


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """What one rank needs of a SavePlan: the groups of the arrays it writes, with its
    writes only (rank 0: every group, it writes every array's node), and the transfers
    it sends or receives, with their tags. Nothing of other ranks' regions, so its size
    does not grow with the number of ranks."""

    rank: int
    groups: tuple[ArrayGroup, ...]
    transfers: tuple[tuple[int, Transfer], ...] = ()  # (tag, transfer)
    exchange: bool = False  # some rank sends or receives: every rank joins the exchange round

    @property
    def arrays(self) -> tuple[ArrayRecord, ...]:
        """Records of the arrays in this part, ordered by path."""
        return tuple(sorted((r for grp in self.groups for r in grp.records()), key=lambda r: r.path))

    @property
    def writes(self) -> tuple[WriteItem, ...]:
        return tuple(_writes_of(self.groups, self.rank))

    @property
    def writes_anything(self) -> bool:
        return any(w[0] == self.rank for grp in self.groups for w in grp.writes)


# ---- plan_save's steps and what they pass on ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Given:
    """The regions of arrays given alike (one :attr:`Holders.given`), checked once."""

    replicated: bool  # some region has several holders (whose replicas are checked per array)
    live: tuple[int, ...] = ()  # not replicated: the indexes of the holders of non-empty regions


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per sharding
class _Owned:
    """The non-empty regions of arrays given alike by the same ranks, every region held
    by one rank, which writes it."""

    regions: tuple[tuple[Box, int], ...]  # (region, its holder); a region held in pieces: each piece
    itemsize: int


@dataclasses.dataclass(frozen=True)
class _Replicas:
    """The regions of an array some of whose regions several ranks hold (each gets one writer)."""

    holders: Mapping[Box, list[int]]  # region -> the ranks holding it, ascending
    cuts: Mapping[int, tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)  # rank -> its cuts


@dataclasses.dataclass(frozen=True)
class _Array:
    """An array leaf, checked: what every holder agrees it is, and its regions."""

    path: str
    desc: LeafDesc  # its first holder's; kind, dtype, itemsize and global shape are every holder's
    regions: _Owned | _Replicas


@dataclasses.dataclass(frozen=True)
class _Checked:
    """Step a's result: every leaf, checked, ordered by path."""

    values: tuple[tuple[str, Any], ...]  # (path, value JSON)
    arrays: tuple[_Array, ...]


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per layout
class _Layout:
    """How arrays of one shape and itemsize, with the same regions and writers, are
    stored (``chunking``) and written (``writes``, ordered by rank and offsets); ``moves``
    are the pieces of straddling shards sent to their writers: (src, dst, region)."""

    shape: tuple[int, ...]
    chunking: Chunking
    writes: tuple[GroupWrite, ...]
    moves: tuple[tuple[int, int, Box], ...] = ()


def plan_save(
    per_rank: Sequence[Sequence[LeafDesc]] | Gathered, *, shard_bytes: int | None = None, inner: bool = True
) -> SavePlan:
    """Validate what all ranks hold and decide who writes what.

    Identical regions given by several ranks are replicas: each is written by one
    of them, the one with the fewest bytes assigned so far (largest regions are
    placed first, after the regions only one rank holds). Distinct regions must
    exactly tile the global array. Every shard (file) has exactly one writer
    (see :func:`_plan_array`). ``shard_bytes`` caps the size of a shard
    (default: ``_chunking.SHARD_BYTES``); ``inner=False`` stores each shard as one
    chunk (:func:`tsckpt._ondisk.chunking.choose_chunking`).

    Arrays sharded the same way (same shape, itemsize and regions) are validated
    and laid out once; beyond that the work is a few passes over the descriptors.
    """
    g = per_rank if isinstance(per_rank, Gathered) else gather_descs(per_rank)
    checked = _check(g)
    return _lay_out(checked, _assign_writers(checked.arrays), g.world, shard_bytes, inner)


def _check(g: Gathered) -> _Checked:
    """Step a: every leaf as its holders give it, checked (LayoutError otherwise)."""
    values: list[tuple[str, Any]] = []
    arrays: list[_Array] = []
    given: dict[int, _Given] = {}  # by Holders.given
    owned: dict[tuple[int, tuple[int, ...]], _Owned] = {}  # by (Holders.given, Holders.ranks)
    covered: set[int] = set()  # Holders.given of the replicated arrays whose cover was checked
    in_pieces: set[int] = set()  # Holders.given of the arrays planned piece by piece
    for path in sorted(g.by_path):
        h = g.by_path[path]
        first = h.first
        if first.kind == "value":
            values.append((path, _check_value(path, h)))
            continue
        if h.given in in_pieces or any(h.held()):
            arrays.append(_Array(path, first, _held_pieces(path, h)))
            continue
        try:
            arrays.append(_Array(path, first, _regions(path, h, given, owned, covered)))
        except LayoutError:
            if not any(h.cuts()):
                raise
            # regions held in pieces that overlap other ranks' regions without equalling them (a
            # process holding two shards, another one of them): their pieces may still tile it
            arrays.append(_Array(path, first, _held_pieces(path, h)))
            in_pieces.add(h.given)
    return _Checked(tuple(values), tuple(arrays))


def _regions(
    path: str, h: Holders, given: dict[int, _Given], owned: dict[tuple[int, tuple[int, ...]], _Owned], covered: set[int]
) -> _Owned | _Replicas:
    """The regions of an array whose holders each give one region, checked once for every
    array given alike (``given``, ``owned`` and ``covered`` remember what was)."""
    first = h.first
    regions = given.get(h.given)
    if regions is None:
        regions = given[h.given] = _check_given(path, h)
    if not regions.replicated:
        mine = owned.get((h.given, h.ranks))
        if mine is None:
            boxes, held_cuts = h.boxes(), h.cuts()
            held = tuple(
                (piece, h.ranks[i]) for i in regions.live for piece in pieces(boxes[i], held_cuts[i], first.itemsize)
            )
            mine = owned[(h.given, h.ranks)] = _Owned(held, first.itemsize)
        return mine
    replicas = replica_groups(path, h.ranks, h.boxes(), h.checksums())
    if h.given not in covered:  # the same regions: the same cover
        check_exact_cover(path, first.global_shape, list(replicas))
        covered.add(h.given)
    return _Replicas(replicas, {r: c for r, c in zip(h.ranks, h.cuts()) if c})


def _held_pieces(path: str, h: Holders) -> _Replicas:
    """The regions of an array some holder gives as separate pieces (:attr:`LeafDesc.held`,
    or the cells of its :attr:`LeafDesc.cuts`): every piece a region of its own, held by the
    ranks that hold it. Holders of the same pieces are replicas, compared by checksum (ranks
    sharing only some pieces are not compared); the distinct pieces must tile the array."""
    if not h.same_leaf():
        check_agreement(path, h.ranks, h.descs())
    boxes, sums = h.boxes(), h.checksums()
    alike: dict[tuple[Box, ...], list[int]] = defaultdict(list)  # the same pieces -> their holders' indexes
    for i, (held, cuts) in enumerate(zip(h.held(), h.cuts())):
        alike[held or tuple(cells(boxes[i], cuts))].append(i)
    holders: dict[Box, list[int]] = defaultdict(list)
    for pieces_held, members in alike.items():
        ranks = [h.ranks[i] for i in members]
        replica_groups(path, ranks, [boxes[members[0]]] * len(members), [sums[i] for i in members])
        for piece in pieces_held:
            holders[piece] += ranks
    check_exact_cover(path, h.first.global_shape, list(holders))
    return _Replicas({box: sorted(ranks) for box, ranks in holders.items()})


def _check_value(path: str, h: Holders) -> Any:
    """The value every holder of ``path`` gives (a plain value is never per-rank)."""
    if not h.same_leaf():
        check_agreement(path, h.ranks, h.descs())
    return agreed_value(path, h.ranks, h.values())


def _check_given(path: str, h: Holders) -> _Given:
    """Check what the holders of an array give (once for every array given alike)."""
    if not h.same_leaf():
        check_agreement(path, h.ranks, h.descs())
    boxes = h.boxes()
    if len(set(boxes)) < len(boxes):
        return _Given(replicated=True)
    check_exact_cover(path, h.first.global_shape, boxes)
    return _Given(replicated=False, live=tuple(i for i, (_, ln) in enumerate(boxes) if math.prod(ln) > 0))


def _assign_writers(arrays: Sequence[_Array]) -> dict[tuple[str, Box], int]:
    """Step b: one writer per replicated region ((path, region) -> rank): among its
    holders, the rank with the fewest bytes so far, counting first the regions only
    one rank holds, then placing the largest replicated regions first."""
    regions = [
        (math.prod(box[1]) * a.desc.itemsize, a.path, box, ranks)
        for a in arrays
        if isinstance(a.regions, _Replicas)
        for box, ranks in a.regions.holders.items()
    ]
    if not regions:
        return {}
    load: dict[int, int] = defaultdict(int)
    for owned, n in Counter(a.regions for a in arrays if isinstance(a.regions, _Owned)).items():
        for box, rank in owned.regions:
            load[rank] += n * math.prod(box[1]) * owned.itemsize
    writer: dict[tuple[str, Box], int] = {}
    for nbytes, path, box, ranks in sorted(regions, key=lambda x: (-x[0], x[1], x[2])):
        rank = min(ranks, key=lambda m: (load[m], m))
        writer[(path, box)] = rank
        load[rank] += nbytes
    return writer


def _lay_out(
    checked: _Checked, writers: Mapping[tuple[str, Box], int], world: int, shard_bytes: int | None, inner: bool = True
) -> SavePlan:
    """Step c: every array's chunking, writes and transfers (planned once per distinct
    layout), and the arrays stored and written alike gathered into groups."""
    layouts: dict[Any, _Layout] = {}  # by _Owned, or by (shape, itemsize, regions with their writers)
    members: dict[tuple[_Layout, str, str], list[str]] = defaultdict(list)  # (layout, dtype, kind) -> paths
    records: list[ArrayRecord] = []
    transfers: list[Transfer] = []
    for a in checked.arrays:
        d = a.desc
        key: Any
        if isinstance(a.regions, _Owned):
            key, written = a.regions, a.regions.regions
        else:
            written = _written(a.path, a.regions, writers, d.itemsize)
            key = (d.global_shape, d.itemsize, written)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _plan_array(d.global_shape, d.itemsize, written, shard_bytes, inner)
        records.append(ArrayRecord(a.path, d.global_shape, d.dtype, d.kind, layout.chunking))
        members[(layout, d.dtype, d.kind)].append(a.path)
        transfers += [Transfer(a.path, src, dst, *box) for src, dst, box in layout.moves]
    groups = tuple(
        ArrayGroup(tuple(paths), layout.shape, dtype, kind, layout.chunking, layout.writes)
        for (layout, dtype, kind), paths in members.items()
    )
    return SavePlan(tuple(records), checked.values, groups, tuple(transfers), world)


def _written(
    path: str, regions: _Replicas, writers: Mapping[tuple[str, Box], int], itemsize: int
) -> tuple[tuple[Box, int], ...]:
    """The non-empty regions of a replicated array with their writers, each region cut into
    the pieces its writer holds."""
    out = []
    for box in regions.holders:
        if math.prod(box[1]) > 0:
            rank = writers[(path, box)]
            out += [(piece, rank) for piece in pieces(box, regions.cuts.get(rank, ()), itemsize)]
    return tuple(out)


def _plan_array(
    shape: tuple[int, ...], itemsize: int, owned: tuple[tuple[Box, int], ...], shard_bytes: int | None = None,
    inner: bool = True,
) -> _Layout:
    """The layout of one array whose non-empty regions ``owned`` are written by the given ranks
    (a rank may own several: the pieces it holds a region in).

    Shards follow the region starts when that keeps them reasonably large. An
    irregular split (e.g. rows 3,3,2,2, or 12565,12564,... from array_split)
    would need shards as thin as the gcd of the starts; instead shards are cut
    no longer than the shortest region, each is written by the rank owning most
    of it, and the thin pieces of straddling shards are sent to that rank.
    """
    cuts = [sorted({box[0][d] for box, _ in owned}) for d in range(len(shape))]
    aligned = choose_chunking(shape, itemsize, cuts, shard_bytes=shard_bytes, inner_chunks=inner)
    # shards no longer than the shortest region, so most lie inside one region
    shortest = [[min(box[1][d] for box, _ in owned)] if len(cuts[d]) > 1 else [] for d in range(len(shape))]
    natural = choose_chunking(shape, itemsize, shortest, shard_bytes=shard_bytes, inner_chunks=inner)
    if shard_count(shape, aligned) <= 2 * shard_count(shape, natural):
        writes = [(rank, box[0], box[1], (0,) * len(shape), False) for box, rank in owned]
        return _Layout(shape, aligned, tuple(sorted(writes, key=lambda w: (w[0], w[1]))))
    writes, moves = [], []
    for cell in shard_boxes((0,) * len(shape), shape, natural):
        parts = [(part, rank) for box, rank in owned if (part := intersect(cell, box)) is not None]
        dst = max(parts, key=lambda p: (math.prod(p[0][1]), -p[1]))[1]
        writes.append((dst, cell[0], cell[1], (), True))
        moves += [(rank, dst, part) for part, rank in parts if rank != dst]
    return _Layout(shape, natural, tuple(sorted(writes, key=lambda w: (w[0], w[1]))), tuple(moves))


def plan_aliases(per_rank: Sequence[Sequence[LeafDesc]], links: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Leaves written once: ``{alias path: stored path}``.

    ``links[r]`` maps a path to the smallest path whose local data rank ``r``
    found to be the very same memory (storage pointer, offset, shape, strides,
    dtype); empty regions prove nothing and are never linked. A path is an alias
    of ``s`` when some rank links it to ``s`` and every rank holding it agrees:
    it links it to ``s`` too, or its region is empty and it holds ``s`` with the
    identical region. One rank holding the two as different memory keeps both.
    """
    candidates = {a for rank_links in links for a in rank_links}
    if not candidates:
        return {}
    wanted = candidates | {s for rank_links in links for s in rank_links.values()}
    held = [pack_descs(descs).select(wanted) for descs in per_rank]
    out: dict[str, str] = {}
    for alias in sorted(candidates):
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


def split_plan(plan: SavePlan) -> list[RankPlan]:
    """Every rank's part of ``plan``, in one pass over it."""
    moves: list[list[tuple[int, Transfer]]] = [[] for _ in range(plan.world)]
    for i, t in enumerate(plan.transfers):
        moves[t.src].append((i, t))
        if t.dst != t.src:
            moves[t.dst].append((i, t))
    parts: list[list[ArrayGroup]] = [[] for _ in range(plan.world)]
    for grp in plan.groups:
        by_rank: dict[int, list[GroupWrite]] = defaultdict(list)
        for w in grp.writes:
            by_rank[w[0]].append(w)
        for rank, writes in by_rank.items():
            if rank:
                parts[rank].append(dataclasses.replace(grp, writes=tuple(writes)))
        if parts:  # rank 0 writes every array's node: it gets every group
            parts[0].append(dataclasses.replace(grp, writes=tuple(by_rank.get(0, ()))))
    exchange = bool(plan.transfers)
    return [RankPlan(r, tuple(groups), tuple(moves[r]), exchange) for r, groups in enumerate(parts)]
