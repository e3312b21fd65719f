"""Multi-rank save/restore on gloo: layouts, resharding, replica checks, failures."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

import tsckpt
from tests import dist_scenarios as sc
from tests.dist_helpers import RankError, run_ranks
from tests.stored import chunk_keys

# every test on both checkpoint layouts: the ranks save in the test's (dist_helpers.rank_layout)
pytestmark = [pytest.mark.usefixtures("layout"), pytest.mark.slow]  # every test here starts processes

SPEC = {
    "wte": ((10, 6), "S0"),
    "wpe": ((5, 4), "S0"),
    "proj": ((7, 3), "S1"),
    "norm": ((6,), "R"),
}


def test_dtensor_4_ranks_restored_on_1_2_3_ranks_and_offline(tmp_path):
    d = str(tmp_path / "ck")
    run_ranks(sc.save_dtensors, 4, d, (4,), SPEC)
    for world in (2, 3):
        run_ranks(sc.restore_dtensors, world, d, (world,), SPEC)
    # a plain single process, no torch.distributed
    out = tsckpt.restore(d)
    for i, (name, (shape, _)) in enumerate(sorted(SPEC.items())):
        np.testing.assert_array_equal(out["model"][name], sc.global_tensor(shape, seed=i).numpy())
    assert out["step"] == 7
    assert tsckpt.open(d)["model/wte"][5:9].shape == (4, 6)


def test_fsdp2_save_4_restore_2_and_as_tp_shard1(tmp_path):
    d = str(tmp_path / "ck")
    run_ranks(sc.save_fsdp2, 4, d)
    run_ranks(sc.restore_fsdp2, 2, d)
    placements = run_ranks(sc.restore_fsdp2_as_tp_shard1, 2, d)
    assert placements[0]["0.weight"] == "(Shard(dim=1),)"
    ref = sc.tiny_model().state_dict()
    spec = {f"model/{k}": None for k in ref}
    got = tsckpt.restore(d)
    for k, v in ref.items():
        np.testing.assert_array_equal(got["model"][k], v.numpy())
    assert set(spec) == {f"model/{k}" for k in got["model"]}


def test_2x2_mesh_to_1d_and_back(tmp_path):
    spec2d = {"a": ((8, 6), "S0,S1"), "b": ((7, 3), "S0,S1"), "c": ((5, 4), "R,S0")}
    spec1d = {"a": ((8, 6), "S1"), "b": ((7, 3), "S0"), "c": ((5, 4), "S0")}
    d1, d2 = str(tmp_path / "a"), str(tmp_path / "b")
    run_ranks(sc.save_dtensors, 4, d1, (2, 2), spec2d)
    run_ranks(sc.restore_dtensors, 2, d1, (2,), spec1d, True)
    run_ranks(sc.save_dtensors, 2, d2, (2,), spec1d)
    run_ranks(sc.restore_dtensors, 4, d2, (2, 2), spec2d, True)


def test_uneven_rows_on_three_ranks(tmp_path):
    d = str(tmp_path / "ck")
    spec = {"w": ((5, 2), "S0"), "v": ((2, 5), "S1")}
    run_ranks(sc.save_dtensors, 3, d, (3,), spec)
    run_ranks(sc.restore_dtensors, 2, d, (2,), spec)


def test_ddp_style_replicas_written_once(tmp_path):
    d = str(tmp_path / "ck")
    run_ranks(sc.replicas, 2, d, False)
    out = tsckpt.restore(d)
    np.testing.assert_array_equal(out["w"], sc.global_tensor((6, 4)).numpy())
    np.testing.assert_array_equal(out["b"], np.arange(3))


@pytest.mark.no_checkpoint_root  # the save fails on every rank
def test_replica_mismatch_raises_on_every_rank(tmp_path):
    d = str(tmp_path / "ck")
    with pytest.raises(RankError) as e:
        run_ranks(sc.replicas, 2, d, True)
    assert set(e.value.errors) == {0, 1}
    for msg in e.value.errors.values():
        assert "LayoutError" in msg and "'w'" in msg and "differ in content" in msg and "ranks [0] vs ranks [1]" in msg
    assert not os.path.exists(os.path.join(d, "zarr.json"))


def test_pipeline_disjoint_paths_union(tmp_path):
    d = str(tmp_path / "ck")
    run_ranks(sc.pipeline_stages, 2, d, False)
    out = tsckpt.restore(d)
    assert sorted(out["model"]) == [f"layers.{i}.weight" for i in range(4)]
    for i in range(4):
        np.testing.assert_array_equal(out["model"][f"layers.{i}.weight"], sc.global_tensor((3, 3), seed=i).numpy())


@pytest.mark.no_checkpoint_root  # the save fails on every rank
def test_pipeline_name_collision_is_an_error(tmp_path):
    d = str(tmp_path / "ck")
    with pytest.raises(RankError) as e:
        run_ranks(sc.pipeline_stages, 2, d, True)
    for msg in e.value.errors.values():
        assert "'model/layers.0.weight'" in msg and "differ in content" in msg and "distinct global names" in msg


def test_a_path_that_is_a_leaf_on_one_rank_and_holds_leaves_on_another_is_refused(tmp_path):
    """Saved as the union of both ranks' leaves ("r" and "r/0"), the step was listed complete
    and could not be restored, and retention had removed the step before it."""
    for message, steps, first in run_ranks(sc.nested_on_one_rank, 2, str(tmp_path / "run")):
        assert message == (
            "'r' is a leaf on rank(s) [0] but holds leaves on rank(s) [1] ('r/0'): the ranks give different trees at "
            "that path (e.g. a tensor on one, a list or dict of them on another); give it the same kind of node on "
            "every rank, or distinct names per rank"
        )
        assert steps == [1] and first == [0.0, 1.0, 2.0]


@pytest.mark.no_checkpoint_root  # the save fails on every rank
@pytest.mark.parametrize(
    "case, first, second",
    [
        ("tuple-list", "a tuple", "a list"),
        ("list-dict", "a list", "a dict"),
        ("none-emptydict", "None", "a dict"),
        ("leaf-emptylist", "a leaf", "a list"),
    ],
)
def test_ranks_giving_other_kinds_of_node_at_a_path_are_refused(tmp_path, case, first, second):
    """Saved as their union, these were committed as a tree neither rank gave: a list and a
    dict of one entry read back as a dict of both keys, a tuple as a dict, None or an empty
    container dropped."""
    for message, committed in run_ranks(sc.trees_differ, 2, str(tmp_path), case):
        assert message == (
            f"'a' is {first} on rank 0 but {second} on rank 1: the ranks give different trees at that path, which "
            "no tree restores; give it the same kind of node on every rank, or distinct names per rank"
        )
        assert not committed


def test_ranks_giving_a_dict_and_an_ordereddict_at_a_path_save_both(tmp_path):
    """A stage's state_dict() (an OrderedDict) against a dict filtered from one: alike."""
    for message, committed in run_ranks(sc.trees_differ, 2, str(tmp_path), "ordereddict-dict"):
        assert (message, committed) == ("", True)
    out = tsckpt.restore(tmp_path / "ordereddict-dict")
    assert sorted(out["a"]) == ["w0", "w1"]
    """overwrite=True on rank 1 only: rank 0 refused alone, before the save, and the ranks
    were one call apart from then on (every later save failed)."""
    root = str(tmp_path / "run")
    for raised, steps in run_ranks(sc.overwrite_on_one_rank, 2, root):
        assert raised == [
            "", f"CheckpointExistsError: {root}: step 1 already has a complete checkpoint; pass overwrite=True to "
            "replace it", "",
        ]
        assert steps == [1, 2]


