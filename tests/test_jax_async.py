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
