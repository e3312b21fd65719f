#!/usr/bin/env python
"""``tsckpt.diff`` of two checkpoints against the time to read both.

Workload
  A      a tsckpt checkpoint of 64 float32 leaves of 4 MiB (256 MiB; 16 leaves with --quick)
  B      an unrelated one: other random values, the same leaves
  C      A with one leaf in ten changed (one element each), saved, then every file whose bytes
         equal A's replaced by a hard link to it: 90% of the chunks shared, as an incremental
         save would leave them
  D      the state of C saved on its own (no file shared): its files' recorded content hashes
         equal A's for the 90% unchanged

Measures (warm page cache: every checkpoint was just written; median of the rounds)
  read both    ``tsckpt.restore(A)`` then ``tsckpt.restore(B)``, each result dropped
  diff A B     ``tsckpt.diff(A, B)``: every block of both read and compared
  diff A C     ``tsckpt.diff(A, C)``: only the changed leaves' shards read
  diff A D     ``tsckpt.diff(A, D)``: the same, decided by the recorded content hashes

Usage
  python benchmarks/bench_diff.py --quick          # smoke run
  python benchmarks/bench_diff.py --leaves 32      # 128 MiB each
  python benchmarks/bench_diff.py --write-results  # rewrite the '## tsckpt diff' section
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import bench_parser, machine_info, write_section

import tsckpt

TITLE = "## tsckpt diff: against reading both checkpoints"
LEAF_ELEMENTS = 1 << 20  # 4 MiB of float32


def state(leaves: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i:03d}": torch.randn(1024, LEAF_ELEMENTS // 1024, generator=gen) for i in range(leaves)}


def shared_files(directory: str) -> int:
    """How many files of ``directory`` are hard links shared with another checkpoint."""
    return sum(os.stat(os.path.join(root, f)).st_nlink > 1 for root, _, files in os.walk(directory) for f in files)


def timed(fn: Callable[[], Any], rounds: int) -> tuple[tuple[float, float], Any]:
    """Median wall and CPU seconds (all threads of this process) of ``rounds`` calls, and
    the last result. On a machine shared with other work the CPU time is the steadier."""
    times, cpus, out = [], [], None
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return (statistics.median(times), statistics.median(cpus)), out


def main() -> None:
    parser = bench_parser(__doc__, 3)
    parser.add_argument("--leaves", type=int, default=64, help="leaves of 4 MiB in each checkpoint")
    args = parser.parse_args()
    leaves = 16 if args.quick else args.leaves
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        a, b, c, d = (os.path.join(tmp, n) for n in "abcd")
        base = state(leaves, 0)
        tsckpt.save(a, base)
        tsckpt.save(b, state(leaves, 1))
        changed = dict(base)
        for i in range(0, leaves, 10):
            name = f"layer{i:03d}"
            changed[name] = base[name].clone()
            changed[name][7, 9] += 1.0
        tsckpt.save(c, changed, base=a)  # incremental: the unchanged files are hard links to a's
        tsckpt.save(d, changed)  # no base: nothing linked, the content hashes recorded
        linked = shared_files(c)
        del base, changed
        rows = {}

        def read_both() -> None:
            tsckpt.restore(a)
            tsckpt.restore(b)

        rows["read both"], _ = timed(read_both, args.repeats)
        rows["diff A B"], unrelated = timed(lambda: tsckpt.diff(a, b, progress=False), args.repeats)
        rows["diff A C"], shared = timed(lambda: tsckpt.diff(a, c, progress=False), args.repeats)
        rows["diff A D"], hashed = timed(lambda: tsckpt.diff(a, d, progress=False), args.repeats)
    assert len(unrelated.differences) == leaves and len(shared.differences) == len(range(0, leaves, 10))
    assert len(hashed.differences) == len(shared.differences)
    nbytes = leaves * LEAF_ELEMENTS * 4
    section = report(rows, nbytes, leaves, linked, unrelated, shared, hashed, args.repeats)
    print(section)
    if args.write_results:
        write_section(TITLE, section)


def report(rows: dict[str, tuple[float, float]], nbytes: int, leaves: int, linked: int, unrelated: Any, shared: Any,
           hashed: Any, rounds: int) -> str:
    info = machine_info()
    load = ", ".join(f"{x:.1f}" for x in info["load_avg"])
    mib = nbytes / (1 << 20)
    both = rows["read both"]
    lines = [
        TITLE,
        "",
        (
            f"Run {info['date']} by `python benchmarks/bench_diff.py --leaves {leaves} --write-results` on "
            f"{info['nproc']} CPUs "
            f"({info['cpu']}), Python {info['python']}, tsckpt {info['tsckpt']} ({info['tsckpt_rev']}): a 2-CPU "
            f"dev machine, loaded by parallel work (load average at the end: {load}), so times are noisy. "
            f"Median of {rounds} rounds, warm page cache; CPU: seconds of all this process's threads."
        ),
        "",
        (
            f"A and B: {leaves} float32 leaves of 4 MiB ({mib:.0f} MiB each), unrelated values. C: A with one leaf "
            f"in ten changed by one element, its other files hard links to A's ({linked} files linked), as an "
            "incremental save leaves them. D: C's state saved on its own (no file linked; its recorded content "
            "hashes equal A's for the unchanged files). Read both: `tsckpt.restore` of each, whole."
        ),
        "",
        (
            "| case | time (s) | against reading both | CPU (s) | CPU against reading both | bytes read by diff "
            "| known equal unread |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| read both (restore A, restore B) | {both[0]:.2f} | 1.00x | {both[1]:.2f} | 1.00x | | |",
        row("diff A B (unrelated)", rows["diff A B"], both, unrelated),
        row("diff A C (90% shared, hard links)", rows["diff A C"], both, shared),
        row("diff A D (90% equal, content hashes)", rows["diff A D"], both, hashed),
    ]
    return "\n".join(lines) + "\n"


def row(case: str, seconds: tuple[float, float], both: tuple[float, float], found: Any) -> str:
    mib = 1 << 20
    (wall, cpu), (wall_both, cpu_both) = seconds, both
    return (
        f"| {case} | {wall:.2f} | {wall / wall_both:.2f}x | {cpu:.2f} | {cpu / cpu_both:.2f}x "
        f"| {found.bytes_read / mib:.0f} MiB "
        f"| {found.bytes_known_equal / mib:.0f} MiB |"
    )


if __name__ == "__main__":
    main()
