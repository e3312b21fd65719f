"""tsckpt's coordination group (tsckpt/_coord/torchdist.py): always gloo, whatever the default group's backend."""

from __future__ import annotations

import threading

import pytest

import torch.distributed as dist

from tests.dist_helpers import run_ranks
from tsckpt._coord import torchdist as _dist


def test_coordination_group_is_gloo_when_the_default_group_is_nccl(monkeypatch):
    made: list[dict] = []

    def new_group(ranks=None, **kwargs):
        made.append({"ranks": ranks, **kwargs})
        return f"group{len(made)}"

    monkeypatch.setattr(_dist, "_groups", {})
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # the training loop's group
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    coord = _dist.coordinator_for()
    assert coord.group == "group1" and made[0]["backend"] == "gloo" and made[0]["ranks"] is None
    assert _dist.coordinator_for().group == "group1"  # made once, then reused
    found = []
    t = threading.Thread(target=lambda: found.append(_dist.coordinator_for().group))  # a background save
    t.start()
    t.join()
    assert found == ["group2"] and [m["backend"] for m in made] == ["gloo", "gloo"]


def test_a_group_of_this_process_alone_is_solo(monkeypatch):
    """One rank saving by itself (a framework that checkpoints from rank 0 only) makes no
    group, which would be a collective the other ranks never join."""
    from tsckpt._coord.protocol import Solo

    def new_group(*args, **kwargs):
        raise AssertionError("no group is made for a group of one")

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 if group == "mine" else 2)
    coord = _dist.coordinator_for("mine")
    assert isinstance(coord, Solo) and (coord.rank, coord.world_size) == (0, 1)


# ---- the probe of lost ranks (DistCoordinator.unreachable) --------------------------------


def probe_live_ranks(rank: int, world: int, rounds: int, seed: int) -> list[list[int]]:
    """Every rank probes its peers ``rounds`` times, entering each probe after a random
    pause of up to 30 ms (so ranks enter in every order and overlap rounds); what each
    probe named as lost."""
    import random
    import time

    coord = _dist.coordinator_for()
    pause = random.Random(seed * 100 + rank)
    named = []
    for _ in range(rounds):
        time.sleep(pause.uniform(0, 0.03))
        named.append(coord.probe())
    return named


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_probe_names_no_live_rank(world):
    rounds = 40
    for rank, named in enumerate(run_ranks(probe_live_ranks, world, rounds, world, timeout=120)):
        assert named == [[]] * rounds, (rank, named)


def lost_then_linger(rank: int, world: int, directory: str, victim: int, linger: float) -> list[tuple[float, str, str]]:
    """Rank ``victim`` is SIGKILLed mid-save (tests.dist_scenarios.killed_mid_write); each
    survivor reports what its save raised, then what a second save raises, after staying
    alive ``linger`` seconds (as a training process that handles the error does), so no
    survivor is freed by another's exit."""
    import time

    import numpy as np

    import tsckpt
    from tests import dist_scenarios

    raised = dist_scenarios.killed_mid_write(rank, world, directory, victim)
    again = dist_scenarios._raised(lambda: tsckpt.save(directory + "-again", {"w": np.zeros(2)}))
    time.sleep(linger)
    return [raised, again]


@pytest.mark.slow
def test_a_survivor_waiting_on_another_is_freed_when_that_one_leaves(tmp_path):
    """On 4 ranks with rank 1 lost in the write's all-gather (a ring), rank 3 still waits for
    rank 2's part, which rank 2 will not send: it is freed by rank 2 leaving the group
    (DistCoordinator.leave), not by rank 2's process ending, and names rank 1 alone."""
    from tests.dist_helpers import RankError

    linger = 40.0
    with pytest.raises(RankError) as e:
        run_ranks(lost_then_linger, 4, str(tmp_path / "ck"), 1, linger, timeout=120)
    assert e.value.errors == {1: "died without reporting (exit code -9)"}
    for rank, (raised, again) in e.value.results.items():
        elapsed, kind, message = raised
        assert kind == "DistributedError", (rank, kind, message)
        assert message.startswith("save (write) failed: lost contact with rank(s) [1], "), (rank, message)
        assert elapsed < linger / 2, (rank, elapsed, message)
        elapsed, kind, message = again  # the group was left: a later save fails at once, naming the same
        assert kind == "DistributedError", (rank, kind, message)
        assert message.startswith("save (describe) failed: lost contact with rank(s) [1], "), (rank, message)
        assert elapsed < 2, (rank, elapsed, message)
