#!/usr/bin/env python
"""Step-time overhead of checkpointing in the background, in a training loop on the CPU.

Workloads: MLPs of Linear layers trained by AdamW on random batches, in one
process, with torch set to use all CPUs but one (the one left is where a
background save runs). The state saved is a ``tsckpt.torch.TrainState`` (model,
optimizer, LR scheduler, step, RNG states): about 3x the parameters' bytes.

  compute   12 layers of 1024 x 1024, batch 256: each step is a few large
            matrix products (the CPU bound case)
  dispatch  96 layers of 128 x 128, batch 8: each step is many small
            operators, its time mostly the Python thread's (as a GPU training
            loop's host side is); a background save that holds the GIL shows here

Phases, interleaved in ``--rounds`` rounds so drift affects all alike:

  no save        ``--steps`` training steps with no checkpointing
  tsckpt process ``CheckpointManager.save_async(step, state)`` with its default
                 writer (a writer process, started once and kept for the whole
                 run) and blocking staging (every tensor copied in the call), a
                 new save as soon as the previous one committed, so a save runs
                 in the background during every step of the phase
  tsckpt thread  the same with ``writer="thread"``: the save in a thread of
                 the training process
  tsckpt overlapped
                 the writer process with ``staging="overlapped"``: the
                 optimizer's parameters and state are copied after the call
                 returns, its next step held back until they are
  dcp            the same with ``torch.distributed.checkpoint.async_save`` of
                 ``get_state_dict(model, opt)`` (DCP's own asynchronous save, in
                 a thread), when it runs without a process group

Reported: the median step time of each phase (steps that began while a save
was in flight; the step that called save_async is counted separately, as the
blocking time of the call), the overhead against "no save", and each save's
blocking and total time, and the median time of the step right after the call
(where an overlapped save's held-back optimizer step shows). Target (issue):
median step time while a save runs at most 5% above the median without one.

Usage
  python benchmarks/bench_train.py                  # ~3-5 min on a 2-core VM
  python benchmarks/bench_train.py --quick          # a smoke run
  python benchmarks/bench_train.py --savers process,overlapped --steps 15 --rounds 2
  python benchmarks/bench_train.py --write-results  # also update benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

from _common import finish, machine_info

import torch
from torch import nn

import tsckpt
import tsckpt.torch

SECTION = "## Training loop: step time while saving in the background"
# A run without DCP (--savers process,overlapped) compares tsckpt's two stagings alone.
STAGING_SECTION = "## Training loop: overlapped against blocking staging"
MiB = 1 << 20


def build(dim: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    return model, opt, sched


def make_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, dim: int, batch: int) -> Callable[[], None]:
    x = torch.randn(batch, dim)

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return step


def timed_steps(step: Callable[[], None], n: int, busy: Callable[[], bool], start_save: Callable[[], Any]) -> dict[str, list[float]]:
    """Run ``n`` steps; before each, start a save if none is in flight (``start_save`` may be a
    no-op). Returns the step times that began while a save was in flight, the others, and
    the blocking times of the save calls."""
    out: dict[str, list[float]] = {"during": [], "idle": [], "blocked": [], "total": [], "first": []}
    started: float | None = None
    for _ in range(n):
        called = False
        if not busy():
            if started is not None:
                out["total"].append(time.perf_counter() - started)
            t = time.perf_counter()
            if start_save():
                out["blocked"].append(time.perf_counter() - t)
                started, called = t, True
            else:
                started = None
        t = time.perf_counter()
        in_flight = busy()
        step()
        took = time.perf_counter() - t
        out["during" if in_flight else "idle"].append(took)
        if called:
            out["first"].append(took)
    return out


class TsckptSaver:
    def __init__(self, root: str, state: Any, writer: str, staging: str = "blocking") -> None:
        self.manager = tsckpt.CheckpointManager(root, keep_last=1, writer=writer, staging=staging)  # type: ignore[arg-type]
        self.state, self.step, self.handle = state, 0, None

    def busy(self) -> bool:
        return self.handle is not None and not self.handle.done()

    def start(self) -> bool:
        if self.handle is not None:
            self.handle.result()
        self.step += 1
        self.handle = self.manager.save_async(self.step, self.state)
        return True

    def close(self) -> None:
        self.manager.wait()  # the writer process stays for the next round, as in a training run

    def finish(self) -> None:
        self.manager.close()


class DcpSaver:
    def __init__(self, root: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.dcp, self.get_state_dict = dcp, get_state_dict
        self.root, self.model, self.opt, self.n, self.future = root, model, opt, 0, None

    def busy(self) -> bool:
        return self.future is not None and not self.future.done()

    def start(self) -> bool:
        if self.future is not None:
            self.future.result()
            shutil.rmtree(os.path.join(self.root, str(self.n - 1)), ignore_errors=True)
        msd, osd = self.get_state_dict(self.model, self.opt)
        self.future = self.dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(self.root, str(self.n)))
        self.n += 1
        return True

    def close(self) -> None:
        if self.future is not None:
            self.future.result()


WORKLOADS = {"compute": (1024, 12, 256, 1), "dispatch": (128, 96, 8, 3)}  # dim, layers, batch, steps factor


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    out: dict[str, Any] = {"machine": machine_info(), "threads": threads, "workloads": {}}
    for name in args.workloads.split(","):
        dim, layers, batch, factor = WORKLOADS[name]
        if args.quick:
            dim, layers = min(dim, 256), min(layers, 4)
        out["workloads"][name] = run_workload(args, dim, layers, batch, args.steps * factor)
    return out


def run_workload(args: argparse.Namespace, dim: int, layers: int, batch: int, steps: int) -> dict[str, Any]:
    model, opt, sched = build(dim, layers)
    step = make_step(model, opt, sched, dim, batch)
    for _ in range(3):
        step()  # warm-up, and AdamW's state exists
    state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched, "step": 0})
    state_bytes = sum(t.numel() * t.element_size() for t in tsckpt.torch.get_state_dict(model, opt)["model"].values())
    state_bytes += sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    root = tempfile.mkdtemp(prefix="bench_train_", dir=args.dir)
    chosen = args.savers.split(",")
    kinds = {"process": ("process", "blocking"), "thread": ("thread", "blocking"), "overlapped": ("process", "overlapped")}
    savers: dict[str, Any] = {
        f"tsckpt {name}": TsckptSaver(os.path.join(root, f"tsckpt-{name}"), state, *kinds[name])
        for name in kinds
        if name in chosen
    }
    for name, saver in savers.items():
        if "thread" not in name:
            saver.start()  # the writer process starts before the timed phases
            saver.close()
    try:
        if "dcp" in chosen:
            savers["dcp"] = DcpSaver(os.path.join(root, "dcp"), model, opt)
            savers["dcp"].start()
            savers["dcp"].close()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"dcp async_save unavailable here: {type(e).__name__}: {e}")
        savers.pop("dcp")
    phases: dict[str, dict[str, list[float]]] = {
        name: {"during": [], "idle": [], "blocked": [], "total": [], "first": []} for name in ["no save", *savers]
    }
    try:
        for _ in range(args.rounds):
            got = timed_steps(step, steps, lambda: False, lambda: False)
            phases["no save"]["idle"] += got["idle"]
            for name, saver in savers.items():
                got = timed_steps(step, steps, saver.busy, saver.start)
                saver.close()
                for k, v in got.items():
                    phases[name][k] += v
    finally:
        for saver in savers.values():
            getattr(saver, "finish", saver.close)()
        shutil.rmtree(root, ignore_errors=True)
    return {"dim": dim, "layers": layers, "batch": batch, "steps": steps, "state_bytes": state_bytes, "phases": phases}


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms" if xs else "-"


def _title(args: argparse.Namespace) -> str:
    return SECTION if "dcp" in args.savers.split(",") else STAGING_SECTION


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    lines = [
        _title(args),
        "",
        f"Measured {m['date'][:10]} by `benchmarks/bench_train.py` on {m['nproc']} CPUs ({m['cpu']}), "
        f"torch {m['torch']} with {results['threads']} thread(s); 1-minute load average {m['load_avg'][0]:.1f}. "
        f"{args.rounds} rounds per phase; medians.",
    ]
    for name, w in results["workloads"].items():
        phases = w["phases"]
        base = statistics.median(phases["no save"]["idle"])
        lines += [
            "",
            f"**{name}**: {w['layers']} Linear layers of {w['dim']} x {w['dim']}, AdamW, batch {w['batch']}; "
            f"state {w['state_bytes'] / MiB:.0f} MiB; {w['steps']} steps per phase and round.",
            "",
            "| phase | median step (save in flight) | steps | overhead | save call blocks | step after the call "
            "| save total |",
            "|---|---|---|---|---|---|---|",
            f"| no save | {_med(phases['no save']['idle'])} | {len(phases['no save']['idle'])} | - | - | - | - |",
        ]
        for saver in [n for n in phases if n != "no save"]:
            p = phases[saver]
            over = f"{(statistics.median(p['during']) / base - 1) * 100:+.1f}%" if p["during"] else "-"
            lines.append(
                f"| {saver} | {_med(p['during'])} | {len(p['during'])} | {over} | {_med(p['blocked'])} "
                f"| {_med(p['first'])} | {_med(p['total'])} |"
            )
        for saver in [name for name in phases if name.startswith("tsckpt")]:
            if phases[saver]["during"]:
                over = statistics.median(phases[saver]["during"]) / base - 1
                verdict = "met" if over <= 0.05 else "missed"
                lines += ["", f"Target for {saver} (at most +5% step time while a save runs): {verdict} ({over * 100:+.1f}%)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="compute,dispatch", help="comma-separated: compute, dispatch")
    ap.add_argument("--steps", type=int, default=30, help="steps per phase and round (dispatch: 3x)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--savers", default="process,thread,overlapped,dcp",
        help="comma-separated: process, thread (tsckpt's writers, blocking staging), overlapped (its staging), dcp"
    )
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the temp dir)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 10, 1
    finish(run(args), args, report, _title(args))


if __name__ == "__main__":
    main()
