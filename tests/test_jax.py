"""jax.Array leaves (tsckpt._leaves.jaxarray): a JAX program writes what PyTorch restores, and back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._read import restore as _restore
from tsckpt._leaves.jaxarray import JaxKind

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

if len(jax.devices()) < 4:  # tests/conftest.py asks XLA for 4 CPU devices before jax starts
    pytest.skip("these tests need 4 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)",
                allow_module_level=True)

MESH = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
ROWS, COLS, BOTH, REPLICATED = P(("a", "b")), P(None, ("a", "b")), P("a", "b"), P()


def test_jax_to_torch_and_back(ckdir):
    tree = {
        "w": jnp.arange(24, dtype=jnp.bfloat16).reshape(4, 6),
        "b": jnp.ones(3, jnp.int32),
        "step": 5,
    }
    tsckpt.save(ckdir, tree)
    rec = tsckpt.open(ckdir).checkpoint.arrays["w"]
    assert (rec.dtype, rec.shape, rec.kind) == ("bfloat16", (4, 6), "numpy")
    out = tsckpt.restore(ckdir, {"w": torch.zeros(4, 6, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.int32), "step": 0})
    assert torch.equal(out["w"], torch.arange(24).reshape(4, 6).to(torch.bfloat16))
    assert out["b"].tolist() == [1, 1, 1] and out["step"] == 5
    back = tsckpt.restore(ckdir, {"w": jnp.zeros((4, 6), jnp.float32), "b": jnp.zeros(3, jnp.int32), "step": 0})
    assert isinstance(back["w"], jax.Array) and back["w"].dtype == jnp.float32
    assert np.array_equal(np.asarray(back["w"]), np.arange(24, dtype=np.float32).reshape(4, 6))


def test_torch_to_jax(ckdir):
    w = torch.randn(5, 3).to(torch.bfloat16)
    tsckpt.save(ckdir, {"w": w})
    out = tsckpt.restore(ckdir, {"w": jnp.zeros((5, 3), jnp.bfloat16)})
    assert np.array_equal(np.asarray(out["w"]).view(np.uint16), w.view(torch.int16).numpy().view(np.uint16))
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"'w': target shape \[3, 5\] but the checkpoint stores \[5, 3\]"):
        tsckpt.restore(ckdir, {"w": jnp.zeros((3, 5), jnp.bfloat16)})


# save_async of jax.Arrays: tests/test_jax_async.py


def _values(shape, dtype=np.float32):
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def _sharded(x, spec):
    return jax.device_put(x, NamedSharding(MESH, spec))


@pytest.fixture
def reads(monkeypatch):
    """The regions each restore reads, leaf path -> [(offsets, lengths)], in order."""
    seen: dict[str, list] = {}
    read_into = _restore.read_into

    def spy(ck, dests, *args, **kwargs):
        for d in dests:
            seen.setdefault(d.item.path, []).append((d.item.storage_offsets, d.item.lengths))
        return read_into(ck, dests, *args, **kwargs)

    monkeypatch.setattr(_restore, "read_into", spy)
    return seen


@pytest.mark.parametrize("spec", [ROWS, COLS, BOTH, REPLICATED], ids=["rows", "cols", "2d", "replicated"])
def test_sharded_save_and_restore(ckdir, spec, reads):
    """A sharded jax.Array is one global array; its ShapeDtypeStruct restore reads each device's slice alone."""
    x = _values((8, 12))
    tsckpt.save(ckdir, {"a": _sharded(x, spec)})
    assert np.array_equal(tsckpt.restore(ckdir, {"a": torch.zeros(8, 12)})["a"].numpy(), x)
    reads.clear()
    sharding = NamedSharding(MESH, spec)
    out = tsckpt.restore(ckdir, {"a": jax.ShapeDtypeStruct((8, 12), jnp.float32, sharding=sharding)})["a"]
    assert isinstance(out, jax.Array) and out.sharding == sharding
    assert np.array_equal(np.asarray(out), x)
    for shard in out.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), x[shard.index])
    distinct = {tuple((sl.start or 0, sl.stop or n) for sl, n in zip(s.index, (8, 12))) for s in out.addressable_shards}
    assert len(reads["a"]) == len(distinct)  # one read per distinct slice: replicas are read once
    assert sorted(reads["a"]) == sorted(
        (tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in distinct
    )


def test_column_sharded_target_reads_only_its_columns(ckdir, reads):
    x = _values((4, 16))
    tsckpt.save(ckdir, {"a": x})
    target = jax.device_put(jnp.zeros((4, 16)), NamedSharding(MESH, COLS))
    out = tsckpt.restore(ckdir, {"a": target})["a"]
    assert sorted(reads["a"]) == [((0, c), (4, 4)) for c in (0, 4, 8, 12)]
    assert out.sharding == target.sharding and np.array_equal(np.asarray(out), x)


def test_save_reads_shards_not_the_gathered_array(ckdir, monkeypatch):
    """Saving reads boxes of the device shards: never numpy of the whole (multi-device) array."""
    a = _sharded(_values((8, 12)), COLS)
    asked = []
    real = np.asarray

    def spy(obj, *args, **kwargs):
        if isinstance(obj, jax.Array):
            asked.append(len(obj.devices()))
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(np, "asarray", spy)
    tsckpt.save(ckdir, {"a": a})
    monkeypatch.undo()
    assert asked and set(asked) == {1}
    assert np.array_equal(tsckpt.restore(ckdir)["a"], _values((8, 12)))


@pytest.mark.parametrize("spec", [ROWS, COLS, BOTH, REPLICATED], ids=["rows", "cols", "2d", "replicated"])
def test_save_writes_each_file_from_one_device_shard(ckdir, spec, monkeypatch, small_chunks):
    """Shard files are cut at the device shards' boundaries: every file's source is a view of one
    device shard's memory, nothing is assembled, and the bytes round-trip."""
    from tsckpt._leaves import jaxarray as _jax

    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)  # 24 KiB: files of 4 KiB
    a = _sharded(x, spec)
    buffers = [np.asarray(s.data) for s in a.addressable_shards]
    sources = []
    read = _jax._Shards.read

    def spy(self, box):
        out = read(self, box)
        sources.append(out)
        return out

    def refuse(self, box):
        raise AssertionError(f"assembled a copy of {box}")

    monkeypatch.setattr(_jax._Shards, "read", spy)
    monkeypatch.setattr(_jax._Shards, "_assemble", refuse)
    tsckpt.save(ckdir, {"a": a})
    monkeypatch.undo()
    rec = tsckpt.open(ckdir).checkpoint.arrays["a"]
    distinct = {str(s.index) for s in a.addressable_shards}
    assert rec.chunking.chunk_shape is not None and len(sources) >= 2 * len(distinct)  # several files per shard
    assert all(any(np.shares_memory(src, b) for b in buffers) for src in sources)
    assert sum(src.size for src in sources) == x.size  # replicas once, every element once
    assert np.array_equal(tsckpt.restore(ckdir)["a"].view(np.uint32), x.view(np.uint32))
    back = tsckpt.restore(ckdir, {"a": jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=NamedSharding(MESH, spec))})
    assert np.array_equal(np.asarray(back["a"]).view(np.uint32), x.view(np.uint32))


