"""Save and read plans: pure functions from small descriptors to frozen dataclasses.

Nothing here does I/O or talks to other ranks, so every planning rule is
testable with hand-made descriptors (e.g. 64 "ranks" in one process).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, overload

import numpy as np

from ._errors import LayoutError
from ._format import ArrayRecord, Chunking
from ._chunking import choose_chunking

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


class LeafDesc(NamedTuple):
    """What one rank holds for one path: a region of a global array, or a value.

    A tuple: ranks send their descriptors as plain tuples, and the planner reads
    them by position, so the coordinator plans 1,000 leaves x 1,024 ranks
    without building (or unpickling) a million objects.
    """

    path: str
    kind: str  # "torch" | "numpy" | "numpy_scalar" | "value"
    dtype: str = ""
    itemsize: int = 0
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    checksum: int | None = None  # of the local region, compared across replicas
    value: Any = None  # JSON of a plain value


# positions of LeafDesc's fields, for descriptors that arrive as plain tuples
_PATH: Final = 0
_KIND: Final = 1
_DTYPE: Final = 2
_ITEMSIZE: Final = 3
_SHAPE: Final = 4
_OFFSETS: Final = 5
_LENGTHS: Final = 6
_CHECKSUM: Final = 7
_VALUE: Final = 8

# One write of one rank: (path, offsets, lengths, source_offsets, assembled), the
# fields of WriteItem after its rank; plain tuples, as LeafDesc.
WriteRow = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]
# A write without its path, for every array of an ArrayGroup: (rank, offsets, lengths,
# source_offsets, assembled).
GroupWrite = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]


@dataclasses.dataclass(frozen=True, eq=False)
class Descs(Sequence[tuple[Any, ...]]):
    """One rank's descriptors, field by field: what a rank sends rank 0.

    A few tuples and small integer arrays instead of one tuple per leaf, so that the
    coordinator unpickles 1,024 ranks' payloads without building a million
    objects, and compares whole ranks at once. Reads as a sequence of
    descriptors (plain tuples in LeafDesc order) for the general planning path.
    """

    # tuples of strings and ints: the garbage collector stops tracking them
    paths: tuple[str, ...]
    kinds: tuple[str, ...]
    dtypes: tuple[str, ...]
    itemsizes: np.ndarray  # one per leaf
    ndims: np.ndarray  # (3, leaves): lengths of global_shape, offsets, lengths
    dims: tuple[np.ndarray, np.ndarray, np.ndarray]  # every leaf's global_shape, offsets, lengths, concatenated
    checksums: tuple[int | None, ...]
    values: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, i: int) -> tuple[Any, ...]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[Any, ...]]: ...

    def __getitem__(self, i: int | slice) -> tuple[Any, ...] | Sequence[tuple[Any, ...]]:
        return self.rows()[i]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows())

    def rows(self) -> list[tuple[Any, ...]]:
        """Every descriptor as a plain tuple in LeafDesc order."""
        cols = [d.tolist() for d in self.dims]
        ends = np.cumsum(self.ndims, axis=1).tolist()
        starts = [[0, *e[:-1]] for e in ends]
        fields = zip(self.paths, self.kinds, self.dtypes, self.itemsizes.tolist(), self.checksums, self.values)
        return [
            (p, k, dt, n, *(tuple(c[s[i]:e[i]]) for c, s, e in zip(cols, starts, ends)), sum_, v)
            for i, (p, k, dt, n, sum_, v) in enumerate(fields)
        ]


def pack_descs(descs: Sequence[Sequence[Any]]) -> Descs:
    """A rank's descriptors (LeafDescs or plain tuples in their order) as one Descs."""
    rows = [tuple(d) if len(d) == len(LeafDesc._fields) else tuple(LeafDesc(*d)) for d in descs]
    fields = list(zip(*rows)) if rows else [()] * len(LeafDesc._fields)
    boxes = fields[_SHAPE], fields[_OFFSETS], fields[_LENGTHS]
    return Descs(
        fields[_PATH],
        fields[_KIND],
        fields[_DTYPE],
        _ints(fields[_ITEMSIZE]),
        _ints([list(map(len, col)) for col in boxes]).reshape(3, len(rows)),
        tuple(_ints([x for t in col for x in t]) for col in boxes),  # type: ignore[arg-type]
        fields[_CHECKSUM],
        fields[_VALUE],
    )


