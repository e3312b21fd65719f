"""Copies between device and host memory (tsckpt/_runtime/devicecopy.py).

The pipeline runs here on the CPU: the ``cpu_as_device`` fixture makes tsckpt treat CPU
tensors as device tensors and replaces the device steps (page-locked allocation,
asynchronous copies, waits) with ordinary CPU tensors and synchronous copies that are
recorded, so save, restore and save_async take their device paths and the tests check
the bytes, the order of the copies and the host memory held. The tests at the end need
CUDA and skip without it.
"""

from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._runtime import devicecopy as _devicecopy
from tsckpt._leaves.stateful import expand
from tsckpt._options import SaveOptions
from tsckpt._runtime import sharedmem
from tsckpt._save import background
from tsckpt._save.background import AsyncSaver, SaveJob
from tsckpt._save.writer import SharedStaging, WriterSlot
from tsckpt._storage.native import ALIGN
from tsckpt._runtime.devicecopy import HostRing, batches, pieces
from tsckpt.tree import flatten
from tests.dist_helpers import run_ranks

# The writer's own refusal (tests/conftest.py replaces it so that saves stay in a thread).
REFUSED = WriterSlot._refused

KiB = 1 << 10


class CpuOps(_devicecopy.DeviceOps):
    """The device steps on the CPU: plain tensors, synchronous copies, every step logged."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []  # (step, number of the copy)
        self.allocated: list[int] = []  # bytes of each host allocation
        self.copied = {"to_host": 0, "to_device": 0}  # bytes
        self.registrations: list[tuple[int, int]] = []  # (address, bytes) page-locked by register

    def pinned(self, size: int) -> torch.Tensor:
        self.allocated.append(size)
        return torch.empty(size, dtype=torch.uint8)

    registered = pinned

    def _copy(self, step: str, src: torch.Tensor, dst: torch.Tensor) -> int:
        with torch.no_grad():
            dst.copy_(src)
        self.copied[step] += src.numel() * src.element_size()
        self.log.append((step, len(self.log)))
        return len(self.log) - 1

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        return self._copy("to_host", src, dst)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> int:
        return self._copy("to_device", src, dst)

    def to_host_all(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Every copy at once (save_async's staging), as one: waited for once."""
        for src, dst in copies:
            self._copy("to_host", src, dst)
        self.log.append(("to_host_all", len(self.log)))
        return len(self.log) - 1

    def register(self, ptr: int, size: int) -> None:
        self.log.append(("register", ptr))
        self.registrations.append((ptr, size))

    def unregister(self, ptr: int) -> None:
        self.log.append(("unregister", ptr))

    def wait(self, started: int) -> None:
        self.log.append(("wait", started))


@pytest.fixture
def cpu_as_device(monkeypatch):
    """CPU tensors take the device paths, through :class:`CpuOps`; every ring made is kept."""
    ops = CpuOps()
    rings: list[HostRing] = []
    init = HostRing.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        rings.append(self)

    monkeypatch.setattr(_devicecopy, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_devicecopy, "OPS", ops)
    monkeypatch.setattr(HostRing, "__init__", record)
    ops.rings = rings
    return ops


