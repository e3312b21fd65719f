"""Model and optimizer state as plain pytrees keyed by parameter name, and loading them back.

Names and sharded state come from torch's own
``torch.distributed.checkpoint.state_dict`` helpers: FSDP2/DDP/torch.compile
prefixes removed, optimizer state keyed by parameter name, DTensors kept
sharded, optimizer state created lazily for a restore target. Loading is done
here, by copying into the live tensors: every tensor keeps its own dtype
(torch's ``Optimizer.load_state_dict`` would cast optimizer state to the
parameter's dtype), a DTensor takes just its region of a full or differently
sharded value, and tied parameters are matched under any of their names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union, cast

import numpy as np
import torch

from .._base import dtypes as _dtypes
from .._base.casting import check_cast, check_casting
from .._errors import LeafTypeError, ShapeMismatchError, StructureMismatchError, count_and_list
from .._leaves.dtensor import is_dtensor
from .._leaves.registry import memory
from .._read.restore import cast_warnings_off, warn_lost_values
from ._statenames import cached_names, model_state, optim_state, renamed

MODEL = "model"
OPTIM = "optim"
STATE = "state"
GROUPS = "param_groups"
TYPES = "types"
PARAMS = "params"

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None]


def optimizer_tuple(optimizers: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if optimizers is None:
        return ()
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def optimizer_type(optim: torch.optim.Optimizer) -> str:
    return f"{type(optim).__module__}.{type(optim).__qualname__}"


def param_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """``id(parameter)`` -> its names without wrapper prefixes, first as torch's
    optimizer state dict keys it; tied parameters have several."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[int, list[str]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        names = out.setdefault(id(p), [])
        for fqn in sorted(_get_fqns(model, key)):
            if fqn not in names:
                names.append(fqn)
    return out


def _names_of(names: dict[int, list[str]], p: torch.Tensor, optim: torch.optim.Optimizer) -> list[str]:
    if id(p) not in names:
        raise StructureMismatchError(
            f"{type(optim).__name__} holds a parameter of shape {list(p.shape)} that is not a parameter of the "
            "model; pass the model whose parameters the optimizer updates"
        )
    return names[id(p)]


