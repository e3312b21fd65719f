"""Overlapped staging: save_async returns before copying the optimizers' tensors, and the
checkpoint still holds every value as it was at the call, bit for bit.

The deferred copies are slowed down so that training, started right after the call,
really races them; a control run without the hooks shows the race saves wrong values.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._save import background
import tsckpt._save.guard as guard_module
import tsckpt.torch as tt
from tsckpt._leaves.stateful import expand
from tsckpt._save.guard import STAGING_THREAD, Guard, hookable, saved_objects
from tsckpt.tree import flatten

COPY_DELAY_S = 0.01


class Sampler:
    """A data sampler whose state has a plain position and a tensor it updates in place."""

    def __init__(self) -> None:
        self.position = 0
        self.order = torch.arange(6)

    def advance(self) -> None:
        self.position += 4
        self.order.add_(1)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": self.order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.order.copy_(torch.as_tensor(state["order"]))


class Run:
    """A model with a BatchNorm, AdamW, an LR scheduler and a sampler, stepped a few times."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)
        self.sampler = Sampler()
        self.state = tt.TrainState(
            self.model, self.opt, extra={"scheduler": self.sched, "step": 3}, per_rank={"sampler": self.sampler}
        )
        for _ in range(2):
            self.step()

    def step(self) -> None:
        self.model(torch.randn(4, 8)).square().mean().backward()  # BatchNorm's running stats change here
        self.opt.step()  # parameters, exp_avg, exp_avg_sq and the step count change here
        self.opt.zero_grad()
        self.sched.step()  # the learning rate in the optimizer's param_groups changes here
        self.sampler.advance()

    def snapshot(self) -> dict[str, Any]:
        """Every leaf the save stores, by path, copied now."""
        flat = flatten(copy.deepcopy(expand(self.state.__tsckpt_tree__(0)).tree))
        return dict(zip(flat.paths, flat.leaves))


def _bits(x: Any) -> Any:
    """A leaf as comparable bits: an array's dtype, shape and bytes; a plain value as is."""
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        return (np.dtype(x.dtype).str, x.shape, x.tobytes())
    return x


def _saved(directory: Any) -> dict[str, Any]:
    flat = flatten(tsckpt.restore(directory))
    return dict(zip(flat.paths, flat.leaves))


def _differences(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    assert saved.keys() == expected.keys()
    return sorted(p for p in expected if _bits(saved[p]) != _bits(expected[p]))


@pytest.fixture
def slow_copies(monkeypatch):
    """Defer the copies of tensors of any size, one per batch, and slow each down; returns the
    number of copies made so far (a list of one)."""
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 0)
    monkeypatch.setattr(guard_module, "COPY_BATCH_BYTES", 0)
    made = [0]
    real = guard_module._copy

    def slow(dst, src):
        assert len(dst) == len(src) == 1
        time.sleep(COPY_DELAY_S)
        real(dst, src)
        made[0] += 1

    monkeypatch.setattr(guard_module, "_copy", slow)
    return made


def _optimizer_bytes(run: Run) -> int:
    """The bytes of the parameters and AdamW state: what overlapped staging copies after the call."""
    params = list(run.model.parameters())
    return 3 * sum(p.numel() * p.element_size() for p in params) + 4 * len(params)  # float32 step counts


def _optimizer_waits_for(run: Run, made: list[int]) -> list[int]:
    """Record how many copies were made when the optimizer's own step began (a pre-hook
    registered after the guard's runs after it)."""
    seen: list[int] = []
    run.opt.register_step_pre_hook(lambda *_: seen.append(made[0]))
    return seen


def test_every_kind_of_state_is_saved_as_at_the_call(tmp_path, slow_copies):
    run = Run()
    expected = run.snapshot()
    handle = tsckpt.save_async(tmp_path / "ck", run.state)  # overlapped: the default
    at_return = slow_copies[0]
    seen = _optimizer_waits_for(run, slow_copies)
    for _ in range(2):
        run.step()  # at once: the guard holds the optimizer's first step until its tensors are copied
    handle.result(timeout=30)
    assert handle.deferred_bytes == _optimizer_bytes(run)
    copies = 4 * len(list(run.model.parameters()))  # each parameter, its step count and 2 moments
    assert at_return < copies and seen[0] == copies  # the copies raced the step; the step waited for all
    assert _differences(_saved(tmp_path / "ck"), expected) == []
    assert _differences(run.snapshot(), expected)  # while everything did change after the call


