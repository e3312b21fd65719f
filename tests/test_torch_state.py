"""tsckpt.torch in one process: state trees, optimizers by name, dtypes, errors."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

import tsckpt
import tsckpt.torch as tt
from tests import torch_scenarios as sc


def _step(model: nn.Module, opt: torch.optim.Optimizer, n: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, sc.VOCAB, (2, 6), generator=g)
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()


def _trained(kind: str = "adamw", seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = sc.gpt(seed, dropout=0.0)
    opt = sc.make_optimizer(model, kind)
    _step(model, opt)
    return model, opt


def _assert_same(model: nn.Module, opt: torch.optim.Optimizer, ref_model: nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    for (n, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(ref_model.state_dict().items())):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    got, want = sc.full_optim(opt, model), sc.full_optim(ref_opt, ref_model)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert _hyper(opt, model) == _hyper(ref_opt, ref_model)


def _hyper(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, dict]:
    """Each parameter's group hyperparameters, by parameter name (groups may be listed in any order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups for p in g["params"]}


def test_get_state_dict_is_a_plain_tree_keyed_by_name_without_side_effects():
    model = sc.gpt(0)
    opt = sc.make_optimizer(model)
    sd = tt.get_state_dict(model, opt)
    assert not opt.state  # a never-stepped optimizer is not stepped to create its state
    assert sd["optim"]["state"] == {}
    assert sd["optim"]["types"] == ["torch.optim.adamw.AdamW"]
    assert sd["optim"]["param_groups"][0]["params"][:2] == ["tok.weight", "pos.weight"]
    assert sd["optim"]["param_groups"][0]["weight_decay"] == 0.1
    assert {"tok.weight", "head.weight", "seen"} <= set(sd["model"])
    assert sd["model"]["tok.weight"].data_ptr() == model.tok.weight.data_ptr()  # the live tensors, no copy
    _step(model, opt, 1)
    sd = tt.get_state_dict(model, opt)
    assert sorted(sd["optim"]["state"]["tok.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert "head.weight" not in sd["optim"]["state"]  # one state for the tied parameter
    assert sd["optim"]["state"]["tok.weight"]["exp_avg"] is opt.state[model.tok.weight]["exp_avg"]


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_round_trip_into_fresh_model_with_other_registration_order(ckdir, kind):
    model, opt = _trained(kind)
    tsckpt.save(ckdir, tt.get_state_dict(model, opt))

    # same names, parameters registered in another order and groups listed the other way round
    fresh = sc.gpt(5, dropout=0.0)
    fresh.blocks = nn.ModuleList(reversed(list(fresh.blocks)))
    for i, blk in enumerate(fresh.blocks):  # names follow the list position
        fresh.blocks._modules[str(i)] = blk
    named = list(fresh.named_parameters())
    decay = [p for _, p in reversed(named) if p.dim() >= 2]
    other = [p for _, p in reversed(named) if p.dim() < 2]
    groups = [{"params": other, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1}]
    fresh_opt = type(opt)(groups, **{k: v for k, v in opt.defaults.items() if k in ("lr", "momentum", "nesterov")})
    tt.set_state_dict(fresh, fresh_opt, tsckpt.restore(ckdir))  # a tree of numpy arrays and values
    _assert_same(fresh, fresh_opt, model, opt)
    # both go on identically
    _step(model, opt, 2, seed=3)
    _step(fresh, fresh_opt, 2, seed=3)
    _assert_same(fresh, fresh_opt, model, opt)


def test_restore_in_place_fills_every_nan_and_keeps_the_tensors(ckdir):
    model, opt = _trained()
    sched = sc.scheduler(opt)
    _step(model, opt, 1)
    sched.step()
    tt.save(ckdir, model, opt, extra={"scheduler": sched, "step": 2, "note": "run-1"})
    fresh = sc.gpt(3, dropout=0.0)
    fresh_opt = sc.make_optimizer(fresh)
    fresh_sched = sc.scheduler(fresh_opt)
    sc.fill_nan(fresh, fresh_opt)
    ptrs = [t.data_ptr() for t in fresh.parameters()] + [v.data_ptr() for s in fresh_opt.state.values() for v in s.values()]
    out = tt.restore(ckdir, fresh, fresh_opt, extra={"scheduler": fresh_sched, "step": 0, "note": ""})
    assert sc.nan_left(fresh, fresh_opt) == []
    assert ptrs == [t.data_ptr() for t in fresh.parameters()] + [v.data_ptr() for s in fresh_opt.state.values() for v in s.values()]
    assert out == {"scheduler": fresh_sched, "step": 2, "note": "run-1"}
    assert fresh_sched.state_dict() == sched.state_dict()
    _assert_same(fresh, fresh_opt, model, opt)


def test_never_stepped_optimizer_resumes_never_stepped(ckdir):
    model = sc.gpt(0, dropout=0.0)
    opt = sc.make_optimizer(model)
    tt.save(ckdir, model, opt)
    assert not opt.state
    fresh = sc.gpt(4, dropout=0.0)
    fresh_opt = sc.make_optimizer(fresh)
    tt.restore(ckdir, fresh, fresh_opt)
    assert not fresh_opt.state  # the state torch creates to restore into is dropped again
    _step(model, opt, 2)
    _step(fresh, fresh_opt, 2)
    _assert_same(fresh, fresh_opt, model, opt)


def test_compiled_model_names_are_clean(ckdir):
    model, opt = _trained()
    compiled = torch.compile(model)  # never called: only the wrapper's naming matters
    sd = tt.get_state_dict(compiled, opt)
    assert "tok.weight" in sd["model"] and not any("_orig_mod" in k for k in sd["model"])
    tsckpt.save(ckdir, sd)
    fresh = sc.gpt(2, dropout=0.0)
    fresh_opt = sc.make_optimizer(fresh)
    tt.set_state_dict(fresh, fresh_opt, tsckpt.restore(ckdir))
    _assert_same(fresh, fresh_opt, model, opt)


class MasterAdam(torch.optim.Optimizer):
    """bf16 parameters updated from fp32 master weights and fp32 moments kept in the optimizer state."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["master"] = p.detach().float().clone()
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["step"] = 0
                st["step"] += 1
                st["exp_avg"].mul_(0.9).add_(p.grad.float(), alpha=0.1)
                st["master"].add_(st["exp_avg"], alpha=-g["lr"])
                p.copy_(st["master"])


def test_mixed_precision_every_leaf_keeps_its_dtype(ckdir):
    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        m[0].to(torch.bfloat16)
        m[1].to(torch.float16)
        m.register_buffer("ema", torch.zeros(3, dtype=torch.float64))
        return m, MasterAdam(m.parameters())

    model, opt = build(0)
    for _ in range(3):
        h = model[0](torch.randn(4, 6, dtype=torch.bfloat16))
        model[1](h.half()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.ema += 1.5
    tt.save(ckdir, model, opt, rng=False)
    stored = {a["path"]: a["dtype"] for a in json.load(open(os.path.join(ckdir, "zarr.json")))["attributes"]["tsckpt"]["arrays"]}
    assert stored["model/0.weight"] == "bfloat16" and stored["model/1.weight"] == "float16"
    assert stored["optim/state/0.weight/master"] == "float32" and stored["model/ema"] == "float64"

    fresh, fresh_opt = build(1)
    sc.fill_nan(fresh, None)
    tt.restore(ckdir, fresh, fresh_opt, rng=False)
    _assert_same(fresh, fresh_opt, model, opt)  # dtypes and bits, master weights not cast to bf16
    assert fresh_opt.state[fresh[0].weight]["master"].dtype == torch.float32
    assert fresh_opt.state[fresh[0].weight]["step"] == 3

    # a target that asks for another dtype gets a cast (and only that leaf)
    wide = copy.deepcopy(fresh)
    wide[0].float()  # the parameters; the float64 buffer stays
    tt.set_state_dict(wide, None, tsckpt.restore(ckdir))
    assert wide[0].weight.dtype == torch.float32 and torch.equal(wide[0].weight, model[0].weight.float())
    assert wide.ema.dtype == torch.float64


def test_another_architecture_lists_missing_and_unexpected_names(ckdir):
    model, opt = _trained()
    tt.save(ckdir, model, opt)
    other = nn.ModuleDict({"tok": nn.Embedding(sc.VOCAB, sc.DIM), "proj": nn.Linear(sc.DIM, 3)})
    with pytest.raises(tsckpt.StructureMismatchError) as e:
        tt.restore(ckdir, other, torch.optim.AdamW(other.parameters()))
    msg = str(e.value)
    assert "model and checkpoint differ" in msg
    assert "missing from the checkpoint: 2 ('proj.bias', 'proj.weight')" in msg
    assert f"{ckdir}: model and checkpoint differ" in msg
    assert "in the checkpoint but not in the model: 29 ('blocks.0.ln1.bias', 'blocks.0.ln1.weight'" in msg
    assert "strict=False" in msg
    with pytest.raises(tsckpt.StructureMismatchError, match="'proj.weight'"):
        tt.set_state_dict(other, None, tsckpt.restore(ckdir))
    # strict=False loads the names both have
    tt.restore(ckdir, other, None, strict=False, rng=True)
    assert torch.equal(other["tok"].weight, model.tok.weight)


def test_optimizer_of_another_type_is_refused(ckdir):
    model, opt = _trained("adamw")
    tt.save(ckdir, model, opt)
    fresh = sc.gpt(1, dropout=0.0)
    sgd = sc.make_optimizer(fresh, "sgd")
    with pytest.raises(tsckpt.StructureMismatchError) as e:
        tt.restore(ckdir, fresh, sgd)
    msg = str(e.value)
    assert "optimizer types differ" in msg and "['torch.optim.adamw.AdamW']" in msg and "['torch.optim.sgd.SGD']" in msg
    assert "restore without optimizers" in msg
    # without the recorded types (a tree from elsewhere), the state keys tell
    sd = tsckpt.restore(ckdir)
    del sd["optim"]["types"]
    with pytest.raises(tsckpt.StructureMismatchError, match=r"holds \['exp_avg', 'exp_avg_sq', 'step'\] but SGD keeps \['momentum_buffer'\]"):
        tt.set_state_dict(fresh, sgd, sd)
    # the model alone still loads
    tt.restore(ckdir, fresh, None)
    assert torch.equal(fresh.tok.weight, model.tok.weight)


def test_padded_vocabulary_shape_mismatch_and_resize(ckdir):
    model, opt = _trained()
    tt.save(ckdir, model, opt)
    padded = sc.gpt(9, dropout=0.0, vocab=sc.VOCAB + 8)  # vocabulary padded to a multiple of 16
    padded_opt = sc.make_optimizer(padded)
    with pytest.raises(tsckpt.ShapeMismatchError) as e:
        tt.restore(ckdir, padded, padded_opt)
    msg = str(e.value)
    assert (
        "'model/tok.weight': the model has shape [48, 32] but the checkpoint holds [40, 32] (and 3 more: "
        "['model/head.weight', 'optim/state/tok.weight/exp_avg', 'optim/state/tok.weight/exp_avg_sq'])" in msg
    )
    assert "pass resize=['head.weight', 'tok.weight'] to copy the overlapping region" in msg
    new_rows = padded.tok.weight[sc.VOCAB :].clone()
    tt.restore(ckdir, padded, padded_opt, resize=["tok.weight"])  # either name of the tied parameter
    assert torch.equal(padded.tok.weight[: sc.VOCAB], model.tok.weight)
    assert torch.equal(padded.tok.weight[sc.VOCAB :], new_rows)  # the padding keeps the model's values
    assert padded.head.weight is padded.tok.weight
    st, ref = padded_opt.state[padded.tok.weight], opt.state[model.tok.weight]
    assert torch.equal(st["exp_avg"][: sc.VOCAB], ref["exp_avg"]) and torch.equal(st["step"], ref["step"])
    assert torch.equal(padded.blocks[1].qkv.weight, model.blocks[1].qkv.weight)
    # the same for a tree through set_state_dict
    again = sc.gpt(9, dropout=0.0, vocab=sc.VOCAB + 8)
    with pytest.raises(tsckpt.ShapeMismatchError, match="resize="):
        tt.set_state_dict(again, None, tsckpt.restore(ckdir))
    tt.set_state_dict(again, None, tsckpt.restore(ckdir), resize=["head.weight"])
    assert torch.equal(again.tok.weight[: sc.VOCAB], model.tok.weight)


def test_rng_states_round_trip_as_arrays(ckdir):
    import random

    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian
    state = tt.get_rng_state()
    want = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2))
    tsckpt.save(ckdir, {"rng": state})
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    tt.set_rng_state(tsckpt.restore(ckdir)["rng"])
    got = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2))
    assert torch.equal(got[0], want[0]) and got[1:3] == want[1:3] and np.array_equal(got[3], want[3])
    kinds = {a["path"]: a["dtype"] for a in json.load(open(os.path.join(ckdir, "zarr.json")))["attributes"]["tsckpt"]["arrays"]}
    assert kinds == {"rng/torch": "uint8", "rng/numpy/keys": "uint32", "rng/python/state": "int64"}


def test_missing_per_rank_state_is_reported(ckdir):
    model, opt = _trained()
    tt.save(ckdir, model, opt, rng=False)
    with pytest.raises(tsckpt.StructureMismatchError) as e:
        tt.restore(ckdir, sc.gpt(1, dropout=0.0), None, per_rank={"data": sc.Cursor()})
    msg = str(e.value)
    assert "missing from the checkpoint: ['ranks/0/data/consumed', 'ranks/0/data/gen', 'ranks/0/rng/numpy/cached_gaussian'" in msg
    assert "saved by 1 ranks; this is rank 0" in msg and "strict=False" in msg
    cursor = sc.Cursor()
    cursor.consumed = 5
    tt.restore(ckdir, sc.gpt(1, dropout=0.0), None, per_rank={"data": cursor}, strict=False)
    assert cursor.consumed == 5  # nothing stored for it: kept


def test_reserved_and_bad_names(ckdir):
    model = sc.gpt(0)
    with pytest.raises(tsckpt.StructureMismatchError, match="'rng' is reserved"):
        tt.save(ckdir, model, per_rank={"rng": sc.Cursor()})
    with pytest.raises(tsckpt.StructureMismatchError, match="extra keys must be str"):
        tt.save(ckdir, model, extra={1: 2})
    with pytest.raises(tsckpt.StructureMismatchError, match="not a parameter of the model"):
        tt.get_state_dict(model, torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))


def test_per_rank_plain_values_and_pytrees_come_back(ckdir):
    model = sc.gpt(0, dropout=0.0)
    cursor = sc.Cursor()
    cursor.consumed = 17
    window = {"start": 3, "ids": torch.arange(4), "name": "shard-a"}
    tt.save(ckdir, model, extra={"seen": 5}, per_rank={"seen": 11, "window": window, "data": cursor})
    root = json.load(open(os.path.join(ckdir, "zarr.json")))["attributes"]["tsckpt"]
    assert root["values"]["ranks/0/seen"]["value"] == 11 and "ranks/0/window/ids" in root["leaves"]

    fresh, ids = sc.Cursor(), torch.zeros(4, dtype=torch.int64)
    out = tt.restore(
        ckdir, sc.gpt(1, dropout=0.0), extra={"seen": 0},
        per_rank={"seen": 0, "window": {"start": 0, "ids": ids, "name": ""}, "data": fresh},
    )
    assert isinstance(out, tt.RestoreResult) and out == {"seen": 5}  # extra names only: no collision
    assert sorted(out.per_rank) == ["data", "seen", "window"]  # the RNG states are not handed back
    assert out.per_rank["seen"] == 11
    assert out.per_rank["window"]["start"] == 3 and out.per_rank["window"]["name"] == "shard-a"
    assert out.per_rank["window"]["ids"] is ids and ids.tolist() == [0, 1, 2, 3]  # a tensor is filled in place
    assert out.per_rank["data"] is fresh and fresh.consumed == 17  # stateful: loaded, as before
    assert repr(out) == f"RestoreResult({{'seen': 5}}, per_rank={out.per_rank!r})"


def test_per_rank_values_without_rng_and_missing_ones(ckdir):
    model = sc.gpt(0, dropout=0.0)
    tt.save(ckdir, model, rng=False, per_rank={"rng": 42})  # the name is free without rng
    out = tt.restore(ckdir, sc.gpt(1, dropout=0.0), rng=False, per_rank={"rng": 0})
    assert out == {} and out.per_rank == {"rng": 42}
    with pytest.raises(tsckpt.StructureMismatchError, match=r"missing from the checkpoint: \['ranks/0/epoch'\]"):
        tt.restore(ckdir, sc.gpt(1, dropout=0.0), rng=False, per_rank={"rng": 0, "epoch": 1})
    out = tt.restore(ckdir, sc.gpt(1, dropout=0.0), rng=False, per_rank={"rng": 0, "epoch": 1}, strict=False)
    assert out.per_rank == {"rng": 42, "epoch": 1}  # nothing stored for it: the value given is kept
