"""Hypothesis strategies for pytrees of tensors, arrays and plain values, and
bit-exact comparison helpers shared by the test files.

Array contents are drawn as raw bytes, so every bit pattern a dtype can hold
(NaN payloads, -0.0, infinities, subnormals) is exercised.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
import torch
from hypothesis import strategies as st

# ---- dtypes -----------------------------------------------------------------

TORCH_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.complex32,
]
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES.append(torch.float8_e8m0fnu)

NUMPY_DTYPES = [
    np.dtype(t)
    for t in (
        np.float64,
        np.float32,
        np.float16,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.bool_,
        np.complex64,
        np.complex128,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
    )
]

# integer dtype of the same width, for viewing any tensor as its raw bits
_BITS_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: None}


def torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_from_bytes(raw: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` whose bits are ``raw`` (bool bytes are masked to 0/1)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    buf = bytearray(raw[: n * itemsize].ljust(n * itemsize, b"\0"))
    if dtype == torch.bool:
        buf = bytearray(b & 1 for b in buf)
    u8 = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return u8.clone().view(dtype).reshape(shape)


def array_from_bytes(raw: bytes, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    n = math.prod(shape)
    buf = raw[: n * dtype.itemsize].ljust(n * dtype.itemsize, b"\0")
    if dtype == np.bool_:
        buf = bytes(b & 1 for b in buf)
    return np.frombuffer(buf, dtype=dtype).reshape(shape).copy()


# ---- bit-exact comparison -----------------------------------------------------


def bits(x: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(logical dtype name, shape, raw little-endian bytes in C order) of a tensor,
    numpy array or numpy scalar. torch and numpy names agree (bfloat16, float8_*)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().resolve_conj().resolve_neg().cpu()
        name = torch_name(t.dtype)
        shape = tuple(t.shape)
        if t.dtype == torch.complex32:
            t = torch.view_as_real(t)
        if t.numel() == 0:
            return name, shape, b""
        flat = torch.empty(t.numel(), dtype=t.dtype)  # standard strides, even for size-1 dims
        flat.copy_(t.reshape(-1))
        return name, shape, flat.view(torch.uint8).numpy().tobytes()
    a = np.asarray(x)
    return str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes()


def float_bits(v: float) -> bytes:
    return struct.pack("<d", v)


def assert_same(got: Any, want: Any, *, loose_arrays: bool = False, path: str = "") -> None:
    """Recursive bit-exact equality of two trees.

    Containers must have the same type (a namedtuple may come back as a
    namedtuple of another class with the same name and fields when
    ``loose_arrays``), the same keys and order. Array leaves compare by dtype,
    shape and bytes; with ``loose_arrays`` a torch tensor may come back as a
    numpy array (restore with target=None) and vice versa.
    """
    where = path or "<root>"
    if isinstance(want, (torch.Tensor, np.ndarray, np.generic)):
        if not loose_arrays:
            assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
        else:
            assert isinstance(got, (torch.Tensor, np.ndarray, np.generic)), f"{where}: got {type(got)}"
            if isinstance(want, np.generic):
                assert isinstance(got, np.generic), f"{where}: numpy scalar came back as {type(got)}"
        gb, wb = bits(got), bits(want)
        assert gb[0] == wb[0], f"{where}: dtype {gb[0]} != {wb[0]}"
        assert gb[1] == wb[1], f"{where}: shape {gb[1]} != {wb[1]}"
        assert gb[2] == wb[2], f"{where}: bytes differ"
        return
    if isinstance(want, float):
        assert type(got) is float, f"{where}: {type(got)} is not float"
        assert float_bits(got) == float_bits(want), f"{where}: {got!r} != {want!r} bitwise"
        return
    if want is None or isinstance(want, (bool, int, str, bytes)):
        assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
        assert got == want, f"{where}: {got!r} != {want!r}"
        return
    if isinstance(want, tuple) and hasattr(want, "_fields"):
        assert isinstance(got, tuple) and hasattr(got, "_fields"), f"{where}: {type(got)} is not a namedtuple"
        assert type(got).__name__ == type(want).__name__ and got._fields == want._fields
        if not loose_arrays:
            assert type(got) is type(want)
        for f in want._fields:
            assert_same(getattr(got, f), getattr(want, f), loose_arrays=loose_arrays, path=f"{path}/{f}")
        return
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, loose_arrays=loose_arrays, path=f"{path}/{i}")
        return
    if isinstance(want, dict):
        assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], loose_arrays=loose_arrays, path=f"{path}/{k}")
        return
    raise AssertionError(f"{where}: cannot compare leaf of type {type(want)}")


# ---- strategies -------------------------------------------------------------

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def torch_tensors(draw: Any, dtypes: list[torch.dtype] = TORCH_DTYPES) -> torch.Tensor:
    """A tensor with random bits, possibly a non-contiguous view (transpose, step, offset)."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    view = draw(st.sampled_from(["plain", "transpose", "step", "offset"]))
    base_shape = shape
    if view == "step" and shape:
        base_shape = (*shape[:-1], shape[-1] * 2)
    elif view == "offset" and shape:
        base_shape = (shape[0] + 1, *shape[1:])
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=0, max_size=math.prod(base_shape) * itemsize))
    t = tensor_from_bytes(raw, base_shape, dtype)
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif view == "step" and shape:
        t = t[..., ::2]
    elif view == "offset" and shape:
        t = t[1:]
    return t


