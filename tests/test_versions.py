"""Incremental saves that skip hashing tensors torch's version counter shows unchanged."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tsckpt
from tsckpt._codec import contenthash
from tsckpt._save import versions

torch = pytest.importorskip("torch")


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts of every file hashed (the data read to hash it), in order."""
    versions.forget()
    seen: list[int] = []
    real = contenthash.digest

    def counting(src: np.ndarray) -> str:
        seen.append(src.nbytes)
        return real(src)

    monkeypatch.setattr(contenthash, "digest", counting)
    return seen


def _links(directory: Any) -> dict[str, int]:
    """Link count of every chunk file below ``directory``, by key."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name != "zarr.json":
                path = os.path.join(root, name)
                out[os.path.relpath(path, directory)] = os.stat(path).st_nlink
    return out


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"frozen": torch.randn(64, 64, generator=g), "w": torch.nn.Parameter(torch.randn(8, 8, generator=g))}


def test_by_default_every_file_is_hashed_again(tmp_path, hashed):
    """The default proves each shared file by its content; torch's counters are not trusted."""
    state = _state()
    m = tsckpt.CheckpointManager(tmp_path)
    m.save(1, state)
    hashed.clear()
    m.save(2, state)
    assert sorted(hashed) == [8 * 8 * 4, 64 * 64 * 4]
    assert set(_links(m.directory(2)).values()) == {2}


def test_an_unchanged_tensor_is_linked_without_being_hashed(tmp_path, hashed):
    state = _state()
    m = tsckpt.CheckpointManager(tmp_path, incremental="versions")
    m.save(1, state)
    assert sorted(hashed) == [8 * 8 * 4, 64 * 64 * 4]
    hashed.clear()
    m.save(2, state)
    assert hashed == []
    assert _links(m.directory(2)) == {"frozen/c.0.0": 2, "w/c.0.0": 2}
    with torch.no_grad():
        state["w"].add_(1)
    m.save(3, state)
    assert hashed == [8 * 8 * 4]  # only the tensor written since
    assert _links(m.directory(3)) == {"frozen/c.0.0": 3, "w/c.0.0": 1}
    out = m.restore(3)
    assert np.array_equal(out["w"], state["w"].detach().numpy())
    assert np.array_equal(out["frozen"], state["frozen"].numpy())
    tsckpt.verify(m.directory(3))  # the hashes taken as known are those of the files' data


def _param() -> Any:
    return torch.nn.Parameter(torch.zeros(4, 4))


def _optimizer_step(p: Any) -> None:
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()


def _fused_optimizer_step(p: Any) -> None:
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)  # one native kernel: torch's counter stays
    p.grad = torch.ones_like(p)
    opt.step()


def _inference_mode_add(p: Any) -> None:
    with torch.inference_mode():
        p.add_(1)


def _no_grad(op: Callable[[Any], Any]) -> Callable[[Any], None]:
    def run(p: Any) -> None:
        with torch.no_grad():
            op(p)

    return run


def _swap_data(p: Any) -> None:
    p.data = torch.full((4, 4), 3.0)


SEEN = {
    "add_": _no_grad(lambda p: p.add_(1)),
    "indexed assignment": _no_grad(lambda p: p.__setitem__((0, 0), 5.0)),
    "through a view": _no_grad(lambda p: p.view(16)[3:5].fill_(2.0)),
    "through detach()": lambda p: p.detach().mul_(0).add_(7),
    "copy_": _no_grad(lambda p: p.copy_(torch.arange(16.0).reshape(4, 4))),
    "an optimizer step": _optimizer_step,
    "a fused optimizer step": _fused_optimizer_step,
    "inference_mode": _inference_mode_add,
    "p.data = another tensor": _swap_data,
    "set_": _no_grad(lambda p: p.set_(torch.full((4, 4), 9.0))),
}


@pytest.mark.parametrize("how", sorted(SEEN))
def test_every_write_torch_counts_is_saved(tmp_path, hashed, how):
    p = _param()
    m = tsckpt.CheckpointManager(tmp_path, incremental="versions")
    m.save(1, {"p": p})
    SEEN[how](p)
    want = p.detach().clone()
    assert not torch.equal(want, torch.zeros(4, 4))
    m.save(2, {"p": p})
    assert hashed == [64, 64]
    assert _links(m.directory(2)) == {"p/c.0.0": 1}
    assert np.array_equal(m.restore(2)["p"], want.numpy())


