"""tsckpt.diff and `tsckpt diff`: leaves only in one side, changed dtypes and shapes, changed
arrays by chunk, tolerance, path filters, JSON, other formats, and reads within the window."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import tsckpt
from tsckpt._base.types import box_slices
from tsckpt._cli import main
from tsckpt._read import diff as diff_module
from tsckpt._read.diff import Tally, blocks, compare_block, engine_serves
from tsckpt._read.reader import LazyArray


def tree() -> dict:
    return {
        "w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) / 7,
        "b": torch.linspace(-1, 1, 100),
        "i": torch.arange(50, dtype=torch.int64),
        "step": 3,
    }


def saved(tmp_path, name: str, state: dict, *, incremental: bool = False) -> str:
    """``state`` saved at ``name``; without content hashes unless ``incremental`` (with them,
    diff decides equal files without reading them: most tests here are of the reading)."""
    where = str(tmp_path / name)
    tsckpt.save(where, state, incremental=incremental)
    return where


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_identical_checkpoints_are_equal(tmp_path, capsys, small_chunks):
    a, b = saved(tmp_path, "a", tree()), saved(tmp_path, "b", tree())
    report = tsckpt.diff(a, b)
    assert report.equal and report.differences == ()
    assert [(leaf.path, leaf.status, leaf.how) for leaf in report.leaves] == [
        ("b", "equal", "read"), ("i", "equal", "read"), ("step", "equal", "value"), ("w", "equal", "read")
    ]
    assert report.bytes_read == 2 * (64 * 64 * 4 + 100 * 4 + 50 * 8)
    code, out, err = run(capsys, "diff", a, b)
    assert (code, err) == (0, "")
    assert out.startswith(f"equal: {a} and {b}, 4 leaves")


def test_one_changed_element(tmp_path, small_chunks):
    before = tree()
    after = tree()
    after["w"] = before["w"].clone()
    after["w"][37, 5] += 3.0
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    report = tsckpt.diff(a, b)
    assert not report.equal
    (leaf,) = report.differences
    md = tsckpt.open(a)["w"].metadata
    assert md.chunk_shape != md.shape  # several chunks, one of them changed
    assert (leaf.path, leaf.status, leaf.how) == ("w", "different", "read")
    assert leaf.chunks == math.prod(-(-n // c) for n, c in zip(md.shape, md.chunk_shape)) > 1
    assert (leaf.changed_chunks, leaf.changed_elements, leaf.first_index) == (1, 1, (37, 5))
    x, y = before["w"].double().numpy(), after["w"].double().numpy()
    assert leaf.max_abs == pytest.approx(np.abs(x - y).max(), rel=1e-12)
    assert leaf.rel_l2 == pytest.approx(np.linalg.norm(x - y) / np.linalg.norm(x), rel=1e-6)


def test_first_index_is_the_first_in_c_order(tmp_path, small_chunks):
    after = tree()
    after["w"] = tree()["w"].clone()
    after["w"][60, 1] = -1.0  # a later shard than the next, but ...
    after["w"][2, 63] = -1.0  # ... this one comes first in C order
    leaf = tsckpt.diff(saved(tmp_path, "a", tree()), saved(tmp_path, "b", after)).differences[0]
    assert (leaf.first_index, leaf.changed_elements, leaf.changed_chunks) == ((2, 63), 2, 2)


def test_only_in_one_side_and_changed_kinds(tmp_path, capsys):
    before = {"gone": torch.ones(3), "w": torch.ones(4), "s": torch.ones(2, 3), "v": 1, "lr": 0.5}
    after = {"new": torch.ones(2), "w": torch.ones(4, dtype=torch.float16), "s": torch.ones(3, 2), "v": torch.ones(1),
             "lr": 0.25}
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    found = {leaf.path: leaf for leaf in tsckpt.diff(a, b).leaves}
    assert {p: leaf.status for p, leaf in found.items()} == {
        "gone": "only_in_a", "new": "only_in_b", "w": "dtype_changed", "s": "shape_changed", "v": "dtype_changed",
        "lr": "different",
    }
    assert (found["w"].dtype_a, found["w"].dtype_b) == ("float32", "float16")
    assert (found["s"].shape_a, found["s"].shape_b) == ((2, 3), (3, 2))
    assert (found["v"].dtype_a, found["v"].dtype_b) == ("int", "float32")
    assert (found["lr"].value_a, found["lr"].value_b) == ("0.5", "0.25")
    assert found["gone"].bytes_read == found["s"].bytes_read == 0  # nothing to compare: nothing read
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    lines = out.splitlines()
    assert "only in A  gone  float32 [3]" in lines
    assert "only in B  new  float32 [2]" in lines
    assert "dtype      w  float32 [4] -> float16 [4]" in lines
    assert "shape      s  float32 [2, 3] -> float32 [3, 2]" in lines
    assert "value      lr  0.5 -> 0.25" in lines
    assert lines[-1].startswith("different: 6 of 6 leaves differ")


def test_tolerance_makes_a_small_change_equal(tmp_path, capsys):
    before = {"w": torch.full((8,), 100.0, dtype=torch.float64)}
    after = {"w": before["w"].clone()}
    after["w"][3] += 0.01
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    assert not tsckpt.diff(a, b).equal
    assert not tsckpt.diff(a, b, atol=0.009).equal
    assert tsckpt.diff(a, b, atol=0.011).equal
    assert tsckpt.diff(a, b, rtol=1.1e-4).equal  # relative to |b| = 100.01
    leaf = tsckpt.diff(a, b, atol=0.011).leaves[0]
    assert (leaf.status, leaf.changed_elements, leaf.changed_chunks) == ("equal", 0, 0)
    assert leaf.max_abs == pytest.approx(0.01)  # still said, though within the tolerance
    assert run(capsys, "diff", a, b, "--atol", "0.011")[0] == 0
    assert run(capsys, "diff", a, b, "--rtol", "1e-5")[0] == 1


def test_path_filter_spellings_as_ls_takes_them(tmp_path, capsys):
    """``/`` and ``.`` alike, a leaf path selecting the leaves below it, as ls takes them."""
    before = {"model": {"w": np.zeros(3), "layers": [{"b": np.zeros(2)}, {"b": np.zeros(2)}]}, "opt": np.zeros(1)}
    after = {"model": {"w": np.ones(3), "layers": [{"b": np.zeros(2)}, {"b": np.ones(2)}]}, "opt": np.ones(1)}
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    for spelling in ("model/*", "model.*", "model", "model/", ["model.layers.*.b", "model.w"]):
        report = tsckpt.diff(a, b, paths=spelling)
        assert [leaf.path for leaf in report.leaves] == ["model/layers/0/b", "model/layers/1/b", "model/w"], spelling
    assert [leaf.path for leaf in tsckpt.diff(a, b, paths="model.layers.1").leaves] == ["model/layers/1/b"]
    code, out, _ = run(capsys, "diff", a, b, "--paths", "model.*")
    assert code == 1 and out.splitlines()[-1].startswith("different: 2 of 3 leaves differ")


def test_paths_that_select_no_leaf_are_an_error(tmp_path, capsys):
    before, after = {"model": {"w": np.zeros(3)}, "step": 1}, {"model": {"w": np.ones(3)}, "step": 1}
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    message = (
        f"paths 'modle/*' select no leaf of {a} or {b}; a leaf path has '/' or '.' between its parts, as "
        f"`tsckpt ls` lists them (here 'model/w', 'step'), and a glob selects the leaves it matches and those "
        f"below (e.g. 'model/*' or 'model'); did you mean 'model/w' or 'model'?"
    )
    with pytest.raises(tsckpt.StructureMismatchError) as raised:
        tsckpt.diff(a, b, paths="modle/*")
    assert isinstance(raised.value, KeyError) and str(raised.value) == message
    with pytest.raises(tsckpt.StructureMismatchError, match=r"^paths 'nothing' select no leaf"):
        tsckpt.diff(a, b, paths=["model/*", "nothing"])  # one of several: still a mistake
    code, out, err = run(capsys, "diff", a, b, "--paths", "modle/*")
    assert (code, out, err) == (2, "", f"tsckpt diff: error: {message}\n")
    code, out, err = run(capsys, "diff", a, b, "--paths", "model/*", "stpe", "--json")
    assert (code, out) == (2, "") and err.startswith("tsckpt diff: error: paths 'stpe' select no leaf of ")
    assert err.rstrip().endswith("did you mean 'step'?")


def test_path_filter(tmp_path, capsys):
    before = {"model": {"w": torch.ones(3), "b": torch.ones(2)}, "opt": {"m": torch.ones(3)}, "step": 1}
    after = {"model": {"w": torch.ones(3), "b": torch.ones(2)}, "opt": {"m": torch.zeros(3)}, "step": 2}
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    report = tsckpt.diff(a, b, paths=["model/*"])
    assert report.equal and [leaf.path for leaf in report.leaves] == ["model/b", "model/w"]
    assert [leaf.path for leaf in tsckpt.diff(a, b, paths="opt/*").differences] == ["opt/m"]
    assert run(capsys, "diff", a, b, "--paths", "model/*")[0] == 0
    assert run(capsys, "diff", a, b, "--paths", "model/*", "step")[0] == 1


def test_json_output(tmp_path, capsys):
    after = {"w": torch.tensor([1.0, float("nan"), 3.0]), "x": torch.ones(2)}
    a = saved(tmp_path, "a", {"w": torch.tensor([1.0, 2.0, 3.0]), "y": torch.ones(1)})
    b = saved(tmp_path, "b", after)
    code, out, err = run(capsys, "diff", a, b, "--json")
    assert (code, err) == (1, "")
    report = json.loads(out)
    assert (report["equal"], report["a"], report["b"], report["atol"]) == (False, a, b, 0.0)
    leaves = {leaf["path"]: leaf for leaf in report["leaves"]}
    assert {p: leaf["status"] for p, leaf in leaves.items()} == {"w": "different", "y": "only_in_a", "x": "only_in_b"}
    w = leaves["w"]
    assert (w["first_index"], w["changed_elements"], w["max_abs"], w["rel_l2"]) == ([1], 1, "inf", "inf")
    assert w["shape_a"] == [3]


def test_nans_at_the_same_index_are_equal(tmp_path):
    state = {"w": torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")])}
    a = saved(tmp_path, "a", state)
    assert tsckpt.diff(a, saved(tmp_path, "b", state)).equal
    flipped = saved(tmp_path, "c", {"w": torch.tensor([float("nan"), 1.0, -float("inf"), 0.0])})
    leaf = tsckpt.diff(a, flipped, rtol=1.0).leaves[0]  # no tolerance brings an infinity nearer
    assert (leaf.changed_elements, leaf.first_index, leaf.max_abs) == (2, (2,), math.inf)


def test_integers_are_compared_exactly(tmp_path):
    big = 2**60
    a = saved(tmp_path, "a", {"i": torch.tensor([big, 1])})
    b = saved(tmp_path, "b", {"i": torch.tensor([big + 1, 1])})  # the same float64
    leaf = tsckpt.diff(a, b).leaves[0]
    assert (leaf.status, leaf.first_index, leaf.changed_elements) == ("different", (0,), 1)


def one_leaf(tmp_path, x, y, **options):
    """The diff of ``{"x": x}`` against ``{"x": y}``, and where both are saved."""
    a, b = saved(tmp_path, "a", {"x": x}), saved(tmp_path, "b", {"x": y})
    return tsckpt.diff(a, b, **options).leaves[0], a, b


def test_int64_beyond_2_53_are_compared_exactly(tmp_path, capsys):
    """2**62 and 2**62 + 3 are one float64: the difference is taken as stored, exactly, the
    tolerance compared with it exactly, and the largest said as an exact int."""
    x, y = np.array([2**62, 5], np.int64), np.array([2**62 + 3, 5], np.int64)
    leaf, a, b = one_leaf(tmp_path, x, y)
    assert (leaf.status, leaf.max_abs, type(leaf.max_abs), leaf.changed_elements) == ("different", 3, int, 1)
    assert tsckpt.diff(a, b, atol=2).leaves[0].status == "different"  # 3 > 2
    assert tsckpt.diff(a, b, atol=2.999).leaves[0].status == "different"
    assert tsckpt.diff(a, b, atol=3).equal
    assert tsckpt.diff(a, b, rtol=2.0**-61).leaves[0].status == "different"  # |b| * rtol = 2
    assert tsckpt.diff(a, b, rtol=2.0**-60).equal  # 4
    code, out, _ = run(capsys, "diff", a, b, "--atol", "2")
    assert code == 1
    assert "changed    x  1 of 1 chunk, 1 element; max |a-b| 3, rel L2 6.51e-19, first at [0]" in out.splitlines()
    code, out, _ = run(capsys, "diff", a, b, "--json")
    assert code == 1 and '"max_abs": 3,' in out and json.loads(out)["leaves"][0]["max_abs"] == 3
    assert run(capsys, "diff", a, b, "--atol", "3")[0] == 0


def test_integer_differences_next_to_2_53_and_of_uint64_extremes(tmp_path):
    big = 2**53
    leaf = one_leaf(tmp_path / "i", np.array([big + 1], np.int64), np.array([big + 2], np.int64))[0]
    assert (leaf.max_abs, type(leaf.max_abs)) == (1, int)
    top = 2**64 - 1
    leaf = one_leaf(tmp_path / "u", np.array([0, top], np.uint64), np.array([top, top - 1], np.uint64))[0]
    assert (leaf.max_abs, leaf.changed_elements, leaf.first_index) == (top, 2, (0,))
    leaf = one_leaf(tmp_path / "v", np.array([top], np.uint64), np.array([top - 1], np.uint64), atol=0.5)[0]
    assert (leaf.status, leaf.max_abs) == ("different", 1)


@pytest.mark.parametrize("dtype", ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"])
def test_every_integer_dtype_from_its_least_to_its_largest(tmp_path, dtype):
    """The widest difference of each integer dtype, exact, against tolerances just below it
    (the largest whole number within it decides) and at it."""
    least, most = (0, 1) if dtype == "bool" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    span = most - least
    x, y = np.array([least, most, 1], dtype), np.array([most, least, 1], dtype)
    leaf, a, b = one_leaf(tmp_path, x, y)
    assert (leaf.max_abs, type(leaf.max_abs), leaf.changed_elements) == (span, int, 2)
    assert tsckpt.diff(a, b, atol=float(span // 2)).leaves[0].changed_elements == 2
    if span < 2**53:
        assert tsckpt.diff(a, b, atol=span - 0.5).leaves[0].changed_elements == 2  # the whole 2**k - 1 is beyond
    assert tsckpt.diff(a, b, atol=float(span)).equal
    assert tsckpt.diff(a, a).leaves[0].max_abs == 0 and type(tsckpt.diff(a, a).leaves[0].max_abs) is int


def test_int4_is_compared_as_an_integer(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, y = np.array([-8, 7, 1], ml_dtypes.int4), np.array([7, -8, 1], ml_dtypes.int4)
    leaf, a, b = one_leaf(tmp_path, x, y)
    assert (leaf.dtype_a, leaf.max_abs, type(leaf.max_abs), leaf.changed_elements) == ("int4", 15, int, 2)
    assert not tsckpt.diff(a, b, atol=14.9).equal and tsckpt.diff(a, b, atol=15).equal


@pytest.mark.parametrize("tolerance", [{}, {"atol": 1e-300}])
def test_relative_l2_of_float64_beyond_the_squares_of_float64(tmp_path, tolerance):
    """Squares beyond float64 (values above 1e154, or below 1e-154) are summed scaled: finite
    values give the finite relative L2 ``||a - b|| / ||a||``, compared as stored or widened."""
    cases = [
        (np.full(4, 2e200), np.full(4, 1e200), 0.5, 1e200),
        (np.full(4, 1e200), np.full(4, 2e200), 1.0, 1e200),
        (np.full(4, 2e-200), np.full(4, 1e-200), 0.5, 1e-200),
        (np.array([3e200, 4e200]), np.array([0.0, 4e200]), 0.6, 3e200),
        (np.array([1.7e308, 1.0]), np.array([-1.7e308, 1.0]), 2.0, math.inf),  # |a - b| beyond float64
    ]
    for k, (x, y, rel, largest) in enumerate(cases):
        leaf = one_leaf(tmp_path / str(k), x, y, **tolerance)[0]
        assert leaf.status == "different" and leaf.max_abs == largest, k
        assert leaf.rel_l2 == pytest.approx(rel, rel=1e-12), k
    x = np.full(4, 1e200)
    y = x * (1 + np.array([0, 0, 0, 1e-10]))
    leaf = one_leaf(tmp_path / "t", x, y)[0]
    assert leaf.rel_l2 == pytest.approx(float(y[3] - x[3]) / 2e200, rel=1e-12)


def test_sums_of_squares_of_every_scale_add_up():
    """Pieces summed plainly and scaled, of any sizes, add into one finite sum: ``||a||`` of
    values whose squares overflow one by one, many pieces at once."""
    a = np.concatenate([np.full(1000, 1.3e154), np.full(24, 1e-170), [3.0]])
    b = np.concatenate([a[:1000] / 2, a[1000:]])
    for piece in (1, 10, 1 << 16):
        tally = Tally()
        compare_block(a, b, "float64", ((0,), (a.size,)), (100,), tally, atol=0.0, rtol=0.0, piece=piece)
        assert diff_module._relative(tally.squares_diff, tally.squares_a) == pytest.approx(0.5, rel=1e-12)
        assert (tally.sq_a, tally.changed_elements) == (math.inf, 1000)  # as one float64: beyond it
    many = diff_module.Squares(0.0)
    for _ in range(5000):
        many = many.plus(diff_module.Squares(1e308))
    assert math.sqrt(many.ssq) * many.scale == pytest.approx(math.sqrt(5000) * 1e154, rel=1e-12)


def test_bfloat16_and_complex(tmp_path):
    before = {"h": torch.ones(4, dtype=torch.bfloat16), "c": torch.tensor([1 + 1j, 2 + 0j])}
    after = {"h": torch.tensor([1, 1, 1.5, 1], dtype=torch.bfloat16), "c": torch.tensor([1 + 1j, 2 + 4j])}
    found = {leaf.path: leaf for leaf in tsckpt.diff(saved(tmp_path, "a", before), saved(tmp_path, "b", after)).leaves}
    assert (found["h"].first_index, found["h"].max_abs) == ((2,), 0.5)
    assert (found["c"].first_index, found["c"].max_abs) == ((1,), 4.0)  # |a - b|, the modulus


def test_a_checkpoint_against_safetensors_with_the_same_tensors(tmp_path, capsys):
    state = {"model.w": torch.randn(16, 8), "model.b": torch.randn(8).to(torch.bfloat16)}
    a = saved(tmp_path, "a", state)
    other = str(tmp_path / "m.safetensors")
    save_file(state, other)
    report = tsckpt.diff(a, other)
    assert report.equal and sorted(leaf.path for leaf in report.leaves) == ["model.b", "model.w"]
    assert run(capsys, "diff", other, a)[0] == 0
    save_file({**state, "model.w": state["model.w"] + 1}, other)
    assert [leaf.path for leaf in tsckpt.diff(a, other).differences] == ["model.w"]


def test_errors_exit_2(tmp_path, capsys):
    a = saved(tmp_path, "a", {"w": torch.ones(2)})
    code, out, err = run(capsys, "diff", a, str(tmp_path / "missing"))
    assert (code, out) == (2, "")
    assert err.startswith("tsckpt diff: error: ") and "missing" in err
    assert run(capsys, "diff", a, a, "--atol", "-1")[0] == 2
    with pytest.raises(ValueError, match="atol must be a finite number at least 0"):
        tsckpt.diff(a, a, atol=-1.0)
    with pytest.raises(TypeError, match="paths must be glob patterns"):
        tsckpt.diff(a, a, paths=[3])  # type: ignore[list-item]


@pytest.fixture
def largest_read(monkeypatch):
    """Every block diff reads of either side (as stored chunks, by the engine or the lazy
    reader), in bytes of the stored dtype; windows below diff's least taken as given (the
    blocks' mechanics, tested at small sizes)."""
    sizes: list[int] = []
    real = diff_module._reader
    monkeypatch.setattr(diff_module, "LEAST_WINDOW", 1)

    def reader(ck, leaf, window, stored=None):
        read = real(ck, leaf, window, stored)

        def recording(block):
            data = read(block)
            sizes.append(data.nbytes)
            return data

        return recording

    monkeypatch.setattr(diff_module, "_reader", reader)
    return sizes


