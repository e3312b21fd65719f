"""torch.distributed.checkpoint storage: ``dcp.save`` and ``dcp.async_save`` write a tsckpt
checkpoint, ``dcp.load`` reads any checkpoint tsckpt reads.

DCP plans what each rank writes or reads (its planners, deduplication and resharding);
these classes only store and fetch what it planned, through tsckpt's own verbs:

* :class:`StorageWriter` turns each rank's final plan into the tree tsckpt's save takes
  (every tensor chunk a :class:`ShardedArray` of its global array, every other entry a
  plain value) and runs tsckpt's save protocol in ``write_data``: the commit, checksums,
  lease and layouts are tsckpt's, and nothing is pickled. DCP's key paths (the default
  planner's ``planner_data``) become the nesting of the tree, so the checkpoint reads as
  the state dict it was (``tsckpt.restore(d)``, zarr tools). One round trip through rank 0
  first gives every rank the whole tree (tsckpt keeps the structure only when ranks give the
  same tree): the entries other ranks write become empty regions, and the values and
  scalar tensors DCP wrote on one rank are given by all.
* :class:`StorageReader` builds DCP's ``Metadata`` from an opened checkpoint of any format
  (the tree flattened by DCP's own rule, so its keys are those its load planner asks for;
  each array one chunk of its whole shape) and serves each ``ReadItem`` by reading just
  its region through tsckpt's read engine into the tensor the planner resolves.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint import planner as _dcp_planner
from torch.distributed.checkpoint import storage as _dcp_storage
from torch.futures import Future

from .._base import dtypes as _dtypes
from .._base.casting import check_cast
from .._base.types import Dest, ReadItem, ShardedArray
from .._coord.protocol import ask_root
from .._coord.torchdist import coordinator_for, rank_of
from .._errors import DistributedError, LayoutError, LeafTypeError
from .._formats.dcp import key_paths_problem, nest
from .._formats.sources import detect, open_checkpoint
from .._ondisk.backing import check_backed
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.readfaults import unchanged
from .._ondisk.records import LAYOUT_PLAIN
from .._options import READ_WINDOW_BYTES, WRITE_WINDOW_BYTES, Incremental, RestoreOptions, SaveOptions, verb
from .._read.engine import read_into
from .._read.restore import cast_warnings_off, warn_lost_values
from .._runtime.progress import Progress
from .._save.protocol import save_with
from .._storage.locations import Directory
from ..tree import ROOT_LEAF_PATH, flatten, unflatten

_TENSOR_ITEMS = (_dcp_planner.WriteItemType.TENSOR, _dcp_planner.WriteItemType.SHARD)


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _path_of(checkpoint_id: Any) -> Any:
    return os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id


# ---- writing --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One DCP entry as every rank gives it to tsckpt's save: an array (``shape``, ``dtype``)
    or a plain value (``shape`` None). ``value`` is the value's plain tree, or a scalar
    tensor's data: both are written by one rank in DCP's plan and given by every rank here."""

    fqn: str
    shape: tuple[int, ...] | None
    dtype: str = ""
    value: Any = None


def _plain_value(fqn: str, value: Any) -> Any:
    """A bytes entry's value as a tree of plain values; LeafTypeError naming the entry when it
    holds anything else (DCP would pickle it; tsckpt never does)."""
    flat = flatten(value)
    for p, leaf in zip(flat.paths, flat.leaves):
        if not isinstance(leaf, (bool, int, float, str, bytes)):
            kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
            what = f"is a {kind}" if p == ROOT_LEAF_PATH else f"holds a {kind} at '{p}'"
            raise LeafTypeError(
                f"dcp.save with tsckpt's StorageWriter: entry '{fqn}' {what}, which DCP would pickle; tsckpt "
                "stores tensors as arrays and values as JSON, never a pickle: keep int, float, bool, str, bytes, "
                "None and lists, tuples and dicts of them as values, and tensors in dicts or lists (which DCP's "
                "planner splits into entries of their own), not in tuples or objects"
            )
    return value


