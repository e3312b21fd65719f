"""restore(): match a target tree to a checkpoint, plan the reads, fill the leaves."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorstore as ts
import torch

from .._base import dtypes as _dtypes
from .._base.types import ArraySpec, Dest, ReadItem
from .._codec.chunkread import read_chunks
from .._codec.route import Place, Route, place, route
from .._codec.route import setting as codec_setting
from .._codec.shardread import READ_THREADS, read_sharded
from .._coord.protocol import phase
from .._coord.torchdist import coordinator_for
from .._errors import LeafTypeError, StructureMismatchError, count_and_list
from .._formats import lazy
from .._formats.sources import open_checkpoint
from .._leaves.registry import destination, kind_of, materialises, memory
from .._leaves.stateful import expand, is_whole_state
from .._ondisk.backing import check_backed
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import shard_boxes
from .._ondisk.readfaults import corrupt_error, unchanged
from .._ondisk.records import ArrayRecord
from .._options import READ_WINDOW_BYTES, RestoreOptions, verb
from .._runtime import devicecopy as _devicecopy
from .._runtime.memory import collector_paused, release_free_memory, unwritable
from .._runtime.progress import Progress
from .._runtime.window import Window
from .._storage.locations import Directory
from ..tree import flatten, prefix_advice, prefix_shift, unflatten
from .reader import LazyArray


class RestoreWarning(UserWarning):
    """strict=False skipped leaves; the message lists them."""


def _check_structure(ck: Checkpoint, paths: list[str], strict: bool) -> None:
    stored = set(ck.leaves)
    wanted = set(paths)
    missing = sorted(wanted - stored)
    unexpected = sorted(stored - wanted)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {count_and_list(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the target: {count_and_list(unexpected)}")
    msg = f"{ck.location}: target tree and checkpoint differ; " + "; ".join(parts)
    shift = prefix_shift(missing, unexpected)
    shifted = ""
    if shift is not None:
        shifted = (
            f"{shift.matched} of the {shift.missing} missing leaves are in the checkpoint "
            + (f"under the prefix {shift.stored!r}" if shift.stored else f"without the prefix {shift.target!r}")
            + f": the names are shifted, not different; {prefix_advice(shift)}"
        )
    if wanted and not wanted & stored:  # even strict=False would restore nothing at all
        raise StructureMismatchError(
            f"{msg}. Not one leaf of the target is in the checkpoint, so a restore would load nothing"
            + ("" if strict else " (strict=False too)")
            + (f". {shifted}" if shifted else "; check that this is the checkpoint meant, and the target its tree")
        )
    if shifted:
        msg += f". {shifted}"
    if strict:
        raise StructureMismatchError(msg + ". Pass strict=False to restore only the leaves both have.")
    loaded = len(wanted & stored)
    warnings.warn(
        msg + f". strict=False: restored the common leaves ({loaded} of the target's {len(wanted)}), kept the "
        "target's values for the rest.",
        RestoreWarning,
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """stacklevel (for a warn() in the caller of this function) of the first frame outside tsckpt."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # tsckpt/
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(pkg):
        frame, level = frame.f_back, level + 1
    return level


def warn_lost_values(checks: list[Any]) -> None:
    """One warning per leaf that casting="unsafe" changed values of (see ``CastCheck``); a leaf
    read in parts (:attr:`Dest.parts`) shares one check among them."""
    for check in {id(c): c for c in checks}.values():
        message = None if check is None else check.warning()
        if message is not None:
            warnings.warn(message, RestoreWarning, stacklevel=_user_stacklevel())


@contextlib.contextmanager
def cast_warnings_off(checked: bool) -> Iterator[None]:
    """Silences numpy's and torch's own warnings on checked casts (only those can overflow
    or drop an imaginary part): the checks report the values changed, once per leaf."""
    if not checked:
        yield
        return
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.filterwarnings("ignore", "Casting complex values to real", UserWarning)
        yield


