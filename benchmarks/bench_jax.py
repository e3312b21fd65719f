#!/usr/bin/env python
"""JAX benchmark: sharded jax.Arrays and a Flax NNX model with AdamW state, tsckpt against Orbax.

Workloads (4 CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=4)
  rows    one 400 MiB float32 array (10240 x 10240) sharded by rows over the 4 devices
  cols    the same array sharded by columns
  flax    a Flax NNX model of 25 Linear(2048, 2048) layers (about 400 MiB of float32
          parameters) and its nnx.Optimizer state of optax.adamw (mu and nu: twice that),
          every kernel sharded by rows over the 4 devices; every float leaf offset by 0.5 (so
          that no chunk is all zeros, as AdamW's moments are before the first update)

Systems (each save and each restore in a fresh process)
  tsckpt  tsckpt.save(dir, state); tsckpt.restore(dir, abstract state)
  orbax   orbax-checkpoint's StandardCheckpointer: save(dir, state) + wait_until_finished();
          restore(dir, abstract state)
  The abstract state is jax.eval_shape's tree of jax.ShapeDtypeStruct with the shardings of
  the saved state: nothing is allocated before the restore.

Measures
  time    wall time of the call (median of --repeats)
  peak    peak RSS during the call above the RSS just before it (VmHWM after clear_refs);
          the saved state is in the baseline of a save (its device buffers touched first),
          the restored state counts as extra in a restore
  Restored values are checked against the saved ones after measuring. Both medians; --raw
  appends every run as a JSON line (to compare two trees run in turn, e.g. before and after
  a change, each with PYTHONPATH pointing at its tree).

Usage
  python benchmarks/bench_jax.py --quick          # small smoke run
  python benchmarks/bench_jax.py --write-results  # full run, rewrite the '## JAX' section
  python benchmarks/bench_jax.py --workloads rows,cols --repeats 3 --raw runs.jsonl
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import bench_parser, machine_info, reset_peak, rss, run_child, write_section

SECTION = "## JAX: sharded arrays and a Flax model against Orbax"
MiB = 1 << 20
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
WORKLOADS = ("rows", "cols", "flax")
SYSTEMS = ("tsckpt", "orbax")


def _mesh() -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:4]), ("x",))


def _sharding(spec: Any) -> Any:
    from jax.sharding import NamedSharding

    return NamedSharding(_mesh(), spec)


def _array(workload: str, quick: bool) -> Any:
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    n = 1024 if quick else 10240
    sharding = _sharding(P("x") if workload == "rows" else P(None, "x"))

    def piece(index: Any) -> Any:
        rows = np.arange(n, dtype=np.float32)[index[0]]
        cols = np.arange(n, dtype=np.float32)[index[1]]
        return rows[:, None] * 3 + cols[None, :]

    return {"w": jax.make_array_from_callback((n, n), sharding, piece)}


def _flax(quick: bool, seed: int = 0) -> Any:
    import jax
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    width, depth = (256, 4) if quick else (2048, 25)

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    model = MLP(nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    state = {"model": nnx.state(model), "opt": nnx.state(opt)}
    rows, replicated = _sharding(P("x")), _sharding(P())
    # AdamW's moments start at zero; offset them (as a first update would), since a chunk of
    # zeros is not stored by Orbax and reads back as memory that is never touched
    state = jax.tree.map(lambda a: a + 0.5 if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a, state)
    return jax.tree.map(lambda a: jax.device_put(a, rows if a.ndim == 2 else replicated), state)


def make_state(workload: str, quick: bool) -> Any:
    return _flax(quick) if workload == "flax" else _array(workload, quick)


def _touch(state: Any) -> None:
    """Materialize every device buffer (jax may copy host data lazily), so the baseline holds them."""
    import jax
    import numpy as np

    for leaf in jax.tree.leaves(jax.block_until_ready(state)):
        for shard in leaf.addressable_shards:
            np.asarray(shard.data)


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _nbytes(state: Any) -> int:
    import jax

    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import jax
    import numpy as np

    system, path = spec["system"], spec["path"]
    state = make_state(spec["workload"], spec["quick"])
    if system == "orbax":
        import orbax.checkpoint as ocp

        ck = ocp.StandardCheckpointer()
    else:
        import tsckpt
    if spec["op"] == "save":
        _touch(state)
        base = rss()
        reset_peak()
        start = time.perf_counter()
        if system == "orbax":
            ck.save(path, state)
            ck.wait_until_finished()
        else:
            tsckpt.save(path, state)
        elapsed = time.perf_counter() - start
        return {"time": elapsed, "peak_extra": rss("VmHWM:") - base, "nbytes": _nbytes(state)}
    abstract = jax.eval_shape(lambda: state)  # ShapeDtypeStructs with the saved shardings
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.sharding), abstract, state)
    expected = jax.tree.map(lambda a: np.array(a, copy=True), state)
    del state
    _trim()  # the freed device buffers go back to the system, not into the restore's allocations
    base = rss()
    reset_peak()
    start = time.perf_counter()
    out = ck.restore(path, abstract) if system == "orbax" else tsckpt.restore(path, abstract)
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - start
    peak = rss("VmHWM:") - base
    same = jax.tree.map(lambda a, e, t: bool(np.array_equal(np.asarray(a), e)) and a.sharding == t.sharding,
                        out, expected, abstract)
    return {"time": elapsed, "peak_extra": peak, "ok": all(jax.tree.leaves(same))}


def main() -> None:
    p = bench_parser(__doc__, repeats=1)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument("--raw", default=None, help="append every run to this file as a JSON line")
    args = p.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not set(args.workloads) <= set(WORKLOADS):
        p.error(f"--workloads: one of {', '.join(WORKLOADS)}")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    base = tempfile.mkdtemp(prefix="bench-jax-", dir=args.dir)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    try:
        for _ in range(args.repeats):
            for workload in args.workloads:
                for system in SYSTEMS:
                    path = os.path.join(base, f"{workload}-{system}")
                    for op in ("save", "restore"):
                        if op == "save":
                            shutil.rmtree(path, ignore_errors=True)
                        spec = {"op": op, "system": system, "workload": workload, "path": path, "quick": args.quick}
                        got = run_child(__file__, spec, args.timeout, env=ENV)
                        runs.setdefault((workload, system, op), []).append(got)
                        print(f"{workload} {system} {op}: {got}", file=sys.stderr)
                        if args.raw:
                            with open(args.raw, "a") as f:
                                f.write(json.dumps({"workload": workload, "system": system, "op": op, **got}) + "\n")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(runs, args)


def report(runs: dict[tuple[str, str, str], list[dict[str, Any]]], args: Any) -> None:
    info = machine_info()
    lines = [
        SECTION,
        "",
        f"4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4); medians of {args.repeats} run(s), each "
        f"save and restore in a fresh process, page cache warm. {info['date']}, {info['nproc']} CPUs "
        f"({info['cpu']}), load average before {info['load_avg'][0]:.1f}, tensorstore {info['tensorstore']}, "
        f"tsckpt {info['tsckpt_rev']}. Restores are into jax.ShapeDtypeStruct targets with the saved shardings.",
        "",
        "| workload | state (MiB) | op | tsckpt time (s) | orbax time (s) | tsckpt peak extra RSS (MiB) "
        "| orbax peak extra RSS (MiB) | values |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload in args.workloads:
        nbytes = runs[(workload, "tsckpt", "save")][0]["nbytes"]
        for op in ("save", "restore"):
            t = {s: statistics.median(r["time"] for r in runs[(workload, s, op)]) for s in SYSTEMS}
            peak = {s: statistics.median(r["peak_extra"] for r in runs[(workload, s, op)]) / MiB for s in SYSTEMS}
            ok = "" if op == "save" else (
                "exact" if all(r["ok"] for s in SYSTEMS for r in runs[(workload, s, op)]) else "WRONG"
            )
            lines.append(
                f"| {workload} | {nbytes / MiB:.0f} | {op} | {t['tsckpt']:.2f} | {t['orbax']:.2f} "
                f"| {peak['tsckpt']:.0f} | {peak['orbax']:.0f} | {ok} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
