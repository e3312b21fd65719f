"""jax.Array leaves, when jax is installed (it is never imported by tsckpt itself).

Saving: a jax.Array is the region of one global array that this process's devices
hold (all of it in a single process; its own part in a multi-process job). The
region is handed to the save plan as a lazy source whose boxes are read from the
device shards themselves, one write at a time, with the offsets where its device
shards begin (:attr:`LeafDesc.cuts`): the planner cuts shard files there too, so
each file lies in one shard and is written from a view of that shard's memory
(zero-copy on CPU devices). Only a shard file of an irregular split (which the
planner cuts by the shortest region) is assembled from the shards' parts; replicated
shards are read once. Nothing gathers the whole array. Where the process's shards do not
form one box (an interleaved device order, ``P(None, ('model', 'data'))``), the region is
their bounding box and the shards are given as the pieces it holds (:attr:`LeafDesc.held`):
the planner makes each a region of its own, written once, never reading the holes.

save_async: a jax.Array is staged before the call returns (the next jitted step may
donate it): :class:`JaxRegion` names the same distinct shards, each copied to host
memory (:func:`start_host_copy` for all, then :func:`host_copy` for each), and is
saved exactly as the array would be.

Restoring: a jax.Array or ``jax.ShapeDtypeStruct`` target is read device slice by
device slice: each distinct slice its sharding gives this process's devices is a
destination of its own (:attr:`Dest.parts`), read by restore's ordinary readers
(only the chunks overlapping it), then handed to its devices with
``jax.make_array_from_callback`` (zero-copy on CPU devices). A ShapeDtypeStruct
without a sharding gives an array on the default device.

Typed PRNG keys (``jax.random.key``) are stored as their uint32 key data under the
kind ``jax_key:<impl>``; a typed-key target takes that kind of the same
implementation, or raw uint32 key data (what Orbax writes), and gets typed keys, laid
out by its sharding (over the global mesh too: a jitted wrap of the key data, which
every process reads whole).

A plain number or bool stored where the target has a shape-() jax leaf (a step saved
as a Python int, restored into ``jax.eval_shape``'s abstract state) becomes a jax
scalar of the target's dtype, its cast checked as an array's.
dtype names match tsckpt's (bfloat16, int4 and float8 through ml_dtypes, as in jax).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base import dtypes as _dtypes
from .._base.casting import check_cast
from .._base.types import Box, Dest, LazySource, Local, ReadItem, box_slices
from .._errors import LeafTypeError, ShapeMismatchError, short_repr
from .._ondisk.chunking import intersect
from .._ondisk.records import KEY_KIND_PREFIX, ArrayRecord, key_impl
from .kinds import LeafKind, check_shape, host_empty, region_leaf, whole


def is_jax_array(x: Any) -> bool:
    mod = sys.modules.get("jax")
    return mod is not None and isinstance(x, mod.Array)


def _is_abstract(x: Any) -> bool:
    mod = sys.modules.get("jax")
    return mod is not None and isinstance(x, mod.ShapeDtypeStruct)


def _is_key(leaf: Any) -> bool:
    import jax

    return bool(jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _key_impl_name(leaf: Any) -> str:
    """The implementation name of typed keys (an array, or a ShapeDtypeStruct: jax names the
    implementation of arrays only, so an abstract one is traced to ask it)."""
    import jax

    if isinstance(leaf, jax.Array):
        return str(jax.random.key_impl(leaf))
    found: list[str] = []

    def ask(k: Any) -> Any:
        found.append(str(jax.random.key_impl(k)))
        return k

    jax.eval_shape(ask, leaf)
    return found[0]


def index_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """A device's index (a tuple of slices, as jax gives them) as a region of ``shape``."""
    ranges = [sl.indices(n) for sl, n in zip(index, shape)]
    ranges += [(0, n, 1) for n in shape[len(ranges):]]
    return tuple(a for a, _, _ in ranges), tuple(max(b - a, 0) for a, b, _ in ranges)


# ---- saving: the process's region, read shard by shard ---------------------------------


