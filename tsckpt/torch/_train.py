"""Whole training state: model, optimizers, schedulers and other stateful objects,
per-rank state (data samplers, RNG), as one :class:`TrainState` that every verb and the
manager save and restore in place; :func:`save`, :func:`save_async` and :func:`restore`
on its parts.

Checkpoint tree of a TrainState (what :func:`save` writes)::

    model/<name>                         parameters and buffers (DTensors: each rank its shards)
    optim/state/<name>/<key>             per-parameter optimizer state, by parameter name
    optim/param_groups/<i>/...           hyperparameters, with the parameter names of each group
    optim/types/<i>                      the optimizer classes
    extra/<key>/...                      state_dict() of stateful objects, or plain values (step, ...)
    ranks/<rank>/rng/...                 this rank's torch / CUDA / numpy / Python RNG states
    ranks/<rank>/<key>/...               this rank's per-rank objects (data samplers)
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import random
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, cast

import numpy as np
import torch

from .._base import dtypes as _dtypes
from .._base.casting import check_cast
from .._coord.protocol import phase, refuse
from .._coord.torchdist import coordinator_for
from .._errors import LeafTypeError, StructureMismatchError, count_and_list
from .._formats.sources import open_checkpoint
from .._leaves.registry import kind_of
from .._leaves.stateful import Expanded, expand, is_stateful
from .._ondisk.checkpoint import Checkpoint
from .._ondisk.records import LAYOUT_PLAIN, encode_value
from .._options import (
    READ_WINDOW_BYTES,
    WRITE_WINDOW_BYTES,
    AsyncOptions,
    BaseDirectory,
    Copy,
    IfBusy,
    Incremental,
    RestoreOptions,
    SaveOptions,
    Staging,
    Writer,
    verb,
)
from .._read.reader import LazyArray, read_subtree
from .._read.restore import RestoreWarning, cast_warnings_off, warn_lost_values
from .._read.restore import restore as core_restore
from .._save.background import AsyncSave, save_async_with
from .._save.protocol import save_with
from .._storage.locations import Directory
from ..tree import escape, flatten, prefix_advice, prefix_shift, unescape
from ._state import (
    ARCH_HINT,
    GROUPS,
    MODEL,
    OPTIM,
    STATE,
    TYPES,
    Optimizers,
    apply_optimizer,
    as_list,
    assign,
    check_names,
    check_optimizer_types,
    check_state_keys,
    get_state_dict,
    live_state,
    local_of,
    match_groups,
    meta_tensors,
    on_meta,
    optimizer_tuple,
    param_names,
    region_of,
    shape_error,
)

log = logging.getLogger("tsckpt")

EXTRA = "extra"
RANKS = "ranks"
RNG = "rng"


# ---- RNG ------------------------------------------------------------------------------


def get_rng_state() -> dict[str, Any]:
    """This process's RNG states as arrays and values (never pickled): torch CPU, CUDA (when
    initialized), numpy's global generator and Python's ``random``."""
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, internal, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": keys, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {
            "version": int(version),
            "state": np.array(internal, dtype=np.int64),
            "has_gauss_next": gauss_next is not None,
            "gauss_next": 0.0 if gauss_next is None else float(gauss_next),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set the RNG states :func:`get_rng_state` returned (from a restore, with or without a target)."""
    if "torch" in state:
        torch.set_rng_state(_byte_tensor(state["torch"]))
    if "numpy" in state:
        s = state["numpy"]
        keys = np.asarray(s["keys"], dtype=np.uint32)
        np.random.set_state(("MT19937", keys, int(s["pos"]), int(s["has_gauss"]), float(s["cached_gaussian"])))
    if "python" in state:
        s = state["python"]
        gauss = float(s["gauss_next"]) if bool(s["has_gauss_next"]) else None
        random.setstate((int(s["version"]), tuple(int(x) for x in np.asarray(s["state"])), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = as_list(state["cuda"])
        count = torch.cuda.device_count()
        if len(cuda) != count:
            warnings.warn(
                f"{len(cuda)} CUDA RNG states were saved, and this process sees {count} CUDA devices: the states "
                f"of the first {min(len(cuda), count)} devices are restored, the others keep theirs",
                RestoreWarning,
                stacklevel=2,
            )
        for i, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(_byte_tensor(s), i)


def _byte_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.uint8).cpu()
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.uint8)))


