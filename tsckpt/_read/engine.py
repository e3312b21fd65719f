"""The read engine of a restore: destinations filled from a checkpoint of any format.

:func:`read_into` plans each destination's reader (:func:`_plan_reads`: the own codec's
one-chunk and shard readers for a local plain checkpoint, another format's lazy sources,
TensorStore decoding in place or into a buffer for the rest), then runs the tiers within
the restore's window of bytes in flight; destinations in device memory are read through
page-locked host memory piece by piece (:func:`_read_device`). What to read, and into
what, is the verb's (:mod:`.restore`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from .._base import dtypes as _dtypes
from .._base.lazytorch import mark_written
from .._base.types import Box, Dest, ReadItem, box_slices
from .._codec.chunkread import read_chunks
from .._codec.route import Place, Route, place, route
from .._codec.shardread import READ_THREADS, read_sharded
from .._formats import lazy
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.chunking import shard_boxes
from .._ondisk.readfaults import corrupt_error
from .._options import READ_WINDOW_BYTES
from .._runtime import devicecopy as _devicecopy
from .._runtime.memory import release_free_memory
from .._runtime.progress import Progress
from .._runtime.window import Window
from .reader import LazyArray

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch


def viewable(dest: Dest, stored: str) -> bool:
    """Whether the destination is memory that chunks can be decoded straight into (no
    buffer, no extra copy): CPU memory of the stored dtype, writable; not for a cast, a
    GPU tensor, or a conjugated or negated view."""
    t = dest.tensor
    if isinstance(t, np.ndarray):
        return stored != "complex32" and t.dtype == _dtypes.numpy_dtype(stored) and t.flags.writeable
    return t.device.type == "cpu" and _dtypes.torch_name(t.dtype) == stored and not t.is_conj() and not t.is_neg()


def _view(dest: Dest) -> np.ndarray:
    """The memory of a :func:`viewable` destination as a writable numpy view in the stored
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
    destination is :func:`viewable`, else TensorStore."""
    if ck.lazy:  # another format's files: no zarr arrays to route
        return _ReadPlan(Place(False, None, f"arrays of a {ck.format} checkpoint"), (), (), (), (), tuple(dests))
    where = place(ck.data(), ck.layout, foreign=ck.foreign)
    tiers: dict[Route, list[Dest]] = {r: [] for r in Route}
    copied: list[Dest] = []
    for dest in dests:
        rec = ck.arrays[dest.item.path]
        if viewable(dest, rec.dtype):
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
    in flight, which bounds the extra memory a restore needs. Every torch destination is
    marked written (:func:`mark_written`), even after a failure: its version counter moves.
    """
    if progress is not None:
        progress.set_total(sum(math.prod(d.item.lengths) * _dtypes.itemsize(ck.arrays[d.item.path].dtype) for d in dests))
    host: list[Dest] = []
    device: list[Dest] = []
    for d in dests:
        (device if _devicecopy.on_device(d.tensor) else host).append(d)
    try:
        if device:
            _read_device(ck, device, progress, window)
        _read_host(ck, host, progress, window)
    finally:
        mark_written(d.tensor for d in dests)


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
                dsel = box_slices(off, ln, dest.item.storage_offsets)
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
        view = _view(dest) if viewable(dest, rec.dtype) else None
        itemsize = _dtypes.itemsize(rec.dtype)
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.chunking):
            box = box_slices(off, ln)
            dsel = box_slices(off, ln, item.storage_offsets)
            if view is not None:
                lazy.fill(src, box, view[dsel] if dsel else view)
            else:
                _copy_in(dest, dsel, off, lazy.read(src, box), rec.dtype)
            if progress is not None:
                progress.update(math.prod(ln) * itemsize, 1)


@dataclasses.dataclass(frozen=True)
class _Fill:
    """Where part of a block read into a buffer goes: a destination, cast or copied in."""

    dest: Dest
    offsets: tuple[int, ...]  # where the part starts in the stored array
    dsel: tuple[slice, ...]  # where it goes in the destination
    within: tuple[slice, ...]  # where it lies in the block read


@dataclasses.dataclass(frozen=True)
class _Block:
    """One read of a stored array's region, started: decoded straight into a destination
    (no fills), or into a buffer whose parts are then cast or copied into their fills."""

    future: Any
    path: str
    fills: tuple[_Fill, ...]
    nbytes: int  # of the destinations' elements it gives


