"""Reading checkpoints written by orbax-checkpoint (JAX) with TensorStore alone.

Layouts understood (local directories):

* **Item directory** (``PyTreeCheckpointHandler``, ``StandardCheckpointer``,
  ``ArrayCheckpointHandler``): ``_METADATA`` is JSON whose ``tree_metadata`` has one
  entry per leaf in tree order, with ``key_metadata`` (keys from the root; ``key_type``
  1 = sequence index, 2 = dict key or attribute) and ``value_metadata.value_type``:
  ``jax.Array``/``np.ndarray`` are arrays, ``scalar`` is a Python number stored as a
  0-d array, ``string`` lives in ``_strings.json``, and ``None``/``Dict``/``List``/
  ``Tuple``/``NamedTuple`` are empty nodes (skipped). An array is stored under its
  keys joined by "."; ``use_zarr3`` picks the ``zarr3`` or ``zarr`` (v2) driver.
  Without OCDBT each array is a directory ``<name>/``. With OCDBT (the default) each
  process writes a database in ``ocdbt.process_<id>/`` and the commit merges their
  indices into the item's own ``manifest.ocdbt`` (+ ``d/``), whose B-tree points into
  the per-process data files: arrays are read, as Orbax reads them, through the
  ``ocdbt`` kvstore over the item directory with key prefix ``<name>/``.
* **Step directory** of a ``CheckpointManager``: ``_CHECKPOINT_METADATA`` lists
  ``item_handlers``, one subdirectory per item; leaf paths start with the item name,
  except for a lone ``default`` item. ``JsonSave`` items (a ``metadata`` file) become values.
* **Names and tree**: leaf paths are Orbax's keys, escaped as tsckpt escapes str keys
  (a sequence index as its number); a restore names its target's leaves by Orbax's
  rules (``tree.ORBAX_NAMES``: a Flax Variable's ``value`` level, int dict keys as
  strings). Without a target the tree is the one Orbax returns: dicts, lists, and the
  empty nodes the metadata records (``{}``, ``[]``, ``()``, ``None``).
* **Commit**: saves are written to ``<name>.orbax-checkpoint-tmp*`` and renamed, or
  (filesystems without atomic rename) written in place and marked by
  ``commit_success.txt``; current Orbax writes that marker in both modes, right after
  the commit timestamp in ``_CHECKPOINT_METADATA``. Having neither means uncommitted.

Not supported: the legacy msgpack ``checkpoint`` file of old Orbax/Flax, custom type
handlers (e.g. PRNG keys), and remote (gs://, s3://) locations.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tensorstore as ts

from .._base import dtypes as _dtypes
from .._errors import (
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LeafTypeError,
    NotACheckpointError,
    short_repr,
)
from .._ondisk.arrays import MANIFEST
from .._ondisk.arrays import parse_node as parse_json
from .._ondisk.backing import UNCHECKED_BYTES
from .._ondisk.bounds import METADATA_BYTES, read_file
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.records import ArrayRecord, Chunking
from .._runtime.memory import bound_heap
from .._storage.confine import confined, refuse_links
from .._storage.locations import Location
from .._storage.mirror import Mirror
from ..tree import (
    MAX_STRUCTURE_DEPTH,
    ORBAX_NAMES,
    ROOT_LEAF_PATH,
    escape,
    paths_problem,
    structure_from_paths,
    structure_problem,
)

TMP_SUFFIX = ".orbax-checkpoint-tmp"
COMMIT_FILE = "commit_success.txt"
TREE_METADATA = "_METADATA"
STEP_METADATA = "_CHECKPOINT_METADATA"
JSON_ITEM = "metadata"
_STEP_NAME = re.compile(r"(?:.*_)?([0-9]+)")
_ARRAY_TYPES = {"jax.Array", "np.ndarray"}
_EMPTY_TYPES = {"None", "Dict", "List", "Tuple", "NamedTuple", "placeholder"}
_UNCOMMITTED = "the save crashed or is still running; wait for it to finish or pass a committed checkpoint"
# The most bytes one chunk (or a shard's index) of an Orbax array may decode to: the largest
# chunk orbax-checkpoint writes by default (its OCDBT target data file size). Orbax chunks are
# compressed, so a file of kilobytes can claim gigabytes; a claim above this is refused before
# anything is decoded (docs/security.md).
MAX_CHUNK_BYTES = 2 << 30
_INDEX_ENTRY_BYTES = 16  # a zarr3 shard index: offset and length of each inner chunk
# The most chunks (shards) an Orbax array may have: far more than orbax-checkpoint writes
# (arrays of up to 2 GiB chunks), few enough that planning reads over them stays cheap.
MAX_CHUNKS = 1 << 24
_SEQUENCE_KEY = re.compile(r"[0-9]{1,18}")


@dataclasses.dataclass(frozen=True)
class ForeignArray:
    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    spec: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ForeignCheckpoint:
    location: str
    leaves: tuple[str, ...]
    arrays: Mapping[str, ForeignArray]
    values: Mapping[str, Any]
    structure: Any
    # what the arrays' specs read through (a Mirror of the directory): kept as long as they are
    held: Any = dataclasses.field(default=None, compare=False, repr=False)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _read_json(loc: Path, name: str) -> Any:
    """The JSON file ``name`` of ``loc`` (no link), with the bounded parse of every format."""
    file = confined(str(loc), name, where=str(loc), field=f"Orbax metadata file '{name}'")
    try:
        return parse_json(read_file(file, METADATA_BYTES, "Orbax metadata", fix="use another checkpoint or re-save it"))
    except CorruptCheckpointError:
        raise
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{loc}: Orbax metadata file '{name}' is unreadable: expected JSON, found {_one_line(e)}; "
            "the checkpoint is damaged, use another one or re-save it"
        ) from e


def _committed(d: Path) -> bool | None:
    """True/False when ``d`` records whether its save committed, None when it records nothing."""
    if (d / COMMIT_FILE).is_file():
        return True
    meta = _read_json(d, STEP_METADATA) if (d / STEP_METADATA).is_file() else None
    if isinstance(meta, dict) and "commit_timestamp_nsecs" in meta:
        return meta["commit_timestamp_nsecs"] is not None
    return None


def _check_committed(d: Path) -> None:
    """Raise unless ``d`` (and the CheckpointManager step holding it, if any) committed."""
    for p in (d, d.parent):
        if TMP_SUFFIX in p.name:
            raise CheckpointIncompleteError(
                f"{d}: Orbax checkpoint never committed: expected a final directory name, found the temporary "
                f"suffix '{TMP_SUFFIX}' on '{p.name}'; {_UNCOMMITTED}"
            )
    step = d.parent if (d.parent / STEP_METADATA).is_file() else d
    for p in dict.fromkeys((step, d)):
        if _committed(p) is False:
            raise CheckpointIncompleteError(
                f"{p}: Orbax checkpoint never committed: expected '{COMMIT_FILE}' or a commit timestamp in "
                f"'{STEP_METADATA}', found neither; {_UNCOMMITTED}"
            )


def _steps(root: Path) -> list[tuple[int, Path]]:
    """Numbered CheckpointManager step directories under ``root`` (temporary ones included)."""
    out = []
    for child in root.iterdir():
        m = _STEP_NAME.fullmatch(child.name.split(TMP_SUFFIX)[0])
        if m and child.is_dir() and (TMP_SUFFIX in child.name or (child / STEP_METADATA).is_file()):
            out.append((int(m.group(1)), child))
    return sorted(out)


def detect(directory: str) -> bool:
    """True if ``directory`` looks like an Orbax item, step or CheckpointManager root directory."""
    try:
        d = Path(directory)
        if not d.is_dir():
            return False
        if TMP_SUFFIX in d.name or any((d / f).is_file() for f in (TREE_METADATA, STEP_METADATA, MANIFEST)):
            return True
        return bool(_steps(d))
    except (OSError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class _ItemMetadata:
    """An item's ``_METADATA``: its leaf entries in tree order, and how its arrays are stored."""

    entries: list[Any]
    zarr3: bool  # the zarr3 driver (else zarr v2)
    ocdbt: bool  # in the item's OCDBT database (else a directory per array)
    fill_missing: bool  # chunks equal to the fill value were not written

    @property
    def node_name(self) -> str:
        """The file of an array's zarr metadata."""
        return "zarr.json" if self.zarr3 else ".zarray"

    def kvstore(self, item: Path, name: str = "") -> dict[str, Any]:
        """TensorStore kvstore spec of the array stored as ``name`` in ``item`` (of ``item``'s
        arrays for an empty name)."""
        if self.ocdbt:
            return {"driver": "ocdbt", "base": {"driver": "file", "path": f"{item}/"}, "path": name}
        return {"driver": "file", "path": os.path.join(str(item), name)}

    def spec(self, item: Path, name: str) -> dict[str, Any]:
        """TensorStore spec of the array stored as ``name`` in ``item``."""
        driver = "zarr3" if self.zarr3 else "zarr"
        return {"driver": driver, "kvstore": self.kvstore(item, name), "fill_missing_data_reads": self.fill_missing}