def _value_of(item: Any, planner: Any) -> Any:
    """The object a bytes item stands for: the planner's own (DefaultSavePlanner's
    ``lookup_object``), else the bytes it resolves to, loaded with ``weights_only=True``."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)
    data.seek(0)
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same here
        raise LeafTypeError(
            f"dcp.save with tsckpt's StorageWriter: entry '{item.index.fqn}' is not a plain value ({e}); keep only "
            "tensors, int, float, bool, str, bytes, None and lists, tuples and dicts of them in the state_dict"
        ) from None


@dataclasses.dataclass(frozen=True)
class _Mine:
    """What one rank writes in DCP's plan: its tensor chunks by entry, and its entries as
    every rank will give them (the payload it sends rank 0)."""

    chunks: dict[str, tuple[torch.Tensor, tuple[int, ...]]]  # fqn -> (local data, offsets)
    entries: list[_Entry]
    key_paths: dict[str, tuple[Any, ...]]


def _mine(plan: Any, planner: Any) -> _Mine:
    chunks: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
    entries: list[_Entry] = []
    for item in plan.items:
        fqn = item.index.fqn
        if item.type in _TENSOR_ITEMS:
            td = item.tensor_data
            shape = tuple(int(n) for n in td.size)
            data = planner.resolve_data(item).detach()
            if fqn in chunks:
                raise LayoutError(
                    f"'{fqn}': this rank writes several chunks of it (offsets {list(chunks[fqn][1])} and "
                    f"{list(td.chunk.offsets)}); tsckpt stores one region of an array per rank: save it as a "
                    "DTensor or a tensor per rank, which DCP writes as one chunk each"
                )
            chunks[fqn] = (data, tuple(int(o) for o in td.chunk.offsets))
            scalar = data.cpu().clone() if not shape else None  # every rank gives it: a replica
            entries.append(_Entry(fqn, shape, _dtypes.torch_name(td.properties.dtype), scalar))
        else:
            entries.append(_Entry(fqn, None, value=_plain_value(fqn, _value_of(item, planner))))
    paths = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    return _Mine(chunks, entries, {e.fqn: paths[e.fqn] for e in entries if e.fqn in paths})


def _refuse_planner_data(data: Any, where: str) -> None:
    """LeafTypeError unless ``data`` is None or DCP's key paths: what else a planner hands the
    writer has no place in the format, and tsckpt would not pickle it."""
    problem = key_paths_problem(data)
    if problem is not None:
        raise LeafTypeError(
            f"dcp.save with tsckpt's StorageWriter: the planner's {where} ({problem}) has no place in a tsckpt "
            "checkpoint, which keeps DCP's key paths (DefaultSavePlanner's planner_data) as its tree and "
            "nothing it would have to pickle; save with DefaultSavePlanner or a planner whose planner_data is "
            "None or those key paths"
        )


def _merge(
    payloads: list[tuple[list[_Entry], dict[str, tuple[Any, ...]]]], planner: Any
) -> tuple[list[_Entry], dict[str, Any]]:
    """Rank 0: every rank's entries, in rank order, each once, and their key paths; the global
    metadata rank 0's planner made is checked first (its planner_data and storage_data)."""
    meta = getattr(planner, "metadata", None)
    if meta is not None:
        _refuse_planner_data(getattr(meta, "planner_data", None), "global planner_data")
        if getattr(meta, "storage_data", None) is not None:
            raise LeafTypeError(
                "dcp.save with tsckpt's StorageWriter: the planner's global metadata carries storage_data "
                f"({type(meta.storage_data).__name__}), which has no place in a tsckpt checkpoint; save with a "
                "planner that leaves it None"
            )
    entries: dict[str, _Entry] = {}
    key_paths: dict[str, Any] = {}
    for rank_entries, paths in payloads:
        for e in rank_entries:
            entries.setdefault(e.fqn, e)
        key_paths.update(paths)
    return list(entries.values()), key_paths


