"""tsckpt.integrations.lightning: Lightning's Trainer saving and resuming through
TsckptCheckpointIO, as its users call it (Trainer plugins, ModelCheckpoint, fit(ckpt_path="last"))."""

from __future__ import annotations

import pathlib

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import tsckpt  # noqa: E402
from tsckpt.integrations.lightning import TsckptCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    """A model whose next losses depend on the weights, Adam's state and the LR schedule."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def trainer(root: pathlib.Path, epochs: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", save_last=True)], **{"devices": 1, **kwargs},
    )


def fit(root: pathlib.Path, epochs: int, *, resume: bool, plugins=()) -> list[float]:
    torch.manual_seed(0)
    model = Tiny()
    trainer(root, epochs, plugins=list(plugins)).fit(model, loader(), ckpt_path="last" if resume else None)
    return model.losses


def test_fit_resumes_from_last_bit_exact(tmp_path):
    whole = fit(tmp_path / "whole", 3, resume=False)
    first = fit(tmp_path / "run", 2, resume=False, plugins=[TsckptCheckpointIO()])
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert last.is_dir() and tsckpt.metadata(last) is not None  # a tsckpt checkpoint directory
    then = fit(tmp_path / "run", 3, resume=True, plugins=[TsckptCheckpointIO()])
    assert first == whole[:8]
    assert len(then) == 4 and then == whole[8:]  # the third epoch's losses, bit for bit


@pytest.mark.slow(reason="three whole Lightning fits (the synchronous twin runs in the fast tier)")
def test_async_save_resumes_bit_exact(tmp_path):
    whole = fit(tmp_path / "whole", 3, resume=False)
    fit(tmp_path / "run", 2, resume=False, plugins=[TsckptCheckpointIO(async_save=True)])
    assert fit(tmp_path / "run", 3, resume=True, plugins=[TsckptCheckpointIO(async_save=True)]) == whole[8:]


def test_async_save_is_waited_for_before_a_removal_and_a_load(tmp_path):
    io = TsckptCheckpointIO(async_save=True)
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    state["w"].zero_()  # the save took its copy during the call
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.arange(1 << 20, dtype=torch.float32))
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "b.ckpt")  # waits for the save first, then removes it whole
    assert not (tmp_path / "b.ckpt").exists()
    io.save_checkpoint({"w": torch.arange(4.0)}, tmp_path / "b.ckpt")
    io.teardown()
    assert torch.equal(tsckpt.restore(tmp_path / "b.ckpt", as_saved=True)["w"], torch.arange(4.0))


def test_checkpoint_dict_round_trips(tmp_path):
    fit(tmp_path, 1, resume=False, plugins=[TsckptCheckpointIO()])
    io = TsckptCheckpointIO()
    ck = io.load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert ck["epoch"] == 0 and ck["global_step"] == 4 and ck["hyper_parameters"] == {"lr": 0.05}
    assert ck["lr_schedulers"][0]["last_epoch"] == 1 and ck["lr_schedulers"][0]["_last_lr"] == [0.025]
    opt = ck["optimizer_states"][0]
    assert opt["param_groups"][0]["betas"] == (0.9, 0.999) and opt["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sorted(opt["state"]) == [0, 1, 2, 3] and opt["state"][0]["exp_avg"].shape == (8, 4)
    assert list(ck["state_dict"]) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    (callback,) = ck["callbacks"].values()
    assert callback["last_model_path"].endswith("last.ckpt")
    reference = torch.load(_torch_save(tmp_path), weights_only=False)
    assert {k: v.tolist() for k, v in reference["state_dict"].items()} != {}  # the same fit, saved by torch.save
    for k, v in reference["state_dict"].items():
        assert torch.equal(ck["state_dict"][k], v), k
    assert ck["loops"] == reference["loops"]


def _torch_save(tmp_path: pathlib.Path) -> pathlib.Path:
    fit(tmp_path / "reference", 1, resume=False)
    return tmp_path / "reference" / "ckpt" / "last.ckpt"


def test_map_location_device(tmp_path):
    fit(tmp_path, 1, resume=False, plugins=[TsckptCheckpointIO()])
    ck = TsckptCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "last.ckpt", map_location="meta")
    assert ck["state_dict"]["net.0.weight"].device.type == "meta" and ck["global_step"] == 4


def test_attribute_dict_hyperparameters_are_stored_as_dicts(tmp_path):
    from lightning_fabric.utilities.data import AttributeDict

    io = TsckptCheckpointIO()
    io.save_checkpoint({"hyper_parameters": AttributeDict(lr=0.5, sizes=[1, 2]), "w": torch.ones(2)}, tmp_path / "c")
    ck = io.load_checkpoint(tmp_path / "c")
    assert ck["hyper_parameters"] == {"lr": 0.5, "sizes": [1, 2]} and type(ck["hyper_parameters"]) is dict


def test_unstorable_hyperparameter_is_refused_naming_it(tmp_path):
    io = TsckptCheckpointIO()
    with pytest.raises(tsckpt.LeafTypeError, match=r"hyper_parameters/path.*PosixPath.*save_hyperparameters\(ignore"):
        io.save_checkpoint({"hyper_parameters": {"path": pathlib.Path("/data")}}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_storage_options_are_refused(tmp_path):
    with pytest.raises(TypeError, match="takes no storage_options"):
        TsckptCheckpointIO().save_checkpoint({"w": torch.ones(1)}, tmp_path / "c", storage_options={"x": 1})


def test_save_replaces_and_remove_removes(tmp_path):
    io = TsckptCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    io.save_checkpoint({"step": 2}, tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt") == {"step": 2}
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").exists()
    io.remove_checkpoint(tmp_path / "last.ckpt")  # gone already: nothing to do


def ddp_fit(rank: int, world: int, root: str, epochs: int, resume: bool, plugin: bool) -> list[float]:
    """A rank of a DDP fit on the CPU (the process group is already joined; Lightning uses it)."""
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.manual_seed(0)
    model = Tiny()
    plugins = [TsckptCheckpointIO()] if plugin else []
    t = trainer(pathlib.Path(root), epochs, plugins=plugins, strategy="ddp", devices=world, num_nodes=1)
    t.fit(model, loader(), ckpt_path="last" if resume else None)
    return model.losses


@pytest.mark.slow
def test_ddp_fit_resumes_from_last_bit_exact(tmp_path):
    """Two CPU ranks: rank 0 saves (Lightning hands it the checkpoint alone), both restore."""
    from tests.dist_helpers import run_ranks

    whole = run_ranks(ddp_fit, 2, str(tmp_path / "whole"), 3, False, False, timeout=240)
    first = run_ranks(ddp_fit, 2, str(tmp_path / "run"), 2, False, True, timeout=240)
    assert (tmp_path / "run" / "ckpt" / "last.ckpt" / "zarr.json").is_file()
    then = run_ranks(ddp_fit, 2, str(tmp_path / "run"), 3, True, True, timeout=240)
    for rank in range(2):
        assert first[rank] == whole[rank][:4]  # 16 samples a rank, batches of 8
        assert len(then[rank]) == 2 and then[rank] == whole[rank][4:], rank
    assert whole[0] != whole[1]  # each rank its own data


class Sharded(Tiny):
    """Tiny under FSDP2, applied as Lightning's ModelParallelStrategy asks (configure_model)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def model_parallel_fit(rank: int, world: int, root: str, epochs: int, resume: bool, tsckpt_strategy: bool) -> list[float]:
    """A rank of an FSDP2 fit on the CPU through Lightning's ModelParallelStrategy, or tsckpt's."""
    import os

    from pytorch_lightning.strategies import ModelParallelStrategy

    from tsckpt.integrations.lightning import TsckptModelParallelStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.manual_seed(0)
    model = Sharded()
    kind = TsckptModelParallelStrategy if tsckpt_strategy else ModelParallelStrategy
    strategy = kind(data_parallel_size=world, tensor_parallel_size=1)
    trainer(pathlib.Path(root), epochs, strategy=strategy, devices=world).fit(
        model, loader(), ckpt_path="last" if resume else None
    )
    return model.losses


