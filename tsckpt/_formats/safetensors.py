"""safetensors files and Hugging Face sharded directories, read and written in pieces.

The byte layout is the safetensors library's own (docs/format.md): an 8-byte
little-endian header length, a JSON header (``__metadata__`` first, then one
``{"dtype", "shape", "data_offsets"}`` entry per tensor in data order), padded
with spaces to a multiple of 8, then the tensors' bytes back to back; files
written here are byte-identical to ``safetensors.torch.save_file`` (a test
checks). Tensor bytes are read with positional reads of the byte runs a box
covers, and written in blocks.

The safetensors library itself is not imported (it is a test dependency: the tests
compare against it); ``benchmarks/bench_safetensors_read.py`` measured why (figures in
benchmarks/RESULTS.md, "Safetensors reading"):

- Writing: ``save_file`` needs every tensor of a file in memory at once, while here a
  file is written in blocks, so peak memory is two blocks whatever the model size.
- Headers: every damaged header ``safe_open`` refuses is refused here too (a test
  checks it differentially), while it accepts some this reader refuses (over MAX_NDIM
  dimensions, a space before the JSON, the 4- and 6-bit dtypes tsckpt cannot hold),
  names neither the file nor, for a size mismatch, the tensor, and gives no offsets, so
  it could only be a pass before these checks, and that pass with the checks measured
  no faster than this parser alone.
- Tensor bytes: ``get_slice`` reads through a map of the file, so a file that shrinks
  under a read kills the process with SIGBUS where this reader raises
  CorruptCheckpointError (and a conversion removes its partial output), and the pages it
  touches count against the process while the file is open; its ``pread`` backend
  (0.8), which raises instead, reads the whole tensor for any slice of it; its numpy
  framework cannot return float8; and it cannot read into a given array (``fill``).
- Through the map it measured no faster into a given array or for whole rows, and faster
  where a new array is wanted (whole tensors: it returns views of the map, copying
  nothing; a few columns of every row, where this reader makes a read call per run):
  kept there too, for the SIGBUS and the memory above. A restore with ``copy=False`` asks
  for exactly that trade: its whole tensors are views of one copy-on-write mapping per
  file (:class:`FileMap`; docs/zerocopy.md).

A Hugging Face directory holds ``model.safetensors``, or
``model-0000N-of-0000M.safetensors`` shards and ``model.safetensors.index.json``
(``metadata.total_size`` and ``weight_map``), as ``save_pretrained`` writes them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import numpy as np

from .._base import dtypes as _dtypes
from .._base.types import LazySource
from .._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    LeafTypeError,
    NotACheckpointError,
    short_repr,
)
from .._ondisk.arrays import parse_node as parse_json
from .._ondisk.bounds import METADATA_BYTES, read_fd
from .._ondisk.records import KINDS, MAX_NDIM, decode_value, dims_ok, known_kind
from .._storage.confine import Root, confined, open_read
from .._storage.filemap import map_private, populate
from ..tree import escape, from_paths, structure_from_json, structure_problem

# Metadata key under which a tsckpt tree (structure, kinds, values, ties) is stored.
METADATA_KEY = "tsckpt"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors refuses headers above 100 MB; so does this reader.
MAX_HEADER_BYTES = 100_000_000
# The safetensors library (serde_json) refuses a header whose arrays and objects nest deeper.
MAX_HEADER_DEPTH = 127
_FIELDS = ("dtype", "shape", "data_offsets")
# Bytes of one tensor read or written at a time.
BLOCK_BYTES = 32 << 20

# safetensors dtype name -> tsckpt logical dtype name
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
_NAMES = {v: k for k, v in DTYPES.items()}
# safetensors dtype name -> bytes per element
_ITEMSIZES = {k: _dtypes.itemsize(v) for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str  # tsckpt logical name
    shape: tuple[int, ...]
    begin: int
    end: int
    stamp: tuple[int, ...] = ()  # the file's identity when its header was checked (:func:`stamp_of`)


def stamp_of(st: os.stat_result) -> tuple[int, ...]:
    """What a file's status says of its identity and content: device, inode, size, modification
    and change times. A file replaced (renamed over) or rewritten since its header was checked
    differs in one (the change time even where the modification time was set back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_stamp(fd: int, entry: TensorEntry, file: str) -> None:
    """Raise CheckpointReplacedError when the open file ``fd`` is no longer the one whose header
    gave ``entry`` (its offsets, dtype and shape would describe other bytes)."""
    now = stamp_of(os.fstat(fd))
    if entry.stamp and now != entry.stamp:
        raise CheckpointReplacedError(
            f"{file}: replaced or rewritten since its header was read (tensor '{entry.name}'; size "
            f"{entry.stamp[2]} then, {now[2]} now): its offsets may describe other bytes; open it again"
        )


@dataclasses.dataclass(frozen=True)
class Header:
    file: str
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    size: int = 0  # the file's bytes when the header was read (its tensors tile it to the end)
    stamp: tuple[int, ...] = ()  # its identity then (:func:`stamp_of`)


def _corrupt(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}; the file is damaged or was not fully written, get a good copy")


def is_safetensors_file(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first 9 bytes) is a safetensors file: an
    8-byte header length, then the JSON header."""
    return head[8:9] == b"{"


def read_header(path: str) -> Header:
    """Parse and check a safetensors header against the file's size, before any data is read."""
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path}: no such file")
    fd = open_read(path)  # a Hugging Face cache snapshot's file: from its repository's blobs/, no link followed
    st = os.fstat(fd)
    size = st.st_size
    with os.fdopen(fd, "rb") as f:
        head = f.read(9)
        if not is_safetensors_file(head):
            raise NotACheckpointError(f"{path}: not a safetensors file (no JSON header after the 8-byte length)")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER_BYTES:
            raise NotACheckpointError(f"{path}: not a safetensors file (header length {n} is over 100 MB)")
        if 8 + n > size:
            raise _corrupt(path, f"truncated: the header needs {n} bytes but the file has {size - 8} after its length")
        f.seek(8)
        raw = f.read(n)
    try:
        header = parse_json(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise _corrupt(path, f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "its header is not a JSON object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta  # null, as the library reads it; not 0, "" or []
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(path, "its __metadata__ is not a map of strings")
    stamp = stamp_of(st)
    entries = {name: dataclasses.replace(_entry(path, name, e, 8 + n), stamp=stamp) for name, e in header.items()}
    _check_cover(path, entries, 8 + n, size)
    return Header(path, entries, meta, size, stamp)


def _entry(path: str, name: str, e: Any, start: int) -> TensorEntry:
    """One tensor's header entry: a known dtype, a shape of non-negative ints (a product under
    2**59, zeros counted as one), and offsets spanning exactly its bytes."""
    fields: dict[str, Any] = e if isinstance(e, dict) else {}
    dtype: Any = fields.get("dtype")
    shape: Any = fields.get("shape")
    offsets: Any = fields.get("data_offsets")
    itemsize = _ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise _corrupt(path, f"tensor '{name}': 'dtype' is {short_repr(dtype)}, expected one of {sorted(DTYPES)}")
    if not dims_ok(shape, positive=False):
        raise _corrupt(
            path, f"tensor '{name}': 'shape' is {short_repr(shape)}, expected a list of at most {MAX_NDIM} "
            "non-negative integers with a product under 2**59"
        )
    # type() is int: JSON gives no other int subclass than bool, which is refused
    if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int
            and 0 <= offsets[0] <= offsets[1] < 2**63):
        raise _corrupt(
            path, f"tensor '{name}': 'data_offsets' is {short_repr(offsets)}, expected [begin, end], integers with "
            "0 <= begin <= end < 2**63"
        )
    begin, end = offsets
    want = math.prod(shape) * itemsize
    if end - begin != want:
        raise _corrupt(
            path, f"tensor '{name}': {dtype}{list(shape)} needs {want} bytes but its offsets [{begin}, {end}] "
            f"span {end - begin}"
        )
    if len(fields) > len(_FIELDS):  # fields safetensors ignores, but parses
        for key, value in fields.items():
            if key not in _FIELDS and _nesting(value, MAX_HEADER_DEPTH - 2) > MAX_HEADER_DEPTH - 2:
                raise _corrupt(path, f"tensor '{name}': its field {short_repr(key)} nests more than "
                               f"{MAX_HEADER_DEPTH - 2} levels deep (the header more than {MAX_HEADER_DEPTH})")
    return TensorEntry(name, DTYPES[dtype], tuple(shape), start + begin, start + end)


def _nesting(value: Any, limit: int) -> int:
    """How deeply lists and objects nest in a parsed JSON value (0: a scalar), counted up to
    one past ``limit``."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def _check_cover(path: str, entries: dict[str, TensorEntry], start: int, size: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no gap, nothing past the end."""
    pos = start
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            what = "overlaps another tensor" if e.begin < pos else f"leaves a gap of {e.begin - pos} bytes before it"
            raise _corrupt(path, f"tensor '{e.name}' at data offset {e.begin - start} {what}")
        pos = e.end
    if pos > size:
        raise _corrupt(path, f"truncated: the header describes {pos - start} data bytes but the file holds {size - start}")
    if pos < size:
        raise _corrupt(path, f"{size - pos} bytes follow the last tensor; the header does not describe them")


def read_box(entry: TensorEntry, file: str, box: tuple[slice, ...], out: np.ndarray | None = None) -> np.ndarray:
    """The elements of ``box`` of one tensor (storage dtype), read with positional reads of
    exactly the byte runs the box covers (one run when it spans whole trailing dimensions,
    else one per row of its outer dimensions), never the rest of the tensor. ``out``: a
    C-contiguous array of the box's shape and the storage dtype to read into (else one is made)."""
    dtype = _dtypes.numpy_dtype(entry.dtype)
    bounds = [slice(*b.indices(n)[:2]) for b, n in zip(box, entry.shape)]
    bounds += [slice(0, n) for n in entry.shape[len(bounds):]]
    lengths = tuple(max(0, b.stop - b.start) for b in bounds)
    if out is None:
        out = np.empty(lengths, dtype)
    flat = out.reshape(-1).view(np.uint8).data
    fd = open_read(file)
    try:
        _check_stamp(fd, entry, file)
        for at, size, pos in _runs(entry, bounds, dtype.itemsize):
            view = flat[pos : pos + size]
            if os.preadv(fd, [view], entry.begin + at) != size:  # a short read: again, to the end or the error
                _pread(fd, view, entry.begin + at, entry, file)
    finally:
        os.close(fd)
    return out


def _runs(entry: TensorEntry, bounds: list[slice], itemsize: int) -> list[tuple[int, int, int]]:
    """(offset in the tensor, bytes, offset in the box) of each contiguous byte run of the box
    ``bounds``, in C order: the trailing dimensions the box spans whole are one run with the
    innermost partial one; the dimensions outside it are walked."""
    shape = entry.shape
    lengths = [b.stop - b.start for b in bounds]
    if 0 in lengths:
        return []
    inner = len(shape) - 1  # the run: dimensions inner.. (all whole but maybe the first of them)
    while inner > 0 and lengths[inner] == shape[inner]:
        inner -= 1
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
    run = (lengths[inner] * strides[inner]) if shape else itemsize
    first = sum(b.start * s for b, s in zip(bounds, strides))
    starts = np.zeros(1, np.int64)
    for d in range(inner):  # every combination of the outer indices, in C order
        starts = (starts[:, None] + np.arange(lengths[d], dtype=np.int64) * strides[d]).reshape(-1)
    return [(first + s, run, i * run) for i, s in enumerate(starts.tolist())]


def _pread(fd: int, view: memoryview, at: int, entry: TensorEntry, file: str) -> None:
    """Fill ``view`` with the file's bytes from ``at``."""
    pos = 0
    while pos < len(view):
        got = os.preadv(fd, [view[pos:]], at + pos)
        if got <= 0:
            raise _corrupt(file, f"tensor '{entry.name}' ends early (the file shrank while it was read)")
        pos += got


class FileMap:
    """One safetensors file's copy-on-write mapping (:func:`tsckpt._storage.filemap.map_private`),
    made when the first of its tensors is mapped and shared by all of them: one mapping per
    file, however many tensors it holds. Opened as every read opens it (no link followed)."""

    def __init__(self, file: str, stamp: tuple[int, ...]) -> None:
        self.file = file
        self.stamp = stamp  # its identity when its header was checked (:func:`stamp_of`)
        self._lock = threading.Lock()
        self._mapped: np.ndarray | None = None

    def array(self) -> np.ndarray | str:
        """The whole file as a uint8 array over its mapping, or why it cannot be mapped: the
        file is checked to be the one whose header was read at every call (a tensor mapped
        later would view a rewritten file's new bytes; the copying read then raises
        CheckpointReplacedError)."""
        with self._lock:
            try:
                fd = open_read(self.file)
            except OSError as e:
                return f"its file cannot be opened ({e})"
            try:
                st = os.fstat(fd)
                if stamp_of(st) != self.stamp:
                    return "its file was replaced or rewritten since its header was read"
                if self._mapped is None:
                    self._mapped = map_private(fd, st.st_size, populate=False)  # each tensor's pages as mapped
            except (OSError, ValueError) as e:
                return f"its file cannot be mapped ({e})"
            finally:
                os.close(fd)
            return self._mapped


def map_tensor(entry: TensorEntry, filemap: FileMap) -> np.ndarray | str:
    """The whole tensor (storage dtype and shape) viewing its file's mapping, or why it cannot be
    (no bytes, or bytes not aligned to the dtype in the file)."""
    dtype = _dtypes.numpy_dtype(entry.dtype)
    if entry.end == entry.begin:
        return "it is empty"
    if entry.begin % dtype.itemsize:
        return f"its bytes start at file offset {entry.begin}, not aligned to its {dtype.itemsize}-byte elements"
    whole = filemap.array()
    if isinstance(whole, str):
        return whole
    populate(whole, entry.begin, entry.end)  # this tensor's pages only: the file may be far larger
    return whole[entry.begin : entry.end].view(dtype).reshape(entry.shape)


def _source(entry: TensorEntry, file: str, kind: str = "torch", filemap: FileMap | None = None) -> LazySource:
    """``kind``: "torch", or "numpy"/"numpy_scalar" for leaves saved from numpy; ``filemap``:
    the file's mapping, shared with the other tensors of the file (None: the source maps nothing)."""
    dtype: Any = _dtypes.torch_dtype(entry.dtype) if kind == "torch" else _dtypes.numpy_dtype(entry.dtype)
    return LazySource(
        entry.shape, dtype, lambda box: read_box(entry, file, box), kind=kind,
        fill=lambda box, out: read_box(entry, file, box, out),
        map=None if filemap is None else lambda: map_tensor(entry, filemap),
    )


# ---- reading a file or a directory as a tree -------------------------------------------


def _tree(where: str, sources: dict[str, tuple[TensorEntry, str]], info: Any, stamps: dict[str, tuple[int, ...]]) -> Any:
    """The tree: rebuilt from tsckpt's metadata when the file has it (checked first, entry by
    entry), else a flat dict by name. ``stamps``: each file's identity when its header was read
    (its tensors share one :class:`FileMap`)."""
    maps = {file: FileMap(file, stamp) for file, stamp in stamps.items()}
    if info is None:
        return {name: _source(e, f, filemap=maps[f]) for name, (e, f) in sorted(sources.items())}
    info = _tsckpt_info(where, info, sources)
    kinds, aliases, values = info["kinds"], info.get("aliases", {}), info["values"]
    made: dict[str, Any] = {}

    def leaf(path: str) -> Any:
        if path in values:
            return decode_value(values[path])
        path = aliases.get(path, path)  # a tied leaf is the same source as the one stored
        if path not in made:
            entry, file = sources[path]
            made[path] = _source(entry, file, kinds.get(path, "torch"), maps[file])
        return made[path]

    leaves = [leaf(p) for p in info["leaves"]]
    if info.get("structure") is not None:
        return structure_from_json(info["structure"], leaves)
    return from_paths(info["leaves"], leaves)


def _tsckpt_info(where: str, info: Any, sources: dict[str, tuple[TensorEntry, str]]) -> dict[str, Any]:
    """tsckpt's metadata (JSON text in a file's ``__metadata__``, an object in an index),
    parsed and checked as the root metadata of a checkpoint is: CorruptCheckpointError naming
    ``where`` and the field unless every leaf it lists is a value, a tie or a stored tensor
    of a known kind, and its structure holds exactly those leaves."""
    if isinstance(info, str):
        try:
            info = parse_json(info.encode("utf-8"))
        except ValueError as e:  # UnicodeEncodeError (a lone surrogate) included
            info = e
    why = _info_problem(info, sources)
    if why is not None:
        example = escape(next(iter(sources), ""))
        raise CorruptCheckpointError(
            f"{where}: its '{METADATA_KEY}' metadata {why}; it is damaged: remove it to read the tensors as a "
            f"flat dict (names: e.g. {example!r})"
        )
    return dict(info)


def _info_problem(info: Any, sources: dict[str, tuple[TensorEntry, str]]) -> str | None:
    """Why tsckpt's metadata (parsed) cannot rebuild the tree over ``sources``, or None."""
    if isinstance(info, ValueError):
        return f"is not valid JSON ({info})"
    if not isinstance(info, dict):
        return f"is {type(info).__name__}, expected a JSON object"
    leaves, kinds, values = info.get("leaves"), info.get("kinds"), info.get("values")
    aliases = info.get("aliases", {})
    if not isinstance(leaves, list) or not all(isinstance(p, str) for p in leaves):
        return f"'leaves' is {short_repr(leaves)}, expected a list of leaf paths"
    if not isinstance(kinds, dict):
        return f"'kinds' is {short_repr(kinds)}, expected an object"
    if not isinstance(values, dict):
        return f"'values' is {short_repr(values)}, expected an object"
    if not isinstance(aliases, dict):
        return f"'aliases' is {short_repr(aliases)}, expected an object"
    for path, kind in kinds.items():
        if not known_kind(kind):
            return f"'kinds' of leaf '{path}' is {short_repr(kind)}, expected one of {list(KINDS)}"
        if kind == "numpy_scalar" and path in sources and sources[path][0].shape:
            return f"'kinds' of leaf '{path}' is 'numpy_scalar', but its tensor has shape {list(sources[path][0].shape)}"
    for path, value in values.items():
        try:
            decode_value(value)
        except ValueError as e:
            return f"'values' of leaf '{path}': {e}"
    for path, stored in aliases.items():
        if stored not in sources:
            return f"'aliases' ties '{path}' to {short_repr(stored)}, which is no tensor of the file"
    return _leaves_problem(info, leaves, values, aliases, sources)


def _leaves_problem(info: dict[str, Any], leaves: list[str], values: dict[str, Any], aliases: dict[str, Any],
                    sources: dict[str, tuple[TensorEntry, str]]) -> str | None:
    """Why ``leaves`` and the structure do not match the values, ties and tensors, or None."""
    for path in leaves:
        if path not in values and path not in aliases and path not in sources:
            return f"lists leaf '{path}', which is no value, tie or tensor of the file"
    unlisted = sorted(set(sources) - set(leaves))
    if unlisted:
        return f"does not list the tensor '{unlisted[0]}' in 'leaves'"
    tree_problem = structure_problem(info.get("structure"), leaves)
    if tree_problem is not None:
        return f"'structure' is invalid: {tree_problem}"
    return None


def read_file(path: str) -> Any:
    """A safetensors file as a tree of lazy sources (nothing but the header is read)."""
    h = read_header(path)
    return _tree(path, {n: (e, path) for n, e in h.entries.items()}, h.metadata.get(METADATA_KEY), {path: h.stamp})


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, INDEX_NAME)) or os.path.isfile(os.path.join(path, SINGLE_NAME))
        or bool(glob.glob(os.path.join(glob.escape(path), "*.safetensors.index.json")))
    )


