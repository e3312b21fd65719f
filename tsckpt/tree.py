"""Pytrees: flattening with stable leaf paths, and a JSON form of the structure.

Traversal is delegated to optree (the pytree library PyTorch itself uses): it
already knows dicts, lists, tuples, namedtuples, deques and ordered dicts, and
gives every leaf an accessor whose entries name the dict key, index or field.
What optree does not do, and lives here, is (1) turning those entries into one
escaped path string per leaf, and (2) writing the structure as JSON so a
checkpoint can be rebuilt without pickle and without importing user classes.

Path rules (see docs/format.md): components are joined by "/". A str key is
kept when it only uses ``[A-Za-z0-9._-]``; any other byte is written as
``%XX`` (UTF-8). Integer keys and sequence indices are plain decimal; a str key
that would read as an integer gets its first character escaped, so ``{0: a}``
and ``{"0": b}`` never collide. The empty key is ``%``, names zarr reserves
(names of periods only, "zarr.json", leading "__") are escaped, and a tree that is a single
leaf stores it at ``%root``. A restore from a checkpoint Orbax wrote names the target's
leaves as Orbax does instead (:data:`ORBAX_NAMES`: a Flax Variable's ``value`` level kept,
an int dict key as its string, ``%30``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import keyword
import re
import sys
import urllib.parse
from typing import Any, Callable, NamedTuple, cast

import optree
from optree import PyTreeKind

from ._base import jaxtree as _jaxtree
from ._base.types import ArraySpec, LazySource, ShardedArray
from ._errors import LeafTypeError, short_repr

NAMESPACE = "tsckpt"
ROOT_LEAF_PATH = "%root"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SAFE_KEY = re.compile(r"[A-Za-z0-9._-]+")
_INTLIKE = re.compile(r"-?[0-9]+")
_RESERVED = {".", "..", "zarr.json"}


@functools.lru_cache(maxsize=1 << 16)
def escape(key: str) -> str:
    """One path component for a str key (injective, a valid zarr node name). Remembered:
    a restore escapes the stored tree's keys and then the same keys of its target."""
    if key == "":
        return "%"
    if _SAFE_KEY.fullmatch(key):  # most keys: no character to encode (one match, not one per character)
        out = key
    else:
        out = _UNSAFE.sub(_percent, key)  # one call per run of characters to encode
    if _INTLIKE.fullmatch(key) or key in _RESERVED or key.startswith("__") or not key.strip("."):
        out = f"%{ord(key[0]):02X}" + out[1:]
    return out


def _percent(run: re.Match[str]) -> str:
    """``%XX`` for every UTF-8 byte of a run of characters (UnicodeEncodeError for a lone surrogate)."""
    return "".join(f"%{b:02X}" for b in run.group().encode())


def unescape(component: str) -> str | int:
    """The dict key or index a path component came from (inverse of :func:`escape`)."""
    if component == "%":
        return ""
    if _INTLIKE.fullmatch(component):
        return int(component)
    return urllib.parse.unquote(component, errors="strict")


def _component(entry: Any, comps: list[str], orbax: bool = False) -> str:
    """The path component of one accessor entry; ``comps``, the components above it, name
    the place of a key that cannot be one (joined only then). ``orbax``: as Orbax names it
    (:data:`ORBAX_NAMES`)."""
    if type(entry) is optree.MappingEntry and type(entry.key) is str:  # most entries: a dict's str key
        return escape(entry.key)
    if isinstance(entry, (optree.NamedTupleEntry, optree.DataclassEntry, optree.StructSequenceEntry)):
        key = entry.field
    elif isinstance(entry, optree.SequenceEntry):
        return str(entry.index)
    elif isinstance(entry, optree.MappingEntry):
        key = entry.key
    elif isinstance(entry, optree.GetAttrEntry):
        key = entry.name
    else:
        key = entry.entry
    if key is _jaxtree.BOX:  # a box around one value (a Flax Variable): no component, or Orbax's level
        return "value" if orbax else ""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise LeafTypeError(
            f"at '{'/'.join(comps) or '<root>'}': key {key!r} of type {type(key).__name__} cannot name a "
            "checkpoint path; use str or int keys"
        )
    if orbax and isinstance(key, int) and (isinstance(entry, optree.MappingEntry) or type(key) is _jaxtree.DictIndex):
        return escape(str(int(key)))  # Orbax stores an int dict key as its string
    return str(key) if isinstance(key, int) else escape(key)


