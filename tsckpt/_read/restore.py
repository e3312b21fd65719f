"""restore(): match a target tree to a checkpoint, plan the reads, fill the leaves."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.lazytorch import is_tensor
from .._base.mapping import Rules
from .._base.types import ArraySpec, Dest
from .._codec.route import setting as codec_setting
from .._coord.protocol import phase, refuse
from .._coord.torchdist import coordinator_for
from .._errors import (
    CorruptCheckpointError,
    LeafTypeError,
    ShapeMismatchError,
    StructureMismatchError,
    count_and_list,
)
from .._formats.sources import open_checkpoint
from .._leaves.quantized import SUBCLASS_KEY
from .._leaves.registry import destination, kind_of, materialises, memory
from .._leaves.stateful import expand, is_whole_state
from .._ondisk.backing import check_backed
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.readfaults import unchanged
from .._ondisk.records import ArrayRecord
from .._options import READ_ONLY, READ_WINDOW_BYTES, Copy, RestoreOptions, verb
from .._runtime.memory import collector_paused, unwritable
from .._runtime.progress import Progress
from .._storage.locations import Directory
from ..tree import flatten, prefix_advice, prefix_shift, unflatten
from .engine import read_into
from .mapped import MappedCheckpoint, mapped_checkpoint, read_amplification
from .zerocopy import map_leaves


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
    quantized = [p for p in missing if f"{p}/{SUBCLASS_KEY}" in stored]
    if quantized:  # a plain target where a quantized tensor is stored
        msg += (
            f". {count_and_list(quantized)} are stored as quantized tensors (parts and metadata, docs/format.md): "
            "give targets of their class, or read their values with tsckpt.open(...)[path].dequantize()"
        )
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
    mapping: Rules | None = None,
    copy: Copy = True,
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

    ``mapping`` (:mod:`tsckpt.mappings`) maps stored leaves to target leaves as they are read:
    renames, and transposes, reshapes, splits and joins of arrays, so that, for instance, a
    Flax checkpoint restores straight into a torch model. The target (and ``strict``) then
    speaks of the mapped paths; each rank reads only the stored boxes its regions need,
    into views of its own memory (never a transposed copy of a whole array).

    ``copy=False`` gives leaves whose region is exactly one chunk stored raw in a local file
    (tsckpt's one-chunk files, safetensors tensors) as views of copy-on-write mappings of
    their files, each crc32c checked first, instead of copies; ``copy="read-only"`` also
    makes such numpy arrays read-only. A file truncated while mapped kills the process with
    SIGBUS when a lost page is touched (docs/zerocopy.md). Every other leaf is copied, and
    the ``tsckpt`` logger says why.
    """
    options, refused = RestoreOptions.checked(locals())  # a bad option raises before any work, on every rank
    coord = coordinator_for(options.group, options.timeout)
    try:
        if refused is not None:
            raise refused
        codec_setting()  # so does a bad TSCKPT_CODEC
    except Exception as e:  # noqa: BLE001 - every rank raises, in the restore's one exchange
        refuse(coord, "restore", e)
    if is_whole_state(target):  # tsckpt.torch.TrainState: restores itself, in place
        return target.__tsckpt_restore__(directory, options)

    def run() -> Any:
        with collector_paused():
            return read()

    def read() -> Any:
        ck = open_checkpoint(directory, format=format, allow_pickle=allow_pickle)
        ck.check_links(deferred=True)
        mapped = None if mapping is None else mapped_checkpoint(ck, mapping)
        with unchanged(ck), Progress("restore", ck.location, show=progress, rank=coord.rank, unit="reads") as bar:
            reader = _ReadSettings(bar, max_inflight_bytes, casting, mapped, copy)
            if mapped is not None:
                ck = mapped.view  # the target's paths are the mapping's; reads go to the stored one
            if target is None:
                return _restore_saved(ck, as_saved, reader)
            expanded = expand(target, rank=coord.rank)  # stateful objects: their state is the target
            return expanded.load(_restore_into(ck, expanded.tree, strict, inplace, reader))

    if coord.world_size == 1:
        return run()
    # every rank reads its own regions; the shared outcome makes all ranks raise together
    return phase(coord, "restore", run)


