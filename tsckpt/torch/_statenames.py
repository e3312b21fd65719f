"""The names of a model's and an optimizer's state, computed once per model and reused.

``torch.distributed.checkpoint.state_dict``'s ``get_model_state_dict`` and
``get_optimizer_state_dict`` name every tensor by walking the model once per parameter
(removing DDP, torch.compile and activation-checkpointing prefixes) at every call: on a model
of a few hundred tensors that is most of what a ``save_async`` call costs. The names
depend only on the model's structure, so they are computed here by torch's helpers once,
checked against torch's own result, and then reused while the model's and the optimizer's
``state_dict()`` keep the same keys over the same parameters (learned again when they
change). Anything else takes torch's path every time: FSDP1 (its state dicts are made under its own contexts), an object whose
``state_dict`` was replaced on the instance (DCP's patching), a state whose names torch
computes differently from here, or an optimizer whose state is still to be created.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

STATE = "state"
GROUPS = "param_groups"
PARAMS = "params"


class _ModelNames(NamedTuple):
    raw: tuple[str, ...]  # model.state_dict()'s keys
    order: tuple[tuple[str, int], ...]  # torch's result in its order: (name, index into raw)


class _OptimNames(NamedTuple):
    params: tuple[int, ...]  # id of each parameter the optimizer holds, in its groups' order
    model: tuple[tuple[str, int], ...]  # model.named_parameters(): (key, id)
    names: tuple[str, ...]  # per parameter the optimizer holds, its name (as torch names it)


_models: weakref.WeakKeyDictionary[torch.nn.Module, _ModelNames | None] = weakref.WeakKeyDictionary()
_optims: weakref.WeakKeyDictionary[torch.optim.Optimizer, _OptimNames | None] = weakref.WeakKeyDictionary()


def _torch_model_state(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return dict(get_model_state_dict(model, options=StateDictOptions()))


def _torch_optim_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optim, options=StateDictOptions()))


def _own_state_dict(obj: Any) -> bool:
    """Whether ``obj.state_dict`` is its class's (not replaced on the instance, as DCP's
    ``_patch_model_state_dict`` does)."""
    return "state_dict" not in vars(obj)


def _fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _same_tensors(a: Any, b: Any) -> bool:
    """Whether two state dicts (as torch makes them) hold the same keys, values and memory."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and type(a) is type(b)
            and a.shape == b.shape and a.dtype == b.dtype
            and (a.device.type == "meta" or a.data_ptr() == b.data_ptr())
        )
    return bool(type(a) is type(b) and a == b)


def _order(model: torch.nn.Module, raw: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """Torch's names for ``raw`` keys, in the order ``get_model_state_dict`` returns them
    (a renamed key moves to the end, as torch moves it)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: dict[str, int] = {k: i for i, k in enumerate(raw)}
    for key in raw:
        fqns = _get_fqns(model, key)
        fqn = next(iter(fqns)) if len(fqns) == 1 else key
        if fqn != key:
            names[fqn] = names.pop(key)
    return tuple(names.items())


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model)`` with default options (module docstring)."""
    cached = _models.get(model, False)
    if isinstance(cached, _ModelNames) and _own_state_dict(model):
        raw = model.state_dict()
        if tuple(raw) == cached.raw:
            values = list(raw.values())
            return {name: values[i] for name, i in cached.order}
    out = _torch_model_state(model)
    if cached is not None:  # a first call, or the keys changed: learn them where this module may serve them
        _models[model] = _learn_model(model, out)
    return out


def _learn_model(model: torch.nn.Module, expected: dict[str, Any]) -> _ModelNames | None:
    if not _own_state_dict(model) or _fsdp1(model):
        return None
    raw = model.state_dict()
    names = _ModelNames(tuple(raw), _order(model, list(raw)))
    values = list(raw.values())
    mine = {name: values[i] for name, i in names.order}
    return names if _same_tensors(mine, expected) else None


def _params(optim: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(id(p) for g in optim.param_groups for p in g[PARAMS])


def cached_names(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """The names of ``optim``'s parameters (in its groups' order) as learned from a previous
    call, while they still hold: the optimizer holds the same parameters and the model has
    the same named parameters; else None."""
    cached = _optims.get(optim)
    if cached is None or not _own_state_dict(optim) or _params(optim) != cached.params:
        return None
    if tuple((k, id(p)) for k, p in model.named_parameters()) != cached.model:
        return None
    return cached.names


def optim_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optim)`` with default options, by torch:
    ``{"state": {name: {...}}, "param_groups": [...]}``; learns the names for
    :func:`cached_names` at the first call whose state exists."""
    out = _torch_optim_state(model, optim)
    if optim.state and _optims.get(optim, False) is not None:  # never refused: learn (again)
        _optims[optim] = _learn_optim(model, optim, out)
    return out


def renamed(osd: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """torch's optimizer state dict with parameter indices replaced by names, as DCP does."""
    state = osd[STATE]
    for pid in list(state):
        state[names[pid]] = state.pop(pid)
    for group in osd[GROUPS]:
        group[PARAMS] = [names[pid] for pid in group[PARAMS]]
    return osd


def _learn_optim(model: torch.nn.Module, optim: torch.optim.Optimizer, expected: dict[str, Any]) -> _OptimNames | None:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    if not _own_state_dict(optim) or not _own_state_dict(model) or _fsdp1(model):
        return None
    params = [p for g in optim.param_groups for p in g[PARAMS]]
    index = {id(p): i for i, p in enumerate(params)}
    names: list[str | None] = [None] * len(params)
    named = tuple(model.named_parameters())
    for key, p in named:
        fqns = _get_fqns(model, key)
        if len(fqns) != 1:
            return None
        if id(p) in index:
            names[index[id(p)]] = next(iter(fqns))
    if any(n is None for n in names):
        return None
    learned = _OptimNames(_params(optim), tuple((k, id(p)) for k, p in named), tuple(n for n in names if n))
    mine = renamed(optim.state_dict(), learned.names)
    return learned if _same_tensors(mine, expected) else None


def forget(obj: Any) -> None:
    """Drop what was learned about a model or an optimizer (tests)."""
    for table in (_models, _optims):
        table.pop(obj, None)  # type: ignore[call-overload]