def join(components: list[str]) -> str:
    return "/".join(components) if components else ROOT_LEAF_PATH


# Dataclasses are pytree nodes in tsckpt (as in equinox/flax), and so are the
# containers of JAX's registry when jax is imported (tsckpt._base.jaxtree); optree needs
# a registration per class, done lazily the first time one is met.
_registered: set[type] = set()


def _dataclass_flatten(obj: Any) -> tuple[list[Any], None, list[str]]:
    names = [f.name for f in dataclasses.fields(obj)]
    return [getattr(obj, n) for n in names], None, names


def _make_dataclass_unflatten(cls: type) -> Callable[[Any, Any], Any]:
    def unflatten(_: Any, children: Any) -> Any:
        obj: Any = object.__new__(cls)
        for f, v in zip(dataclasses.fields(cls), children):
            object.__setattr__(obj, f.name, v)
        return obj

    return unflatten


# Types whose nodes are known to need nothing from _register_dataclasses (it runs once per
# node of every tree flattened). Until jax is imported only types that can never be JAX
# containers are remembered, since importing jax may make other types containers.
_passed: set[type] = set()
_NEVER_JAX = ("builtins", "collections", "torch", "numpy")
_dataclass_nodes: set[type] = set()  # the dataclasses registered here: their paths are their fields


def _register_dataclasses(node: Any) -> bool:
    cls = type(node)
    if cls in _passed:
        return False
    if isinstance(node, (ArraySpec, ShardedArray, LazySource)):
        return True  # tsckpt's own leaf dataclasses are leaves, not containers
    if cls not in _registered and _jaxtree.node_type(node):  # JAX's registry first: it knows static fields
        optree.register_pytree_node(cls, _jaxtree.flatten_one, _jaxtree.unflatten_one, namespace=NAMESPACE)
        _registered.add(cls)
    if cls not in _registered and dataclasses.is_dataclass(node) and not isinstance(node, type):
        optree.register_pytree_node(
            cls, _dataclass_flatten, _make_dataclass_unflatten(cls), namespace=NAMESPACE
        )
        _registered.add(cls)
        _dataclass_nodes.add(cls)
    if "jax" in sys.modules or cls.__module__.partition(".")[0] in _NEVER_JAX:
        _passed.add(cls)
    return False


def register_node(
    cls: type,
    flatten_fn: Callable[[Any], tuple[Any, Any, Any]],
    unflatten_fn: Callable[[Any, Any], Any],
) -> None:
    """Make ``cls`` a pytree node. ``flatten_fn(obj) -> (children, aux, keys)``;
    ``unflatten_fn(aux, children) -> obj``. ``keys`` (str or int) name the paths."""
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
    _registered.add(cls)


class Flat(NamedTuple):
    paths: list[str]
    leaves: list[Any]
    spec: optree.PyTreeSpec


def too_deep(where: str = "") -> LeafTypeError:
    """The error for a tree nested deeper than a checkpoint's structure may be (``where``: the
    leaf path at which it was found, if known)."""
    at = f" (at '{where[:60]}...')" if len(where) > 60 else f" (at '{where}')" if where else ""
    return LeafTypeError(
        f"the tree nests more than {MAX_STRUCTURE_DEPTH} levels deep{at}: tsckpt's limit on a tree's depth "
        f"(a checkpoint's structure is at most {MAX_STRUCTURE_DEPTH} levels, so it could not be read back); "
        "flatten the deep part first (e.g. into a dict keyed by its paths, or a list)"
    )


# The names a tree's leaves have in a checkpoint Orbax wrote (``flatten(names=ORBAX_NAMES)``):
# a Flax Variable keeps its ``value`` level, and an int dict key is the string of its digits,
# as Orbax stores them; sequence indices, str keys and attributes are named as tsckpt names them.
ORBAX_NAMES = "orbax"
TSCKPT_NAMES = "tsckpt"


