"""tsckpt's coordination group (tsckpt/_dist.py): always gloo, whatever the default group's backend."""

from __future__ import annotations

import threading

import torch.distributed as dist

from tsckpt import _dist


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
