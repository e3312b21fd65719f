"""torch.distributed.checkpoint (DCP) directories read as a tsckpt source tree, without a process group.

Tensors become :class:`LazySource` leaves read region by region through DCP's own
``FileSystemReader`` and load-planner protocol (``dcp.load``'s single-process path),
touching only the saved chunks a region overlaps and keeping the last region, so a
conversion holds about one tensor. Values are loaded with ``weights_only=True``, but
``.metadata`` itself is a pickle, and unpickling can run any code it names: it is
read only when the caller passes ``allow_pickle=True`` (``--allow-pickle``), for a
checkpoint from a trusted source. What it holds is then checked before any data is
read: every data file a path inside the directory (no link), every tensor's chunks
tiling its shape, and every chunk's stored bytes at least its size.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pickle
import stat
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.lazytorch import is_dtype
from .._base.types import LazySource, span_slices
from .._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LeafTypeError,
    LinkRefusedError,
    NotACheckpointError,
    short_repr,
)
from .._ondisk.bounds import METADATA_BYTES, file_problem, refused
from .._ondisk.records import MAX_ELEMENTS, MAX_NDIM
from .._storage.confine import Root, confined, open_read
from ..tree import MAX_STRUCTURE_DEPTH, escape, from_paths, paths_problem, structure_from_json, structure_from_paths
from .torchfile import plain_tree, reason, weights_only_refusal

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# The pickled metadata file dcp.save writes last: its presence marks a DCP directory.
METADATA_FILE = ".metadata"

PICKLE_WARNING = (
    "A torch.distributed.checkpoint directory's .metadata file is a Python pickle: reading it can run "
    "arbitrary code, so tsckpt reads one only with --allow-pickle (allow_pickle=True), for a checkpoint "
    "from a trusted source."
)

# Chunks of one tensor compared pairwise for overlap at a time (numpy, rows x all).
_OVERLAP_ROWS = 256


def is_dcp_dir(path: str) -> bool:
    """Whether ``path`` is a directory with DCP's metadata file (its contents are not read)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_dcp(path: str, *, allow_pickle: bool = False) -> Any:
    """The state_dict saved by ``dcp.save`` in directory ``path``: tensors as lazy sources,
    values loaded, nesting rebuilt from the planner's key paths (a flat dict without them).
    The pickled metadata is read only with ``allow_pickle`` (NotACheckpointError saying so
    otherwise); its entries and every data file (inside the directory, present, long enough)
    are checked before anything is read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta, root = _read_metadata(path, allow_pickle)
    _check_entries(path, meta)
    _check_files(root, meta)
    reader = _RegionReader(root, meta)
    entries = meta.state_dict_metadata
    values = reader.values([k for k, md in entries.items() if not isinstance(md, TensorStorageMetadata)])
    leaves: dict[str, Any] = {}
    for key, md in entries.items():
        if key in values:
            leaves[key] = plain_tree(values[key], f"{path}: entry '{key}'")
        else:
            leaves[key] = LazySource(tuple(md.size), md.properties.dtype, functools.partial(reader.read, key), kind="torch")
    return nest(leaves, meta.planner_data)


def _read_metadata(path: str, allow_pickle: bool) -> tuple[Any, Root]:
    """The checkpoint's metadata, unpickled (only with ``allow_pickle``), and its directory,
    opened once: every file of it is read from there (:func:`_reader`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such directory; give the directory dcp.save wrote")
    mfile = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(mfile):
        raise NotACheckpointError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata file); give the one dcp.save wrote")
    root = Root(path)
    confined(root, METADATA_FILE, where=path, field="the DCP metadata file")
    problem = file_problem(mfile, METADATA_BYTES, "DCP metadata")
    if problem is not None:  # read whole by torch: never a device or a sparse file of gigabytes
        raise refused(mfile, problem, "it is damaged or not DCP's; re-save the checkpoint")
    if not allow_pickle:
        raise NotACheckpointError(
            f"{mfile}: a torch.distributed.checkpoint's metadata is a Python pickle, and unpickling it can run "
            "arbitrary code; tsckpt unpickles only when asked: pass allow_pickle=True (--allow-pickle) if you "
            "trust where this checkpoint came from"
        )
    try:
        meta = _reader(root).read_metadata()
    except OSError:
        raise
    except Exception as e:  # unpickling garbage raises almost anything
        raise CorruptCheckpointError(
            f"{mfile}: cannot unpickle the DCP metadata ({reason(e)}); it is damaged or from an "
            "incompatible torch version: re-save the checkpoint"
        ) from None
    if not (isinstance(meta, Metadata) and isinstance(meta.state_dict_metadata, dict) and isinstance(meta.storage_data, dict)):
        raise CorruptCheckpointError(f"{mfile}: expected DCP Metadata listing data files, found {type(meta).__name__}; re-save")
    return meta, root