def flatten(tree: Any, *, names: str = TSCKPT_NAMES) -> Flat:
    """Leaves in a fixed order, each with its unique path string (as tsckpt names them, or
    as Orbax does: :data:`ORBAX_NAMES`). A tree deeper than a checkpoint's structure may be
    (:data:`MAX_STRUCTURE_DEPTH`) raises :func:`too_deep`. The paths of a structure met
    before are remembered (:func:`paths_of`): a training loop flattens the same tree at
    every save."""
    try:
        leaves, spec = optree.tree_flatten(tree, is_leaf=_register_dataclasses, namespace=NAMESPACE)
    except RecursionError:  # optree recurses once per level
        raise too_deep() from None
    return Flat(list(paths_of(spec, names=names)), leaves, spec)


def paths_of(spec: optree.PyTreeSpec, *, names: str = TSCKPT_NAMES) -> tuple[str, ...]:
    """The path of each leaf of a structure (as :func:`flatten` names them), remembered by structure."""
    orbax = names == ORBAX_NAMES
    paths = _known_paths(spec, orbax)
    return _paths(spec, orbax) if paths is None else paths


# Paths by (structure, names): a structure whose every node names its children by its type
# and the structure's own data (dicts, sequences, named tuples, dataclasses) has the same
# paths wherever it is met; other registered nodes may name children by what only their
# flatten function returns, which a structure's equality does not compare.
_PATHS: dict[tuple[optree.PyTreeSpec, bool], tuple[str, ...]] = {}
_PATHS_KEPT = 64
_NAMED_BY_STRUCTURE = (dict, list, tuple, collections.OrderedDict, collections.defaultdict, collections.deque)


def _known_paths(spec: optree.PyTreeSpec, orbax: bool) -> tuple[str, ...] | None:
    try:
        return _PATHS.get((spec, orbax))
    except TypeError:  # a node's data is not hashable
        return None


def _paths(spec: optree.PyTreeSpec, orbax: bool) -> tuple[str, ...]:
    paths = []
    named_by_structure = True
    for acc in spec.accessors():
        comps: list[str] = []
        for entry in acc:
            named_by_structure = named_by_structure and (
                entry.type in _NAMED_BY_STRUCTURE or entry.type in _dataclass_nodes
                or (issubclass(entry.type, tuple) and hasattr(entry.type, "_fields"))
            )
            component = _component(entry, comps, orbax)
            if component:
                comps.append(component)
        if len(comps) >= MAX_STRUCTURE_DEPTH:  # the leaf is one more level
            raise too_deep(join(comps))
        paths.append(join(comps))
    out = tuple(paths)
    if named_by_structure:
        try:
            if len(_PATHS) >= _PATHS_KEPT:
                _PATHS.pop(next(iter(_PATHS)))
            _PATHS[spec, orbax] = out
        except TypeError:  # a node's data is not hashable
            pass
    return out


def leaves(tree: Any, *, stop: Callable[[Any], bool] | None = None) -> tuple[list[Any], optree.PyTreeSpec]:
    """The leaves and structure of ``tree`` as :func:`flatten` traverses it, without the
    paths (a twentieth of its cost); a node for which ``stop`` is true is a leaf."""

    passed = _passed

    def is_leaf(node: Any) -> bool:  # once per node: types known to be no containers answered here
        return (stop is not None and stop(node)) or (type(node) not in passed and _register_dataclasses(node))

    try:
        return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    except RecursionError:  # optree recurses once per level
        raise too_deep() from None


