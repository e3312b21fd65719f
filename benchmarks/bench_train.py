#!/usr/bin/env python
"""Step-time overhead of checkpointing in the background, in a training loop on the CPU, against the peers.

Workloads: MLPs of Linear layers trained by AdamW on random batches, in one
process, with torch set to use all CPUs but one (the one left is where a
background save runs). The state saved is the model, the optimizer, the LR
scheduler and a step counter (tsckpt: a ``tsckpt.torch.TrainState``, which adds
the RNG states): about 3x the parameters' bytes.

  compute   12 layers of 1024 x 1024, batch 256: each step is a few large
            matrix products (the CPU bound case)
  dispatch  96 layers of 128 x 128, batch 8: each step is many small
            operators, its time mostly the Python thread's (as a GPU training
            loop's host side is); a background save that holds the GIL shows here

Columns (``--savers``), each a save started as soon as the previous one committed,
so that a save runs in the background during every step of its phase:

  process              tsckpt ``CheckpointManager.save_async`` with its default writer (a
                       writer process, started once and kept) and blocking staging
  thread               the same with ``writer="thread"`` (the save in a thread of the trainer)
  overlapped           the writer process with ``staging="overlapped"`` (the optimizer's
                       tensors copied after the call returns, its next step held back until they are)
  dcp                  ``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, opt)``,
                       thread mode (the default)
  dcp-process          the same with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``
                       (a daemon process started once; needs a process group: a 1-rank gloo
                       group on a FileStore is initialized for the whole run when it is chosen)
  torch-checkpointing  torch-checkpointing's async ``CheckpointManager.save`` of
                       ``{"model", "optim", "scheduler", "step"}``, its CPU configuration
                       (staging without pinned memory or non-blocking copies, into shared memory,
                       written by its background process), the optimizer's step inside
                       ``manager.lock()`` as its documentation asks. Its storage is configured with
                       ``use_direct_io=False``: its default direct I/O fails (EINVAL) on file systems
                       that refuse unaligned direct writes. It never fsyncs what it writes, so its
                       "commit" is data in the page cache, where the others' is on the disk.

Each column's life is its own: created (its background process started), one
untimed save, then ``--rounds`` rounds of a "no save" phase and a phase of saves,
then closed, before the next column is created. The "no save" phases of all
columns make the baseline. A thread samples the memory of the trainer and all its
child processes (psutil, every 50 ms) for the whole run.

Reported per column: the median step time while a save is in flight and its
overhead against "no save"; the time the save call blocks; the median time of the
step right after the call (where held-back optimizer steps show); the time to
commit (from the call until the save is durable; training goes on meanwhile: a
phase continues until the last save committed, at most ``--tail`` seconds);
the peak extra memory of the trainer and its child processes over the column's
life against just before it was created: PSS summed (shared staging memory
counted once) and RSS summed (shared pages counted in every process that maps
them). Two baselines, timed while no training runs: a plain copy of the state's
tensors into preallocated buffers, and a synchronous ``tsckpt.save`` of the same
state. The issue's targets are judged at the end, met or missed.

Usage
  python benchmarks/bench_train.py                  # one round: about 3 minutes on a quiet 2-CPU machine
  python benchmarks/bench_train.py --quick          # a smoke run (small models, a few steps), about a minute
  python benchmarks/bench_train.py --rounds 3       # steadier medians, about 3x as long
  python benchmarks/bench_train.py --savers process,overlapped --steps 15 --rounds 2
  python benchmarks/bench_train.py --write-results  # also update benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, ContextManager

from _common import finish, machine_info

import psutil
import torch
from torch import nn

import tsckpt
import tsckpt.torch

SECTION = "## Training loop: step time while saving in the background"
# A run of tsckpt's columns alone (no peer) compares its writers and stagings.
STAGING_SECTION = "## Training loop: overlapped against blocking staging"
MiB = 1 << 20
TSCKPT = {"process": ("process", "blocking"), "thread": ("thread", "blocking"), "overlapped": ("process", "overlapped")}
PEERS = ("dcp", "dcp-process", "torch-checkpointing")
LABELS = {
    "process": "tsckpt process",
    "thread": "tsckpt thread",
    "overlapped": "tsckpt overlapped",
    "dcp": "DCP thread",
    "dcp-process": "DCP process",
    "torch-checkpointing": "torch-checkpointing",
}
Guard = Callable[[], ContextManager[Any]]


def build(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    return model, opt, sched


def make_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, dim: int, batch: int) -> Callable[[Guard], None]:
    """A training step; ``guard`` wraps the optimizer's in-place update (torch-checkpointing's lock)."""
    x = torch.randn(batch, dim)

    def step(guard: Guard) -> None:
        loss = model(x).square().mean()
        loss.backward()
        with guard():
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return step


# ---- the columns ---------------------------------------------------------------------------------


class Saver:
    """One column: starts a save when asked, stamps when each save is durable."""

    def __init__(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        self.root, self.n = root, 0
        self.handle: Future[Any] | None = None
        self.outcomes: dict[int, float | None] = {}  # save number: seconds from the call to the commit (None: failed)

    def call(self, n: int) -> Future[Any]:
        raise NotImplementedError

    def guard(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def busy(self) -> bool:
        return self.handle is not None and not self.handle.done()

    def start(self) -> float:
        """Start the next save (the previous one has committed); returns how long the call blocked."""
        if self.handle is not None:
            self.handle.result()
        self.n += 1
        t0 = time.perf_counter()
        handle = self.call(self.n)
        blocked = time.perf_counter() - t0
        handle.add_done_callback(functools.partial(self._done, t0, self.n))
        self.handle = handle
        return blocked

    def _done(self, t0: float, n: int, fut: Future[Any]) -> None:
        took = time.perf_counter() - t0
        if fut.exception() is None:
            self.retire(n)
        self.outcomes[n] = took if fut.exception() is None else None

    def commits(self, first: int) -> list[float]:
        """Commit times of saves ``first`` on; waits (briefly) for the last done-callbacks, which
        run after ``result()`` has returned."""
        deadline = time.monotonic() + 10
        while len([n for n in range(first, self.n + 1) if n in self.outcomes]) < self.n + 1 - first:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return [v for n, v in sorted(self.outcomes.items()) if n >= first and v is not None]

    def retire(self, n: int) -> None:
        """Delete the checkpoint before ``n`` (in the thread that completed save ``n``)."""
        shutil.rmtree(os.path.join(self.root, str(n - 1)), ignore_errors=True)

    def drain(self) -> None:
        if self.handle is not None:
            self.handle.result()

    def finish(self) -> None:
        self.drain()


class TsckptSaver(Saver):
    def __init__(self, root: str, state: Any, writer: str, staging: str) -> None:
        super().__init__(root)
        self.manager = tsckpt.CheckpointManager(root, keep_last=1, writer=writer, staging=staging)  # type: ignore[arg-type]
        self.state = state

    def call(self, n: int) -> Future[Any]:
        return self.manager.save_async(n, self.state)

    def retire(self, n: int) -> None:
        pass  # keep_last=1: the manager's own retention

    def finish(self) -> None:
        self.manager.close()


class DcpSaver(Saver):
    def __init__(self, root: str, model: nn.Module, opt: torch.optim.Optimizer, *, process: bool) -> None:
        super().__init__(root)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.dcp, self.get_state_dict, self.model, self.opt, self.process = dcp, get_state_dict, model, opt, process
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD

    def call(self, n: int) -> Future[Any]:
        msd, osd = self.get_state_dict(self.model, self.opt)
        fut = self.dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=os.path.join(self.root, str(n)), async_checkpointer_type=self.kind
        )
        return fut if isinstance(fut, Future) else fut.upload_completion

    def finish(self) -> None:
        self.drain()
        if self.process:  # DCP keeps its daemon for the life of the trainer; stop it so the next column starts clean
            from torch.distributed.checkpoint import _async_process_executor as executor

            daemon, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
            if daemon is not None:
                daemon.__del__()


class TorchCheckpointingSaver(Saver):
    def __init__(self, root: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
        super().__init__(root)
        from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager, CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        staging = CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False, use_shared_memory=True)
        self.manager = CheckpointManager(
            CheckpointManager.Config(
                save=AsyncCheckpointSaverConfig(staging_config=staging),
                storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
            )
        )
        self.model, self.opt, self.sched = model, opt, sched

    def call(self, n: int) -> Future[Any]:
        payload = {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "step": n,
        }
        fut = self.manager.save(os.path.join(self.root, str(n)), payload)
        if fut is None:
            raise RuntimeError("torch-checkpointing saved synchronously: expected its async saver")
        return fut

    def guard(self) -> ContextManager[Any]:
        return self.manager.lock()

    def finish(self) -> None:
        self.manager.close()


def make_saver(name: str, root: str, state: Any, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> Saver:
    path = os.path.join(root, name)
    if name in TSCKPT:
        return TsckptSaver(path, state, *TSCKPT[name])
    if name == "torch-checkpointing":
        return TorchCheckpointingSaver(path, model, opt, sched)
    return DcpSaver(path, model, opt, process=name == "dcp-process")


def init_group(root: str) -> None:
    """A 1-rank gloo process group (DCP's process mode needs one), on a FileStore: no port to pick."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where DCP's daemon starts its own store
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "group-store"), 1), rank=0, world_size=1)