def test_a_fused_optimizers_state_is_saved_at_every_step(tmp_path, hashed):
    """Its moments, updated by the same fused kernel, are hashed again at each step; a frozen
    tensor beside them is not."""
    p, frozen = torch.nn.Parameter(torch.ones(8, 8)), torch.arange(64.0).reshape(8, 8)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    m = tsckpt.CheckpointManager(tmp_path, incremental="versions")
    for step in range(1, 4):
        p.grad = torch.full_like(p, float(step))
        opt.step()
        hashed.clear()
        m.save(step, {"p": p, "frozen": frozen, "optim": opt.state_dict()})
        if step > 1:
            assert sorted(hashed) == [4, 256, 256, 256]  # step, p and both moments; not the frozen tensor
        out = m.restore(step)
        assert np.array_equal(out["p"], p.detach().numpy())
        for name in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(out["optim"]["state"][0][name], opt.state[p][name].numpy())


def test_a_saved_tensor_can_still_be_swapped(tmp_path, monkeypatch):
    """No weak reference to the tensor itself is kept (torch.utils.swap_tensors refuses a
    tensor that has one, as ``Module.to`` uses it when torch's future flag asks): a module
    converted by swapping after a save is saved anew."""
    versions.forget()
    model = torch.nn.Linear(4, 4)
    m = tsckpt.CheckpointManager(tmp_path, incremental="versions")
    m.save(1, {"w": model.weight, "b": model.bias})
    monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
    model.to(torch.float64)
    with torch.no_grad():
        model.weight.fill_(2.0)
    m.save(2, {"w": model.weight, "b": model.bias})
    out = m.restore(2)
    assert out["w"].dtype == np.float64 and np.array_equal(out["w"], np.full((4, 4), 2.0))
    assert np.array_equal(out["b"], model.bias.detach().numpy())


def test_a_restore_in_place_counts_as_a_write(tmp_path, hashed):
    p = _param()
    m = tsckpt.CheckpointManager(tmp_path, incremental="versions")
    m.save(1, {"p": p})
    with torch.no_grad():
        p.add_(1)
    m.save(2, {"p": p})
    m.restore(1, {"p": p}, inplace=True)  # back to zeros, written through numpy: the counter moves anyway
    assert torch.equal(p, torch.zeros(4, 4))
    m.save(3, {"p": p})
    assert np.array_equal(m.restore(3)["p"], np.zeros((4, 4), np.float32))
    assert len(hashed) == 3


def _through_data(p: Any) -> None:
    p.data.add_(1)


def _through_numpy(p: Any) -> None:
    p.detach().numpy()[0, 0] = 1.0


def _through_storage(p: Any) -> None:
    p.untyped_storage().fill_(1)


UNSEEN = {"tensor.data": _through_data, "a numpy view": _through_numpy, "the storage": _through_storage}


@pytest.mark.parametrize("how", sorted(UNSEEN))
def test_writes_the_counter_misses_are_saved_by_default(tmp_path, hashed, how):
    """What docs/incremental.md says the counter cannot see: trusting the counters
    (incremental="versions"), the step keeps the unchanged file (the documented limit); with
    the default (every file hashed) the new values."""
    p = _param()
    m = tsckpt.CheckpointManager(tmp_path / "versions", incremental="versions")
    m.save(1, {"p": p})
    UNSEEN[how](p)
    want = p.detach().clone()
    assert not torch.equal(want, torch.zeros(4, 4))
    m.save(2, {"p": p})
    assert np.array_equal(m.restore(2)["p"], np.zeros((4, 4), np.float32))  # unseen: the limit
    h = tsckpt.CheckpointManager(tmp_path / "default")
    q = _param()
    h.save(1, {"p": q})
    UNSEEN[how](q)
    h.save(2, {"p": q})
    assert np.array_equal(h.restore(2)["p"], want.numpy())


def test_what_is_always_hashed(tmp_path, hashed):
    shared = torch.zeros(4, 4).share_memory_()
    arr = np.zeros((4, 4), np.float32)
    inference = torch.zeros(4, 4)
    with torch.inference_mode():
        inference = torch.zeros(4, 4)
    state = {"shared": shared, "numpy": arr, "inference": inference}
    m = tsckpt.CheckpointManager(tmp_path, incremental="versions")
    m.save(1, state)
    hashed.clear()
    m.save(2, state)
    assert len(hashed) == 3
    assert set(_links(m.directory(2)).values()) == {2}