def _cell(rec: Any, off: tuple[int, ...], ln: tuple[int, ...]) -> tuple[int, ...] | None:
    """The stored chunk (the unit TensorStore decodes whole) that holds all of the block
    (``off``, ``ln``), by its grid position; None when the block spans several or is empty."""
    grid = rec.chunking.chunk_shape or rec.chunking.shard_shape
    if not grid or 0 in ln:
        return None
    first = tuple(o // g for o, g in zip(off, grid))
    return first if first == tuple((o + n - 1) // g for o, n, g in zip(off, ln, grid)) else None


def _shared_chunks(ck: Checkpoint, parts: list[tuple[Dest, bool, Box]]) -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """The stored chunks that blocks of several destinations lie in (the device slices of
    one jax.Array split within a chunk): chunk -> the indices of those blocks in ``parts``.
    Such a chunk is read once, its region for all of them, not decoded once per slice."""
    by_cell: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, (dest, _, (off, ln)) in enumerate(parts):
        cell = _cell(ck.arrays[dest.item.path], off, ln)
        if cell is not None:
            by_cell.setdefault((dest.item.path, cell), []).append(i)
    return {key: members for key, members in by_cell.items() if len(members) > 1}


def _read_tensorstore(
    ck: Checkpoint, into: list[Dest], copied: tuple[Dest, ...], progress: Progress | None, window: int
) -> None:
    """The TensorStore tiers, block by block (each destination's region cut at the stored
    chunks): decode straight into ``into``'s memory, and read blocks of ``copied`` into
    buffers that are then cast or copied in. A chunk that blocks of several destinations
    lie in is read once, into a buffer of their region of it, and copied into each: every
    chunk is decoded at most once. After each window's worth of reads the decode buffers'
    freed pages are given back."""
    stores = _open_all(ck, [d.item.path for d in (*into, *copied)])
    parts = [
        (dest, in_place, box)
        for dest, in_place in [(dest, True) for dest in into] + [(dest, False) for dest in copied]
        for box in shard_boxes(dest.item.storage_offsets, dest.item.lengths, ck.arrays[dest.item.path].chunking)
    ]
    shared = _shared_chunks(ck, parts)
    joined = {members[0]: members for members in shared.values()}
    skipped = {i for members in shared.values() for i in members[1:]}

    def settle(b: _Block) -> None:
        try:
            raw = b.future.result()
        except ValueError as e:
            raise corrupt_error(ck, b.path, e) from e
        if progress is not None:
            progress.update(b.nbytes, 1)
        for f in b.fills:
            _copy_in(f.dest, f.dsel, f.offsets, raw[f.within] if f.within else raw, ck.arrays[b.path].dtype)

    in_flight: Window[_Block] = Window(window, settle)
    released = 0
    current: tuple[Any, Any] = (None, None)  # the destination being read in place, its memory as a TensorStore array
    for i, (dest, in_place, (off, ln)) in enumerate(parts):
        if i in skipped:  # read with the first block of its chunk
            continue
        item = dest.item
        store = stores[item.path]
        itemsize = _dtypes.itemsize(ck.arrays[item.path].dtype)
        nbytes = math.prod(ln) * itemsize
        if i in joined:
            members = [parts[j] for j in joined[i]]
            lo = tuple(min(b[0][d] for _, _, b in members) for d in range(len(off)))
            hi = tuple(max(b[0][d] + b[1][d] for _, _, b in members) for d in range(len(off)))
            fills = tuple(
                _Fill(m, mo, box_slices(mo, mn, m.item.storage_offsets), box_slices(mo, mn, lo))
                for m, _, (mo, mn) in members
            )
            read = math.prod(h - l for l, h in zip(lo, hi)) * itemsize
            fut = store[tuple(slice(l, h) for l, h in zip(lo, hi))].read()
            block = _Block(fut, item.path, fills, sum(math.prod(mn) for _, _, (_, mn) in members) * itemsize)
            in_flight.add(block, read)
        else:
            box = box_slices(off, ln)
            src = store[box] if box else store
            dsel = box_slices(off, ln, item.storage_offsets)
            if in_place:  # TensorStore's decode buffers are bounded by the same window
                if current[0] is not dest:  # its blocks come one after another
                    current = (dest, ts.array(_view(dest), copy=False))
                target = current[1]
                block = _Block((target[dsel] if dsel else target).write(src), item.path, (), nbytes)
            else:
                block = _Block(src.read(), item.path, (_Fill(dest, off, dsel, ()),), nbytes)
            in_flight.add(block, nbytes)
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
