#!/usr/bin/env python
"""Quantized training state: save and restore of an fp8 state, tsckpt against DCP.

Workload
  ``layers`` square weights of ``width`` (default 8 x 1024): each as a torchao
  ``Float8Tensor`` of 128 x 128 blocks (float8_e4m3fn data + float32 block scales), its
  bf16 master weight, and AdamW's state for the master (exp_avg, exp_avg_sq in float32,
  step), one flat dict.

Systems (the same process, each repeated; each save into a new directory)
  tsckpt        tsckpt.save(dir, state); tsckpt.restore(dir, target, inplace=True) into a
                state of the same structure (the float8 weights restored as Float8Tensor)
  dcp           torch.distributed.checkpoint.save / load of the same state where it saves
                it; where it refuses the Float8Tensor leaves, of the state with each float8
                weight given by hand as its two plain tensors (data and scales), and the
                refusal is reported

  Restored values are compared bit for bit with the saved ones after measuring.

Usage
  python benchmarks/bench_quantized.py --quick            # small run (seconds)
  python benchmarks/bench_quantized.py --write-results    # also update its RESULTS.md section
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

from _common import dir_stats, write_section

SECTION = "## Quantized training state: fp8 weights + bf16 master + AdamW, tsckpt against DCP"


def build(layers: int, width: int, seed: int) -> dict[str, Any]:
    import torch
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock

    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for i in range(layers):
        master = torch.randn(width, width, generator=g).to(torch.bfloat16)
        state[f"model.l{i}.weight"] = Float8Tensor.from_hp(master, granularity=PerBlock([128, 128]))
        state[f"master.l{i}.weight"] = master
        state[f"optim.l{i}.exp_avg"] = torch.randn(width, width, generator=g)
        state[f"optim.l{i}.exp_avg_sq"] = torch.rand(width, width, generator=g)
        state[f"optim.l{i}.step"] = torch.tensor(float(seed))
    return state


def as_plain(state: dict[str, Any]) -> dict[str, Any]:
    """Each Float8Tensor as its two plain tensors (what a DCP user writes by hand)."""
    out = {}
    for k, v in state.items():
        if type(v).__name__ == "Float8Tensor":
            out[k], out[k + "_scale_inv"] = v.qdata, v.scale
        else:
            out[k] = v
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    def raw(t: Any) -> list[Any]:
        ts = [t.qdata, t.scale] if type(t).__name__ == "Float8Tensor" else [t]
        return [x.reshape(-1).view(torch.uint8) for x in ts]

    return all(all(torch.equal(x, y) for x, y in zip(raw(a[k]), raw(b[k]))) for k in a)


def timed(fn: Any, repeats: int, arg: Any = None) -> float:
    """Median time of ``fn(arg(i))`` over ``repeats`` runs (``arg``: what each run is given,
    made outside the timing)."""
    times = []
    for i in range(repeats):
        given = None if arg is None else arg(i)
        t0 = time.perf_counter()
        fn() if arg is None else fn(given)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import tsckpt

    torch.set_num_threads(1)
    state = build(args.layers, args.width, seed=1)
    nbytes = sum(
        (v.qdata.nbytes + v.scale.nbytes) if type(v).__name__ == "Float8Tensor" else v.nbytes for v in state.values()
    )
    root = tempfile.mkdtemp(prefix="bench_quantized_")
    results: dict[str, Any] = {"nbytes": nbytes, "layers": args.layers, "width": args.width}
    try:
        # each save into a new directory: removing the last one's files is no part of a save
        d = f"{root}/tsckpt"
        target = build(args.layers, args.width, seed=2)
        results["tsckpt"] = {"save": timed(lambda p: tsckpt.save(p, state), args.repeats, lambda i: f"{d}{i}")}
        d = f"{d}0"
        results["tsckpt_stored"] = dir_stats(d)[1]
        results["tsckpt"]["restore"] = timed(lambda: tsckpt.restore(d, target, inplace=True), args.repeats)
        results["tsckpt"]["exact"] = same(state, target)

        dd = f"{root}/dcp"
        dcp_state: dict[str, Any] = state
        try:
            dcp.save(state, checkpoint_id=f"{dd}-probe")
            results["dcp_refusal"] = None
        except Exception as e:  # noqa: BLE001 - reported
            results["dcp_refusal"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            dcp_state = as_plain(state)
        dcp_target = build(args.layers, args.width, seed=2)
        dcp_target = dcp_target if results["dcp_refusal"] is None else as_plain(dcp_target)
        results["dcp"] = {
            "save": timed(lambda p: dcp.save(dcp_state, checkpoint_id=p), args.repeats, lambda i: f"{dd}{i}")
        }
        probe = dcp.FileSystemReader(f"{dd}-probe").read_metadata() if results["dcp_refusal"] is None else None
        dd = f"{dd}0"
        results["dcp_stored"] = dir_stats(dd)[1]
        weight = next(k for k in state if k.startswith("model."))
        results["dcp_weight_dtype"] = None if probe is None else str(probe.state_dict_metadata[weight].properties.dtype)
        results["dcp"]["restore"] = timed(lambda: dcp.load(dcp_target, checkpoint_id=dd), args.repeats)
        results["dcp"]["exact"] = same(dcp_state, dcp_target)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def report(r: dict[str, Any]) -> str:
    mib = r["nbytes"] / (1 << 20)
    rows = [
        SECTION,
        "",
        (
            f"{r['layers']} weights of {r['width']} x {r['width']}: Float8Tensor (128 x 128 blocks) + bf16 master + "
            f"AdamW (float32 moments), {mib:.0f} MiB; median of the runs, one process, page cache warm. 2-CPU dev "
            "machine, loaded by parallel work: the times are noisy, compare the systems only with each other."
        ),
        "",
        "| system | save s | restore s | save MiB/s | restore MiB/s | stored MiB | bit-exact |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("tsckpt", "dcp"):
        x = r[name]
        rows.append(
            f"| {name} | {x['save']:.3f} | {x['restore']:.3f} | {mib / x['save']:.0f} | {mib / x['restore']:.0f} "
            f"| {r[name + '_stored'] / (1 << 20):.0f} | {'yes' if x['exact'] else 'NO'} |"
        )
    rows.append("")
    if r["dcp_refusal"]:
        rows.append(
            f"DCP refused the Float8Tensor leaves (`{r['dcp_refusal']}`); its row saves each float8 weight given by "
            "hand as two plain tensors. tsckpt saves and restores the Float8Tensor itself (data and scales as "
            "arrays, its metadata beside them)."
        )
    else:
        rows.append(
            "DCP saved the Float8Tensor leaves itself: its data file holds each as the subclass object (the "
            "float8 data, the scales and their serialization: about the stored size of tsckpt's), while its metadata "
            f"describes a {r['dcp_weight_dtype']} tensor of the logical shape. tsckpt stores the float8 data and the "
            "scales as arrays of their own, with the subclass's metadata beside them, readable without torch."
        )
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="4 weights of 512, 2 repeats")
    p.add_argument("--write-results", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.layers, args.width, args.repeats = 4, 512, 2
    warnings.filterwarnings("ignore")
    section = report(run(args))
    print(section)
    if args.write_results:
        write_section(SECTION, section)


if __name__ == "__main__":
    main()