# ---- measuring -----------------------------------------------------------------------------------


class TreeMemory(threading.Thread):
    """Samples PSS and RSS of this process and all its descendants; keeps the peak since ``reset``."""

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True, name="bench-memory")
        self.interval, self.proc = interval, psutil.Process()
        self.peak = (0, 0)
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def sample(self) -> tuple[int, int]:
        pss = rss = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                m = p.memory_full_info()
                pss, rss = pss + m.pss, rss + m.rss
        return pss, rss

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            pss, rss = self.sample()
            with self.lock:
                self.peak = (max(self.peak[0], pss), max(self.peak[1], rss))

    def reset(self) -> tuple[int, int]:
        now = self.sample()
        with self.lock:
            self.peak = now
        return now

    def take(self) -> tuple[int, int]:
        now = self.sample()
        with self.lock:
            return max(self.peak[0], now[0]), max(self.peak[1], now[1])


def timed_steps(step: Callable[[Guard], None], n: int, saver: Saver | None, tail_s: float) -> dict[str, list[float]]:
    """Run ``n`` steps; before each, start a save if none is in flight. Then keep training
    (no new save) until the last save committed, for at most ``tail_s`` seconds. Returns
    the step times that began while a save was in flight, the others, the blocking times
    of the save calls and the times of the steps right after them."""
    out: dict[str, list[float]] = {"during": [], "idle": [], "blocked": [], "first": [], "past_tail": []}
    guard: Guard = saver.guard if saver is not None else contextlib.nullcontext
    i, tail_end = 0, None
    while True:
        if i >= n:
            if saver is None or not saver.busy():
                break
            tail_end = tail_end or time.perf_counter() + tail_s
            if time.perf_counter() > tail_end:
                out["past_tail"].append(1.0)  # the last save commits after training stopped
                break
        called = False
        if saver is not None and i < n and not saver.busy():
            out["blocked"].append(saver.start())
            called = True
        in_flight = saver is not None and saver.busy()
        t = time.perf_counter()
        step(guard)
        took = time.perf_counter() - t
        out["during" if in_flight else "idle"].append(took)
        if called:
            out["first"].append(took)
        i += 1
    return out