@pytest.mark.no_checkpoint_root  # the save fails on every rank
def test_partial_placement_is_refused(tmp_path):
    with pytest.raises(RankError) as e:
        run_ranks(sc.partial_save, 2, str(tmp_path / "ck"))
    for msg in e.value.errors.values():
        assert "Partial" in msg and "'p'" in msg and "redistribute" in msg


def test_rank_failing_mid_save_makes_all_raise_and_commits_nothing(tmp_path):
    d = str(tmp_path / "ck")
    with pytest.raises(RankError) as e:
        run_ranks(sc.failing_save, 2, d, timeout=60)
    assert "disk full (injected)" in e.value.errors[1]
    assert "DistributedError" in e.value.errors[0] and "rank(s) [1]" in e.value.errors[0]
    # every rank knew of the failure, so rank 0 removed the partial checkpoint
    assert "the partial checkpoint was removed, so saving again needs no overwrite=True" in e.value.errors[0]
    assert not os.path.exists(d)
    with pytest.raises(tsckpt.CheckpointNotFoundError):
        tsckpt.restore(d)
    run_ranks(sc.save_dtensors, 2, d, (2,), SPEC)  # saving again needs no overwrite=True
    assert tsckpt.restore(d)["step"] == 7


def test_irregular_explicit_shards(tmp_path):
    d = str(tmp_path / "ck")
    splits = [3, 3, 2, 2]
    run_ranks(sc.sharded_arrays, 4, d, splits, 5)
    full = sc.global_tensor((10, 5))
    np.testing.assert_array_equal(tsckpt.restore(d)["emb"], full.numpy())
    run_ranks(sc.restore_sharded_arrays, 4, d, [4, 1, 1, 4], 5)


