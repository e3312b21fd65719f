"""The ready-made Flax <-> torch rules (tsckpt/mappings.py) and mapping= on restore, open and
metadata: a Flax NNX model's checkpoint restores into the equivalent torch module, and back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt.mappings import Concat, MappingError, Reshape, Rule, Rules, Split, Transpose, flax_to_torch, torch_to_flax

nnx = pytest.importorskip("flax.nnx")
jnp = pytest.importorskip("jax.numpy")


class FlaxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(10, 8, rngs=rngs)
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, epsilon=1e-6, rngs=rngs)
        self.rms = nnx.RMSNorm(16, epsilon=1e-6, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, ids):
        h = self.l1(self.embed(ids))
        return self.l2(self.rms(self.norm(nnx.relu(h))))


class TorchNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.l1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16, eps=1e-6)
        self.rms = torch.nn.RMSNorm(16, eps=1e-6)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, ids):
        h = self.l1(self.embed(ids))
        return self.l2(self.rms(self.norm(torch.relu(h))))


IDS = np.array([[1, 2, 3], [9, 0, 4]])


def _flax_net(seed: int) -> FlaxNet:
    net = FlaxNet(nnx.Rngs(seed))
    # non-trivial norm parameters, so that a scale or bias restored to the wrong place shows
    net.norm.scale[...] = jnp.linspace(0.5, 1.5, 16)
    net.norm.bias[...] = jnp.linspace(-0.1, 0.1, 16)
    net.rms.scale[...] = jnp.linspace(1.5, 0.5, 16)
    return net


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


@pytest.mark.slow(reason="Flax NNX models built and run: JAX compiles")
def test_a_flax_nnx_checkpoint_restores_into_the_torch_module(tmp_path):
    flax_net = _flax_net(0)
    tsckpt.save(tmp_path / "flax", nnx.state(flax_net, nnx.Param))
    model = TorchNet()
    state = tsckpt.restore(tmp_path / "flax", model.state_dict(), mapping=flax_to_torch())
    model.load_state_dict(state)
    np.testing.assert_array_equal(_bits(model.l1.weight.detach()), _bits(np.asarray(flax_net.l1.kernel[...]).T))
    np.testing.assert_array_equal(_bits(model.embed.weight.detach()), _bits(flax_net.embed.embedding[...]))
    np.testing.assert_array_equal(_bits(model.rms.weight.detach()), _bits(flax_net.rms.scale[...]))
    # bit-exact against the module given the Flax weights converted by hand
    by_hand = TorchNet()
    flax_params = {
        "embed.weight": flax_net.embed.embedding, "l1.weight": flax_net.l1.kernel, "l1.bias": flax_net.l1.bias,
        "norm.weight": flax_net.norm.scale, "norm.bias": flax_net.norm.bias, "rms.weight": flax_net.rms.scale,
        "l2.weight": flax_net.l2.kernel, "l2.bias": flax_net.l2.bias,
    }
    by_hand.load_state_dict({
        name: torch.from_numpy(np.array(v[...]).T.copy() if name.endswith("weight") and v[...].ndim == 2
                               and "embed" not in name else np.array(v[...]))
        for name, v in flax_params.items()
    })
    with torch.no_grad():
        got = model(torch.from_numpy(IDS))
        assert torch.equal(got, by_hand(torch.from_numpy(IDS)))
    want = np.asarray(flax_net(jnp.asarray(IDS)))
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=2e-6)  # two libraries' float32 kernels


class FlaxStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(10, 8, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)])
        self.norm = nnx.LayerNorm(4, epsilon=1e-6, rngs=rngs)

    def __call__(self, ids):
        return self.norm(self.layers[1](nnx.relu(self.layers[0](self.embed(ids)))))


class TorchStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)])
        self.norm = torch.nn.LayerNorm(4, eps=1e-6)

    def forward(self, ids):
        return self.norm(self.layers[1](torch.relu(self.layers[0](self.embed(ids)))))


def test_an_orbax_written_nnx_state_restores_into_the_torch_module_with_no_user_code(tmp_path):
    """Orbax stores an NNX Variable with its /value level and a list's items as the string
    keys "0", "1" (tsckpt's paths: layers/%30/kernel/value): flax_to_torch maps them onto
    layers.0.weight with nothing else said, and the outputs match the by-hand conversion bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    flax_net = FlaxStack(nnx.Rngs(4))
    flax_net.norm.scale[...] = jnp.linspace(0.5, 1.5, 4)
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", nnx.state(flax_net, nnx.Param))
        ck.wait_until_finished()
    assert "layers/%30/kernel/value" in list(tsckpt.open(tmp_path / "orbax"))
    model = TorchStack()
    model.load_state_dict(tsckpt.restore(tmp_path / "orbax", model.state_dict(), mapping=flax_to_torch()))
    np.testing.assert_array_equal(_bits(model.layers[0].weight.detach()), _bits(np.asarray(flax_net.layers[0].kernel[...]).T))
    by_hand = TorchStack()
    by_hand.load_state_dict({
        "embed.weight": torch.from_numpy(np.array(flax_net.embed.embedding[...])),
        **{f"layers.{i}.weight": torch.from_numpy(np.array(layer.kernel[...]).T.copy()) for i, layer in enumerate(flax_net.layers)},
        **{f"layers.{i}.bias": torch.from_numpy(np.array(layer.bias[...])) for i, layer in enumerate(flax_net.layers)},
        "norm.weight": torch.from_numpy(np.array(flax_net.norm.scale[...])),
        "norm.bias": torch.from_numpy(np.array(flax_net.norm.bias[...])),
    })
    with torch.no_grad():
        assert torch.equal(model(torch.from_numpy(IDS)), by_hand(torch.from_numpy(IDS)))
    # the same rules on tsckpt's own names of that state (no /value level, the list's items as 0, 1)
    tsckpt.save(tmp_path / "own", nnx.state(flax_net, nnx.Param))
    again = TorchStack()
    again.load_state_dict(tsckpt.restore(tmp_path / "own", again.state_dict(), mapping=flax_to_torch()))
    with torch.no_grad():
        assert torch.equal(again(torch.from_numpy(IDS)), by_hand(torch.from_numpy(IDS)))


@pytest.mark.slow(reason="Flax NNX models built and run: JAX compiles")
def test_a_torch_checkpoint_restores_into_the_flax_nnx_model_and_back_bit_exact(tmp_path):
    model = TorchNet()
    torch.nn.init.uniform_(model.norm.weight, 0.5, 1.5)
    torch.nn.init.uniform_(model.rms.weight, 0.5, 1.5)
    tsckpt.save(tmp_path / "torch", model.state_dict())
    flax_net = FlaxNet(nnx.Rngs(1))
    rules = torch_to_flax(embeddings=["embed"])
    restored = tsckpt.restore(tmp_path / "torch", nnx.state(flax_net, nnx.Param), mapping=rules)
    nnx.update(flax_net, restored)
    np.testing.assert_array_equal(_bits(flax_net.l2.kernel[...]), _bits(model.l2.weight.detach().numpy().T))
    np.testing.assert_array_equal(_bits(flax_net.norm.scale[...]), _bits(model.norm.weight.detach().numpy()))
    with torch.no_grad():
        want = model(torch.from_numpy(IDS)).numpy()
    np.testing.assert_allclose(np.asarray(flax_net(jnp.asarray(IDS))), want, rtol=2e-6, atol=2e-6)
    # and back: the Flax model's checkpoint into a fresh torch module gives the very outputs
    tsckpt.save(tmp_path / "flax", nnx.state(flax_net, nnx.Param))
    again = TorchNet()
    again.load_state_dict(tsckpt.restore(tmp_path / "flax", again.state_dict(), mapping=flax_to_torch()))
    with torch.no_grad():
        assert torch.equal(again(torch.from_numpy(IDS)), torch.from_numpy(want))


@pytest.mark.slow(reason="Flax NNX models built and run: JAX compiles")
def test_conv_kernels_are_permuted(tmp_path):
    conv = nnx.Conv(3, 5, kernel_size=(3, 2), padding="VALID", rngs=nnx.Rngs(2))
    tsckpt.save(tmp_path / "c", {"conv": nnx.state(conv, nnx.Param)})
    tmodel = torch.nn.ModuleDict({"conv": torch.nn.Conv2d(3, 5, (3, 2))})
    tmodel.load_state_dict(tsckpt.restore(tmp_path / "c", tmodel.state_dict(), mapping=flax_to_torch()))
    x = np.random.default_rng(0).standard_normal((2, 6, 7, 3), dtype=np.float32)  # NHWC
    with torch.no_grad():
        got = tmodel["conv"](torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(got, np.asarray(conv(jnp.asarray(x))), rtol=1e-5, atol=1e-5)
    tsckpt.save(tmp_path / "t", tmodel.state_dict())
    target = {"conv": {"kernel": np.zeros((3, 2, 3, 5), np.float32), "bias": np.zeros(5, np.float32)}}
    back = tsckpt.restore(tmp_path / "t", target, mapping=torch_to_flax())
    np.testing.assert_array_equal(_bits(back["conv"]["kernel"]), _bits(conv.kernel[...]))


def test_open_and_metadata_show_the_mapped_tree(tmp_path):
    tsckpt.save(tmp_path / "c", {"params": {"l1": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}, "step": 7})
    rules = flax_to_torch(stored_prefix="params/")
    reader = tsckpt.open(tmp_path / "c", mapping=rules)
    assert sorted(reader) == ["l1.weight", "step"]
    arr = reader["l1.weight"]
    assert arr.shape == (3, 2) and arr.dtype == "float32" and reader["step"] == 7
    np.testing.assert_array_equal(arr[1:, 1], np.arange(6, dtype=np.float32).reshape(2, 3).T[1:, 1])
    np.testing.assert_array_equal(np.asarray(arr), np.arange(6, dtype=np.float32).reshape(2, 3).T)
    meta = tsckpt.metadata(tmp_path / "c", mapping=rules)
    assert meta["l1.weight"].shape == (3, 2) and meta["step"] == 7
    assert set(tsckpt.restore(tmp_path / "c", mapping=rules)) == {"l1.weight", "step"}


def test_fused_arrays_split_and_join(tmp_path):
    qkv = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    tsckpt.save(tmp_path / "c", {"attn": {"qkv": qkv}})
    split = Rules([Rule("attn/qkv", ("q", "k", "v"), (Split(0, 3), Transpose((1, 0))))])
    out = tsckpt.restore(tmp_path / "c", {n: torch.zeros(4, 2) for n in "qkv"}, mapping=split)
    for i, n in enumerate("qkv"):
        assert torch.equal(out[n], torch.from_numpy(qkv[2 * i : 2 * i + 2].T.copy()))
    tsckpt.save(tmp_path / "parts", {n: qkv[2 * i : 2 * i + 2] for i, n in enumerate("qkv")})
    join = Rules([Rule(("q", "k", "v"), "qkv", Concat(0))])
    fused = tsckpt.restore(tmp_path / "parts", {"qkv": np.zeros((6, 4), np.float32)}, mapping=join)
    np.testing.assert_array_equal(fused["qkv"], qkv)


def test_a_cast_follows_the_casting_rule(tmp_path):
    tsckpt.save(tmp_path / "c", {"l": {"kernel": np.arange(6, dtype=np.float64).reshape(2, 3)}})
    rules = Rules([Rule("{m}/kernel", "{m}.weight", Transpose((1, 0)))])
    out = tsckpt.restore(tmp_path / "c", {"l.weight": torch.zeros(3, 2, dtype=torch.float32)}, mapping=rules)
    assert out["l.weight"].dtype == torch.float32 and torch.equal(out["l.weight"], torch.arange(6.0).reshape(2, 3).T)
    with pytest.raises(tsckpt.LeafTypeError, match="l.weight"):
        tsckpt.restore(tmp_path / "c", {"l.weight": torch.zeros(3, 2, dtype=torch.int32)}, mapping=rules)


def test_a_rule_casts_under_the_casting_rule(tmp_path):
    """A rule's dtype: stored bfloat16 read as float32 (safe), stored float32 as bfloat16
    (same_kind: rounded, refused under "safe" naming the rule, the stored and the target path);
    open, metadata and target=None see the rule's dtype."""
    import ml_dtypes

    w = np.array([[1.0, 2.5, -3.0], [0.1, 1e-3, 7.0]], np.float32)
    tsckpt.save(tmp_path / "c", {"a": {"kernel": w.astype(ml_dtypes.bfloat16)}, "b": {"kernel": w}})
    up = Rules([Rule("a/kernel", "a.weight", Transpose((1, 0)), dtype="float32")], unmatched="drop")
    out = tsckpt.restore(tmp_path / "c", {"a.weight": torch.zeros(3, 2)}, mapping=up)
    assert torch.equal(out["a.weight"], torch.from_numpy(w.astype(ml_dtypes.bfloat16).astype(np.float32).T.copy()))
    down = Rules([Rule("b/kernel", "b.weight", Transpose((1, 0)), dtype=torch.bfloat16)], unmatched="drop")
    target = {"b.weight": torch.zeros(3, 2, dtype=torch.bfloat16)}
    got = tsckpt.restore(tmp_path / "c", target, mapping=down)["b.weight"]
    assert torch.equal(got, torch.from_numpy(w.T.copy()).to(torch.bfloat16))
    with pytest.raises(tsckpt.LeafTypeError, match=r"casting=\"safe\" refuses stored float32 into the bfloat16 target.*"
                       r"Rule\('b/kernel' -> 'b.weight', Transpose\(perm=\(1, 0\)\), dtype=bfloat16\) \(stored "
                       r"'b/kernel', target 'b.weight'\)"):
        tsckpt.restore(tmp_path / "c", target, mapping=down, casting="safe")
    # the rule's dtype is the leaf's: a float32 target of a rule that rounds to bfloat16 is refused
    with pytest.raises(tsckpt.LeafTypeError, match=r"rule casts stored float32 into bfloat16.*target 'b.weight'"):
        tsckpt.restore(tmp_path / "c", {"b.weight": torch.zeros(3, 2)}, mapping=down)
    # a float64 target of a rule that widens bfloat16 to float32 gets the same values
    wide = tsckpt.restore(tmp_path / "c", {"a.weight": np.zeros((3, 2))}, mapping=up)["a.weight"]
    np.testing.assert_array_equal(wide, w.astype(ml_dtypes.bfloat16).astype(np.float64).T)
    arr = tsckpt.open(tmp_path / "c", mapping=down)["b.weight"]
    assert arr.dtype == "bfloat16" and np.array_equal(arr[...], w.T.astype(ml_dtypes.bfloat16))
    assert tsckpt.metadata(tmp_path / "c", mapping=up)["a.weight"].dtype == "float32"
    # a value that does not fit the rule's dtype is refused as a restore's cast refuses it
    tsckpt.save(tmp_path / "big", {"k": np.array([1.0, 1e39], np.float64)})
    narrow = Rules([Rule("k", "k32", dtype="float32")])
    with pytest.raises(tsckpt.LossyCastError, match="'k32'.*1e\\+39"):
        tsckpt.restore(tmp_path / "big", {"k32": np.zeros(2, np.float32)}, mapping=narrow)
    with pytest.raises(TypeError, match="dtype 'float7' is not a dtype tsckpt reads"):
        Rule("k", "k32", dtype="float7")


def test_errors_name_the_rule_the_stored_and_the_target_path(tmp_path):
    tsckpt.save(tmp_path / "c", {"a": {"kernel": np.zeros((2, 3), np.float32)}})
    rules = Rules([Rule("{m}/kernel", "{m}.weight", Reshape((4, 2)))])
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"Rule\('\{m\}/kernel'.*stored 'a/kernel', target 'a.weight'"):
        tsckpt.restore(tmp_path / "c", {"a.weight": np.zeros((4, 2), np.float32)}, mapping=rules)
    good = flax_to_torch()
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"'a.weight'.*mapped by Rule\('\{m\*\}/kernel'.*stored "
                       r"'a/kernel', target 'a.weight'\): shape \[3, 2\]"):  # the target's shape is not the mapped one
        tsckpt.restore(tmp_path / "c", {"a.weight": np.zeros((2, 3), np.float32)}, mapping=good)
    with pytest.raises(tsckpt.StructureMismatchError, match="missing from the checkpoint: .*'b.weight'.*--map RULES"):
        tsckpt.restore(tmp_path / "c", {"a.weight": np.zeros((3, 2), np.float32), "b.weight": np.zeros(1)}, mapping=good)
    tsckpt.save(tmp_path / "two", {"a": {"kernel": np.zeros(2)}, "b": {"kernel": np.zeros(2)}})
    twice = Rules([Rule("{y}/kernel", "w")])
    with pytest.raises(MappingError, match="target 'w' is made twice: from stored 'a/kernel' .* from stored 'b/kernel'"):
        tsckpt.open(tmp_path / "two", mapping=twice)