def _ints(values: Sequence[Any]) -> np.ndarray:
    """``values`` in the smallest signed integer dtype that holds them (a smaller payload)."""
    a = np.array(values, dtype=np.int64)
    for t in (np.int8, np.int16, np.int32):
        if not a.size or (np.iinfo(t).min <= a.min() and a.max() <= np.iinfo(t).max):
            return a.astype(t)
    return a


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
    and chunking, and gets the same ``writes`` (rank, offsets, lengths, source_offsets,
    assembled; ordered by rank and offsets). A plan holds one per such set of arrays
    (e.g. every layer's weight of one shape, sharded the same way), not one row per write."""

    paths: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    kind: str
    chunking: Chunking
    writes: tuple[GroupWrite, ...]

    def records(self) -> list[ArrayRecord]:
        return [ArrayRecord(p, self.shape, self.dtype, self.kind, self.chunking) for p in self.paths]


def _rows(groups: Sequence[ArrayGroup], rank: int) -> list[WriteRow]:
    """Rank ``rank``'s writes in ``groups``, ordered by path and offsets."""
    rows: list[WriteRow] = []
    for grp in groups:
        mine = [w[1:] for w in grp.writes if w[0] == rank]
        if mine:
            rows += [(p, *w) for p in grp.paths for w in mine]  # type: ignore[misc]
    rows.sort(key=_path_of)  # stable: a path's writes stay ordered by offsets
    return rows


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """The whole plan, as the coordinator computes it."""

    arrays: tuple[ArrayRecord, ...]  # ordered by path
    values: tuple[tuple[str, Any], ...]  # (path, value JSON)
    groups: tuple[ArrayGroup, ...]  # every array in exactly one
    transfers: tuple[Transfer, ...] = ()
    world: int = 1

    @property
    def rows(self) -> tuple[tuple[WriteRow, ...], ...]:
        """``rows[r]``: rank r's writes, ordered by path and offsets."""
        return tuple(tuple(_rows(self.groups, r)) for r in range(self.world))

    @property
    def writes(self) -> tuple[WriteItem, ...]:
        return tuple(WriteItem(r, *row) for r, rows in enumerate(self.rows) for row in rows)

    def writes_for(self, rank: int) -> list[WriteItem]:
        return [WriteItem(rank, *row) for row in _rows(self.groups, rank)] if 0 <= rank < self.world else []


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
        return tuple(WriteItem(self.rank, *row) for row in _rows(self.groups, self.rank))

    @property
    def writes_anything(self) -> bool:
        return any(w[0] == self.rank for grp in self.groups for w in grp.writes)


@dataclasses.dataclass(frozen=True)
class ReadItem:
    """Read the global box (``storage_offsets``, ``lengths``) of ``path`` into the whole
    local destination."""

    path: str
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


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


# (ranks, their descriptors, in rank order; and a number for what they give: the kind,
# dtype, itemsize, shape and region of each, equal for arrays sharded the same way)
Holders = tuple[tuple[int, ...], Sequence[Any], int]  # descriptors: LeafDescs or plain tuples
Pairs = list[tuple[int, LeafDesc]]

_path_of = operator.itemgetter(_PATH)
_sig_of = operator.itemgetter(_KIND, _DTYPE, _SHAPE)
_box_of = operator.itemgetter(_OFFSETS, _LENGTHS)
_given_of = operator.itemgetter(_KIND, _DTYPE, _ITEMSIZE, _SHAPE, _OFFSETS, _LENGTHS)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Every rank's descriptors grouped by path: the coordinator's view."""

    world: int
    by_path: dict[str, Holders]


def gather_descs(per_rank: Sequence[Sequence[LeafDesc]] | Sequence[Descs]) -> Gathered:
    """Group every rank's descriptors by path (plain tuples in LeafDesc order, or Descs)."""
    world = len(per_rank)
    if world and all(isinstance(d, Descs) for d in per_rank):
        fast = _gather_alike(per_rank)  # type: ignore[arg-type]
        if fast is not None:
            return fast
        per_rank = [d.rows() for d in per_rank]  # type: ignore[union-attr,assignment]
    ids: dict[tuple[Any, ...], int] = {}
    paths = list(map(_path_of, per_rank[0])) if per_rank else []
    if world > 1 and len(set(paths)) == len(paths) and all(list(map(_path_of, d)) == paths for d in per_rank[1:]):
        # every rank gives the same paths in the same order (data or fully sharded
        # parallel): transpose instead of grouping one descriptor at a time
        everyone = tuple(range(world))
        return Gathered(world, {p: _holders(everyone, col, ids) for p, col in zip(paths, zip(*per_rank))})
    ranks: dict[str, list[int]] = defaultdict(list)
    descs: dict[str, list[Any]] = defaultdict(list)
    for rank, leaves in enumerate(per_rank):
        for leaf in leaves:
            ranks[leaf[_PATH]].append(rank)
            descs[leaf[_PATH]].append(leaf)
    return Gathered(world, {p: _holders(tuple(ranks[p]), tuple(descs[p]), ids) for p in ranks})


def _holders(ranks: tuple[int, ...], descs: tuple[Any, ...], ids: dict[tuple[Any, ...], int]) -> Holders:
    return ranks, descs, ids.setdefault(tuple(map(_given_of, descs)), len(ids))


def _gather_alike(tables: Sequence[Descs]) -> Gathered | None:
    """The common case at scale, a column at a time: every rank gives the same paths in
    the same order, each with the same kind, dtype, itemsize and global shape on every
    rank. Only regions, checksums and values differ. None otherwise (the general path
    then groups descriptor by descriptor, and reports any disagreement)."""
    first = tables[0]
    paths = first.paths
    if len(set(paths)) != len(paths):
        return None
    for t in tables[1:]:
        if t.paths != paths or t.kinds != first.kinds or t.dtypes != first.dtypes:
            return None
        if not (np.array_equal(t.itemsizes, first.itemsizes) and np.array_equal(t.ndims, first.ndims)):
            return None
        if not np.array_equal(t.dims[0], first.dims[0]):
            return None
    if not (np.array_equal(first.ndims[0], first.ndims[1]) and np.array_equal(first.ndims[0], first.ndims[2])):
        return None  # a region of another rank than its global shape: the general path explains
    # one row per dimension of every leaf, one column per rank
    offsets = np.stack([t.dims[1] for t in tables], axis=1)
    lengths = np.stack([t.dims[2] for t in tables], axis=1)
    world = len(tables)
    everyone = tuple(range(world))
    ids: dict[tuple[Any, ...], int] = {}
    by_path: dict[str, Holders] = {}
    rank0 = first.rows()
    s = 0
    for i, e in enumerate(np.cumsum(first.ndims[0]).tolist()):
        d = rank0[i]
        # what every holder gives (_given_of over the column), with the regions as bytes
        given = (d[_KIND], d[_DTYPE], d[_ITEMSIZE], d[_SHAPE], offsets[s:e].tobytes(), lengths[s:e].tobytes())
        column = _Column(tables, i, d, offsets[s:e], lengths[s:e])
        by_path[d[_PATH]] = (everyone, column, ids.setdefault(given, len(ids)))
        s = e
    return Gathered(world, by_path)


class _Column(Sequence[tuple[Any, ...]]):
    """Leaf ``i``'s descriptors on every rank, built from the ranks' tables when first
    read past rank 0's: the planner reads them whole once per distinct sharding."""

    def __init__(self, tables: Sequence[Descs], i: int, first: tuple[Any, ...], offsets: np.ndarray, lengths: np.ndarray):
        self._tables, self._i, self._first = tables, i, first
        self._offsets, self._lengths = offsets, lengths
        self._rows: list[tuple[Any, ...]] | None = None

    def __len__(self) -> int:
        return len(self._tables)

    @overload
    def __getitem__(self, k: int) -> tuple[Any, ...]: ...

    @overload
    def __getitem__(self, k: slice) -> Sequence[tuple[Any, ...]]: ...

    def __getitem__(self, k: int | slice) -> tuple[Any, ...] | Sequence[tuple[Any, ...]]:
        if k == 0:
            return self._first
        return self.rows()[k]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self.rows())

    def rows(self) -> list[tuple[Any, ...]]:
        if self._rows is None:
            i, head = self._i, self._first[:_OFFSETS]
            offs, lens = self._offsets.T.tolist(), self._lengths.T.tolist()
            self._rows = [
                (*head, tuple(o), tuple(n), t.checksums[i], t.values[i]) for t, o, n in zip(self._tables, offs, lens)
            ]
        return self._rows


