#!/usr/bin/env python
"""How long a background save's call blocks the training loop, before and after a change, beside the peers.

The two workloads of ``bench_train.py`` (``dispatch``: 96 Linear 128 x 128, about 600
leaves, the case where per-leaf work dominates; ``compute``: 12 Linear 1024 x 1024), each
trained by AdamW with an LR scheduler. Each case runs in a fresh process: a few training
steps, then ``--saves`` saves, each followed by a training step (which an overlapped
staging may hold back) and waited for, so no save is in flight at the next call.

Reported per case: the median wall time of the call, the median CPU time the calling thread
spent in it (``time.thread_time``: less sensitive to other load on the machine than wall
time), the median time of the step right after the call (held-back optimizer steps
show there), and the peak resident memory (``VmHWM``) of the saver's processes (tsckpt's
writer, DCP's daemon) after the last save, summed, read from outside the process, so every
version and peer is measured alike. Cases:

  tsckpt               ``CheckpointManager.save_async`` of a ``tsckpt.torch.TrainState``, its
                       defaults (writer process, overlapped staging)
  tsckpt-before        the same with the tsckpt package of ``--before DIR`` (a directory holding
                       ``tsckpt/``, e.g. ``git archive <rev> tsckpt | tar -x -C DIR``)
  torch-checkpointing  its async ``CheckpointManager.save`` (bench_train.py's configuration)
  dcp-process          ``dcp.async_save`` in process mode (a 1-rank gloo group)
  plain copy           not a save: a copy of the state's tensors into buffers made beforehand
                       (the reference of issue 33's blocking targets)

Usage
  python benchmarks/bench_save_call.py --before /tmp/before           # all cases, both workloads
  python benchmarks/bench_save_call.py --cases tsckpt --workloads dispatch
  python benchmarks/bench_save_call.py --before /tmp/before --write-results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import finish, machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = {"dispatch": (128, 96, 8), "compute": (1024, 12, 256)}  # dim, layers, batch
CASES = ("tsckpt", "tsckpt-before", "torch-checkpointing", "dcp-process", "plain copy")
TITLE = "## save_async call time (issue 33): blocking per call, before and after"


def _case(case: str, workload: str, saves: int) -> dict[str, Any]:
    """Run one case in this process (a child of the driver) and return its medians."""
    import torch

    import bench_train as bt

    torch.set_num_threads(1)
    dim, layers, batch = WORKLOADS[workload]
    model, opt, sched = bt.build(dim, layers)
    step = bt.make_step(model, opt, sched, dim, batch)
    for _ in range(3):
        step(bt.contextlib.nullcontext)
    if case == "plain copy":
        tensors = [t for t in model.state_dict().values()] + [
            v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        return {"call": bt.plain_copy(tensors, saves), "cpu": None, "next_step": None, "helpers_peak": None}
    root = tempfile.mkdtemp(prefix="bench-call-")
    if case == "dcp-process":
        bt.init_group(root)
    import tsckpt.torch

    state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched, "step": 0})
    name = {"tsckpt": "overlapped", "tsckpt-before": "overlapped"}.get(case, case)
    saver = bt.make_saver(name, root, state, model, opt, sched)
    calls, cpus, nexts = [], [], []
    for n in range(saves + 1):
        w, c = time.perf_counter(), time.thread_time()
        fut = saver.call(n)
        w, c = time.perf_counter() - w, time.thread_time() - c
        t = time.perf_counter()
        step(saver.guard)
        t = time.perf_counter() - t
        fut.result()
        if n:  # the first starts the writer processes
            calls.append(w), cpus.append(c), nexts.append(t)
    helpers = _children_peak()
    saver.finish()
    shutil.rmtree(root, ignore_errors=True)  # every save's checkpoint: gigabytes over a run
    return {
        "call": statistics.median(calls), "cpu": statistics.median(cpus), "next_step": statistics.median(nexts),
        "helpers_peak": helpers,
    }


def _children_peak() -> int | None:
    """The peak resident memory (VmHWM) of this process's child processes alive now, summed
    (a saver's writer or daemon), in bytes; None where there are none."""
    import psutil

    peaks = []
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/status") as f:
                peaks.append(next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")))
        except (OSError, StopIteration):
            continue  # gone meanwhile, or a zombie
    return sum(peaks) if peaks else None


def _spawn(case: str, workload: str, saves: int, before: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if case == "tsckpt-before":
        if before is None:
            raise SystemExit("tsckpt-before needs --before DIR")
        env["PYTHONPATH"] = os.pathsep.join([before, HERE])
    else:
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE])
    out = subprocess.run(
        [sys.executable, __file__, "--child", case, "--workloads", workload, "--saves", str(saves)],
        env=env, capture_output=True, text=True, timeout=900,
        cwd=tempfile.gettempdir(),  # not a directory holding another tsckpt (a writer process imports from its cwd)
    )
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = [c for c in args.cases.split(",") if c != "tsckpt-before" or args.before]
    results: dict[str, Any] = {"machine": machine_info(), "saves": args.saves, "rounds": args.rounds, "rows": {}}
    for workload in args.workloads.split(","):
        for r in range(args.rounds):
            for case in cases[r % len(cases):] + cases[: r % len(cases)]:  # rotated by the round
                got = _spawn(case, workload, args.saves, args.before)
                results["rows"].setdefault(workload, {}).setdefault(case, []).append(got)
                print(workload, case, got, flush=True)
    return results


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    lines = [
        TITLE, "",
        f"Run {m['date']} by `python benchmarks/bench_save_call.py{' --before DIR' if args.before else ''} "
        f"--rounds {args.rounds} --saves {args.saves}`; {m['nproc']} CPUs ({m['cpu']}), tsckpt {m['tsckpt_rev']}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}. Medians over the rounds of each round's median (ms); each case a fresh process.",
        "",
        "| workload | case | call, wall | call, thread CPU | step after the call | saver processes' peak RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload, cases in results["rows"].items():
        for case, rounds in cases.items():
            ok = [r for r in rounds if "error" not in r]
            if not ok:
                lines.append(f"| {workload} | {case} | failed: {rounds[0]['error'][:80]} | | | |")
                continue

            def med(key: str) -> float | None:
                xs = [r[key] for r in ok if r.get(key) is not None]
                return statistics.median(xs) if xs else None

            peak = med("helpers_peak")
            lines.append(
                f"| {workload} | {case} | {_ms(med('call'))} | {_ms(med('cpu'))} | {_ms(med('next_step'))} "
                f"| {'-' if peak is None else f'{peak / (1 << 20):.0f}'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--workloads", default="dispatch,compute")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="a directory holding the tsckpt package to compare with")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    p.add_argument("--write-results", action="store_true")
    args = p.parse_args()
    if args.child:
        print(json.dumps(_case(args.child, args.workloads, args.saves)))
        return
    finish(run(args), args, report, TITLE)


if __name__ == "__main__":
    main()
