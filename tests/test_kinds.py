"""Leaf kinds (tsckpt._leaves.kinds, _leaves): one adapter per array type, tested without I/O; and what save refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._ondisk.records import ArrayRecord, Chunking
from tsckpt._leaves.kinds import LazyKind, NumpyKind, ShardedKind, SpecKind, TorchKind
from tsckpt._leaves.registry import describe, destination, kind_of, memory
from tsckpt._base import dtypes as _dtypes
from tsckpt._base.types import LazySource, TorchRegion


def rec(shape, dtype="float32", kind="torch"):
    return ArrayRecord("w", tuple(shape), dtype, kind, Chunking(tuple(shape) or (1,), None))


@pytest.mark.parametrize(
    "leaf, kind",
    [
        (torch.zeros(2), TorchKind),
        (np.zeros(2), NumpyKind),
        (np.float32(1), NumpyKind),
        (tsckpt.ShardedArray(torch.zeros(2), (4,), (2,)), ShardedKind),
        (tsckpt.ArraySpec((2,), torch.float32), SpecKind),
        (LazySource((2,), torch.float32, lambda box: torch.zeros(2)), LazyKind),
    ],
)
def test_each_array_leaf_has_one_kind(leaf, kind):
    assert isinstance(kind_of(leaf), kind)


@pytest.mark.parametrize("value", [1, 2.5, "s", b"b", True])
def test_plain_values_have_no_kind(value):
    assert kind_of(value) is None
    assert describe("v", value).desc.kind == "value"


def test_describe_records_region_dtype_and_itemsize():
    d = describe("w", tsckpt.ShardedArray(torch.zeros(2, 3, dtype=torch.complex32), (4, 3), (2, 0))).desc
    assert (d.kind, d.dtype, d.itemsize, d.global_shape, d.offsets, d.lengths) == (
        "torch", "complex32", 4, (4, 3), (2, 0), (2, 3))
    d = describe("s", np.float16(1)).desc
    assert (d.kind, d.dtype, d.itemsize, d.global_shape) == ("numpy_scalar", "float16", 2, ())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64, torch.bool])
def test_a_torch_region_describes_as_the_tensor_it_holds(dtype):
    t = torch.arange(6).reshape(2, 3).to(dtype)
    held = t.view(torch.uint8 if t.element_size() == 1 else getattr(torch, f"int{8 * t.element_size()}")).numpy()
    region = TorchRegion(held.view(_dtypes.numpy_twin(_dtypes.torch_name(dtype))), (2, 3), (0, 0))
    got, want = describe("w", region), describe("w", t)
    assert got.desc == want.desc and got.desc.kind == "torch"
    assert isinstance(got.data, np.ndarray) and got.data.tobytes() == t.view(torch.uint8).numpy().tobytes()
    d = describe("w", TorchRegion(np.zeros((2, 3), np.float32), (4, 3), (2, 0))).desc
    assert (d.kind, d.dtype, d.global_shape, d.offsets) == ("torch", "float32", (4, 3), (2, 0))


def test_memory_identity_is_equal_for_the_same_view_only():
    w = torch.arange(12.0).reshape(3, 4)
    assert memory(w) == memory(w.view(3, 4)) == memory(tsckpt.ShardedArray(w, (3, 4), (0, 0)))
    assert memory(w) != memory(w[1:])
    assert memory(w) != memory(w.t())
    assert memory(w) != memory(w.view(torch.int32))
    a = np.arange(6.0)
    assert memory(a) == memory(a[:]) and memory(a) != memory(a[1:])
    assert memory(np.float32(1)) is None
    src = LazySource((2,), torch.float32, lambda box: None)
    assert memory(src) == memory(src) and memory(src) != memory(LazySource((2,), torch.float32, lambda b: None))


def test_destinations_check_shape_and_cast_with_the_path():
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"'w': target shape \[3\] but the checkpoint stores \[2\]"):
        destination(rec((2,)), "w", torch.zeros(3), False)
    with pytest.raises(tsckpt.LeafTypeError, match="'w': stored dtype complex64 is complex but the target is"):
        destination(rec((2,), "complex64"), "w", np.zeros(2), False)
    with pytest.raises(tsckpt.LeafTypeError, match="'w': the checkpoint stores an array float32\\[2\\] but the target leaf is str"):
        destination(rec((2,)), "w", "x", False)
    with pytest.raises(tsckpt.LeafTypeError, match="'w': a LazySource cannot be a restore target"):
        destination(rec((2,)), "w", LazySource((2,), torch.float32, None), False)


def test_destination_in_place_or_fresh():
    t = torch.zeros(2)
    assert destination(rec((2,)), "w", t, True).tensor is t
    fresh = destination(rec((2,)), "w", t, False)
    assert fresh.tensor is not t and fresh.result is fresh.tensor
    scalar = destination(rec((), "float32", "numpy_scalar"), "s", np.float32(0), True)
    scalar.tensor[()] = 7
    assert scalar.restored() == np.float32(7) and isinstance(scalar.restored(), np.float32)
    region = destination(rec((4,)), "w", tsckpt.ShardedArray(np.zeros(2, np.float32), (4,), (2,)), False)
    assert (region.item.storage_offsets, region.item.lengths) == ((2,), (2,))


def test_read_only_numpy_target_refused_in_place():
    a = np.zeros(2, np.float32)
    a.flags.writeable = False
    with pytest.raises(tsckpt.LeafTypeError, match="'w': target numpy array is read-only"):
        destination(rec((2,)), "w", a, True)


# ---- what save refuses because restore would -------------------------------------------

_HUGE_EMPTY = (0, 2**30, 2**30)  # no elements, but extents whose product is 2**60


@pytest.mark.parametrize(
    "leaf",
    [
        torch.empty(_HUGE_EMPTY),
        np.empty((0, 2**40, 2**20), np.uint8),
        tsckpt.ShardedArray(torch.empty(0, 4), (0, 2**59), (0, 0)),
        LazySource(_HUGE_EMPTY, torch.float32, lambda box: torch.empty(0)),
    ],
)
def test_describe_refuses_extents_restore_refuses(leaf):
    with pytest.raises(tsckpt.LeafTypeError) as info:
        describe("model/w", leaf)
    assert str(info.value).startswith("'model/w': an array of shape [")
    assert "(a zero counted as one) is " in str(info.value) and "not under 2**59" in str(info.value)
    assert str(info.value).endswith("reshape it (merge dimensions, or give an empty array smaller extents) before saving")


def test_describe_refuses_more_dimensions_than_readers_open():
    assert describe("ok", torch.zeros([1] * 32)).desc.global_shape == (1,) * 32
    with pytest.raises(tsckpt.LeafTypeError) as info:
        describe("deep", torch.zeros([1] * 33))
    assert str(info.value) == (
        f"'deep': an array of shape {[1] * 33} has 33 dimensions, more than the 32 zarr readers open, so the "
        "checkpoint could not be read back; reshape it (merge dimensions, or give an empty array smaller extents) "
        "before saving"
    )


def test_save_and_restore_share_one_definition_of_the_limits():
    from tsckpt._ondisk.records import MAX_ELEMENTS, MAX_NDIM, extent_problem, record_problem

    def problem(shape):
        j = {"path": "w", "kind": "torch", "dtype": "float32", "shape": list(shape),
             "shard_shape": [max(s, 1) for s in shape], "chunk_shape": None}
        return record_problem(j, lambda d: True)

    for shape in [(1,) * MAX_NDIM, (0, 2**29, 2**29), (MAX_ELEMENTS - 1,)]:
        assert extent_problem(shape) is None and problem(shape) is None
    for shape in [(1,) * (MAX_NDIM + 1), (0, 2**30, 2**29), (MAX_ELEMENTS,)]:
        assert extent_problem(shape) is not None and problem(shape) is not None
    assert extent_problem((0, 2**30, 2**30)) == (
        "extents whose product (a zero counted as one) is 1152921504606846976 (2**60.0), not under 2**59")


def test_save_refuses_before_writing_anything(tmp_path):
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'big': an array of shape \[0, 1073741824, 1073741824\]"):
        tsckpt.save(str(tmp_path / "ck"), {"ok": torch.ones(2), "big": torch.empty(_HUGE_EMPTY)})
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("offsets", [(3, 0), (4, 0), (0, 2), (-1, 0)])
@pytest.mark.parametrize("inplace", [False, True])
def test_a_sharded_target_outside_the_stored_array_is_refused_naming_its_region(tmp_path, offsets, inplace):
    """Rows [3:5] of a 4-row array were read with row 3 copied into a row 4 that does not
    exist; further out, the restore blamed the checkpoint as damaged."""
    tsckpt.save(tmp_path / "ck", {"w": torch.arange(16.0).reshape(4, 4)})
    target = tsckpt.ShardedArray(torch.full((2, 4), -7.0), (4, 4), offsets)
    box = ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, (2, 4)))
    with pytest.raises(tsckpt.ShapeMismatchError) as e:
        tsckpt.restore(tmp_path / "ck", {"w": target}, inplace=inplace)
    assert str(e.value) == (
        f"'w': the target's region [{box}] (offsets {list(offsets)}, local shape [2, 4]) lies outside the global "
        "shape [4, 4]; fix the target's offsets or local shape"
    )
    assert (target.local == -7.0).all()