def test_abstract_target_without_sharding_is_one_device(ckdir):
    tsckpt.save(ckdir, {"w": _values((3, 5)), "b": np.ones(2, np.int32)})
    out = tsckpt.restore(ckdir, jax.eval_shape(lambda: {"w": jnp.zeros((3, 5), jnp.bfloat16), "b": jnp.zeros(2, jnp.int32)}))
    assert out["w"].dtype == jnp.bfloat16 and len(out["w"].devices()) == 1
    assert np.array_equal(np.asarray(out["w"], np.float32), _values((3, 5)))
    assert out["b"].tolist() == [1, 1]
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"'w': target shape \[5, 3\]"):
        tsckpt.restore(ckdir, {"w": jax.ShapeDtypeStruct((5, 3), jnp.float32), "b": jnp.zeros(2, jnp.int32)})


@pytest.mark.filterwarnings("ignore:.*target tree and checkpoint differ")  # each case restores one leaf
def test_plain_numbers_restore_into_scalar_jax_targets(ckdir):
    """A step saved as a Python int restores into jax.eval_shape's abstract state (a shape-()
    ShapeDtypeStruct) as a jax scalar of the target's dtype and sharding, its cast checked."""
    tsckpt.save(ckdir, {"step": 5, "lr": 0.5, "done": True, "big": 2**40, "name": "run", "w": _values((2, 2))})
    abstract = jax.eval_shape(lambda: {"step": 0, "lr": 0.0, "done": False, "w": jnp.zeros((2, 2))})
    replicated = NamedSharding(MESH, P())
    abstract["step"] = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    out = tsckpt.restore(ckdir, abstract, strict=False)
    assert [(out[k].dtype, out[k].item()) for k in ("step", "lr", "done")] == [
        (jnp.int32, 5), (jnp.float32, 0.5), (jnp.bool_, True)]
    assert out["step"].sharding == replicated and isinstance(out["lr"], jax.Array)
    with pytest.raises(tsckpt.LossyCastError, match=r"^'big': stored int64 values do not fit the int32 target"):
        tsckpt.restore(ckdir, {"big": jax.ShapeDtypeStruct((), jnp.int32)}, strict=False)
    with pytest.warns(tsckpt.RestoreWarning, match=r"'big': casting=\"unsafe\" changed 1 of the 1 stored int64"):
        assert tsckpt.restore(ckdir, {"big": jnp.int32(1)}, strict=False, casting="unsafe")["big"].item() == 0
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'name': the checkpoint stores a plain value \(str\) but "
                       r"the target leaf is a jax int32\[\] array; .* give a target of shape \(\) for a number, "
                       r"or the plain value itself \(e.g. the saved one, 'run'\) as this target leaf$"):
        tsckpt.restore(ckdir, {"name": jax.ShapeDtypeStruct((), jnp.int32)}, strict=False)
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'step': the checkpoint stores a plain value \(int\) but the "
                       r"target leaf is a jax int32\[3\] array"):
        tsckpt.restore(ckdir, {"step": jax.ShapeDtypeStruct((3,), jnp.int32)}, strict=False)
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'step': a jax.ShapeDtypeStruct target cannot be filled in place"):
        tsckpt.restore(ckdir, {"step": jax.ShapeDtypeStruct((), jnp.int32)}, strict=False, inplace=True)
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'step': the checkpoint stores a plain value \(int\) but the "
                       r"target leaf is ndarray, which takes an array; give a plain value as this target leaf "
                       r"\(e.g. the saved one, 5\)"):
        tsckpt.restore(ckdir, {"step": np.zeros(())}, strict=False)


