"""Reading real orbax-checkpoint checkpoints (written here with jax on CPU) without jax/orbax."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import tensorstore as ts

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

ocp = pytest.importorskip("orbax.checkpoint")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from tsckpt._formats import orbax as _orbax
from tsckpt._errors import (
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from tsckpt.tree import escape, structure_problem

DEFAULT_OCDBT_ZARR2 = "standard"


def _tree(strings: bool) -> dict:
    if len(jax.devices()) >= 4:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        sharded = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4) - 7.25, sharding)
    else:
        sharded = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) - 7.25
    tree = {
        "params": {
            "w": jnp.linspace(-3, 3, 48, dtype=jnp.float32).reshape(8, 6),
            "b": (jnp.arange(6, dtype=jnp.float32) / 3).astype(jnp.bfloat16),
            "sharded": sharded,
            "layers": [{"k": jnp.arange(12, dtype=jnp.int32) - 5}, {"k": jnp.array(3.5, jnp.float32)}],
        },
        "seq": [jnp.full((2,), i, jnp.int32) for i in range(12)],  # indices order numerically: 0, 1, ..., 10, 11
        "odd key/é": np.arange(5, dtype=np.int64),
        "flag": jnp.array(True),
        "step": 3,
        "lr": 0.1,
        "none": None,
        "empty": {},
    }
    if strings:
        tree["name"] = "x"
    return tree


def _expected(tree: dict, prefix: tuple[str, ...] = ()) -> dict:
    """tsckpt leaf path -> value, in jax tree order (computed with jax, independently of the reader)."""
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        comps = [str(k.idx) if isinstance(k, jax.tree_util.SequenceKey) else escape(str(k.key)) for k in keypath]
        out["/".join(prefix + tuple(comps))] = leaf
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every checkpoint variant, written once: name -> (directory, expected leaves)."""
    base = tmp_path_factory.mktemp("orbax")
    out = {}
    ck = ocp.StandardCheckpointer()
    ck.save(base / DEFAULT_OCDBT_ZARR2, _tree(strings=False))
    ck.wait_until_finished()
    out[DEFAULT_OCDBT_ZARR2] = (base / DEFAULT_OCDBT_ZARR2, _expected(_tree(strings=False)))
    for ocdbt in (True, False):
        for zarr3 in (True, False):
            name = f"pytree-{'ocdbt' if ocdbt else 'files'}-{'zarr3' if zarr3 else 'zarr2'}"
            handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)
            ocp.Checkpointer(handler).save(base / name, args=ocp.args.PyTreeSave(_tree(strings=True)))
            out[name] = (base / name, _expected(_tree(strings=True)))
    big = {"big": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)}
    for zarr3 in (True, False):
        name = f"subchunked-{'zarr3' if zarr3 else 'zarr2'}"
        args = ocp.args.PyTreeSave(big, save_args={"big": ocp.SaveArgs(chunk_byte_size=1024)})
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)).save(base / name, args=args)
        out[name] = (base / name, _expected(big))

    def state(s):
        return {"a": jnp.arange(4, dtype=jnp.float32) * s, "opt": [jnp.ones((3,), jnp.bfloat16) * s], "step": s}

    def params(s):
        return {"w": jnp.eye(5, dtype=jnp.float32) * s}

    with ocp.CheckpointManager(base / "manager", item_names=("state", "params")) as mgr:
        for s in (1, 2):
            items = {"state": ocp.args.StandardSave(state(s)), "params": ocp.args.StandardSave(params(s))}
            mgr.save(s, args=ocp.args.Composite(**items))
        mgr.wait_until_finished()
    out["manager"] = (base / "manager", None)
    step2 = {**_expected(params(2), ("params",)), **_expected(state(2), ("state",))}
    out["manager-step2"] = (base / "manager" / "2", step2)
    with ocp.CheckpointManager(base / "manager-default") as mgr:
        for s in (5, 7):
            mgr.save(s, args=ocp.args.StandardSave(state(s)))
        mgr.wait_until_finished()
    out["default-step7"] = (base / "manager-default" / "7", _expected(state(7)))
    return out