def _tree(entries: list[_Entry], key_paths: dict[str, Any], mine: _Mine) -> Any:
    """This rank's tree for tsckpt's save: the same paths on every rank (see the module's docstring)."""
    leaves: dict[str, Any] = {}
    for e in entries:
        if not e.shape:  # a value, or a scalar tensor: every rank gives what its writer sent
            leaves[e.fqn] = e.value
        elif e.fqn in mine.chunks:
            data, offsets = mine.chunks[e.fqn]
            leaves[e.fqn] = ShardedArray(data, e.shape, offsets)
        else:
            empty = torch.empty((0,) * len(e.shape), dtype=_dtypes.torch_dtype(e.dtype))
            leaves[e.fqn] = ShardedArray(empty, e.shape, (0,) * len(e.shape))
    return nest(leaves, key_paths)


def _nbytes(item: _dcp_planner.WriteItem) -> int:
    """The bytes of a tensor chunk DCP planned (a value's: 0, its JSON is part of the root)."""
    td = item.tensor_data
    if item.type not in _TENSOR_ITEMS or td is None:
        return 0
    return td.chunk.sizes.numel() * _dtypes.itemsize(_dtypes.torch_name(td.properties.dtype))


class StorageWriter(_dcp_storage.StorageWriter):
    """``dcp.save(state_dict, storage_writer=tsckpt.torch.StorageWriter(path))``: DCP plans, tsckpt
    writes and commits a checkpoint of zarr v3 global arrays that ``tsckpt.open``,
    ``tsckpt.restore`` and zarr tools read, and :class:`StorageReader` loads.

    The options are :func:`tsckpt.save`'s. ``group`` must be the group ``dcp.save`` is given
    (default: the default group): every rank of it calls ``dcp.save``. ``path`` may instead
    come as ``dcp.save``'s ``checkpoint_id``. ``dcp.async_save`` takes it too. Entries DCP
    would pickle must be plain values (int, float, bool, str, bytes, None and lists, tuples
    and dicts of them); any other is refused, naming it.
    """

    @verb("tsckpt.torch.StorageWriter")
    def __init__(
        self,
        path: Directory | None = None,
        *,
        overwrite: bool = False,
        group: Any = None,
        check_replicas: bool = True,
        timeout: datetime.timedelta | None = None,
        max_inflight_bytes: int = WRITE_WINDOW_BYTES,
        layout: str = LAYOUT_PLAIN,
        inner_chunks: bool = True,
        progress: bool | None = None,
        incremental: Incremental = True,
    ) -> None:
        super().__init__()
        self.options = SaveOptions.of(locals())
        self.path = _path_of(path)
        self._dcp_rank: int | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path_of(checkpoint_id)
        self._dcp_rank = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self._dcp_rank = rank if isinstance(rank, int) else None

    def prepare_local_plan(self, plan: _dcp_planner.SavePlan) -> _dcp_planner.SavePlan:
        _refuse_planner_data(plan.planner_data, "planner_data")  # before anything is written
        return plan

    def prepare_global_plan(self, plans: list[_dcp_planner.SavePlan]) -> list[_dcp_planner.SavePlan]:
        return plans

    def write_data(
        self, plan: _dcp_planner.SavePlan, planner: _dcp_planner.SavePlanner
    ) -> Future[list[_dcp_storage.WriteResult]]:
        if self.path is None:
            raise ValueError(
                "tsckpt.torch.StorageWriter has no path: give StorageWriter(path) or dcp.save(checkpoint_id=path)"
            )
        coord = coordinator_for(self.options.group, self.options.timeout)

        def describe() -> tuple[_Mine, Any]:
            if self._dcp_rank is not None and self._dcp_rank != coord.rank:
                raise DistributedError(
                    f"dcp.save runs this process as rank {self._dcp_rank}, and tsckpt's StorageWriter's group as "
                    f"rank {coord.rank}: give StorageWriter(group=...) the process_group dcp.save has, and call "
                    "dcp.save on every rank of it (not with no_dist=True in a job of several ranks)"
                )
            mine = _mine(plan, planner)
            return mine, (mine.entries, mine.key_paths)

        def answer(payloads: list[Any]) -> list[Any]:
            return [_merge(payloads, planner)] * coord.world_size

        mine, (entries, key_paths) = ask_root(coord, "dcp.save (describe)", describe, answer)
        save_with(self.path, _tree(entries, key_paths, mine), self.options)
        results = [_dcp_storage.WriteResult(index=i.index, size_in_bytes=_nbytes(i), storage_data=None) for i in plan.items]
        return _done(results)

    def finish(self, metadata: _dcp_metadata.Metadata, results: list[list[_dcp_storage.WriteResult]]) -> None:
        """Nothing left: tsckpt's save committed the checkpoint in ``write_data`` once every rank had written."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


# ---- reading --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Index:
    """An opened checkpoint as DCP sees it: its Metadata, the stored array of each tensor
    entry, and each bytes entry's value (its arrays as stand-ins, read when it is loaded)."""

    ck: Checkpoint
    metadata: _dcp_metadata.Metadata
    arrays: dict[str, str]  # fqn -> stored array path
    values: dict[str, Any]  # fqn -> plain tree, arrays as stand-ins
    standins: dict[int, str]  # id of a stand-in tensor -> stored array path


