"""Save planning across many simulated ranks: exact cover, one writer per file."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import unittest.mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tsckpt._ondisk.chunking as chunking
from tsckpt import LayoutError
from tsckpt._ondisk.chunking import shard_boxes
from tsckpt._save.descs import gather_alike, gather_by_rank, gather_descs, pack_descs, shared_regions, with_checksums
from tsckpt._save.plan import RankPlan, plan_save, split_plan
from tsckpt._base.types import LeafDesc
from tests.conftest import examples


def desc(path, shape, off, ln, itemsize=4, checksum=None, cuts=()):
    return LeafDesc(path, "torch", "float32", itemsize, tuple(shape), tuple(off), tuple(ln), checksum, cuts=cuts)


@st.composite
def splits(draw, n):
    """Split n into 1..4 positive parts (even or irregular)."""
    k = draw(st.integers(1, min(4, n)))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    edges = [0, *cuts, n]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


@st.composite
def sharded_arrays(draw):
    rows = draw(st.integers(1, 300))
    cols = draw(st.integers(1, 300))
    row_parts = draw(splits(rows))
    col_parts = draw(splits(cols))
    replicas = draw(st.integers(1, 2))
    per_rank = []
    for (r0, rn), (c0, cn) in itertools.product(row_parts, col_parts):
        for _ in range(replicas):
            per_rank.append([desc("a", (rows, cols), (r0, c0), (rn, cn))])
    return (rows, cols), per_rank


def cells(shape, layout):
    return shard_boxes((0,) * len(shape), shape, layout)


@settings(max_examples=examples(2))  # planning only, no I/O: more layouts
@given(sharded_arrays())
def test_every_file_has_exactly_one_writer_and_every_element_is_written_once(case):
    shape, per_rank = case
    plan = plan_save(per_rank)
    (rec,) = plan.arrays
    # cells covered by each item, per writer
    writers: dict[tuple, set[int]] = {}
    covered = 0
    for w in plan.writes:
        covered += math.prod(w.lengths)
        for cell in shard_boxes(w.offsets, w.lengths, rec.chunking):
            key = tuple(o // g for o, g in zip(cell[0], rec.chunking.shard_shape))
            writers.setdefault(key, set()).add(w.rank)
        if not w.assembled:  # a plain write only covers the writer's own region
            (mine,) = per_rank[w.rank]
            assert all(m <= o and o + n <= m + k for o, n, m, k in zip(w.offsets, w.lengths, mine.offsets, mine.lengths))
    assert covered == math.prod(shape)
    assert all(len(ranks) == 1 for ranks in writers.values())
    assert len(writers) == len(cells(shape, rec.chunking))
    # the pieces sent to a writer come from the rank that owns them
    for t in plan.transfers:
        (src,) = per_rank[t.src]
        assert all(m <= o and o + n <= m + k for o, n, m, k in zip(t.offsets, t.lengths, src.offsets, src.lengths))
    # the number of files stays proportional to the regions, never one per row
    regions = {(d.offsets, d.lengths) for (d,) in per_rank}
    natural = math.prod(-(-s // max(1, min(ln[i] for _, ln in regions))) for i, s in enumerate(shape))
    assert len(cells(shape, rec.chunking)) <= 2 * natural + len(regions)


def test_irregular_rows_use_region_sized_shards_with_boundary_transfers():
    n, cols = 50257, 768
    sizes = [12565, 12564, 12564, 12564]
    starts = [0, 12565, 25129, 37693]
    plan = plan_save([[desc("wte", (n, cols), (s, 0), (k, cols))] for s, k in zip(starts, sizes)])
    (rec,) = plan.arrays
    assert rec.chunking.shard_shape == (12564, 768)
    assert [(t.src, t.dst, t.offsets, t.lengths) for t in plan.transfers] == [
        (0, 1, (12564, 0), (1, 768)),
        (1, 2, (25128, 0), (1, 768)),
        (2, 3, (37692, 0), (1, 768)),
    ]


def test_torch_chunk_splits_align_without_transfers():
    plan = plan_save([[desc("w", (10, 4), (o, 0), (n, 4))] for o, n in [(0, 4), (4, 4), (8, 2)]])
    assert plan.transfers == ()
    assert plan.arrays[0].chunking.shard_shape[0] == 4


def test_replicas_are_balanced_across_ranks():
    per_rank = [[desc(f"p{i}", (256, 256), (0, 0), (256, 256)) for i in range(8)] for _ in range(4)]
    plan = plan_save(per_rank)
    assert sorted(sum(1 for w in plan.writes if w.rank == r) for r in range(4)) == [2, 2, 2, 2]


def test_overlap_and_hole_messages_name_path_and_regions():
    with pytest.raises(LayoutError, match=r"'w': regions \[0:3, 0:4\] and \[2:5, 0:4\] overlap"):
        plan_save([[desc("w", (10, 4), (0, 0), (3, 4))], [desc("w", (10, 4), (2, 0), (3, 4))]])
    with pytest.raises(LayoutError, match=r"'w': shards cover 24 of 40 elements .* a shard is missing"):
        plan_save([[desc("w", (10, 4), (0, 0), (3, 4))], [desc("w", (10, 4), (4, 0), (3, 4))]])
    with pytest.raises(LayoutError, match=r"'w': region \[8:12, 0:4\] lies outside the global shape \[10, 4\]"):
        plan_save([[desc("w", (10, 4), (0, 0), (8, 4))], [desc("w", (10, 4), (8, 0), (4, 4))]])


def test_replica_checksum_mismatch_names_ranks():
    with pytest.raises(LayoutError, match=r"'w': replicas of region \[0:2\] differ in content \(ranks \[0, 2\] vs ranks \[1\]\)"):
        plan_save([[desc("w", (2,), (0,), (2,), checksum=c)] for c in (1, 2, 1)])


def test_disagreeing_shapes_and_values():
    with pytest.raises(LayoutError, match="ranks disagree on what this leaf is"):
        plan_save([[desc("w", (2,), (0,), (2,))], [desc("w", (3,), (0,), (3,))]])
    v = lambda x: LeafDesc("step", "value", value={"type": "int", "value": x})  # noqa: E731
    with pytest.raises(LayoutError, match="'step': ranks 0 and \\[1\\] give different values"):
        plan_save([[v(1)], [v(2)]])


def test_planner_scales_to_64_ranks_and_1000_leaves():
    per_rank = []
    for r in range(64):
        per_rank.append([desc(f"layers.{i}.w", (6400, 64), (r * 100, 0), (100, 64)) for i in range(1000)])
    plan = plan_save(per_rank)
    assert len(plan.arrays) == 1000 and len(plan.writes) == 64000 and not plan.transfers


# ---- each rank's part of the plan ----------------------------------------------------------


def fsdp(world, leaves, rows_per_rank=4, cols=8, replicated=0):
    """Every leaf Shard(0) over ``world`` ranks, plus ``replicated`` small leaves every rank holds."""
    n = world * rows_per_rank
    per_rank = []
    for r in range(world):
        descs = [desc(f"layers.{i}.w", (n, cols), (r * rows_per_rank, 0), (rows_per_rank, cols)) for i in range(leaves)]
        descs += [desc(f"layers.{i}.b", (cols,), (0,), (cols,), checksum=5) for i in range(replicated)]
        per_rank.append(descs)
    return per_rank


def rank_part(plan, rank):
    """Rank ``rank``'s part of ``plan``, the obvious way: what split_plan must give."""
    moves = tuple((i, t) for i, t in enumerate(plan.transfers) if rank in (t.src, t.dst))
    groups = [dataclasses.replace(grp, writes=tuple(w for w in grp.writes if w[0] == rank)) for grp in plan.groups]
    return RankPlan(rank, tuple(grp for grp in groups if rank == 0 or grp.writes), moves, bool(plan.transfers))


