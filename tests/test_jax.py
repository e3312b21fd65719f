"""jax.Array leaves (tsckpt._jax): a JAX program writes what PyTorch restores, and back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tsckpt

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


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


def test_async_save_of_jax_arrays(ckdir):
    h = tsckpt.save_async(ckdir, {"w": jnp.full((3,), 2.0)})
    h.result(timeout=60)
    assert h.staged_bytes == 0  # immutable: nothing to copy
    assert tsckpt.restore(ckdir)["w"].tolist() == [2.0, 2.0, 2.0]


def test_sharded_over_two_devices(tmp_path):
    """A jax.Array sharded over two (CPU) devices is one global array, restored with its sharding."""
    script = textwrap.dedent(
        """
        import sys
        import jax, jax.numpy as jnp, numpy as np, torch, tsckpt
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        s = NamedSharding(mesh, P("x"))
        a = jax.device_put(jnp.arange(16.0).reshape(8, 2), s)
        assert len(a.addressable_shards) == 2
        tsckpt.save(sys.argv[1], {"a": a})
        t = tsckpt.restore(sys.argv[1], {"a": torch.zeros(8, 2)})["a"]
        assert torch.equal(t, torch.arange(16.0).reshape(8, 2)), t
        back = tsckpt.restore(sys.argv[1], {"a": jax.device_put(jnp.zeros((8, 2)), s)})["a"]
        assert back.sharding == s and np.array_equal(np.asarray(back), np.asarray(a))
        print("ok")
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=180, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
