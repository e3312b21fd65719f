"""tsckpt's root ``zarr.json``: the one reading of a root's state, and the parsing and
validation of a committed root's metadata into a :class:`Checkpoint`.

Every field is checked before anything is opened: a root that is no checkpoint, was
never committed or was written by a newer format is refused first, then each leaf's
entry (array record, value, alias, its place in ``leaves``) and the tree structure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from .._base import dtypes as _dtypes
from .._base.lazytorch import loaded
from .._errors import (
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    NotACheckpointError,
    count_and_list,
    short_repr,
)
from .._storage.confine import file_kind
from .._storage.locations import CONTEXT, Location
from .._storage.mirror import Mirror
from ..tree import structure_problem
from .arrays import MANIFEST
from .bounds import METADATA_BYTES, ROOT_BYTES, file_problem, refused
from .checkpoint import Checkpoint
from .readfaults import replaced
from .records import (
    FORMAT_VERSION,
    LAYOUT_COMPACT,
    LAYOUT_PLAIN,
    LAYOUTS,
    ROOT_KEY,
    STATE_COMMITTED,
    ArrayRecord,
    decode_value,
    record_problem,
)


@dataclasses.dataclass(frozen=True)
class RootState:
    """What a root ``zarr.json`` says about the save that wrote it."""

    state: str | None  # "committed", "pending", ...; None when there is no root zarr.json
    meta: Mapping[str, Any] | None = None  # attributes.tsckpt, when readable
    # "json": not valid JSON; "foreign": a zarr.json without tsckpt metadata; "file": not read,
    # as it is no regular file or too large (bounds.py), ``detail`` saying which
    problem: str | None = None
    detail: str = ""


def root_state(value: bytes | None) -> RootState:
    """Parse a root ``zarr.json`` (None: the key does not exist). The one reading of a root's state."""
    if value is None:
        return RootState(None)
    try:
        root = json.loads(value)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply to parse
        return RootState("invalid", problem="json", detail=str(e))
    attrs = root.get("attributes") if isinstance(root, dict) else None
    meta = attrs.get("tsckpt") if isinstance(attrs, dict) else None
    if not isinstance(meta, dict):
        return RootState("invalid", problem="foreign")
    state = meta.get("state")
    return RootState(state if isinstance(state, str) else "invalid", meta)


def root_file_problem(loc: Location, key: str = ROOT_KEY) -> str | None:
    """Why the root zarr.json at ``key`` below the local location ``loc`` is not read (it is
    no regular file, or larger than :data:`bounds.ROOT_BYTES`), as a phrase after its name;
    None when it may be read, or is missing, or ``loc`` is not local. Checked before every
    read of a root: TensorStore would wait on a FIFO forever, and read a device or a sparse
    file of gigabytes whole."""
    if loc.local is None:
        return None
    return file_problem(os.path.join(loc.local, key), ROOT_BYTES, "a root zarr.json")


def read_roots(loc: Location, keys: list[str]) -> dict[str, tuple[RootState, bytes]]:
    """:func:`root_state` of several root keys below ``loc``, read concurrently, each with the
    generation it was read at (TensorStore's generation of a missing key when there is none):
    the condition of replacing or removing it. A root that is not read (:func:`root_file_problem`)
    is "invalid" (problem "file"), with no generation. The states leave the roots' tables out
    (:func:`_summary`); a local root read before at the same generation is not read or parsed
    again (:class:`_Parsed`)."""
    problems = {k: root_file_problem(loc, k) for k in keys}
    kv, _held = _root_store(loc, [k for k in keys if problems[k] is None])
    seen = {k: _PARSED.get(loc, k) for k in keys}
    reads = {k: kv.read(k, if_not_equal=_generation(seen[k])) for k in keys if problems[k] is None}
    out = {}
    for key in keys:
        problem = problems[key]
        if problem is not None:
            out[key] = (RootState("invalid", problem="file", detail=f"its root zarr.json {problem}"), b"")
            continue
        r = reads[key].result()
        generation, before = bytes(r.stamp.generation), seen[key]
        if r.state == "unspecified" and before is not None and before[0] == generation:
            out[key] = (before[1], generation)
            continue
        out[key] = (_summary(root_state(r.value if r.state == "value" else None)), generation)
        _PARSED.put(loc, key, *out[key])
    return out