# ---- the training state ----------------------------------------------------------------


def _check_keys(what: str, objs: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(objs or {})
    for k, obj in out.items():
        if not isinstance(k, str):
            raise StructureMismatchError(f"{what} keys must be str names, found {k!r} ({type(k).__name__})")
        _check_saveable(what, k, obj)
    return out


def _check_saveable(what: str, name: str, obj: Any) -> None:
    """Refuse, when the TrainState is built rather than at its first save, an object of
    ``extra`` or ``per_rank`` that tsckpt can neither store nor hand its state back to (a
    torch ``RandomSampler`` or ``DistributedSampler``: no ``state_dict()``)."""
    for leaf in flatten(obj).leaves:
        if is_stateful(leaf) or kind_of(leaf) is not None or encode_value(leaf) is not None:
            continue
        kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
        advice = (
            "Pass what resumes it instead: plain values it is rebuilt from (the epoch and seed: "
            f"{what}={{'epoch': epoch}}, then sampler.set_epoch(epoch) after the restore), or a stateful "
            "loader such as torchdata's StatefulDataLoader, whose state_dict() tsckpt saves"
            if "sampler" in kind.lower() or "dataloader" in kind.lower()
            else "Give it state_dict() and load_state_dict(), or pass the tensors and plain values it is "
            "rebuilt from"
        )
        raise LeafTypeError(
            f"TrainState({what}={{'{name}': ...}}): a {kind} has no state_dict()/load_state_dict() and is no "
            f"tensor, array or plain value, so tsckpt can neither save nor restore it. {advice}"
        )


class TrainState:
    """A whole training state, saved and restored as one object by every tsckpt verb.

    ``model`` and ``optimizers`` (one, a sequence, or None) are saved by parameter
    name (:func:`get_state_dict`); ``extra`` maps names to objects with
    ``state_dict()``/``load_state_dict()`` (LR scheduler, GradScaler, a
    ``torch.Generator``, ...) or to plain values and pytrees (step counters),
    the same on every rank; ``per_rank`` maps names to what differs between
    ranks (a data sampler, the number of samples seen), stored under
    ``ranks/<rank>/<name>``; ``rng`` also stores this rank's RNG states there
    (torch CPU and every initialized CUDA device, numpy, Python). ``resize``
    names parameters whose shape may differ from the checkpoint's (a padded
    vocabulary): a restore loads their overlap.

    Give it where a tree goes: ``tsckpt.save(d, state)``,
    ``tsckpt.save_async(d, state)``, ``manager.save_async(step, state)``; and as
    a restore's target: ``tsckpt.restore(d, state)``,
    ``manager.restore(target=state)``. A restore loads it in place: tensors
    straight into the live parameters and optimizer state (under FSDP2 or TP
    each rank reads only its shards, from a checkpoint of any sharding or world
    size), stateful objects through ``load_state_dict``, the RNG states into
    this process's generators, and each plain value of ``extra`` and
    ``per_rank`` replaced in those dicts by its restored value
    (``state.extra["step"]``). ``strict=False`` (a restore option) keeps what
    the checkpoint lacks as it is.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Optimizers = None,
        *,
        extra: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        rng: bool = True,
        resize: Iterable[str] = (),
    ) -> None:
        self.model = model
        self.optimizers = optimizer_tuple(optimizers)
        self.extra = _check_keys("extra", extra)
        self.per_rank = _check_keys("per_rank", per_rank)
        if rng and RNG in self.per_rank:
            raise StructureMismatchError(f"per_rank name '{RNG}' is reserved for the RNG states; rename it")
        self.rng = rng
        self.resize = frozenset(resize)

    def __repr__(self) -> str:
        return (
            f"TrainState({type(self.model).__name__}, {len(self.optimizers)} optimizer(s), "
            f"extra={sorted(self.extra)}, per_rank={sorted(self.per_rank)}, rng={self.rng})"
        )

    def __tsckpt_tree__(self, rank: int) -> dict[str, Any]:
        """The tree this rank saves (module docstring); the save stores each stateful object's
        state in its place."""
        return {**get_state_dict(self.model, self.optimizers), **_others(self, rank)}

    def __tsckpt_objects__(self) -> list[Any]:
        """The live objects whose state it saves (an overlapped ``save_async`` guards their updates)."""
        return [self.model, *self.optimizers, *self.extra.values(), *self.per_rank.values()]

    def __tsckpt_restore__(self, directory: Directory, options: RestoreOptions) -> TrainState:
        """Restore in place (see the class docstring); returns this state."""
        out = _restore_state(directory, self, options)
        self.extra.update(out)
        self.per_rank.update(out.per_rank)
        return self


# ---- save ---------------------------------------------------------------------------------


@verb("tsckpt.torch.save")
def save(
    directory: Directory,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    extra: Mapping[str, Any] | None = None,
    per_rank: Mapping[str, Any] | None = None,
    rng: bool = True,
    overwrite: bool = False,
    group: Any = None,
    check_replicas: bool = True,
    timeout: datetime.timedelta | None = None,
    max_inflight_bytes: int = WRITE_WINDOW_BYTES,
    layout: str = LAYOUT_PLAIN,
    inner_chunks: bool = True,
    progress: bool | None = None,
    incremental: Incremental = True,
    base: BaseDirectory = None,
) -> None:
    """Save the training state; every rank calls it.

    ``extra``: name -> an object with ``state_dict()``/``load_state_dict()`` (LR
    scheduler, GradScaler, ...) or a plain value or pytree (step counters); the
    same on every rank. ``per_rank``: name -> stateful object, or plain value or
    pytree, that differs between ranks (data sampler position), stored under
    ``ranks/<rank>/<name>``. ``rng`` also stores this rank's RNG states there.
    The optimizers are not stepped or otherwise changed. ``overwrite``,
    ``group``, ``check_replicas``, ``timeout``, ``max_inflight_bytes``,
    ``layout`` and ``progress`` are as for :func:`tsckpt.save`.
    """
    options, refused = SaveOptions.checked(locals())  # a bad option raises in the save's first step, on every rank
    state = TrainState(model, optimizers, extra=extra, per_rank=per_rank, rng=rng)
    save_with(directory, state, options, refused=refused)


@verb("tsckpt.torch.save_async")
def save_async(
    directory: Directory,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    extra: Mapping[str, Any] | None = None,
    per_rank: Mapping[str, Any] | None = None,
    rng: bool = True,
    overwrite: bool = False,
    group: Any = None,
    check_replicas: bool = True,
    timeout: datetime.timedelta | None = None,
    max_inflight_bytes: int = WRITE_WINDOW_BYTES,
    layout: str = LAYOUT_PLAIN,
    inner_chunks: bool = True,
    progress: bool | None = None,
    incremental: Incremental = True,
    base: BaseDirectory = None,
    if_busy: IfBusy = "wait",
    max_staging_bytes: int | None = None,
    staging: Staging = "overlapped",
    writer: Writer = "process",
) -> AsyncSave:
    """:func:`save`, returning once the state is staged (see ``staging``); every rank calls it.

    The twin of :func:`save` as :func:`tsckpt.save_async` is of :func:`tsckpt.save`:
    the same checkpoint and options, plus ``if_busy``, ``max_staging_bytes``,
    ``staging`` and ``writer`` (see there); ``result()`` of the returned handle waits for the commit. The
    state (stateful objects' ``state_dict()``, the RNG states) is taken during the call.
    """
    options, refused = SaveOptions.checked(locals())  # a bad option raises in the call, on every rank
    background, refused_too = AsyncOptions.checked(locals())
    state = TrainState(model, optimizers, extra=extra, per_rank=per_rank, rng=rng)
    return save_async_with(directory, state, options, background, refused=refused or refused_too)


# ---- restore ------------------------------------------------------------------------------


def _under(ck: Checkpoint, prefix: str) -> list[str]:
    start = prefix.rstrip("/") + "/"
    return [p for p in ck.leaves if p.startswith(start) or p == prefix]


@dataclasses.dataclass(frozen=True)
class _Plan:
    target: dict[str, Any]
    resized: list[tuple[str, Any]]  # (stored path, live tensor): overlapping region read separately
    groups: list[Any]
    types: Any
    optim_state: dict[str, dict[str, Any]]  # stored name -> live entries the checkpoint has (resized ones too)
    others: Expanded  # extra and per-rank state (RNG too): their targets, and how they are handed back


@dataclasses.dataclass(frozen=True)
class _Optim:
    """The optimizers matched to the checkpoint."""

    target: dict[str, dict[str, Any]]  # stored name -> live state tensors to restore in place
    state: dict[str, dict[str, Any]]  # stored name -> live entries the checkpoint has
    groups: list[Any]
    types: Any


class _Shapes:
    """Sorts live tensors by whether their stored shape matches: restored in place, read as a
    resized overlap, or an error (all shape errors are reported together)."""

    def __init__(self, ck: Checkpoint, model: torch.nn.Module, resize: frozenset[str]) -> None:
        self.ck, self.resize = ck, resize
        self.tied = {n: ns for ns in param_names(model).values() for n in ns}
        self.resized: list[tuple[str, Any]] = []
        self.errors: list[tuple[str, tuple[int, ...], tuple[int, ...], str]] = []

    def admit(self, path: str, dst: Any, name: str) -> bool:
        """True: restore ``dst`` from ``path`` normally; False: its shape differs (read separately)."""
        stored = self.ck.array_metadata(path).shape if self.ck.is_array(path) else None
        if stored is None or not isinstance(dst, torch.Tensor) or tuple(dst.shape) == stored:
            return True
        if any(n in self.resize for n in self.tied.get(name, [name])) and len(stored) == dst.dim():
            self.resized.append((path, dst))
        else:
            self.errors.append((path, tuple(dst.shape), stored, name))
        return False

    def raise_errors(self) -> None:
        if self.errors:
            path, want, stored, _ = self.errors[0]
            names = sorted({e[3] for e in self.errors})
            raise shape_error(path, want, stored, names, [e[0] for e in self.errors[1:]])


def _match_model(ck: Checkpoint, live: dict[str, Any], shapes: _Shapes, strict: bool) -> dict[str, Any]:
    """Live model tensors to restore: names first (another architecture, or the same names
    shifted by a prefix), then shapes. A model none of whose names the checkpoint has is refused
    even with strict=False (it would load nothing); strict=False logs what it leaves out."""
    stored_model = {str(unescape(p.split("/", 1)[1])): p for p in _under(ck, MODEL)}
    missing = sorted(set(live) - set(stored_model))
    unexpected = sorted(set(stored_model) - set(live))
    shifted = _shifted_names(ck, missing, unexpected)
    if live and len(missing) == len(live):
        listed = f"missing from the checkpoint: {count_and_list(missing, 6)}"
        if unexpected:
            listed += f"; in the checkpoint but not in the model: {count_and_list(unexpected, 6)}"
        raise StructureMismatchError(
            f"{ck.location}: model and checkpoint differ; not one of the model's {len(live)} names is in the "
            f"checkpoint, so a restore would load nothing{'' if strict else ' (strict=False too)'} ({listed}). "
            + (shifted or "Is this a checkpoint of this model written by tsckpt.torch.save (or a TrainState)?")
        )
    check_names("model", live, stored_model, strict=strict, hint=shifted or ARCH_HINT, where=str(ck.location))
    if missing or unexpected:  # strict=False (strict raised above): say what was left out, once
        log.warning(
            "%s: strict=False: loaded %d of the model's %d tensors; not in the checkpoint (kept as they are): %s; "
            "in the checkpoint but not in the model (not loaded): %s",
            ck.location, len(live) - len(missing), len(live), count_and_list(missing, 10),
            count_and_list(unexpected, 10),
        )
    return {n: dst for n, dst in live.items() if n in stored_model and shapes.admit(stored_model[n], dst, n)}


_NO_PREFIX_OPTION = "tsckpt.torch.restore has no option to select or strip a prefix"
_META_NOTE = (
    " (a model on the meta device: model.load_state_dict(tsckpt.restore(directory, model.state_dict()), "
    "assign=True))"
)


def _shifted_names(ck: Checkpoint, missing: list[str], unexpected: list[str]) -> str | None:
    """Why most model names are missing when they are the checkpoint's names shifted by a
    prefix, and how to restore it; None when they are not."""
    if not missing:
        return None
    inner = prefix_shift(missing, unexpected)  # under model/: e.g. Hugging Face's "model." added or dropped
    if inner is not None:
        where = f"under the prefix {inner.stored!r}" if inner.stored else f"without the prefix {inner.target!r}"
        return (
            f"{inner.matched} of the {inner.missing} missing names are in the checkpoint {where}: the names are "
            f"shifted, not another architecture. {_NO_PREFIX_OPTION}; restore the model's state_dict with "
            f"tsckpt.restore, its names as the checkpoint's: "
            f"{prefix_advice(inner, 'model.state_dict()')} and give that as the target's '{MODEL}' entry "
            "(inplace=True loads straight into the model)"
        )
    outside = [p for p in ck.leaves if p != MODEL and not p.startswith(MODEL + "/")]
    whole = prefix_shift([f"{MODEL}/{escape(n)}" for n in missing], outside)
    if whole is None:
        return None
    if whole.target == MODEL + "/":  # a plain state_dict: a Hugging Face directory, tsckpt.save(d, sd)
        return (
            f"{whole.matched} of the {whole.missing} missing names are at the top of the checkpoint, without the "
            f"'{MODEL}/' prefix tsckpt.torch.save writes: it holds a plain state_dict (a Hugging Face directory, "
            f"or tsckpt.save(directory, model.state_dict())), not a training state. {_NO_PREFIX_OPTION}; restore "
            f"the state_dict itself: tsckpt.restore(directory, model.state_dict(), inplace=True){_META_NOTE}"
        )
    where = f"under the prefix {whole.stored!r}" if whole.stored else f"without the prefix {whole.target!r}"
    return (
        f"{whole.matched} of the {whole.missing} missing names are in the checkpoint {where} rather than under "
        f"'{MODEL}/': the names are shifted, not another architecture. {_NO_PREFIX_OPTION}; restore the state_dict "
        f"with tsckpt.restore instead: {prefix_advice(whole, repr({MODEL: 0}).replace('0', 'model.state_dict()'))}"
        f"{_META_NOTE}"
    )


def _match_optimizers(
    ck: Checkpoint, model: torch.nn.Module, optims: tuple[torch.optim.Optimizer, ...], live_state: dict[str, Any],
    shapes: _Shapes, strict: bool,
) -> _Optim:
    """Optimizer types, param groups and per-parameter state keys, checked against the checkpoint."""
    if not _under(ck, f"{OPTIM}/{GROUPS}"):
        raise StructureMismatchError(
            f"{ck.location}: the checkpoint holds no optimizer state (no '{OPTIM}/{GROUPS}'); restore "
            "without optimizers to load only the model"
        )
    types = read_subtree(ck, f"{OPTIM}/{TYPES}") or None
    check_optimizer_types(types, optims)
    groups = as_list(read_subtree(ck, f"{OPTIM}/{GROUPS}"))
    match_groups(model, optims, groups, strict=strict)
    stored_state: dict[str, dict[str, str]] = {}
    for p in _under(ck, f"{OPTIM}/{STATE}"):
        parts = p.split("/")
        stored_state.setdefault(str(unescape(parts[2])), {})[str(unescape(parts[3]))] = p
    names = param_names(model)
    target: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    for optim, param in ((o, p) for o in optims for g in o.param_groups for p in g["params"]):
        pn = names[id(param)]
        key = next((n for n in pn if n in stored_state), None)
        live_entry = next((live_state[n] for n in pn if n in live_state), None)
        if key is None or live_entry is None:
            continue  # never stepped when saved (or here): set afterwards
        stored_keys = stored_state[key]
        # a key whose value was None when saved has no leaf: compare only the keys with data
        check_state_keys(key, [k for k, v in live_entry.items() if v is not None], stored_keys, optim)
        state[key] = {k: v for k, v in live_entry.items() if k in stored_keys}
        target[key] = {
            k: v for k, v in state[key].items() if not isinstance(v, torch.Tensor) or shapes.admit(stored_keys[k], v, pn[0])
        }
    return _Optim(target, state, groups, types)


def _others(state: TrainState, rank: int) -> dict[str, Any]:
    """The extra and per-rank entries of ``state`` as the tree they are saved as (stateful objects kept)."""
    out: dict[str, Any] = {}
    if state.extra:
        out[EXTRA] = dict(state.extra)
    mine = {**state.per_rank, **({RNG: _RngSlot()} if state.rng else {})}
    if mine:
        out[RANKS] = {rank: mine}
    return out


def _match_cuda_rng(ck: Checkpoint, prefix: str, target: dict[str, Any]) -> None:
    """The CUDA RNG states' target: none when the checkpoint has none (this process keeps its
    own); one byte tensor per stored device when it has them and CUDA is available here, even
    where this process has not used CUDA yet (so they are never silently left out)."""
    stored = sorted(_under(ck, prefix), key=lambda p: int(p.rsplit("/", 1)[1]))
    if not stored or not torch.cuda.is_available():
        target.pop("cuda", None)
        return
    target["cuda"] = [torch.empty(ck.array_metadata(p).shape, dtype=torch.uint8) for p in stored]


def _match_others(ck: Checkpoint, state: TrainState, rank: int, strict: bool) -> Expanded:
    """Extra, per-rank and RNG state: each object's own state is its target (stateful_objects
    expanded), compared path by path with the checkpoint's."""
    given = _others(state, rank)
    expanded = expand(given, rank=rank)
    mine: dict[str, Any] = expanded.tree.get(RANKS, {}).get(rank, {})
    if state.rng:
        _match_cuda_rng(ck, f"{RANKS}/{rank}/{RNG}/cuda", mine[RNG])
    if not strict:
        return expanded
    cuda = f"{RANKS}/{rank}/{RNG}/cuda/"  # matched by _match_cuda_rng: not compared
    wanted = [p for p in (flatten(expanded.tree).paths if expanded.tree else []) if not p.startswith(cuda)]
    sections = [f"{EXTRA}/{escape(n)}" for n in state.extra] + [f"{RANKS}/{rank}/{escape(n)}" for n in mine]
    stored = [p for s in sections for p in _under(ck, s) if not p.startswith(cuda)]
    missing, unexpected = sorted(set(wanted) - set(stored)), sorted(set(stored) - set(wanted))
    if missing or unexpected:
        saved = ck.raw.get("world_size")
        hint = (
            f" The checkpoint was saved by {saved} ranks; this is rank {rank}: per-rank state exists only for "
            "the ranks that saved it. Pass rng=False / fewer per_rank objects, or strict=False to keep this "
            "rank's current state where the checkpoint has none."
            if any(p.startswith(f"{RANKS}/") for p in missing)
            else " Pass strict=False to restore only the entries both have."
        )
        raise StructureMismatchError(
            f"{ck.location}: extra / per-rank state differs; missing from the checkpoint: {missing[:6]}; "
            f"in the checkpoint but not given: {unexpected[:6]}.{hint}"
        )
    return expanded


