"""Orbax checkpoints through tsckpt's own verbs: open, metadata, restore (numpy, torch,
DTensor on 2 ranks, resharded), verify, the CLI, reading only the chunks a target needs."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tsckpt
from tests import dist_scenarios as sc
from tests.dist_helpers import run_ranks

pytestmark = pytest.mark.slow  # every test here starts processes

pytest.importorskip("orbax.checkpoint")

ROWS, COLS = 64, 16
W = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) / 7


@pytest.fixture(scope="module")
def orbax_dirs(tmp_path_factory):
    """Written by jax with 4 CPU devices (rows sharded 4 ways: 16-row chunks): OCDBT
    (Orbax's default) and one file per chunk (zarr3)."""
    base = tmp_path_factory.mktemp("orbax")
    script = textwrap.dedent(
        """
        import sys
        import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
        w = jax.device_put(jnp.asarray(np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 7),
                           NamedSharding(mesh, P("x")))
        tree = {"params": {"w": w, "b": jnp.arange(16, dtype=jnp.bfloat16)}, "step": 12,
                "layers": [jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32)]}
        for name, ocdbt in (("ocdbt", True), ("files", False)):
            h = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True)
            ocp.Checkpointer(h).save(sys.argv[1] + "/" + name, args=ocp.args.PyTreeSave(tree))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    r = subprocess.run([sys.executable, "-c", script, str(base)], capture_output=True, text=True, timeout=240,
                       env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"ocdbt": str(base / "ocdbt"), "files": str(base / "files")}


@pytest.mark.parametrize("name", ["ocdbt", "files"])
def test_open_metadata_and_lazy_slices(orbax_dirs, name):
    ck = tsckpt.open(orbax_dirs[name])
    assert list(ck) == ["layers/0", "layers/1", "params/b", "params/w", "step"]
    assert ck["step"] == 12
    w = ck["params/w"]
    assert (w.shape, w.dtype, w.metadata.chunk_shape) == ((ROWS, COLS), "float32", (16, COLS))
    assert np.array_equal(w[5:9, 2], W[5:9, 2])
    assert torch.equal(ck["params/b"].torch[...], torch.arange(16, dtype=torch.bfloat16))
    meta = tsckpt.metadata(orbax_dirs[name])
    assert meta["params"]["w"].shape == (ROWS, COLS) and meta["step"] == 12


@pytest.mark.parametrize("name", ["ocdbt", "files"])
def test_restore_into_numpy_and_torch(orbax_dirs, name):
    target = {
        "params": {"w": torch.zeros(ROWS, COLS, dtype=torch.float64), "b": torch.zeros(16, dtype=torch.bfloat16)},
        "step": 0,
        "layers": [np.zeros(2, np.int64), torch.zeros(2, dtype=torch.int32)],
    }
    out = tsckpt.restore(orbax_dirs[name], target)
    assert out["params"]["w"].dtype == torch.float64 and np.array_equal(out["params"]["w"].numpy(), W.astype(np.float64))
    assert out["step"] == 12 and out["layers"][0].tolist() == [0, 0] and out["layers"][1].tolist() == [1, 1]
    plain = tsckpt.restore(orbax_dirs[name])
    assert plain["params"]["w"].tobytes() == W.tobytes() and plain["step"] == 12
    assert isinstance(plain["layers"], list) and [a.tolist() for a in plain["layers"]] == [[0, 0], [1, 1]]
    assert tsckpt.verify(orbax_dirs[name]).ok


def test_a_region_reads_only_its_chunks(orbax_dirs):
    """Rows 0..31 need the first two 16-row chunks only: the others may be missing."""
    d = orbax_dirs["files"] + "-partial"
    subprocess.run(["cp", "-r", orbax_dirs["files"], d], check=True, timeout=60)
    chunks = sorted(glob.glob(os.path.join(d, "params.w", "c", "*", "0")))
    assert [os.path.basename(os.path.dirname(c)) for c in chunks] == ["0", "1", "2", "3"]
    for c in chunks[2:]:
        os.remove(c)
    part = tsckpt.ShardedArray(torch.zeros(32, COLS), (ROWS, COLS), (0, 0))
    with pytest.warns(tsckpt.RestoreWarning, match="not in the target: 4"):
        out = tsckpt.restore(d, {"params": {"w": part}}, strict=False)
    assert np.array_equal(out["params"]["w"].local.numpy(), W[:32])
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'params/w' in .*a chunk file is missing"):
        with pytest.warns(tsckpt.RestoreWarning):
            tsckpt.restore(d, {"params": {"w": torch.zeros(ROWS, COLS)}}, strict=False)
    assert not tsckpt.verify(d).ok


def test_dtensor_targets_on_two_ranks(orbax_dirs):
    """Saved by 4 JAX devices (Shard rows), restored on 2 torch ranks as Shard(0) and Shard(1)."""
    for placement in ("shard0", "shard1"):
        locals_ = run_ranks(sc.restore_foreign_dtensor, 2, orbax_dirs["ocdbt"], "params/w", (ROWS, COLS), placement)
        axis = 0 if placement == "shard0" else 1
        assert np.array_equal(np.concatenate(locals_, axis=axis), W)


def test_cli_reads_orbax(orbax_dirs):
    r = subprocess.run([sys.executable, "-m", "tsckpt", "show", orbax_dirs["ocdbt"], "params/w[1, :3]"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "params/w[1, :3]: float32 [3]"
    assert np.allclose(np.array(r.stdout.splitlines()[1].strip("[] ").split(), dtype=np.float32), W[1, :3])