def test_reads_block_by_block_within_the_window(tmp_path, largest_read, capsys):
    before = {"w": torch.randn(256, 128), "v": torch.randn(3000)}  # 128 KiB, 12 KiB
    after = {"w": before["w"].clone(), "v": before["v"].clone()}
    after["w"][200, 100] = 9.0
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    window = 8 << 10
    report = tsckpt.diff(a, b, max_inflight_bytes=window)
    assert max(largest_read) <= window // 2 // 2  # each side's block: a quarter of the window
    assert len(largest_read) >= 2 * (128 + 12) * 1024 // (window // 4)
    assert sum(largest_read) == report.bytes_read == 2 * (256 * 128 + 3000) * 4
    (leaf,) = report.differences
    assert (leaf.path, leaf.first_index, leaf.changed_elements) == ("w", (200, 100), 1)
    largest_read.clear()
    assert run(capsys, "diff", a, b, "--max-inflight-bytes", "8KiB")[0] == 1
    assert 0 < max(largest_read) <= window // 4


def test_a_window_smaller_than_one_row(tmp_path, largest_read):
    before = {"w": torch.randn(4, 1000)}
    after = {"w": before["w"].clone()}
    after["w"][3, 999] = 5.0
    report = tsckpt.diff(saved(tmp_path, "a", before), saved(tmp_path, "b", after), max_inflight_bytes=1000)
    assert max(largest_read) <= 1000 // 4 and sum(largest_read) == 2 * 4 * 1000 * 4
    assert report.differences[0].first_index == (3, 999)


