"""torch.distributed.checkpoint directories read as a tsckpt source tree (tsckpt._formats.dcp)."""

from __future__ import annotations

import dataclasses
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
from tsckpt._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LeafTypeError,
    LinkRefusedError,
    NotACheckpointError,
)
from tsckpt._errors import short_repr
from tsckpt._base.types import LazySource
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
    """What DCP gives back: its flattening turns every dict key into a str, and a key of an
    int's digits reads back as that int (the optimizer state's 0): the state as saved."""
    assert list(state["opt"]["state"]) == [0]
    return dict(state)


def test_nested_state_dict_reads_lazily_and_restores_exactly(tmp_path, state):
    src = str(tmp_path / "dcp")
    _save(state, src)
    tree = read_dcp(src, allow_pickle=True)
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
    tree = read_dcp(src, allow_pickle=True)
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
    run = dcp_mod._RegionReader._run

    def counted(self, items, tensors, what):
        loads.append(what)
        return run(self, items, tensors, what)

    monkeypatch.setattr(dcp_mod._RegionReader, "_run", counted)
    tree = read_dcp(src, allow_pickle=True)
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
    run = dcp_mod._RegionReader._run

    def recorded(self, items, tensors, what):
        regions.extend(tuple(t.shape) for t in tensors.values())
        return run(self, items, tensors, what)

    monkeypatch.setattr(dcp_mod._RegionReader, "_run", recorded)
    lazy = read_dcp(src, allow_pickle=True)["w"]
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
    tree = read_dcp(src, allow_pickle=True)
    assert "model.w" in tree and "opt.state.0.exp_avg" in tree and "opt.param_groups.0.lr" in tree
    assert tree["step"] == 7 and tree["opt.param_groups.0.params"] == [0]
    assert torch.equal(_materialize(tree["layers.1"]), state["layers"][1])


@pytest.mark.parametrize(("value", "found"), [({1, 2}, "set"), (Opaque(), "Opaque")])
def test_value_that_is_not_plain_is_named(tmp_path, value, found):
    src = str(tmp_path / "dcp")
    _save({"w": torch.ones(2), "extra": value}, src)
    with pytest.raises(LeafTypeError) as e:
        read_dcp(src, allow_pickle=True)
    msg = str(e.value)
    assert src in msg and "'extra'" in msg and found in msg and "\n" not in msg


