#!/usr/bin/env python
"""DCP storage: ``dcp.save`` / ``dcp.load`` of a model and its AdamW state with DCP's
``FileSystemWriter`` / ``FileSystemReader`` against tsckpt's ``StorageWriter`` /
``StorageReader``, in the same rounds.

Workload: bias-free float32 Linear layers of 1024 x 1024 (``--layers``, default 16:
64 MiB of parameters, 128 MiB of AdamW state), the state dict of
``torch.distributed.checkpoint.state_dict.get_state_dict``, one process, local disk.
Each round saves with every writer (tsckpt's in both layouts) into new directories (order alternating by round),
then loads each checkpoint into the live model and optimizer with its reader (the files
just written, so in the page cache) and checks every tensor equal. Times are wall
seconds of the ``dcp.save`` / ``dcp.load`` call alone (planning included); DCP's
``FileSystemWriter`` syncs its files (``sync_files=True``), tsckpt syncs before its commit.

Usage
  python benchmarks/bench_dcp_storage.py                   # 5 rounds
  python benchmarks/bench_dcp_storage.py --write-results   # and rewrite its section of RESULTS.md
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import bench_parser, finish, machine_info  # noqa: E402

TITLE = "## DCP storage: dcp.save / dcp.load through tsckpt against FileSystemWriter / Reader"
SYSTEMS = ("dcp FileSystem", "tsckpt Storage", "tsckpt Storage compact")


def run(args: Any) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import tsckpt.torch

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    machine = machine_info()  # and the load average at the start
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 1}
    want = {k: v.clone() for k, v in msd.items()}
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())

    def writer(name: str, d: str) -> Any:
        if name == "dcp FileSystem":
            return dcp.FileSystemWriter(d)
        return tsckpt.torch.StorageWriter(d, layout="compact" if name.endswith("compact") else "plain")

    def reader(name: str, d: str) -> Any:
        return dcp.FileSystemReader(d) if name == "dcp FileSystem" else tsckpt.torch.StorageReader(d)

    times: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": []} for s in SYSTEMS}
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for r in range(args.repeats):
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            for name in order:
                d = os.path.join(root, f"{r}-{name.replace(' ', '-')}")
                os.sync()
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=writer(name, d))
                times[name]["save"].append(time.perf_counter() - t0)
            for name in order:
                d = os.path.join(root, f"{r}-{name.replace(' ', '-')}")
                with torch.no_grad():
                    for v in msd.values():
                        v.zero_()
                t0 = time.perf_counter()
                dcp.load(state, storage_reader=reader(name, d))
                times[name]["load"].append(time.perf_counter() - t0)
                if not all(torch.equal(msd[k], v) for k, v in want.items()):
                    raise AssertionError(f"{name}: loaded parameters differ from the saved ones")
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine, "layers": args.layers, "nbytes": nbytes, "times": times,
            "load": os.getloadavg()}


def report(results: dict[str, Any], args: Any) -> str:
    m = results["machine"]
    mib = results["nbytes"] / 2**20
    lines = [
        TITLE,
        "",
        f"Run {m['date']}. Machine: {m['nproc']} CPUs, {m['mem_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python "
        f"{m['python']}; torch {m['torch']}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt']} ({m['tsckpt_rev']}). "
        "2-CPU dev machine, loaded by parallel work (load average at start: "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}; at the end: {', '.join(f'{x:.1f}' for x in results['load'])}).",
        "",
        f"Workload: {results['layers']} bias-free float32 Linear layers of 1024 x 1024 and their AdamW state "
        f"({mib:,.0f} MiB of tensors), `get_state_dict`, one process, local disk; loads into the live model and "
        f"optimizer from the page cache. Median of {args.repeats} rounds (wall seconds of the call).",
        "",
        "| storage | save (s) | load (s) | save MiB/s | load MiB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    med = {s: {k: statistics.median(v) for k, v in results["times"][s].items()} for s in SYSTEMS}
    for s in SYSTEMS:
        lines.append(
            f"| {s} | {med[s]['save']:.3f} | {med[s]['load']:.3f} | {mib / med[s]['save']:,.0f} | {mib / med[s]['load']:,.0f} |"
        )
    f = med["dcp FileSystem"]
    ratios = "; ".join(
        f"{s}: save {med[s]['save'] / f['save']:.2f}x, load {med[s]['load'] / f['load']:.2f}x" for s in SYSTEMS[1:]
    )
    lines += [
        "",
        f"Time over DCP's own storage: {ratios}. Layouts: plain, files per array (zarr tools read it); "
        "compact, one OCDBT database per writing rank. Reproduce with `python benchmarks/bench_dcp_storage.py`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_parser(__doc__, repeats=5)
    p.add_argument("--layers", type=int, default=16, help="Linear layers of 1024 x 1024")
    p.add_argument("--json", default=None, help="keep the raw results here")
    args = p.parse_args()
    if args.quick:
        args.layers, args.repeats = 4, 2
    finish(run(args), args, report, TITLE)


if __name__ == "__main__":
    main()