def _shared_files(directory: str) -> int:
    """How many files of ``directory`` are hard links shared with another checkpoint."""
    return sum(os.stat(os.path.join(root, f)).st_nlink > 1 for root, _, files in os.walk(directory) for f in files)


def test_hard_linked_shards_are_not_read(tmp_path, small_chunks, largest_read):
    before = tree()
    after = tree()
    after["w"] = before["w"].clone()
    after["w"][0, 0] = 5.0
    a = saved(tmp_path, "a", before, incremental=True)
    b = str(tmp_path / "b")
    tsckpt.save(b, after, base=a)  # an incremental save: the unchanged files are hard links to a's
    assert _shared_files(b) > 4
    report = tsckpt.diff(a, b)
    md = tsckpt.open(a)["w"].metadata
    chunk = math.prod(md.chunk_shape) * 4  # of the changed shard, only its changed inner chunk is read
    assert math.prod(md.shard_shape) > math.prod(md.chunk_shape)
    assert report.bytes_read == sum(largest_read) == 2 * chunk  # from both sides
    assert report.bytes_known_equal == (64 * 64 * 4 - chunk) + 100 * 4 + 50 * 8
    found = {leaf.path: leaf for leaf in report.leaves}
    assert (found["b"].how, found["i"].how, found["w"].how) == ("same files", "same files", "read")
    assert (found["w"].changed_chunks, found["w"].first_index) == (1, (0, 0))
    x, y = before["w"].double().numpy(), after["w"].double().numpy()
    read = box_slices((0, 0), md.chunk_shape)  # the changed chunk: the first
    assert found["w"].rel_l2 == pytest.approx(np.linalg.norm(x - y) / np.linalg.norm(x[read]), rel=1e-6)
    assert found["w"].rel_l2 > np.linalg.norm(x - y) / np.linalg.norm(x)  # over what was read: an upper bound


