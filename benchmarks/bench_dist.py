#!/usr/bin/env python
"""Distributed save/restore benchmark: tsckpt against torch.distributed.checkpoint (DCP).

Workload
  8 float32 tensors of 8192 x 1024 (32 MiB each, 256 MiB in all) as DTensors on a
  1-D CPU mesh. 4 gloo ranks save them sharded Shard(0) (rows); 2 gloo ranks then
  restore them in place into Shard(1) (column) DTensors, so every restoring rank
  needs half of every saved shard.

For each system (tsckpt.save / tsckpt.restore(inplace=True) and dcp.save /
dcp.load with the default FileSystemWriter / FileSystemReader):

  save time     per rank from a barrier before the call to a barrier after it;
                the table shows the maximum over ranks.
  restore time  the same, on the 2 restoring ranks.
  read amp.     bytes read from storage during restore, summed over ranks, divided
                by the bytes of the target's local shards summed over ranks (1.0 =
                nothing read that was not needed). Bytes read come from /proc/self/io
                deltas around the restore call in each rank: rchar (bytes returned
                by read syscalls, whatever served them) and read_bytes (bytes fetched
                from the block device, including readahead). For tsckpt the bytes the
                chunk layout implies (inner chunks overlapping each local shard, shard
                indexes, zarr.json nodes) are computed from the saved metadata too.

Every rank is a fresh process (torch, tsckpt, DCP imported before timing). Before
the timed call each process does one small save (or restore) with the same system,
so one-time costs (imports inside the libraries, tsckpt's gloo side group,
thread pools) are excluded, as in a training job that checkpoints repeatedly.
Before every save and between save and restore, dirty pages are synced and, when
the process may write /proc/sys/vm/drop_caches (root), the page cache is dropped,
so restores read from storage; otherwise restores are reported as warm-cache.
Restored shards are compared exactly with the saved values after timing.

A second part, in one process and without any I/O, measures tsckpt's planning for
1,000 leaves across 64 simulated ranks: the size of the descriptors every rank
gathers (pickled, as all_gather_object sends them), plan_save time, and the size
of the committed root zarr.json.

Usage
  python benchmarks/bench_dist.py                  # full run (~4-6 min)
  python benchmarks/bench_dist.py --quick          # small smoke run (~1 min)
  python benchmarks/bench_dist.py --write-results  # also update benchmarks/RESULTS.md
  python benchmarks/bench_dist.py --json out.json  # raw measurements
  python benchmarks/bench_dist.py --profile        # cProfile rank 0 of each timed call
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
from typing import Any

from _common import dir_stats, drop_caches, finish, machine_info, proc_io, rank_entry, run_ranks, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.abspath(__file__)
SECTION = "## Distributed save/restore"

MiB = 1 << 20
GiB = 1 << 30
SYSTEMS = ("tsckpt", "dcp")
SAVE_RANKS = 4
RESTORE_RANKS = 2
MOD = 1 << 24  # values are integers below 2**24, exact in float32

# targets: read amplification (tsckpt), restore and save time relative to DCP
TARGET_AMP = 1.1
TARGET_RESTORE = 0.7
TARGET_SAVE = 1.0


def workload(quick: bool) -> list[tuple[str, tuple[int, int]]]:
    rows, cols = (1024, 1024) if quick else (8192, 1024)
    return [(f"w{i}", (rows, cols)) for i in range(8)]


def warm_workload() -> list[tuple[str, tuple[int, int]]]:
    return [("w0", (64, 64)), ("w1", (64, 64))]


# --------------------------------------------------------------------------
# rank side


def values(i: int, shape: tuple[int, int], box: tuple[tuple[int, int], tuple[int, int]]) -> Any:
    """Elements [off : off + len] of tensor ``i``: distinct integers, exact in float32."""
    import torch

    (r0, c0), (nr, nc) = box
    rows = torch.arange(r0, r0 + nr, dtype=torch.int64)[:, None]
    cols = torch.arange(c0, c0 + nc, dtype=torch.int64)[None, :]
    return ((rows * shape[1] + cols) * (2 * i + 1) % MOD).to(torch.float32)


def local_box(shape: tuple[int, int], dim: int, rank: int, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's box under Shard(dim) (torch.chunk split, as DTensor does)."""
    n = shape[dim]
    step = -(-n // world)
    lo, hi = min(n, rank * step), min(n, (rank + 1) * step)
    off, ln = [0, 0], list(shape)
    off[dim], ln[dim] = lo, hi - lo
    return (off[0], off[1]), (ln[0], ln[1])


def make_tree(mesh: Any, spec: list[tuple[str, tuple[int, int]]], dim: int, fill: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, (name, shape) in enumerate(spec):
        box = local_box(shape, dim, rank, world)
        local = values(i, shape, box) if fill else torch.zeros(box[1], dtype=torch.float32)
        out[name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=(shape[1], 1))
    return out


def do_save(system: str, path: str, tree: dict[str, Any]) -> None:
    if system == "tsckpt":
        import tsckpt

        tsckpt.save(path, {"model": tree})
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": tree}, storage_writer=dcp.FileSystemWriter(path))


def do_restore(system: str, path: str, tree: dict[str, Any]) -> None:
    if system == "tsckpt":
        import tsckpt

        tsckpt.restore(path, {"model": tree}, inplace=True)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": tree}, storage_reader=dcp.FileSystemReader(path))


def timed(fn: Any, profile_to: str | None) -> dict[str, Any]:
    """Barrier, call, barrier: wall time and /proc/self/io deltas around the call itself."""
    import torch.distributed as dist

    prof = None
    if profile_to:
        import cProfile

        prof = cProfile.Profile()
    dist.barrier()
    io0 = proc_io()
    c0 = time.process_time()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    fn()
    if prof:
        prof.disable()
    t1 = time.perf_counter()
    c1 = time.process_time()
    io1 = proc_io()
    dist.barrier()
    t2 = time.perf_counter()
    if prof is not None and profile_to:
        prof.dump_stats(profile_to)
    return {
        "time": t2 - t0,
        "call_s": t1 - t0,
        "cpu_s": c1 - c0,
        **{k: io1[k] - io0[k] for k in ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes")},
    }


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
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    system, spec = job["system"], [(n, tuple(s)) for n, s in job["spec"]]
    prof = job.get("profile") if rank == 0 else None
    if job["op"] == "save":
        do_save(system, job["warm_path"], make_tree(mesh, warm_workload(), 0, True))
        tree = make_tree(mesh, spec, 0, True)
        res = timed(lambda: do_save(system, job["path"], tree), prof)
        res["local_bytes"] = sum(t.to_local().nbytes for t in tree.values())
        return res
    # restore: Shard(1) targets, zero-filled
    do_restore(system, job["warm_path"], make_tree(mesh, warm_workload(), 1, False))
    tree = make_tree(mesh, spec, 1, False)
    res = timed(lambda: do_restore(system, job["path"], tree), prof)
    res["local_bytes"] = sum(t.to_local().nbytes for t in tree.values())
    for i, (name, shape) in enumerate(spec):
        if not torch.equal(tree[name].to_local(), values(i, shape, local_box(shape, 1, rank, world))):
            raise AssertionError(f"{system}: rank {rank}: restored {name} differs from what was saved")
    res["verified"] = True
    return res


# --------------------------------------------------------------------------
# parent side


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def expected_tsckpt_reads(path: str, spec: list[tuple[str, tuple[int, int]]], world: int) -> dict[str, Any]:
    """Bytes a Shard(1) restore on ``world`` ranks must read, from the saved chunk layout.

    Per rank: the root zarr.json, each array's zarr.json, the index of every
    shard file touched (16 bytes per inner chunk + crc32c, read from the file's
    end), and every inner chunk overlapping the local shard (+ its crc32c).
    """
    with open(os.path.join(path, "zarr.json"), "rb") as f:
        root = json.load(f)
    records = {a["path"]: a for a in root["attributes"]["tsckpt"]["arrays"]}
    parts: dict[str, Any] = {"root_json": 0, "array_json": 0, "shard_index": 0, "chunks": 0}
    for rank in range(world):
        parts["root_json"] += os.path.getsize(os.path.join(path, "zarr.json"))
        for name, shape in spec:
            rec = records[f"model/{name}"]
            parts["array_json"] += os.path.getsize(os.path.join(path, "model", name, "zarr.json"))
            shard, chunk = rec["shard_shape"], rec["chunk_shape"] or rec["shard_shape"]
            itemsize = 4
            (r0, c0), (nr, nc) = local_box(shape, 1, rank, world)
            lo, hi = (r0, c0), (r0 + nr, c0 + nc)
            n_chunks = math.prod(hi[d] // chunk[d] - lo[d] // chunk[d] + (hi[d] % chunk[d] > 0) for d in range(2))
            n_shards = math.prod(-(-hi[d] // shard[d]) - lo[d] // shard[d] for d in range(2))
            parts["chunks"] += n_chunks * (math.prod(chunk) * itemsize + 4)
            if rec["chunk_shape"] is not None:
                inner_per_shard = math.prod(s // c for s, c in zip(shard, chunk))
                parts["shard_index"] += n_shards * (inner_per_shard * 16 + 4)
    parts["total"] = sum(parts.values())
    rec = records[f"model/{spec[0][0]}"]
    parts["layout"] = [rec["shard_shape"], rec["chunk_shape"] or rec["shard_shape"]]
    return parts


def bench_system(system: str, base: str, args: argparse.Namespace, can_drop: bool, rep: int) -> dict[str, Any]:
    spec = workload(args.quick)
    path = os.path.join(base, f"{system}-ckpt")
    warm = os.path.join(base, f"{system}-warm")
    for p in (path, warm):
        shutil.rmtree(p, ignore_errors=True)
    prof = os.path.join(args.profile_dir, f"{system}-save-{rep}.prof") if args.profile_dir else None
    job = {"op": "save", "system": system, "path": path, "warm_path": warm, "spec": spec, "profile": prof}
    can_drop and drop_caches()
    save = run_ranks(SCRIPT, job, SAVE_RANKS, args.timeout)
    files, size = dir_stats(path)
    exp = expected_tsckpt_reads(path, spec, RESTORE_RANKS) if system == "tsckpt" else None
    can_drop and drop_caches()
    prof = os.path.join(args.profile_dir, f"{system}-restore-{rep}.prof") if args.profile_dir else None
    restore = run_ranks(SCRIPT, dict(job, op="restore", profile=prof), RESTORE_RANKS, args.timeout)
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(warm, ignore_errors=True)
    need = sum(r["local_bytes"] for r in restore)
    out = {
        "save": save,
        "restore": restore,
        "save_time": max(r["time"] for r in save),
        "restore_time": max(r["time"] for r in restore),
        "save_cpu": sum(r["cpu_s"] for r in save),
        "restore_cpu": sum(r["cpu_s"] for r in restore),
        "files": files,
        "stored_bytes": size,
        "needed_bytes": need,
        "rchar": sum(r["rchar"] for r in restore),
        "read_bytes": sum(r["read_bytes"] for r in restore),
        "amp_rchar": sum(r["rchar"] for r in restore) / need,
        "amp_read_bytes": sum(r["read_bytes"] for r in restore) / need,
        "expected": exp,
    }
    log(
        f"[{system}] rep {rep}: save {out['save_time']:.3f} s (CPU {out['save_cpu']:.2f} s), "
        f"restore {out['restore_time']:.3f} s (CPU {out['restore_cpu']:.2f} s), "
        f"read amp {out['amp_rchar']:.3f} (rchar) / {out['amp_read_bytes']:.3f} (read_bytes), {files} files"
    )
    return out


# ---- planning and metadata at scale (one process, no I/O) -------------------


def bench_metadata(n_leaves: int, n_ranks: int, repeats: int) -> dict[str, Any]:
    from tsckpt._save.plan import plan_save
    from tsckpt._base.types import LeafDesc
    from tsckpt._save.commit import root_json as _root
    from tsckpt._ondisk.records import STATE_COMMITTED
    from tsckpt.tree import flatten, structure_to_json

    # a transformer-like tree: 4 weight matrices per layer, 4096 x 1024 float32, Shard(0)
    layers = -(-n_leaves // 4)
    tree = {"model": {"layers": [{k: 0 for k in ("wq", "wk", "wv", "wo")} for _ in range(layers)]}}
    flat = flatten(tree)
    paths = flat.paths[:n_leaves]
    structure = structure_to_json(flat.spec)
    shape = (4096, 1024)
    rows = shape[0] // n_ranks
    per_rank = [
        [
            LeafDesc(path=p, kind="torch", dtype="float32", itemsize=4, global_shape=shape, offsets=(r * rows, 0), lengths=(rows, shape[1]))
            for p in paths
        ]
        for r in range(n_ranks)
    ]
    # what each rank passes to all_gather_object in save(): its descriptors, the tree's
    # paths and structure, and its tied-leaf links (none here)
    blobs = [pickle.dumps((descs, flat.paths, structure, {})) for descs in per_rank]
    sent = [len(b) for b in blobs]
    t0 = time.perf_counter()
    for b in blobs:  # what every rank does on receiving them
        pickle.loads(b)
    unpickle_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_save(per_rank)
        times.append(time.perf_counter() - t0)
    meta = {
        "structure": structure,
        "leaves": flat.paths,
        "arrays": [a.to_json() for a in plan.arrays],
        "values": dict(plan.values),
        "world_size": n_ranks,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    t0 = time.perf_counter()
    root = _root(STATE_COMMITTED, meta)
    encode_s = time.perf_counter() - t0
    from tsckpt._ondisk.arrays import array_node
    from tsckpt._storage.durable import encode_json

    node = len(encode_json(array_node(plan.arrays[0])))
    return {
        "leaves": len(paths),
        "ranks": n_ranks,
        "shape": list(shape),
        "per_rank_pickle": max(sent),
        "gathered_pickle": sum(sent),
        "unpickle_s": unpickle_s,
        "plan_s": min(times),
        "plan_s_all": times,
        "root_json": len(root),
        "root_encode_s": encode_s,
        "array_json_each": node,
        "writes": len(plan.writes),
        "layout": [list(plan.arrays[0].chunking.shard_shape), list(plan.arrays[0].chunking.chunk_shape or [])],
    }


# ---- reporting ---------------------------------------------------------------




def spread(xs: list[float]) -> str:
    return f"{(max(xs) / min(xs) - 1) * 100:.0f}%" if len(xs) > 1 else "-"


def verdict(ok: bool) -> str:
    return "**pass**" if ok else "**miss**"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "save": min(r["save_time"] for r in runs),
        "save_spread": spread([r["save_time"] for r in runs]),
        "restore": min(r["restore_time"] for r in runs),
        "restore_spread": spread([r["restore_time"] for r in runs]),
        "amp_rchar": min(r["amp_rchar"] for r in runs),
        "amp_rchar_max": max(r["amp_rchar"] for r in runs),
        "amp_read_bytes": max(r["amp_read_bytes"] for r in runs),
        "save_cpu": min(r["save_cpu"] for r in runs),
        "restore_cpu": min(r["restore_cpu"] for r in runs),
        "files": runs[0]["files"],
        "stored": runs[0]["stored_bytes"],
        "needed": runs[0]["needed_bytes"],
    }


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    spec = workload(args.quick)
    total = sum(4 * math.prod(s) for _, s in spec)
    S = {k: summarize(results["runs"][k]) for k in SYSTEMS}
    T, D = S["tsckpt"], S["dcp"]
    cache = "cold (page cache dropped before each save and between save and restore)" if results["cold_cache"] else (
        "WARM (the page cache could not be dropped)"
    )
    exp = results["runs"]["tsckpt"][0]["expected"]
    md = results["metadata"]
    rows, cols = spec[0][1]
    lines = [
        SECTION,
        "",
        f"Run {m['date']}{' (--quick smoke run: sizes reduced, not comparable)' if args.quick else ''}. "
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python {m['python']}; "
        f"torch {m['torch']}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt']} ({m['tsckpt_rev']}). "
        f"Load average at start: {', '.join(f'{x:.1f}' for x in m['load_avg'])}; the machine is shared with other jobs, so "
        f"timings are noisy. {args.repeats} runs per system, best shown, spread = slowest/best - 1.",
        "",
        f"Workload: {len(spec)} float32 tensors of {rows} x {cols} ({total / MiB:,.0f} MiB) as DTensors on a 1-D CPU mesh "
        f"(gloo). {SAVE_RANKS} ranks save them Shard(0); {RESTORE_RANKS} ranks restore them in place into Shard(1) "
        "DTensors, so each restoring rank needs half of every saved shard. tsckpt: `tsckpt.save` / "
        "`tsckpt.restore(..., inplace=True)`; DCP: `dcp.save` / `dcp.load` with the default FileSystemWriter / "
        "FileSystemReader. Times run from a barrier before the call to a barrier after it, maximum over ranks; each "
        "rank process first does one small save or restore with the same system (imports, process groups and thread "
        f"pools warm). Restores: {cache}. Read amplification = bytes read during the restore call (summed over "
        "ranks) / bytes of the target's local shards (summed over ranks); rchar = bytes returned by read syscalls, "
        "read_bytes = bytes fetched from the block device (includes readahead), both /proc/self/io deltas.",
        "",
        "| system | save (s) | spread | save CPU (s) | restore (s) | spread | restore CPU (s) | read amp. (rchar) | "
        "read amp. (read_bytes) | files | stored (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in SYSTEMS:
        s = S[k]
        lines.append(
            f"| {k} | {s['save']:.3f} | {s['save_spread']} | {s['save_cpu']:.2f} | {s['restore']:.3f} | "
            f"{s['restore_spread']} | {s['restore_cpu']:.2f} | {s['amp_rchar']:.3f} | {s['amp_read_bytes']:.3f} | "
            f"{s['files']:,} | {s['stored'] / MiB:,.1f} |"
        )
    lines += [
        "",
        "CPU = process CPU time (all threads) during the call, summed over ranks, least of the runs. All runs "
        "(save s / restore s, max over ranks; read amplification by rchar):",
        "",
    ]
    for k in SYSTEMS:
        runs = ", ".join(f"{r['save_time']:.2f} / {r['restore_time']:.2f} / {r['amp_rchar']:.3f}" for r in results["runs"][k])
        lines.append(f"- {k}: {runs}")
    if exp:
        lines += [
            "",
            f"tsckpt's expected restore reads from its chunk layout (shard {exp['layout'][0]}, inner chunk "
            f"{exp['layout'][1]}), summed over the {RESTORE_RANKS} ranks: inner chunks {exp['chunks']:,} + shard "
            f"indexes {exp['shard_index']:,} + array zarr.json {exp['array_json']:,} + root zarr.json "
            f"{exp['root_json']:,} = {exp['total']:,} bytes, i.e. read amplification "
            f"{exp['total'] / T['needed']:.3f} (measured by rchar: {T['amp_rchar']:.3f}).",
        ]
    ra, rr, rs = T["amp_rchar"], T["restore"] / D["restore"], T["save"] / D["save"]
    lines += [
        "",
        "| target | result | figures |",
        "|---|---|---|",
        f"| tsckpt read amplification <= {TARGET_AMP} | {verdict(ra <= TARGET_AMP)} | {ra:.3f} (DCP {D['amp_rchar']:.3f}) |",
        f"| tsckpt restore <= {TARGET_RESTORE}x DCP | {verdict(rr <= TARGET_RESTORE)} | {T['restore']:.3f} s vs "
        f"{D['restore']:.3f} s = {rr:.2f}x |",
        f"| tsckpt save <= {TARGET_SAVE}x DCP | {verdict(rs <= TARGET_SAVE)} | {T['save']:.3f} s vs {D['save']:.3f} s = {rs:.2f}x |",
        "",
        f"### Planning and metadata: {md['leaves']:,} leaves across {md['ranks']} simulated ranks",
        "",
        f"In one process, no I/O: {md['leaves']:,} leaves of {md['shape'][0]} x {md['shape'][1]} float32, each Shard(0) over "
        f"{md['ranks']} ranks, described by hand-made LeafDesc lists and planned with plan_save (what every rank runs "
        "after gathering the descriptors). The gathered bytes are what all_gather_object moves in save(): each rank's "
        "pickled (descriptors, tree paths, tree structure, tied-leaf links); every rank receives and unpickles all of them.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| descriptors sent per rank (pickled) | {md['per_rank_pickle'] / 1024:,.1f} KiB |",
        f"| descriptors gathered by every rank | {md['gathered_pickle'] / MiB:,.2f} MiB |",
        f"| unpickling the gathered descriptors | {md['unpickle_s'] * 1e3:,.0f} ms |",
        f"| plan_save time (best of {len(md['plan_s_all'])}) | {md['plan_s'] * 1e3:,.0f} ms |",
        f"| write items planned | {md['writes']:,} |",
        f"| committed root zarr.json | {md['root_json'] / 1024:,.1f} KiB |",
        f"| one array's zarr.json (x {md['leaves']:,}) | {md['array_json_each']:,} bytes |",
        "",
    ]
    return "\n".join(lines)


def print_profiles(profile_dir: str) -> None:
    import pstats

    for name in sorted(os.listdir(profile_dir)):
        log(f"==== {name} (rank 0, cumulative)")
        st = pstats.Stats(os.path.join(profile_dir, name), stream=sys.stderr)
        st.sort_stats("cumulative").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 run per system: a smoke test")
    ap.add_argument("--repeats", type=int, default=None, help="runs per system (default 5, 1 with --quick)")
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a new temporary directory)")
    ap.add_argument("--json", default=None, help="write raw measurements here")
    ap.add_argument("--write-results", action="store_true", help=f"replace the '{SECTION}' section of RESULTS.md")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed call on rank 0; print the top functions")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per multi-rank step")
    ap.add_argument("--report", default=None, metavar="JSON", help="only print (and with --write-results write) "
                    "the section from measurements saved earlier with --json")
    ap.add_argument("--rank-job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_job is not None:
        rank_entry(rank_main, json.loads(args.rank_job))
        return
    if args.report is not None:
        with open(args.report) as f:
            saved = json.load(f)
        args.quick, args.repeats = saved["quick"], len(saved["runs"]["tsckpt"])
        section = report(saved, args)
        print(section)
        if args.write_results:
            write_section(SECTION, section)
        return
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    base = tempfile.mkdtemp(prefix="tsckpt-bench-dist-", dir=args.dir)
    args.profile_dir = os.path.join(base, "profiles") if args.profile else None
    if args.profile_dir:
        os.makedirs(args.profile_dir)
    t0 = time.time()
    try:
        can_drop = drop_caches()
        if not can_drop:
            log("cannot drop the page cache (not root?): restores are warm-cache")
        results: dict[str, Any] = {"machine": machine_info(), "cold_cache": can_drop, "quick": args.quick}
        results["metadata"] = bench_metadata(100 if args.quick else 1000, 64, 3)
        log(f"[metadata] {json.dumps({k: v for k, v in results['metadata'].items() if k != 'plan_s_all'})}")
        results["runs"] = {k: [] for k in SYSTEMS}
        for rep in range(args.repeats):
            order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]  # alternate, so neither always runs first
            for system in order:
                results["runs"][system].append(bench_system(system, base, args, can_drop, rep))
        if args.profile_dir:
            print_profiles(args.profile_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["wall_s"] = time.time() - t0
    log(f"total {results['wall_s']:.0f} s")
    finish(results, args, report, SECTION)


if __name__ == "__main__":
    main()
