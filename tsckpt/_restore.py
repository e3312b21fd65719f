"""restore(): match a target tree to a checkpoint, plan the reads, fill the leaves."""

from __future__ import annotations

import collections
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

from . import _dtypes, _store
from ._arrays import chunk_key, stored_node_problem
from ._coord import phase
from ._dist import coordinator_for
from ._codec.encode import LITTLE_ENDIAN, decode_chunk
from ._errors import LeafTypeError, StructureMismatchError, count_and_list
from ._format import ROOT_KEY, ArrayRecord
from ._leaves import destination, kind_of, memory
from ._memory import release_free_memory
from ._chunking import shard_boxes
from ._options import READ_WINDOW_BYTES, RestoreOptions, verb
from ._progress import Progress
from ._backing import check_backed
from ._checkpoint import Checkpoint
from ._formats.sources import open_checkpoint
from ._reader import LazyArray
from ._readerrors import corrupt_error
from ._codec.shardread import read_sharded
from ._store import Directory
from ._types import ArraySpec, Dest
from .tree import flatten, unflatten


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
    if strict:
        raise StructureMismatchError(msg + ". Pass strict=False to restore only the leaves both have.")
    warnings.warn(
        msg + ". strict=False: restored the common leaves, kept the target's values for the rest.",
        RestoreWarning,
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """stacklevel (for a warn() in the caller of this function) of the first frame outside tsckpt."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(pkg):
        frame, level = frame.f_back, level + 1
    return level


def warn_lost_values(checks: list[Any]) -> None:
    """One warning per leaf that casting="unsafe" changed values of (see ``CastCheck``)."""
    for check in checks:
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


def _stored_offsets(dest: Dest, dsel: tuple[slice, ...]) -> list[int]:
    """Where in the stored array the block written to ``dsel`` of the destination starts."""
    item = dest.item
    return [s.start - d + o for s, d, o in zip(dsel, item.dest_offsets, item.storage_offsets)]


def _direct_view(dest: Dest, stored: str) -> np.ndarray | None:
    """The destination memory as a writable numpy view in the stored dtype, when
    TensorStore can decode chunks straight into it (no buffer, no extra copy)."""
    t = dest.tensor
    if stored == "complex32":
        return None
    if isinstance(t, np.ndarray):
        return t if t.dtype == _dtypes.numpy_dtype(stored) and t.flags.writeable else None
    if t.device.type != "cpu" or _dtypes.torch_name(t.dtype) != stored or t.is_conj() or t.is_neg():
        return None
    return _dtypes.tensor_to_numpy(t)


def _open_all(ck: Checkpoint, paths: list[str]) -> dict[str, Any]:
    """Open the arrays concurrently (each open reads and checks its zarr.json)."""
    arrays = {p: LazyArray(ck, p) for p in dict.fromkeys(paths)}
    futures = {p: arr.open_future() for p, arr in arrays.items()}
    for p, fut in futures.items():
        arrays[p].set_store(fut)
    return {p: arr.tensorstore() for p, arr in arrays.items()}


def _single_chunk(rec: ArrayRecord) -> bool:
    """Stored as one plain chunk (no sharding codec): what save encodes itself."""
    return (
        rec.chunking.chunk_shape is None
        and rec.dtype != "complex32"
        and math.prod(rec.shape) > 0
        and all(g >= n for g, n in zip(rec.chunking.shard_shape, rec.shape))
    )


def _read_small(ck: Checkpoint, dests: list[Dest], progress: Progress | None, window: int) -> list[Dest]:
    """Read the arrays stored as one plain chunk into CPU memory of their dtype with two
    kvstore reads each: the array's zarr.json, checked against the root record as
    TensorStore would, and its chunk, checked by crc32c. Opening a TensorStore array
    per leaf dominated restores of thousands of small leaves.

    Returns the destinations left for TensorStore: every other kind, and any whose node
    or chunk is not exactly as expected, so that the general path reports the damage.
    """
    if ck.foreign or not LITTLE_ENDIAN:
        return dests
    rest: list[Dest] = []
    pending: collections.deque[tuple[Dest, np.ndarray, int, Any, Any]] = collections.deque()
    in_flight = 0
    kv = ts.KvStore.open(ck.data(), context=_store.CONTEXT).result()

    def settle() -> int:
        dest, view, nbytes, node_read, chunk_read = pending.popleft()
        rec = ck.arrays[dest.item.path]
        try:
            node, chunk = node_read.result(), chunk_read.result()
            ok = node.state == "value" and chunk.state == "value" and stored_node_problem(node.value, rec) is None
        except ValueError:  # unreadable or not JSON: the general path says which
            ok = False
        data = decode_chunk(chunk.value, view.dtype, rec.shape) if ok else None
        if data is None:
            rest.append(dest)
            return nbytes
        item = dest.item
        box = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
        view[tuple(slice(o, o + n) for o, n in zip(item.dest_offsets, item.lengths))] = data[box]
        if progress is not None:
            progress.update(nbytes, 1)
        return nbytes

    for dest in dests:
        rec = ck.arrays[dest.item.path]
        view = _direct_view(dest, rec.dtype) if _single_chunk(rec) else None
        if view is None:
            rest.append(dest)
            continue
        nbytes = math.prod(rec.shape) * _dtypes.itemsize(rec.dtype)
        reads = kv.read(f"{rec.path}/{ROOT_KEY}"), kv.read(chunk_key(rec, (0,) * len(rec.shape)))
        pending.append((dest, view, nbytes, *reads))
        in_flight += nbytes
        while in_flight > window and pending:
            in_flight -= settle()
    while pending:
        settle()
    return rest


def read_into(
    ck: Checkpoint, dests: list[Dest], progress: Progress | None = None, *, window: int = READ_WINDOW_BYTES
) -> None:
    """Execute read items shard by shard.

    Where the destination is CPU memory of the stored dtype, small arrays are
    decoded here (:func:`_read_small`), sharded arrays of a local plain
    checkpoint are read by :func:`read_sharded`, and TensorStore writes the
    others' decoded chunks into it directly. Otherwise (a cast, a GPU tensor) each
    shard is read into a buffer and copied; a bounded window of such reads is
    in flight, which bounds the extra memory a restore needs; after each
    window's worth of reads the decode buffers' freed pages are given back.
    """
    pending: collections.deque[tuple[Any, Dest, tuple[slice, ...], np.ndarray | None, int]] = collections.deque()
    in_flight = drained = 0
    if progress is not None:
        progress.set_total(sum(math.prod(d.item.lengths) * _dtypes.itemsize(ck.arrays[d.item.path].dtype) for d in dests))
    dests = _read_small(ck, dests, progress, window)
    dests = read_sharded(ck, dests, progress, window, _direct_view)
    stores = _open_all(ck, [d.item.path for d in dests])

    def drain_one() -> int:
        fut, dest, dsel, direct, nbytes = pending.popleft()
        stored = ck.arrays[dest.item.path].dtype
        try:
            raw = fut.result()
        except ValueError as e:
            raise corrupt_error(ck, dest.item.path, e) from e
        if progress is not None:
            progress.update(nbytes, 1)
        if direct is not None:
            return nbytes
        if dest.cast is not None:  # before any of the block is written
            dest.cast.check(raw, _stored_offsets(dest, dsel))
        if isinstance(dest.tensor, np.ndarray):
            if stored == "complex32":  # float16 (re, im) pairs
                raw = raw[..., 0].astype(np.complex64) + 1j * raw[..., 1].astype(np.complex64)
            dest.tensor[dsel if dsel else ...] = raw
            return nbytes
        src = _dtypes.numpy_to_tensor(raw, stored)
        with torch.no_grad():  # targets may be parameters that require grad
            (dest.tensor[dsel] if dsel else dest.tensor).copy_(src)
        return nbytes

    for dest in dests:
        item = dest.item
        store = stores[item.path]
        rec = ck.arrays[item.path]
        view = _direct_view(dest, rec.dtype)
        target = ts.array(view, copy=False) if view is not None else None
        itemsize = _dtypes.itemsize(rec.dtype)
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.chunking):
            box = tuple(slice(o, o + n) for o, n in zip(off, ln))
            src = store[box] if box else store
            dsel = tuple(
                slice(d + o - so, d + o - so + n)
                for d, o, so, n in zip(item.dest_offsets, off, item.storage_offsets, ln)
            )
            nbytes = int(np.prod(ln)) * itemsize
            if target is not None:  # TensorStore's decode buffers are bounded by the same window
                pending.append(((target[dsel] if dsel else target).write(src), dest, dsel, view, nbytes))
            else:
                pending.append((src.read(), dest, dsel, None, nbytes))
            in_flight += nbytes
            while in_flight > window and pending:
                n = drain_one()
                in_flight -= n
                drained += n
                if drained >= window:
                    drained = 0
                    release_free_memory()
    while pending:
        drain_one()
    release_free_memory()


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
) -> Any:
    """Restore a checkpoint, optionally shaped like ``target``.

    With ``target=None`` the saved tree comes back with numpy arrays (torch
    complex32 as a torch tensor, which numpy cannot hold) and plain values, so
    reading needs no torch device; ``as_saved=True`` gives each array back as
    the kind it was saved as (torch tensors on the CPU, numpy arrays, numpy
    scalars). Otherwise the result has the target's structure and, leaf by leaf,
    its type, dtype (cast from the stored dtype) and device; ``inplace=True``
    copies straight into the target's tensors and arrays so memory does not double.
    A target whose leaves differ from the checkpoint's raises
    :class:`StructureMismatchError`; ``strict=False`` restores the leaves both have
    instead, keeps the target's values for the others and lists them in a
    :class:`RestoreWarning`.

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
    """
    RestoreOptions.of(locals())  # a bad option raises here, before any work
    coord = coordinator_for(group, timeout)

    def run() -> Any:
        ck = open_checkpoint(directory)
        ck.check_links()
        with Progress("restore", ck.location, show=progress, rank=coord.rank) as bar:
            reader = _Reader(bar, max_inflight_bytes, casting)
            if target is None:
                return _restore_saved(ck, as_saved, reader)
            return _restore_into(ck, target, strict, inplace, reader)

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


def _fill(ck: Checkpoint, paths: list[str], leaves: list[Any], inplace: bool, reader: _Reader) -> list[Any]:
    """Read the stored leaves into the target ``leaves``; returns the restored leaves in order."""
    out: list[Any] = []
    dests: list[tuple[int, Dest]] = []
    filled: set[tuple[Any, ...]] = set()  # in place: (stored path, region, memory) already scheduled
    check_backed(ck, sorted({ck.aliases.get(p, p) for p in paths} & ck.arrays.keys()))  # before allocating any
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        path = ck.aliases.get(path, path)  # tied leaves are stored once, under one path
        if path in ck.values:
            if kind_of(leaf) is not None:
                raise LeafTypeError(
                    f"'{path}': the checkpoint stores a plain value ({type(ck.values[path]).__name__}) but the "
                    f"target leaf is {type(leaf).__name__}"
                )
            out.append(ck.values[path])
        elif path in ck.arrays:
            dest = destination(ck.arrays[path], path, leaf, inplace, casting=reader.casting)
            mem = (path, dest.item.storage_offsets, dest.item.lengths, memory(dest.tensor))
            if not inplace or mem not in filled:  # a target whose tied leaves share memory reads once
                filled.add(mem)
                dests.append((i, dest))
            out.append(dest.result)
        else:
            out.append(leaf)
    with cast_warnings_off(any(d.cast is not None for _, d in dests)):
        read_into(ck, [d for _, d in dests], reader.progress, window=reader.window)
    warn_lost_values([d.cast for _, d in dests])
    for i, dest in dests:
        if dest.finish is not None:
            out[i] = dest.restored()
    return out


def _restore_into(ck: Checkpoint, target: Any, strict: bool, inplace: bool, reader: _Reader) -> Any:
    flat = flatten(target)
    _check_structure(ck, flat.paths, strict)
    return unflatten(flat.spec, _fill(ck, flat.paths, flat.leaves, inplace, reader))


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