def _reader(root: Root) -> Any:
    """DCP's FileSystemReader of the checkpoint at ``root`` whose every file (the metadata,
    each data file) is opened below the directory's descriptor with no link followed
    (:func:`open_read`), never by the path DCP would join."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(root.path)
    reader.fs = _file_system_type()(root)
    return reader


@functools.cache
def _file_system_type() -> type:
    """DCP's FileSystem, its files opened confined below a :class:`Root` (a class made on
    first use: importing DCP takes most of a second)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ConfinedFileSystem(FileSystem):
        def __init__(self, root: Root) -> None:
            super().__init__()
            self.root = root

        def concat_path(self, path: Any, suffix: str) -> Any:
            where = os.path.join(self.root.path, METADATA_FILE)
            return confined(self.root, suffix, where=where, field="a data file's relative_path")

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if mode != "rb":
                raise ValueError(f"{path}: tsckpt reads a DCP checkpoint, never writes it")
            fd = open_read(str(path) if not isinstance(path, str) else path)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise CorruptCheckpointError(f"{path}: is not a regular file; re-save the checkpoint")
                yield f

    return ConfinedFileSystem


def _corrupt(path: str, field: str, what: str) -> CorruptCheckpointError:
    """The error for a bad field of the DCP metadata of the checkpoint at ``path``."""
    return CorruptCheckpointError(
        f"{os.path.join(path, METADATA_FILE)}: {field}: {what}; the checkpoint is damaged: re-save it"
    )


def _sizes(value: Any, ndim: int | None) -> tuple[int, ...] | None:
    """``value`` as a tuple of non-negative ints (of ``ndim`` of them, when given) with a
    product (zeros counted as one) under 2**59, or None."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_NDIM or (ndim is not None and len(value) != ndim):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        return None
    return tuple(value) if math.prod(max(n, 1) for n in value) < MAX_ELEMENTS else None


def _check_entries(path: str, meta: Any) -> None:
    """Every entry of the metadata is of DCP's types and sound: a tensor's shape and dtype,
    its chunks tiling the shape exactly (no hole, which would read as uninitialized memory),
    each chunk's data listed; each listed data entry a path, an offset and a length."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    if not (meta.planner_data is None or isinstance(meta.planner_data, dict)):
        raise _corrupt(path, "planner_data", f"expected a dict, found {type(meta.planner_data).__name__}")
    listed: set[tuple[str, Any]] = set()
    for index, info in meta.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _corrupt(path, "storage_data", f"a key {short_repr(index)} is not a MetadataIndex")
        field = f"storage_data['{index.fqn}']"
        if index.offset is not None and _sizes(index.offset, None) is None:
            raise _corrupt(path, f"{field} (its key)", f"expected chunk offsets, found {short_repr(index.offset)}")
        for name in ("offset", "length"):
            n = getattr(info, name, None)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise _corrupt(path, f"{field}.{name}", f"expected a non-negative int, found {short_repr(n)}")
        listed.add((index.fqn, None if index.offset is None else tuple(index.offset)))
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _corrupt(path, "state_dict_metadata", f"a key {short_repr(key)} is not a str")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(path, key, md, listed)
        elif not isinstance(md, BytesStorageMetadata):
            raise _corrupt(path, f"entry '{key}'", f"expected tensor or bytes metadata, found {type(md).__name__}")
        elif key not in {fqn for fqn, _ in listed}:
            raise _corrupt(path, f"entry '{key}'", "no data is listed for it in storage_data")


