#!/usr/bin/env python
"""Object-store benchmark: save and restore against a local S3 server whose every request
is delayed by 20 ms (as the round trip to a store in another zone would be), counting the
requests; tsckpt's plain and compact layouts against torch.distributed.checkpoint (DCP)
through fsspec and s3fs, on the same server in the same run.

Workloads
  large   --mib MiB (default 1,024) of float32 in 16 MiB tensors (64 for 1 GiB)
  small   --leaves float32 tensors (default 10,000) of 1-64 KiB each (random sizes, fixed seed)

Systems
  tsckpt plain     tsckpt.save(url, state) / tsckpt.restore(url, target, inplace=True)
  tsckpt compact   the same with layout="compact"
  compact, before  the compact checkpoint restored by tsckpt as it was before its readers
                   coalesced reads (--before DIR: a checkout of that tsckpt; its package
                   is imported from DIR instead of this one); skipped without --before
  DCP              dcp.save / dcp.load with FsspecWriter / FsspecReader (s3fs), defaults

Every save and restore runs in a fresh process (one per call), one process, no process
group; times run from just before the call to just after it (the restore target, zero
tensors, is made before). The server (moto's, on 127.0.0.1) runs in a thread of this
process and counts the requests of each call by method; the 20 ms are added there, before
each request is served, requests being served concurrently. Restored values are checked
exactly after timing.

DCP needs s3fs (``pip install tsckpt[bench]``). Where its aiobotocore would need another
botocore than the one installed, install it into a virtual environment made with
``python -m venv --system-site-packages`` and run this script with that interpreter;
without s3fs the DCP rows are skipped, with a line saying so.

Usage
  python benchmarks/bench_s3.py --mib 64 --leaves 1000     # a quick run
  python benchmarks/bench_s3.py --write-results            # 1 GiB and 10,000 leaves; rewrite
                                                           # the "Object storage" section of RESULTS.md
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import LocalS3, bench_parser, finish, machine_info  # noqa: E402

TITLE = "## Object storage: restore by few large requests"
SEED = 0
MiB = 1 << 20
LARGE_TENSOR_MIB = 16
SYSTEMS = ("tsckpt plain", "tsckpt compact", "compact, before", "DCP")


def shapes(workload: str, mib: int, leaves: int) -> list[tuple[str, tuple[int, ...]]]:
    if workload == "large":
        n = max(1, mib // LARGE_TENSOR_MIB)
        per = min(mib, LARGE_TENSOR_MIB) * MiB // 4
        return [(f"t{i:03d}", (per // 1024, 1024)) for i in range(n)]
    import numpy as np

    nbytes = np.random.default_rng(SEED).integers(1024, 64 * 1024, size=leaves, endpoint=True)
    return [(f"t{i:05d}", (int(b) // 4,)) for i, b in enumerate(nbytes)]


def make_tree(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    return {k: torch.empty(s).uniform_(-1, 1, generator=g)
            for k, s in shapes(spec["workload"], spec["mib"], spec["leaves"])}


def has_s3fs() -> bool:
    return importlib.util.find_spec("s3fs") is not None


# --------------------------------------------------------------------------
# one call, in a fresh process


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    tree = make_tree(spec)
    system, url = spec["system"], spec["url"]
    if spec["op"] == "restore":
        target = {k: torch.zeros_like(v) for k, v in tree.items()}
    if system == "DCP":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        kw = {"endpoint_url": spec["endpoint"]}
        start, cpu = time.perf_counter(), time.process_time()
        if spec["op"] == "save":
            dcp.save(tree, storage_writer=FsspecWriter(url, **kw))
        else:
            dcp.load(target, storage_reader=FsspecReader(url, **kw))
    else:
        import tsckpt

        layout = "plain" if system == "tsckpt plain" else "compact"
        start, cpu = time.perf_counter(), time.process_time()
        if spec["op"] == "save":
            tsckpt.save(url, tree, layout=layout)
        else:
            tsckpt.restore(url, target, inplace=True)
    out = {"time": time.perf_counter() - start, "cpu": time.process_time() - cpu}
    if spec["op"] == "restore":
        out["exact"] = all(torch.equal(target[k], v) for k, v in tree.items())
    return out


def run_child(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``spec`` in a fresh interpreter (this one); its last stdout line is the JSON result."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{spec}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# the parent: the server, the cases, the report


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def counted(s3: LocalS3, phase: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one call with the server counting its requests."""
    s3.take_counts()
    s3.set_phase(phase)
    try:
        out = run_child(spec, env, timeout)
    finally:
        s3.set_phase(None)
    out["requests"] = s3.take_counts().get(phase, {})
    return out