def test_mapping_must_be_rules(tmp_path):
    with pytest.raises(TypeError, match="mapping must be a tsckpt.mappings.Rules"):
        tsckpt.restore(tmp_path / "c", {}, mapping=[Rule("a", "b")])


@pytest.mark.slow
def test_fsdp2_ranks_read_only_the_stored_boxes_of_their_shards(tmp_path):
    from tests import map_scenarios
    from tests.dist_helpers import run_ranks

    rng = np.random.default_rng(3)
    params = {
        "l1": {"kernel": rng.standard_normal((6, 8), dtype=np.float32), "bias": rng.standard_normal(8, dtype=np.float32)},
        "norm": {"scale": rng.standard_normal(8, dtype=np.float32), "bias": rng.standard_normal(8, dtype=np.float32)},
        "l2": {"kernel": rng.standard_normal((8, 4), dtype=np.float32), "bias": rng.standard_normal(4, dtype=np.float32)},
    }
    tsckpt.save(tmp_path / "flax", {"params": params})
    results = run_ranks(map_scenarios.restore_flax_into_fsdp2, 2, str(tmp_path / "flax"), timeout=120)
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["full"]["l1.weight"], params["l1"]["kernel"].T)
        np.testing.assert_array_equal(got["full"]["l2.weight"], params["l2"]["kernel"].T)
        np.testing.assert_array_equal(got["full"]["norm.weight"], params["norm"]["scale"])
        # Shard(0) of a (out, in) weight is a column block of the stored (in, out) kernel: only that is read
        reads = got["reads"]
        assert ("params/l1/kernel", (0, 4 * rank), (6, 4)) in reads
        assert ("params/l2/kernel", (0, 2 * rank), (8, 2)) in reads
        assert [r for r in reads if r[0] == "params/l1/kernel"] == [("params/l1/kernel", (0, 4 * rank), (6, 4))]
        assert sum(int(np.prod(n)) for _, _, n in reads) == (6 * 8 + 8 + 8 + 8 + 8 * 4 + 4) // 2


