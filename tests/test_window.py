"""The bounded window of work in flight (tsckpt/_runtime/window.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tsckpt._runtime.window import Window


def test_settles_oldest_first_until_within_the_limit():
    done = []
    w = Window(10, done.append)
    w.add("a", 4)
    w.add("b", 4)
    assert done == [] and w.in_flight == 8
    w.add("c", 4)  # 12 > 10: the oldest goes
    assert done == ["a"] and w.in_flight == 8 and len(w) == 2
    w.add("d", 20)  # larger than the limit: everything before it goes, it stays alone
    assert done == ["a", "b", "c", "d"] and w.in_flight == 0
    w.drain()
    assert w.settled == 32


def test_an_item_larger_than_the_limit_is_settled_at_once():
    done = []
    w = Window(3, done.append)
    w.add("big", 5)
    assert done == ["big"] and len(w) == 0


def test_batch_mode_settles_the_whole_window_together():
    batches = []
    w = Window(10, batch=batches.append)
    for name in "abc":
        w.add(name, 4)
    assert batches == [["a", "b", "c"]] and w.in_flight == 0
    w.add("d", 1)
    w.drain()
    w.drain()  # nothing left: no empty batch
    assert batches == [["a", "b", "c"], ["d"]] and w.settled == 13


def test_needs_exactly_one_way_to_settle():
    with pytest.raises(TypeError, match="exactly one"):
        Window(1)
    with pytest.raises(TypeError, match="exactly one"):
        Window(1, print, batch=print)


def test_a_failing_settle_propagates_and_leaves_the_rest_pending():
    def settle(item):
        if item == "bad":
            raise ValueError(item)

    w = Window(1, settle)
    w.add("bad", 1)
    with pytest.raises(ValueError, match="bad"):
        w.add("next", 1)
    assert len(w) == 1 and w.in_flight == 1


@given(st.integers(1, 64), st.lists(st.integers(0, 40), max_size=30))
def test_never_more_than_the_limit_in_flight_after_add(limit, sizes):
    done = []
    w = Window(limit, done.append)
    for i, n in enumerate(sizes):
        w.add(i, n)
        assert w.in_flight <= limit
        assert done == list(range(len(done)))  # FIFO
    w.drain()
    assert done == list(range(len(sizes))) and w.settled == sum(sizes)