def test_without_the_hooks_the_race_saves_the_updated_values(tmp_path, slow_copies, monkeypatch):
    monkeypatch.setattr(Guard, "_hold", lambda self, need: lambda *_: None)
    run = Run()
    expected = run.snapshot()
    handle = tsckpt.save_async(tmp_path / "ck", run.state, staging="overlapped")
    run.step()
    handle.result(timeout=30)
    wrong = _differences(_saved(tmp_path / "ck"), expected)
    assert wrong and all(p.startswith("optim/state/") or p.startswith("model/") for p in wrong)


def test_the_hooks_are_removed_after_staging(tmp_path, slow_copies):
    run = Run()
    handle = tsckpt.save_async(tmp_path / "a", run.state, staging="overlapped")
    assert len(run.opt._optimizer_step_pre_hooks) == 1
    assert all(not m._forward_pre_hooks for m in run.model.modules())  # forward is never held back
    run.step()
    handle.wait_for_staging(timeout=30)
    assert len(run.opt._optimizer_step_pre_hooks) == 0
    assert not [t for t in threading.enumerate() if t.name == STAGING_THREAD]
    handle.result(timeout=30)
    # a hook left by a save no one waited for is removed by the next save
    tsckpt.save_async(tmp_path / "b", run.state, staging="overlapped")
    run.step()
    handle = tsckpt.save_async(tmp_path / "c", run.state, staging="overlapped")
    assert len(run.opt._optimizer_step_pre_hooks) == 1  # this save's own
    handle.result(timeout=30)
    handle.wait_for_staging()
    assert len(run.opt._optimizer_step_pre_hooks) == 0


def test_a_failed_copy_releases_the_step_and_raises_from_result(tmp_path, monkeypatch):
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 0)
    monkeypatch.setattr(guard_module, "COPY_BATCH_BYTES", 0)
    real = guard_module._copy
    made = [0]

    def failing(dst, src):
        made[0] += 1
        if made[0] == 2:
            raise MemoryError("staging buffer lost")
        time.sleep(COPY_DELAY_S)
        real(dst, src)

    monkeypatch.setattr(guard_module, "_copy", failing)
    run = Run()
    handle = tsckpt.save_async(tmp_path / "ck", run.state, staging="overlapped")
    run.step()  # not held back for ever
    handle.wait_for_staging(timeout=30)  # returns: the failure is result()'s
    assert len(run.opt._optimizer_step_pre_hooks) == 0
    with pytest.raises(MemoryError, match="staging buffer lost"):
        handle.result(timeout=30)
    assert not (tmp_path / "ck").exists()
    monkeypatch.setattr(guard_module, "_copy", real)
    expected = run.snapshot()
    tsckpt.save_async(tmp_path / "again", run.state, staging="overlapped").result(timeout=30)
    assert _differences(_saved(tmp_path / "again"), expected) == []


def test_tensors_no_optimizer_of_the_tree_updates_are_copied_before_the_call_returns(tmp_path, slow_copies):
    run = Run()
    # the model's state as raw tensors, no optimizer: nothing is deferred
    tree = {"model": run.model.state_dict(), "extra": torch.ones(3)}
    expected = copy.deepcopy(tree)
    handle = tsckpt.save_async(tmp_path / "raw", tree, staging="overlapped")
    assert handle.deferred_bytes == 0 and slow_copies[0] == 0
    with torch.no_grad():
        for t in [*run.model.parameters(), tree["extra"]]:
            t.add_(1)  # user code, right after the call
    handle.result(timeout=30)
    got = tsckpt.restore(tmp_path / "raw")
    assert all(_bits(got["model"][k]) == _bits(v) for k, v in expected["model"].items())
    assert _bits(got["extra"]) == _bits(expected["extra"])


def test_raw_parameters_beside_their_optimizer_are_guarded(tmp_path, slow_copies):
    run = Run()
    tree = {"model": run.model.state_dict(), "opt": run.opt}
    expected = dict(zip(*(lambda f: (f.paths, f.leaves))(flatten(copy.deepcopy(expand(tree).tree)))))
    handle = tsckpt.save_async(tmp_path / "ck", tree, staging="overlapped")
    assert handle.deferred_bytes == _optimizer_bytes(run)
    run.step()
    handle.result(timeout=30)
    assert _differences(_saved(tmp_path / "ck"), expected) == []


