"""diff(): what differs between two checkpoints of any formats tsckpt reads, leaf by leaf.

Arrays are compared over A's stored chunk grid, in blocks of whole chunks where one fits the
window, each block read from both sides by restore's read engine (:func:`.engine.read_into`:
the own shard and chunk readers, crc32c checked, where the checkpoint allows), or, where
both sides keep the array in local shard files of one layout, as its stored inner chunks
(:func:`.shardread.read_stored`, crc32c checked) compared where they lie in the buffer
read; so memory stays within the window whatever the checkpoints' size. A piece of the
same bytes on both sides costs a byte comparison; only elements that differ are widened
to float64. A region whose stored data is known equal without reading
(:func:`known_equal`: the same content hash recorded on both sides, the same file on disk,
a hard link, or :func:`one_checkpoint` given twice) is not read; nor, in a shard file
whose hash differs, an inner chunk whose recorded hash is the same on both sides
(:func:`unequal_chunks`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any, Literal, NamedTuple

import numpy as np

from .._base import dtypes as _dtypes
from .._base.leafnames import did_you_mean, listed, spelled, under
from .._base.types import Box, Dest, ReadItem, box_slices
from .._codec.files import node_agrees, opened_directory, stored_starts
from .._codec.route import Place, Route, place, route
from .._codec.shardread import StoredChunk, check_stored, read_stored
from .._errors import StructureMismatchError
from .._ondisk.arrays import chunk_key
from .._ondisk.backing import check_backed
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import cells, shard_boxes
from .._ondisk.readfaults import unchanged
from .._ondisk.records import LAYOUT_PLAIN, ArrayRecord, content_chunks, content_entries
from .._options import READ_WINDOW_BYTES, RestoreOptions, verb
from .._runtime import fork as _fork
from .._runtime.progress import Progress
from .._storage import native
from .._storage.locations import Directory
from ..tree import structure_nodes
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
# Blocks read while one is compared, at most (:class:`_Pipeline`), each on two threads (A, B).
READS_AHEAD = 2
# Read buffers kept for reuse (:class:`_Buffers`): those of a block compared, for the next one read.
KEPT_BUFFERS = 4


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """How one leaf differs between A and B.

    ``status``: ``equal`` (within the tolerance), ``different``, ``only_in_a``, ``only_in_b``,
    ``dtype_changed`` (an array against a value counts as one), ``shape_changed``. ``how`` says
    how the answer was found: ``read`` (data of both sides compared), ``same files`` (known
    equal from what is stored, nothing read), ``value`` (plain values compared; also ``None``
    entries and empty containers, which both sides' recorded trees hold as parts no leaf path
    names, shown as ``value_a``/``value_b``: "None", "{}"), ``structure`` (a container of
    another kind on each side, ``value_a``/``value_b`` naming the kinds), or empty
    when the two sides were not compared. For arrays compared by reading: ``chunks`` in A's
    stored chunk grid, of which ``changed_chunks`` hold an element beyond the tolerance;
    ``changed_elements``; ``max_abs``, the largest ``|a - b|`` (for integer dtypes an exact
    ``int``; infinite where one side is NaN, or where it is beyond the largest float64; NaNs
    at the same index of both sides are equal); ``rel_l2``, ``||a - b|| / ||a||``
    over the finite elements read (a region known equal unread adds nothing to ``a - b``,
    but its part of ``||a||`` is unknown: then ``rel_l2_bound`` and ``rel_l2`` is an upper
    bound, or None where A's part read is all zeros); ``first_index``, the first element beyond the tolerance in C
    order. Plain values: ``value_a`` and ``value_b`` (their repr) when they differ. A leaf that
    only one side names ``path`` is matched with one the other side names alike but for its
    separators (``model/layers.0.weight`` and ``model/layers/0/weight``; each the only such
    name on its side): ``path`` is A's name, ``path_b`` B's.
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
    max_abs: int | float | None = None
    rel_l2: float | None = None
    rel_l2_bound: bool = False  # rel_l2 is an upper bound (or None: not known): regions known equal left unread
    first_index: tuple[int, ...] | None = None
    value_a: str | None = None
    value_b: str | None = None
    path_b: str | None = None  # B's name of the leaf, where it differs from A's only in its separators
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
    another library's checkpoint, or one saved without them), and those of the inner chunks
    of its shard files (key -> hashes, where recorded)."""

    ck: Checkpoint
    hashes: Mapping[str, str]
    chunks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, ck: Checkpoint) -> Stored:
        if ck.foreign:
            return cls(ck, {})
        return cls(ck, {k: e[0] for k, e in content_entries(ck.raw).items()}, content_chunks(ck.raw))


def one_checkpoint(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether A and B are one checkpoint given twice (of any format or layout), not replaced
    in between: every region is known equal."""
    if a.location.local is None or b.location.local is None:
        return False
    return _same_path(str(a.location.local), str(b.location.local)) and a.root_generation == b.root_generation


def known_equal(a: Stored, b: Stored, path: str, region: Box, path_b: str | None = None) -> bool | None:
    """Whether the array ``path`` (in B ``path_b``, where named otherwise) holds the same data
    in A and B over ``region`` (one of A's
    stored shards), known from what is stored, without reading it: True when both sides
    recorded the same content hash for its file (docs/format.md, "Content hashes"), or keep
    it in the same file (a file hard-linked from the other; one checkpoint given twice is
    :func:`one_checkpoint`'s); None when that is not known, and the region must be read."""
    ca, cb = a.ck, b.ck
    local = ca.location.local is not None and cb.location.local is not None
    keys = _shard_keys(a, b, path, region, path_b)
    if keys is None:
        return None
    # a shard not stored (all fill value) or unreadable is read
    ka, kb = keys[1:]
    ha, hb = a.hashes.get(ka), b.hashes.get(kb)
    if ha is not None and hb is not None:
        return True if ha == hb else None  # files of other contents are not one file
    if not local:
        return None
    return True if _same_path(os.path.join(str(ca.location.local), ka), os.path.join(str(cb.location.local), kb)) else None


def _shard_keys(
    a: Stored, b: Stored, path: str, region: Box, path_b: str | None
) -> tuple[ArrayRecord, str, str] | None:
    """A's record of the array ``path`` (in B ``path_b``) and each side's key of the file of the
    shard ``region``, where both sides are tsckpt plain checkpoints storing the array alike
    (dtype, shape, chunking): what makes equal stored bytes equal elements; else None."""
    ca, cb = a.ck, b.ck
    path_b = path if path_b is None else path_b
    ra, rb = ca.arrays.get(ca.aliases.get(path, path)), cb.arrays.get(cb.aliases.get(path_b, path_b))
    if ra is None or rb is None or ca.foreign or cb.foreign or LAYOUT_PLAIN != ca.layout or LAYOUT_PLAIN != cb.layout:
        return None
    if (ra.dtype, ra.shape, ra.chunking) != (rb.dtype, rb.shape, rb.chunking):
        return None  # the same bytes would not decode to the same elements
    return ra, chunk_key(ra, region[0]), chunk_key(rb, region[0])


def unequal_chunks(
    a: Stored, b: Stored, path: str, region: Box, path_b: str | None = None
) -> list[tuple[Box, bool]] | None:
    """The inner chunks of the shard ``region`` (one of A's stored shards, not known equal: its
    files' hashes differ) of the array ``path`` (in B ``path_b``), each with whether its data
    may differ, known from the hashes both sides recorded for the inner chunks of its file
    (docs/format.md, "Content hashes"): a chunk of the same hash on both sides is equal. None
    where that is not known (a side records none, or a list of another length than the
    file's inner chunks): the shard is read whole; so too where every chunk's hash is the
    same on both sides although the files' hashes differ (records that contradict
    themselves prove nothing), and where every one differs (nothing to leave unread: the
    shard is read in blocks of several chunks, not a chunk at a time)."""
    found = _shard_keys(a, b, path, region, path_b)
    chunk = None if found is None else found[0].chunking.chunk_shape
    if found is None or chunk is None:
        return None
    ha, hb = a.chunks.get(found[1]), b.chunks.get(found[2])
    starts = list(stored_starts(region[1], chunk))
    if ha is None or hb is None or not len(ha) == len(hb) == len(starts) or ha == hb:
        return None
    if all(x != y for x, y in zip(ha, hb)):
        return None
    return [
        ((tuple(o + s for o, s in zip(region[0], lo)), tuple(min(c, n - s) for c, n, s in zip(chunk, region[1], lo))),
         x != y)
        for lo, x, y in zip(starts, ha, hb)
    ]


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


class Squares(NamedTuple):
    """A sum of squares as ``scale**2 * ssq``: ``scale`` is 1 where the plain sum is a normal
    float64, else the largest element (:func:`_squares`), so any finite elements give a finite
    sum, whatever their size; infinite ``ssq`` where an element is."""

    ssq: float
    scale: float = 1.0

    @property
    def value(self) -> float:
        """The sum as one float64 (infinite or 0 where it is beyond float64)."""
        with np.errstate(over="ignore", under="ignore"):
            return float(np.float64(self.scale) ** 2 * self.ssq)

    def plus(self, other: Squares) -> Squares:
        """The sum of both, on the larger scale (the smaller one's part of it rounded as it must)."""
        x, y = self.kept(), other.kept()
        if x.scale < y.scale:
            x, y = y, x
        if y.ssq == 0.0:
            return x
        if x.ssq == 0.0:
            return y
        return Squares(x.ssq + (y.ssq if y.scale == x.scale else y.ssq * (y.scale / x.scale) ** 2), x.scale).kept()

    def kept(self) -> Squares:
        """The same sum with ``ssq`` kept far from overflow (rescaled by an exact power of two),
        so that any number of them can be added."""
        if _RESCALE < self.ssq < math.inf:
            return Squares(self.ssq * _RESCALE_BY**2, self.scale / _RESCALE_BY)
        return self


# Sums of squares above this are rescaled by an exact power of two (:meth:`Squares.kept`).
_RESCALE = 2.0**600
_RESCALE_BY = 2.0**-300
NO_SQUARES = Squares(0.0)


@dataclasses.dataclass
class Tally:
    """What the blocks of one array found so far: ``max_abs`` an ``int`` for integer dtypes;
    the sums of the squares of ``|a - b|`` and of ``|a|`` as :class:`Squares` (``sq_diff``
    and ``sq_a``: each as one float64)."""

    changed_chunks: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    changed_elements: int = 0
    max_abs: int | float = 0.0
    squares_diff: Squares = NO_SQUARES
    squares_a: Squares = NO_SQUARES
    first: tuple[int, ...] | None = None

    @property
    def sq_diff(self) -> float:
        return self.squares_diff.value

    @property
    def sq_a(self) -> float:
        return self.squares_a.value


class Scratch:
    """Work memory of the comparisons: one buffer per thread and dtype, reused from piece to
    piece (a fresh temporary per piece costs the allocator, and page faults where it maps one)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, dtype: np.dtype, n: int) -> np.ndarray:
        held: dict[np.dtype, np.ndarray] = self._local.__dict__.setdefault("held", {})
        buf = held.get(dtype)
        if buf is None or buf.size < n:
            buf = held[dtype] = np.empty(n, dtype)
        return buf[:n]


class Found(NamedTuple):
    """What the comparison of one piece found: the largest ``|a - b|`` (an ``int`` for integer
    dtypes; where ``pending``, rounded to the stored dtype: :func:`_exact_max` finds it
    exactly), the sums of the squares of ``|a - b|`` and of ``|a|``, and how many elements differ."""

    max_abs: int | float
    sq_diff: Squares
    sq_a: Squares
    changed: int
    pending: bool = False


def _compare_piece(sa: np.ndarray, sb: np.ndarray, dtype: str, out: np.ndarray, *, atol: float, rtol: float,
                   scratch: Scratch) -> Found:
    """Compare one piece of both sides: whether each element differs into ``out``, and what
    :class:`Found` says. A piece of the same bytes costs a comparison of its bytes; float32
    and float64 pieces without a tolerance are compared as stored (:func:`_stored_differences`);
    elsewhere only the elements that differ are widened to float64 (the others add nothing
    to ``a - b``); integers are compared exactly as stored (:func:`_integer_differences`)."""
    if _same_bits(sa, sb):  # nothing more to learn
        out[:] = False
        return Found(0.0, NO_SQUARES, _squared_norm(sa, dtype, equal=True), 0)
    if sa.dtype in STORED_FLOATS and not (atol or rtol):
        found = _stored_differences(sa, sb, out, scratch)
        if found is not None:
            return found
    sq_a = _squared_norm(sa, dtype, equal=False)
    ne = sa != sb  # NaNs included; 0.0 against -0.0 is no difference
    if ne.ndim > 1:  # complex32: (re, im) pairs
        ne = ne.any(axis=-1)
    count = int(np.count_nonzero(ne))
    if not count:
        out[:] = False
        return Found(0.0, NO_SQUARES, sq_a, 0)
    differences = _integer_differences if is_integer(sa.dtype) else _widened_differences
    if count == ne.size:
        top, sq_diff, bad = differences(sa, sb, dtype, atol=atol, rtol=rtol)
        out[:] = bad
    else:
        idx = np.flatnonzero(ne)
        top, sq_diff, bad = differences(sa[idx], sb[idx], dtype, atol=atol, rtol=rtol)
        out[:] = False
        out[idx] = bad
    return Found(top, sq_diff, sq_a, int(np.count_nonzero(bad)))


def is_integer(dtype: np.dtype) -> bool:
    """Whether elements of ``dtype`` (as numpy holds a stored dtype) are integers: bool, the
    signed and unsigned integers and raw bits, and ml_dtypes' int4."""
    return dtype.kind in "biu" or dtype.name == "int4"


def _integer_differences(ca: np.ndarray, cb: np.ndarray, dtype: str, *, atol: float,
                         rtol: float) -> tuple[int, Squares, np.ndarray]:
    """For integer elements: the largest ``|a - b|`` as an exact ``int``, the sum of the
    squares of ``|a - b|`` (in float64) and whether each element is beyond the tolerance,
    decided exactly: ``|a - b|`` computed in the unsigned integer of the stored width (it
    always fits: no wrap-around, no rounding, as float64 would past 2**53) against the
    largest whole number within the tolerance."""
    if ca.dtype.kind not in "biu":  # int4: held in int8
        ca, cb = ca.astype(np.int8), cb.astype(np.int8)
    unsigned = np.dtype(f"u{ca.dtype.itemsize}")
    ua, ub = ca.view(unsigned), cb.view(unsigned)
    # modulo 2**bits, the difference of the larger and the smaller is exact (two's complement)
    gap = np.where(ca < cb, ub - ua, ua - ub)
    if atol or rtol:
        bound = np.floor(atol + rtol * np.abs(cb.astype(np.float64)) if rtol else np.float64(atol))
        beyond = bound >= float(np.iinfo(unsigned).max)  # every difference of the width is within
        bad = (gap > np.where(beyond, 0.0, bound).astype(unsigned)) & ~beyond
    else:
        bad = gap != 0
    return int(gap.max()), _squares(gap.astype(np.float64), tiny=False), bad


def _widened_differences(ca: np.ndarray, cb: np.ndarray, dtype: str, *, atol: float,
                         rtol: float) -> tuple[float, Squares, np.ndarray]:
    """The largest ``|a - b|`` in float64 (infinite where one side is NaN, 0 where both are
    alike), the sum of the squares of ``|a - b|`` (:class:`Squares`: finite for finite
    elements, even where ``|a - b|`` is beyond float64) and whether each element is beyond the
    tolerance, for elements of ``dtype`` as stored."""
    na, nb = _numbers(ca, dtype), _numbers(cb, dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, 0 * inf
        gap = np.abs(na - nb)
        bound = atol + rtol * np.abs(nb) if rtol else atol
    odd = np.isnan(gap)  # a NaN on either side, or the same infinity on both
    if odd.any():
        alike = odd & ((na == nb) | (np.isnan(na) & np.isnan(nb)))
        gap[odd] = np.inf
        gap[alike] = 0.0
    # no tolerance brings an infinity nearer
    bad = gap > bound if not rtol else (gap > 0) & (~(gap <= bound) | np.isinf(gap))
    top = float(gap.max())
    tiny = dtype in TINY_DTYPES
    if math.isfinite(top):
        return top, _squares(gap, tiny=tiny), bad
    finite = np.isfinite(na) & np.isfinite(nb)
    if not finite.all():  # an infinity or a NaN against a number: infinitely far
        return top, Squares(math.inf), bad
    with np.errstate(over="ignore"):  # finite elements whose difference is beyond float64: halved
        half = np.abs(na / 2 - nb / 2)
    found = _squares(half, tiny=tiny)
    return top, Squares(4 * found.ssq, found.scale), bad


# Stored dtypes whose elements' squares can be too small for float64 (below about 1e-154).
TINY_DTYPES = ("float64", "complex128")


# Stored dtypes whose pieces are compared as stored when no tolerance is given.
STORED_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _stored_differences(sa: np.ndarray, sb: np.ndarray, out: np.ndarray, scratch: Scratch) -> Found | None:
    """Without a tolerance, finite float32 or float64 elements differ where they are unequal,
    found in passes over the stored dtype in reused memory: ``|a - b|``, its largest and the
    sum of its squares (:func:`_stored_sum_of_squares`), the mask and its count. The largest
    ``|a - b|`` exactly is left pending: ``|a - b|`` rounded to the stored dtype keeps the
    order of the exact ones, so :func:`_exact_max` finds it again in float64 where the rounded
    one is largest, in the pieces whose largest is the largest of their block only. None where
    a difference is not finite in the stored dtype (a NaN, an infinity, an overflow): then
    the widened path answers."""
    sq_a = _squared_norm(sa, sa.dtype.name, equal=False)
    d = scratch.get(sa.dtype, sa.size)
    np.subtract(sa, sb, out=d)  # an overflow is found below (the pieces run without FP warnings)
    np.abs(d, out=d)
    top = d.max()
    if not np.isfinite(top):
        return None
    np.not_equal(sa, sb, out=out)  # every element finite: no NaN to tell apart
    count = int(np.count_nonzero(out))
    if not count:
        return Found(0.0, NO_SQUARES, sq_a, 0)
    sq = _stored_sum_of_squares(d)
    if _normal(sq, sa.dtype):
        return Found(float(top), Squares(sq), sq_a, count, pending=True)
    # squares beyond the stored dtype (or too small for it): summed in float64, scaled where need be
    return Found(float(top), _squares(d.astype(np.float64), tiny=sa.dtype == np.float64), sq_a, count, pending=True)


def _exact_max(sa: np.ndarray, sb: np.ndarray, top: float) -> float:
    """The largest ``|a - b|`` in float64 over the elements of a piece whose ``|a - b|`` in the
    stored dtype is ``top``, the piece's largest (:func:`_stored_differences`)."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(np.subtract(sa, sb))
    at = np.flatnonzero(d == top)
    return float(np.abs(sa[at].astype(np.float64) - sb[at].astype(np.float64)).max())


# Elements whose squares one BLAS dot product sums in the stored dtype (:func:`_stored_sum_of_squares`).
DOT_ELEMENTS = 1024


def _stored_sum_of_squares(x: np.ndarray) -> float:
    """The sum of ``x**2`` for flat float32 or float64 ``x``, in one pass without a temporary:
    each :data:`DOT_ELEMENTS` summed by one BLAS dot product in the stored dtype, those sums
    added in float64 (within a relative 1e-6 of a float64 sum; numpy's pairwise sum of the
    squares took about 3x as long). Not finite where a sum overflows or ``x`` holds an
    infinity or a NaN."""
    n = x.size - x.size % DOT_ELEMENTS
    total = 0.0
    if n:
        rows = x[:n].reshape(-1, 1, DOT_ELEMENTS)
        total = float(np.matmul(rows, rows.reshape(-1, DOT_ELEMENTS, 1)).sum(dtype=np.float64))
    if n < x.size:
        rest = x[n:].astype(np.float64)
        total += float(np.dot(rest, rest))
    return total


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes, compared as the widest
    words their addresses allow (a first few kilobytes alone, where they already differ)."""
    x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    n = x.size
    if n > 2 * PREFIX_BYTES and x[:PREFIX_BYTES].tobytes() != y[:PREFIX_BYTES].tobytes():
        return False
    whole = 0
    for word in _WORDS:
        whole = n - n % word.itemsize
        wx, wy = x[:whole].view(word), y[:whole].view(word)
        if whole and wx.flags.aligned and wy.flags.aligned:
            if not (wx == wy).all():
                return False
            break
        whole = 0
    return whole == n or x[whole:].tobytes() == y[whole:].tobytes()


_WORDS = (np.dtype(np.uint64), np.dtype(np.uint32))


@dataclasses.dataclass(frozen=True)
class Pair:
    """One region read from both sides: ``a`` and ``b`` in the stored dtype, C-contiguous, of
    the region's shape (complex32: with its pair dimension)."""

    region: Box
    a: np.ndarray
    b: np.ndarray


def compare_block(a: np.ndarray, b: np.ndarray, dtype: str, region: Box, chunk: Sequence[int], tally: Tally,
                  *, atol: float, rtol: float, piece: int, workers: Executor | None = None,
                  scratch: Scratch | None = None) -> None:
    """Compare one block read from both sides (:func:`compare_blocks`)."""
    compare_blocks([Pair(region, a, b)], dtype, chunk, tally, atol=atol, rtol=rtol, piece=piece, workers=workers,
                   scratch=scratch)


def compare_blocks(pairs: Sequence[Pair], dtype: str, chunk: Sequence[int], tally: Tally, *, atol: float,
                   rtol: float, piece: int, workers: Executor | None = None, scratch: Scratch | None = None) -> None:
    """Compare regions read from both sides, ``piece`` elements at a time (on ``workers``, the
    pieces of every region at once; ``scratch``: their reused work memory), into ``tally``; the
    changed chunks are counted on the grid of ``chunk``. An element differs when
    ``|a - b| > atol + rtol * |b|`` (numpy's isclose); NaNs at the same index are equal, NaN
    against a number infinitely far."""
    scratch = Scratch() if scratch is None else scratch
    two = dtype == "complex32"
    flat = [
        (p.a.reshape(-1, 2) if two else p.a.reshape(-1), p.b.reshape(-1, 2) if two else p.b.reshape(-1),
         np.empty(math.prod(p.region[1]), dtype=bool))
        for p in pairs
    ]
    jobs = [(k, i) for k, (_, _, differs) in enumerate(flat) for i in range(0, differs.size, piece)]

    def one(job: tuple[int, int]) -> Found:
        k, i = job
        fa, fb, differs = flat[k]
        j = i + piece
        with np.errstate(over="ignore", invalid="ignore"):  # overflows and NaNs are looked for where they matter
            return _compare_piece(fa[i:j], fb[i:j], dtype, differs[i:j], atol=atol, rtol=rtol, scratch=scratch)

    found = list(map(one, jobs) if workers is None or len(jobs) < 2 else workers.map(one, jobs))
    top = max((f.max_abs for f in found if f.pending), default=None)
    counts = [0] * len(pairs)
    for (k, i), f in zip(jobs, found):
        if f.pending and f.max_abs == top:
            fa, fb, _ = flat[k]
            tally.max_abs = max(tally.max_abs, _exact_max(fa[i : i + piece], fb[i : i + piece], f.max_abs))
        elif not f.pending:
            tally.max_abs = max(tally.max_abs, f.max_abs)
        tally.squares_diff = tally.squares_diff.plus(f.sq_diff)
        tally.squares_a = tally.squares_a.plus(f.sq_a)
        counts[k] += f.changed
    for p, (_, _, differs), count in zip(pairs, flat, counts):
        if count:
            _count_changed(p.region, chunk, differs, count, tally)


def _count_changed(region: Box, chunk: Sequence[int], differs: np.ndarray, count: int, tally: Tally) -> None:
    """Add the ``count`` elements of ``region`` that differ (``differs``, in C order) to ``tally``:
    the first of them, and the chunks of the grid of ``chunk`` they lie in."""
    shape = region[1]
    tally.changed_elements += count
    first = tuple(int(o + i) for o, i in zip(region[0], np.unravel_index(int(differs.argmax()), shape)))
    tally.first = first if tally.first is None else min(tally.first, first)
    cuts = [range((o // c + 1) * c, o + n, c) for o, n, c in zip(*region, chunk)]
    boxes = cells(region, cuts)
    if len(boxes) == 1 or count == differs.size:  # every chunk of the region changed
        tally.changed_chunks.update(tuple(o // c for o, c in zip(box[0], chunk)) for box in boxes)
        return
    grid = differs.reshape(shape)
    for box in boxes:
        if grid[box_slices(box[0], box[1], region[0])].any():
            tally.changed_chunks.add(tuple(o // c for o, c in zip(box[0], chunk)))


def _sum_of_squares(x: np.ndarray) -> float:
    """The sum of ``x**2`` (real float64 ``x``), in numpy's own loop: BLAS's threads would
    spin against the readers' on a busy machine, for a sum that memory bandwidth bounds anyway."""
    return float(np.einsum("i,i->", x, x))


def _squared_norm(x: np.ndarray, dtype: str, *, equal: bool) -> Squares:
    """The sum of ``|x|**2`` over the finite elements of ``x`` (stored elements of ``dtype``):
    float32 and float64 as :func:`_stored_sum_of_squares` sums them (in float64, scaled, where
    that is beyond the stored dtype: :func:`_squares`), the others in float64. ``equal``: a
    piece equal on both sides, whose sum of 0 is taken as every element 0 (elements whose
    squares are too small for float64 are looked for only where the piece differs)."""
    if x.dtype in STORED_FLOATS:
        total = _stored_sum_of_squares(x)
        if (total == 0.0 and equal) or _normal(total, x.dtype):
            return Squares(total)
    size = x if x.dtype == np.float64 else _numbers(x, dtype)
    if size.dtype.kind == "c":
        size = np.abs(size)
    return _squares(size, tiny=dtype in TINY_DTYPES and not equal)


def _normal(total: float, dtype: np.dtype) -> bool:
    """Whether a sum of squares summed in ``dtype`` (float32 or float64) is finite and far
    above its smallest normal number (squares too small for it, lost, are then below its
    precision)."""
    return _LEAST_NORMAL_SUM[dtype] < total < math.inf


_LEAST_NORMAL_SUM = {d: float(np.finfo(d).tiny) / float(np.finfo(d).eps) ** 2 for d in STORED_FLOATS}


def _squares(x: np.ndarray, *, tiny: bool) -> Squares:
    """The sum of ``x**2`` over the finite elements of real float64 ``x``: summed as they are
    where that is a normal float64, else over them divided by the largest (:class:`Squares`),
    so that finite elements give a finite sum whatever their size. ``tiny``: whether elements
    may be so small that their squares are lost (a sum of 0 is otherwise exact)."""
    total = _sum_of_squares(x)
    if _normal(total, x.dtype) or (total == 0.0 and not tiny):
        return Squares(total)
    if not math.isfinite(total):
        x = x[np.isfinite(x)]
    largest = float(np.abs(x).max()) if x.size else 0.0
    if largest == 0.0:
        return NO_SQUARES
    return Squares(_sum_of_squares(x / largest), largest)


class _Buffers:
    """Aligned memory for the stored bytes of blocks (:func:`read_stored`), given back once a
    block is compared and taken again by the next (fresh memory costs page faults): at most
    :data:`KEPT_BUFFERS` are kept, of ``kept_bytes`` in all."""

    def __init__(self, kept_bytes: int) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._kept = kept_bytes

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, buf in enumerate(self._free) if buf.size >= n]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].size))
        return native.aligned_empty(n)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.size)
            while self._free and (len(self._free) > KEPT_BUFFERS or sum(b.size for b in self._free) > self._kept):
                self._free.pop()  # the largest


@dataclasses.dataclass(frozen=True)
class _Sides:
    """Both checkpoints, the tolerance and the window: what every leaf's comparison needs.
    ``dirs``: each side's directory, open, where its sharded arrays can be read as stored
    chunks (:func:`read_stored`: a local plain checkpoint of the own codec), else None."""

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
    places: tuple[Place | None, Place | None]
    dirs: tuple[int | None, int | None]
    buffers: _Buffers
    scratch: Scratch
    twice: bool  # one checkpoint given twice (:func:`one_checkpoint`)


@dataclasses.dataclass
class _StoredSide:
    """One side's array, read as stored chunks where a block is whole chunks (:func:`read_stored`)."""

    ck: Checkpoint
    dir_fd: int
    rec: ArrayRecord
    buffers: _Buffers
    agrees: bool | None = None  # its zarr.json agrees with its record (checked at its first block)


@dataclasses.dataclass(frozen=True)
class _StoredBlock:
    """A block read as its stored chunks, in the C order of their cells, into ``buffer`` (None:
    they are views of the file's mapping); ``nbytes``: the block's elements' (as a block read
    into an array would hold)."""

    chunks: list[StoredChunk]
    buffer: np.ndarray | None
    nbytes: int


def _block_cells(rec: ArrayRecord, block: Box) -> tuple[tuple[int, ...], list[tuple[int, ...]]] | None:
    """Where the shard holding ``block`` starts, and the cells of its inner chunks the block is,
    in C order; None unless the block is whole inner chunks of one shard (the array's end
    may cut the last)."""
    chunk, shard = rec.chunking.chunk_shape, rec.chunking.shard_shape
    off, ln = block
    if chunk is None or not off:
        return None
    origin = tuple(o // s * s for o, s in zip(off, shard))
    ends = tuple(o + n for o, n in zip(off, ln))
    if any(o % c or (e % c and e != size) or e > g + s
           for o, e, c, size, g, s in zip(off, ends, chunk, rec.shape, origin, shard)):
        return None
    ranges = [range((o - g) // c, -(-(e - g) // c)) for o, e, g, c in zip(off, ends, origin, chunk)]
    return origin, list(itertools.product(*ranges))


class _ArrayWork:
    """The comparison of one array of the same dtype and shape on both sides: its blocks to
    read (:meth:`blocks`), what their comparisons found, and its :class:`LeafDiff` once every
    block is compared (:meth:`result`). Where both sides store it in shard files of one
    layout that the own codec reads, blocks of whole inner chunks are read as stored and
    compared chunk by chunk where they lie in the buffer read (:meth:`_stored_pairs`): no
    chunk is placed into a block, and a chunk of the same bytes on both sides costs a byte
    comparison (and the sum of its squares), as any piece does."""

    def __init__(self, sides: _Sides, path: str, la: LazyArray, lb: LazyArray) -> None:
        self.sides, self.path, self.la, self.lb = sides, path, la, lb
        self.rec = sides.a.arrays[sides.a.aliases.get(path, path)]
        self.chunk = la.metadata.chunk_shape
        self.itemsize = _dtypes.itemsize(la.dtype)
        self.integer = la.dtype != "complex32" and is_integer(_dtypes.numpy_dtype(la.dtype))
        # half the window: two blocks of both sides (one compared while the next is read) and the
        # mask of one; the other half: the float64 work on pieces of a block
        self.limit = max(1, sides.window // 2 // (4 * self.itemsize + 1))
        self.piece = max(1, min(PIECE_ELEMENTS, sides.window // 2 // WORK_BYTES_PER_ELEMENT // COMPARING_THREADS))
        self.tally = Tally()
        self.known = 0  # bytes of A known equal, not read
        self.read = 0  # bytes read, both sides
        stored_a, stored_b = self._stored_sides()
        self.read_a = _reader(sides.a, la, sides.window, stored_a)
        self.read_b = _reader(sides.b, lb, sides.window, stored_b)

    def _stored_sides(self) -> tuple[_StoredSide | None, _StoredSide | None]:
        """Both sides' array as :class:`_StoredSide`, where both store it in shard files the own
        codec reads (:func:`.route`), of one dtype, shape and chunking; else neither."""
        sides, la, lb = self.sides, self.la, self.lb
        rb = sides.b.arrays[self.lb.path]  # B's name (alias resolved), which may be spelled otherwise
        (pa, pb), (da, db) = sides.places, sides.dirs
        if (
            pa is None or pb is None or da is None or db is None
            or not (engine_serves(la) and engine_serves(lb))
            or (self.rec.dtype, self.rec.shape, self.rec.chunking) != (rb.dtype, rb.shape, rb.chunking)
            or route(self.rec, pa) is not Route.SHARD or route(rb, pb) is not Route.SHARD
        ):
            return None, None
        return _StoredSide(sides.a, da, self.rec, sides.buffers), _StoredSide(sides.b, db, rb, sides.buffers)

    def blocks(self) -> Iterator[Box]:
        """The blocks to read: every stored shard of A not known equal (:func:`known_equal`), of
        it only the inner chunks not known equal where both sides record their hashes
        (:func:`unequal_chunks`)."""
        sides = self.sides
        for shard in shard_boxes((0,) * len(self.la.shape), self.la.shape, self.rec.chunking):
            if sides.twice or known_equal(sides.stored_a, sides.stored_b, self.la.path, shard, self.lb.path):
                self._known(shard)
                continue
            inner = None
            if tuple(self.chunk) == self.rec.chunking.chunk_shape:  # blocks of whole inner chunks
                inner = unequal_chunks(sides.stored_a, sides.stored_b, self.la.path, shard, self.lb.path)
            for box, differs in [(shard, True)] if inner is None else inner:
                if differs:
                    yield from blocks(box, self.chunk, self.limit)
                else:
                    self._known(box)

    def _known(self, box: Box) -> None:
        """Count ``box`` as known equal, not read."""
        nbytes = math.prod(box[1]) * self.itemsize
        self.known += nbytes
        self.sides.progress.update(2 * nbytes)

    def compare(self, block: Box, a: np.ndarray | _StoredBlock, b: np.ndarray | _StoredBlock) -> None:
        sides = self.sides
        try:
            if isinstance(a, _StoredBlock) and isinstance(b, _StoredBlock):
                pairs = self._stored_pairs(block, a, b)
            else:
                pairs = [Pair(block, self._array(block, a), self._array(block, b))]
            compare_blocks(pairs, self.la.dtype, self.chunk, self.tally, atol=sides.atol, rtol=sides.rtol,
                           piece=self.piece, workers=sides.workers, scratch=sides.scratch)
        finally:
            for got in (a, b):
                if isinstance(got, _StoredBlock) and got.buffer is not None:
                    sides.buffers.give(got.buffer)
        n = 2 * math.prod(block[1]) * self.itemsize
        sides.progress.update(n, 2)
        self.read += n

    def _stored_pairs(self, block: Box, a: _StoredBlock, b: _StoredBlock) -> list[Pair]:
        """The chunks of a block read as stored from both sides, as regions to compare, each
        in the array's coordinates: its elements in place, not copied into a block (a chunk
        at the array's end: its part in the array)."""
        rec = self.rec
        dt = _dtypes.numpy_dtype(rec.dtype)
        chunk = rec.chunking.chunk_shape or ()
        origin = tuple(o // s * s for o, s in zip(block[0], rec.chunking.shard_shape))
        pairs = []
        for x, y in zip(a.chunks, b.chunks):
            first = tuple(g + k * c for g, k, c in zip(origin, x.cell, chunk))
            ln = tuple(min(c, n - f) for c, f, n in zip(chunk, first, rec.shape))
            pairs.append(Pair((first, ln), _chunk_elements(x, dt, chunk, ln), _chunk_elements(y, dt, chunk, ln)))
        return pairs

    def _array(self, block: Box, got: np.ndarray | _StoredBlock) -> np.ndarray:
        """A block of one side as an array: read so, or assembled from its stored chunks (where
        the other side's file was read by the engine)."""
        if isinstance(got, np.ndarray):
            return got
        rec = self.rec
        dt = _dtypes.numpy_dtype(rec.dtype)
        chunk = rec.chunking.chunk_shape or ()
        origin = tuple(o // s * s for o, s in zip(block[0], rec.chunking.shard_shape))
        out = np.empty(block[1], dtype=dt)
        for x in got.chunks:
            first = tuple(g + k * c for g, k, c in zip(origin, x.cell, chunk))
            ln = tuple(min(c, n - f) for c, f, n in zip(chunk, first, rec.shape))
            out[box_slices(first, ln, block[0])] = _chunk_elements(x, dt, chunk, ln)
        return out

    def result(self) -> LeafDiff:
        tally, read, shape = self.tally, self.read, self.la.shape
        rel: float | None = _relative(tally.squares_diff, tally.squares_a) if read else 0.0
        bound = bool(read and self.known and tally.changed_elements)
        if bound and rel == math.inf:  # A's part read is all zeros; its part left unread, unknown
            rel = None
        return LeafDiff(
            self.path, "different" if tally.changed_elements else "equal",
            "read" if read or not self.known else "same files",
            self.la.dtype, self.lb.dtype, shape, self.lb.shape,
            chunks=math.prod(-(-n // c) for n, c in zip(shape, self.chunk)),
            changed_chunks=len(tally.changed_chunks), changed_elements=tally.changed_elements,
            max_abs=(int(tally.max_abs) if self.integer else float(tally.max_abs)) if read else 0 if self.integer else 0.0,
            rel_l2=rel, rel_l2_bound=bound, first_index=tally.first, bytes_read=read,
        )


def _chunk_elements(chunk: StoredChunk, dtype: np.dtype, shape: Sequence[int], within: tuple[int, ...]) -> np.ndarray:
    """The elements of a stored chunk of ``shape`` that lie in the array (the first ``within``
    along each dimension; a chunk at the array's end is stored whole), C-contiguous."""
    elements = chunk.data.view(dtype).reshape(tuple(shape))
    if within == tuple(shape):
        return elements
    return np.ascontiguousarray(elements[tuple(slice(0, n) for n in within)])


_Reading = tuple[_ArrayWork, Box, "Future[Any]", "Future[Any]", int]


class _Pipeline:
    """The blocks of every array, read ahead of the comparison, across arrays: the next
    blocks' reads (the next array's, at an array's last block) run while a block is compared,
    so reading and comparing overlap whatever the size of the arrays. Blocks are read ahead
    while those held (read, being read, or compared: both sides and a mask each) fit in
    ``budget`` bytes, at most :data:`READS_AHEAD` blocks while one is compared, always one."""

    def __init__(self, pool: Executor, budget: int) -> None:
        self.pool, self.budget = pool, budget
        self.ahead: collections.deque[_Reading] = collections.deque()
        self.held = 0

    def add(self, work: _ArrayWork) -> None:
        for block in work.blocks():
            cost = math.prod(block[1]) * (2 * work.itemsize + 1)
            while self.ahead and (self.held + cost > self.budget or len(self.ahead) > READS_AHEAD):
                if len(self.ahead) == 1:  # the next block's reads start before this one is compared
                    self._submit(work, block, cost)
                    self._settle()
                    break
                self._settle()
            else:
                self._submit(work, block, cost)

    def _submit(self, work: _ArrayWork, block: Box, cost: int) -> None:
        self.ahead.append((work, block, self.pool.submit(work.read_a, block), self.pool.submit(work.read_b, block), cost))
        self.held += cost

    def drain(self) -> None:
        while self.ahead:
            self._settle()

    def close(self) -> None:
        """After an error: the reads under way are waited for, not left to write into freed blocks."""
        for _, _, da, db, _ in self.ahead:
            da.cancel()
            db.cancel()
            wait([da, db])
        self.ahead.clear()

    def _settle(self) -> None:
        work, block, da, db, cost = self.ahead.popleft()
        try:
            work.compare(block, da.result(), db.result())
        finally:
            self.held -= cost


def engine_serves(leaf: LazyArray) -> bool:
    """Whether the read engine of a restore reads ``leaf``'s blocks for diff (its own shard
    and chunk readers where the checkpoint allows, else TensorStore or another format's
    source): a plain stored array of a stored dtype numpy holds; the rest (a mapped leaf,
    complex32's float16 pairs) is read through the lazy reader."""
    return type(leaf) is LazyArray and leaf.dtype != "complex32"


def _reader(ck: Checkpoint, leaf: LazyArray, window: int,
            stored: _StoredSide | None = None) -> Callable[[Box], np.ndarray | _StoredBlock]:
    """How one side's blocks are read: as stored chunks where ``stored`` says so and a block
    is whole inner chunks (:func:`read_stored`), else through the engine where
    :func:`engine_serves`, else the lazy reader; the last two in the stored dtype, with the
    same checks (that the checkpoint was not replaced: once over the whole diff, see :func:`diff`)."""
    if not engine_serves(leaf):
        return lambda block: leaf.read_box(box_slices(*block))
    path = ck.aliases.get(leaf.path, leaf.path)
    dtype = _dtypes.numpy_dtype(leaf.dtype)

    def read(block: Box) -> np.ndarray | _StoredBlock:
        _fork.enter(f"reading '{leaf.path}'")
        found = None if stored is None else _read_stored_block(stored, block)
        if found is not None:
            return found
        out = np.empty(block[1], dtype=dtype)
        check_backed(ck, [path], box_slices(*block))
        read_into(ck, [Dest(ReadItem(path, *block), out, None)], window=window)
        return out

    return read


def _read_stored_block(side: _StoredSide, block: Box) -> _StoredBlock | None:
    """``block`` of one side read as its stored chunks (:func:`read_stored`), into a buffer of
    ``side.buffers``, each chunk's crc32c checked; None where it is not whole inner chunks, the array's zarr.json does not
    agree with its record, or its file is left to the engine."""
    where = _block_cells(side.rec, block)
    if where is None:
        return None
    if side.agrees is None:
        side.agrees = node_agrees(side.dir_fd, side.rec)
    if not side.agrees:
        return None
    taken: list[np.ndarray] = []

    def take(n: int) -> np.ndarray:
        taken.append(side.buffers.take(n))
        return taken[-1]

    chunks = read_stored(side.ck, side.dir_fd, side.rec, *where, take)
    if chunks is None:
        for buf in taken:
            side.buffers.give(buf)
        return None
    for chunk in chunks:  # as the engine checks every chunk it reads (on this reading thread)
        check_stored(side.ck, side.rec.path, chunk)
    return _StoredBlock(chunks, taken[0] if taken else None, math.prod(block[1]) * _dtypes.itemsize(side.rec.dtype))


def _relative(sq_diff: Squares, sq_a: Squares) -> float:
    """``||a - b|| / ||a||`` from the sums of squares (finite where both are and ``||a||`` is not 0)."""
    if sq_diff.ssq == 0.0:
        return 0.0
    if not sq_a.ssq > 0.0:
        return math.inf
    with np.errstate(over="ignore"):
        return float(np.float64(math.sqrt(sq_diff.ssq) / math.sqrt(sq_a.ssq)) * (sq_diff.scale / sq_a.scale))


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


# How an empty node of a tree reads in a report (a leaf-less part of it, which no leaf path names).
_EMPTY = {"none": "None", "dict": "{}", "ordereddict": "OrderedDict()", "list": "[]", "tuple": "()"}


_DIGIT_KEY = re.compile(r"^%3([0-9][0-9]*)$")  # a str key of digits as tsckpt escapes it (tree.escape)


def _alike(only_a: Sequence[str], only_b: Sequence[str]) -> dict[str, str]:
    """A's leaves that B names alike but for separators (``/`` and ``.``, as --paths takes them)
    -> B's names: a nested tree against the flat names of another format, say. A spelling
    two leaves of one side share matches nothing."""
    def unique(paths: Sequence[str]) -> dict[str, str]:
        found: dict[str, list[str]] = {}
        for p in paths:  # a key of digits ("0", stored as %30) spelled as the index it reads as
            found.setdefault(spelled("/".join(_DIGIT_KEY.sub(r"\1", c) for c in p.split("/"))), []).append(p)
        return {k: v[0] for k, v in found.items() if len(v) == 1}

    a, b = unique(only_a), unique(only_b)
    return {path: b[key] for key, path in a.items() if key in b}


def _chosen(
    leaves_a: Sequence[str], leaves_b: Sequence[str], patterns: tuple[str, ...] | None
) -> tuple[list[str], list[str], dict[str, str]]:
    """The leaves of each side ``patterns`` select, and A's leaves B names alike (:func:`_alike`)
    among them -> B's names. Leaves are paired first: a pattern that selects either leaf of a
    pair selects both (``model/layers.0.w`` against B's ``model/layers/0/w``)."""
    names_a, names_b = set(leaves_a), set(leaves_b)
    alike = _alike([p for p in leaves_a if p not in names_b], [p for p in leaves_b if p not in names_a])
    partner = {b: a for a, b in alike.items()}
    in_a = [p for p in leaves_a if _selected(p, patterns) or (p in alike and _selected(alike[p], patterns))]
    in_b = [p for p in leaves_b if _selected(p, patterns) or (p in partner and _selected(partner[p], patterns))]
    chosen_a = set(in_a)
    return in_a, in_b, {a: b for a, b in alike.items() if a in chosen_a}


def _named_b(leaf: LeafDiff, renamed: dict[str, str]) -> LeafDiff:
    return dataclasses.replace(leaf, path_b=renamed[leaf.path]) if leaf.path in renamed else leaf


# The smallest window diff works in: blocks of fewer bytes pay their per-block work (reads,
# passes, bookkeeping) for a handful of elements each; a restore likewise reads at least a
# chunk at a time whatever its window.
LEAST_WINDOW = 1 << 20


def _empty_at(nodes: dict[str, tuple[str, bool]], path: str) -> str | None:
    """How the empty node at ``path`` of a tree (:func:`tsckpt.tree.structure_nodes`) reads ("None", "{}"), or None."""
    node = nodes.get(path)
    return _EMPTY.get(node[0], node[0]) if node is not None and node[1] else None


def _containers(
    na: dict[str, tuple[str, bool]], nb: dict[str, tuple[str, bool]], patterns: tuple[str, ...] | None,
    leaves: set[str],
) -> list[LeafDiff]:
    """The parts of two trees no leaf path names (``None`` entries, empty containers) and the
    containers whose kind differs (a list against a tuple), where both sides have a tree
    structure (:func:`tsckpt.tree.structure_nodes`): without them two checkpoints of different trees would read as
    equal. A path either side has a leaf at (``leaves``) is the leaf's comparison's."""
    out: list[LeafDiff] = []
    for path in [*na, *(p for p in nb if p not in na)]:
        if not path or not _selected(path, patterns) or path in leaves:
            continue
        a, b = na.get(path), nb.get(path)
        if a is not None and b is not None:
            if a[0] != b[0]:
                shown_a, shown_b = _EMPTY.get(a[0], a[0]), _EMPTY.get(b[0], b[0])
                out.append(LeafDiff(path, "different", how="structure", value_a=shown_a, value_b=shown_b))
            elif a[1]:
                out.append(LeafDiff(path, "equal", how="value"))
        elif a is not None and a[1]:
            out.append(LeafDiff(path, "only_in_a", value_a=_empty_at(na, path)))
        elif b is not None and b[1]:
            out.append(LeafDiff(path, "only_in_b", value_b=_empty_at(nb, path)))
    return out


def _selected(path: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(under(path, p) for p in patterns)


def _check_selected(patterns: tuple[str, ...], selected: Sequence[str], leaves_a: Sequence[str],
                    leaves_b: Sequence[str], a: str, b: str) -> None:
    """A pattern of ``paths`` that selects no leaf of either side is a mistake (a typo, another
    spelling), not a filter that leaves nothing to differ: a StructureMismatchError naming it."""
    missing = [p for p in patterns if not any(under(x, p) for x in selected)]
    if missing:
        known = set(leaves_a)
        leaves = [*leaves_a, *(p for p in leaves_b if p not in known)]
        raise StructureMismatchError(
            f"paths {listed(missing)} select no leaf of {a} or {b}; a leaf path has '/' or '.' between its "
            f"parts, as `tsckpt ls` lists them (here {listed(leaves, 3)}), and a glob selects the leaves it "
            f"matches and those below (e.g. 'model/*' or 'model'); {did_you_mean(missing[0], leaves, a, prefixes=True)}"
        )


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


def _own_shards(ck: Checkpoint) -> Place | None:
    """Where the own codec reads ``ck``'s shard files itself (a local plain checkpoint, as
    :func:`.route.place` says), else None."""
    if ck.lazy:
        return None
    where = place(ck.data(), ck.layout, foreign=ck.foreign)
    return where if where.directory is not None else None


@contextlib.contextmanager
def _directory(where: Place | None) -> Iterator[int | None]:
    """The directory of ``where`` open while the diff runs; None when there is none or it
    cannot be opened (the engine then reads every block)."""
    if where is None or where.directory is None:
        yield None
        return
    with opened_directory(where.directory) as fd:
        yield fd


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

    Leaves are matched by path; ``paths`` (leaf paths or glob patterns, ``/`` and ``.`` alike
    between their parts, as ls takes them: ``"model/*"``, ``"model.layers.0"``) keeps only the
    leaves at or below a match of one; one that selects no leaf of A or B is a
    :class:`~tsckpt.StructureMismatchError`. Arrays of the same dtype and shape are compared element by element:
    equal when ``|a - b| <= atol + rtol * |b|`` (numpy's isclose; NaNs at the same index are
    equal; complex numbers by the modulus of the difference); the counts of changed chunks
    are over A's stored chunk grid. Plain values are compared by value, exactly. Data is read
    in blocks by the reader :func:`tsckpt.restore` uses, at most ``max_inflight_bytes`` of reads and work
    at a time (at least :data:`LEAST_WINDOW`); a file both sides recorded the same content hash for, or keep as the same
    file (a hard link), is not read.
    ``progress`` shows a bar of bytes compared (default: when stderr is a terminal)."""
    RestoreOptions.of(locals())
    max_inflight_bytes = max(max_inflight_bytes, LEAST_WINDOW)
    tolerance = _tolerance("atol", atol), _tolerance("rtol", rtol)
    patterns = _patterns(paths)
    ra = open_reader(a, allow_pickle=allow_pickle)
    rb = open_reader(b, allow_pickle=allow_pickle)
    in_a, in_b, renamed = _chosen(list(ra), list(rb), patterns)
    set_a, set_b = set(in_a), set(in_b)
    if patterns is not None:
        _check_selected(patterns, [*in_a, *in_b], list(ra), list(rb), str(ra.checkpoint.location),
                        str(rb.checkpoint.location))
    sa, sb = ra.checkpoint.structure, rb.checkpoint.structure
    na, nb = (structure_nodes(sa), structure_nodes(sb)) if sa is not None and sb is not None else ({}, {})
    both = [p for p in in_a if p in set_b or p in renamed]
    where = f"{ra.checkpoint.location} and {rb.checkpoint.location}"
    found: list[LeafDiff | _ArrayWork] = []
    places = _own_shards(ra.checkpoint), _own_shards(rb.checkpoint)
    with (
        unchanged(ra.checkpoint),  # never data of a checkpoint that replaced the one opened,
        unchanged(rb.checkpoint),  # checked once after every read, as a restore does
        Progress("diff", where, show=progress) as bar,
        _directory(places[0]) as dir_a,
        _directory(places[1]) as dir_b,
        ThreadPoolExecutor(2 * READS_AHEAD, thread_name_prefix="tsckpt-diff-read") as pool,
        ThreadPoolExecutor(COMPARING_THREADS, thread_name_prefix="tsckpt-diff") as workers,
    ):
        bar.set_total(2 * sum(_array_bytes(ra[p]) for p in both))
        many = workers if COMPARING_THREADS > 1 else None
        sides = _Sides(
            ra.checkpoint, rb.checkpoint, Stored.of(ra.checkpoint), Stored.of(rb.checkpoint), *tolerance,
            max_inflight_bytes, pool, many, bar, places, (dir_a, dir_b), _Buffers(max_inflight_bytes // 4), Scratch(),
            one_checkpoint(ra.checkpoint, rb.checkpoint),
        )
        pipeline = _Pipeline(pool, max_inflight_bytes // 2)
        try:
            for p in in_a:
                if p not in set_b and p not in renamed:
                    x = ra[p]
                    other = _empty_at(nb, p)  # B: None, {} there
                    found.append(
                        LeafDiff(p, "dtype_changed", dtype_a=_kind(x)[0], shape_a=_kind(x)[1], dtype_b=other)
                        if other is not None else LeafDiff(p, "only_in_a", dtype_a=_kind(x)[0], shape_a=_kind(x)[1])
                    )
                    continue
                leaf = _compare_leaf(sides, p, ra[p], rb[renamed.get(p, p)])
                found.append(leaf)
                if isinstance(leaf, _ArrayWork):
                    pipeline.add(leaf)
            taken = set(renamed.values())
            for p in in_b:
                if p not in set_a and p not in taken:
                    y = rb[p]
                    other = _empty_at(na, p)  # A: None, {} there
                    found.append(
                        LeafDiff(p, "dtype_changed", dtype_a=other, dtype_b=_kind(y)[0], shape_b=_kind(y)[1])
                        if other is not None else LeafDiff(p, "only_in_b", dtype_b=_kind(y)[0], shape_b=_kind(y)[1])
                    )
            pipeline.drain()
        finally:
            pipeline.close()
    found.extend(_containers(na, nb, patterns, set_a | set_b))
    leaves = tuple(_named_b(f.result() if isinstance(f, _ArrayWork) else f, renamed) for f in found)
    skipped = sum(f.known for f in found if isinstance(f, _ArrayWork))
    return DiffReport(
        str(ra.checkpoint.location), str(rb.checkpoint.location), *tolerance, leaves,
        sum(leaf.bytes_read for leaf in leaves), skipped,
    )