def test_the_examples_of_docs_mapping_run():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "mapping.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "docs/mapping.md", "exec"), scope)  # noqa: S102 - the page's own examples


def test_read_amplification_is_measured_and_reported(tmp_path, caplog):
    from tsckpt._base.types import Dest, ReadItem
    from tsckpt._formats.sources import open_checkpoint
    from tsckpt._read.mapped import read_amplification

    tsckpt.save(tmp_path / "c", {"k": np.zeros((8, 8), np.float32)})
    ck = open_checkpoint(tmp_path / "c")
    chunk = ck.arrays["k"].chunking.chunk_shape or ck.arrays["k"].chunking.shard_shape
    assert chunk == (8, 8)  # one chunk: a column block of it touches all of it
    whole = Dest(ReadItem("k", (0, 0), (8, 8)), None, None)
    assert read_amplification(ck, [whole]) == 1.0
    caplog.set_level("INFO", logger="tsckpt")
    block = Dest(ReadItem("k", (0, 4), (8, 2)), None, None)
    assert read_amplification(ck, [block]) == 4.0
    assert "4.00x the stored bytes" in caplog.text and "'k' 4.00x (chunks [8, 8])" in caplog.text


def test_sharded_jax_targets_read_each_device_slice_from_its_stored_box(tmp_path, monkeypatch):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from tsckpt._read import restore as restore_module

    if jax.device_count() < 4:
        pytest.skip("needs 4 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    weight = torch.arange(48, dtype=torch.float32).reshape(8, 6)  # a torch Linear(6, 8) weight
    tsckpt.save(tmp_path / "t", {"fc.weight": weight, "fc.bias": torch.ones(8)})
    mesh = jax.make_mesh((4,), ("x",))
    target = {"fc": {
        "kernel": jax.ShapeDtypeStruct((6, 8), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "x"))),
        "bias": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("x"))),
    }}
    reads = []
    real = restore_module.read_into

    def counting(ck, dests, *args, **kwargs):
        reads.extend((d.item.path, d.item.storage_offsets, d.item.lengths) for d in dests)
        real(ck, dests, *args, **kwargs)

    monkeypatch.setattr(restore_module, "read_into", counting)
    out = tsckpt.restore(tmp_path / "t", target, mapping=torch_to_flax())
    np.testing.assert_array_equal(np.asarray(out["fc"]["kernel"]), weight.numpy().T)
    assert out["fc"]["kernel"].sharding == target["fc"]["kernel"].sharding
    # each device's column block of the kernel is a row block of the stored weight
    assert sorted(r for r in reads if r[0] == "fc.weight") == [("fc.weight", (2 * i, 0), (2, 6)) for i in range(4)]


