"""Multi-rank scenarios, run by tests/test_distributed.py on gloo ranks. What they
save is in the test's checkpoint layout (``rank_layout()``)."""

from __future__ import annotations

import collections
import os
from typing import Any

import torch
import torch.distributed as dist

import tsckpt
from tests.dist_helpers import rank_layout


def global_tensor(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def dtensor(full: torch.Tensor, m: Any, placements: list[Any]) -> Any:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, m, placements)


def in_env(rank: int, world: int, env: dict[str, str], fn: Any, *args: Any) -> Any:
    """Run scenario ``fn`` with ``env`` set first: forked ranks start with the
    environment their fork server had, not the test's."""
    os.environ.update(env)
    return fn(rank, world, *args)


# ---- save side -------------------------------------------------------------


def save_dtensors(rank: int, world: int, directory: str, mesh_shape: tuple[int, ...], spec: dict[str, Any]) -> None:
    """spec: name -> (global shape, placements as strings like 'S0', 'S1', 'R')."""
    m = mesh(mesh_shape)
    tree = {name: dtensor(global_tensor(shape, seed=i), m, parse(pl)) for i, (name, (shape, pl)) in enumerate(sorted(spec.items()))}
    tsckpt.save(directory, {"model": tree, "step": 7}, layout=rank_layout())


def restore_dtensors(rank: int, world: int, directory: str, mesh_shape: tuple[int, ...], spec: dict[str, Any], inplace: bool = False) -> dict[str, int]:
    m = mesh(mesh_shape)
    target = {}
    for i, (name, (shape, pl)) in enumerate(sorted(spec.items())):
        d = dtensor(torch.full(shape, float("nan")), m, parse(pl))
        target[name] = d
    out = tsckpt.restore(directory, {"model": target, "step": 0}, inplace=inplace)
    checked = {}
    for i, (name, (shape, pl)) in enumerate(sorted(spec.items())):
        got = out["model"][name]
        expect = dtensor(global_tensor(shape, seed=i), m, parse(pl)).to_local()
        if not torch.equal(got.to_local(), expect):
            raise AssertionError(f"rank {rank}: {name} local shard differs")
        if tuple(got.placements) != tuple(parse(pl)):
            raise AssertionError(f"{name}: placements {got.placements}")
        if inplace and got.to_local().data_ptr() != target[name].to_local().data_ptr():
            raise AssertionError("inplace restore allocated a new local tensor")
        checked[name] = got.to_local().numel()
    if out["step"] != 7:
        raise AssertionError(out["step"])
    return checked


def parse(pl: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in pl.split(",")]


def save_fsdp2(rank: int, world: int, directory: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    fully_shard(model, mesh=mesh((world,)))
    tsckpt.save(directory, {"model": dict(model.state_dict())}, layout=rank_layout())


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def restore_and_check(rank: int, model: torch.nn.Module, directory: str, ref: dict[str, torch.Tensor]) -> None:
    """NaN-fill the (sharded) model, restore it in place, compare every full tensor with ``ref``."""
    sd = dict(model.state_dict())
    for v in sd.values():
        v.to_local().fill_(float("nan"))
    tsckpt.restore(directory, {"model": sd}, inplace=True)
    for name, p in model.state_dict().items():
        if not torch.equal(p.full_tensor(), ref[name]):
            raise AssertionError(f"rank {rank}: {name} differs after restore")


def restore_fsdp2(rank: int, world: int, directory: str) -> None:
    from torch.distributed.fsdp import fully_shard

    ref = tiny_model().state_dict()
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh((world,)))
    restore_and_check(rank, model, directory, ref)


def replicas(rank: int, world: int, directory: str, differ: bool) -> None:
    w = global_tensor((6, 4))
    if differ and rank == 1:
        w = w + 1
    tsckpt.save(directory, {"w": w, "b": torch.arange(3)}, layout=rank_layout())


