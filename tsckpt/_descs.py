"""Rank descriptors on their way to rank 0, and rank 0's view of them.

The part of save()'s protocol (tsckpt/_save.py) that moves descriptors, before
the planner (tsckpt/_plan.py) decides who writes what:

1. Describe (all ranks): each rank packs its leaves' descriptors field by field,
   with its tree, tied-leaf links, write window and layout, into one
   :class:`Payload` (:meth:`Payload.of`), which it sends to rank 0 only.
2. Gather (rank 0): :func:`gather_descs` groups every rank's descriptors by
   path (a column at a time when every rank gives the same leaves),
   :func:`without` drops the tied leaves (stored once, under another path) and
   :func:`shared_regions` finds the regions several ranks hold; when there are
   any, rank 0 sends each rank a :class:`ChecksumRequest` for its own.
3. Replica checksums (rank 0, only after 2's requests): :func:`with_checksums`
   adds what the ranks computed, for the planner to compare replicas.

Pure functions and frozen dataclasses: no I/O, no messages (save() sends them).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from ._types import LeafDesc


@dataclasses.dataclass(frozen=True, eq=False)
class Descs(Sequence[LeafDesc]):
    """One rank's descriptors, field by field: what a rank sends rank 0.

    A few tuples and small integer arrays instead of one tuple per leaf, so that the
    coordinator unpickles 1,024 ranks' payloads without building a million
    objects, and compares whole ranks at once. Reads as a sequence of
    :class:`LeafDesc` for the general planning path.
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
    def __getitem__(self, i: int) -> LeafDesc: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[LeafDesc]: ...

    def __getitem__(self, i: int | slice) -> LeafDesc | Sequence[LeafDesc]:
        return self.rows()[i]

    def __iter__(self) -> Iterator[LeafDesc]:
        return iter(self.rows())

    def rows(self) -> list[LeafDesc]:
        """Every descriptor, in order."""
        shapes, offsets, lengths = (
            [tuple(col[s:e]) for s, e in zip([0, *ends[:-1]], ends)]
            for col, ends in zip((d.tolist() for d in self.dims), np.cumsum(self.ndims, axis=1).tolist())
        )
        return [
            LeafDesc(*fields)
            for fields in zip(
                self.paths, self.kinds, self.dtypes, self.itemsizes.tolist(), shapes, offsets, lengths,
                self.checksums, self.values,
            )
        ]


def pack_descs(descs: Sequence[Sequence[Any]]) -> Descs:
    """A rank's descriptors (LeafDescs, or plain tuples of their fields) as one Descs."""
    rows = [d if isinstance(d, LeafDesc) else LeafDesc(*d) for d in descs]
    return Descs(
        tuple(d.path for d in rows),
        tuple(d.kind for d in rows),
        tuple(d.dtype for d in rows),
        _ints([d.itemsize for d in rows]),
        _ints([[len(d.global_shape) for d in rows], [len(d.offsets) for d in rows], [len(d.lengths) for d in rows]]),
        (
            _ints([x for d in rows for x in d.global_shape]),
            _ints([x for d in rows for x in d.offsets]),
            _ints([x for d in rows for x in d.lengths]),
        ),
        tuple(d.checksum for d in rows),
        tuple(d.value for d in rows),
    )


def _ints(values: Sequence[Any]) -> np.ndarray:
    """``values`` in the smallest signed integer dtype that holds them (a smaller payload)."""
    a = np.array(values, dtype=np.int64)
    for t in (np.int8, np.int16, np.int32):
        if not a.size or (np.iinfo(t).min <= a.min() and a.max() <= np.iinfo(t).max):
            return a.astype(t)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class Payload:
    """What a rank sends rank 0 in step 1. Few objects, so rank 0 unpickles every
    rank's payload fast; the tree as JSON text, so it compares trees as strings."""

    descs: Descs
    paths: tuple[str, ...]  # the tree's leaf paths, in tree order
    structure: str  # the tree's structure (tree.structure_to_json), as JSON text
    links: dict[str, str]  # tied leaves: path -> the smallest other path of the same memory
    window: int  # bytes of source data this rank keeps in flight while writing
    layout: str

    @classmethod
    def of(
        cls, descs: Sequence[Sequence[Any]], paths: Sequence[str], structure: Any, links: dict[str, str],
        window: int, layout: str,
    ) -> Payload:
        """The payload of a rank's descriptors (LeafDescs or plain tuples) and tree structure (JSON)."""
        return cls(pack_descs(descs), tuple(paths), json.dumps(structure, separators=(",", ":")), links, window, layout)


@dataclasses.dataclass(frozen=True)
class ChecksumRequest:
    """Rank 0 to one rank (step 2): checksum your regions of these paths (others hold them too)."""

    paths: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Holders:
    """Every rank that gives one path, with its descriptor."""

    ranks: tuple[int, ...]  # ascending
    descs: Sequence[LeafDesc]  # one per rank in ``ranks``
    # numbers what the holders give (each one's kind, dtype, itemsize, shape and region):
    # equal for arrays sharded the same way, so the planner checks and lays them out once
    given: int


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Every rank's descriptors grouped by path: the coordinator's view."""

    world: int
    by_path: dict[str, Holders]


_given_of = operator.attrgetter("kind", "dtype", "itemsize", "global_shape", "offsets", "lengths")


def box_of(d: LeafDesc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The region a descriptor gives: (offsets, lengths)."""
    return d.offsets, d.lengths


