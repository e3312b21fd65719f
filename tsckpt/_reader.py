"""Reading a committed checkpoint: its metadata, and lazy arrays for offline reads."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import optree
import tensorstore as ts
import torch

from . import _dtypes, _store
from ._formats import orbax
from ._links import refuse_links
from ._arrays import MANIFEST, data_spec, node_problem, open_array_future, parse_node, stored_files, stored_size
from ._errors import (
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    NotACheckpointError,
    TsckptError,
    count_and_list,
    short_repr,
)
from ._format import (
    FORMAT_VERSION,
    LAYOUT_COMPACT,
    LAYOUT_PLAIN,
    LAYOUTS,
    ROOT_KEY,
    STATE_COMMITTED,
    ArrayRecord,
    Chunking,
    decode_value,
    record_problem,
)
from ._store import Directory, Location, resolve
from .tree import ROOT_LEAF_PATH, child, from_paths, structure_from_json, structure_from_paths, structure_problem


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What is known about a stored array without reading its data."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]  # unit of partial reads
    shard_shape: tuple[int, ...]  # one file per shard
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The parsed root metadata of a committed checkpoint."""

    location: Location
    leaves: tuple[str, ...]
    arrays: Mapping[str, ArrayRecord]
    values: Mapping[str, Any]  # path -> decoded plain value
    structure: Any
    raw: Mapping[str, Any]
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # alias path -> stored array path
    # arrays of a checkpoint written by another library (Orbax): path -> TensorStore spec
    specs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # load(keep_bad=True): leaves left out because their entry in the root metadata is invalid
    bad: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tree_problem: str | None = None  # and why the structure cannot rebuild the tree
    # the data kvstore, and the arrays whose files were found to back their records
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def kvstore(self) -> ts.KvStore:
        """The kvstore of :meth:`data`, opened once."""
        if "kv" not in self._cache:
            self._cache["kv"] = ts.KvStore.open(self.data(), context=_store.CONTEXT).result()
        return cast(ts.KvStore, self._cache["kv"])

    @property
    def format(self) -> str:
        """"tsckpt", or the library that wrote a checkpoint tsckpt reads directly ("orbax")."""
        return str(self.raw.get("format", "tsckpt"))

    @property
    def layout(self) -> str:
        """Where the array data lives: "plain" (a file per shard) or "compact" (OCDBT)."""
        return str(self.raw.get("layout", LAYOUT_PLAIN))

    def data(self) -> dict[str, Any]:
        """kvstore spec holding the array nodes and chunks."""
        return data_spec(self.location, self.layout)

    def open_array_future(self, path: str) -> Opening:
        """Open a stored array for reading; its zarr.json is checked against the root metadata."""
        return Opening(self, path)

    def check_links(self) -> None:
        """Refuse a local checkpoint that holds a symbolic link before reading its data
        (docs/security.md); another library's checkpoint (Orbax) is left to that library."""
        if not self.specs:
            refuse_links(self.location.local, str(self.location), tuple(self.arrays))

    def is_array(self, path: str) -> bool:
        return path in self.arrays or path in self.aliases

    def array_metadata(self, path: str) -> ArrayMetadata:
        rec = self.arrays[self.aliases.get(path, path)]
        return ArrayMetadata(
            path=path,
            shape=rec.shape,
            dtype=rec.dtype,
            chunk_shape=rec.chunking.chunk_shape or rec.chunking.shard_shape,
            shard_shape=rec.chunking.shard_shape,
            nbytes=math.prod(rec.shape) * _dtypes.itemsize(rec.dtype),
        )

    def build(self, leaves: list[Any]) -> Any:
        """Arrange per-leaf objects (in ``self.leaves`` order) into the saved tree."""
        if self.structure is not None:
            return structure_from_json(self.structure, leaves)
        return from_paths(self.leaves, leaves)  # saved by ranks with different trees

    def subtree(self, prefix: str) -> Any:
        """The saved subtree at ``prefix``: values as saved, arrays read whole (numpy), containers as saved."""
        node = self.build(list(self.leaves))
        for component in (c for c in prefix.strip("/").split("/") if c):
            try:
                node = child(node, component)
            except (KeyError, IndexError):
                return None
        return optree.tree_map(self._read_whole, node, none_is_leaf=False)

    def _read_whole(self, path: str) -> Any:
        stored = self.aliases.get(path, path)
        return self.values[stored] if stored in self.values else LazyArray(self, stored)[...]