def without(g: Gathered, paths: Collection[str]) -> Gathered:
    """``g`` without the leaves at ``paths`` (e.g. aliases, stored once under another path)."""
    return Gathered(g.world, {p: h for p, h in g.by_path.items() if p not in paths}) if paths else g


def shared_regions(g: Gathered) -> list[list[str]]:
    """Per rank, the paths whose region some other rank holds too: the replicas to
    checksum. All empty when every region has one holder (fully sharded or
    pipeline-disjoint state), the fast path that checksums nothing."""
    out: list[list[str]] = [[] for _ in range(g.world)]
    shared: dict[int, list[int]] = {}  # what holders give -> indexes of shared regions
    for path, (ranks, descs, given) in g.by_path.items():
        if len(ranks) < 2 or descs[0][_KIND] == "value":
            continue
        if given not in shared:
            count = Counter(map(_box_of, descs))
            shared[given] = [i for i, d in enumerate(descs) if count[_box_of(d)] > 1]
        for i in shared[given]:
            out[ranks[i]].append(path)
    return out


def with_checksums(g: Gathered, sums: Sequence[Mapping[str, int]]) -> Gathered:
    """``g`` with the checksums ranks computed (``sums[r]``: path -> checksum of rank r's region)."""
    by_path = dict(g.by_path)
    for p in {p for rank_sums in sums for p in rank_sums}:
        ranks, descs, given = by_path[p]
        descs = tuple(
            (*d[:_CHECKSUM], sums[r][p], *d[_CHECKSUM + 1 :]) if p in sums[r] else d for r, d in zip(ranks, descs)
        )
        by_path[p] = (ranks, descs, given)
    return Gathered(g.world, by_path)