def test_blocking_staging_copies_everything_in_the_call(tmp_path, slow_copies):
    run = Run()
    handle = tsckpt.save_async(tmp_path / "ck", run.state, staging="blocking")
    assert handle.deferred_bytes == 0 and slow_copies[0] == 0
    assert len(run.opt._optimizer_step_pre_hooks) == 0
    handle.result(timeout=30)


def test_manager_and_torch_twins_stage_overlapped(tmp_path, slow_copies):
    run = Run()
    expected = run.snapshot()
    with tsckpt.CheckpointManager(tmp_path / "run", staging="overlapped") as manager:
        handle = manager.save_async(1, run.state)
        assert handle.deferred_bytes > 0
        manager.wait_for_staging()
        assert len(run.opt._optimizer_step_pre_hooks) == 0
        run.step()
    assert _differences(_saved(tmp_path / "run" / "00000001"), expected) == []
    expected_2 = run.snapshot()
    with tsckpt.CheckpointManager(tmp_path / "run", staging="overlapped") as manager:
        manager.save_async(2, run.state)
        assert len(run.opt._optimizer_step_pre_hooks) == 1
        assert manager.restore(1, target=run.state) == 1  # in place: once the save no longer copies
        hooks_left = len(run.opt._optimizer_step_pre_hooks)
    assert _differences(_saved(tmp_path / "run" / "00000002"), expected_2) == []
    assert _differences(run.snapshot(), expected) == []  # the live state is step 1's
    assert hooks_left == 0

    handle = tt.save_async(
        tmp_path / "tt", run.model, run.opt, extra={"scheduler": run.sched, "step": 3},
        per_rank={"sampler": run.sampler}, staging="overlapped",
    )
    expected_tt = run.snapshot()  # the same tree: the call does not change the state
    assert handle.deferred_bytes > 0
    run.step()
    handle.result(timeout=30)
    assert _differences(_saved(tmp_path / "tt"), expected_tt) == []


class _Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper that never runs Optimizer.__init__ (as accelerate's): its own step
    runs no hooks, the optimizer it wraps does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)


def test_a_wrapped_optimizer_is_hooked_where_its_step_runs_hooks():
    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert hookable(inner) is inner
    assert hookable(_Wrapper(inner)) is inner
    bare = _Wrapper.__new__(_Wrapper)  # wraps nothing: its tensors are copied at the call
    assert hookable(bare) is None
    assert hookable(object()) is None


def test_saved_objects_are_found_in_trees_and_whole_states():
    run = Run()
    assert saved_objects(run.state) == [run.model, run.opt, run.sched, run.sampler]
    assert saved_objects({"a": [run.opt, torch.ones(1)], "b": 2}) == [run.opt]
    assert saved_objects(run.opt) == [run.opt]


def test_only_large_contiguous_tensors_are_deferred(tmp_path, monkeypatch):
    """Tensors below DEFER_MIN_BYTES (step counts, biases) are copied in the call."""
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 64 * 64 * 4)
    model = torch.nn.Linear(64, 64)  # weight: exactly the bound; bias: below it
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    opt.step()
    handle = tsckpt.save_async(tmp_path / "ck", {"model": model, "opt": opt}, staging="overlapped")
    assert handle.deferred_bytes == 3 * 64 * 64 * 4  # the weight and its two moments
    handle.result(timeout=30)
    handle.wait_for_staging()
    guard = Guard.of(opt)
    transposed = model.weight.detach().t()  # the same memory, but not contiguous: copied in the call
    assert guard is not None and guard.defers(model.weight.detach()) and not guard.defers(transposed)
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 64 * 64 * 4 + 1)
    handle = tsckpt.save_async(tmp_path / "none", {"model": model, "opt": opt}, staging="overlapped")
    assert handle.deferred_bytes == 0 and len(opt._optimizer_step_pre_hooks) == 0
    handle.result(timeout=30)


def test_wait_for_staging_times_out_with_the_save_named(tmp_path, monkeypatch):
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 0)
    gate = threading.Event()
    real = guard_module._copy

    def held(dst, src):
        assert gate.wait(30), "test gate never opened"
        real(dst, src)

    monkeypatch.setattr(guard_module, "_copy", held)
    run = Run()
    handle = tsckpt.save_async(tmp_path / "ck", run.state)
    with pytest.raises(TimeoutError, match=r"asynchronous save to .*ck still copying the live tensors after 0.05 s"):
        handle.wait_for_staging(timeout=0.05)
    assert len(run.opt._optimizer_step_pre_hooks) == 1  # still guarding
    gate.set()
    handle.result(timeout=30)
    handle.wait_for_staging(timeout=30)
    assert len(run.opt._optimizer_step_pre_hooks) == 0