def unflatten(spec: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    return optree.tree_unflatten(spec, leaves)


# ---- names shifted by a prefix ------------------------------------------------


class PrefixShift(NamedTuple):
    """Names that match once a common prefix is moved: ``stored`` before every checkpoint name
    where the target has none (a checkpoint saved as ``{"model": sd}`` restored into ``sd``;
    ``"model."`` before Hugging Face names), or ``target`` before every target name where the
    checkpoint has none (the reverse). One of the two is empty."""

    target: str
    stored: str
    matched: int  # how many of the names missing from the checkpoint match once the prefix moves
    missing: int


def _cuts(name: str) -> list[int]:
    """The positions just after each separator ('/' between components, '.' inside a name)."""
    return [i + 1 for i, c in enumerate(name) if c in "/." and i + 1 < len(name)]


def prefix_shift(missing: list[str] | set[str], unexpected: list[str] | set[str]) -> PrefixShift | None:
    """The prefix that, added to the target's names or taken from them, makes ``missing`` names
    (in the target, not the checkpoint) ``unexpected`` ones (in the checkpoint, not the target):
    at least half of each, as when a whole tree moved (a few names that match inside a larger
    tree, such as 'proj.weight' in 'blocks.0.attn.proj.weight', are another architecture). None
    when no prefix does; linear in the names' length."""
    miss, extra = set(missing), set(unexpected)
    if not miss or not extra:
        return None
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for u in extra:  # the checkpoint's names have a prefix the target's lack
        for k in _cuts(u):
            if u[k:] in miss:
                counts["", u[:k]] += 1
    for m in miss:  # the target's names have a prefix the checkpoint's lack
        for k in _cuts(m):
            if m[k:] in extra:
                counts[m[:k], ""] += 1
    if not counts:
        return None
    (target, stored), n = max(counts.items(), key=lambda kv: (kv[1], -len(kv[0][0]) - len(kv[0][1])))
    if 2 * n < len(miss) or 2 * n < len(extra):
        return None
    return PrefixShift(target, stored, n, len(miss))


def _subscripts(prefix: str) -> str | None:
    """``['a']['b']`` for a prefix of whole components ``a/b/``; None for one that cuts a name."""
    if not prefix.endswith("/"):
        return None
    return "".join(f"[{unescape(c)!r}]" for c in prefix[:-1].split("/"))


def prefix_advice(shift: PrefixShift, target: str = "target") -> str:
    """What a restore shaped like ``target`` (the name of the caller's target expression) whose
    names are shifted as ``shift`` says should be given instead, as Python."""
    prefix = shift.target or shift.stored
    sub = _subscripts(prefix)
    if shift.target and sub is not None:  # the target nests what the checkpoint holds at its top
        return f"restore that part of the target, tsckpt.restore(directory, {target}{sub})"
    if shift.stored and sub is not None:  # the checkpoint nests it: wrap the target the same way
        wrapped = target
        for c in reversed(prefix[:-1].split("/")):
            wrapped = f"{{{unescape(c)!r}: {wrapped}}}"
        return f"nest the target as the checkpoint does, tsckpt.restore(directory, {wrapped}){sub}"
    if "/" not in prefix:  # a prefix inside the names of one mapping (Hugging Face's "model.")
        if shift.target:
            return f"rename the target's keys, {{k.removeprefix({prefix!r}): v for k, v in {target}.items()}}"
        return f"rename the target's keys, {{{prefix!r} + k: v for k, v in {target}.items()}}"
    return f"shape the target's names as the checkpoint's ({prefix!r} {'removed' if shift.target else 'added'})"


# ---- structure as JSON ------------------------------------------------------

_SEQ = {PyTreeKind.LIST: "list", PyTreeKind.TUPLE: "tuple", PyTreeKind.DEQUE: "deque"}
_MAP = {PyTreeKind.DICT, PyTreeKind.ORDEREDDICT, PyTreeKind.DEFAULTDICT}


def _json_key(key: Any) -> Any:
    return key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)


