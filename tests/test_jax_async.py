"""save_async of jax.Arrays: staged to host memory before the call returns, so the next jitted
step may donate them (``donate_argnums``), as a training loop does."""

from __future__ import annotations

import numpy as np
import pytest

import tsckpt
from tsckpt._save import background as _background
from tsckpt._save.background import AsyncSaver

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

if len(jax.devices()) < 4:  # tests/conftest.py asks XLA for 4 CPU devices before jax starts
    pytest.skip("these tests need 4 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)",
                allow_module_level=True)

MESH = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
SPECS = {"rows": P(("a", "b")), "cols": P(None, ("a", "b")), "grid": P("a", "b"), "replicated": P(), "half": P("a")}


@jax.jit
def _init(seed):
    k = jax.random.key(seed)
    return {
        "w": jax.random.normal(k, (64, 48), jnp.float32),
        "b": jnp.arange(48, dtype=jnp.bfloat16),
        "count": jnp.zeros((), jnp.int32),
    }


def _step(params):
    """One update of every leaf (not an identity: each step's values differ from the last)."""
    return {"w": params["w"] * 0.5 + 1.0, "b": params["b"] + 1, "count": params["count"] + 1}


STEP = jax.jit(_step, donate_argnums=0)


def _host(tree):
    """Host copies of every leaf (what the tree holds now), keyed as the tree."""
    return jax.tree.map(lambda a: np.array(a, copy=True), tree)


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.slow(reason="jitted donated steps compiled for each save")
def test_donated_step_after_each_async_save(tmp_path):
    """The training pattern: save_async, then at once the jitted step that donates the saved
    params. Every step commits, bit-exact to the values when save_async was called."""
    params = _init(0)
    saved = {}
    with tsckpt.CheckpointManager(tmp_path / "run") as manager:
        for step in range(20):
            saved[step] = _host(params)
            manager.save_async(step, {"params": params, "step": step})
            old = params
            params = STEP(params)  # donates every buffer of `old`
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
        manager.wait()
        assert manager.all_steps() == list(range(20))
        for step in range(20):
            out = manager.restore(step=step)
            assert out["step"] == step
            for name, want in saved[step].items():
                assert _same_bits(out["params"][name], want), (step, name)


def test_a_step_between_saves_donates_buffers_staging_no_longer_views(tmp_path):
    """Staging leaves no view of a device buffer behind: jax can donate every buffer (on CPU, a
    numpy view of a buffer would make it refuse and copy)."""
    params = _init(1)
    saver = AsyncSaver()
    handle = saver.submit("x", {"params": params}, lambda staged: tsckpt.save(tmp_path / "ck", staged))
    old, params = params, STEP(params)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    handle.result(timeout=60)
    saver.close()


def _sharded_tree(x):
    return {name: jax.device_put(x, NamedSharding(MESH, spec)) for name, spec in SPECS.items()}


@jax.jit
def _plus_one(tree):
    return jax.tree.map(lambda a: a + 1, tree)


PLUS_ONE = jax.jit(_plus_one, donate_argnums=0)


def test_sharded_arrays_are_staged_shard_by_shard(tmp_path, small_chunks):
    """Each distinct device shard this process holds (replicas once) is copied into a buffer of
    tsckpt's own, reused by the next save; the checkpoint is the synchronous save's, files cut at
    the same shard boundaries, and restores bit-exact after the donated steps."""
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)  # 24 KiB: files of 4 KiB
    tree = _sharded_tree(x)
    tsckpt.save(tmp_path / "sync", tree)
    want = [x, x + np.float32(1), x + np.float32(1) + np.float32(1)]  # each step's values, as the steps round
    saver = AsyncSaver()
    seen = []

    def job(staged):
        seen.append(staged)
        tsckpt.save(tmp_path / str(len(seen) - 1), staged)

    for i in range(3):
        handle = saver.submit("x", tree, job)
        # rows, cols and grid: 4 shards of a quarter each; replicated: 1 of 4; half: 2 distinct of 4
        assert handle.staged_bytes == 5 * x.nbytes
        handle.result(timeout=60)
        device = [np.asarray(s.data) for a in tree.values() for s in a.addressable_shards]  # views, on CPU
        for name, region in seen[-1].items():
            assert len(region.shards) == (1 if name == "replicated" else 2 if name == "half" else 4)
            assert not any(np.shares_memory(b, d) for b in region.shards.values() for d in device)
        del device  # (a view of a buffer would keep jax from donating it)
        tree = PLUS_ONE(tree)  # donates every shard
    for name in SPECS:  # the staging buffers are reused: the same memory in the first and the last save
        assert all(np.shares_memory(a, b) for a, b in zip(seen[0][name].shards.values(), seen[-1][name].shards.values()))
    assert saver.staging_bytes == 5 * x.nbytes
    saver.close()
    sync = tsckpt.open(tmp_path / "sync").checkpoint
    for i in range(3):
        ck = tsckpt.open(tmp_path / str(i)).checkpoint
        for name, spec in SPECS.items():
            assert ck.arrays[name] == sync.arrays[name], name  # same record: chunking, shard cuts, kind
        out = tsckpt.restore(tmp_path / str(i), _abstract(x))
        for name, spec in SPECS.items():
            assert out[name].sharding == NamedSharding(MESH, spec)
            assert _same_bits(out[name], want[i]), (i, name)
    files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != "zarr.json")  # noqa: E731
    assert files(tmp_path / "0") == files(tmp_path / "sync")


