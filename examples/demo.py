"""Save a small training state, list it, read a slice lazily, restore it, check it.

Run: python examples/demo.py
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

import tsckpt


def make_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    model, opt = make_state(seed=0)
    train_step(model, opt)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1,
        "rng": np.random.default_rng(0).integers(0, 2**32, size=4, dtype=np.uint64),
        "run": "demo",
    }

    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "step-1")
        tsckpt.save(directory, state)

        # What `tsckpt ls DIR` prints, through the API: no array data is read.
        reader = tsckpt.open(directory)
        total = 0
        print(f"checkpoint {directory}:")
        for path in reader:
            leaf = reader[path]
            if isinstance(leaf, tsckpt.LazyArray):
                md = leaf.metadata
                total += md.nbytes
                print(f"  {path:40s} {md.dtype:9s} {str(list(md.shape)):10s} {md.nbytes:>6d} B")
            else:
                print(f"  {path:40s} {type(leaf).__name__:9s} = {leaf!r}")
        print(f"  {len(reader)} leaves, {total} bytes of arrays")

        # A lazy read touches only the chunks the slice needs.
        row = reader["model/0.weight"].torch[0, :4]
        print(f"model/0.weight[0, :4] = {row.tolist()}")

        # Restore into a fresh model and optimizer of the same shapes (one step
        # creates the optimizer's per-parameter state), then load them.
        fresh_model, fresh_opt = make_state(seed=1)
        train_step(fresh_model, fresh_opt)
        target = {
            "model": fresh_model.state_dict(),
            "optimizer": fresh_opt.state_dict(),
            "step": 0,
            "rng": np.zeros(4, dtype=np.uint64),
            "run": "",
        }
        restored = tsckpt.restore(directory, target)
        fresh_model.load_state_dict(restored["model"])
        fresh_opt.load_state_dict(restored["optimizer"])

        for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()):
            assert torch.equal(a, b), "restored weights differ from the saved ones"
        for i, s in opt.state_dict()["state"].items():
            for k, v in s.items():
                assert torch.equal(v, fresh_opt.state_dict()["state"][i][k]), f"optimizer state {i}/{k} differs"
        assert restored["step"] == 1 and restored["run"] == "demo"
        assert np.array_equal(restored["rng"], state["rng"])
        print(f"restored {len(reader)} leaves: weights, optimizer state, step and rng match the saved ones")


if __name__ == "__main__":
    main()
