#!/usr/bin/env python
"""Orbax interop benchmark: restore a 1 GiB Orbax checkpoint into torch tensors.

Workload
  64 float32 arrays of 4096 x 1024 (1 GiB), written once by orbax-checkpoint's
  StandardCheckpointer from jax (its defaults: OCDBT, zarr3).

Systems (each restore in a fresh process, page cache dropped first when possible)
  orbax          Orbax's own restore: StandardCheckpointer().restore(dir, abstract
                 tree of jax.ShapeDtypeStruct) -> jax arrays, then torch tensors through
                 np.asarray + torch.from_numpy (zero-copy where jax allows)
  tsckpt         tsckpt.restore(dir, tree of torch.empty, inplace=True): reads straight
                 into preallocated torch tensors; jax and orbax are not imported
  tsckpt-numpy   tsckpt.restore(dir): no target, new numpy arrays

Measures
  time    wall time of the restore call (best of --repeats), and the ratio to orbax
  peak    peak RSS during the call above the RSS just before it (VmHWM after
          clear_refs); for tsckpt the 1 GiB of preallocated targets is in the baseline,
          for orbax and tsckpt-numpy the result arrays count as extra
  Values are checked against the saved ones after measuring.

Usage
  python benchmarks/bench_orbax.py --quick          # 64 MiB smoke run
  python benchmarks/bench_orbax.py --write-results  # full run, rewrite the '## Orbax interop' section
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from _common import bench_parser, drop_caches, machine_info, reset_peak, rss, run_child, write_section

SECTION = "## Orbax interop"
MiB = 1 << 20


def shapes(quick: bool) -> dict[str, tuple[int, int]]:
    rows = 256 if quick else 4096
    return {f"layer{i:02d}": (rows, 1024) for i in range(64)}


def value(i: int, shape: tuple[int, int]) -> Any:
    import numpy as np

    return (np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape) % 1000) * (i + 1)


def child_write(spec: dict[str, Any]) -> dict[str, Any]:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    tree = {k: jnp.asarray(value(i, s)) for i, (k, s) in enumerate(shapes(spec["quick"]).items())}
    ck = ocp.StandardCheckpointer()
    ck.save(spec["path"], tree)
    ck.wait_until_finished()
    return {}


def child_restore(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    sh = shapes(spec["quick"])
    system = spec["system"]
    if system == "orbax":
        import jax
        import orbax.checkpoint as ocp

        abstract = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in sh.items()}
        ck = ocp.StandardCheckpointer()
    else:
        import tsckpt

        target = {k: torch.empty(s) for k, s in sh.items()} if system == "tsckpt" else None
        if target is not None:
            for t in target.values():
                t.fill_(0)  # touched, so the baseline holds them
    dropped = drop_caches() if spec["drop"] else False
    base = rss("VmRSS:")
    reset_peak()
    start = time.perf_counter()
    if system == "orbax":
        restored = ck.restore(spec["path"], abstract)
        out = {k: torch.from_numpy(np.asarray(v)) for k, v in restored.items()}
    elif system == "tsckpt":
        out = tsckpt.restore(spec["path"], target, inplace=True)
    else:
        out = {k: torch.from_numpy(v) for k, v in tsckpt.restore(spec["path"]).items()}
    elapsed = time.perf_counter() - start
    peak = rss("VmHWM:") - base
    ok = all(np.array_equal(out[k].numpy(), value(i, s)) for i, (k, s) in enumerate(sh.items()))
    return {"time": elapsed, "peak_extra": peak, "ok": ok, "dropped": dropped}


def main() -> None:
    p = bench_parser(__doc__, repeats=3)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_write(spec) if spec["op"] == "write" else child_restore(spec)))
        return

    base = tempfile.mkdtemp(prefix="bench-orbax-", dir=args.dir)
    try:
        path = os.path.join(base, "ckpt")
        run_child(__file__, {"op": "write", "path": path, "quick": args.quick}, args.timeout)
        can_drop = drop_caches()
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in ("orbax", "tsckpt", "tsckpt-numpy")}
        for _ in range(args.repeats):
            for system in runs:
                spec = {"op": "restore", "system": system, "path": path, "quick": args.quick, "drop": can_drop}
                runs[system].append(run_child(__file__, spec, args.timeout))
                print(f"{system}: {runs[system][-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    nbytes = sum(r * c * 4 for r, c in shapes(args.quick).values())
    best = {s: min(r["time"] for r in rs) for s, rs in runs.items()}
    info = machine_info()
    lines = [
        SECTION,
        "",
        f"Restore of a {nbytes / MiB:.0f} MiB Orbax checkpoint (64 float32 arrays, StandardCheckpointer defaults) "
        f"into torch tensors; best of {args.repeats} runs, each in a fresh process, page cache "
        f"{'dropped before every restore' if can_drop else 'WARM (could not be dropped)'}. "
        f"{info['date']}, {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, "
        f"tensorstore {info['tensorstore']}, tsckpt {info['tsckpt_rev']}.",
        "",
        "| system | time (s) | vs orbax | GB/s | peak RSS above baseline (MiB) | values |",
        "|---|---|---|---|---|---|",
    ]
    for s, rs in runs.items():
        peak = max(r["peak_extra"] for r in rs) / MiB
        ok = "exact" if all(r["ok"] for r in rs) else "WRONG"
        lines.append(
            f"| {s} | {best[s]:.2f} | {best[s] / best['orbax']:.2f}x | {nbytes / best[s] / 1e9:.2f} | {peak:.0f} | {ok} |"
        )
    ratio = best["tsckpt"] / best["orbax"]
    lines += ["", f"Target: tsckpt within 1.2x of Orbax's own restore: {ratio:.2f}x, {'met' if ratio <= 1.2 else 'missed'}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