def test_irregular_split_keeps_few_files_and_one_writer_each(tmp_path):
    """array_split-style rows 13,12,12,12 would need 1-row shards if files followed
    the region starts; instead straddling shards get their few rows sent over."""
    d = str(tmp_path / "ck")
    splits = [13, 12, 12, 12]
    run_ranks(sc.sharded_arrays, 4, d, splits, 64)
    full = sc.global_tensor((49, 64))
    np.testing.assert_array_equal(tsckpt.restore(d)["emb"], full.numpy())
    assert chunk_keys(d, "emb") == ["/0/0", "/1/0", "/2/0", "/3/0", "/4/0"]  # 12-row shards, not 49 one-row files
    run_ranks(sc.restore_sharded_arrays, 3, d, [20, 20, 9], 64)


def test_fsdp_x_tp_2d_strided_to_fsdp_1d_and_back(tmp_path, layout):
    d1, d2 = str(tmp_path / "a"), str(tmp_path / "b")
    placements = run_ranks(sc.save_fsdp_tp, 4, d1)
    assert any("_StridedShard" in p for p in placements[0])  # FSDP2 on top of TP really is strided
    ref = sc.MLP().state_dict()
    got = tsckpt.restore(d1)
    for k, v in ref.items():
        np.testing.assert_array_equal(got["model"][k], v.numpy())
    run_ranks(sc.restore_fsdp_1d, 2, d1)
    tsckpt.save(d2, {"model": ref}, layout=layout)  # single process, plain tensors
    run_ranks(sc.restore_fsdp_tp, 4, d2)


def test_hsdp_and_empty_shards(tmp_path):
    d = str(tmp_path / "ck")
    spec = {"hsdp": ((6, 4), "R,S0"), "tiny": ((1, 3), "S0,R")}  # rank (1, *) holds an empty shard of tiny
    run_ranks(sc.save_dtensors, 4, d, (2, 2), spec)
    run_ranks(sc.restore_dtensors, 3, d, (3,), {"hsdp": ((6, 4), "S1"), "tiny": ((1, 3), "S0")})


@pytest.mark.no_checkpoint_root  # the save fails on every rank
def test_bad_leaf_on_one_rank_fails_every_rank_before_anything_is_written(tmp_path):
    d = str(tmp_path / "ck")
    with pytest.raises(RankError) as e:
        run_ranks(sc.bad_leaf_on_one_rank, 2, d, timeout=60)
    assert "LeafTypeError" in e.value.errors[1] and "'oops'" in e.value.errors[1]
    assert "DistributedError" in e.value.errors[0] and "save (describe) failed on rank(s) [1]" in e.value.errors[0]
    assert not os.path.exists(d)


