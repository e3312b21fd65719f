"""Transforms on read: rules that map stored leaves to target leaves, and the planner that
turns a target region into the stored boxes to read and where each goes.

A :class:`Rule` names stored leaves by a path template (``params/{name}/kernel``) and the
target leaf it gives (``{name}.weight``), through views applied to the stored array:
:class:`Transpose`, :class:`Reshape`, :class:`Split` (one stored array into several
targets) and :class:`Concat` (several stored arrays into one target). A :class:`Rules`
is an ordered set of rules; :meth:`Rules.resolve` applies it to a checkpoint's leaves.

The planner (:func:`plan`) works backwards from a target region: each piece it returns is
one stored box and the operations (slices, permutations, reshapes: views, never copies)
that turn the target region's memory into memory of that box's shape. Reading the box
into that view fills the target, so a transposed target never needs a transposed copy
of the whole array, and each rank reads only the preimage of its own region.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import numpy as np

from .._errors import ShapeMismatchError, StructureMismatchError
from . import dtypes as _dtypes
from .lazytorch import is_dtype

# The most flat runs a reshaped target region may be cut into (a region whose rows are
# not contiguous in the reshaped array); more is refused rather than read slowly.
MAX_RUNS = 4096


class MappingError(StructureMismatchError):
    """A mapping's rules cannot map the checkpoint's leaves: no match for a rule's other
    sources, two rules for one target, a view that does not fit the stored shape."""


@dataclasses.dataclass(frozen=True)
class Transpose:
    """The stored array's axes permuted: target axis ``d`` is stored axis ``perm[d]``
    (numpy's ``transpose(perm)``)."""

    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "perm", tuple(int(p) for p in self.perm))
        if sorted(self.perm) != list(range(len(self.perm))):
            raise ValueError(f"Transpose{self.perm}: perm must be a permutation of 0..{len(self.perm) - 1}")


@dataclasses.dataclass(frozen=True)
class Reshape:
    """The array in a new shape, C order (numpy's ``reshape``); one entry may be -1."""

    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if sum(s == -1 for s in self.shape) > 1 or any(s < -1 for s in self.shape):
            raise ValueError(f"Reshape{self.shape}: sizes must be >= 0, with at most one -1")


@dataclasses.dataclass(frozen=True)
class Split:
    """A fused array cut along ``axis`` into the rule's targets, in order: ``parts`` equal
    parts (an int), or parts of the given sizes (a tuple)."""

    axis: int
    parts: int | tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.parts, int):
            object.__setattr__(self, "parts", tuple(int(p) for p in self.parts))


@dataclasses.dataclass(frozen=True)
class Concat:
    """The rule's stored arrays (each through the views before this one) joined along
    ``axis`` into one target."""

    axis: int