@st.composite
def numpy_arrays(draw: Any, dtypes: list[np.dtype] = NUMPY_DTYPES) -> np.ndarray:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    raw = draw(st.binary(min_size=0, max_size=math.prod(shape) * dtype.itemsize))
    a = array_from_bytes(raw, shape, dtype)
    if a.ndim >= 2 and draw(st.booleans()):
        a = a.T  # non-contiguous
    elif a.ndim == 1 and draw(st.booleans()):
        a = a[::-1]  # negative stride
    return a


@st.composite
def numpy_scalars(draw: Any) -> np.generic:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    raw = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    return array_from_bytes(raw, (), dtype)[()]


def any_float() -> st.SearchStrategy[float]:
    """Every float64 bit pattern, NaN payloads included."""
    return st.binary(min_size=8, max_size=8).map(lambda b: struct.unpack("<d", b)[0])


python_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    any_float(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)

array_leaves = st.one_of(torch_tensors(), numpy_arrays(), numpy_scalars())
# weighted towards arrays (one_of picks branches about evenly)
leaves = st.one_of(torch_tensors(), torch_tensors(), numpy_arrays(), numpy_scalars(), python_values)

# dict keys: any str (no surrogates: not UTF-8 encodable) or int, including the tricky ones
dict_keys = st.one_of(
    st.text(max_size=6),
    st.integers(-3, 20),
    st.sampled_from(["", "0", "-1", ".", "..", "...", "zarr.json", "__x", "%", "%25", "a/b", "c", "%root", " ", "é"]),
)