# A root's tables (a committed save's tree, leaves, arrays, values and content entries): what
# a step is judged by (its state, claim, save id) never needs them, so the states read by
# :func:`read_roots` leave them out (a manager keeps them for each step it has seen).
_TABLES = frozenset({"structure", "leaves", "arrays", "values", "content", "aliases"})


def _summary(state: RootState) -> RootState:
    """``state`` without its root's tables."""
    if state.meta is None or not _TABLES & state.meta.keys():
        return state
    return dataclasses.replace(state, meta={k: v for k, v in state.meta.items() if k not in _TABLES})


def _generation(seen: tuple[bytes, RootState] | None) -> bytes | None:
    return None if seen is None else seen[0]


class _Parsed:
    """The states of local roots read before, by checkpoint, key and the generation read (a
    manager reads the root of every step at each save: each is parsed once while it stays
    the same file, TensorStore's conditional read telling so, its bytes not read again).
    A root whose file is replaced or written has another generation; a missing one is never kept."""

    LIMIT = 1024  # entries kept at most (emptied when full); each a few hundred bytes (no tables)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[tuple[str, str], tuple[bytes, RootState]] = {}

    def get(self, loc: Location, key: str) -> tuple[bytes, RootState] | None:
        if loc.local is None:
            return None
        with self._lock:
            return self._states.get((loc.local, key))

    def put(self, loc: Location, key: str, state: RootState, generation: bytes) -> None:
        if loc.local is None or state.state is None or not generation:
            return
        with self._lock:
            if len(self._states) >= self.LIMIT:
                self._states.clear()
            self._states[(loc.local, key)] = (generation, state)


_PARSED = _Parsed()


def load(loc: Location, *, keep_bad: bool = False) -> Checkpoint:
    """Parse and validate the root metadata at ``loc``; raise a precise error if it is not a
    committed tsckpt checkpoint (storage faults pass unchanged: the caller words them).

    Every leaf's entry and the tree structure are checked before anything is opened. A bad
    one raises a CorruptCheckpointError naming it, unless ``keep_bad`` (verify): then the bad
    leaves are left out of the checkpoint and listed in ``Checkpoint.bad``."""
    root, generation = _read_root(loc)
    meta = _committed_meta(loc, root)
    _check_layout(loc, meta, generation)
    found = _leaf_records(loc, meta)
    structure = meta.get("structure")
    tree_problem = structure_problem(structure, found.leaves)
    if tree_problem is not None:
        tree_problem = f"the tree structure in the root metadata is invalid: {tree_problem}"
    if not keep_bad:
        _raise_first(loc, found.bad, tree_problem)
    return Checkpoint(
        loc,
        found.leaves,
        found.arrays,
        found.values,
        None if tree_problem else structure,
        meta,
        found.aliases,
        bad=found.bad,
        tree_problem=tree_problem,
        root_generation=generation,
    )


# ---- the root itself ---------------------------------------------------------------------