View = Union[Transpose, Reshape, Split, Concat]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Stored leaves matching ``stored`` give the target leaf ``target`` through ``views``.

    Templates are paths with wildcards: ``{name}`` matches one name (no ``/`` nor ``.``),
    ``{name*}`` any text; a target template uses the same names. ``sep=("/", ".")``
    replaces ``/`` by ``.`` in what the wildcards matched (``blocks/0/mlp`` becomes
    ``blocks.0.mlp``, as torch names modules; a str key of digits, escaped as ``%30``
    where Orbax stores a list's items so, is written as its digits). Several stored templates (a tuple) are
    joined by a :class:`Concat` view; several target templates are cut from one stored
    array by a :class:`Split` view. ``ndim`` restricts the rule to stored arrays of that
    many dimensions (a torch ``weight`` of a Linear and of a LayerNorm differ only there).
    ``dtype`` (a name such as ``"float32"``, a numpy or torch dtype) casts what is read into
    that dtype, under the restore's ``casting=`` rules: the target leaf has that dtype.
    """

    stored: str | tuple[str, ...]
    target: str | tuple[str, ...]
    views: tuple[View, ...] | View = ()
    sep: tuple[str, str] | None = None
    ndim: int | None = None
    dtype: Any = None

    def __post_init__(self) -> None:
        for field in ("stored", "target"):  # several templates given as a list, as often written
            if isinstance(getattr(self, field), list):
                object.__setattr__(self, field, tuple(getattr(self, field)))
            templates = getattr(self, field)
            if not (isinstance(templates, str) or (isinstance(templates, tuple) and templates
                                                   and all(isinstance(t, str) for t in templates))):
                raise TypeError(f"{self}: {field} is a template (a str) or several (a tuple of str), not {templates!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", _dtype_name(self, self.dtype))
        if isinstance(self.views, list):
            object.__setattr__(self, "views", tuple(self.views))
        if not isinstance(self.views, tuple):
            object.__setattr__(self, "views", (self.views,))
        views: tuple[View, ...] = self.views  # type: ignore[assignment]
        bad = [v for v in views if not isinstance(v, (Transpose, Reshape, Split, Concat))]
        if bad:
            raise TypeError(f"{self}: views are Transpose, Reshape, Split or Concat, not {bad[0]!r}")
        concats = sum(isinstance(v, Concat) for v in views)
        splits = sum(isinstance(v, Split) for v in views)
        if concats != (1 if isinstance(self.stored, tuple) else 0):
            raise ValueError(f"{self}: several stored templates need exactly one Concat view, one template none")
        if splits != (1 if isinstance(self.target, tuple) else 0):
            raise ValueError(f"{self}: several target templates need exactly one Split view, one template none")
        if concats and splits:
            raise ValueError(f"{self}: a rule either joins stored arrays (Concat) or cuts one (Split), not both")
        for s in self.stored_templates:
            _template(s)
        names = set(_template(self.stored_templates[0])[1])
        for t in self.target_templates:
            missing = set(_template(t)[1]) - names
            if missing:
                raise ValueError(f"{self}: the target template {t!r} uses {sorted(missing)}, which the stored one lacks")

    @property
    def stored_templates(self) -> tuple[str, ...]:
        return self.stored if isinstance(self.stored, tuple) else (self.stored,)

    @property
    def target_templates(self) -> tuple[str, ...]:
        return self.target if isinstance(self.target, tuple) else (self.target,)

    def __str__(self) -> str:
        views = ", ".join(repr(v) for v in self.views) if isinstance(self.views, tuple) else repr(self.views)
        cast = f", dtype={self.dtype}" if self.dtype is not None else ""
        return f"Rule({self.stored!r} -> {self.target!r}{', ' + views if views else ''}{cast})"


def _dtype_name(rule: Rule, dtype: Any) -> str:
    """The logical name of a rule's ``dtype``; TypeError for one tsckpt does not store."""
    try:
        name = _dtypes.torch_name(dtype) if is_dtype(dtype) else dtype if _dtypes.is_known(dtype) else (
            _dtypes.numpy_name(np.dtype(dtype)))
    except TypeError:
        name = None
    if name is None or not _dtypes.is_known(name):
        raise TypeError(f"Rule({rule.stored!r} -> {rule.target!r}): dtype {dtype!r} is not a dtype tsckpt reads")
    return str(name)


_WILD = re.compile(r"\{(\w+)(\*?)\}")


def _template(text: str) -> tuple[re.Pattern[str], list[str]]:
    """The regular expression of a template and its wildcard names, in order."""
    out, names, pos = [], [], 0
    for m in _WILD.finditer(text):
        out.append(re.escape(text[pos : m.start()]))
        if m.group(1) in names:
            raise ValueError(f"template {text!r} names {{{m.group(1)}}} twice")
        names.append(m.group(1))
        out.append(f"(?P<{m.group(1)}>.+?)" if m.group(2) else f"(?P<{m.group(1)}>[^/.]+)")
        pos = m.end()
    out.append(re.escape(text[pos:]))
    return re.compile("".join(out)), names


# A path component that is an escaped int-like str key (``"0"`` is stored as ``%30``, as
# Orbax names a list of modules): torch names such an item by its digits.
_ESCAPED_INT = re.compile(r"%(3[0-9]|2D)([0-9]*)")


def _fill(text: str, captured: Mapping[str, str], sep: tuple[str, str] | None) -> str:
    def sub(m: re.Match[str]) -> str:
        value = captured[m.group(1)]
        if not sep:
            return value
        if sep[0] == "/":  # path components into a module name: an escaped digit key is its digits
            value = "/".join(_digits(c) for c in value.split("/"))
        return value.replace(sep[0], sep[1])

    return _WILD.sub(sub, text)


def _digits(component: str) -> str:
    m = _ESCAPED_INT.fullmatch(component)
    return chr(int(m.group(1), 16)) + m.group(2) if m else component


@dataclasses.dataclass(frozen=True)
class Rules:
    """Rules tried in order: the first whose stored template matches a stored leaf claims it.
    Stored leaves no rule claims keep their paths (``unmatched="keep"``), or are left out
    (``"drop"``: the rules pick a part of a larger checkpoint, such as a model's parameters
    beside its optimizer's state)."""

    rules: tuple[Rule, ...]
    unmatched: str = "keep"

    def __init__(self, rules: Iterable[Rule], *, unmatched: str = "keep") -> None:
        rules = tuple(rules)
        bad = [r for r in rules if not isinstance(r, Rule)]
        if bad:
            raise TypeError(f"a Rules holds Rule objects, not {bad[0]!r}")
        if unmatched not in ("keep", "drop"):
            raise ValueError(f'unmatched must be "keep" or "drop", not {unmatched!r}')
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "unmatched", unmatched)

    def __add__(self, other: Rules) -> Rules:
        return Rules(self.rules + other.rules, unmatched=self.unmatched)

    def resolve(self, arrays: Mapping[str, tuple[tuple[int, ...], str]], values: Iterable[str] = ()) -> dict[str, Mapped]:
        """The target leaves this mapping makes of stored ``arrays`` (path -> (shape, dtype))
        and plain ``values`` (paths): target path -> :class:`Mapped`, in stored order."""
        claimed: list[tuple[str, list[Mapped]]] = []
        compiled = [(rule, [_template(s)[0] for s in rule.stored_templates]) for rule in self.rules]
        for path in [*arrays, *values]:
            is_array = path in arrays
            for rule, patterns in compiled:
                m = patterns[0].fullmatch(path)
                if m is None or (rule.ndim is not None and (not is_array or len(arrays[path][0]) != rule.ndim)):
                    continue
                claimed.append((path, _apply(rule, m.groupdict(), path, arrays, is_array)))
                break
            else:
                claimed.append((path, [_own(path, arrays[path]) if is_array else _value(path)]))
        joined = {s for _, leaves in claimed for leaf in leaves if leaf.rule is not None for s in leaf.sources[1:]}
        out: dict[str, Mapped] = {}
        made_by: dict[str, tuple[Rule | None, str]] = {}
        for path, leaves in claimed:
            for leaf in leaves:
                if leaf.rule is None and (path in joined or self.unmatched == "drop"):
                    continue  # read as part of a joined target, or not wanted
                if leaf.target in made_by:
                    first_rule, first_path = made_by[leaf.target]
                    raise MappingError(
                        f"target '{leaf.target}' is made twice: from stored '{first_path}' by "
                        f"{first_rule or 'no rule (its own name)'} and from stored '{path}' by "
                        f"{leaf.rule or 'no rule (its own name)'}; a target may come from one rule only"
                    )
                made_by[leaf.target] = (leaf.rule, path)
                out[leaf.target] = leaf
        return out


