"""Stateful objects anywhere in a tree (DCP's state_dict()/load_state_dict() convention, and
torch.Generator), through save, save_async, restore and the manager."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt.torch as tt
from tsckpt._leaves.stateful import expand, is_stateful


class Counter:
    """A stateful object whose state holds a tensor, a value and another stateful object."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.buf, self.gen = n, torch.full((3,), float(n)), torch.Generator().manual_seed(seed)
        self.loaded: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "buf": self.buf, "gen": self.gen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)
        self.n, self.buf = state["n"], state["buf"]
        if state["gen"] is not self.gen:
            raise AssertionError("the nested generator should come back as the object, loaded")


def _trained_linear(seed: int) -> tuple[torch.nn.Linear, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for _ in range(3):
        lin(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    return lin, opt, sched


@pytest.mark.parametrize("how", ["save", "save_async", "manager.save", "manager.save_async"])
def test_stateful_objects_anywhere_round_trip_into_the_same_objects(tmp_path, how):
    lin, opt, sched = _trained_linear(0)
    gen = torch.Generator().manual_seed(7)
    torch.rand(5, generator=gen)
    tree = {"model": lin, "optim": opt, "parts": [sched, {"gen": gen, "counter": Counter(4, 3)}], "step": 9}
    if how == "save":
        tsckpt.save(tmp_path / "ck", tree)
    elif how == "save_async":
        tsckpt.save_async(tmp_path / "ck", tree).result()
    else:
        with tsckpt.CheckpointManager(tmp_path / "m") as m:
            getattr(m, how.split(".")[1])(1, tree)
            if how.endswith("async"):
                m.wait()
    directory = tmp_path / "ck" if how.startswith("save") else tmp_path / "m" / "00000001"
    stored = tsckpt.open(directory)
    assert np.array_equal(stored["parts/1/gen"][...], gen.get_state().numpy())
    assert stored["parts/0/last_epoch"] == 3 and stored["parts/1/counter/n"] == 4 and stored["step"] == 9
    assert "optim/state/0/exp_avg" in stored and stored["optim/param_groups/0/params/1"] == 1

    lin2, opt2, sched2 = _trained_linear(1)
    gen2, counter2 = torch.Generator().manual_seed(99), Counter(0, 5)
    target = {"model": lin2, "optim": opt2, "parts": [sched2, {"gen": gen2, "counter": counter2}], "step": 0}
    out = tsckpt.restore(directory, target)
    assert out["model"] is lin2 and out["optim"] is opt2 and out["parts"][0] is sched2
    assert out["parts"][1]["gen"] is gen2 and out["parts"][1]["counter"] is counter2 and out["step"] == 9
    assert torch.equal(lin2.weight, lin.weight) and torch.equal(lin2.bias, lin.bias)
    assert torch.equal(opt2.state[lin2.weight]["exp_avg"], opt.state[lin.weight]["exp_avg"])
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(torch.rand(4, generator=gen2), torch.rand(4, generator=gen))  # the same stream onwards
    assert counter2.n == 4 and torch.equal(counter2.buf, torch.full((3,), 4.0)) and len(counter2.loaded) == 1


def test_a_tree_without_stateful_objects_is_left_alone():
    tree = {"a": torch.zeros(2), "b": [1, "x", np.ones(3)], "c": None}
    assert expand(tree).tree is tree
    assert expand(tree).load(tree) is tree
    assert not is_stateful(torch.zeros(2)) and not is_stateful({"state_dict": 1}) and is_stateful(torch.Generator())


def test_inplace_reads_straight_into_a_modules_parameters(tmp_path):
    lin = _trained_linear(0)[0]
    tsckpt.save(tmp_path, {"m": lin})
    lin2 = _trained_linear(1)[0]
    weight = lin2.weight
    before = weight.data_ptr()
    tsckpt.restore(tmp_path, {"m": lin2}, inplace=True)
    assert lin2.weight is weight and weight.data_ptr() == before and torch.equal(weight, lin.weight)


def test_strict_false_keeps_an_objects_state_the_checkpoint_lacks(tmp_path):
    tsckpt.save(tmp_path, {"step": 1})
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    with pytest.raises(tsckpt.StructureMismatchError, match="gen"):
        tsckpt.restore(tmp_path, {"step": 0, "gen": gen})
    with pytest.warns(tsckpt.RestoreWarning, match="gen"):
        out = tsckpt.restore(tmp_path, {"step": 0, "gen": gen}, strict=False)
    assert out["gen"] is gen and torch.equal(gen.get_state(), state) and out["step"] == 1


def test_restore_without_target_gives_the_saved_state_as_a_tree(tmp_path):
    gen = torch.Generator().manual_seed(3)
    tsckpt.save(tmp_path, {"gen": gen, "counter": Counter(2, 1)})
    out = tsckpt.restore(tmp_path)
    assert np.array_equal(out["gen"], gen.get_state().numpy()) and out["counter"]["n"] == 2
    assert np.array_equal(out["counter"]["gen"], torch.Generator().manual_seed(1).get_state().numpy())


def test_a_whole_state_inside_a_tree_is_refused_naming_its_place(tmp_path):
    state = tt.TrainState(torch.nn.Linear(2, 2))
    with pytest.raises(tsckpt.StructureMismatchError, match=r"at 'run/0': a TrainState is a whole checkpoint's state"):
        tsckpt.save(tmp_path, {"run": [state]})
    assert not (tmp_path / "zarr.json").exists()


def test_a_failing_state_dict_fails_the_save_naming_nothing_half_written(tmp_path):
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("sampler state unavailable")

        def load_state_dict(self, state: Any) -> None:
            raise AssertionError("never restored")

    with pytest.raises(RuntimeError, match="sampler state unavailable"):
        tsckpt.save(tmp_path / "ck", {"x": torch.ones(2), "s": Broken()})
    assert not (tmp_path / "ck").exists() or not (tmp_path / "ck" / "zarr.json").exists()
    with pytest.raises(RuntimeError, match="sampler state unavailable"):
        tsckpt.save_async(tmp_path / "ck2", {"s": Broken()})  # in the caller, not the background