def _item_metadata(item: Path) -> _ItemMetadata:
    """Parse ``item``'s tree metadata; an OCDBT item must have its merged manifest."""
    meta = _read_json(item, TREE_METADATA)
    try:
        entries = list(meta["tree_metadata"].values())
        zarr3 = bool(meta.get("use_zarr3", False))
        ocdbt = meta.get("use_ocdbt")
        fill_missing = not meta.get("store_array_data_equal_to_fill_value", False)
    except (AttributeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{item}: Orbax '{TREE_METADATA}' is malformed: expected an object with 'tree_metadata', found "
            f"{type(meta).__name__} ({_one_line(e)}); the checkpoint is damaged, re-save it"
        ) from e
    if ocdbt is None:
        ocdbt = (item / MANIFEST).is_file()
    if ocdbt and not (item / MANIFEST).is_file():
        procs = sorted(p.name for p in item.glob("ocdbt.process_*"))
        raise CheckpointIncompleteError(
            f"{item}: Orbax OCDBT checkpoint is incomplete: expected '{MANIFEST}' (written when the per-process "
            f"databases are merged at commit), found none (per-process directories: {procs}); {_UNCOMMITTED}"
        )
    return _ItemMetadata(entries, zarr3, bool(ocdbt), fill_missing)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One leaf entry of ``tree_metadata``."""

    keys: list[tuple[str, int]]  # (key, key_type) from the root
    value_type: str
    skip: bool  # skip_deserialize

    @property
    def name(self) -> str:
        """The name the leaf is stored under: its keys joined by "."."""
        return ".".join(k for k, _ in self.keys)

    def path(self, prefix: list[str]) -> str:
        """The tsckpt leaf path: a sequence index as its number, a dict key escaped."""
        comps = [str(int(k)) if t == 1 else escape(k) for k, t in self.keys]
        return "/".join(prefix + comps) or ROOT_LEAF_PATH


# Orbax's key types (``key_metadata``): a sequence index, and a dict key or attribute
_SEQUENCE, _MAPPING = 1, 2
# What Orbax gives back, without a target, for an empty node of each stored type (a
# NamedTuple, as its default options give, None); a placeholder is no node at all.
_EMPTY_NODES: dict[str, Any] = {
    "None": {"type": "none"},
    "NamedTuple": {"type": "none"},
    "Dict": {"type": "dict", "keys": [], "children": []},
    "List": {"type": "list", "children": []},
    "Tuple": {"type": "tuple", "children": []},
}


class _Level(dict):  # type: ignore[type-arg]
    """One container of :class:`_Shape`: (key, key type) -> a child level, None (a leaf) or
    an empty node's structure JSON."""