def _read_root(loc: Location) -> tuple[RootState, bytes]:
    """The root's state and generation; a missing directory or an empty location is not found."""
    if loc.local is not None and not os.path.isdir(loc.local):
        if os.path.exists(loc.local):  # nothing of it is read: it may be a FIFO
            mode = os.stat(loc.local).st_mode
            what = "a file" if stat.S_ISREG(mode) else file_kind(mode)
            raise NotACheckpointError(
                f"{loc}: is {what}, not a checkpoint directory (nothing of it was read); give the directory a save "
                "wrote, or a file of another format (format= names it)"
            )
        raise CheckpointNotFoundError(f"{loc}: no such directory; check the path")
    problem = root_file_problem(loc)
    if problem is not None:
        raise refused(
            f"{loc}: zarr.json", problem, "it is no checkpoint's root (tsckpt writes a regular file of a few MiB at "
            "most); restore from another checkpoint"
        )
    kv, _held = _root_store(loc, [ROOT_KEY])
    found = kv.read(ROOT_KEY).result()
    root = root_state(found.value if found.state == "value" else None)
    if root.state is None and loc.local is None and not kv.list().result():
        raise CheckpointNotFoundError(f"{loc}: nothing stored here; check the location")
    return root, bytes(found.stamp.generation)


def _root_store(loc: Location, keys: list[str]) -> tuple[ts.KvStore, Mirror | None]:
    """The kvstore to read the roots ``keys`` below ``loc`` from: for a local directory, a
    :class:`Mirror` of those files, opened now with no link followed (LinkRefusedError for a
    root that is a link: TensorStore would read wherever it leads), kept while it is read;
    else ``loc``'s own. The generations read are the files' own, as ``loc``'s kvstore gives them."""
    if loc.local is None or not os.path.isdir(loc.local):
        return loc.kvstore(), None
    mirror = Mirror(loc.local, str(loc))
    mirror.add(keys, field="the root metadata")
    return ts.KvStore.open(mirror.spec(), context=CONTEXT).result(), mirror


def _committed_meta(loc: Location, root: RootState) -> Mapping[str, Any]:
    """The tsckpt metadata of a root that a tsckpt of this version reads and whose save committed."""
    if root.state is None:
        raise NotACheckpointError(
            f"{loc}: not a tsckpt checkpoint (no root zarr.json); it may be another kind of directory, "
            "or an overwrite that was interrupted"
        )
    if root.problem == "json":
        raise CorruptCheckpointError(f"{loc}: root zarr.json is not valid JSON ({root.detail})")
    if root.meta is None:
        raise NotACheckpointError(
            f"{loc}: a zarr hierarchy but not a tsckpt checkpoint (no 'tsckpt' attributes in zarr.json)"
        )
    _check_version(loc, root.meta)
    if root.state != STATE_COMMITTED:
        raise CheckpointIncompleteError(
            f"{loc}: this checkpoint was never committed (state {short_repr(root.meta.get('state'))}): its save "
            "crashed or is still running; use an earlier checkpoint, or save again with overwrite=True"
        )
    return root.meta


def _check_version(loc: Location, meta: Mapping[str, Any]) -> None:
    """Refuse a format version no tsckpt writes, or one newer than this tsckpt reads."""
    version = meta.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version < 1:
        raise FormatVersionError(
            f"{loc}: 'format_version' is {version}, which no tsckpt writes (versions start at 1); the root "
            "metadata is damaged: restore from another checkpoint"
        )
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        library = meta.get("library", "an unknown library")
        raise FormatVersionError(
            f"{loc}: written with format version {short_repr(version)} by "
            f"{library if isinstance(library, str) and len(library) <= 80 else 'an unknown library'}, "
            f"but this tsckpt reads versions up to {FORMAT_VERSION}; upgrade tsckpt"
        )


def _check_layout(loc: Location, meta: Mapping[str, Any], generation: bytes) -> None:
    """A known layout, and a compact checkpoint with arrays has its database (unless the
    root of ``generation`` was replaced or deleted meanwhile: that is said instead)."""
    if meta.get("layout", LAYOUT_PLAIN) not in LAYOUTS:
        raise CorruptCheckpointError(
            f"{loc}: root metadata names an unknown layout {short_repr(meta.get('layout'))} "
            f"(expected one of {list(LAYOUTS)})"
        )
    if meta.get("layout") == LAYOUT_COMPACT and meta.get("arrays") and not _has_manifest(loc):
        gone = replaced(loc, generation)
        if gone is not None:
            raise gone
        raise CorruptCheckpointError(
            f"{loc}: the array database of this compact checkpoint is missing ({MANIFEST} does not exist); "
            "restore from another checkpoint"
        )