def _check(directory, expected) -> _orbax.ForeignCheckpoint:
    assert _orbax.detect(str(directory))
    ck = _orbax.load(str(directory))
    assert ck.location == str(directory) and structure_problem(ck.structure, ck.leaves) is None
    assert list(ck.leaves) == list(expected)  # tree order, None/empty nodes skipped
    assert set(ck.arrays) | set(ck.values) == set(expected) and not set(ck.arrays) & set(ck.values)
    for path, want in expected.items():
        if path in ck.values:
            assert type(ck.values[path]) is type(want) and ck.values[path] == want, path
            continue
        want = np.asarray(want)
        arr = ck.arrays[path]
        assert arr.path == path and arr.shape == want.shape and arr.dtype == want.dtype.name, path
        assert len(arr.chunk_shape) == want.ndim
        store = ts.open(arr.spec, read=True).result()
        got = store.read().result()
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), path
        if want.ndim and want.shape[0] >= 4:
            part = ts.open(arr.spec).result()[2:4].read().result()
            assert part.tobytes() == want[2:4].tobytes(), path
    return ck


@pytest.mark.parametrize(
    "name",
    [DEFAULT_OCDBT_ZARR2, "pytree-ocdbt-zarr3", "pytree-ocdbt-zarr2", "pytree-files-zarr3", "pytree-files-zarr2"],
)
def test_item_directory(saved, name):
    directory, expected = saved[name]
    ck = _check(directory, expected)
    assert ck.values["step"] == 3 and isinstance(ck.values["step"], int)
    assert ck.values["lr"] == 0.1 and isinstance(ck.values["lr"], float)
    assert ck.values.get("name", "x") == "x"
    assert ck.arrays["params/b"].dtype == "bfloat16" and ck.arrays["flag"].dtype == "bool"
    assert ck.arrays["params/layers/1/k"].shape == () and ck.arrays["odd%20key%2F%C3%A9"].dtype == "int64"
    # one zarr chunk per device shard (4 CPU devices unless XLA_FLAGS asked for fewer)
    assert ck.arrays["params/sharded"].chunk_shape == ((2, 4) if len(jax.devices()) >= 4 else (8, 4))
    kv = ck.arrays["params/w"].spec["kvstore"]
    read_from = ck.held.path  # TensorStore reads the directory's files through held descriptors
    if "ocdbt" in name or name == DEFAULT_OCDBT_ZARR2:
        # the merged manifest at the item root indexes the data in ocdbt.process_*/d/
        assert kv["driver"] == "ocdbt" and kv["base"]["path"] == f"{read_from}/" and kv["path"] == "params.w"
        assert any(directory.glob("ocdbt.process_*/d/*")) and (directory / "manifest.ocdbt").is_file()
    else:
        assert kv == {"driver": "file", "path": os.path.join(read_from, "params.w")}
    assert ck.arrays["params/w"].spec["driver"] == ("zarr3" if "zarr3" in name else "zarr")


@pytest.mark.parametrize("name", ["subchunked-zarr3", "subchunked-zarr2"])
def test_chunk_shape_is_the_stored_chunk(saved, name):
    ck = _check(*saved[name])
    assert ck.arrays["big"].shape == (64, 32) and ck.arrays["big"].chunk_shape == (16, 16)


def test_manager_step_with_named_items(saved):
    ck = _check(*saved["manager-step2"])
    assert ck.values == {"state/step": 2}
    assert _orbax.load(str(saved["manager-step2"][0] / "state")).leaves == ("a", "opt/0", "step")


def test_manager_step_with_only_the_default_item(saved):
    ck = _check(*saved["default-step7"])
    assert ck.leaves == ("a", "opt/0", "step") and ck.values == {"step": 7}


def test_json_item_becomes_values(tmp_path):
    with ocp.CheckpointManager(tmp_path / "m", item_names=("state", "meta")) as mgr:
        state = ocp.args.StandardSave({"a": jnp.arange(3.0)})
        mgr.save(1, args=ocp.args.Composite(state=state, meta=ocp.args.JsonSave({"epoch": 3, "tags": ["a", None]})))
        mgr.wait_until_finished()
    ck = _orbax.load(str(tmp_path / "m" / "1"))
    assert ck.leaves == ("meta/epoch", "meta/tags/0", "state/a") and ck.values == {"meta/epoch": 3, "meta/tags/0": "a"}


def test_manager_root_names_newest_committed_step(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved["manager"][0], root)
    shutil.copytree(root / "2", root / "3.orbax-checkpoint-tmp-1234")  # a save of step 3 still in flight
    assert _orbax.detect(str(root))
    with pytest.raises(NotACheckpointError, match=r"CheckpointManager root.*found steps \[1, 2\].*pass the newest "
                       rf"committed step directory '{re.escape(str(root / '2'))}' instead") as e:
        _orbax.load(str(root))
    assert "\n" not in str(e.value)


