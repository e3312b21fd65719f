"""Incremental saves: a frozen base plus a small changing adapter and its AdamW state.

A CheckpointManager saves the same run of steps twice in one process: with
``incremental="versions"`` (every file hashed, except those of tensors torch's
version counter shows unchanged since their last save; unchanged files shared with the
previous step by hard links; the default ``True`` hashes every file) and with ``incremental=False`` (every file written, no
hashes: a save as before). Then issue 36's "full training" case: every tensor changed at
every step, saved by a manager with and without hashes in turns. Reported per step: the bytes of new files (files shared
with an earlier step are not counted) and the save time; then the restore time of the
last step of each (warm page cache), ``du`` of each manager's root, and the throughput
of the content hash (xxh3-128) beside blake2b-128 and crc32c on one buffer.

    python benchmarks/bench_incremental.py --quick            # 16 MiB base, a smoke run
    python benchmarks/bench_incremental.py --base-mib 128     # issue 36 asks 512 (the default)
    python benchmarks/bench_incremental.py --write-results    # rewrite its section of RESULTS.md
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import crc32c
import numpy as np
import xxhash
from _common import bench_parser, machine_info, write_section

import tsckpt

MIB = 1 << 20
TITLE = "## Incremental saves: a frozen base and a changing adapter"


def _model(base_mib: int, adapter_mib: int) -> tuple[dict[str, Any], Any, Any]:
    """A frozen base of 4 MiB float32 matrices, a trainable adapter (an nn.Parameter of
    adapter_mib) and its AdamW optimizer, each step updating the adapter and both moments."""
    import torch

    g = torch.Generator().manual_seed(0)
    base = {f"layer{i:02d}": torch.randn(1024, 1024, generator=g) for i in range(base_mib // 4)}
    adapter = torch.nn.Parameter(torch.randn(adapter_mib * MIB // 4 // 256, 256, generator=g))
    opt = torch.optim.AdamW([adapter], lr=1e-3)
    return base, adapter, opt


def _train_step(adapter: Any, opt: Any, step: int) -> None:
    import torch

    adapter.grad = torch.randn(adapter.shape, generator=torch.Generator().manual_seed(step))
    opt.step()


def _new_bytes(directory: str) -> int:
    """Bytes of the files below ``directory`` that no other directory shares (a single link)."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            st = os.stat(os.path.join(root, name))
            if st.st_nlink == 1:
                total += st.st_size
    return total


