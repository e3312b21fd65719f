"""A small GPT-like model, its training loop, and the multi-rank scenarios of the PyTorch bridge tests.

Scenarios are module-level functions ``fn(rank, world, *args)`` for
``tests.dist_helpers.run_ranks``; ``run_solo`` runs one in a fresh process
without torch.distributed.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tsckpt
import tsckpt.torch

VOCAB, CTX, DIM, LAYERS, HEADS, BATCH = 40, 12, 32, 2, 2, 8


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, c)), drop, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), drop, self.training)


class TinyGPT(nn.Module):
    """Token embedding tied to the LM head, as in GPT-2."""

    def __init__(self, vocab: int = VOCAB, dropout: float = 0.1, tied: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, DIM)
        self.pos = nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS, dropout) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))  # a persistent buffer
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def gpt(seed: int, *, dropout: float = 0.1, vocab: int = VOCAB, tied: bool = True) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab, dropout, tied)


def corpus() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (400,), generator=g)


class Cursor:
    """A per-rank data sampler: its own generator and position, with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.consumed = 0
        self.gen = torch.Generator().manual_seed(400)

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["consumed"])
        self.gen.set_state(state["gen"])


def batch(data: torch.Tensor, cursor: Cursor) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch drawn with the sampler's generator and the Python and numpy RNGs."""
    starts = torch.randint(0, len(data) - CTX - 8, (BATCH,), generator=cursor.gen)
    starts = starts + random.randrange(4) + int(np.random.randint(0, 4))
    rows = torch.stack([data[s : s + CTX + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), foreach=False)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=3e-3, foreach=False)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, foreach=False)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(s / 20)))


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    cursor: Cursor,
    steps: int,
    *,
    rank: int = 0,
    world: int = 1,
) -> list[float]:
    """``steps`` steps on this rank's slice of each global batch; returns the global losses."""
    data = corpus()
    losses = []
    model.train()
    for _ in range(steps):
        x, y = batch(data, cursor)
        per = BATCH // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        cursor.consumed += len(x)
        with torch.no_grad():
            model.seen += 1
        g = loss.detach().clone()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(g)
            g /= world
        losses.append(float(g))
    return losses


def full_params(model: nn.Module) -> dict[str, np.ndarray]:
    from tsckpt._leaves.dtensor import is_dtensor

    out = {}
    for name, v in model.state_dict().items():
        v = v.full_tensor() if is_dtensor(v) else v
        out[name] = v.detach().clone().numpy()
    return out


def full_optim(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, np.ndarray]:
    from tsckpt._leaves.dtensor import is_dtensor
    from tsckpt.torch._state import param_names

    names = param_names(model)
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{names[id(p)][0]}/{k}"] = (v.full_tensor() if is_dtensor(v) else v).detach().clone().numpy()
    return out