def _viewable(dest: Dest, stored: str) -> bool:
    """Whether the destination is memory that chunks can be decoded straight into (no
    buffer, no extra copy): CPU memory of the stored dtype, writable; not for a cast, a
    GPU tensor, or a conjugated or negated view."""
    t = dest.tensor
    if isinstance(t, np.ndarray):
        return stored != "complex32" and t.dtype == _dtypes.numpy_dtype(stored) and t.flags.writeable
    return t.device.type == "cpu" and _dtypes.torch_name(t.dtype) == stored and not t.is_conj() and not t.is_neg()


def _view(dest: Dest) -> np.ndarray:
    """The memory of a :func:`_viewable` destination as a writable numpy view in the stored
    dtype and shape (complex32: its float16 pairs)."""
    t = dest.tensor
    return t if isinstance(t, np.ndarray) else _dtypes.tensor_to_numpy(t)


def _open_all(ck: Checkpoint, paths: list[str]) -> dict[str, Any]:
    """Open the arrays concurrently (each open reads and checks its zarr.json)."""
    arrays = {p: LazyArray(ck, p) for p in dict.fromkeys(paths)}
    futures = {p: arr.open_future() for p, arr in arrays.items()}
    for p, fut in futures.items():
        arrays[p].set_store(fut)
    return {p: arr.tensorstore() for p, arr in arrays.items()}


@dataclasses.dataclass(frozen=True)
class _ReadPlan:
    """Which reader fills each destination (:func:`_plan_reads`), tier by tier. The
    destinations are kept, not their views (made again as each is read): holding 10,000
    views at once made planning a restore of 10,000 small leaves 0.1 s slower (the
    garbage collector walks them)."""

    place: Place
    chunks: tuple[Dest, ...]  # the own codec: unsharded chunk files, decoded into the memory
    shards: tuple[Dest, ...]  # the own codec: the local shard files, read into the memory
    into: tuple[Dest, ...]  # TensorStore, decoding straight into the memory
    copied: tuple[Dest, ...]  # TensorStore, each block read into a buffer, then cast or copied in
    sources: tuple[Dest, ...] = ()  # another format's files, region by region (_formats/lazy.py)


def _plan_reads(ck: Checkpoint, dests: list[Dest]) -> _ReadPlan:
    """Each destination's reader: the own codec where :func:`route` says so and the
    destination is :func:`_viewable`, else TensorStore."""
    if ck.lazy:  # another format's files: no zarr arrays to route
        return _ReadPlan(Place(False, None, f"arrays of a {ck.format} checkpoint"), (), (), (), (), tuple(dests))
    where = place(ck.data(), ck.layout, foreign=ck.foreign)
    tiers: dict[Route, list[Dest]] = {r: [] for r in Route}
    copied: list[Dest] = []
    for dest in dests:
        rec = ck.arrays[dest.item.path]
        if _viewable(dest, rec.dtype):
            tiers[route(rec, where)].append(dest)
        else:
            copied.append(dest)
    return _ReadPlan(
        where, tuple(tiers[Route.CHUNK]), tuple(tiers[Route.SHARD]), tuple(tiers[Route.TENSORSTORE]), tuple(copied)
    )


def read_into(
    ck: Checkpoint, dests: list[Dest], progress: Progress | None = None, *, window: int = READ_WINDOW_BYTES
) -> None:
    """Execute read items: plan each destination's reader (:func:`_plan_reads`), then run
    the tiers. The own codec reads unsharded chunk files (:func:`read_chunks`) and the
    shard files of a local plain checkpoint (:func:`read_sharded`) into CPU memory of
    the stored dtype, leaving to TensorStore what it finds not exactly as expected;
    TensorStore decodes the others straight into such memory, and reads blocks into
    buffers for the rest (a cast, a GPU tensor). ``window`` bounds the bytes of reads
    in flight, which bounds the extra memory a restore needs.
    """
    if progress is not None:
        progress.set_total(sum(math.prod(d.item.lengths) * _dtypes.itemsize(ck.arrays[d.item.path].dtype) for d in dests))
    host: list[Dest] = []
    device: list[Dest] = []
    for d in dests:
        (device if _devicecopy.on_device(d.tensor) else host).append(d)
    if device:
        _read_device(ck, device, progress, window)
    _read_host(ck, host, progress, window)