def _uncommitted(monkeypatch, tmp_path, temporary_path_class):
    async def crash_before_commit(self):
        return None

    monkeypatch.setattr(temporary_path_class, "finalize", crash_before_commit)
    ck = ocp.Checkpointer(ocp.StandardCheckpointHandler(), temporary_path_class=temporary_path_class)
    ck.save(tmp_path / "ck", args=ocp.args.StandardSave({"a": jnp.arange(3.0)}))
    return tmp_path / "ck"


def test_uncommitted_atomic_rename_save(monkeypatch, tmp_path):
    _uncommitted(monkeypatch, tmp_path, ocp.path.atomicity.AtomicRenameTemporaryPath)
    (tmp,) = tmp_path.glob("ck.orbax-checkpoint-tmp*")
    assert _orbax.detect(str(tmp)) and not (tmp_path / "ck").exists()
    with pytest.raises(CheckpointIncompleteError, match=rf"^{re.escape(str(tmp))}: Orbax checkpoint never committed: "
                       r"expected a final directory name, found the temporary suffix '\.orbax-checkpoint-tmp'"
                       r".*still running"):
        _orbax.load(str(tmp))


def test_uncommitted_commit_file_save(monkeypatch, tmp_path):
    ck = _uncommitted(monkeypatch, tmp_path, ocp.path.atomicity.CommitFileTemporaryPath)
    assert not (ck / "commit_success.txt").exists()
    assert json.loads((ck / "_CHECKPOINT_METADATA").read_text())["commit_timestamp_nsecs"] is None
    with pytest.raises(CheckpointIncompleteError, match=rf"^{re.escape(str(ck))}: Orbax checkpoint never committed: "
                       r"expected 'commit_success\.txt' or a commit timestamp in '_CHECKPOINT_METADATA', "
                       "found neither"):
        _orbax.load(str(ck))


def test_uncommitted_manager_step(saved, tmp_path):
    step = tmp_path / "4"
    shutil.copytree(saved["manager-step2"][0], step)
    (step / "commit_success.txt").unlink()
    meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    (step / "_CHECKPOINT_METADATA").write_text(json.dumps({**meta, "commit_timestamp_nsecs": None}))
    for d in (step, step / "state"):  # the item's own marker does not commit the step
        with pytest.raises(CheckpointIncompleteError, match=rf"^{re.escape(str(step))}: Orbax checkpoint never"):
            _orbax.load(str(d))


@pytest.mark.parametrize(
    "remove, match",
    [
        ("_METADATA", r"Orbax item is incomplete: expected the tree metadata file '_METADATA', found \["),
        ("manifest.ocdbt", r"Orbax OCDBT checkpoint is incomplete: expected 'manifest\.ocdbt' .*found none "
                           r"\(per-process directories: \['ocdbt\.process_0'\]\)"),
    ],
)
def test_missing_metadata_or_manifest(saved, tmp_path, remove, match):
    ck = tmp_path / "ck"
    shutil.copytree(saved[DEFAULT_OCDBT_ZARR2][0], ck)
    (ck / remove).unlink()
    assert _orbax.detect(str(ck))
    with pytest.raises(CheckpointIncompleteError, match=rf"^{re.escape(str(ck))}: {match}") as e:
        _orbax.load(str(ck))
    assert "\n" not in str(e.value)


def test_corrupt_tree_metadata(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved[DEFAULT_OCDBT_ZARR2][0], ck)
    (ck / "_METADATA").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(ck))}: Orbax metadata file '_METADATA' is "
                       "unreadable: expected JSON, found"):
        _orbax.load(str(ck))


