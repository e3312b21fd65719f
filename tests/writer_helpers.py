"""Jobs and scenarios for tests/test_writer.py: a save held open inside the writer process
(so a test can kill the writer or its trainer mid-save), and the ranks' scenarios."""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tsckpt
from tsckpt._save import protocol

HOLD_S = 60.0  # how long a held save waits for the test (a test kills it long before)


@dataclasses.dataclass(frozen=True)
class Held:
    """A job that runs ``inner`` with the commit held back: once the save has written
    everything and claimed its root (pending), it touches ``flag`` and waits (``before``:
    hold before the save starts instead; ``after``: once it committed, before the writer replies)."""

    inner: Any
    flag: str
    before: bool = False
    after: bool = False

    def __call__(self, tree: Any) -> None:
        if self.before:
            self._hold()
            self.inner(tree)
            return
        if self.after:
            self.inner(tree)
            self._hold()
            return
        commit = protocol._commit

        def held(*args: Any, **kwargs: Any) -> None:
            self._hold()
            commit(*args, **kwargs)

        protocol._commit = held  # type: ignore[assignment]
        try:
            self.inner(tree)
        finally:
            protocol._commit = commit  # type: ignore[assignment]

    @property
    def options(self) -> Any:
        return self.inner.options

    @property
    def step(self) -> int | None:
        return getattr(self.inner, "step", None)

    def _hold(self) -> None:
        Path(self.flag).write_text(str(os.getpid()))
        time.sleep(HOLD_S)

    def in_writer(self) -> Held | None:
        inner = self.inner.in_writer()
        return None if inner is None else dataclasses.replace(self, inner=inner)


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A job the writer process cannot unpickle (its unpickling raises ValueError)."""

    inner: Any

    def __call__(self, tree: Any) -> None:
        self.inner(tree)

    @property
    def options(self) -> Any:
        return self.inner.options

    def in_writer(self) -> Unreadable:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_unpickling, ("a test's job the writer cannot read",))


def _refuse_unpickling(why: str) -> None:
    raise ValueError(why)


def hold_next_save(manager: tsckpt.CheckpointManager, flag: str, *, before: bool = False, after: bool = False) -> None:
    """Make ``manager``'s next save a :class:`Held` one (later saves as usual)."""
    real = manager._job

    def job(step: int, options: Any) -> Any:
        manager._job = real  # type: ignore[method-assign]
        return Held(real(step, options), flag, before, after)

    manager._job = job  # type: ignore[method-assign]


def wait_for(path: str, timeout: float = 120.0) -> int:
    """Wait until ``path`` exists; return the pid written in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and Path(path).read_text():
            return int(Path(path).read_text())
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear in {timeout} s")


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": np.arange(seed, seed + 10, dtype=np.int64), "step": seed}


# ---- scenarios on ranks (tests.dist_helpers.run_ranks) ----------------------------------------


def one_writer_killed(rank: int, world: int, root: str, how: str = "SIGKILL", timeout_s: float = 60) -> dict[str, Any]:
    """Save step 1; rank 1's writer is killed (``how``: or stopped, then killed by its training
    process once silent for the save's timeout) during step 2 (before its save starts, so rank
    0's writer waits for it in the protocol); step 3 is saved by new writers on every rank; step
    4, which rank 1 must save in a thread, by the thread on every rank."""
    manager = tsckpt.CheckpointManager(root, timeout=datetime.timedelta(seconds=timeout_s))
    manager.save_async(1, state(1)).result()
    first = manager._saver.writer_pid
    flag = os.path.join(root, f"held-{rank}")
    if rank == 1:
        hold_next_save(manager, flag, before=True)
    handle = manager.save_async(2, state(2))
    if rank == 1:
        os.kill(wait_for(flag), getattr(signal, how))
    try:
        handle.result()
        raised = None
    except tsckpt.TsckptError as e:
        raised = (type(e).__name__, str(e), list(getattr(e, "lost", ())))
    manager.save_async(3, state(10)).result()
    then = manager._saver.writer_pid
    if rank == 1:  # this rank must save step 4 in a thread: every rank does
        from tsckpt._save.writer import WriterSlot

        WriterSlot._refused = lambda *_: "a test's reason"  # type: ignore[method-assign]
    fourth = manager.save_async(4, state(4))
    fourth.result()
    out = {
        "raised": raised, "steps": manager.all_steps(), "first": first, "then": then,
        "fourth_by_writer": fourth.writer_peak_bytes is not None,
    }
    manager.close()
    return out
