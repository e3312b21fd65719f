"""How long ``save_async`` blocks its caller under torch.distributed, before and after a change.

Each rank of a gloo job (fresh processes, torchrun's environment) calls ``tsckpt.save_async`` of a
small state (50 float32 tensors of 64 x 64) ``--saves`` times, waiting for each result before the
next call, and reports the median time a call blocked (the first calls left out: they make the
groups). Under torch.distributed a call ends with an agreement of the ranks (a call failing on one
rank fails on every rank); this measures what that costs per call. ``tsckpt-before`` runs the
tsckpt package of ``--before DIR`` (a directory holding an older ``tsckpt``); the two take turns
in each round.

    python benchmarks/bench_call_ranks.py --before /tmp/before --rounds 5
    python benchmarks/bench_call_ranks.py --before /tmp/before --write-results
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from _common import bench_parser, machine_info, rank_entry, run_ranks, write_section

HERE = os.path.dirname(os.path.abspath(__file__))
TITLE = "## save_async call time under torch.distributed (the ranks' agreement per call)"
SKIPPED = 5  # the first calls make the groups and start the worker


def _rank(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import tsckpt

    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same values on every rank: replicas
    state = {f"w{i}": torch.randn(64, 64) for i in range(50)}
    calls = []
    for n in range(job["saves"] + SKIPPED):
        start = time.perf_counter()
        handle = tsckpt.save_async(os.path.join(job["root"], str(n)), state, writer=job["writer"])
        calls.append(time.perf_counter() - start)
        handle.result()
    return {"call": statistics.median(calls[SKIPPED:]), "package": os.path.dirname(tsckpt.__file__)}


def _measure(case: str, args: Any) -> float:
    env = {"PYTHONPATH": os.pathsep.join([args.before, HERE])} if case == "tsckpt-before" else {}
    with tempfile.TemporaryDirectory(prefix="bench-call-ranks-") as root:
        job = {"root": root, "saves": args.saves, "writer": args.writer}
        got = run_ranks(os.path.abspath(__file__), job, args.world, timeout=600, env=env)
    if case == "tsckpt-before" and not all(g["package"].startswith(os.path.abspath(args.before)) for g in got):
        raise SystemExit(f"--before {args.before}: the ranks imported another tsckpt ({got[0]['package']})")
    return statistics.mean(g["call"] for g in got)


def main() -> None:
    p = bench_parser(__doc__, repeats=5)
    p.add_argument("--rank-job", default=None, help="(internal) run one rank of a job")
    p.add_argument("--before", default=None, help="a directory holding the tsckpt package to compare with")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--saves", type=int, default=40)
    p.add_argument("--writer", default="thread", choices=("thread", "process"))
    args = p.parse_args()
    args.rounds = args.repeats
    if args.rank_job:
        rank_entry(_rank, json.loads(args.rank_job))
        return
    cases = ["tsckpt-before", "tsckpt"] if args.before else ["tsckpt"]
    rows: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            rows[case].append(_measure(case, args))
            print(f"round {r} {case}: {rows[case][-1] * 1e3:.2f} ms", file=sys.stderr)
    m = machine_info()
    lines = [
        TITLE,
        "",
        f"Run {m['date']} by `python benchmarks/bench_call_ranks.py{' --before DIR' if args.before else ''} "
        f"--world {args.world} --saves {args.saves} --rounds {args.rounds} --writer {args.writer}` on {m['nproc']} CPUs "
        f"({m['cpu']}), tsckpt {m['tsckpt']} ({m['tsckpt_rev']}), load average at the end {m['load_avg'][0]:.1f}. A call's median blocking time, the mean over the ranks, per round.",
        "",
        "| case | per round, ms | median, ms |",
        "| --- | --- | ---: |",
    ]
    for case, values in rows.items():
        per = ", ".join(f"{v * 1e3:.2f}" for v in values)
        lines.append(f"| {case} | {per} | {statistics.median(values) * 1e3:.2f} |")
    if args.before:
        ratios = [a / b for a, b in zip(rows["tsckpt"], rows["tsckpt-before"])]
        lines += ["", f"After against before: {statistics.median(ratios):.2f}x (median of the per-round ratios)."]
    body = "\n".join(lines)
    print(body)
    if args.write_results:
        write_section(TITLE, body)


if __name__ == "__main__":
    main()
