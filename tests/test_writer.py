"""save_async's writer process (tsckpt/_save/writer.py): the save outside the training process,
from shared staging buffers; its reuse, its death, its trainer's death, several ranks, memory."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest
import torch

import tsckpt
import tsckpt.torch
from tests.dist_helpers import run_ranks
from tests.writer_helpers import Unreadable, gone, hold_next_save, one_writer_killed, state, wait_for
from tsckpt._base.types import TorchRegion
from tsckpt._leaves.registry import describe
from tsckpt._ondisk.records import ROOT_KEY
from tsckpt._runtime import sharedmem
from tsckpt._save import background, writer
from tsckpt._save.background import AsyncSaver, SaveJob
from tsckpt._options import SaveOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Pair:
    weight: torch.Tensor
    count: int


def _tree() -> dict:
    w = torch.randn(33, 7)
    return {
        "w": w,
        "tied": w,
        "half": torch.randn(5, 3).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "ints": np.arange(12, dtype=np.int16).reshape(3, 4),
        "strided": torch.arange(20.0).reshape(4, 5)[:, ::2],
        "empty": torch.empty(0, 4),
        "region": tsckpt.ShardedArray(torch.ones(2, 3), (2, 3), (0, 0)),
        "pair": Pair(torch.arange(4), 3),
        "values": {"lr": 0.5, "name": "run", "blob": b"\x00\x01", "none": None, "scalar": np.float64(2.5)},
    }


def _root_metadata(directory) -> dict:
    with open(os.path.join(directory, ROOT_KEY)) as f:
        meta = json.load(f)["attributes"]["tsckpt"]
    for varying in ("created", "save_id"):
        meta.pop(varying, None)
    content = meta.get("content", {})
    # each file's hash and size stay; its modification time and inode are those of this copy
    content["files"] = {rel: entry[:2] for rel, entry in content.get("files", {}).items()}
    return meta


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_round_trip_is_bit_exact_and_the_same_checkpoint_as_a_synchronous_save(tmp_path, writer_process):
    tree = _tree()
    tsckpt.save(tmp_path / "sync", tree)
    handle = tsckpt.save_async(tmp_path / "async", tree)
    handle.result()
    assert handle.writer_peak_bytes is not None and handle.writer_peak_bytes > 0  # saved by a writer process
    assert handle.staged_bytes > 0
    assert _root_metadata(tmp_path / "async") == _root_metadata(tmp_path / "sync")  # ties, structure, values
    out = tsckpt.restore(tmp_path / "async", as_saved=True)
    for key in ("w", "tied", "half", "mask", "strided", "empty"):
        assert out[key].dtype == tree[key].dtype
        assert torch.equal(out[key], tree[key]), key
    assert np.array_equal(out["ints"], tree["ints"]) and out["ints"].dtype == np.int16
    assert torch.equal(out["pair"]["weight"], torch.arange(4)) and out["pair"]["count"] == 3
    assert out["values"] == {"lr": 0.5, "name": "run", "blob": b"\x00\x01", "none": None, "scalar": 2.5}
    background._default.close()  # save_async's own saver: its writer leaves with it


def _train_state(seed: int) -> tsckpt.torch.TrainState:
    """A small model in bfloat16 and float32 with float16, int64 and bool buffers; AdamW stepped
    once; a scheduler; a step counter; the RNG states."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    model[0].to(torch.bfloat16)
    model.register_buffer("scale", torch.randn(3).half())
    model.register_buffer("index", torch.arange(5) * seed)
    model.register_buffer("mask", torch.tensor([True, False, seed % 2 == 0]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    return tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched, "step": seed})


def _files(directory) -> dict[str, bytes]:
    """Every file of a checkpoint by relative path, but its root metadata (see :func:`_root_metadata`)."""
    out = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), directory)
            if rel != ROOT_KEY:
                with open(os.path.join(parent, name), "rb") as f:
                    out[rel] = f.read()
    return out