class _Shards:
    """The distinct shards this process holds of one array (replicas once), read box by box."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype, shards: dict[Box, Any]) -> None:
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.shards = shards  # box -> a single-device jax.Array, or its host copy (numpy)
        self.region = self._bounding_region()
        # the shards, where they do not fill their bounding box (:attr:`LeafDesc.held`)
        covered = sum(math.prod(b[1]) for b in shards)
        self.held: tuple[Box, ...] = () if covered == math.prod(self.region[1]) else tuple(sorted(shards))

    @classmethod
    def of(cls, path: str, arr: Any) -> _Shards:
        shape = tuple(arr.shape)
        shards: dict[Box, Any] = {}
        for s in arr.addressable_shards:
            shards.setdefault(index_box(s.index, shape), s.data)
        return cls(path, shape, np.dtype(arr.dtype), shards)

    def holding(self, shards: dict[Box, Any]) -> _Shards:
        """The same boxes holding other data (their host copies): the region and what it holds
        as found for these boxes, not found again (save_async stages every shard of every leaf)."""
        if list(shards) != list(self.shards):
            raise ValueError(f"'{self.path}': shards {sorted(shards)} for boxes {sorted(self.shards)}")
        new = object.__new__(_Shards)
        new.path, new.shape, new.dtype, new.shards = self.path, self.shape, self.dtype, shards
        new.region, new.held = self.region, self.held
        return new

    def cuts(self) -> tuple[tuple[int, ...], ...]:
        """Per dimension, the offsets inside this process's region where a shard begins
        (:attr:`LeafDesc.cuts`); () when one shard holds all of it."""
        if len(self.shards) < 2 or self.held:  # held pieces are each a region of their own
            return ()
        return tuple(
            tuple(sorted({b[0][d] for b in self.shards} - {self.region[0][d]})) for d in range(len(self.shape))
        )

    def _bounding_region(self) -> Box:
        boxes = list(self.shards)
        lo = tuple(min(b[0][d] for b in boxes) for d in range(len(self.shape)))
        hi = tuple(max(b[0][d] + b[1][d] for b in boxes) for d in range(len(self.shape)))
        return lo, tuple(h - o for o, h in zip(lo, hi))

    def read(self, box: tuple[slice, ...]) -> np.ndarray:
        """The elements of ``box`` (relative to this process's region) as numpy."""
        off = tuple(o + (s.start or 0) for o, s in zip(self.region[0], box))
        ln = tuple((s.stop if s.stop is not None else n) - (s.start or 0) for s, n in zip(box, self.region[1]))
        parts = [(b, data) for b, data in self.shards.items() if _inside((off, ln), b)]
        if parts:  # one shard holds all of the box: a view of it (no copy on a CPU device)
            return _shard_part(parts[0][1], parts[0][0], (off, ln))
        return self._assemble((off, ln))

    def _assemble(self, box: Box) -> np.ndarray:
        """A box across shards (global coordinates), copied together from their parts; where
        the shards leave holes (:attr:`held`), those read as zeros (only a checksum of the
        whole region reads them, alike on every replica)."""
        off, ln = box
        out = np.zeros(ln, self.dtype) if self.held else np.empty(ln, self.dtype)
        for b, data in self.shards.items():
            common = intersect((off, ln), b)
            if common is not None:
                out[box_slices(common[0], common[1], off)] = _shard_part(
                    data, b, common
                )
        return out


def _inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and i + n <= o + m for i, n, o, m in zip(inner[0], inner[1], outer[0], outer[1]))


def _shard_part(data: Any, shard: Box, box: Box) -> np.ndarray:
    """The part ``box`` (global coordinates) of one shard's single-device array (or of its
    host copy), as numpy. On a CPU device numpy views the device buffer itself; elsewhere
    only the part is copied to the host (numpy of the whole shard would be cached for the
    array's life)."""
    sel = box_slices(box[0], box[1], shard[0])
    if isinstance(data, np.ndarray):
        return data[sel]
    if data.device.platform == "cpu":
        return np.asarray(data)[sel]
    return np.asarray(data[sel])


# ---- restoring: each device slice a destination of its own -------------------------------


def _sharding(leaf: Any) -> Any:
    import jax

    sharding = getattr(leaf, "sharding", None)
    return sharding if sharding is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _device_indices(path: str, sharding: Any, shape: tuple[int, ...]) -> dict[Any, Any]:
    """Each of this process's devices -> its index (a tuple of slices) of ``shape`` in the sharding."""
    try:
        return dict(sharding.addressable_devices_indices_map(shape))
    except Exception as e:  # noqa: BLE001 - jax raises its own error types (IndivisibleError, ValueError)
        raise LeafTypeError(
            f"'{path}': the target's sharding {sharding} cannot lay out the stored shape {list(shape)}: {e}; "
            "give a sharding whose shard shapes divide the stored shape"
        ) from e


def _device_boxes(path: str, sharding: Any, shape: tuple[int, ...]) -> dict[Any, Box]:
    """Each of this process's devices -> the region of ``shape`` the sharding puts there."""
    return {dev: index_box(idx, shape) for dev, idx in _device_indices(path, sharding, shape).items()}


