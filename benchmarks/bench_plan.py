"""Planning a save at scale: 1,000 leaves on 64, 256 and 1,024 simulated ranks.

No processes and no I/O: each simulated rank's payload is built as save() builds
it (descriptors packed field by field, tree paths and structure, tied-leaf links,
write window), and rank 0's work is run on all of them, as save() runs it: grouping
the descriptors, finding replicated regions, planning, and splitting the plan
into one part per rank. Reported per world size:

- bytes each rank sends (its pickled payload) and rank 0 receives in total;
- bytes each rank receives: its pickled part of the plan (and, when some
  regions are replicated, its list of regions to checksum);
- what every rank received before, when all ranks all-gathered every rank's
  payload with descriptors as dataclasses;
- rank 0's planning time (median of --repeats runs), and apart from it the
  time to unpickle the gathered payloads and to pickle the replies.

Two workloads: "sharded" (1,000 weight matrices, each Shard(0) over all ranks:
one round trip, no checksums) and "mixed" (900 sharded matrices and 100 small
vectors every rank holds: their checksums take a second round trip).

    python benchmarks/bench_plan.py --quick            # 64 ranks only
    python benchmarks/bench_plan.py --write-results    # rewrite "## Planning at scale" in RESULTS.md
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import statistics
import sys
import time
from typing import Any

from _common import bench_parser, machine_info, write_section

from tsckpt._ondisk.chunking import SHARD_BYTES
from tsckpt._save.descs import ChecksumRequest, Payload, gather_descs, shared_regions, with_checksums, without
from tsckpt._save.plan import plan_aliases, plan_save, split_plan
from tsckpt._options import WRITE_WINDOW_BYTES
from tsckpt._save.protocol import Part
from tsckpt._base.types import LeafDesc
from tsckpt.tree import flatten, structure_to_json

LEAVES = 1000
ROWS, COLS = 16384, 1024  # every weight matrix; 16 rows a rank at 1,024 ranks


@dataclasses.dataclass(frozen=True)
class OldLeafDesc:
    """The descriptor as every rank all-gathered it before (a dataclass, same fields)."""

    path: str
    kind: str
    dtype: str = ""
    itemsize: int = 0
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    checksum: int | None = None
    value: Any = None


def payloads(world: int, replicated: int) -> list[Payload]:
    """Every simulated rank's payload to rank 0, as save() builds it (step 1)."""
    layers = LEAVES // 10
    tree = {"model": {"layers": [{**{f"w{j}": 0 for j in range(9)}, "b": 0} for _ in range(layers)]}}
    flat = flatten(tree)
    structure = structure_to_json(flat.spec)
    bias = set(flat.paths[9::10][:replicated])
    rows = ROWS // world
    out = []
    for r in range(world):
        descs = [
            LeafDesc(p, "torch", "float32", 4, (COLS,), (0,), (COLS,))
            if p in bias
            else LeafDesc(p, "torch", "float32", 4, (ROWS, COLS), (r * rows, 0), (rows, COLS))
            for p in flat.paths
        ]
        out.append(Payload.of(descs, flat.paths, structure, {}, WRITE_WINDOW_BYTES, "plain"))
    return out


def run_once(blobs: list[bytes], world: int) -> dict[str, Any]:
    """Rank 0's work on the gathered payloads, timed; and the replies' sizes."""
    t0 = time.perf_counter()
    got = [pickle.loads(b) for b in blobs]
    t1 = time.perf_counter()
    per_rank = [p.descs for p in got]
    aliases = plan_aliases(per_rank, [p.links for p in got])
    g = without(gather_descs(per_rank), aliases)
    shared = shared_regions(g)
    t2 = time.perf_counter()
    asks = [pickle.dumps(ChecksumRequest(tuple(s))) for s in shared] if any(shared) else []
    t3 = time.perf_counter()
    if asks:  # every replica agrees (what the ranks would send back)
        g = with_checksums(g, [{p: 7 for p in s} for s in shared])
    t3b = time.perf_counter()
    plan = plan_save(g, shard_bytes=min(SHARD_BYTES, min(p.window for p in got)))
    t4 = time.perf_counter()
    parts = split_plan(plan)
    t5 = time.perf_counter()
    replies = [pickle.dumps(Part(part, WRITE_WINDOW_BYTES)) for part in parts[1:]]
    t6 = time.perf_counter()
    return {
        "unpickle_s": t1 - t0,
        "group_s": t2 - t1,
        "plan_s": t4 - t3b,
        "split_s": t5 - t4,
        "plan_total_s": (t2 - t1) + (t4 - t3) + (t5 - t4),
        "pickle_s": (t6 - t5) + (t3 - t2),
        "total_s": t6 - t0,
        "reply_max": max(len(r) for r in replies),
        "reply_min": min(len(r) for r in replies),
        "ask_max": max((len(a) for a in asks), default=0),
        "writes": sum(len(g.paths) * len(g.writes) for p in parts for g in p.groups),
        "transfers": len(plan.transfers),
    }


