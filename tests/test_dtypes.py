"""Every supported dtype and leaf kind survives save/restore bit-exactly."""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import torch

import tsckpt
from tests.strategies import NUMPY_DTYPES, TORCH_DTYPES, array_from_bytes, assert_same, bits, float_bits, tensor_from_bytes, torch_name

RNG = np.random.default_rng(1234)


def random_tensor(shape, dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    return tensor_from_bytes(RNG.bytes(math.prod(shape) * itemsize), shape, dtype)


def all_views(dtype):
    """Contiguous, 0-d, zero-size and non-contiguous tensors of one dtype."""
    base = random_tensor((6, 8), dtype)
    return {
        "contig": base,
        "transposed": base.t(),
        "strided": base[1::2, ::3],
        "offset": base[2:, 5:],
        "row": base[3],
        "scalar": random_tensor((), dtype),
        "empty": random_tensor((0, 4), dtype),
        "empty3": random_tensor((2, 0, 3), dtype),
        "expanded": base[0].expand(3, 8),
    }


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=torch_name)
def test_torch_dtype_roundtrip_bit_exact(ckdir, dtype, dirty_empty):
    tree = all_views(dtype)
    assert not tree["transposed"].is_contiguous() and not tree["strided"].is_contiguous()
    assert tree["offset"].storage_offset() > 0
    tsckpt.save(ckdir, tree)

    back = tsckpt.restore(ckdir, tree)
    assert_same(back, tree)  # torch tensors of the same dtype and bits
    for k, t in back.items():
        assert t.is_contiguous(), k

    raw = tsckpt.restore(ckdir)  # target=None: numpy (complex32: torch, numpy has no such dtype)
    for k, t in tree.items():
        got = raw[k]
        if dtype == torch.complex32:
            assert isinstance(got, torch.Tensor) and got.dtype == torch.complex32
        else:
            assert isinstance(got, np.ndarray), k
        assert bits(got) == bits(t), k


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=torch_name)
def test_stored_zarr_data_type(ckdir, dtype):
    tsckpt.save(ckdir, {"x": random_tensor((3, 2), dtype)})
    with open(os.path.join(ckdir, "x", "zarr.json")) as f:
        node = json.load(f)
    name = torch_name(dtype)
    if dtype == torch.complex32:  # float16 (re, im) pairs in a trailing dimension
        assert node["data_type"] == "float16" and node["shape"] == [3, 2, 2]
    else:
        assert node["data_type"] == name and node["shape"] == [3, 2]
    assert node["attributes"]["tsckpt"] == {"dtype": name, "kind": "torch"}
    assert node["fill_value"] == (False if name == "bool" else [0, 0] if node["data_type"].startswith("complex") else 0)
    md = tsckpt.metadata(ckdir)["x"]
    assert md.dtype == name and md.shape == (3, 2)
    assert md.nbytes == 6 * torch.empty((), dtype=dtype).element_size()


def _special_floats(dtype):
    """NaN with a payload, negative NaN, -0.0, +-inf, the smallest subnormal, as raw bits."""
    if dtype == torch.float64:
        pats = [0x7FF8_0000_0000_1234, 0xFFF0_0000_0000_0001, 0x8000_0000_0000_0000, 0x7FF0 << 48, 0xFFF0 << 48, 1]
        return torch.tensor([struct.unpack("<q", struct.pack("<Q", p))[0] for p in pats], dtype=torch.int64).view(dtype)
    if dtype == torch.float32:
        pats = [0x7FC0_1234, 0xFF80_0001, 0x8000_0000, 0x7F80_0000, 0xFF80_0000, 1]
        return torch.tensor(np.array(pats, dtype=np.uint32).view(np.int32)).view(dtype)
    if dtype in (torch.float16, torch.bfloat16):
        pats = [0x7E12, 0xFC01, 0x8000, 0x7C00, 0xFC00, 1] if dtype == torch.float16 else [0x7FC1, 0xFF81, 0x8000, 0x7F80, 0xFF80, 1]
        return torch.tensor(np.array(pats, dtype=np.uint16).view(np.int16)).view(dtype)
    raise AssertionError(dtype)


_NP_FLOAT = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", list(_NP_FLOAT), ids=torch_name)
def test_nan_payloads_negative_zero_and_inf(ckdir, dtype):
    t = _special_floats(dtype)
    assert math.isnan(float(t[0])) and math.isnan(float(t[1]))
    assert float(t[2]) == 0.0 and math.copysign(1.0, float(t[2])) == -1.0
    assert float(t[3]) == math.inf and float(t[4]) == -math.inf and 0 < float(t[5]) < 1e-4
    a = t.view(_INT_OF_SIZE[t.element_size()]).numpy().view(_NP_FLOAT[dtype]).copy()  # same bits in numpy
    tsckpt.save(ckdir, {"t": t, "n": a})
    back = tsckpt.restore(ckdir, {"t": torch.empty_like(t), "n": np.empty_like(a)})
    assert bits(back["t"]) == bits(t)
    assert bits(back["n"]) == bits(a)
    raw = tsckpt.restore(ckdir)
    assert bits(raw["t"]) == bits(t) and bits(raw["n"]) == bits(a)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_numpy_arrays_and_scalars(ckdir, dtype, dirty_empty):
    a = array_from_bytes(RNG.bytes(24 * dtype.itemsize), (4, 6), dtype)
    tree = {
        "a": a,
        "t": a.T,
        "neg": a[::-1, ::-2],
        "zero": np.empty((0, 3), dtype),
        "zero_d": a[1:2, 2:3].reshape(()).copy(),
        "scalar": a[2, 3],  # numpy scalar (np.generic)
    }
    assert isinstance(tree["scalar"], np.generic) and isinstance(tree["zero_d"], np.ndarray)
    tsckpt.save(ckdir, tree)
    for back in (tsckpt.restore(ckdir), tsckpt.restore(ckdir, tree)):
        assert_same(back, tree)
        assert type(back["scalar"]) is type(tree["scalar"])
        assert back["zero_d"].shape == () and isinstance(back["zero_d"], np.ndarray)
    md = tsckpt.metadata(ckdir)
    assert md["scalar"].shape == () and md["a"].dtype == str(dtype)


