"""save_async: staging, background failures, one save at a time, buffer reuse."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._save.protocol as save_module
from tsckpt._save.background import AsyncSaver


def _tree():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.arange(5, dtype=torch.bfloat16)},
        "opt": [np.arange(12, dtype=np.int32).reshape(3, 4), np.float64(0.25)],
        "shard": tsckpt.ShardedArray(torch.ones(4, 3), (4, 3), (0, 0)),
        "step": 7,
        "name": "run",
        "blob": bytearray(b"\x00\x01"),
    }


def _gate(monkeypatch):
    """Make every save wait until the returned event is set (the background phase, held open)."""
    gate = threading.Event()
    entered = threading.Event()
    real = save_module.save

    def slow_save(*args, **kwargs):
        entered.set()
        assert gate.wait(30), "test gate never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "save", slow_save)
    return gate, entered


def test_roundtrip_matches_sync_save(tmp_path):
    tree = _tree()
    tsckpt.save(tmp_path / "sync", tree)
    handle = tsckpt.save_async(tmp_path / "async", tree)
    assert handle.result(timeout=30) is None
    assert handle.done()
    sync, asyn = tsckpt.restore(tmp_path / "sync"), tsckpt.restore(tmp_path / "async")
    assert sync["step"] == asyn["step"] == 7 and asyn["name"] == "run" and asyn["blob"] == b"\x00\x01"
    for a, b in zip(
        [sync["model"]["w"], sync["opt"][0], sync["opt"][1], sync["shard"]],
        [asyn["model"]["w"], asyn["opt"][0], asyn["opt"][1], asyn["shard"]],
    ):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    back = tsckpt.restore(tmp_path / "async", tree)
    assert back["model"]["b"].dtype == torch.bfloat16 and back["model"]["b"].tolist() == [0, 1, 2, 3, 4]
    assert isinstance(back["shard"], tsckpt.ShardedArray) and back["shard"].local.tolist() == [[1.0] * 3] * 4


def test_returns_before_commit_and_snapshot_is_taken_at_call(tmp_path, monkeypatch):
    gate, entered = _gate(monkeypatch)
    w = torch.arange(6, dtype=torch.float32)
    a = np.arange(4, dtype=np.int64)
    strided = torch.arange(20, dtype=torch.float32).reshape(4, 5)[:, ::2]  # non-contiguous
    handle = tsckpt.save_async(tmp_path / "ck", {"w": w, "a": a, "s": strided})
    assert entered.wait(30)
    assert not handle.done()
    assert handle.staged_bytes == 6 * 4 + 4 * 8 + 12 * 4
    # training goes on and mutates its state while the save is still running
    w.add_(100)
    a *= -1
    strided.zero_()
    with pytest.raises(TimeoutError, match="still running after 0.05 s"):
        handle.result(timeout=0.05)
    gate.set()
    handle.result(timeout=30)
    out = tsckpt.restore(tmp_path / "ck")
    assert out["w"].tolist() == [0, 1, 2, 3, 4, 5]
    assert out["a"].tolist() == [0, 1, 2, 3]
    assert out["s"].tolist() == torch.arange(20.0).reshape(4, 5)[:, ::2].tolist()


def test_background_failure_is_reraised(tmp_path):
    tsckpt.save(tmp_path / "ck", {"x": np.zeros(2)})
    handle = tsckpt.save_async(tmp_path / "ck", {"x": np.ones(2)})
    with pytest.raises(tsckpt.CheckpointExistsError, match="already exists here; pass overwrite=True"):
        handle.result(timeout=30)
    assert handle.done()
    assert isinstance(handle.exception(), tsckpt.CheckpointExistsError)
    assert tsckpt.restore(tmp_path / "ck")["x"].tolist() == [0, 0]  # untouched
    tsckpt.save_async(tmp_path / "ck", {"x": np.ones(2)}, overwrite=True).result(timeout=30)
    assert tsckpt.restore(tmp_path / "ck")["x"].tolist() == [1, 1]


def test_unsupported_leaf_fails_in_the_caller(tmp_path):
    with pytest.raises(tsckpt.LeafTypeError, match="'bad/0': leaf of type builtins.object cannot be stored"):
        tsckpt.save_async(tmp_path / "ck", {"ok": np.zeros(1), "bad": [object()]})
    assert not (tmp_path / "ck").exists()


def test_second_save_waits_for_the_first(tmp_path, monkeypatch):
    gate, entered = _gate(monkeypatch)
    first = tsckpt.save_async(tmp_path / "a", {"x": np.zeros(3)})
    assert entered.wait(30)
    second_handle = []
    t = threading.Thread(target=lambda: second_handle.append(tsckpt.save_async(tmp_path / "b", {"x": np.ones(3)})))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not first.done()  # the second call is held until the first one commits
    gate.set()
    t.join(30)
    assert not t.is_alive() and first.done()
    second_handle[0].result(timeout=30)
    assert tsckpt.restore(tmp_path / "a")["x"].tolist() == [0, 0, 0]
    assert tsckpt.restore(tmp_path / "b")["x"].tolist() == [1, 1, 1]


def test_second_save_can_refuse_instead(tmp_path, monkeypatch):
    gate, entered = _gate(monkeypatch)
    first = tsckpt.save_async(tmp_path / "a", {"x": np.zeros(3)})
    assert entered.wait(30)
    with pytest.raises(tsckpt.SaveInProgressError, match=r"save to .*a is still running; wait for it with \.result\(\)"):
        tsckpt.save_async(tmp_path / "b", {"x": np.ones(3)}, if_busy="error")
    with pytest.raises(ValueError, match="if_busy must be 'wait' or 'error', not 'skip'"):
        tsckpt.save_async(tmp_path / "b", {"x": np.ones(3)}, if_busy="skip")
    gate.set()
    first.result(timeout=30)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("checked", [True, False])
def test_close_raises_a_failure_only_where_result_did_not(tmp_path, monkeypatch, checked):
    """A failure its result() raised (and the loop handled) is not raised again by close() in a
    finally; one nobody asked for is."""
    import tsckpt._save.protocol as save_module

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_module, "_write_regions", fail)
    m = tsckpt.CheckpointManager(tmp_path / "run", writer="thread")
    handle = m.save_async(1, {"x": np.ones(1)})
    if checked:
        with pytest.raises(OSError, match="No space left on device"):
            handle.result(timeout=30)
        m.close()
    else:
        with pytest.raises(OSError, match="No space left on device"):
            m.close()
    assert m.all_steps() == []


def test_unchecked_failure_is_reported_by_the_next_save(tmp_path):
    tsckpt.save(tmp_path / "ck", {"x": np.zeros(1)})
    failed = tsckpt.save_async(tmp_path / "ck", {"x": np.zeros(1)})
    deadline = time.monotonic() + 30
    while not failed.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match=r"save to .*ck failed and its result\(\) was never checked: CheckpointExistsError"):
        tsckpt.save_async(tmp_path / "other", {"x": np.zeros(1)}).result(timeout=30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once only
        tsckpt.save_async(tmp_path / "third", {"x": np.zeros(1)}).result(timeout=30)


def test_staging_buffers_are_reused_and_bounded(tmp_path):
    saver = AsyncSaver()
    seen = []

    def job(staged):
        seen.append(staged)

    w = torch.zeros(256, 256)
    a = np.zeros(1000, dtype=np.float32)
    for i in range(3):
        w.fill_(i)
        a.fill(i)
        saver.submit("x", {"w": w, "a": a, "i": i}, job).result(timeout=30)
        assert seen[-1]["w"] is not w and seen[-1]["a"] is not a
        assert float(seen[-1]["w"][0, 0]) == i and float(seen[-1]["a"][0]) == i and seen[-1]["i"] == i
    assert seen[0]["w"].data_ptr() == seen[2]["w"].data_ptr()  # the same buffer each time
    assert seen[0]["a"].ctypes.data == seen[2]["a"].ctypes.data
    assert saver.staging_bytes == 256 * 256 * 4 + 4000
    # a leaf that changed shape or dtype, or disappeared, releases its buffer
    saver.submit("x", {"w": torch.zeros(10, dtype=torch.float64)}, job).result(timeout=30)
    assert saver.staging_bytes == 80
    saver.close()


def test_staging_buffers_are_kept_per_dtype_not_per_dtype_string():
    """float8 formats of one size share a dtype string ('<V1') but not a buffer."""
    import ml_dtypes

    saver = AsyncSaver()
    seen = []
    for dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3b11fnuz):
        x = np.arange(16, dtype=np.float32).astype(dtype)
        saver.submit("x", {"w": x}, seen.append).result(timeout=30)
        assert seen[-1]["w"].dtype == np.dtype(dtype) and seen[-1]["w"].tobytes() == x.tobytes()
    saver.close()


def test_staging_limit_falls_back_to_a_blocking_save(tmp_path):
    saver = AsyncSaver(max_staging_bytes=100)
    done = []
    w = np.zeros(100)
    with pytest.warns(RuntimeWarning, match="saving to x synchronously: the state has 800 bytes of arrays, more than max_staging_bytes=100"):
        handle = saver.submit("x", {"w": w}, lambda tree: done.append(tree))
    assert handle.done() and handle.staged_bytes == 0 and done[0]["w"] is w  # saved in place, no copy
    assert saver.staging_bytes == 0
    saver.submit("x", {"w": np.zeros(10)}, lambda tree: done.append(tree)).result(timeout=30)
    assert saver.staging_bytes == 80


def test_memory_store(tmp_path):
    tsckpt.save_async("memory://async_test/ck", {"w": torch.arange(3)}).result(timeout=30)
    assert tsckpt.restore("memory://async_test/ck")["w"].tolist() == [0, 1, 2]


@pytest.mark.slow
def test_pending_save_finishes_at_interpreter_exit(tmp_path):
    code = (
        "import numpy as np, tsckpt\n"
        f"tsckpt.save_async({str(tmp_path / 'ck')!r}, {{'x': np.arange(1 << 20)}})\n"
        # the script ends right away; the save is still in flight
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert tsckpt.restore(tmp_path / "ck")["x"][-1] == (1 << 20) - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_staged_in_pinned_memory(tmp_path):
    saver = AsyncSaver()
    seen = []
    t = torch.arange(1000, device="cuda", dtype=torch.float32)
    saver.submit("x", {"t": t}, seen.append).result(timeout=30)
    staged = seen[0]["t"]
    assert staged.device.type == "cpu" and staged.is_pinned()
    assert staged.tolist() == list(range(1000))
    handle = tsckpt.save_async(tmp_path / "ck", {"t": t})
    t.zero_()
    handle.result(timeout=30)
    assert tsckpt.restore(tmp_path / "ck")["t"].tolist() == list(range(1000))


def test_exports():
    assert {"save_async", "AsyncSave", "CheckpointManager", "SaveInProgressError"} <= set(tsckpt.__all__)
    assert issubclass(tsckpt.SaveInProgressError, tsckpt.TsckptError)
    assert issubclass(tsckpt.SaveInProgressError, RuntimeError)


def _two_ranks(rank: int, world: int, directory: str) -> tuple:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    sh = tsckpt.ShardedArray(torch.full((2, 3), float(rank)), (4, 3), (2 * rank, 0))
    m = tsckpt.CheckpointManager(directory, keep_last=1)
    for step in range(3):
        handle = m.save_async(step, {"dt": dt, "sh": sh, "rep": torch.ones(3) * step, "step": step})
        dt.to_local().add_(100)  # training mutates its state ...
        sh.local.add_(100)
        x = torch.ones(1)
        for _ in range(20):  # ... and runs its own collectives while the save commits
            dist.all_reduce(x)
        assert x.item() == world**20
        # a synchronous collective save while the background one commits: separate gloo groups
        tsckpt.save(os.path.join(directory + "-sync", str(step)), {"dt": dt, "step": step})
        handle.result(timeout=60)
    out = m.restore()
    sync = tsckpt.restore(os.path.join(directory + "-sync", "2"))
    assert sync["step"] == 2 and sync["dt"].tolist() == (torch.arange(32.0).reshape(8, 4) + 300).tolist()
    return m.all_steps(), out["dt"].tolist(), out["sh"].tolist(), out["rep"].tolist(), out["step"]


@pytest.mark.slow
def test_two_ranks_dtensor_and_sharded_leaves(tmp_path):
    from tests.dist_helpers import run_ranks
    from tests.test_crash import _context

    _context()  # if this starts the forkserver, preload what the crash tests fork too
    results = run_ranks(_two_ranks, 2, str(tmp_path / "run"), timeout=120)
    assert results[0] == results[1]
    steps, dt, sh, rep, step = results[0]
    assert steps == [2] and step == 2 and rep == [2.0, 2.0, 2.0]
    assert dt == (torch.arange(32.0).reshape(8, 4) + 200).tolist()
    assert sh == [[200.0] * 3] * 2 + [[201.0] * 3] * 2
    assert sorted(os.listdir(tmp_path / "run")) == ["00000002"]


def test_tied_leaves_are_staged_once_and_stay_tied(tmp_path):
    emb = torch.randn(8, 4)
    tree = {"tok": emb, "head": emb, "view": emb.view(8, 4), "other": emb.clone()}
    saver = AsyncSaver()
    h = saver.submit("x", tree, lambda staged: save_module.save(str(tmp_path / "ck"), staged))
    h.result(timeout=60)
    assert h.staged_bytes == 4 * 8 * 4 * 4  # counted per leaf; copied once per distinct memory
    assert saver.staging_bytes == 2 * 8 * 4 * 4
    ck = tsckpt.open(str(tmp_path / "ck")).checkpoint
    assert ck.aliases == {"tok": "head", "view": "head"}
    out = tsckpt.restore(str(tmp_path / "ck"))
    assert out["tok"] is out["head"] and np.array_equal(out["head"], emb.numpy())
    m = tsckpt.CheckpointManager(tmp_path / "run")
    m.save_async(1, tree).result(timeout=60)
    assert tsckpt.open(m.directory(1)).checkpoint.aliases == {"tok": "head", "view": "head"}
    saver.close()
    m.close()


def test_async_save_is_a_future(tmp_path):
    import concurrent.futures

    h = tsckpt.save_async(str(tmp_path / "ck"), {"w": torch.ones(2)})
    assert isinstance(h, concurrent.futures.Future)
    done, _ = concurrent.futures.wait([h], timeout=60)
    assert h in done and h.result() is None


@pytest.mark.slow
def test_a_failure_nobody_checked_is_reported_at_exit(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    code = (
        "import numpy as np, tsckpt\n"
        f"tsckpt.save_async({str(blocker / 'ck')!r}, {{'x': np.arange(10)}})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(
        f"tsckpt: the asynchronous save to {blocker / 'ck'} failed and its result() was never checked: "
        f"StorageError: {blocker / 'ck'}: not a directory (ENOTDIR) while writing"
    ), proc.stderr
    checked = code.replace("tsckpt.save_async(", "h = tsckpt.save_async(") + "try:\n    h.result()\nexcept OSError:\n    pass\n"
    proc = subprocess.run([sys.executable, "-c", checked], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_expired_steps_do_not_pile_up_when_saves_run_back_to_back(tmp_path, monkeypatch):
    """Retention's removals run beside the next save, but a save waits for those of the saves
    before the last: with removals slower than the saves, expired steps stayed on disk by the
    dozen (the disk held keep_last steps and all those)."""
    import shutil

    import tsckpt._manager as manager_module

    real = shutil.rmtree

    def slow(path, *args, **kwargs):
        if ".tsckpt-deleting-" in str(path):
            time.sleep(0.1)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(manager_module.shutil, "rmtree", slow)
    m = tsckpt.CheckpointManager(tmp_path / "run", keep_last=1, writer="thread")
    tree = {f"l{i}": np.full(8, float(i)) for i in range(20)}
    pending = []
    for step in range(1, 11):
        m.save_async(step, tree).result(timeout=60)
        pending.append(sum(n.startswith(".tsckpt-deleting-") for n in os.listdir(tmp_path / "run")))
    assert max(pending) <= 2, pending
    m.wait()
    assert sorted(os.listdir(tmp_path / "run")) == ["00000010"]
    m.close()


@pytest.mark.slow
def test_if_busy_error_refuses_on_every_rank_when_one_rank_is_busy(tmp_path):
    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    results = run_ranks(sc.busy_on_one_rank, 2, str(tmp_path / "run"))
    for rank, (asynchronous, synchronous) in enumerate(results):
        for message in (asynchronous, synchronous):
            assert "is still running" in message and "if_busy='wait'" in message, (rank, message)
            assert rank == 0 or "on rank(s) [0], so every rank refuses this one" in message


@pytest.mark.slow
def test_max_staging_bytes_exceeded_on_one_rank_takes_every_rank_to_a_synchronous_save(tmp_path):
    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    root = tmp_path / "run"
    results = run_ranks(sc.staging_bound_on_one_rank, 2, str(root), timeout=120)
    (warned0, steps0), (warned1, steps1) = results
    assert steps0 == steps1 == [1]
    assert warned0 == [f"saving to {root / '00000001'} synchronously: rank(s) [1] hold more array bytes than "
                       f"max_staging_bytes={256 << 10} (every rank saves alike)"]
    assert warned1 == [f"saving to {root / '00000001'} synchronously: the state has {256 * 1024 * 4} bytes of "
                       f"arrays, more than max_staging_bytes={256 << 10}"]
    w = tsckpt.restore(root / "00000001")["w"]
    assert (w[:16] == 0).all() and (w[16:] == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("writer, how", [("thread", "leaf"), ("process", "leaf"), ("process", "interrupt")])
def test_a_save_async_failing_in_the_call_on_one_rank_fails_on_every_rank_and_the_ranks_stay_in_step(
    tmp_path, writer, how
):
    """A leaf tsckpt cannot save, or Ctrl-C in a state_dict(), on rank 1 only."""
    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    (errors0, steps0), (errors1, steps1) = run_ranks(
        sc.failing_call_on_one_rank, 2, str(tmp_path / "run"), writer, how, timeout=240
    )
    own = "LeafTypeError" if how == "leaf" else "KeyboardInterrupt"
    assert steps0 == steps1 == [1, 3, 4]
    assert len(errors0) == 1 and errors0[0].startswith("2: DistributedError: the asynchronous save to ")
    assert f"failed in the call on rank(s) [1] (rank 1: {own}: " in errors0[0]
    assert len(errors1) == 1 and errors1[0].startswith(f"2: {own}: ")


@pytest.mark.slow
@pytest.mark.parametrize(
    "option, values, expected",
    [
        ("writer", ("process", "thread"), "ranks passed different writer options (rank 0 'process', rank 1 'thread')"),
        ("if_busy", ("wait", "error"), "ranks passed different if_busy options ('error' on some, 'wait' on others)"),
    ],
)
def test_ranks_asking_for_other_protocols_all_raise_before_any_save(tmp_path, option, values, expected):
    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    for message, made in run_ranks(sc.other_options, 2, str(tmp_path), option, values, timeout=120):
        assert expected in message
        assert not made
    assert tsckpt.restore(tmp_path / "b")["w"].tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
