"""Leaf names as people type them: '/' and '.' alike, a path or glob selecting the leaves at
or below it (one definition for ls, show and diff)."""

from __future__ import annotations

import pytest

from tsckpt._base.leafnames import did_you_mean, listed, spelled, under


@pytest.mark.parametrize(
    ("prefix", "selected"),
    [
        (None, ["model/w", "model/layers/0/b", "model/layers/01/b", "model.embed.weight", "step"]),
        ("", ["model/w", "model/layers/0/b", "model/layers/01/b", "model.embed.weight", "step"]),
        ("model", ["model/w", "model/layers/0/b", "model/layers/01/b", "model.embed.weight"]),
        ("model.layers.0", ["model/layers/0/b"]),
        ("model/layers/0/", ["model/layers/0/b"]),
        ("model/*", ["model/w", "model/layers/0/b", "model/layers/01/b", "model.embed.weight"]),
        ("model.layers.0*", ["model/layers/0/b", "model/layers/01/b"]),
        ("model.layers.?", ["model/layers/0/b"]),
        ("*.b", ["model/layers/0/b", "model/layers/01/b"]),
        ("model/embed", ["model.embed.weight"]),
        ("modle/*", []),
        ("Model", []),  # case-sensitive
    ],
)
def test_under(prefix, selected):
    leaves = ["model/w", "model/layers/0/b", "model/layers/01/b", "model.embed.weight", "step"]
    assert [p for p in leaves if under(p, prefix)] == selected


def test_spelled_and_listed():
    assert spelled("model/layers/0.weight") == "model.layers.0.weight"
    assert listed(["a", "b", "c"], 2) == "'a', 'b', ... 1 more"
    assert listed([]) == "none"


def test_did_you_mean():
    leaves = ["model/w", "step"]
    assert did_you_mean("modle", leaves, "ck", prefixes=True) == "did you mean 'model'?"
    assert did_you_mean("stpe", leaves, "ck") == "did you mean 'step'?"
    assert did_you_mean("zzz", leaves, "my ck") == "`tsckpt ls 'my ck'` lists every leaf"
