"""Quantized tensor subclasses (torchao's MX, NVFP4 and float8 training tensors) as leaves:
saved as groups of arrays, restored into the same subclass, resharded, read offline, staged
by save_async, and unknown subclasses refused (tsckpt/_leaves/quantized.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tsckpt
from tests import quantized_scenarios as qs
from tests.dist_helpers import run_ranks

pytest.importorskip("torchao")

from torchao.prototype.mx_formats.mx_tensor import MXTensor


def _zeroed(q):
    return type(q).__tensor_unflatten__(
        {n: torch.zeros_like(t) for n, t in qs.parts(q).items()}, q.__tensor_flatten__()[1], q.shape, q.stride()
    )


@pytest.mark.parametrize("kind", qs.KINDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_each_format_restores_into_its_subclass_bit_exact(tmp_path, kind, inplace):
    q = qs.quantized(kind)
    tsckpt.save(tmp_path / "c", {"w": q, "b": torch.ones(3)})
    target = {"w": _zeroed(q), "b": torch.zeros(3)}
    out = tsckpt.restore(tmp_path / "c", target, inplace=inplace)
    assert qs.same(out["w"], q)
    assert (out["w"] is target["w"]) == inplace
    assert torch.equal(out["b"], torch.ones(3))


def test_stored_as_parts_with_metadata(tmp_path):
    q = qs.quantized("mxfp4")
    tsckpt.save(tmp_path / "c", {"w": q})
    r = tsckpt.open(tmp_path / "c")
    assert sorted(r) == ["w/qdata", "w/scale", "w/subclass"]
    assert (r["w/qdata"].dtype, r["w/qdata"].shape) == ("uint8", (8, 32))  # fp4 packed two to a byte
    assert (r["w/scale"].dtype, r["w/scale"].shape) == ("float8_e8m0fnu", (8, 2))  # one per 32 elements
    meta = json.loads(r["w/subclass"])
    assert meta["class"] == "torchao.prototype.mx_formats.mx_tensor.MXTensor"
    assert meta["shape"] == [8, 64] and meta["parts"] == [["qdata", "uint8"], ["scale", "float8_e8m0fnu"]]
    assert meta["attributes"]["elem_dtype"] == {"dtype": "float4_e2m1fn_x2"}
    assert meta["attributes"]["block_size"] == 32
    assert meta["attributes"]["orig_dtype"] == {"dtype": "bfloat16"}


@pytest.mark.parametrize("kind", qs.KINDS)
def test_open_gives_parts_and_dequantized_values(tmp_path, kind):
    q = qs.quantized(kind)
    tsckpt.save(tmp_path / "c", {"w": q})
    view = tsckpt.open(tmp_path / "c")["w"]
    assert view.shape == (8, 64) and view.subclass.endswith(type(q).__name__)
    for name, t in qs.parts(q).items():
        np.testing.assert_array_equal(view.parts[name].torch[...].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    ref = q.to_original_precision() if kind in ("float8", "float8_axiswise") else q.dequantize()
    got = view.dequantize()
    assert got.dtype == ref.dtype and torch.equal(got, ref)
    assert qs.same(view.to_torch(), q)


def test_restore_without_target_gives_the_parts(tmp_path):
    q = qs.quantized("nvfp4_pts")
    tsckpt.save(tmp_path / "c", {"w": q})
    out = tsckpt.restore(tmp_path / "c")["w"]
    assert sorted(out) == ["per_tensor_scale", "qdata", "scale", "subclass"]
    np.testing.assert_array_equal(out["qdata"], q.qdata.numpy())
    assert float(out["per_tensor_scale"]) == 0.75


def test_plain_target_of_a_stored_quantized_tensor_is_told_how(tmp_path):
    tsckpt.save(tmp_path / "c", {"w": qs.quantized("mxfp8")})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"1 \('w'\) are stored as quantized tensors.*dequantize"):
        tsckpt.restore(tmp_path / "c", {"w": torch.zeros(8, 64, dtype=torch.bfloat16)})


def test_save_async_stages_the_parts_exactly(tmp_path):
    q = qs.quantized("mxfp8")
    ref = {n: t.clone() for n, t in qs.parts(q).items()}
    saver = tsckpt.save_async(tmp_path / "c", {"w": q})
    q.qdata.view(torch.uint8).fill_(0x7F)  # NaN in float8_e4m3fn
    q.scale.view(torch.uint8).fill_(0xFF)  # NaN in e8m0
    saver.result(timeout=60)
    out = tsckpt.restore(tmp_path / "c", {"w": _zeroed(q)})["w"]
    for n, t in ref.items():
        assert torch.equal(getattr(out, n).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert not out.dequantize().isnan().any()


def test_wrong_format_target_is_refused(tmp_path):
    tsckpt.save(tmp_path / "c", {"w": qs.quantized("nvfp4_pts")})
    with pytest.raises(tsckpt.StructureMismatchError, match="'w/per_tensor_scale'"):
        tsckpt.restore(tmp_path / "c", {"w": qs.quantized("nvfp4")})
    tsckpt.save(tmp_path / "d", {"w": qs.quantized("mxfp8")})
    with pytest.raises(tsckpt.StructureMismatchError, match="'w': part 'qdata' is stored as float8_e4m3fn but the target's is float8_e5m2"):
        tsckpt.restore(tmp_path / "d", {"w": qs.quantized("mxfp8_e5m2")}, casting="unsafe")


def test_unknown_subclass_is_refused_naming_leaf_and_type(tmp_path):
    from torch.testing._internal.two_tensor import TwoTensor

    with pytest.raises(tsckpt.LeafTypeError, match=r"'model/w'.*TwoTensor.*does not know"):
        tsckpt.save(tmp_path / "c", {"model": {"w": TwoTensor(torch.ones(2), torch.ones(2))}})
    assert not (tmp_path / "c").exists()


def test_metadata_naming_other_classes_is_refused_or_a_plain_value(tmp_path):
    meta = {"class": "torchao.prototype.mx_formats.mx_tensor.MXTensor", "shape": [2], "parts": [["qdata", "float32"]],
            "attributes": {"k": {"enum": "os:system", "value": "true"}}}
    tsckpt.save(tmp_path / "c", {"w": {"qdata": torch.ones(2), "subclass": json.dumps(meta)},
                                 "v": {"a": torch.ones(2), "subclass": "a user's string"}})
    r = tsckpt.open(tmp_path / "c")
    with pytest.raises(tsckpt.LeafTypeError, match="'w'.*'os:system'; tsckpt only builds classes of torchao"):
        r["w"].to_torch()
    with pytest.raises(KeyError, match="'v' is not a leaf"):
        r["v"]
    meta["class"] = "torchao.no_such_module.Y"
    tsckpt.save(tmp_path / "d", {"w": {"qdata": torch.ones(2), "subclass": json.dumps(meta)}})
    with pytest.raises(tsckpt.LeafTypeError, match="'w'.*'torchao.no_such_module:Y', which cannot be imported"):
        tsckpt.open(tmp_path / "d")["w"].to_torch()


def test_swizzled_scales_whole_but_not_by_region(tmp_path):
    x = qs.hp().repeat(32, 2)  # 256 x 128: whole tiles of the swizzle
    q = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, is_swizzled_scales=True)
    tsckpt.save(tmp_path / "c", {"w": q})
    assert qs.same(tsckpt.restore(tmp_path / "c", {"w": _zeroed(q)})["w"], q)
    assert torch.equal(tsckpt.open(tmp_path / "c")["w"].dequantize(), q.dequantize())
    with pytest.raises(tsckpt.LeafTypeError, match="'v': a sharded MXTensor with swizzled"):
        tsckpt.save(tmp_path / "d", {"v": tsckpt.ShardedArray(q, (512, 128), (256, 0))})


@pytest.mark.parametrize("kind", ["mxfp8", "mxfp4"])
def test_transposed_quantized_tensor_is_refused(tmp_path, kind):
    with pytest.raises(tsckpt.LeafTypeError, match=r"'w': part 'qdata' of the MXTensor is not contiguous"):
        tsckpt.save(tmp_path / "c", {"w": qs.quantized(kind).t()})


def test_hp_float8_weight_is_saved_as_its_tensor(tmp_path):
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    x = qs.hp()
    w = WeightWithDynamicFloat8CastTensor(x.clone(), LinearMMConfig(), torch.float8_e4m3fn)
    tsckpt.save(tmp_path / "c", {"w": w})
    r = tsckpt.open(tmp_path / "c")
    assert list(r) == ["w"] and r["w"].dtype == "bfloat16"  # a plain array: the float8 cast is no state
    target = WeightWithDynamicFloat8CastTensor(torch.zeros_like(x), LinearMMConfig(), torch.float8_e4m3fn)
    assert tsckpt.restore(tmp_path / "c", {"w": target}, inplace=True)["w"] is target
    assert torch.equal(target._tensor, x)
    assert torch.equal(tsckpt.restore(tmp_path / "c", {"w": torch.zeros_like(x)})["w"], x)  # into a plain model


def test_region_off_a_block_boundary_is_refused(tmp_path):
    q = qs.quantized("mxfp8")
    half = qs.shard(q, 1, 0, 32)
    bad = tsckpt.ShardedArray(half, (8, 64), (0, 16))  # columns 16..48: not on blocks of 32
    with pytest.raises(tsckpt.LeafTypeError, match=r"'w'.*dimension 1.*blocks of 32"):
        tsckpt.save(tmp_path / "c", {"w": bad})


@pytest.mark.slow  # starts gloo ranks
@pytest.mark.parametrize("dim,hand_made", [(0, False), (1, False), (0, True)])
def test_two_ranks_to_one_and_one_to_two(tmp_path, dim, hand_made):
    d2, d1 = str(tmp_path / "two"), str(tmp_path / "one")
    run_ranks(qs.save_sharded, 2, d2, dim, hand_made, timeout=180)
    kinds = [k for k in qs.KINDS if not (dim == 1 and k == "float8_axiswise")]
    for kind in kinds:  # 2 -> 1: the whole tensor, bit-exact
        full = qs.quantized(kind)
        got = tsckpt.restore(d2, {kind: _zeroed(full)}, strict=False)[kind]
        assert qs.same(got, full), kind
    tsckpt.save(d1, {k: qs.quantized(k) for k in kinds})
    for inplace in (False, True):  # 1 -> 2
        assert run_ranks(qs.restore_sharded, 2, d1, dim, hand_made, inplace, timeout=180) == [[], []]


@pytest.mark.slow  # starts gloo ranks
def test_fsdp2_float8_training_two_ranks_to_one_and_back(tmp_path):
    d = str(tmp_path / "c")
    assert run_ranks(qs.save_fsdp2_float8, 2, d, timeout=180) == ["WeightWithDynamicFloat8CastTensor"] * 2
    r = tsckpt.open(d)
    assert r["model/0.weight"].dtype == "float32" and r["model/0.weight"].shape == (32, 64)
    assert run_ranks(qs.restore_fsdp2_float8, 2, d, timeout=180) == [[], []]


# ---- block-scaled fp8 weights to and from Hugging Face checkpoints -----------------------


def _block_fp8(x, block=(128, 128)):
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock

    return Float8Tensor.from_hp(x, granularity=PerBlock(list(block)))


def _hf_fp8_dir(tmp_path, config, cli=False, max_shard_size=None):
    """A tsckpt checkpoint of a block-scaled fp8 weight (256 x 384, 2 x 3 blocks) and a
    bf16 norm, converted to a Hugging Face directory with ``config`` copied from (through
    ``tsckpt convert`` with ``cli``)."""
    from tsckpt._cli import main

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 384, generator=g).to(torch.bfloat16)
    w = _block_fp8(x)
    norm = torch.randn(384, generator=g).to(torch.bfloat16)
    tsckpt.save(tmp_path / "c", {"l.weight": w, "norm.weight": norm})
    if cli:
        argv = ["convert", str(tmp_path / "c"), str(tmp_path / "hf"), "--to", "safetensors", "--copy-from", str(src)]
        assert main(argv) == 0
    else:
        tsckpt.convert(
            tmp_path / "c", tmp_path / "hf", to_format="safetensors", copy_from=src, max_shard_size=max_shard_size
        )
    return w, norm, tmp_path / "hf"


def test_convert_writes_block_fp8_as_weight_and_scale_inv(tmp_path):
    from safetensors import safe_open

    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    w, norm, hf = _hf_fp8_dir(tmp_path, {"model_type": "x", "torch_dtype": "float32", "quantization_config": qc})
    with safe_open(hf / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["l.weight", "l.weight_scale_inv", "norm.weight"]
        weight, scale = f.get_tensor("l.weight"), f.get_tensor("l.weight_scale_inv")
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (2, 3)
        assert torch.equal(weight.view(torch.uint8), w.qdata.view(torch.uint8)) and torch.equal(scale, w.scale)
        assert torch.equal(f.get_tensor("norm.weight"), norm)
    config = json.loads((hf / "config.json").read_text())
    assert config["quantization_config"] == qc and config["torch_dtype"] == "bfloat16"


def test_convert_adds_a_quantization_config_where_none_is(tmp_path):
    _, _, hf = _hf_fp8_dir(tmp_path, {"model_type": "x"}, cli=True)
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_hf_block_fp8_restores_into_float8_and_bf16_targets_by_region(tmp_path, monkeypatch):
    import tsckpt.torch
    from tsckpt._read.reader import LazyArray

    reads = []
    real = LazyArray.read  # what arr[...] and arr.torch[...] both read through

    def recording(self, index, **kw):
        reads.append((self.path, tuple((s.start, s.stop) for s in index) if isinstance(index, tuple) else index))
        return real(self, index, **kw)

    monkeypatch.setattr(LazyArray, "read", recording)

    w, norm, hf = _hf_fp8_dir(tmp_path, {"model_type": "x"})
    ref = w.dequantize()
    out = tsckpt.torch.restore_fp8_blocks(hf, {"l.weight": torch.zeros(256, 384, dtype=torch.bfloat16),
                                               "norm.weight": torch.zeros(384, dtype=torch.bfloat16)})
    assert torch.equal(out["l.weight"], ref) and torch.equal(out["norm.weight"], norm)
    target = _block_fp8(torch.zeros(256, 384, dtype=torch.bfloat16))
    tsckpt.torch.restore_fp8_blocks(hf, {"l.weight": target})
    assert qs.same(target, w)
    rows = tsckpt.ShardedArray(torch.zeros(100, 384, dtype=torch.bfloat16), (256, 384), (100, 0))  # inside blocks
    reads.clear()
    tsckpt.torch.restore_fp8_blocks(hf, {"l.weight": rows})
    assert torch.equal(rows.local, ref[100:200])
    # only the rows of the region, and the two row blocks of scales that cover them
    assert sorted(reads) == [("l.weight", ((100, 200), (0, 384))), ("l.weight_scale_inv", ((0, 2), (0, 3)))]
    half = _block_fp8(torch.zeros(128, 384, dtype=torch.bfloat16))
    tsckpt.torch.restore_fp8_blocks(hf, {"l.weight": tsckpt.ShardedArray(half, (256, 384), (128, 0))})
    assert torch.equal(half.qdata.view(torch.uint8), w.qdata[128:].view(torch.uint8))
    assert torch.equal(half.scale, w.scale[1:])


def test_hf_block_fp8_from_a_sharded_directory(tmp_path):
    import tsckpt.torch

    w, norm, hf = _hf_fp8_dir(tmp_path, {"model_type": "x"}, max_shard_size="64KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2 and set(index) == {"l.weight", "l.weight_scale_inv", "norm.weight"}
    target = _block_fp8(torch.zeros(256, 384, dtype=torch.bfloat16))
    out = tsckpt.torch.restore_fp8_blocks(hf, {"l.weight": target, "norm.weight": torch.zeros(384, dtype=torch.bfloat16)})
    assert qs.same(target, w) and torch.equal(out["norm.weight"], norm)


@pytest.mark.slow  # starts gloo ranks
def test_hf_block_fp8_into_dtensor_row_shards_on_two_ranks(tmp_path):
    _, _, hf = _hf_fp8_dir(tmp_path, {"model_type": "x"})
    assert run_ranks(qs.restore_hf_fp8, 2, str(hf), timeout=180) == [[], []]
