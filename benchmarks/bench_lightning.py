#!/usr/bin/env python
"""Lightning checkpoints: TsckptCheckpointIO against Lightning's default TorchCheckpointIO.

Workload
  The checkpoint dict a Lightning Trainer hands its CheckpointIO after some steps of a
  model of bias-free float32 Linear layers (default 12 x 2048 x 2048, 50.3 M parameters,
  192 MiB) with Adam (exp_avg and exp_avg_sq: 384 MiB): state_dict, optimizer_states, an LR
  scheduler, loop counters and callback states, taken from a real 1-step fit.

Systems (the same process, alternating, each round on a fresh directory)
  torch    pytorch_lightning's TorchCheckpointIO: torch.save to one .ckpt file; load: torch.load
  tsckpt   tsckpt.integrations.lightning.TsckptCheckpointIO: a tsckpt checkpoint directory
           (every file synced before its atomic commit); load: the same dict back

Measures
  save   wall time of save_checkpoint(checkpoint, path)
  load   wall time of load_checkpoint(path), its files in the page cache
  Loaded tensors are compared exactly with the saved ones after measuring.

Usage
  python benchmarks/bench_lightning.py                  # about 30 s
  python benchmarks/bench_lightning.py --quick          # small smoke run
  python benchmarks/bench_lightning.py --write-results  # also update its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from _common import framework_main, machine_info, make_resident, save_load_rows

SECTION = "## Lightning: TsckptCheckpointIO against TorchCheckpointIO"
MiB = 1 << 20


def checkpoint(layers: int, width: int) -> dict:
    """A real Trainer checkpoint dict of the workload, captured from a 1-step fit."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.plugins.io import CheckpointIO

    class Capture(CheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            self.checkpoint = checkpoint

        def load_checkpoint(self, path, map_location=None, weights_only=None):
            raise NotImplementedError

        def remove_checkpoint(self, path):
            pass

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

        def training_step(self, batch, _):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-4)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

    capture = Capture()
    data = torch.utils.data.TensorDataset(torch.randn(2, width))
    trainer = pl.Trainer(
        max_steps=1, plugins=[capture], logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", default_root_dir=tempfile.mkdtemp(),
        callbacks=[pl.callbacks.ModelCheckpoint(every_n_train_steps=1)],
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))
    return capture.checkpoint


def tensors(tree: dict) -> list:
    import torch

    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return out


def cached(path: str, buf: bytearray) -> None:
    """Bring a checkpoint's files (a directory, or one file) into the page cache."""
    if os.path.isdir(path):
        make_resident(path, buf)
    else:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def run(args: argparse.Namespace) -> dict:
    import torch
    from pytorch_lightning.plugins.io import TorchCheckpointIO

    from tsckpt.integrations.lightning import TsckptCheckpointIO

    ck = checkpoint(args.layers, args.width)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(ck))
    systems = {"torch": TorchCheckpointIO(), "tsckpt": TsckptCheckpointIO()}
    times: dict[str, dict[str, list[float]]] = {s: {"save": [], "load": []} for s in systems}
    buf = bytearray(16 * MiB)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for r in range(args.rounds):
            for name, io in systems.items():
                path = os.path.join(root, f"{name}-{r}.ckpt")
                t0 = time.perf_counter()
                io.save_checkpoint(ck, path)
                times[name]["save"].append(time.perf_counter() - t0)
                cached(path, buf)
                t0 = time.perf_counter()
                loaded = io.load_checkpoint(path)
                times[name]["load"].append(time.perf_counter() - t0)
                assert all(torch.equal(a, b) for a, b in zip(tensors(ck), tensors(loaded), strict=True)), name
                del loaded
                io.remove_checkpoint(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine_info(), "nbytes": nbytes, "times": times, "args": vars(args)}


def report(results: dict, args: argparse.Namespace) -> str:
    m = results["machine"]
    t = results["times"]
    med = {s: {k: statistics.median(v) for k, v in t[s].items()} for s in t}
    lines = [
        SECTION,
        "",
        f"Run {m['date']}. Machine: {m['nproc']} CPUs, {m['mem_gib']:.1f} GiB RAM, Linux {m['kernel']}, Python "
        f"{m['python']}; torch {m['torch']}, tensorstore {m['tensorstore']}, tsckpt {m['tsckpt']} ({m['tsckpt_rev']}). "
        f"Load average at start: {', '.join(f'{x:.1f}' for x in m['load_avg'])}. 2-CPU dev machine, loaded by parallel "
        "work: the times are indicative, the ratios between the two systems (measured alternately) more so.",
        "",
        f"Workload: a Lightning Trainer checkpoint dict of {args.layers} bias-free float32 Linear layers of "
        f"{args.width} x {args.width} with Adam state, {results['nbytes'] / MiB:,.0f} MiB of tensors, plus the "
        f"scheduler, loop counters and callback states. Median of {args.rounds} rounds, local disk; loads from the "
        "page cache.",
        "",
        "| system | save (s) | load (s) | save + load (s) | save + load vs torch |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += save_load_rows(med, "torch")
    lines += [
        "",
        "torch: pytorch_lightning's default `TorchCheckpointIO` (`torch.save` of the dict to one file, no fsync; "
        "`torch.load`); tsckpt: `TsckptCheckpointIO` (a checkpoint directory, each file synced before the "
        "atomic commit; the dict back with `as_saved=True`). Reproduce with `python benchmarks/bench_lightning.py`.",
    ]
    return "\n".join(lines)


def main() -> None:
    framework_main(__doc__, run, report, SECTION)


if __name__ == "__main__":
    main()
