"""The state-dict names learned once per model (tsckpt/torch/_statenames.py) against torch's own
``get_model_state_dict`` / ``get_optimizer_state_dict``, and when they must not be reused."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import tsckpt.torch
from tsckpt.torch import _statenames as names


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def _trained(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters())
    model.train()
    model(torch.randint(0, 10, (3,))).sum().backward() if isinstance(model, Tied) else None
    opt.step()
    return opt


def _forward(self: Tied, x: torch.Tensor) -> torch.Tensor:
    return self.head(self.body(self.emb(x)))


Tied.forward = _forward  # type: ignore[method-assign]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
    return bool(a == b)


@pytest.fixture
def torch_calls(monkeypatch):
    """Counts the calls that take torch's path."""
    calls = {"model": 0, "optim": 0}
    real_m, real_o = names._torch_model_state, names._torch_optim_state

    def model(m):
        calls["model"] += 1
        return real_m(m)

    def optim(m, o):
        calls["optim"] += 1
        return real_o(m, o)

    monkeypatch.setattr(names, "_torch_model_state", model)
    monkeypatch.setattr(names, "_torch_optim_state", optim)
    return calls


@pytest.mark.parametrize(
    "wrap", ["plain", pytest.param("compiled", marks=pytest.mark.slow(reason="torch.compile of the model")), "checkpointed"]
)
def test_learned_names_give_torchs_state_dicts(wrap, torch_calls):
    model: torch.nn.Module = Tied()
    opt = _trained(model)
    if wrap == "compiled":
        model = torch.compile(model)  # never run: only its names (_orig_mod.) matter
    elif wrap == "checkpointed":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.body = checkpoint_wrapper(model.body)  # type: ignore[assignment]
    for _ in range(3):
        ours = tsckpt.torch.get_state_dict(model, opt)
    assert torch_calls == {"model": 1, "optim": 1}  # learned at the first call, reused after
    want_model = get_model_state_dict(model)
    want_optim = get_optimizer_state_dict(model, opt)
    assert _same(ours["model"], dict(want_model))
    assert _same(ours["optim"]["state"], dict(want_optim["state"]))
    assert _same(ours["optim"]["param_groups"], list(want_optim["param_groups"]))


def test_a_changed_structure_takes_torchs_path_again(torch_calls):
    model = Tied()
    opt = _trained(model)
    tsckpt.torch.get_state_dict(model, opt)
    model.extra = torch.nn.Linear(2, 2)  # new keys
    out = tsckpt.torch.get_state_dict(model, opt)
    assert "extra.weight" in out["model"] and torch_calls == {"model": 2, "optim": 2}
    opt.add_param_group({"params": list(model.extra.parameters())})  # another parameter list
    out = tsckpt.torch.get_state_dict(model, opt)
    assert torch_calls == {"model": 2, "optim": 3}
    tsckpt.torch.get_state_dict(model, opt)
    assert torch_calls == {"model": 2, "optim": 3}  # learned again
    assert _same(out["optim"]["param_groups"], list(get_optimizer_state_dict(model, opt)["param_groups"]))


def test_a_replaced_parameter_is_the_one_returned(torch_calls):
    model = Tied()
    opt = _trained(model)
    tsckpt.torch.get_state_dict(model, opt)
    new = torch.nn.Parameter(torch.zeros(4))
    model.body[0].bias = new
    out = tsckpt.torch.get_state_dict(model)
    assert out["model"]["body.0.bias"].data_ptr() == new.data_ptr()
    with pytest.raises(tsckpt.StructureMismatchError, match="not a parameter of the model"):
        tsckpt.torch.get_state_dict(model, opt)  # the optimizer still holds the old one


def test_an_instance_state_dict_is_never_learned(torch_calls):
    model = Tied()
    _trained(model)
    model.state_dict = lambda *a, **k: torch.nn.Module.state_dict(model, *a, **k)  # type: ignore[method-assign]
    for _ in range(2):
        tsckpt.torch.get_state_dict(model)
    assert torch_calls["model"] == 2