def test_jax_targets_are_not_filled_in_place(ckdir):
    tsckpt.save(ckdir, {"w": _values((2, 2))})
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'w': a jax.Array target cannot be filled in place \(jax arrays "
                       r"are immutable\); pass inplace=False"):
        tsckpt.restore(ckdir, {"w": jnp.zeros((2, 2))}, inplace=True)
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'w': a jax.ShapeDtypeStruct target cannot be filled in place"):
        tsckpt.restore(ckdir, {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)}, inplace=True)


def test_sharding_that_cannot_lay_out_the_stored_shape(ckdir):
    tsckpt.save(ckdir, {"w": _values((8, 12))})
    three = NamedSharding(Mesh(np.array(jax.devices()[:3]), ("z",)), P("z"))
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'w': the target's sharding .* cannot lay out the stored shape "
                       r"\[8, 12\]: .*give a sharding whose shard shapes divide the stored shape$"):
        tsckpt.restore(ckdir, {"w": jax.ShapeDtypeStruct((8, 12), jnp.float32, sharding=three)})


def test_abstract_leaf_cannot_be_saved(ckdir):
    with pytest.raises(tsckpt.LeafTypeError, match="^'w': a ShapeDtypeStruct is a restore target only"):
        tsckpt.save(ckdir, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_parts_of_a_cast_share_one_check(ckdir):
    """A cast into a sharded target is checked once for the leaf, over all its slices."""
    tsckpt.save(ckdir, {"w": np.array([[1, 2], [3, 1000]], np.int32)})
    with pytest.raises(tsckpt.LossyCastError, match="'w'"):
        tsckpt.restore(ckdir, {"w": jax.ShapeDtypeStruct((2, 2), jnp.int8, sharding=NamedSharding(MESH, BOTH))})
    dest = JaxKind().destination(tsckpt.open(ckdir).checkpoint.arrays["w"], "w",
                                 jax.ShapeDtypeStruct((2, 2), jnp.int8, sharding=NamedSharding(MESH, BOTH)),
                                 False, "unsafe")
    assert len(dest.parts) == 4 and len({id(p.cast) for p in dest.parts}) == 1


# ---- typed PRNG keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_round_trip(ckdir, impl):
    keys = jax.random.split(jax.random.key(7, impl=impl), 4)
    tsckpt.save(ckdir, {"k": keys, "one": jax.random.key(3, impl=impl)})
    rec = tsckpt.open(ckdir).checkpoint.arrays["k"]
    assert (rec.kind, rec.dtype, rec.shape) == (f"jax_key:{impl}", "uint32", tuple(jax.random.key_data(keys).shape))
    target = {"k": jax.random.split(jax.random.key(0, impl=impl), 4), "one": jax.random.key(0, impl=impl)}
    out = tsckpt.restore(ckdir, target)
    assert jax.dtypes.issubdtype(out["k"].dtype, jax.dtypes.prng_key) and str(jax.random.key_impl(out["k"])) == impl
    assert np.array_equal(jax.random.key_data(out["k"]), jax.random.key_data(keys))
    abstract = tsckpt.restore(ckdir, jax.eval_shape(lambda: target))
    assert np.array_equal(jax.random.key_data(abstract["one"]), jax.random.key_data(jax.random.key(3, impl=impl)))
    raw = tsckpt.restore(ckdir)["k"]  # no target: the key data
    assert raw.dtype == np.uint32 and np.array_equal(raw, jax.random.key_data(keys))


def test_sharded_keys(ckdir):
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(MESH, ROWS))
    tsckpt.save(ckdir, {"k": keys})
    sharding = NamedSharding(MESH, ROWS)
    out = tsckpt.restore(ckdir, {"k": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=sharding)})["k"]
    assert out.sharding == sharding and np.array_equal(jax.random.key_data(out), jax.random.key_data(keys))


