#!/usr/bin/env python
"""accelerate: tsckpt.integrations.accelerate's save_state / load_state against the Accelerator's own.

Workload
  A prepared model of bias-free float32 Linear layers (default 12 x 2048 x 2048, 50.3 M
  parameters, 192 MiB), AdamW after one step (384 MiB of state), an LR scheduler; one
  process on the CPU.

Systems (the same process, alternating, each round a fresh directory)
  accelerate  accelerator.save_state(dir) (safetensors weights, pickled optimizer and the rest)
              and accelerator.load_state(dir)
  tsckpt      save_state(accelerator, dir) and load_state(accelerator, dir)

Measures
  save   wall time of the save
  load   wall time of the load into the live objects, files in the page cache
  The loaded parameters are compared exactly with the saved ones after measuring.

Usage
  python benchmarks/bench_accelerate.py                  # about a minute
  python benchmarks/bench_accelerate.py --quick          # small smoke run
  python benchmarks/bench_accelerate.py --write-results  # also update its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from _common import framework_main, machine_info, make_resident, save_load_rows

SECTION = "## accelerate: save_state / load_state through tsckpt against the Accelerator's own"
MiB = 1 << 20


def run(args: argparse.Namespace) -> dict:
    import accelerate
    import torch

    from tsckpt.integrations.accelerate import load_state, save_state

    acc = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.backward(model(torch.randn(2, args.width)).square().mean())
    opt.step()
    sched.step()
    opt.zero_grad()
    saved = [p.detach().clone() for p in model.parameters()]
    nbytes = sum(t.numel() * t.element_size() for t in saved) * 3
    systems = {
        "accelerate": (lambda d: acc.save_state(d), lambda d: acc.load_state(d)),
        "tsckpt": (lambda d: save_state(acc, d), lambda d: load_state(acc, d)),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in systems}
    buf = bytearray(16 * MiB)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for r in range(args.rounds):
            for kind, (save, load) in systems.items():
                directory = os.path.join(root, f"{kind}-{r}")
                t0 = time.perf_counter()
                save(directory)
                times[kind]["save"].append(time.perf_counter() - t0)
                make_resident(directory, buf)
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                t0 = time.perf_counter()
                load(directory)
                times[kind]["load"].append(time.perf_counter() - t0)
                assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved, strict=True)), kind
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine_info(), "nbytes": nbytes, "times": times, "accelerate": accelerate.__version__}


def report(results: dict, args: argparse.Namespace) -> str:
    m = results["machine"]
    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in results["times"].items()}
    lines = [
        SECTION,
        "",
        f"Run {m['date']}. Machine: {m['nproc']} CPUs, {m['mem_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python "
        f"{m['python']}; torch {m['torch']}, tensorstore {m['tensorstore']}, accelerate {results['accelerate']}, "
        f"tsckpt {m['tsckpt']} ({m['tsckpt_rev']}). Load average at start: "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}. 2-CPU dev machine, loaded by parallel work: the times are "
        "indicative, the ratios between the two systems (measured alternately) more so.",
        "",
        f"Workload: a prepared model of {args.layers} bias-free float32 Linear layers of {args.width} x {args.width} "
        f"with AdamW after one step ({results['nbytes'] / MiB:,.0f} MiB of tensors) and an LR scheduler; one "
        f"process. Median of {args.rounds} rounds, local disk; loads from the page cache.",
        "",
        "| system | save (s) | load (s) | save + load (s) | save + load vs accelerate |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += save_load_rows(med, "accelerate")
    lines += [
        "",
        "accelerate: `accelerator.save_state` / `load_state` (safetensors for the weights, `torch.save` pickles "
        "for the optimizer, scheduler and RNG states); tsckpt: `tsckpt.integrations.accelerate.save_state` / "
        "`load_state` (one tsckpt checkpoint, files synced before the atomic commit, restored in place). "
        "Reproduce with `python benchmarks/bench_accelerate.py`.",
    ]
    return "\n".join(lines)


def main() -> None:
    framework_main(__doc__, run, report, SECTION)


if __name__ == "__main__":
    main()