def pipeline_stages(rank: int, world: int, directory: str, collide: bool) -> None:
    """Each stage holds 2 layers; global names unless ``collide`` (stage-local names)."""
    tree = {}
    for j in range(2):
        idx = j if collide else rank * 2 + j
        tree[f"layers.{idx}.weight"] = global_tensor((3, 3), seed=rank * 2 + j)
    tsckpt.save(directory, {"model": tree}, layout=rank_layout())


def partial_save(rank: int, world: int, directory: str) -> None:
    from torch.distributed.tensor import DTensor, Partial

    m = mesh((world,))
    d = DTensor.from_local(torch.ones(2, 2), m, [Partial()])
    tsckpt.save(directory, {"p": d}, layout=rank_layout())


def failing_save(rank: int, world: int, directory: str) -> None:
    """Rank 1 fails while writing its data; every rank must raise."""
    import tsckpt._save.protocol as save_mod

    if rank == 1:
        def boom(*a: Any, **k: Any) -> Any:
            raise OSError("disk full (injected)")

        save_mod._write_regions = boom  # type: ignore[assignment]
    m = mesh((world,))
    tsckpt.save(directory, {"w": dtensor(global_tensor((8, 2)), m, parse("S0"))}, layout=rank_layout())


def _rows(rank: int, world: int) -> tuple[torch.Tensor, Any]:
    """This rank's rows of a (6 * world, 4) array, as a ShardedArray, and the whole array."""
    full = global_tensor((6 * world, 4))
    local = full[6 * rank : 6 * (rank + 1)].clone()
    return full, tsckpt.ShardedArray(local, tuple(full.shape), (6 * rank, 0))


def _raised(verb: Any) -> tuple[float, str, str]:
    """How long ``verb()`` took to raise, its exception's type name and message."""
    import time

    start = time.monotonic()
    try:
        verb()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return time.monotonic() - start, type(e).__name__, str(e)
    raise AssertionError("it succeeded although a rank was killed")


def killed_mid_write(rank: int, world: int, directory: str, victim: int) -> tuple[float, str, str]:
    """Rank ``victim`` is SIGKILLed in the write step, its files written but its status not
    sent; the others return what their save raised (:func:`_raised`)."""
    import signal

    import tsckpt._save.protocol as save_mod

    if rank == victim:
        real = save_mod._write_regions

        def write_then_die(*a: Any, **k: Any) -> Any:
            real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        save_mod._write_regions = write_then_die  # type: ignore[assignment]
    _, mine = _rows(rank, world)
    return _raised(lambda: tsckpt.save(directory, {"w": mine}, layout=rank_layout()))


def killed_before_restore(rank: int, world: int, directory: str, victim: int) -> tuple[float, str, str]:
    """Every rank saves; then rank ``victim`` is SIGKILLed while the others restore, and they
    return what their restore raised (:func:`_raised`)."""
    import signal

    _, mine = _rows(rank, world)
    tsckpt.save(directory, {"w": mine}, layout=rank_layout())
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    target = tsckpt.ShardedArray(torch.empty_like(mine.local), mine.global_shape, mine.offsets)
    return _raised(lambda: tsckpt.restore(directory, {"w": target}))


def sharded_arrays(rank: int, world: int, directory: str, splits: list[int], cols: int) -> None:
    """Hand-made row shards of a (sum(splits), cols) array, one per rank."""
    full = global_tensor((sum(splits), cols))
    start = sum(splits[:rank])
    local = full[start : start + splits[rank]].clone()
    tsckpt.save(directory, {"emb": tsckpt.ShardedArray(local, full.shape, (start, 0))}, layout=rank_layout())


def restore_sharded_arrays(rank: int, world: int, directory: str, splits: list[int], cols: int) -> None:
    full = global_tensor((sum(splits), cols))
    start = sum(splits[:rank])
    target = tsckpt.ShardedArray(torch.empty(splits[rank], cols), full.shape, (start, 0))
    out = tsckpt.restore(directory, {"emb": target})
    if not torch.equal(out["emb"].local, full[start : start + splits[rank]]):
        raise AssertionError(f"rank {rank}: region differs")


