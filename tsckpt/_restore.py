"""restore(): match a target tree to a checkpoint, plan the reads, fill the leaves."""

from __future__ import annotations

import collections
import datetime
import dataclasses
import os
import sys
import warnings
from typing import Any

import numpy as np
import tensorstore as ts
import torch

from . import _dtypes
from ._coord import phase
from ._dist import coordinator_for
from ._errors import LeafTypeError, ShapeMismatchError, StructureMismatchError
from ._leaves import ArraySpec, ShardedArray
from ._plan import ReadItem, plan_read, shard_boxes
from ._reader import Checkpoint, LazyArray, corrupt_error, load
from ._store import Directory
from .tree import flatten, unflatten

# Bytes read from storage but not yet copied into their destination.
READ_WINDOW_BYTES = 64 << 20


class RestoreWarning(UserWarning):
    """strict=False skipped leaves; the message lists them."""


@dataclasses.dataclass
class _Dest:
    """Where one target leaf's data goes, and what restore returns for it."""

    item: ReadItem
    tensor: torch.Tensor | np.ndarray  # the destination memory, in the target's dtype
    result: Any


def _list(paths: list[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:5])
    return f"{len(paths)} ({shown}{', ...' if len(paths) > 5 else ''})"


def _check_structure(ck: Checkpoint, paths: list[str], strict: bool) -> None:
    stored = set(ck.leaves)
    wanted = set(paths)
    missing = sorted(wanted - stored)
    unexpected = sorted(stored - wanted)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_list(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the target: {_list(unexpected)}")
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


def _writable(arr: np.ndarray, path: str) -> np.ndarray:
    """A numpy destination; numpy assignment casts, so any numeric dtype will do."""
    if not arr.flags.writeable:
        raise LeafTypeError(f"'{path}': target numpy array is read-only; pass a writable array or inplace=False")
    return arr


def _check_shape(path: str, want: tuple[int, ...], stored: tuple[int, ...]) -> None:
    if tuple(want) != tuple(stored):
        raise ShapeMismatchError(
            f"'{path}': target shape {list(want)} but the checkpoint stores {list(stored)}; resize the target, "
            "or read a slice with tsckpt.open(...)[path][...] and copy it in yourself"
        )


def _check_cast(path: str, stored: str, target: Any) -> None:
    """``target``: a torch or numpy dtype."""
    is_complex = target.is_complex if isinstance(target, torch.dtype) else np.dtype(target).kind == "c"
    if stored.startswith("complex") and not is_complex:
        raise LeafTypeError(
            f"'{path}': stored dtype {stored} is complex but the target is {target}; casting would drop the "
            "imaginary part. Use a complex target"
        )


def _destination(ck: Checkpoint, path: str, leaf: Any, inplace: bool) -> _Dest:
    rec = ck.arrays[path]
    from ._dtensor import dtensor_destination, is_dtensor

    if is_dtensor(leaf):
        return dtensor_destination(rec, path, leaf, inplace)
    whole = plan_read(path, (0,) * len(rec.shape), rec.shape)
    if isinstance(leaf, ShardedArray):
        local = leaf.local
        _check_shape(path, leaf.global_shape, rec.shape)
        item = ReadItem(path, leaf.offsets, tuple(local.shape), (0,) * len(rec.shape))
        if isinstance(local, torch.Tensor):
            _check_cast(path, rec.dtype, local.dtype)
            t = local if inplace else torch.empty_like(local)
            return _Dest(item, t, ShardedArray(t, leaf.global_shape, leaf.offsets))
        _check_cast(path, rec.dtype, local.dtype)
        a = local if inplace else np.empty_like(local)
        return _Dest(item, _writable(a, path), ShardedArray(a, leaf.global_shape, leaf.offsets))
    if isinstance(leaf, torch.Tensor):
        _check_shape(path, tuple(leaf.shape), rec.shape)
        _check_cast(path, rec.dtype, leaf.dtype)
        t = leaf if inplace else torch.empty(rec.shape, dtype=leaf.dtype, device=leaf.device)
        return _Dest(whole, t, t)
    if isinstance(leaf, (np.ndarray, np.generic)):
        _check_shape(path, np.shape(leaf), rec.shape)
        _check_cast(path, rec.dtype, leaf.dtype)
        if isinstance(leaf, np.generic) or not inplace:
            a = np.empty(rec.shape, dtype=leaf.dtype)
        else:
            a = leaf
        return _Dest(whole, _writable(a, path), a)  # 0-d: made a scalar after the read, in restore()
    if isinstance(leaf, ArraySpec):
        if leaf.shape is not None:
            _check_shape(path, tuple(leaf.shape), rec.shape)
        if isinstance(leaf.dtype, torch.dtype):
            _check_cast(path, rec.dtype, leaf.dtype)
            t = torch.empty(rec.shape, dtype=leaf.dtype, device=leaf.device or "cpu")
            return _Dest(whole, t, t)
        dtype = np.dtype(leaf.dtype) if leaf.dtype is not None else _dtypes.numpy_dtype(rec.dtype)
        _check_cast(path, rec.dtype, dtype)
        a = np.empty(rec.shape, dtype=dtype)
        return _Dest(whole, _writable(a, path), a)
    raise LeafTypeError(
        f"'{path}': the checkpoint stores an array {rec.dtype}{list(rec.shape)} but the target leaf is "
        f"{type(leaf).__name__}; use a tensor, numpy array, tsckpt.ArraySpec or ShardedArray target"
    )


def _direct_view(dest: _Dest, stored: str) -> np.ndarray | None:
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
    return {p: arr._tensorstore() for p, arr in arrays.items()}


def read_into(ck: Checkpoint, dests: list[_Dest]) -> None:
    """Execute read items shard by shard.

    Where the destination is CPU memory of the stored dtype, TensorStore writes
    the decoded chunks into it directly. Otherwise (a cast, a GPU tensor) each
    shard is read into a buffer and copied; a bounded window of such reads is
    in flight, which bounds the extra memory a restore needs.
    """
    pending: collections.deque[tuple[Any, _Dest, tuple[slice, ...], np.ndarray | None, int]] = collections.deque()
    in_flight = 0
    stores = _open_all(ck, [d.item.path for d in dests])

    def drain_one() -> int:
        fut, dest, dsel, direct, nbytes = pending.popleft()
        stored = ck.arrays[dest.item.path].dtype
        try:
            raw = fut.result()
        except ValueError as e:
            raise corrupt_error(ck, dest.item.path, e) from e
        if direct is not None:
            return nbytes
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
        itemsize = 4 if rec.dtype == "complex32" else _dtypes.numpy_dtype(rec.dtype).itemsize
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.layout):
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
            while in_flight > READ_WINDOW_BYTES and pending:
                in_flight -= drain_one()
    while pending:
        drain_one()