def test_missing_array_data_names_the_leaf(saved, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(saved["pytree-files-zarr2"][0], ck)
    shutil.rmtree(ck / "params.w")
    with pytest.raises(CorruptCheckpointError, match=rf"^{re.escape(str(ck))}: leaf 'params/w': cannot read Orbax "
                       r"array 'params\.w'"):
        _orbax.load(str(ck))


def test_not_orbax(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    (tmp_path / "plain" / "12").mkdir()  # a numbered directory alone does not make a manager root
    assert not _orbax.detect(str(tmp_path / "plain"))
    assert not _orbax.detect(str(tmp_path / "missing")) and not _orbax.detect(str(tmp_path / "plain" / "notes.txt"))
    with pytest.raises(NotACheckpointError, match=r"not an Orbax checkpoint: expected '_METADATA' \(item\).*found "
                       r"\['12', 'notes\.txt'\]; pass an Orbax item or step directory"):
        _orbax.load(str(tmp_path / "plain"))
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        _orbax.load(str(tmp_path / "missing"))


def test_tsckpt_checkpoint_is_not_detected(tmp_path):
    import torch

    import tsckpt

    tsckpt.save(str(tmp_path / "ck"), {"w": torch.ones(3), "_METADATA": torch.zeros(1)})
    assert not _orbax.detect(str(tmp_path / "ck"))
    mgr = tsckpt.CheckpointManager(str(tmp_path / "run"))
    mgr.save(1, {"w": torch.ones(2)})
    mgr.close()
    assert not _orbax.detect(str(tmp_path / "run"))


# ---- convert: Orbax (JAX) into Hugging Face safetensors and tsckpt --------------------------


def test_convert_orbax_to_hf_directory_and_tsckpt(saved, tmp_path):
    import torch
    from safetensors.torch import load_file

    import tsckpt

    directory, expected = saved["manager-step2"]
    hf = str(tmp_path / "hf")
    r = tsckpt.convert(str(directory), hf, to_format="safetensors", subtree="state", max_shard_size="16B")
    assert (r.src_format, r.n_arrays, r.n_values) == ("orbax", 2, 1) and len(r.files) == 3
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == ["a", "opt/0"]
    loaded = {}
    for f in set(index["weight_map"].values()):
        loaded.update(load_file(os.path.join(hf, f)))
    assert torch.equal(loaded["a"], torch.from_numpy(np.asarray(expected["state/a"])))
    assert loaded["opt/0"].dtype == torch.bfloat16
    assert torch.equal(loaded["opt/0"].float(), torch.full((3,), 2.0))
    ck = str(tmp_path / "ck")
    assert tsckpt.convert(str(directory), ck).src_format == "orbax"
    got = tsckpt.restore(ck)
    assert got["state"]["step"] == 2 and isinstance(got["state"]["opt"], list)
    np.testing.assert_array_equal(got["params"]["w"], np.eye(5, dtype=np.float32) * 2)


def test_convert_uncommitted_orbax_is_one_line_exit_1(monkeypatch, tmp_path, capsys):
    from tsckpt._cli import main

    _uncommitted(monkeypatch, tmp_path, ocp.path.atomicity.CommitFileTemporaryPath)
    code = main(["convert", str(tmp_path / "ck"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "never committed" in err and str(tmp_path / "ck") in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    code = main(["convert", str(tmp_path / "ck"), str(tmp_path / "out"), "--from", "tsckpt"])
    assert code == 1 and not (tmp_path / "out").exists()


# ---- Flax trees as Orbax writes them: targets Orbax accepts, and the tree without one ----------


@pytest.fixture(scope="module")
def flax_saved(tmp_path_factory):
    """A CheckpointManager step saved as Flax users do (StandardSave, OCDBT): an NNX model and
    its optimizer, an optax state with int keys, a Linen TrainState after a jitted step (its
    step a jax scalar), and empty nodes. Returns (step directory, the saved trees, Orbax's
    restore without a target)."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    linen = pytest.importorskip("flax.linen")
    train_state = pytest.importorskip("flax.training.train_state")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 3, rngs=rngs)
            self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 2, rngs=rngs)])
            self.bn = nnx.BatchNorm(3, rngs=rngs)
            self.rngs = rngs

    model = Model(nnx.Rngs(7))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tx = optax.adam(1e-3)
    int_keys = {"s": tx.init({0: jnp.arange(3, dtype=jnp.float32), 1: jnp.ones(2)})}
    dense = linen.Dense(3)
    ts = train_state.TrainState.create(
        apply_fn=dense.apply, params=dense.init(jax.random.key(1), jnp.ones((1, 4))), tx=optax.sgd(0.1)
    )
    ts = jax.jit(lambda s: s.apply_gradients(grads=jax.tree.map(jnp.ones_like, s.params)))(ts)
    other = {"empty": {}, "none": None, "lst": [], "tup": (), "pair": (jnp.ones(1), 3)}
    trees = {"model": nnx.state(model), "opt": nnx.state(opt), "ints": int_keys, "ts": ts, "other": other}
    base = tmp_path_factory.mktemp("flax")
    with ocp.CheckpointManager(base) as mgr:
        mgr.save(1, args=ocp.args.Composite(**{k: ocp.args.StandardSave(v) for k, v in trees.items()}))
        mgr.wait_until_finished()
        plain = mgr.restore(1)
    abstract = {"model": nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))}
    fresh = train_state.TrainState.create(
        apply_fn=dense.apply, params=jax.tree.map(jnp.zeros_like, ts.params), tx=optax.sgd(0.1)
    )
    return base / "1", trees, plain, {**abstract, "ts": fresh, "tx": tx}


def _bytes(x):
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key) else x
    return np.asarray(x).dtype, np.asarray(x).tobytes()


def test_nnx_eval_shape_target_restores_an_orbax_written_state(flax_saved):
    import tsckpt

    step, trees, _, targets = flax_saved
    out = tsckpt.restore(step / "model", targets["model"])
    assert type(out) is type(trees["model"])
    assert jax.tree.structure(out) == jax.tree.structure(trees["model"])
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(trees["model"])):
        assert _bytes(got) == _bytes(want)
    assert jax.dtypes.issubdtype(out["rngs"]["default"]["key"][...].dtype, jax.dtypes.prng_key)
    with pytest.warns(tsckpt.RestoreWarning, match="restored the common leaves"):  # the step directory
        both = tsckpt.restore(step, {"model": targets["model"], "ts": targets["ts"]}, strict=False)
    assert jax.tree.structure(both["model"]) == jax.tree.structure(trees["model"])


def test_int_key_optax_state_and_linen_train_state_create(flax_saved):
    import tsckpt

    step, trees, _, targets = flax_saved
    tx = targets["tx"]
    out = tsckpt.restore(step / "ints", {"s": tx.init({0: jnp.zeros(3), 1: jnp.zeros(2)})})
    assert jax.tree.structure(out) == jax.tree.structure(trees["ints"])
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(trees["ints"])):
        assert _bytes(got) == _bytes(want)
    ts = tsckpt.restore(step / "ts", targets["ts"])  # step: an int target, a stored jax scalar
    assert type(ts.step) is int and ts.step == 1 and ts.apply_fn is targets["ts"].apply_fn
    for got, want in zip(jax.tree.leaves(ts.params), jax.tree.leaves(trees["ts"].params)):
        assert _bytes(got) == _bytes(want)
    with pytest.raises(tsckpt.LeafTypeError, match=r"'step': casting=\"same_kind\" refuses stored int32 into the bool target"):
        tsckpt.restore(step / "ts", targets["ts"].replace(step=False))


def test_orbax_names_only_for_orbax_checkpoints(flax_saved, tmp_path):
    """A target named as tsckpt names it (no `value` level) does not match an Orbax checkpoint,
    and tsckpt's own checkpoints keep tsckpt's names: no guessing either way."""
    import tsckpt

    step, trees, _, targets = flax_saved
    pure = jax.tree.map(np.asarray, {"l1": {"bias": trees["model"]["l1"]["bias"][...]}})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"missing from the checkpoint: 1 \('l1/bias'\)"):
        tsckpt.restore(step / "model", pure, strict=False)
    tsckpt.save(tmp_path / "own", {"d": {0: np.ones(2)}, "m": trees["model"]})
    own = tsckpt.restore(tmp_path / "own", {"d": {0: np.zeros(2)}, "m": targets["model"]})
    assert own["d"][0].tolist() == [1, 1] and "m/l1/bias" in tsckpt.open(tmp_path / "own")


def test_without_a_target_the_tree_orbax_returns(flax_saved):
    """Nested dicts with str keys (int keys as Orbax stores them), lists for sequences, the
    `value` level, empty containers and Nones: Orbax's own restore without a target; arrays as
    numpy, typed keys as their key data."""
    import tsckpt

    step, _, plain, _ = flax_saved
    out = tsckpt.restore(step)
    is_none = lambda x: x is None  # noqa: E731
    assert jax.tree.structure(out, is_leaf=is_none) == jax.tree.structure(dict(plain), is_leaf=is_none)
    assert out["other"]["empty"] == {} and out["other"]["lst"] == [] and out["other"]["tup"] == () and out["other"]["none"] is None
    assert list(out["ints"]["s"][0]["mu"]) == ["0", "1"] and out["ints"]["s"][1] is None
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(dict(plain))):
        assert _bytes(got) == _bytes(want) and isinstance(got, (np.ndarray, int))