def plain_copy(tensors: list[torch.Tensor], repeats: int) -> float:
    """Median time to copy the state's tensors into buffers allocated (and touched) beforehand."""
    buffers = [torch.zeros_like(t) for t in tensors]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for dst, src in zip(buffers, tensors):
            dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sync_save(root: str, state: Any, repeats: int) -> float:
    """Median time of a synchronous ``tsckpt.save`` of the state (committed, fsynced)."""
    times = []
    for i in range(repeats):
        path = os.path.join(root, f"sync-{i}")
        t = time.perf_counter()
        tsckpt.save(path, state)
        times.append(time.perf_counter() - t)
        shutil.rmtree(path, ignore_errors=True)
    return statistics.median(times)


WORKLOADS = {"compute": (1024, 12, 256, 1), "dispatch": (128, 96, 8, 3)}  # dim, layers, batch, steps factor


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    chosen = args.savers.split(",")
    unknown = [s for s in chosen if s not in LABELS]
    if unknown:
        raise SystemExit(f"--savers: unknown {unknown}; choose from {', '.join(LABELS)}")
    out: dict[str, Any] = {"machine": machine_info(), "threads": threads, "group": False, "workloads": {}}
    root = tempfile.mkdtemp(prefix="bench_train_", dir=args.dir)
    memory = TreeMemory()
    memory.start()
    try:
        if "dcp-process" in chosen:
            init_group(root)
            out["group"] = True
        for name in args.workloads.split(","):
            dim, layers, batch, factor = WORKLOADS[name]
            if args.quick:
                dim, layers = min(dim, 256), min(layers, 4)
            out["workloads"][name] = run_workload(
                args, chosen, memory, os.path.join(root, name), dim, layers, batch, args.steps * factor
            )
    finally:
        memory.stopped.set()
        if out["group"]:
            torch.distributed.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return out


