#!/usr/bin/env python
"""Hugging Face safetensors interop: export 1 GiB to sharded safetensors, import it back.

Workload
  A 1 GiB model state: one 256 MiB float32 embedding (65536 x 1024) and 48 float32
  matrices of 1024 x 4096 (16 MiB each), saved once as a tsckpt checkpoint under
  "model". Shards of at most 300 MB (4 files), as transformers names them.

Systems (each case in a fresh process; the systems rotate within every round)
  export  tsckpt            tsckpt.convert(ckpt, dir, to_format="safetensors", subtree="model",
                            max_shard_size="300MB"): reads the checkpoint block by block
          save_file         safetensors' save_file of the same tensors, already in memory,
                            into the same 4 shards, each file fsynced (the direct tool)
          restore+save_file tsckpt.restore(ckpt) then save_file as above (what one would do
                            without convert)
  import  tsckpt            tsckpt.convert(dir, ckpt2): reads the shards block by block into a
                            tsckpt checkpoint (checksummed, fsynced, committed)
          load_file         safetensors' load_file of every shard, every tensor touched (the
                            direct tool; it writes nothing)
          load_file+save    load_file of every shard, then tsckpt.save (what one would do
                            without convert)

Measures
  time    wall time of the call, median over the rounds, and the ratio to the direct tool
  peak    peak RSS during the call above the RSS just before it (VmHWM after clear_refs);
          for save_file the 1 GiB of source tensors is in the baseline
  Caches: "warm" runs read files another case just wrote or read; "cold" runs first evict
  the files being read from the page cache (posix_fadvise DONTNEED; no root needed).
  Output bytes are checked against the source after every run.

Usage
  python benchmarks/bench_interop.py --quick          # 64 MiB smoke run
  python benchmarks/bench_interop.py --write-results  # full run, rewrite the '## Safetensors interop' section
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

from _common import bench_parser, evict, machine_info, reset_peak, rss, run_child, write_section

SECTION = "## Safetensors interop"
MiB = 1 << 20


def shard_limit(quick: bool) -> str:
    return "20MB" if quick else "300MB"


def shapes(quick: bool) -> dict[str, tuple[int, int]]:
    scale = 16 if quick else 1
    out = {"embed.weight": (65536 // scale, 1024)}
    out.update({f"layers.{i}.w": (1024 // scale, 4096) for i in range(48)})
    return out


def value(i: int, shape: tuple[int, int]) -> Any:
    import torch

    return (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) % 997) * (i + 1)


def state(quick: bool) -> dict[str, Any]:
    return {k: value(i, s) for i, (k, s) in enumerate(shapes(quick).items())}


def shard_groups(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """The same grouping transformers (and tsckpt) use: fill in order up to the limit."""
    groups: list[list[str]] = [[]]
    total = 0
    for n in names:
        if groups[-1] and total + sizes[n] > limit:
            groups.append([])
            total = 0
        groups[-1].append(n)
        total += sizes[n]
    return groups


def save_shards(tensors: dict[str, Any], directory: str, quick: bool) -> None:
    from safetensors.torch import save_file

    from tsckpt._convert import parse_size

    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    groups = shard_groups(names, {n: tensors[n].numel() * 4 for n in names}, parse_size(shard_limit(quick)) or 0)
    for i, group in enumerate(groups):
        path = os.path.join(directory, f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors")
        save_file({n: tensors[n] for n in group}, path, metadata={"format": "pt"})
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def check(tensors: dict[str, Any], quick: bool) -> bool:
    import torch

    return all(torch.equal(tensors[k], value(i, s)) for i, (k, s) in enumerate(shapes(quick).items()))


def read_shards(directory: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tsckpt

    system, quick = spec["system"], spec["quick"]
    src, dst = spec["src"], spec["dst"]
    shutil.rmtree(dst, ignore_errors=True)
    tensors = state(quick) if system == "export/save_file" else None
    if spec["cold"]:
        evict(src)
    base = rss()
    reset_peak()
    start = time.perf_counter()
    touched = 0.0
    if system == "export/tsckpt":
        tsckpt.convert(src, dst, to_format="safetensors", subtree="model", max_shard_size=shard_limit(quick),
                        progress=False)
    elif system == "export/save_file":
        save_shards(tensors, dst, quick)
    elif system == "export/restore+save_file":
        save_shards(tsckpt.restore(src, as_saved=True)["model"], dst, quick)
    elif system == "import/tsckpt":
        tsckpt.convert(src, dst, progress=False)
    elif system == "import/load_file":
        loaded = read_shards(src)
        touched = float(sum(float(t.view(-1)[:: 1024].sum()) for t in loaded.values()))  # every page
    else:  # import/load_file+save
        tsckpt.save(dst, read_shards(src))
    elapsed = time.perf_counter() - start
    peak = rss("VmHWM:") - base
    del tensors
    if system.startswith("export"):
        ok = check(read_shards(dst), quick) and len([f for f in os.listdir(dst) if f.endswith(".safetensors")]) > 1
    elif system == "import/load_file":
        ok = touched != 0.0 and check(read_shards(src), quick)
    else:
        got = tsckpt.restore(dst, as_saved=True)
        ok = check({k: torch.as_tensor(v) for k, v in got.items()}, quick)
    return {"time": elapsed, "peak_extra": peak, "ok": ok}


SYSTEMS = {
    "export": ["tsckpt", "save_file", "restore+save_file"],
    "import": ["tsckpt", "load_file", "load_file+save"],
}
DIRECT = {"export": "save_file", "import": "load_file"}


def main() -> None:
    p = bench_parser(__doc__, repeats=5)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    import tsckpt

    base = tempfile.mkdtemp(prefix="bench-interop-", dir=args.dir)
    runs: dict[tuple[str, str, bool], list[dict[str, Any]]] = {}
    try:
        ck, hf = os.path.join(base, "ckpt"), os.path.join(base, "hf")
        tsckpt.save(ck, {"model": state(args.quick)})
        tsckpt.convert(ck, hf, to_format="safetensors", subtree="model", max_shard_size=shard_limit(args.quick),
                       progress=False)
        for r in range(args.repeats):
            for cold in (False, True):
                for op, systems in SYSTEMS.items():
                    rotated = systems[r % len(systems):] + systems[: r % len(systems)]
                    for s in rotated:
                        src = ck if op == "export" else hf
                        spec = {"system": f"{op}/{s}", "quick": args.quick, "src": src,
                                "dst": os.path.join(base, f"out-{op}"), "cold": cold}
                        res = run_child(__file__, spec, args.timeout)
                        runs.setdefault((op, s, cold), []).append(res)
                        print(f"round {r} {'cold' if cold else 'warm'} {op}/{s}: {res}", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    nbytes = sum(a * b * 4 for a, b in shapes(args.quick).values())
    med = {k: statistics.median(x["time"] for x in v) for k, v in runs.items()}
    info = machine_info()
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_interop.py{' --quick' if args.quick else ''} --repeats {args.repeats}`: "
        f"{nbytes / MiB:.0f} MiB (one 65536 x 1024 and 48 1024 x 4096 float32 tensors) exported to "
        f"safetensors shards of at most {shard_limit(args.quick)} and imported back; median of {args.repeats} rotating rounds, each "
        f"case in a fresh process. {info['date']}, {info['nproc']} CPUs ({info['cpu']}), torch {info['torch']}, "
        f"safetensors {info['safetensors']}, tensorstore {info['tensorstore']}, tsckpt {info['tsckpt_rev']}.",
        "",
        "| operation | system | cache | time (s) | vs direct tool | GB/s | peak RSS above baseline (MiB) | output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (op, s, cold), rs in runs.items():
        t = med[(op, s, cold)]
        ratio = t / med[(op, DIRECT[op], cold)]
        peak = max(x["peak_extra"] for x in rs) / MiB
        ok = "exact" if all(x["ok"] for x in rs) else "WRONG"
        lines.append(f"| {op} | {s} | {'cold' if cold else 'warm'} | {t:.2f} | {ratio:.2f}x | "
                     f"{nbytes / t / 1e9:.2f} | {peak:.0f} | {ok} |")
    lines += ["", "Targets (tsckpt): time within 1.2x of the direct tool; peak RSS at most 300 MiB above baseline."]
    for op in SYSTEMS:
        for cold in (False, True):
            ratio = med[(op, "tsckpt", cold)] / med[(op, DIRECT[op], cold)]
            peak = max(x["peak_extra"] for x in runs[(op, "tsckpt", cold)]) / MiB
            lines.append(f"- {op}, {'cold' if cold else 'warm'}: time {ratio:.2f}x ({'met' if ratio <= 1.2 else 'missed'}), "
                         f"peak +{peak:.0f} MiB ({'met' if peak <= 300 else 'missed'})")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
