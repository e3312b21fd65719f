"""torch.distributed.checkpoint (DCP) directories read as a tsckpt source tree, without a process group.

Tensors become :class:`LazySource` leaves read region by region through DCP's own
``FileSystemReader`` and load-planner protocol (``dcp.load``'s single-process path),
touching only the saved chunks a region overlaps and keeping the last region, so a
conversion holds about one tensor. Values are loaded with ``weights_only=True``, but
``.metadata`` itself is a pickle: a DCP directory must come from a trusted source.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import threading
from typing import Any

import torch

from .._errors import CheckpointNotFoundError, CorruptCheckpointError, LeafTypeError, NotACheckpointError
from .torchfile import plain_tree, reason, weights_only_refusal
from .._types import LazySource
from ..tree import escape, from_paths, structure_from_json, structure_from_paths

# The pickled metadata file dcp.save writes last: its presence marks a DCP directory.
METADATA_FILE = ".metadata"

PICKLE_WARNING = (
    "A torch.distributed.checkpoint directory's .metadata file is a Python pickle: reading it can run "
    "arbitrary code, so only read DCP checkpoints from a trusted source."
)


def is_dcp_dir(path: str) -> bool:
    """Whether ``path`` is a directory with DCP's metadata file (its contents are not read)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_dcp(path: str) -> Any:
    """The state_dict saved by ``dcp.save`` in directory ``path``: tensors as lazy sources,
    values loaded, nesting rebuilt from the planner's key paths (a flat dict without them).
    Every data file is checked for presence and length before anything is read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = _read_metadata(path)
    _check_files(path, meta)
    reader = _Reader(path, meta)
    entries = meta.state_dict_metadata
    values = reader.values([k for k, md in entries.items() if not isinstance(md, TensorStorageMetadata)])
    leaves: dict[str, Any] = {}
    for key, md in entries.items():
        if key in values:
            leaves[key] = plain_tree(values[key], f"{path}: entry '{key}'")
        elif sum(math.prod(c.sizes) for c in md.chunks) != math.prod(md.size):
            raise CorruptCheckpointError(f"{path}: the chunks of tensor '{key}' do not tile its shape; re-save it")
        else:
            leaves[key] = LazySource(tuple(md.size), md.properties.dtype, functools.partial(reader.read, key), kind="torch")
    return _nest(leaves, meta.planner_data)


def _read_metadata(path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such directory; give the directory dcp.save wrote")
    mfile = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(mfile):
        raise NotACheckpointError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata file); give the one dcp.save wrote")
    try:
        meta = FileSystemReader(path).read_metadata()
    except OSError:
        raise
    except Exception as e:  # unpickling garbage raises almost anything
        raise CorruptCheckpointError(
            f"{mfile}: cannot unpickle the DCP metadata ({reason(e)}); it is damaged or from an "
            "incompatible torch version: re-save the checkpoint"
        ) from None
    if not (isinstance(meta, Metadata) and isinstance(meta.state_dict_metadata, dict) and isinstance(meta.storage_data, dict)):
        raise CorruptCheckpointError(f"{mfile}: expected DCP Metadata listing data files, found {type(meta).__name__}; re-save")
    return meta


def _check_files(path: str, meta: Any) -> None:
    """Refuse entries with no data listed and data files missing or shorter than the metadata says."""
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(set(meta.state_dict_metadata) - {index.fqn for index in meta.storage_data})
    if missing:
        raise CorruptCheckpointError(f"{path}: the DCP metadata lists no data for {missing[:5]}; re-save the checkpoint")
    for rel, n in sorted(need.items()):
        file = os.path.join(path, rel)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < n:
            found = "missing" if size is None else f"truncated ({size} bytes)"
            raise CorruptCheckpointError(
                f"{file}: {found}, but the DCP metadata places {n} bytes of data in it; restore the file or re-save"
            )


class _Reader:
    """Reads DCP entries through FileSystemReader, keeping the last tensor region read."""

    def __init__(self, path: str, meta: Any) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self._path, self._meta = path, meta
        self._fs = FileSystemReader(path)
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
        return last[2][tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, last[1]))]

    def _run(self, items: list[Any], tensors: dict[str, torch.Tensor], what: str) -> dict[str, Any]:
        """Read DCP ReadItems into ``tensors``; returns the bytes entries read (values), by key."""
        from torch.distributed.checkpoint import LoadPlan

        planner = _planner_type()(tensors)
        try:
            plan = self._fs.prepare_global_plan([self._fs.prepare_local_plan(LoadPlan(items))])[0]
            self._fs.read_data(plan, planner).wait()
        except LeafTypeError as e:
            raise LeafTypeError(f"{self._path}: {e}") from None
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


def _nest(leaves: dict[str, Any], planner_data: Any) -> Any:
    """Nested dicts and lists from DCP's ``{flat key: key path}`` (int components are list
    indices), or ``leaves`` as a flat dict if the paths are missing or do not form a tree."""
    paths: list[Any] = [planner_data.get(k) if isinstance(planner_data, dict) else None for k in leaves]
    if not all(isinstance(p, tuple) and p and all(isinstance(c, (str, int)) for c in p) for p in paths):
        return leaves
    names = ["/".join(str(c) if isinstance(c, int) else escape(c) for c in p) for p in paths]
    parents = {n.rsplit("/", i)[0] for n in names for i in range(1, n.count("/") + 1)}
    if len(set(names)) < len(names) or parents & set(names):
        return leaves
    structure = structure_from_paths(names)
    values = list(leaves.values())
    return from_paths(names, values) if structure is None else structure_from_json(structure, values)