def _plan(ck: Checkpoint, state: TrainState, live: dict[str, Any], rank: int, *, strict: bool) -> _Plan:
    """Match the live state to the checkpoint, with precise errors, before anything is read."""
    model, optims = state.model, state.optimizers
    shapes = _Shapes(ck, model, state.resize)
    target: dict[str, Any] = {MODEL: _match_model(ck, live[MODEL], shapes, strict)}
    optim = _Optim({}, {}, [], None)
    if optims:
        optim = _match_optimizers(ck, model, optims, live[OPTIM][STATE], shapes, strict)
        target[OPTIM] = {STATE: optim.target}
    shapes.raise_errors()
    others = _match_others(ck, state, rank, strict)
    target.update(others.tree)
    return _Plan(target, shapes.resized, optim.groups, optim.types, optim.state, others)


def _read_overlap(ck: Checkpoint, path: str, dst: Any, casting: str) -> None:
    """Copy the overlap of the stored array and this rank's part of ``dst`` (a resized parameter)."""
    arr = LazyArray(ck, ck.aliases.get(path, path))
    offsets, lengths = region_of(dst, path)
    box = tuple(slice(min(o, s), min(o + n, s)) for o, n, s in zip(offsets, lengths, arr.shape))
    if any(b.stop <= b.start for b in box):
        return
    local = local_of(dst)
    check = check_cast(path, arr.dtype, local.dtype, casting=casting)
    raw = arr.read_box(box)
    if check is not None:
        check.check(raw, [b.start for b in box])
    with torch.no_grad(), cast_warnings_off(check is not None):
        local[tuple(slice(0, b.stop - b.start) for b in box)].copy_(_dtypes.numpy_to_tensor(raw, arr.dtype))
    warn_lost_values([check])


