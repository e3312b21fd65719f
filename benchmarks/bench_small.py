#!/usr/bin/env python
"""Many small leaves: save and restore of bench_core's "small" workload (10,000 float32
tensors of 1-64 KiB, the same tensors) with tsckpt's two layouts against DCP and
safetensors, in the same rounds; and what the file system charges for the files alone.

Cases (each in a fresh process; every library imported and the tree built before the
timer starts; dirty pages synced before every save):
  save     tsckpt (default), tsckpt plain, tsckpt compact, dcp (FileSystemWriter,
           sync_files=True), safetensors+fsync (save_file, fsync of file and directory)
  files    the plain layout's directories and files without tsckpt: per leaf a mkdir of
           the leaf, then zarr.json and the chunk file c.0 beside it (format 3: a one-file
           array's key) written with open/write/close, then one syncfs(): the file
           system's share of a plain save
  restore  warm (every file of the checkpoint read just before the child starts):
           tsckpt.restore(dir) of each layout, safetensors load_file, dcp.load into a
           preallocated target; every tensor is summed afterwards (timed), as bench_core does

A/B: ``--base DIR`` also runs every tsckpt case with the tsckpt checkout at DIR (on
PYTHONPATH), alternating with this one case by case (which goes first alternates by
round); each checkout restores the checkpoint it saved. Rounds rotate the case order.
The report gives medians of wall and CPU seconds (user + system, this process and its
threads) and, per round, tsckpt over DCP; the load average is printed beside each round,
as the CPU seconds are steadier than wall time on a shared machine.

Usage
  python benchmarks/bench_small.py                         # 5 rounds, every case
  python benchmarks/bench_small.py --base /tmp/ab-main     # A/B against another checkout
  python benchmarks/bench_small.py --cases "save:tsckpt plain,save:dcp" --rounds 3
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import bench_parser, drop_caches, finish, machine_info, make_resident, run_child  # noqa: E402

TITLE = "## Many small leaves: save with each layout, against DCP and safetensors"
SAVES = ("tsckpt (default)", "tsckpt plain", "tsckpt compact", "dcp", "safetensors+fsync", "files")
RESTORES = ("tsckpt plain", "tsckpt compact", "safetensors", "dcp")
# which save's files each restore reads
SOURCE = {"tsckpt plain": "tsckpt plain", "tsckpt compact": "tsckpt compact", "safetensors": "safetensors+fsync",
          "dcp": "dcp"}
HERE = os.path.dirname(os.path.abspath(__file__))


def cpu() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


def tree(spec: dict[str, Any]) -> dict[str, Any]:
    import bench_core

    return bench_core.make_tree({"workload": "small", "quick": spec["quick"]})


def child_save(spec: dict[str, Any]) -> dict[str, Any]:
    lib, path = spec["lib"], spec["path"]
    import bench_core

    bench_core.preimport()
    state = tree(spec)
    drop_caches() or os.sync()
    (u0, s0), t0 = cpu(), time.perf_counter()
    if lib.startswith("tsckpt"):
        import tsckpt

        layout = lib.split()[1] if lib != "tsckpt (default)" else None
        tsckpt.save(path, state, **({"layout": layout} if layout else {}))
    elif lib == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    elif lib == "safetensors+fsync":
        from safetensors.torch import save_file

        os.makedirs(path)
        save_file(state, os.path.join(path, "ckpt.safetensors"))
        bench_core.fsync_path(os.path.join(path, "ckpt.safetensors"))
    elif lib == "files":
        plain_files(path, state)
    else:
        raise ValueError(lib)
    (u1, s1), t1 = cpu(), time.perf_counter()
    return {"time": t1 - t0, "user": u1 - u0, "sys": s1 - s0, "cpu": u1 - u0 + s1 - s0}


def plain_files(path: str, state: dict[str, Any]) -> None:
    """The plain layout's directories and files, written with plain system calls."""
    os.mkdir(path)
    node = b'{"zarr_format":3,"node_type":"array"}' + b" " * 300
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    for name, t in state.items():
        leaf = os.path.join(path, name)
        os.mkdir(leaf)
        for file, data in ((os.path.join(leaf, "c.0"), t.numpy()), (os.path.join(leaf, "zarr.json"), node)):
            fd = os.open(file, flags, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        ctypes.CDLL(None).syncfs(fd)
    finally:
        os.close(fd)


def child_restore(spec: dict[str, Any]) -> dict[str, Any]:
    lib, path = spec["lib"], spec["path"]
    import bench_core

    bench_core.preimport()
    names = [k for k, _ in bench_core.shapes("small", spec["quick"])]
    target = bench_core.zeros_tree({"workload": "small", "quick": spec["quick"]}) if lib == "dcp" else None
    (u0, s0), t0 = cpu(), time.perf_counter()
    if lib.startswith("tsckpt"):
        import tsckpt

        out = tsckpt.restore(path)
    elif lib == "safetensors":
        from safetensors.torch import load_file

        out = load_file(os.path.join(path, "ckpt.safetensors"))
    elif lib == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        out = target
    else:
        raise ValueError(lib)
    t1 = time.perf_counter()
    total = bench_core.touch(out[k] for k in names)
    (u1, s1), t2 = cpu(), time.perf_counter()
    return {"time": t2 - t0, "load_s": t1 - t0, "user": u1 - u0, "sys": s1 - s0, "cpu": u1 - u0 + s1 - s0,
            "checksum": total}


def files_and_bytes(path: str) -> tuple[int, int]:
    n = size = 0
    for root, dirs, names in os.walk(path):
        n += len(names) + len(dirs)
        size += sum(os.path.getsize(os.path.join(root, f)) for f in names)
    return n, size


def run(script_env: dict[str, str] | None, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    return run_child(os.path.abspath(__file__), spec, timeout, env=script_env)


def order(trees: dict[str, Any], rnd: int) -> list[str]:
    """The A/B pair in round ``rnd``: this checkout first in even rounds, the base first in odd ones."""
    names = list(trees)
    return names if rnd % 2 == 0 else names[::-1]


def measure(args: Any) -> dict[str, Any]:
    cases = args.cases.split(",") if args.cases else [f"save:{s}" for s in SAVES] + [f"restore:{r}" for r in RESTORES]
    trees = {"this": {"PYTHONPATH": os.path.dirname(HERE)}}
    if args.base:
        trees["base"] = {"PYTHONPATH": os.path.abspath(args.base)}
    base = tempfile.mkdtemp(prefix="bench_small_", dir=args.dir)
    runs: list[dict[str, Any]] = []
    buf = bytearray(64 << 20)
    try:
        saves = [c.split(":", 1)[1] for c in cases if c.startswith("save:")]
        restores = [c.split(":", 1)[1] for c in cases if c.startswith("restore:")]
        for rnd in range(args.repeats):
            load = os.getloadavg()[0]
            k = rnd % max(len(saves), 1)
            for lib in saves[k:] + saves[:k]:
                for tree_name in (order(trees, rnd) if lib.startswith("tsckpt") else ["this"]):
                    path = os.path.join(base, f"{tree_name}-{lib}")
                    shutil.rmtree(path, ignore_errors=True)
                    r = run(trees[tree_name], {"op": "save", "lib": lib, "path": path, "quick": args.quick}, args.timeout)
                    r.update(op="save", lib=lib, tree=tree_name, round=rnd, load=load, entries=files_and_bytes(path)[0])
                    runs.append(r)
                    print(f"round {rnd} load {load:.1f} save {lib:18s} {tree_name}: {r['time']:.2f} s, "
                          f"cpu {r['cpu']:.2f} (user {r['user']:.2f}, sys {r['sys']:.2f}), {r['entries']} entries",
                          file=sys.stderr, flush=True)
            k = rnd % max(len(restores), 1)
            for lib in restores[k:] + restores[:k]:
                for tree_name in (order(trees, rnd) if lib.startswith("tsckpt") else ["this"]):
                    # each checkout restores its own save (a newer format is refused by an older reader)
                    src = os.path.join(base, f"{tree_name if lib.startswith('tsckpt') else 'this'}-{SOURCE[lib]}")
                    make_resident(src, buf)
                    r = run(trees[tree_name], {"op": "restore", "lib": lib, "path": src, "quick": args.quick},
                            args.timeout)
                    r.update(op="restore", lib=lib, tree=tree_name, round=rnd, load=os.getloadavg()[0])
                    runs.append(r)
                    print(f"round {rnd} restore {lib:16s} {tree_name}: {r['time']:.2f} s (load {r['load_s']:.2f}), "
                          f"cpu {r['cpu']:.2f}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"machine": machine_info(), "runs": runs, "quick": args.quick, "rounds": args.repeats,
            "trees": {k: v["PYTHONPATH"] for k, v in trees.items()}}


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(results: dict[str, Any], args: Any = None) -> str:
    runs = results["runs"]
    m = results["machine"]
    n = 1000 if results["quick"] else 10_000
    loads = [r["load"] for r in runs]
    lines = [TITLE, "", f"{m['date']}, {m['nproc']} CPUs ({m['cpu']}), {n:,} float32 tensors of 1-64 KiB, "
             f"{results['rounds']} rounds, load average {min(loads):.1f}-{max(loads):.1f} during the run. "
             "Wall and CPU (user + system) seconds, medians; \"/ dcp\" is the median over rounds of the "
             "ratio to DCP in the same round.", ""]
    for op in ("save", "restore"):
        keys = sorted({(r["lib"], r["tree"]) for r in runs if r["op"] == op}, key=lambda k: (k[1] != "this", k[0]))
        if not keys:
            continue
        dcp = {r["round"]: r for r in runs if r["op"] == op and r["lib"] == "dcp"}
        lines += [f"| {op} | tsckpt | wall s | CPU s | user s | sys s | / dcp (wall) | / dcp (CPU) |"
                  + (" entries |" if op == "save" else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if op == "save" else "")]
        for lib, tree_name in keys:
            rs = [r for r in runs if r["op"] == op and r["lib"] == lib and r["tree"] == tree_name]
            ratio = [r["time"] / dcp[r["round"]]["time"] for r in rs if r["round"] in dcp]
            cratio = [r["cpu"] / dcp[r["round"]]["cpu"] for r in rs if r["round"] in dcp]
            where = results["trees"][tree_name] if lib.startswith("tsckpt") else ""
            label = "this" if tree_name == "this" else f"base ({os.path.basename(where.rstrip('/'))})"
            cells = [lib, label if lib.startswith("tsckpt") else "", f"{med([r['time'] for r in rs]):.2f}",
                     f"{med([r['cpu'] for r in rs]):.2f}", f"{med([r['user'] for r in rs]):.2f}",
                     f"{med([r['sys'] for r in rs]):.2f}", f"{med(ratio):.2f}x", f"{med(cratio):.2f}x"]
            if op == "save":
                cells.append(f"{rs[0]['entries']:,}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = bench_parser(__doc__, 5)
    ap.add_argument("--base", default=None, help="root of another tsckpt checkout to A/B against")
    ap.add_argument("--cases", default=None, help='comma-separated "save:NAME" / "restore:NAME" (default: all)')
    ap.add_argument("--json", default=None, help="write raw measurements here")
    ap.add_argument("--from-json", default=None, help="report from a --json file, measuring nothing")
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        out = child_save(spec) if spec["op"] == "save" else child_restore(spec)
        print(json.dumps(out))
        return
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        results = measure(args)
    finish(results, args, report, TITLE)


if __name__ == "__main__":
    main()
