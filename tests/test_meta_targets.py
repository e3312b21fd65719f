"""Targets on the meta device: a restore gives them real tensors (on the CPU), read region by
region into the new memory; a meta module restored by tsckpt.torch ends with real parameters."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._read.restore as restore_mod
import tsckpt.torch


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.fixture
def saved(ckdir):
    tree = {"w": torch.randn(4, 3), "b": torch.arange(3.0), "step": 5}
    tsckpt.save(ckdir, tree)
    return ckdir, tree


@pytest.mark.parametrize("inplace", [False, True])
def test_meta_target_gets_real_cpu_tensors(saved, inplace):
    d, tree = saved
    target = {"w": meta(4, 3), "b": meta(3, dtype=torch.float64), "step": 0}
    out = tsckpt.restore(d, target, inplace=inplace)
    assert out["w"].device.type == "cpu" and out["b"].device.type == "cpu"
    assert torch.equal(out["w"], tree["w"])
    assert out["b"].dtype == torch.float64 and out["b"].tolist() == [0.0, 1.0, 2.0]  # the target's dtype, cast
    assert out["step"] == 5
    assert target["w"].device.type == "meta"  # a meta tensor cannot be written: the result holds the data


def test_meta_target_is_read_straight_into_the_new_tensor(saved, monkeypatch):
    """No whole second copy: the tensor returned is the memory the reads filled."""
    d, _ = saved
    filled: list[int] = []
    real = restore_mod.read_into

    def recording(ck, dests, *rest, **kw):
        filled.extend(dest.tensor.data_ptr() for dest in dests)
        return real(ck, dests, *rest, **kw)

    monkeypatch.setattr(restore_mod, "read_into", recording)
    out = tsckpt.restore(d, {"w": meta(4, 3), "b": meta(3), "step": 0}, inplace=True)
    assert out["w"].device.type == "cpu"
    assert sorted(filled) == sorted([out["w"].data_ptr(), out["b"].data_ptr()])


def test_tied_meta_targets_get_one_tensor(ckdir):
    w = torch.randn(5, 2)
    tsckpt.save(ckdir, {"emb": w, "head": w})
    with torch.device("meta"):
        emb = torch.nn.Embedding(5, 2)
    out = tsckpt.restore(ckdir, {"emb": emb.weight.detach(), "head": emb.weight.detach()})
    assert out["head"] is out["emb"] and torch.equal(out["emb"], w)


def test_meta_state_dict_loads_with_assign(ckdir):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    tsckpt.save(ckdir, ref.state_dict())
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    out = tsckpt.restore(ckdir, model.state_dict())
    model.load_state_dict(out, assign=True)
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))


def test_meta_sharded_array_target(ckdir):
    full = torch.arange(12.0).reshape(4, 3)
    tsckpt.save(ckdir, {"w": full})
    out = tsckpt.restore(ckdir, {"w": tsckpt.ShardedArray(meta(2, 3), (4, 3), (2, 0))}, inplace=True)
    assert out["w"].local.device.type == "cpu" and torch.equal(out["w"].local, full[2:])


# ---- a meta module through tsckpt.torch --------------------------------------------------


class Tied(torch.nn.Module):
    """A language-model shape: the head's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.body = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # buffers: running stats, a counter
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.emb(idx))))


def _trained() -> Tied:
    torch.manual_seed(0)
    model = Tied()
    model(torch.randint(0, 11, (8,)))  # running stats move
    model.eval()
    return model


def _meta_model() -> Tied:
    with torch.device("meta"):
        model = Tied()
    model.body.bias.requires_grad_(False)
    return model.eval()


def _check_restored(model: Tied, ref: Tied) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == "cpu", name
    assert model.head.weight is model.emb.weight  # still tied: one parameter
    assert isinstance(model.emb.weight, torch.nn.Parameter) and model.emb.weight.requires_grad
    assert isinstance(model.body.bias, torch.nn.Parameter) and not model.body.bias.requires_grad  # kept
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    idx = torch.arange(11)
    assert torch.equal(model(idx), ref(idx))
    model(idx).sum().backward()
    assert model.emb.weight.grad is not None


def test_torch_restore_into_a_meta_module_gives_real_parameters(ckdir):
    ref = _trained()
    tsckpt.torch.save(ckdir, ref, extra={"step": 3})
    model = _meta_model()
    out = tsckpt.torch.restore(ckdir, model, extra={"step": 0})
    assert out["step"] == 3
    _check_restored(model, ref)


