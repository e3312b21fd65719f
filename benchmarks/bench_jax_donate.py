#!/usr/bin/env python
"""A JAX training loop whose jitted step donates the state: how long each save's call blocks, tsckpt against Orbax.

Issue 33's JAX target: in a loop whose step is ``jax.jit(step, donate_argnums=0)`` (every
array of the state updated, its old buffer donated and deleted), 20 of 20 saves committed
and bit-exact, the call blocking no longer than Orbax's asynchronous save of the same state.

Workloads (one CPU device; a state of parameters and one tree of moments of the same shapes)
  large   24 float32 arrays of 1024 x 1024 and their moments (48 leaves, 192 MiB)
  many    250 float32 arrays of 128 x 128 and their moments (500 leaves, 31 MiB): per-leaf
          work dominates

Each case runs in a fresh process: the state is built and the step compiled, then ``--saves``
times: ``--steps`` donated steps, a wait for the previous save (outside the timed call, as
the users of both libraries do before the next save), a host copy of the state
(``np.array(leaf, copy=True)``: what the save must hold), the timed call, and at once the
next donated step (timed to its result). After the loop every saved step is restored and
compared bit for bit with its host copy. Cases, their order rotated by the round:

  tsckpt  ``tsckpt.CheckpointManager(root).save_async(step, state)`` with its defaults (jax
          arrays are copied to host memory in the call and saved by the manager's thread);
          the previous save's ``result()`` before the next call; committed: its handle's done
          callback (the result is out at the commit)
  orbax   orbax-checkpoint's ``CheckpointManager`` with ``enable_async_checkpointing=True``
          (its default) and ``save(step, args=ocp.args.StandardSave(state))``, what Orbax
          documents as its asynchronous save; ``wait_until_finished()`` before the next call;
          committed: ``AsyncOptions.post_finalization_callback`` (it runs right before the
          rename of the temporary directory into the step's, a rename on a local disk)

Reported per workload and case: the call's blocking time (median and max, ``perf_counter``
around the call only), saves committed and bit-exact of ``--saves``, the median time from
the call to the commit, the donated step right after the call, the call and that step
together, how many of those steps took the donated buffers (an array whose buffer a save
still holds, e.g. through a zero-copy numpy view of a CPU array, is not donated: jax then
leaves it alive and allocates the step's outputs afresh), the wait for the previous save
before the next call, and the process's peak RSS above its start, less the host copies the
benchmark keeps. For reference, a plain copy of the state into host buffers made beforehand.

Usage
  python benchmarks/bench_jax_donate.py --quick                          # 4 saves, small arrays
  python benchmarks/bench_jax_donate.py --saves 20 --rounds 1 --write-results
  python benchmarks/bench_jax_donate.py --cases tsckpt --workloads many --json raw.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from _common import bench_parser, finish, machine_info, reset_peak, rss, run_child

TITLE = "## JAX donated-step loop (issue 33): save call against Orbax's async save"
WORKLOADS = {"large": (24, 1024), "many": (250, 128)}  # arrays per tree, side
QUICK = {"large": (4, 256), "many": (50, 32)}
CASES = ("tsckpt", "orbax")
MiB = 1 << 20


def _state(count: int, side: int) -> Any:
    """Parameters and moments, every value distinct and non-zero (Orbax does not store a chunk of zeros)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {f"w{i:03d}": jnp.asarray(rng.standard_normal((side, side), dtype=np.float32)) for i in range(count)}
    moments = {k: jnp.full((side, side), 0.5, jnp.float32) for k in params}
    return {"params": params, "moments": moments}


def _step(state: Any) -> Any:
    """An update of every array: moments from the parameters, parameters from the moments."""
    import jax

    moments = jax.tree.map(lambda m, p: 0.9 * m + 0.1 * p, state["moments"], state["params"])
    params = jax.tree.map(lambda p, m: p - 1e-3 * m + 1e-4, state["params"], moments)
    return {"params": params, "moments": moments}


class _Tsckpt:
    def __init__(self, root: str) -> None:
        import tsckpt

        self.manager = tsckpt.CheckpointManager(root)
        self.handle: Any = None
        self.committed: dict[int, float] = {}

    def save(self, step: int, state: Any) -> bool:
        self.handle = self.manager.save_async(step, state)
        self.handle.add_done_callback(lambda f, s=step: self.committed.setdefault(s, time.perf_counter()))
        return True

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.result()

    def steps(self) -> list[int]:
        return self.manager.all_steps()

    def restore(self, step: int, abstract: Any) -> Any:
        return self.manager.restore(step)

    def close(self) -> None:
        self.manager.close()


