"""Save and read plans from hand-made descriptors (tsckpt._save.plan): no I/O, many "ranks"."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsckpt import LayoutError
from tsckpt._ondisk.chunking import shard_boxes
from tsckpt._ondisk.records import Chunking
from tsckpt._save.plan import WriteItem, plan_save
from tsckpt._base.types import LeafDesc
from tests.conftest import examples


def region(path, offsets, lengths, global_shape=(8, 4), *, dtype="float32", itemsize=4, checksum=None, kind="torch"):
    return LeafDesc(
        path=path,
        kind=kind,
        dtype=dtype,
        itemsize=itemsize,
        global_shape=tuple(global_shape),
        offsets=tuple(offsets),
        lengths=tuple(lengths),
        checksum=checksum,
    )


def value(path, v):
    return LeafDesc(path=path, kind="value", value={"type": "int", "value": v})


def test_single_rank_whole_arrays_and_values():
    plan = plan_save([[region("w", (0, 0), (8, 4)), value("step", 3), region("b", (0,), (5,), (5,))]])
    assert [a.path for a in plan.arrays] == ["b", "w"]  # sorted by path
    w = plan.arrays[1]
    assert (w.shape, w.dtype, w.kind, w.chunking) == ((8, 4), "float32", "torch", Chunking((8, 4), None))
    assert plan.values == (("step", {"type": "int", "value": 3}),)
    assert plan.writes == (
        WriteItem(0, "b", (0,), (5,), (0,)),
        WriteItem(0, "w", (0, 0), (8, 4), (0, 0)),
    )


def test_row_sharded_array_one_write_per_rank_and_shards_follow_regions():
    per_rank = [[region("w", (0, 0), (4, 4)), value("step", 3)], [region("w", (4, 0), (4, 4)), value("step", 3)]]
    plan = plan_save(per_rank)
    (w,) = plan.arrays
    assert w.chunking.shard_shape == (4, 4)  # no shard crosses the rank boundary at row 4
    assert plan.writes == (WriteItem(0, "w", (0, 0), (4, 4), (0, 0)), WriteItem(1, "w", (4, 0), (4, 4), (0, 0)))
    assert plan.values == (("step", {"type": "int", "value": 3}),)


def test_replicas_are_written_once_balancing_bytes():
    # every rank holds every array whole: each array is written by exactly one rank, spread out
    per_rank = [[region(p, (0, 0), (8, 4), checksum=7) for p in ("a", "b", "c", "d")] for _ in range(4)]
    plan = plan_save(per_rank)
    assert sorted(w.path for w in plan.writes) == ["a", "b", "c", "d"]
    assert sorted(w.rank for w in plan.writes) == [0, 1, 2, 3]


def test_larger_regions_are_assigned_first():
    big = [region("big", (0,), (100,), (100,)), region("small", (0,), (10,), (10,))]
    plan = plan_save([big, big])
    ranks = {w.path: w.rank for w in plan.writes}
    assert ranks["big"] != ranks["small"]


def test_mixed_sharded_and_replicated_with_source_offsets():
    # ranks 0,1 hold rows [0:4], ranks 2,3 hold rows [4:8] (data parallel x tensor parallel)
    per_rank = [[region("w", (0, 0), (4, 4))]] * 2 + [[region("w", (4, 0), (4, 4))]] * 2
    plan = plan_save(per_rank)
    assert len(plan.writes) == 2
    boxes = sorted((w.offsets, w.lengths, w.source_offsets) for w in plan.writes)
    assert boxes == [((0, 0), (4, 4), (0, 0)), ((4, 0), (4, 4), (0, 0))]
    assert {w.rank for w in plan.writes if w.offsets == (0, 0)} <= {0, 1}
    assert {w.rank for w in plan.writes if w.offsets == (4, 0)} <= {2, 3}


def test_zero_size_regions_are_allowed():
    plan = plan_save([[region("e", (0, 0), (0, 3), (0, 3))]])
    assert plan.arrays[0].shape == (0, 3)


def test_missing_shard_is_a_layout_error():
    with pytest.raises(LayoutError, match=r"'w': shards cover 16 of 32 elements of global shape \[8, 4\] \(regions: \[0:4, 0:4\]\); a shard is missing"):
        plan_save([[region("w", (0, 0), (4, 4))]])


def test_overlapping_shards_are_a_layout_error():
    with pytest.raises(LayoutError, match=r"'w': regions \[0:5, 0:4\] and \[4:8, 0:4\] overlap"):
        plan_save([[region("w", (0, 0), (5, 4))], [region("w", (4, 0), (4, 4))]])


def test_region_outside_global_shape_is_a_layout_error():
    with pytest.raises(LayoutError, match=r"'w': region \[0:9, 0:4\] lies outside the global shape \[8, 4\]"):
        plan_save([[region("w", (0, 0), (9, 4))]])
    with pytest.raises(LayoutError, match="lies outside"):
        plan_save([[region("w", (-1, 0), (8, 4))]])


def test_replicas_with_different_content_are_a_layout_error():
    with pytest.raises(LayoutError, match=r"'w': replicas of region \[0:8, 0:4\] differ in content \(ranks \[0, 2\] vs ranks \[1\]\)"):
        plan_save([[region("w", (0, 0), (8, 4), checksum=1)], [region("w", (0, 0), (8, 4), checksum=2)], [region("w", (0, 0), (8, 4), checksum=1)]])


def test_ranks_disagreeing_on_dtype_or_shape():
    with pytest.raises(LayoutError, match=r"'w': ranks disagree on what this leaf is \(rank 0: torch float32 \[8, 4\]; rank 1: torch float16 \[8, 4\]\)"):
        plan_save([[region("w", (0, 0), (8, 4))], [region("w", (0, 0), (8, 4), dtype="float16", itemsize=2)]])
    with pytest.raises(LayoutError, match=r"rank 0: value; rank 1: torch float32"):
        plan_save([[value("s", 1)], [region("s", (0, 0), (8, 4))]])


def test_ranks_disagreeing_on_a_value():
    with pytest.raises(LayoutError, match=r"'s': ranks 0 and \[1\] give different values .*use a rank-unique path"):
        plan_save([[value("s", 3)], [value("s", 4)]])


def test_shard_boxes_split_at_shard_boundaries():
    assert shard_boxes((1, 0), (6, 4), Chunking((4, 4), None)) == [((1, 0), (3, 4)), ((4, 0), (3, 4))]
    assert shard_boxes((), (), Chunking((), None)) == [((), ())]
    assert shard_boxes((0, 0), (4, 4), Chunking((2, 3), (1, 1))) == [
        ((0, 0), (2, 3)),
        ((0, 3), (2, 1)),
        ((2, 0), (2, 3)),
        ((2, 3), (2, 1)),
    ]
    assert shard_boxes((3,), (0,), Chunking((2,), None)) == []


@settings(max_examples=examples(2))  # planning only, cheap: more regions
@given(st.data())
def test_shard_boxes_tile_the_region_within_single_shards(data):
    ndim = data.draw(st.integers(1, 3))
    shard = tuple(data.draw(st.integers(1, 5)) for _ in range(ndim))
    offsets = tuple(data.draw(st.integers(0, 12)) for _ in range(ndim))
    lengths = tuple(data.draw(st.integers(0, 12)) for _ in range(ndim))
    boxes = shard_boxes(offsets, lengths, Chunking(shard, None))
    cells = set()
    for off, ln in boxes:
        assert all(n > 0 for n in ln)
        # every box lies inside one shard
        assert all(o // g == (o + n - 1) // g for o, n, g in zip(off, ln, shard))
        cells |= set(itertools.product(*(range(o, o + n) for o, n in zip(off, ln))))
    assert sum(math.prod(ln) for _, ln in boxes) == len(cells)  # no overlap
    assert cells == set(itertools.product(*(range(o, o + n) for o, n in zip(offsets, lengths))))


@given(st.integers(1, 64), st.integers(1, 8))
def test_many_ranks_row_sharded_tiles_exactly(world, rows_per_rank):
    n = world * rows_per_rank
    per_rank = [[region("w", (r * rows_per_rank, 0), (rows_per_rank, 3), (n, 3))] for r in range(world)]
    plan = plan_save(per_rank)
    assert len(plan.writes) == world
    assert {w.rank for w in plan.writes} == set(range(world))
    shard_rows = plan.arrays[0].chunking.shard_shape[0]
    assert rows_per_rank % shard_rows == 0


def test_shard_bytes_caps_every_shard():
    big = region("w", (0, 0), (4096, 1024), (4096, 1024))  # 16 MiB of float32
    (rec,) = plan_save([[big]]).arrays
    assert math.prod(rec.chunking.shard_shape) * 4 == 16 << 20
    (rec,) = plan_save([[big]], shard_bytes=2 << 20).arrays
    assert math.prod(rec.chunking.shard_shape) * 4 <= 2 << 20
    assert math.prod(rec.chunking.chunk_shape) * 4 == 512 << 10  # inner chunks unchanged


def test_save_window_caps_shard_files(tmp_path):
    import os

    import numpy as np

    import tsckpt

    a = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB
    tsckpt.save(str(tmp_path / "ck"), {"a": a}, max_inflight_bytes=1 << 20)
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "ck" / "a" / "c") for f in fs]
    assert len(files) == 4 and all(os.path.getsize(f) <= (1 << 20) + 4096 for f in files)
    assert np.array_equal(tsckpt.restore(str(tmp_path / "ck"))["a"], a)


def _held(rank_rows, *, checksum=None, shape=(8, 4)):
    """A region of row blocks of 2 (``rank_rows``: the first rows of the blocks) held as pieces."""
    pieces = tuple(((r, 0), (2, 4)) for r in rank_rows)
    lo, hi = min(rank_rows), max(rank_rows) + 2
    return region("w", (lo, 0), (hi - lo, 4), shape, checksum=checksum)._replace(held=pieces)


def _written(plan):
    return sorted((w.rank, w.offsets, w.lengths) for w in plan.writes)


def test_held_pieces_each_written_once_by_a_holder():
    """Two ranks whose row blocks interleave (their bounding boxes overlap): each block is a
    region of its own, written by the rank holding it."""
    plan = plan_save([[_held([0, 4])], [_held([2, 6])]])
    assert _written(plan) == [(0, (0, 0), (2, 4)), (0, (4, 0), (2, 4)), (1, (2, 0), (2, 4)), (1, (6, 0), (2, 4))]


def test_held_pieces_replicated_and_shared_with_a_box():
    """Ranks 0 and 1 hold the same pieces (replicas: one writer each piece, their checksums
    compared), rank 2 the others. A box overlapping pieces it does not equal, and pieces that
    leave elements out, are refused."""
    plan = plan_save([[_held([0, 4], checksum=1)], [_held([0, 4], checksum=1)], [_held([2, 6], checksum=2)]])
    rows = sorted((w.offsets[0], w.rank) for w in plan.writes)
    assert [r for r, _ in rows] == [0, 2, 4, 6] and {rank for r, rank in rows if r in (0, 4)} <= {0, 1}
    assert {rank for r, rank in rows if r in (2, 6)} == {2}
    with pytest.raises(LayoutError, match=r"replicas of region \[0:6, 0:4\] differ in content"):
        plan_save([[_held([0, 4], checksum=1)], [_held([0, 4], checksum=3)], [_held([2, 6])]])
    with pytest.raises(LayoutError, match=r"regions \[0:2, 0:4\] and \[0:4, 0:4\] overlap"):
        plan_save([[_held([0, 4])], [region("w", (0, 0), (4, 4))], [_held([6])]])
    with pytest.raises(LayoutError, match="shards cover 16 of 32 elements"):
        plan_save([[_held([0, 4])]])


def test_regions_in_pieces_that_overlap_without_equalling():
    """Rank 1 holds the whole array as two shards (cut at row 4), ranks 0 and 2 one shard each
    (3 processes of an unusual device order): planned shard by shard, each written once."""
    whole = region("w", (0, 0), (8, 4))._replace(cuts=((4,), ()))
    plan = plan_save([[region("w", (0, 0), (4, 4))], [whole], [region("w", (4, 0), (4, 4))]])
    rows = sorted((w.offsets, w.lengths, w.rank) for w in plan.writes)
    assert [(o, n) for o, n, _ in rows] == [((0, 0), (4, 4)), ((4, 0), (4, 4))]
    assert rows[0][2] in (0, 1) and rows[1][2] in (1, 2)
    with pytest.raises(LayoutError, match=r"overlap"):  # without the cuts the regions overlap
        plan_save([[region("w", (0, 0), (4, 4))], [region("w", (0, 0), (8, 4))], [region("w", (4, 0), (4, 4))]])
