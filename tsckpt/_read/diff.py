"""diff(): what differs between two checkpoints of any formats tsckpt reads, leaf by leaf.

Arrays are compared over A's stored chunk grid, in blocks of whole chunks where one fits the
window, each block read from both sides by restore's read engine (:func:`.engine.read_into`:
the own shard and chunk readers, crc32c checked, where the checkpoint allows), so memory
stays within the window whatever the checkpoints' size. A block of the same bytes on both
sides costs a byte comparison; only elements that differ are widened to float64. A region whose stored data is known equal without
reading (:func:`known_equal`: the same content hash recorded on both sides, the same file
on disk, a hard link or one checkpoint given twice) is not read.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, Literal

import numpy as np

from .._base import dtypes as _dtypes
from .._base.types import Box, Dest, ReadItem, box_slices
from .._ondisk.arrays import chunk_key
from .._ondisk.backing import check_backed
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import cells, shard_boxes
from .._ondisk.readfaults import unchanged
from .._ondisk.records import LAYOUT_PLAIN, content_entries
from .._options import READ_WINDOW_BYTES, RestoreOptions, verb
from .._runtime import fork as _fork
from .._runtime.progress import Progress
from .._storage.locations import Directory
from .engine import read_into
from .open import open as open_reader
from .reader import LazyArray

Status = Literal["equal", "different", "only_in_a", "only_in_b", "dtype_changed", "shape_changed"]

# Bytes of float64 work per element compared at once: both sides, |a - b|, the bound and masks.
WORK_BYTES_PER_ELEMENT = 48
# Elements compared at once, at most: pieces this small stay in the CPU's caches, and their
# temporaries are reused from the heap rather than mapped (and faulted in) afresh.
PIECE_ELEMENTS = 1 << 16
# Bytes of a piece compared first, before the whole: unrelated pieces differ there already.
PREFIX_BYTES = 1 << 12
# Threads comparing pieces at once (numpy works without the GIL).
COMPARING_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """How one leaf differs between A and B.

    ``status``: ``equal`` (within the tolerance), ``different``, ``only_in_a``, ``only_in_b``,
    ``dtype_changed`` (an array against a value counts as one), ``shape_changed``. ``how`` says
    how the answer was found: ``read`` (data of both sides compared), ``same files`` (known
    equal from what is stored, nothing read), ``value`` (plain values compared), or empty
    when the two sides were not compared. For arrays compared by reading: ``chunks`` in A's
    stored chunk grid, of which ``changed_chunks`` hold an element beyond the tolerance;
    ``changed_elements``; ``max_abs``, the largest ``|a - b|`` (infinite where one side is
    NaN; NaNs at the same index of both sides are equal); ``rel_l2``, ``||a - b|| / ||a||``
    over the finite elements read (a region known equal unread adds nothing to ``a - b``,
    but its part of ``||a||`` is unknown: then an upper bound); ``first_index``, the first element beyond the tolerance in C
    order. Plain values: ``value_a`` and ``value_b`` (their repr) when they differ.
    """

    path: str
    status: Status
    how: str = ""
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    chunks: int = 0
    changed_chunks: int = 0
    changed_elements: int = 0
    max_abs: float | None = None
    rel_l2: float | None = None
    first_index: tuple[int, ...] | None = None
    value_a: str | None = None
    value_b: str | None = None
    bytes_read: int = 0  # both sides

    @property
    def equal(self) -> bool:
        return self.status == "equal"


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What :func:`diff` found: every leaf of A or B selected, in A's order then B's.
    ``bytes_read`` counts both sides; ``bytes_known_equal`` the bytes of A known equal without
    reading them."""

    a: str
    b: str
    atol: float
    rtol: float
    leaves: tuple[LeafDiff, ...]
    bytes_read: int
    bytes_known_equal: int

    @property
    def equal(self) -> bool:
        """Every leaf selected is in both, of the same dtype and shape, equal within the tolerance."""
        return all(leaf.equal for leaf in self.leaves)

    @property
    def differences(self) -> tuple[LeafDiff, ...]:
        return tuple(leaf for leaf in self.leaves if not leaf.equal)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON types; a non-finite number is written as a string ("inf", "nan")."""
        raw = dataclasses.asdict(self)
        raw["leaves"] = [{k: _json_number(v) for k, v in leaf.items()} for leaf in raw["leaves"]]
        return {"equal": self.equal, **raw}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return list(v) if isinstance(v, tuple) else v


# ---- what is known without reading ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stored:
    """What one side records of its files: their content hashes (key -> hash; none for
    another library's checkpoint, or one saved without them)."""

    ck: Checkpoint
    hashes: Mapping[str, str]

    @classmethod
    def of(cls, ck: Checkpoint) -> Stored:
        entries = {} if ck.foreign else content_entries(ck.raw)
        return cls(ck, {k: e[0] for k, e in entries.items()})


def known_equal(a: Stored, b: Stored, path: str, region: Box) -> bool | None:
    """Whether the array ``path`` holds the same data in A and B over ``region`` (one of A's
    stored shards), known from what is stored, without reading it: True when both sides
    recorded the same content hash for its file (docs/format.md, "Content hashes"), or keep
    it in the same file (one checkpoint given twice, or a file hard-linked from the other);
    None when that is not known, and the region must be read."""
    ca, cb = a.ck, b.ck
    local = ca.location.local is not None and cb.location.local is not None
    if local and _same_path(str(ca.location.local), str(cb.location.local)) and ca.root_generation == cb.root_generation:
        return True  # one checkpoint given twice (of any format or layout), not replaced in between
    ra, rb = ca.arrays.get(ca.aliases.get(path, path)), cb.arrays.get(cb.aliases.get(path, path))
    if ra is None or rb is None or ca.foreign or cb.foreign or LAYOUT_PLAIN != ca.layout or LAYOUT_PLAIN != cb.layout:
        return None
    if (ra.dtype, ra.shape, ra.chunking) != (rb.dtype, rb.shape, rb.chunking):
        return None  # the same bytes would not decode to the same elements
    # a shard not stored (all fill value) or unreadable is read
    ka, kb = chunk_key(ra, region[0]), chunk_key(rb, region[0])
    ha = a.hashes.get(ka)
    if ha is not None and ha == b.hashes.get(kb):
        return True
    if not local:
        return None
    return True if _same_path(os.path.join(str(ca.location.local), ka), os.path.join(str(cb.location.local), kb)) else None


def _same_path(x: str, y: str) -> bool:
    """Whether ``x`` and ``y`` are one file or directory (False when either cannot be found)."""
    try:
        return os.path.samefile(x, y)
    except OSError:
        return False


# ---- comparing arrays -------------------------------------------------------------------


def blocks(region: Box, chunk: Sequence[int], limit: int) -> Iterator[Box]:
    """``region`` (aligned to ``chunk`` boundaries) cut into blocks of at most ``limit``
    elements, in C order: whole chunks along the leading dimensions where one fits, else
    pieces of one chunk (never spanning two)."""
    off, ln = region
    if math.prod(ln) <= limit:
        yield region
        return
    d = next(i for i, n in enumerate(ln) if n > 1)  # the dimensions before it are 1 long
    row = math.prod(ln[d + 1 :])  # elements in one step along d
    end = off[d] + ln[d]
    c = chunk[d]
    if row * c <= limit:
        edges = list(range(off[d], end, (limit // row) // c * c))
    else:
        edges = sorted(set(range(off[d], end, max(1, limit // row))) | set(range(off[d], end, c)))
    for lo, hi in zip(edges, [*edges[1:], end]):
        yield from blocks((off[:d] + (lo,) + off[d + 1 :], ln[:d] + (hi - lo,) + ln[d + 1 :]), chunk, limit)


def _numbers(data: np.ndarray, dtype: str) -> np.ndarray:
    """Stored elements as float64 (complex128 for complex dtypes), exact for every float dtype."""
    if dtype == "complex32":  # stored as float16 (re, im) pairs
        return data[..., 0].astype(np.float64) + 1j * data[..., 1].astype(np.float64)
    if data.dtype.kind == "c":
        return data.astype(np.complex128)
    if data.dtype.kind in "biuf":
        return data.astype(np.float64)
    return data.astype(np.float32).astype(np.float64)  # bfloat16, float8 and other ml_dtypes


@dataclasses.dataclass
class Tally:
    """What the blocks of one array found so far."""

    changed_chunks: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    changed_elements: int = 0
    max_abs: float = 0.0
    sq_diff: float = 0.0
    sq_a: float = 0.0
    first: tuple[int, ...] | None = None


def _compare_piece(sa: np.ndarray, sb: np.ndarray, dtype: str, out: np.ndarray, *, atol: float,
                   rtol: float) -> tuple[float, float, float, int]:
    """Compare one piece of both sides: whether each element differs into ``out``; the largest
    ``|a - b|``, the sum of its squares and that of ``|a|`` (finite elements), and the count
    of elements that differ. A piece of the same bytes costs a comparison of its bytes;
    float32 and float64 pieces without a tolerance are compared as stored
    (:func:`_stored_differences`); elsewhere only the elements that differ are widened to
    float64 (the others add nothing to ``a - b``)."""
    sq_a = _squared_norm(sa, dtype)
    if _same_bits(sa, sb):  # nothing more to learn
        out[:] = False
        return 0.0, 0.0, sq_a, 0
    if sa.dtype in STORED_FLOATS and not (atol or rtol):
        found = _stored_differences(sa, sb, out)
        if found is not None:
            return found[0], found[1], sq_a, found[2]
    ne = sa != sb  # NaNs included; 0.0 against -0.0 is no difference
    if ne.ndim > 1:  # complex32: (re, im) pairs
        ne = ne.any(axis=-1)
    count = int(np.count_nonzero(ne))
    if not count:
        out[:] = False
        return 0.0, 0.0, sq_a, 0
    if count == ne.size:
        gap, bad = _widened_differences(sa, sb, dtype, atol=atol, rtol=rtol)
        out[:] = bad
    else:
        idx = np.flatnonzero(ne)
        gap, bad = _widened_differences(sa[idx], sb[idx], dtype, atol=atol, rtol=rtol)
        out[:] = False
        out[idx] = bad
    return float(gap.max()), _sum_of_squares(gap), sq_a, int(np.count_nonzero(bad))


def _widened_differences(ca: np.ndarray, cb: np.ndarray, dtype: str, *, atol: float,
                         rtol: float) -> tuple[np.ndarray, np.ndarray]:
    """``|a - b|`` in float64 (infinite where one side is NaN, 0 where both are alike) and
    whether each element is beyond the tolerance, for elements of ``dtype`` as stored."""
    na, nb = _numbers(ca, dtype), _numbers(cb, dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 0 * inf
        gap = np.abs(na - nb)
        bound = atol + rtol * np.abs(nb) if rtol else atol
    odd = np.isnan(gap)  # a NaN on either side, or the same infinity on both
    if odd.any():
        alike = odd & ((na == nb) | (np.isnan(na) & np.isnan(nb)))
        gap[odd] = np.inf
        gap[alike] = 0.0
    if ca.dtype.kind in "biu":  # integers compared as stored (float64 is not exact past 2**53)
        bad = ca != cb
        if atol or rtol:
            bad &= ~(gap <= bound)
    else:  # no tolerance brings an infinity nearer
        bad = gap > bound if not rtol else (gap > 0) & (~(gap <= bound) | np.isinf(gap))
    return gap, bad


# Stored dtypes whose pieces are compared as stored when no tolerance is given.
STORED_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _stored_differences(sa: np.ndarray, sb: np.ndarray, out: np.ndarray) -> tuple[float, float, int] | None:
    """Without a tolerance, finite float32 or float64 elements differ where they are unequal,
    found in a few passes over the stored dtype: ``|a - b|`` once, its largest, the mask, its
    count. The largest ``|a - b|`` rounded to float32 is the exact one rounded (rounding keeps
    order), so it is found again in float64 over the few elements that reach it; the sum of
    squares is summed pairwise in the stored dtype (relative error below 1e-6). None where a
    difference is not finite in the stored dtype (a NaN, an infinity, an overflow): then the
    widened path answers."""
    with np.errstate(invalid="ignore", over="ignore"):
        gap = np.subtract(sa, sb)
    np.abs(gap, out=gap)
    top = gap.max()
    if not np.isfinite(top):
        return None
    np.not_equal(sa, sb, out=out)  # every element finite: no NaN to tell apart
    count = int(np.count_nonzero(out))
    if not count:
        return 0.0, 0.0, 0
    if gap.dtype == np.float64:
        exact = float(top)
    else:
        at = np.flatnonzero(gap == top)
        exact = float(np.abs(sa[at].astype(np.float64) - sb[at].astype(np.float64)).max())
    fits = float(top) ** 2 * gap.size < float(np.finfo(gap.dtype).max)  # no square nor sum overflows
    return exact, _stored_sum_of_squares(gap, scratch=gap if fits else None), count


def _stored_sum_of_squares(x: np.ndarray, *, scratch: np.ndarray | None = None) -> float:
    """The sum of ``x**2`` for float32 or float64 ``x``, squared and summed pairwise in its own
    dtype (relative error below 1e-6); in float64 where float32 squares overflow. ``scratch``
    holds the squares: ``x`` itself, when it is not needed after and no square can overflow."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(np.square(x, out=scratch).sum())
    if math.isfinite(total) or x.dtype == np.float64:
        return total
    return _sum_of_squares(x.astype(np.float64))


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes, compared as wide words
    (a first few kilobytes alone, where they already differ)."""
    x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if x.size > 2 * PREFIX_BYTES and not np.array_equal(x[:PREFIX_BYTES], y[:PREFIX_BYTES]):
        return False
    whole = x.size - x.size % 8
    if whole and x.ctypes.data % 8 == 0 and y.ctypes.data % 8 == 0:
        if not np.array_equal(x[:whole].view(np.uint64), y[:whole].view(np.uint64)):
            return False
        x, y = x[whole:], y[whole:]
    return bool(np.array_equal(x, y))


def compare_block(a: np.ndarray, b: np.ndarray, dtype: str, region: Box, chunk: Sequence[int], tally: Tally,
                  *, atol: float, rtol: float, piece: int, workers: Executor | None = None) -> None:
    """Compare one block read from both sides (stored dtype), ``piece`` elements of float64
    work at a time (on ``workers``, several pieces at once), into ``tally``. An element differs
    when ``|a - b| > atol + rtol * |b|`` (numpy's isclose); NaNs at the same index are equal,
    NaN against a number infinitely far."""
    pairs = dtype == "complex32"
    shape = region[1]
    fa = a.reshape(-1, 2) if pairs else a.reshape(-1)
    fb = b.reshape(-1, 2) if pairs else b.reshape(-1)
    differs = np.empty(math.prod(shape), dtype=bool)

    def one(i: int) -> tuple[float, float, float, int]:
        j = i + piece
        return _compare_piece(fa[i:j], fb[i:j], dtype, differs[i:j], atol=atol, rtol=rtol)

    starts = range(0, differs.size, piece)
    count = 0
    for max_abs, sq_diff, sq_a, n in (map(one, starts) if workers is None else workers.map(one, starts)):
        tally.max_abs = max(tally.max_abs, max_abs)
        tally.sq_diff += sq_diff
        tally.sq_a += sq_a
        count += n
    if not count:
        return
    tally.changed_elements += count
    first = tuple(int(o + i) for o, i in zip(region[0], np.unravel_index(int(differs.argmax()), shape)))
    tally.first = first if tally.first is None else min(tally.first, first)
    grid = differs.reshape(shape)
    cuts = [range((o // c + 1) * c, o + n, c) for o, n, c in zip(*region, chunk)]
    for cell in cells(region, cuts):
        if grid[box_slices(cell[0], cell[1], region[0])].any():
            tally.changed_chunks.add(tuple(o // c for o, c in zip(cell[0], chunk)))


def _sum_of_squares(x: np.ndarray) -> float:
    """The sum of ``x**2`` (real float64 ``x``), in numpy's own loop: BLAS's threads would
    spin against the readers' on a busy machine, for a sum that memory bandwidth bounds anyway."""
    return float(np.einsum("i,i->", x, x))


def _squared_norm(x: np.ndarray, dtype: str) -> float:
    """The sum of ``|x|**2`` over the finite elements of ``x`` (stored elements of ``dtype``):
    float32 and float64 as :func:`_stored_sum_of_squares` sums them, the others in float64."""
    if x.dtype in STORED_FLOATS:
        total = _stored_sum_of_squares(x)
        if math.isfinite(total):
            return total
    size = x if x.dtype == np.float64 else _numbers(x, dtype)
    if size.dtype.kind == "c":
        size = np.abs(size)
    total = _sum_of_squares(size)
    if math.isfinite(total):
        return total
    return _sum_of_squares(size[np.isfinite(size)])


@dataclasses.dataclass(frozen=True)
class _Sides:
    """Both checkpoints, the tolerance and the window: what every leaf's comparison needs."""

    a: Checkpoint
    b: Checkpoint
    stored_a: Stored
    stored_b: Stored
    atol: float
    rtol: float
    window: int
    pool: ThreadPoolExecutor  # the reads of both sides
    workers: ThreadPoolExecutor | None  # the comparisons, several pieces at once
    progress: Progress


class _ArrayWork:
    """The comparison of one array of the same dtype and shape on both sides: its blocks to
    read (:meth:`blocks`), what their comparisons found, and its :class:`LeafDiff` once every
    block is compared (:meth:`result`)."""

    def __init__(self, sides: _Sides, path: str, la: LazyArray, lb: LazyArray) -> None:
        self.sides, self.path, self.la, self.lb = sides, path, la, lb
        self.rec = sides.a.arrays[sides.a.aliases.get(path, path)]
        self.chunk = la.metadata.chunk_shape
        self.itemsize = _dtypes.itemsize(la.dtype)
        # half the window: two blocks of both sides (one compared while the next is read) and the
        # mask of one; the other half: the float64 work on pieces of a block
        self.limit = max(1, sides.window // 2 // (4 * self.itemsize + 1))
        self.piece = max(1, min(PIECE_ELEMENTS, sides.window // 2 // WORK_BYTES_PER_ELEMENT // COMPARING_THREADS))
        self.tally = Tally()
        self.known = 0  # bytes of A known equal, not read
        self.read = 0  # bytes read, both sides
        self.read_a, self.read_b = _reader(sides.a, la, sides.window), _reader(sides.b, lb, sides.window)

    def blocks(self) -> Iterator[Box]:
        """The blocks to read: every stored shard of A not known equal (:func:`known_equal`)."""
        sides = self.sides
        for shard in shard_boxes((0,) * len(self.la.shape), self.la.shape, self.rec.chunking):
            if known_equal(sides.stored_a, sides.stored_b, self.path, shard):
                self.known += math.prod(shard[1]) * self.itemsize
                sides.progress.update(2 * math.prod(shard[1]) * self.itemsize)
                continue
            yield from blocks(shard, self.chunk, self.limit)

    def compare(self, block: Box, a: np.ndarray, b: np.ndarray) -> None:
        sides = self.sides
        compare_block(a, b, self.la.dtype, block, self.chunk, self.tally, atol=sides.atol, rtol=sides.rtol,
                      piece=self.piece, workers=sides.workers)
        n = 2 * math.prod(block[1]) * self.itemsize
        sides.progress.update(n, 2)
        self.read += n

    def result(self) -> LeafDiff:
        tally, read, shape = self.tally, self.read, self.la.shape
        return LeafDiff(
            self.path, "different" if tally.changed_elements else "equal",
            "read" if read or not self.known else "same files",
            self.la.dtype, self.lb.dtype, shape, self.lb.shape,
            chunks=math.prod(-(-n // c) for n, c in zip(shape, self.chunk)),
            changed_chunks=len(tally.changed_chunks), changed_elements=tally.changed_elements,
            max_abs=tally.max_abs if read else 0.0,
            rel_l2=_relative(tally.sq_diff, tally.sq_a) if read else 0.0,
            first_index=tally.first, bytes_read=read,
        )


_Reading = tuple[_ArrayWork, Box, "Future[np.ndarray]", "Future[np.ndarray]"]


class _Pipeline:
    """The blocks of every array, read one block ahead of the comparison, across arrays: the
    next block's reads (the next array's, at an array's last block) run while a block is
    compared, so reading and comparing overlap whatever the size of the arrays."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self.ahead: collections.deque[_Reading] = collections.deque()

    def add(self, work: _ArrayWork) -> None:
        for block in work.blocks():
            self.ahead.append((work, block, self.pool.submit(work.read_a, block), self.pool.submit(work.read_b, block)))
            if len(self.ahead) > 1:
                self._settle()

    def drain(self) -> None:
        while self.ahead:
            self._settle()

    def close(self) -> None:
        """After an error: the reads under way are waited for, not left to write into freed blocks."""
        for _, _, da, db in self.ahead:
            da.cancel()
            db.cancel()
            wait([da, db])
        self.ahead.clear()

    def _settle(self) -> None:
        work, block, da, db = self.ahead.popleft()
        work.compare(block, da.result(), db.result())


def engine_serves(leaf: LazyArray) -> bool:
    """Whether the read engine of a restore reads ``leaf``'s blocks for diff (its own shard
    and chunk readers where the checkpoint allows, else TensorStore or another format's
    source): a plain stored array of a stored dtype numpy holds; the rest (a mapped leaf,
    complex32's float16 pairs) is read through the lazy reader."""
    return type(leaf) is LazyArray and leaf.dtype != "complex32"


def _reader(ck: Checkpoint, leaf: LazyArray, window: int) -> Callable[[Box], np.ndarray]:
    """How one side's blocks are read: through the engine where :func:`engine_serves`,
    else the lazy reader; either way in the stored dtype, with the same checks (that the
    checkpoint was not replaced: once over the whole diff, see :func:`diff`)."""
    if not engine_serves(leaf):
        return lambda block: leaf.read_box(box_slices(*block))
    stored = ck.aliases.get(leaf.path, leaf.path)
    dtype = _dtypes.numpy_dtype(leaf.dtype)

    def read(block: Box) -> np.ndarray:
        _fork.enter(f"reading '{leaf.path}'")
        out = np.empty(block[1], dtype=dtype)
        check_backed(ck, [stored], box_slices(*block))
        read_into(ck, [Dest(ReadItem(stored, *block), out, None)], window=window)
        return out

    return read


def _relative(sq_diff: float, sq_a: float) -> float:
    if sq_diff == 0.0:
        return 0.0
    return math.sqrt(sq_diff / sq_a) if sq_a > 0.0 else math.inf


# ---- leaves -------------------------------------------------------------------------------


def _kind(leaf: Any) -> tuple[str, tuple[int, ...] | None]:
    """dtype and shape of an array; the type's name and no shape for a plain value."""
    if isinstance(leaf, LazyArray):
        return leaf.dtype, leaf.shape
    return type(leaf).__name__, None


def _same_value(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and math.isnan(x) and math.isnan(y):
        return True
    return bool(x == y)


def _compare_leaf(sides: _Sides, path: str, x: Any, y: Any) -> LeafDiff | _ArrayWork:
    """The diff of one leaf in both sides, or for two arrays of one dtype and shape the work
    of comparing them (run by a :class:`_Pipeline`)."""
    (dtype_a, shape_a), (dtype_b, shape_b) = _kind(x), _kind(y)
    kinds = LeafDiff(path, "equal", "", dtype_a, dtype_b, shape_a, shape_b)
    if dtype_a != dtype_b or isinstance(x, LazyArray) != isinstance(y, LazyArray):
        return dataclasses.replace(kinds, status="dtype_changed")
    if shape_a != shape_b:
        return dataclasses.replace(kinds, status="shape_changed")
    if isinstance(x, LazyArray) and isinstance(y, LazyArray):
        return _ArrayWork(sides, path, x, y)
    if _same_value(x, y):
        return dataclasses.replace(kinds, how="value")
    return dataclasses.replace(kinds, status="different", how="value", value_a=repr(x), value_b=repr(y))


def _selected(path: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(path, p) for p in patterns)


def _tolerance(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {value!r} ({type(value).__name__})")
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number at least 0, not {value!r}")
    return float(value)


def _patterns(paths: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if paths is None:
        return None
    patterns = (paths,) if isinstance(paths, str) else tuple(paths)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"paths must be glob patterns (str), not {paths!r}")
    return patterns


def _array_bytes(reader_leaf: Any) -> int:
    return reader_leaf.metadata.nbytes if isinstance(reader_leaf, LazyArray) else 0


@verb("tsckpt.diff")
def diff(
    a: Directory,
    b: Directory,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    paths: str | Sequence[str] | None = None,
    progress: bool | None = None,
    max_inflight_bytes: int = READ_WINDOW_BYTES,
    allow_pickle: bool = False,
) -> DiffReport:
    """Compare two checkpoints of any formats tsckpt reads (each detected from its files),
    leaf by leaf, into a :class:`DiffReport` (``report.equal``; ``report.to_json()``).

    Leaves are matched by path; ``paths`` (glob patterns, e.g. ``"model/*"``) keeps only
    those matching one. Arrays of the same dtype and shape are compared element by element:
    equal when ``|a - b| <= atol + rtol * |b|`` (numpy's isclose; NaNs at the same index are
    equal; complex numbers by the modulus of the difference); the counts of changed chunks
    are over A's stored chunk grid. Plain values are compared by value, exactly. Data is read
    in blocks by the reader :func:`tsckpt.restore` uses, at most ``max_inflight_bytes`` of reads and work
    at a time; a file both sides recorded the same content hash for, or keep as the same
    file (a hard link), is not read.
    ``progress`` shows a bar of bytes compared (default: when stderr is a terminal)."""
    RestoreOptions.of(locals())
    tolerance = _tolerance("atol", atol), _tolerance("rtol", rtol)
    patterns = _patterns(paths)
    ra = open_reader(a, allow_pickle=allow_pickle)
    rb = open_reader(b, allow_pickle=allow_pickle)
    in_a = [p for p in ra if _selected(p, patterns)]
    in_b = [p for p in rb if _selected(p, patterns)]
    set_a, set_b = set(in_a), set(in_b)
    both = [p for p in in_a if p in set_b]
    where = f"{ra.checkpoint.location} and {rb.checkpoint.location}"
    found: list[LeafDiff | _ArrayWork] = []
    with (
        unchanged(ra.checkpoint),  # never data of a checkpoint that replaced the one opened,
        unchanged(rb.checkpoint),  # checked once after every read, as a restore does
        Progress("diff", where, show=progress) as bar,
        ThreadPoolExecutor(2, thread_name_prefix="tsckpt-diff-read") as pool,
        ThreadPoolExecutor(COMPARING_THREADS, thread_name_prefix="tsckpt-diff") as workers,
    ):
        bar.set_total(2 * sum(_array_bytes(ra[p]) for p in both))
        many = workers if COMPARING_THREADS > 1 else None
        sides = _Sides(
            ra.checkpoint, rb.checkpoint, Stored.of(ra.checkpoint), Stored.of(rb.checkpoint), *tolerance,
            max_inflight_bytes, pool, many, bar,
        )
        pipeline = _Pipeline(pool)
        try:
            for p in in_a:
                if p not in set_b:
                    x = ra[p]
                    found.append(LeafDiff(p, "only_in_a", dtype_a=_kind(x)[0], shape_a=_kind(x)[1]))
                    continue
                leaf = _compare_leaf(sides, p, ra[p], rb[p])
                found.append(leaf)
                if isinstance(leaf, _ArrayWork):
                    pipeline.add(leaf)
            for p in in_b:
                if p not in set_a:
                    y = rb[p]
                    found.append(LeafDiff(p, "only_in_b", dtype_b=_kind(y)[0], shape_b=_kind(y)[1]))
            pipeline.drain()
        finally:
            pipeline.close()
    leaves = tuple(f.result() if isinstance(f, _ArrayWork) else f for f in found)
    skipped = sum(f.known for f in found if isinstance(f, _ArrayWork))
    return DiffReport(
        str(ra.checkpoint.location), str(rb.checkpoint.location), *tolerance, leaves,
        sum(leaf.bytes_read for leaf in leaves), skipped,
    )