def plan_save(per_rank: Sequence[Sequence[LeafDesc]] | Gathered, *, shard_bytes: int | None = None) -> SavePlan:
    """Validate what all ranks hold and decide who writes what.

    Identical regions given by several ranks are replicas: each is written by one
    of them, the one with the fewest bytes assigned so far (largest regions are
    placed first, after the regions only one rank holds). Distinct regions must
    exactly tile the global array. Every shard (file) has exactly one writer
    (see :func:`_plan_array`). ``shard_bytes`` caps the size of a shard
    (default: ``_chunking.SHARD_BYTES``).

    Arrays sharded the same way (same shape, itemsize and regions) are validated
    and laid out once; beyond that the work is a few passes over the descriptors.
    """
    g = per_rank if isinstance(per_rank, Gathered) else gather_descs(per_rank)
    values: list[tuple[str, Any]] = []
    # (path, first holder, key of its chunking (None: replicated), owned regions or replica groups)
    entries: list[tuple[str, LeafDesc, Any, Any]] = []
    # what every holder gives (kind, dtype, itemsize, shape, region), already checked -> the
    # indexes of its non-empty regions (None: all), or None itself when a region has several
    # holders (then their boxes, checked)
    seen: dict[int, tuple[list[int] | None] | None] = {}
    covered: set[int] = set()  # what holders give, for replicated regions whose cover was checked
    single: Counter[tuple[Any, ...]] = Counter()  # chunking key of each single-holder array -> arrays
    owners: dict[tuple[Any, ...], tuple[tuple[Box, int], ...]] = {}  # chunking key -> (region, writer)
    for path in sorted(g.by_path):
        ranks, descs, given = g.by_path[path]
        first = descs[0]
        if first[_KIND] == "value":
            if len(set(map(_sig_of, descs))) > 1:
                _check_agreement(path, list(zip(ranks, descs)))
            values.append((path, _agreed_value(path, list(zip(ranks, descs)))))
            continue
        if given not in seen:
            if len(set(map(_sig_of, descs))) > 1:
                _check_agreement(path, list(zip(ranks, descs)))
            boxes = list(map(_box_of, descs))
            known = None
            if len(set(boxes)) == len(boxes):
                _check_exact_cover(path, first[_SHAPE], boxes)
                empty = {i for i, box in enumerate(boxes) if math.prod(box[1]) == 0}
                known = ([i for i in range(len(boxes)) if i not in empty] if empty else None,)
            seen[given] = known
        known = seen[given]
        if known is not None:
            key = (given, ranks)
            if key not in owners:
                boxes = list(map(_box_of, descs))
                keep = range(len(boxes)) if known[0] is None else known[0]
                owners[key] = tuple((boxes[i], ranks[i]) for i in keep)
            single[key] += 1
            entries.append((path, first, key, owners[key]))
        else:
            replicas = _replica_groups(path, list(zip(ranks, descs)))
            if given not in covered:  # the same regions: the same cover
                _check_exact_cover(path, first[_SHAPE], list(replicas))
                covered.add(given)
            entries.append((path, first, None, replicas))

    itemsize = {key: first[_ITEMSIZE] for _, first, key, _ in entries if key is not None}
    writer = _assign_writers(entries, {owners[key]: (itemsize[key], n) for key, n in single.items()})
    arrays: list[ArrayRecord] = []
    transfers: list[Transfer] = []
    laid_out: dict[Any, tuple[Chunking, tuple[GroupWrite, ...], list[tuple[int, int, Box]]]] = {}
    # (chunking key, shape, dtype, kind) -> paths
    members: dict[tuple[Any, tuple[int, ...], str, str], list[str]] = defaultdict(list)
    for path, first, key, owned in entries:
        if key is None:
            owned = tuple((box, writer[(path, box)]) for box in owned if math.prod(box[1]) > 0)
            key = (first[_SHAPE], first[_ITEMSIZE], owned)  # type: ignore[assignment]
        if key not in laid_out:
            chunking, items, moves = _plan_array(first[_SHAPE], first[_ITEMSIZE], owned, shard_bytes)
            laid_out[key] = (chunking, tuple((rank, *rest) for rank, rest in items), moves)  # type: ignore[misc]
        chunking, _, moves = laid_out[key]
        arrays.append(ArrayRecord(path, first[_SHAPE], first[_DTYPE], first[_KIND], chunking))
        members[(key, first[_SHAPE], first[_DTYPE], first[_KIND])].append(path)
        transfers += [Transfer(path, src, dst, box[0], box[1]) for src, dst, box in moves]
    groups = tuple(
        ArrayGroup(tuple(paths), shape, dtype, kind, laid_out[key][0], laid_out[key][1])
        for (key, shape, dtype, kind), paths in members.items()
    )
    return SavePlan(tuple(arrays), tuple(values), groups, tuple(transfers), g.world)