class _Shape:
    """The tree an Orbax checkpoint holds as Orbax restores it without a target: nested dicts
    (str keys) and lists, its empty containers and Nones included. Built entry by entry in
    tree order; entries that make no tree (keys of both types in one node, a key twice) make
    none."""

    def __init__(self) -> None:
        self.root = _Level()
        self.broken = False

    def add(self, keys: list[tuple[str, int]], node: Any) -> None:
        """A leaf (``node`` None) or an empty node (its structure JSON) at ``keys`` (none: the root)."""
        level = self.root
        for key in keys[:-1]:
            child = level.setdefault(key, _Level())
            if not isinstance(child, _Level):
                self.broken = True
                return
            level = child
        last = keys[-1] if keys else ()
        self.broken = self.broken or last in level or (not keys and bool(self.root))
        level[last] = node

    def structure(self) -> Any:
        """The structure JSON (:mod:`tsckpt.tree`), or None when the entries make no tree."""
        if () in self.root:  # a tree that is one leaf (or one empty node)
            return None if self.broken else self.root[()]
        out = self._json(self.root)
        return None if self.broken else out

    def _json(self, level: _Level) -> Any:
        children = [self._json(c) if isinstance(c, _Level) else c for c in level.values()]
        kinds = {t for _, t in level}
        if kinds == {_SEQUENCE} and [int(k) for k, _ in level] == list(range(len(level))):
            return {"type": "list", "children": children}
        if kinds == {_MAPPING}:
            return {"type": "dict", "keys": [k for k, _ in level], "children": children}
        self.broken = True
        return None