def _read_host(ck: Checkpoint, dests: list[Dest], progress: Progress | None, window: int) -> None:
    """Read into destinations in host memory, tier by tier (see :func:`read_into`)."""
    plan = _plan_reads(ck, dests)
    if plan.sources:
        _read_sources(ck, plan.sources, progress)
    left: list[Dest] = []
    if plan.chunks:
        left += read_chunks(ck, plan.chunks, _view, progress, window, directory=plan.place.directory)
    if plan.shards and plan.place.directory is not None:
        left += read_sharded(ck, plan.place.directory, plan.shards, _view, progress, window)
    if plan.into or left or plan.copied:
        _read_tensorstore(ck, [*plan.into, *left], plan.copied, progress, window)


def _read_device(ck: Checkpoint, dests: list[Dest], progress: Progress | None, window: int) -> None:
    """Read into destinations in device memory through host memory of ``window`` bytes at
    most (a :class:`_devicecopy.ToDevice` ring): each destination is cut into pieces
    (within its shards, on their inner chunk grid, small enough that a batch holds a piece
    for each reading thread), a batch of pieces of half the window is read into host memory in the target's dtype by the host tiers (casts and
    their checks included), then copied to the device asynchronously while the next
    batch is read."""
    half = max(1, window // 2)
    parts = []
    for dest in dests:
        rec, item = ck.arrays[dest.item.path], dest.item
        itemsize = dest.tensor.element_size()
        inner = rec.chunking.chunk_shape or rec.chunking.shard_shape
        rows = inner[0] if inner else 1
        chunk = math.prod(inner) * itemsize
        limit = max(chunk, half // READ_THREADS)  # a batch of ``half`` keeps every reading thread busy
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.chunking):
            parts += [(dest, o, n) for o, n in _devicecopy.pieces(off, ln, itemsize, min(limit, half), rows=rows)]
    copier = _devicecopy.ToDevice(window)
    try:
        for batch in _devicecopy.batches(parts, lambda p: _devicecopy.align(math.prod(p[2]) * p[0].tensor.element_size()), half):
            hosts = []
            for dest, off, ln in batch:
                host, loan = copier.take(dest.tensor.dtype, ln)
                hosts.append((Dest(ReadItem(dest.item.path, off, ln), host, None, cast=dest.cast), loan))
            _read_host(ck, [h for h, _ in hosts], progress, window)
            for (dest, off, ln), (read, loan) in zip(batch, hosts):
                dsel = tuple(slice(o - so, o - so + n) for o, so, n in zip(off, dest.item.storage_offsets, ln))
                copier.upload(read.tensor, loan, dest.tensor[dsel] if dsel else dest.tensor)
    finally:
        copier.finish()


def _read_sources(ck: Checkpoint, dests: tuple[Dest, ...], progress: Progress | None) -> None:
    """Another format's arrays: each destination's region asked of its source block by block
    (the record's shards, :data:`lazy.BLOCK_BYTES` each), so only the byte ranges of the
    region are read. A block goes straight into memory of the stored dtype (safetensors: read
    into it), else through a buffer of one block that is cast or copied in; reads run one at
    a time, so the window is one block."""
    sources = ck.sources or {}
    for dest in dests:
        item, rec = dest.item, ck.arrays[dest.item.path]
        src = sources[item.path]
        view = _view(dest) if _viewable(dest, rec.dtype) else None
        itemsize = _dtypes.itemsize(rec.dtype)
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.chunking):
            box = tuple(slice(o, o + n) for o, n in zip(off, ln))
            dsel = tuple(slice(o - so, o - so + n) for o, so, n in zip(off, item.storage_offsets, ln))
            if view is not None:
                lazy.fill(src, box, view[dsel] if dsel else view)
            else:
                _copy_in(dest, dsel, off, lazy.read(src, box), rec.dtype)
            if progress is not None:
                progress.update(math.prod(ln) * itemsize, 1)