def test_missing_directory(tmp_path):
    src = str(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no such directory") as e:
        read_dcp(src, allow_pickle=True)
    assert src in str(e.value)


def test_directory_without_metadata(tmp_path):
    with pytest.raises(NotACheckpointError, match="not a torch.distributed.checkpoint directory") as e:
        read_dcp(str(tmp_path), allow_pickle=True)
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
    monkeypatch.setattr(dcp_mod._RegionReader, "_run", lambda *a: pytest.fail("read data of a damaged checkpoint"))
    with pytest.raises(CorruptCheckpointError, match="missing" if damage == "delete" else "truncated") as e:
        read_dcp(src, allow_pickle=True)
    assert data in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("with_value", [False, True])
def test_damaged_data_bytes_are_corrupt(tmp_path, with_value):
    src = str(tmp_path / "dcp")
    _save({"w": torch.ones(4), **({"step": 3} if with_value else {})}, src)
    data = _data_file(src)
    with open(data, "r+b") as f:
        f.write(b"\0" * os.path.getsize(data))
    with pytest.raises(CorruptCheckpointError, match="cannot read (values|tensor 'w')") as e:
        read_dcp(src, allow_pickle=True)["w"][(slice(0, 4),)]  # values are read by read_dcp, tensors when sliced
    assert src in str(e.value) and "\n" not in str(e.value)


def test_garbage_metadata_is_corrupt(tmp_path, state):
    src = str(tmp_path / "dcp")
    _save(state, src)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(b"this is not a pickle")
    with pytest.raises(CorruptCheckpointError, match="cannot unpickle the DCP metadata") as e:
        read_dcp(src, allow_pickle=True)
    assert os.path.join(src, ".metadata") in str(e.value) and "\n" not in str(e.value)


def test_pickle_warning_says_to_trust_the_source():
    assert "pickle" in PICKLE_WARNING and "trusted" in PICKLE_WARNING and "--allow-pickle" in PICKLE_WARNING


# ---- unpickling only when asked -----------------------------------------------------------


class _Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(directory, marker) -> None:
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        pickle.dump(_Payload(str(marker)), f)


def test_without_allow_pickle_the_metadata_is_never_unpickled(tmp_path, state, capsys):
    src = str(tmp_path / "dcp")
    _save(state, src)
    marker = tmp_path / "ran"
    _plant(src, marker)
    with pytest.raises(NotACheckpointError) as e:
        read_dcp(src)
    assert str(e.value) == (
        f"{src}/.metadata: a torch.distributed.checkpoint's metadata is a Python pickle, and unpickling it can run "
        "arbitrary code; tsckpt unpickles only when asked: pass allow_pickle=True (--allow-pickle) if you "
        "trust where this checkpoint came from"
    )
    with pytest.raises(NotACheckpointError, match=r"pass allow_pickle=True \(--allow-pickle\)"):
        tsckpt.convert(src, str(tmp_path / "out"))
    from tsckpt._cli import main

    assert main(["convert", src, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-pickle" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="allow_pickle must be True or False"):
        tsckpt.convert(src, str(tmp_path / "out"), allow_pickle="yes")


def test_allow_pickle_reads_dcp_through_the_cli(tmp_path, state, capsys):
    src = str(tmp_path / "dcp")
    _save(state, src)
    from tsckpt._cli import main

    assert main(["convert", src, str(tmp_path / "out"), "--allow-pickle"]) == 0
    assert_same(tsckpt.restore(str(tmp_path / "out"), as_saved=True), _expected(state))


def test_a_planted_metadata_file_does_not_make_a_safetensors_directory_dcp(tmp_path):
    from safetensors.torch import save_file

    from tsckpt._formats.sources import detect

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.arange(4.0)}, str(hf / "model.safetensors"))
    marker = tmp_path / "ran"
    _plant(hf, marker)
    assert detect(str(hf)) == "safetensors"
    r = tsckpt.convert(str(hf), str(tmp_path / "out"), allow_pickle=True)
    assert r.src_format == "safetensors" and not marker.exists()
    assert torch.equal(tsckpt.restore(str(tmp_path / "out"), as_saved=True)["w"], torch.arange(4.0))


# ---- what the unpickled metadata may say -----------------------------------------------------


def _storage(d):
    return dcp.FileSystemReader(d).read_metadata().storage_data


def test_a_data_file_outside_the_directory_is_refused(tmp_path):
    src = str(tmp_path / "dcp")
    _save({"w": torch.arange(4.0)}, src)
    data = _data_file(src)
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(open(data, "rb").read())
    for rel in (str(outside), "../outside.distcp"):
        (index, info), = _storage(src).items()
        _rewrite_metadata(src, storage_data={index: dataclasses.replace(info, relative_path=rel)})
        with pytest.raises(CorruptCheckpointError) as e:
            read_dcp(src, allow_pickle=True)
        assert str(e.value) == (
            f"{src}/.metadata: storage_data['w'].relative_path {short_repr(rel)} is not a relative path inside the "
            "checkpoint; the checkpoint is damaged or made to read elsewhere: use a trusted copy"
        )
    (index, info), = _storage(src).items()
    _rewrite_metadata(src, storage_data={index: dataclasses.replace(info, relative_path=os.path.basename(data))})
    os.rename(data, str(outside))
    os.symlink(str(outside), data)
    with pytest.raises(LinkRefusedError, match=r"relative_path '__0_0.distcp': __0_0.distcp is a symbolic link \(to "):
        read_dcp(src, allow_pickle=True)


def test_a_linked_metadata_file_is_refused(tmp_path):
    src = str(tmp_path / "dcp")
    _save({"w": torch.arange(4.0)}, src)
    meta = os.path.join(src, ".metadata")
    os.rename(meta, str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), meta)
    with pytest.raises(LinkRefusedError, match=r"the DCP metadata file '.metadata': .metadata is a symbolic link"):
        read_dcp(src, allow_pickle=True)


def test_chunks_that_overlap_leaving_a_hole_are_refused(tmp_path):
    """Chunk volumes that add up to the shape but overlap leave a hole, which would read as
    uninitialized memory."""
    src = str(tmp_path / "dcp")
    _two_chunk_checkpoint(src, torch.randn(5, 6))
    md = dcp.FileSystemReader(src).read_metadata()
    w = md.state_dict_metadata["w"]
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])), ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([3, 6]))]
    storage = dict(zip([MetadataIndex("w", [0, 0]), MetadataIndex("w", [1, 0])], md.storage_data.values()))
    _rewrite_metadata(src, state_dict_metadata={"w": TensorStorageMetadata(w.properties, w.size, chunks)},
                      storage_data=storage)
    with pytest.raises(CorruptCheckpointError) as e:
        read_dcp(src, allow_pickle=True)
    assert str(e.value) == (
        f"{src}/.metadata: entry 'w'.chunks: they do not tile the shape [5, 6] exactly (overlap or holes); "
        "the checkpoint is damaged: re-save it"
    )