def _entry(item: Path, entry: Any) -> _Entry:
    try:
        keys = [(str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"]]
        value_type = str(entry["value_metadata"]["value_type"])
        skip = bool(entry["value_metadata"].get("skip_deserialize", False))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{item}: Orbax '{TREE_METADATA}' entry {short_repr(entry, 80)} is malformed: expected 'key_metadata' and "
            f"'value_metadata', found {_one_line(e)}; the checkpoint is damaged, re-save it"
        ) from e
    why = _keys_problem(keys)
    if why is not None:
        raise CorruptCheckpointError(
            f"{item}: Orbax '{TREE_METADATA}' entry {short_repr(entry, 80)}: 'key_metadata' {why}; the checkpoint "
            "is damaged, re-save it"
        )
    return _Entry(keys, value_type, skip)


def _keys_problem(keys: list[tuple[str, int]]) -> str | None:
    """Why an entry's keys make no tsckpt leaf path: too many, a sequence index that is no
    number, or a key that cannot be written as a path component. None if they do."""
    if len(keys) > MAX_STRUCTURE_DEPTH:
        return f"nests {len(keys)} levels deep, more than {MAX_STRUCTURE_DEPTH}"
    for k, t in keys:
        if t == 1 and not _SEQUENCE_KEY.fullmatch(k):
            return f"has the sequence index {short_repr(k)}, expected a number"
        try:
            escape(k)
        except (UnicodeEncodeError, ValueError):
            return f"has the key {short_repr(k)}, which is not valid text"
    return None


def _json_key(item: Path, key: Any) -> str:
    """A JSON item's dict key as a path component."""
    try:
        return escape(str(key))
    except (UnicodeEncodeError, ValueError):
        raise CorruptCheckpointError(
            f"{item / JSON_ITEM}: the key {short_repr(key)} is not valid text; the checkpoint is damaged, re-save it"
        ) from None


@dataclasses.dataclass(frozen=True)
class _Pending:
    """An array leaf found in an item's metadata, opened once every leaf is known."""

    path: str  # the tsckpt leaf path
    name: str  # where the item stores it
    scalar: bool  # a Python number saved as a 0-d array, read into its value
    item: Path
    meta: _ItemMetadata
    read_item: Path  # where TensorStore reads the item: its place in the checkpoint's Mirror

    @property
    def spec(self) -> dict[str, Any]:
        return self.meta.spec(self.read_item, self.name)

    @property
    def node(self) -> str:
        """The array's metadata file, as errors name it."""
        return f"{self.name}/{self.meta.node_name}"

    def where(self) -> str:
        return f"{self.item}: leaf '{self.path}'"


class _LeafCollector:
    """Collects the leaves of one Orbax checkpoint; arrays are opened together at the end."""

    def __init__(self, location: Path) -> None:
        self.location = location
        # TensorStore follows links: it reads the checkpoint's files through held descriptors
        self.mirror = Mirror(str(location), str(location))
        self.mirror.add_tree("")
        self.leaves: list[str] = []
        self.values: dict[str, Any] = {}
        self.pending: list[_Pending] = []
        self.shape = _Shape()
        self._strings: dict[Path, Any] = {}  # item -> its _strings.json, read at its first string

    def add_item(self, item: Path, name: str | None = None) -> None:
        """The leaves of one committed item directory, under its ``name`` (None: at the root)."""
        _check_committed(item)
        top = [] if name is None else [(name, _MAPPING)]
        prefix = [escape(k) for k, _ in top]
        if not (item / TREE_METADATA).is_file():
            self._add_json_item(item, prefix, top)
            return
        meta = _item_metadata(item)
        for raw in meta.entries:
            entry = _entry(item, raw)
            path = entry.path(prefix)
            if not entry.skip and entry.value_type not in _EMPTY_TYPES:
                self._add_entry(item, meta, entry, path)
                self.shape.add(top + entry.keys, None)
            elif entry.value_type in _EMPTY_NODES:
                self.shape.add(top + entry.keys, dict(_EMPTY_NODES[entry.value_type]))

    def _add_json_item(self, item: Path, prefix: list[str], top: list[tuple[str, int]]) -> None:
        """A ``JsonSave`` item (its values become leaves); any other item without tree metadata is incomplete."""
        if (item / JSON_ITEM).is_file():
            self._add_json(item, _read_json(item, JSON_ITEM), prefix, top)
            return
        found = sorted(p.name for p in item.iterdir())[:8]
        raise CheckpointIncompleteError(
            f"{item}: Orbax item is incomplete: expected the tree metadata file '{TREE_METADATA}', found "
            f"{found}; the save crashed before writing it, use another checkpoint or re-save"
        )

    def _add_entry(self, item: Path, meta: _ItemMetadata, entry: _Entry, path: str) -> None:
        name = entry.name
        if entry.value_type != "string":  # the name is where the array is stored: inside the item, no link
            field = f"leaf '{path}': the array name (its keys joined by '.')"
            confined(str(item), name, where=str(item / TREE_METADATA), field=field)
        if entry.value_type == "string":
            value = self._string(item, path, name)
            self.leaves.append(path)
            self.values[path] = value
        elif entry.value_type in _ARRAY_TYPES or entry.value_type == "scalar":
            self.leaves.append(path)
            read_item = Path(self.mirror.path, os.path.relpath(item, self.location))
            self.pending.append(_Pending(path, name, entry.value_type == "scalar", item, meta, read_item))
        else:
            raise LeafTypeError(
                f"{item}: leaf '{path}': Orbax value type '{entry.value_type}' is not supported: expected one of "
                f"{sorted(_ARRAY_TYPES | {'scalar', 'string'})}; restore this leaf with orbax instead"
            )

    def _string(self, item: Path, path: str, name: str) -> str:
        """The string leaf stored as ``name`` in ``item``'s ``_strings.json``."""
        if item not in self._strings:
            self._strings[item] = _read_json(item, "_strings.json")
        strings = self._strings[item]
        if not isinstance(strings, dict) or not isinstance(strings.get(name), str):
            raise CorruptCheckpointError(
                f"{item}: leaf '{path}': expected string '{name}' in '_strings.json', found none; "
                "the checkpoint is damaged, re-save it"
            )
        return strings[name]

    def _add_json(self, item: Path, value: Any, prefix: list[str], top: list[tuple[str, int]]) -> None:
        """The values of a JSON item as leaves, walked iteratively to at most the depth of a tree."""
        stack: list[tuple[Any, list[str], list[tuple[str, int]]]] = [(value, prefix, top)]
        while stack:
            node, comps, keys = stack.pop()
            if len(comps) - len(prefix) > MAX_STRUCTURE_DEPTH:
                raise CorruptCheckpointError(
                    f"{item / JSON_ITEM}: the JSON item nests more than {MAX_STRUCTURE_DEPTH} levels deep; "
                    "the checkpoint is damaged, re-save it"
                )
            if isinstance(node, dict) and node:
                stack.extend(
                    (v, comps + [_json_key(item, k)], keys + [(str(k), _MAPPING)]) for k, v in reversed(list(node.items()))
                )
            elif isinstance(node, list) and node:
                stack.extend((v, comps + [str(i)], keys + [(str(i), _SEQUENCE)]) for i, v in reversed(list(enumerate(node))))
            elif isinstance(node, (dict, list)) or node is None:
                self.shape.add(keys, dict(_EMPTY_NODES["Dict" if isinstance(node, dict) else "List" if node == [] else "None"]))
            else:
                path = "/".join(comps) or ROOT_LEAF_PATH
                self.leaves.append(path)
                self.values[path] = node
                self.shape.add(keys, None)

    def finish(self) -> ForeignCheckpoint:
        """Open every array (concurrently) once its metadata is parsed and its chunks are
        found to decode to a bounded size; a scalar leaf is read into its value."""
        why = paths_problem(self.leaves)
        if why is not None:
            raise CorruptCheckpointError(
                f"{self.location}: Orbax '{TREE_METADATA}' gives leaf paths that make no tree: {why}; the "
                "checkpoint is damaged, re-save it"
            )
        context = ts.Context()
        nodes = [_read_node(a, context) for a in self.pending]
        for a, node in zip(self.pending, nodes):
            _check_node(a, node)
        opened = [ts.open(a.spec, read=True, context=context) for a in self.pending]
        arrays: dict[str, ForeignArray] = {}
        for a, future in zip(self.pending, opened):
            try:
                store = future.result()
            except Exception as e:  # TensorStore raises ValueError/OSError subclasses, varying by version
                raise _unreadable(a, e) from e
            _check_chunks(a, store)
            _check_stored(a, store, context)
            if a.scalar:  # a Python int/float/bool saved as a 0-d array
                try:
                    self.values[a.path] = store.read().result().item()
                except Exception as e:  # noqa: BLE001 - as above
                    raise _unreadable(a, e) from e
                continue
            arrays[a.path] = self._array(a.path, a.spec, store)
        values = {p: self.values[p] for p in self.leaves if p in self.values}
        proxy = types.MappingProxyType
        structure = self.shape.structure()
        if structure_problem(structure, self.leaves) is not None:  # entries out of tree order: nested dicts
            structure = structure_from_paths(self.leaves)
        return ForeignCheckpoint(str(self.location), tuple(self.leaves), proxy(arrays), proxy(values), structure, self.mirror)

    def _array(self, path: str, spec: dict[str, Any], store: ts.TensorStore) -> ForeignArray:
        dtype = _dtypes.numpy_name(store.dtype.numpy_dtype)
        if dtype is None:
            raise LeafTypeError(
                f"{self.location}: leaf '{path}': Orbax array dtype {store.dtype.name} has no tsckpt "
                f"equivalent: expected a numeric dtype; restore this leaf with orbax instead"
            )
        shape = tuple(int(s) for s in store.shape)
        chunk = tuple(int(c or s) for c, s in zip(store.chunk_layout.read_chunk.shape or shape, shape))
        return ForeignArray(path, shape, dtype, chunk, spec)


def _unreadable(a: _Pending, e: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{a.where()}: cannot read Orbax array '{a.name}': expected a readable {a.spec['driver']} array, found "
        f"{_one_line(e)}; the checkpoint is damaged, re-save it"
    )


def _item_store(a: _Pending, context: ts.Context) -> ts.KvStore:
    """The kvstore of the item holding the array (keys ``<name>/...``)."""
    kv = a.meta.kvstore(a.read_item)
    kv = {**kv, "path": kv["path"].rstrip("/") + "/" if kv["path"] else ""}
    return ts.KvStore.open(kv, context=context).result()


def _read_node(a: _Pending, context: ts.Context) -> Any:
    """Start reading the array's zarr metadata (a future of its bytes)."""
    return _item_store(a, context).read(f"{a.name}/{a.meta.node_name}")


def _check_node(a: _Pending, node: Any) -> None:
    """The array's metadata is a JSON object TensorStore can parse: TensorStore itself crashes
    the process on JSON nested deeply enough, so it never sees such a node."""
    try:
        found = node.result()
    except Exception as e:  # noqa: BLE001 - a damaged database, an unreadable file
        raise _unreadable(a, e) from e
    if found.state != "value":
        raise CorruptCheckpointError(
            f"{a.where()}: cannot read Orbax array '{a.name}': expected its metadata '{a.node}', found none; the "
            "checkpoint is damaged, re-save it"
        )
    try:
        parsed = parse_json(found.value)
    except ValueError as e:
        parsed = e
    if not isinstance(parsed, dict):
        what = f"not JSON ({parsed})" if isinstance(parsed, ValueError) else f"a JSON {type(parsed).__name__}"
        raise CorruptCheckpointError(
            f"{a.where()}: '{a.node}' is {what}, expected a JSON object; the checkpoint is damaged, re-save it"
        )


def _check_chunks(a: _Pending, store: ts.TensorStore) -> None:
    """Refuse an array whose chunks (or a shard's index) would decode to more than
    MAX_CHUNK_BYTES, or whose chunks are larger than the array itself, before any is read."""
    shape = tuple(int(n) for n in store.shape)
    itemsize = store.dtype.numpy_dtype.itemsize
    layout = store.chunk_layout
    read = tuple(int(c or s) for c, s in zip(layout.read_chunk.shape or shape, shape))
    write = tuple(int(c or s) for c, s in zip(layout.write_chunk.shape or read, shape))
    index = math.prod(-(-w // r) for w, r in zip(write, read)) * _INDEX_ENTRY_BYTES if write != read else 0
    for chunk, what in ((read, "chunks"), (write, "shards")):
        nbytes = math.prod(chunk) * itemsize
        if nbytes <= MAX_CHUNK_BYTES and index <= MAX_CHUNK_BYTES and all(c <= max(s, 1) for c, s in zip(chunk, shape)):
            continue
        raise CorruptCheckpointError(
            f"{a.where()}: '{a.node}' gives the array {list(shape)} {what} of {list(chunk)} ({nbytes} bytes decoded "
            f"each{f', {index} bytes of shard index' if index else ''}): expected {what} no larger than the array, "
            f"of at most {MAX_CHUNK_BYTES} bytes (the largest orbax-checkpoint writes by default); refused before "
            "any is decoded: the checkpoint is damaged or made to exhaust memory, use a trusted copy"
        )
    cells = math.prod(-(-s // w) for s, w in zip(shape, write)) if all(shape) else 0
    if cells > MAX_CHUNKS:
        raise CorruptCheckpointError(
            f"{a.where()}: '{a.node}' gives the array {list(shape)} {cells} chunks of {list(write)}: expected at most "
            f"{MAX_CHUNKS}; the checkpoint is damaged or made to exhaust memory, use a trusted copy"
        )


def _check_stored(a: _Pending, store: ts.TensorStore, context: ts.Context) -> None:
    """An array of more than 64 MiB whose missing chunks are errors (as Orbax writes it) must
    store every chunk its metadata gives it, checked by listing its keys before anything is
    allocated for it: a record of kilobytes could otherwise claim petabytes. (An array whose
    missing chunks read as fill values, from an older Orbax, cannot be checked so.)"""
    shape = tuple(int(n) for n in store.shape)
    if a.meta.fill_missing or math.prod(shape) * store.dtype.numpy_dtype.itemsize <= UNCHECKED_BYTES:
        return
    write = tuple(int(c or s) for c, s in zip(store.chunk_layout.write_chunk.shape or shape, shape))
    cells = math.prod(-(-s // w) for s, w in zip(shape, write))
    prefix = f"{a.name}/"
    keys = _item_store(a, context).list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
    stored = sum(not k.decode("utf-8", "replace").rsplit("/", 1)[-1].startswith((".z", "zarr.json")) for k in keys)
    if stored < cells:
        raise CorruptCheckpointError(
            f"{a.where()}: '{a.node}' gives the array {list(shape)} {cells} chunks of {list(write)} but it stores "
            f"{stored}, and a missing chunk is an error in this checkpoint; refused before anything is allocated: "
            "the checkpoint is damaged, re-save it"
        )


def _items(step: Path) -> list[str]:
    meta = _read_json(step, STEP_METADATA) if (step / STEP_METADATA).is_file() else None
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    if isinstance(handlers, dict):
        return sorted(str(k) for k in handlers)
    return sorted(
        p.name for p in step.iterdir() if p.is_dir() and any((p / f).is_file() for f in (TREE_METADATA, JSON_ITEM))
    )


def load(directory: str) -> ForeignCheckpoint:
    """Parse an Orbax item or step directory; arrays come back as TensorStore specs."""
    d = Path(os.path.abspath(directory))
    if not d.is_dir():
        raise CheckpointNotFoundError(f"{d}: no such directory: expected an Orbax checkpoint directory; check the path")
    refuse_links(str(d), str(d), verify_lists=False)  # TensorStore follows links: none may lead out of it
    reader = _LeafCollector(d)
    if (d / TREE_METADATA).is_file() or TMP_SUFFIX in d.name:
        reader.add_item(d)
    elif items := _items(d) if (d / STEP_METADATA).is_file() else []:
        _add_step(reader, d, items)
    elif (d / STEP_METADATA).is_file() or (d / MANIFEST).is_file() or any(d.glob("ocdbt.process_*")):
        reader.add_item(d)  # an item without tree metadata: raises unless it is a JSON item
    else:
        raise _not_one_checkpoint(d)
    return reader.finish()


def _add_step(reader: _LeafCollector, step: Path, items: list[str]) -> None:
    """The items of a committed step; a lone ``default`` item's leaves are not prefixed by its name."""
    _check_committed(step)
    for name in items:
        confined(str(step), name, where=str(step / STEP_METADATA), field="an item of 'item_handlers'")
        if not (step / name).is_dir():
            raise CheckpointIncompleteError(
                f"{step}: Orbax step is incomplete: expected item directory '{name}' listed in '{STEP_METADATA}', "
                f"found none; {_UNCOMMITTED}"
            )
        reader.add_item(step / name, None if items == ["default"] else name)


def _not_one_checkpoint(d: Path) -> Exception:
    """Why ``d``, neither an item nor a step directory, is not read: a CheckpointManager root
    (naming its newest committed step), a legacy msgpack checkpoint, or no Orbax checkpoint."""
    steps = _steps(d)
    if steps:
        done = [(s, p) for s, p in steps if TMP_SUFFIX not in p.name and _committed(p) is not False]
        if not done:
            return CheckpointIncompleteError(
                f"{d}: Orbax CheckpointManager root with no committed step: expected a committed step directory, "
                f"found only {[p.name for _, p in steps]}; {_UNCOMMITTED}"
            )
        return NotACheckpointError(
            f"{d}: an Orbax CheckpointManager root, not one checkpoint: expected an item or step directory, found "
            f"steps {[s for s, _ in done]}; pass the newest committed step directory '{done[-1][1]}' instead"
        )
    if (d / "checkpoint").is_file():
        return NotACheckpointError(
            f"{d}: a legacy msgpack Orbax/Flax checkpoint: expected '{TREE_METADATA}' tree metadata, found only "
            "the 'checkpoint' file; re-save it with a current orbax-checkpoint"
        )
    found = sorted(p.name for p in d.iterdir())[:8]
    return NotACheckpointError(
        f"{d}: not an Orbax checkpoint: expected '{TREE_METADATA}' (item), '{STEP_METADATA}' (step) or numbered "
        f"step directories, found {found}; pass an Orbax item or step directory"
    )


def as_checkpoint(loc: Location) -> Checkpoint:
    """The local Orbax checkpoint at ``loc`` as a :class:`Checkpoint` whose arrays open
    through their own specs (read verbs never read Orbax's files any other way)."""
    if loc.local is None:
        raise NotACheckpointError(f"{loc}: Orbax checkpoints are read from a local directory; copy it to one")
    fc = load(loc.local)
    bound_heap()  # its chunks are decoded by TensorStore's threads, into buffers they free
    arrays = {
        p: ArrayRecord(p, a.shape, a.dtype, "numpy", Chunking(a.chunk_shape or (1,) * len(a.shape), None))
        for p, a in fc.arrays.items()
    }
    specs = {p: a.spec for p, a in fc.arrays.items()}
    return Checkpoint(
        loc, fc.leaves, arrays, dict(fc.values), fc.structure, {}, {}, specs, format="orbax", names=ORBAX_NAMES, held=fc.held
    )