def _refuse_inplace(path: str, leaf: Any) -> None:
    raise LeafTypeError(
        f"'{path}': a {'jax.Array' if is_jax_array(leaf) else 'jax.ShapeDtypeStruct'} target cannot be filled "
        "in place (jax arrays are immutable); "
        "pass inplace=False: restore then returns new jax arrays with the target's sharding"
    )


def _array_dest(rec: ArrayRecord, path: str, leaf: Any, casting: str) -> Dest:
    """Each distinct device slice of the target a destination (read alone, into its own host
    buffer), made one jax.Array on the target's devices once read."""
    import jax

    check_shape(path, tuple(leaf.shape), rec.shape)
    dtype = np.dtype(leaf.dtype)
    cast = check_cast(path, rec.dtype, dtype, casting=casting)
    sharding = _sharding(leaf)
    parts: dict[Box, Dest] = {}
    for box in _device_boxes(path, sharding, rec.shape).values():
        if box not in parts:
            parts[box] = Dest(ReadItem(path, *box), host_empty(box[1], dtype), None, cast=cast)
    shape = rec.shape

    def piece(index: Any) -> np.ndarray:
        return parts[index_box(index, shape)].tensor

    def finish(_: Any) -> Any:
        return jax.make_array_from_callback(shape, sharding, piece)

    return Dest(whole(rec, path), None, None, finish=finish, parts=tuple(parts.values()))


def _key_dest(rec: ArrayRecord, path: str, leaf: Any) -> Dest:
    """Typed keys from their stored key data (of the same implementation) or from raw uint32
    key data (Orbax's), with the target's sharding. Key data is small: read whole."""
    import jax

    impl = _key_impl_name(leaf)
    stored = key_impl(rec.kind)
    if stored is not None and stored != impl:
        raise LeafTypeError(
            f"'{path}': the checkpoint stores PRNG keys of the implementation {stored!r} but the target's keys are "
            f"{impl!r}; make the target with jax.random.key(..., impl={stored!r}) (an implementation this jax "
            "lacks cannot be restored as keys: restore with target=None for the raw key data)"
        )
    data = jax.eval_shape(jax.random.key_data, leaf)
    if rec.dtype != "uint32" or tuple(rec.shape) != tuple(data.shape):
        raise ShapeMismatchError(
            f"'{path}': the target is {impl} PRNG keys of shape {list(leaf.shape)}, whose key data is "
            f"uint32{list(data.shape)}, but the checkpoint stores {rec.dtype}{list(rec.shape)}; "
            "give a key target of the stored shape, or a uint32 array target for the raw data"
        )
    sharding = getattr(leaf, "sharding", None)

    def finish(buf: Any) -> Any:
        keys = jax.random.wrap_key_data(buf, impl=impl)
        if sharding is None or sharding.is_fully_addressable:
            return keys if sharding is None else jax.device_put(keys, sharding)
        # a sharding over other processes' devices too (a global mesh): every process read the
        # same key data whole, which a jitted wrap takes as replicated and lays out as the target
        return _global_wrap(impl, sharding)(buf)

    return Dest(whole(rec, path), host_empty(rec.shape, np.uint32), None, finish=finish)


@functools.lru_cache(maxsize=64)
def _global_wrap(impl: str, sharding: Any) -> Any:
    """Key data (the same numpy array on every process) -> typed keys laid out by ``sharding``."""
    import jax

    return jax.jit(functools.partial(jax.random.wrap_key_data, impl=impl), out_shardings=sharding)


def _scalar_of(path: str, value: Any, leaf: Any, casting: str) -> tuple[Any, Any]:
    """A plain number or bool the checkpoint stores (a step counter saved as a Python int)
    as a jax scalar of a shape-() target's dtype and sharding, the value's cast checked as
    an array's would be; anything else is refused naming what the target would need."""
    import jax

    what = f"{np.dtype(leaf.dtype)}{list(leaf.shape)}"
    if isinstance(value, (bool, int, float)) and not _is_key(leaf):
        a = np.asarray(value)
        stored = _dtypes.numpy_name(a.dtype) if a.dtype.kind in "biuf" else None
        if stored is not None and tuple(leaf.shape) == ():
            cast = check_cast(path, stored, np.dtype(leaf.dtype), casting=casting)
            if cast is not None:
                cast.check(a.reshape(1), ())
            with np.errstate(all="ignore"):
                return jax.device_put(a.astype(leaf.dtype), _sharding(leaf)), cast
    raise LeafTypeError(
        f"'{path}': the checkpoint stores a plain value ({type(value).__name__}) but the target leaf is a jax {what} "
        "array; a plain value restores into a jax target only as a number or bool into shape (); give a target of "
        f"shape () for a number, or the plain value itself (e.g. the saved one, {short_repr(value, 40)}) as this "
        "target leaf"
    )


