"""restore() with targets: casts, numpy, ArraySpec, inplace, strictness, shapes."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import tsckpt


@pytest.fixture
def saved(ckdir):
    tree = {
        "w": torch.arange(20, dtype=torch.float32).reshape(4, 5) / 3,
        "c": torch.tensor([1 + 2j, -3.5 + 0.25j], dtype=torch.complex64),
        "n": np.arange(6.0).reshape(2, 3),
        "i": torch.arange(-3, 3, dtype=torch.int64),
        "step": 7,
        "sc": np.int32(5),
    }
    tsckpt.save(ckdir, tree)
    return ckdir, tree


def like(tree, **changes):
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v) for k, v in tree.items()}
    out.update(changes)
    return out


def test_restore_casts_to_target_dtypes(saved, dirty_empty):
    d, tree = saved
    target = like(
        tree,
        w=torch.empty(4, 5, dtype=torch.bfloat16),
        c=torch.empty(2, dtype=torch.complex128),
        n=np.empty((2, 3), np.float32),
        i=torch.empty(6, dtype=torch.int8),
        sc=np.int64(0),
    )
    back = tsckpt.restore(d, target)
    assert back["w"].dtype == torch.bfloat16
    assert torch.equal(back["w"], tree["w"].to(torch.bfloat16))  # same rounding as torch's own cast
    assert back["c"].dtype == torch.complex128 and torch.equal(back["c"], tree["c"].to(torch.complex128))
    assert back["n"].dtype == np.float32 and np.array_equal(back["n"], tree["n"].astype(np.float32))
    assert back["i"].dtype == torch.int8 and back["i"].tolist() == [-3, -2, -1, 0, 1, 2]
    assert type(back["sc"]) is np.int64 and back["sc"] == 5
    assert back["step"] == 7


def test_restore_into_numpy_ml_dtypes(saved):
    d, tree = saved
    back = tsckpt.restore(d, like(tree, w=np.empty((4, 5), ml_dtypes.bfloat16)))
    assert back["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["w"].view(np.uint16), tree["w"].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_restore_does_not_touch_target_without_inplace(saved):
    d, tree = saved
    target = like(tree, w=torch.zeros(4, 5), n=np.zeros((2, 3)))
    back = tsckpt.restore(d, target)
    assert back["w"] is not target["w"] and torch.count_nonzero(target["w"]) == 0
    assert back["n"] is not target["n"] and not target["n"].any()
    assert torch.equal(back["w"], tree["w"])


def test_array_spec_targets(saved, dirty_empty):
    d, tree = saved
    back = tsckpt.restore(
        d,
        like(
            tree,
            w=tsckpt.ArraySpec((4, 5), torch.float64),
            n=tsckpt.ArraySpec((2, 3), np.float16),
            i=tsckpt.ArraySpec(None, None),  # any shape, stored dtype, numpy
            c=tsckpt.ArraySpec(None, np.complex64),
        ),
    )
    assert isinstance(back["w"], torch.Tensor) and back["w"].dtype == torch.float64 and back["w"].device.type == "cpu"
    assert torch.equal(back["w"], tree["w"].double())
    assert isinstance(back["n"], np.ndarray) and back["n"].dtype == np.float16
    np.testing.assert_array_equal(back["n"], tree["n"].astype(np.float16))
    assert isinstance(back["i"], np.ndarray) and back["i"].dtype == np.int64 and back["i"].tolist() == [-3, -2, -1, 0, 1, 2]
    np.testing.assert_array_equal(back["c"], tree["c"].numpy())


def test_array_spec_shape_mismatch(saved):
    d, tree = saved
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"'w': target shape \[5, 4\] but the checkpoint stores \[4, 5\]"):
        tsckpt.restore(d, like(tree, w=tsckpt.ArraySpec((5, 4), torch.float32)))


def test_inplace_writes_into_the_same_storage(saved):
    d, tree = saved
    w = torch.zeros(4, 5)
    w16 = torch.zeros(6, dtype=torch.int16)
    n = np.zeros((2, 3))
    ptrs = (w.data_ptr(), w16.data_ptr(), n.ctypes.data)
    back = tsckpt.restore(d, like(tree, w=w, i=w16, n=n), inplace=True)
    assert back["w"] is w and back["i"] is w16 and back["n"] is n
    assert (w.data_ptr(), w16.data_ptr(), n.ctypes.data) == ptrs
    assert torch.equal(w, tree["w"])
    assert w16.tolist() == [-3, -2, -1, 0, 1, 2]  # cast in place
    np.testing.assert_array_equal(n, tree["n"])


def test_inplace_into_a_non_contiguous_view(saved):
    d, tree = saved
    base = torch.zeros(5, 4)
    view = base.t()  # (4, 5), non-contiguous
    tsckpt.restore(d, like(tree, w=view), inplace=True)
    assert torch.equal(base, tree["w"].t())


def test_inplace_into_parameters_that_require_grad(ckdir):
    src = torch.nn.Linear(3, 2)
    tsckpt.save(ckdir, {"model": dict(src.named_parameters())})
    dst = torch.nn.Linear(3, 2)
    params = dict(dst.named_parameters())
    ptr = dst.weight.data_ptr()
    back = tsckpt.restore(ckdir, {"model": params}, inplace=True)
    assert back["model"]["weight"] is dst.weight and dst.weight.data_ptr() == ptr
    assert dst.weight.requires_grad
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


def test_read_only_numpy_target_is_refused_inplace(saved):
    d, tree = saved
    n = np.zeros((2, 3))
    n.flags.writeable = False
    with pytest.raises(tsckpt.LeafTypeError, match=r"'n': target numpy array is read-only"):
        tsckpt.restore(d, like(tree, n=n), inplace=True)


def test_strict_mismatch_lists_missing_and_unexpected_paths(saved):
    d, tree = saved
    target = like(tree, extra=torch.zeros(1), more={"x": 1})
    del target["w"], target["c"]
    with pytest.raises(tsckpt.StructureMismatchError) as ei:
        tsckpt.restore(d, target)
    msg = str(ei.value)
    assert "target tree and checkpoint differ" in msg
    assert "missing from the checkpoint: 2 ('extra', 'more/x')" in msg
    assert "in the checkpoint but not in the target: 2 ('c', 'w')" in msg
    assert "Pass strict=False" in msg
    assert isinstance(ei.value, KeyError)
    assert not msg.startswith('"')  # plain message, not KeyError's repr


def test_strict_mismatch_message_is_truncated_for_many_paths(ckdir):
    tsckpt.save(ckdir, {f"k{i}": i for i in range(9)})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"in the checkpoint but not in the target: 9 \('k0', 'k1', 'k2', 'k3', 'k4', \.\.\.\)"):
        tsckpt.restore(ckdir, {})


def test_non_strict_restores_the_intersection_and_warns(saved):
    d, tree = saved
    keep = torch.full((3,), 9.0)
    target = {"w": torch.zeros(4, 5), "extra": keep}
    with pytest.warns(tsckpt.RestoreWarning) as rec:
        back = tsckpt.restore(d, target, strict=False)
    assert torch.equal(back["w"], tree["w"])
    assert back["extra"] is keep and keep.tolist() == [9.0, 9.0, 9.0]
    assert set(back) == {"w", "extra"}
    (w,) = rec.list
    assert "missing from the checkpoint: 1 ('extra')" in str(w.message)
    assert "in the checkpoint but not in the target: 5 ('c', 'i', 'n', 'sc', 'step')" in str(w.message)
    assert "strict=False: restored the common leaves" in str(w.message)
    assert w.filename == __file__  # points at the caller's line


def test_non_strict_without_differences_does_not_warn(saved):
    d, tree = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tsckpt.restore(d, tree, strict=False)


def test_shape_mismatch_names_path_and_both_shapes(saved):
    d, tree = saved
    with pytest.raises(tsckpt.ShapeMismatchError) as ei:
        tsckpt.restore(d, like(tree, w=torch.empty(5, 4)))
    assert str(ei.value).startswith("'w': target shape [5, 4] but the checkpoint stores [4, 5]")
    assert isinstance(ei.value, ValueError)
    with pytest.raises(tsckpt.ShapeMismatchError, match=r"'n': target shape \[6\] but the checkpoint stores \[2, 3\]"):
        tsckpt.restore(d, like(tree, n=np.empty(6)))


@pytest.mark.parametrize(
    "target, shown",
    [
        (torch.empty(2), "torch.float32"),
        (np.empty(2, np.float64), "float64"),
        (tsckpt.ArraySpec((2,), torch.float16), "torch.float16"),
        (tsckpt.ArraySpec((2,), np.float32), "float32"),
    ],
    ids=["tensor", "numpy", "spec-torch", "spec-numpy"],
)
def test_complex_to_real_cast_is_refused(saved, target, shown):
    d, tree = saved
    with pytest.raises(tsckpt.LeafTypeError) as ei:
        tsckpt.restore(d, like(tree, c=target))
    assert str(ei.value) == (
        f"'c': stored dtype complex64 is complex but the target is {shown}; casting would drop the imaginary part. "
        'Use a complex target, or casting="unsafe" to drop it'
    )


def test_real_to_complex_cast_is_allowed(saved):
    d, tree = saved
    back = tsckpt.restore(d, like(tree, w=torch.empty(4, 5, dtype=torch.complex64)))
    assert torch.equal(back["w"].real, tree["w"]) and not back["w"].imag.any()


def test_array_into_plain_value_target_and_back(saved):
    d, tree = saved
    with pytest.raises(tsckpt.LeafTypeError, match=r"'w': the checkpoint stores an array float32\[4, 5\] but the target leaf is int"):
        tsckpt.restore(d, like(tree, w=0))
    with pytest.raises(tsckpt.LeafTypeError, match=r"'step': the checkpoint stores a plain value \(int\) but the target leaf is Tensor"):
        tsckpt.restore(d, like(tree, step=torch.zeros(())))


def test_plain_number_target_of_a_shape_0_array(saved):
    """A plain number target of a stored shape-() array (a step a jitted update made a scalar)
    is a number of the target's type, its cast checked as an array's."""
    d, tree = saved
    back = tsckpt.restore(d, like(tree, sc=0))
    assert type(back["sc"]) is int and back["sc"] == 5
    back = tsckpt.restore(d, like(tree, sc=0.0))
    assert type(back["sc"]) is float and back["sc"] == 5.0
    with pytest.raises(tsckpt.LeafTypeError, match=r"'sc': casting=\"same_kind\" refuses stored int32 into the bool"):
        tsckpt.restore(d, like(tree, sc=False))


def test_value_leaves_take_the_stored_value(saved):
    d, tree = saved
    back = tsckpt.restore(d, like(tree, step="placeholder"))
    assert back["step"] == 7
    # None is an empty subtree, not a leaf: the stored value is then unexpected
    with pytest.raises(tsckpt.StructureMismatchError, match=r"in the checkpoint but not in the target: 1 \('step'\)"):
        tsckpt.restore(d, like(tree, step=None))


def test_restore_target_structure_decides_the_result_type(saved):
    d, tree = saved
    order = ["step", "w", "c", "n", "i", "sc"]
    back = tsckpt.restore(d, {k: tree[k] for k in order})
    assert list(back) == order


def test_reversed_numpy_target(saved):
    d, tree = saved
    back = tsckpt.restore(d, like(tree, n=np.zeros((2, 3))[::-1]))  # a new array
    np.testing.assert_array_equal(back["n"], tree["n"])
    base = np.zeros((2, 3))
    rev = base[::-1, ::-1]  # negative strides: torch cannot alias this memory, numpy can
    back = tsckpt.restore(d, like(tree, n=rev), inplace=True)
    assert back["n"] is rev
    np.testing.assert_array_equal(rev, tree["n"])
    np.testing.assert_array_equal(base, tree["n"][::-1, ::-1])


@pytest.mark.parametrize("window", [1, 4096, 64 << 20])
def test_read_window_is_an_option_and_changes_no_value(ckdir, small_chunks, dirty_empty, window, monkeypatch):
    import tsckpt._read.restore as restore_mod

    tree = {"w": torch.randn(64, 32), "b": np.arange(100, dtype=np.int16), "c": torch.randn(8).to(torch.bfloat16)}
    tsckpt.save(ckdir, tree)
    waits: list[int] = []  # reads outstanding when the executor waits for the oldest
    real = restore_mod.read_into

    def counting(ck, dests, progress=None, *, window):
        drained = progress.update

        def update(nbytes, files=0):
            waits.append(nbytes)
            drained(nbytes, files)

        progress.update = update
        return real(ck, dests, progress, window=window)

    monkeypatch.setattr(restore_mod, "read_into", counting)
    target = {"w": torch.empty(64, 32), "b": np.empty(100, np.int16), "c": torch.empty(8, dtype=torch.bfloat16)}
    out = tsckpt.restore(ckdir, target, inplace=True, max_inflight_bytes=window)
    assert torch.equal(out["w"], tree["w"]) and np.array_equal(out["b"], tree["b"]) and torch.equal(out["c"], tree["c"])
    assert sum(waits) == 64 * 32 * 4 + 100 * 2 + 8 * 2
    assert len(waits) == 2 + 1 + 1  # w in two 4 KiB shards: one read per shard file, whatever the window


def test_small_arrays_are_read_without_a_tensorstore_array(ckdir, small_chunks, monkeypatch, layout):
    """One plain chunk each: decoded by tsckpt (node checked, crc32c checked); the rest
    (but sharded arrays of the plain layout), and any target needing a cast, go through TensorStore."""
    import tsckpt._read.restore as restore_mod

    tree = {
        "big": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32),  # sharded: several files
        "small": np.arange(10, dtype=np.int64),
        "bf": torch.linspace(-1, 1, 7).to(torch.bfloat16),
        "flag": np.array(True),
        "cast": torch.arange(6, dtype=torch.float32),
    }
    tsckpt.save(ckdir, tree, layout=layout)
    opened: list[str] = []
    real = tsckpt._read.engine._open_all
    monkeypatch.setattr(tsckpt._read.engine, "_open_all", lambda ck, paths: (opened.extend(paths), real(ck, paths))[1])
    target = {
        "big": torch.zeros(64, 32), "small": np.zeros(10, np.int64), "bf": torch.zeros(7, dtype=torch.bfloat16),
        "flag": np.array(False), "cast": torch.zeros(6, dtype=torch.float64),
    }
    out = tsckpt.restore(ckdir, target, inplace=True)
    # a sharded array of a local plain checkpoint is read by tsckpt too (tests/test_shardread.py)
    assert sorted(opened) == (["cast"] if layout == "plain" else ["big", "cast"])
    assert torch.equal(out["big"], tree["big"]) and np.array_equal(out["small"], tree["small"])
    assert torch.equal(out["bf"], tree["bf"]) and out["flag"] == np.array(True)
    assert torch.equal(out["cast"], tree["cast"].double())


def test_the_collector_is_paused_during_a_restore_and_its_setting_restored(tmp_path, monkeypatch):
    import gc

    from tsckpt._read import restore as _restore

    tsckpt.save(tmp_path / "c", {"a": torch.arange(4.0)})
    seen: list[bool] = []
    real = _restore.open_checkpoint

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(_restore, "open_checkpoint", spy)
    assert gc.isenabled()
    assert torch.equal(tsckpt.restore(tmp_path / "c", {"a": torch.empty(4)})["a"], torch.arange(4.0))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(tsckpt.StructureMismatchError):  # a failed restore re-enables it too
        tsckpt.restore(tmp_path / "c", {"b": torch.empty(4)})
    assert gc.isenabled()
    gc.disable()
    try:  # a caller who disabled it keeps it disabled
        tsckpt.restore(tmp_path / "c", {"a": torch.empty(4)})
        assert not gc.isenabled()
    finally:
        gc.enable()