def _has_manifest(loc: Location) -> bool:
    """Whether the compact checkpoint at ``loc`` has its database's manifest; on a local disk
    looked at without reading it (read later by TensorStore, whole: it must be a regular file
    of at most :data:`bounds.METADATA_BYTES`)."""
    if loc.local is None:
        return bool(loc.kvstore().read(MANIFEST).result().state == "value")
    path = os.path.join(loc.local, MANIFEST)
    problem = file_problem(path, METADATA_BYTES, "an OCDBT manifest")
    if problem is not None:
        raise refused(f"{loc}: {MANIFEST}", problem, "the checkpoint is damaged; restore from another checkpoint")
    return os.path.lexists(path)


def _raise_first(loc: Location, bad: Mapping[str, str], tree_problem: str | None) -> None:
    """Refuse a root with bad leaves (naming the first and how many) or an invalid tree."""
    if bad:
        first = next(iter(bad.values()))
        more = f" (also bad: {count_and_list(list(bad)[1:])})" if len(bad) > 1 else ""
        raise CorruptCheckpointError(f"{loc}: {first}; restore from another checkpoint{more}")
    if tree_problem is not None:
        raise CorruptCheckpointError(f"{loc}: {tree_problem}; restore from another checkpoint")


# ---- the leaves' entries -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Fields:
    """The root's per-leaf fields, each of its JSON type."""

    records: list[Any]  # "arrays"
    encoded: dict[str, Any]  # "values"
    listed: list[str]  # "leaves"
    tied: dict[str, Any]  # "aliases"


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """The valid entries of a committed root, and ``bad``: each leaf whose entry is invalid, and why."""

    leaves: tuple[str, ...]
    arrays: dict[str, ArrayRecord]
    values: dict[str, Any]
    aliases: dict[str, str]
    bad: dict[str, str]


def _leaf_records(loc: Location, meta: Mapping[str, Any]) -> _Leaves:
    """The leaves of a committed root. Each invalid entry is listed in ``bad`` rather than
    raised, so that verify can report every one (a bad leaf is neither read nor listed as
    good); a root whose fields are not of their JSON types at all is refused here."""
    fields = _fields(loc, meta)
    bad: dict[str, str] = {}
    arrays = _array_records(fields.records, meta["format_version"], bad)
    values = _values(fields.encoded, arrays, bad)
    aliases = _aliases(fields.tied, arrays, fields.encoded, bad)
    _check_listed(fields.listed, arrays, values, aliases, bad)
    for path in bad:
        arrays.pop(path, None)
        values.pop(path, None)
    return _Leaves(tuple(fields.listed), arrays, values, aliases, bad)


def _fields(loc: Location, meta: Mapping[str, Any]) -> _Fields:
    records = _root_field(loc, meta, "arrays", list, "a list of array records")
    encoded = _root_field(loc, meta, "values", dict, "an object mapping leaf paths to values")
    listed = _root_field(loc, meta, "leaves", list, "a list of leaf paths")
    if not all(isinstance(p, str) for p in listed):
        raise CorruptCheckpointError(
            f"{loc}: root metadata is malformed ('leaves' holds a non-string); restore from another checkpoint"
        )
    tied = meta.get("aliases") or {}
    if not isinstance(tied, dict) or not all(isinstance(s, str) for s in tied.values()):
        raise CorruptCheckpointError(
            f"{loc}: root metadata is malformed ('aliases' is not an object mapping leaf paths to paths); "
            "restore from another checkpoint"
        )
    return _Fields(records, encoded, listed, tied)