@dataclasses.dataclass(frozen=True)
class Mapped:
    """One target leaf of a mapping: the rule (None: a stored leaf under its own name), its
    stored sources, each source's views before a concat, the concat axis, the views after
    it, and the target's shape and dtype. ``pre_shapes[i]``: the shapes of source ``i``
    through its views; ``post_shapes``: the shapes through the views after the concat."""

    target: str
    rule: Rule | None
    sources: tuple[str, ...]
    pre_shapes: tuple[tuple[tuple[int, ...], ...], ...]
    pre_views: tuple[View, ...]
    concat: int | None
    post_views: tuple[_Part | Transpose | Reshape, ...]
    shape: tuple[int, ...]
    dtype: str
    post_shapes: tuple[tuple[int, ...], ...] = ()
    is_value: bool = False
    cast_from: str | None = None  # the stored dtype, where the rule casts it into ``dtype``

    def origin(self) -> str:
        """Where the target comes from, for listings: the stored paths and the views."""
        views = [repr(v) for v in self.pre_views]
        if self.concat is not None:
            views.append(f"Concat(axis={self.concat})")
        views += [repr(v) for v in self.post_views]
        if self.cast_from is not None:
            views.append(f"{self.cast_from} as {self.dtype}")
        return " + ".join(self.sources) + (f" | {', '.join(views)}" if views else "")

    def where(self) -> str:
        """The rule, stored and target paths, for messages."""
        stored = " + ".join(f"'{s}'" for s in self.sources)
        return f"{self.rule} (stored {stored}, target '{self.target}')"