def structure_to_json(spec: optree.PyTreeSpec, depth: int = 1) -> Any:
    """The tree's shape as JSON; leaves are ``null``. No types are imported on load. Empty
    containers nested deeper than :data:`MAX_STRUCTURE_DEPTH` raise :func:`too_deep`."""
    kind = spec.kind
    if kind == PyTreeKind.LEAF:
        return None
    if kind == PyTreeKind.NONE:
        return {"type": "none"}
    if depth > MAX_STRUCTURE_DEPTH:
        raise too_deep()
    children = [structure_to_json(c, depth + 1) for c in spec.children()]
    if kind in _SEQ:
        return {"type": _SEQ[kind], "children": children}
    keys = [_json_key(k) for k in spec.entries()]
    if kind in _MAP:
        node: dict[str, Any] = {"type": "dict", "keys": keys, "children": children}
        positions = cast(optree.PyTreeSpec, spec.one_level()).unflatten(list(range(spec.num_children)))
        order: list[int] = list(positions.values())  # type: ignore[union-attr,arg-type]
        if order != sorted(order):
            node["order"] = order
        if kind == PyTreeKind.ORDEREDDICT:
            node["type"] = "ordereddict"
        return node
    if kind in (PyTreeKind.NAMEDTUPLE, PyTreeKind.STRUCTSEQUENCE):
        fields = [getattr(acc[0], "field") for acc in cast(optree.PyTreeSpec, spec.one_level()).accessors()]
        return {"type": "namedtuple", "name": cast(type, spec.type).__name__, "keys": fields, "children": children}
    if list(spec.entries()) == [_jaxtree.BOX]:  # a box adds no level, as it adds no path component
        return children[0]
    cls = cast(type, spec.type)
    return {
        "type": "custom",
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "keys": keys,
        "children": children,
    }


def structure_nodes(structure: Any) -> dict[str, tuple[str, bool]]:
    """Every container and ``None`` of a tree structure (:func:`structure_to_json`) by path:
    (its kind, a namedtuple's with its name and fields in order; whether it is empty: ``None``,
    or a container with no entries). The root's path is ``""``."""
    out: dict[str, tuple[str, bool]] = {}
    _walk(structure, "", out)
    return out


def _walk(node: Any, path: str, out: dict[str, tuple[str, bool]]) -> None:
    """Add ``node`` (a leaf: null, nothing to add) and the nodes below it to ``out``."""
    if not isinstance(node, dict):
        return
    kind = node_kind(node)
    children = node_children(node)
    for name, child in children:
        _walk(child, f"{path}/{name}" if path else name, out)
    out[path] = (kind, kind == "none" or not children)


def node_kind(node: dict[str, Any]) -> str:
    """What a container or ``None`` node of a tree structure is: its type, a namedtuple's with
    its name and fields in their order (``P(x, y)`` is not ``P(y, x)``), a custom node's with its name."""
    kind = str(node.get("type"))
    keys = node.get("keys")
    if kind in ("namedtuple", "custom"):
        fields = ", ".join(map(str, keys)) if isinstance(keys, list) and kind == "namedtuple" else ""
        kind = f"{kind} {node.get('name')}" + (f"({fields})" if fields else "")
    return kind


def node_children(node: dict[str, Any]) -> list[tuple[str, Any]]:
    """The children of a node of a tree structure, each with its path component."""
    keys = node.get("keys")
    out = []
    for i, child in enumerate(node.get("children") or []):
        key = keys[i] if isinstance(keys, list) and i < len(keys) else i
        out.append((escape(key) if isinstance(key, str) else str(key), child))
    return out


def own_order(structure: Any) -> list[int]:
    """The leaves' positions in flatten order (dict keys sorted, as optree flattens them)
    listed in the tree's own order (each dict's insertion order, as it was built); where
    several leaves are one array, the first of this order is the one the user wrote first."""

    def walk(node: Any, start: int) -> tuple[list[int], int]:
        if node is None:
            return [start], start + 1
        parts = []
        for c in node.get("children", ()):
            part, start = walk(c, start)
            parts.append(part)
        if node.get("order") is not None:  # as _build applies it
            parts = [parts[i] for i in node["order"]]
        return [i for part in parts for i in part], start

    return walk(structure, 0)[0]


@dataclasses.dataclass
class _Cursor:
    leaves: list[Any]
    pos: int = 0


_namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple(name: str, fields: list[str]) -> type:
    key = (name, tuple(fields))
    if key not in _namedtuples:
        _namedtuples[key] = collections.namedtuple(name, fields, rename=True)  # type: ignore[misc]
    return _namedtuples[key]


