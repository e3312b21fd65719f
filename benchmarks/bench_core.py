#!/usr/bin/env python
"""Core save/restore benchmark: tsckpt against torch.save, safetensors and
torch.distributed.checkpoint (single process).

Workloads
  large  1 GiB in 64 float32 tensors of 4096 x 1024 (16 MiB each)
  small  10,000 float32 tensors of 1-64 KiB each (random sizes, fixed seed)
  row    one row of a 16384 x 16384 float32 tensor (1 GiB) read with tsckpt.open

Every measurement runs in a fresh subprocess, so peak RSS (ru_maxrss) is per
case and no library benefits from another's warm state. Every library is
imported, and the data or target built, before the timer starts. Right before
each timed call, dirty pages are synced and, when the process may write
/proc/sys/vm/drop_caches (root), the page cache is dropped, so restores read
from storage; otherwise restores are reported as warm-cache.
Restores "touch the data": every restored tensor is summed, and the sum is
checked against the one computed at save time, so mmap-based loaders pay for
the bytes they hand out. Each case runs ``--repeats`` times; tables show the
best time and the spread (slowest / best - 1) as a noise indicator.

Usage
  python benchmarks/bench_core.py                  # full run (~10-15 min)
  python benchmarks/bench_core.py --quick          # small smoke run (~1-2 min)
  python benchmarks/bench_core.py --write-results  # also update benchmarks/RESULTS.md
  python benchmarks/bench_core.py --json out.json  # raw measurements
  python benchmarks/bench_core.py --only large --ab  # also tsckpt with TensorStore writing
                                                     # every file, and with whole-row chunks
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import dir_stats, machine_info, proc_io, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Core save/restore"

SEED = 1234
GiB = 1 << 30
MiB = 1 << 20

# name -> (writes with fsync/syncfs?, what it does)
SAVERS = {
    "tsckpt": (True, "tsckpt.save (fsyncs the written files, or syncfs() when there are many, before the commit)"),
    "torch.save": (False, "torch.save(tree, file)"),
    "torch.save+fsync": (True, "torch.save then fsync(file) and fsync(dir)"),
    "safetensors": (False, "safetensors.torch.save_file"),
    "safetensors+fsync": (True, "save_file then fsync(file) and fsync(dir)"),
    "dcp": (True, "dcp.save, FileSystemWriter defaults (sync_files=True), no process group"),
}
# --ab: tsckpt variants, saved in rotation with the others (not peers; nothing restores them)
VARIANTS = {
    "tsckpt (TensorStore writer)": (True, "tsckpt.save with every file encoded and written by TensorStore"),
    "tsckpt (whole-row chunks)": (True, "tsckpt.save with inner chunks of whole rows (the last dim not cut in 4)"),
}
FLOOR = "read(), 1 thread (reference)"
# restore name -> (saver whose output it reads, description)
LOADERS = {
    "tsckpt (target=None)": ("tsckpt", "tsckpt.restore(dir) -> numpy arrays"),
    "tsckpt (inplace)": ("tsckpt", "tsckpt.restore(dir, target, inplace=True), target preallocated"),
    "torch.load(mmap)": ("torch.save", "torch.load(file, mmap=True, weights_only=True)"),
    "safetensors": ("safetensors", "safetensors.torch.load_file"),
    "dcp": ("dcp", "dcp.load(target), target preallocated, no process group"),
    # a reference, not a peer: one thread reading the safetensors file into one reused buffer
    FLOOR: ("safetensors", "read() the safetensors file in 64 MiB pieces into one reused buffer, no decoding"),
}
PEER_LOADERS = [s for s in LOADERS if not s.startswith("tsckpt") and s != FLOOR]


# --------------------------------------------------------------------------
# workloads (shared by parent and children; torch imported lazily)


def shapes(workload: str, quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    if workload == "large":
        rows = 256 if quick else 4096
        return [(f"t{i:02d}", (rows, 1024)) for i in range(64)]
    if workload == "small":
        import numpy as np

        n = 1000 if quick else 10_000
        nbytes = np.random.default_rng(SEED).integers(1024, 64 * 1024, size=n, endpoint=True)
        return [(f"t{i:05d}", (int(b) // 4,)) for i, b in enumerate(nbytes)]
    raise ValueError(workload)


def row_shape(quick: bool) -> tuple[int, int]:
    return (4096, 4096) if quick else (16384, 16384)


def nbytes_of(workload: str, quick: bool) -> int:
    return sum(4 * math.prod(s) for _, s in shapes(workload, quick))


def make_tree(workload: str, quick: bool) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    return {k: torch.empty(s, dtype=torch.float32).uniform_(-1, 1, generator=g) for k, s in shapes(workload, quick)}


def zeros_tree(workload: str, quick: bool) -> dict[str, Any]:
    import torch

    return {k: torch.zeros(s, dtype=torch.float32) for k, s in shapes(workload, quick)}


def touch(values: Any) -> float:
    """Read every byte of every tensor; the float32 sums double as a checksum."""
    import numpy as np
    import torch

    total = 0.0
    for v in values:
        t = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        total += float(t.sum())
    return total


# --------------------------------------------------------------------------
# child side: one measurement per process


def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def cpu_s() -> float:
    """user + system CPU seconds of this process, all threads."""
    t = os.times()
    return t.user + t.system


def preimport() -> dict[str, float]:
    """Import every library (and torch.distributed.tensor, which dcp imports and
    tsckpt imports lazily on its first call) before any timer starts; returns the
    seconds each import took, for the record."""
    out = {}
    for mod in ("torch", "torch.distributed.tensor", "tsckpt", "safetensors.torch", "torch.distributed.checkpoint"):
        t = time.perf_counter()
        __import__(mod)
        out[mod] = time.perf_counter() - t
    return out


def fsync_path(path: str) -> None:
    for p in (path, os.path.dirname(path)):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def child_save(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    lib, path, quick = spec["lib"], spec["path"], spec["quick"]
    import_s = preimport()
    tree = make_tree(spec["workload"], quick)
    t = time.perf_counter()
    checksum = touch(tree.values())
    touch_s = time.perf_counter() - t
    rss0 = rss_now()
    if spec["drop"]:
        drop_caches()
    c0, t0 = cpu_s(), time.perf_counter()
    if lib.startswith("tsckpt"):
        import tsckpt
        import tsckpt._layout
        import tsckpt._save

        if lib == "tsckpt (TensorStore writer)":
            tsckpt._save.WRITE_THREADS = 0
        elif lib == "tsckpt (whole-row chunks)":
            tsckpt._layout.TRAILING_PIECES = 1
        tsckpt.save(path, tree)
    elif lib.startswith("torch.save"):
        os.makedirs(path)
        f = os.path.join(path, "ckpt.pt")
        torch.save(tree, f)
        if lib.endswith("+fsync"):
            fsync_path(f)
    elif lib.startswith("safetensors"):
        from safetensors.torch import save_file

        os.makedirs(path)
        f = os.path.join(path, "ckpt.safetensors")
        save_file(tree, f)
        if lib.endswith("+fsync"):
            fsync_path(f)
    elif lib == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(tree, storage_writer=dcp.FileSystemWriter(path))
    else:
        raise ValueError(lib)
    dt, cpu = time.perf_counter() - t0, cpu_s() - c0
    return {
        "time": dt,
        "cpu": cpu,
        "rss_before": rss0,
        "peak_rss": peak_rss(),
        "checksum": checksum,
        "touch_s": touch_s,
        "import_s": import_s,
    }


def child_restore(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    lib, path, quick, wl = spec["lib"], spec["path"], spec["quick"], spec["workload"]
    preimport()
    target = zeros_tree(wl, quick) if lib in ("tsckpt (inplace)", "dcp") else None
    names = [k for k, _ in shapes(wl, quick)]
    rss0 = rss_now()
    if spec["drop"]:
        drop_caches()
    c0, t0 = cpu_s(), time.perf_counter()
    if lib == "tsckpt (target=None)":
        import tsckpt

        out = tsckpt.restore(path)
    elif lib == "tsckpt (inplace)":
        import tsckpt

        out = tsckpt.restore(path, target, inplace=True)
    elif lib == "torch.load(mmap)":
        out = torch.load(os.path.join(path, "ckpt.pt"), mmap=True, weights_only=True)
    elif lib == "safetensors":
        from safetensors.torch import load_file

        out = load_file(os.path.join(path, "ckpt.safetensors"))
    elif lib == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        out = target
    elif lib == FLOOR:
        buf = bytearray(64 * MiB)
        with open(os.path.join(path, "ckpt.safetensors"), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        out = None
    else:
        raise ValueError(lib)
    t1 = time.perf_counter()
    checksum = touch(out[k] for k in names) if out is not None else float("nan")
    t2, cpu = time.perf_counter(), cpu_s() - c0
    return {
        "time": t2 - t0,
        "cpu": cpu,
        "load_s": t1 - t0,
        "touch_s": t2 - t1,
        "rss_before": rss0,
        "peak_rss": peak_rss(),
        "checksum": checksum,
    }


def child_row_save(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tsckpt

    g = torch.Generator().manual_seed(SEED)
    w = torch.empty(row_shape(spec["quick"]), dtype=torch.float32).uniform_(-1, 1, generator=g)
    t0 = time.perf_counter()
    tsckpt.save(spec["path"], {"w": w})
    dt = time.perf_counter() - t0
    return {"time": dt, "sums": {str(r): float(w[r].sum()) for r in spec["rows"]}}


def child_row_read(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np  # noqa: F401  (imported before the first measurement)
    import torch

    import tsckpt

    r1, r2 = spec["rows"]
    if spec["drop"]:
        drop_caches()
    io0 = proc_io()
    t0 = time.perf_counter()
    reader = tsckpt.open(spec["path"])
    arr = reader["w"]
    t1 = time.perf_counter()
    x = arr[r1]
    t2 = time.perf_counter()
    io1 = proc_io()
    y = arr[r2]
    t3 = time.perf_counter()
    io2 = proc_io()
    md = arr.metadata
    return {
        "open_s": t1 - t0,
        "first_row_s": t2 - t1,
        "second_row_s": t3 - t2,
        "rchar_first": io1["rchar"] - io0["rchar"],
        "read_bytes_first": io1["read_bytes"] - io0["read_bytes"],
        "rchar_second": io2["rchar"] - io1["rchar"],
        "read_bytes_second": io2["read_bytes"] - io1["read_bytes"],
        "chunk_shape": list(md.chunk_shape),
        "shard_shape": list(md.shard_shape),
        "sums": {str(r1): float(torch.from_numpy(x).sum()), str(r2): float(torch.from_numpy(y).sum())},
        "peak_rss": peak_rss(),
    }


def child_main(spec: dict[str, Any]) -> None:
    import warnings

    warnings.filterwarnings("ignore")  # dcp warns that it runs without a process group
    fn = {"save": child_save, "restore": child_restore, "row_save": child_row_save, "row_read": child_row_read}[spec["op"]]
    res = fn(spec)
    print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------
# parent side: orchestration, tables, RESULTS.md


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"case {spec} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_workload(wl: str, base: str, args: argparse.Namespace, can_drop: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"nbytes": nbytes_of(wl, args.quick), "n": len(shapes(wl, args.quick)), "save": {}, "restore": {}}
    root = os.path.join(base, wl)
    checksum = None
    savers = [*SAVERS, *(VARIANTS if args.ab else ())]
    if args.savers:
        savers = [s for s in savers if s in args.savers.split(",")]
    for rep in range(args.repeats):
        for lib in savers:
            path = os.path.join(root, lib)
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
            spec = {"op": "save", "lib": lib, "path": path, "workload": wl, "quick": args.quick, "drop": can_drop}
            r = run_child(spec, args.timeout)
            r["files"], r["bytes"] = dir_stats(path)
            checksum = r["checksum"]
            out["save"].setdefault(lib, []).append(r)
            log(f"[{wl}] save    {lib:22s} rep {rep}: {r['time']:.3f} s, {r['files']} files")
    for rep in range(args.repeats):
        for lib, (src, _) in LOADERS.items():
            if src not in savers:
                continue
            spec = {"op": "restore", "lib": lib, "path": os.path.join(root, src), "workload": wl, "quick": args.quick}
            r = run_child({**spec, "drop": can_drop}, args.timeout)
            r["ok"] = lib == FLOOR or math.isclose(r["checksum"], checksum, rel_tol=1e-9, abs_tol=1e-6)
            if not r["ok"]:
                raise RuntimeError(f"[{wl}] {lib}: restored data checksum {r['checksum']} != saved {checksum}")
            out["restore"].setdefault(lib, []).append(r)
            log(f"[{wl}] restore {lib:22s} rep {rep}: {r['time']:.3f} s (load {r['load_s']:.3f} + touch {r['touch_s']:.3f})")
    shutil.rmtree(root, ignore_errors=True)
    return out


def bench_row(base: str, args: argparse.Namespace, can_drop: bool) -> dict[str, Any]:
    path = os.path.join(base, "row")
    shape = row_shape(args.quick)
    rows = [shape[0] // 2 + 3, shape[0] - 1]  # two different shards
    shutil.rmtree(path, ignore_errors=True)
    s = run_child({"op": "row_save", "path": path, "quick": args.quick, "rows": rows}, args.timeout)
    runs = []
    for rep in range(args.repeats):
        r = run_child({"op": "row_read", "path": path, "quick": args.quick, "rows": rows, "drop": can_drop}, args.timeout)
        if r["sums"] != s["sums"]:
            raise RuntimeError(f"row read returned wrong data: {r['sums']} != {s['sums']}")
        runs.append(r)
        log(f"[row] read rep {rep}: open {r['open_s'] * 1e3:.1f} ms, row {r['first_row_s'] * 1e3:.1f} ms, rchar {r['rchar_first']}")
    # what one row needs from storage: the inner chunks it crosses (+crc32c each), the index of
    # every shard it crosses, the array's zarr.json and the root zarr.json
    chunk, shard = runs[0]["chunk_shape"], runs[0]["shard_shape"]
    n_chunks = math.prod(-(-n // c) for n, c in zip(shape[1:], chunk[1:]))
    n_shards = math.prod(-(-n // c) for n, c in zip(shape[1:], shard[1:]))
    chunk_bytes = n_chunks * (math.prod(chunk) * 4 + 4)
    n_inner = math.prod(s // c for s, c in zip(shard, chunk))
    index_bytes = n_shards * (n_inner * 16 + 4) if chunk != shard else 0
    root_json = os.path.getsize(os.path.join(path, "zarr.json"))
    array_json = os.path.getsize(os.path.join(path, "w", "zarr.json"))
    files, size = dir_stats(path)
    shutil.rmtree(path, ignore_errors=True)
    return {
        "shape": list(shape),
        "runs": runs,
        "chunk_shape": chunk,
        "shard_shape": shard,
        "expected_bytes": chunk_bytes + index_bytes + root_json + array_json,
        "expected_parts": {
            "chunks": chunk_bytes,
            "n_chunks": n_chunks,
            "shard_index": index_bytes,
            "n_shards": n_shards,
            "array_zarr_json": array_json,
            "root_zarr_json": root_json,
        },
        "files": files,
        "bytes": size,
    }




# ---- formatting ------------------------------------------------------------


def best(runs: list[dict[str, Any]], key: str = "time") -> float:
    return min(r[key] for r in runs)


def spread(runs: list[dict[str, Any]]) -> str:
    ts = [r["time"] for r in runs]
    return f"{(max(ts) / min(ts) - 1) * 100:.0f}%" if len(ts) > 1 else "-"


def fmt_mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def save_table(res: dict[str, Any]) -> list[str]:
    nb = res["nbytes"]
    peers = {k: best(v) for k, v in res["save"].items() if not k.startswith("tsckpt")}
    best_peer = min(peers.values())
    best_sync = min(v for k, v in peers.items() if SAVERS[k][0])
    lines = [
        "| save | fsync | time (s) | GB/s | vs fastest peer | vs fastest syncing peer | CPU (s) | files | peak RSS (MiB) | RSS over baseline (MiB) | spread |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lib, runs in res["save"].items():
        t = best(runs)
        r = min(runs, key=lambda r: r["time"])
        lines.append(
            f"| {lib} | {'yes' if {**SAVERS, **VARIANTS}[lib][0] else 'no'} | {t:.3f} | {nb / t / 1e9:.2f} | {fmt_ratio(t / best_peer)} | "
            f"{fmt_ratio(t / best_sync)} | {min(x['cpu'] for x in runs):.2f} | {r['files']:,} | {fmt_mib(max(x['peak_rss'] for x in runs))} | "
            f"{fmt_mib(max(x['peak_rss'] - x['rss_before'] for x in runs))} | {spread(runs)} |"
        )
    return lines


def restore_table(res: dict[str, Any]) -> list[str]:
    nb = res["nbytes"]
    best_peer = min(best(v) for k, v in res["restore"].items() if k in PEER_LOADERS)
    lines = [
        "| restore (data touched) | time (s) | GB/s | vs fastest peer | vs safetensors | vs dcp | load / touch (s) | CPU (s) | peak RSS (MiB) | RSS over baseline (MiB) | spread |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    st, dc = best(res["restore"]["safetensors"]), best(res["restore"]["dcp"])
    for lib, runs in res["restore"].items():
        t = best(runs)
        r = min(runs, key=lambda r: r["time"])
        lines.append(
            f"| {lib} | {t:.3f} | {nb / t / 1e9:.2f} | {fmt_ratio(t / best_peer)} | {fmt_ratio(t / st)} | {fmt_ratio(t / dc)} | "
            f"{r['load_s']:.3f} / {r['touch_s']:.3f} | {min(x['cpu'] for x in runs):.2f} | {fmt_mib(max(x['peak_rss'] for x in runs))} | "
            f"{fmt_mib(max(x['peak_rss'] - x['rss_before'] for x in runs))} | {spread(runs)} |"
        )
    return lines


def verdict(ok: bool) -> str:
    return "**pass**" if ok else "**miss**"


def targets(results: dict[str, Any]) -> list[str]:
    out = []
    L, S, R = results["large"], results["small"], results["row"]
    ts_save = best(L["save"]["tsckpt"])
    sync_peers = {k: best(v) for k, v in L["save"].items() if not k.startswith("tsckpt") and SAVERS[k][0]}
    fastest_sync = min(sync_peers, key=sync_peers.get)
    ratio = ts_save / sync_peers[fastest_sync]
    out.append(
        f"| 1 GiB save <= 1.1x fastest syncing peer | {verdict(ratio <= 1.1)} | {ts_save:.3f} s vs {fastest_sync} "
        f"{sync_peers[fastest_sync]:.3f} s = {ratio:.2f}x |"
    )
    st, dc = best(L["restore"]["safetensors"]), best(L["restore"]["dcp"])
    for lib in ("tsckpt (target=None)", "tsckpt (inplace)"):
        t = best(L["restore"][lib])
        out.append(f"| 1 GiB restore, {lib}, <= 1.2x safetensors | {verdict(t / st <= 1.2)} | {t:.3f} s vs {st:.3f} s = {t / st:.2f}x |")
        out.append(f"| 1 GiB restore, {lib}, <= 0.5x dcp | {verdict(t / dc <= 0.5)} | {t:.3f} s vs {dc:.3f} s = {t / dc:.2f}x |")
    rchar = max(r["rchar_first"] for r in R["runs"])
    out.append(
        f"| one-row read touches <= 4 MiB | {verdict(rchar <= 4 * MiB)} | {rchar / MiB:.2f} MiB read (rchar), "
        f"{R['expected_bytes'] / MiB:.2f} MiB expected from the layout |"
    )
    a, b = best(S["save"]["tsckpt"]), best(S["save"]["dcp"])
    out.append(f"| 10k small: save no slower than dcp | {verdict(a <= b)} | {a:.3f} s vs {b:.3f} s = {a / b:.2f}x |")
    for lib in ("tsckpt (target=None)", "tsckpt (inplace)"):
        a, b = best(S["restore"][lib]), best(S["restore"]["dcp"])
        out.append(f"| 10k small: restore ({lib}) no slower than dcp | {verdict(a <= b)} | {a:.3f} s vs {b:.3f} s = {a / b:.2f}x |")
    return out


def dtensor_import_s(results: dict[str, Any]) -> float:
    ts = sorted(r["import_s"]["torch.distributed.tensor"] for runs in results["large"]["save"].values() for r in runs)
    return ts[len(ts) // 2]


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    L, S, R = results["large"], results["small"], results["row"]
    E = R["expected_parts"]
    cache = "cold (dirty pages synced and page cache dropped right before every timed call)" if results["cold_cache"] else "WARM (page cache could not be dropped)"
    lines = [
        SECTION,
        "",
        f"Run {m['date']}{' (--quick smoke run: sizes reduced, not comparable)' if args.quick else ''}; "
        f"{args.repeats} runs per case, best shown, spread = slowest/best - 1. "
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python {m['python']}; "
        f"torch {m['torch']}, tensorstore {m['tensorstore']}, safetensors {m['safetensors']}, "
        f"tsckpt {m['tsckpt']} ({m['tsckpt_rev']}). Load average at start: "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])} (the machine is shared, so timings are noisy). "
        f"Restores: {cache}. Every case runs in a fresh process; GB/s = 1e9 bytes/s of tensor data; "
        "peak RSS is the child's ru_maxrss (includes the tree or target); 'over baseline' subtracts the RSS "
        "just before the timed call; CPU = user + system seconds of all the child's threads during the call "
        "(less sensitive to other load than wall time). Libraries are imported before the timer; "
        f"torch.distributed.tensor too (dcp imports it; tsckpt imports it lazily on its first save/restore, which "
        f"costs a fresh process about {dtensor_import_s(results):.2f} s, warm cache, not included below). "
        "Restore times include summing every tensor (the 'touch'); 'load / touch' splits them. "
        f"'{FLOOR}' is a reference, not a peer: one thread read()s the safetensors file cold into a reused "
        "64 MiB buffer, no decoding and no allocation: what plain sequential reading costs on this storage "
        "(loaders that read with several threads, or fault pages in with readahead, can beat it).",
        "",
        f"### 1 GiB in 64 float32 tensors ({L['nbytes'] / MiB:,.0f} MiB)",
        "",
        *save_table(L),
        "",
        *restore_table(L),
        "",
        f"### {S['n']:,} small float32 tensors, 1-64 KiB ({S['nbytes'] / MiB:,.0f} MiB)",
        "",
        *save_table(S),
        "",
        *restore_table(S),
        "",
        f"### One row of a {R['shape'][0]} x {R['shape'][1]} float32 tensor with tsckpt.open",
        "",
        f"Layout: shard {R['shard_shape']} ({R['files']} files), inner chunk {R['chunk_shape']}. "
        f"Expected bytes for one row: {E['n_chunks']} inner chunks {E['chunks']:,} + {E['n_shards']} shard index "
        f"{E['shard_index']:,} + array zarr.json {E['array_zarr_json']:,} + root zarr.json {E['root_zarr_json']:,} "
        f"= {R['expected_bytes']:,} bytes ({R['expected_bytes'] / MiB:.2f} MiB). rchar = bytes returned by read "
        "syscalls, read_bytes = bytes fetched from the block device (includes readahead, and for the first read "
        "also the library code paged in on first use), both /proc/self/io deltas in a fresh process whose page "
        "cache was dropped after its imports.",
        "",
        "| run | open (ms) | first row, cold (ms) | rchar | read_bytes | second row, other shard (ms) | rchar | read_bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(R["runs"]):
        lines.append(
            f"| {i + 1} | {r['open_s'] * 1e3:.1f} | {r['first_row_s'] * 1e3:.1f} | {r['rchar_first']:,} | {r['read_bytes_first']:,} | "
            f"{r['second_row_s'] * 1e3:.1f} | {r['rchar_second']:,} | {r['read_bytes_second']:,} |"
        )
    lines += [
        "",
        "### Targets",
        "",
        "| target | result | figures |",
        "|---|---|---|",
        *targets(results),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 run per case: a smoke test")
    ap.add_argument("--repeats", type=int, default=None, help="runs per case (default 3, 1 with --quick)")
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a new temporary directory)")
    ap.add_argument("--json", default=None, help="write raw measurements here")
    ap.add_argument("--write-results", action="store_true", help=f"replace the '{SECTION}' section of RESULTS.md")
    ap.add_argument("--only", choices=["large", "small", "row"], action="append", help="run only these parts")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per case")
    ap.add_argument("--ab", action="store_true", help="also save with tsckpt variants: " + ", ".join(VARIANTS))
    ap.add_argument("--savers", default=None, help="comma-separated savers to run (default: all); restores only read what ran")
    ap.add_argument("--from-json", default=None, help="measure nothing: report (and --write-results) from a --json file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        args.quick, args.repeats = results["quick"], results["repeats"]
        section = report(results, args)
        print(section)
        if args.write_results:
            write_section(SECTION, section)
        return
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    parts = args.only or ["large", "small", "row"]
    base = tempfile.mkdtemp(prefix="tsckpt-bench-", dir=args.dir)
    t0 = time.time()
    try:
        can_drop = drop_caches()
        if not can_drop:
            log("cannot drop the page cache (not root?): restores are warm-cache")
        results: dict[str, Any] = {"machine": machine_info(), "cold_cache": can_drop, "quick": args.quick, "repeats": args.repeats}
        for part in parts:
            results[part] = bench_row(base, args, can_drop) if part == "row" else bench_workload(part, base, args, can_drop)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["wall_s"] = time.time() - t0
    log(f"total {results['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if set(parts) == {"large", "small", "row"}:
        section = report(results, args)
        print(section)
        if args.write_results:
            write_section(SECTION, section)
    else:
        print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1)[:20000])


if __name__ == "__main__":
    main()