def _maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_train_state_is_saved_by_a_writer_that_never_imports_torch_as_a_synchronous_save_saves_it(tmp_path, writer_process):
    state = _train_state(3)
    tsckpt.save(tmp_path / "sync", state)
    try:
        handle = tsckpt.save_async(tmp_path / "async", state)
        handle.result()
        pid = background._default.writer_pid
        assert pid is not None and not _maps_libtorch(pid)
    finally:
        background._default.close()  # save_async's own saver: its writer leaves with it
    assert handle.writer_peak_bytes is not None  # saved by a writer process
    # the writer's own peak, not the training process's resident memory (torch's libraries alone are more)
    assert 0 < handle.writer_peak_bytes < _rss(os.getpid())
    sync, written = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sorted(written) == sorted(sync)
    assert [rel for rel in sync if written[rel] != sync[rel]] == []  # every array file and zarr.json
    assert _root_metadata(tmp_path / "async") == _root_metadata(tmp_path / "sync")  # kinds, dtypes, hashes
    with open(tmp_path / "async" / "model" / "0.weight" / "zarr.json") as f:
        assert json.load(f)["attributes"]["tsckpt"]["kind"] == "torch"
    target = _train_state(4)
    tsckpt.restore(tmp_path / "async", target)
    for got, want in [(target.model.state_dict(), state.model.state_dict()),
                      (target.optimizers[0].state_dict()["state"], state.optimizers[0].state_dict()["state"])]:
        flat_got, flat_want = tsckpt.tree.flatten(got), tsckpt.tree.flatten(want)
        assert flat_got.paths == flat_want.paths
        for path, a, b in zip(flat_got.paths, flat_got.leaves, flat_want.leaves):
            assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), path
    assert target.extra["scheduler"].state_dict() == state.extra["scheduler"].state_dict()
    assert target.extra["step"] == 3


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_tensors_of_dtypes_numpy_lacks_are_saved_by_the_writer_through_torch(tmp_path, writer_process):
    tree = {
        "c32": torch.randn(4, 3, dtype=torch.complex64).to(torch.complex32),
        "fp4": torch.arange(6, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "region": tsckpt.ShardedArray(torch.randn(2, 3).half(), (2, 3), (0, 0)),
    }
    tsckpt.save(tmp_path / "sync", tree)
    try:
        handle = tsckpt.save_async(tmp_path / "async", tree)
        handle.result()
        pid = background._default.writer_pid
        assert pid is not None and _maps_libtorch(pid)  # complex32 and float4 x2 tensors: torch's views
    finally:
        background._default.close()
    assert _files(tmp_path / "async") == _files(tmp_path / "sync")
    assert _root_metadata(tmp_path / "async") == _root_metadata(tmp_path / "sync")
    out = tsckpt.restore(tmp_path / "async", as_saved=True)
    for key in ("c32", "fp4", "bf16"):
        assert out[key].dtype == tree[key].dtype
        assert torch.equal(out[key].view(torch.uint8), tree[key].view(torch.uint8)), key


ENUMS = textwrap.dedent("""
    import enum, json, sys
    import numpy as np
    import tsckpt

    class Mode(enum.IntEnum):  # in __main__, which the writer process does not have
        A = 3

    class Name(str, enum.Enum):
        B = "b"

    handle = tsckpt.save_async(sys.argv[1], {"mode": Mode.A, "name": Name.B, "x": np.arange(3)})
    handle.result(timeout=120)
    out = tsckpt.restore(sys.argv[1])
    print(json.dumps([handle.writer_peak_bytes is not None, out["mode"], out["name"], out["x"].tolist()]))
""")


@pytest.mark.slow
def test_values_of_a_training_scripts_own_enums_are_saved_by_the_writer_as_their_builtin_values(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", ENUMS, str(tmp_path / "ck")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [True, 3, "b", [0, 1, 2]]  # saved by the writer process


@pytest.mark.slow
def test_a_save_the_writer_cannot_read_fails_with_why_and_the_next_save_starts_a_new_writer(tmp_path, writer_process):
    saver = AsyncSaver()
    try:
        handle = saver.submit("file", {"x": torch.ones(3)}, Unreadable(SaveJob(str(tmp_path / "a"), SaveOptions())),
                              writer="process")
        first = saver._process._writer.proc
        with pytest.raises(ValueError, match="^a test's job the writer cannot read$") as raised:
            handle.result(timeout=120)
        assert "in the writer process" in str(raised.value.__cause__)
        assert first.wait(timeout=30) == writer.UNREADABLE
        handle = saver.submit("file", {"x": torch.ones(3)}, SaveJob(str(tmp_path / "b"), SaveOptions()), writer="process")
        handle.result(timeout=120)
        assert handle.writer_peak_bytes is not None and saver.writer_pid not in (None, first.pid)
    finally:
        saver.close()
    assert torch.equal(torch.as_tensor(tsckpt.restore(tmp_path / "b")["x"]), torch.ones(3))
    assert not os.path.exists(tmp_path / "a")


@pytest.mark.slow
def test_one_writer_serves_every_save_of_a_manager_and_leaves_with_it(tmp_path, writer_process, caplog):
    caplog.set_level(logging.INFO, logger="tsckpt")
    manager = tsckpt.CheckpointManager(tmp_path, keep_last=2)
    pids = []
    for step in range(4):
        manager.save_async(step, state(step)).result()
        pids.append(manager._saver.writer_pid)
    assert pids[0] is not None and pids[0] != os.getpid()
    assert pids == [pids[0]] * 4
    assert manager.all_steps() == [2, 3]
    assert np.array_equal(manager.restore(3)["b"], state(3)["b"])
    # the writer's log lines reach this process's logger; the manager logs what each save cost
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(rf"save {re.escape(str(tmp_path))}/00000003: .* in \d+ files, .*", m) for m in lines), lines
    assert any(re.fullmatch(r"step 3 committed: 0\.0 MiB staged, caller held \d\.\d{3} s, writer peak RSS \d+\.\d MiB", m)
               for m in lines), lines
    manager.close()
    assert gone(pids[0])
    assert manager._saver.writer_pid is None


@pytest.mark.slow
def test_a_writer_killed_mid_save_fails_the_save_naming_its_step_and_the_next_save_starts_a_new_one(tmp_path, writer_process):
    manager = tsckpt.CheckpointManager(tmp_path / "run")
    manager.save_async(1, state(1)).result()
    first = manager._saver.writer_pid
    hold_next_save(manager, str(tmp_path / "held"))
    handle = manager.save_async(2, state(2))
    assert wait_for(str(tmp_path / "held")) == first  # written and claimed, the commit held back
    assert json.loads((tmp_path / "run" / "00000002" / ROOT_KEY).read_text())["attributes"]["tsckpt"]["state"] == "pending"
    os.kill(first, signal.SIGKILL)
    with pytest.raises(tsckpt.WriterLostError, match=r"writer process \(pid \d+\) of the asynchronous save to .*00000002 "
                       r"\(step 2\) was killed by SIGKILL.*before the save committed: nothing of it is listed as a checkpoint"):
        handle.result(timeout=120)
    assert manager.all_steps() == [1]
    manager.save_async(2, state(22)).result()  # the leftover is removed, a new writer saves
    assert manager._saver.writer_pid not in (None, first)
    assert manager.all_steps() == [1, 2]
    assert np.array_equal(manager.restore(2)["b"], state(22)["b"])
    manager.close()


TRAINER = textwrap.dedent(
    """
    import sys
    import tsckpt
    from tests.writer_helpers import hold_next_save, state

    root, flag = sys.argv[1], sys.argv[2]
    manager = tsckpt.CheckpointManager(root)
    hold_next_save(manager, flag)
    manager.save_async(5, state(5))
    print(manager._saver.writer_pid, flush=True)
    import time
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_writer_and_no_complete_step(tmp_path):
    root, flag = str(tmp_path / "run"), str(tmp_path / "held")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, root, flag], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        writer = int(trainer.stdout.readline())
        assert wait_for(flag) == writer  # mid-save: written, claimed, the commit held back
        trainer.kill()
        trainer.wait(30)
        deadline = time.monotonic() + 30
        while not gone(writer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(writer), "the writer outlived its trainer"
    finally:
        trainer.kill()
        trainer.wait(30)
    manager = tsckpt.CheckpointManager(root, writer="thread")
    assert manager.all_steps() == []
    assert [(s.step, s.state) for s in tsckpt._manager.list_steps(root)] == [(5, "partial")]
    manager.save(5, state(6))  # the leftover is cleared by the next save of the step
    assert manager.all_steps() == [5]


EXITING = textwrap.dedent(
    """
    import sys
    import torch
    import tsckpt

    manager = tsckpt.CheckpointManager(sys.argv[1])
    manager.save_async(3, {"w": torch.arange(100_000.0)})
    print(manager._saver.writer_pid, flush=True)
    """
)


@pytest.mark.slow
def test_a_trainer_that_exits_lets_its_save_commit_and_its_writer_leave(tmp_path):
    root = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", EXITING, root], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert gone(int(done.stdout))
    manager = tsckpt.CheckpointManager(root, writer="thread")
    assert manager.all_steps() == [3]
    assert np.array_equal(manager.restore(3)["w"], np.arange(100_000.0, dtype=np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_every_rank_raises_when_one_writer_dies_and_the_ranks_agree_on_new_writers_and_on_the_thread(tmp_path, how):
    """Rank 1's writer killed, or stopped (its training process kills it once it has said
    nothing for the save's timeout): rank 0 raises too, naming rank 1 and why its writer is gone."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    results = run_ranks(one_writer_killed, 2, root, how, 60 if how == "SIGKILL" else 6, timeout=300)
    for rank, out in enumerate(results):
        assert out["steps"] == [1, 3, 4], out
        assert out["then"] not in (None, out["first"])
        assert out["fourth_by_writer"] is False
    why = "was killed by SIGKILL" if how == "SIGKILL" else "said nothing for "
    lost_type, lost_text, _ = results[1]["raised"]
    assert lost_type == "WriterLostError" and f"(step 2) {why}" in lost_text
    peer_type, peer_text, lost = results[0]["raised"]
    assert peer_type == "DistributedError", peer_text
    # a stopped writer may still hold its connections when rank 0's wait times out: not named lost, but named
    assert lost == [1] or (how == "SIGSTOP" and lost == []), peer_text
    assert peer_text.startswith(f"the asynchronous save to {os.path.join(root, '00000002')}: "), peer_text
    assert f"; rank 1's writer {why}" in peer_text, peer_text
    if how == "SIGSTOP":
        assert "more than the save's timeout (stopped, or stuck), and was killed; " in peer_text, peer_text
    assert "if every training process is still running, the next save starts new writers" in peer_text
    assert "the job cannot go on" not in peer_text  # it went on: step 3 was saved by new writers
    restored = tsckpt.restore(os.path.join(root, "00000003"))
    assert restored["step"] == 10  # the same tree on each rank: replicas


@pytest.mark.slow
def test_a_writer_killed_after_its_commit_leaves_a_complete_step_and_says_so(tmp_path, writer_process, caplog):
    """Killed between its commit and its reply: the step is complete (listed, restorable), so
    the save succeeds, with a warning, rather than raise that nothing of it is listed."""
    manager = tsckpt.CheckpointManager(tmp_path / "run")
    manager.save_async(1, state(1)).result(timeout=120)
    first = manager._saver.writer_pid
    hold_next_save(manager, str(tmp_path / "held"), after=True)
    handle = manager.save_async(2, state(2))
    assert wait_for(str(tmp_path / "held")) == first  # committed, the reply held back
    os.kill(first, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="tsckpt"):
        assert handle.result(timeout=120) is None
    assert any(re.search(r"\(step 2\) was killed by SIGKILL.* after the save committed: the step is complete", r.getMessage())
               for r in caplog.records)
    assert manager.all_steps() == [1, 2]
    assert np.array_equal(manager.restore(2)["b"], state(2)["b"])
    manager.save_async(3, state(3)).result(timeout=120)  # a new writer
    assert manager._saver.writer_pid not in (None, first) and manager.all_steps() == [1, 2, 3]
    manager.close()


@pytest.mark.slow
def test_a_writer_ignores_sigint_and_a_terminals_signals_go_to_the_trainer_alone(tmp_path, writer_process):
    """Ctrl-C in a terminal signals the training process only (the writer has a process group
    of its own); a SIGINT sent to the writer itself, right after a save, leaves it serving saves
    (it could end its loop mid-way and leave it alive and deaf: the next save waited for ever)."""
    manager = tsckpt.CheckpointManager(tmp_path / "run")
    manager.save_async(1, state(1)).result(timeout=120)
    pid = manager._saver.writer_pid
    assert os.getpgid(pid) != os.getpgid(0)
    for step in range(2, 10):
        os.kill(pid, signal.SIGINT)
        manager.save_async(step, state(step)).result(timeout=30)
    assert manager._saver.writer_pid == pid and manager.all_steps() == list(range(1, 10))
    assert np.array_equal(manager.restore(9)["b"], state(9)["b"])
    manager.close()


def _staging_held() -> tuple[int, int]:
    """Descriptors of, and bytes mapped from, shared staging blocks in this process."""
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "tsckpt-staging" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    mapped = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "tsckpt-staging" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                mapped += end - start
    return fds, mapped


@pytest.mark.slow
def test_a_closed_manager_keeps_no_staging_block(tmp_path, writer_process):
    """Each manager opened and closed in one process left its state-sized block of shared
    memory behind (its descriptor and mapping), however it was dropped."""
    before = _staging_held()
    for run in range(3):
        manager = tsckpt.CheckpointManager(tmp_path / f"run{run}")
        manager.save_async(1, {"a": np.random.rand(512, 1024)}).result(timeout=120)
        assert _staging_held()[1] >= 4 << 20  # the block: 4 MiB of staging
        manager.close()
        assert _staging_held() == before


@pytest.mark.slow
def test_a_staging_block_that_cannot_be_made_sends_the_save_to_the_thread(tmp_path, writer_process, monkeypatch, caplog):
    """A file-size limit (ulimit -f counts memory files) or no memory for the shared block: the
    save runs in the thread, warned once, instead of a bare OSError from the call."""
    import errno

    from tsckpt._runtime import sharedmem

    manager = tsckpt.CheckpointManager(tmp_path / "run")
    assert manager.save_async(1, {"x": np.ones(10)}).result(timeout=120) is None
    real = sharedmem.SharedBlock.__init__

    def limited(self, size, *, fd=None):
        if fd is None and size > 1 << 20:
            raise OSError(errno.EFBIG, "File too large")
        real(self, size, fd=fd)

    monkeypatch.setattr(sharedmem.SharedBlock, "__init__", limited)
    big = {"a": np.arange(200_000.0), "b": np.ones(200_000)}
    with caplog.at_level(logging.WARNING, logger="tsckpt"):
        for step in (2, 3):
            handle = manager.save_async(step, big)
            handle.result(timeout=120)
            assert handle.writer_peak_bytes is None  # the thread saved it
    assert [r.getMessage() for r in caplog.records if "shared staging memory" in r.getMessage()] == [
        "tsckpt: asynchronous saves run in a thread of this process: the shared staging memory for the writer process "
        "could not be made (File too large; a file-size limit, ulimit -f, counts memory files too)"
    ]
    assert np.array_equal(manager.restore(3)["a"], big["a"])
    manager.save_async(4, {"x": np.ones(10)}).result(timeout=120)  # a block that fits: the writer again
    assert manager.all_steps() == [1, 2, 3, 4]
    manager.close()


@pytest.mark.slow
def test_fifty_saves_in_a_row_commit_and_memory_does_not_grow(tmp_path, writer_process):
    manager = tsckpt.CheckpointManager(tmp_path)
    tree = {"w": torch.randn(256, 256), "m": [torch.randn(128, 128) for _ in range(4)], "step": 0}
    rss = {}
    for step in range(50):
        tree["w"].add_(1.0)
        tree["step"] = step
        handle = manager.save_async(step, tree)
        handle.result()
        assert handle.staged_bytes == (256 * 256 + 4 * 128 * 128) * 4
        if step in (9, 49):
            rss[step] = (_rss(os.getpid()), _rss(manager._saver.writer_pid), handle.writer_peak_bytes)
    assert manager.all_steps() == list(range(50))
    assert manager.restore(49)["step"] == 49
    (trainer_10, writer_10, peak_10), (trainer_50, writer_50, peak_50) = rss[9], rss[49]
    bound = 8 << 20  # a few allocator arenas' worth; a state copy a save is 0.5 MiB
    assert trainer_50 - trainer_10 < bound, (trainer_10, trainer_50)
    assert writer_50 - writer_10 < bound, (writer_10, writer_50)
    assert peak_50 - peak_10 < bound, (peak_10, peak_50)
    manager.close()


@pytest.mark.slow
def test_what_a_writer_process_cannot_take_is_saved_by_the_thread(tmp_path, writer_process):
    saver = AsyncSaver()
    options = SaveOptions()
    handle = saver.submit("memory", {"x": torch.ones(3)}, SaveJob("memory://writer-test/ck", options), writer="process")
    handle.result()
    assert handle.writer_peak_bytes is None and saver.writer_pid is None
    assert torch.equal(torch.as_tensor(tsckpt.restore("memory://writer-test/ck")["x"]), torch.ones(3))
    handle = saver.submit("file", {"x": torch.ones(3)}, SaveJob(str(tmp_path / "ck"), options), writer="process")
    handle.result()
    assert handle.writer_peak_bytes is not None and saver.writer_pid is not None
    saver.close()


@pytest.mark.skipif(not sharedmem.supported(), reason="no anonymous shared memory files")
def test_a_writer_without_torch_views_tensors_as_numpy_arrays_saved_as_tensors_except_dtypes_numpy_lacks(monkeypatch):
    block = sharedmem.SharedBlock(4096)
    try:
        block.base[:] = np.arange(4096) % 251
        ours = writer._Buffer(64, True, "bfloat16", (2, 3), None)
        tied = writer._Buffer(64, True, "bfloat16", (2, 3), ((4, 3), (2, 0)))
        arrays = writer._Buffer(128, False, np.dtype(np.int16), (4,), None)
        c32 = writer._Buffer(192, True, "complex32", (2,), None)
        monkeypatch.setattr(writer, "loaded", lambda: None)  # a writer that has not imported torch
        whole, region, plain, half = writer._views(block, [ours, tied, arrays, c32, 7])[:4]
        assert isinstance(whole, TorchRegion) and isinstance(region, TorchRegion)
        assert whole.local is region.local  # one view per buffer: tied leaves stay tied
        assert (whole.global_shape, whole.offsets, region.global_shape, region.offsets) == ((2, 3), (0, 0), (4, 3), (2, 0))
        assert whole.local.dtype == np.dtype(ml_dtypes.bfloat16) and whole.local.tobytes() == bytes(range(64, 76))
        assert type(plain) is np.ndarray and plain.dtype == np.int16
        assert torch.is_tensor(half) and half.dtype == torch.complex32  # numpy has no complex32: torch's view
        tensor = torch.frombuffer(bytearray(range(64, 76)), dtype=torch.bfloat16).view(2, 3)
        assert describe("w", whole).desc == describe("w", tensor).desc  # saved as the tensor is
        monkeypatch.setattr(writer, "loaded", lambda: torch)  # torch imported already: its views, as before
        as_tensor = writer._views(block, [ours])[0]
        assert torch.is_tensor(as_tensor) and as_tensor.dtype == torch.bfloat16
    finally:
        block.close()


class _Mode(enum.IntEnum):
    A = 3


class _Name(str, enum.Enum):
    B = "b"


def test_plain_values_of_builtin_subclasses_go_to_the_writer_as_the_builtin_values_they_are_saved_as():
    class Ratio(float):
        pass

    for value, want in [(_Mode.A, 3), (_Name.B, "b"), (Ratio(0.25), 0.25), (True, True), (b"x", b"x")]:
        got = writer._builtin(value)
        assert type(got) is type(want) and got == want
        assert describe("v", got).desc == describe("v", value).desc  # the same record
    scalar = np.float64(2.5)  # a float subclass, saved as an array
    assert writer._builtin(scalar) is scalar and writer._builtin(None) is None


def test_the_writer_option_is_checked_in_the_caller(tmp_path):
    with pytest.raises(ValueError, match="writer must be 'process' or 'thread', not 'fork'"):
        tsckpt.save_async(tmp_path / "ck", {"x": 1}, writer="fork")
    with pytest.raises(ValueError, match="writer must be 'process' or 'thread', not 'fork'"):
        tsckpt.CheckpointManager(tmp_path, writer="fork")


@pytest.mark.slow
def test_retention_through_the_writer_renames_before_the_result_and_removes_before_wait_returns(tmp_path, writer_process):
    """The writer replies at the commit, the expired step renamed away; its files go beside the
    next save, and the manager's wait() returns once they are gone."""
    manager = tsckpt.CheckpointManager(tmp_path, keep_last=1)
    for step in range(1, 5):
        manager.save_async(step, {"w": torch.full((64, 64), float(step)), "step": step}).result()
        assert manager.all_steps() == [step]
        assert not (tmp_path / f"{step - 1:08d}").exists()
    manager.wait()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tsckpt-deleting-")]
    assert manager.restore(4)["step"] == 4
    manager.close()


_SLOW_REMOVALS = '''
import os, shutil, time

_rmtree = shutil.rmtree


def _slow(path, *args, **kwargs):
    if ".tsckpt-deleting-" in str(path):
        with open(os.environ["TSCKPT_TEST_SLOWED"], "a") as f:
            f.write(str(os.getpid()) + "\\n")
        time.sleep(0.2)
    return _rmtree(path, *args, **kwargs)


shutil.rmtree = _slow
'''


@pytest.mark.slow
def test_expired_steps_do_not_pile_up_when_the_writer_saves_back_to_back(tmp_path, writer_process, monkeypatch):
    """A writer process removes the steps retention expired beside the next save, but a save
    waits for the removals of the saves before the last: with removals slower than the saves
    (the writer's rmtree slowed by a sitecustomize on its import path), at most two expired
    steps stay on disk, and wait() leaves none."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_REMOVALS)
    slowed = tmp_path / "slowed"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TSCKPT_TEST_SLOWED", str(slowed))
    m = tsckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    tree = {f"l{i}": np.full(8, float(i)) for i in range(20)}
    pending = []
    for step in range(1, 11):
        m.save_async(step, tree).result(timeout=60)
        pending.append(sum(n.startswith(".tsckpt-deleting-") for n in os.listdir(tmp_path / "run")))
    m.wait()
    assert sorted(os.listdir(tmp_path / "run")) == ["00000010"]
    pids = set(slowed.read_text().split())
    m.close()
    assert pids and str(os.getpid()) not in pids, pids  # the removals ran, slowed, in the writer
    assert max(pending) <= 2, pending


@pytest.mark.slow
def test_a_writer_that_says_nothing_for_the_saves_timeout_is_killed_and_the_save_fails_naming_why(tmp_path, writer_process):
    """A writer stopped (SIGSTOP) or stuck: its save fails once it has said nothing (it says it
    is alive every BEAT_S while it runs) for the save's timeout, rather than be waited for
    without end; the next save starts a new writer."""
    import datetime

    manager = tsckpt.CheckpointManager(tmp_path / "run", timeout=datetime.timedelta(seconds=3))
    manager.save_async(1, state(1)).result()
    pid = manager._saver.writer_pid
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        handle = manager.save_async(2, state(2))
        with pytest.raises(tsckpt.WriterLostError, match=r"\(step 2\) said nothing for [0-9]+ s, more than the "
                           r"save's timeout \(stopped, or stuck\), and was killed before the save committed"):
            handle.result(timeout=60)
    finally:
        if not gone(pid):  # never leave a stopped process behind
            os.kill(pid, signal.SIGKILL)
    assert 3 <= time.monotonic() - start < 30
    manager.save_async(3, state(3)).result(timeout=60)
    assert manager._saver.writer_pid != pid and manager.all_steps() == [1, 3]
    manager.close()


@pytest.mark.slow
def test_a_short_timeout_does_not_kill_a_writer_between_two_beats(tmp_path, writer_process):
    """With timeout=2 s, a writer that says it is alive every 2 s was killed between two beats
    ("said nothing for 2 s", a save queued behind a longer one): the bound is a few beats at least."""
    import datetime

    from tsckpt._save.writer import BEAT_S, SILENT_BEATS

    manager = tsckpt.CheckpointManager(tmp_path / "run", timeout=datetime.timedelta(seconds=2))
    manager.save_async(1, state(1)).result(timeout=60)
    assert manager._saver._process._writer._silent_s == SILENT_BEATS * BEAT_S > 2
    manager.close()