def _check_tensor(path: str, key: str, md: Any, listed: set[tuple[str, Any]]) -> None:
    """A tensor entry: shape, dtype, and chunks inside the shape, tiling it, each with its data listed."""
    field = f"entry '{key}'"
    size = _sizes(getattr(md, "size", None), None)
    if size is None:
        raise _corrupt(path, f"{field}.size", f"expected a shape under 2**59 elements, found {short_repr(md.size)}")
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not is_dtype(dtype) or not _dtypes.is_supported_torch(dtype):
        raise _corrupt(path, f"{field}.properties.dtype", f"expected a torch dtype tsckpt stores, found {short_repr(dtype)}")
    chunks = getattr(md, "chunks", None)
    if not isinstance(chunks, list):
        raise _corrupt(path, f"{field}.chunks", f"expected a list, found {type(chunks).__name__}")
    boxes = []
    for i, c in enumerate(chunks):
        offsets, sizes = _sizes(getattr(c, "offsets", None), len(size)), _sizes(getattr(c, "sizes", None), len(size))
        if offsets is None or sizes is None or any(o + n > s for o, n, s in zip(offsets, sizes, size)):
            raise _corrupt(
                path, f"{field}.chunks[{i}]",
                f"expected offsets and sizes inside the shape {list(size)}, found {short_repr(c)}",
            )
        if (key, offsets) not in listed:
            raise _corrupt(path, f"{field}.chunks[{i}]", f"no data is listed for the chunk at {list(offsets)}")
        boxes.append((offsets, sizes))
    if sum(math.prod(n) for _, n in boxes) != math.prod(size) or _overlap(boxes):
        raise _corrupt(path, f"{field}.chunks", f"they do not tile the shape {list(size)} exactly (overlap or holes)")


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the non-empty boxes (offsets, sizes) overlap; numpy, a block of rows at a time."""
    boxes = [b for b in boxes if math.prod(b[1])]
    if len(boxes) < 2 or not boxes[0][0]:
        return len(boxes) > 1  # two non-empty 0-d chunks overlap
    lo = np.array([o for o, _ in boxes], dtype=object)
    hi = np.array([[a + n for a, n in zip(o, s)] for o, s in boxes], dtype=object)
    for start in range(0, len(boxes), _OVERLAP_ROWS):
        rows = slice(start, start + _OVERLAP_ROWS)
        hit = np.asarray(((lo[rows, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[rows, None, :])).all(axis=2))
        np.fill_diagonal(hit[:, start:], False)
        if hit.any():
            return True
    return False


def _check_files(root: Root, meta: Any) -> None:
    """Refuse data files outside the directory (or links), and ones missing or shorter than the
    metadata says; and a tensor chunk whose stored bytes are fewer than its size (a compression
    transform aside), so that no read allocates more than the files hold."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    chunks = {
        (key, tuple(c.offsets)): (c, md.properties.dtype.itemsize)
        for key, md in meta.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata) for c in md.chunks
    }
    path = root.path
    need: dict[str, str] = {}
    ends: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        rel = info.relative_path
        field = f"storage_data['{index.fqn}'].relative_path"
        need[rel] = confined(root, rel, where=os.path.join(path, METADATA_FILE), field=field)
        ends[rel] = max(ends.get(rel, 0), info.offset + info.length)
        chunk, itemsize = chunks.get((index.fqn, tuple(index.offset or ())), (None, 0))
        if chunk is not None and not getattr(info, "transform_descriptors", None):
            want = math.prod(chunk.sizes) * itemsize
            if info.length < want:
                raise _corrupt(
                    path, f"storage_data['{index.fqn}'].length",
                    f"{info.length} bytes hold less than the chunk at {list(chunk.offsets)} needs ({want} bytes)",
                )
    for rel, n in sorted(ends.items()):
        file = need[rel]
        size = _size(file)
        if size is None or size < n:
            found = "missing" if size is None else f"truncated ({size} bytes)"
            raise CorruptCheckpointError(
                f"{file}: {found}, but the DCP metadata places {n} bytes of data in it; restore the file or re-save"
            )