def read_dir(path: str) -> Any:
    """A Hugging Face directory (one file, or shards and their index) as a tree of lazy sources."""
    indexes = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors.index.json")))
    root = Root(path)  # every file below it is opened from it, with no link followed
    if not indexes:
        if os.path.isfile(os.path.join(path, SINGLE_NAME)):
            return read_file(confined(root, SINGLE_NAME, where=path, field="the weights file"))
        raise NotACheckpointError(f"{path}: no {SINGLE_NAME} or *.safetensors.index.json here")
    index_file = os.path.join(path, INDEX_NAME) if os.path.join(path, INDEX_NAME) in indexes else indexes[0]
    index_file = confined(root, os.path.basename(index_file), where=path, field="the index file")
    weight_map, meta = read_index(index_file)
    stamps: dict[str, tuple[int, ...]] = {}
    return _tree(index_file, _shard_sources(root, index_file, weight_map, stamps), meta.get(METADATA_KEY), stamps)


def read_index(index_file: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(weight map: tensor name -> file, metadata) of a sharded directory's index (its JSON,
    of a bounded size, parsed with bounds, its fields checked): a safetensors index, or a
    torch.save one."""
    raw = read_fd(open_read(index_file), index_file, METADATA_BYTES, "a Hugging Face index", fix="restore the index")
    try:
        index = parse_json(raw)
    except ValueError as e:  # UnicodeDecodeError included
        raise CorruptCheckpointError(f"{index_file}: not a valid index: it is not JSON ({e}); restore it") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    meta = (index.get("metadata") if isinstance(index, dict) else None) or {}
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        found = short_repr(weight_map) if isinstance(index, dict) else f"a JSON {type(index).__name__}"
        raise CorruptCheckpointError(
            f"{index_file}: not a valid index: 'weight_map' is {found}, expected an object mapping each tensor "
            "name to the file holding it; restore the index"
        )
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(
            f"{index_file}: not a valid index: 'metadata' is {short_repr(meta)}, expected an object; restore the index"
        )
    return weight_map, meta


def _shard_sources(
    root: Root, index_file: str, weight_map: dict[str, str], stamps: dict[str, tuple[int, ...]]
) -> dict[str, tuple[TensorEntry, str]]:
    """Tensor name -> (its header entry, its file) for every tensor the index maps; each
    file it names must be inside the directory (no link), and hold the tensor. ``stamps``
    gets each file's identity as its header was read."""
    headers: dict[str, Header] = {}
    sources: dict[str, tuple[TensorEntry, str]] = {}
    for name, fname in weight_map.items():
        file = confined(root, fname, where=index_file, field=f"weight_map[{name!r}]")
        if fname not in headers:
            if not os.path.isfile(file):
                raise CorruptCheckpointError(f"{file}: missing, but {os.path.basename(index_file)} maps '{name}' to it")
            headers[fname] = read_header(file)
            stamps[file] = headers[fname].stamp
        if name not in headers[fname].entries:
            raise CorruptCheckpointError(f"{file}: has no tensor '{name}', but {os.path.basename(index_file)} maps it there")
        sources[name] = (headers[fname].entries[name], file)
    return sources


