"""Races the tests stage: two saves racing for one location (used by the manager and
object-store tests); a file swapped with a link in a loop while it is read (tests/test_confine.py)."""

from __future__ import annotations

import threading


def race_two_saves(monkeypatch, save_one) -> tuple[int, BaseException]:
    """Run ``save_one(0)`` and ``save_one(1)`` in two threads that both find the location
    free before either claims it; returns (the winner, the loser's error)."""
    import tsckpt._storage.durable as durable

    both_checked = threading.Barrier(2, timeout=30)
    real = durable.has_any_key

    def has_any_key(loc):
        found = real(loc)
        both_checked.wait()
        return found

    monkeypatch.setattr(durable, "has_any_key", has_any_key)
    outcome: dict[int, BaseException | None] = {}

    def run(i: int) -> None:
        try:
            save_one(i)
            outcome[i] = None
        except BaseException as e:  # noqa: BLE001 - returned to the test
            outcome[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, e in outcome.items() if e is None]
    losers = [e for e in outcome.values() if e is not None]
    assert len(winners) == 1 and len(losers) == 1, outcome
    return winners[0], losers[0]


def swap_with_link(path: str, target: str, keep: str, stop: threading.Event) -> threading.Thread:
    """Start a thread swapping the file ``path`` and a symbolic link to ``target`` in a loop,
    until ``stop`` is set; each swap is one rename, so ``path`` is always there, a file or a
    link. ``keep``: a hard link of the file (made here), from which it is put back."""
    import os

    os.link(path, keep)
    link, copy = f"{keep}.link", f"{keep}.tmp"

    def run() -> None:
        while not stop.is_set():
            os.symlink(target, link)
            os.replace(link, path)  # now a link
            os.link(keep, copy)
            os.replace(copy, path)  # the file again

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