def world_of_group(rank: int, world: int) -> int:
    return dist.get_world_size()


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def save_fsdp_tp(rank: int, world: int, directory: str) -> list[str]:
    """2x2 mesh: tensor parallel on 'tp', FSDP2 on 'dp' (strided sharding)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = mesh((2, 2), ("dp", "tp"))
    model = MLP()
    parallelize_module(model, m["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=m["dp"])
    sd = dict(model.state_dict())
    tsckpt.save(directory, {"model": sd}, layout=rank_layout())
    return [str(v.placements) for v in sd.values()]


def restore_fsdp_1d(rank: int, world: int, directory: str) -> None:
    from torch.distributed.fsdp import fully_shard

    ref = MLP().state_dict()
    torch.manual_seed(5)
    model = MLP()
    fully_shard(model, mesh=mesh((world,)))
    restore_and_check(rank, model, directory, ref)


def restore_fsdp_tp(rank: int, world: int, directory: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ref = MLP().state_dict()
    m = mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(5)
    model = MLP()
    parallelize_module(model, m["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=m["dp"])
    restore_and_check(rank, model, directory, ref)


def bad_leaf_on_one_rank(rank: int, world: int, directory: str) -> None:
    tree: dict[str, Any] = {"w": torch.ones(2)}
    if rank == 1:
        tree["oops"] = object()
    tsckpt.save(directory, tree, layout=rank_layout())


def restore_fsdp2_as_tp_shard1(rank: int, world: int, directory: str) -> dict[str, str]:
    """An FSDP2 (Shard(0)) checkpoint read into tensor-parallel Shard(1) DTensors (Shard(0) for 1-D)."""
    from torch.distributed.tensor import Shard

    ref = tiny_model().state_dict()
    m = mesh((world,))
    target = {k: dtensor(torch.full(v.shape, float("nan")), m, [Shard(1 if v.dim() == 2 else 0)]) for k, v in ref.items()}
    out = tsckpt.restore(directory, {"model": target}, inplace=True)["model"]
    for k, v in ref.items():
        want = dtensor(v, m, [Shard(1 if v.dim() == 2 else 0)]).to_local()
        if not torch.equal(out[k].to_local(), want):
            raise AssertionError(f"rank {rank}: {k} differs")
    return {k: str(out[k].placements) for k in ref}


def restore_foreign_dtensor(rank: int, world: int, directory: str, path: str, shape: tuple[int, ...], placement: str):
    """Restore one array of a checkpoint (any format tsckpt reads) into a DTensor; return the local shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.full(shape, float("nan")), mesh, [Shard(0 if placement == "shard0" else 1)])
    parts = path.split("/")
    target: dict = {}
    node = target
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = dt
    tsckpt.restore(directory, target, strict=False, inplace=True)
    return dt.to_local().numpy().copy()


def restore_foreign_dtensor_counted(rank: int, world: int, directory: str, path: str, shape: tuple[int, ...]):
    """:func:`restore_foreign_dtensor` by columns (Shard(1)), with the bytes TensorStore's file
    kvstore read during the restore: (the local shard, bytes read)."""
    import tensorstore as ts

    def read() -> int:
        names = ("/tensorstore/kvstore/file/bytes_read", "/tensorstore/file/mmap_bytes")
        return sum(m["values"][0]["value"] for m in ts.experimental_collect_matching_metrics("/tensorstore/")
                   if m["name"] in names)

    before = read()
    local = restore_foreign_dtensor(rank, world, directory, path, shape, "shard1")
    return local, read() - before


def many_leaves(rank: int, world: int, directory: str, n: int) -> None:
    """An optimizer-like state of ``n`` leaves, each row-sharded over the ranks, plus a replicated step."""
    tree = {}
    for i in range(n):
        full = torch.arange(world * 4 * 3, dtype=torch.float32).reshape(world * 4, 3) + i
        tree[f"l{i:04d}"] = tsckpt.ShardedArray(full[rank * 4 : (rank + 1) * 4].clone(), tuple(full.shape), (rank * 4, 0))
    tsckpt.save(directory, {"opt": tree, "step": 5}, layout=rank_layout())