def test_union_of_rank_parts_is_the_whole_plan():
    sizes, cols = [13, 12, 12, 12], 64  # irregular: straddling shards and transfers
    starts = [sum(sizes[:i]) for i in range(4)]
    per_rank = [
        [desc("emb", (49, cols), (s, 0), (k, cols)), desc("b", (3,), (0,), (3,), checksum=1), desc(f"own{r}", (2,), (0,), (2,))]
        for r, (s, k) in enumerate(zip(starts, sizes))
    ]
    plan = plan_save(per_rank)
    assert plan.transfers
    parts = split_plan(plan)
    assert parts == [rank_part(plan, r) for r in range(4)]
    assert [w for p in parts for w in p.writes] == list(plan.writes)
    assert sorted(tag for p in parts for tag, _ in p.transfers) == sorted(
        [i for i, _ in enumerate(plan.transfers)] * 2
    )  # each transfer in its sender's part and its receiver's
    for p in parts:
        assert all(p.rank in (t.src, t.dst) and plan.transfers[i] == t for i, t in p.transfers)
        assert p.exchange
        written = {w.path for w in p.writes}
        assert {a.path for a in p.arrays} == (written if p.rank else {a.path for a in plan.arrays})
    assert parts[0].arrays == plan.arrays  # rank 0 writes every array's zarr.json