class RestoreResult(dict[str, Any]):
    """What :func:`restore` returns: a dict of the ``extra`` names, and ``per_rank``.

    Each ``extra`` name maps to its object (stateful objects, loaded) or to its
    restored value (plain values and pytrees, e.g. the step). ``per_rank`` maps
    this rank's ``per_rank`` names the same way; it is an attribute, not a key,
    so it never collides with an ``extra`` name. The RNG states are not in it:
    they are loaded into this process's generators.
    """

    def __init__(self, extra: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        super().__init__(extra)
        self.per_rank: dict[str, Any] = dict(per_rank)

    def __repr__(self) -> str:
        return f"RestoreResult({dict.__repr__(self)}, per_rank={self.per_rank!r})"


@verb("tsckpt.torch.restore")
def restore(
    directory: Directory,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    extra: Mapping[str, Any] | None = None,
    per_rank: Mapping[str, Any] | None = None,
    rng: bool = True,
    strict: bool = True,
    resize: Iterable[str] = (),
    group: Any = None,
    timeout: datetime.timedelta | None = None,
    progress: bool | None = None,
    max_inflight_bytes: int = READ_WINDOW_BYTES,
    casting: str = "same_kind",
    copy: Copy = True,
) -> RestoreResult:
    """Restore a :func:`save` checkpoint in place into a live model and optimizers; every rank calls it.

    Each tensor is read straight into the live parameter, buffer or optimizer
    state (in its own dtype; under FSDP2 each rank reads only its shards, from a
    checkpoint saved with any sharding or world size), so memory stays at
    model + optimizer + a bounded read buffer. Never-stepped optimizers get their
    state created first (torch's lazy init). ``extra`` and ``per_rank`` are as
    for :func:`save`, each value the target of its restore (tensors in it are
    filled in place): stateful objects get ``load_state_dict``. The result (a
    :class:`RestoreResult`) maps each ``extra`` name to the object, or to the
    restored value (e.g. the step); its ``per_rank`` attribute maps this rank's
    ``per_rank`` names the same way (``out.per_rank["seen"]``).
    ``rng`` restores this rank's RNG states. ``strict`` reports names missing on
    either side (another architecture, another optimizer type, or the same names
    shifted by a prefix: a Hugging Face directory holds a plain state_dict, restored
    with ``tsckpt.restore(directory, model.state_dict(), inplace=True)``);
    ``strict=False`` loads the names both have and logs what it left out on the
    ``tsckpt`` logger, and still raises when the model has no name in the
    checkpoint. A model on the meta device (parameters and buffers, DTensors under
    FSDP2 included) ends with real ones: each restored tensor becomes the new
    parameter (an ``nn.Parameter`` keeping ``requires_grad``; tied parameters stay one
    parameter) or buffer, as ``load_state_dict(assign=True)`` does, read straight into
    its memory (peak memory: the model and the read window); give such a model without
    optimizers, then build them over its real parameters. ``resize`` names
    parameters whose shape changed (a padded vocabulary): their overlapping
    region is loaded, the rest keeps the model's values. ``max_inflight_bytes``
    is that read buffer's bound, ``casting`` governs tensors whose live dtype
    differs from the stored one, and ``group``, ``timeout`` and ``progress`` are
    as for :func:`tsckpt.restore`. ``copy=False``: the new parameters and buffers of a model on
    the meta device map the checkpoint's files where a stored chunk is exactly the tensor
    (copy-on-write: training writes them, never the files; docs/zerocopy.md); live tensors
    are filled in place either way. The same as ``tsckpt.restore(directory,
    TrainState(model, optimizers, extra=..., per_rank=..., rng=..., resize=...))``.
    """
    options, refused = RestoreOptions.checked(locals())  # a bad option raises in the check, on every rank
    state = TrainState(model, optimizers, extra=extra, per_rank=per_rank, rng=rng, resize=resize)
    return _restore_state(directory, state, options, refused=refused)


def _restore_state(
    directory: Directory, state: TrainState, options: RestoreOptions, *, refused: Exception | None = None
) -> RestoreResult:
    """Restore ``state`` in place (see :func:`restore`): check everything, read, then apply.
    ``refused``: a bad option's error (RestoreOptions.checked), raised in the check on every rank."""
    coord = coordinator_for(options.group, options.timeout)
    for name, reason in _NOT_FOR_TRAIN_STATE.items():
        if refused is None and getattr(options, name) != getattr(RestoreOptions(), name):
            refused = ValueError(f"{name}={getattr(options, name)!r} does not apply to a TrainState: {reason}")
    if refused is not None:
        refuse(coord, "restore (check)", refused)
    casting = options.casting

    def check() -> tuple[Checkpoint, _Plan]:
        ck = open_checkpoint(directory)
        _check_meta(state)
        live = live_state(state.model, state.optimizers)  # creates never-stepped optimizers' state to read into
        plan = _plan(ck, state, live, coord.rank, strict=options.strict)
        for path, dst in plan.resized:  # refused casts raise before anything is read
            if on_meta(dst):
                raise LeafTypeError(
                    f"'{path}': resize keeps the model's values outside the stored region, and this parameter is "
                    "on the meta device, with none; materialise it first (model.to_empty(device=...) and "
                    "initialise it), or restore without resize"
                )
            check_cast(path, ck.array_metadata(path).dtype, local_of(dst).dtype, casting=casting)
        return ck, plan

    on_meta_before = bool(meta_tensors(state.model))
    ck, plan = cast("tuple[Checkpoint, _Plan]", phase(coord, "restore (check)", check))
    with warnings.catch_warnings():
        # differences were checked above, with better messages (values lost to casting="unsafe" still warn)
        warnings.filterwarnings("ignore", ".*target tree and checkpoint differ", RestoreWarning)
        restored = core_restore(
            directory, plan.target, **dataclasses.replace(options, strict=False, inplace=True).kwargs()
        )

    def finish() -> dict[str, Any]:
        meta = {n: restored[MODEL][n] for n, t in plan.target[MODEL].items() if on_meta(t)}
        if meta:  # a meta model: the new tensors become its parameters and buffers
            assign(state.model, meta)
        if meta or on_meta_before:
            left = meta_tensors(state.model)
            if left:
                log.warning(
                    "%s: %s of the model are still on the meta device after the restore (the checkpoint has no "
                    "values for them: non-persistent buffers, or names missing under strict=False): %s; "
                    "initialise them before use",
                    ck.location, _count(len(left), "tensor"), count_and_list(left),
                )
        for path, dst in plan.resized:
            _read_overlap(ck, path, dst, casting)
        if state.optimizers:
            live = {k: {**plan.optim_state[k], **v} for k, v in restored[OPTIM][STATE].items()}
            stored = {STATE: live, GROUPS: plan.groups, TYPES: plan.types}
            apply_optimizer(
                state.model, state.optimizers, stored, strict=False, resize=state.resize, casting=casting
            )
        # stateful objects get load_state_dict, the RNG states go into this process's generators
        return cast("dict[str, Any]", plan.others.load({k: restored[k] for k in plan.others.tree}))

    others = cast("dict[str, Any]", phase(coord, "restore (apply)", finish))
    mine = dict(others.get(RANKS, {}).get(coord.rank, {}))
    if state.rng:
        del mine[RNG]
    return RestoreResult(others.get(EXTRA, {}), mine)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _check_meta(state: TrainState) -> None:
    """A model with parameters on the meta device is restored by replacing them (they have no
    memory to copy into); optimizers built over the meta parameters would keep those, and their
    state, so they are refused before anything is read."""
    if not state.optimizers:
        return
    meta = [n for n, p in state.model.named_parameters() if on_meta(p)]
    if meta:
        raise LeafTypeError(
            f"the model has {_count(len(meta), 'parameter')} on the meta device ({count_and_list(meta)}) and "
            "optimizers were given: the restore replaces meta parameters by new ones, and an optimizer built over "
            "the meta ones would keep them. restore the model first (tsckpt.torch.restore(directory, model) "
            "gives it real parameters), then build the optimizers over model.parameters() and restore again "
            "with them: tsckpt.torch.restore(directory, model, optimizers, ...)"
        )


# Restore options a TrainState never uses, and why.
_NOT_FOR_TRAIN_STATE = {
    "as_saved": "it restores into the live model, optimizers and objects",
    "format": "it restores what a TrainState saved: a tsckpt checkpoint",
    "allow_pickle": "it restores what a TrainState saved: a tsckpt checkpoint, never a pickle",
}


class _RngSlot:
    """The RNG states as a stateful object, so they restore like any per-rank object."""

    def state_dict(self) -> dict[str, Any]:
        return get_rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_rng_state(state)
