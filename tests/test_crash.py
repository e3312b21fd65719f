"""Crash safety: a saving process SIGKILLed at random moments, and savers racing for one directory.

Child processes are forked from a forkserver that has torch and tsckpt
imported already, so each of the many short-lived savers starts in
milliseconds rather than seconds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._save.protocol as save_module
from tsckpt._save.commit import root_json
from tsckpt._ondisk.records import ROOT_KEY
from tsckpt._storage import durable
from tsckpt._storage.locations import Location, resolve

KILLS = 24
KEEP_LAST = 2
KEEP_EVERY = 5


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    preload = set(getattr(multiprocessing.forkserver._forkserver, "_preload_modules", None) or ())
    ctx.set_forkserver_preload(sorted(preload | {"torch", "torch.distributed.tensor", "tsckpt", __name__}))
    return ctx


def make_state(step: int) -> dict:
    """A different, reproducible state per step: several files of several chunks each."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(512, 1024, generator=g), "b": [torch.randn(64, generator=g) for _ in range(6)]},
        "opt": {"count": np.arange(1000, dtype=np.int64) * step, "lr": np.float64(1.0 / (step + 1))},
        "step": step,
    }


def _same(out: dict, step: int) -> bool:
    want = make_state(step)
    pairs = [(out["model"]["w"], want["model"]["w"]), (out["opt"]["count"], want["opt"]["count"])]
    pairs += list(zip(out["model"]["b"], want["model"]["b"]))
    pairs.append((out["opt"]["lr"], want["opt"]["lr"]))
    return out["step"] == step and all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in pairs)


def _saver(root: str, log: str, layout: str) -> None:
    """Save step after step until killed; log progress with unbuffered appends."""
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    # one-time costs (lazy imports, thread pools) before the clock starts
    tsckpt.save_async(f"memory://warmup-{os.getpid()}", {"x": np.zeros(1)}).result()
    # the save in this process, killed with it at random moments (a writer process starts in
    # seconds, longer than a kill waits; a killed trainer's writer: tests/test_writer.py)
    m = tsckpt.CheckpointManager(root, keep_last=KEEP_LAST, keep_every=KEEP_EVERY, layout=layout, writer="thread")
    latest = m.latest_step()
    step = 0 if latest is None else latest + 1
    os.write(fd, b"ready\n")
    while True:
        state = make_state(step)
        os.write(fd, f"begin {step} {time.monotonic()}\n".encode())
        if step % 2:
            m.save(step, state)
        else:
            handle = m.save_async(step, state)
            state["model"]["w"].add_(1.0)  # training goes on while the save is written
            state["opt"]["count"] += 1
            handle.result()
        os.write(fd, f"committed {step} {time.monotonic()}\n".encode())
        step += 1