def _du(path: str) -> int:
    """Disk use of ``path`` in bytes, each hard-linked file counted once (as du counts)."""
    out = subprocess.run(["du", "-sk", path], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 1024


def _run(root: str, base_mib: int, adapter_mib: int, steps: int, incremental: bool | str) -> dict[str, Any]:
    base, adapter, opt = _model(base_mib, adapter_mib)
    m = tsckpt.CheckpointManager(root, incremental=incremental)
    times, written = [], []
    for step in range(1, steps + 1):
        _train_step(adapter, opt, step)
        state = {"base": base, "adapter": adapter, "optim": opt.state_dict(), "step": step}
        t = time.perf_counter()
        m.save(step, state)
        times.append(time.perf_counter() - t)
        written.append(_new_bytes(str(m.directory(step))))
    return {"save_s": times, "new_bytes": written, "du": _du(root), "manager": m}


def _restores(runs: list[dict[str, Any]], step: int, rounds: int) -> None:
    """The median restore time of ``step`` of each run, the runs taking turns (the machine's
    load then weighs on each alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            t = time.perf_counter()
            run["manager"].restore(step)
            times[i].append(time.perf_counter() - t)
    for run, ts in zip(runs, times):
        run["restore_s"] = statistics.median(ts)


def _full_training(root: str, base_mib: int, steps: int) -> dict[bool, list[float]]:
    """Issue 36's "full training" case: every tensor changes at every step, so nothing can be
    shared and an incremental save only adds its hashing. Two managers (``incremental=True``,
    the default, and ``False``; keep_last=2 as a run would) save the same state at each step,
    taking turns in alternating order; returns each one's save times."""
    import torch

    g = torch.Generator().manual_seed(0)
    state = {f"layer{i:03d}": torch.randn(1024, 1024, generator=g) for i in range(base_mib // 4)}
    managers = {k: tsckpt.CheckpointManager(os.path.join(root, f"full-{k}"), incremental=k, keep_last=2) for k in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(1, steps + 1):
        with torch.no_grad():
            for v in state.values():
                v.add_(1.0)
        for k in (True, False) if step % 2 else (False, True):
            t = time.perf_counter()
            managers[k].save(step, state)
            times[k].append(time.perf_counter() - t)
    return times


def _throughput(fn: Any, data: np.ndarray, repeats: int = 3) -> float:
    fn(data)
    t = time.perf_counter()
    for _ in range(repeats):
        fn(data)
    return repeats * data.nbytes / (time.perf_counter() - t) / (1 << 30)


def main() -> None:
    parser = bench_parser(__doc__, 3)
    parser.add_argument("--base-mib", type=int, default=512, help="the frozen base's size (the adapter: 1/64 of it)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    base_mib, steps = (16, 5) if args.quick else (args.base_mib, args.steps)
    adapter_mib = max(1, base_mib // 64)
    work = tempfile.mkdtemp(dir=args.dir)
    try:
        on = _run(os.path.join(work, "incremental"), base_mib, adapter_mib, steps, "versions")
        off = _run(os.path.join(work, "full"), base_mib, adapter_mib, steps, False)
        _restores([on, off], steps, 7)
        shutil.rmtree(os.path.join(work, "incremental")), shutil.rmtree(os.path.join(work, "full"))
        changing = _full_training(work, base_mib, max(3, steps // 2 + 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    buf = np.random.default_rng(1).integers(0, 255, 64 * MIB, dtype=np.uint8)
    hashes = {
        "xxh3-128 (xxhash)": _throughput(lambda d: xxhash.xxh3_128(d).digest(), buf),
        "blake2b-128 (hashlib)": _throughput(lambda d: hashlib.blake2b(d, digest_size=16).digest(), buf),
        "crc32c (crc32c)": _throughput(crc32c.crc32c, buf),
    }
    info = machine_info()
    load = ", ".join(f"{x:.1f}" for x in info["load_avg"])
    lines = [
        TITLE,
        "",
        f"Run {info['date']} by `python benchmarks/bench_incremental.py{' --quick' if args.quick else ''}"
        f"{'' if args.quick else f' --base-mib {base_mib} --steps {steps}'}` on "
        f"{info['nproc']} CPUs ({info['cpu']}), Python {info['python']}, tsckpt {info['tsckpt']} "
        f"({info['tsckpt_rev']}). 2-CPU dev machine, loaded by parallel work (load average at the end: {load}): "
        "times are noisy. State: a "
        f"{base_mib} MiB frozen base (4 MiB float32 torch matrices), a {adapter_mib} MiB adapter (nn.Parameter) "
        f"and its torch AdamW state ({3 * adapter_mib} MiB changing per step, one optimizer step before each "
        f"save), {steps} CheckpointManager steps, local disk.",
        "",
        "| step | new bytes, incremental | new bytes, full | save s, incremental | save s, full |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for i in range(steps):
        lines.append(
            f"| {i + 1} | {on['new_bytes'][i] / MIB:.1f} MiB | {off['new_bytes'][i] / MIB:.1f} MiB | "
            f"{on['save_s'][i]:.3f} | {off['save_s'][i]:.3f} |"
        )
    lines += [
        "",
        f"- Restore of step {steps} (warm cache, median of 7, the two taking turns): incremental {on['restore_s']:.3f} s, "
        f"full {off['restore_s']:.3f} s ({on['restore_s'] / off['restore_s']:.2f}x).",
        f"- Saves after the first: incremental {statistics.mean(on['save_s'][1:]):.3f} s, full "
        f"{statistics.mean(off['save_s'][1:]):.3f} s on average "
        f"({statistics.mean(on['save_s'][1:]) / statistics.mean(off['save_s'][1:]):.2f}x); the first save "
        f"(everything hashed and written) {on['save_s'][0] / off['save_s'][0]:.2f}x the save without hashes.",
        f"- `du` of the root after {steps} steps: incremental {on['du'] / MIB:.1f} MiB, full {off['du'] / MIB:.1f} MiB.",
        f"- Full training ({base_mib} MiB, every tensor changed before each of {len(changing[True])} steps, keep_last=2, "
        "the two managers taking turns): save with hashes (`incremental=True`) "
        + ", ".join(f"{x:.3f}" for x in changing[True]) + " s; without (`incremental=False`) "
        + ", ".join(f"{x:.3f}" for x in changing[False]) + " s; median of the per-step ratios after the first "
        f"{statistics.median(a / b for a, b in zip(changing[True][1:], changing[False][1:])):.2f}x.",
        "- Hash throughput on one 64 MiB buffer, one thread: "
        + ", ".join(f"{k} {v:.2f} GiB/s" for k, v in hashes.items())
        + ".",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write_results:
        write_section(TITLE, section)


if __name__ == "__main__":
    main()
