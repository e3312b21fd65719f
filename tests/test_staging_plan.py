"""save_async's reuse of a previous call's work for the same tensors (tsckpt/_save/background.py:
the checked leaves, the staging plan; tsckpt/_save/writer.py: the message that sends only what
changed): every save still stores exactly the state at its call, whatever changed between calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt.torch
import tsckpt._save.background as background


@pytest.fixture
def stage_keys(monkeypatch):
    """Counts the regions the staging looks at one by one (none when a plan is replayed)."""
    seen = [0]
    real = background._Staging._key

    def key(path, data):
        seen[0] += 1
        return real(path, data)

    monkeypatch.setattr(background._Staging, "_key", staticmethod(key))
    return seen



def test_the_same_tensors_are_staged_by_the_plan_and_saved_as_at_each_call(tmp_path, stage_keys):
    w, b = torch.randn(16, 8), torch.zeros(8)
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    m.save_async(1, {"w": w, "b": b, "step": 1}).result()
    m.save_async(2, {"w": w, "b": b, "step": 2}).result()  # builds the plan
    stage_keys[0] = 0
    with torch.no_grad():
        w.add_(1)
        b.fill_(3)
    m.save_async(3, {"w": w, "b": b, "step": 3}).result()
    assert stage_keys[0] == 0  # replayed: no region looked at again
    out = m.restore(3)
    assert np.array_equal(out["w"], w.numpy()) and np.array_equal(out["b"], b.numpy()) and out["step"] == 3
    m.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_ties_that_change_between_saves_of_the_same_shapes(tmp_path, writer):
    """{"a": x, "b": x} then {"a": x, "b": y}: the same signature, but b is no longer x."""
    x, y = torch.full((4, 4), 1.0), torch.full((4, 4), 2.0)
    m = tsckpt.CheckpointManager(tmp_path, writer=writer)
    for step in (1, 2):
        m.save_async(step, {"a": x, "b": x}).result()
    m.save_async(3, {"a": x, "b": y}).result()
    m.save_async(4, {"a": x, "b": y}).result()
    m.save_async(5, {"a": x, "b": x}).result()
    for step, b in ((2, 1.0), (3, 2.0), (4, 2.0), (5, 1.0)):
        out = m.restore(step)
        assert out["a"].tolist() == [[1.0] * 4] * 4 and out["b"].tolist() == [[b] * 4] * 4, step
    m.close()


def test_tensors_made_anew_at_each_call_are_saved_with_their_values(tmp_path, stage_keys):
    """As the RNG states are: new tensors and numpy arrays of the same shapes at every call."""
    w = torch.randn(32)
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    want = {}
    for step in range(1, 6):
        fresh = torch.full((8,), float(step))
        arr = np.full(3, step, np.int64)
        m.save_async(step, {"w": w, "fresh": fresh, "arr": arr}).result()
        want[step] = (fresh.clone(), arr.copy())
    for step, (fresh, arr) in want.items():
        out = m.restore(step)
        assert np.array_equal(out["fresh"], fresh.numpy()) and np.array_equal(out["arr"], arr), step
    m.close()


def test_numpy_arrays_tied_at_one_call_only(tmp_path):
    a, b = np.arange(6.0), np.arange(6.0) + 10
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    m.save_async(1, {"x": a, "y": b}).result()
    m.save_async(2, {"x": a, "y": b}).result()
    m.save_async(3, {"x": a, "y": a}).result()
    m.save_async(4, {"x": a, "y": b}).result()
    assert np.array_equal(m.restore(3)["y"], a) and np.array_equal(m.restore(4)["y"], b)
    m.close()


def test_the_writer_gets_the_plain_values_of_each_save(tmp_path):
    """The message to the writer process sends the arrays' places once: the values that change
    (a step, a learning rate), the paths of a new tree and the arrays' new values still arrive."""
    w = torch.zeros(8, 8)
    m = tsckpt.CheckpointManager(tmp_path, writer="process")
    for step in range(1, 5):
        with torch.no_grad():
            w.fill_(step)
        m.save_async(step, {"w": w, "meta": {"step": step, "lr": 0.1 * step, "name": f"s{step}"}}).result()
    m.save_async(5, {"w": w, "other": 5}).result()  # another tree: new paths and structure
    m.save_async(6, {"w": w, "meta": {"step": 6, "lr": 0.6, "name": "s6"}}).result()
    for step in range(1, 5):
        out = m.restore(step)
        assert out["meta"] == {"step": step, "lr": pytest.approx(0.1 * step), "name": f"s{step}"}
        assert (out["w"] == step).all()
    assert m.restore(5)["other"] == 5 and "meta" not in m.restore(5)
    assert m.restore(6)["meta"]["name"] == "s6"
    m.close()