def _index(ck: Checkpoint, checkpoint_id: Any) -> _Index:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    standins: dict[int, str] = {}
    leaves: list[Any] = []
    for p in ck.leaves:
        if not ck.is_array(p):
            leaves.append(ck.values[p])
            continue
        md = ck.array_metadata(p)
        dtype = _dtypes.torch_dtypes().get(md.dtype)
        if dtype is None:
            raise LeafTypeError(
                f"{ck.location}: '{p}' is stored as {md.dtype}, which torch has no dtype for, and DCP loads "
                "torch tensors only; read it with tsckpt.restore or tsckpt.open instead"
            )
        standin = torch.empty(md.shape, dtype=dtype, device="meta")
        standins[id(standin)] = ck.aliases.get(p, p)
        leaves.append(standin)
    tree = ck.build(leaves)
    if not isinstance(tree, Mapping):  # a checkpoint of one leaf, or of a list: DCP loads dicts
        tree = {ROOT_LEAF_PATH: tree}
    flat, key_paths = flatten_state_dict(dict(tree))  # DCP's own rule: the keys its load planner asks for
    entries: dict[str, Any] = {}
    arrays: dict[str, str] = {}
    values: dict[str, Any] = {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor) and id(v) in standins:
            arrays[fqn] = standins[id(v)]
            whole = _dcp_metadata.ChunkStorageMetadata(offsets=torch.Size([0] * v.dim()), sizes=v.shape)
            entries[fqn] = _dcp_metadata.TensorStorageMetadata(
                properties=_dcp_metadata.TensorProperties(dtype=v.dtype), size=v.shape, chunks=[whole]
            )
        else:
            values[fqn] = v
            entries[fqn] = _dcp_metadata.BytesStorageMetadata()
    meta = _dcp_metadata.Metadata(
        state_dict_metadata=entries,
        planner_data=dict(key_paths),
        storage_meta=_dcp_metadata.StorageMeta(checkpoint_id=checkpoint_id),
    )
    return _Index(ck, meta, arrays, values, standins)