def measure(world: int, replicated: int, repeats: int) -> dict[str, Any]:
    pl = payloads(world, replicated)
    blobs = [pickle.dumps(p) for p in pl]
    old = [pickle.dumps(([OldLeafDesc(*d) for d in p.descs], p.paths, json.loads(p.structure), p.links, p.window)) for p in pl]
    runs = []
    for _ in range(repeats):
        gc.collect()
        runs.append(run_once(blobs, world))
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "world": world,
        "replicated": replicated,
        "sent": max(len(b) for b in blobs),
        "root_received": sum(len(b) for b in blobs),
        "old_received": sum(len(b) for b in old),
        "runs": runs,
        **med,
    }


def fmt_bytes(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def main() -> None:
    args = bench_parser(__doc__, repeats=3).parse_args()
    worlds = [64] if args.quick else [64, 256, 1024]
    rows = []
    for name, replicated in (("sharded", 0), ("mixed", 100)):
        for world in worlds:
            m = measure(world, replicated, args.repeats)
            m["workload"] = name
            rows.append(m)
            print(
                f"{name} x {world}: sends {fmt_bytes(m['sent'])}, receives {fmt_bytes(m['reply_max'])} "
                f"(checksum list {fmt_bytes(m['ask_max'])}); rank 0 receives {fmt_bytes(m['root_received'])}; "
                f"before: every rank received {fmt_bytes(m['old_received'])}; planning {m['plan_total_s']:.2f} s "
                f"(group {m['group_s']:.2f}, plan {m['plan_s']:.2f}, split {m['split_s']:.2f}); "
                f"unpickle {m['unpickle_s']:.2f} s, pickle replies {m['pickle_s']:.2f} s; total {m['total_s']:.2f} s",
                flush=True,
            )
    if args.write_results:
        write_section("## Planning at scale", report(rows, args.repeats))


def report(rows: list[dict[str, Any]], repeats: int) -> str:
    info = machine_info()
    load = ", ".join(f"{x:.1f}" for x in info["load_avg"])
    lines = [
        "## Planning at scale",
        "",
        f"Run {info['date']} by `python benchmarks/bench_plan.py --write-results` on {info['nproc']} CPUs "
        f"({info['cpu']}), Python {info['python']}, tsckpt {info['tsckpt']} ({info['tsckpt_rev']}). "
        f"Load average at the end: {load}; the machine is shared, so times are noisy. "
        f"Median of {repeats} runs.",
        "",
        f"One process, no I/O: {LEAVES:,} leaves on each simulated rank, payloads built as `save()` builds them and "
        "rank 0's work run on all of them (grouping the descriptors, finding replicated regions, `plan_save`, "
        "`split_plan`). *sharded*: 1,000 float32 matrices of 16384 x 1024, each Shard(0) over all ranks (no region "
        "has two holders: one round trip, no checksums). *mixed*: 900 such matrices and 100 vectors of 1024 "
        "that every rank holds (their checksums take a second round trip). Bytes are pickled sizes: a rank "
        "sends its payload; it receives its part of the plan (the largest over ranks 1..N-1; `scatter_object_list` "
        "pads every rank's message to the largest) and, in *mixed*, its list of regions to checksum. "
        "*before*: what every rank received when every rank all-gathered every rank's payload (descriptors as "
        "dataclasses). Planning = grouping + `plan_save` + `split_plan` on rank 0; unpickling the gathered payloads "
        "and pickling the replies are shown apart, and in the total (everything rank 0 does between receiving "
        "and sending, except the checksum round trip itself).",
        "",
        "| workload | ranks | a rank sends | a rank receives | rank 0 receives | before: every rank received "
        "| planning (s) | of which plan_save (s) | unpickle (s) | pickle replies (s) | total on rank 0 (s) "
        "| writes planned |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in rows:
        recv = fmt_bytes(m["reply_max"]) + (f" + {fmt_bytes(m['ask_max'])}" if m["ask_max"] else "")
        lines.append(
            f"| {m['workload']} | {m['world']:,} | {fmt_bytes(m['sent'])} | {recv} | {fmt_bytes(m['root_received'])} "
            f"| {fmt_bytes(m['old_received'])} | {m['plan_total_s']:.2f} | {m['plan_s']:.2f} | {m['unpickle_s']:.2f} "
            f"| {m['pickle_s']:.2f} | {m['total_s']:.2f} | {m['writes']:,} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
