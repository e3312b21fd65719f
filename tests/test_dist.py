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


def leave_after_a_peer_left(rank: int, world: int, linger: float) -> float | None:
    """Rank 0 leaves the coordination group first; then rank 1 leaves, its first peer
    (rank 0) already gone; rank 2 waits on a receive from rank 1, which never sends.
    Ranks 0 and 1 stay alive ``linger`` seconds, so only rank 1 leaving can free rank 2;
    rank 2 returns how long it waited."""
    import time

    import torch

    coord = _dist.coordinator_for()
    coord.all_gather(rank)  # every connection made
    if rank == 0:
        coord.leave([])
    elif rank == 1:
        time.sleep(1.0)  # rank 0 gone first
        coord.leave([])
    else:
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.recv(torch.zeros(1, dtype=torch.uint8), src=1, group=coord.group, tag=0x51)
        return time.monotonic() - start
    time.sleep(linger)
    return None


@pytest.mark.slow
def test_a_rank_leaving_after_a_peer_left_still_frees_the_ranks_waiting_on_it():
    """Leaving closes every connection of the rank (gloo does so when a wait times out):
    the first peer's connection being closed already (it left first) must not end the
    leave before the others are closed."""
    linger = 10.0
    waited = run_ranks(leave_after_a_peer_left, 3, linger, timeout=120)[2]
    assert waited < linger / 2, waited


def test_leaving_goes_on_past_a_peer_whose_connection_closed_in_the_wait(monkeypatch):
    """The race the test above cannot force: the first peer's receive is posted before its
    closing is seen, so its wait fails with "connection closed", which closes nothing else
    (only a timeout does). The leave must go on to the next peer, whose wait times out."""
    posted: list[int] = []

    class Work:
        def __init__(self, src: int) -> None:
            self.src = src

        def wait(self, timeout=None):
            if self.src == 0:
                raise RuntimeError("pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
            raise RuntimeError("unbound_buffer.cc:78] Timed out waiting 1ms for recv operation to complete")

    def irecv(tensor, src, group=None, tag=0):
        posted.append(src)
        return Work(src)

    monkeypatch.setattr(dist, "irecv", irecv)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    coord = object.__new__(_dist.DistCoordinator)
    coord.group, coord.rank, coord.world_size = "g", 1, 4
    coord._close()
    assert posted[:2] == [0, 2], posted


def timeouts_changing(rank: int, world: int, root: str) -> float | None:
    """Every rank saves with 30 s; then rank 1 alone passes 20 s; then rank 0 passes 2 s for a
    save rank 1 never joins. How long rank 0 waited for it."""
    import datetime
    import os
    import time

    import numpy as np

    import tsckpt

    def save(name: str, seconds: float) -> None:
        tsckpt.save(os.path.join(root, name), {"w": np.arange(4.0)}, timeout=datetime.timedelta(seconds=seconds))

    save("a", 30)
    save("b", 20 if rank == 1 else 30)
    if rank == 1:
        time.sleep(10)
        return None
    start = time.monotonic()
    with pytest.raises(tsckpt.DistributedError):
        save("c", 2)
    return time.monotonic() - start


@pytest.mark.slow
def test_a_timeout_changed_on_one_rank_makes_no_group_and_takes_effect(tmp_path):
    """Groups were made per timeout: a rank passing another timeout made a new group, a
    collective the others never entered (they waited in the save). Now one group, whose
    waits the latest timeout bounds."""
    waited = run_ranks(timeouts_changing, 2, str(tmp_path), timeout=120)[0]
    assert waited is not None and waited < 8, waited


def restore_on_rank_0_alone(rank: int, world: int, root: str) -> str | None:
    """Every rank saves; rank 0 alone restores (with a 2 s timeout) while rank 1 waits. What rank 0 raised."""
    import datetime
    import os
    import time

    import numpy as np

    import tsckpt

    tsckpt.save(os.path.join(root, "a"), {"w": np.arange(4.0)})
    if rank == 1:
        time.sleep(8)
        return None
    try:
        tsckpt.restore(os.path.join(root, "a"), timeout=datetime.timedelta(seconds=2))
    except tsckpt.DistributedError as e:
        return str(e)
    return "restored"


@pytest.mark.slow
def test_a_restore_no_other_rank_makes_says_every_rank_makes_it(tmp_path):
    message = run_ranks(restore_on_rank_0_alone, 2, str(tmp_path), timeout=120)[0]
    assert message is not None and message.startswith("restore failed: lost contact with another rank"), message
    assert "or it never made this call: every rank of the group makes it; one process alone reads with tsckpt.open" \
        in message, message