def _build(node: Any, cur: _Cursor) -> Any:
    if node is None:
        value = cur.leaves[cur.pos]
        cur.pos += 1
        return value
    kind = node["type"]
    if kind == "none":
        return None
    children = [_build(c, cur) for c in node["children"]]
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if kind == "deque":
        return collections.deque(children)
    if kind == "namedtuple":
        return _namedtuple(node["name"], node["keys"])(*children)
    pairs = list(zip(node["keys"], children))
    if node.get("order") is not None:  # checked by structure_problem: a permutation
        pairs = [pairs[i] for i in node["order"]]
    if kind == "ordereddict":
        return collections.OrderedDict(pairs)
    return dict(pairs)  # dict, and custom nodes (their classes are never imported)


# Deeper structures are refused: rebuilding recurses once per level.
MAX_STRUCTURE_DEPTH = 200
_KEYED = ("dict", "ordereddict", "namedtuple", "custom")
_NODE_TYPES = ("none", "list", "tuple", "deque", *_KEYED)


def _key_components(kind: str, keys: list[Any]) -> list[str] | str:
    """The path components of a keyed node's keys (each escaped once, here), or why one of
    the keys cannot name a path, or two are the same."""
    ok = (str,) if kind == "namedtuple" else (str, int)
    components: list[str] = []
    for k in keys:
        component = None if isinstance(k, bool) or not isinstance(k, ok) else _path_component(k)
        if component is None:
            expected = "a str" if kind == "namedtuple" else "a str or int"
            return f"a {kind} node with the key {short_repr(k)} ({expected} expected)"
        components.append(component)
    if len(set(keys)) != len(keys):
        return f"a {kind} node with a repeated key"
    return components


def _node_problem(node: Any) -> str | list[str] | None:
    """Why ``node`` is not a node of the structure (a str), or the path components of its
    children (a list; None for a node without keys)."""
    if not isinstance(node, dict) or node.get("type") not in _NODE_TYPES:
        kind = node.get("type") if isinstance(node, dict) else type(node).__name__
        return f"a node of unknown type {kind!r}"
    if node["type"] == "none":
        return None
    children = node.get("children")
    if not isinstance(children, list):
        return f"a {node['type']} node without a list of children"
    if node["type"] in _KEYED:
        keys = node.get("keys")
        if not isinstance(keys, list) or len(keys) != len(children):
            return f"a {node['type']} node whose keys do not match its {len(children)} children"
        components = _key_components(node["type"], keys)
        if isinstance(components, str):
            return components
        order = node.get("order")
        if order is not None and (
            not isinstance(order, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in order)
            or sorted(order) != list(range(len(children)))
        ):
            return f"a {node['type']} node whose order is not a permutation of its children"
    if node["type"] == "namedtuple":
        name = node.get("name")
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            return f"a namedtuple node named {name!r}, not an identifier"
    return components if node["type"] in _KEYED else None


def _path_component(key: str | int) -> str | None:
    """The path component of a dict key or index, None for a str UTF-8 cannot encode."""
    try:
        return str(key) if isinstance(key, int) else escape(key)
    except (UnicodeEncodeError, ValueError):  # a lone surrogate; an int too long to print
        return None


def structure_problem(structure: Any, leaves: list[str] | tuple[str, ...]) -> str | None:
    """Why ``structure`` (from the root metadata) does not hold exactly the leaf paths
    ``leaves`` in order, or None. Iterative, so a hostile structure cannot exhaust the stack;
    one frame per container on the way down (its children's components, its children, the
    next one's index, its path, its depth), none per leaf: a structure of 10,000 leaves made
    20,000 tuples here, and their garbage collections cost 0.1 s in a fresh process."""
    if structure is None:
        return paths_problem(leaves)
    found = 0
    frames: list[list[Any]] = []
    node, path, depth = structure, "", 1
    while True:
        if depth > MAX_STRUCTURE_DEPTH:
            return f"it is nested more than {MAX_STRUCTURE_DEPTH} levels deep"
        if node is None:
            if found < len(leaves) and path != leaves[found]:
                return f"its leaf '{path}' is listed in 'leaves' as {short_repr(leaves[found])}"
            found += 1
        else:
            why = _node_problem(node)
            if isinstance(why, str):
                return f"it has {why}"
            children = () if node["type"] == "none" else node["children"]  # a None has no children (as built)
            components = why if why is not None else [str(i) for i in range(len(children))]
            frames.append([components, children, 0, path, depth])
        while frames and frames[-1][2] >= min(len(frames[-1][0]), len(frames[-1][1])):
            frames.pop()  # every child of the innermost container walked
        if not frames:
            break
        frame = frames[-1]
        components, children, i, parent, depth = frame
        frame[2] = i + 1
        node, depth = children[i], depth + 1
        path = f"{parent}/{components[i]}" if parent else components[i]
    if found != len(leaves):
        return f"it has {found} leaves but the checkpoint lists {len(leaves)}"
    return None


