"""Quantized tensor subclasses (torchao's) as small groups of plain arrays.

A known subclass at leaf path ``p`` is saved as the subtree ``p/<part>`` of its inner
tensors (``qdata`` and ``scale``, NVFP4's ``per_tensor_scale``, float8 training's
``_data`` and ``_scale``: the names of its ``__tensor_flatten__``) and the value
``p/subclass``: JSON naming the class, the logical shape and the attributes that
``__tensor_unflatten__`` needs (dtypes, block size, enums, torchao's config tuples),
so a restore builds the same subclass with the same metadata, and a reader without the
training code finds the parts and dequantizes them (docs/format.md, "Quantized tensors").

Each part is a global array of its own. A sharded leaf (a DTensor whose local tensor is
such a subclass, or a :class:`ShardedArray` of one) is saved as the region of each part
that its region of the logical array covers: a part dimension packed two to a byte
(fp4) or one scale per block of ``block_size`` elements is the logical region divided
by that ratio, so each scale block travels with its data and any world size restores
any other's checkpoint. A dimension a part broadcasts over (a tensorwise or axiswise
float8 scale) is held whole by every rank (a replica). A shard boundary inside a block
is refused, naming the leaf.

``WeightWithDynamicFloat8CastTensor`` (float8 training's weight under FSDP2) holds a
high-precision tensor that is cast to float8 at each all-gather: it is saved as that
tensor, a plain array (the cast is no state), and restored into it.

Any other tensor subclass (one with ``__tensor_flatten__``) is refused with its leaf
path and type: its raw storage is no array of its values. torchao is never imported
here; a subclass is recognised by its class's module and name.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._base import dtypes as _dtypes
from .._base.lazytorch import is_tensor
from .._base.types import ShardedArray
from .._errors import LeafTypeError, StructureMismatchError
from .dtensor import is_dtensor, region
from .kinds import is_wrapper_subclass, unknown_subclass

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# The value beside the parts that marks a saved subclass and holds its metadata.
SUBCLASS_KEY = "subclass"

MX = "torchao.prototype.mx_formats.mx_tensor.MXTensor"
NVFP4 = "torchao.prototype.mx_formats.nvfp4_tensor.NVFP4Tensor"
FLOAT8 = "torchao.float8.float8_training_tensor.Float8TrainingTensor"
# torchao's float8 weights for inference; with block_size [128, 128] the layout of block-scaled
# fp8 checkpoints (DeepSeek-V3's weight and weight_scale_inv)
FLOAT8_BLOCKS = "torchao.quantization.Float8Tensor"  # its module names itself so
HP_WEIGHT = "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor"
# Subclasses saved as their parts; the high-precision weight is saved as its tensor.
KNOWN = (MX, NVFP4, FLOAT8, FLOAT8_BLOCKS)

# Modules whose classes a stored attribute may name (enums, named tuples, dataclasses).
_TRUSTED_MODULES = ("torchao.",)

Ratios = tuple["int | None", ...]  # per part dimension: elements per part element, None: broadcast


def class_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def is_subclass_tensor(t: Any) -> bool:
    """A tensor of a wrapper subclass (one ``__tensor_flatten__`` describes), other than a
    plain tensor, a parameter or a DTensor of plain tensors."""
    if is_dtensor(t):
        return is_wrapper_subclass(t._local_tensor)
    return is_wrapper_subclass(t)


def is_subclass_leaf(node: Any) -> bool:
    """A tree node this module expands (or refuses): a subclass tensor, a DTensor of one, or
    a ShardedArray of one."""
    if is_tensor(node):
        return is_subclass_tensor(node)
    return isinstance(node, ShardedArray) and is_tensor(node.local) and is_subclass_tensor(node.local)


# ---- attributes as JSON -------------------------------------------------------------


def _encode(path: str, value: Any) -> Any:
    if isinstance(value, enum.Enum):  # before str: torchao's enums are str enums too
        return {"enum": _qualified(type(value)), "value": _encode(path, value.value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": _dtypes.torch_name(value)}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        names: tuple[str, ...] = type(value)._fields  # type: ignore[attr-defined]
        fields = {k: _encode(path, getattr(value, k)) for k in names}
        return {"namedtuple": _qualified(type(value)), "fields": fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(path, getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"dataclass": _qualified(type(value)), "fields": fields}
    if isinstance(value, (list, tuple)):
        return {"list": [_encode(path, v) for v in value]}
    raise LeafTypeError(
        f"'{path}': an attribute of the quantized tensor is a {type(value).__qualname__} ({value!r}), which tsckpt "
        "cannot store as metadata; it stores None, numbers, strings, dtypes, enums, named tuples and dataclasses"
    )


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _trusted_class(path: str, name: str) -> Any:
    module, _, qual = name.partition(":")
    if not module.startswith(_TRUSTED_MODULES) or not qual:
        raise LeafTypeError(
            f"'{path}': the stored metadata names the class {name!r}; tsckpt only builds classes of torchao"
        )
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise LeafTypeError(
            f"'{path}': the stored metadata names {name!r}, which cannot be imported here ({e}); install the torchao "
            "version that saved it, or read the parts as plain arrays (tsckpt.open(...)[path].parts)"
        ) from e
    return obj


def _decode(path: str, value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "dtype" in value:
        return _dtypes.torch_dtype(value["dtype"])
    if "enum" in value:
        return _trusted_class(path, value["enum"])(_decode(path, value["value"]))
    if "list" in value:
        return [_decode(path, v) for v in value["list"]]
    kind = "namedtuple" if "namedtuple" in value else "dataclass"
    cls = _trusted_class(path, value[kind])
    return cls(**{k: _decode(path, v) for k, v in value["fields"].items()})


@dataclasses.dataclass(frozen=True)
class Subclass:
    """What ``p/subclass`` records: the class, the logical (global) shape, the part names and
    the attributes ``__tensor_unflatten__`` takes (as JSON, see :func:`_encode`)."""

    cls: str
    shape: tuple[int, ...]
    parts: dict[str, str]  # name -> dtype, in the order of __tensor_flatten__
    attributes: dict[str, Any]

    def to_json(self) -> str:
        parts = [[name, dtype] for name, dtype in self.parts.items()]
        return json.dumps(
            {"class": self.cls, "shape": list(self.shape), "parts": parts, "attributes": self.attributes},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, path: str, text: Any) -> Subclass:
        try:
            d = json.loads(text)
            parts = {str(name): str(dtype) for name, dtype in d["parts"]}
            return cls(str(d["class"]), tuple(int(s) for s in d["shape"]), parts, dict(d["attributes"]))
        except (TypeError, ValueError, KeyError) as e:
            raise LeafTypeError(
                f"'{path}/{SUBCLASS_KEY}': not the metadata of a quantized tensor tsckpt wrote ({e}); "
                "read its parts as plain arrays"
            ) from e

    def context(self, path: str) -> dict[str, Any]:
        return {k: _decode(path, v) for k, v in self.attributes.items()}

    def build(self, path: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> Any:
        """The subclass of ``parts`` (a region of logical shape ``shape``), through torchao."""
        module, _, name = self.cls.rpartition(".")
        klass = _trusted_class(path, f"{module}:{name}")
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        return klass.__tensor_unflatten__(dict(parts), self.context(path), torch.Size(shape), stride)


# ---- how a part's region follows the logical region ----------------------------------------


def part_ratios(path: str, info: Subclass, name: str, part_ndim: int) -> Ratios:
    """Per dimension of part ``name``: how many logical elements one part element covers
    (1: the same, 2: fp4 packed two to a byte, the block size: a block scale), None where
    the part broadcasts over the dimension (a float8 tensorwise or axiswise scale). A part
    of no dimensions is replicated."""
    attrs = info.attributes
    ndim = len(info.shape)
    if part_ndim == 0:
        return ()
    if part_ndim != ndim:
        raise LeafTypeError(
            f"'{path}': part '{name}' has {part_ndim} dimensions and the tensor {ndim}; tsckpt shards a quantized "
            "tensor only where each part has the tensor's dimensions; save it unsharded (full_tensor())"
        )
    ones: list[int | None] = [1] * ndim
    if info.cls in (MX, NVFP4):
        if attrs.get("is_swizzled_scales"):
            raise LeafTypeError(
                f"'{path}': a sharded {info.cls.rpartition('.')[2]} with swizzled (blocked) scales cannot be saved "
                "by region (the swizzle mixes rows of 128); quantize with is_swizzled_scales=False"
            )
        packed = info.cls == NVFP4 or attrs.get("elem_dtype") == {"dtype": "float4_e2m1fn_x2"}
        if name == "qdata":
            ones[-1] = 2 if packed else 1
        elif name == "scale":
            ones[-1] = int(attrs["block_size"])
        else:
            raise LeafTypeError(f"'{path}': part '{name}' of a sharded {info.cls} has no known layout")
        return tuple(ones)
    if info.cls == FLOAT8_BLOCKS and name == "scale":
        block = attrs.get("block_size") or {"list": list(info.shape)}
        sizes = [int(b) for b in block["list"]]
        return tuple(None if b >= n else b for b, n in zip(sizes, info.shape))
    if info.cls == FLOAT8 and name == "_scale":
        axis = attrs.get("_axiswise_dim")
        if axis is not None:
            ones[int(axis)] = None
    return tuple(ones)


def part_region(
    path: str, name: str, ratios: Ratios, shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offsets, lengths) of a part, for the logical region ``offsets`` +
    ``lengths`` of a tensor of global ``shape``."""
    if not ratios:
        return (), (), ()
    g: list[int] = []
    o: list[int] = []
    n: list[int] = []
    for d, r in enumerate(ratios):
        if r is None:
            g.append(1)
            o.append(0)
            n.append(1)
            continue
        if offsets[d] % r or (lengths[d] % r and offsets[d] + lengths[d] != shape[d]):
            raise LeafTypeError(
                f"'{path}': the region [{offsets[d]}:{offsets[d] + lengths[d]}] of dimension {d} (of {shape[d]}) does "
                f"not fall on blocks of {r} elements, as part '{name}' needs; shard on multiples of {r}"
            )
        # a last block may be partial (a dimension not a multiple of 128 in a 128 x 128 block-scaled weight)
        g.append(-(-shape[d] // r))
        o.append(offsets[d] // r)
        n.append(-(-lengths[d] // r))
    return tuple(g), tuple(o), tuple(n)


def is_subclass_json(value: Any) -> bool:
    """Whether a stored value is a quantized tensor's metadata (not a user's value that
    happens to be named ``subclass``)."""
    try:
        info = Subclass.from_json("", value)
    except LeafTypeError:
        return False
    return info.cls.startswith(_TRUSTED_MODULES)


# ---- the expansion -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Placed:
    """Where a subclass leaf's local tensor lies: its global shape and region, and how to
    rewrap a rebuilt local tensor as the leaf was (a DTensor, a ShardedArray, or as is)."""

    local: Any
    shape: tuple[int, ...]
    offsets: tuple[int, ...] | None  # None: not sharded
    wrap: Callable[[Any], Any]


def _placed(path: str, leaf: Any) -> _Placed:
    if isinstance(leaf, ShardedArray):
        g, off = leaf.global_shape, leaf.offsets
        return _Placed(leaf.local, g, off, lambda t: ShardedArray(t, g, off))
    if is_dtensor(leaf):
        from torch.distributed.tensor import DTensor

        offsets, _ = region(path, leaf)
        mesh, placements, shape, stride = leaf.device_mesh, leaf.placements, leaf.shape, leaf.stride()

        def wrap(t: Any) -> Any:
            return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)

        return _Placed(leaf._local_tensor, tuple(int(s) for s in leaf.shape), offsets, wrap)
    return _Placed(leaf, tuple(int(s) for s in leaf.shape), None, lambda t: t)


def expand_leaf(path: str, leaf: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The subtree a subclass leaf is saved as (or the target a restore reads into), and how
    the restored subtree becomes the leaf again."""
    placed = _placed(path, leaf)
    local = placed.local
    name = class_name(local)
    if name == HP_WEIGHT:
        return _expand_hp(placed, leaf)
    if name not in KNOWN:
        raise unknown_subclass(path, local, "the leaf" if local is leaf else "its local tensor")
    inner, ctx = local.__tensor_flatten__()
    dtypes = {part: _dtypes.torch_name(getattr(local, part).dtype) for part in inner}
    info = Subclass(name, placed.shape, dtypes, {k: _encode(path, v) for k, v in ctx.items()})
    parts: dict[str, Any] = {}
    lengths = tuple(int(s) for s in local.shape)
    for part in inner:
        t = getattr(local, part)
        if not t.is_contiguous():  # a transposed tensor: its subclass reads its layout from the strides
            raise LeafTypeError(
                f"'{path}': part '{part}' of the {name.rpartition('.')[2]} is not contiguous (shape {list(t.shape)}, "
                f"strides {list(t.stride())}: a transposed tensor), and the subclass reads its layout (fp4 packing, "
                "scale blocks) from the strides; tsckpt stores quantized tensors in row-major layout only: save "
                "one quantized from a contiguous tensor"
            )
        if placed.offsets is None:
            parts[part] = t
            continue
        g, o, n = part_region(path, part, part_ratios(path, info, part, t.dim()), placed.shape, placed.offsets, lengths)
        if tuple(t.shape) != n:
            raise LeafTypeError(
                f"'{path}': part '{part}' of the local tensor has shape {list(t.shape)} but its region "
                f"{list(lengths)} of the tensor implies {list(n)}; the quantized tensor is inconsistent"
            )
        parts[part] = ShardedArray(t, g, o)
    tree = {**parts, SUBCLASS_KEY: info.to_json()}

    def load(restored: Any) -> Any:
        return _rebuild(path, leaf, placed, info, lengths, restored)

    return tree, load


def _rebuild(path: str, leaf: Any, placed: _Placed, want: Subclass, lengths: tuple[int, ...], restored: Any) -> Any:
    stored = Subclass.from_json(path, restored[SUBCLASS_KEY])
    if stored.cls != want.cls or stored.shape != want.shape:
        raise StructureMismatchError(
            f"'{path}': the checkpoint stores a {stored.cls} of shape {list(stored.shape)} but the target is a "
            f"{want.cls} of shape {list(want.shape)}; give a target of the stored kind, or restore with "
            "target=None to read the parts"
        )
    parts = {k: (v.local if isinstance(v, ShardedArray) else v) for k, v in restored.items() if k != SUBCLASS_KEY}
    for k, dtype in stored.parts.items():  # parts are data, never cast: the target's must be the stored dtypes
        if k in parts and _dtypes.torch_name(parts[k].dtype) != dtype:
            raise StructureMismatchError(
                f"'{path}': part '{k}' is stored as {dtype} but the target's is {_dtypes.torch_name(parts[k].dtype)} "
                f"(a {stored.cls.rpartition('.')[2]} of other attributes: stored {stored.attributes}); give a target "
                "quantized as stored, or restore with target=None to read the parts"
            )
    local = placed.local
    if all(parts[k] is getattr(local, k) for k in parts) and stored.attributes == want.attributes:
        return leaf  # read in place into the target's own parts, metadata the same
    return placed.wrap(stored.build(path, parts, lengths))


def _expand_hp(placed: _Placed, leaf: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The high-precision weight of float8 training: saved as its tensor."""
    local = placed.local
    hp = local._tensor
    tree = hp if placed.offsets is None else ShardedArray(hp, placed.shape, placed.offsets)

    def load(restored: Any) -> Any:
        t = restored.local if isinstance(restored, ShardedArray) else restored
        if t is hp:
            return leaf
        inner, ctx = local.__tensor_flatten__()
        rebuilt = type(local).__tensor_unflatten__({inner[0]: t}, ctx, t.shape, t.stride())
        return placed.wrap(rebuilt)

    return tree, load


def dequantized(t: Any) -> torch.Tensor:
    """A subclass tensor's values in its original dtype (torchao's own dequantization)."""
    if class_name(t) == FLOAT8:  # torch.Tensor.dequantize is torch's own quantization's
        return t.to_original_precision()
    return t.dequantize()