def _check_agreement(path: str, holders: Pairs) -> None:
    """Every rank giving ``path`` gives the same kind of leaf, global shape and dtype."""
    first = holders[0][1]
    kinds = {d[_KIND] for _, d in holders}
    if len(kinds) > 1 or (first[_KIND] != "value" and len({(d[_DTYPE], d[_SHAPE]) for _, d in holders}) > 1):
        desc = "; ".join(
            f"rank {r}: {d[_KIND]} {d[_DTYPE]} {list(d[_SHAPE])}" if d[_KIND] != "value" else f"rank {r}: value"
            for r, d in holders[:8]
        )
        raise LayoutError(
            f"'{path}': ranks disagree on what this leaf is ({desc}); every rank giving a path must give "
            "the same global shape and dtype"
        )


def _agreed_value(path: str, holders: Pairs) -> Any:
    """The value every rank giving ``path`` gives (a plain value is never per-rank)."""
    first_rank, first = holders[0]
    shown = repr(first[_VALUE])
    differ = [(r, d) for r, d in holders if repr(d[_VALUE]) != shown]
    if differ:
        raise LayoutError(
            f"'{path}': ranks {first_rank} and {[r for r, _ in differ][:8]} give different values "
            f"({first[_VALUE]!r} vs {differ[0][1][_VALUE]!r}); use a rank-unique path for per-rank state"
        )
    return first[_VALUE]