class _Orbax:
    def __init__(self, root: str) -> None:
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.done: list[float] = []  # one save in flight at a time: the last entry is the last save's
        self.committed: dict[int, float] = {}
        self.pending: int | None = None
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=lambda: self.done.append(time.perf_counter())),
        )
        self.manager = ocp.CheckpointManager(root, options=options)

    def save(self, step: int, state: Any) -> bool:
        self.pending = step
        return bool(self.manager.save(step, args=self.ocp.args.StandardSave(state)))

    def wait(self) -> None:
        self.manager.wait_until_finished()
        if self.pending is not None and self.done:
            self.committed[self.pending] = self.done[-1]
            self.done.clear()
        self.pending = None

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, step: int, abstract: Any) -> Any:
        return self.manager.restore(step, args=self.ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.manager.close()


def _bit_exact(restored: Any, expected: list[Any]) -> bool:
    import jax
    import numpy as np

    got = jax.tree.leaves(restored)
    if len(got) != len(expected):
        return False
    for a, e in zip(got, expected):
        a = np.asarray(a)
        if a.shape != e.shape or a.dtype != e.dtype or not np.array_equal(a.view(np.uint8), e.view(np.uint8)):
            return False
    return True


def _plain_copy(leaves: list[Any]) -> float:
    """The reference: a copy of the state into host buffers made (and touched) beforehand, median of 3."""
    import numpy as np

    src = [np.asarray(leaf) for leaf in leaves]
    dst = [np.empty_like(a) for a in src]
    times = []
    for _ in range(4):
        t = time.perf_counter()
        for d, a in zip(dst, src):
            np.copyto(d, a)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One case in this process (a child of the driver)."""
    import jax
    import numpy as np

    count, side = (QUICK if spec["quick"] else WORKLOADS)[spec["workload"]]
    train = jax.jit(_step, donate_argnums=0)
    state = _state(count, side)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    first = jax.tree.leaves(state)[0]
    state = jax.block_until_ready(train(state))  # compiled before anything is timed
    donated = first.is_deleted()
    saver = _Tsckpt(spec["path"]) if spec["case"] == "tsckpt" else _Orbax(spec["path"])
    base = rss()
    reset_peak()
    calls, starts, nexts, waits, copies, performed, errors, donations = [], {}, [], [], [], 0, [], 0
    for n in range(spec["saves"]):
        for _ in range(spec["steps"]):
            state = train(state)
        t = time.perf_counter()
        saver.wait()
        waits.append(time.perf_counter() - t)
        copies.append([np.array(leaf, copy=True) for leaf in jax.tree.leaves(jax.block_until_ready(state))])
        step = (n + 1) * spec["steps"]
        old = jax.tree.leaves(state)[0]
        t = time.perf_counter()
        try:
            performed += saver.save(step, state)
        except Exception as e:  # noqa: BLE001 - a failed save is counted, not fatal
            errors.append(f"{type(e).__name__}: {e}"[:200])
        calls.append(time.perf_counter() - t)
        starts[step] = t
        t = time.perf_counter()
        state = jax.block_until_ready(train(state))
        nexts.append(time.perf_counter() - t)
        donations += old.is_deleted()  # False: the step could not take the buffer (a save still holds it)
        del old
    try:
        saver.wait()
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}"[:200])
    peak_extra = rss("VmHWM:") - base - len(copies) * nbytes
    plain = _plain_copy(jax.tree.leaves(state))
    saved = set(saver.steps())
    committed = [s for s in starts if s in saved and s in saver.committed]
    exact = 0
    for i, s in enumerate(starts):
        if s in saved:
            try:
                exact += _bit_exact(saver.restore(s, abstract), copies[i])
            except Exception as e:  # noqa: BLE001
                errors.append(f"restore {s}: {type(e).__name__}: {e}"[:200])
    saver.close()
    return {
        "calls": calls, "nexts": nexts, "waits": waits, "performed": performed,
        "committed": len(committed), "exact": exact, "saves": spec["saves"],
        "to_commit": [saver.committed[s] - starts[s] for s in committed],
        "peak_extra": peak_extra, "nbytes": nbytes, "leaves": len(jax.tree.leaves(state)),
        "donated": donated, "donations": donations, "plain_copy": plain, "errors": errors[:5],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = [c for c in args.cases.split(",") if c]
    results: dict[str, Any] = {"machine": machine_info(), "saves": args.saves, "steps": args.steps,
                               "rounds": args.repeats, "quick": args.quick, "rows": {}}
    base = tempfile.mkdtemp(prefix="bench-jax-donate-", dir=args.dir)
    try:
        for workload in args.workloads.split(","):
            for r in range(args.repeats):
                for case in cases[r % len(cases):] + cases[: r % len(cases)]:  # rotated by the round
                    path = os.path.join(base, f"{workload}-{case}-{r}")
                    spec = {"case": case, "workload": workload, "path": path, "saves": args.saves,
                            "steps": args.steps, "quick": args.quick}
                    t = time.perf_counter()
                    try:
                        got = run_child(__file__, spec, args.timeout)
                    except Exception as e:  # noqa: BLE001 - a failed or timed-out case is reported, not fatal
                        got = {"error": (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]}
                    got["wall"] = time.perf_counter() - t
                    shutil.rmtree(path, ignore_errors=True)
                    results["rows"].setdefault(workload, {}).setdefault(case, []).append(got)
                    print(workload, case, {k: v for k, v in got.items() if k not in ("calls", "nexts", "waits", "to_commit")},
                          flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Pooled over the rounds: every call counts once."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return None

    def pool(key: str) -> list[float]:
        return [x for r in ok for x in r[key]]

    calls, commits = pool("calls"), pool("to_commit")
    blocked = [c + s for r in ok for c, s in zip(r["calls"], r["nexts"])]
    return {
        "call_med": statistics.median(calls), "call_max": max(calls),
        "committed": sum(r["committed"] for r in ok), "exact": sum(r["exact"] for r in ok),
        "saves": sum(r["saves"] for r in ok),
        "commit_med": statistics.median(commits) if commits else None,
        "next_med": statistics.median(pool("nexts")), "blocked_med": statistics.median(blocked),
        "donations": sum(r["donations"] for r in ok), "plain_copy": statistics.median(r["plain_copy"] for r in ok), "wait_med": statistics.median(pool("waits")),
        "peak_extra": statistics.median(r["peak_extra"] for r in ok),
        "nbytes": ok[0]["nbytes"], "leaves": ok[0]["leaves"], "donated": all(r["donated"] for r in ok),
        "errors": [e for r in ok for e in r["errors"]],
    }


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    m = results["machine"]
    lines = [
        TITLE, "",
        (f"Run {m['date']} by `python benchmarks/bench_jax_donate.py{' --quick' if results['quick'] else ''} "
        f"--saves {results['saves']} --rounds {results['rounds']} --steps {results['steps']}`; {m['nproc']} CPUs "
        f"({m['cpu']}), tsckpt {m['tsckpt_rev']}, tensorstore {m['tensorstore']}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_avg'])}. One CPU device; each case a fresh process; "
        f"{results['steps']} donated steps between saves; times pooled over every call of the rounds."),
        "",
        ("| workload (state) | case | call, median (ms) | call, max (ms) | committed | bit-exact "
        "| call to commit, median (ms) | step after the call (ms) | call + that step (ms) | donations taken by that step "
         "| wait before the next call (ms) "
        "| peak RSS above start, less the kept copies (MiB) |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for workload, cases in results["rows"].items():
        s = {case: _summary(rounds) for case, rounds in cases.items()}
        for case, rounds in cases.items():
            row = s[case]
            if row is None:
                lines.append(f"| {workload} | {case} | failed: {rounds[0]['error'][:120]} | | | | | | | | | |")
                continue
            state = f"{workload} ({row['leaves']} leaves, {row['nbytes'] / MiB:.{0 if row['nbytes'] >= 10 * MiB else 1}f} MiB)"
            lines.append(
                f"| {state} | {case} | {_ms(row['call_med'])} | {_ms(row['call_max'])} "
                f"| {row['committed']} / {row['saves']} | {row['exact']} / {row['saves']} | {_ms(row['commit_med'])} "
                f"| {_ms(row['next_med'])} | {_ms(row['blocked_med'])} | {row['donations']} / {row['saves']} "
                f"| {_ms(row['wait_med'])} | {row['peak_extra'] / MiB:.0f} |"
            )
            for e in row["errors"][:3]:
                verdicts.append(f"- {workload}, {case}: {e}")
            if not row["donated"]:
                verdicts.append(f"- {workload}: the step's donation left the old buffers alive (not donated)")
        copied = [row["plain_copy"] for row in s.values() if row is not None]
        if copied:
            verdicts.append(f"- {workload}: a plain copy of the state into ready host buffers takes "
                            f"{_ms(statistics.median(copied))} ms (median over the cases' processes)")
        t, o = s.get("tsckpt"), s.get("orbax")
        if t is not None and o is not None:
            whole = t["committed"] == t["exact"] == t["saves"]
            faster = t["call_med"] <= o["call_med"]
            verdicts.append(
                f"- {workload}: tsckpt {t['committed']} / {t['saves']} committed, {t['exact']} bit-exact; call "
                f"{_ms(t['call_med'])} ms against Orbax's {_ms(o['call_med'])} ms "
                f"({t['call_med'] / o['call_med']:.2f}x of medians; max {_ms(t['call_max'])} against "
                f"{_ms(o['call_max'])} ms; call + the step after it {_ms(t['blocked_med'])} against "
                f"{_ms(o['blocked_med'])} ms): target {'met' if whole and faster else '**missed**'}."
            )
    if verdicts:
        lines += ["", "Against the target (every save committed and bit-exact, the call's median no longer than Orbax's):", ""]
        lines += verdicts
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_parser(__doc__, repeats=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--steps", type=int, default=3, help="donated steps between saves")
    p.add_argument("--json", default=None, help="keep every measurement in this file")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.quick:
        args.saves = min(args.saves, 4)
    finish(run(args), args, report, TITLE)


if __name__ == "__main__":
    main()