def optimizer_state(model: torch.nn.Module, optims: tuple[torch.optim.Optimizer, ...], *, init: bool) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (torch's layout) plus the optimizer types.

    ``init=True`` lets torch create the state of a never-stepped optimizer (a
    step with zero gradients and lr 0) so it can be restored into; ``init=False``
    leaves such an optimizer untouched (its state is saved as empty), since that
    step would change what the next real step does (Adam's step count).
    """
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    names: dict[int, list[str]] | None = None
    for optim in optims:
        learned = cached_names(model, optim)
        if learned is None:  # check the parameters are the model's before torch names them
            names = param_names(model) if names is None else names
            for g in optim.param_groups:
                for p in g[PARAMS]:
                    _names_of(names, p, optim)
        osd: dict[str, Any]
        if optim.state and learned is not None:
            osd = renamed(optim.state_dict(), learned)
        elif optim.state or init:
            osd = optim_state(model, optim)
        else:
            own = learned or tuple(cast("dict[int, list[str]]", names)[id(p)][0] for g in optim.param_groups for p in g[PARAMS])
            osd = renamed(optim.state_dict(), own)
        state.update(cast("dict[str, Any]", osd[STATE]))
        groups.extend(cast("list[dict[str, Any]]", osd[GROUPS]))
    return {STATE: state, GROUPS: groups, TYPES: [optimizer_type(o) for o in optims]}


def get_state_dict(model: torch.nn.Module, optimizers: Optimizers = None) -> dict[str, Any]:
    """``{"model": {name: tensor}, "optim": {"state": {name: {...}}, "param_groups": [...], "types": [...]}}``.

    A plain pytree for :func:`tsckpt.save`. Tensors are the live ones (no copy);
    under FSDP2 they are DTensors, so each rank saves only its shards. Names are
    the model's own (DDP's ``module.`` and torch.compile's ``_orig_mod.``
    removed); tied parameters appear under every name and are stored once.
    Several optimizers are merged, as torch does. Calling this has no side effects.
    """
    out: dict[str, Any] = {MODEL: model_state(model)}
    optims = optimizer_tuple(optimizers)
    if optims:
        out[OPTIM] = optimizer_state(model, optims, init=False)
    return out


def live_state(model: torch.nn.Module, optims: tuple[torch.optim.Optimizer, ...]) -> dict[str, Any]:
    """Like :func:`get_state_dict`, with never-stepped optimizers' state created (a restore target)."""
    out: dict[str, Any] = {MODEL: model_state(model)}
    if optims:
        out[OPTIM] = optimizer_state(model, optims, init=True)
    return out


# ---- copying into live tensors ----------------------------------------------------------


def same_memory(a: Any, b: Any) -> bool:
    """True when ``b`` is ``a`` or a view of exactly the same memory (nothing to copy)."""
    if a is b:
        return True
    if is_dtensor(a) != is_dtensor(b) or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    key = memory(a)  # None: no memory (a freed storage, no elements), so nothing is shared
    return key is not None and key == memory(b)


def as_tensor(value: Any, path: str) -> torch.Tensor:
    """A CPU tensor (or the tensor itself) from a tensor, DTensor, numpy array or number."""
    if is_dtensor(value):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        name = _dtypes.numpy_name(arr.dtype)
        if name is None:
            raise LeafTypeError(f"'{path}': numpy dtype {arr.dtype} cannot be loaded into a tensor")
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
        return _dtypes.numpy_to_tensor(arr, name)
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    raise LeafTypeError(
        f"'{path}': expected a tensor, numpy array or number to load into a tensor, found {type(value).__name__}"
    )


def region_of(dst: Any, path: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local lengths) of the part of ``dst`` this rank holds."""
    if is_dtensor(dst):
        from .._leaves.dtensor import region

        return region(path, dst)
    return (0,) * dst.dim(), tuple(dst.shape)


def local_of(dst: Any) -> torch.Tensor:
    return dst.to_local() if is_dtensor(dst) else dst


def on_meta(t: Any) -> bool:
    """Whether a live tensor (or DTensor's local shard) is on the meta device: no memory to copy into."""
    return isinstance(t, torch.Tensor) and local_of(t).device.type == "meta"


def meta_tensors(model: torch.nn.Module) -> list[str]:
    """The names of the model's parameters and buffers still on the meta device (tied ones once)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in named if on_meta(t)]


def assign(model: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Make the restored ``values`` (name, as :func:`get_state_dict` names it -> tensor or DTensor)
    the model's parameters and buffers, in place of its meta ones: ``load_state_dict(assign=True)``
    semantics (so FSDP2 re-points its sharded parameters), each parameter a new
    ``nn.Parameter`` over the restored tensor (no copy) keeping ``requires_grad``, and one new
    parameter for all the names of a tied one, so tied parameters stay tied."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    made: dict[int, torch.Tensor] = {}
    by_raw: dict[str, torch.Tensor] = {}
    for raw, old in model.state_dict(keep_vars=True).items():
        name = next((n for n in sorted(_get_fqns(model, raw)) if n in values), None)
        if name is None or not on_meta(old):
            continue
        new = made.get(id(old))
        if new is None:
            value = values[name]
            new = torch.nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else value
            made[id(old)] = new
        by_raw[raw] = new
    if by_raw:
        model.load_state_dict(by_raw, strict=False, assign=True)


def shape_error(
    path: str, want: tuple[int, ...], stored: tuple[int, ...], names: list[str], others: Sequence[str] = ()
) -> ShapeMismatchError:
    also = f" (and {len(others)} more: {list(others)[:5]}{' ...' if len(others) > 5 else ''})" if others else ""
    return ShapeMismatchError(
        f"'{path}': the model has shape {list(want)} but the checkpoint holds {list(stored)}{also}; for a resized "
        f"parameter (e.g. a vocabulary padded to a multiple of 64) pass resize={sorted(names)} to copy the "
        "overlapping region and keep the model's values elsewhere"
    )


@torch.no_grad()
def copy_into(
    dst: Any, src: Any, path: str, *, name: str, resize: bool = False, casting: str = "same_kind"
) -> None:
    """Copy ``src`` (whole global value, or a DTensor) into the live tensor ``dst``, keeping dst's dtype.

    A DTensor ``dst`` takes only its own region. With ``resize``, shapes may
    differ: the overlapping leading region is copied. A cast to dst's dtype is
    allowed and its values checked as ``casting`` says (see :func:`tsckpt.restore`).
    """
    if on_meta(dst):
        raise LeafTypeError(
            f"'{path}': the live tensor is on the meta device, with no memory to copy into; restore a meta model "
            "with tsckpt.torch.restore(directory, model) (which gives it real parameters), or load the values with "
            "model.load_state_dict(values, assign=True)"
        )
    if same_memory(dst, src):
        return
    if is_dtensor(dst) and is_dtensor(src) and src.placements == dst.placements and src.shape == dst.shape:
        if src.device_mesh == dst.device_mesh:
            local = src.to_local()
            offsets, _ = region_of(dst, path)
            checked_copy(dst.to_local(), local, path, offsets, casting)
            return
    full = as_tensor(src, path)
    want = tuple(dst.shape)
    if tuple(full.shape) != want:
        if not resize or full.dim() != len(want):
            raise shape_error(path, want, tuple(full.shape), [name])
    offsets, lengths = region_of(dst, path)
    box = tuple(slice(o, min(o + n, s)) for o, n, s in zip(offsets, lengths, full.shape))
    part = full[box] if box else full
    local = local_of(dst)
    dsel = tuple(slice(0, b.stop - b.start) if b.stop > b.start else slice(0, 0) for b in box)
    checked_copy(local[dsel] if dsel else local, part, path, [b.start for b in box], casting)


def checked_copy(dst: torch.Tensor, src: torch.Tensor, path: str, offsets: Sequence[int], casting: str) -> None:
    """``dst.copy_(src)``, where ``src`` is the part of the value at ``path`` starting at
    ``offsets``; a cast is allowed, and its values checked, as ``casting`` says."""
    check = None
    if src.dtype != dst.dtype and _dtypes.is_supported_torch(src.dtype):
        check = check_cast(path, _dtypes.torch_name(src.dtype), dst.dtype, casting=casting)
    if check is not None:
        check.check(_dtypes.tensor_to_numpy(src.detach().cpu()), offsets)
    with torch.no_grad(), cast_warnings_off(check is not None):
        dst.copy_(src)
    if check is not None:
        warn_lost_values([check])


def _stored_value(value: Any) -> Any:
    """Plain Python from what a restore without a target gives for a value (numpy scalars included)."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def as_list(x: Any) -> list[Any]:
    """A list from a list/tuple, or a dict keyed 0..n-1 (how a tree saved by ranks with different trees comes back)."""
    if isinstance(x, Mapping):
        keys = sorted(x, key=lambda k: int(k))
        return [x[k] for k in keys]
    return list(x)


# ---- set_state_dict ---------------------------------------------------------------------


def check_names(what: str, live: Iterable[str], stored: Iterable[str], *, strict: bool, hint: str, where: str = "") -> None:
    live_s, stored_s = set(live), set(stored)
    missing, unexpected = sorted(live_s - stored_s), sorted(stored_s - live_s)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {count_and_list(missing, 6)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in the {what}: {count_and_list(unexpected, 6)}")
        prefix = f"{where}: " if where else ""
        raise StructureMismatchError(f"{prefix}{what} and checkpoint differ; " + "; ".join(parts) + f". {hint}")


ARCH_HINT = (
    "The checkpoint is of another architecture (or another version of this model); pass strict=False to load "
    "only the names both have"
)


def check_optimizer_types(stored: Any, optims: tuple[torch.optim.Optimizer, ...]) -> None:
    live = [optimizer_type(o) for o in optims]
    if stored is not None and [str(s) for s in as_list(stored)] != live:
        raise StructureMismatchError(
            f"optimizer types differ: the checkpoint was saved from {[str(s) for s in as_list(stored)]} but the "
            f"target is {live}; build the same optimizer type(s) in the same order, or restore without "
            "optimizers to load only the model"
        )


def check_state_keys(name: str, live_keys: Iterable[str], stored_keys: Iterable[str], optim: torch.optim.Optimizer) -> None:
    live_k, stored_k = sorted(live_keys), sorted(stored_keys)
    if live_k and live_k != stored_k:
        raise StructureMismatchError(
            f"optimizer state of parameter '{name}': the checkpoint holds {stored_k} but {type(optim).__name__} "
            f"keeps {live_k}; the checkpoint was saved by another optimizer type or configuration (e.g. amsgrad, "
            "momentum); build the same optimizer, or restore without optimizers to load only the model"
        )


def match_groups(
    model: torch.nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    stored_groups: list[Mapping[str, Any]],
    *,
    strict: bool,
) -> list[tuple[dict[str, Any], Mapping[str, Any] | None]]:
    """Pair every live param group with the stored group holding its parameters (by name, any tied name)."""
    names = param_names(model)
    where: dict[str, int] = {}
    for gi, sg in enumerate(stored_groups):
        for n in as_list(sg.get(PARAMS, [])):
            where[str(n)] = gi
    missing: list[str] = []
    pairs: list[tuple[dict[str, Any], Mapping[str, Any] | None]] = []
    matched: set[str] = set()
    for optim in optims:
        for g in optim.param_groups:
            found: set[int] = set()
            for p in g[PARAMS]:
                pn = _names_of(names, p, optim)
                hits = [n for n in pn if n in where]
                if hits:
                    found.add(where[hits[0]])
                    matched.update(hits)
                else:
                    missing.append(pn[0])
            if len(found) > 1:
                shown = [[str(n) for n in as_list(stored_groups[i][PARAMS])][:4] for i in sorted(found)]
                raise StructureMismatchError(
                    f"a param group of {type(optim).__name__} holds parameters {[names[id(p)][0] for p in g[PARAMS]][:6]} "
                    f"that the checkpoint keeps in {len(found)} different groups ({shown}); group the "
                    "parameters as when the checkpoint was saved"
                )
            pairs.append((g, stored_groups[found.pop()] if found else None))
    check_names(
        "optimizer",
        missing + sorted(matched),
        sorted(where),
        strict=strict,
        hint="The optimizer's parameters differ from the checkpoint's; pass strict=False to load the common ones",
    )
    return pairs


def apply_group(live: dict[str, Any], stored: Mapping[str, Any], path: str, casting: str = "same_kind") -> None:
    """Hyperparameters of one param group (lr, betas, weight_decay, initial_lr, ...), live types kept."""
    for key, value in stored.items():
        if key == PARAMS:
            continue
        cur = live.get(key)
        if isinstance(cur, torch.Tensor):
            copy_into(cur, value, f"{path}/{key}", name=key, casting=casting)
        elif isinstance(cur, tuple) or (cur is None and isinstance(value, Mapping)):
            live[key] = tuple(_stored_value(v) for v in as_list(value))
        elif isinstance(value, (list, Mapping)) and not isinstance(cur, list):
            live[key] = tuple(_stored_value(v) for v in as_list(value))
        else:
            live[key] = _stored_value(value)


def apply_optimizer(
    model: torch.nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    stored: Mapping[str, Any],
    *,
    strict: bool,
    resize: frozenset[str] = frozenset(),
    casting: str = "same_kind",
) -> None:
    """Load stored optimizer state (any tree: tensors, numpy, DTensors, values) into live optimizers."""
    check_optimizer_types(stored.get(TYPES), optims)
    stored_state: Mapping[str, Any] = stored.get(STATE) or {}
    stored_groups = [g for g in as_list(stored.get(GROUPS) or [])]
    pairs = match_groups(model, optims, stored_groups, strict=strict)
    for i, (g, sg) in enumerate(pairs):
        if sg is not None:
            apply_group(g, sg, f"{OPTIM}/{GROUPS}/{i}", casting)
    names = param_names(model)
    in_groups = {str(n) for sg in stored_groups for n in as_list(sg.get(PARAMS, []))}
    for optim in optims:
        for g in optim.param_groups:
            for p in g[PARAMS]:
                pn = names[id(p)]
                key = next((n for n in pn if n in stored_state), None)
                if key is None:
                    if any(n in in_groups for n in pn):
                        optim.state.pop(p, None)  # it had no state when saved (never stepped)
                    continue
                ss = stored_state[key]
                ls = optim.state[p]
                check_state_keys(key, [k for k, v in ls.items() if v is not None], [k for k, v in ss.items() if v is not None], optim)
                for k, v in ss.items():
                    cur = ls.get(k)
                    path = f"{OPTIM}/{STATE}/{key}/{k}"
                    if isinstance(cur, torch.Tensor):
                        resized = key in resize or any(n in resize for n in pn)
                        copy_into(cur, v, path, name=key, resize=resized, casting=casting)
                    elif v is None or not isinstance(v, (torch.Tensor, np.ndarray)):
                        ls[k] = _stored_value(v)
                    else:
                        ls[k] = _new_state_tensor(p, v, path, key)


def _new_state_tensor(p: torch.Tensor, value: Any, path: str, name: str) -> torch.Tensor:
    """State the live optimizer lacks: laid out like the parameter when it has its shape."""
    src = as_tensor(value, path)
    if tuple(src.shape) == tuple(p.shape):
        out = torch.empty_like(p.detach(), dtype=src.dtype)
        copy_into(out, src, path, name=name)
        return out
    return src.clone()


def set_state_dict(
    model: torch.nn.Module,
    optimizers: Optimizers,
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    resize: Iterable[str] = (),
    casting: str = "same_kind",
) -> None:
    """Load ``state`` (as made by :func:`get_state_dict`) into a live model and optimizers.

    ``state`` may hold tensors, DTensors (any sharding), numpy arrays or values,
    e.g. ``tsckpt.restore(dir)``. Every value is copied into the live tensor in
    the live tensor's dtype; a sharded model takes just its shards. Tied
    parameters load from any of their names. ``strict`` reports names missing on
    either side; ``resize`` names parameters (e.g. a padded embedding) whose
    overlapping region is copied when shapes differ. ``casting`` governs values of
    another dtype than the live tensor's, as for :func:`tsckpt.restore`.
    """
    check_casting(casting)
    optims = optimizer_tuple(optimizers)
    resized = frozenset(n for ns in param_names(model).values() if set(ns) & set(resize) for n in ns) | set(resize)
    live = live_state(model, optims)
    stored_model = state.get(MODEL)
    if not isinstance(stored_model, Mapping):
        raise StructureMismatchError(
            f"state has no '{MODEL}' mapping (keys: {sorted(state)}); pass the tree get_state_dict made"
        )
    check_names("model", live[MODEL], stored_model, strict=strict, hint=ARCH_HINT)
    meta = [f"{MODEL}/{n}" for n, t in live[MODEL].items() if n in stored_model and on_meta(t)]
    if meta:
        raise LeafTypeError(
            f"the model has tensors on the meta device, with no memory to copy into: {count_and_list(meta)}; "
            "restore a meta model with tsckpt.torch.restore(directory, model) (which gives it real parameters), "
            "or load the values with model.load_state_dict(values, assign=True)"
        )
    for name, dst in live[MODEL].items():
        if name in stored_model:
            copy_into(dst, stored_model[name], f"{MODEL}/{name}", name=name, resize=name in resized, casting=casting)
    if optims:
        stored_optim = state.get(OPTIM)
        if not isinstance(stored_optim, Mapping):
            raise StructureMismatchError(
                f"state has no '{OPTIM}' entry but optimizers were given; save with get_state_dict(model, "
                "optimizers), or pass optimizers=None to load only the model"
            )
        apply_optimizer(model, optims, stored_optim, strict=strict, resize=resized, casting=casting)


__all__ = ["get_state_dict", "set_state_dict"]