def test_other_formats_read_through_a_mapping(tmp_path):
    from safetensors.torch import save_file

    w = torch.arange(12.0).reshape(3, 4)
    save_file({"fc.weight": w, "fc.bias": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    target = {"fc": {"kernel": np.zeros((4, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    out = tsckpt.restore(tmp_path / "m.safetensors", target, mapping=torch_to_flax())
    np.testing.assert_array_equal(out["fc"]["kernel"], w.numpy().T)
    np.testing.assert_array_equal(tsckpt.open(tmp_path / "m.safetensors", mapping=torch_to_flax())["fc/kernel"][1:, :2],
                                  w.numpy().T[1:, :2])


def test_a_view_the_target_memory_cannot_take_names_the_rule(tmp_path):
    tsckpt.save(tmp_path / "c", {"k": np.arange(12, dtype=np.float32)})
    rules = Rules([Rule("k", "w", Reshape((3, 4)))])
    out = tsckpt.restore(tmp_path / "c", {"w": torch.zeros(3, 4)}, mapping=rules)
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
    strided = torch.zeros(4, 3).T  # (3, 4), not contiguous: no flat view of it exists
    with pytest.raises(MappingError, match=r"Rule\('k' -> 'w', Reshape.*stored 'k', target 'w'.*without a copy"):
        tsckpt.restore(tmp_path / "c", {"w": strided}, mapping=rules, inplace=True)


def test_the_manager_restores_a_step_through_a_mapping(tmp_path):
    manager = tsckpt.CheckpointManager(tmp_path / "run")
    manager.save(3, {"l": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}})
    model = torch.nn.ModuleDict({"l": torch.nn.Linear(2, 3, bias=False)})
    out = manager.restore(target=model.state_dict(), mapping=flax_to_torch())
    assert torch.equal(out["l.weight"], torch.arange(6.0).reshape(2, 3).T)


def test_tied_leaves_read_their_stored_array_through_a_mapping(tmp_path):
    w = torch.arange(6.0).reshape(2, 3)
    tsckpt.save(tmp_path / "c", {"embed": {"embedding": w}, "head": {"w": w}})  # tied: stored once
    target = {"embed.weight": torch.zeros(2, 3), "head": {"w": torch.zeros(2, 3)}}
    out = tsckpt.restore(tmp_path / "c", target, mapping=flax_to_torch())
    assert torch.equal(out["embed.weight"], w) and torch.equal(out["head"]["w"], w)