def _abstract(x):
    return {name: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=NamedSharding(MESH, spec))
            for name, spec in SPECS.items()}


def test_every_host_copy_starts_before_any_is_awaited(tmp_path, monkeypatch):
    """The device-to-host copies of all shards of all arrays are started first, then awaited
    one by one: the call blocks for one overlapped transfer, not a sum of them."""
    events = []
    start, copy = _background.start_host_copy, _background.host_copy

    def spy_start(shard):
        events.append("start")
        start(shard)

    def spy_copy(shard, buffer):
        events.append("wait")
        return copy(shard, buffer)

    monkeypatch.setattr(_background, "start_host_copy", spy_start)
    monkeypatch.setattr(_background, "host_copy", spy_copy)
    tree = {**_sharded_tree(np.ones((8, 12), np.float32)), "t": np.zeros(3), "p": _init(2)}
    tsckpt.save_async(tmp_path / "ck", tree).result(timeout=60)
    shards = 4 + 4 + 4 + 1 + 2 + 3
    assert events == ["start"] * shards + ["wait"] * shards


@pytest.mark.parametrize(
    "impl", ["threefry2x32", pytest.param("rbg", marks=pytest.mark.slow(reason="a second key implementation compiled"))]
)
def test_typed_key_leaves_are_staged(tmp_path, impl):
    """Typed PRNG keys are staged as their key data (sharded ones shard by shard) and stored as
    tsckpt stores keys; the step that splits them may donate them."""

    def next_keys(state):
        return {"key": jax.random.split(state["key"])[0], "keys": jax.vmap(lambda k: jax.random.split(k)[1])(state["keys"])}

    step = jax.jit(next_keys, donate_argnums=0)
    state = {"key": jax.random.key(3, impl=impl),
             "keys": jax.device_put(jax.random.split(jax.random.key(4, impl=impl), 8), NamedSharding(MESH, P("a")))}
    want = []
    with tsckpt.CheckpointManager(tmp_path / "run") as manager:
        for i in range(3):
            want.append({k: np.array(jax.random.key_data(v)) for k, v in state.items()})
            manager.save_async(i, state)
            old, state = state, step(state)
            assert old["keys"].is_deleted()
        manager.wait()
        for i in range(3):
            ck = tsckpt.open(tmp_path / "run" / f"{i:08d}").checkpoint
            assert {ck.arrays[k].kind for k in want[i]} == {f"jax_key:{impl}"}
            out = manager.restore(step=i, target=jax.eval_shape(lambda: state))
            for k, data in want[i].items():
                assert str(jax.random.key_impl(out[k])) == impl
                assert _same_bits(jax.random.key_data(out[k]), data), (i, k)


def test_a_state_over_the_staging_budget_is_saved_synchronously(tmp_path):
    """As for torch tensors: a state whose staged bytes (this process's distinct shards) exceed
    max_staging_bytes is saved in the call, with a RuntimeWarning, before the step may donate it."""
    x = np.arange(96, dtype=np.float32).reshape(8, 12)  # 384 bytes
    replicated = jax.device_put(x, NamedSharding(MESH, P()))  # on 4 devices, staged once
    with tsckpt.CheckpointManager(tmp_path / "run", max_staging_bytes=400) as manager:
        handle = manager.save_async(0, {"w": replicated})
        assert handle.staged_bytes == 384 and manager.staging_bytes == 384
        replicated = PLUS_ONE(replicated)
        tree = {"w": replicated, "b": jax.device_put(x, NamedSharding(MESH, P("a")))}  # 768 bytes
        with pytest.warns(RuntimeWarning, match=r"saving to .*00000001 synchronously: the state has 768 bytes of "
                          r"arrays, more than max_staging_bytes=400"):
            handle = manager.save_async(1, tree)
        assert handle.done() and handle.staged_bytes == 0  # committed in the call: nothing staged
        tree = PLUS_ONE(tree)
        manager.wait()
        assert _same_bits(manager.restore(step=0)["w"], x)
        out = manager.restore(step=1)
        assert _same_bits(out["w"], x + 1) and _same_bits(out["b"], x)


def test_single_array_async_save(ckdir):
    h = tsckpt.save_async(ckdir, {"w": jnp.full((3,), 2.0)})
    h.result(timeout=60)
    assert h.staged_bytes == 12  # copied, as any array: the next step may donate it
    assert tsckpt.restore(ckdir)["w"].tolist() == [2.0, 2.0, 2.0]


def test_a_leaf_that_changes_dtype_gets_a_buffer_of_its_own(tmp_path):
    """Buffers are kept per shard, shape and dtype: float8 formats of one size are not one dtype."""
    import ml_dtypes

    saver = AsyncSaver()
    seen = []
    for dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3b11fnuz, jnp.bfloat16, jnp.float16):
        x = np.arange(16, dtype=np.float32).astype(dtype)
        saver.submit("x", {"w": jnp.asarray(x)}, seen.append).result(timeout=60)
        (host,) = seen[-1]["w"].shards.values()
        assert host.dtype == np.dtype(dtype) and host.tobytes() == x.tobytes()
    saver.close()