@dataclasses.dataclass(frozen=True)
class _Part:
    """Part ``index`` of a :class:`Split`: the span [start, start + size) of ``axis``."""

    axis: int
    start: int
    size: int

    def __repr__(self) -> str:
        return f"Split(axis={self.axis})[{self.start}:{self.start + self.size}]"


def _own(path: str, array: tuple[tuple[int, ...], str]) -> Mapped:
    """A stored array no rule claims: the target of its own name, as stored."""
    return Mapped(path, None, (path,), ((array[0],),), (), None, (), array[0], array[1], (array[0],))


def _value(path: str) -> Mapped:
    """A plain value no rule claims: the target of its own name."""
    return Mapped(path, None, (path,), (), (), None, (), (), "", is_value=True)


def _apply(
    rule: Rule, captured: dict[str, str], path: str, arrays: Mapping[str, tuple[tuple[int, ...], str]], is_array: bool
) -> list[Mapped]:
    targets = [_fill(t, captured, rule.sep) for t in rule.target_templates]
    sources = [path] + [_fill(s, captured, None) for s in rule.stored_templates[1:]]
    where = f"{rule} (stored '{path}', target {' + '.join(repr(t) for t in targets)})"
    views: tuple[View, ...] = rule.views  # type: ignore[assignment]
    if not is_array:
        if views or rule.dtype is not None:
            raise MappingError(f"{where}: the stored leaf is a plain value, which views and casts cannot apply to")
        return [Mapped(targets[0], rule, (path,), (), (), None, (), (), "", is_value=True)]
    lacking = [s for s in sources if s not in arrays]
    if lacking:
        raise MappingError(f"{where}: the rule's stored array '{lacking[0]}' is not in the checkpoint")
    dtypes = {arrays[s][1] for s in sources}
    if len(dtypes) > 1:
        raise MappingError(f"{where}: the stored arrays have different dtypes ({sorted(dtypes)}), which cannot be joined")
    k = next((i for i, v in enumerate(views) if isinstance(v, (Concat, Split))), len(views))
    pre, joint, post = views[:k], (views[k] if k < len(views) else None), views[k + 1 :]
    pre_shapes = tuple(_through(arrays[s][0], pre, where) for s in sources)
    shape = pre_shapes[0][-1]
    concat = None
    if isinstance(joint, Concat):
        concat = _axis(joint.axis, len(shape), where)
        ends = [s[-1] for s in pre_shapes]
        if any(len(e) != len(shape) or any(a != b for d, (a, b) in enumerate(zip(e, shape)) if d != concat) for e in ends):
            raise ShapeMismatchError(
                f"{where}: the arrays to join along axis {concat} differ elsewhere: {[list(e) for e in ends]}"
            )
        shape = tuple(sum(e[concat] for e in ends) if d == concat else n for d, n in enumerate(shape))
    parts: list[tuple[_Part | None]] = [(None,)] * len(targets)
    if isinstance(joint, Split):
        axis = _axis(joint.axis, len(shape), where)
        sizes = joint.parts if isinstance(joint.parts, tuple) else None
        if sizes is None:
            n = int(joint.parts)  # type: ignore[arg-type]
            if n != len(targets) or shape[axis] % n:
                raise ShapeMismatchError(
                    f"{where}: Split into {n} equal parts of axis {axis} (size {shape[axis]}) for {len(targets)} targets"
                )
            sizes = (shape[axis] // n,) * n
        if len(sizes) != len(targets) or sum(sizes) != shape[axis]:
            raise ShapeMismatchError(
                f"{where}: Split sizes {list(sizes)} must be one per target ({len(targets)}) and add up to axis "
                f"{axis}'s size {shape[axis]}"
            )
        parts = [(_Part(axis, sum(sizes[:i]), sizes[i]),) for i in range(len(sizes))]
    stored = arrays[path][1]
    cast_from = stored if rule.dtype is not None and rule.dtype != stored else None
    out = []
    for target, (part,) in zip(targets, parts):
        chain: tuple[Any, ...] = ((part,) if part is not None else ()) + tuple(post)
        post_shapes = _through(shape, chain, where)
        out.append(Mapped(target, rule, tuple(sources), pre_shapes, tuple(pre), concat, chain, post_shapes[-1],
                          rule.dtype or stored, post_shapes, cast_from=cast_from))
    return out


def _axis(axis: int, ndim: int, where: str) -> int:
    if not -ndim <= axis < ndim:
        raise ShapeMismatchError(f"{where}: axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim


def _through(shape: tuple[int, ...], views: Sequence[Any], where: str) -> tuple[tuple[int, ...], ...]:
    """``shape`` and the shape after each view, in order; a view that does not fit raises."""
    shapes = [tuple(shape)]
    for v in views:
        s = shapes[-1]
        if isinstance(v, Transpose):
            if len(v.perm) != len(s):
                raise ShapeMismatchError(f"{where}: {v} permutes {len(v.perm)} axes of an array of shape {list(s)}")
            shapes.append(tuple(s[p] for p in v.perm))
        elif isinstance(v, Reshape):
            new = list(v.shape)
            if -1 in new:
                rest = math.prod(n for n in new if n != -1)
                new[new.index(-1)] = math.prod(s) // rest if rest else 0
            if math.prod(new) != math.prod(s):
                raise ShapeMismatchError(f"{where}: {v} cannot reshape an array of shape {list(s)} ({math.prod(s)} elements)")
            shapes.append(tuple(new))
        elif isinstance(v, _Part):
            shapes.append(tuple(v.size if d == v.axis else n for d, n in enumerate(s)))
        else:
            raise MappingError(f"{where}: {v} must be the only join of the rule")
    return tuple(shapes)


# ---- planning ---------------------------------------------------------------------------

# An operation on the target region's memory: ("slice", slices) | ("permute", perm) | ("reshape", shape)
Op = tuple[str, tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Read the box (``offsets``, ``lengths``) of stored array ``source`` into the view that
    ``ops`` make of the target region's memory (:func:`place`)."""

    source: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    ops: tuple[Op, ...]


def plan(leaf: Mapped, offsets: Sequence[int], lengths: Sequence[int]) -> list[Piece]:
    """The stored boxes that fill the target region (``offsets``, ``lengths``) of ``leaf``:
    exactly its preimage, each with the view of the region's memory it is read into."""
    region = tuple(lengths)
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Op, ...]]] = [(tuple(offsets), region, ())]
    shapes = leaf.post_shapes or (leaf.shape,)
    for i in reversed(range(len(leaf.post_views))):
        boxes = [b for box in boxes for b in _undo(leaf, region, leaf.post_views[i], shapes[i], shapes[i + 1], *box)]
    per_source: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[Op, ...]]] = []
    if leaf.concat is None:
        per_source = [(0, o, n, ops) for o, n, ops in boxes]
    else:
        a = leaf.concat
        for o, n, ops in boxes:
            start = 0
            for i, shp in enumerate(leaf.pre_shapes):
                size = shp[-1][a]
                lo, hi = max(o[a], start), min(o[a] + n[a], start + size)
                if lo < hi:
                    sl = tuple(slice(lo - o[a], hi - o[a]) if d == a else slice(None) for d in range(len(o)))
                    so = tuple(lo - start if d == a else x for d, x in enumerate(o))
                    sn = tuple(max(0, hi - lo) if d == a else x for d, x in enumerate(n))
                    per_source.append((i, so, sn, ops + (("slice", sl),)))
                start += size
    out: list[Piece] = []
    for i, o, n, ops in per_source:
        shp = leaf.pre_shapes[i]
        todo = [(o, n, ops)]
        for j in reversed(range(len(leaf.pre_views))):
            todo = [b for box in todo for b in _undo(leaf, region, leaf.pre_views[j], shp[j], shp[j + 1], *box)]
        out += [Piece(leaf.sources[i], bo, bn, bops) for bo, bn, bops in todo]
    return out