class Opening:
    """A stored array being opened (``result()`` is the TensorStore). Its zarr.json is read
    and parsed here first, as TensorStore crashes the process on JSON nested deeply enough;
    a node that agrees with the record is then not read again, and any other is left to
    TensorStore, which names what differs. Reads start at once, so arrays open concurrently."""

    def __init__(self, ck: Checkpoint, path: str) -> None:
        self._ck, self._path = ck, path
        self._node = None if path in ck.specs else ck.kvstore().read(f"{path}/{ROOT_KEY}")

    def result(self) -> ts.TensorStore:
        ck, path = self._ck, self._path
        if self._node is None:
            return ts.open(ck.specs[path], read=True, context=_store.CONTEXT).result()
        found = self._node.result()
        rec = ck.arrays[path]
        if found.state == "value":
            try:
                node = parse_node(found.value)
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"'{path}' in {ck.location}: {path}/zarr.json is not valid JSON ({e}); "
                    "restore from another checkpoint"
                ) from None
            if node_problem(node, rec) is None:
                return open_array_future(ck.data(), rec, checked=True).result()
        return open_array_future(ck.data(), rec).result()  # missing or different: TensorStore says how


@dataclasses.dataclass(frozen=True)
class RootState:
    """What a root ``zarr.json`` says about the save that wrote it."""

    state: str | None  # "committed", "pending", ...; None when there is no root zarr.json
    meta: Mapping[str, Any] | None = None  # attributes.tsckpt, when readable
    problem: str | None = None  # "json": not valid JSON; "foreign": a zarr.json without tsckpt metadata
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


def read_root_states(kv: ts.KvStore, keys: list[str]) -> dict[str, RootState]:
    """:func:`root_state` of several root keys, read concurrently."""
    reads = {k: kv.read(k) for k in keys}
    out = {}
    for key, fut in reads.items():
        r = fut.result()
        out[key] = root_state(r.value if r.state == "value" else None)
    return out


def load(directory: Directory | Location, *, keep_bad: bool = False) -> Checkpoint:
    """Parse and validate the root metadata; raise a precise error if not a committed checkpoint.

    Every leaf's entry and the tree structure are checked before anything is opened. A bad
    one raises a CorruptCheckpointError naming it, unless ``keep_bad`` (verify): then the bad
    leaves are left out of the checkpoint and listed in ``Checkpoint.bad``."""
    loc = directory if isinstance(directory, Location) else resolve(directory)
    with _store.storage_errors(loc):
        return _load(loc, keep_bad)


def _load(loc: Location, keep_bad: bool) -> Checkpoint:
    if loc.local is not None and not os.path.isdir(loc.local):
        raise CheckpointNotFoundError(f"{loc}: no such directory; check the path")
    kv = loc.kvstore()
    root = read_root_states(kv, [ROOT_KEY])[ROOT_KEY]
    if root.state is None and loc.local is not None and orbax.detect(loc.local):
        return _from_orbax(loc, orbax.load(loc.local))
    if root.state is None:
        if loc.local is None and not kv.list().result():
            raise CheckpointNotFoundError(f"{loc}: nothing stored here; check the location")
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
    meta = root.meta
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
    if root.state != STATE_COMMITTED:
        raise CheckpointIncompleteError(
            f"{loc}: this checkpoint was never committed (state {short_repr(meta.get('state'))}): its save crashed "
            "or is still running; use an earlier checkpoint, or save again with overwrite=True"
        )
    if meta.get("layout", LAYOUT_PLAIN) not in LAYOUTS:
        raise CorruptCheckpointError(
            f"{loc}: root metadata names an unknown layout {short_repr(meta.get('layout'))} "
            f"(expected one of {list(LAYOUTS)})"
        )
    if meta.get("layout") == LAYOUT_COMPACT and meta.get("arrays") and kv.read(MANIFEST).result().state != "value":
        raise CorruptCheckpointError(
            f"{loc}: the array database of this compact checkpoint is missing ({MANIFEST} does not exist); "
            "restore from another checkpoint"
        )
    leaves, arrays, values, aliases, bad = _leaf_records(loc, meta)
    structure = meta.get("structure")
    tree_problem = structure_problem(structure, leaves)
    if tree_problem is not None:
        tree_problem = f"the tree structure in the root metadata is invalid: {tree_problem}"
    if not keep_bad:
        _raise_first(loc, bad, tree_problem)
    structure = None if tree_problem else structure
    return Checkpoint(loc, leaves, arrays, values, structure, meta, aliases, bad=bad, tree_problem=tree_problem)


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