def test_recorded_content_hashes_decide_equal_files_unread(tmp_path, small_chunks, largest_read):
    before, after = tree(), tree()
    after["w"] = before["w"].clone()
    after["w"][0, 0] = 5.0
    a = saved(tmp_path, "a", before, incremental=True)
    b = saved(tmp_path, "b", after, incremental=True)  # no base: no file shared, only hashes recorded
    assert _shared_files(b) == 0
    report = tsckpt.diff(a, b)
    chunk = math.prod(tsckpt.open(a)["w"].metadata.chunk_shape) * 4
    assert report.bytes_read == sum(largest_read) == 2 * chunk  # the changed inner chunk, from both sides
    assert report.bytes_known_equal == (64 * 64 * 4 - chunk) + 100 * 4 + 50 * 8
    found = {leaf.path: leaf for leaf in report.leaves}
    assert (found["b"].how, found["i"].how, found["w"].how) == ("same files", "same files", "read")
    assert (found["w"].changed_chunks, found["w"].first_index, found["w"].max_abs) == (1, (0, 0), 5.0)
    largest_read.clear()
    c = saved(tmp_path, "c", after)  # no hashes on one side: everything read
    assert tsckpt.diff(a, c).bytes_read == sum(largest_read) == 2 * (64 * 64 * 4 + 100 * 4 + 50 * 8)


def test_one_checkpoint_given_twice_reads_nothing(tmp_path, largest_read):
    compact = str(tmp_path / "compact")
    tsckpt.save(compact, tree(), layout="compact")
    other = str(tmp_path / "m.safetensors")
    save_file({"w": torch.ones(3)}, other)
    for one in (compact, other):
        assert tsckpt.diff(one, one).equal and largest_read == []
    assert tsckpt.diff(compact, compact).bytes_known_equal == 64 * 64 * 4 + 100 * 4 + 50 * 8
    a = saved(tmp_path, "a", tree())
    copy = str(tmp_path / "copy")
    shutil.copytree(a, copy, copy_function=os.link)
    for other in (a, copy):
        report = tsckpt.diff(a, other)
        assert report.equal and report.bytes_read == 0 and largest_read == []


@pytest.mark.parametrize(
    "region, chunk, limit",
    [(((0, 0), (64, 64)), (4, 64), 1024), (((8, 0), (8, 100)), (8, 10), 30), (((0,), (10,)), (4,), 3), (((), ()), (), 1)],
)
def test_blocks_cover_the_region_within_the_limit(region, chunk, limit):
    found = list(blocks(region, chunk, limit))
    seen = np.zeros([o + n for o, n in zip(*region)], dtype=int)
    for off, ln in found:
        assert math.prod(ln) <= limit
        if math.prod(chunk) <= limit:  # whole chunks where one fits
            ends = [o + n for o, n in zip(*region)]
            assert all(o % c == 0 and ((o + n) % c == 0 or o + n == e) for o, n, c, e in zip(off, ln, chunk, ends))
        seen[tuple(slice(o, o + n) for o, n in zip(off, ln))] += 1
    inside = seen[tuple(slice(o, o + n) for o, n in zip(*region))]
    assert (inside == 1).all() and seen.sum() == inside.sum()


def test_a_bar_of_bytes_compared(tmp_path, bars, caplog):
    before = {"w": torch.ones(64, 64), "n": 1}
    after = {"w": torch.zeros(64, 64), "n": 1}
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    with caplog.at_level("INFO", logger="tsckpt"):
        tsckpt.diff(a, b, progress=True)
        tsckpt.diff(a, a, progress=True)  # known equal: counted done, not read
    assert bars == [("diff", 2 * 64 * 64 * 4, 2 * 64 * 64 * 4)] * 2
    assert [r.getMessage().split(" ", 1)[0] for r in caplog.records if r.name == "tsckpt"] == ["diff", "diff"]
    tsckpt.diff(a, b)  # stderr is captured, not a terminal: no bar
    assert len(bars) == 2


