"""Rank descriptors on their way to rank 0, and rank 0's view of them.

The part of save()'s protocol (tsckpt/_save/protocol.py) that moves descriptors, before
the planner (tsckpt/_save/plan.py) decides who writes what:

1. Describe (all ranks): each rank packs its leaves' descriptors field by field,
   with its tree, tied-leaf links, write window and layout, into one
   :class:`Payload` (:meth:`Payload.of`), which it sends to rank 0 only.
2. Gather (rank 0): :func:`gather_descs` groups every rank's descriptors by
   path (a column at a time when every rank gives the same leaves),
   :func:`without` drops the tied leaves (stored once, under another path) and
   :func:`shared_regions` finds the regions several ranks hold; when there are
   any, rank 0 sends each rank a :class:`ChecksumRequest` for its own.
3. Replica checksums (all ranks, only after 2's requests): each rank
   checksums its regions of the paths asked, and rank 0 adds the checksums
   (:func:`with_checksums`) for the planner to compare replicas.

Pure functions and frozen dataclasses: no I/O, no messages (save() sends them).
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from .._base.types import Box, LeafDesc


@dataclasses.dataclass(frozen=True, eq=False)
class Descs(Sequence[LeafDesc]):
    """One rank's descriptors, field by field: what a rank sends rank 0.

    A few tuples and small integer arrays instead of one tuple per leaf, so that the
    coordinator unpickles 1,024 ranks' payloads without building a million
    objects, and compares whole ranks at once. Reads as a sequence of
    :class:`LeafDesc` (built on each read: for tests and small lookups).
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
    cuts: tuple[Any, ...] = ()  # every leaf's LeafDesc.cuts; () when no leaf has any (the common case)
    helds: tuple[Any, ...] = ()  # every leaf's LeafDesc.held; () when no leaf has any (the common case)

    def cut(self, i: int) -> tuple[tuple[int, ...], ...]:
        """Leaf ``i``'s cuts (:attr:`LeafDesc.cuts`)."""
        return self.cuts[i] if self.cuts else ()

    def held(self, i: int) -> tuple[Box, ...]:
        """Leaf ``i``'s pieces held (:attr:`LeafDesc.held`)."""
        return self.helds[i] if self.helds else ()

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
        t = _Unpacked.of(self)
        return [t.desc(i) for i in range(len(self))]

    def select(self, paths: Collection[str]) -> dict[str, LeafDesc]:
        """The descriptors of those of ``paths`` this rank gives, by path (no other built)."""
        chosen = [i for i, p in enumerate(self.paths) if p in paths]
        if not chosen:
            return {}
        ends, ndims = np.cumsum(self.ndims, axis=1).T.tolist(), self.ndims.T.tolist()
        out = {}
        for i in chosen:
            shape, offsets, lengths = (tuple(col[e - n:e].tolist()) for col, e, n in zip(self.dims, ends[i], ndims[i]))
            out[self.paths[i]] = LeafDesc(
                self.paths[i], self.kinds[i], self.dtypes[i], int(self.itemsizes[i]), shape, offsets, lengths,
                self.checksums[i], self.values[i], self.cut(i), self.held(i),
            )
        return out


def pack_descs(descs: Sequence[Sequence[Any]]) -> Descs:
    """A rank's descriptors (LeafDescs, or plain tuples of their fields) as one Descs."""
    if isinstance(descs, Descs):
        return descs
    rows = [d if isinstance(d, LeafDesc) else LeafDesc(*d) for d in descs]
    cuts = tuple(d.cuts for d in rows)
    helds = tuple(d.held for d in rows)
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
        cuts if any(cuts) else (),
        helds if any(helds) else (),
    )