def _leaf_records(
    loc: Location, meta: Mapping[str, Any]
) -> tuple[tuple[str, ...], dict[str, ArrayRecord], dict[str, Any], dict[str, str], dict[str, str]]:
    """(leaves, array records, decoded values, aliases, bad) of a committed root. ``bad`` maps
    each leaf whose entry is invalid to why, so that verify can report every one; a root
    whose fields are not of their JSON types at all is refused here."""
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
    bad: dict[str, str] = {}
    arrays: dict[str, ArrayRecord] = {}
    for i, rec in enumerate(records):
        why = record_problem(rec, _dtypes.is_known)
        name = rec["path"] if isinstance(rec, dict) and isinstance(rec.get("path"), str) else "?"
        if why is None and rec["kind"] == "torch" and not isinstance(getattr(torch, rec["dtype"], None), torch.dtype):
            why = f"'kind' is 'torch' but torch has no dtype {rec['dtype']!r} (a numpy array's kind is 'numpy')"
        if why is None and name in arrays:
            why = "the leaf has two records"
            del arrays[name]
        if why is not None:
            key = name if name != "?" else f"arrays[{i}]"
            bad.setdefault(key, f"the record of array '{name}' in the root metadata is invalid: {why}")
        elif name not in bad:
            arrays[name] = ArrayRecord.from_json(rec)
    values: dict[str, Any] = {}
    for path, enc in encoded.items():
        try:
            values[path] = decode_value(enc)
        except ValueError as e:
            bad.setdefault(path, f"the value of '{path}' in the root metadata is invalid: {e}")
        if path in arrays:
            bad.setdefault(path, f"'{path}' has both an array record and a value in the root metadata")
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
    for path in listed:
        if path not in arrays and path not in values and path not in aliases and path not in bad:
            bad[path] = f"leaves ['{path}'] are listed but have no record"
    named = set(listed)
    for path in [*arrays, *values]:
        if path not in named:  # read by verify, never by restore: the two would disagree
            bad.setdefault(path, f"'{path}' has an entry in the root metadata but is not listed in 'leaves'")
    for path in bad:  # a bad leaf is neither read nor listed as good
        arrays.pop(path, None)
        values.pop(path, None)
    return tuple(listed), arrays, values, aliases, bad


def _raise_first(loc: Location, bad: Mapping[str, str], tree_problem: str | None) -> None:
    """Refuse a root with bad leaves (naming the first and how many) or an invalid tree."""
    if bad:
        first = next(iter(bad.values()))
        more = f" (also bad: {count_and_list(list(bad)[1:])})" if len(bad) > 1 else ""
        raise CorruptCheckpointError(f"{loc}: {first}; restore from another checkpoint{more}")
    if tree_problem is not None:
        raise CorruptCheckpointError(f"{loc}: {tree_problem}; restore from another checkpoint")


