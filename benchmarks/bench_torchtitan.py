#!/usr/bin/env python
"""torchtitan checkpoints: TsckptCheckpointManager against torchtitan's own (DCP) CheckpointManager.

Workload
  What torchtitan's trainer hands its checkpoint manager: a model part of bias-free
  float32 Linear layers (default 12 x 2048 x 2048, 50.3 M parameters, 192 MiB) through
  ModelWrapper, an OptimizersContainer of AdamW after one step (384 MiB of state), an
  LRSchedulersContainer and the trainer's counters. One process (a gloo group of one).

Systems (the same process, alternating, each round a fresh folder)
  dcp      torchtitan.components.checkpointer.CheckpointManager (torch.distributed.checkpoint,
           synchronous): save(step), then a new manager's load(step)
  tsckpt   tsckpt.integrations.torchtitan.TsckptCheckpointManager (synchronous): the same calls

Measures
  save   wall time of manager.save(step) (a full checkpoint: model, optimizer, scheduler, counters)
  load   wall time of a new manager's load(step) into the live objects, files in the page cache
  The loaded parameters are compared exactly with the saved ones after measuring.

Usage
  python benchmarks/bench_torchtitan.py                  # about a minute
  python benchmarks/bench_torchtitan.py --quick          # small smoke run
  python benchmarks/bench_torchtitan.py --write-results  # also update its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from _common import framework_main, machine_info, make_resident, save_load_rows

SECTION = "## torchtitan: TsckptCheckpointManager against torchtitan's DCP CheckpointManager"
MiB = 1 << 20


class Counters:
    """The trainer's own state (torchtitan's Trainer.state_dict)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 1, 4096

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(args: argparse.Namespace):  # noqa: ANN201
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})
    opts = OptimizersContainer.Config(param_groups=[group], implementation="foreach").build(model_parts=[model])
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=10)
    model(torch.randn(2, args.width)).square().mean().backward()
    opts.step()
    scheds.step()
    opts.zero_grad()
    return model, opts, scheds


def manager(kind: str, folder: str, model, opts, scheds):  # noqa: ANN001, ANN201
    from torchtitan.components.checkpointer import CheckpointManager

    from tsckpt.integrations.torchtitan import TsckptCheckpointManager

    cls = TsckptCheckpointManager if kind == "tsckpt" else CheckpointManager
    config = cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, last_save_model_only=False)
    return config.build(
        dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
        states={"train_state": Counters()}, sd_adapter=None,
    )


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, opts, scheds = build(args)
    saved = [p.detach().clone() for p in model.parameters()]
    nbytes = sum(t.numel() * t.element_size() for t in saved) * 3  # parameters, exp_avg, exp_avg_sq
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in ("dcp", "tsckpt")}
    buf = bytearray(16 * MiB)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for r in range(args.rounds):
            for kind in ("dcp", "tsckpt"):
                folder = os.path.join(root, f"{kind}-{r}")
                m = manager(kind, folder, model, opts, scheds)
                t0 = time.perf_counter()
                m.save(5)
                times[kind]["save"].append(time.perf_counter() - t0)
                m.close()
                make_resident(folder, buf)
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                m = manager(kind, folder, model, opts, scheds)
                t0 = time.perf_counter()
                m.load(step=5)
                times[kind]["load"].append(time.perf_counter() - t0)
                m.close()
                assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved, strict=True)), kind
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    return {"machine": machine_info(), "nbytes": nbytes, "times": times}


def report(results: dict, args: argparse.Namespace) -> str:
    m = results["machine"]
    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in results["times"].items()}
    lines = [
        SECTION,
        "",
        f"Run {m['date']}. Machine: {m['nproc']} CPUs, {m['mem_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python "
        f"{m['python']}; torch {m['torch']}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt']} ({m['tsckpt_rev']}). "
        f"Load average at start: {', '.join(f'{x:.1f}' for x in m['load_avg'])}. 2-CPU dev machine, loaded by parallel "
        "work: the times are indicative, the ratios between the two systems (measured alternately) more so.",
        "",
        f"Workload: torchtitan's trainer state for {args.layers} bias-free float32 Linear layers of {args.width} x "
        f"{args.width} with AdamW after one step ({results['nbytes'] / MiB:,.0f} MiB of tensors), its LR schedulers "
        f"and counters; one process. Median of {args.rounds} rounds, local disk; loads from the page cache.",
        "",
        "| system | save (s) | load (s) | save + load (s) | save + load vs dcp |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += save_load_rows(med, "dcp")
    lines += [
        "",
        "dcp: torchtitan's `CheckpointManager` (`async_mode=\"disabled\"`: `dcp.save` / `dcp.load`); tsckpt: "
        "`TsckptCheckpointManager` (a `tsckpt.CheckpointManager` step, files synced before the atomic commit; the "
        "load checks the states' leaves against the checkpoint's, then restores in place). Reproduce with "
        "`python benchmarks/bench_torchtitan.py`.",
    ]
    return "\n".join(lines)


def main() -> None:
    framework_main(__doc__, run, report, SECTION)


if __name__ == "__main__":
    main()