@dataclasses.dataclass(frozen=True)
class _ReadSettings:
    """How a restore reads: its progress, the bytes of reads kept in flight, and the casting
    allowed into targets of another dtype."""

    progress: Progress
    window: int
    casting: str = "same_kind"
    mapped: MappedCheckpoint | None = None  # the checkpoint as the mapping shows it, and its reads
    copy: Copy = True  # False, "read-only": leaves that can be are mapped from their files (zerocopy.py)

    def stored(self, ck: Checkpoint) -> Checkpoint:
        """The checkpoint the reads go to: ``ck`` itself, or the one the mapping views."""
        return ck if self.mapped is None else self.mapped.stored


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
    ck: Checkpoint, paths: list[str], leaves: list[Any], inplace: bool, reader: _ReadSettings, ties: dict[int, int] | None = None
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
    if reader.mapped is None:  # before allocating any
        check_backed(ck, sorted({ck.aliases.get(p, p) for p in paths} & ck.arrays.keys()))
    else:
        check_backed(reader.mapped.stored, reader.mapped.sources(paths))
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
            try:
                dest = destination(ck.arrays[path], path, leaf, inplace, casting=reader.casting)
            except (ShapeMismatchError, LeafTypeError) as e:
                if reader.mapped is None:
                    raise
                raise reader.mapped.explained(path, e) from e
            if dest.finish is not None:
                finishing.append((i, dest))
            parts = dest.parts or (dest,)
            for part in parts if reader.mapped is None else reader.mapped.dests(path, parts, casting=reader.casting):
                key = memory(part.tensor) if inplace else None
                if key is not None:  # a target whose tied leaves share memory reads once
                    mem = (path, part.item.path, part.item.storage_offsets, part.item.lengths, key)
                    if mem in filled:
                        continue
                    filled.add(mem)
                dests.append((i, part))
            out.append(dest.result)
        else:
            out.append(leaf)
    mapped_leaves: dict[int, Any] = {}
    if reader.copy is not True:  # before any read: every mapped chunk's crc32c is checked by then
        mapped_leaves, dests = map_leaves(
            reader.stored(ck), dests, leaves, paths, inplace=inplace, read_only=reader.copy == READ_ONLY
        )
        for i, result in mapped_leaves.items():
            out[i] = result
    if inplace:
        _refuse_read_only(paths, dests)
    if reader.mapped is not None or (ck.foreign and not ck.lazy):  # Orbax chunks: reported past 1.1x too
        read_amplification(reader.stored(ck), [d for _, d in dests])
    with cast_warnings_off(any(d.cast is not None for _, d in dests)):
        read_into(reader.stored(ck), [d for _, d in dests], reader.progress, window=reader.window)
    for result in mapped_leaves.values():
        reader.progress.update(int(result.nbytes), 1)
    warn_lost_values([d.cast for _, d in dests] + value_casts)
    for i, dest in finishing:
        out[i] = dest.restored()
    if reader.copy == READ_ONLY and not inplace:  # numpy results read-only, the copied as the mapped
        for i, _ in dests:
            if isinstance(out[i], np.ndarray):
                out[i].flags.writeable = False
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
    if not is_tensor(t) or not t.is_cpu or t.untyped_storage().resizable() or t.numel() == 0:
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


def _restore_into(ck: Checkpoint, target: Any, strict: bool, inplace: bool, reader: _ReadSettings) -> Any:
    flat = flatten(target, names=ck.names)
    ties = tied_to_stored(ck, flat.paths, flat.leaves)
    try:
        _check_structure(ck, [p for i, p in enumerate(flat.paths) if i not in ties], strict)
    except StructureMismatchError as e:
        if reader.mapped is None:
            raise
        raise StructureMismatchError(
            f"{e} (the checkpoint's leaves as the mapping names them: `tsckpt ls DIR --map RULES` lists them, "
            "each with the stored leaves it comes from)"
        ) from e
    return unflatten(flat.spec, _fill(ck, flat.paths, flat.leaves, inplace, reader, ties))


def saved_kind_target(rec: ArrayRecord, as_saved: bool) -> Any:
    """The target leaf that restores ``rec`` as numpy, or (``as_saved``) as the kind it was saved as."""
    if rec.kind == "numpy_scalar":
        return _dtypes.numpy_dtype(rec.dtype).type(0)
    if rec.dtype == "complex32" or (as_saved and rec.kind == "torch"):
        dtype = _dtypes.torch_dtypes().get(rec.dtype)  # checked on load too, where torch was imported by then
        if dtype is None:
            raise CorruptCheckpointError(
                f"'{rec.path}': its record's 'kind' is 'torch' but torch has no dtype {rec.dtype!r}; "
                "restore it without as_saved=True to read it as a numpy array"
            )
        return ArraySpec(rec.shape, dtype)
    return ArraySpec(rec.shape, None)


def _restore_saved(ck: Checkpoint, as_saved: bool, reader: _ReadSettings) -> Any:
    stored = [p for p in ck.leaves if p not in ck.aliases]
    targets = [ck.values[p] if p in ck.values else saved_kind_target(ck.arrays[p], as_saved) for p in stored]
    by_path = dict(zip(stored, _fill(ck, stored, targets, False, reader)))
    # a tied leaf is the very object of its stored leaf, as when it was saved
    return ck.build([by_path[ck.aliases.get(p, p)] for p in ck.leaves])