class _Subclass(torch.Tensor):
    pass


def test_only_plain_dense_tensors_are_deferred(monkeypatch):
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 0)
    dense = torch.ones(3)
    assert guard_module._span(dense) == (dense.data_ptr(), 12)
    assert guard_module._span(torch.nn.Parameter(dense)) == (dense.data_ptr(), 12)
    assert guard_module._span(dense.as_subclass(_Subclass)) is None  # its own semantics: copied at the call
    assert guard_module._span(dense.to_sparse()) is None
    assert guard_module._span(torch.ones(0)) is None
    assert guard_module._span(np.ones(3)) is None


def test_an_accelerate_optimizer_is_guarded_through_the_one_it_wraps(tmp_path, slow_copies):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    try:
        run = Run()
        model, opt = accelerate.Accelerator(cpu=True).prepare(run.model, run.opt)
        assert hookable(opt) is run.opt and opt is not run.opt
        tree = {"model": model, "opt": opt}
        expected = dict(zip(*(lambda f: (f.paths, f.leaves))(flatten(copy.deepcopy(expand(tree).tree)))))
        handle = tsckpt.save_async(tmp_path / "ck", tree)
        assert handle.deferred_bytes == _optimizer_bytes(run)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()  # the wrapper's step runs the wrapped optimizer's, which waits
        handle.result(timeout=30)
        assert _differences(_saved(tmp_path / "ck"), expected) == []
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.slow
def test_the_writer_process_reads_the_buffers_once_the_deferred_copies_are_made(tmp_path, slow_copies, writer_process):
    run = Run()
    expected = run.snapshot()
    handle = tsckpt.save_async(tmp_path / "ck", run.state, staging="overlapped", writer="process")
    at_return = slow_copies[0]
    for _ in range(2):
        run.step()
    handle.result(timeout=60)
    assert handle.writer_peak_bytes is not None  # saved by the writer process, not the thread
    assert at_return < 4 * len(list(run.model.parameters()))  # the copies raced the step
    assert _differences(_saved(tmp_path / "ck"), expected) == []
    background._default.close()  # save_async's own saver: its writer leaves with it


@pytest.mark.slow
def test_a_failed_deferred_copy_under_the_writer_process_raises_from_result(tmp_path, monkeypatch, writer_process):
    monkeypatch.setattr(guard_module, "DEFER_MIN_BYTES", 0)
    real = guard_module._copy

    def broken(dst, src):
        raise MemoryError("staging buffer lost")

    monkeypatch.setattr(guard_module, "_copy", broken)
    run = Run()
    handle = tsckpt.save_async(tmp_path / "ck", run.state, staging="overlapped", writer="process")
    with pytest.raises(MemoryError, match="staging buffer lost"):
        handle.result(timeout=60)
    assert not (tmp_path / "ck").exists()
    monkeypatch.setattr(guard_module, "_copy", real)
    expected = run.snapshot()
    again = tsckpt.save_async(tmp_path / "again", run.state, staging="overlapped", writer="process")
    again.result(timeout=60)
    assert again.writer_peak_bytes is not None
    assert _differences(_saved(tmp_path / "again"), expected) == []
    background._default.close()


def test_deferred_copies_are_made_in_batches(tmp_path, monkeypatch):
    """One call into torch per COPY_BATCH_BYTES of deferred copies, each batch at least one."""
    calls: list[int] = []
    real = guard_module._copy

    def counted(dst, src):
        calls.append(len(dst))
        real(dst, src)

    monkeypatch.setattr(guard_module, "_copy", counted)
    run = Run()
    expected = run.snapshot()
    tensors = 4 * len(list(run.model.parameters()))  # each parameter, its step count and 2 moments
    tsckpt.save_async(tmp_path / "one", run.state, staging="overlapped").result(timeout=30)
    assert calls == [tensors]
    assert _differences(_saved(tmp_path / "one"), expected) == []
    calls.clear()
    monkeypatch.setattr(guard_module, "COPY_BATCH_BYTES", 1)
    tsckpt.save_async(tmp_path / "each", run.state, staging="overlapped").result(timeout=30)
    assert calls == [1] * tensors
    assert _differences(_saved(tmp_path / "each"), expected) == []