def test_changed_chunks_count_in_a_grid(tmp_path, monkeypatch):
    from tsckpt._ondisk import chunking

    before = {"w": torch.zeros(64, 64)}
    after = {"w": torch.zeros(64, 64)}
    after["w"][:, 0] = 1.0  # a column: every row of chunks
    b = saved(tmp_path, "b", after)  # one chunk
    monkeypatch.setattr(chunking, "INNER_CHUNK_BYTES", 1024)
    monkeypatch.setattr(chunking, "SHARD_BYTES", 4096)
    a = saved(tmp_path, "a", before)  # many
    ma, mb = tsckpt.open(a)["w"].metadata, tsckpt.open(b)["w"].metadata
    assert ma.chunk_shape != mb.chunk_shape == (64, 64)
    rows = -(-64 // ma.chunk_shape[0])
    leaf = tsckpt.diff(a, b).leaves[0]
    assert (leaf.chunks, leaf.changed_chunks, leaf.changed_elements) == (
        rows * -(-64 // ma.chunk_shape[1]), rows, 64
    )
    assert tsckpt.diff(b, a).leaves[0].changed_chunks == 1  # B's single chunk, from B's side


def test_damaged_data_is_an_error(tmp_path, capsys):
    a = saved(tmp_path, "a", {"w": torch.ones(1000)})
    b = saved(tmp_path, "b", {"w": torch.ones(1000)})
    shard = os.path.join(b, "w", "c.0")
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'w'"):
        tsckpt.diff(a, b)
    code, out, err = run(capsys, "diff", a, b)
    assert (code, out) == (2, "") and "tsckpt diff: error:" in err


@settings(deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    data=st.data(),
)
def test_blocks_and_compare_agree_with_numpy(shape, data):
    """Any region, chunk grid and limit: the blocks compared one by one find what numpy finds
    on the whole array."""
    chunk = [data.draw(st.integers(1, n)) for n in shape]
    limit = data.draw(st.integers(1, 40))
    piece = data.draw(st.integers(1, 16))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    a = rng.standard_normal(shape).astype(np.float32)
    b = a.copy()
    b[rng.random(shape) < 0.2] += 1.0
    tally = Tally()
    for block in blocks(((0,) * len(shape), tuple(shape)), chunk, limit):
        box = box_slices(*block)
        compare_block(np.ascontiguousarray(a[box]), np.ascontiguousarray(b[box]), "float32", block, chunk, tally,
                      atol=0.0, rtol=0.0, piece=piece)
    diff = a != b
    assert tally.changed_elements == int(diff.sum())
    assert tally.first == (tuple(int(i) for i in np.argwhere(diff)[0]) if diff.any() else None)
    grid = {tuple(int(i) // c for i, c in zip(idx, chunk)) for idx in np.argwhere(diff)}
    assert tally.changed_chunks == grid
    assert tally.max_abs == pytest.approx(float(np.abs(a.astype(np.float64) - b).max()))


def changed_pair(tmp_path) -> tuple[str, str]:
    """Two checkpoints whose arrays differ in many ways: values, NaNs at the same and other
    indices, infinities, integers, a half-precision and a bfloat16 leaf, booleans, complex
    numbers, one leaf equal (with ``small_chunks``, most in shard files of several chunks)."""
    gen = torch.Generator().manual_seed(5)
    before = {
        "w": torch.randn(96, 40, generator=gen),
        "d": torch.randn(300, generator=gen, dtype=torch.float64),
        "h": torch.randn(1500, generator=gen).half(),
        "bf": torch.randn(1500, generator=gen).bfloat16(),
        "i": torch.arange(900, dtype=torch.int64) * (2**40),
        "flag": torch.arange(3000) % 3 == 0,
        "c": torch.randn(700, generator=gen, dtype=torch.complex64),
        "same": torch.randn(33, generator=gen),
    }
    after = {k: v.clone() for k, v in before.items()}
    after["w"][3:50, 7] += 0.5
    after["w"][60, 1] = float("nan")
    before["w"][61, 2] = after["w"][61, 2] = float("nan")
    after["d"][::7] = -after["d"][::7]
    after["d"][5] = float("inf")
    after["h"][10:20] += 1
    after["bf"][-1] = 4.0
    after["i"][17] += 1
    after["flag"][2999] = True
    after["c"][650] += 1j
    return saved(tmp_path, "a", before), saved(tmp_path, "b", after)


def same_report(x: dict, y: dict) -> None:
    """Two reports (as dicts) alike, the relative L2 to rounding (sums of squares added in
    another order where blocks are cut otherwise)."""
    assert {k: v for k, v in x.items() if k != "leaves"} == {k: v for k, v in y.items() if k != "leaves"}
    assert len(x["leaves"]) == len(y["leaves"])
    for p, q in zip(x["leaves"], y["leaves"]):
        assert {k: v for k, v in p.items() if k != "rel_l2"} == {k: v for k, v in q.items() if k != "rel_l2"}
        assert p["rel_l2"] == q["rel_l2"] or p["rel_l2"] == pytest.approx(q["rel_l2"], rel=1e-12)


@pytest.mark.parametrize("tolerance", [{}, {"atol": 0.1}, {"rtol": 0.3}])
def test_the_engine_and_the_lazy_reader_give_one_report(tmp_path, monkeypatch, small_chunks, tolerance):
    a, b = changed_pair(tmp_path)
    by_engine = tsckpt.diff(a, b, **tolerance).to_dict()
    monkeypatch.setattr(diff_module, "engine_serves", lambda leaf: False)
    by_lazy = tsckpt.diff(a, b, **tolerance).to_dict()
    same_report(by_engine, by_lazy)
    found = {leaf["path"]: leaf for leaf in by_engine["leaves"]}
    assert found["same"]["status"] == "equal" and found["d"]["max_abs"] == "inf"
    assert found["i"]["changed_elements"] == (0 if "rtol" in tolerance else 1)  # 1 in 17 * 2**40
    assert found["w"]["changed_elements"] > 0


def test_arrays_of_a_tsckpt_checkpoint_are_read_by_the_engine(tmp_path, monkeypatch, small_chunks):
    a, b = changed_pair(tmp_path)

    def refused(self, box):
        raise AssertionError(f"lazy read of {self.path}")

    monkeypatch.setattr(LazyArray, "read_box", refused)
    report = tsckpt.diff(a, b)
    assert {leaf.path for leaf in report.differences} == {"w", "d", "h", "bf", "i", "flag", "c"}
    ra = tsckpt.open(a)
    assert all(engine_serves(ra[p]) for p in ("w", "d", "h", "bf", "i", "same"))


def test_complex32_is_read_by_the_lazy_reader():
    leaf = LazyArray.__new__(LazyArray)
    leaf.metadata = type("M", (), {"dtype": "complex32"})()
    assert not engine_serves(leaf)


def test_only_differing_elements_are_widened(monkeypatch):
    """A block equal bit for bit is settled by comparing its bytes; a float32 block with one
    changed element is compared as stored without a tolerance, and with one only that element
    is widened to float64 for its difference."""
    a = np.arange(1001, dtype=np.float32)
    widened: list[int] = []
    real = diff_module._widened_differences

    def recording(ca, cb, dtype, **tolerance):
        widened.append(ca.size)
        return real(ca, cb, dtype, **tolerance)

    monkeypatch.setattr(diff_module, "_widened_differences", recording)
    tally = Tally()
    compare_block(a, a.copy(), "float32", ((0,), (1001,)), (100,), tally, atol=0.0, rtol=0.0, piece=300)
    assert (widened, tally.changed_elements, tally.max_abs, tally.sq_diff) == ([], 0, 0.0, 0.0)
    assert tally.sq_a == pytest.approx(float(np.sum(a.astype(np.float64) ** 2)), rel=1e-6)  # summed as stored
    b = a.copy()
    b[500] += 1
    compare_block(a, b, "float32", ((0,), (1001,)), (100,), tally, atol=0.0, rtol=0.0, piece=300)
    assert (widened, tally.changed_elements, tally.first, tally.changed_chunks) == ([], 1, (500,), {(5,)})
    assert (tally.max_abs, tally.sq_diff) == (1.0, 1.0)  # no tolerance: compared as stored, nothing widened
    tolerant = Tally()
    compare_block(a, b, "float32", ((0,), (1001,)), (100,), tolerant, atol=0.5, rtol=0.0, piece=300)
    assert (widened, tolerant.changed_elements, tolerant.first, tolerant.max_abs) == ([1], 1, (500,), 1.0)


@pytest.mark.parametrize("tolerance", [{}, {"atol": 0.5}])
def test_float32_differing_throughout_agrees_with_float64(tolerance):
    """Every element differs: float32 compared as stored (no tolerance) or widened finds what
    numpy finds in float64; an overflow or a NaN takes the exact path."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(5000) * 1e3).astype(np.float32)
    b = (a + rng.standard_normal(5000).astype(np.float32)).astype(np.float32)
    b[a == b] += 1
    a[7], b[7] = 3e38, -3e38  # overflows in float32
    for x, y in [(a[100:], b[100:]), (a, b)]:
        tally = Tally()
        n = x.size
        compare_block(x, y, "float32", ((0,), (n,)), (1000,), tally, piece=1 << 16, **{"atol": 0.0, "rtol": 0.0, **tolerance})
        gap = np.abs(x.astype(np.float64) - y)
        assert tally.changed_elements == int((gap > tolerance.get("atol", 0.0)).sum())
        assert tally.max_abs == gap.max()
        assert tally.sq_diff == pytest.approx(float(np.sum(gap**2)), rel=1e-6)


def test_float32_differences_whose_squares_overflow_are_summed_in_float64():
    a = np.array([3e19, 1.0, 2.0, 5.0], np.float32)
    b = np.array([-1e19, 1.0, 0.0, 5.0], np.float32)
    tally = Tally()
    compare_block(a, b, "float32", ((0,), (4,)), (2,), tally, atol=0.0, rtol=0.0, piece=4)
    x, y = a.astype(np.float64), b.astype(np.float64)
    assert tally.max_abs == np.abs(x - y).max()
    assert tally.sq_diff == pytest.approx(float(np.sum((x - y) ** 2)), rel=1e-6)
    assert tally.sq_a == pytest.approx(float(np.sum(x**2)), rel=1e-6)
    assert (tally.changed_elements, tally.first, tally.changed_chunks) == (2, (0,), {(0,), (1,)})


# ---- blocks read as stored chunks -------------------------------------------------------------


@pytest.fixture
def settled(monkeypatch):
    """What diff did with stored chunks: those whose crc32c it checked, and the elements it
    compared one by one (float pieces not of the same bytes)."""
    seen: dict[str, list] = {"checked": [], "compared": []}
    check, differences = diff_module.check_stored, diff_module._stored_differences

    def checking(ck, path, chunk):
        seen["checked"].append((path, chunk.cell))
        return check(ck, path, chunk)

    def comparing(sa, sb, out, scratch):
        seen["compared"].append(sa.shape[0])
        return differences(sa, sb, out, scratch)

    monkeypatch.setattr(diff_module, "check_stored", checking)
    monkeypatch.setattr(diff_module, "_stored_differences", comparing)
    return seen


def test_one_changed_inner_chunk_of_a_shard(tmp_path, small_chunks, settled, largest_read):
    """A shard whose files differ in one inner chunk: every chunk read is checked (crc32c), and
    only that chunk's elements are compared one by one (the others: their bytes). The report:
    one changed chunk, the first index, the exact largest difference, ||a - b|| / ||a|| over all."""
    before = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1))}
    after = {"w": before["w"].clone()}
    after["w"][21, 40] += 0.25
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    md = tsckpt.open(a)["w"].metadata
    assert math.prod(md.shard_shape) // math.prod(md.chunk_shape) >= 4  # several inner chunks per shard
    report = tsckpt.diff(a, b)
    (leaf,) = report.differences
    assert (leaf.changed_chunks, leaf.changed_elements, leaf.first_index) == (1, 1, (21, 40))
    chunks = 64 * 64 // math.prod(md.chunk_shape)
    assert len(settled["checked"]) == 2 * chunks  # read as stored, each checked
    assert sum(settled["compared"]) == math.prod(md.chunk_shape)  # the changed chunk's elements only
    x, y = before["w"].double().numpy(), after["w"].double().numpy()
    assert leaf.max_abs == np.abs(x - y).max()
    assert leaf.rel_l2 == pytest.approx(np.linalg.norm(x - y) / np.linalg.norm(x), rel=1e-6)
    assert report.bytes_read == sum(largest_read) == 2 * 64 * 64 * 4  # every byte of both, once


def test_stored_chunks_at_the_array_edges(tmp_path, small_chunks, settled):
    """Inner chunks the array's end cuts (stored whole): only their part in the array counts."""
    gen = torch.Generator().manual_seed(2)
    before = {"w": torch.randn(50, 37, generator=gen), "v": torch.randn(1001, generator=gen, dtype=torch.float64)}
    after = {k: v.clone() for k, v in before.items()}
    after["w"][49, 36] = 4.0
    after["v"][1000] = -1.0
    report = tsckpt.diff(saved(tmp_path, "a", before), saved(tmp_path, "b", after))
    found = {leaf.path: leaf for leaf in report.differences}
    assert (found["w"].first_index, found["w"].changed_elements) == ((49, 36), 1)
    assert (found["v"].first_index, found["v"].changed_elements) == ((1000,), 1)
    assert found["v"].max_abs == abs(before["v"][1000].item() + 1.0)
    assert settled["checked"]  # read as stored


@pytest.mark.parametrize("io", ["mapped", "buffered", "direct"])
@pytest.mark.parametrize("tolerance", [{}, {"atol": 0.1}, {"rtol": 0.3}])
def test_stored_chunks_and_the_engine_give_one_report(tmp_path, monkeypatch, small_chunks, settled, tolerance, io):
    """Read as stored chunks (views of the files' mappings, or read through the page cache or
    with direct I/O), by the engine, or one side each way (a file left to the engine): one
    report (sums of squares compared to rounding)."""
    from tsckpt._codec import shardread

    monkeypatch.setattr(shardread, "MAPPED_FROM", 0.0 if io == "mapped" else 2.0)
    monkeypatch.setattr(shardread, "DIRECT_BELOW", 2.0 if io == "direct" else 0.0)
    a, b = changed_pair(tmp_path)
    stored = tsckpt.diff(a, b, **tolerance).to_dict()
    assert settled["checked"]  # read as stored
    real = diff_module.read_stored
    ckb = tsckpt.open(b)

    def only_a(ck, *args):
        return None if str(ck.location) == str(ckb.checkpoint.location) else real(ck, *args)

    monkeypatch.setattr(diff_module, "read_stored", only_a)
    mixed = tsckpt.diff(a, b, **tolerance).to_dict()
    monkeypatch.setattr(diff_module, "read_stored", lambda *args: None)
    settled["checked"].clear()
    by_engine = tsckpt.diff(a, b, **tolerance).to_dict()
    assert settled["checked"] == []
    for other in (mixed, by_engine):
        same_report(stored, other)


def test_damaged_stored_chunk(tmp_path, small_chunks):
    """Every stored chunk read is checked: damage is an error naming the leaf and the chunk,
    even where both sides hold the same damaged bytes."""
    state = {"w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)}
    a, b, c = (saved(tmp_path, name, state) for name in "abc")
    assert tsckpt.diff(a, b).equal
    for ck in (a, b):
        with open(os.path.join(ck, "w", "c", "1", "0"), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x40]))
    for x, y in ((c, b), (a, c), (a, b)):
        with pytest.raises(tsckpt.CorruptCheckpointError, match=r"^'w' in .*w/c/1/0: inner chunk \[0, 0\] fails its crc32c"):
            tsckpt.diff(x, y)


def test_the_exact_largest_difference_where_float32_ties():
    """Differences that round to the same float32 in different pieces: the exact largest is
    found in float64 among all of them, whichever piece holds it."""
    a = np.array([1e8, 5.0, 1e8, 1e8], np.float32)
    b = np.array([0.5, 5.0, 0.25, 0.75], np.float32)
    assert len({float(np.float32(x - y)) for x, y in zip(a[[0, 2, 3]], b[[0, 2, 3]])}) == 1  # one float32
    for piece in (1, 2, 4):
        tally = Tally()
        compare_block(a, b, "float32", ((0,), (4,)), (2,), tally, atol=0.0, rtol=0.0, piece=piece)
        assert tally.max_abs == 1e8 - 0.25 and (tally.changed_elements, tally.first) == (3, (0,))


@pytest.mark.parametrize("n", [1, 1000, 1024, 5000, 70001])
def test_stored_sums_of_squares(n):
    """Dot products of DOT_ELEMENTS in the stored dtype, added in float64: within 1e-6."""
    rng = np.random.default_rng(n)
    for dtype in (np.float32, np.float64):
        x = (rng.standard_normal(n) * 1e3).astype(dtype)
        exact = float(np.sum(x.astype(np.float64) ** 2))
        assert diff_module._stored_sum_of_squares(x) == pytest.approx(exact, rel=1e-6)
    huge = np.full(n, 3e20, np.float32)  # squares beyond float32: not finite (callers sum in float64), or exact
    with np.errstate(over="ignore"):
        got = diff_module._stored_sum_of_squares(huge)
    assert got == (math.inf if n >= diff_module.DOT_ELEMENTS else pytest.approx(n * 9e40, rel=1e-6))


def test_blocks_held_at_once_fit_half_the_window(tmp_path, monkeypatch, small_chunks):
    monkeypatch.setattr(diff_module, "LEAST_WINDOW", 1)  # the blocks' mechanics, at small sizes
    """Blocks are read ahead while those held (read, being read or compared) fit in half the
    window, at most READS_AHEAD besides the one compared; always the next one."""
    held: list[tuple[int, int]] = []
    submit = diff_module._Pipeline._submit

    def recording(self, work, block, cost):
        submit(self, work, block, cost)
        held.append((self.held, len(self.ahead)))

    monkeypatch.setattr(diff_module._Pipeline, "_submit", recording)
    before = {"w": torch.randn(256, 64)}
    after = {"w": before["w"] + 1}
    a, b = saved(tmp_path, "a", before), saved(tmp_path, "b", after)
    # blocks of a shard of 1024 elements (9 KiB held each): 3 fit in half of 1 MiB, 2 in half of 40 KiB;
    # blocks of a row, or of its chunk's rows: 3 fit in half of 16 or 4 KiB
    for window, most in ((1 << 20, 3), (40 << 10, 2), (16 << 10, 3), (4 << 10, 3)):
        held.clear()
        report = tsckpt.diff(a, b, max_inflight_bytes=window)
        assert report.differences[0].changed_elements == 256 * 64
        assert all(cost <= window // 2 or n <= 2 for cost, n in held), (window, held)
        assert max(n for _, n in held) == most == min(most, diff_module.READS_AHEAD + 1)


def test_read_buffers_kept_for_reuse_are_bounded():
    buffers = diff_module._Buffers(10_000)
    given = [buffers.take(n) for n in (4096, 8192, 100, 3000, 5000, 2000)]
    for buf in given:
        buffers.give(buf)
    kept = buffers._free
    assert len(kept) <= diff_module.KEPT_BUFFERS and sum(b.size for b in kept) <= 10_000
    again = buffers.take(2500)
    assert again.size >= 2500 and any(again is b for b in given)  # reused, the smallest that fits
    assert again.ctypes.data % 4096 == 0


def test_none_entries_empty_containers_and_container_kinds_are_compared(tmp_path, capsys):
    """Trees that restore differently never diff equal: their None entries and empty
    containers (no leaf path names them) and their containers' kinds count."""
    tsckpt.save(tmp_path / "a", {"k": 1, "foreach": None, "hist": [None, None], "sched": {}, "t": (1, 2)})
    tsckpt.save(tmp_path / "b", {"k": 1, "t": [1, 2], "hist": []})
    report = tsckpt.diff(tmp_path / "a", tmp_path / "b")
    got = {(d.path, d.status, d.how, d.value_a, d.value_b) for d in report.differences}
    assert got == {
        ("foreach", "only_in_a", "", "None", None), ("hist/0", "only_in_a", "", "None", None),
        ("hist/1", "only_in_a", "", "None", None), ("sched", "only_in_a", "", "{}", None),
        ("t", "different", "structure", "()", "[]"),
    }
    same = tsckpt.diff(tmp_path / "a", tmp_path / "a")
    assert same.equal and {(d.path, d.how) for d in same.leaves if d.how == "value"} >= {("foreach", "value"), ("sched", "value")}
    assert tsckpt.diff(tmp_path / "a", tmp_path / "b", paths=["k"]).equal  # a filter selects these too
    code, out, _ = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1
    assert "only in A  foreach  None\n" in out and "container  t  () -> []\n" in out


def test_a_tiny_window_is_raised_to_the_least_diff_works_in(tmp_path, monkeypatch):
    import tsckpt._read.diff as diff_module

    a = np.arange(1 << 18, dtype=np.float32)
    tsckpt.save(tmp_path / "a", {"w": a})
    tsckpt.save(tmp_path / "b", {"w": a + (np.arange(a.size) == 7)})
    seen = []
    real = diff_module._Sides
    monkeypatch.setattr(diff_module, "_Sides", lambda *args: seen.append(args[6]) or real(*args))
    report = tsckpt.diff(tmp_path / "a", tmp_path / "b", max_inflight_bytes=1)
    assert seen == [diff_module.LEAST_WINDOW]
    (w,) = report.leaves
    assert (w.status, w.first_index, w.changed_elements) == ("different", (7,), 1)


def test_leaves_named_alike_but_for_separators_are_compared(tmp_path, capsys):
    """A nested tree against flat names (another format's, or a state_dict's): each leaf only
    one side names is matched with the other side's of the same spelling, / and . alike."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    tsckpt.save(tmp_path / "flat", {"model": {"layers.0.weight": w, "layers.1.weight": w * 2, "x.y": w}})
    tsckpt.save(tmp_path / "nested", {"model": {"layers": [{"weight": w}, {"weight": w * 2 + (w == 5)}], "x": {"y": w}}})
    report = tsckpt.diff(tmp_path / "flat", tmp_path / "nested")
    got = {d.path: (d.path_b, d.status) for d in report.leaves}
    assert got == {
        "model/layers.0.weight": ("model/layers/0/weight", "equal"),
        "model/layers.1.weight": ("model/layers/1/weight", "different"),
        "model/x.y": ("model/x/y", "equal"),
    }
    code, out, _ = run(capsys, "diff", str(tmp_path / "flat"), str(tmp_path / "nested"))
    assert code == 1 and "changed    model/layers.1.weight (B: model/layers/1/weight)  1 of 1 chunk" in out
    # a spelling two leaves of one side share matches nothing
    tsckpt.save(tmp_path / "both", {"a.b": w, "a": {"b": w}})
    assert {d.status for d in tsckpt.diff(tmp_path / "both", tmp_path / "flat").leaves} <= {"only_in_a", "only_in_b"}


def test_none_against_a_leaf_is_one_changed_dtype_and_namedtuple_fields_in_order_count(tmp_path):
    import collections

    x = np.arange(2.0)
    P, Q = collections.namedtuple("P", "x y"), collections.namedtuple("P", "y x")
    tsckpt.save(tmp_path / "a", {"p": None, "n": P(x, x + 1), "q": None})
    tsckpt.save(tmp_path / "b", {"p": np.ones(4), "n": Q(x + 1, x), "q": 0})
    got = {(d.path, d.status, d.dtype_a, d.dtype_b, d.value_a, d.value_b) for d in tsckpt.diff(tmp_path / "a", tmp_path / "b").differences}
    assert got == {
        ("p", "dtype_changed", "None", "float64", None, None), ("q", "dtype_changed", "None", "int", None, None),
        ("n", "different", None, None, "namedtuple P(x, y)", "namedtuple P(y, x)"),
    }


def test_a_key_of_digits_matches_an_index_spelled_alike_and_a_second_spelling_matches_nothing(tmp_path):
    x = np.arange(2.0)
    tsckpt.save(tmp_path / "flat", {"model.layers.0.weight": x})
    tsckpt.save(tmp_path / "nested", {"model": {"layers": {"0": {"weight": x}}}})
    tsckpt.save(tmp_path / "two", {"model": {"layers": {"0": {"weight": x}}, "layers.0": {"weight": x + 1}}})
    (leaf,) = tsckpt.diff(tmp_path / "flat", tmp_path / "nested").leaves
    assert (leaf.path, leaf.path_b, leaf.status) == ("model.layers.0.weight", "model/layers/%30/weight", "equal")
    statuses = sorted(d.status for d in tsckpt.diff(tmp_path / "flat", tmp_path / "two").leaves)
    assert statuses == ["only_in_a", "only_in_b", "only_in_b"]  # two of B spelled alike: neither is A's


def _found(leaf) -> tuple:
    """What a diff reports of an array whatever it read."""
    return (leaf.status, leaf.chunks, leaf.changed_chunks, leaf.changed_elements, leaf.max_abs, leaf.first_index)


def _root_chunks(directory: str, edit=None) -> dict:
    """The ``content.chunks`` of a checkpoint's root, edited in place by ``edit`` where given."""
    path = os.path.join(directory, "zarr.json")
    with open(path) as f:
        raw = json.load(f)
    chunks = raw["attributes"]["tsckpt"]["content"]["chunks"]
    if edit is not None:
        edit(chunks)
        with open(path, "w") as f:
            json.dump(raw, f)
    return chunks


def _changed_state() -> tuple[dict, dict, list[tuple[int, int]]]:
    """A state, and it with three elements changed: two in inner chunks of the first shard,
    one in the array's last (partly outside) inner chunk."""
    g = torch.Generator().manual_seed(3)
    before = {"w": torch.randn(70, 50, generator=g), "i": torch.arange(64 * 40, dtype=torch.int64).reshape(64, 40)}
    after = {k: v.clone() for k, v in before.items()}
    at = [(0, 1), (6, 40), (69, 49)]
    after["w"][at[0]] += 0.5
    after["w"][at[1]] -= 3.0
    after["w"][at[2]] = float("nan")
    after["i"][63, 0] = -7
    return before, after, at


def test_only_inner_chunks_whose_hashes_differ_are_read(tmp_path, small_chunks, largest_read):
    """Where the files' hashes differ and both sides record their inner chunks' hashes, only the
    inner chunks of other hashes are read (from both sides), and the report is a full read's."""
    before, after, at = _changed_state()
    a = saved(tmp_path, "a", before, incremental=True)
    linked = str(tmp_path / "linked")
    tsckpt.save(linked, after, base=a)  # an incremental save: the unchanged files are hard links
    hashed = saved(tmp_path, "hashed", after, incremental=True)  # nothing linked, hashes recorded
    full_a, full_b = saved(tmp_path, "full_a", before), saved(tmp_path, "full_b", after)  # no hashes: all read
    md = {p: tsckpt.open(a)[p].metadata for p in ("w", "i")}
    assert all(math.prod(m.shard_shape) > math.prod(m.chunk_shape) for m in md.values())

    def chunk_bytes(path, index):
        c = md[path].chunk_shape
        lo = [k // n * n for k, n in zip(index, c)]
        return math.prod(min(n, s - o) for n, s, o in zip(c, md[path].shape, lo)) * 8 // (2 if path == "w" else 1)

    # distinct inner chunks: each changed element's own, the last cut by the array's end
    assert len({tuple(k // n for k, n in zip(i, md["w"].chunk_shape)) for i in at}) == 3
    want_read = 2 * (sum(chunk_bytes("w", i) for i in at) + chunk_bytes("i", (63, 0)))
    for tolerance in ({}, {"atol": 1.0}, {"rtol": 0.1}):
        full = {leaf.path: _found(leaf) for leaf in tsckpt.diff(full_a, full_b, **tolerance).leaves}
        for b in (linked, hashed):
            largest_read.clear()
            report = tsckpt.diff(a, b, **tolerance)
            assert report.bytes_read == sum(largest_read) == want_read
            assert report.bytes_known_equal == (70 * 50 * 4 + 64 * 40 * 8) - want_read // 2
            assert {leaf.path: _found(leaf) for leaf in report.leaves} == full
    assert full["w"][2:] == (3, 3, math.inf, (0, 1)) and full["i"][2:] == (1, 1, 63 * 40 + 7, (63, 0))
    unrelated = saved(tmp_path, "unrelated", {k: v + 1 for k, v in before.items()}, incremental=True)
    largest_read.clear()
    tsckpt.diff(a, unrelated)  # every inner chunk's hash differs: shards read in blocks, not chunk by chunk
    assert max(largest_read) == max(math.prod(md["w"].shard_shape) * 4, math.prod(md["i"].shard_shape) * 8)


def test_inner_chunk_hashes_that_prove_nothing_read_the_shard_whole(tmp_path, small_chunks, largest_read):
    """A list of hashes of another length than the file's inner chunks, or not of 32 lowercase
    hex digits, is none; so are lists equal on both sides although the files' hashes differ
    (records contradicting themselves): the changed shard is read whole, and found."""
    before, after, _ = _changed_state()
    a = saved(tmp_path, "a", before, incremental=True)
    md = tsckpt.open(a)["w"].metadata
    shard = math.prod(md.shard_shape) * 4  # the first shard: whole, not at the array's end
    full_read = tsckpt.diff(saved(tmp_path, "full_a", before), saved(tmp_path, "full_b", after))
    full = {leaf.path: _found(leaf) for leaf in full_read.leaves}["w"]
    key = "w/c/0/0"
    theirs = _root_chunks(a)[key]
    edits = {
        "short": lambda c: c.__setitem__(key, c[key][:-1]),
        "long": lambda c: c.__setitem__(key, [*c[key], c[key][0]]),
        "upper": lambda c: c.__setitem__(key, [c[key][0].upper(), *c[key][1:]]),
        "not a list": lambda c: c.__setitem__(key, "".join(c[key])),
        "equal to A's": lambda c: c.__setitem__(key, list(theirs)),
    }
    for name, edit in edits.items():
        b = saved(tmp_path, name, after, incremental=True)
        assert _root_chunks(b)[key] != theirs
        _root_chunks(b, edit)
        largest_read.clear()
        (leaf,) = [leaf for leaf in tsckpt.diff(a, b).leaves if leaf.path == "w"]
        assert _found(leaf) == full, name
        changed_rest = leaf.bytes_read - 2 * shard  # the other changed shard's changed inner chunk
        assert 0 < changed_rest < 2 * shard, name


def test_forged_inner_chunk_hashes_are_found_by_verify(tmp_path, small_chunks):
    """Well-formed but false hashes are trusted by diff as false file hashes are (a root that
    claims another inner chunk changed hides the one that did: docs/security.md); verify
    hashes every inner chunk it reads, and reports them."""
    before, after, _ = _changed_state()
    a = saved(tmp_path, "a", before, incremental=True)
    b = saved(tmp_path, "b", after, incremental=True)
    key = "w/c/0/0"
    mine, theirs = _root_chunks(b)[key], _root_chunks(a)[key]
    differ = [i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y]
    assert len(differ) == 2  # the first shard's two changed elements
    forged = [theirs[i] if i in differ else "f" * 32 if i == len(mine) - 1 else mine[i] for i in range(len(mine))]
    _root_chunks(b, lambda c: c.__setitem__(key, forged))
    (leaf,) = [leaf for leaf in tsckpt.diff(a, b).leaves if leaf.path == "w"]
    assert (leaf.status, leaf.changed_elements) == ("different", 1)  # the first shard's two changes hidden
    assert tsckpt.verify(a).ok
    report = tsckpt.verify(b)
    assert list(report.bad) == ["w"] and f"its file {key} does not hold the data its save hashed" in report.bad["w"]


@pytest.mark.parametrize(
    "paths", [["model/layers.0.w"], ["model.layers.0.w"], ["model/layers/0/w"], ["model/layers/%30/w"], ["model/*"]]
)
def test_a_path_filter_selects_both_leaves_of_a_pair_spelled_differently(tmp_path, paths):
    """A stores model/layers.0.w, B the dict key "0" (model/layers/%30/w): paired without a
    filter, they were split by one naming either (only in A, or only in B)."""
    u = torch.arange(10.0)
    v = u.clone()
    v[3] = -1
    tsckpt.save(tmp_path / "a", {"model": {"layers.0.w": u}})
    tsckpt.save(tmp_path / "b", {"model": {"layers": {"0": {"w": v}}}})
    report = tsckpt.diff(tmp_path / "a", tmp_path / "b", paths=paths)
    assert [(x.path, x.path_b, x.status, x.changed_elements) for x in report.leaves] == [
        ("model/layers.0.w", "model/layers/%30/w", "different", 1)
    ]


@pytest.mark.parametrize("zero_chunk", [True, False])
def test_rel_l2_with_inner_chunks_left_unread_is_a_bound_or_not_known(tmp_path, capsys, small_chunks, zero_chunk):
    """Only the changed inner chunk is read (the others known equal by their hashes): ||a|| is
    then A's part read. It was reported as inf where that part is all zeros, with nothing
    saying it is not the whole; now None (not known), else an upper bound, marked as one."""
    a = torch.ones(64, 64)
    a[:4] = 0.0 if zero_chunk else 2.0  # the first inner chunk (1 KiB: 4 rows)
    b = a.clone()
    b[1, 7] += 1e-3
    tsckpt.save(tmp_path / "a", {"w": a})
    tsckpt.save(tmp_path / "b", {"w": b})
    assert tuple(tsckpt.open(tmp_path / "a")["w"].metadata.chunk_shape) == (4, 64)
    (leaf,) = tsckpt.diff(tmp_path / "a", tmp_path / "b").differences
    assert leaf.bytes_read == 2 * 4 * 64 * 4 and leaf.rel_l2_bound  # that chunk from each side, no more
    true = float((a - b).double().norm() / a.double().norm())
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    if zero_chunk:
        assert leaf.rel_l2 is None
        assert "rel L2 not known (A's part read is zero, the rest left unread)" in out
    else:
        assert leaf.rel_l2 >= true
        assert f"rel L2 <= {leaf.rel_l2:.3g}," in out