def save_and_restore_with_progress(rank: int, world: int, directory: str) -> list[tuple[str, int, int]]:
    """Save and restore row shards with progress=True; return the bars this rank showed (verb, n, total)."""
    import tqdm

    bars: list[tuple[str, int, int]] = []

    class Recording(tqdm.tqdm):
        def close(self) -> None:
            if not self.disable:  # tqdm closes again when collected
                bars.append((self.desc, self.n, self.total))
            super().close()

    tqdm.tqdm = Recording  # type: ignore[misc]
    full = torch.arange(world * 256, dtype=torch.float32).reshape(world * 16, 16)
    mine = full[rank * 16 : (rank + 1) * 16].clone()
    tree = {"w": tsckpt.ShardedArray(mine, tuple(full.shape), (rank * 16, 0))}
    tsckpt.save(directory, tree, progress=True, layout=rank_layout())
    target = {"w": tsckpt.ShardedArray(torch.zeros(16, 16), tuple(full.shape), (rank * 16, 0))}
    tsckpt.restore(directory, target, inplace=True, progress=True)
    if not torch.equal(target["w"].local, mine):
        raise AssertionError(f"rank {rank}: restored rows differ")
    return bars


def save_with_layouts(rank: int, world: int, directory: str, layouts: list[str]) -> None:
    """Each rank saves its row block with its own ``layouts[rank]``."""
    tsckpt.save(directory, {"w": tsckpt.ShardedArray(torch.ones(2, 3), (2 * world, 3), (2 * rank, 0))}, layout=layouts[rank])