def fill_nan(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """Every floating parameter, buffer and optimizer state tensor set to NaN (integers to -1)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def fill(t: torch.Tensor) -> None:
        from tsckpt._leaves.dtensor import is_dtensor

        t = t.to_local() if is_dtensor(t) else t
        t.fill_(float("nan") if t.is_floating_point() else -1)

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            fill(t)
        if opt is not None:
            get_optimizer_state_dict(model, opt)  # torch creates the state of a never-stepped optimizer
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        fill(v)


def nan_left(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[str]:
    from tsckpt._leaves.dtensor import is_dtensor

    def bad(t: torch.Tensor) -> bool:
        t = t.to_local() if is_dtensor(t) else t
        return bool(torch.isnan(t).any()) if t.is_floating_point() else bool((t == -1).any())

    out = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if bad(t)]
    if opt is not None:
        out += [f"optim:{k}" for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and bad(v)]
    return out


# ---- runs: train, save, go on (the uninterrupted reference); resume elsewhere ---------------


def shard(model: nn.Module, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def seed_all(rank: int) -> None:
    torch.manual_seed(100 + rank)  # dropout: per rank
    random.seed(200)  # data: the same global batch on every rank
    np.random.seed(300)


def train_save_continue(
    rank: int, world: int, directory: str | None, n: int, m: int, fsdp: bool, kind: str = "adamw",
    via: str = "torch",
) -> dict[str, Any]:
    """Train n steps, save (unless ``directory`` is None), train m more: the uninterrupted run.

    ``via="torch"``: ``tsckpt.torch.save`` into ``directory``; ``via="manager"``: a
    TrainState saved as step n by ``CheckpointManager(directory).save_async``, training
    going on while it is written."""
    seed_all(rank)
    model = gpt(0, dropout=0.0 if fsdp else 0.1)  # dropout masks depend on the world size
    if fsdp:
        shard(model, world)
    opt = make_optimizer(model, kind)
    sched, cursor = scheduler(opt), Cursor()
    before = train(model, opt, sched, cursor, n, rank=rank, world=world)
    manager = None
    if directory is not None and via == "manager":
        state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched, "step": n}, per_rank={"data": cursor})
        manager = tsckpt.CheckpointManager(directory, keep_last=2)
        pending = manager.save_async(n, state)
    elif directory is not None:
        tsckpt.torch.save(directory, model, opt, extra={"scheduler": sched, "step": n}, per_rank={"data": cursor})
    after = train(model, opt, sched, cursor, m, rank=rank, world=world)
    if manager is not None:
        pending.result()
        manager.close()
    if directory is not None and not fsdp:  # and a run that never saved, in the same process
        unsaved = train_save_continue(rank, world, None, n, m, fsdp, kind)
        if unsaved["before"] + unsaved["after"] != before + after:
            raise AssertionError(f"saving changed training: {unsaved['after']} vs {after}")
    return {
        "before": before,
        "after": after,
        "params": full_params(model),
        "optim": full_optim(opt, model),
        "lr": [g["lr"] for g in opt.param_groups],
        "consumed": cursor.consumed,
    }


def resume(
    rank: int, world: int, directory: str, m: int, fsdp: bool, kind: str = "adamw", unsharded: str | None = None,
    via: str = "torch",
) -> dict[str, Any]:
    """A fresh process: new model (other seed), NaN everywhere, restore, train m steps.

    ``unsharded``: also restore that single-process checkpoint into a fresh sharded model.
    ``via="manager"``: restore the latest step of ``CheckpointManager(directory)`` into a TrainState."""
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    model = gpt(7, dropout=0.0 if fsdp else 0.1)
    if fsdp:
        shard(model, world)
    opt = make_optimizer(model, kind)
    sched, cursor = scheduler(opt), Cursor()
    fill_nan(model, opt)
    if via == "manager":
        state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched, "step": 0}, per_rank={"data": cursor})
        with tsckpt.CheckpointManager(directory) as manager:
            step = manager.restore(target=state)
        if state.extra["step"] != step or state.extra["scheduler"] is not sched or state.per_rank["data"] is not cursor:
            raise AssertionError(f"the TrainState was not loaded in place: {state.extra}, {state.per_rank}")
    else:
        given = {"scheduler": sched, "step": 0}
        step = tsckpt.torch.restore(directory, model, opt, extra=given, per_rank={"data": cursor})["step"]
    left = nan_left(model, opt)
    tied = model.head.weight is model.tok.weight
    after = train(model, opt, sched, cursor, m, rank=rank, world=world)
    extra: dict[str, Any] = {}
    if unsharded is not None:
        plain = gpt(11, dropout=0.0)
        shard(plain, world)
        plain_opt = make_optimizer(plain, kind)
        fill_nan(plain, plain_opt)
        tsckpt.torch.restore(unsharded, plain, plain_opt, rng=False)
        extra = {"unsharded_nan_left": nan_left(plain, plain_opt), "unsharded": full_params(plain),
                 "unsharded_optim": full_optim(plain_opt, plain)}
        # DDP: names without the wrapper's "module." prefix, both ways
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(gpt(12, dropout=0.0))
        ddp_opt = make_optimizer(ddp.module)
        fill_nan(ddp, ddp_opt)
        tsckpt.torch.restore(unsharded, ddp, ddp_opt, rng=False)
        extra["ddp_names"] = sorted(tsckpt.torch.get_state_dict(ddp, ddp_opt)["model"])[:3]
        extra["ddp_nan_left"] = nan_left(ddp, ddp_opt)
        extra["ddp"] = full_params(ddp.module)
    return {
        **extra,
        "step": step,
        "nan_left": left,
        "tied": tied,
        "after": after,
        "params": full_params(model),
        "optim": full_optim(opt, model),
        "lr": [g["lr"] for g in opt.param_groups],
        "consumed": cursor.consumed,
    }


# ---- a fresh process without torch.distributed -------------------------------------------


def _solo_entry(fn: Callable[..., Any], args: tuple[Any, ...], q: Any) -> None:
    import os
    import traceback

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        q.put(("ok", fn(0, 1, *args)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def run_solo(fn: Callable[..., Any], *args: Any, timeout: float = 120) -> Any:
    """Run ``fn(0, 1, *args)`` in a fresh process with no process group."""
    from tests.dist_helpers import _CTX

    import queue
    import time

    q = _CTX.Queue()
    p = _CTX.Process(target=_solo_entry, args=(fn, args, q), daemon=True)
    p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                status, value = q.get(timeout=0.5)
                break
            except queue.Empty:
                if not p.is_alive() and q.empty():
                    raise RuntimeError(f"the process running {fn.__name__} died (exit code {p.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish in {timeout}s") from None
    finally:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value