def test_key_target_takes_raw_key_data(ckdir):
    """Orbax stores typed keys as their raw uint32 key data: a typed-key target reads it as keys."""
    tsckpt.save(ckdir, {"k": np.asarray(jax.random.key_data(jax.random.key(5)))})
    out = tsckpt.restore(ckdir, {"k": jax.random.key(0)})["k"]
    assert np.array_equal(jax.random.key_data(out), jax.random.key_data(jax.random.key(5)))
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"^'k': the target is threefry2x32 PRNG keys of shape \[3\], "
                       r"whose key data is uint32\[3, 2\], but the checkpoint stores uint32\[2\]"):
        tsckpt.restore(ckdir, {"k": jax.random.split(jax.random.key(0), 3)})


def test_orbax_written_key(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "ob", {"k": jax.random.key(9), "w": jnp.ones(3)})
    ck.wait_until_finished()
    out = tsckpt.restore(tmp_path / "ob", {"k": jax.random.key(0), "w": jnp.zeros(3)})
    assert np.array_equal(jax.random.key_data(out["k"]), jax.random.key_data(jax.random.key(9)))


def test_key_of_another_or_unknown_implementation(ckdir):
    from tests.stored import read_key, write_key
    import json

    tsckpt.save(ckdir, {"k": jax.random.key(1)})
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'k': the checkpoint stores PRNG keys of the implementation "
                       r"'threefry2x32' but the target's keys are 'rbg'"):
        tsckpt.restore(ckdir, {"k": jax.random.key(0, impl="rbg")})
    root = json.loads(read_key(ckdir, "zarr.json"))
    meta = root["attributes"]["tsckpt"]
    meta["arrays"][0]["kind"] = "jax_key:future_impl"
    write_key(ckdir, "zarr.json", json.dumps(root).encode())
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'k': the checkpoint stores PRNG keys of the implementation "
                       r"'future_impl'"):
        tsckpt.restore(ckdir, {"k": jax.random.key(0)})
    assert tsckpt.restore(ckdir)["k"].dtype == np.uint32


@pytest.mark.slow(reason="jit compiles of the README's Flax example (its README block runs in the fast tier)")
def test_readme_jax_example(tmp_path, monkeypatch):
    """The README's JAX section: a Flax NNX model saved, restored abstractly (sharded), read by PyTorch."""
    pytest.importorskip("flax")
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## JAX\n"):]
    section = section[: section.index("\n## ")]
    jax_part, torch_part = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.chdir(tmp_path)
    saved: dict = {}
    exec(jax_part, saved)  # noqa: S102 - the README's own code
    assert saved["state"]["model"]["fc1"]["kernel"].sharding.spec == P("x")
    read: dict = {}
    exec(torch_part, read)  # noqa: S102
    x = np.linspace(-1, 1, 784, dtype=np.float32)[None]
    want = np.asarray(saved["model"](jnp.asarray(x)))
    assert np.allclose(read["net"](torch.from_numpy(x)).detach().numpy(), want, atol=1e-5)
