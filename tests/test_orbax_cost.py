"""Orbax reads at tsckpt's own cost: each stored chunk a process's target touches is read
once, however many device slices it splits into, and memory after a restore is back where
it started (bytes read are counted by TensorStore's own metrics)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorstore as ts
import torch

import tsckpt

ocp = pytest.importorskip("orbax.checkpoint")
jax = pytest.importorskip("jax")
pytestmark = pytest.mark.filterwarnings("ignore:.*target tree and checkpoint differ")  # each test reads part of one checkpoint
if len(jax.devices()) < 4:  # tests/conftest.py asks XLA for 4 CPU devices before jax starts
    pytest.skip("these tests need 4 jax devices", allow_module_level=True)

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, COLS = 256, 1024
NBYTES = ROWS * COLS * 4  # 1 MiB in chunks of 256 KiB: four row blocks or four column blocks
# TensorStore's counters of what its file kvstore read (positional reads and mapped files)
_READ_METRICS = ("/tensorstore/kvstore/file/bytes_read", "/tensorstore/file/mmap_bytes")


def _bytes_read() -> int:
    found = {m["name"]: m["values"][0]["value"] for m in ts.experimental_collect_matching_metrics("/tensorstore/")
             if m["name"] in _READ_METRICS}
    if "/tensorstore/kvstore/file/bytes_read" not in found:
        pytest.skip("this TensorStore does not count the bytes its file kvstore reads")
    return sum(found.values())


def _values() -> np.ndarray:
    """Random values: chunks that barely compress, so the bytes stored are about the bytes owned."""
    return np.random.default_rng(7).standard_normal((ROWS, COLS), dtype=np.float32)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]), ("x",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Written by Orbax (its defaults: OCDBT, zarr v2) from 4 devices: ``rows`` in four row
    chunks, ``cols`` in four column chunks."""
    d = tmp_path_factory.mktemp("orbax-cost") / "ck"
    x = _values()
    tree = {name: jax.device_put(x, NamedSharding(_mesh(), spec)) for name, spec in (("rows", P("x")), ("cols", P(None, "x")))}
    with ocp.StandardCheckpointer() as ck:
        ck.save(d, tree)
        ck.wait_until_finished()
    return str(d)


def _restore(directory: str, target: dict, **kw) -> tuple[dict, int]:
    before = _bytes_read()
    out = tsckpt.restore(directory, target, strict=False, **kw)
    return out, _bytes_read() - before