def _replica_groups(path: str, holders: Pairs) -> dict[Box, list[int]]:
    """Holder ranks grouped by region; replicas of a region must agree on their checksum."""
    groups: dict[Box, list[tuple[int, LeafDesc]]] = defaultdict(list)
    for r, d in holders:
        groups[(d[_OFFSETS], d[_LENGTHS])].append((r, d))
    for box, members in groups.items():
        if len({d[_CHECKSUM] for _, d in members if d[_CHECKSUM] is not None}) > 1:
            by_sum: dict[int | None, list[int]] = defaultdict(list)
            for r, d in members:
                by_sum[d[_CHECKSUM]].append(r)
            parts = " vs ".join(f"ranks {rs}" for rs in by_sum.values())
            raise LayoutError(
                f"'{path}': replicas of region {_fmt_box(box)} differ in content ({parts}); ranks that give "
                "the same path must hold the same data. If these are different tensors (e.g. pipeline "
                "stages with stage-local names), give them distinct global names; to skip this check pass "
                "check_replicas=False"
            )
    return {box: [r for r, _ in members] for box, members in groups.items()}


def _assign_writers(
    entries: list[tuple[str, LeafDesc, Any, Any]], single: Mapping[tuple[tuple[Box, int], ...], tuple[int, int]]
) -> dict[tuple[str, Box], int]:
    """One writer per replicated region: among its holders, the rank with the fewest bytes
    so far, counting first the regions only one rank holds (``single``: their (region,
    rank) pairs -> (itemsize, number of arrays)), then placing the largest replicated
    regions first."""
    regions = [
        (math.prod(box[1]) * first[_ITEMSIZE], path, box, members)
        for path, first, key, groups in entries
        if key is None
        for box, members in groups.items()
    ]
    if not regions:
        return {}
    load: dict[int, int] = defaultdict(int)
    for owned, (itemsize, n) in single.items():
        for box, rank in owned:
            load[rank] += n * math.prod(box[1]) * itemsize
    writer: dict[tuple[str, Box], int] = {}
    for nbytes, path, box, members in sorted(regions, key=lambda x: (-x[0], x[1], x[2])):
        rank = min(members, key=lambda m: (load[m], m))
        writer[(path, box)] = rank
        load[rank] += nbytes
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
    candidates = {a for rank_links in links for a in rank_links}
    if not candidates:
        return {}
    wanted = candidates | {s for rank_links in links for s in rank_links.values()}
    held = [{d[_PATH]: d for d in descs if d[_PATH] in wanted} for descs in per_rank]
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
                    math.prod(a[_LENGTHS]) == 0
                    and s is not None
                    and (a[_KIND], a[_DTYPE], a[_SHAPE], a[_OFFSETS], a[_LENGTHS])
                    == (s[_KIND], s[_DTYPE], s[_SHAPE], s[_OFFSETS], s[_LENGTHS])
                )
            if not agreed:
                break
        if agreed:
            out[alias] = stored
    return out


