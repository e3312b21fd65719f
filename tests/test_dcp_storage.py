"""torch.distributed.checkpoint storage through tsckpt (tsckpt.torch.StorageWriter / StorageReader):
dcp.save and dcp.async_save write tsckpt checkpoints, dcp.load reads any checkpoint tsckpt reads."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException carrying each rank's error
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tsckpt
import tsckpt.torch as tt
from tests.dist_helpers import run_ranks
from tests.strategies import assert_same
from tests.torch_scenarios import Cursor, fill_nan, full_optim, full_params, gpt, make_optimizer, nan_left, scheduler
from tests.torch_scenarios import seed_all, shard, train


@pytest.fixture(autouse=True)
def _single_process_is_meant():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * seed, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def _same_training_state(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    for (name, x), (_, y) in zip(a[0].state_dict().items(), b[0].state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def _load_into_fresh(d: Any, **reader: Any) -> tuple[tuple[torch.nn.Module, torch.optim.Optimizer], dict[str, Any]]:
    fresh = _trained(7)  # other values everywhere, and a learning rate of its own
    sd = _state(*fresh, step=0)
    dcp.load(sd, storage_reader=tt.StorageReader(d, **reader))
    set_state_dict(*fresh, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return fresh, sd


def test_save_and_load_round_trip_bit_exact(tmp_path, layout):
    saved = _trained(1)
    d = tmp_path / "ck"
    dcp.save(_state(*saved, step=2), storage_writer=tt.StorageWriter(d, layout=layout))
    fresh, sd = _load_into_fresh(d)
    _same_training_state(saved, fresh)
    assert sd["step"] == 2


def test_the_checkpoint_is_tsckpts_own_tree_read_by_tsckpt_and_zarr(tmp_path):
    zarr = pytest.importorskip("zarr")
    model, opt = _trained(1)
    d = tmp_path / "ck"
    dcp.save(_state(model, opt, step=2), storage_writer=tt.StorageWriter(d))
    assert sorted(os.listdir(d)) == ["model", "optim", "zarr.json"]  # no pickle beside the arrays
    assert tsckpt.verify(d).ok  # tsckpt's checksums, recorded at the commit
    restored = tsckpt.restore(d)
    assert restored["step"] == 2
    groups = restored["optim"]["param_groups"]
    assert groups[0]["betas"] == (0.8, 0.9) and groups[0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert groups[0]["foreach"] is None
    view = tsckpt.open(d)
    group = zarr.open_group(str(d), mode="r")
    for name, t in model.state_dict().items():
        assert np.array_equal(view[f"model/{name}"][...], t.numpy())
        assert np.array_equal(group[f"model/{name}"][...], t.numpy())
    exp_avg = opt.state_dict()["state"][0]["exp_avg"].numpy()
    assert np.array_equal(group["optim/state/0.weight/exp_avg"][...], exp_avg)
    assert float(restored["optim"]["state"]["0.weight"]["step"]) == 2.0


def test_checkpoint_id_gives_the_path(tmp_path):
    saved = _trained(1)
    d = tmp_path / "ck"
    dcp.save(_state(*saved, step=2), checkpoint_id=d, storage_writer=tt.StorageWriter())
    fresh, _ = _load_into_fresh(d)
    _same_training_state(saved, fresh)


def test_an_existing_checkpoint_is_kept_unless_overwrite(tmp_path):
    d = tmp_path / "ck"
    dcp.save(_state(*_trained(1), step=1), storage_writer=tt.StorageWriter(d))
    with pytest.raises(CheckpointException, match="already"):
        dcp.save(_state(*_trained(2), step=2), storage_writer=tt.StorageWriter(d))
    assert tsckpt.restore(d)["step"] == 1
    dcp.save(_state(*_trained(2), step=2), storage_writer=tt.StorageWriter(d, overwrite=True))
    assert tsckpt.restore(d)["step"] == 2


def test_async_save_writes_the_same_checkpoint(tmp_path):
    saved = _trained(1)
    d = tmp_path / "ck"
    future = dcp.async_save(_state(*saved, step=3), storage_writer=tt.StorageWriter(d))
    future.result(timeout=120)
    fresh, sd = _load_into_fresh(d)
    _same_training_state(saved, fresh)
    assert sd["step"] == 3


def test_loads_a_hugging_face_directory(tmp_path):
    from safetensors.torch import save_file

    model, _ = _trained(1)
    (tmp_path / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "hf" / "model.safetensors"))
    fresh = _model()
    sd = fresh.state_dict()
    dcp.load(sd, storage_reader=tt.StorageReader(tmp_path / "hf"))
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_loads_a_torch_save_file_with_values_and_a_tuple_of_tensors(tmp_path):
    model, _ = _trained(1)
    pair = (torch.arange(3.0), torch.ones(2, dtype=torch.int64))
    torch.save({"model": model.state_dict(), "step": 5, "pair": pair, "name": "run"}, tmp_path / "ck.pt")
    fresh = _model()
    sd = {"model": fresh.state_dict(), "step": 0, "pair": (torch.zeros(3), torch.zeros(2)), "name": ""}
    dcp.load(sd, storage_reader=tt.StorageReader(tmp_path / "ck.pt"))
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    assert sd["step"] == 5 and sd["name"] == "run"
    assert torch.equal(sd["pair"][0], pair[0]) and torch.equal(sd["pair"][1], pair[1])


def test_loads_an_orbax_checkpoint(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    jnp = pytest.importorskip("jax.numpy")
    w = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "orbax", {"params": {"w": jnp.asarray(w), "b": jnp.arange(4, dtype=jnp.bfloat16)}})
    sd = {"params": {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}}
    dcp.load(sd, storage_reader=tt.StorageReader(tmp_path / "orbax"))
    assert np.array_equal(sd["params"]["w"].numpy(), w)
    assert sd["params"]["b"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_loads_dcps_own_directory_only_when_its_pickle_is_allowed(tmp_path):
    saved = _trained(1)
    d = tmp_path / "dcp"
    dcp.save(_state(*saved, step=4), checkpoint_id=d)  # DCP's FileSystemWriter: a pickled .metadata
    with pytest.raises(CheckpointException, match="allow_pickle=True"):
        _load_into_fresh(d)
    fresh, sd = _load_into_fresh(d, allow_pickle=True)
    _same_training_state(saved, fresh)
    assert sd["step"] == 4


def test_a_cast_that_loses_values_is_refused(tmp_path):
    d = tmp_path / "ck"
    dcp.save({"w": torch.tensor([1.5, 70000.0])}, storage_writer=tt.StorageWriter(d))
    with pytest.raises(CheckpointException, match="float16"):
        dcp.load({"w": torch.zeros(2, dtype=torch.float16)}, storage_reader=tt.StorageReader(d))
    out = {"w": torch.zeros(2, dtype=torch.float64)}
    dcp.load(out, storage_reader=tt.StorageReader(d))
    assert out["w"].tolist() == [1.5, 70000.0]


class Opaque:
    pass


def test_a_value_dcp_would_pickle_is_refused_naming_it(tmp_path):
    d = tmp_path / "ck"
    with pytest.raises(CheckpointException, match=r"entry 'extra.obj' is a tests.test_dcp_storage.Opaque, which DCP would pickle; .*never a pickle"):
        dcp.save({"w": torch.ones(2), "extra": {"obj": Opaque()}}, storage_writer=tt.StorageWriter(d))
    with pytest.raises(CheckpointException, match=r"entry 'pair' holds a torch.Tensor at '0'"):
        dcp.save({"pair": (torch.ones(2), torch.ones(3))}, storage_writer=tt.StorageWriter(d))
    assert not (d / "zarr.json").exists()


def test_planner_data_that_has_no_place_in_the_format_is_refused(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Odd(DefaultSavePlanner):
        def create_local_plan(self):  # type: ignore[no-untyped-def]
            return dataclasses.replace(super().create_local_plan(), planner_data={"w": Opaque()})

    d = tmp_path / "ck"
    with pytest.raises(CheckpointException, match="planner_data .*has no place in a tsckpt checkpoint"):
        dcp.save({"w": torch.ones(2)}, storage_writer=tt.StorageWriter(d), planner=Odd())
    assert not d.exists() or not (d / "zarr.json").exists()


def test_validate_checkpoint_id(tmp_path):
    assert tt.StorageWriter.validate_checkpoint_id(str(tmp_path / "new"))
    assert not tt.StorageReader.validate_checkpoint_id(str(tmp_path / "new"))
    dcp.save({"w": torch.ones(2)}, storage_writer=tt.StorageWriter(tmp_path / "ck"))
    assert tt.StorageReader.validate_checkpoint_id(tmp_path / "ck")


def test_options_are_checked_when_made():
    with pytest.raises(ValueError, match="layout"):
        tt.StorageWriter("x", layout="zip")
    with pytest.raises(ValueError, match="casting"):
        tt.StorageReader("x", casting="sometimes")


# ---- FSDP2 on 2 gloo ranks, resharded to 1 process and back -------------------------------


def _gpt_state(rank: int, world: int, fsdp: bool, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    seed_all(rank)
    model = gpt(seed, dropout=0.0)
    if fsdp:
        shard(model, world)
    opt = make_optimizer(model)
    sched = scheduler(opt)
    return model, opt, sched


def _report(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": full_params(model), "optim": full_optim(opt, model), "lr": [g["lr"] for g in opt.param_groups]}


def dcp_save_scenario(rank: int, world: int, d: str, fsdp: bool, in_background: str | None = None) -> dict[str, Any]:
    """Train 3 steps and dcp.save to ``d``; also dcp.async_save to ``in_background``."""
    model, opt, sched = _gpt_state(rank, world, fsdp, 0)
    train(model, opt, sched, Cursor(), 3, rank=rank, world=world)
    msd, osd = get_state_dict(model, opt)
    if world > 1:  # each rank saving alone, while tsckpt's writer saves with the whole group: refused on all
        with pytest.raises(CheckpointException, match=r"not with no_dist=True in a job of several ranks"):
            dcp.save({"step": 3}, storage_writer=tt.StorageWriter(f"{d}-alone"), no_dist=True)
        if os.path.exists(f"{d}-alone"):
            raise AssertionError("a refused save left a directory")
    dcp.save({"model": msd, "optim": osd, "step": 3}, storage_writer=tt.StorageWriter(d))
    if in_background is not None:
        pending = dcp.async_save({"model": msd, "optim": osd, "step": 3}, storage_writer=tt.StorageWriter(in_background))
        pending.result(timeout=120)
    return _report(model, opt)


def dcp_load_scenario(rank: int, world: int, d: str, fsdp: bool, hf: str | None = None) -> dict[str, Any]:
    """A fresh model and optimizer, NaN everywhere, dcp.load from ``d``; the parameters also
    loaded into another fresh model from the Hugging Face directory ``hf``."""
    torch.manual_seed(999)
    model, opt, _ = _gpt_state(rank, world, fsdp, 5)
    fill_nan(model, opt)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    dcp.load(sd, storage_reader=tt.StorageReader(d))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out = {**_report(model, opt), "step": sd["step"], "nan": nan_left(model, opt)}
    if hf is not None:
        other, _, _ = _gpt_state(rank, world, fsdp, 6)
        fill_nan(other, None)
        dcp.load(other.state_dict(), storage_reader=tt.StorageReader(hf))
        out["hf"] = full_params(other)
    return out


def _assert_same(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    assert loaded["nan"] == [] and loaded["step"] == 3 and loaded["lr"] == saved["lr"]
    for part in ("params", "optim"):
        assert saved[part].keys() == loaded[part].keys()
        for k, v in saved[part].items():
            assert v.tobytes() == loaded[part][k].tobytes(), (part, k)


@pytest.mark.slow
def test_fsdp2_on_2_ranks_saved_then_loaded_in_1_process(tmp_path):
    d, d2 = str(tmp_path / "ck"), str(tmp_path / "async")
    saved = run_ranks(dcp_save_scenario, 2, d, True, d2, timeout=240)
    assert saved[0]["params"].keys() == saved[1]["params"].keys()
    assert_same(tsckpt.restore(d2), tsckpt.restore(d))  # dcp.async_save wrote the same checkpoint
    _assert_same(saved[0], dcp_load_scenario(0, 1, d, False))
    view = tsckpt.open(d)  # tsckpt's global arrays, whole, from the shards both ranks wrote
    assert view["step"] == 3
    for name, v in saved[0]["params"].items():
        assert view[f"model/{name}"][...].tobytes() == v.tobytes(), name


@pytest.mark.slow
def test_saved_in_1_process_then_loaded_by_fsdp2_on_2_ranks(tmp_path):
    from safetensors.torch import save_file

    d, hf = str(tmp_path / "ck"), tmp_path / "hf"
    saved = dcp_save_scenario(0, 1, d, False)
    hf.mkdir()
    save_file({k: torch.from_numpy(v) for k, v in saved["params"].items()}, str(hf / "model.safetensors"))
    for loaded in run_ranks(dcp_load_scenario, 2, d, True, str(hf), timeout=240):
        _assert_same(saved, loaded)
        for k, v in saved["params"].items():
            assert v.tobytes() == loaded["hf"][k].tobytes(), k
