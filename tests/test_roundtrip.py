"""Round trips of whole trees: a hypothesis property over trees, dtypes and shapes,
the container types, and the memory:// kvstore."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import tsckpt
from tests.strategies import assert_same, trees

_counter = itertools.count()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(trees())
def test_roundtrip_property(tmp_path, dirty_empty, tree):
    d = str(tmp_path / f"ck{next(_counter)}")
    tsckpt.save(d, tree)
    assert_same(tsckpt.restore(d), tree, loose_arrays=True)  # target=None: arrays come back as numpy
    assert_same(tsckpt.restore(d, tree), tree)  # target: same types, dtypes and bits
    flat = tsckpt.tree.flatten(tree)
    assert list(tsckpt.open(d)) == flat.paths

    # inplace into fresh buffers of the same strides (np.empty_like makes reversed views positive)
    def fresh(leaf):
        if isinstance(leaf, torch.Tensor):
            return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype)
        if isinstance(leaf, np.ndarray):
            return np.empty_like(leaf)
        return leaf

    targets = [fresh(leaf) for leaf in flat.leaves]
    back = tsckpt.restore(d, tsckpt.tree.unflatten(flat.spec, targets), inplace=True)
    assert_same(back, tree)
    for got, target in zip(tsckpt.tree.flatten(back).leaves, targets):
        if isinstance(target, (torch.Tensor, np.ndarray)):
            assert got is target  # filled in place


@given(trees(max_leaves=5))
def test_roundtrip_property_in_memory(tree):
    url = f"memory://prop-{uuid.uuid4().hex}/"
    tsckpt.save(url, tree)
    assert_same(tsckpt.restore(url), tree, loose_arrays=True)
    assert_same(tsckpt.restore(url, tree), tree)


Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class State:
    weights: dict
    step: int
    extra: object = None


def test_containers_roundtrip(ckdir):
    tree = {
        "list": [torch.arange(3), [np.ones(2)]],
        "tuple": (torch.zeros(1), (1,)),
        "point": Point(x=torch.ones(2), y="label"),
        "state": State(weights={"w": torch.eye(2)}, step=10),
        "od": collections.OrderedDict([("z", torch.tensor(1)), ("a", 2)]),
        "empty": {"d": {}, "l": [], "t": ()},
        "none": None,
    }
    tsckpt.save(ckdir, tree)

    back = tsckpt.restore(ckdir, tree)
    assert type(back["state"]) is State and back["state"].step == 10 and back["state"].extra is None
    assert torch.equal(back["state"].weights["w"], torch.eye(2))
    assert type(back["point"]) is Point and back["point"].y == "label"
    assert type(back["od"]) is collections.OrderedDict and list(back["od"]) == ["z", "a"]
    assert back["empty"] == {"d": {}, "l": [], "t": ()} and back["none"] is None

    raw = tsckpt.restore(ckdir)  # no user classes imported: dataclass -> dict, namedtuple by name
    assert raw["state"] == {"weights": {"w": raw["state"]["weights"]["w"]}, "step": 10, "extra": None}
    np.testing.assert_array_equal(raw["state"]["weights"]["w"], np.eye(2, dtype=np.float32))
    assert type(raw["point"]).__name__ == "Point" and raw["point"]._fields == ("x", "y")
    assert type(raw["tuple"]) is tuple and type(raw["tuple"][1]) is tuple
    assert type(raw["od"]) is collections.OrderedDict
    assert raw["empty"] == {"d": {}, "l": [], "t": ()} and raw["none"] is None
    assert list(raw) == list(tree)  # insertion order kept


def test_single_leaf_tree(ckdir):
    t = torch.arange(6.0).reshape(2, 3)
    tsckpt.save(ckdir, t)
    assert sorted(os.listdir(ckdir)) == ["%root", "zarr.json"]
    back = tsckpt.restore(ckdir)
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, t.numpy())
    assert torch.equal(tsckpt.restore(ckdir, torch.empty(2, 3)), t)
    assert tsckpt.metadata(ckdir).shape == (2, 3)
    np.testing.assert_array_equal(tsckpt.open(ckdir)[""][1], [3.0, 4.0, 5.0])


def test_single_value_and_empty_trees(tmp_path):
    for i, tree in enumerate([5, "s", None, {}, [], ()]):
        d = str(tmp_path / str(i))
        tsckpt.save(d, tree)
        assert tsckpt.restore(d) == tree and type(tsckpt.restore(d)) is type(tree)
        assert tsckpt.restore(d, tree) == tree


def test_root_metadata_records_the_tree(ckdir):
    tsckpt.save(ckdir, {"b": torch.zeros(2, dtype=torch.bfloat16), "a": {"n": 1.5}})
    with open(os.path.join(ckdir, "zarr.json")) as f:
        root = json.load(f)
    assert root["zarr_format"] == 3 and root["node_type"] == "group"
    meta = root["attributes"]["tsckpt"]
    assert meta["format_version"] == 3 and meta["state"] == "committed"
    assert meta["leaves"] == ["a/n", "b"]
    assert meta["arrays"] == [
        {"path": "b", "kind": "torch", "shape": [2], "dtype": "bfloat16", "shard_shape": [2], "chunk_shape": None}
    ]
    assert meta["values"] == {"a/n": {"type": "float", "value": 1.5, "bits": "000000000000f83f"}}
    assert meta["structure"]["keys"] == ["a", "b"]
    # values live only in the root metadata: no node for "a"
    assert sorted(os.listdir(ckdir)) == ["b", "zarr.json"]


def test_intermediate_groups_have_zarr_json(ckdir):
    tsckpt.save(ckdir, {"a": {"b": {"c": torch.zeros(1)}}})
    for group in ("a", "a/b"):
        with open(os.path.join(ckdir, group, "zarr.json")) as f:
            assert json.load(f) == {"zarr_format": 3, "node_type": "group", "attributes": {}}
    with open(os.path.join(ckdir, "a/b/c", "zarr.json")) as f:
        assert json.load(f)["node_type"] == "array"


def test_memory_kvstore_save_restore_open():
    url = f"memory://somewhere-{uuid.uuid4().hex}/"
    tree = {"a": torch.arange(10.0), "b": [np.int8(3), "s"], "c": torch.ones(2, 2, dtype=torch.bfloat16)}
    with pytest.raises(tsckpt.CheckpointNotFoundError, match="nothing stored here"):
        tsckpt.restore(url)
    tsckpt.save(url, tree)
    assert_same(tsckpt.restore(url, tree), tree)
    assert_same(tsckpt.restore(url), tree, loose_arrays=True)
    assert_same(tsckpt.restore(url.rstrip("/")), tree, loose_arrays=True)  # trailing slash optional
    np.testing.assert_array_equal(tsckpt.open(url)["a"][2:4], [2.0, 3.0])
    assert tsckpt.metadata(url)["c"].dtype == "bfloat16"
    with pytest.raises(tsckpt.CheckpointExistsError):
        tsckpt.save(url, {"z": 1})
    tsckpt.save(url, {"z": 1}, overwrite=True)
    assert tsckpt.restore(url) == {"z": 1}
    # a sibling location is independent
    with pytest.raises(tsckpt.CheckpointNotFoundError):
        tsckpt.restore(url.rstrip("/") + "-other/")


def test_kvstore_spec_dict_location(tmp_path):
    spec = {"driver": "file", "path": str(tmp_path / "viaspec")}
    tsckpt.save(spec, {"x": torch.arange(3)})
    np.testing.assert_array_equal(tsckpt.restore(str(tmp_path / "viaspec"))["x"], [0, 1, 2])
    assert torch.equal(tsckpt.restore(spec, {"x": torch.empty(3, dtype=torch.int64)})["x"], torch.arange(3))


def test_large_sharded_array_roundtrip(ckdir, small_chunks):
    x = torch.randn(37, 91)  # ragged edges: neither dim divides the shard or chunk shape
    y = torch.randint(-100, 100, (5, 7, 64), dtype=torch.int16)
    tsckpt.save(ckdir, {"x": x, "y": y})
    md = tsckpt.metadata(ckdir)
    assert md["x"].chunk_shape != md["x"].shard_shape  # really sharded with inner chunks
    back = tsckpt.restore(ckdir, {"x": x, "y": y})
    assert torch.equal(back["x"], x) and torch.equal(back["y"], y)