def _from_orbax(loc: Location, fc: orbax.ForeignCheckpoint) -> Checkpoint:
    """An Orbax checkpoint as a :class:`Checkpoint` whose arrays open through their own specs."""
    arrays = {
        p: ArrayRecord(p, a.shape, a.dtype, "numpy", Chunking(a.chunk_shape or (1,) * len(a.shape), None))
        for p, a in fc.arrays.items()
    }
    specs = {p: a.spec for p, a in fc.arrays.items()}
    # Orbax escapes int-like dict keys, so a plain int component is a list index
    structure = structure_from_paths(fc.leaves)
    return Checkpoint(loc, fc.leaves, arrays, dict(fc.values), structure, {"format": "orbax"}, {}, specs)


def metadata(directory: Directory) -> Any:
    """The saved tree with :class:`ArrayMetadata` in place of arrays; reads no array data."""
    return Reader(load(directory)).metadata()


# What a failed chunk read means, in the words every read path uses.
CHECKSUM_MISMATCH = "checksum mismatch: stored bytes were altered"
CHUNK_MISSING = "a chunk file is missing"
UNDECODABLE = "stored data could not be decoded (truncated or damaged file)"


def _classify_read_error(err: Exception) -> tuple[str, str]:
    """(what a failed chunk read means, TensorStore's message): the one place that reads it."""
    msg = " ".join(str(err).split())
    low = msg.lower()
    if "digest mismatch" in low or "crc32c" in low or "checksum" in low:
        return CHECKSUM_MISMATCH, msg
    if "not_found" in low or "missing" in low or "not found" in low:
        return CHUNK_MISSING, msg
    return UNDECODABLE, msg


def describe_read_error(err: Exception) -> str:
    what, msg = _classify_read_error(err)
    return f"{what} ({msg})"


def corrupt_error(ck: Checkpoint, path: str, err: Exception) -> TsckptError:
    unreachable = _store.storage_problem(ck.location, err, leaf=path)
    if unreachable is not None:
        return unreachable
    what, msg = _classify_read_error(err)
    return CorruptCheckpointError(f"'{path}' in {ck.location}: {what}; restore from another checkpoint. ({msg})")


def node_error(ck: Checkpoint, path: str, err: Exception) -> TsckptError:
    """Opening an array failed: its zarr.json is missing, unreadable, or disagrees with the root metadata."""
    unreachable = _store.storage_problem(ck.location, err, leaf=path)
    if unreachable is not None:
        return unreachable
    msg = str(err).split(" [tensorstore_spec=")[0]
    low = msg.lower()
    if "ocdbt database" in low and any(s in low for s in ("manifest", "byte range", "error decoding", "invalid json")):
        what = (
            f"the checkpoint's database could not be read for {path}/zarr.json ({MANIFEST} or a file under d/ "
            "or ocdbt.r*/d/ is damaged or missing)"
        )
    elif "does not exist" in msg or "not found" in low:
        what = f"the array is missing ({path}/zarr.json does not exist)"
    elif "Cannot create using specified" in msg:
        what = "TensorStore cannot open the array its record describes ('shard_shape' or 'chunk_shape' beyond its limits)"
    elif "Expected" in msg or "Mismatch" in msg or "Incompatible" in msg:
        what = f"{path}/zarr.json does not match the root metadata (shape, dtype or chunking differ)"
    else:
        what = f"{path}/zarr.json cannot be read"
    return CorruptCheckpointError(f"'{path}' in {ck.location}: {what}; restore from another checkpoint. ({msg})")


# A read whose files the record says hold at most this many bytes, counting TensorStore's
# bookkeeping of about CHUNK_OVERHEAD bytes for each chunk it decodes, is not checked first:
# whatever a damaged record claims, a read allocates at most this much more than the
# checkpoint stores (docs/format.md, "Validation").
UNCHECKED_BYTES = 64 << 20
CHUNK_OVERHEAD = 1 << 10
_PROBES_IN_FLIGHT = 64
_MAX_FILE_BYTES = 2**62


Box = tuple[slice, ...]