def test_tuple_descriptors_plan_like_leaf_descs():
    per_rank = fsdp(4, 3, replicated=2)
    assert plan_save([[tuple(d) for d in descs] for descs in per_rank]) == plan_save(per_rank)


def test_a_ranks_part_does_not_grow_with_the_world():
    sizes = {}
    for world in (64, 1024):
        parts = split_plan(plan_save(fsdp(world, 50, replicated=5)))
        sizes[world] = [len(pickle.dumps(parts[r])) for r in (1, world // 2, world - 1)]
    # a rank that also writes a replicated array receives one more group: compare the largest
    assert max(sizes[1024]) <= 1.05 * max(sizes[64]), sizes


def test_shared_regions_fast_path_and_replicas():
    assert not any(shared_regions(gather_descs(fsdp(8, 5))))  # fully sharded: nothing to checksum
    pipeline = [[desc(f"stage{r}.w", (4,), (0,), (4,))] for r in range(4)]
    assert not any(shared_regions(gather_descs(pipeline)))  # pipeline-disjoint
    hsdp = [[desc("w", (4, 2), (2 * (r // 2), 0), (2, 2)), desc("s", (2,), (0,), (2,))] for r in range(4)]
    assert shared_regions(gather_descs(hsdp)) == [["w", "s"]] * 4
    mixed = fsdp(3, 2, replicated=1)
    assert shared_regions(gather_descs(mixed)) == [["layers.0.b"]] * 3


def test_checksums_reach_the_plan():
    per_rank = [[desc("w", (2,), (0,), (2,))] for _ in range(3)]
    g = gather_descs(per_rank)
    with pytest.raises(LayoutError, match=r"ranks \[0, 2\] vs ranks \[1\]"):
        plan_save(with_checksums(g, [{"w": 1}, {"w": 2}, {"w": 1}]))
    assert len(plan_save(with_checksums(g, [{"w": 1}] * 3)).writes) == 1


def test_single_holder_regions_count_before_replicas_are_assigned():
    # rank 0 already writes a large sharded array: the replicated one goes to rank 1
    per_rank = [[desc("big", (100,), (0,), (90,)), desc("r", (10,), (0,), (10,))], [desc("big", (100,), (90,), (10,)), desc("r", (10,), (0,), (10,))]]
    assert {w.path: w.rank for w in plan_save(per_rank).writes if w.path == "r"} == {"r": 1}


def test_ask_root_alone_answers_and_raises_the_roots_error():
    from tsckpt._coord.protocol import Solo, ask_root

    assert ask_root(Solo(), "x", lambda: (1, "p"), lambda got: [got]) == (1, ["p"])

    def refuse(got):
        raise LayoutError("'w': regions overlap")

    with pytest.raises(LayoutError, match="regions overlap"):
        ask_root(Solo(), "x", lambda: (1, "p"), refuse)


# ---- gathered a column at a time (gather_alike), descriptors plan as gathered rank by rank ----


@st.composite
def alike_ranks(draw):
    """Every rank gives the same arrays (and a value) in the same order: random row pieces,
    some held by several ranks (replicas, maybe differing), some by none (holes), some
    shifted (overlaps, regions outside the shape), some empty."""
    world = draw(st.integers(1, 6))
    per_rank = [[] for _ in range(world)]
    for a in range(draw(st.integers(1, 4))):
        rows = draw(st.integers(1, 40))
        shape = (rows, draw(st.integers(1, 3))) if draw(st.booleans()) else (rows,)
        pieces = draw(splits(rows)) if rows > 1 else [(0, 1)]
        for r in range(world):
            start, n = pieces[draw(st.integers(0, len(pieces) - 1))]
            if draw(st.integers(0, 9)) == 0:
                start += draw(st.sampled_from([-1, 1]))
            if draw(st.integers(0, 9)) == 0:
                n = 0
            off, ln = (start, *([0] * (len(shape) - 1))), (n, *shape[1:])
            per_rank[r].append(desc(f"a{a}", shape, off, ln, checksum=draw(st.sampled_from([1, 1, 1, 2]))))
    step = draw(st.sampled_from([3, 3, 4]))
    for r in range(world):
        per_rank[r].append(LeafDesc("step", "value", value={"type": "int", "value": step if r else 3}))
    return per_rank


def planned(per_rank):
    try:
        plan = plan_save(per_rank)
    except LayoutError as e:
        return str(e)
    return plan, split_plan(plan)


@settings(max_examples=examples(3))  # planning only, no I/O: more layouts
@given(alike_ranks(), st.booleans())
def test_columns_plan_exactly_like_ranks_gathered_one_by_one(per_rank, differ):
    tables = [pack_descs(d) for d in per_rank]
    alike, by_rank = gather_alike(tables), gather_by_rank(tables)
    assert alike is not None  # the column-at-a-time path is the one tested
    assert planned(alike) == planned(by_rank)
    assert gather_descs(per_rank).by_path.keys() == alike.by_path.keys()
    shared = shared_regions(alike)
    assert shared == shared_regions(by_rank)
    # checksums computed on request replace the descriptors' on both paths alike
    sums = [{p: r % 2 if differ else 5 for p in paths} for r, paths in enumerate(shared)]
    assert planned(with_checksums(alike, sums)) == planned(with_checksums(by_rank, sums))


def test_packed_descriptors_round_trip():
    per_rank = fsdp(3, 2, replicated=1)
    assert [list(pack_descs(d)) for d in per_rank] == per_rank
    assert list(pack_descs([])) == []


def test_ranks_that_disagree_are_gathered_one_by_one_and_raise():
    def both(per_rank):
        tables = [pack_descs(d) for d in per_rank]
        assert gather_alike(tables) is None
        return planned(gather_descs(tables)), planned(gather_by_rank(tables))

    got, want = both([[desc("w", (8, 4), (0, 0), (8, 4))], [desc("w", (8, 4), (0, 0), (8, 4), itemsize=2)._replace(dtype="float16")]])
    assert got == want and "ranks disagree on what this leaf is (rank 0: torch float32 [8, 4]; rank 1: torch float16" in got
    got, want = both([[desc("w", (10, 4), (0, 0), (3, 4))], [desc("w", (10, 4), (2,), (3, 4))]])
    assert got == want
    got, want = both([[desc("a", (4,), (0,), (2,))], [desc("b", (2,), (0,), (2,))]])
    assert got == want and "'a': shards cover 2 of 4 elements" in got


# ---- regions held in pieces (a jax.Array's device shards) -------------------------------------


@st.composite
def held_in_pieces(draw):
    """An array sharded as jax shards it: a grid of device shards of (h, w) elements (the last
    row and column of the grid possibly shorter), each rank holding a block of whole grid rows
    as its region, in pieces (its device shards); with replicas, two ranks hold each region."""
    grid_rows, grid_cols = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    h, w = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    rows = draw(st.integers((grid_rows - 1) * h + 1, grid_rows * h))
    cols = draw(st.integers((grid_cols - 1) * w + 1, grid_cols * w))
    k = draw(st.integers(1, grid_rows))
    inner = sorted(draw(st.sets(st.integers(1, grid_rows - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    bounds = [0, *inner, grid_rows]
    replicas = draw(st.integers(1, 2))
    per_rank = []
    for a, b in zip(bounds, bounds[1:]):
        top, bottom = a * h, min(b * h, rows)
        cuts = (tuple(range(top + h, bottom, h)), tuple(range(w, cols, w)))
        d = desc("a", (rows, cols), (top, 0), (bottom - top, cols), checksum=1, cuts=cuts)
        per_rank += [[d]] * replicas
    return (rows, cols), per_rank


def _pieces_of(d):
    from tsckpt._ondisk.chunking import pieces

    return pieces((d.offsets, d.lengths), d.cuts, d.itemsize)


@settings(max_examples=examples(2))  # planning only, no I/O: more layouts
@given(held_in_pieces())
def test_no_file_spans_two_pieces_of_its_writer(case):
    shape, per_rank = case
    with unittest.mock.patch.object(chunking, "INNER_CHUNK_BYTES", 64):  # small regions held in pieces count too
        plan = plan_save(per_rank)
        tables = [pack_descs(d) for d in per_rank]
        assert planned(gather_alike(tables)) == planned(gather_by_rank(tables))
        _check_pieces(shape, per_rank, plan)
    assert [list(t) for t in tables] == per_rank  # the cuts travel with the descriptors


def _check_pieces(shape, per_rank, plan):
    (rec,) = plan.arrays
    assert plan.transfers == () and not any(w.assembled for w in plan.writes)
    writers: dict[tuple, set[int]] = {}
    covered = 0
    for w in plan.writes:
        (mine,) = per_rank[w.rank]
        assert ((w.offsets, w.lengths)) in _pieces_of(mine)  # each write is one piece of its writer
        covered += math.prod(w.lengths)
        for cell in shard_boxes(w.offsets, w.lengths, rec.chunking):
            writers.setdefault(tuple(o // g for o, g in zip(cell[0], rec.chunking.shard_shape)), set()).add(w.rank)
    assert covered == math.prod(shape)  # replicas written once
    assert all(len(r) == 1 for r in writers.values()) and len(writers) == len(cells(shape, rec.chunking))


def test_arrays_alike_but_for_their_pieces_are_laid_out_apart():
    """One rank holding two arrays of the same region, one cut by rows, one by columns: each is
    laid out by its own pieces (the layout is not shared), and a region in one piece is not cut."""
    whole = desc("a", (1024, 1024), (0, 0), (1024, 1024))  # 4 MiB
    small = desc("s", (8, 8), (0, 0), (8, 8), cuts=((4,), ()))  # one inner chunk: kept whole, one file
    plan = plan_save([[whole, whole._replace(path="b", cuts=((512,), ())), whole._replace(path="c", cuts=((), (512,))),
                       small]])
    shards = {r.path: r.chunking.shard_shape for r in plan.arrays}
    assert shards == {"a": (1024, 1024), "b": (512, 1024), "c": (1024, 512), "s": (8, 8)}
    assert [(w.path, w.offsets, w.lengths) for w in plan.writes] == [
        ("a", (0, 0), (1024, 1024)), ("b", (0, 0), (512, 1024)), ("b", (512, 0), (512, 1024)),
        ("c", (0, 0), (1024, 512)), ("c", (0, 512), (1024, 512)), ("s", (0, 0), (8, 8)),
    ]


def test_irregular_pieces_of_one_rank_are_assembled_by_that_rank_alone():
    """Pieces of an irregular split (rows 26, 25, 25, 25) are cut by the shortest, as regions of
    several ranks are: a file straddling two of one rank's pieces is that rank's to assemble, with
    nothing sent (one writer per file still)."""
    d = desc("a", (101, 2048), (0, 0), (101, 2048), cuts=((26, 51, 76), ()))  # 808 KiB
    plan = plan_save([[d]])
    assert plan.transfers == () and plan.arrays[0].chunking.shard_shape == (25, 2048)
    assert [(w.rank, w.offsets, w.assembled) for w in plan.writes] == [(0, (r, 0), True) for r in range(0, 101, 25)]


def test_without_inner_chunks_every_rank_writes_its_region_as_one_chunk_file():
    per_rank = [[desc("w", (8, 1024 * 64), (4 * r, 0), (4, 1024 * 64))] for r in range(2)]  # 1 MiB per rank
    (rec,) = plan_save(per_rank, inner=False).arrays
    assert rec.chunking.shard_shape == (4, 1024 * 64) and rec.chunking.chunk_shape is None
    (default,) = plan_save(per_rank).arrays
    assert default.chunking.chunk_shape is not None


def test_ranks_with_other_chunking_options_or_targets_are_refused_by_rank_0():
    from tsckpt._save.descs import Payload
    from tsckpt._save.protocol import _gather

    def payload(rank, **kw):
        d = desc("w", (8, 4), (4 * rank, 0), (4, 4))
        return Payload.of([d], ["w"], None, {}, 1 << 20, "plain", **{"target": "/ck", **kw})

    assert _gather([payload(0), payload(1)]).gathered is not None
    with pytest.raises(LayoutError, match=r"ranks passed different inner_chunks options \(rank 0 True, rank 1 False\)"):
        _gather([payload(0), payload(1, inner_chunks=False)])
    with pytest.raises(LayoutError, match="rank 0 saves /ck, rank 1 saves /other"):
        _gather([payload(0), payload(1, target="/other")])


@pytest.mark.parametrize("name, first, other", [("overwrite", False, True), ("check_replicas", True, False)])
def test_ranks_passing_other_options_that_decide_for_every_rank_are_refused(name, first, other):
    """overwrite=True on rank 1 only was decided by rank 0 (rank 1 told to pass what it passed);
    check_replicas=False on rank 0 only skipped the check rank 1 asked for."""
    from tsckpt._save.descs import Payload
    from tsckpt._save.protocol import _gather

    def payload(rank, **kw):
        d = desc("w", (8, 4), (4 * rank, 0), (4, 4))
        return Payload.of([d], ["w"], None, {}, 1 << 20, "plain", "/ck", **kw)

    with pytest.raises(LayoutError) as e:
        _gather([payload(0, **{name: first}), payload(1, **{name: other})])
    assert str(e.value) == (
        f"ranks passed different {name} options (rank 0 {first!r}, rank 1 {other!r}); every rank must save with the same"
    )
