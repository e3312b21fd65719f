#!/usr/bin/env python
"""Reading a bfloat16 array through zarr-python with tsckpt's data types, against TensorStore.

Workload
  A tsckpt checkpoint (plain layout, default chunking: 512 KiB inner chunks in one shard
  file) of a 64 MiB bfloat16 array [4096, 8192] and, as the baseline of a dtype
  zarr-python knows, a float16 array of the same shape and size. 8 MiB with --quick.

Systems (rotating within every round, one process)
  zarr-python   ``zarr.open_array(path, mode="r")[...]`` after ``tsckpt_zarr.register()``
  tensorstore   ``ts.open({"driver": "zarr3", ...}).result().read().result()``
  tsckpt        ``tsckpt.open(ckpt)[leaf][...]`` (its own shard reader)

Measures
  time of open + whole read, median over the rounds (min-max), warm page cache (the
  file was read just before) and cold (its pages evicted with posix_fadvise first).
  Every result is compared with the saved bytes.

Usage
  python benchmarks/bench_zarr_read.py --quick          # smoke run
  python benchmarks/bench_zarr_read.py --write-results  # rewrite the '## zarr-python reading bfloat16' section
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from _common import bench_parser, evict, finish, machine_info

SECTION = "## zarr-python reading bfloat16: tsckpt's data types against TensorStore"
MiB = 1 << 20


def readers(ckpt: str) -> dict[str, Callable[[str], Any]]:
    import tensorstore as ts
    import zarr

    import tsckpt
    import tsckpt_zarr

    tsckpt_zarr.register()

    def zarr_python(leaf: str) -> Any:
        return zarr.open_array(os.path.join(ckpt, leaf), mode="r")[...]

    def tensorstore(leaf: str) -> Any:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(ckpt, leaf) + "/"}}
        return ts.open(spec, read=True).result().read().result()

    def own(leaf: str) -> Any:
        return tsckpt.open(ckpt)[leaf][...]

    return {"zarr-python": zarr_python, "tensorstore": tensorstore, "tsckpt": own}


def run(args: Any) -> dict[str, Any]:
    import torch

    import tsckpt

    rows, cols = (1024, 4096) if args.quick else (4096, 8192)
    base = tempfile.mkdtemp(dir=args.dir)
    try:
        ckpt = os.path.join(base, "ck")
        g = torch.Generator().manual_seed(0)
        tree = {"bf16": torch.randn(rows, cols, generator=g).to(torch.bfloat16),
                "f16": torch.randn(rows, cols, generator=g).to(torch.float16)}
        tsckpt.save(ckpt, tree)
        want = {leaf: t.view(torch.int16).numpy().tobytes() for leaf, t in tree.items()}
        systems = readers(ckpt)
        times: dict[tuple[str, str, str], list[float]] = {}
        for r in range(args.repeats):
            names = list(systems)
            names = names[r % len(names):] + names[: r % len(names)]
            for leaf in tree:
                for cache in ("warm", "cold"):
                    for name in names:
                        path = os.path.join(ckpt, leaf)
                        if cache == "cold":
                            evict(path)
                        else:
                            systems["tensorstore"](leaf)  # pages in
                        t0 = time.perf_counter()
                        got = systems[name](leaf)
                        dt = time.perf_counter() - t0
                        if got.tobytes() != want[leaf]:
                            raise AssertionError(f"{name} read {leaf} to other bytes")
                        times.setdefault((leaf, cache, name), []).append(dt)
        return {"machine": machine_info(), "shape": [rows, cols], "repeats": args.repeats,
                "times": {"|".join(k): v for k, v in times.items()}}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(results: dict[str, Any], args: Any) -> str:
    import zarr

    m = results["machine"]
    rows, cols = results["shape"]
    mib = rows * cols * 2 / MiB
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_zarr_read.py --repeats {results['repeats']}{' --quick' if args.quick else ''}`"
        f": {m['date']}, {m['nproc']} CPUs ({m['cpu']}), load average "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])} at the start (2-CPU dev machine, loaded by parallel work), "
        f"zarr-python {zarr.__version__}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt_rev']}.",
        "",
        f"Open and read a whole [{rows}, {cols}] array ({mib:.0f} MiB) of a tsckpt checkpoint; median of "
        f"{results['repeats']} rotating rounds (min-max); every read compared with the saved bytes:",
        "",
        "| array | cache | system | time (ms) | min-max (ms) | vs TensorStore | MiB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    times = {tuple(k.split("|")): v for k, v in results["times"].items()}
    for (leaf, cache, name), v in times.items():
        med = statistics.median(v)
        ref = statistics.median(times[(leaf, cache, "tensorstore")])
        label = "bfloat16 (tsckpt's data type)" if leaf == "bf16" else "float16 (zarr-python's own)"
        lines.append(f"| {label} | {cache} | {name} | {med * 1e3:.1f} | {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} | "
                     f"{med / ref:.2f}x | {mib / med:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    warnings.simplefilter("ignore")
    p = bench_parser(__doc__, repeats=5)
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args()
    finish(run(args), args, report, SECTION)


if __name__ == "__main__":
    main()