def _size(file: str) -> int | None:
    """The size of the regular file ``file`` (opened as it is read: no link followed), or None."""
    try:
        fd = open_read(file)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class _RegionReader:
    """Reads DCP entries through FileSystemReader, keeping the last tensor region read."""

    def __init__(self, root: Root, meta: Any) -> None:
        self._path, self._meta = root.path, meta
        self._fs = _reader(root)
        self._fs.set_up_storage_reader(meta, True)
        self._lock = threading.Lock()
        self._last: tuple[str, tuple[int, ...], torch.Tensor] | None = None  # key, offsets, data

    def values(self, keys: list[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

        return self._run(create_default_local_load_plan(dict.fromkeys(keys), self._meta).items, {}, "values")

    def read(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self._meta.state_dict_metadata[key]
        box = tuple(box) + (slice(None),) * (len(md.size) - len(box))
        lo = tuple(s.indices(n)[0] for s, n in zip(box, md.size))
        hi = tuple(max(a, s.indices(n)[1]) for a, s, n in zip(lo, box, md.size))
        if any(h == a for a, h in zip(lo, hi)):
            return torch.empty([h - a for a, h in zip(lo, hi)], dtype=md.properties.dtype)
        with self._lock:
            last = self._last
            if last is None or last[0] != key or not all(
                o <= a and h <= o + n for a, h, o, n in zip(lo, hi, last[1], last[2].shape)
            ):
                self._last = None  # let the previous region go before allocating the next
                # load the bounding box of the saved chunks the box overlaps: DCP reads a chunk whole anyway
                hit = [c for c in md.chunks if all(o < h and a < o + n for a, h, o, n in zip(lo, hi, c.offsets, c.sizes))]
                start = tuple(min([a, *(c.offsets[d] for c in hit)]) for d, a in enumerate(lo))
                stop = tuple(max([h, *(c.offsets[d] + c.sizes[d] for c in hit)]) for d, h in enumerate(hi))
                data = torch.empty([b - a for a, b in zip(start, stop)], dtype=md.properties.dtype)
                region = ChunkStorageMetadata(offsets=torch.Size(start), sizes=data.shape)
                self._run(create_read_items_for_chunk_list(key, md, [region]), {key: data}, f"tensor '{key}'")
                last = self._last = (key, start, data)
        return last[2][span_slices(lo, hi, last[1])]

    def _run(self, items: list[Any], tensors: dict[str, torch.Tensor], what: str) -> dict[str, Any]:
        """Read DCP ReadItems into ``tensors``; returns the bytes entries read (values), by key."""
        from torch.distributed.checkpoint import LoadPlan

        planner = _planner_type()(tensors)
        try:
            plan = self._fs.prepare_global_plan([self._fs.prepare_local_plan(LoadPlan(items))])[0]
            self._fs.read_data(plan, planner).wait()
        except LeafTypeError as e:
            raise LeafTypeError(f"{self._path}: {e}") from None
        except LinkRefusedError:
            raise
        except Exception as e:  # torch.load of damaged bytes raises almost anything
            raise CorruptCheckpointError(
                f"{self._path}: cannot read {what} ({reason(e)}); the data files are "
                "damaged: restore them or re-save the checkpoint"
            ) from None
        return dict(planner.values)


@functools.cache
def _planner_type() -> type:
    """A planner reading tensors into given regions and values with weights_only=True (a class
    made on first use: importing DCP takes most of a second)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Loads(DefaultLoadPlanner):
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.state_dict = tensors
            self.values: dict[str, Any] = {}

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn]  # the region's tensor; read items carry offsets into it

        def load_bytes(self, read_item: Any, value: Any) -> None:
            key = read_item.dest_index.fqn
            try:
                self.values[key] = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                if weights_only_refusal(e) is None:
                    raise
                raise LeafTypeError(
                    f"entry '{key}' is not a plain value ({weights_only_refusal(e)}); keep only tensors, int, float, bool, str, "
                    "bytes, None and lists, tuples and dicts of them in the state_dict"
                ) from None

    return Loads


def key_paths_problem(key_paths: Any) -> str | None:
    """Why ``key_paths`` is not DCP's ``{flat key: key path}`` (the default planner's
    ``planner_data``: each path a tuple of str keys and int list indices), or None."""
    if key_paths is None:
        return None
    if not isinstance(key_paths, dict):
        return f"expected a dict of flat keys to key paths, found {type(key_paths).__name__}"
    for key, p in key_paths.items():
        if not isinstance(key, str) or not _is_key_path(p):
            return f"entry {short_repr(key)}: {short_repr(p)} is not a key path (a tuple of str keys and int indices)"
    return None


def _is_key_path(p: Any) -> bool:
    return (
        isinstance(p, tuple) and 0 < len(p) <= MAX_STRUCTURE_DEPTH
        and all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in p)
    )


def nest(leaves: dict[str, Any], key_paths: Any) -> Any:
    """Nested dicts and lists from DCP's ``{flat key: key path}`` (int components are list
    indices), the leaves taken depth first, or ``leaves`` as a flat dict if the paths are
    missing or do not form a tree.

    DCP writes every mapping key as ``str(key)``, so an optimizer's state, keyed by int in
    ``optimizer.state_dict()``, is stored under ``"0"``, ``"1"``...: a mapping key of decimal
    digits comes back as the int it most likely was (:func:`_key`), so the tree matches the
    state dict it came from (a restore into it, ``load_state_dict``, a diff against tsckpt's
    own save of it)."""
    paths: list[Any] = [key_paths.get(k) if isinstance(key_paths, dict) else None for k in leaves]
    if not all(_is_key_path(p) for p in paths):
        return leaves
    built = _typed_tree(paths, list(leaves.values()))
    if built is not None:
        return built
    try:
        names = ["/".join(str(c) if isinstance(c, int) else escape(c) for c in p) for p in paths]
    except (UnicodeEncodeError, ValueError):  # a lone surrogate; an int too long to print
        return leaves
    if paths_problem(names) is not None:  # paths listed twice, or a leaf with leaves below it
        return leaves
    order = _depth_first(names)
    names = [names[i] for i in order]
    values = list(leaves.values())
    values = [values[i] for i in order]
    structure = structure_from_paths(names)
    return from_paths(names, values) if structure is None else structure_from_json(structure, values)


def _key(component: str) -> str | int:
    """A mapping key as DCP stored it (``str(key)``), back as an int where it reads as one
    (decimal digits, no leading zero, short enough for any int a state dict keys by)."""
    if component.isascii() and component.isdigit() and len(component) <= 18 and str(int(component)) == component:
        return int(component)
    return component


def _typed_tree(paths: list[tuple[Any, ...]], values: list[Any]) -> Any:
    """The tree DCP's key paths name: int components list indices (0..n-1), str components
    mapping keys (:func:`_key`); None where they do not form one (a leaf with leaves below
    it, a node with both kinds of components, indices with gaps)."""
    if any(isinstance(c, str) and not _encodable(c) for p in paths for c in p):
        return None  # a lone surrogate: no name a tree of tsckpt's can hold
    root: dict[Any, Any] = {}
    for i, p in enumerate(paths):
        node = root
        for c in p[:-1]:
            node = node.setdefault(c, {})
            if not isinstance(node, dict):
                return None
        if p[-1] in node:
            return None
        node[p[-1]] = i
    order: list[int] = []

    def to_json(node: Any) -> Any:
        if isinstance(node, int):
            order.append(node)
            return None
        keys = list(node)
        if all(isinstance(k, int) for k in keys):
            if sorted(keys) != list(range(len(keys))):
                raise ValueError("list indices with gaps")
            return {"type": "list", "children": [to_json(node[k]) for k in range(len(keys))]}
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("list indices and mapping keys in one node")
        typed = [_key(k) for k in keys]
        return {"type": "dict", "keys": typed, "children": [to_json(node[k]) for k in keys]}

    try:
        structure = to_json(root)
    except ValueError:
        return None
    return structure_from_json(structure, [values[i] for i in order])


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _depth_first(names: list[str]) -> list[int]:
    """The indices of ``names`` (paths of one tree) in depth-first order, siblings in the
    order they first appear (list indices in their own order), so keys given rank by rank
    still nest as one tree."""
    root: dict[str, Any] = {}
    for i, name in enumerate(names):
        node = root
        *parents, last = name.split("/")
        for c in parents:
            node = node.setdefault(c, {})
        node[last] = i
    order: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, int):
            order.append(node)
        else:
            keys = list(node)
            if all(k.isdigit() for k in keys):  # list indices (a str key that reads as one is escaped)
                keys.sort(key=int)
            for k in keys:
                walk(node[k])

    walk(root)
    return order
