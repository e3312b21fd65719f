"""tsckpt.integrations.torchtitan: TsckptCheckpointManager driven as torchtitan's trainer drives
its checkpoint manager (ModelWrapper, OptimizersContainer, LRSchedulersContainer, its data
loader, the trainer's own state), resumed bit-exact."""

from __future__ import annotations

import pathlib

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("torchdata")

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402

import tsckpt  # noqa: E402
from tsckpt.integrations.torchtitan import TsckptCheckpointManager  # noqa: E402


class Data(torch.utils.data.IterableDataset):
    """An endless stream of samples, each a function of its index, that remembers its position
    (as torchtitan's datasets do)."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.pos, self.rank, self.world = 0, rank, world

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.pos * self.world + self.rank)
            self.pos += 1
            yield torch.randn(4, generator=g), torch.randn(1, generator=g)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class Counters:
    """The trainer's own state (torchtitan's Trainer.state_dict)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class Run:
    """What torchtitan's Trainer builds, and its loop (Trainer.train): load, then a step and a
    save per step."""

    def __init__(self, folder: pathlib.Path, total: int, rank: int = 0, world: int = 1, shard=None, **config) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        if shard is not None:
            shard(self.model)
        group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.05})
        self.optimizers = OptimizersContainer.Config(param_groups=[group], implementation="for-loop").build(
            model_parts=[self.model]
        )
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=total
        )
        self.loader = ParallelAwareDataloader(Data(rank, world), dp_rank=rank, dp_world_size=world, batch_size=4)
        self.counters = Counters()
        self.total = total
        settings = {"enable": True, "interval": 2, "keep_latest_k": 2, "last_save_model_only": False, **config}
        self.checkpointer = TsckptCheckpointManager.Config(**settings).build(
            dataloader=self.loader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"train_state": self.counters}, sd_adapter=None,
            base_folder=str(folder),
        )

    def train(self, stop: int | None = None) -> list[float]:
        self.checkpointer.load(step=-1)
        losses = []
        batches = iter(self.loader)
        while self.counters.step < (stop or self.total):
            self.counters.step += 1
            x, y = next(batches)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()
            self.counters.ntokens_seen += x.numel()
            losses.append(loss.item())
            self.checkpointer.save(self.counters.step, last_step=self.counters.step == self.total)
        self.checkpointer.maybe_wait_for_saving()
        return losses


@pytest.mark.parametrize(
    "async_mode", ["disabled", pytest.param("async", marks=pytest.mark.slow(reason="a second torchtitan run, resumed"))]
)
def test_resume_bit_exact(tmp_path, async_mode):
    whole = Run(tmp_path / "whole", 6).train()
    first = Run(tmp_path / "run", 6, async_mode=async_mode)
    assert first.train(stop=4) == whole[:4]
    first.checkpointer.close()  # the job ends after step 4
    again = Run(tmp_path / "run", 6, async_mode=async_mode)
    assert again.train() == whole[4:]  # steps 5 and 6, bit for bit
    assert (again.counters.step, again.counters.ntokens_seen) == (6, 6 * 16)
    assert again.checkpointer.manager.all_steps() == [4, 6]  # keep_latest_k=2
    again.checkpointer.close()


def test_checkpoint_holds_every_state(tmp_path):
    run = Run(tmp_path, 6)
    run.train(stop=2)
    step = run.checkpointer.manager.directory(2)
    tree = tsckpt.restore(step, as_saved=True)
    assert sorted(tree) == ["dataloader", "lr_scheduler", "model", "optimizer", "train_state"]
    assert torch.equal(tree["model"]["0.weight"], run.model[0].weight.detach())
    assert tree["train_state"] == {"step": 2, "ntokens_seen": 32}
    assert tree["lr_scheduler"] == {"last_epoch": 2}
    assert torch.equal(tree["optimizer"]["state.0.weight.exp_avg"], run.optimizers.optimizers[0].state[run.model[0].weight]["exp_avg"])
    assert tree["dataloader"]["world_size"] == 1 and isinstance(tree["dataloader"]["dp_rank_0"], bytes)


def test_last_step_saves_the_model_alone_in_the_export_dtype(tmp_path):
    run = Run(tmp_path, 2, last_save_model_only=True, export_dtype="bfloat16")
    run.train()
    tree = tsckpt.restore(run.checkpointer.manager.directory(2), as_saved=True)
    assert sorted(tree) == ["model"] and tree["model"]["0.weight"].dtype == torch.bfloat16


def test_initial_load_model_only(tmp_path):
    source = Run(tmp_path / "source", 6)
    source.train(stop=2)
    path = str(source.checkpointer.manager.directory(2))
    fresh = Run(tmp_path / "fresh", 6, initial_load_path=path, initial_load_model_only=True)
    assert fresh.checkpointer.load(step=-1)
    assert torch.equal(fresh.model[0].weight, source.model[0].weight)
    assert fresh.counters.step == 0 and fresh.schedulers.schedulers[0].last_epoch == 0  # only the model