def _undo(
    leaf: Mapped, region: tuple[int, ...], view: Any, before: tuple[int, ...], after: tuple[int, ...],
    o: tuple[int, ...], n: tuple[int, ...], ops: tuple[Op, ...],
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[Op, ...]]]:
    """The boxes before ``view`` whose image is the box (o, n) after it, with their views."""
    if isinstance(view, Transpose):
        inv = tuple(int(i) for i in np.argsort(view.perm))
        bo = [0] * len(o)
        for d, p in enumerate(view.perm):
            bo[p] = o[d]
        return [(tuple(bo), tuple(n[inv[j]] for j in range(len(n))), ops + (("permute", inv),))]
    if isinstance(view, _Part):
        return [(tuple(x + view.start if d == view.axis else x for d, x in enumerate(o)), n, ops)]
    return _undo_reshape(leaf, region, before, after, o, n, ops)


def _flattens(region: tuple[int, ...], ops: tuple[Op, ...]) -> bool:
    """Whether the view ``ops`` make of C-contiguous memory of shape ``region`` exists
    without a copy; asked of strides alone (a view of no memory)."""
    strides = tuple(math.prod(region[d + 1 :]) for d in range(len(region)))
    fake = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=region, strides=strides, writeable=False)
    try:
        place(fake, ops)
    except ValueError:
        return False
    return True


