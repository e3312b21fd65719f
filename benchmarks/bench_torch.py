#!/usr/bin/env python
"""PyTorch bridge benchmark: peak memory of restoring a model and its optimizer.

Workload
  A stack of bias-free float32 Linear layers (default 12 x 2048 x 2048, 50.3 M
  parameters, 192 MiB) with AdamW state (exp_avg and exp_avg_sq: 384 MiB), saved
  once by each system after two training steps.

Systems (each restore in a fresh process; the model and optimizer are built first)
  tsckpt        tsckpt.torch.restore(dir, model, opt): reads into the live tensors
  dcp           torch.distributed.checkpoint: sd = get_state_dict(model, opt);
                dcp.load(sd, checkpoint_id=dir); set_state_dict(model, opt, sd)
  tsckpt-copy   tsckpt.restore(dir) (no target: the whole state as new numpy
                arrays) then tsckpt.torch.set_state_dict: the full extra copy the
                in-place path avoids, for reference

  Each runs with a live optimizer (state already created, as after a step) and a
  fresh one (never stepped: the restore creates its state, and torch's lazy
  initialisation, used by both systems, briefly allocates zero gradients).

Measures
  baseline   RSS once model and optimizer exist (VmRSS)
  peak       the process's peak RSS during the restore (VmHWM, reset just before
             the call by writing 5 to /proc/self/clear_refs)
  extra      peak - baseline, also as a multiple of the model + optimizer bytes
  time       wall time of the restore call
  Restored values are compared exactly with the saved ones after measuring.

Usage
  python benchmarks/bench_torch.py                  # full run (~1 min)
  python benchmarks/bench_torch.py --quick          # small smoke run
  python benchmarks/bench_torch.py --write-results  # also update the '## PyTorch bridge' section of RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import make_resident, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## PyTorch bridge"
MiB = 1 << 20
NOTE = (
    "Where tsckpt's extra memory comes from: its own reader reads inner chunks straight into the live tensors "
    "where a chunk's region is contiguous, and otherwise through scratch buffers of at most `max_inflight_bytes` "
    "(default `READ_WINDOW_BYTES`, 32 MiB: 8 reader threads of 4 MiB), so the memory added is about that window. "
    "Arrays it does not handle are decoded by TensorStore on several threads, whose glibc heaps keep what they "
    "freed until restore gives it back (`malloc_trim`) after each window and at the end. No copy of the state is "
    "made (compare tsckpt-copy). DCP reads one tensor's bytes at a time and copies them in, so it needs little "
    "extra; tsckpt's window is what lets it overlap reads, copies and checksums."
)


def build(layers: int, width: int, seed: int, stepped: bool):  # noqa: ANN201 - runs in the child
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    if stepped:
        for _ in range(2):
            model(torch.randn(4, width)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, opt


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import gc

    import torch

    torch.set_num_threads(1)
    system, directory = args.system, args.dir
    # both libraries imported before the baseline: their import cost is not the restore's
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import tsckpt.torch  # noqa: F401
    model, opt = build(args.layers, args.width, seed=1, stepped=args.live)
    if args.live:  # other values than the checkpoint's, so the check below means something
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    gc.collect()
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0, c0 = time.perf_counter(), sum(os.times()[:2])
    if system == "tsckpt":
        import tsckpt.torch

        tsckpt.torch.restore(directory, model, opt, rng=False)
    elif system == "tsckpt-copy":
        import tsckpt
        import tsckpt.torch

        tsckpt.torch.set_state_dict(model, opt, tsckpt.restore(directory))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    seconds, cpu = time.perf_counter() - t0, sum(os.times()[:2]) - c0
    peak = _status("VmHWM")
    ref_model, ref_opt = build(args.layers, args.width, seed=0, stepped=True)
    ok = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        s, r = opt.state[p], ref_opt.state[q]
        ok = ok and all(torch.equal(s[k], r[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    print(json.dumps({"baseline": baseline, "peak": peak, "seconds": seconds, "cpu": cpu, "state_bytes": state_bytes,
                      "ok": bool(ok)}))


def run_child(system: str, directory: str, live: bool, args: argparse.Namespace, malloc: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", system, "--dir", directory,
           "--layers", str(args.layers), "--width", str(args.width)] + (["--live"] if live else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if malloc:  # glibc: return every freed block of 1 MiB or more to the OS at once
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{system} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def save_checkpoints(args: argparse.Namespace, root: str) -> dict[str, str]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import tsckpt.torch

    torch.set_num_threads(1)  # as in the children, which rebuild this state bit for bit to check the restore
    model, opt = build(args.layers, args.width, seed=0, stepped=True)
    dirs = {"tsckpt": os.path.join(root, "tsckpt"), "dcp": os.path.join(root, "dcp")}
    tsckpt.torch.save(dirs["tsckpt"], model, opt, rng=False)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dirs["dcp"])
    return dirs


def machine() -> str:
    from importlib.metadata import version

    import torch

    import tsckpt

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    return (
        f"{os.cpu_count()} CPUs, {mem:.1f} GiB RAM, {platform.system()} {platform.release()}, Python "
        f"{platform.python_version()}; torch {torch.__version__}, tensorstore {version('tensorstore')}, "
        f"tsckpt {tsckpt.__version__} ({commit})"
    )


def rounds_table(rounds: list[dict]) -> list[str]:
    """The live restores timed round after round (--rounds): medians, and tsckpt / dcp per round."""
    if not rounds:
        return []
    by = {s: [r for r in rounds if r["system"] == s] for s in ("tsckpt", "dcp")}
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(by["tsckpt"], by["dcp"])]
    lines = [
        "",
        f"Time, live optimizer, default allocator, {len(ratios)} rounds (tsckpt and dcp each once a round, their order "
        "alternating; files read into the page cache right before each): medians.",
        "",
        "| system | time (s) | CPU (s) | tsckpt / dcp, median of the rounds |",
        "|---|---:|---:|---:|",
    ]
    for system, runs in by.items():
        ratio = f"{statistics.median(ratios):.2f}x" if system == "tsckpt" else "-"
        lines.append(f"| {system} | {statistics.median(r['seconds'] for r in runs):.3f} "
                     f"| {statistics.median(r['cpu'] for r in runs):.2f} | {ratio} |")
    return lines


def report(rows: list[dict], args: argparse.Namespace, scale: list[dict], rounds: list[dict] | None = None) -> str:
    n = args.layers * args.width * args.width
    state = rows[0]["state_bytes"]
    lines = [
        SECTION,
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Machine: {machine()}. Load average at start: "
        f"{', '.join(f'{x:.1f}' for x in args.load)}.",
        "",
        f"Workload: {args.layers} bias-free float32 Linear layers of {args.width} x {args.width} ({n / 1e6:.1f} M "
        f"parameters, {n * 4 / MiB:.0f} MiB) with AdamW state ({n * 8 / MiB:.0f} MiB); model + optimizer = "
        f"{state / MiB:.0f} MiB. Single process, local disk, checkpoint files read into the page cache before each "
        "restore (page cache is not RSS). Each restore runs in a fresh process after the model and optimizer are built. baseline = "
        "RSS before the call; peak = peak RSS during the call (VmHWM reset just before it); extra = peak - "
        "baseline. *live*: the optimizer already has state (as after a step); *fresh*: never stepped, so the "
        "restore creates its state (both systems use torch's lazy initialisation, which briefly allocates zero "
        "gradients of the model's size). Every restored parameter and optimizer tensor was checked equal to "
        "the saved one.",
        "",
        "| system | optimizer | allocator | baseline (MiB) | peak (MiB) | extra (MiB) | extra / (model + optimizer) | time (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        extra = r["peak"] - r["baseline"]
        lines.append(
            f"| {r['system']} | {'live' if r['live'] else 'fresh'} | {'mmap >= 1 MiB' if r['malloc'] else 'default'} "
            f"| {r['baseline'] / MiB:,.0f} | {r['peak'] / MiB:,.0f} "
            f"| {extra / MiB:,.0f} | {extra / state:.2f} | {r['seconds']:.2f} |"
        )
    small = {r["system"]: r for r in rows if r["live"] and not r["malloc"]}
    lines += rounds_table(rounds or [])
    lines += [
        "",
        f"Scaling, live optimizer, default allocator: the same with {scale[0]['layers']} layers (model + optimizer "
        f"{scale[0]['state_bytes'] / MiB:,.0f} MiB, 3x):",
        "",
        "| system | extra at 1x (MiB) | extra at 3x (MiB) | time at 3x (s) |",
        "|---|---:|---:|---:|",
    ]
    for r in scale:
        s = small[r["system"]]
        lines.append(
            f"| {r['system']} | {(s['peak'] - s['baseline']) / MiB:,.0f} | {(r['peak'] - r['baseline']) / MiB:,.0f} "
            f"| {r['seconds']:.2f} |"
        )
    lines += [
        "",
        "tsckpt: `tsckpt.torch.restore(dir, model, opt)`; dcp: `get_state_dict` + `dcp.load` + `set_state_dict` "
        "(torch.distributed.checkpoint, default FileSystemReader); tsckpt-copy: `tsckpt.restore(dir)` without a "
        "target, then `tsckpt.torch.set_state_dict`. allocator: *default* glibc malloc, or "
        "`MALLOC_MMAP_THRESHOLD_=1048576` (freed blocks of 1 MiB or more go back to the OS at once, so RSS shows "
        "what is live rather than what the allocator keeps). Reproduce with `python benchmarks/bench_torch.py`.",
        "",
        NOTE,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description="Peak memory of restoring a model and optimizer: tsckpt vs DCP")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="4 layers of 512")
    ap.add_argument("--write-results", action="store_true", help=f"replace the '{SECTION}' section of RESULTS.md")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds timing the live restores of tsckpt and dcp again, order alternating (default 5)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--live", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width = 4, 512
    if args.child:
        args.system = args.child
        child(args)
        return
    args.load = os.getloadavg()
    root = tempfile.mkdtemp(prefix="bench_torch_")
    try:
        dirs = save_checkpoints(args, root)
        rows = []
        runs = [(s, live, False) for live in (True, False) for s in ("tsckpt", "dcp", "tsckpt-copy")]
        runs += [("tsckpt", True, True), ("dcp", True, True)]
        buf = bytearray(64 * MiB)
        for system, live, malloc in runs:
            make_resident(dirs["dcp" if system == "dcp" else "tsckpt"], buf)  # tsckpt writes with direct I/O
            r = run_child(system, dirs["dcp" if system == "dcp" else "tsckpt"], live, args, malloc)
            if not r["ok"]:
                raise RuntimeError(f"{system}: restored values differ from the saved ones")
            rows.append({"system": system, "live": live, "malloc": malloc, **r})
            print(f"{system:12s} {'live' if live else 'fresh'}{' mmap' if malloc else ''}: baseline {r['baseline'] / MiB:7.0f} MiB  peak "
                  f"{r['peak'] / MiB:7.0f} MiB  extra {(r['peak'] - r['baseline']) / MiB:6.0f} MiB  {r['seconds']:.2f} s",
                  flush=True)
        rounds = []
        for rnd in range(args.rounds):
            for system in ("tsckpt", "dcp")[:: 1 if rnd % 2 == 0 else -1]:
                make_resident(dirs["dcp" if system == "dcp" else "tsckpt"], buf)
                r = run_child(system, dirs["dcp" if system == "dcp" else "tsckpt"], True, args)
                rounds.append({"system": system, "round": rnd, **r})
                print(f"{system:12s} live, round {rnd}: {r['seconds']:.3f} s, cpu {r['cpu']:.2f} s", flush=True)
        # three times the state: does the extra memory grow with it?
        big = argparse.Namespace(**{**vars(args), "layers": args.layers * 3})
        shutil.rmtree(root, ignore_errors=True)
        dirs = save_checkpoints(big, root)
        scale = []
        for system in ("tsckpt", "dcp"):
            make_resident(dirs["dcp" if system == "dcp" else "tsckpt"], buf)
            r = run_child(system, dirs["dcp" if system == "dcp" else "tsckpt"], True, big)
            if not r["ok"]:
                raise RuntimeError(f"{system}: restored values differ from the saved ones")
            scale.append({"system": system, "layers": big.layers, **r})
            print(f"{system:12s} x3: extra {(r['peak'] - r['baseline']) / MiB:6.0f} MiB  {r['seconds']:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    section = report(rows, args, scale, rounds)
    print()
    print(section)
    if args.write_results:
        write_section(SECTION, section)


if __name__ == "__main__":
    main()