# ---- writing ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutTensor:
    """A tensor to write: ``read(box)`` returns the box's elements in ``dtype`` (storage numpy)."""

    name: str
    dtype: str  # tsckpt logical name
    shape: tuple[int, ...]
    read: Callable[[tuple[slice, ...]], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtypes.itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class SideFile:
    """A file written beside a directory's weights (config.json, tokenizer files), renamed
    into place with them: ``write(out)`` writes its bytes to the open temporary file."""

    name: str  # a plain file name in the directory
    write: Callable[[BinaryIO], None]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which file, in data order, and the bytes they hold."""

    files: tuple[tuple[str, tuple[str, ...]], ...]
    total_size: int


def check_dtype(path: str, dtype: str) -> None:
    if dtype not in _NAMES:
        raise LeafTypeError(f"'{path}': dtype {dtype} has no safetensors equivalent; keep it in a tsckpt checkpoint")


def _data_order(tensors: Sequence[OutTensor]) -> list[OutTensor]:
    """safetensors' order: larger itemsizes first (aligned), then by name."""
    return sorted(tensors, key=lambda t: (-_dtypes.itemsize(t.dtype), t.name))


def plan_shards(tensors: Sequence[OutTensor], max_shard_size: int | None) -> ShardPlan:
    """Fill files in order up to ``max_shard_size`` bytes, as transformers does (a tensor
    larger than the limit gets a file of its own); one file when no limit is given."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if max_shard_size is not None and groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = tuple((name, tuple(t.name for t in _data_order(g))) for name, g in zip(names, groups))
    return ShardPlan(files, sum(t.nbytes for t in tensors))


def header_bytes(tensors: Sequence[OutTensor], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length and padded JSON header for ``tensors`` (already in data order)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _blocks(shape: tuple[int, ...], itemsize: int) -> list[tuple[slice, ...]]:
    """Row ranges of about BLOCK_BYTES each, covering the tensor in C order."""
    if not shape:
        return [()]
    row = max(1, math.prod(shape[1:]) * itemsize)
    step = max(1, BLOCK_BYTES // row)
    return [(slice(lo, min(lo + step, shape[0])),) + tuple(slice(0, n) for n in shape[1:])
            for lo in range(0, shape[0], step)] or [tuple(slice(0, n) for n in shape)]


def _write_one(file: str, tensors: Sequence[OutTensor], metadata: dict[str, str] | None) -> None:
    """Write one file; the next block is read on a second thread while this one is
    written (reads decode and checksum with the GIL released), two blocks at most in memory."""

    def read(t: OutTensor, box: tuple[slice, ...]) -> np.ndarray:
        want = np.dtype(_dtypes.numpy_dtype(t.dtype))
        data = np.require(t.read(box), requirements="C")  # ascontiguousarray makes 0-d 1-d
        shape = tuple(s.stop - s.start for s in box)
        if data.shape != shape or data.dtype != want:
            raise ValueError(f"'{t.name}': read {data.dtype}{list(data.shape)} for a {want}{list(shape)} block")
        return data

    blocks = [(t, box) for t in tensors for box in _blocks(t.shape, _dtypes.itemsize(t.dtype))]
    with open(file, "xb") as f, concurrent.futures.ThreadPoolExecutor(1) as pool:
        f.write(header_bytes(tensors, metadata))
        ahead = pool.submit(read, *blocks[0]) if blocks else None
        for i in range(len(blocks)):
            data = ahead.result() if ahead is not None else None
            ahead = pool.submit(read, *blocks[i + 1]) if i + 1 < len(blocks) else None
            if data is not None:
                f.write(data.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())


def existing_outputs(directory: str) -> list[str]:
    """The safetensors weight files and indexes in a directory (what writing would replace)."""
    pattern = [os.path.join(glob.escape(directory), p) for p in ("*.safetensors", "*.safetensors.index.json")]
    return sorted(f for p in pattern for f in glob.glob(p))


def write(
    dst: str,
    tensors: Sequence[OutTensor],
    info: dict[str, Any] | None,
    *,
    directory: bool,
    max_shard_size: int | None = None,
    overwrite: bool = False,
    side_files: Sequence[SideFile] = (),
) -> list[str]:
    """Write ``tensors`` to the file ``dst``, or as a Hugging Face directory with
    ``side_files`` beside them; returns the files.

    Every file is written under a temporary name, synced, and renamed only when all
    are complete (the index last), so a failed write leaves no partial output; other
    files of a directory (config.json, tokenizer, ...) are kept unless ``side_files``
    replaces them.
    """
    _check_names(tensors)
    plan = plan_shards(tensors, max_shard_size if directory else None)
    if not directory and (len(plan.files) > 1 or side_files):
        raise ValueError("a .safetensors destination is one file; write to a directory to shard it or add files")
    sides = [os.path.join(dst, side.name) for side in side_files]
    old = _replaced(dst, directory, overwrite) + _replaced_sides(sides, overwrite)
    sharded = len(plan.files) > 1
    final = [os.path.join(dst, name) for name, _ in plan.files] if directory else [dst]
    final += sides
    if sharded:
        final.append(os.path.join(dst, INDEX_NAME))
    temps = [f"{f}.tmp-{os.getpid()}" for f in final]
    created = directory and not os.path.isdir(dst)
    done = False
    try:
        if directory:
            os.makedirs(dst, exist_ok=True)
        _write_files(plan, tensors, info, temps)
        _write_sides(side_files, temps[len(plan.files):len(plan.files) + len(sides)])
        if sharded:
            _write_index(temps[-1], plan, info)
        _replace(old, temps, final)
        done = True
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)
        if created and not done and os.path.isdir(dst) and not os.listdir(dst):
            os.rmdir(dst)
    return final


def _check_names(tensors: Sequence[OutTensor]) -> None:
    """Every tensor has a dtype safetensors holds, and a name of its own."""
    seen: set[str] = set()
    for t in tensors:
        check_dtype(t.name, t.dtype)
        if t.name in seen:
            raise ValueError(f"two leaves map to the tensor name '{t.name}'; change the prefix options")
        seen.add(t.name)


def _replaced(dst: str, directory: bool, overwrite: bool) -> list[str]:
    """The existing outputs a write to ``dst`` replaces; refused unless ``overwrite``."""
    old = existing_outputs(dst) if directory and os.path.isdir(dst) else ([dst] if os.path.exists(dst) else [])
    if old and not overwrite:
        raise CheckpointExistsError(f"{old[0]} already exists; pass overwrite=True (--overwrite) to replace it")
    return old


def _replaced_sides(sides: list[str], overwrite: bool) -> list[str]:
    """The side files already in the directory that a write replaces; refused unless ``overwrite``."""
    old = [f for f in sides if os.path.lexists(f)]
    if old and not overwrite:
        raise CheckpointExistsError(f"{old[0]} already exists; pass overwrite=True (--overwrite) to replace it")
    return old


def _write_sides(side_files: Sequence[SideFile], temps: list[str]) -> None:
    """Each side file under its temporary name, synced."""
    for side, tmp in zip(side_files, temps):
        with open(tmp, "xb") as out:
            side.write(out)
            out.flush()
            os.fsync(out.fileno())


def _write_files(plan: ShardPlan, tensors: Sequence[OutTensor], info: dict[str, Any] | None, temps: list[str]) -> None:
    """Each file of the plan under its temporary name; one file carries the tree metadata
    itself, a sharded directory's index carries it instead."""
    by_name = {t.name: t for t in tensors}
    info_text = json.dumps(info, separators=(",", ":"), ensure_ascii=False) if info is not None else None
    for (_, names), tmp in zip(plan.files, temps):
        meta = {"format": "pt"}
        if info_text is not None and len(plan.files) == 1:
            meta[METADATA_KEY] = info_text
        _write_one(tmp, [by_name[n] for n in names], meta)


def _write_index(tmp: str, plan: ShardPlan, info: dict[str, Any] | None) -> None:
    """``model.safetensors.index.json`` of a sharded directory, under its temporary name, synced."""
    index_meta: dict[str, Any] = {"total_size": plan.total_size}
    if info is not None:
        index_meta[METADATA_KEY] = info
    weight_map = {n: name for name, names in plan.files for n in names}
    index = {"metadata": index_meta, "weight_map": dict(sorted(weight_map.items()))}
    with open(tmp, "x", encoding="utf-8") as out:
        out.write(json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())


def _replace(old: list[str], temps: list[str], final: list[str]) -> None:
    """Remove the replaced outputs the write does not rename over, rename every temporary
    file to its name (the index last), and sync the directory."""
    for stale in old:
        if stale not in final:
            os.remove(stale)
    for tmp, name in zip(temps, final):
        os.replace(tmp, name)
    fd = os.open(os.path.dirname(os.path.abspath(final[0])), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