def run_workload(
    args: argparse.Namespace, chosen: list[str], memory: TreeMemory, root: str, dim: int, layers: int, batch: int,
    steps: int,
) -> dict[str, Any]:
    print(f"{dim} x {dim} x {layers} layers, batch {batch}:", flush=True)
    model, opt, sched = build(dim, layers)
    step = make_step(model, opt, sched, dim, batch)
    for _ in range(3):
        step(contextlib.nullcontext)  # warm-up, and AdamW's state exists
    state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched, "step": 0})
    tensors = [*model.state_dict().values()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    os.makedirs(root)
    copy_s = plain_copy(tensors, args.repeats)
    sync_s = sync_save(root, state, args.repeats)
    print(f"  plain copy {copy_s * 1e3:.1f} ms, synchronous save {sync_s * 1e3:.1f} ms", flush=True)
    no_save: list[float] = []
    columns: dict[str, dict[str, Any]] = {}
    for name in chosen:
        base = memory.reset()
        t = time.perf_counter()
        try:
            saver = make_saver(name, root, state, model, opt, sched)
            saver.start()  # its background process starts, its buffers are allocated: before the timed phases
            saver.drain()
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            print(f"  {LABELS[name]} unavailable here: {type(e).__name__}: {e}")
            columns[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        first = saver.n + 1
        col: dict[str, Any] = {"during": [], "idle": [], "blocked": [], "first": [], "past_tail": []}
        col["setup_s"] = time.perf_counter() - t
        try:
            for _ in range(args.rounds):
                no_save += timed_steps(step, steps, None, 0.0)["idle"]
                for k, v in timed_steps(step, steps, saver, args.tail).items():
                    col[k] += v
                saver.drain()
        finally:
            peak = memory.take()
            saver.finish()
        col["commits"] = saver.commits(first)
        col["extra_pss"], col["extra_rss"] = peak[0] - base[0], peak[1] - base[1]
        columns[name] = col
        print(f"  {LABELS[name]}: {len(col['during'])} steps during {len(col['commits'])} saves", flush=True)
    return {
        "dim": dim, "layers": layers, "batch": batch, "steps": steps, "state_bytes": state_bytes,
        "copy_s": copy_s, "sync_s": sync_s, "no_save": no_save, "columns": columns,
    }


# ---- the report ----------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.1f} ms" if x is not None else "-"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _title(args: argparse.Namespace) -> str:
    return SECTION if any(s in PEERS for s in args.savers.split(",")) else STAGING_SECTION


def summarize(w: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per column: median step during a save, overhead, blocking, step after the call, commit, memory."""
    base = statistics.median(w["no_save"])
    out = {}
    for name, c in w["columns"].items():
        if "error" in c:
            continue
        during = _median(c["during"])
        out[name] = {
            "during": during,
            "over": during / base - 1 if during is not None else None,
            "blocked": _median(c["blocked"]),
            "first": _median(c["first"]),
            "commit": _median(c["commits"]),
            "extra_pss": c["extra_pss"],
            "extra_rss": c["extra_rss"],
        }
    return out


def targets(w: dict[str, Any], s: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's targets, each tsckpt column judged on its own, met or missed."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    lines = []
    peers = {n: s[n] for n in PEERS if n in s}
    budget = 1.1 * w["state_bytes"] + 64 * MiB
    for name in [n for n in TSCKPT if n in s]:
        c, label = s[name], LABELS[name]
        if c["over"] is not None:
            below = [p for p, v in peers.items() if v["over"] is not None and c["over"] >= v["over"]]
            ok = c["over"] <= 0.03 and not below
            why = f"{c['over'] * 100:+.1f}%" + (f"; not below {', '.join(LABELS[p] for p in below)}" if below else "")
            why += "" if peers else "; no peer in this run"
            lines.append(f"- {label}, step overhead at most +3% and below every peer: {verdict(ok)} ({why})")
        if "torch-checkpointing" in peers and c["blocked"] is not None:
            theirs = peers["torch-checkpointing"]["blocked"]
            lines.append(
                f"- {label}, call blocks no longer than torch-checkpointing's: {verdict(c['blocked'] <= theirs)} "
                f"({_ms(c['blocked'])} against {_ms(theirs)})"
            )
        if c["blocked"] is not None:
            limit = 0.2 if name == "overlapped" else 1.2
            ratio = c["blocked"] / w["copy_s"]
            lines.append(
                f"- {label}, call blocks at most {limit}x a plain copy of the state: {verdict(ratio <= limit)} "
                f"({ratio:.2f}x: {_ms(c['blocked'])} against {_ms(w['copy_s'])})"
            )
        if c["commit"] is not None:
            ratio = c["commit"] / w["sync_s"]
            lines.append(
                f"- {label}, commit at most 1.2x a synchronous save: {verdict(ratio <= 1.2)} "
                f"({ratio:.2f}x: {_ms(c['commit'])} against {_ms(w['sync_s'])})"
            )
        lines.append(
            f"- {label}, peak extra memory (PSS) at most 1.1x the state + 64 MiB ({budget / MiB:.0f} MiB): "
            f"{verdict(c['extra_pss'] <= budget)} ({c['extra_pss'] / MiB:.0f} MiB)"
        )
    return lines


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    group = " A 1-rank gloo process group was up for the whole run (DCP's process mode needs one)." if results["group"] else ""
    lines = [
        _title(args),
        "",
        f"Measured {m['date'][:10]} by `benchmarks/bench_train.py` on {m['nproc']} CPUs ({m['cpu']}), "
        f"torch {m['torch']} with {results['threads']} thread(s); 1-minute load average {m['load_avg'][0]:.1f}. "
        f"{args.rounds} round(s) per column; medians.{group}",
    ]
    for name, w in results["workloads"].items():
        s = summarize(w)
        lines += [
            "",
            f"**{name}**: {w['layers']} Linear layers of {w['dim']} x {w['dim']}, AdamW, batch {w['batch']}; "
            f"state {w['state_bytes'] / MiB:.0f} MiB; {w['steps']} steps per phase and round. "
            f"Plain copy of the state into preallocated buffers: {_ms(w['copy_s'])}; "
            f"synchronous `tsckpt.save` of it: {_ms(w['sync_s'])}.",
            "",
            "| column | median step (save in flight) | steps | overhead | save call blocks | step after the call "
            "| commit (call to durable) | saves | peak extra PSS | peak extra RSS (sum) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| no save | {_ms(statistics.median(w['no_save']))} | {len(w['no_save'])} | - | - | - | - | - | - | - |",
        ]
        for col, c in w["columns"].items():
            if "error" in c:
                lines.append(f"| {LABELS[col]} | unavailable: {c['error']} | | | | | | | | |")
                continue
            v = s[col]
            over = f"{v['over'] * 100:+.1f}%" if v["over"] is not None else "-"
            past = f" ({len(c['past_tail'])} past the tail)" if c["past_tail"] else ""
            lines.append(
                f"| {LABELS[col]} | {_ms(v['during'])} | {len(c['during'])} | {over} | {_ms(v['blocked'])} "
                f"| {_ms(v['first'])} | {_ms(v['commit'])} | {len(c['commits'])}{past} | {v['extra_pss'] / MiB:.0f} MiB "
                f"| {v['extra_rss'] / MiB:.0f} MiB |"
            )
        judged = targets(w, s)
        if judged:
            lines += ["", f"Targets ({name}):", "", *judged]
    lines += [
        "",
        "Commit: from the call until the save is durable, training going on; a save counted \"past the tail\" "
        "committed after its phase stopped training (`--tail`), so part of it ran without a step competing. "
        "Peak extra memory: of the trainer and all its child processes, from just before the column was created "
        "until it was closed. torch-checkpointing never fsyncs: its commit is to the page cache, the others' to "
        "the disk. Not judged here: no growth of memory over 50 saves (a test), the JAX donated-step loop (bench_jax_donate.py), "
        "GPU staging.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="compute,dispatch", help="comma-separated: compute, dispatch")
    ap.add_argument("--steps", type=int, default=8, help="steps per phase and round (dispatch: 3x)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per column (more: steadier medians, longer run)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each baseline (plain copy, synchronous save)")
    ap.add_argument("--tail", type=float, default=10.0, help="seconds a phase may train on, waiting for its last save")
    ap.add_argument("--savers", default=",".join(LABELS), help=f"comma-separated: {', '.join(LABELS)}")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the temp dir)")
    ap.add_argument("--quick", action="store_true", help="small models, 4 steps, 1 round, 1 repeat")
    ap.add_argument("--json")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds, args.repeats, args.tail = 4, 1, 1, 5.0
    finish(run(args), args, report, _title(args))


if __name__ == "__main__":
    main()
