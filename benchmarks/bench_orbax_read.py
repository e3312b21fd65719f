#!/usr/bin/env python
"""Orbax reads at tsckpt's own cost: an Orbax checkpoint restored into column-sharded jax
targets by 2 JAX processes, bytes read and memory after the restore, against Orbax's own.

Workload
  Two checkpoints written by orbax-checkpoint's StandardCheckpointer (its defaults: OCDBT,
  zarr v2) from one process of 4 CPU devices, each of float32 arrays of R x C (one with
  --quick, four without): "rows"
  saved P('x') (chunks of R/4 rows), "cols" saved P(None, 'x') (chunks of C/4 columns).
  Random values, so chunks barely compress and the bytes stored are about the bytes owned.

Systems (2 processes x 2 CPU devices under jax.distributed, each a fresh interpreter)
  tsckpt         tsckpt.restore(dir, targets): this tree
  tsckpt-before  the same call on another source tree (--before DIR), e.g. the commit
                 before a change
  orbax          StandardCheckpointer().restore(dir, the same abstract targets)
  Targets: jax.ShapeDtypeStruct sharded P(None, ('p', 'd')) over the global 2 x 2 mesh, so
  each process owns half the columns of every array, in two device slices.

Measures, per process (the larger of the two)
  read      bytes TensorStore's file kvstore read during the restore (its own metrics,
            which count Orbax's reads as well), over the bytes the process owns. Column
            chunks allow 1.0 (its own chunks); row chunks need every chunk its columns lie
            in, the whole array: 2.0 is the chunking's own cost
  time      wall time of the restore call
  after     anonymous RSS after the restore, the result deleted (jax frees buffers
            asynchronously: 0.2 s given), over the same before it; after the first restore
            and after the last of --restores in one process
  Values are checked against the saved ones.

Usage
  python benchmarks/bench_orbax_read.py --quick --before /path/to/old/tree
  python benchmarks/bench_orbax_read.py --write-results
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from _common import bench_parser, free_port, machine_info, write_section

SECTION = "## Orbax reads into column-sharded jax targets: bytes read and memory after"
MiB = 1 << 20
KINDS = ("rows", "cols")  # the stored chunking of each checkpoint
_READ_METRICS = ("/tensorstore/kvstore/file/bytes_read", "/tensorstore/file/mmap_bytes")


def shapes(quick: bool) -> dict[str, tuple[int, int]]:
    """Arrays larger than a restore's window (32 MiB), so slices' reads of one chunk do not
    all run at once (TensorStore then merges them by chance)."""
    return {f"a{i}": (2048, 16384) for i in range(1 if quick else 4)}


def value(name: str, shape: tuple[int, int]) -> Any:
    import numpy as np

    return np.random.default_rng(sum(map(ord, name))).standard_normal(shape, dtype=np.float32)


def child_write(spec: dict[str, Any]) -> dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    tree = {
        k: jax.device_put(value(k, s), NamedSharding(mesh, P("x") if spec["kind"] == "rows" else P(None, "x")))
        for k, s in shapes(spec["quick"]).items()
    }
    with ocp.StandardCheckpointer() as ck:
        ck.save(spec["path"], tree)
        ck.wait_until_finished()
    return {}


def _bytes_read() -> int:
    import tensorstore as ts

    return sum(m["values"][0]["value"] for m in ts.experimental_collect_matching_metrics("/tensorstore/")
               if m["name"] in _READ_METRICS)


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024


def child_restore(spec: dict[str, Any]) -> dict[str, Any]:
    import gc
    import time

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize(f"127.0.0.1:{spec['port']}", num_processes=2, process_id=spec["process"],
                               initialization_timeout=120)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("p", "d"))
    sharding = NamedSharding(mesh, P(None, ("p", "d")))
    sh = shapes(spec["quick"])
    abstract = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding) for k, s in sh.items()}
    if spec["system"] == "orbax":
        import orbax.checkpoint as ocp

        ck = ocp.StandardCheckpointer()

        def restore() -> Any:
            return ck.restore(spec["path"], abstract)
    else:
        import tsckpt

        def restore() -> Any:
            return tsckpt.restore(spec["path"], abstract)

    out: dict[str, Any] = {"after": []}
    gc.collect()
    before = _anon()
    for i in range(spec["restores"]):
        read0 = _bytes_read()
        start = time.perf_counter()
        tree = restore()
        jax.block_until_ready(tree)
        elapsed = time.perf_counter() - start
        read = _bytes_read() - read0
        if i == 0:
            out["time"] = elapsed
            out["read"] = read
            out["ok"] = all(
                np.array_equal(np.asarray(shard.data), value(k, sh[k])[shard.index])
                for k, arr in tree.items() for shard in arr.addressable_shards
            )
        del tree
        gc.collect()
        time.sleep(0.2)
        out["after"].append(_anon() - before)
    out["owned"] = sum(r * c * 4 for r, c in sh.values()) // 2
    jax.distributed.shutdown()
    return out


def run_job(system: str, path: str, quick: bool, restores: int, timeout: float, tree: str | None) -> list[dict[str, Any]]:
    """One restore job of 2 JAX processes; each one's result."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    if tree is not None:
        env["PYTHONPATH"] = tree
    procs = []
    for p in range(2):
        spec = {"op": "restore", "system": system, "path": path, "quick": quick, "restores": restores,
                "port": port, "process": p}
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{system}: exit {proc.returncode}\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def main() -> None:
    p = bench_parser(__doc__, repeats=1)
    p.add_argument("--before", default=None, help="a source tree whose tsckpt is measured as 'tsckpt-before'")
    p.add_argument("--restores", type=int, default=3, help="restores in one process (memory after the last)")
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_write(spec) if spec["op"] == "write" else child_restore(spec)))
        return

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    systems = {"tsckpt": here, "orbax": None}
    if args.before:
        systems = {"tsckpt-before": os.path.abspath(args.before), **systems}
    base = tempfile.mkdtemp(prefix="bench-orbax-read-", dir=args.dir)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in systems}
    try:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
        for kind in KINDS:
            spec = {"op": "write", "path": os.path.join(base, kind), "quick": args.quick, "kind": kind}
            subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], check=True, env=env,
                           timeout=args.timeout, stdin=subprocess.DEVNULL, capture_output=True)
        for _ in range(args.repeats):
            for kind in KINDS:
                for system, tree in systems.items():
                    res = run_job(system, os.path.join(base, kind), args.quick, args.restores, args.timeout, tree)
                    runs[system].setdefault(kind, []).extend(res)
                    print(f"{system} {kind}: {res}", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = report(runs, args)
    print(text)
    if args.write_results:
        write_section(SECTION, text)


def report(runs: dict[str, dict[str, list[dict[str, Any]]]], args: Any) -> str:
    info = machine_info()
    sh = shapes(args.quick)
    total = sum(r * c * 4 for r, c in sh.values())
    r, c = next(iter(sh.values()))
    lines = [
        SECTION,
        "",
        (
            f"Each checkpoint: {len(sh)} float32 array(s) of {r} x {c} ({total / MiB:.0f} MiB), written by Orbax's "
            "StandardCheckpointer from 4 CPU devices in row chunks (rows) or column chunks (cols); restored by 2 JAX "
            f"processes x 2 CPU devices into targets sharded P(None, ('p', 'd')): each process owns {total / 2 / MiB:.0f} "
            f"MiB, in two device slices. {args.repeats} job(s) per case, {args.restores} restores per process; the larger "
            f"of the two processes. {info['date']}, {info['nproc']} CPUs ({info['cpu']}), tensorstore {info['tensorstore']}, "
            f"tsckpt {info['tsckpt_rev']}. 2-CPU dev machine, loaded by parallel work (load average "
            f"{info['load_avg'][0]:.1f}): times are indicative only."
        ),
        "",
        (
            "| chunks | system | read per process (MiB) | read / owned | time (s) | anon RSS after restore 1 (MiB) | "
            f"after restore {args.restores} (MiB) | values |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        for system, kinds in runs.items():
            rs = kinds[kind]
            read = max(x["read"] for x in rs)
            first = max(x["after"][0] for x in rs) / MiB
            last = max(x["after"][-1] for x in rs) / MiB
            ok = "exact" if all(x["ok"] for x in rs) else "WRONG"
            lines.append(f"| {kind} | {system} | {read / MiB:.0f} | {read / rs[0]['owned']:.2f} | "
                         f"{min(x['time'] for x in rs):.2f} | {first:+.0f} | {last:+.0f} | {ok} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