def _meta_fsdp2(world: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    model[2].bias.requires_grad_(False)
    fully_shard(model, mesh=mesh((world,)))
    if not all(v.to_local().is_meta for v in model.state_dict().values()):
        raise AssertionError("the test model is not on the meta device")
    return model


def _check_meta_restored(rank: int, model: torch.nn.Module, ref: dict[str, torch.Tensor], how: str) -> None:
    """Every parameter a real DTensor shard equal to ``ref``, requires_grad kept, and FSDP2 still works."""
    for name, p in model.named_parameters():
        if not isinstance(p, torch.nn.Parameter) or p.to_local().device.type != "cpu":
            raise AssertionError(f"rank {rank} ({how}): {name} is {type(p).__name__} on {p.to_local().device}")
        if not torch.equal(p.full_tensor(), ref[name]):
            raise AssertionError(f"rank {rank} ({how}): {name} differs after restore")
    if model[2].bias.requires_grad or not model[0].weight.requires_grad:
        raise AssertionError(f"rank {rank} ({how}): requires_grad not kept")
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    y = model(x)
    plain = tiny_model()
    if not torch.allclose(y, plain(x)):
        raise AssertionError(f"rank {rank} ({how}): the sharded model computes other values")
    y.sum().backward()


def restore_fsdp2_meta(rank: int, world: int, directory: str) -> None:
    """FSDP2's fully_shard on a meta-initialised model, then a restore: real DTensor shards."""
    import tsckpt.torch

    ref = tiny_model().state_dict()
    for inplace in (False, True):
        model = _meta_fsdp2(world)
        out = tsckpt.restore(directory, {"model": model.state_dict()}, inplace=inplace)
        model.load_state_dict(out["model"], assign=True)
        _check_meta_restored(rank, model, ref, f"tsckpt.restore, inplace={inplace}")
    model = _meta_fsdp2(world)
    tsckpt.torch.restore(directory, model, rng=False)
    _check_meta_restored(rank, model, ref, "tsckpt.torch.restore")


def incremental_steps(rank: int, world: int, root: str) -> None:
    """Two manager steps of a frozen row-sharded weight (one shard file per rank) and a changing
    replicated adapter: each rank shares its own unchanged files with the previous step."""
    full = global_tensor((64 * world, 256))
    frozen = tsckpt.ShardedArray(full[64 * rank : 64 * (rank + 1)].clone(), tuple(full.shape), (64 * rank, 0))
    m = tsckpt.CheckpointManager(root)
    for step in (1, 2):
        m.save(step, {"frozen": frozen, "adapter": torch.full((8, 8), float(step))}, max_inflight_bytes=64 * 256 * 4)


def out_of_step(rank: int, world: int, root: str, how: str) -> tuple[str, list[int]]:
    """Ranks saving different checkpoints in one call: each to its own directory ("dirs"), or
    a manager's loop whose rank 1 skipped step 2 (its call failed there) and pairs step 3 with
    rank 0's step 2 ("steps"). Returns the error each rank got and the steps listed after."""
    tree = {"w": tsckpt.ShardedArray(torch.full((2, 3), float(rank)), (2 * world, 3), (2 * rank, 0))}
    m = tsckpt.CheckpointManager(root, layout=rank_layout())
    try:
        if how == "dirs":
            tsckpt.save(os.path.join(root, f"d{rank}"), tree, layout=rank_layout())
        else:
            m.save(1, tree)
            m.save(2 if rank == 0 else 3, tree)
    except tsckpt.LayoutError as e:
        return str(e), m.all_steps()
    return "", m.all_steps()


def nested_on_one_rank(rank: int, world: int, root: str) -> tuple[str, list[int], list[float]]:
    """A manager keeping one step saves step 1, then step 2 with "r" a tensor on rank 0 and a
    list of one on rank 1: the error each rank got, the steps listed, and step 1's "r" read back."""
    m = tsckpt.CheckpointManager(root, keep_last=1, layout=rank_layout())
    m.save(1, {"r": torch.arange(3.0)})
    try:
        m.save(2, {"r": torch.arange(3.0) if rank == 0 else [torch.arange(3.0)]})
        message = ""
    except tsckpt.LayoutError as e:
        message = str(e)
    return message, m.all_steps(), m.restore(1)["r"].tolist()


# Trees rank 0 and rank 1 give under one path, which differ in what "a" is.
DIFFERING_TREES = {
    "tuple-list": ((1, 2), [1, 2]),
    "list-dict": ([torch.ones(2)], {"0": torch.ones(2)}),
    "none-emptydict": (None, {}),
    "leaf-emptylist": (torch.ones(2), []),
    "ordereddict-dict": (collections.OrderedDict(w0=torch.ones(2)), {"w1": torch.ones(2)}),  # alike: saved
}


def trees_differ(rank: int, world: int, root: str, case: str) -> tuple[str, bool]:
    """Every rank saves {"a": ..., "w": its rows}, "a" as DIFFERING_TREES[case] gives it for
    its rank: the error it got, and whether anything was committed."""
    tree = {
        "a": DIFFERING_TREES[case][rank],
        "w": tsckpt.ShardedArray(torch.full((2, 3), float(rank)), (2 * world, 3), (2 * rank, 0)),
    }
    try:
        tsckpt.save(os.path.join(root, case), tree, layout=rank_layout())
        message = ""
    except tsckpt.LayoutError as e:
        message = str(e)
    return message, os.path.exists(os.path.join(root, case, "zarr.json"))


def overwrite_on_one_rank(rank: int, world: int, root: str) -> tuple[list[str], list[int]]:
    """A manager saves step 1, then step 1 again with overwrite=True on rank 1 only, then step
    2: what each save raised, and the steps listed."""
    m = tsckpt.CheckpointManager(root, layout=rank_layout())
    raised = []
    for step, overwrite in ((1, False), (1, rank == 1), (2, False)):
        tree = {"w": tsckpt.ShardedArray(torch.full((2, 3), float(step)), (2 * world, 3), (2 * rank, 0))}
        try:
            m.save(step, tree, overwrite=overwrite)
            raised.append("")
        except tsckpt.TsckptError as e:
            raised.append(f"{type(e).__name__}: {e}")
    return raised, m.all_steps()


def busy_on_one_rank(rank: int, world: int, root: str) -> tuple[str, str]:
    """Rank 0 still has a save in flight (a handle not yet done), rank 1 none: a save_async and a
    save with if_busy="error" are refused on both ranks (the messages each got)."""
    import warnings

    from tsckpt._save.background import AsyncSave

    m = tsckpt.CheckpointManager(root, if_busy="error", writer="thread", layout=rank_layout())
    tree = {"w": tsckpt.ShardedArray(torch.full((2, 3), float(rank)), (2 * world, 3), (2 * rank, 0))}
    m.save(1, tree)
    held = AsyncSave("held", 0)
    if rank == 0:
        m._saver._inflight = held
    got = []
    for call in (lambda: m.save_async(2, tree), lambda: m.save(2, tree)):
        try:
            call()
            got.append("")
        except tsckpt.SaveInProgressError as e:
            got.append(str(e))
    held.set_result(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.save_async(2, tree).result()  # both ranks in step again
    assert m.all_steps() == [1, 2]
    return got[0], got[1]


def staging_bound_on_one_rank(rank: int, world: int, root: str) -> tuple[list[str], list[int]]:
    """Rank 1 holds more than max_staging_bytes, rank 0 less: both save synchronously (one
    rank in a writer and the other in its caller would each wait for the other)."""
    import warnings

    rows = 16 if rank == 0 else 256  # 64 KiB and 1 MiB of float32 rows of 1024
    offset = 0 if rank == 0 else 16
    tree = {"w": tsckpt.ShardedArray(torch.full((rows, 1024), float(rank)), (272, 1024), (offset, 0))}
    m = tsckpt.CheckpointManager(root, max_staging_bytes=256 << 10, layout=rank_layout())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.save_async(1, tree).result()
    return [str(w.message) for w in caught if "synchronously" in str(w.message)], m.all_steps()


class _Interrupted:
    """A stateful object whose state_dict() is cut short by Ctrl-C."""

    def state_dict(self) -> dict[str, Any]:
        raise KeyboardInterrupt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def failing_call_on_one_rank(
    rank: int, world: int, root: str, writer: str, how: str = "leaf"
) -> tuple[list[str], list[int]]:
    """A manager loop whose rank 1 gives a leaf tsckpt cannot save (``how="interrupt"``: an
    object whose state_dict() raises KeyboardInterrupt) at step 2 only, the loop going on after
    the error: every rank raises at step 2, and the later steps are saved."""
    m = tsckpt.CheckpointManager(root, writer=writer, layout=rank_layout())
    errors = []
    for step in range(1, 5):
        w = torch.full((2, 3), float(step + rank))
        tree: dict[str, Any] = {"w": tsckpt.ShardedArray(w, (2 * world, 3), (2 * rank, 0))}
        if step == 2 and rank == 1:
            tree["bad"] = object() if how == "leaf" else _Interrupted()
        try:
            m.save_async(step, tree).result()
        except (tsckpt.TsckptError, KeyboardInterrupt) as e:
            errors.append(f"{step}: {type(e).__name__}: {e}")
    m.close()
    return errors, m.all_steps()


def other_options(rank: int, world: int, root: str, option: str, values: tuple[Any, ...]) -> tuple[str, bool]:
    """Rank r passes ``option=values[r]`` (e.g. a writer process on rank 0, a thread on rank 1):
    every rank raises, and the next save (alike) works."""
    tree = {"w": tsckpt.ShardedArray(torch.full((2, 3), float(rank)), (2 * world, 3), (2 * rank, 0))}
    try:
        tsckpt.save_async(os.path.join(root, "a"), tree, **{option: values[rank]}).result()
        message = ""
    except ValueError as e:
        message = str(e)
    tsckpt.save_async(os.path.join(root, "b"), tree, writer="thread", layout=rank_layout()).result()
    return message, os.path.exists(os.path.join(root, "a", "zarr.json"))