def _undo_reshape(
    leaf: Mapped, region: tuple[int, ...], before: tuple[int, ...], after: tuple[int, ...],
    o: tuple[int, ...], n: tuple[int, ...], ops: tuple[Op, ...],
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[Op, ...]]]:
    if math.prod(n) == 0:
        return []
    # k: the last axis of the box that is not whole; the box is prod(n[:k]) flat runs
    k = max((d for d in range(len(after)) if (o[d], n[d]) != (0, after[d])), default=-1)
    first = ops + ((("slice", tuple(slice(0, 1) for _ in range(k))),) if k > 0 else ()) + (("reshape", (-1,)),)
    if after and not _flattens(region, first):  # the memory is a transposed view: runs of its last axis only
        k = len(after) - 1
    if k < 0:
        return [(tuple(0 for _ in before), before, ops + (("reshape", before),))]
    runs = math.prod(n[:k])
    if runs > MAX_RUNS:
        raise MappingError(
            f"{leaf.where()}: the target region {list(n)} at {list(o)} is {runs} separate runs of the reshaped "
            f"array (more than {MAX_RUNS}); shard the target along its first axis, or write the rule with its "
            "Transpose before its Reshape, so that the runs are rows of the target's own memory"
        )
    strides = [math.prod(after[d + 1 :]) for d in range(len(after))]
    out = []
    for idx in np.ndindex(*n[:k]):
        first = sum((o[d] + i) * strides[d] for d, i in enumerate(idx)) + o[k] * strides[k]
        size = n[k] * strides[k]
        run_ops = ops + (("slice", tuple(slice(i, i + 1) for i in idx)), ("reshape", (-1,)))
        for bo, bn, start in _flat_boxes(first, first + size, before):
            piece_ops = run_ops + (("slice", (slice(start - first, start - first + math.prod(bn)),)), ("reshape", bn))
            out.append((bo, bn, piece_ops))
    return out


def _flat_boxes(a: int, b: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range [a, b) of an array of ``shape`` as boxes in order, each contiguous in
    C order: (offsets, lengths, flat start)."""
    if a >= b:
        return []
    if not shape:
        return [((), (), a)]
    stride = math.prod(shape[1:])
    r0, r1 = a // stride, (b - 1) // stride
    if r0 == r1:
        return [((r0, *o), (1, *n), s + r0 * stride) for o, n, s in _flat_boxes(a - r0 * stride, b - r0 * stride, shape[1:])]
    out = []
    if a % stride:
        out += _flat_boxes(a, (r0 + 1) * stride, shape)
        r0 += 1
    full_end = r1 + 1 if b % stride == 0 else r1
    if full_end > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (full_end - r0, *shape[1:]), r0 * stride))
    if b % stride:
        out += _flat_boxes(r1 * stride, b, shape)
    return out


def place(memory: Any, ops: Sequence[Op]) -> Any:
    """The view ``ops`` make of ``memory`` (a torch tensor or numpy array); raises
    ValueError where one would need a copy (a reshape of memory that is not contiguous)."""
    for name, arg in ops:
        if name == "slice":
            memory = memory[arg]
        elif name == "permute":
            memory = memory.transpose(arg) if isinstance(memory, np.ndarray) else memory.permute(arg)
        elif isinstance(memory, np.ndarray):
            memory = np.reshape(memory, arg, copy=False)
        else:
            try:
                memory = memory.view(arg)
            except RuntimeError as e:
                raise ValueError(str(e)) from e
    return memory
