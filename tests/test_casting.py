"""restore(casting=...): numpy's casting rules for targets of another dtype, with the
values read checked for overflow and lost integer bits."""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._base.casting as casting_mod
from tsckpt._base import dtypes as _dtypes
import tsckpt.torch
from tsckpt._base.casting import level
from tsckpt._ondisk.records import ArrayRecord
from tsckpt._leaves.registry import destination
from tests.dist_helpers import run_ranks

F16_1E6 = (
    "'w': stored float32 values do not fit the float16 target: 1000000.0 at index [1] is beyond float16's largest "
    "finite value 65504; 1 such value among the first 3 read. Pass casting=\"unsafe\" to cast anyway, or restore "
    "into a target of the stored dtype float32"
)


def saved(ckdir: str, **arrays: np.ndarray) -> str:
    tsckpt.save(ckdir, dict(arrays))
    return ckdir


def restore_one(ckdir: str, path: str, target, **kwargs):
    return tsckpt.restore(ckdir, {path: target}, strict=False, **kwargs)[path]


@pytest.fixture
def quiet():
    """Any warning fails the test (strict=False's own warning about the other leaves aside)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", ".*target tree and checkpoint differ", tsckpt.RestoreWarning)
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental", UserWarning)
        yield


def lost_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if "target tree and checkpoint differ" not in str(w.message)]


TARGETS_F16 = {
    "numpy": lambda n: np.zeros(n, np.float16),
    "torch": lambda n: torch.zeros(n, dtype=torch.float16),
    "spec-numpy": lambda n: tsckpt.ArraySpec((n,), np.float16),
    "spec-torch": lambda n: tsckpt.ArraySpec((n,), torch.float16),
}


# ---- same_kind (the default): checked values ------------------------------------------


@pytest.mark.parametrize("make", TARGETS_F16.values(), ids=TARGETS_F16.keys())
def test_overflow_into_float16_raises_naming_the_leaf(ckdir, make):
    saved(ckdir, w=np.array([1.0, 1e6, 2.0], np.float32))
    with pytest.raises(tsckpt.LossyCastError) as ei:
        restore_one(ckdir, "w", make(3))
    assert str(ei.value) == F16_1E6
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("make", TARGETS_F16.values(), ids=TARGETS_F16.keys())
def test_rounding_to_float16_is_not_a_loss(ckdir, make, quiet):
    saved(ckdir, w=np.array([1.1, -65504.0, 1e-9, 65504.0], np.float32))
    back = restore_one(ckdir, "w", make(4))
    back = back.numpy() if isinstance(back, torch.Tensor) else back
    assert back.dtype == np.float16
    assert back.tolist() == [float(np.float16(1.1)), -65504.0, 0.0, 65504.0]
    assert float(np.float16(1.1)) != 1.1  # it was rounded


def test_nan_and_inf_in_the_stored_data_are_not_losses(ckdir, quiet):
    saved(ckdir, w=np.array([np.nan, np.inf, -np.inf, 3.0], np.float32))
    back = restore_one(ckdir, "w", torch.zeros(4, dtype=torch.float16))
    assert back[0].isnan() and back[1:].tolist() == [float("inf"), float("-inf"), 3.0]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_int64_out_of_int32_range_raises(ckdir, kind):
    saved(ckdir, i=np.array([0, 2**40, -(2**40), 5], np.int64))
    target = np.zeros(4, np.int32) if kind == "numpy" else torch.zeros(4, dtype=torch.int32)
    with pytest.raises(tsckpt.LossyCastError) as ei:
        restore_one(ckdir, "i", target)
    assert str(ei.value) == (
        "'i': stored int64 values do not fit the int32 target: 1099511627776 at index [1] is outside int32's range "
        "[-2147483648, 2147483647]; 2 such values among the first 4 read. Pass casting=\"unsafe\" to cast anyway, "
        "or restore into a target of the stored dtype int64"
    )


def test_int64_at_the_int32_limits_fits(ckdir, quiet):
    saved(ckdir, i=np.array([2**31 - 1, -(2**31), 7], np.int64))
    assert restore_one(ckdir, "i", torch.zeros(3, dtype=torch.int32)).tolist() == [2**31 - 1, -(2**31), 7]
    saved(ckdir + "u", u=np.array([255, 0], np.uint64))
    assert restore_one(ckdir + "u", "u", np.zeros(2, np.uint8)).tolist() == [255, 0]


def test_integer_not_exact_in_float32_raises(ckdir):
    saved(ckdir, i=np.array([3, 2**24 + 1], np.int64))
    with pytest.raises(tsckpt.LossyCastError) as ei:
        restore_one(ckdir, "i", torch.zeros(2))
    assert str(ei.value) == (
        "'i': stored int64 values do not fit the float32 target: 16777217 at index [1] is not exactly representable "
        "in float32 (24 significant bits); 1 such value among the first 2 read. Pass casting=\"unsafe\" to cast "
        "anyway, or restore into a target of the stored dtype int64"
    )


def test_integers_exact_in_float32_fit(ckdir, quiet):
    values = [2**24, -(2**24), 2**40, -(2**63), 2**24 + 2, 0]  # at most 24 significant bits
    saved(ckdir, i=np.array(values, np.int64))
    assert restore_one(ckdir, "i", np.zeros(6, np.float32)).tolist() == [float(v) for v in values]


# ---- bfloat16 and float8 targets ------------------------------------------------------


def test_bfloat16_targets(ckdir, quiet):
    saved(ckdir, f=np.array([1.1, -3.0e38, 1e-40], np.float64), i=np.array([256, -(2**20), 3], np.int32))
    back = restore_one(ckdir, "f", torch.zeros(3, dtype=torch.bfloat16))
    assert back.tolist() == torch.tensor([1.1, -3.0e38, 1e-40], dtype=torch.float64).to(torch.bfloat16).tolist()
    assert restore_one(ckdir, "i", torch.zeros(3, dtype=torch.bfloat16)).tolist() == [256.0, -(2.0**20), 3.0]
    np_back = restore_one(ckdir, "f", np.zeros(3, ml_dtypes.bfloat16))
    assert np_back.dtype == ml_dtypes.bfloat16 and np_back.astype(np.float64).tolist() == back.tolist()


@pytest.mark.parametrize(
    "stored, value, target, message",
    [
        (np.float64, 1e300, torch.bfloat16,
         "1e+300 at index [1] is beyond bfloat16's largest finite value 3.38953e+38; 1 such value among the first 2 read"),
        (np.float32, 3.4e38, torch.bfloat16,
         "3.3999999521443642e+38 at index [1] is beyond bfloat16's largest finite value 3.38953e+38; 1 such value "
         "among the first 2 read"),
        (np.int64, 257, torch.bfloat16,
         "257 at index [1] is not exactly representable in bfloat16 (8 significant bits); 1 such value among the "
         "first 2 read"),
        (np.float32, 500.0, torch.float8_e4m3fn,
         "500.0 at index [1] is beyond float8_e4m3fn's largest finite value 448; 1 such value among the first 2 read"),
        (np.float32, np.inf, torch.float8_e4m3fn,
         "inf at index [1] has no float8_e4m3fn value (float8_e4m3fn has no infinity); 1 such value among the first "
         "2 read"),
        (np.float16, -2.0, torch.float8_e8m0fnu,
         "-2.0 at index [1] is negative; float8_e8m0fnu has no negative values; 1 such value among the first 2 read"),
    ],
    ids=["f64-bf16", "f32-bf16", "int-bf16", "f32-e4m3", "inf-e4m3", "neg-e8m0"],
)
def test_narrow_float_targets_raise(ckdir, stored, value, target, message):
    saved(ckdir, w=np.array([1, value], stored))
    name = str(np.dtype(stored))
    with pytest.raises(tsckpt.LossyCastError) as ei:
        restore_one(ckdir, "w", torch.zeros(2, dtype=target))
    tname = str(target).removeprefix("torch.")
    assert str(ei.value) == (
        f"'w': stored {name} values do not fit the {tname} target: {message}. Pass casting=\"unsafe\" to cast "
        f"anyway, or restore into a target of the stored dtype {name}"
    )


def test_float8_in_range_rounds(ckdir, quiet):
    saved(ckdir, w=np.array([448.0, -1.3, 0.0], np.float32))
    back = restore_one(ckdir, "w", torch.zeros(3, dtype=torch.float8_e4m3fn))
    assert back.float().tolist() == torch.tensor([448.0, -1.3, 0.0]).to(torch.float8_e4m3fn).float().tolist()


# ---- other kinds: refused under same_kind, checked under unsafe -----------------------


@pytest.mark.parametrize("target", [np.zeros(3, np.int32), torch.zeros(3, dtype=torch.int32)], ids=["numpy", "torch"])
def test_float_to_int_refused_under_same_kind_before_reading(ckdir, target):
    saved(ckdir, f=np.array([1.0, 1.5, 2.0], np.float32))
    _remove_chunks(ckdir, "f")  # a refusal never gets as far as reading
    shown = "torch.int32" if isinstance(target, torch.Tensor) else "int32"
    with pytest.raises(tsckpt.LeafTypeError) as ei:
        restore_one(ckdir, "f", target)
    assert str(ei.value) == (
        f"'f': casting=\"same_kind\" refuses stored float32 into the {shown} target (float to integer); restore into "
        "a target of the stored dtype float32, or pass casting=\"unsafe\""
    )


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_float_to_int_under_unsafe_warns_when_values_are_lost(ckdir, kind):
    saved(ckdir, f=np.array([1.0, 1.5, -2.5, 2.0], np.float32))
    target = np.zeros(4, np.int32) if kind == "numpy" else torch.zeros(4, dtype=torch.int32)
    back, caught = lost_warnings(lambda: restore_one(ckdir, "f", target, casting="unsafe"))
    assert back.tolist() == [1, 1, -2, 2]
    assert caught == [
        "'f': casting=\"unsafe\" changed 2 of the 4 stored float32 values read into the int32 target; the first, 1.5 "
        "at index [1], is not an integer in int32's range [-2147483648, 2147483647]"
    ]


def test_unsafe_without_loss_is_silent(ckdir, quiet):
    saved(ckdir, f=np.array([1.0, -2.0], np.float32), i=np.array([1, 0], np.int64))
    assert restore_one(ckdir, "f", torch.zeros(2, dtype=torch.int64), casting="unsafe").tolist() == [1, -2]
    assert restore_one(ckdir, "i", np.zeros(2, bool), casting="unsafe").tolist() == [True, False]


def test_unsafe_overflow_warns_and_casts(ckdir):
    saved(ckdir, w=np.array([1.0, 1e6, 2.0], np.float32))
    back, caught = lost_warnings(lambda: restore_one(ckdir, "w", np.zeros(3, np.float16), casting="unsafe"))
    assert back.tolist() == [1.0, float("inf"), 2.0]
    assert caught == [
        "'w': casting=\"unsafe\" changed 1 of the 3 stored float32 values read into the float16 target; the first, "
        "1000000.0 at index [1], is beyond float16's largest finite value 65504"
    ]


def test_complex_casts(ckdir):
    saved(ckdir, c=np.array([1 + 2j, 3 + 0j, 1e300 + 1j], np.complex128))
    with pytest.raises(tsckpt.LossyCastError, match=r"^'c': stored complex128 values do not fit the complex64 target: "
                       r"\(1e\+300\+1j\) at index \[2\] \(its real part\) is beyond float32's largest finite value"):
        restore_one(ckdir, "c", np.zeros(3, np.complex64))
    back, caught = lost_warnings(lambda: restore_one(ckdir, "c", torch.zeros(3, dtype=torch.float64), casting="unsafe"))
    assert back.tolist() == [1.0, 3.0, 1e300]
    assert caught == [
        "'c': casting=\"unsafe\" changed 2 of the 3 stored complex128 values read into the float64 target; the "
        "first, (1+2j) at index [0], has a nonzero imaginary part, which the real float64 target drops"
    ]


def test_complex32_into_complex64_is_safe(ckdir, quiet):
    c = torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64).to(torch.complex32)
    tsckpt.save(ckdir, {"c": c})
    assert restore_one(ckdir, "c", torch.zeros(2, dtype=torch.complex64)).tolist() == [1 + 2j, -0.5j]


# ---- no / equiv / safe: refused before anything is read -------------------------------


@pytest.mark.parametrize("casting", ["no", "equiv", "safe"])
def test_strict_castings_refuse_float32_into_float16_before_reading(ckdir, casting):
    saved(ckdir, w=np.array([1.0, 2.0], np.float32))
    _remove_chunks(ckdir, "w")
    with pytest.raises(tsckpt.LeafTypeError) as ei:
        restore_one(ckdir, "w", torch.zeros(2, dtype=torch.float16), casting=casting)
    assert str(ei.value) == (
        f"'w': casting=\"{casting}\" refuses stored float32 into the torch.float16 target (not every stored value is "
        "exactly a target value); restore into a target of the stored dtype float32, or pass casting=\"same_kind\" "
        "to cast and check the values read"
    )


def test_strict_castings_allow_what_they_name(ckdir, quiet):
    saved(ckdir, w=np.array([1.5, 2.0], np.float32), h=np.array([1.5, -2.0], np.float16), i=np.array([7, -9], np.int32))
    assert restore_one(ckdir, "w", torch.zeros(2), casting="no").tolist() == [1.5, 2.0]
    assert restore_one(ckdir, "w", np.zeros(2, ">f4"), casting="equiv").tolist() == [1.5, 2.0]
    assert restore_one(ckdir, "h", np.zeros(2, np.float32), casting="safe").tolist() == [1.5, -2.0]
    assert restore_one(ckdir, "h", torch.zeros(2, dtype=torch.complex64), casting="safe").tolist() == [1.5, -2.0]
    assert restore_one(ckdir, "i", torch.zeros(2, dtype=torch.float64), casting="safe").tolist() == [7.0, -9.0]
    with pytest.raises(tsckpt.LeafTypeError, match=r"\(the byte order differs\); .* or pass casting=\"equiv\"$"):
        restore_one(ckdir, "w", np.zeros(2, ">f4"), casting="no")
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'h': casting=\"equiv\" refuses stored float16 into the float32 "
                       r"target \(the dtypes differ\); .* or pass casting=\"safe\"$"):
        restore_one(ckdir, "h", np.zeros(2, np.float32), casting="equiv")


def test_unknown_casting_is_a_value_error(ckdir):
    saved(ckdir, w=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="^casting must be one of 'no', 'equiv', 'safe', 'same_kind', 'unsafe', not 'lossy'$"):
        tsckpt.restore(ckdir, {"w": np.zeros(2, np.float32)}, casting="lossy")


def test_raw_bits_cast_to_nothing_else(ckdir):
    tsckpt.save(ckdir, {"b": torch.zeros(2, dtype=torch.uint8).view(torch.bits8)})
    with pytest.raises(tsckpt.LeafTypeError, match="^'b': stored dtype bits8 cannot be restored into the torch.uint8 "
                       "target: raw bits cast to no other dtype; use a target of the stored dtype$"):
        restore_one(ckdir, "b", torch.zeros(2, dtype=torch.uint8), casting="unsafe")


# ---- the order of dtypes ----------------------------------------------------------------


@pytest.mark.parametrize("stored, target, needed", [
    ("float32", "float32", "no"),
    ("float16", "float32", "safe"),
    ("bfloat16", "float32", "safe"),
    ("float8_e4m3fn", "bfloat16", "safe"),
    ("float8_e5m2", "float16", "safe"),
    ("float8_e4m3fn", "float16", "safe"),
    ("float8_e8m0fnu", "float32", "safe"),
    ("float16", "bfloat16", "same_kind"),  # fewer significant bits, more range
    ("bfloat16", "float16", "same_kind"),
    ("float32", "float8_e8m0fnu", "same_kind"),
    ("int16", "float32", "safe"),
    ("int32", "float32", "same_kind"),
    ("int64", "float64", "same_kind"),  # numpy calls this safe; 2**53 + 1 is not a float64
    ("uint8", "bfloat16", "safe"),
    ("int8", "float8_e4m3fn", "same_kind"),
    ("uint8", "int16", "safe"),
    ("uint64", "int8", "same_kind"),
    ("int8", "uint64", "unsafe"),
    ("bool", "float8_e8m0fnu", "same_kind"),  # it has no zero
    ("bool", "int4", "safe"),
    ("int4", "int8", "safe"),
    ("float16", "complex32", "safe"),
    ("complex32", "complex64", "safe"),
    ("complex64", "complex32", "same_kind"),
    ("complex64", "float64", "unsafe"),
    ("float32", "int64", "unsafe"),
    ("int8", "bool", "unsafe"),
    ("bits8", "uint8", None),
    ("uint8", "bits8", None),
])
def test_where_each_cast_sits(stored, target, needed):
    assert level(stored, target) == needed


def rec(dtype: str) -> ArrayRecord:
    return ArrayRecord.from_json(
        {"path": "w", "kind": "torch", "shape": [2], "dtype": dtype, "shard_shape": [2], "chunk_shape": None}
    )


def test_only_casts_that_can_lose_values_are_checked():
    assert destination(rec("float32"), "w", torch.zeros(2), False).cast is None  # same dtype: the direct path
    assert destination(rec("float16"), "w", torch.zeros(2), False).cast is None  # safe
    assert destination(rec("float16"), "w", torch.zeros(2, dtype=torch.bfloat16), False).cast is None  # rounding only
    assert destination(rec("float32"), "w", torch.zeros(2, dtype=torch.bfloat16), False).cast is not None
    assert destination(rec("int64"), "w", np.zeros(2, np.int32), False).cast is not None


# ---- checked block by block, in global coordinates ------------------------------------


def test_check_runs_block_by_block_with_global_indices(ckdir, small_chunks, monkeypatch):
    monkeypatch.setattr(casting_mod, "BLOCK", 7)
    w = np.zeros((64, 40), np.float32)
    w[50, 33] = w[50, 35] = w[63, 0] = 7e4
    tsckpt.save(ckdir, {"w": w})
    assert len(tsckpt.open(ckdir).checkpoint.arrays["w"].chunking.shard_shape) == 2
    with pytest.raises(tsckpt.LossyCastError, match=r"70000.0 at index \[50, 33\]"):
        restore_one(ckdir, "w", torch.zeros(64, 40, dtype=torch.float16))
    out, caught = lost_warnings(lambda: restore_one(ckdir, "w", torch.zeros(64, 40, dtype=torch.float16), casting="unsafe"))
    assert int(out.isinf().sum()) == 3
    assert caught == [
        "'w': casting=\"unsafe\" changed 3 of the 2560 stored float32 values read into the float16 target; the "
        "first, 70000.0 at index [50, 33], is beyond float16's largest finite value 65504"
    ]
    region = tsckpt.ShardedArray(torch.zeros(10, 40, dtype=torch.float16), (64, 40), (48, 0))
    with pytest.raises(tsckpt.LossyCastError, match=r"70000.0 at index \[50, 33\] .* among the first \d+ read"):
        restore_one(ckdir, "w", region)


def _remove_chunks(ckdir: str, path: str) -> None:
    for root, _, files in os.walk(os.path.join(ckdir, path)):
        for f in files:
            if f != "zarr.json":
                os.remove(os.path.join(root, f))


# ---- tsckpt.torch, set_state_dict, CheckpointManager --------------------------------


def test_torch_restore_checks_the_live_dtypes(ckdir):
    model = torch.nn.Linear(2, 2).double()
    with torch.no_grad():
        model.weight[0, 1] = 1e6
    tsckpt.torch.save(ckdir, model, rng=False)
    live = torch.nn.Linear(2, 2).half()
    with pytest.raises(tsckpt.LossyCastError, match=r"^'model/weight': stored float64 values do not fit the float16 "
                       r"target: 1000000.0 at index \[0, 1\]"):
        tsckpt.torch.restore(ckdir, live, rng=False)
    _, caught = lost_warnings(lambda: tsckpt.torch.restore(ckdir, live, rng=False, casting="unsafe"))
    assert len(caught) == 1 and caught[0].startswith("'model/weight': casting=\"unsafe\" changed 1 of the 4")
    assert live.weight[0, 1].isinf() and live.bias.tolist() == model.bias.half().tolist()


def test_torch_restore_checks_resized_parameters(ckdir):
    model = torch.nn.Embedding(4, 2).double()
    with torch.no_grad():
        model.weight[1, 0] = 1e6
    tsckpt.torch.save(ckdir, model, rng=False)
    live = torch.nn.Embedding(6, 2).half()
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'model/weight': casting=\"safe\" refuses stored float64"):
        tsckpt.torch.restore(ckdir, live, rng=False, resize=["weight"], casting="safe")
    with pytest.raises(tsckpt.LossyCastError, match=r"^'model/weight': stored float64 values do not fit the float16 "
                       r"target: 1000000.0 at index \[1, 0\]"):
        tsckpt.torch.restore(ckdir, live, rng=False, resize=["weight"])
    _, caught = lost_warnings(lambda: tsckpt.torch.restore(ckdir, live, rng=False, resize=["weight"], casting="unsafe"))
    assert len(caught) == 1 and caught[0].startswith("'model/weight': casting=\"unsafe\" changed 1 of the 8")
    assert live.weight[1, 0].isinf()


def test_set_state_dict_checks_casts(ckdir):
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.bias[0] = 2.0**24 + 1
    state = tsckpt.torch.get_state_dict(model)
    state["model"]["bias"] = state["model"]["bias"].double()
    live = torch.nn.Linear(2, 1)
    with pytest.raises(tsckpt.LeafTypeError, match=r"^'model/bias': casting=\"safe\" refuses stored float64"):
        tsckpt.torch.set_state_dict(live, None, state, casting="safe")
    state["model"]["bias"] = torch.tensor([1e300], dtype=torch.float64)
    with pytest.raises(tsckpt.LossyCastError, match=r"^'model/bias': stored float64 values do not fit the float32 target: "
                       r"1e\+300 at index \[0\]"):
        tsckpt.torch.set_state_dict(live, None, state)


def test_manager_restore_takes_casting(tmp_path):
    manager = tsckpt.CheckpointManager(str(tmp_path / "run"))
    manager.save(1, {"w": np.array([1e6], np.float32)})
    with pytest.raises(tsckpt.LossyCastError, match="^'w': stored float32 values do not fit the float16 target"):
        manager.restore(target={"w": np.zeros(1, np.float16)})
    _, caught = lost_warnings(lambda: manager.restore(target={"w": np.zeros(1, np.float16)}, casting="unsafe"))
    assert len(caught) == 1


# ---- DTensor targets, 2 ranks -----------------------------------------------------------


def _restore_dtensors_cast(rank: int, world: int, directory: str) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def target() -> object:
        return distribute_tensor(torch.zeros(8, dtype=torch.float16), mesh, [Shard(0)])

    out: dict[str, object] = {}
    fine = tsckpt.restore(directory, {"ok": target()}, strict=False)["ok"]
    out["ok"] = fine.to_local().tolist()
    try:
        tsckpt.restore(directory, {"big": target()}, strict=False)
    except tsckpt.TsckptError as e:
        out["error"] = (type(e).__name__, str(e))
    _, out["warnings"] = lost_warnings(lambda: tsckpt.restore(directory, {"big": target()}, strict=False, casting="unsafe"))
    return out


@pytest.mark.slow
def test_dtensor_targets_follow_the_policy(ckdir):
    big = np.arange(8, dtype=np.float32)
    big[6] = 1e5
    tsckpt.save(ckdir, {"ok": np.arange(8, dtype=np.float32) + 0.1, "big": big})
    r0, r1 = run_ranks(_restore_dtensors_cast, 2, ckdir, timeout=120)
    halves = np.split((np.arange(8, dtype=np.float32) + 0.1).astype(np.float16).astype(np.float64), 2)
    assert r0["ok"] == halves[0].tolist() and r1["ok"] == halves[1].tolist()
    assert r1["error"] == ("LossyCastError", (
        "'big': stored float32 values do not fit the float16 target: 100000.0 at index [6] is beyond float16's "
        "largest finite value 65504; 1 such value among the first 4 read. Pass casting=\"unsafe\" to cast anyway, "
        "or restore into a target of the stored dtype float32"
    ))
    assert r0["error"][0] == "DistributedError" and "rank 1" in r0["error"][1]
    assert r0["warnings"] == [] and len(r1["warnings"]) == 1 and "index [6]" in r1["warnings"][0]


# ---- convert --dtype --------------------------------------------------------------------


def test_convert_dtype_checks_the_values(tmp_path, capsys):
    from tsckpt._cli import main

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    saved(src, w=np.array([1.0, 1e6], np.float32), b=np.array([1.1], np.float32))
    with pytest.raises(tsckpt.LossyCastError) as ei:
        tsckpt.convert(src, dst, dtype="float16")
    assert str(ei.value) == (
        "'w': stored float32 values do not fit the float16 target: 1000000.0 at index [1] is beyond float16's largest "
        "finite value 65504; 1 such value among the first 2 read. Pass casting=\"unsafe\" (--casting unsafe) to cast "
        "anyway, or convert without a dtype; the partial checkpoint was removed, so saving again needs no overwrite=True"
    )
    assert not os.path.exists(dst)  # the partial output is removed
    assert main(["convert", src, dst, "--dtype", "float16"]) == 1
    assert "error: 'w': stored float32 values do not fit the float16 target" in capsys.readouterr().err
    _, caught = lost_warnings(lambda: main(["convert", src, dst, "--dtype", "float16", "--casting", "unsafe"]))
    assert caught == [
        "'w': casting=\"unsafe\" changed 1 of the 2 stored float32 values read into the float16 target; the first, "
        "1000000.0 at index [1], is beyond float16's largest finite value 65504"
    ]
    assert tsckpt.open(dst)["w"][...].tolist() == [1.0, float("inf")]
    assert tsckpt.open(dst)["b"][...].tolist() == [float(np.float16(1.1))]


def test_the_shortcut_for_the_stored_dtype_itself_agrees_with_the_full_check(monkeypatch):
    """check_cast answers a target of the stored dtype itself at once (no cast, nothing to
    check): the full check, run without the shortcut, says the same for every dtype torch has
    and every casting."""
    same = dict(_dtypes.torch_dtypes())
    assert {"float32", "bfloat16", "complex32", "float8_e4m3fn", "bool"} <= same.keys()
    monkeypatch.setattr(casting_mod, "_is_stored_dtype", lambda target, stored: False)
    for name, dtype in same.items():
        for casting in casting_mod.CASTINGS:
            assert casting_mod.check_cast("w", name, dtype, casting=casting) is None, (name, casting)
    assert casting_mod.check_cast("w", "float64", torch.float32, casting="same_kind") is not None