def _root_field(loc: Location, meta: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    """A required field of the root metadata, of the JSON type ``kind``; else the root is malformed."""
    if key not in meta:
        raise CorruptCheckpointError(
            f"{loc}: root metadata is malformed (KeyError: '{key}'); restore from another checkpoint"
        )
    value = meta[key]
    if not isinstance(value, kind):
        raise CorruptCheckpointError(
            f"{loc}: root metadata is malformed ('{key}' is a JSON {_json_type(value)}, expected {what}); "
            "restore from another checkpoint"
        )
    return value


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _array_records(records: list[Any], version: int, bad: dict[str, str]) -> dict[str, ArrayRecord]:
    """The valid array records by path (of a root of format ``version``); an invalid one, or a
    path with two, goes to ``bad``."""
    arrays: dict[str, ArrayRecord] = {}
    for i, rec in enumerate(records):
        why = _record_problem(rec)
        name = rec["path"] if isinstance(rec, dict) and isinstance(rec.get("path"), str) else "?"
        if why is None and name in arrays:
            why = "the leaf has two records"
            del arrays[name]
        if why is not None:
            key = name if name != "?" else f"arrays[{i}]"
            bad.setdefault(key, f"the record of array '{name}' in the root metadata is invalid: {why}")
        elif name not in bad:
            arrays[name] = ArrayRecord.from_json(rec, version=version)
    return arrays


def _record_problem(rec: Any) -> str | None:
    """Why one array record is invalid, or None."""
    why = record_problem(rec, _dtypes.is_known)
    # a process without torch reads such an array as numpy, and checks the dtype if as_saved
    # asks for a tensor (tsckpt._read.restore.saved_kind_target)
    if why is None and rec["kind"] == "torch" and loaded() is not None and rec["dtype"] not in _dtypes.torch_dtypes():
        why = f"'kind' is 'torch' but torch has no dtype {rec['dtype']!r} (a numpy array's kind is 'numpy')"
    return why


def _values(encoded: dict[str, Any], arrays: Mapping[str, ArrayRecord], bad: dict[str, str]) -> dict[str, Any]:
    """The decoded plain values by path; one that does not decode, or is also an array, goes to ``bad``."""
    values: dict[str, Any] = {}
    for path, enc in encoded.items():
        try:
            values[path] = decode_value(enc)
        except ValueError as e:
            bad.setdefault(path, f"the value of '{path}' in the root metadata is invalid: {e}")
        if path in arrays:
            bad.setdefault(path, f"'{path}' has both an array record and a value in the root metadata")
    return values


def _aliases(
    tied: dict[str, str], arrays: Mapping[str, ArrayRecord], encoded: Mapping[str, Any], bad: dict[str, str]
) -> dict[str, str]:
    """Tied leaf -> the stored array it reads; one naming no valid array, or with an entry of
    its own, goes to ``bad``."""
    aliases: dict[str, str] = {}
    for alias, stored in tied.items():
        if stored in bad:
            bad.setdefault(alias, f"aliases ['{alias} -> {stored}'] name an array whose record is invalid")
        elif stored not in arrays:
            bad.setdefault(alias, f"aliases ['{alias} -> {stored}'] name no stored array")
        elif alias in arrays or alias in encoded:
            bad.setdefault(alias, f"alias '{alias}' also has its own record in the root metadata")
        else:
            aliases[alias] = stored
    return aliases


def _check_listed(
    listed: list[str],
    arrays: Mapping[str, ArrayRecord],
    values: Mapping[str, Any],
    aliases: Mapping[str, str],
    bad: dict[str, str],
) -> None:
    """Every listed leaf has an entry, and every entry is listed (an unlisted one would be
    read by verify, never by restore: the two would disagree)."""
    for path in listed:
        if path not in arrays and path not in values and path not in aliases and path not in bad:
            bad[path] = f"leaves ['{path}'] are listed but have no record"
    named = set(listed)
    for path in [*arrays, *values]:
        if path not in named:
            bad.setdefault(path, f"'{path}' has an entry in the root metadata but is not listed in 'leaves'")