def gather_descs(per_rank: Sequence[Sequence[Sequence[Any]]]) -> Gathered:
    """Group every rank's descriptors by path (each rank's: Descs, or LeafDescs or plain
    tuples of their fields)."""
    world = len(per_rank)
    if world and all(isinstance(d, Descs) for d in per_rank):
        fast = gather_alike(per_rank)  # type: ignore[arg-type]
        if fast is not None:
            return fast
    rows = [d.rows() if isinstance(d, Descs) else [x if isinstance(x, LeafDesc) else LeafDesc(*x) for x in d]
            for d in per_rank]
    ids: dict[tuple[Any, ...], int] = {}
    paths = [d.path for d in rows[0]] if rows else []
    if world > 1 and len(set(paths)) == len(paths) and all([d.path for d in r] == paths for r in rows[1:]):
        # every rank gives the same paths in the same order (data or fully sharded
        # parallel): transpose instead of grouping one descriptor at a time
        everyone = tuple(range(world))
        return Gathered(world, {p: _holders(everyone, col, ids) for p, col in zip(paths, zip(*rows))})
    ranks: dict[str, list[int]] = defaultdict(list)
    descs: dict[str, list[LeafDesc]] = defaultdict(list)
    for rank, leaves in enumerate(rows):
        for leaf in leaves:
            ranks[leaf.path].append(rank)
            descs[leaf.path].append(leaf)
    return Gathered(world, {p: _holders(tuple(ranks[p]), tuple(descs[p]), ids) for p in ranks})


def _holders(ranks: tuple[int, ...], descs: tuple[LeafDesc, ...], ids: dict[tuple[Any, ...], int]) -> Holders:
    return Holders(ranks, descs, ids.setdefault(tuple(map(_given_of, descs)), len(ids)))


def gather_alike(tables: Sequence[Descs]) -> Gathered | None:
    """:func:`gather_descs` in the common case at scale, a column at a time: every rank
    gives the same paths in the same order, each with the same kind, dtype, itemsize and
    global shape on every rank. Only regions, checksums and values differ. None
    otherwise (the general path then groups descriptor by descriptor, and reports any
    disagreement)."""
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
        given = (d.kind, d.dtype, d.itemsize, d.global_shape, offsets[s:e].tobytes(), lengths[s:e].tobytes())
        column = _Column(tables, i, d, offsets[s:e], lengths[s:e])
        by_path[d.path] = Holders(everyone, column, ids.setdefault(given, len(ids)))
        s = e
    return Gathered(world, by_path)


class _Column(Sequence[LeafDesc]):
    """Leaf ``i``'s descriptors on every rank, built from the ranks' tables when first
    read past rank 0's: the planner reads them whole once per distinct sharding.
    ``checksums`` (one per rank), when given, replace those the ranks sent."""

    def __init__(
        self, tables: Sequence[Descs], i: int, first: LeafDesc, offsets: np.ndarray, lengths: np.ndarray,
        checksums: Sequence[int | None] | None = None,
    ):
        self._tables, self._i, self._first = tables, i, first
        self._offsets, self._lengths = offsets, lengths
        self._checksums = checksums
        self._rows: list[LeafDesc] | None = None

    def __len__(self) -> int:
        return len(self._tables)

    @overload
    def __getitem__(self, k: int) -> LeafDesc: ...

    @overload
    def __getitem__(self, k: slice) -> Sequence[LeafDesc]: ...

    def __getitem__(self, k: int | slice) -> LeafDesc | Sequence[LeafDesc]:
        if k == 0 and self._checksums is None:
            return self._first
        return self.rows()[k]

    def __iter__(self) -> Iterator[LeafDesc]:
        return iter(self.rows())

    def with_checksums(self, computed: Mapping[int, int]) -> _Column:
        """This column with the checksums ranks computed (rank -> checksum) in place of those
        they sent, without building any descriptor."""
        sums = [computed.get(r, t.checksums[self._i]) for r, t in enumerate(self._tables)]
        return _Column(self._tables, self._i, self._first, self._offsets, self._lengths, sums)

    def rows(self) -> list[LeafDesc]:
        if self._rows is None:
            i, d = self._i, self._first
            offs, lens = self._offsets.T.tolist(), self._lengths.T.tolist()
            sums = self._checksums or [t.checksums[i] for t in self._tables]
            self._rows = [
                LeafDesc(d.path, d.kind, d.dtype, d.itemsize, d.global_shape, tuple(o), tuple(n), c, t.values[i])
                for t, o, n, c in zip(self._tables, offs, lens, sums)
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
    shared: dict[int, list[int]] = {}  # Holders.given -> indexes of the holders of shared regions
    for path, h in g.by_path.items():
        if len(h.ranks) < 2 or h.descs[0].kind == "value":
            continue
        if h.given not in shared:
            count = Counter(map(box_of, h.descs))
            shared[h.given] = [i for i, d in enumerate(h.descs) if count[box_of(d)] > 1]
        for i in shared[h.given]:
            out[h.ranks[i]].append(path)
    return out


def with_checksums(g: Gathered, sums: Sequence[Mapping[str, int]]) -> Gathered:
    """``g`` with the checksums ranks computed (``sums[r]``: path -> checksum of rank r's
    region); a holder that computed none for a path keeps its descriptor's."""
    by_path = dict(g.by_path)
    for p in {p for rank_sums in sums for p in rank_sums}:
        h = by_path[p]
        computed = {r: sums[r][p] for r in h.ranks if p in sums[r]}
        descs: Sequence[LeafDesc]
        if isinstance(h.descs, _Column):
            descs = h.descs.with_checksums(computed)
        else:
            descs = tuple(d._replace(checksum=computed[r]) if r in computed else d for r, d in zip(h.ranks, h.descs))
        by_path[p] = Holders(h.ranks, descs, h.given)
    return Gathered(g.world, by_path)