# A rank lost (its process SIGKILLed, as when its host dies) is told to the survivors by gloo
# at once; they raise within seconds, far below the 10 minutes of the collectives' timeout.
LOST_WITHIN_S = 30


def _named_lost(message: str, phase: str, rank: int) -> set[int]:
    """The ranks a survivor's DistributedError names as lost in ``phase`` (never ``rank`` itself)."""
    match = re.match(rf"{re.escape(phase)} failed: lost contact with rank\(s\) \[([0-9, ]+)\], ", message)
    assert match is not None, message
    named = {int(r) for r in match.group(1).split(",")}
    assert rank not in named, message
    return named


def _run_losing(scenario, world: int, d: str, killed: int, phase: str) -> dict[int, str]:
    """Run ``scenario`` on ``world`` ranks, rank ``killed`` SIGKILLed in it: every survivor
    raises DistributedError naming exactly that rank lost in ``phase``, in time; returns each
    survivor's message."""
    with pytest.raises(RankError) as e:
        run_ranks(scenario, world, d, killed, timeout=90)
    assert e.value.errors == {killed: "died without reporting (exit code -9)"}
    for rank, (elapsed, kind, message) in e.value.results.items():
        assert kind == "DistributedError", (rank, kind, message)
        assert _named_lost(message, phase, rank) == {killed}, (rank, message)
        assert "Connection" in message and elapsed < LOST_WITHIN_S, (rank, elapsed, message)
    return {rank: message for rank, (_, _, message) in e.value.results.items()}


def _saves_again(d: str, layout: str) -> None:
    assert not os.path.exists(os.path.join(d, "zarr.json"))  # no pending root left behind
    tsckpt.save(d, {"w": np.arange(4)}, layout=layout)  # saving again needs no overwrite=True
    assert tsckpt.restore(d)["w"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [2, 3])
def test_rank_killed_mid_write_survivors_raise_and_rank_0_cleans_up(tmp_path, layout, world):
    d = str(tmp_path / "ck")
    messages = _run_losing(sc.killed_mid_write, world, d, 1, "save (write)")
    assert "the partial checkpoint was removed, so saving again needs no overwrite=True" in messages[0]
    _saves_again(d, layout)


def test_rank_0_killed_mid_write_the_lowest_survivor_cleans_up(tmp_path, layout):
    d = str(tmp_path / "ck")
    messages = _run_losing(sc.killed_mid_write, 3, d, 0, "save (write)")
    assert "rank 0 was lost, and this rank removed the partial checkpoint" in messages[1]
    assert "removed" not in messages[2]
    _saves_again(d, layout)


def test_rank_killed_during_restore_survivors_raise(tmp_path):
    d = str(tmp_path / "ck")
    _run_losing(sc.killed_before_restore, 3, d, 2, "restore")
    assert tsckpt.open(d)["w"].shape == (18, 4)  # the checkpoint restored from is untouched


@pytest.mark.parametrize("how", [pytest.param("dirs", marks=pytest.mark.no_checkpoint_root), "steps"])
def test_ranks_saving_different_checkpoints_in_one_call_all_raise_and_nothing_is_committed(tmp_path, how):
    """Paired, two saves' regions were planned as one: each checkpoint committed without the
    other ranks' rows, listed as complete."""
    root = str(tmp_path / "run")
    results = run_ranks(sc.out_of_step, 2, root, how)
    want = "d0" if how == "dirs" else "00000002"
    other = "d1" if how == "dirs" else "00000003"
    for message, steps in results:
        assert f"the ranks are saving different checkpoints: rank 0 saves {os.path.join(root, want)}, rank 1 saves " \
               f"{os.path.join(root, other)}" in message
        assert steps == ([] if how == "dirs" else [1])
    assert not os.path.exists(os.path.join(root, want, "zarr.json"))
