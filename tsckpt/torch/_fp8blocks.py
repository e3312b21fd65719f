"""Block-scaled fp8 weights of Hugging Face checkpoints, read into torch targets region by region.

Such a checkpoint (DeepSeek-V3's layout, transformers' ``fp8`` quantization) stores a
weight ``W`` as float8_e4m3fn and ``W_scale_inv`` as float32, one per block of
``weight_block_size`` (``config.json``'s ``quantization_config``; 128 x 128 when it has
none): the values are ``W * W_scale_inv`` of its block. :func:`restore_fp8_blocks` reads
such a directory (or a tsckpt checkpoint of the same names, or the safetensors that
``tsckpt convert`` writes) into a torchao ``Float8Tensor`` of the same blocks (its parts
read as stored) or dequantized into a floating-point target (bf16), each target's region
only (a DTensor's or ShardedArray's local shard), with the scale blocks that cover it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .._base.types import ShardedArray
from .._convert import HF_SCALE_SUFFIX
from .._errors import LeafTypeError, StructureMismatchError
from .._leaves.dtensor import is_dtensor, region
from .._leaves.quantized import FLOAT8_BLOCKS, class_name, part_region
from .._read.open import open as open_checkpoint
from .._read.reader import LazyArray
from .._read.restore import RestoreWarning, restore

DEFAULT_BLOCK = (128, 128)


def _block_size(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """``weight_block_size`` of the directory's config.json, else :data:`DEFAULT_BLOCK`."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        return DEFAULT_BLOCK
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    return DEFAULT_BLOCK if block is None else (int(block[0]), int(block[1]))


def _local(name: str, leaf: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, offsets of its region) of a target leaf."""
    if is_dtensor(leaf):
        offsets, _ = region(name, leaf)
        return leaf._local_tensor, tuple(leaf.shape), offsets
    if isinstance(leaf, ShardedArray):
        return leaf.local, leaf.global_shape, leaf.offsets
    return leaf, tuple(leaf.shape), (0,) * leaf.dim()


def _box(offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


def _read_fp8(
    name: str, weight: LazyArray, scale: LazyArray, block: tuple[int, int], local: Any, shape: tuple[int, ...],
    offsets: tuple[int, ...],
) -> None:
    """Fill ``local`` (the region at ``offsets`` of the weight ``name``) from the stored weight
    and the scale blocks covering the region."""
    if tuple(weight.shape) != shape or len(shape) != 2:
        raise LeafTypeError(
            f"'{name}': the target has shape {list(shape)} but the checkpoint stores a block-scaled fp8 weight of "
            f"{list(weight.shape)}; give a 2-D target of the stored shape"
        )
    want = tuple(-(-n // b) for n, b in zip(shape, block))
    if tuple(scale.shape) != want:
        raise LeafTypeError(
            f"'{name}{HF_SCALE_SUFFIX}': {list(scale.shape)} scales for a weight of {list(shape)} in blocks of "
            f"{list(block)}, which needs {list(want)}; the config's weight_block_size does not match the weights"
        )
    lengths = tuple(int(s) for s in local.shape)
    if class_name(local) == FLOAT8_BLOCKS:
        if tuple(local.block_size) != block:
            raise LeafTypeError(
                f"'{name}': the target Float8Tensor has blocks of {list(local.block_size)} but the checkpoint's are "
                f"{list(block)}; quantize the target with PerBlock({list(block)}), or give a bf16 target"
            )
        _, s_off, s_len = part_region(name, "scale", block, shape, offsets, lengths)
        with torch.no_grad():
            local.qdata.copy_(weight.torch[_box(offsets, lengths)])
            local.scale.copy_(scale.torch[_box(s_off, s_len)])
        return
    if not local.dtype.is_floating_point:
        raise LeafTypeError(
            f"'{name}': a block-scaled fp8 weight restores into a torchao Float8Tensor or a floating-point tensor, "
            f"not {local.dtype}"
        )
    first = tuple(o // b for o, b in zip(offsets, block))  # the scale blocks the region touches
    last = tuple(-(-(o + n) // b) for o, n, b in zip(offsets, lengths, block))
    scales = scale.torch[tuple(slice(a, z) for a, z in zip(first, last))]
    full = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    start = tuple(o - a * b for o, a, b in zip(offsets, first, block))
    values = weight.torch[_box(offsets, lengths)].to(torch.float32) * full[_box(start, lengths)]
    with torch.no_grad():
        local.copy_(values.to(local.dtype))


def restore_fp8_blocks(directory: str | os.PathLike[str], target: Mapping[str, Any]) -> dict[str, Any]:
    """Restore ``target`` (name -> tensor, DTensor, ShardedArray or torchao ``Float8Tensor``,
    filled in place) from a checkpoint of block-scaled fp8 weights (module docstring): a
    name with a ``<name>_scale_inv`` beside it is read as such a weight, into a
    ``Float8Tensor`` of the same blocks as stored or dequantized into a floating-point
    target; every other name is restored as :func:`tsckpt.restore` does. Returns ``target``."""
    reader = open_checkpoint(directory)
    block = _block_size(directory)
    stored = set(reader)
    fp8 = {n: leaf for n, leaf in target.items() if n + HF_SCALE_SUFFIX in stored and n in stored}
    plain = {n: leaf for n, leaf in target.items() if n not in fp8}
    missing = sorted(set(plain) - stored)
    if missing:
        raise StructureMismatchError(
            f"{os.fspath(directory)}: the target's {missing[:5]} ({len(missing)}) are not in the checkpoint; give "
            "the names it stores (tsckpt ls lists them)"
        )
    if plain:  # the checkpoint's fp8 weights and scales are the target's other leaves: no warning for them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RestoreWarning)
            restore(directory, plain, inplace=True, strict=False)
    for name, leaf in fp8.items():
        local, shape, offsets = _local(name, leaf)
        _read_fp8(name, reader[name], reader[name + HF_SCALE_SUFFIX], block, local, shape, offsets)
    return dict(target)