def trees(leaf: st.SearchStrategy[Any] = leaves, max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Nested dicts (str and int keys), lists and tuples of ``leaf``."""

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(dict_keys, children, max_size=3),
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


# ---- damaged JSON documents ----------------------------------------------------

ODD_STRINGS = [
    "", "float128x", "../x", "/abs", "a//b", ".", "%root", "zarr.json", "é", "\u0000", "\ud800", "x" * 300,
    "float32", "bfloat16", "complex32", "int4", "uint64", "bool", "torch", "numpy", "numpy_scalar",
    "committed", "pending", "compact", "plain", "dict", "list", "namedtuple", "none", "custom", "sharding_indexed",
]
HUGE_AND_NEGATIVE = [0, 1, 2, 3, -1, 10**15, 2**31, 2**62, 2**63, 2**64, -(2**63), 10**40]


class Deep:
    """A value nested ``levels`` deep in lists and list nodes; :func:`dumps` writes it
    without recursion (json.dumps would exhaust the stack)."""

    def __init__(self, levels: int, leaf: Any = None) -> None:
        self.levels, self.leaf = levels, leaf

    def __repr__(self) -> str:
        return f"Deep({self.levels}, {self.leaf!r})"

    def text(self) -> str:
        opens = ['{"type": "list", "children": [' if i % 2 else "[" for i in range(self.levels)]
        closes = ["]}" if i % 2 else "]" for i in reversed(range(self.levels))]
        return "".join(opens) + dumps(self.leaf) + "".join(closes)


def dumps(doc: Any) -> str:
    """JSON text of ``doc``, which may hold :class:`Deep` values."""
    found: list[Deep] = []

    def hook(o: Any) -> Any:
        if isinstance(o, Deep):
            found.append(o)
            return f"@@deep{len(found) - 1}@@"
        raise TypeError(type(o).__name__)

    text = json.dumps(doc, default=hook)
    for i, d in enumerate(found):
        text = text.replace(f'"@@deep{i}@@"', d.text(), 1)
    return text


def deep(levels: int, leaf: Any = None) -> Deep:
    return Deep(levels, leaf)


json_scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HUGE_AND_NEGATIVE),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(ODD_STRINGS),
    st.text(max_size=6),
)
# Any JSON value, weighted towards the numbers, strings and short lists that fields hold.
json_values: st.SearchStrategy[Any] = st.one_of(
    json_scalars,
    st.lists(st.sampled_from(HUGE_AND_NEGATIVE), max_size=4),
    st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                 max_leaves=6),
    st.sampled_from([50, 201, 5000]).map(deep),
)


def json_locations(doc: Any, limit: int = 2000) -> list[tuple[Any, ...]]:
    """Every location (the keys and indices leading to it) in a JSON document, breadth first."""
    out: list[tuple[Any, ...]] = [()]
    i = 0
    while i < len(out) and len(out) < limit:
        node = get_at(doc, out[i])
        if isinstance(node, dict):
            out.extend((*out[i], k) for k in node)
        elif isinstance(node, list):
            out.extend((*out[i], j) for j in range(len(node)))
        i += 1
    return out[:limit]


def get_at(doc: Any, where: tuple[Any, ...]) -> Any:
    for k in where:
        doc = doc[k]
    return doc


MUTATIONS = ("delete", "replace", "extra", "number", "resize", "deep", "swap", "swap")


@st.composite
def json_mutations(draw: Any, doc: Any, under: tuple[Any, ...] = ()) -> tuple[str, tuple[Any, ...], Any]:
    """(operation, location, value) for :func:`mutate`: a field deleted, replaced by any JSON
    value, an extra key or element, a number nudged or made huge or negative, a list made
    shorter or longer, a value nested deeply, two elements or values swapped. Locations are
    drawn from below ``under``."""
    locations = [w for w in json_locations(doc) if w[: len(under)] == under]
    where = draw(st.sampled_from(locations))
    op = draw(st.sampled_from(MUTATIONS))
    if op == "number":
        node = get_at(doc, where)
        base = node if isinstance(node, int) and not isinstance(node, bool) else 1
        value: Any = draw(st.sampled_from([base + 1, base - 1, base * 2, -base, *HUGE_AND_NEGATIVE]))
    elif op == "resize":
        value = draw(st.sampled_from(["drop", "repeat", "empty"]))
    elif op == "extra":
        value = (draw(st.text(max_size=5) | st.sampled_from(["order", "aliases", "layout", "bits", "must_understand"])),
                 draw(json_values))
    elif op == "deep":
        value = draw(st.sampled_from([201, 1000, 100_000]))
    elif op == "swap":  # two elements of a list, or the values of two keys
        value = (draw(st.integers(0, 100)), draw(st.integers(0, 100)))
    else:
        value = draw(json_values)
    return op, where, value


def mutate(doc: Any, mutation: tuple[str, tuple[Any, ...], Any]) -> Any:
    """A copy of ``doc`` with one :func:`json_mutations` mutation applied."""
    op, where, value = mutation
    doc = copy.deepcopy(doc)
    parent, key = (get_at(doc, where[:-1]), where[-1]) if where else (None, None)
    node = get_at(doc, where)

    def put(new: Any) -> Any:
        if parent is None:
            return new
        parent[key] = new
        return doc

    if op == "delete":
        if parent is None:
            return {}
        del parent[key]
        return doc
    if op in ("replace", "number"):
        return put(value)
    if op == "extra":
        if isinstance(node, dict):
            node[value[0]] = value[1]
        elif isinstance(node, list):
            node.append(value[1])
        else:
            return put([node, value[1]])
        return doc
    if op == "resize":
        if not isinstance(node, list):
            return put([node] if value != "empty" else [])
        if value == "drop":
            return put(node[:-1])
        return put(node + node[-1:] if value == "repeat" else [])
    if op == "deep":
        return put(deep(value, node))
    if op == "swap":
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if len(keys) >= 2:
            a, b = keys[value[0] % len(keys)], keys[value[1] % len(keys)]
            node[a], node[b] = node[b], node[a]
        return doc
    raise ValueError(op)


DIMS = [0, 1, 2, 3, 4, 5, 8, 16, 32, 64, 100, 2**20, 10**15, 2**40, 2**61]
KNOWN_DTYPES = ["bool", "int8", "uint8", "int16", "float16", "bfloat16", "int32", "float32", "uint32", "int64",
                "float64", "complex64", "complex128", "complex32", "float8_e4m3fn", "int4", "bits8", "bits16"]


@st.composite
def record_edits(draw: Any, record: dict[str, Any]) -> dict[str, Any]:
    """An array record of the root metadata with plausible but wrong fields: dtypes this
    tsckpt knows, shapes of the same or another rank, huge extents, shard and chunk shapes
    that divide each other (so the record stays valid and the damage reaches the reads)."""
    out = dict(record)
    shape = record.get("shape") if isinstance(record.get("shape"), list) else []
    ndim = len(shape) if draw(st.booleans()) else draw(st.integers(0, 3))
    dims = st.sampled_from(DIMS)
    fields = draw(st.sets(st.sampled_from(["shape", "shard_shape", "chunk_shape", "dtype", "kind"]), min_size=1))
    if "dtype" in fields:
        out["dtype"] = draw(st.sampled_from(KNOWN_DTYPES))
    if "kind" in fields:
        out["kind"] = draw(st.sampled_from(["torch", "numpy", "numpy_scalar"]))
    if "shape" in fields or ndim != len(shape):
        out["shape"] = draw(st.lists(dims, min_size=ndim, max_size=ndim))
    ndim = len(out["shape"]) if isinstance(out.get("shape"), list) else ndim
    shard = out.get("shard_shape")
    if "shard_shape" in fields or not isinstance(shard, list) or len(shard) != ndim:
        out["shard_shape"] = draw(st.lists(dims.filter(bool), min_size=ndim, max_size=ndim))
    chunk = out.get("chunk_shape")
    if "chunk_shape" in fields or (chunk is not None and (not isinstance(chunk, list) or len(chunk) != ndim)):
        if draw(st.booleans()):
            out["chunk_shape"] = None
        else:  # a divisor of each shard extent
            out["chunk_shape"] = [s // draw(st.sampled_from([d for d in (1, 2, 4, 16, s) if s % d == 0]))
                                  for s in out["shard_shape"]]
    return out