@dataclasses.dataclass(frozen=True)
class _Block:
    """One shard's part of a destination, its TensorStore read or write started."""

    future: Any
    dest: Dest
    offsets: tuple[int, ...]  # where the block starts in the stored array
    dsel: tuple[slice, ...]  # where it goes in the destination
    copy: bool  # the future gives the block, to be cast or copied in (else it was decoded in place)
    nbytes: int


def _read_tensorstore(
    ck: Checkpoint, into: list[Dest], copied: tuple[Dest, ...], progress: Progress | None, window: int
) -> None:
    """The TensorStore tiers, shard by shard: decode straight into ``into``'s memory, and
    read blocks of ``copied`` into buffers that are then cast or copied in. After each
    window's worth of reads the decode buffers' freed pages are given back."""
    stores = _open_all(ck, [d.item.path for d in (*into, *copied)])
    tiers = [(dest, True) for dest in into] + [(dest, False) for dest in copied]

    def settle(b: _Block) -> None:
        try:
            raw = b.future.result()
        except ValueError as e:
            raise corrupt_error(ck, b.dest.item.path, e) from e
        if progress is not None:
            progress.update(b.nbytes, 1)
        if b.copy:
            _copy_in(b.dest, b.dsel, b.offsets, raw, ck.arrays[b.dest.item.path].dtype)

    in_flight: Window[_Block] = Window(window, settle)
    released = 0
    for dest, in_place in tiers:
        item = dest.item
        target = ts.array(_view(dest), copy=False) if in_place else None
        store = stores[item.path]
        itemsize = _dtypes.itemsize(ck.arrays[item.path].dtype)
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, ck.arrays[item.path].chunking):
            box = tuple(slice(o, o + n) for o, n in zip(off, ln))
            src = store[box] if box else store
            dsel = tuple(slice(o - so, o - so + n) for o, so, n in zip(off, item.storage_offsets, ln))
            if target is not None:  # TensorStore's decode buffers are bounded by the same window
                fut = (target[dsel] if dsel else target).write(src)
            else:
                fut = src.read()
            nbytes = math.prod(ln) * itemsize
            in_flight.add(_Block(fut, dest, off, dsel, target is None, nbytes), nbytes)
            if in_flight.settled - released >= window:
                released = in_flight.settled
                release_free_memory()
    in_flight.drain()
    release_free_memory()


def _copy_in(dest: Dest, dsel: tuple[slice, ...], offsets: tuple[int, ...], raw: np.ndarray, stored: str) -> None:
    """Cast or copy a block read in the stored dtype into its place in the destination."""
    if dest.cast is not None:  # before any of the block is written
        dest.cast.check(raw, offsets)
    if isinstance(dest.tensor, np.ndarray):
        if stored == "complex32":  # float16 (re, im) pairs
            raw = raw[..., 0].astype(np.complex64) + 1j * raw[..., 1].astype(np.complex64)
        dest.tensor[dsel if dsel else ...] = raw
        return
    src = _dtypes.numpy_to_tensor(raw, stored)
    with torch.no_grad():  # targets may be parameters that require grad
        (dest.tensor[dsel] if dsel else dest.tensor).copy_(src)