def paths_problem(leaves: list[str] | tuple[str, ...]) -> str | None:
    """Why ``leaves`` are not the paths of one tree of nested dicts (see :func:`from_paths`):
    a path written other than as tsckpt escapes it, listed twice, or both a leaf and a
    container. None if they are."""
    if list(leaves) == [ROOT_LEAF_PATH]:
        return None
    seen: set[tuple[str | int, ...]] = set()
    containers: set[tuple[str | int, ...]] = set()
    for path in leaves:
        try:
            keys = tuple(unescape(c) for c in path.split("/"))
        except ValueError:  # not UTF-8 once unescaped; an int too long to parse
            keys = ()
        if not keys or "/".join(str(_path_component(k)) for k in keys) != path:
            return f"its leaf path {short_repr(path)} is not a path tsckpt writes"
        if keys in seen:
            return f"it lists the leaf '{path}' twice"
        seen.add(keys)
        containers.update(keys[:i] for i in range(1, len(keys)))
    clash = next((k for k in seen if k in containers), None)
    if clash is not None:
        return f"its leaf '{'/'.join(str(_path_component(k)) for k in clash)}' also has leaves below it"
    return None


def structure_from_json(structure: Any, leaves: list[Any]) -> Any:
    """Rebuild a tree from :func:`structure_to_json` output and the leaves in order."""
    cur = _Cursor(leaves)
    tree = _build(structure, cur)
    if cur.pos != len(leaves):
        raise ValueError(f"structure has {cur.pos} leaves but {len(leaves)} were given")
    return tree


def from_paths(paths: list[str] | tuple[str, ...], leaves: list[Any]) -> Any:
    """Nested dicts whose flattened paths are exactly ``paths`` (for trees saved without a
    structure: by ranks with different trees, or converted from other formats)."""
    if list(paths) == [ROOT_LEAF_PATH]:
        return leaves[0]
    out: dict[Any, Any] = {}
    for path, leaf in zip(paths, leaves):
        node = out
        *parents, last = (unescape(c) for c in path.split("/"))
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def structure_from_paths(paths: list[str] | tuple[str, ...]) -> Any:
    """Structure JSON of the nested containers ``paths`` name, where a node whose keys are
    exactly 0..n-1 is a list (for trees whose int components are sequence indices, as in
    Orbax checkpoints). None if the paths are not in depth-first order of that tree."""
    if list(paths) == [ROOT_LEAF_PATH]:
        return None
    root: dict[Any, Any] = {}
    for path in paths:
        node = root
        *parents, last = (unescape(c) for c in path.split("/"))
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = path

    def to_json(node: Any) -> Any:
        if isinstance(node, str):
            return None
        keys = list(node)
        children = [to_json(node[k]) for k in keys]
        if keys == list(range(len(keys))):
            return {"type": "list", "children": children}
        return {"type": "dict", "keys": keys, "children": children}

    structure = to_json(root)
    order: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            order.append(node)
        else:
            for v in node.values():
                walk(v)

    walk(root)
    return structure if order == list(paths) else None


def child(node: Any, component: str) -> Any:
    """The child of a rebuilt tree node named by one path component (KeyError if none)."""
    key = unescape(component)
    if isinstance(node, dict):
        return node[key]
    if isinstance(node, (list, tuple, collections.deque)) and isinstance(key, int) and not hasattr(node, "_fields"):
        return node[key]
    if hasattr(node, "_fields") and isinstance(key, str) and key in node._fields:
        return getattr(node, key)
    raise KeyError(component)


__all__ = ["escape", "flatten", "register_node", "ROOT_LEAF_PATH"]