def backing_problems(ck: Checkpoint, reads: Iterable[tuple[str, Box | None]]) -> dict[str, str]:
    """Array path -> why the shard files a read (path, box; None: the whole array) touches do
    not hold the bytes its record says they do, for each read that fails. Checked before
    anything is allocated or decoded for them: TensorStore allocates a chunk at the size the
    record gives it before it reads the file. One 1-byte read at each file's expected end
    (which fails when the file is shorter) proves the file holds its chunks, index and
    checksums. The reads of all arrays are in flight together; files are probed in order and
    an array's first missing or short one ends its probes, however many files its record claims."""
    found: dict[str, str] = {}
    whole: list[str] = []
    pending: collections.deque[tuple[str, str, int, str, int, bool, ts.Future]] = collections.deque()

    def settle() -> None:
        path, key, size, fields, files, whole_array, fut = pending.popleft()
        try:
            got = fut.result()
        except ValueError as e:
            unreachable = _store.storage_problem(ck.location, e)
            if unreachable is not None:
                raise unreachable from e
            msg = re.sub(r" \[\w+='.*$", "", " ".join(str(e).split()))  # without a store's response details
            if "OUT_OF_RANGE" in msg:
                found.setdefault(path, f"{key} holds fewer than the {size} bytes that {fields} give it ({msg})")
            else:
                found.setdefault(path, f"{key} cannot be read ({msg})")
            return
        if got.state != "value":
            part = "the array" if whole_array else "the part read"
            why = f"a chunk file is missing ({key} does not exist; {fields} give {part} {files} such files)"
            found.setdefault(path, why)

    for path, box in reads:
        if ck.specs or (box is None and path in ck._cache.get("backed", ())):
            continue
        rec = ck.arrays[path]
        files, chunks, nbytes = stored_size(rec, box)
        if nbytes + chunks * CHUNK_OVERHEAD <= UNCHECKED_BYTES:
            continue
        chunking = rec.chunking
        chunk = None if chunking.chunk_shape is None else list(chunking.chunk_shape)
        fields = (
            f"its record's 'shape' {short_repr(list(rec.shape))}, 'shard_shape' "
            f"{short_repr(list(chunking.shard_shape))}, 'chunk_shape' {short_repr(chunk)} and 'dtype' {rec.dtype!r}"
        )
        for key, size in stored_files(rec, box):
            if path in found:
                break
            if size > _MAX_FILE_BYTES:
                found[path] = f"{key} cannot hold the {size} bytes that {fields} give it (no file holds 2**62 bytes)"
                break
            probe = ck.kvstore().read(key, byte_range=slice(size - 1, size))
            pending.append((path, key, size, fields, files, box is None, probe))
            while len(pending) >= _PROBES_IN_FLIGHT:
                settle()
        if box is None:
            whole.append(path)
    while pending:
        settle()
    ck._cache.setdefault("backed", set()).update(p for p in whole if p not in found)
    return found


def check_backed(ck: Checkpoint, paths: Iterable[str], box: Box | None = None) -> None:
    """Raise the first of :func:`backing_problems` for reads of ``box`` (default: all) of
    each array of ``paths``, as a CorruptCheckpointError naming the leaf."""
    paths = list(paths)
    found = backing_problems(ck, [(p, box) for p in paths])
    for path in paths:
        if path in found:
            raise CorruptCheckpointError(f"'{path}' in {ck.location}: {found[path]}; restore from another checkpoint")


