"""Quantized tensors (torchao) for tests/test_quantized.py: the reference tensors of each
format, their row and column shards, and the multi-rank scenarios run on gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

import tsckpt
from tests.dist_helpers import rank_layout

ROWS, COLS = 8, 64
KINDS = ("mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4", "nvfp4_pts", "float8", "float8_axiswise", "float8_block")


def hp(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, COLS, generator=g) * torch.logspace(-3, 3, COLS)).to(torch.bfloat16)


def quantized(kind: str, x: torch.Tensor | None = None) -> Any:
    """``x`` (default :func:`hp`) quantized as ``kind``."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    x = hp() if x is None else x
    if kind.startswith("mx"):
        elem = {"mxfp8": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp4": torch.float4_e2m1fn_x2}[kind]
        return MXTensor.to_mx(x, elem, 32)
    if kind.startswith("nvfp4"):
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=torch.tensor(0.75) if kind == "nvfp4_pts" else None)
    if kind == "float8_block":
        from torchao.quantization import Float8Tensor
        from torchao.quantization.granularity import PerBlock

        return Float8Tensor.from_hp(x, granularity=PerBlock([4, 32]))
    axiswise = kind == "float8_axiswise"
    return hp_tensor_to_float8_dynamic(
        x, torch.float8_e4m3fn, LinearMMConfig(), gemm_input_role=GemmInputRole.WEIGHT,
        scaling_granularity=ScalingGranularity.AXISWISE if axiswise else ScalingGranularity.TENSORWISE,
        axiswise_dim=-1 if axiswise else None,
    )


def parts(q: Any) -> dict[str, torch.Tensor]:
    names, _ = q.__tensor_flatten__()
    return {n: getattr(q, n) for n in names}


def same(a: Any, b: Any) -> bool:
    """Same class, metadata and bytes of every part."""
    if type(a) is not type(b) or a.shape != b.shape:
        return False
    (na, ca), (nb, cb) = a.__tensor_flatten__(), b.__tensor_flatten__()
    if na != nb or ca != cb:
        return False
    return all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(parts(a).values(), parts(b).values())
    )


def _ratio(q: Any, name: str, dim: int) -> int:
    """Logical elements per element of part ``name`` along ``dim`` (test-side, by shapes)."""
    t = getattr(q, name)
    if t.dim() == 0 or t.shape[dim] == 1:
        return 0  # broadcast: held whole
    return q.shape[dim] // t.shape[dim]


def shard(q: Any, dim: int, lo: int, hi: int) -> Any:
    """Elements [lo:hi] along ``dim`` of ``q``, as the same subclass."""
    names, ctx = q.__tensor_flatten__()
    inner = {}
    for n in names:
        t, r = getattr(q, n), _ratio(q, n, dim)
        inner[n] = t if r == 0 else t.narrow(dim, lo // r, (hi - lo) // r).contiguous()
    shape = list(q.shape)
    shape[dim] = hi - lo
    return type(q).__tensor_unflatten__(inner, ctx, torch.Size(shape), (shape[1], 1))


def bounds(rank: int, world: int, n: int) -> tuple[int, int]:
    step = n // world
    return rank * step, (rank + 1) * step


# ---- multi-rank scenarios --------------------------------------------------------------


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _local_tree(rank: int, world: int, dim: int, hand_made: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Any] = {}
    m = _mesh(world)
    for kind in KINDS:
        full = quantized(kind)
        n = full.shape[dim]
        lo, hi = bounds(rank, world, n)
        local = shard(full, dim, lo, hi)
        if hand_made:
            offsets = (lo, 0) if dim == 0 else (0, lo)
            out[kind] = tsckpt.ShardedArray(local, tuple(full.shape), offsets)
        else:
            out[kind] = DTensor.from_local(local, m, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride())
    return out


def save_sharded(rank: int, world: int, directory: str, dim: int, hand_made: bool) -> None:
    tree = _local_tree(rank, world, dim, hand_made)
    if dim == 1:  # axiswise float8 scales over rows cannot be split by columns
        tree.pop("float8_axiswise")
    tsckpt.save(directory, tree, layout=rank_layout())


def restore_sharded(rank: int, world: int, directory: str, dim: int, hand_made: bool, inplace: bool) -> list[str]:
    """Restore into zeroed local shards; the kinds whose local tensor differs from the reference."""
    want = _local_tree(rank, world, dim, hand_made)
    if dim == 1:
        want.pop("float8_axiswise")
    target = {}
    for kind, leaf in want.items():
        local = leaf.local if hand_made else leaf.to_local()
        zeroed = type(local).__tensor_unflatten__(
            {n: torch.zeros_like(t) for n, t in parts(local).items()}, local.__tensor_flatten__()[1], local.shape,
            local.stride(),
        )
        target[kind] = tsckpt.ShardedArray(zeroed, leaf.global_shape, leaf.offsets) if hand_made else type(leaf).from_local(
            zeroed, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
        )
    out = tsckpt.restore(directory, target, inplace=inplace)
    bad = []
    for kind, leaf in want.items():
        got = out[kind].local if hand_made else out[kind].to_local()
        ref = leaf.local if hand_made else leaf.to_local()
        if not same(got, ref) or (inplace and out[kind] is not target[kind]):
            bad.append(kind)
    return bad


def _float8_model(world: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 16, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
    fully_shard(model, mesh=_mesh(world))
    return model


def save_fsdp2_float8(rank: int, world: int, directory: str) -> str:
    """FSDP2 float8 training: the weights are DTensors of WeightWithDynamicFloat8CastTensor."""
    model = _float8_model(world)
    kinds = {type(v.to_local()).__name__ for v in model.state_dict().values()}
    tsckpt.save(directory, {"model": model}, layout=rank_layout())
    return ",".join(sorted(kinds))


def restore_fsdp2_float8(rank: int, world: int, directory: str) -> list[str]:
    model = _float8_model(world)
    ref = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local()._tensor.zero_()
    tsckpt.restore(directory, {"model": model}, inplace=True)
    sd = model.state_dict()
    return [k for k, v in ref.items() if not torch.equal(sd[k].full_tensor(), v)]


def restore_hf_fp8(rank: int, world: int, directory: str) -> list[str]:
    """Block-scaled fp8 weights of a Hugging Face directory into DTensor row shards: bf16 (dequantized)
    and Float8Tensor (as stored); the names whose local shard differs from the reference."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, Shard
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock

    import tsckpt.torch

    stored = load_file(f"{directory}/model.safetensors")
    weight, scale = stored["l.weight"], stored["l.weight_scale_inv"]
    ref = (weight.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
    m = _mesh(world)
    rows = weight.shape[0] // world
    lo, hi = rank * rows, (rank + 1) * rows

    def dt(local: Any) -> Any:
        return DTensor.from_local(local, m, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride())

    bf16 = dt(torch.zeros(rows, weight.shape[1], dtype=torch.bfloat16))
    fp8 = dt(Float8Tensor.from_hp(torch.zeros(rows, weight.shape[1], dtype=torch.bfloat16), granularity=PerBlock([128, 128])))
    tsckpt.torch.restore_fp8_blocks(directory, {"l.weight": bf16})
    tsckpt.torch.restore_fp8_blocks(directory, {"l.weight": fp8})
    bad = []
    if not torch.equal(bf16.to_local(), ref[lo:hi]):
        bad.append("bf16")
    local = fp8._local_tensor
    if not (torch.equal(local.qdata.view(torch.uint8), weight[lo:hi].view(torch.uint8))
            and torch.equal(local.scale, scale[lo // 128:hi // 128])):
        bad.append("float8")
    return bad