@pytest.mark.slow
def test_model_parallel_fit_resumes_from_last_bit_exact(tmp_path):
    """FSDP2 on two CPU ranks: every rank saves its shards through tsckpt; the resumed third
    epoch matches an uninterrupted run, and the checkpoint reads in one process unsharded."""
    from tests.dist_helpers import run_ranks

    whole = run_ranks(model_parallel_fit, 2, str(tmp_path / "whole"), 3, False, False, timeout=240)
    first = run_ranks(model_parallel_fit, 2, str(tmp_path / "run"), 2, False, True, timeout=240)
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    then = run_ranks(model_parallel_fit, 2, str(tmp_path / "run"), 3, True, True, timeout=240)
    for rank in range(2):
        assert first[rank] == whole[rank][:4]
        assert len(then[rank]) == 2 and then[rank] == whole[rank][4:], rank
    stored = tsckpt.restore(last, as_saved=True)
    assert stored["model"]["net.0.weight"].shape == (8, 4)  # one global array, whatever the sharding
    assert stored["extra"]["lightning"]["global_step"] == 6 and "state_dict" not in stored["extra"]["lightning"]


def test_a_checkpoint_that_is_no_dict_is_refused(tmp_path):
    tsckpt.save(tmp_path / "c", [torch.ones(1)])
    with pytest.raises(tsckpt.StructureMismatchError, match=r"a Lightning checkpoint is a dict, and this tsckpt checkpoint holds a list"):
        TsckptCheckpointIO().load_checkpoint(tmp_path / "c")