def _normalize(index: Any, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[Any, ...]]:
    """numpy-style basic index -> (bounding box to read, index applied to what was read)."""
    if not isinstance(index, tuple):
        index = (index,)
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in index:
        e = index.index(Ellipsis)
        index = index[:e] + (slice(None),) * (len(shape) - len(index) + 1) + index[e + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices: array is {len(shape)}-dimensional, but {len(index)} were indexed")
    index = index + (slice(None),) * (len(shape) - len(index))
    box: list[slice] = []
    post: list[Any] = []
    for i, n in zip(index, shape):
        if isinstance(i, (int, np.integer)):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {int(i)} is out of bounds for axis with size {n}")
            box.append(slice(j, j + 1))
            post.append(0)
        elif isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step > 0:
                lo, hi = start, max(start, stop)
            else:
                lo, hi = (stop + 1, start + 1) if start > stop else (0, 0)
            box.append(slice(lo, hi))
            post.append(slice(None, None, step))
        else:
            raise TypeError(f"only integers, slices and '...' are valid indices, not {type(i).__name__}")
    return tuple(box), tuple(post)


class LazyArray:
    """A stored array; indexing reads only the chunks the index touches."""

    def __init__(self, ck: Checkpoint, path: str) -> None:
        self._ck = ck
        self.path = path
        self.metadata = ck.array_metadata(path)
        self._store: ts.TensorStore | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.metadata.shape

    @property
    def dtype(self) -> str:
        return self.metadata.dtype

    def __repr__(self) -> str:
        return f"LazyArray('{self.path}', shape={list(self.shape)}, dtype={self.dtype})"

    def open_future(self) -> Opening:
        return self._ck.open_array_future(self.path)

    def set_store(self, future: Opening) -> None:
        try:
            self._store = future.result()
        except ValueError as e:
            raise node_error(self._ck, self.path, e) from e

    def _tensorstore(self) -> ts.TensorStore:
        if self._store is None:
            self.set_store(self.open_future())
        return cast(ts.TensorStore, self._store)

    def read_box(self, box: tuple[slice, ...]) -> np.ndarray:
        """Read a bounding box (non-negative slices with unit step) in the storage dtype."""
        bounds = tuple(slice(*b.indices(n)[:2]) for b, n in zip(box, self.shape))
        check_backed(self._ck, [self.path], bounds + tuple(slice(0, n) for n in self.shape[len(bounds):]))
        store = self._tensorstore()
        try:
            return store[box].read().result() if box else store.read().result()
        except ValueError as e:
            raise corrupt_error(self._ck, self.path, e) from e

    def __getitem__(self, index: Any) -> np.ndarray:
        """numpy array in the storage dtype (complex32 comes back as float16 (..., 2) pairs)."""
        box, post = _normalize(index, self.shape)
        data = self.read_box(box)
        if self.dtype == "complex32":
            post = post + (slice(None),)
        return data[post] if post else data

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[...]
        return out if dtype is None else out.astype(dtype)

    @property
    def torch(self) -> _TorchView:
        """``arr.torch[idx]`` returns a torch tensor of the logical dtype."""
        return _TorchView(self)


class _TorchView:
    def __init__(self, arr: LazyArray) -> None:
        self._arr = arr

    def __getitem__(self, index: Any) -> torch.Tensor:
        data = np.asarray(self._arr[index])  # a full integer index gives a numpy scalar
        if any(s < 0 for s in data.strides):
            data = np.ascontiguousarray(data)
        return _dtypes.numpy_to_tensor(data, self._arr.dtype)


class Reader(Mapping[str, Any]):
    """Mapping from leaf path to :class:`LazyArray` (arrays) or the saved value."""

    def __init__(self, ck: Checkpoint) -> None:
        self.checkpoint = ck

    def __getitem__(self, path: str) -> Any:
        ck = self.checkpoint
        if path == "" and ROOT_LEAF_PATH in ck.arrays:
            path = ROOT_LEAF_PATH
        path = ck.aliases.get(path, path)  # a tied leaf reads its stored array
        if path in ck.arrays:
            return LazyArray(ck, path)
        if path in ck.values:
            return ck.values[path]
        close = [p for p in ck.leaves if p.startswith(path.rstrip("/") + "/")][:5]
        hint = f"; leaves below it: {close}" if close else "; `tsckpt ls` lists the paths"
        raise KeyError(f"'{path}' is not a leaf of {ck.location}{hint}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.leaves)

    def __len__(self) -> int:
        return len(self.checkpoint.leaves)

    def metadata(self) -> Any:
        ck = self.checkpoint
        return ck.build([ck.array_metadata(p) if ck.is_array(p) else ck.values[p] for p in ck.leaves])


def open(directory: Directory) -> Reader:  # noqa: A001 - mirrors tsckpt.open
    """A lazy, read-only view of a committed checkpoint; no process group needed."""
    ck = load(directory)
    ck.check_links()
    return Reader(ck)