def test_a_chunk_larger_than_its_stored_bytes_is_refused_before_allocating(tmp_path, monkeypatch):
    src = str(tmp_path / "dcp")
    _save({"w": torch.arange(4.0)}, src)
    md = dcp.FileSystemReader(src).read_metadata()
    w = md.state_dict_metadata["w"]
    huge = torch.Size([1 << 40])
    _rewrite_metadata(src, state_dict_metadata={
        "w": TensorStorageMetadata(w.properties, huge, [ChunkStorageMetadata(torch.Size([0]), huge)])})
    monkeypatch.setattr(dcp_mod._RegionReader, "_run", lambda *a: pytest.fail("read data of a damaged checkpoint"))
    with pytest.raises(CorruptCheckpointError) as e:
        read_dcp(src, allow_pickle=True)
    length = md.storage_data[MetadataIndex("w", [0])].length
    assert str(e.value) == (
        f"{src}/.metadata: storage_data['w'].length: {length} bytes hold less than the chunk at [0] needs "
        f"({4 << 40} bytes); the checkpoint is damaged: re-save it"
    )


@pytest.mark.parametrize(
    ("change", "field", "found"),
    [
        (lambda md: {"size": torch.Size([-1])}, "entry 'w'.size", "expected a shape under 2**59 elements"),
        (lambda md: {"size": torch.Size([1 << 60])}, "entry 'w'.size", "expected a shape under 2**59 elements"),
        (lambda md: {"properties": dataclasses.replace(md.properties, dtype="float32")}, "entry 'w'.properties.dtype",
         "expected a torch dtype tsckpt stores, found 'float32'"),
        (lambda md: {"chunks": [ChunkStorageMetadata(torch.Size([2]), torch.Size([4]))]}, "entry 'w'.chunks[0]",
         "expected offsets and sizes inside the shape [4]"),
        (lambda md: {"chunks": None}, "entry 'w'.chunks", "expected a list, found NoneType"),
    ],
)
def test_malformed_tensor_entries_are_named(tmp_path, change, field, found):
    src = str(tmp_path / "dcp")
    _save({"w": torch.arange(4.0)}, src)
    w = dcp.FileSystemReader(src).read_metadata().state_dict_metadata["w"]
    _rewrite_metadata(src, state_dict_metadata={"w": dataclasses.replace(w, **change(w))})
    with pytest.raises(CorruptCheckpointError) as e:
        read_dcp(src, allow_pickle=True)
    assert str(e.value).startswith(f"{src}/.metadata: {field}: {found}") and "\n" not in str(e.value)


def test_nest_takes_keys_depth_first_and_int_components_as_list_indices():
    leaves = {"a.x": 1, "b": 2, "a.y": 3, "l.1": "second", "l.0": "first"}
    paths = {"a.x": ("a", "x"), "b": ("b",), "a.y": ("a", "y"), "l.1": ("l", 1), "l.0": ("l", 0)}
    assert dcp_mod.nest(leaves, paths) == {"a": {"x": 1, "y": 3}, "b": 2, "l": ["first", "second"]}
    assert dcp_mod.nest(leaves, None) == leaves  # no key paths: the flat keys
    assert dcp_mod.key_paths_problem(paths) is None
    assert "not a key path" in dcp_mod.key_paths_problem({"a": ["a"]})
    assert "expected a dict" in dcp_mod.key_paths_problem([("a",)])


def test_an_optimizers_int_keys_stored_by_dcp_as_digits_come_back_as_ints(tmp_path):
    """DCP writes every mapping key as str(key): an optimizer's state, keyed 0, 1... in its
    state_dict, reads back keyed by int, so it restores into that state_dict, loads into the
    optimizer, and diffs equal against tsckpt's own save of it."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(4)
    opt.step()
    state = {"optim": opt.state_dict(), "names": {"7": 1.0, "07": 2.0}}
    _save(state, str(tmp_path / "dcp"))
    tsckpt.save(tmp_path / "ts", state)
    got = tsckpt.restore(tmp_path / "dcp", allow_pickle=True)
    assert list(got["optim"]["state"]) == [0] and got["names"] == {7: 1.0, "07": 2.0}  # "07": not an int's digits
    into = tsckpt.restore(tmp_path / "dcp", {"optim": opt.state_dict()}, strict=False, allow_pickle=True)
    assert torch.equal(into["optim"]["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1, momentum=0.9)
    fresh.load_state_dict({**got["optim"], "state": {0: {"momentum_buffer": torch.from_numpy(got["optim"]["state"][0]["momentum_buffer"])}}})
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"], torch.ones(4))
    report = tsckpt.diff(tmp_path / "ts", tmp_path / "dcp", paths=["optim"], allow_pickle=True)
    assert report.equal, [(leaf.path, leaf.status) for leaf in report.leaves]
