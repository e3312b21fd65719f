"""tsckpt.torch.TrainState in the training loop: the manager's async saves, restores in place,
and the bridge's twins (save / save_async / restore) agreeing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt.torch as tt
from tests import torch_scenarios as sc
from tests.dist_helpers import run_ranks

N, M = 5, 4


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def _state(seed: int) -> tuple[tt.TrainState, torch.nn.Module, torch.optim.Optimizer, sc.Cursor]:
    model = sc.gpt(seed, dropout=0.0)
    opt = sc.make_optimizer(model)
    sched, cursor = sc.scheduler(opt), sc.Cursor()
    state = tt.TrainState(model, opt, extra={"scheduler": sched, "step": 0, "gen": torch.Generator().manual_seed(seed)},
                          per_rank={"data": cursor, "seen": 0})
    return state, model, opt, cursor


@pytest.mark.slow
def test_manager_save_async_and_restore_resume_bit_identically(tmp_path):
    ref = sc.run_solo(sc.train_save_continue, str(tmp_path), N, M, False, "adamw", "manager")
    got = sc.run_solo(sc.resume, str(tmp_path), M, False, "adamw", None, "manager")
    assert got["step"] == N and got["nan_left"] == [] and got["tied"]
    assert got["after"] == ref["after"]  # losses bit for bit: training went on during the save
    _same(got["params"], ref["params"])
    _same(got["optim"], ref["optim"])
    assert got["lr"] == ref["lr"] and got["consumed"] == ref["consumed"]
    root = json.load(open(os.path.join(tmp_path, f"{N:08d}", "zarr.json")))["attributes"]["tsckpt"]
    assert root["aliases"] == {"model/tok.weight": "model/head.weight"}  # tied weights stored once


@pytest.mark.slow
def test_fsdp2_manager_loop_on_2_ranks_resumes_exactly(tmp_path):
    ref = run_ranks(sc.train_save_continue, 2, str(tmp_path), N, M, True, "adamw", "manager")
    got = run_ranks(sc.resume, 2, str(tmp_path), M, True, "adamw", None, "manager")
    for r in range(2):
        assert got[r]["step"] == N and got[r]["nan_left"] == [] and got[r]["tied"]
        assert got[r]["after"] == ref[r]["after"]
        _same(got[r]["params"], ref[r]["params"])
        _same(got[r]["optim"], ref[r]["optim"])
        assert got[r]["consumed"] == ref[r]["consumed"]
    root = json.load(open(os.path.join(tmp_path, f"{N:08d}", "zarr.json")))["attributes"]["tsckpt"]
    assert root["world_size"] == 2 and "ranks/1/data/gen" in root["leaves"] and "ranks/1/rng/torch" in root["leaves"]


def test_train_state_through_every_verb_restores_in_place(tmp_path):
    state, model, opt, cursor = _state(1)
    sc.train(model, opt, state.extra["scheduler"], cursor, 2)
    state.extra["step"], state.per_rank["seen"] = 2, 17
    want_gen = torch.rand(3, generator=torch.Generator().set_state(state.extra["gen"].get_state()))
    tsckpt.save(tmp_path / "a", state)
    tsckpt.save_async(tmp_path / "b", state).result()
    tt.save_async(tmp_path / "c", model, opt, extra=state.extra, per_rank=state.per_rank).result()
    tt.save(tmp_path / "d", model, opt, extra=state.extra, per_rank=state.per_rank)
    saved = {k: v.copy() for k, v in sc.full_params(model).items()}
    readers = [tsckpt.open(tmp_path / d) for d in "abcd"]
    assert sorted(readers[0]) == sorted(readers[1]) == sorted(readers[2]) == sorted(readers[3])
    for path in readers[0]:
        if "/rng/" not in path:  # the RNG states are each call's own
            values = [np.asarray(r[path][...]) if isinstance(r[path], tsckpt.LazyArray) else r[path] for r in readers]
            assert all(np.array_equal(values[0], v) for v in values[1:]), path
    for d in "abcd":
        fresh, model2, opt2, cursor2 = _state(5)
        sched2, gen2 = fresh.extra["scheduler"], fresh.extra["gen"]
        assert tsckpt.restore(tmp_path / d, fresh) is fresh
        _same(sc.full_params(model2), saved)
        assert fresh.extra["step"] == 2 and fresh.per_rank["seen"] == 17  # plain values replaced
        assert fresh.extra["scheduler"] is sched2 and sched2.last_epoch == 2  # objects loaded in place
        assert fresh.extra["gen"] is gen2 and torch.equal(torch.rand(3, generator=gen2), want_gen)
        assert fresh.per_rank["data"] is cursor2 and cursor2.consumed == cursor.consumed


def test_manager_restore_returns_the_step_for_objects_restored_in_place(tmp_path):
    state, model, opt, cursor = _state(1)
    with tsckpt.CheckpointManager(tmp_path, keep_last=2) as manager:
        for step in (10, 20, 30):
            state.extra["step"] = step
            manager.save_async(step, state).result()
        assert manager.all_steps() == [20, 30]
        fresh = _state(2)[0]
        assert manager.restore(target=fresh) == 30 and fresh.extra["step"] == 30
        assert manager.restore(20, fresh) == 20 and fresh.extra["step"] == 20
        lin = torch.nn.Linear(2, 2)
        manager.save(40, lin)
        lin2 = torch.nn.Linear(2, 2)
        assert manager.restore(target=lin2) == 40 and torch.equal(lin2.weight, lin.weight)
        tree = manager.restore(40)  # no target: the tree, as tsckpt.restore gives it
        assert sorted(tree) == ["bias", "weight"] and np.array_equal(tree["weight"], lin.weight.detach().numpy())


def test_train_state_refuses_options_that_do_not_apply(tmp_path):
    state = _state(1)[0]
    tsckpt.save(tmp_path, state)
    with pytest.raises(ValueError, match="as_saved=True does not apply to a TrainState: it restores into the live"):
        tsckpt.restore(tmp_path, state, as_saved=True)
    with pytest.raises(ValueError, match="format='dcp' does not apply to a TrainState"):
        tsckpt.restore(tmp_path, state, format="dcp")


def test_train_state_checks_its_names():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(tsckpt.StructureMismatchError, match="per_rank name 'rng' is reserved"):
        tt.TrainState(model, per_rank={"rng": 1})
    with pytest.raises(tsckpt.StructureMismatchError, match="extra keys must be str names, found 3"):
        tt.TrainState(model, extra={3: 1})
    assert tt.TrainState(model, per_rank={"rng": 1}, rng=False).per_rank == {"rng": 1}


def test_train_state_strict_false_keeps_what_the_checkpoint_lacks(tmp_path):
    model = torch.nn.Linear(2, 2)
    tsckpt.save(tmp_path, tt.TrainState(model, extra={"step": 3}))
    state = tt.TrainState(torch.nn.Linear(2, 2), extra={"step": 0, "epoch": 9})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"missing from the checkpoint: \['extra/epoch'\]"):
        tsckpt.restore(tmp_path, state)
    tsckpt.restore(tmp_path, state, strict=False)
    assert state.extra == {"step": 3, "epoch": 9}
    assert torch.equal(state.model.weight, model.weight)


def test_cuda_rng_states_are_matched_even_before_cuda_is_used(tmp_path, monkeypatch):
    """CUDA RNG states in the checkpoint are restored on a machine with CUDA even when this
    process has not initialized CUDA yet; a different device count warns. (CUDA faked: the
    states are byte tensors, and torch.cuda's calls are recorded.)"""
    import tsckpt.torch._train as train_module

    saved = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    real = train_module.get_rng_state
    monkeypatch.setattr(train_module, "get_rng_state", lambda: {**real(), "cuda": saved})
    tsckpt.save(tmp_path, tt.TrainState(torch.nn.Linear(2, 2)))
    monkeypatch.setattr(train_module, "get_rng_state", real)

    set_calls: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: set_calls.append((i, s.tolist())))
    for devices in (2, 1):
        set_calls.clear()
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        if devices == 2:
            tsckpt.restore(tmp_path, tt.TrainState(torch.nn.Linear(2, 2)))
        else:
            with pytest.warns(tsckpt.RestoreWarning, match="2 CUDA RNG states were saved, and this process sees 1"):
                tsckpt.restore(tmp_path, tt.TrainState(torch.nn.Linear(2, 2)))
        assert set_calls == [(i, saved[i].tolist()) for i in range(devices)]


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: torch.utils.data.RandomSampler(range(10)),
        lambda: torch.utils.data.distributed.DistributedSampler(range(10), num_replicas=2, rank=0),
    ],
)
def test_a_sampler_without_state_is_refused_when_the_state_is_built(sampler):
    """torch's own samplers have no state_dict(): refused naming the object and what to pass,
    when the TrainState is built, not at the first save after training started."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(tsckpt.LeafTypeError) as e:
        tt.TrainState(model, per_rank={"sampler": sampler()})
    msg = str(e.value)
    assert msg.startswith("TrainState(per_rank={'sampler': ...}): a torch.utils.data.")
    assert "has no state_dict()/load_state_dict()" in msg
    assert "per_rank={'epoch': epoch}" in msg and "StatefulDataLoader" in msg
    with pytest.raises(tsckpt.LeafTypeError, match=r"^TrainState\(extra=\{'helper': \.\.\.\}\): a builtins\.object"):
        tt.TrainState(model, extra={"helper": [1, object()]})


def test_plain_values_generators_and_stateful_objects_are_accepted(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    state = tt.TrainState(model, opt, extra={"sched": sched, "step": 3, "cfg": {"a": [1.5, None, "x"]}},
                       per_rank={"seen": 7, "gen": torch.Generator().manual_seed(1), "buf": torch.zeros(2)})
    tsckpt.save(str(tmp_path / "ck"), state)
    assert tsckpt.metadata(str(tmp_path / "ck"))["ranks"][0]["seen"] == 7