def test_a_remembered_hash_belongs_to_one_tensor_object():
    versions.forget()
    t = torch.arange(8.0)
    box = ("float32", (0,), (0,), (8,))
    before = versions.state(t)
    assert before is not None
    versions.remember(t, before, box, "d" * 32)
    assert versions.known(t, before, box) == "d" * 32
    alias = t.view(8)  # the same memory and counter, another object: not proven
    assert versions.state(alias) == before and versions.known(alias, before, box) is None
    with torch.no_grad():
        t.add_(1)
    assert versions.known(t, versions.state(t), box) is None
    assert versions.state(t.to(torch.float64)) != before


def test_incremental_takes_versions_and_refuses_other_strings(tmp_path):
    with pytest.raises(TypeError, match='incremental must be True, False or "versions"'):
        tsckpt.save(tmp_path / "a", {"x": np.zeros(2)}, incremental="yes")


def test_background_saves_hash_their_staged_copies(tmp_path, hashed):
    """save_async saves staging buffers refilled with copy_ at every save: their counter moves,
    so each save hashes them, and a tensor changed between saves is saved changed."""
    p = _param()
    frozen = torch.ones(32, 32)
    m = tsckpt.CheckpointManager(tmp_path, writer="thread")
    m.save_async(1, {"p": p, "frozen": frozen}).result()
    with torch.no_grad():
        p.add_(2)
    hashed.clear()
    m.save_async(2, {"p": p, "frozen": frozen}).result()
    assert sorted(hashed) == [64, 32 * 32 * 4]
    assert _links(m.directory(2)) == {"frozen/c.0.0": 2, "p/c.0.0": 1}  # shared by its hash
    assert np.array_equal(m.restore(2)["p"], np.full((4, 4), 2.0, np.float32))


def test_the_state_is_taken_before_the_data_is_read(tmp_path, monkeypatch):
    """A write racing a save's read (against the contract of a synchronous save) then leaves a
    hash remembered for the version before it, never one the racing write produced."""
    versions.forget()
    order: list[str] = []
    real_state, real_digest = versions.state, contenthash.digest

    def state(data):
        order.append("state")
        return real_state(data)

    def digest(src):
        order.append("read")
        return real_digest(src)

    monkeypatch.setattr(versions, "state", state)
    monkeypatch.setattr(contenthash, "digest", digest)
    tsckpt.save(tmp_path / "a", {"p": _param()}, incremental="versions")
    assert order == ["state", "read"]


def _broadcast_between_saves(rank: int, world: int, root: str) -> tuple[list[str], float, float]:
    """Each rank saves its row, rank 0's value is broadcast into every rank's, and the ranks
    save again with and without trusting the counters: what each step holds of this rank's row,
    and the warnings the saves gave."""
    import warnings

    import torch.distributed as dist

    t = torch.full((1, 4), float(rank + 2))
    tree = lambda: {"w": tsckpt.ShardedArray(t, (world, 4), (rank, 0))}  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tsckpt.save(f"{root}/a", tree(), incremental="versions")
        dist.broadcast(t, src=0)  # every rank's row now 2.0; the counter does not move
        tsckpt.save(f"{root}/b", tree(), incremental="versions", base=f"{root}/a")
        tsckpt.save(f"{root}/c", tree(), incremental=True, base=f"{root}/a")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    b = float(tsckpt.open(f"{root}/b")["w"][rank, 0])
    c = float(tsckpt.open(f"{root}/c")["w"][rank, 0])
    return messages, b, c


@pytest.mark.slow
def test_a_collectives_writes_are_unseen_by_the_counters_and_a_versions_save_under_distributed_warns(tmp_path):
    from tests.dist_helpers import run_ranks

    results = run_ranks(_broadcast_between_saves, 2, str(tmp_path))
    for rank, (messages, b, c) in enumerate(results):
        assert len(messages) == 1 and 'incremental="versions" under torch.distributed: collectives' in messages[0]
        assert c == 2.0  # hashed: rank 0's value
        assert b == (2.0 if rank == 0 else 3.0)  # the blind spot the warning names: rank 1 kept its old row