def test_python_values_roundtrip_exactly(ckdir, dirty_empty):
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]
    tree = {
        "int": 7,
        "neg": -3,
        "big": 2**100 + 1,
        "float": 0.1,
        "negzero": -0.0,
        "inf": float("inf"),
        "ninf": float("-inf"),
        "nan": nan_payload,
        "tiny": 5e-324,
        "true": True,
        "false": False,
        "str": "héllo / wörld \u2603 \x00",
        "empty": "",
        "bytes": b"\x00\xffabc",
        "none": None,
        "nested": [None, (1, "x")],
    }
    tsckpt.save(ckdir, tree)
    for back in (tsckpt.restore(ckdir), tsckpt.restore(ckdir, tree)):
        assert_same(back, tree)
        assert float_bits(back["nan"]) == float_bits(nan_payload)
        assert type(back["true"]) is bool and type(back["int"]) is int
    assert tsckpt.open(ckdir)["str"] == tree["str"]
    assert tsckpt.metadata(ckdir)["big"] == 2**100 + 1


def test_bytearray_comes_back_as_bytes(ckdir):
    tsckpt.save(ckdir, {"b": bytearray(b"xyz")})
    assert tsckpt.restore(ckdir) == {"b": b"xyz"}


def test_torch_tensor_values_of_special_kinds(ckdir):
    c = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    x = torch.arange(4.0)
    tree = {"conj": c.conj(), "neg": torch._neg_view(x), "grad": x.clone().requires_grad_()}
    assert tree["conj"].is_conj() and tree["neg"].is_neg()
    tsckpt.save(ckdir, tree)
    back = tsckpt.restore(ckdir)
    np.testing.assert_array_equal(back["conj"], np.array([1 - 2j, -3 + 4j], np.complex64))
    np.testing.assert_array_equal(back["neg"], -np.arange(4.0, dtype=np.float32))
    np.testing.assert_array_equal(back["grad"], np.arange(4.0, dtype=np.float32))


@pytest.mark.parametrize(
    "leaf, type_name",
    [
        (object(), "builtins.object"),
        (1 + 2j, "builtins.complex"),
        ({1, 2}, "builtins.set"),
        (torch.nn.Linear(1, 1).forward, "builtins.method"),  # a module itself is stateful: saved
    ],
    ids=["object", "complex", "set", "method"],
)
def test_unsupported_leaf_type_names_path_and_type(ckdir, leaf, type_name):
    with pytest.raises(tsckpt.LeafTypeError) as ei:
        tsckpt.save(ckdir, {"a": [1, {"bad key": leaf}]})
    msg = str(ei.value)
    assert msg.startswith("'a/1/bad%20key': leaf of type " + type_name + " cannot be stored")
    assert "supported leaves are torch.Tensor" in msg
    assert isinstance(ei.value, TypeError)
    assert not os.path.exists(ckdir)  # rejected before anything is written


def test_unsupported_numpy_dtype(ckdir):
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'s': numpy dtype <U3 cannot be stored"):
        tsckpt.save(ckdir, {"s": np.array(["abc"])})
    with pytest.raises(TypeError, match=r"'o': numpy dtype object cannot be stored"):
        tsckpt.save(ckdir, {"o": np.array([None, 1], dtype=object)})
    assert not os.path.exists(ckdir)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_unsupported_torch_dtype(ckdir):
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'q': torch dtype torch.quint8 cannot be stored; convert it first"):
        tsckpt.save(ckdir, {"q": q})


def test_big_endian_numpy_is_stored_little_endian_with_same_values(ckdir):
    a = np.array([1.5, -2.25, np.inf], dtype=">f8")
    tsckpt.save(ckdir, {"a": a})
    out = tsckpt.restore(ckdir)["a"]
    assert out.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(out, a)
    with open(os.path.join(ckdir, "a", "zarr.json")) as f:
        assert json.load(f)["data_type"] == "float64"


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_a_torch_dtypes_numpy_twin_holds_its_elements_byte_for_byte(dtype):
    from tsckpt._base import dtypes as _dtypes

    name = _dtypes.torch_name(dtype)
    twin = _dtypes.numpy_twin(name)
    if name == "complex32" or name.endswith("_x2") or name.startswith("bits"):
        assert twin is None
        return
    t = torch.arange(8).to(dtype) if dtype != torch.bool else torch.arange(8) % 3 == 0
    assert twin is not None and twin.itemsize == t.element_size()
    held = t.view(torch.uint8).numpy().view(twin)
    saved = _dtypes.tensor_to_numpy(t)  # what a save of the tensor writes
    assert held.dtype == saved.dtype and held.shape == saved.shape and held.tobytes() == saved.tobytes()