def _wait_for(path: Path, text: str, proc: mp.process.BaseProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        if not proc.is_alive():
            raise AssertionError(f"saver exited with {proc.exitcode} before '{text}'")
        time.sleep(0.005)
    proc.kill()
    raise AssertionError(f"saver did not report '{text}' within {timeout} s")


def _let_run(rng: random.Random, kill: int, logs: list[Path], procs: list, durations: list[float]) -> None:
    """Let the savers run to a random moment: within a few saves (as observed) of their start.

    Every fourth kill first waits for one more commit, so the savers make progress however
    loaded the machine is; the kill still falls at a random moment after it.
    """
    if kill % 4 == 3:
        _wait_for(logs[0], "committed", procs[0], timeout=120)
    time.sleep(rng.uniform(0.0, max(0.6, 4 * sorted(durations)[len(durations) // 2])))


def _on_disk(root: Path) -> dict[str, str | None]:
    """State of every entry under the run directory, read directly."""
    out: dict[str, str | None] = {}
    for entry in sorted(root.iterdir()) if root.exists() else []:
        rootfile = entry / ROOT_KEY
        if not rootfile.exists():
            out[entry.name] = None
            continue
        out[entry.name] = json.loads(rootfile.read_text())["attributes"]["tsckpt"]["state"]
    return out


def _events(log: Path) -> tuple[list[int], list[int], dict[int, float], dict[int, float]]:
    """Steps begun and committed per the saver's log, with their times."""
    events = [line.split() for line in log.read_text().splitlines()[1:]]
    starts = {int(e[1]): float(e[2]) for e in events if e[0] == "begin" and len(e) == 3}
    ends = {int(e[1]): float(e[2]) for e in events if e[0] == "committed" and len(e) == 3}
    return list(starts), list(ends), starts, ends


def _inside(on_disk: dict[str, str | None], begun: list[int], done: list[int]) -> bool:
    """Whether a kill landed inside a save or a deletion: a step on disk not committed, or
    renamed away, or the saver's last step begun and not committed (killed before its claim)."""
    return any(s != "committed" or n.startswith(".") for n, s in on_disk.items()) or bool(
        begun and begun[-1] not in done
    )


def _check_latest(m: tsckpt.CheckpointManager, committed_ever: int | None, begun: list[int], context: str) -> None:
    """The last commit the saver saw survives, and nothing newer than what it started exists."""
    latest = m.latest_step()
    if committed_ever is not None:
        assert latest is not None and latest >= committed_ever, context
    if begun:
        assert latest is None or latest <= begun[-1], context


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path, layout):
    ctx = _context()
    rng = random.Random(20240611)
    root = tmp_path / "run"
    committed_ever: int | None = None
    interrupted = 0
    verified: set[int] = set()
    durations = [0.2]  # seconds per save, as observed; kills fall within a few saves of the start
    for kill in range(KILLS):
        log = tmp_path / f"log{kill}"
        proc = ctx.Process(target=_saver, args=(str(root), str(log), layout), daemon=True)
        proc.start()
        try:
            _wait_for(log, "ready", proc)
            _let_run(rng, kill, [log], [proc], durations)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        begun, done, starts, ends = _events(log)
        durations += [t - starts[step] for step, t in ends.items()]
        committed_ever = max(done, default=committed_ever)
        before = _on_disk(root)
        # a kill inside a save leaves a pending or rootless step, or (before its claim) a step begun and
        # never committed in the saver's log; inside a deletion, a renamed-away one
        interrupted += _inside(before, begun, done)

        m = tsckpt.CheckpointManager(root, keep_last=KEEP_LAST, keep_every=KEEP_EVERY, layout=layout)
        latest = m.latest_step()
        steps = m.all_steps()
        context = f"kill {kill}: begun {begun[-3:]}, committed {done[-3:]}, on disk {before}, complete {steps}"
        _check_latest(m, committed_ever, begun, context)
        # every step called complete is complete, bit for bit
        if latest is not None:
            assert _same(m.restore(), latest), context
        for step in set(steps[:-1]) - verified:  # a complete step never changes, so once is enough
            assert _same(m.restore(step), step), f"{context}: step {step} differs"
        verified.update(steps)
        # retention held (one extra step when the kill fell between a commit and its retention)
        recent = [s for s in steps if s % KEEP_EVERY]
        assert len(recent) <= KEEP_LAST + 1, context
        # the restarted manager removes what the crash left behind when it first saves (never when
        # it is made: a reader writes nothing), before anything else
        m._clean()
        after = _on_disk(root)
        assert set(after.values()) <= {"committed"} and not [n for n in after if n.startswith(".")], (
            f"{context}: after cleanup {after}"
        )
    assert committed_ever is not None and committed_ever >= KILLS // 4, "the saver made too little progress"
    assert interrupted >= KILLS // 3, f"only {interrupted} of {KILLS} kills landed inside a save or deletion"


def _race(directory: str, value: int, barrier: Any, delay: float, result: str) -> None:
    barrier.wait(60)  # both savers are forked and ready: go
    if delay:
        until = time.perf_counter() + delay
        while time.perf_counter() < until:
            pass
    try:
        tsckpt.save(directory, {"x": np.full(10_000, value, dtype=np.int64), "who": value})
        outcome = "ok"
    except tsckpt.CheckpointExistsError as e:
        outcome = f"exists {e}"
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outcome = f"other {type(e).__name__}: {e}"
    Path(result).write_text(outcome)


@pytest.mark.slow
def test_two_processes_save_to_one_directory(tmp_path):
    ctx = _context()
    for trial, delay in enumerate([0.0, 0.0, 0.0, 0.0, 0.002, 0.01, 0.05]):
        directory = str(tmp_path / f"ck{trial}")
        barrier = ctx.Barrier(2)
        procs = [
            ctx.Process(target=_race, args=(directory, v, barrier, delay if v == 2 else 0.0, str(tmp_path / f"r{trial}-{v}")))
            for v in (1, 2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            if p.exitcode is None:
                p.kill()
            assert p.exitcode == 0
        outcomes = {v: (tmp_path / f"r{trial}-{v}").read_text() for v in (1, 2)}
        winners = [v for v, o in outcomes.items() if o == "ok"]
        losers = [o for o in outcomes.values() if o != "ok"]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert losers[0].startswith(f"exists {directory}: "), outcomes
        assert "another save into this directory" in losers[0] or "already exists here" in losers[0], outcomes
        out = tsckpt.restore(directory)
        assert out["who"] == winners[0] and out["x"].tolist() == [winners[0]] * 10_000


ROUNDS = 40


def _manager_race(root: str, who: int, barrier: Any, result: str) -> None:
    """Job ``who`` of two starting on one run, ROUNDS times: a new manager saves step ``round``."""
    rng = random.Random(who)
    fd = os.open(result, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for step in range(ROUNDS):
        barrier.wait(60)  # both jobs start together
        until = time.perf_counter() + rng.choice([0.0, 0.0, 0.0005, 0.001, 0.002, 0.004])
        while time.perf_counter() < until:
            pass
        try:
            m = tsckpt.CheckpointManager(root)
            m.save(step, {"x": np.full(4096, who, dtype=np.int64), "w": torch.full((64, 64), float(who)), "who": who})
            outcome = "ok"
        except tsckpt.CheckpointExistsError as e:
            outcome = f"exists {e}"
        except tsckpt.SaveInProgressError as e:
            outcome = f"busy {e}"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome = f"other {type(e).__name__}: {e}"
        os.write(fd, (json.dumps([step, outcome]) + "\n").encode())


@pytest.mark.slow
def test_two_jobs_starting_on_one_run_save_the_same_step(tmp_path):
    """Two jobs start on one run and save the same step, round after round. Before: about one
    round in 100 both failed (a manager's clean-up removed the step the other job had just
    claimed), leaving array files and no root that every manager refused from then on, and
    sometimes a raw StorageError ENOENT. Now exactly one wins; the other is refused with
    CheckpointExistsError (or SaveInProgressError, when it finds the winner still writing)."""
    ctx = _context()
    root = tmp_path / "run"
    barrier = ctx.Barrier(2)
    results = [tmp_path / f"r{who}" for who in (1, 2)]
    procs = [ctx.Process(target=_manager_race, args=(str(root), who, barrier, str(r))) for who, r in zip((1, 2), results)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.exitcode is None:
            p.kill()
        assert p.exitcode == 0
    outcomes = [dict(json.loads(line) for line in r.read_text().splitlines()) for r in results]
    for step in range(ROUNDS):
        pair = {who: o[step] for who, o in zip((1, 2), outcomes)}
        winners = [who for who, o in pair.items() if o == "ok"]
        assert len(winners) == 1, f"step {step}: {pair}"
        loser = next(o for o in pair.values() if o != "ok")
        assert loser.startswith((f"exists {root}", f"busy {root}")), f"step {step}: {pair}"
        out = tsckpt.restore(root / f"{step:08d}")
        assert out["who"] == winners[0] and out["x"].tolist() == [winners[0]] * 4096, f"step {step}: {pair}"
    m = tsckpt.CheckpointManager(root)
    m.save(ROUNDS, {"x": np.zeros(1)})  # nothing left blocked
    assert m.all_steps() == list(range(ROUNDS + 1))
    assert sorted(os.listdir(root)) == [f"{s:08d}" for s in range(ROUNDS + 1)]


def test_claim_lost_between_check_and_create(tmp_path, monkeypatch):
    """The other saver creates its marker after our existence check: the conditional create fails."""
    from pytest import raises

    loc = resolve(tmp_path / "ck")
    real = durable.has_any_key

    def other_saver_wins(location):
        empty = real(location)
        durable.write_durable(location, ROOT_KEY, root_json("pending"))
        return empty

    monkeypatch.setattr(durable, "has_any_key", other_saver_wins)
    with raises(
        tsckpt.CheckpointExistsError,
        match="another save into this directory started at the same time and claimed it first; nothing was written",
    ):
        save_module._begin(loc, overwrite=False)
    monkeypatch.undo()
    with raises(tsckpt.CheckpointExistsError, match="another save into this directory is running, or one crashed"):
        tsckpt.save(tmp_path / "ck", {"x": np.zeros(1)})
    tsckpt.save(tmp_path / "ck", {"x": np.ones(1)}, overwrite=True)  # a crashed save can be replaced
    assert tsckpt.restore(tmp_path / "ck")["x"].tolist() == [1.0]


def test_overwrite_loses_to_a_concurrent_replacement(tmp_path, monkeypatch):
    """With overwrite=True, the uncommit is conditional on the root we read."""
    from pytest import raises

    tsckpt.save(tmp_path / "ck", {"x": np.zeros(1)})
    loc = resolve(tmp_path / "ck")
    real = Location.kvstore

    class Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    class ReplacedAfterRead:
        """The root is replaced by another saver right after _begin reads it."""

        def __init__(self, kv):
            self._kv = kv

        def read(self, key):
            r = self._kv.read(key).result()
            durable.write_durable(loc, ROOT_KEY, root_json("pending"))
            return Done(r)

        def __getattr__(self, name):
            return getattr(self._kv, name)

    monkeypatch.setattr(Location, "kvstore", lambda self: ReplacedAfterRead(real(self)))
    with raises(tsckpt.CheckpointExistsError, match="another save claimed this directory first; nothing was changed"):
        save_module._begin(loc, overwrite=True)
    assert (tmp_path / "ck" / "x").exists()


def _dist_saver(rank: int, port: int, root: str, log: str, layout: str) -> None:
    """One of 2 gloo ranks saving step after step (rows of 'w' sharded by rank) until killed."""
    from tests.dist_helpers import join

    torch.set_num_threads(1)
    join(port, rank, 2)
    fd = os.open(f"{log}.{rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    # the save in this process, killed with it at random moments (a writer process starts in
    # seconds, longer than a kill waits; a killed trainer's writer: tests/test_writer.py)
    m = tsckpt.CheckpointManager(root, keep_last=KEEP_LAST, keep_every=KEEP_EVERY, layout=layout, writer="thread")
    latest = m.latest_step()
    step = 0 if latest is None else latest + 1
    os.write(fd, b"ready\n")
    while True:
        state = make_state(step)
        w = state["model"]["w"]
        half = w.shape[0] // 2
        state["model"]["w"] = tsckpt.ShardedArray(w[rank * half : (rank + 1) * half].clone(), tuple(w.shape), (rank * half, 0))
        os.write(fd, f"begin {step} {time.monotonic()}\n".encode())
        if step % 2:
            m.save(step, state)
        else:
            m.save_async(step, state).result()
        os.write(fd, f"committed {step} {time.monotonic()}\n".encode())
        step += 1


@pytest.mark.slow
def test_sigkill_two_ranks_at_random_moments(tmp_path, layout):
    from tests.dist_helpers import rendezvous

    ctx = _context()
    rng = random.Random(7)
    root = tmp_path / "run"
    committed_ever: int | None = None
    interrupted = 0
    durations = [0.4]  # seconds per save, as observed
    for kill in range(20):
        log = tmp_path / f"log{kill}"
        store = rendezvous()  # the ranks' store, served here: it outlives the kill
        procs = [
            ctx.Process(target=_dist_saver, args=(r, store.port, str(root), str(log), layout), daemon=True)
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        try:
            for r, p in enumerate(procs):
                _wait_for(Path(f"{log}.{r}"), "ready", p)
            _let_run(rng, kill, [Path(f"{log}.0")], procs[:1], durations)
        finally:
            for p in procs:
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(30)
        begun, done, starts, ends = _events(Path(f"{log}.0"))
        durations += [t - starts[step] for step, t in ends.items()]
        committed_ever = max(done, default=committed_ever)
        before = _on_disk(root)
        interrupted += _inside(before, begun, done)
        m = tsckpt.CheckpointManager(root, keep_last=KEEP_LAST, keep_every=KEEP_EVERY, layout=layout)
        context = f"kill {kill}: begun {begun[-3:]}, committed {done[-3:]}, on disk {before}"
        _check_latest(m, committed_ever, begun, context)
        for step in m.all_steps():  # every step called complete restores bit-exactly
            assert _same(m.restore(step), step), f"{context}: step {step} differs"
        m._clean()  # what the restarted job's first save does first
        after = _on_disk(root)
        assert set(after.values()) <= {"committed"}, f"{context}: after cleanup {after}"
    assert committed_ever is not None and committed_ever >= 5, "the ranks made too little progress"
    assert interrupted >= 5, f"only {interrupted} of 20 kills landed inside a save or deletion"
