#!/usr/bin/env python
"""Hugging Face weights loaded into FSDP2 DTensors: tsckpt.restore against DCP's HuggingFaceStorageReader.

Workload
  A Llama-shaped model (embedding, N decoder layers of q/k/v/o and gate/up/down
  projections and two norms, a final norm; the head tied to the embedding, so left
  out of the files as transformers does) in bfloat16, written as a sharded Hugging
  Face directory (model-0000N-of-0000M.safetensors shards of at most 256 MiB and
  model.safetensors.index.json): about 1 GiB, 36 MiB with --quick.

  4 gloo ranks each build the model on the meta device, shard it with FSDP2
  (``fully_shard`` on every layer and the root, a 1-D CPU mesh, so every parameter
  is a Shard(0) DTensor), allocate their local shards (``to_empty``) and load the
  directory into ``model.state_dict()``:

    tsckpt  ``tsckpt.restore(dir, state_dict, inplace=True)``
    dcp     ``dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(dir))``

  Reported per system (one run of each per round, the systems alternating):

    load time     per rank from a barrier before the call to a barrier after it;
                  the table shows the maximum over ranks (median over rounds).
    peak RSS      VmHWM of each rank during the call, reset just before it (after
                  the imports and the process group, before the local shards are
                  touched); shown as the growth over the RSS before the model was
                  built (the local shards, 1/4 of the model, plus what the load
                  itself holds) and as the absolute peak. The maximum over ranks.
    read          bytes returned by read calls (/proc/self/io rchar) during the call,
                  summed over ranks. A mapped file's pages are not counted there.

Every rank is a fresh process; before the timed call each does one small load of a
tiny directory with the same system (imports inside the libraries excluded). The
files are in the page cache (written just before; the machine has room): a warm-cache
comparison of the two readers' work, not of the disk (written back with sync first). Loaded shards are compared with
the files' values after timing.

Targets: peak RSS growth per rank at most 1/4 of the model plus 64 MiB; tsckpt's load
time at most 0.7x DCP's.

Usage
  python benchmarks/bench_hf.py --quick              # small smoke run (~1 min)
  python benchmarks/bench_hf.py                      # about 1 GiB (a few minutes)
  python benchmarks/bench_hf.py --write-results      # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import finish, machine_info, proc_io, rank_entry, reset_peak, rss, run_ranks

SCRIPT = os.path.abspath(__file__)
SECTION = "## Hugging Face weights into FSDP2 DTensors"
MiB = 1 << 20
SYSTEMS = ("tsckpt", "dcp")
WORLD = 4
SHARD_BYTES = 256 * MiB
TARGET_TIME = 0.7
TARGET_RSS_SLACK = 64 * MiB


def shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the Llama-shaped model (bfloat16)."""
    hidden, inter, vocab, layers = (512, 1408, 8000, 4) if quick else (2048, 5632, 32000, 9)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{name}.weight"] = (hidden, hidden)
        out[p + "mlp.gate_proj.weight"] = (inter, hidden)
        out[p + "mlp.up_proj.weight"] = (inter, hidden)
        out[p + "mlp.down_proj.weight"] = (hidden, inter)
        out[p + "input_layernorm.weight"] = (hidden,)
        out[p + "post_attention_layernorm.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    return out


def value(name: str, shape: tuple[int, ...]) -> Any:
    """The tensor written for ``name``: a seeded random bfloat16 tensor."""
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def write_hf(directory: str, spec: dict[str, tuple[int, ...]], shard_bytes: int) -> int:
    """Write ``spec`` as a sharded Hugging Face directory; returns the bytes of tensor data."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = total = 0
    for name, shape in spec.items():
        n = 2 * int(__import__("math").prod(shape))
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size, total = size + n, total + n
    weight_map = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: value(n, spec[n]) for n in names}, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


# --------------------------------------------------------------------------
# rank side


def build(spec: dict[str, tuple[int, ...]], mesh: Any) -> Any:
    """The model on the meta device, FSDP2-sharded (every layer, then the root), its local
    shards allocated but not touched."""
    import torch
    from torch.distributed.fsdp import fully_shard

    root = torch.nn.Module()
    with torch.device("meta"):
        for name, shape in spec.items():
            *parents, leaf = name.split(".")
            mod = root
            for p in parents:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16)))
    for layer in root.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    return root.to_empty(device="cpu")


def load(system: str, directory: str, state: dict[str, Any]) -> None:
    if system == "tsckpt":
        import tsckpt

        tsckpt.restore(directory, state, inplace=True, progress=False)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        dcp.load(state, storage_reader=HuggingFaceStorageReader(directory))


def check(directory: str, state: dict[str, Any]) -> None:
    """Every local shard equals its region of the files."""
    import torch
    from safetensors import safe_open

    from tsckpt._leaves.dtensor import region

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for name, dt in state.items():
        offsets, lengths = region(name, dt)
        with safe_open(os.path.join(directory, weight_map[name]), "pt") as f:
            want = f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
        if not torch.equal(dt.to_local(), want):
            raise AssertionError(f"{name}: the loaded shard differs from the file")


def rank_main(job: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (imported before timing)
    from torch.distributed.device_mesh import init_device_mesh

    import tsckpt  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    system = job["system"]
    warm_spec = {k: tuple(v) for k, v in job["warm_spec"].items()}
    load(system, job["warm"], build(warm_spec, mesh).state_dict())
    base = rss()
    spec = {k: tuple(v) for k, v in job["spec"].items()}
    state = build(spec, mesh).state_dict()
    local = sum(t.to_local().nbytes for t in state.values())
    dist.barrier()
    reset_peak()
    io0 = proc_io()
    t0 = time.perf_counter()
    load(system, job["path"], state)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = rss("VmHWM:")
    io1 = proc_io()
    check(job["path"], state)
    return {"seconds": seconds, "peak": peak, "growth": peak - base, "base": base, "local": local,
            "rchar": io1["rchar"] - io0["rchar"]}


# --------------------------------------------------------------------------
# parent side


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="bench_hf-", dir=args.dir)
    try:
        spec = shapes(args.quick)
        warm_spec = {"model.embed_tokens.weight": (64, 32), "model.layers.0.mlp.up_proj.weight": (32, 32)}
        path, warm = os.path.join(base, "hf"), os.path.join(base, "warm")
        t0 = time.perf_counter()
        nbytes = write_hf(path, spec, SHARD_BYTES)
        write_hf(warm, warm_spec, SHARD_BYTES)
        os.sync()  # the files' dirty pages written back now, not during the first timed load
        files = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
        log(f"wrote {nbytes / MiB:.0f} MiB in {files} files ({time.perf_counter() - t0:.1f} s)")
        runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SYSTEMS}
        for rep in range(args.repeats):
            for system in (SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]):
                job = {"system": system, "path": path, "warm": warm, "spec": spec, "warm_spec": warm_spec}
                ranks = run_ranks(SCRIPT, job, WORLD, args.timeout)
                runs[system].append(ranks)
                log(f"round {rep + 1} {system}: {max(r['seconds'] for r in ranks):.2f} s, peak growth "
                    f"{max(r['growth'] for r in ranks) / MiB:.0f} MiB")
        return {"quick": args.quick, "nbytes": nbytes, "files": files, "leaves": len(spec), "runs": runs,
                "machine": machine_info()}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    runs, nbytes = results["runs"], results["nbytes"]
    m = results["machine"]
    size = f"{nbytes / MiB:.0f} MiB"
    lines = [
        SECTION,
        "",
        f"{time.strftime('%Y-%m-%d')}, `python benchmarks/bench_hf.py{' --quick' if results['quick'] else ''}`: "
        f"a Llama-shaped bfloat16 model of {size} ({results['leaves']} tensors, {results['files']} safetensors "
        f"files, head tied and left out) loaded into FSDP2 Shard(0) DTensors on {WORLD} gloo ranks, warm page "
        f"cache, {len(runs['tsckpt'])} round(s). Machine: {m.get('cpu', '?')}, {m.get('nproc', '?')} cores, torch {m.get('torch', '?')}.",
        "",
        "| system | load time (max over ranks, median) | peak RSS growth per rank (max) | peak RSS per rank (max) "
        "| bytes read (all ranks) |",
        "|---|---|---|---|---|",
    ]
    med: dict[str, float] = {}
    growth: dict[str, int] = {}
    for system in SYSTEMS:
        times = [max(r["seconds"] for r in ranks) for ranks in runs[system]]
        med[system] = statistics.median(times)
        growth[system] = max(r["growth"] for ranks in runs[system] for r in ranks)
        peak = max(r["peak"] for ranks in runs[system] for r in ranks)
        read = statistics.median(sum(r["rchar"] for r in ranks) for ranks in runs[system])
        lines.append(f"| {system} | {med[system]:.2f} s | {growth[system] / MiB:.0f} MiB | {peak / MiB:.0f} MiB "
                     f"| {read / MiB:.0f} MiB |")
    local = max(r["local"] for ranks in runs["tsckpt"] for r in ranks)
    limit = local + TARGET_RSS_SLACK
    ratio = med["tsckpt"] / med["dcp"]
    lines += [
        "",
        f"- time: tsckpt / DCP = {ratio:.2f} (target at most {TARGET_TIME}): "
        f"{'met' if ratio <= TARGET_TIME else 'missed'}.",
        f"- memory: a rank's local shards are {local / MiB:.0f} MiB; the target is growth at most that plus 64 MiB "
        f"= {limit / MiB:.0f} MiB: tsckpt {growth['tsckpt'] / MiB:.0f} MiB "
        f"({'met' if growth['tsckpt'] <= limit else 'missed'}), DCP {growth['dcp'] / MiB:.0f} MiB.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 36 MiB model: a smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 3, 1 with --quick)")
    ap.add_argument("--dir", default=None, help="where to write the directory (default: the temporary directory)")
    ap.add_argument("--json", default=None, help="write raw measurements here")
    ap.add_argument("--write-results", action="store_true", help=f"replace the '{SECTION}' section of RESULTS.md")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per multi-rank load")
    ap.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_job is not None:
        rank_entry(rank_main, json.loads(args.rank_job))
        return
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    finish(run(args), args, report, SECTION)


if __name__ == "__main__":
    main()
