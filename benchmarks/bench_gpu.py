#!/usr/bin/env python
"""GPU benchmark: saving from and restoring into CUDA tensors, against a plain pinned copy and DCP.

Workload: ``--gib`` GiB (default 4) of bfloat16 CUDA tensors in ``--tensors`` equal
tensors (default 32), random bits, saved to a local directory (``--root``, default the
system's temporary directory).

Measured, in one process, in rounds (round 0 a warm-up, then ``--repeats`` rounds; the
order of tsckpt and DCP alternates between rounds):

  pinned copy     copying every tensor into preallocated page-locked host buffers
                  (copy_(non_blocking=True), then one synchronize): the floor for any
                  save that snapshots GPU state to the host
  async blocked   tsckpt.save_async, from call to return (the time training stops);
                  the first call page-locks its staging slab, later calls reuse it
                  ("steady"). Target (issue): steady <= 1.3x pinned copy.
  save            tsckpt.save and torch.distributed.checkpoint's dcp.save of the same
                  state, from call to return (both sync their files)
  restore         tsckpt.restore(dir, target, inplace=True) and dcp.load(target) into
                  CUDA tensors of the state's shapes, from call to return after a
                  torch.cuda.synchronize(); the files were just written, so they come
                  from the page cache for both. Every restore is checked bit-exact.
                  Target (issue): tsckpt <= 0.7x DCP, save and restore.

Without CUDA the script says so and exits with status 0.

Usage
  python benchmarks/bench_gpu.py                    # 4 GiB, 3 rounds
  python benchmarks/bench_gpu.py --gib 8 --repeats 5
  python benchmarks/bench_gpu.py --quick            # 256 MiB smoke run
  python benchmarks/bench_gpu.py --write-results    # also update benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from _common import finish, machine_info

SECTION = "## GPU save and restore"
MiB, GiB = 1 << 20, 1 << 30


def shapes_for(total: int, count: int, itemsize: int, width: int = 4096) -> list[tuple[int, int]]:
    """``count`` 2-D shapes of ``width`` columns holding ``total`` bytes of ``itemsize`` in all
    (each rounded down to whole rows, at least one)."""
    rows = max(1, total // (count * width * itemsize))
    return [(rows, width)] * count


def spread(values: list[float]) -> str:
    """Median and range of timings, in seconds."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def ratio(a: list[float], b: list[float]) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "-"


def make_state(shapes: list[tuple[int, int]]) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for i, shape in enumerate(shapes):
        bits = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device="cuda", generator=g)
        state[f"layers/{i}/weight"] = bits.view(torch.bfloat16)
    return state


def timed(fn: Callable[[], Any]) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import tsckpt

    shapes = shapes_for(int(args.gib * GiB), args.tensors, 2)
    state = make_state(shapes)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in state.items()}
    targets = {k: torch.empty_like(t) for k, t in state.items()}
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(shapes), "shape": list(shapes[0]), "rounds": args.repeats}
    times: dict[str, list[float]] = {k: [] for k in ("pinned", "async_first", "async", "async_total", "tsckpt_save",
                                                      "dcp_save", "tsckpt_restore", "dcp_restore")}
    root = tempfile.mkdtemp(prefix="bench_gpu_", dir=args.root)
    try:
        for rnd in range(args.repeats + 1):
            keep = rnd > 0

            def copy() -> None:
                for k, t in state.items():
                    pinned[k].copy_(t, non_blocking=True)

            t = timed(copy)
            if keep:
                times["pinned"].append(t)
            d = os.path.join(root, f"async{rnd}")
            t0 = time.perf_counter()
            handle = tsckpt.save_async(d, state)
            blocked = time.perf_counter() - t0
            handle.result()
            total = time.perf_counter() - t0
            if rnd == 0:
                times["async_first"].append(blocked)
            else:
                times["async"].append(blocked)
                times["async_total"].append(total)
            shutil.rmtree(d)
            order = ["tsckpt", "dcp"] if rnd % 2 else ["dcp", "tsckpt"]
            for system in order:
                d = os.path.join(root, f"{system}{rnd}")
                if system == "tsckpt":
                    t = timed(lambda d=d: tsckpt.save(d, state))
                else:
                    t = timed(lambda d=d: dcp.save(state, checkpoint_id=d))
                if keep:
                    times[f"{system}_save"].append(t)
                for v in targets.values():
                    v.zero_()
                if system == "tsckpt":
                    t = timed(lambda d=d: tsckpt.restore(d, targets, inplace=True))
                else:
                    t = timed(lambda d=d: dcp.load(targets, checkpoint_id=d))
                if not same(targets, state):
                    raise SystemExit(f"{system} restored different bytes")
                if keep:
                    times[f"{system}_restore"].append(t)
                shutil.rmtree(d)
            print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items() if v), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["times"] = times
    props = torch.cuda.get_device_properties(0)
    out["device"] = f"{props.name}, {props.total_memory / GiB:.0f} GiB, CUDA {torch.version.cuda}"
    return out


def report(r: dict[str, Any], args: argparse.Namespace) -> str:
    m, t = r["machine"], r["times"]
    gib = r["bytes"] / GiB
    rate = lambda v: f"{gib / statistics.median(v):.2f}" if v else "-"  # noqa: E731
    rows = [
        ("pinned copy (device to page-locked host)", t["pinned"], ""),
        ("tsckpt.save_async blocked, first call", t["async_first"], ""),
        ("tsckpt.save_async blocked, steady", t["async"], f"{ratio(t['async'], t['pinned'])} of pinned copy (target <= 1.3x)"),
        ("tsckpt.save_async until committed", t["async_total"], ""),
        ("tsckpt.save", t["tsckpt_save"], f"{ratio(t['tsckpt_save'], t['dcp_save'])} of DCP (target <= 0.7x)"),
        ("dcp.save", t["dcp_save"], ""),
        ("tsckpt.restore into CUDA, in place", t["tsckpt_restore"],
         f"{ratio(t['tsckpt_restore'], t['dcp_restore'])} of DCP (target <= 0.7x)"),
        ("dcp.load into CUDA", t["dcp_restore"], ""),
    ]
    lines = [
        SECTION,
        "",
        f"Run {m['date']} on {r['device']}; host: {m['cpu']}, {m['nproc']} CPUs, {m['mem_gib']:.0f} GiB; torch "
        f"{m['torch']}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt']} ({m['tsckpt_rev']}).",
        "",
        f"Workload: {r['tensors']} bfloat16 CUDA tensors of {r['shape'][0]} x {r['shape'][1]} ({gib:.2f} GiB), "
        "random bits, local disk. Median (range) of "
        f"{r['rounds']} rounds after a warm-up round; restores read files just written (page cache) and are "
        "checked bit-exact. See benchmarks/bench_gpu.py for what each row times.",
        "",
        "| what | seconds | GiB/s | compared |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {name} | {spread(v)} | {rate(v)} | {cmp} |" for name, v, cmp in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description="save/restore of CUDA tensors: tsckpt vs a pinned copy and DCP")
    ap.add_argument("--gib", type=float, default=4.0, help="state size in GiB (default 4)")
    ap.add_argument("--tensors", type=int, default=32, help="number of tensors (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    ap.add_argument("--root", default=None, help="directory for the checkpoints (default: the temporary directory)")
    ap.add_argument("--quick", action="store_true", help="256 MiB, 1 round")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--write-results", action="store_true", help=f"replace the '{SECTION}' section of RESULTS.md")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.repeats = 0.25, 1
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    results = run(args)
    results["machine"] = machine_info()
    finish(results, args, report, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