def _ints(values: Sequence[Any]) -> np.ndarray:
    """``values`` in the smallest signed integer dtype that holds them (a smaller payload)."""
    a = np.array(values, dtype=np.int64)
    for t in (np.int8, np.int16, np.int32):
        if not a.size or (np.iinfo(t).min <= a.min() and a.max() <= np.iinfo(t).max):
            return a.astype(t)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class _Unpacked:
    """A rank's Descs with every field as Python objects, leaf by leaf: what the general
    gathering path reads. Tuples of ints and strings, which the garbage collector
    stops tracking, rather than a descriptor object per leaf."""

    descs: Descs
    itemsizes: list[int]
    shapes: list[tuple[int, ...]]
    offsets: list[tuple[int, ...]]
    lengths: list[tuple[int, ...]]

    @classmethod
    def of(cls, descs: Descs) -> _Unpacked:
        shapes, offsets, lengths = (
            [tuple(col[s:e]) for s, e in zip([0, *ends[:-1]], ends)]
            for col, ends in zip((d.tolist() for d in descs.dims), np.cumsum(descs.ndims, axis=1).tolist())
        )
        return cls(descs, descs.itemsizes.tolist(), shapes, offsets, lengths)

    def given(self, i: int) -> tuple[Any, ...]:
        """What leaf ``i`` gives, as Holders.given numbers it."""
        d = self.descs
        return (
            d.kinds[i], d.dtypes[i], self.itemsizes[i], self.shapes[i], self.offsets[i], self.lengths[i], d.cut(i),
            d.held(i),
        )

    def desc(self, i: int) -> LeafDesc:
        d = self.descs
        return LeafDesc(
            d.paths[i], d.kinds[i], d.dtypes[i], self.itemsizes[i], self.shapes[i], self.offsets[i], self.lengths[i],
            d.checksums[i], d.values[i], d.cut(i), d.held(i),
        )


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
    target: str = ""  # the checkpoint this rank saves (its location): every rank's must be one
    inner_chunks: bool = True  # the save's options (with layout) that every rank must pass alike: AGREED
    overwrite: bool = False
    check_replicas: bool = True

    @classmethod
    def of(
        cls, descs: Sequence[Sequence[Any]], paths: Sequence[str], structure: Any, links: dict[str, str],
        window: int, layout: str, target: str = "", inner_chunks: bool = True, *, overwrite: bool = False,
        check_replicas: bool = True,
    ) -> Payload:
        """The payload of a rank's descriptors (LeafDescs or plain tuples) and tree structure (JSON)."""
        return cls(
            pack_descs(descs), tuple(paths), json.dumps(structure, separators=(",", ":")), links, window, layout, target,
            inner_chunks, overwrite, check_replicas,
        )


# The save options every rank must pass alike (rank 0 refuses them otherwise, on every rank): each
# decides for the whole checkpoint, and a rank passing another would see its own ignored.
AGREED = ("layout", "inner_chunks", "overwrite", "check_replicas")


@dataclasses.dataclass(frozen=True)
class ChecksumRequest:
    """Rank 0 to one rank (step 2): checksum your regions of these paths (others hold them too)."""

    paths: tuple[str, ...]


