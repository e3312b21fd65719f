#!/usr/bin/env python
"""A Flax checkpoint into an FSDP2 torch model: tsckpt's mapping against the usual workaround.

Workload
  An MLP of ``--layers`` Linear(H, H) layers (float32) saved as Flax lays it out
  (``l{i}/kernel`` of shape (in, out), ``l{i}/bias``), and the same weights as a torch
  state dict (``l{i}.weight`` of shape (out, in)). 2 gloo ranks restore them into the
  model sharded by FSDP2 (``fully_shard``: each weight Shard(0), rows), in place.

Systems, each in fresh rank processes:

  mapping          tsckpt.restore(flax checkpoint, model.state_dict(), inplace=True,
                   mapping=tsckpt.mappings.flax_to_torch()): each rank reads the column
                   block of each kernel its rows need, into a transposed view of its shard.
  transposed copy  what a user writes without a mapping: restore each kernel into a
                   temporary Shard(1) DTensor of the kernel's layout (the rank's columns),
                   then copy it transposed into the parameter's shard.
  untransformed    the torch-layout checkpoint restored with no transform at all (the floor).

Measured per rank, from a barrier before the call to a barrier after it (the table shows
the maximum over ranks): time, and peak extra RSS (VmHWM after the call, reset before it,
minus the RSS before it). Each rank first restores once untimed with the same system (the
libraries' one-time costs: imports, tsckpt's gloo side group, thread pools), so the page
cache is warm for every system. The restored parameters are checked against the saved
weights after timing.

Usage
  python benchmarks/bench_mapping.py --quick          # small smoke run
  python benchmarks/bench_mapping.py                  # 8 layers of 2048 x 2048 (128 MiB)
  python benchmarks/bench_mapping.py --write-results  # also update benchmarks/RESULTS.md
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from _common import bench_parser, finish, machine_info, rank_entry, reset_peak, rss, run_ranks

SCRIPT = os.path.abspath(__file__)
TITLE = "## Flax checkpoint into an FSDP2 model: mapping vs transposed copy (bench_mapping.py)"
SYSTEMS = ("mapping", "transposed copy", "untransformed")
WORLD = 2


def _model(layers: int, hidden: int) -> Any:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(layers):
                setattr(self, f"l{i}", torch.nn.Linear(hidden, hidden))

    return MLP()


def _restore(job: dict[str, Any], model: Any, mesh: Any) -> None:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import tsckpt

    if job["system"] == "mapping":
        tsckpt.restore(job["flax"], model.state_dict(), inplace=True, mapping=tsckpt.mappings.flax_to_torch())
    elif job["system"] == "untransformed":
        tsckpt.restore(job["torch"], model.state_dict(), inplace=True)
    else:
        sd = model.state_dict()
        target: dict[str, Any] = {}
        for i in range(job["layers"]):
            w = sd[f"l{i}.weight"]
            local = torch.empty(w.shape[1], w.to_local().shape[0])  # the kernel's columns of this rank's rows
            kernel = DTensor.from_local(local, mesh, [Shard(1)], shape=(w.shape[1], w.shape[0]),
                                        stride=(w.shape[0], 1), run_check=False)
            target[f"l{i}"] = {"kernel": kernel, "bias": sd[f"l{i}.bias"]}
        tsckpt.restore(job["flax"], target, inplace=True)
        with torch.no_grad():
            for i in range(job["layers"]):
                sd[f"l{i}.weight"].to_local().copy_(target[f"l{i}"]["kernel"].to_local().T)


def rank_main(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(job["layers"], job["hidden"])
    fully_shard(model, mesh=mesh)
    _restore(job, model, mesh)  # untimed: one-time costs, page cache warm
    dist.barrier()
    before = rss()
    reset_peak()
    t0 = time.perf_counter()
    _restore(job, model, mesh)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = rss("VmHWM:") - before
    want = np.load(job["check"])
    got = model.state_dict()["l0.weight"].full_tensor().numpy()
    if not np.array_equal(got, want):
        raise AssertionError(f"{job['system']}: l0.weight differs after the restore")
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {"seconds": seconds, "peak_extra": peak, "shard_bytes": shard}


def report(results: dict[str, Any], args: Any) -> str:
    info = results["machine"]
    mib = 1 << 20
    lines = [
        TITLE,
        "",
        f"{results['layers']} Linear({results['hidden']}, {results['hidden']}) layers, float32 "
        f"({results['total_bytes'] / mib:.0f} MiB of parameters), {WORLD} gloo ranks, FSDP2 Shard(0); "
        f"{info['date']}, {info['nproc']} CPUs, torch {info['torch']}, tsckpt {info['tsckpt_rev']}. "
        "2-CPU dev machine, loaded by parallel work: times are indicative only.",
        "",
        "| system | time (s, max over ranks) | peak extra RSS per rank (MiB, max) | the rank's own shard (MiB) |",
        "| --- | --- | --- | --- |",
    ]
    for system in SYSTEMS:
        r = results["systems"][system]
        lines.append(
            f"| {system} | {r['seconds']:.2f} | {r['peak_extra'] / mib:.0f} | {r['shard_bytes'] / mib:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_parser(__doc__, repeats=1)
    p.add_argument("--rank-job", default=None, help=argparse_suppress())
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    args = p.parse_args()
    if args.rank_job:
        rank_entry(rank_main, json.loads(args.rank_job))
        return
    import numpy as np

    import tsckpt

    layers = args.layers or (4 if args.quick else 8)
    hidden = args.hidden or (512 if args.quick else 2048)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        rng = np.random.default_rng(0)
        kernels = [rng.standard_normal((hidden, hidden), dtype=np.float32) for _ in range(layers)]
        biases = [rng.standard_normal(hidden, dtype=np.float32) for _ in range(layers)]
        flax, torch_dir = os.path.join(root, "flax"), os.path.join(root, "torch")
        tsckpt.save(flax, {f"l{i}": {"kernel": k, "bias": b} for i, (k, b) in enumerate(zip(kernels, biases))})
        tsckpt.save(torch_dir, {f"l{i}.weight": np.ascontiguousarray(k.T) for i, k in enumerate(kernels)}
                    | {f"l{i}.bias": b for i, b in enumerate(biases)})
        check = os.path.join(root, "l0.npy")
        np.save(check, kernels[0].T)
        results: dict[str, Any] = {"layers": layers, "hidden": hidden, "machine": machine_info(),
                                   "total_bytes": layers * (hidden * hidden + hidden) * 4, "systems": {}}
        for system in SYSTEMS:
            job = {"system": system, "flax": flax, "torch": torch_dir, "check": check, "layers": layers, "hidden": hidden}
            ranks = run_ranks(SCRIPT, job, WORLD, args.timeout)
            results["systems"][system] = {k: max(r[k] for r in ranks) for k in ("seconds", "peak_extra", "shard_bytes")}
            print(system, results["systems"][system], file=sys.stderr)
        finish(results, args, report, TITLE)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