class JaxRegion:
    """The region of a jax.Array this process holds, as save writes it: the stored kind
    (``numpy``, or ``jax_key:<impl>`` for typed keys, whose key data the shards are) and
    each distinct device shard (replicas once) by its box of the global array.

    ``save_async`` stages a jax.Array leaf as the region :meth:`on_host` gives: every
    shard a host copy, so the array may be donated or deleted once the call returns,
    and the save writes the same files as from the device shards (same region, kind
    and shard cuts)."""

    def __init__(self, kind: str, shards: _Shards) -> None:
        self.kind = kind
        self._shards = shards

    @classmethod
    def of(cls, path: str, leaf: Any) -> JaxRegion:
        """A jax.Array's region in this process (raises LeafTypeError where its shards there
        do not form one box)."""
        kind = "numpy"
        if _is_key(leaf):
            import jax

            kind = KEY_KIND_PREFIX + str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        return cls(kind, _Shards.of(path, leaf))

    @property
    def shards(self) -> dict[Box, Any]:
        """Box of the global array -> that shard's data (a single-device jax.Array, or numpy)."""
        return dict(self._shards.shards)

    def on_host(self, copies: Sequence[np.ndarray]) -> JaxRegion:
        """The same region with the shards' data replaced by ``copies`` (in :attr:`shards`' order)."""
        old = self._shards
        boxes = list(old.shards)
        if len(copies) != len(boxes) or any(tuple(c.shape) != b[1] for c, b in zip(copies, boxes)):
            raise ValueError(f"'{old.path}': host copies {[c.shape for c in copies]} for shards {boxes}")
        return JaxRegion(self.kind, old.holding(dict(zip(boxes, copies))))

    def describe(self, path: str) -> Local:
        shards = self._shards
        (offsets, lengths) = shards.region
        source = LazySource(lengths, shards.dtype, shards.read, kind="numpy")
        local = region_leaf(path, source, shards.shape, offsets, self.kind)
        return Local(local.desc._replace(cuts=shards.cuts(), held=shards.held), local.data)


def start_host_copy(shard: Any) -> None:
    """Start copying one single-device jax.Array to host memory (returns at once; nothing
    to do for a CPU device)."""
    shard.copy_to_host_async()


def host_copy(shard: Any, buffer: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """One single-device jax.Array as host memory that no jax array uses, waiting for its
    copy (:func:`start_host_copy`), and whether it is ``buffer`` (reusable for the next copy).
    Where numpy views the device buffer itself (a CPU device) it is copied into ``buffer``
    (a new array when None); elsewhere the host copy jax made is returned as it is."""
    host = np.asarray(shard)
    if _views_device_memory(host, shard):
        if buffer is None or not buffer.flags.writeable:
            buffer = host_empty(host.shape, host.dtype)
        np.copyto(buffer, host, casting="no")
        return buffer, True
    return host, False


def _views_device_memory(host: np.ndarray, shard: Any) -> bool:
    """Whether ``np.asarray(shard)`` may be the device buffer itself rather than a copy:
    on CPU devices, or where its address is the buffer's (a host memory kind); when in doubt,
    yes (a copy too many is safe, a view of memory the next step reuses is not)."""
    if shard.device.platform == "cpu" or host.size == 0:
        return True
    try:
        return bool(host.ctypes.data == shard.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 - a backend without buffer pointers: copy
        return True


class JaxKind(LeafKind):
    def owns(self, leaf: Any) -> bool:
        return is_jax_array(leaf) or _is_abstract(leaf) or isinstance(leaf, JaxRegion)

    def describe(self, path: str, leaf: Any) -> Local:
        if _is_abstract(leaf):
            return super().describe(path, leaf)
        region = leaf if isinstance(leaf, JaxRegion) else JaxRegion.of(path, leaf)
        return region.describe(path)

    def from_value(self, path: str, value: Any, leaf: Any, inplace: bool, casting: str) -> tuple[Any, Any]:
        if inplace:
            _refuse_inplace(path, leaf)
        return _scalar_of(path, value, leaf, casting)

    def destination(self, rec: ArrayRecord, path: str, leaf: Any, inplace: bool, casting: str) -> Dest:
        if inplace:
            _refuse_inplace(path, leaf)
        if _is_key(leaf):
            return _key_dest(rec, path, leaf)
        return _array_dest(rec, path, leaf, casting)
