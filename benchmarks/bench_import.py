#!/usr/bin/env python
"""What ``import tsckpt`` costs a JAX process: wall seconds and RSS added by the import,
then by a first save and restore of a small numpy tree, and whether torch was imported.

Cases (each in a fresh process that has imported jax and run one jax computation first,
as a JAX program has, before the timer starts):
  tsckpt           ``import tsckpt`` from this checkout (torch is imported only when a torch
                   object is involved: tsckpt/_base/lazytorch.py)
  torch + tsckpt   ``import torch`` then ``import tsckpt``: what every process paid when
                   tsckpt imported torch at import
  base             ``import tsckpt`` from the checkout at ``--base DIR`` (e.g. a worktree of
                   an earlier commit), for before/after numbers of the same code path

Rounds rotate the case order; the report gives medians.

Usage
  python benchmarks/bench_import.py                       # 5 rounds
  python benchmarks/bench_import.py --base /tmp/before    # also an earlier checkout
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import bench_parser, finish, machine_info, rss, run_child  # noqa: E402

TITLE = "## Import cost in a JAX process: `import tsckpt` with and without torch"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np

    jnp.arange(4).sum().block_until_ready()  # a JAX process that has started its backend
    r0, t0 = rss(), time.perf_counter()
    if spec["torch_first"]:
        import torch  # noqa: F401
    import tsckpt

    t_import, r_import = time.perf_counter() - t0, rss() - r0
    tree = {"w": np.arange(1 << 16, dtype=np.float32), "step": 3}
    with tempfile.TemporaryDirectory() as d:
        t1 = time.perf_counter()
        tsckpt.save(os.path.join(d, "c"), tree)
        tsckpt.restore(os.path.join(d, "c"))
        t_first = time.perf_counter() - t1
    return {"import_s": t_import, "import_rss": r_import, "first_s": t_first, "total_rss": rss() - r0,
            "torch": "torch" in sys.modules, "file": tsckpt.__file__}


def report(results: dict[str, Any], args: Any) -> str:
    m = results["machine"]
    lines = [
        TITLE, "",
        f"{m['date']}; {m['cpu']} ({m['nproc']} CPUs), Python {m['python']}, torch {m['torch']}, "
        f"tsckpt {m['tsckpt_rev']}; load average {m['load_avg'][0]:.1f} at the start "
        "(2-CPU dev machine, loaded by parallel work: times vary; RSS is steadier).",
        f"Medians of {results['rounds']} rounds, each case in a fresh JAX process (jax imported and one "
        "computation run before the timer starts). *first save+restore*: `tsckpt.save` and `tsckpt.restore` "
        "of a 256 KiB numpy array and an int right after the import. *base*: `import tsckpt` from a checkout "
        "of the commit named (`--base`); *torch + tsckpt*: torch imported first, as tsckpt did before its lazy "
        "torch import.",
        "",
        "| case | import s | RSS added by the import | first save+restore s | RSS added in all | torch imported |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for case, runs in results["cases"].items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "import_rss", "first_s", "total_rss")}
        lines.append(
            f"| {case} | {med['import_s']:.2f} | {med['import_rss'] / 2**20:.0f} MiB | {med['first_s']:.2f} | "
            f"{med['total_rss'] / 2**20:.0f} MiB | {'yes' if all(r['torch'] for r in runs) else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_parser(__doc__, repeats=5)
    p.add_argument("--base", default=None, help="another tsckpt checkout to measure as 'base'")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    cases: dict[str, tuple[str, bool]] = {"tsckpt": (REPO, False), "torch + tsckpt": (REPO, True)}
    if args.base:
        rev = subprocess.run(["git", "-C", args.base, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        cases[f"base ({rev.stdout.strip() or 'another checkout'})"] = (os.path.abspath(args.base), False)
    rounds = 1 if args.quick else args.repeats
    out: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    names = list(cases)
    for r in range(rounds):
        for case in names[r % len(names):] + names[: r % len(names)]:
            root, torch_first = cases[case]
            env = {"PYTHONPATH": root, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
            res = run_child(os.path.abspath(__file__), {"torch_first": torch_first}, args.timeout, env=env)
            if not res["file"].startswith(root):
                raise RuntimeError(f"{case}: imported tsckpt from {res['file']}, not {root}")
            out[case].append(res)
            print(f"round {r + 1} {case}: {res['import_s']:.2f} s, {res['import_rss'] / 2**20:.0f} MiB, "
                  f"torch={res['torch']}", file=sys.stderr)
    finish({"machine": machine_info(), "rounds": rounds, "cases": out}, args, report, TITLE)


if __name__ == "__main__":
    main()