class StorageReader(_dcp_storage.StorageReader):
    """``dcp.load(state_dict, storage_reader=tsckpt.torch.StorageReader(path))``: any checkpoint
    tsckpt reads (its own, a safetensors file or Hugging Face directory, a ``torch.save``
    file, an Orbax checkpoint; a DCP directory with ``allow_pickle=True``), loaded by DCP's own
    planners, resharded to the state dict's DTensors: each rank reads only its regions.

    The options are :func:`tsckpt.restore`'s that apply: ``casting`` refuses a cast into the
    state dict's dtypes that would lose values (DCP itself casts silently);
    ``max_inflight_bytes`` bounds the reads in flight; ``format`` and ``allow_pickle`` say
    which checkpoint and how to open it. ``path`` may instead come as ``dcp.load``'s
    ``checkpoint_id``.
    """

    @verb("tsckpt.torch.StorageReader")
    def __init__(
        self,
        path: Directory | None = None,
        *,
        progress: bool | None = None,
        max_inflight_bytes: int = READ_WINDOW_BYTES,
        casting: str = "same_kind",
        format: str | None = None,  # noqa: A002 - the read verbs' option
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.options = RestoreOptions.of(locals())
        self.path = _path_of(path)
        self._index: _Index | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path_of(checkpoint_id)
        self._index = None

    def _opened(self) -> _Index:
        if self._index is None:
            if self.path is None:
                raise ValueError(
                    "tsckpt.torch.StorageReader has no path: give StorageReader(path) or dcp.load(checkpoint_id=path)"
                )
            o = self.options
            ck = open_checkpoint(self.path, format=o.format, allow_pickle=o.allow_pickle)
            ck.check_links()
            self._index = _index(ck, self.path)
        return self._index

    def read_metadata(self) -> _dcp_metadata.Metadata:
        return self._opened().metadata

    def set_up_storage_reader(
        self, metadata: _dcp_metadata.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._opened()

    def prepare_local_plan(self, plan: _dcp_planner.LoadPlan) -> _dcp_planner.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[_dcp_planner.LoadPlan]) -> list[_dcp_planner.LoadPlan]:
        return plans

    def read_data(self, plan: _dcp_planner.LoadPlan, planner: _dcp_planner.LoadPlanner) -> Future[None]:
        index = self._opened()
        ck, o = index.ck, self.options
        dests: list[Dest] = []
        targets: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (read item, target, what is read into)
        loads = []
        for req in plan.items:
            if req.type == _dcp_planner.LoadItemType.BYTE_IO:
                loads.append(req)
                continue
            path = index.arrays[req.storage_index.fqn]
            target = planner.resolve_tensor(req).detach()
            into = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
            cast = check_cast(path, ck.arrays[path].dtype, target.dtype, casting=o.casting)
            item = ReadItem(path, tuple(int(n) for n in req.storage_offsets), tuple(int(n) for n in req.lengths))
            dests.append(Dest(item, into, None, cast=cast))
            targets.append((req, target, into))
        values = {req.storage_index.fqn: index.values[req.storage_index.fqn] for req in loads}
        wanted = [leaf for v in values.values() for leaf in flatten(v).leaves if id(leaf) in index.standins]
        whole = [_whole(index.standins[id(leaf)], leaf) for leaf in wanted]
        everything = dests + whole
        if everything:
            check_backed(ck, sorted({d.item.path for d in everything}))
            with unchanged(ck), cast_warnings_off(any(d.cast is not None for d in dests)), Progress(
                "dcp.load", ck.location, show=o.progress, rank=rank_of(), unit="reads"
            ) as bar:
                read_into(ck, everything, bar, window=o.max_inflight_bytes)
            warn_lost_values([d.cast for d in dests])
        with torch.no_grad():
            for req, target, into in targets:
                if into is not target:
                    target.copy_(into)
                planner.commit_tensor(req, target)
        read = {id(leaf): d.tensor for leaf, d in zip(wanted, whole)}
        for req in loads:
            flat = flatten(values[req.storage_index.fqn])
            value = unflatten(flat.spec, [read.get(id(leaf), leaf) for leaf in flat.leaves])
            stream = io.BytesIO()
            torch.save(value, stream)  # DCP's load planner takes a value as torch.save's bytes
            stream.seek(0)
            planner.load_bytes(req, stream)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and detect(os.fspath(checkpoint_id)) is not None


def _whole(path: str, standin: torch.Tensor) -> Dest:
    """A destination for a whole stored array inside a value (a tuple of tensors)."""
    shape = tuple(standin.shape)
    return Dest(ReadItem(path, (0,) * len(shape), shape), torch.empty(shape, dtype=standin.dtype), None)