def restore(
    directory: Directory,
    target: Any = None,
    *,
    strict: bool = True,
    inplace: bool = False,
    group: Any = None,
    timeout: datetime.timedelta | None = None,
) -> Any:
    """Restore a checkpoint, optionally shaped like ``target``.

    With ``target=None`` the saved tree comes back with numpy arrays (torch
    complex32 as a torch tensor, which numpy cannot hold) and plain values.
    Otherwise the result has the target's structure and, leaf by leaf, its type,
    dtype (cast from the stored dtype) and device; ``inplace=True`` copies
    straight into the target's tensors and arrays so memory does not double.

    DTensor and ShardedArray targets receive just their local region, whatever
    layout and world size saved the checkpoint; each rank reads only the
    chunks overlapping that region.
    """
    coord = coordinator_for(group, timeout)
    if coord.world_size == 1:
        return _restore(directory, target, strict, inplace)
    # every rank reads its own regions; the shared outcome makes all ranks raise together
    return phase(coord, "restore", lambda: _restore(directory, target, strict, inplace))


def _memory(t: torch.Tensor | np.ndarray) -> tuple[Any, ...]:
    """Identity of the memory a destination views (tied targets share it)."""
    if isinstance(t, np.ndarray):
        return ("numpy", t.__array_interface__["data"][0], t.shape, t.strides, t.dtype.str)
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _restore(directory: Directory, target: Any, strict: bool, inplace: bool) -> Any:
    ck = load(directory)
    if target is None:
        return _restore_saved(ck)
    flat = flatten(target)
    _check_structure(ck, flat.paths, strict)
    out: list[Any] = []
    dests: list[_Dest] = []
    filled: set[tuple[Any, ...]] = set()  # in place: (stored path, region, memory) already scheduled
    for path, leaf in zip(flat.paths, flat.leaves):
        path = ck.aliases.get(path, path)  # tied leaves are stored once, under one path
        if path in ck.values:
            if isinstance(leaf, (torch.Tensor, np.ndarray, ArraySpec, ShardedArray)):
                raise LeafTypeError(
                    f"'{path}': the checkpoint stores a plain value ({type(ck.values[path]).__name__}) but the "
                    f"target leaf is {type(leaf).__name__}"
                )
            out.append(ck.values[path])
        elif path in ck.arrays:
            dest = _destination(ck, path, leaf, inplace)
            mem = (path, dest.item.storage_offsets, dest.item.lengths, _memory(dest.tensor))
            if not inplace or mem not in filled:  # a target whose tied leaves share memory reads once
                filled.add(mem)
                dests.append(dest)
            out.append(dest.result)
        else:
            out.append(leaf)
    read_into(ck, dests)
    for i, value in enumerate(out):  # 0-d numpy targets come back as numpy scalars
        if isinstance(value, np.ndarray) and isinstance(flat.leaves[i], np.generic):
            out[i] = value[()]
    return unflatten(flat.spec, out)


def _restore_saved(ck: Checkpoint) -> Any:
    dests = []
    leaves: list[Any] = []
    for path in ck.leaves:
        if path in ck.values or path in ck.aliases:
            leaves.append(ck.values.get(path))  # aliases: filled after the read
            continue
        rec = ck.arrays[path]
        if rec.dtype == "complex32":
            t = torch.empty(rec.shape, dtype=torch.complex32)
            dests.append(_Dest(plan_read(path, (0,) * len(rec.shape), rec.shape), t, t))
            leaves.append(t)
            continue
        a = np.empty(rec.shape, dtype=_dtypes.numpy_dtype(rec.dtype))
        dests.append(_Dest(plan_read(path, (0,) * len(rec.shape), rec.shape), a, a))
        leaves.append(a)
    read_into(ck, dests)
    # numpy scalars only after the read: a[()] copies the (still empty) buffer
    leaves = [x[()] if p in ck.arrays and ck.arrays[p].kind == "numpy_scalar" else x for p, x in zip(ck.leaves, leaves)]
    if ck.aliases:  # a tied leaf is the very object of its stored leaf, as when it was saved
        by_path = dict(zip(ck.leaves, leaves))
        leaves = [by_path[ck.aliases[p]] if p in ck.aliases else x for p, x in zip(ck.leaves, leaves)]
    return ck.build(leaves)
