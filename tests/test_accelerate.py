"""tsckpt.integrations.accelerate: an Accelerator's state saved and loaded through tsckpt, as
accelerate's users call save_state / load_state, resumed bit-exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import tsckpt  # noqa: E402
from tsckpt.integrations.accelerate import load_state, save_state, save_state_async, train_state  # noqa: E402


class Counter:
    """An object given to register_for_checkpointing."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def setup(seed: int = 0):
    """A prepared model, optimizer, scheduler and loader, as an accelerate script builds them."""
    from accelerate.utils import set_seed

    acc = accelerate.Accelerator(cpu=True)
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    return acc, model, opt, sched, loader, counter


def steps(acc, model, opt, sched, loader, counter, n: int) -> list[float]:
    """``n`` training steps; dropout and an extra random draw make the losses depend on the RNG states."""
    losses = []
    for x, y in loader:
        if len(losses) == n:
            break
        loss = torch.nn.functional.mse_loss(model(x), y) + 1e-3 * torch.rand(()) + 1e-3 * np.random.rand()
        loss = loss + 1e-3 * random.random()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.step += 1
        counter.n += 1
        losses.append(loss.item())
    return losses


def test_save_then_load_resumes_bit_exact(tmp_path):
    parts = setup()
    steps(*parts, 3)
    save_state(parts[0], tmp_path / "ckpt")
    whole = steps(*parts, 3)

    other = setup(seed=5)  # another start: everything must come from the checkpoint
    load_state(other[0], tmp_path / "ckpt")
    assert other[0].step == 3 and other[-1].n == 3 and other[3].scheduler.last_epoch == 3
    assert steps(*other, 3) == whole


def test_checkpoint_layout_is_a_train_state(tmp_path):
    parts = setup()
    steps(*parts, 2)
    save_state(parts[0], tmp_path / "ckpt")
    tree = tsckpt.restore(tmp_path / "ckpt", as_saved=True)
    assert sorted(tree["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert torch.equal(tree["model"]["0.weight"], parts[1].state_dict()["0.weight"])
    assert tree["optim"]["types"] == ["torch.optim.adamw.AdamW"]
    assert tree["extra"]["step"] == 2 and tree["extra"]["custom"] == [{"n": 2}]
    assert tree["extra"]["schedulers"][0]["last_epoch"] == 2
    assert sorted(tree["ranks"][0]["rng"]) == ["numpy", "python", "torch"]


def test_async_save(tmp_path):
    parts = setup()
    steps(*parts, 2)
    handle = save_state_async(parts[0], tmp_path / "ckpt")
    expected = {k: v.clone() for k, v in parts[1].state_dict().items()}
    steps(*parts, 1)  # training goes on while the save runs: the saved state is the staged one
    handle.result()
    tree = tsckpt.restore(tmp_path / "ckpt", as_saved=True)
    assert all(torch.equal(tree["model"][k], v) for k, v in expected.items())


def test_train_state_with_a_manager(tmp_path):
    parts = setup()
    steps(*parts, 2)
    manager = tsckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    manager.save(2, train_state(parts[0]))
    whole = steps(*parts, 2)
    other = setup(seed=3)
    assert manager.restore(target=train_state(other[0])) == 2
    assert steps(*other, 2) == whole


def test_without_a_prepared_model_is_refused(tmp_path):
    with pytest.raises(tsckpt.LeafTypeError, match=r"no prepared model: call accelerator.prepare"):
        save_state(accelerate.Accelerator(cpu=True), tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("kind", "version", "match"),
    [("DEEPSPEED", 1, r"runs DEEPSPEED, which saves its own engine's checkpoint"), ("FSDP", 1, r"FSDP version 1")],
)
def test_engines_tsckpt_cannot_hold_are_refused(tmp_path, kind, version, match):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    fake = SimpleNamespace(
        distributed_type=DistributedType[kind], state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version))
    )
    with pytest.raises(tsckpt.LeafTypeError, match=match):
        save_state(fake, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def ddp_run(rank: int, world: int, directory: str, resume: bool) -> list[float]:
    """A rank of a 2-process DDP run on the CPU: 2 steps then a save, then 2 more steps; or a
    fresh start that loads the save and runs the same 2 steps."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    parts = setup(seed=7 if resume else 0)
    assert parts[0].num_processes == world and isinstance(parts[1], torch.nn.parallel.DistributedDataParallel)
    if resume:
        load_state(parts[0], directory)
        return steps(*parts, 2)
    steps(*parts, 2)
    save_state(parts[0], directory)
    return steps(*parts, 2)


@pytest.mark.slow
def test_ddp_resume_bit_exact(tmp_path):
    from tests.dist_helpers import run_ranks

    whole = run_ranks(ddp_run, 2, str(tmp_path / "ckpt"), False, timeout=180)
    resumed = run_ranks(ddp_run, 2, str(tmp_path / "ckpt"), True, timeout=180)
    assert resumed == whole and whole[0] != whole[1]
    stored = tsckpt.restore(tmp_path / "ckpt", as_saved=True)
    assert sorted(stored["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # DDP's module. prefix gone
    assert sorted(stored["ranks"]) == [0, 1]


def test_several_models_and_optimizers(tmp_path):
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opts = torch.optim.Adam(gen.parameters()), torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    gen, disc, *opts = acc.prepare(gen, disc, *opts)
    disc(gen(torch.randn(2, 3))).sum().backward()
    for o in opts:
        o.step()
    save_state(acc, tmp_path / "ckpt")
    tree = tsckpt.restore(tmp_path / "ckpt", as_saved=True)
    assert sorted(tree["model"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert tree["optim"]["types"] == ["torch.optim.adam.Adam", "torch.optim.sgd.SGD"]
    expected = {k: v.clone() for k, v in {**gen.state_dict(), **{f"d{k}": v for k, v in disc.state_dict().items()}}.items()}
    momentum = opts[1].optimizer.state[disc.weight]["momentum_buffer"].clone()
    with torch.no_grad():
        for p in [*gen.parameters(), *disc.parameters()]:
            p.zero_()
    opts[1].optimizer.state[disc.weight]["momentum_buffer"].zero_()
    load_state(acc, tmp_path / "ckpt")
    got = {**gen.state_dict(), **{f"d{k}": v for k, v in disc.state_dict().items()}}
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert torch.equal(opts[1].optimizer.state[disc.weight]["momentum_buffer"], momentum)