def test_a_tensor_replaced_by_another_of_the_same_shape_is_saved(tmp_path, stage_keys):
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    model = torch.nn.BatchNorm1d(4)
    state = tsckpt.torch.TrainState(model)
    m.save_async(1, state).result()
    m.save_async(2, state).result()
    model.weight = torch.nn.Parameter(torch.full((4,), 7.0))  # a new parameter of the same shape
    model.running_mean = torch.full((4,), 5.0)  # a buffer replaced
    m.save_async(3, state).result()
    out = m.restore(3)["model"]
    assert (out["weight"] == 7.0).all() and (out["running_mean"] == 5.0).all()
    m.close()



def test_a_byte_swapped_array_is_saved_by_value_at_every_call(tmp_path):
    big = np.arange(6, dtype=">f4")
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    for step in (1, 2, 3):
        big[0] = step
        m.save_async(step, {"big": big, "w": torch.ones(2)}).result()
    for step in (1, 2, 3):
        got = m.restore(step)["big"]
        assert got.dtype == np.float32 and got.tolist() == [float(step), 1, 2, 3, 4, 5], step
    m.close()


@pytest.fixture
def described(monkeypatch):
    """Counts the leaves save_async's call checks one by one (the arrays: none when its last
    verdict is replayed)."""
    seen: list[str] = []
    real = background.describe

    def describe(path, leaf):
        seen.append(path)
        return real(path, leaf)

    monkeypatch.setattr(background, "describe", describe)
    return seen


def test_the_last_verdict_is_replayed_and_plain_values_are_taken_at_each_call(tmp_path, described):
    w, b = torch.randn(4, 4), np.arange(3.0)
    raw = bytearray(b"ab")
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    m.save_async(1, {"w": w, "b": b, "step": 1, "raw": raw}).result()
    m.save_async(2, {"w": w, "b": b, "step": 2, "raw": raw}).result()
    described.clear()
    handle = m.save_async(3, {"w": w, "b": b, "step": 3.5, "raw": raw})
    raw[0] = ord("z")  # after the call: the checkpoint keeps the value at the call
    handle.result()
    assert sorted(described) == ["raw", "step"]  # the arrays were not checked again; the values were
    out = m.restore(3)
    assert out["step"] == 3.5 and out["raw"] == b"ab" and np.array_equal(out["w"], w.numpy())
    m.close()


def test_a_leaf_of_another_type_at_the_same_place_is_checked(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    w = torch.ones(3)
    for step in (1, 2):
        m.save_async(step, {"w": w, "x": 1}).result()
    with pytest.raises(tsckpt.LeafTypeError, match="'x': leaf of type builtins.object cannot be stored"):
        m.save_async(3, {"w": w, "x": object()})
    m.close()


def test_a_tensor_changed_in_place_to_another_dtype_is_checked_and_saved(tmp_path, described):
    p = torch.nn.Parameter(torch.arange(4.0))
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    for step in (1, 2):
        m.save_async(step, {"p": p}).result()
    p.data = p.data.to(torch.float64) + 1  # the same object, another dtype and memory
    described.clear()
    m.save_async(3, {"p": p}).result()
    assert described == ["p"]
    out = m.restore(3)["p"]
    assert out.dtype == np.float64 and out.tolist() == [1.0, 2.0, 3.0, 4.0]
    m.close()


def test_overlapped_saves_start_no_thread_after_the_first(tmp_path, monkeypatch):
    """The deferred copies run in kept threads: a call never waits for a thread to start."""
    import threading

    started: list[str] = []
    real = threading.Thread.start

    def start(self):
        if threading.current_thread() is threading.main_thread():  # by the call (the save's own run elsewhere)
            started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    state = tsckpt.torch.TrainState(model, opt)
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")

    def step(n):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        handle = m.save_async(n, state)
        assert handle.deferred_bytes > 0
        handle.result()
        m.wait()  # its housekeeping too: the kept threads are idle at the next call

    step(1)
    step(2)
    started.clear()
    for n in (3, 4, 5):
        step(n)
    assert started == []
    m.close()