class Holders(abc.ABC):
    """Every rank that gives one path, with what it gives: read field by field (regions,
    checksums, values) from the ranks' packed descriptors, so that planning 1,000
    leaves x 1,024 ranks builds no descriptor object per rank and leaf."""

    ranks: tuple[int, ...]  # ascending
    # numbers what the holders give (each one's kind, dtype, itemsize, shape and region):
    # equal for arrays sharded the same way, so the planner checks and lays them out once
    given: int
    first: LeafDesc  # the descriptor of ranks[0] (with its computed checksum, if any)

    @abc.abstractmethod
    def same_leaf(self) -> bool:
        """Whether every holder gives the same kind of leaf, dtype and global shape."""

    @abc.abstractmethod
    def boxes(self) -> list[Box]:
        """Each holder's region, in rank order."""

    @abc.abstractmethod
    def checksums(self) -> Sequence[int | None]:
        """Each holder's checksum of its region (None: not computed), in rank order."""

    @abc.abstractmethod
    def values(self) -> Sequence[Any]:
        """Each holder's value (JSON; None for arrays), in rank order."""

    @abc.abstractmethod
    def cuts(self) -> Sequence[tuple[tuple[int, ...], ...]]:
        """Each holder's cuts of its region into pieces (:attr:`LeafDesc.cuts`), in rank order."""

    @abc.abstractmethod
    def held(self) -> Sequence[tuple[Box, ...]]:
        """Each holder's pieces held of its region (:attr:`LeafDesc.held`), in rank order."""

    @abc.abstractmethod
    def descs(self) -> list[LeafDesc]:
        """Each holder's descriptor, in rank order (built on each call: for messages)."""

    @abc.abstractmethod
    def with_checksums(self, computed: Mapping[int, int]) -> Holders:
        """These holders with the checksums ranks computed (rank -> checksum) in place of
        those in their descriptors."""


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Every rank's descriptors grouped by path: the coordinator's view."""

    world: int
    by_path: dict[str, Holders]


def gather_descs(per_rank: Sequence[Sequence[Sequence[Any]]]) -> Gathered:
    """Group every rank's descriptors by path (each rank's: Descs, or LeafDescs or plain
    tuples of their fields): a column at a time where it can (:func:`gather_alike`),
    else rank by rank (:func:`gather_by_rank`)."""
    tables = [pack_descs(d) for d in per_rank]
    return (gather_alike(tables) if tables else None) or gather_by_rank(tables)


def gather_by_rank(tables: Sequence[Descs]) -> Gathered:
    """:func:`gather_descs` in general: rank by rank, descriptor by descriptor."""
    unpacked = [_Unpacked.of(t) for t in tables]
    ranks: dict[str, list[int]] = defaultdict(list)
    indexes: dict[str, list[int]] = defaultdict(list)
    for rank, t in enumerate(tables):
        for i, path in enumerate(t.paths):
            ranks[path].append(rank)
            indexes[path].append(i)
    ids: dict[tuple[Any, ...], int] = {}
    by_path: dict[str, Holders] = {}
    for path, held in ranks.items():
        rows = [unpacked[r] for r in held]
        given = ids.setdefault(tuple(t.given(i) for t, i in zip(rows, indexes[path])), len(ids))
        by_path[path] = _Listed(tuple(held), given, rows, indexes[path])
    return Gathered(len(tables), by_path)


def gather_alike(tables: Sequence[Descs]) -> Gathered | None:
    """:func:`gather_descs` in the common case at scale, a column at a time: every rank
    gives the same paths in the same order, each with the same kind, dtype, itemsize and
    global shape on every rank. Only regions, checksums and values differ. None
    otherwise (:func:`gather_by_rank` then groups descriptor by descriptor, and reports
    any disagreement)."""
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
    everyone = tuple(range(len(tables)))
    pieces = any(t.cuts or t.helds for t in tables)  # some rank holds some region in pieces
    ids: dict[tuple[Any, ...], int] = {}
    by_path: dict[str, Holders] = {}
    rank0 = first.rows()
    s = 0
    for i, e in enumerate(np.cumsum(first.ndims[0]).tolist()):
        d = rank0[i]
        # what every holder gives, as _Unpacked.given, with the regions as bytes
        given = (d.kind, d.dtype, d.itemsize, d.global_shape, offsets[s:e].tobytes(), lengths[s:e].tobytes(),
                 tuple((t.cut(i), t.held(i)) for t in tables) if pieces else ())
        by_path[d.path] = _Column(everyone, ids.setdefault(given, len(ids)), d, tables, i, offsets[s:e], lengths[s:e])
        s = e
    return Gathered(len(tables), by_path)


class _Column(Holders):
    """Leaf ``i`` of every rank, every rank giving the same leaves in the same order
    (:func:`gather_alike`): its regions are columns of the ranks' stacked offsets and
    lengths (one row per dimension, one column per rank)."""

    def __init__(
        self, ranks: tuple[int, ...], given: int, first: LeafDesc, tables: Sequence[Descs], i: int,
        offsets: np.ndarray, lengths: np.ndarray, checksums: Sequence[int | None] | None = None,
    ):
        self.ranks, self.given, self.first = ranks, given, first
        self._tables, self._i = tables, i
        self._offsets, self._lengths = offsets, lengths
        self._checksums = checksums

    def same_leaf(self) -> bool:
        return True  # gather_alike compared the ranks' kinds, dtypes and shapes

    def boxes(self) -> list[Box]:
        offsets, lengths = self._offsets.T.tolist(), self._lengths.T.tolist()
        return list(zip(map(tuple, offsets), map(tuple, lengths)))

    def checksums(self) -> Sequence[int | None]:
        return self._checksums if self._checksums is not None else [t.checksums[self._i] for t in self._tables]

    def values(self) -> Sequence[Any]:
        return [t.values[self._i] for t in self._tables]

    def cuts(self) -> Sequence[tuple[tuple[int, ...], ...]]:
        return [t.cut(self._i) for t in self._tables]

    def held(self) -> Sequence[tuple[Box, ...]]:
        return [t.held(self._i) for t in self._tables]

    def descs(self) -> list[LeafDesc]:
        d = self.first
        return [
            LeafDesc(d.path, d.kind, d.dtype, d.itemsize, d.global_shape, o, n, c, v, k, h)
            for (o, n), c, v, k, h in zip(self.boxes(), self.checksums(), self.values(), self.cuts(), self.held())
        ]

    def with_checksums(self, computed: Mapping[int, int]) -> Holders:
        sums = [computed.get(r, c) for r, c in zip(self.ranks, self.checksums())]
        first = self.first._replace(checksum=sums[0])
        return _Column(self.ranks, self.given, first, self._tables, self._i, self._offsets, self._lengths, sums)


class _Listed(Holders):
    """One path's holders found rank by rank (:func:`gather_by_rank`): leaf
    ``indexes[k]`` of ``tables[k]`` for the k-th rank in ``ranks``."""

    def __init__(
        self, ranks: tuple[int, ...], given: int, tables: list[_Unpacked], indexes: list[int],
        checksums: Sequence[int | None] | None = None,
    ):
        self.ranks, self.given = ranks, given
        self._tables, self._indexes = tables, indexes
        self._checksums = checksums
        first = tables[0].desc(indexes[0])
        self.first = first if checksums is None else first._replace(checksum=checksums[0])

    def same_leaf(self) -> bool:
        return len({(t.descs.kinds[i], t.descs.dtypes[i], t.shapes[i]) for t, i in self._held()}) < 2

    def boxes(self) -> list[Box]:
        return [(t.offsets[i], t.lengths[i]) for t, i in self._held()]

    def checksums(self) -> Sequence[int | None]:
        return self._checksums if self._checksums is not None else [t.descs.checksums[i] for t, i in self._held()]

    def values(self) -> Sequence[Any]:
        return [t.descs.values[i] for t, i in self._held()]

    def cuts(self) -> Sequence[tuple[tuple[int, ...], ...]]:
        return [t.descs.cut(i) for t, i in self._held()]

    def held(self) -> Sequence[tuple[Box, ...]]:
        return [t.descs.held(i) for t, i in self._held()]

    def descs(self) -> list[LeafDesc]:
        return [t.desc(i)._replace(checksum=c) for (t, i), c in zip(self._held(), self.checksums())]

    def with_checksums(self, computed: Mapping[int, int]) -> Holders:
        sums = [computed.get(r, c) for r, c in zip(self.ranks, self.checksums())]
        return _Listed(self.ranks, self.given, self._tables, self._indexes, sums)

    def _held(self) -> Iterator[tuple[_Unpacked, int]]:
        return zip(self._tables, self._indexes)


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
        if len(h.ranks) < 2 or h.first.kind == "value":
            continue
        if h.given not in shared:
            boxes = h.boxes()
            count = Counter(boxes)
            shared[h.given] = [i for i, box in enumerate(boxes) if count[box] > 1]
        for i in shared[h.given]:
            out[h.ranks[i]].append(path)
    return out


def with_checksums(g: Gathered, sums: Sequence[Mapping[str, int]]) -> Gathered:
    """``g`` with the checksums ranks computed (``sums[r]``: path -> checksum of rank r's
    region); a holder that computed none for a path keeps its descriptor's."""
    by_path = dict(g.by_path)
    for p in {p for rank_sums in sums for p in rank_sums}:
        h = by_path[p]
        by_path[p] = h.with_checksums({r: sums[r][p] for r in h.ranks if p in sums[r]})
    return Gathered(g.world, by_path)
