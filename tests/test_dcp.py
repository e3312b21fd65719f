"""torch.distributed.checkpoint directories read as a tsckpt source tree (tsckpt._formats.dcp)."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

import tsckpt
import tsckpt._formats.dcp as dcp_mod
from tsckpt._formats.dcp import PICKLE_WARNING, read_dcp
from tsckpt._errors import CheckpointNotFoundError, CorruptCheckpointError, LeafTypeError, NotACheckpointError
from tsckpt._types import LazySource
from tests.strategies import assert_same


class Opaque:  # a value weights_only=True refuses to unpickle
    pass


def _save(sd, d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(sd, checkpoint_id=d, no_dist=True)


def _rewrite_metadata(d, **changes):
    md = dcp.FileSystemReader(d).read_metadata()
    md = Metadata(**{**{f: getattr(md, f) for f in ("state_dict_metadata", "planner_data", "storage_data")}, **changes})
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _materialize(tree):
    if isinstance(tree, LazySource):
        return tree[tuple(slice(0, n) for n in tree.shape)]
    if isinstance(tree, dict):
        return {k: _materialize(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_materialize(v) for v in tree)
    return tree


@pytest.fixture
def state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(5, 7, generator=g),
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "scale": torch.tensor(0.5),
        },
        "opt": {
            "state": {0: {"exp_avg": torch.randn(5, 7, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": [0], "name": None}],
        },
        "layers": [torch.arange(3), torch.ones(2, dtype=torch.bfloat16)],
        "step": 7,
        "tag": "run-1",
    }


def _expected(state):
    """What DCP gives back: its flattening turns every dict key into a str."""
    out = dict(state)
    out["opt"] = {"state": {"0": state["opt"]["state"][0]}, "param_groups": state["opt"]["param_groups"]}
    return out


def test_nested_state_dict_reads_lazily_and_restores_exactly(tmp_path, state):
    src = str(tmp_path / "dcp")
    _save(state, src)
    tree = read_dcp(src)
    w = tree["model"]["w"]
    assert isinstance(w, LazySource) and w.shape == (5, 7) and w.dtype == torch.float32 and w.kind == "torch"
    assert tree["model"]["b"].dtype == torch.bfloat16 and tree["model"]["scale"].shape == ()
    assert isinstance(tree["layers"], list) and isinstance(tree["opt"]["param_groups"], list)
    assert tree["step"] == 7 and tree["tag"] == "run-1"
    assert_same(_materialize(tree), _expected(state))

    d = str(tmp_path / "ck")
    tsckpt.save(d, tree, max_inflight_bytes=64)
    assert_same(tsckpt.restore(d, as_saved=True), _expected(state))


def test_read_of_a_box_is_exactly_that_region(tmp_path, state):
    src = str(tmp_path / "dcp")
    _save(state, src)
    tree = read_dcp(src)
    w, t = tree["model"]["w"], state["model"]["w"]
    for box in [(slice(1, 4), slice(2, 6)), (slice(4, 5), slice(0, 7)), (slice(0, 5), slice(6, 7))]:
        got = w[box]
        assert got.dtype == torch.float32 and torch.equal(got, t[box]), box
    assert w[(slice(2, 2), slice(0, 7))].shape == (0, 7)
    assert torch.equal(tree["model"]["scale"][()], torch.tensor(0.5))
    assert torch.equal(tree["model"]["b"][(slice(3, 5),)], state["model"]["b"][3:5])


def test_successive_boxes_of_one_tensor_load_it_once(tmp_path, state, small_chunks, monkeypatch):
    src = str(tmp_path / "dcp")
    state["model"]["big"] = torch.randn(64, 64)  # 16 KiB: several 4 KiB shards, so several boxes
    _save(state, src)
    loads: list[str] = []
    run = dcp_mod._Reader._run

    def counted(self, items, tensors, what):
        loads.append(what)
        return run(self, items, tensors, what)

    monkeypatch.setattr(dcp_mod._Reader, "_run", counted)
    tree = read_dcp(src)
    assert loads == ["values"]
    d = str(tmp_path / "ck")
    tsckpt.save(d, tree, max_inflight_bytes=1 << 10)
    shard = tsckpt.open(d).checkpoint.arrays["model/big"].chunking.shard_shape
    assert shard != (64, 64)  # written in several boxes
    assert sorted(loads[1:]) == sorted(set(loads[1:]))  # each tensor loaded once
    assert len(loads) == 1 + 7
    assert torch.equal(tsckpt.restore(d, as_saved=True)["model"]["big"], state["model"]["big"])


def _two_chunk_checkpoint(d, w):
    """A DCP checkpoint whose tensor 'w' is saved as two row blocks, as two ranks write it."""
    _save({"top": w[:2].clone(), "bottom": w[2:].clone()}, d)
    md = dcp.FileSystemReader(d).read_metadata()
    top, bottom = md.state_dict_metadata["top"], md.state_dict_metadata["bottom"]
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), top.size), ChunkStorageMetadata(torch.Size([2, 0]), bottom.size)]
    _rewrite_metadata(
        d,
        state_dict_metadata={"w": TensorStorageMetadata(top.properties, torch.Size(w.shape), chunks)},
        planner_data={"w": ("w",)},
        storage_data={
            MetadataIndex("w", [0, 0]): md.storage_data[MetadataIndex("top", [0, 0])],
            MetadataIndex("w", [2, 0]): md.storage_data[MetadataIndex("bottom", [0, 0])],
        },
    )


def test_sharded_tensor_reads_only_the_chunks_a_box_overlaps(tmp_path, monkeypatch):
    src = str(tmp_path / "dcp")
    w = torch.randn(5, 6)
    _two_chunk_checkpoint(src, w)
    regions: list[tuple[int, ...]] = []
    run = dcp_mod._Reader._run

    def recorded(self, items, tensors, what):
        regions.extend(tuple(t.shape) for t in tensors.values())
        return run(self, items, tensors, what)

    monkeypatch.setattr(dcp_mod._Reader, "_run", recorded)
    lazy = read_dcp(src)["w"]
    assert torch.equal(lazy[(slice(3, 5), slice(1, 4))], w[3:5, 1:4])
    assert regions == [(3, 6)]  # the second chunk only
    assert torch.equal(lazy[(slice(2, 3), slice(0, 6))], w[2:3])
    assert regions == [(3, 6)]  # served from the region kept
    assert torch.equal(lazy[(slice(1, 3), slice(0, 6))], w[1:3])  # straddles both chunks
    assert regions == [(3, 6), (5, 6)]
    assert torch.equal(_materialize(lazy), w)


def test_without_planner_data_the_tree_is_flat(tmp_path, state):
    src = str(tmp_path / "dcp")
    _save(state, src)
    _rewrite_metadata(src, planner_data=None)
    tree = read_dcp(src)
    assert "model.w" in tree and "opt.state.0.exp_avg" in tree and "opt.param_groups.0.lr" in tree
    assert tree["step"] == 7 and tree["opt.param_groups.0.params"] == [0]
    assert torch.equal(_materialize(tree["layers.1"]), state["layers"][1])


@pytest.mark.parametrize(("value", "found"), [({1, 2}, "set"), (Opaque(), "Opaque")])
def test_value_that_is_not_plain_is_named(tmp_path, value, found):
    src = str(tmp_path / "dcp")
    _save({"w": torch.ones(2), "extra": value}, src)
    with pytest.raises(LeafTypeError) as e:
        read_dcp(src)
    msg = str(e.value)
    assert src in msg and "'extra'" in msg and found in msg and "\n" not in msg


def test_missing_directory(tmp_path):
    src = str(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no such directory") as e:
        read_dcp(src)
    assert src in str(e.value)


def test_directory_without_metadata(tmp_path):
    with pytest.raises(NotACheckpointError, match="not a torch.distributed.checkpoint directory") as e:
        read_dcp(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def _data_file(src):
    (name,) = [n for n in os.listdir(src) if n.endswith(".distcp")]
    return os.path.join(src, name)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_missing_or_short_data_file_fails_before_reading(tmp_path, state, damage, monkeypatch):
    src = str(tmp_path / "dcp")
    _save(state, src)
    data = _data_file(src)
    if damage == "delete":
        os.remove(data)
    else:
        os.truncate(data, os.path.getsize(data) - 1)
    monkeypatch.setattr(dcp_mod._Reader, "_run", lambda *a: pytest.fail("read data of a damaged checkpoint"))
    with pytest.raises(CorruptCheckpointError, match="missing" if damage == "delete" else "truncated") as e:
        read_dcp(src)
    assert data in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("with_value", [False, True])
def test_damaged_data_bytes_are_corrupt(tmp_path, with_value):
    src = str(tmp_path / "dcp")
    _save({"w": torch.ones(4), **({"step": 3} if with_value else {})}, src)
    data = _data_file(src)
    with open(data, "r+b") as f:
        f.write(b"\0" * os.path.getsize(data))
    with pytest.raises(CorruptCheckpointError, match="cannot read (values|tensor 'w')") as e:
        read_dcp(src)["w"][(slice(0, 4),)]  # values are read by read_dcp, tensors when sliced
    assert src in str(e.value) and "\n" not in str(e.value)


def test_garbage_metadata_is_corrupt(tmp_path, state):
    src = str(tmp_path / "dcp")
    _save(state, src)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(b"this is not a pickle")
    with pytest.raises(CorruptCheckpointError, match="cannot unpickle the DCP metadata") as e:
        read_dcp(src)
    assert os.path.join(src, ".metadata") in str(e.value) and "\n" not in str(e.value)


def test_pickle_warning_says_to_trust_the_source():
    assert "pickle" in PICKLE_WARNING and "trusted" in PICKLE_WARNING