def bf16_state(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors of ``n`` random bit patterns in all (NaNs and infinities included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int16, generator=g)
    return {
        "a": bits[: n // 2].view(torch.bfloat16).reshape(-1, 64),
        "b": bits[n // 2 :].view(torch.bfloat16).reshape(-1, 32),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty": torch.empty(0, 4),
    }


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads included)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dim() == 0:
        x, y = x.reshape(1), y.reshape(1)
    return bool((x.contiguous().view(torch.uint8) == y.contiguous().view(torch.uint8)).all())


# ---- the ring --------------------------------------------------------------------------


def test_ring_lends_in_order_wraps_and_refuses_when_full():
    made = []
    ring = HostRing(4 * 4096, lambda n: made.append(n) or torch.zeros(n, dtype=torch.uint8))
    a, b, c = ring.take(4096), ring.take(4096), ring.take(2 * 4096)
    assert (a.start, b.start, c.start) == (0, 4096, 8192)
    assert ring.take(1) is None  # full
    ring.give(b)  # out of order: not reusable until a is back
    assert ring.take(1) is None and ring.held == 3 * 4096
    ring.give(a)
    d = ring.take(2 * 4096)  # wraps to the start
    assert d.start == 0 and ring.take(1) is None
    ring.give(c)
    ring.give(d)
    assert ring.held == 0 and len(ring) == 0 and ring.peak == 4 * 4096
    assert ring.take(4 * 4096 + 1) is None  # larger than the ring
    e = ring.take(10)
    view = ring.view(e, torch.int16, (5,))
    view.copy_(torch.arange(5, dtype=torch.int16))
    assert made == [4 * 4096]  # one buffer, made on the first view


def test_ring_offsets_are_aligned():
    ring = HostRing(1 << 20, lambda n: torch.zeros(n, dtype=torch.uint8))
    loans = [ring.take(n) for n in (3, 5000, 1, 7)]
    assert [x.start % ALIGN for x in loans] == [0, 0, 0, 0]
    assert loans[1].start == 4096 and loans[2].start == 3 * 4096


@pytest.mark.parametrize(
    "lengths,itemsize,limit",
    [((10, 7), 2, 28), ((10, 7), 2, 1000), ((3, 5, 8), 4, 40), ((3, 5, 8), 4, 3), ((9,), 8, 20), ((), 4, 1), ((0, 5), 2, 4)],
)
def test_pieces_cover_the_box_once_within_the_limit(lengths, itemsize, limit):
    offsets = tuple(range(2, 2 + len(lengths)))
    seen = np.zeros([o + n for o, n in zip(offsets, lengths)], dtype=np.int64)
    got = pieces(offsets, lengths, itemsize, limit)
    for off, ln in got:
        assert math.prod(ln) * itemsize <= max(limit, itemsize)
        seen[tuple(slice(o, o + n) for o, n in zip(off, ln))] += 1
        # a piece is contiguous in a C-contiguous array: after its first partial dimension, all whole
        partial = [i for i, (n, full) in enumerate(zip(ln, lengths)) if n != full]
        assert all(n == 1 for n in ln[: partial[0]]) if partial else True
    box = seen[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert (box == 1).all() and seen.sum() == math.prod(lengths)
    assert (got == []) == (0 in lengths)


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_pieces_follow_the_inner_chunk_rows_where_the_limit_holds_them(rows):
    got = pieces((8, 0), (40, 10), 2, 20 * 7, rows=rows)  # the limit holds 7 rows of 10
    steps = [ln[0] for _, ln in got]
    assert sum(steps) == 40 and [off[0] for off, _ in got] == [8 + sum(steps[:i]) for i in range(len(got))]
    want = 7 if rows > 7 else 7 - 7 % rows  # whole multiples of the chunk's rows, else as many rows as fit
    assert steps[:-1] == [want] * (len(got) - 1) and 0 < steps[-1] <= want


def test_batches_keep_order_and_bound():
    assert list(batches([3, 3, 3, 9, 1], lambda n: n, 6)) == [[3, 3], [3], [9], [1]]
    assert list(batches([], lambda n: n, 6)) == []


# ---- save: device to host --------------------------------------------------------------


def test_save_copies_device_sources_in_bounded_pieces_one_ahead(ckdir, cpu_as_device, layout, small_chunks):
    state = bf16_state(1 << 16)  # 128 KiB of bf16, in shard files of 4 KiB
    window = 16 * KiB
    tsckpt.save(ckdir, state, max_inflight_bytes=window, layout=layout)
    ops = cpu_as_device
    assert ops.copied["to_host"] == sum(t.numel() * t.element_size() for t in state.values())
    (ring,) = ops.rings
    assert ring.peak <= window and ops.allocated == [window]  # never the whole state
    copies = [n for step, n in ops.log if step == "to_host"]
    assert len(copies) >= 32  # shard boxes of at most the window
    # the copy of each box is started before the previous box's copy is waited for
    # (and its write started), so copies overlap with the writes
    for prev, nxt in zip(copies, copies[1:]):
        assert ops.log.index(("wait", prev)) > nxt
    with _plain():
        back = tsckpt.restore(ckdir, as_saved=True)
    for k, t in state.items():
        assert same_bits(back[k], t), k


def test_save_of_cpu_tensors_takes_no_device_path(ckdir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU tensor went through the device copies")

    monkeypatch.setattr(_devicecopy.ToHost, "start", refuse)
    monkeypatch.setattr(_devicecopy.ToDevice, "take", refuse)
    state = bf16_state(1 << 12)
    tsckpt.save(ckdir, state)
    back = tsckpt.restore(ckdir, {k: torch.empty_like(t) for k, t in state.items()})
    assert all(same_bits(back[k], t) for k, t in state.items())


def test_save_with_window_smaller_than_a_box_still_writes_every_byte(ckdir, cpu_as_device):
    state = {"x": torch.arange(40000, dtype=torch.int32).reshape(200, 200)}  # one shard: one inner chunk
    tsckpt.save(ckdir, state, max_inflight_bytes=8 * KiB)
    assert cpu_as_device.rings[0].peak == 160000 and cpu_as_device.allocated == [160000]  # that one, alone
    with _plain():
        assert (tsckpt.restore(ckdir)["x"] == state["x"].numpy()).all()


class _plain:
    """Within the block, CPU tensors are CPU tensors again (the reference reads)."""

    def __enter__(self):
        self.saved = _devicecopy.DEVICE_TYPES
        _devicecopy.DEVICE_TYPES = ("cuda",)

    def __exit__(self, *exc):
        _devicecopy.DEVICE_TYPES = self.saved


# ---- restore: host to device -----------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
def test_restore_into_device_targets_through_bounded_host_memory(ckdir, cpu_as_device, dirty_empty, inplace):
    state = bf16_state(1 << 20, seed=1)
    with _plain():
        tsckpt.save(ckdir, state)
    window = 128 * KiB
    target = {k: torch.zeros_like(t) for k, t in state.items()}
    back = tsckpt.restore(ckdir, target, inplace=inplace, max_inflight_bytes=window)
    for k, t in state.items():
        assert same_bits(back[k], t), k
        assert (back[k] is target[k]) == inplace
    ops = cpu_as_device
    assert ops.copied["to_device"] == sum(t.numel() * t.element_size() for t in state.values())
    (ring,) = ops.rings
    assert ring.peak <= window and ops.allocated == [window]
    # the read of a batch overlaps the copies of the one before: copies are waited for
    # only when the ring needs their memory, the last ones at the end
    uploads = [n for step, n in ops.log if step == "to_device"]
    assert ops.log.index(("wait", uploads[0])) > uploads[1]


def test_restore_into_device_targets_casts_and_regions(ckdir, cpu_as_device, dirty_empty):
    x = torch.randn(300, 70, dtype=torch.float32)
    with _plain():
        tsckpt.save(ckdir, {"x": x.to(torch.bfloat16), "y": x})
    target = {
        "x": torch.zeros(300, 70, dtype=torch.float32),  # a cast on the host, per piece
        "y": tsckpt.ShardedArray(torch.zeros(70, 300).t()[100:250], (300, 70), (100, 0)),  # a strided region
    }
    back = tsckpt.restore(ckdir, target, max_inflight_bytes=16 * KiB)
    assert torch.equal(back["x"], x.to(torch.bfloat16).float())
    assert torch.equal(back["y"].local, x[100:250])
    with pytest.raises(tsckpt.LossyCastError):
        with _plain():
            tsckpt.save(ckdir, {"x": torch.tensor([70000], dtype=torch.int32), "y": x}, overwrite=True)
        tsckpt.restore(ckdir, {"x": torch.zeros(1, dtype=torch.int16), "y": torch.zeros_like(x)})


# ---- save_async: staging ---------------------------------------------------------------


def test_async_stages_device_tensors_in_one_reused_slab(cpu_as_device):
    ops = cpu_as_device
    saver = AsyncSaver()
    seen = []
    state = bf16_state(1 << 14, seed=2)
    tied = {**state, "tied": state["a"]}
    saver.submit("x", tied, seen.append).result(timeout=30)
    staged = seen[-1]
    assert all(same_bits(staged[k], t) for k, t in state.items())
    assert staged["tied"] is staged["a"]  # stored once
    assert len(ops.allocated) == 1 and saver.staging_bytes <= ops.allocated[0]
    ptrs = {k: staged[k].data_ptr() for k in state}
    state["a"].view(torch.int16).add_(1)  # training moves on; the next save reuses the slab
    saver.submit("x", tied, seen.append).result(timeout=30)
    assert len(ops.allocated) == 1 and {k: seen[-1][k].data_ptr() for k in state} == ptrs
    assert same_bits(seen[-1]["a"], state["a"]) and not same_bits(seen[0]["a"], bf16_state(1 << 14, seed=2)["a"])
    saver.submit("x", {"a": torch.ones(3)}, seen.append).result(timeout=30)  # another state: a new slab
    assert len(ops.allocated) == 2 and ops.allocated[1] == ALIGN
    assert saver.staging_bytes == 12
    saver.close()


def test_async_larger_than_its_bound_saves_through_the_write_window(ckdir, cpu_as_device, small_chunks):
    state = bf16_state(1 << 18, seed=3)
    with pytest.warns(RuntimeWarning, match="max_staging_bytes"):
        tsckpt.save_async(ckdir, state, max_staging_bytes=64 * KiB, max_inflight_bytes=64 * KiB).result(timeout=60)
    assert cpu_as_device.allocated == [64 * KiB]  # no slab: the ring of the synchronous save only
    with _plain():
        back = tsckpt.restore(ckdir, as_saved=True)
    assert all(same_bits(back[k], t) for k, t in state.items())


# ---- save_async through a writer process: the shared block ------------------------------


def test_the_shared_block_is_registered_once_and_unregistered_before_it_is_released(cpu_as_device, monkeypatch):
    ops = cpu_as_device
    close = sharedmem.SharedBlock.close
    monkeypatch.setattr(
        sharedmem.SharedBlock, "close", lambda self: (ops.log.append(("close", self.pointer)), close(self))[1]
    )
    shared, buffers = SharedStaging(), {}
    keys = [("a", "torch", (64, 8), torch.bfloat16, True), ("n", "numpy", (5,), np.dtype("int32")),
            ("b", "torch", (3,), torch.float32, True)]
    shared.reserve(buffers, keys)
    first = shared.block
    assert ops.registrations == [(first.pointer, first.size)] and shared.unpinned is None
    assert [first.address(buffers[k]) for k in keys] == [0, 1024, 1088]  # every buffer a view of the block
    shared.reserve(buffers, keys)  # the same arrays: the same block, registered once
    assert shared.block is first and len(ops.registrations) == 1
    for k in keys:
        buffers.pop(k)
    shared.reserve(buffers, [("a", "torch", (32,), torch.bfloat16, True)])  # another state: a new block
    second = shared.block
    steps = [s for s in ops.log if s[0] in ("register", "unregister", "close")]
    assert steps == [("register", first.pointer), ("unregister", first.pointer), ("close", first.pointer),
                     ("register", second.pointer)]
    buffers.clear()
    shared.reserve(buffers, [("n", "numpy", (5,), np.dtype("int32"))])  # host arrays alone: not page-locked
    shared.release()
    assert [s[0] for s in ops.log if s[0] in ("register", "unregister")][-2:] == ["register", "unregister"]
    assert len(ops.registrations) == 2


@pytest.mark.slow
def test_device_tensors_go_to_the_writer_process_through_the_page_locked_shared_block(
    ckdir, cpu_as_device, writer_process
):
    ops = cpu_as_device
    state = bf16_state(1 << 14, seed=5)
    tree = {**state, "tied": state["a"], "host": np.arange(6, dtype=np.int16)}
    expected = {k: t.clone() for k, t in state.items()}
    saver = AsyncSaver()
    handle = saver.submit(ckdir, tree, SaveJob(ckdir, SaveOptions()), writer="process")
    state["a"].view(torch.int16).add_(1)  # training moves on at once
    handle.result(timeout=60)
    assert handle.writer_peak_bytes is not None and saver.writer_pid is not None  # saved by the writer process
    block = saver._process._shared.block
    assert ops.registrations == [(block.pointer, block.size)]
    staged = [b for b in saver._staging._buffers.values() if b.nbytes]
    assert len(staged) == 4 and all(block.address(b) is not None for b in staged)  # a, b, scalar, host
    assert [s for s, _ in ops.log].count("to_host_all") == 1 and ops.log[-1][0] == "wait"  # issued at once, one wait
    with _plain():
        back = tsckpt.restore(ckdir, as_saved=True)
    assert all(same_bits(back[k], t) for k, t in expected.items()) and same_bits(back["tied"], expected["a"])
    pid = saver.writer_pid
    saver.submit(ckdir, tree, SaveJob(ckdir, SaveOptions(overwrite=True)), writer="process").result(timeout=60)
    assert saver.writer_pid == pid and len(ops.registrations) == 1  # the same writer and block
    saver.close()


def test_a_block_that_cannot_be_page_locked_sends_the_save_to_the_thread_saying_why(
    ckdir, cpu_as_device, monkeypatch, caplog
):
    monkeypatch.setattr(WriterSlot, "_refused", REFUSED)  # the real refusal; no writer starts here

    def refuse(ptr: int, size: int) -> None:
        raise RuntimeError("page-locking 4096 bytes of host memory failed with CUDA error 801")

    monkeypatch.setattr(cpu_as_device, "register", refuse)
    caplog.set_level(logging.DEBUG, logger="tsckpt")
    state = bf16_state(1 << 12, seed=6)
    saver = AsyncSaver()
    handle = saver.submit(ckdir, state, SaveJob(ckdir, SaveOptions()), writer="process")
    handle.result(timeout=60)
    assert handle.writer_peak_bytes is None and saver.writer_pid is None  # saved by the thread
    why = (
        "page-locking the shared staging block failed "
        "(RuntimeError: page-locking 4096 bytes of host memory failed with CUDA error 801)"
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"tsckpt: asynchronous saves of CUDA tensors run in a thread of this process: {why}"]
    assert any(r.getMessage().endswith(f"runs in a thread: it holds CUDA tensors and {why}") for r in caplog.records)
    block = saver._process._shared.block
    assert all(block.address(b) is None for b in saver._staging._buffers.values())  # the private slab
    with _plain():
        back = tsckpt.restore(ckdir, as_saved=True)
    assert all(same_bits(back[k], t) for k, t in state.items())
    saver.close()


# ---- on a GPU ---------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def cuda_state(n: int) -> dict[str, torch.Tensor]:
    return {k: t.cuda() for k, t in bf16_state(n, seed=4).items()}


@cuda
def test_cuda_save_and_restore_bit_exact_within_the_windows(ckdir, monkeypatch):
    rings: list[HostRing] = []
    init = HostRing.__init__
    monkeypatch.setattr(HostRing, "__init__", lambda self, *a: (init(self, *a), rings.append(self))[0])
    state = cuda_state(8 << 20)  # 16 MiB
    tsckpt.save(ckdir, state, max_inflight_bytes=2 << 20)
    assert rings[0].peak <= 2 << 20
    host = tsckpt.restore(ckdir, as_saved=True)
    assert all(same_bits(host[k], t.cpu()) for k, t in state.items())
    for inplace in (False, True):
        target = {k: torch.full_like(t, 7) for k, t in state.items()}
        back = tsckpt.restore(ckdir, target, inplace=inplace, max_inflight_bytes=1 << 20)
        assert rings[-1].peak <= 1 << 20
        for k, t in state.items():
            assert back[k].device == t.device and same_bits(back[k], t), k
    back = tsckpt.restore(ckdir, {k: tsckpt.ArraySpec(t.shape, t.dtype, device="cuda") for k, t in state.items()})
    assert all(same_bits(back[k], t) for k, t in state.items())


@cuda
def test_cuda_restore_casts_on_the_way(ckdir):
    x = torch.randn(1000, 33, device="cuda")
    tsckpt.save(ckdir, {"x": x})
    back = tsckpt.restore(ckdir, {"x": torch.zeros(1000, 33, dtype=torch.bfloat16, device="cuda")})
    assert torch.equal(back["x"], x.to(torch.bfloat16))


@cuda
def test_cuda_save_async_stages_in_a_reused_page_locked_slab(ckdir, tmp_path):
    saver = AsyncSaver()
    seen = []
    state = cuda_state(1 << 20)
    saver.submit("x", state, seen.append).result(timeout=60)
    assert all(seen[0][k].is_pinned() and same_bits(seen[0][k], t.cpu()) for k, t in state.items() if t.numel())
    ptr = seen[0]["a"].data_ptr()
    saver.submit("x", state, seen.append).result(timeout=60)
    assert seen[1]["a"].data_ptr() == ptr
    saver.close()
    handle = tsckpt.save_async(ckdir, state)
    expected = {k: t.cpu() for k, t in state.items()}
    for t in state.values():
        t.zero_()  # after staging: not in the checkpoint
    handle.result(timeout=60)
    back = tsckpt.restore(ckdir, as_saved=True)
    assert all(same_bits(back[k], t) for k, t in expected.items())
    with pytest.warns(RuntimeWarning, match="max_staging_bytes"):
        tsckpt.save_async(tmp_path / "big", state, max_staging_bytes=1 << 10).result(timeout=60)


@cuda
def test_cuda_rng_states_of_every_device_round_trip(ckdir):
    import tsckpt.torch as tt

    for d in range(torch.cuda.device_count()):
        torch.cuda.manual_seed_all(1234)
        torch.rand(1, device=f"cuda:{d}")  # initialize every device's generator
    state = tt.get_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    tsckpt.save(ckdir, {"rng": state})
    want = [torch.rand(5, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    tt.set_rng_state(tsckpt.restore(ckdir)["rng"])
    got = [torch.rand(5, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def _dtensor_on_cuda(rank: int, world: int, directory: str) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tsckpt._coord.torchdist import coordinator_for

    mesh = init_device_mesh("cuda", (world,))
    full = torch.arange(64 * 48, dtype=torch.float32, device="cuda").reshape(64, 48).to(torch.bfloat16)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    tsckpt.save(directory, {"dt": dt, "rep": full}, max_inflight_bytes=1 << 12)
    target = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])  # resharded
    back = tsckpt.restore(directory, {"dt": target, "rep": torch.zeros_like(full)})
    assert torch.equal(back["dt"].full_tensor(), full) and torch.equal(back["rep"], full)
    return dist.get_backend(coordinator_for().group)


@pytest.mark.slow
@cuda
def test_cuda_dtensor_one_process_nccl(ckdir):
    assert run_ranks(_dtensor_on_cuda, 1, ckdir, backend="nccl", timeout=300) == ["gloo"]


@pytest.mark.slow
@two_gpus
def test_cuda_dtensor_two_processes_nccl_coordinates_on_gloo(ckdir):
    assert run_ranks(_dtensor_on_cuda, 2, ckdir, backend="nccl", timeout=300) == ["gloo", "gloo"]



@pytest.mark.slow
@cuda
def test_cuda_model_and_adamw_saved_by_the_writer_process_bit_exact_after_mutating_at_once(ckdir, writer_process):
    import tsckpt.torch as tt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(16, 64, device="cuda")).square().mean().backward()  # BatchNorm's running stats
        opt.step()  # parameters, moments, step counts
        opt.zero_grad()

    step()
    state = tt.TrainState(model, opt)
    flat = flatten(copy.deepcopy(expand(state.__tsckpt_tree__(0)).tree))
    expected = {p: (v.cpu() if isinstance(v, torch.Tensor) else v) for p, v in zip(flat.paths, flat.leaves)}
    handle = tsckpt.save_async(ckdir, state, writer="process")
    step()  # right after the call
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    handle.result(timeout=120)
    assert handle.writer_peak_bytes is not None and background._default.writer_pid is not None  # the writer process
    saved = flatten(tsckpt.restore(ckdir))
    assert saved.paths == flat.paths
    for path, got in zip(saved.paths, saved.leaves):
        want = expected[path]
        if isinstance(want, torch.Tensor):
            assert same_bits(torch.as_tensor(got), want), path
        else:
            assert got == want, path
    background._default.close()  # save_async's own saver: its writer leaves with it


@cuda
def test_cuda_staging_copies_run_on_one_reused_side_stream_after_the_queued_work():
    ops = _devicecopy.DeviceOps()
    side = ops.side_stream(torch.device("cuda"))
    assert ops.side_stream(torch.device("cuda", torch.cuda.current_device())) is side
    assert side != torch.cuda.current_stream()
    src = torch.zeros(1 << 22, device="cuda")
    host = ops.registered(src.numel() * 4).view(torch.float32)
    for value in (1.0, 2.0):  # queued on the training stream just before: the copy sees it
        src.fill_(value)
        ops.wait(ops.to_host_all([(src, host)]))
        assert bool((host == value).all())