def plan_for_rank(plan: SavePlan, rank: int) -> RankPlan:
    """Rank ``rank``'s part of ``plan`` (see :func:`split_plan` for every rank at once)."""
    moves = tuple((i, t) for i, t in enumerate(plan.transfers) if rank in (t.src, t.dst))
    mine = [_only(grp, rank) for grp in plan.groups]
    return RankPlan(rank, tuple(grp for grp in mine if rank == 0 or grp.writes), moves, bool(plan.transfers))


def _only(grp: ArrayGroup, rank: int) -> ArrayGroup:
    return dataclasses.replace(grp, writes=tuple(w for w in grp.writes if w[0] == rank))


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


def _n_shards(shape: Sequence[int], chunking: Chunking) -> int:
    return math.prod(-(-max(1, n) // g) for n, g in zip(shape, chunking.shard_shape))


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def _plan_array(
    shape: tuple[int, ...], itemsize: int, owned: tuple[tuple[Box, int], ...], shard_bytes: int | None = None
) -> tuple[Chunking, list[tuple[int, tuple[Any, ...]]], list[tuple[int, int, Box]]]:
    """Chunking, writes (rank, WriteRow without its path) and transfers (src, dst, box) of
    one array whose non-empty regions ``owned`` are written by the given ranks.

    Shards follow the region starts when that keeps them reasonably large. An
    irregular split (e.g. rows 3,3,2,2, or 12565,12564,... from array_split)
    would need shards as thin as the gcd of the starts; instead shards are cut
    no longer than the shortest region, each is written by the rank owning most
    of it, and the thin pieces of straddling shards are sent to that rank.
    Rows come sorted by rank and offsets.
    """
    cuts = [sorted({box[0][d] for box, _ in owned}) for d in range(len(shape))]
    aligned = choose_chunking(shape, itemsize, cuts, shard_bytes=shard_bytes)
    # shards no longer than the shortest region, so most lie inside one region
    shortest = [[min(box[1][d] for box, _ in owned)] if len(cuts[d]) > 1 else [] for d in range(len(shape))]
    natural = choose_chunking(shape, itemsize, shortest, shard_bytes=shard_bytes)
    if _n_shards(shape, aligned) <= 2 * _n_shards(shape, natural):
        items = [(rank, (box[0], box[1], (0,) * len(shape), False)) for box, rank in owned]
        items.sort(key=lambda x: (x[0], x[1][0]))
        return aligned, items, []
    items, moves = [], []
    for cell in shard_boxes((0,) * len(shape), shape, natural):
        parts = [(part, rank) for box, rank in owned if (part := _intersect(cell, box)) is not None]
        dst = max(parts, key=lambda p: (math.prod(p[0][1]), -p[1]))[1]
        items.append((dst, (cell[0], cell[1], (), True)))
        moves += [(rank, dst, part) for part, rank in parts if rank != dst]
    items.sort(key=lambda x: (x[0], x[1][0]))
    return natural, items, moves


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


def plan_read(path: str, want_offsets: Sequence[int], want_lengths: Sequence[int]) -> ReadItem:
    """Read the region a local target needs; the executor slabs it by shard."""
    return ReadItem(path, tuple(want_offsets), tuple(want_lengths))