def bench_workload(s3: LocalS3, workload: str, systems: list[str], args: Any) -> dict[str, Any]:
    env = {**s3.env(), "AWS_REGION": "us-east-1"}
    before = {**env, "PYTHONPATH": os.path.abspath(args.before or "")}
    rows: dict[str, Any] = {}
    base = {"workload": workload, "mib": args.mib, "leaves": args.leaves, "endpoint": s3.url}
    compact_url = None
    for system in systems:
        prefix = f"{uuid.uuid4().hex}/{workload}"
        url = f"s3://{s3.BUCKET}/{prefix}"
        row: dict[str, Any] = {}
        if system == "compact, before":
            if compact_url is None:
                continue
            url = compact_url
        else:
            log(f"{workload}: {system} save")
            row["save"] = counted(s3, "save", {**base, "system": system, "op": "save", "url": url}, env, args.timeout)
            row["objects"], row["stored"] = s3.objects(prefix)
        log(f"{workload}: {system} restore")
        row["restore"] = counted(s3, "restore", {**base, "system": system, "op": "restore", "url": url},
                                 before if system == "compact, before" else env, args.timeout)
        rows[system] = row
        if system == "tsckpt compact" and "compact, before" in systems:
            compact_url = url
        elif url != compact_url:
            s3.delete(prefix)
    if compact_url is not None:
        s3.delete(compact_url.split("/", 3)[3])
    nbytes = sum(4 * (s[0] * (s[1] if len(s) > 1 else 1)) for _, s in shapes(workload, args.mib, args.leaves))
    return {"rows": rows, "leaves": len(shapes(workload, args.mib, args.leaves)), "nbytes": nbytes}


def measure(args: Any) -> dict[str, Any]:
    systems = [s for s in SYSTEMS if s != "compact, before" or args.before]
    dcp_note = None
    if not has_s3fs():
        systems.remove("DCP")
        dcp_note = (f"DCP skipped: s3fs is not installed for {sys.executable} (pip install s3fs, see this "
                    "script's docstring)")
        log(dcp_note)
    s3 = LocalS3(delay=args.latency_ms / 1000, ranges=True)
    try:
        results = {"machine": machine_info(), "latency_ms": args.latency_ms, "dcp_note": dcp_note, "workloads": {}}
        for workload in args.workloads:
            results["workloads"][workload] = bench_workload(s3, workload, systems, args)
    finally:
        s3.close()
    return results


# --------------------------------------------------------------------------
# report


def fmt_requests(req: dict[str, int]) -> str:
    total = sum(req.values())
    return f"{total:,} (" + ", ".join(f"{m} {n:,}" for m, n in sorted(req.items())) + ")" if req else "0"


def report(results: dict[str, Any], args: Any) -> str:
    m = results["machine"]
    lines = [
        TITLE, "",
        f"Run {m['date']} by `python benchmarks/bench_s3.py{' --mib ' + str(args.mib) if args.mib != 1024 else ''}"
        f"{' --leaves ' + str(args.leaves) if args.leaves != 10_000 else ''}` on {m['nproc']} CPUs ({m['cpu']}), "
        f"Python {m['python']}; torch {m['torch']}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt']} "
        f"({m['tsckpt_rev']}). Load average at start: {', '.join(f'{x:.1f}' for x in m['load_avg'])}.",
        "",
        f"moto's S3 server on 127.0.0.1 with {results['latency_ms']:g} ms added before every request; each call in a "
        "fresh process, one run each; requests counted at the server by method. Restores are in place into zero "
        "tensors made before the timer; every value is checked after timing. \"compact, before\": the same compact "
        f"checkpoint restored by tsckpt as of {args.before_rev or 'the --before checkout'} (before its readers "
        "coalesced reads). Ranged GETs are served from the range (moto itself reads the whole object for each).",
    ]
    if results.get("dcp_note"):
        lines += ["", f"**{results['dcp_note']}.**"]
    for workload, res in results["workloads"].items():
        what = (f"{res['nbytes'] / MiB:,.0f} MiB in {res['leaves']} float32 tensors" if workload == "large"
                else f"{res['leaves']:,} float32 tensors of 1-64 KiB ({res['nbytes'] / MiB:,.0f} MiB)")
        lines += ["", f"### {what}", "",
                  "| system | save (s) | save requests | objects | restore (s) | restore requests | restore requests "
                  "per 100 leaves | restore vs DCP |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        dcp = res["rows"].get("DCP", {}).get("restore", {}).get("time")
        for system, row in res["rows"].items():
            r, save = row["restore"], row.get("save")
            per100 = 100 * sum(r["requests"].values()) / res["leaves"]
            saved = (f"{save['time']:.2f} | {fmt_requests(save['requests'])} | {row['objects']:,}" if save
                     else "(the compact save) | | ")
            restored = f"{r['time']:.2f}" + ("" if r["exact"] else " (WRONG VALUES)")
            ratio = f"{r['time'] / dcp:.2f}x" if dcp else "-"
            requests = fmt_requests(r["requests"])
            lines.append(f"| {system} | {saved} | {restored} | {requests} | {per100:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_parser(__doc__, 1)
    p.add_argument("--mib", type=int, default=1024, help="MiB of the large state")
    p.add_argument("--leaves", type=int, default=10_000, help="tensors of the small state")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added before every request")
    p.add_argument("--workloads", nargs="+", default=["large", "small"], choices=["large", "small"])
    p.add_argument("--json", default=None, help="write the raw results here")
    p.add_argument("--before", default=None, help="a directory holding an older tsckpt package, for 'compact, before'")
    p.add_argument("--before-rev", default=None, help="the commit --before was taken from, for the report")
    args = p.parse_args()
    if args.quick:
        args.mib, args.leaves = 64, 1000
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    finish(measure(args), args, report, TITLE)


if __name__ == "__main__":
    main()
