"""Multi-process JAX (tsckpt._coord.jaxdist): 2 processes x 2 CPU devices coordinated through
jax.distributed alone, and their checkpoints read by torch.distributed ranks, and back."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import numpy as np
import pytest

import tsckpt
from tests.dist_helpers import reserved_port, run_ranks

pytest.importorskip("jax")

from tests import jax_scenarios  # noqa: E402
from tsckpt._coord import jaxdist as _jaxcoord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(scenario: str, directory) -> list[str]:
    """Run a scenario of tests/jax_scenarios.py on 2 processes; each one's last line."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with reserved_port() as port:  # held until the job is done
        return _run_job(scenario, directory, port, env)


def _run_job(scenario: str, directory, port: int, env: dict[str, str]) -> list[str]:
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.jax_scenarios", scenario, str(p), str(port), str(directory)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         stdin=subprocess.DEVNULL)
        for p in range(2)
    ]
    lines = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            lines.append(out.strip().splitlines()[-1] if out.strip() else f"no output: {err[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return lines


@pytest.mark.slow
def test_two_jax_processes_save_and_restore(tmp_path):
    ck = tmp_path / "ck"
    assert _job("save", ck) == ["ok", "ok"]
    out = tsckpt.restore(ck)
    for name in jax_scenarios.SPECS:
        assert np.array_equal(out[name], jax_scenarios.values(name)), name
    assert out["step"] == 3 and tsckpt.open(ck).checkpoint.arrays["key"].kind == "jax_key:threefry2x32"


@pytest.mark.slow
def test_the_manager_under_jax_distributed(tmp_path):
    assert _job("manager", tmp_path) == ["ok", "ok"]
    assert sorted(os.listdir(tmp_path)) == ["00000002"]  # step 1 expired, deleted once (process 0)


@pytest.mark.slow
def test_each_process_reads_only_its_devices_slices(tmp_path):
    """With the file of process 1's columns deleted, process 0 reads its own columns (it fails
    only because process 1 did), and process 1 names the leaf and the missing file."""
    ck = tmp_path / "ck"
    assert _job("save", ck) == ["ok", "ok"]
    assert sorted(os.listdir(ck / "cols" / "c" / "0")) == ["0", "1"]  # columns 0..5 and 6..11
    os.remove(ck / "cols" / "c" / "0" / "1")
    first, second = _job("restore", ck)
    assert first.startswith("DistributedError: restore failed on rank(s) [1]: rank 1: CorruptCheckpointError: 'cols'")
    assert second.startswith("CorruptCheckpointError: 'cols' in ") and "cols/c/0/1" in second


@pytest.mark.slow
def test_jax_processes_and_torch_ranks_read_each_other(tmp_path):
    assert _job("save", tmp_path / "from-jax") == ["ok", "ok"]
    run_ranks(jax_scenarios.dtensor_restore_cols, 2, str(tmp_path / "from-jax"))
    run_ranks(jax_scenarios.dtensor_save_cols, 2, str(tmp_path / "from-torch"))
    assert _job("restore_cols", tmp_path / "from-torch") == ["ok", "ok"]


# ---- the coordinator over a stand-in key-value store (no processes) ------------------------------


class _Store:
    """The coordination service client's key-value calls over a dict; a missing key times out."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value):
        self.kv[key] = value

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.kv:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.kv[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_delete(self, key):
        del self.kv[key]


def _coords(store, world):
    """``world`` coordinators of one job, each with its own operation numbers (as processes have)."""
    coords = []
    for r in range(world):
        c = object.__new__(_jaxcoord.JaxCoordinator)
        c.rank, c.world_size, c._client, c._ms, c._channel, c._counters = r, world, store, 1000, "main", {}
        coords.append(c)
    return coords


def test_gather_and_scatter_in_pieces_leave_no_keys(monkeypatch):
    store = _Store()
    monkeypatch.setattr(_jaxcoord, "PIECE_BYTES", 10)
    zero, one, two = _coords(store, 3)
    big = b"x" * 95
    assert one.gather({"r": 1, "big": big}) is None and two.gather({"r": 2}) is None
    assert zero.gather({"r": 0}) == [{"r": 0}, {"r": 1, "big": big}, {"r": 2}]
    assert zero.scatter(["a", "b" * 30, "c"]) == "a"
    assert one.scatter(None) == "b" * 30 and two.scatter(None) == "c"
    assert store.kv == {}
    sent = np.arange(6, dtype=np.float32)
    assert one.exchange([(2, 5, sent)], []) == {}
    got = two.exchange([], [(1, 5, sent.nbytes)])
    assert np.array_equal(got[5].view(np.float32), sent) and store.kv == {}


def test_a_silent_peer_is_a_distributed_error():
    zero, _ = _coords(_Store(), 2)
    with pytest.raises(tsckpt.DistributedError, match=r"^process 0: no answer from process 1 of the jax.distributed "
                       r"job within 1 s .*did every process call the same tsckpt verb\?$"):
        zero.gather("x")


def test_no_coordinator_without_jax_distributed():
    assert _jaxcoord.coordinator(datetime.timedelta(seconds=1)) is None


@pytest.mark.slow
def test_typed_keys_restore_into_global_mesh_targets(tmp_path):
    """One key and 4 keys sharded over the global mesh, restored replicated over it and sharded
    (jax's device_put refuses a sharding over other processes' devices)."""
    assert _job("keys", tmp_path / "ck") == ["ok", "ok"]


def _owner(name: str, offsets: list[int], lengths: list[int]) -> int:
    """The process whose devices hold the box (it lies in one block of 2 rows or 3 columns):
    process 0 holds blocks 0 and 2, process 1 blocks 1 and 3."""
    dim, size = (0, 2) if name == "interleaved" else (1, 3)
    block = offsets[dim] // size
    assert offsets[dim] + lengths[dim] <= (block + 1) * size, (name, offsets, lengths)
    return block % 2


@pytest.mark.slow
def test_shards_that_are_not_one_box_per_process(tmp_path):
    """An interleaved device order and P(None, ('model', 'data')): each process's shards are two
    blocks apart. Saved by 2 processes, each element written once by a process holding it;
    restored bit-exact by 2 processes (same and process-major shardings) and by 1."""
    import json

    ck = tmp_path / "ck"
    assert _job("odd_save", ck) == ["ok", "ok"]
    writes = [json.loads((tmp_path / f"ck.writes{p}.json").read_text()) for p in range(2)]
    for name in jax_scenarios.ODD:
        count = np.zeros(jax_scenarios.SHAPE, np.int64)
        for process, boxes in enumerate(writes):
            for path, offsets, lengths in boxes:
                if path == name:
                    assert _owner(name, offsets, lengths) == process, (name, offsets, lengths)
                    count[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
        assert (count == 1).all(), (name, count)
    out = tsckpt.restore(ck)
    for name in jax_scenarios.ODD:
        assert out[name].tobytes() == jax_scenarios.odd_values(name).tobytes(), name
    assert _job("odd_restore", ck) == ["ok", "ok"]