@verb("tsckpt.restore")
def restore(
    directory: Directory,
    target: Any = None,
    *,
    strict: bool = True,
    inplace: bool = False,
    as_saved: bool = False,
    group: Any = None,
    timeout: datetime.timedelta | None = None,
    progress: bool | None = None,
    max_inflight_bytes: int = READ_WINDOW_BYTES,
    casting: str = "same_kind",
    format: str | None = None,  # noqa: A002 - named as convert's --from names it
    allow_pickle: bool = False,
) -> Any:
    """Restore a checkpoint, optionally shaped like ``target``.

    With ``target=None`` the saved tree comes back with numpy arrays (torch
    complex32 as a torch tensor, which numpy cannot hold) and plain values, so
    reading needs no torch device; ``as_saved=True`` gives each array back as
    the kind it was saved as (torch tensors on the CPU, numpy arrays, numpy
    scalars). Otherwise the result has the target's structure and, leaf by leaf,
    its type, dtype (cast from the stored dtype) and device; ``inplace=True``
    copies straight into the target's tensors and arrays so memory does not double.
    A target on the meta device (a tensor, or a DTensor or ShardedArray whose local
    tensor is) has no memory to write: it gets a new tensor on the CPU (a DTensor's
    local shard on its mesh's device type), read region by region straight into it,
    which is in the result even with ``inplace=True`` (the target stays on meta), so
    ``model.load_state_dict(out, assign=True)`` loads a meta model. An in-place
    target that cannot be written (a storage freed with ``resize_(0)``, memory mapped
    read-only) raises :class:`LeafTypeError` naming the leaf before anything is read.
    A target whose leaves differ from the checkpoint's raises
    :class:`StructureMismatchError` (saying so when the names are the same shifted
    by a prefix, such as ``model/``); ``strict=False`` restores the leaves both have
    instead, keeps the target's values for the others and lists them in a
    :class:`RestoreWarning`, and still raises when the two have no leaf in common.

    Under torch.distributed every rank of ``group`` (default: the default group)
    calls restore; ``timeout`` (a :class:`datetime.timedelta`, default 10 minutes)
    bounds every wait on other ranks. DTensor and ShardedArray targets receive
    just their local region, whatever layout and world size saved the
    checkpoint; each rank reads only the chunks overlapping that region.

    ``progress`` shows a bar of bytes read on rank 0 (default: when stderr is a
    terminal); each rank logs bytes, reads and throughput at the end.
    ``max_inflight_bytes`` bounds the chunk reads in flight, which bounds the
    memory a restore needs beyond its result (smaller: less memory, less overlap).

    ``casting`` is numpy's rule for a target of another dtype than the stored one
    ("no", "equiv", "safe", "same_kind", "unsafe"); a cast it refuses raises
    :class:`LeafTypeError` before anything is read. With "same_kind" the values read
    are checked: one that overflows the target or loses integer bits raises
    :class:`LossyCastError` (a float's rounding to a lower precision is not a loss);
    with "unsafe" such losses give a :class:`RestoreWarning`.

    ``directory`` may also hold another library's checkpoint, detected from its files
    (``format`` names it instead): a safetensors file or Hugging Face directory
    (``model.safetensors``, or shards and ``model.safetensors.index.json``), a
    ``torch.save`` file, a torch.distributed.checkpoint directory (its metadata is a
    pickle: read only with ``allow_pickle=True``) or an Orbax checkpoint. Each rank reads
    only the byte ranges of the regions it restores, so Hugging Face weights load straight
    into DTensor (FSDP2) targets. A target leaf the checkpoint lacks but whose memory is
    that of a leaf it has (a weight tied to another, which transformers leaves out of its
    files) is restored with it, not reported missing; only leaves that really share memory
    are tied (meta tensors: the same storage), never two freed or empty tensors.
    """
    options = RestoreOptions.of(locals())  # a bad option raises here, before any work
    if is_whole_state(target):  # tsckpt.torch.TrainState: restores itself, in place
        return target.__tsckpt_restore__(directory, options)
    codec_setting()  # so does a bad TSCKPT_CODEC
    coord = coordinator_for(group, timeout)

    def run() -> Any:
        with collector_paused():
            return read()

    def read() -> Any:
        ck = open_checkpoint(directory, format=format, allow_pickle=allow_pickle)
        ck.check_links(deferred=True)
        with unchanged(ck), Progress("restore", ck.location, show=progress, rank=coord.rank) as bar:
            reader = _Reader(bar, max_inflight_bytes, casting)
            if target is None:
                return _restore_saved(ck, as_saved, reader)
            expanded = expand(target, rank=coord.rank)  # stateful objects: their state is the target
            return expanded.load(_restore_into(ck, expanded.tree, strict, inplace, reader))

    if coord.world_size == 1:
        return run()
    # every rank reads its own regions; the shared outcome makes all ranks raise together
    return phase(coord, "restore", run)


