#!/usr/bin/env python
"""Scale benchmark: a 10,000-leaf optimizer-like state on 4 ranks, tsckpt's plain and
compact layouts against torch.distributed.checkpoint (DCP), on a local disk and on S3.

Workload
  2,500 parameters of mixed small sizes (1-64 KiB each, fixed seed; 3 in 4 are
  matrices of N x 64 float32, the rest vectors), each giving 4 leaves as in an
  optimizer's state: the parameter, exp_avg and exp_avg_sq (DTensors, Shard(0) row
  blocks over 4 gloo ranks) and step (a 0-d float32 tensor every rank holds: a
  replicated leaf). 10,000 leaves, about 240 MiB. --quick: 250 parameters.

Parts
  dist    4 ranks save the state and restore it in place into preallocated zero
          DTensors (and tensors) with tsckpt plain, tsckpt compact
          (layout="compact") and DCP (dcp.save / dcp.load, FileSystemWriter /
          FileSystemReader defaults). Times run from a barrier before the call to
          a barrier after it, maximum over ranks; each rank first does one small
          save and restore with the same system (imports, process groups, thread
          pools warm). The checkpoint's pages are evicted from the page cache
          between save and restore. Files written: every file under the
          checkpoint. Metadata bytes read at open: /proc/self/io rchar delta around
          tsckpt.open(dir) and tsckpt.metadata(dir), and around DCP's
          FileSystemReader.read_metadata(), each in a fresh process (after one
          call on another checkpoint, so imports are not counted).
  s3      the same 4-rank save and restore for tsckpt plain and compact against
          moto's S3 server on 127.0.0.1, counting requests by method (torch has
          no S3 storage writer for DCP).
  single  one process: the same 10,000 tensors, unsharded, saved with tsckpt
          (both layouts) and safetensors save_file, then restored with
          tsckpt.restore (in place, and without a target) and load_file, every
          tensor summed after the call (included in the time).

Every case runs in fresh processes; the cases rotate within each round and the
median over rounds is reported, with the range. Restored values are checked
exactly after timing.

Usage
  python benchmarks/bench_scale.py --quick            # 1,000 leaves, 1 round: a smoke run
  python benchmarks/bench_scale.py --write-results    # 10,000 leaves, 3 rounds; rewrite the
                                                      # "Scale: 10,000 leaves" section of RESULTS.md
  python benchmarks/bench_scale.py --only single --profile   # cProfile each timed call (rank 0)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import (LocalS3, bench_parser, dir_stats, evict, finish, machine_info, proc_io, rank_entry, run_child,
                     run_ranks, write_section)

SCRIPT = os.path.abspath(__file__)
SECTION = "## Scale: 10,000 leaves"
MiB = 1 << 20
WORLD = 4
SEED = 0
MOD = 1 << 24  # values are integers below 2**24: exact in float32
PARTS = ("dist", "s3", "single")
DIST_SYSTEMS = ("plain", "compact", "dcp")
S3_SYSTEMS = ("plain", "compact")
SINGLE_SYSTEMS = ("compact", "compact (target=None)", "plain", "safetensors")
TARGET_SINGLE = 2.0  # compact restore of 10,000 small tensors within 2x of safetensors


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the workload -----------------------------------------------------------------------


def param_shapes(quick: bool) -> list[tuple[int, ...]]:
    """One shape per parameter: 1-64 KiB of float32, 3 in 4 a matrix of N x 64, else a vector."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    n = 250 if quick else 2500
    nbytes = rng.integers(1024, 64 * 1024, size=n, endpoint=True)
    matrix = rng.random(n) < 0.75
    return [(int(b) // 256, 64) if m else (int(b) // 4,) for b, m in zip(nbytes, matrix)]


def leaves(quick: bool) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(path in the tree, global shape) of every leaf; shape () is the replicated step."""
    out: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
    for j, shape in enumerate(param_shapes(quick)):
        name = f"p{j:04d}"
        out.append((("model", name), shape))
        out += [(("optim", name, k), shape) for k in ("exp_avg", "exp_avg_sq")]
        out.append((("optim", name, "step"), ()))
    return out


def total_bytes(quick: bool) -> int:
    return sum(4 * math.prod(s) for _, s in leaves(quick))


def row_block(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of ``rank`` under Shard(0) (torch.chunk split, as DTensor does)."""
    step = -(-n // world)
    return min(n, rank * step), min(n, (rank + 1) * step)


def values(i: int, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> Any:
    """Rows ``rows`` (default all) of leaf ``i``: distinct integers, exact in float32."""
    import torch

    if shape == ():
        return torch.tensor(float(i))
    lo, hi = rows or (0, shape[0])
    inner = math.prod(shape[1:])
    idx = torch.arange(lo * inner, hi * inner, dtype=torch.int64)
    return ((idx * (2 * i + 1) + i) % MOD).to(torch.float32).reshape((hi - lo, *shape[1:]))


def put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def build_state(quick: bool, fill: bool, mesh: Any = None) -> dict[str, Any]:
    """The state: with ``mesh``, this rank's DTensors (Shard(0)) and replicated steps; without,
    the whole tensors. ``fill=False`` gives zeros (a restore target)."""
    import torch

    tree: dict[str, Any] = {}
    rank, world = (mesh.get_rank(), mesh.size()) if mesh is not None else (0, 1)
    for i, (path, shape) in enumerate(leaves(quick)):
        if mesh is None or shape == ():
            v = values(i, shape) if fill else torch.zeros(shape)
        else:
            from torch.distributed.tensor import DTensor, Shard

            rows = row_block(shape[0], rank, world)
            local = values(i, shape, rows) if fill else torch.zeros((rows[1] - rows[0], *shape[1:]))
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            v = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
        put(tree, path, v)
    return tree


def check_state(tree: dict[str, Any], quick: bool, mesh: Any = None) -> None:
    """Every leaf equals what was saved (this rank's rows of it, with ``mesh``)."""
    import numpy as np
    import torch

    rank, world = (mesh.get_rank(), mesh.size()) if mesh is not None else (0, 1)
    for i, (path, shape) in enumerate(leaves(quick)):
        got = get(tree, path)
        got = got.to_local() if hasattr(got, "to_local") else got
        got = torch.from_numpy(np.asarray(got)) if isinstance(got, np.ndarray) else got
        rows = row_block(shape[0], rank, world) if mesh is not None and shape != () else None
        if not torch.equal(got, values(i, shape, rows)):
            raise AssertionError(f"restored {'/'.join(path)} differs from what was saved")


def warm_state(mesh: Any, fill: bool) -> dict[str, Any]:
    """A small state of the same kinds, saved and restored once before timing."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    local = torch.ones(16, 64) if fill else torch.zeros(16, 64)
    w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((16 * mesh.size(), 64)), stride=(64, 1))
    return {"model": {"w": w}, "optim": {"w": {"step": torch.tensor(1.0) if fill else torch.tensor(0.0)}}}


# ---- systems ----------------------------------------------------------------------------


def do_save(system: str, path: str, tree: Any) -> None:
    if system == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(tree, storage_writer=dcp.FileSystemWriter(path))
    elif system == "safetensors":
        from safetensors.torch import save_file

        save_file(flat_tensors(tree), os.path.join(path, "model.safetensors"))
    else:
        import tsckpt

        tsckpt.save(path, tree, layout=system)


def do_restore(system: str, path: str, target: Any) -> Any:
    """Restore in place into ``target`` (returns it), or, for the load-everything systems, the loaded tree."""
    if system == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        return target
    if system == "safetensors":
        from safetensors.torch import load_file

        return load_file(os.path.join(path, "model.safetensors"))
    import tsckpt

    if system.endswith("(target=None)"):
        return tsckpt.restore(path)
    tsckpt.restore(path, target, inplace=True)
    return target


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": tensor}`` from a nested dict (safetensors' flat naming)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for k, v in flat.items():
        put(tree, tuple(k.split(".")), v)
    return tree


def touch(tree: Any) -> float:
    """Read every element of every restored array (a float sum, which also checks nothing is lazy)."""
    import numpy as np
    import torch

    total = 0.0
    for v in flat_tensors(tree).values():
        total += float(torch.from_numpy(np.asarray(v)).sum() if isinstance(v, np.ndarray) else v.sum())
    return total


def profiled(fn: Any, profile_to: str | None) -> Any:
    """Call ``fn``; with ``profile_to``, under cProfile, dumping the stats there."""
    if not profile_to:
        return fn()
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        prof.dump_stats(profile_to)


# ---- rank side (4 gloo ranks) -----------------------------------------------------------


def timed(fn: Any, profile_to: str | None) -> dict[str, float]:
    """Barrier, call, barrier: wall time (until the barrier after) and this process's CPU time."""
    import torch.distributed as dist

    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    profiled(fn, profile_to)
    c1 = time.process_time()
    dist.barrier()
    return {"time": time.perf_counter() - t0, "cpu_s": c1 - c0}


def set_phase(url: str | None, name: str) -> None:
    """Tell the local S3 server which phase the requests that follow belong to."""
    if url:
        import urllib.request

        urllib.request.urlopen(f"{url}/_bench/phase/{name}").read()


def rank_main(job: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then save the state, evict it (local disk), and restore it in place; check it."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (imported before timing)
    from torch.distributed.device_mesh import init_device_mesh

    import tsckpt  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    system, path, quick = job["system"], job["path"], job["quick"]
    s3 = job.get("s3_url") if rank == 0 else None
    prof = job.get("profile") if rank == 0 else None
    do_save(system, job["warm_path"], warm_state(mesh, True))
    do_restore(system, job["warm_path"], warm_state(mesh, False))
    state, target = build_state(quick, True, mesh), build_state(quick, False, mesh)
    set_phase(s3, "save")
    save = timed(lambda: do_save(system, path, state), prof and prof + ".save")
    if rank == 0 and not job.get("s3_url"):
        evict(path)
    set_phase(s3, "restore")
    restore = timed(lambda: do_restore(system, path, target), prof and prof + ".restore")
    set_phase(s3, "none")
    check_state(target, quick, mesh)
    return {"save": save, "restore": restore}


# ---- child side (one process) -----------------------------------------------------------


def child_open(spec: dict[str, Any]) -> dict[str, Any]:
    """Bytes read (rchar) and time of opening a checkpoint's metadata, after one warm-up call."""
    system, path, warm = spec["system"], spec["path"], spec["warm_path"]
    out: dict[str, Any] = {}
    if system == "dcp":
        import torch.distributed.checkpoint as dcp

        calls = {"read_metadata": lambda p: dcp.FileSystemReader(p).read_metadata()}
    else:
        import tsckpt

        calls = {"open": tsckpt.open, "metadata": tsckpt.metadata}
    for name, fn in calls.items():
        fn(warm)
        set_phase(spec.get("s3_url"), name)
        io0, t0 = proc_io(), time.perf_counter()
        fn(path)
        t1, io1 = time.perf_counter(), proc_io()
        set_phase(spec.get("s3_url"), "none")
        out[name] = {"rchar": io1["rchar"] - io0["rchar"], "syscr": io1["syscr"] - io0["syscr"], "time": t1 - t0}
    return out


def child_single(spec: dict[str, Any]) -> dict[str, Any]:
    """One process: save the whole state, or restore it (page cache evicted first) and sum every tensor."""
    import torch.distributed.checkpoint  # noqa: F401  (tsckpt recognises DTensors only once loaded; as in the ranks)

    import safetensors.torch  # noqa: F401
    import tsckpt  # noqa: F401

    system, path, quick = spec["system"], spec["path"], spec["quick"]
    if spec["op"] == "save":
        state = build_state(quick, True)
        if system == "safetensors":
            os.makedirs(path, exist_ok=True)
        t0 = time.perf_counter()
        profiled(lambda: do_save(system, path, state), spec.get("profile"))
        return {"time": time.perf_counter() - t0}
    target = build_state(quick, False)
    evict(path)
    t0 = time.perf_counter()
    out = profiled(lambda: do_restore(system, path, target), spec.get("profile"))
    t1 = time.perf_counter()
    touch(out)
    t2 = time.perf_counter()
    check_state(nest(out) if system == "safetensors" else out, quick)
    return {"time": t2 - t0, "load": t1 - t0, "touch": t2 - t1}


def child_main(spec: dict[str, Any]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    res = child_open(spec) if spec["op"] == "open" else child_single(spec)
    print(json.dumps(res), flush=True)


# ---- parent side ------------------------------------------------------------------------


def rotate(systems: tuple[str, ...], r: int) -> tuple[str, ...]:
    """The systems in round ``r``'s order (each starts a different round)."""
    k = r % len(systems)
    return systems[k:] + systems[:k]


def prof_path(args: Any, name: str) -> str | None:
    return os.path.join(args.profile_dir, name.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "-")) if args.profile_dir else None


def bench_dist(base: str, args: Any) -> dict[str, Any]:
    """4-rank save and restore on the local disk, files and metadata reads at open."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in DIST_SYSTEMS}
    for r in range(args.repeats):
        for system in rotate(DIST_SYSTEMS, r):
            path, warm = os.path.join(base, f"{system}-{r}"), os.path.join(base, f"{system}-warm-{r}")
            job = {"system": system, "path": path, "warm_path": warm, "quick": args.quick,
                   "profile": prof_path(args, f"dist-{system}-{r}")}
            ranks = run_ranks(SCRIPT, job, WORLD, args.timeout)
            files, size = dir_stats(path)
            res = {"save": max(x["save"]["time"] for x in ranks), "restore": max(x["restore"]["time"] for x in ranks),
                   "save_cpu": sum(x["save"]["cpu_s"] for x in ranks),
                   "restore_cpu": sum(x["restore"]["cpu_s"] for x in ranks), "files": files, "bytes": size}
            if r == 0:
                res["open"] = run_child(SCRIPT, {"op": "open", "system": system, "path": path, "warm_path": warm}, args.timeout)
                res["meta_file"] = os.path.getsize(os.path.join(path, ".metadata" if system == "dcp" else "zarr.json"))
            runs[system].append(res)
            log(f"[dist r{r}] {system}: save {res['save']:.2f} s, restore {res['restore']:.2f} s, {files:,} files"
                + (f", open {json.dumps(res['open'])}" if "open" in res else ""))
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(warm, ignore_errors=True)
    return runs


def s3_quick(args: Any) -> bool:
    """The S3 part runs the --quick state (a tenth) unless --s3-full: the local server answers
    about 150 requests a second here, and a full-size restore makes tens of thousands."""
    return args.quick or not args.s3_full


def bench_s3(args: Any) -> dict[str, Any]:
    """The same 4-rank save and restore against moto's S3 server, with request counts."""
    server = LocalS3()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in S3_SYSTEMS}
    try:
        for r in range(args.repeats):
            for system in rotate(S3_SYSTEMS, r):
                key, warm = f"{system}-{r}", f"{system}-warm-{r}"
                path = f"s3://{server.BUCKET}/{key}"
                job = {"system": system, "path": path, "warm_path": f"s3://{server.BUCKET}/{warm}", "quick": s3_quick(args),
                       "s3_url": server.url, "profile": prof_path(args, f"s3-{system}-{r}")}
                server.take_counts()
                ranks = run_ranks(SCRIPT, job, WORLD, args.timeout, env=server.env())
                counts = server.take_counts()
                objects, size = server.objects(key + "/")
                res = {"save": max(x["save"]["time"] for x in ranks), "restore": max(x["restore"]["time"] for x in ranks),
                       "save_cpu": sum(x["save"]["cpu_s"] for x in ranks),
                       "restore_cpu": sum(x["restore"]["cpu_s"] for x in ranks), "objects": objects, "bytes": size,
                       "requests": counts}
                if r == 0:
                    spec = {"op": "open", "system": system, "path": path, "warm_path": job["warm_path"], "s3_url": server.url}
                    res["open"] = run_child(SCRIPT, spec, args.timeout, env=server.env())
                    res["open_requests"] = server.take_counts()
                runs[system].append(res)
                log(f"[s3 r{r}] {system}: save {res['save']:.2f} s, restore {res['restore']:.2f} s, {objects:,} objects, "
                    f"requests {json.dumps(counts)}")
                server.delete(key + "/")
                server.delete(warm + "/")
    finally:
        server.close()
    return runs


def bench_single(base: str, args: Any) -> dict[str, Any]:
    """One process: save once per format, then restore in rotating rounds."""
    paths = {"compact": os.path.join(base, "single-compact"), "plain": os.path.join(base, "single-plain"),
             "safetensors": os.path.join(base, "single-safetensors")}
    out: dict[str, Any] = {"save": {}, "files": {}, "restore": {s: [] for s in SINGLE_SYSTEMS}}
    for system, path in paths.items():
        spec = {"op": "save", "system": system, "path": path, "quick": args.quick, "profile": prof_path(args, f"single-save-{system}")}
        out["save"][system] = run_child(SCRIPT, spec, args.timeout)["time"]
        out["files"][system] = dir_stats(path)
        log(f"[single] save {system}: {out['save'][system]:.2f} s, {out['files'][system][0]:,} files")
    for r in range(args.repeats):
        for system in rotate(SINGLE_SYSTEMS, r):
            spec = {"op": "restore", "system": system, "path": paths[system.split(" ")[0]], "quick": args.quick,
                    "profile": prof_path(args, f"single-restore-{system}-{r}")}
            res = run_child(SCRIPT, spec, args.timeout)
            out["restore"][system].append(res)
            log(f"[single r{r}] restore {system}: {res['time']:.2f} s (load {res['load']:.2f} + touch {res['touch']:.2f})")
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)
    return out


# ---- report -----------------------------------------------------------------------------


def med(xs: list[float]) -> str:
    """Median with the range over rounds."""
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def fmt_requests(counts: dict[str, int] | None) -> str:
    if not counts:
        return "0"
    return f"{sum(counts.values()):,} (" + ", ".join(f"{m} {n:,}" for m, n in sorted(counts.items())) + ")"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def dist_table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        "| system | save (s) | restore (s) | save CPU (s) | restore CPU (s) | files | stored (MiB) | "
        "metadata file (KiB) | bytes read at open (KiB) | open (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in DIST_SYSTEMS:
        rs = runs[system]
        first = rs[0]
        opened = first["open"]
        if system == "dcp":
            read = f"read_metadata {opened['read_metadata']['rchar'] / 1024:,.1f}"
            ms = f"{opened['read_metadata']['time'] * 1e3:,.0f}"
            name = "DCP"
        else:
            read = f"open {opened['open']['rchar'] / 1024:,.1f}; metadata {opened['metadata']['rchar'] / 1024:,.1f}"
            ms = f"{opened['open']['time'] * 1e3:,.0f} / {opened['metadata']['time'] * 1e3:,.0f}"
            name = f"tsckpt {system}"
        lines.append(
            f"| {name} | {med([r['save'] for r in rs])} | {med([r['restore'] for r in rs])} | "
            f"{median_of(rs, 'save_cpu'):.2f} | {median_of(rs, 'restore_cpu'):.2f} | {first['files']:,} | "
            f"{first['bytes'] / MiB:,.1f} | {first['meta_file'] / 1024:,.1f} | {read} | {ms} |"
        )
    return lines


def s3_table(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [
        "| system | save (s) | restore (s) | save CPU (s) | restore CPU (s) | objects | save requests | "
        "restore requests | requests at open / metadata |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in S3_SYSTEMS:
        rs = runs[system]
        first = rs[0]
        req = first["requests"]
        op = first.get("open_requests", {})
        lines.append(
            f"| tsckpt {system} | {med([r['save'] for r in rs])} | {med([r['restore'] for r in rs])} | "
            f"{median_of(rs, 'save_cpu'):.2f} | {median_of(rs, 'restore_cpu'):.2f} | {first['objects']:,} | "
            f"{fmt_requests(req.get('save'))} | {fmt_requests(req.get('restore'))} | "
            f"{fmt_requests(op.get('open'))} / {fmt_requests(op.get('metadata'))} |"
        )
    lines.append("| DCP | - | - | - | - | - | - | - | - |")
    return lines


def single_table(single: dict[str, Any]) -> list[str]:
    st = statistics.median(r["time"] for r in single["restore"]["safetensors"])
    lines = [
        "| system | save (s, 1 run) | files | restore + touch (s) | of which touch (s) | vs safetensors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for system in SINGLE_SYSTEMS:
        rs = single["restore"][system]
        fmt = system.split(" ")[0]
        label = ("tsckpt " if system != "safetensors" else "") + system
        label += ", in place" if system in ("compact", "plain") else ""
        lines.append(
            f"| {label} | {single['save'][fmt]:.2f} | {single['files'][fmt][0]:,} | {med([r['time'] for r in rs])} | "
            f"{median_of(rs, 'touch'):.2f} | {median_of(rs, 'time') / st:.2f}x |"
        )
    return lines


def targets(results: dict[str, Any]) -> list[str]:
    lines = ["| target | result | figures |", "|---|---|---|"]
    d = results.get("dist")
    if d:
        for op in ("save", "restore"):
            c, p = median_of(d["compact"], op), median_of(d["dcp"], op)
            lines.append(f"| 4 ranks, compact {op} no slower than DCP | {verdict(c <= p)} | {c:.2f} s vs {p:.2f} s = {c / p:.2f}x |")
    s = results.get("single")
    if s:
        st = median_of(s["restore"]["safetensors"], "time")
        for system in ("compact", "compact (target=None)"):
            c = median_of(s["restore"][system], "time")
            lines.append(f"| one process, {system} restore of {results['n_leaves']:,} tensors within {TARGET_SINGLE:g}x of "
                         f"safetensors | {verdict(c <= TARGET_SINGLE * st)} | {c:.2f} s vs {st:.2f} s = {c / st:.2f}x |")
    return lines


def report(results: dict[str, Any], args: Any) -> str:
    m = results["machine"]
    quick = " --quick" if args.quick else ""
    n_params = len(param_shapes(args.quick))
    load_end = ", ".join(f"{x:.1f}" for x in results["load_end"])
    lines = [
        SECTION,
        "",
        f"Run {m['date']} by `python benchmarks/bench_scale.py{quick} --rounds {args.repeats}"
        f"{' --write-results' if args.write_results else ''}` on {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']:.0f} GiB RAM, "
        f"Python {m['python']}; torch {m['torch']}, tensorstore {m['tensorstore']}, safetensors {m['safetensors']}, "
        f"tsckpt {m['tsckpt']} ({m['tsckpt_rev']}); local disk. Load average at start: "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}; at the end: {load_end} (the machine is shared with other jobs). "
        f"Median of {args.repeats} rotating rounds, range in brackets; {results['wall_s'] / 60:.0f} minutes in all."
        + (" **Smoke run: reduced workload, not comparable.**" if args.quick else ""),
        "",
        f"Workload: {n_params:,} parameters of 1-64 KiB float32 each (fixed seed; 3 in 4 are N x 64 matrices, the rest "
        f"vectors), each giving 4 leaves as in an optimizer state: the parameter, exp_avg and exp_avg_sq, DTensors "
        f"sharded Shard(0) in row blocks over {WORLD} gloo ranks, and step, a 0-d float32 tensor every rank holds "
        f"(replicated). {results['n_leaves']:,} leaves, {total_bytes(args.quick) / MiB:,.0f} MiB. Saves and in-place "
        "restores (into zero DTensors and tensors built before the timer) run on 4 rank processes, timed from a barrier "
        "before the call to a barrier after it, maximum over ranks; each rank first saves and restores a small state with "
        "the same system, so imports, process groups and thread pools are warm. CPU = process CPU time during the call "
        "summed over ranks. Every restored value is checked after timing. tsckpt: `tsckpt.save(dir, state, layout=...)` / "
        "`tsckpt.restore(dir, target, inplace=True)`; DCP: `dcp.save` / `dcp.load` with the default FileSystemWriter / "
        "FileSystemReader.",
        "",
    ]
    if "dist" in results:
        lines += [
            f"### {WORLD} ranks, local disk",
            "",
            "The checkpoint's pages are evicted from the page cache (`posix_fadvise`) between save and restore. Files: "
            "every file under the checkpoint. Metadata file: the root `zarr.json` (tsckpt) or `.metadata` (DCP). Bytes "
            "read at open: `/proc/self/io` rchar delta around `tsckpt.open(dir)` and `tsckpt.metadata(dir)`, and around "
            "DCP's `FileSystemReader(dir).read_metadata()`, in a fresh process after one call on another checkpoint.",
            "",
            *dist_table(results["dist"]),
            "",
        ]
    if "s3" in results:
        lines += [
            f"### {WORLD} ranks, S3 (moto's server on 127.0.0.1)",
            "",
            f"The same saves and restores{'' if args.s3_full else ', on a tenth of the state (' + format(len(leaves(True)), ',') + ' leaves, ' + format(total_bytes(True) / MiB, '.0f') + ' MiB; --s3-full for all of it)'}, "
            "to `s3://bucket/...` against moto's S3 server, run in a thread of the "
            "benchmark's parent process on the same 2 CPUs (its request handling competes with the ranks, so these times "
            "measure the request pattern more than the library). Requests counted at the server by method, first round. "
            "Requests at open: `tsckpt.open` and `tsckpt.metadata` in a fresh process. DCP: torch has no S3 storage "
            "writer or reader, so there is no DCP row.",
            "",
            *s3_table(results["s3"]),
            "",
        ]
    if "single" in results:
        lines += [
            f"### One process: {results['n_leaves']:,} tensors, unsharded",
            "",
            "The same tensors, whole, saved once by one process with tsckpt (both layouts) and safetensors `save_file`, "
            "then restored in fresh processes: `tsckpt.restore(dir, target, inplace=True)`, `tsckpt.restore(dir)` "
            "(numpy arrays) and `load_file` (memory-mapped). Every restored tensor is summed after the call (included "
            "in the time: it makes the memory-mapped load read its pages). The files are evicted from the page cache "
            "before each restore.",
            "",
            *single_table(results["single"]),
            "",
        ]
    lines += ["### Targets", "", *targets(results), ""]
    return "\n".join(lines)


def print_profiles(profile_dir: str, top: int = 30) -> None:
    import pstats

    for name in sorted(os.listdir(profile_dir)):
        log(f"==== {name} (cumulative)")
        pstats.Stats(os.path.join(profile_dir, name), stream=sys.stderr).sort_stats("cumulative").print_stats(top)


def main() -> None:
    p = bench_parser(__doc__, repeats=3)
    p.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    p.add_argument("--json", default=None, help="write the raw measurements here")
    p.add_argument("--s3-full", action="store_true", help="run the S3 part on the full state (default: a tenth of it)")
    p.add_argument("--profile", action="store_true", help="cProfile each timed call (rank 0); print the top functions")
    p.add_argument("--report", default=None, metavar="JSON", help="only print (with --write-results, write) the section "
                   "from measurements saved earlier with --json")
    p.add_argument("--rank-job", default=None, help="==SUPPRESS==")
    args = p.parse_args()
    if args.rank_job is not None:
        rank_entry(rank_main, json.loads(args.rank_job))
        return
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    if args.report is not None:
        with open(args.report) as f:
            results = json.load(f)
        args.quick, args.repeats, args.s3_full = results["quick"], results["rounds"], results["s3_full"]
        section = report(results, args)
        print(section)
        if args.write_results:
            write_section(SECTION, section)
        return
    if args.quick and "--repeats" not in sys.argv and "--rounds" not in sys.argv:
        args.repeats = 1
    parts = args.only or list(PARTS)
    base = tempfile.mkdtemp(prefix="tsckpt-bench-scale-", dir=args.dir)
    args.profile_dir = os.path.join(base, "profiles") if args.profile else None
    if args.profile_dir:
        os.makedirs(args.profile_dir)
    results: dict[str, Any] = {"machine": machine_info(), "quick": args.quick, "rounds": args.repeats,
                               "s3_full": args.s3_full, "n_leaves": len(leaves(args.quick))}
    log(f"load average at start: {results['machine']['load_avg']}")
    t0 = time.time()
    try:
        if "dist" in parts:
            results["dist"] = bench_dist(base, args)
        if "s3" in parts:
            results["s3"] = bench_s3(args)
        if "single" in parts:
            results["single"] = bench_single(base, args)
        if args.profile_dir:
            print_profiles(args.profile_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["wall_s"] = time.time() - t0
    results["load_end"] = os.getloadavg()
    finish(results, args, report, SECTION)


if __name__ == "__main__":
    main()