def test_column_sharded_jax_target_reads_each_row_chunk_once(saved):
    """Four device slices of columns each lie in every row chunk: each chunk is read once
    (before: once per slice, 4x the array), and every slice gets its columns. A window of one
    chunk keeps TensorStore from merging the slices' reads of a chunk by chance."""
    target = {"rows": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=NamedSharding(_mesh(), P(None, "x")))}
    out, read = _restore(saved, target, max_inflight_bytes=NBYTES // 4)
    assert read <= 1.1 * NBYTES, f"read {read} bytes for an array of {NBYTES}"
    arr = out["rows"]
    assert arr.sharding == target["rows"].sharding
    assert np.asarray(arr).tobytes() == _values().tobytes()


def test_a_column_region_reads_its_own_chunks(saved):
    """Where the stored chunks are the target's columns, a process owning half of them reads
    at most 1.1x what it owns; where they are rows it must decode every chunk its columns lie
    in: the whole array, twice what it owns (the chunking's own cost, no more)."""
    half = COLS // 2
    for name, most in (("cols", 1.1 * NBYTES / 2), ("rows", 1.1 * NBYTES)):
        part = tsckpt.ShardedArray(torch.zeros(ROWS, half), (ROWS, COLS), (0, half))
        out, read = _restore(saved, {name: part}, max_inflight_bytes=NBYTES // 4)
        assert read <= most, f"'{name}': read {read} bytes, owning {NBYTES // 2}"
        assert out[name].local.numpy().tobytes() == np.ascontiguousarray(_values()[:, half:]).tobytes()


def test_a_layout_that_makes_a_region_read_more_is_reported(saved, caplog):
    """Half the columns of row chunks: the restore says (INFO) that it touches 2x what the
    region needs, naming the array and its chunks; the column chunks' own half says nothing."""
    caplog.set_level("INFO", logger="tsckpt")
    half = COLS // 2
    for name in ("rows", "cols"):
        part = tsckpt.ShardedArray(torch.zeros(ROWS, half), (ROWS, COLS), (0, half))
        tsckpt.restore(saved, {name: part}, strict=False)
    assert "the reads touch 2.00x the stored bytes" in caplog.text
    assert f"'rows' 2.00x (chunks [{ROWS // 4}, {COLS}])" in caplog.text and "'cols'" not in caplog.text
    caplog.clear()
    target = {"rows": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=NamedSharding(_mesh(), P(None, "x")))}
    tsckpt.restore(saved, target, strict=False)  # the whole array, in four slices: each chunk read once, no more
    assert "the reads touch" not in caplog.text


def test_jax_slices_of_one_chunk_get_a_cast_and_their_own_parts(saved):
    """Slices read through one buffer still go through the restore's cast: float32 into a
    float64 target (safe), each slice its own columns."""
    target = {"rows": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=NamedSharding(_mesh(), P(None, "x")))}
    jax.config.update("jax_enable_x64", True)
    try:
        wide = {"rows": jax.ShapeDtypeStruct((ROWS, COLS), np.float64, sharding=target["rows"].sharding)}
        out, read = _restore(saved, wide, max_inflight_bytes=NBYTES // 4)
        assert read <= 1.1 * NBYTES
        got = out["rows"]
        assert got.dtype == np.float64
        for shard in got.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), _values()[shard.index].astype(np.float64))
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.slow  # starts ranks
def test_dtensor_shard1_ranks_read_their_own_column_chunks(saved):
    """Two torch ranks restoring DTensors sharded by columns: from column chunks each reads at
    most 1.1x what it owns; from row chunks, every chunk once (the whole array), no more."""
    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    for name, most in (("cols", 1.1 * NBYTES / 2), ("rows", 1.1 * NBYTES)):
        results = run_ranks(sc.restore_foreign_dtensor_counted, 2, saved, name, (ROWS, COLS))
        assert np.concatenate([local for local, _ in results], axis=1).tobytes() == _values().tobytes()
        for rank, (_, read) in enumerate(results):
            assert read <= most, f"'{name}', rank {rank}: read {read} bytes, owning {NBYTES // 2}"


_REPEATED = """
import gc, sys, time
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tsckpt

def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) << 10

mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
target = {"rows": jax.ShapeDtypeStruct((2048, 4096), np.float32, sharding=NamedSharding(mesh, P(None, "x")))}
growth = []
for i in range(6):
    if i == 1:
        start = anon()  # after one restore: jax's own first-use memory is in the baseline
    out = tsckpt.restore(sys.argv[1], target)
    del out
    gc.collect()
    time.sleep(0.2)  # jax frees arrays' buffers asynchronously
    if i >= 1:
        growth.append(anon() - start)
print(max(growth))
"""


@pytest.mark.slow  # a fresh process: the allocator's state of the test runner is no baseline
def test_memory_after_repeated_orbax_restores_is_back_where_it_started(tmp_path):
    """Chunks of 8 MiB decoded on TensorStore's threads left their arenas holding tens of
    MiB each, for good: five more restores of a 32 MiB checkpoint must leave the process
    within 16 MiB of where the first left it."""
    d = tmp_path / "ck"
    x = np.random.default_rng(3).standard_normal((2048, 4096), dtype=np.float32)
    with ocp.StandardCheckpointer() as ck:
        ck.save(d, {"rows": jax.device_put(x, NamedSharding(_mesh(), P("x")))})
        ck.wait_until_finished()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    for v in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_REPEATED), str(d)], capture_output=True, text=True,
                       timeout=240, env=env, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) <= 16 << 20, f"grew by {int(r.stdout.split()[-1]) >> 20} MiB"