@dataclasses.dataclass(frozen=True)
class _Reader:
    """How a restore reads: its progress, the bytes of reads kept in flight, and the casting
    allowed into targets of another dtype."""

    progress: Progress
    window: int
    casting: str = "same_kind"


def tied_to_stored(ck: Checkpoint, paths: list[str], leaves: list[Any]) -> dict[int, int]:
    """Target leaves the checkpoint lacks that view the same memory as a target leaf it stores
    as an array (a weight tied to another, which Hugging Face files leave out): index of each
    -> index of the stored leaf it shares memory with. Restoring the stored one restores both."""
    missing = [i for i, path in enumerate(paths) if not ck.is_array(path) and path not in ck.values]
    if not missing:  # the usual case: no leaf's memory needs to be looked up
        return {}
    stored: dict[Any, int] = {}
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        if ck.is_array(path):
            key = memory(leaf)
            if key is not None:
                stored.setdefault(key, i)
    ties: dict[int, int] = {}
    for i in missing:
        key = memory(leaves[i])
        if key is not None and key in stored:
            ties[i] = stored[key]
    return ties


def _fill(
    ck: Checkpoint, paths: list[str], leaves: list[Any], inplace: bool, reader: _Reader, ties: dict[int, int] | None = None
) -> list[Any]:
    """Read the stored leaves into the target ``leaves``; returns the restored leaves in order.
    ``ties`` (:func:`tied_to_stored`): a leaf the checkpoint lacks is the restored leaf it is tied
    to (in place: the target's own leaf, whose memory was filled)."""
    out: list[Any] = []
    dests: list[tuple[int, Dest]] = []
    finishing: list[tuple[int, Dest]] = []  # leaves whose result is made after the read
    filled: set[tuple[Any, ...]] = set()  # in place: (stored path, region, memory) already scheduled
    made: dict[tuple[str, Any], int] = {}  # (stored path, memory) of a meta target -> the leaf first made for it
    same_as: dict[int, int] = {}  # a meta target tied to one made already -> that one
    value_casts: list[Any] = []  # the casts of plain values into array targets
    check_backed(ck, sorted({ck.aliases.get(p, p) for p in paths} & ck.arrays.keys()))  # before allocating any
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        path = ck.aliases.get(path, path)  # tied leaves are stored once, under one path
        if path in ck.arrays and materialises(leaf):  # tied meta targets get one new tensor
            key = memory(leaf)
            first = i if key is None else made.setdefault((path, key), i)
            if first != i:
                same_as[i] = first
                out.append(None)
                continue
        if path in ck.values:
            kind = kind_of(leaf)  # an array target of a plain value: its kind takes the value or refuses it
            value, cast = (ck.values[path], None) if kind is None else kind.from_value(
                path, ck.values[path], leaf, inplace, reader.casting
            )
            out.append(value)
            value_casts.append(cast)
        elif path in ck.arrays:
            dest = destination(ck.arrays[path], path, leaf, inplace, casting=reader.casting)
            if dest.finish is not None:
                finishing.append((i, dest))
            for part in dest.parts or (dest,):
                key = memory(part.tensor) if inplace else None
                if key is not None:  # a target whose tied leaves share memory reads once
                    mem = (path, part.item.storage_offsets, part.item.lengths, key)
                    if mem in filled:
                        continue
                    filled.add(mem)
                dests.append((i, part))
            out.append(dest.result)
        else:
            out.append(leaf)
    if inplace:
        _refuse_read_only(paths, dests)
    with cast_warnings_off(any(d.cast is not None for _, d in dests)):
        read_into(ck, [d for _, d in dests], reader.progress, window=reader.window)
    warn_lost_values([d.cast for _, d in dests] + value_casts)
    for i, dest in finishing:
        out[i] = dest.restored()
    for i, j in same_as.items():
        out[i] = out[j]
    for i, j in (ties or {}).items():
        out[i] = leaves[i] if inplace and not materialises(leaves[i]) else out[j]
    return out