def test_exclude_from_loading(tmp_path):
    source = Run(tmp_path, 6)
    source.train(stop=2)
    again = Run(tmp_path, 6, exclude_from_loading=["dataloader", "lr_scheduler"])
    assert again.checkpointer.load(step=-1)
    assert again.counters.step == 2 and again.schedulers.schedulers[0].last_epoch == 0


def test_a_checkpoint_of_another_model_is_refused_naming_leaves(tmp_path):
    source = Run(tmp_path, 6)
    source.train(stop=2)
    other = Run(tmp_path, 6)
    other.model.register_buffer("extra", torch.zeros(2))
    other.checkpointer.states["model"].cached_state_dict = other.checkpointer.states["model"]._get_state_dict()
    with pytest.raises(tsckpt.StructureMismatchError, match=r"the checkpoint lacks 1 \('model/extra'\) of the trainer"):
        other.checkpointer.load(step=-1)


def test_leaves_beyond_the_trainers_are_left_alone(tmp_path):
    """As DCP's loads: a pipeline stage loads its own part of a checkpoint of all stages."""
    source = Run(tmp_path, 6)
    source.model.register_buffer("other_stage", torch.ones(2))
    source.checkpointer.states["model"].cached_state_dict = source.checkpointer.states["model"]._get_state_dict()
    source.train(stop=2)
    again = Run(tmp_path, 6)
    assert again.checkpointer.load(step=-1) and again.counters.step == 2
    assert torch.equal(again.model[0].weight, source.model[0].weight)


def test_missing_load_step_is_refused(tmp_path):
    run = Run(tmp_path, 6)
    run.train(stop=2)
    with pytest.raises(tsckpt.CheckpointNotFoundError, match=r"load_step=3: .* \(complete steps: \[2\]\)"):
        Run(tmp_path, 6).checkpointer.load(step=3)


def test_initial_load_from_a_hugging_face_directory(tmp_path):
    from safetensors.torch import save_file

    class Adapter:  # torchtitan's BaseStateDictAdapter: native names <-> Hugging Face names
        hf_assets_path = None

        def to_hf(self, sd):
            return {f"model.{k}": v for k, v in sd.items()}

        def from_hf(self, sd):
            return {k.removeprefix("model."): v for k, v in sd.items()}

    weights = {f"model.{k}": torch.randn(v.shape) for k, v in Run(tmp_path / "x", 2).model.state_dict().items()}
    (tmp_path / "hf").mkdir()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    run = Run(tmp_path / "run", 2, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True)
    run.checkpointer.sd_adapter = Adapter()
    assert run.checkpointer.load(step=-1)
    assert torch.equal(run.model[2].bias, weights["model.2.bias"])


def test_last_save_in_hf_is_refused_with_the_way():
    with pytest.raises(ValueError, match=r"tsckpt.convert\(step_directory"):
        TsckptCheckpointManager.Config(enable=True, last_save_in_hf=True)


def fsdp2_run(rank: int, world: int, folder: str, stop: int | None) -> list[float]:
    """A rank of a 2-rank FSDP2 run on the CPU, driven as torchtitan's trainer drives it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def shard(model: torch.nn.Module) -> None:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    run = Run(pathlib.Path(folder), 6, rank, world, shard=shard)
    losses = run.train(stop=stop)
    run.checkpointer.close()
    return losses


@pytest.mark.slow
def test_fsdp2_two_ranks_resume_bit_exact(tmp_path):
    from tests.dist_helpers import run_ranks

    whole = run_ranks(fsdp2_run, 2, str(tmp_path / "whole"), None, timeout=240)
    first = run_ranks(fsdp2_run, 2, str(tmp_path / "run"), 4, timeout=240)
    again = run_ranks(fsdp2_run, 2, str(tmp_path / "run"), None, timeout=240)
    for rank in range(2):
        assert first[rank] == whole[rank][:4] and again[rank] == whole[rank][4:], rank
    assert whole[0] != whole[1]  # each rank its own data
    tree = tsckpt.restore(tmp_path / "run" / "checkpoint" / "00000004", as_saved=True)
    assert tree["model"]["0.weight"].shape == (8, 4)  # one global array from both ranks' shards
    assert sorted(tree["dataloader"]) == ["dp_rank_0", "dp_rank_1", "world_size"]
    # resharded 2 -> 1: one process resumes step 6 (the data loader's state is per data-parallel rank)
    one = Run(tmp_path / "run", 6, exclude_from_loading=["dataloader"])
    assert one.checkpointer.load(step=-1) and one.counters.step == 6
    last = tsckpt.restore(tmp_path / "run" / "checkpoint" / "00000006", as_saved=True)
    assert torch.equal(one.model[0].weight, last["model"]["0.weight"])
    state = one.optimizers.optimizers[0].state[one.model[0].weight]
    assert torch.equal(state["exp_avg_sq"], last["optimizer"]["state.0.weight.exp_avg_sq"])