def test_train_state_restore_into_a_meta_module(ckdir):
    ref = _trained()
    tsckpt.save(ckdir, tsckpt.torch.TrainState(ref, rng=False))
    model = _meta_model()
    tsckpt.restore(ckdir, tsckpt.torch.TrainState(model, rng=False))
    _check_restored(model, ref)


def test_meta_module_parameters_are_the_memory_read_into(ckdir, monkeypatch):
    """No whole second copy: each new parameter is the tensor the reads filled."""
    tsckpt.torch.save(ckdir, _trained(), rng=False)
    filled: list[int] = []
    real = restore_mod.read_into

    def recording(ck, dests, *rest, **kw):
        filled.extend(dest.tensor.data_ptr() for dest in dests)
        return real(ck, dests, *rest, **kw)

    monkeypatch.setattr(restore_mod, "read_into", recording)
    model = _meta_model()
    tsckpt.torch.restore(ckdir, model, rng=False)
    assert model.emb.weight.device.type == "cpu"
    assert {t.data_ptr() for t in model.state_dict().values()} <= set(filled)


def test_meta_module_with_optimizers_is_refused_before_reading(ckdir):
    ref = _trained()
    tsckpt.torch.save(ckdir, ref, torch.optim.SGD(ref.parameters(), lr=0.1), rng=False)
    model = _meta_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tsckpt.LeafTypeError, match=r"meta device.*'body\.bias'.*restore the model first"):
        tsckpt.torch.restore(ckdir, model, opt, rng=False)
    assert model.emb.weight.device.type == "meta"


def test_meta_leaves_left_after_a_restore_are_logged(ckdir, caplog):
    class WithNonPersistent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("cache", torch.zeros(2), persistent=False)

    tsckpt.torch.save(ckdir, WithNonPersistent(), rng=False)
    with torch.device("meta"):
        model = WithNonPersistent()
    with caplog.at_level(logging.WARNING, logger="tsckpt"):
        tsckpt.torch.restore(ckdir, model, rng=False)
    assert model.lin.weight.device.type == "cpu"
    (rec,) = [r for r in caplog.records if "meta device" in r.getMessage()]
    assert "'cache'" in rec.getMessage()


def test_set_state_dict_into_a_meta_model_is_refused_not_a_no_op():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    state = {"model": {"weight": np.ones((2, 2), np.float32), "bias": np.zeros(2, np.float32)}}
    with pytest.raises(tsckpt.LeafTypeError, match=r"meta device.*'model/bias'"):
        tsckpt.torch.set_state_dict(model, None, state)


# ---- memory: the model and the read window, no second copy ------------------------------


_PEAK = """
import resource, sys, torch, tsckpt, tsckpt.torch
d = sys.argv[1]
tsckpt.open(d)["model/0.weight"][0:1]  # TensorStore's threads and torch.distributed's modules: not counted
tsckpt.torch.get_state_dict(torch.nn.Linear(1, 1))
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(64)])  # 256 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tsckpt.torch.restore(d, model, rng=False, max_inflight_bytes=8 << 20)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert all(p.device.type == "cpu" for p in model.parameters())
print((after - before) * 1024)
"""


@pytest.mark.slow
def test_meta_module_restore_peak_memory_is_the_model_and_the_window(tmp_path):
    import subprocess
    import sys

    d = str(tmp_path / "ck")
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(64)])
    tsckpt.torch.save(d, model, rng=False)
    del model
    r = subprocess.run([sys.executable, "-c", _PEAK, d], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    grew = int(r.stdout.split()[-1])
    model_bytes = 64 * 1024 * 1024 * 4
    # the model, the window (8 MiB) and TensorStore's decode heaps (measured: 294 MiB); a second
    # copy of the model would be twice the model
    assert grew < model_bytes + (96 << 20), f"peak RSS grew {grew >> 20} MiB restoring a {model_bytes >> 20} MiB model"


@pytest.mark.slow
def test_fsdp2_meta_model_restores_real_shards(tmp_path):
    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    d = str(tmp_path / "ck")
    run_ranks(sc.save_fsdp2, 2, d)
    run_ranks(sc.restore_fsdp2_meta, 2, d)