def _host_span(t: Any) -> tuple[int, int] | None:
    """(address, bytes) of the host memory a destination's elements lie in, where it may be
    mapped read-only; None for device memory and for memory its library allocated (a torch
    storage its allocator made, which is resizable; a numpy array owning its data), which is
    writable: checking only the others keeps this to a microsecond a leaf."""
    if isinstance(t, np.ndarray):
        if t.size == 0 or t.flags.owndata:
            return None
        base = t.__array_interface__["data"][0]
        lo = sum((n - 1) * s for n, s in zip(t.shape, t.strides) if s < 0)
        hi = sum((n - 1) * s for n, s in zip(t.shape, t.strides) if s > 0) + t.itemsize
        return (base + lo, hi - lo)
    if not isinstance(t, torch.Tensor) or not t.is_cpu or t.untyped_storage().resizable() or t.numel() == 0:
        return None
    return (t.data_ptr(), (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size())


def _refuse_read_only(paths: list[str], dests: list[tuple[int, Dest]]) -> None:
    """Refuse, before anything is written, in-place targets in memory mapped read-only (a file
    mapped for reading): writing there kills the process (SIGSEGV). Neither torch nor numpy's
    ``writeable`` flag tells (torch.from_numpy of a read-only array, t.numpy() of such a tensor)."""
    spans = [(i, _host_span(d.tensor)) for i, d in dests]
    host = [(i, s) for i, s in spans if s is not None]
    bad = unwritable([s for _, s in host])
    if bad:
        i = host[bad[0]][0]
        others = sorted({paths[host[b][0]] for b in bad[1:]} - {paths[i]})
        also = f" (and {count_and_list(others)})" if others else ""
        raise LeafTypeError(
            f"'{paths[i]}'{also}: the target's memory is read-only (mapped from a file for reading, or a read-only "
            "buffer), so an in-place restore cannot write it; give writable memory (e.g. tensor.clone() or "
            "np.array(a)), or restore with inplace=False to get new arrays"
        )


def _restore_into(ck: Checkpoint, target: Any, strict: bool, inplace: bool, reader: _Reader) -> Any:
    flat = flatten(target)
    ties = tied_to_stored(ck, flat.paths, flat.leaves)
    _check_structure(ck, [p for i, p in enumerate(flat.paths) if i not in ties], strict)
    return unflatten(flat.spec, _fill(ck, flat.paths, flat.leaves, inplace, reader, ties))


def saved_kind_target(rec: ArrayRecord, as_saved: bool) -> Any:
    """The target leaf that restores ``rec`` as numpy, or (``as_saved``) as the kind it was saved as."""
    if rec.kind == "numpy_scalar":
        return _dtypes.numpy_dtype(rec.dtype).type(0)
    if rec.dtype == "complex32" or (as_saved and rec.kind == "torch"):
        return ArraySpec(rec.shape, _dtypes.torch_dtype(rec.dtype))
    return ArraySpec(rec.shape, None)


def _restore_saved(ck: Checkpoint, as_saved: bool, reader: _Reader) -> Any:
    stored = [p for p in ck.leaves if p not in ck.aliases]
    targets = [ck.values[p] if p in ck.values else saved_kind_target(ck.arrays[p], as_saved) for p in stored]
    by_path = dict(zip(stored, _fill(ck, stored, targets, False, reader)))
    # a tied leaf is the very object of its stored leaf, as when it was saved
    return ck.build([by_path[ck.aliases.get(p, p)] for p in ck.leaves])
