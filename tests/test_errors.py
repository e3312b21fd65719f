"""Every failure mode raises its own exception class with a message that says what happened."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tsckpt

TREE = {"x": np.arange(8 * 256, dtype=np.float32).reshape(8, 256), "small": np.arange(4, dtype=np.int16), "step": 1}


@pytest.fixture
def saved(ckdir, small_chunks):
    tsckpt.save(ckdir, TREE)
    return ckdir


def edit_root(d, fn):
    path = os.path.join(d, "zarr.json")
    with open(path) as f:
        root = json.load(f)
    fn(root["attributes"]["tsckpt"])
    with open(path, "w") as f:
        json.dump(root, f)


def snapshot(d):
    """Every file below ``d`` with its bytes and modification time."""
    out = {}
    for root, _, files in os.walk(d):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = (f.read(), os.stat(p).st_mtime_ns)
    return out


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_missing_directory(tmp_path):
    d = str(tmp_path / "nope")
    for fn in (tsckpt.restore, tsckpt.open, tsckpt.metadata):
        with pytest.raises(tsckpt.CheckpointNotFoundError) as ei:
            fn(d)
        assert str(ei.value) == f"{d}: no such directory; check the path"
        assert isinstance(ei.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        tsckpt.restore(d, {"x": torch.zeros(1)})


@pytest.mark.parametrize("content", ["empty", "file", "zarr_group"])
def test_directory_that_is_not_a_checkpoint(tmp_path, content):
    d = tmp_path / "other"
    d.mkdir()
    if content == "file":
        (d / "notes.txt").write_text("hello")
    if content == "zarr_group":  # a plain zarr v3 group, not written by tsckpt
        (d / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    with pytest.raises(tsckpt.NotACheckpointError) as ei:
        tsckpt.restore(str(d))
    if content == "zarr_group":
        assert "a zarr hierarchy but not a tsckpt checkpoint (no 'tsckpt' attributes in zarr.json)" in str(ei.value)
    else:
        assert str(ei.value).startswith(f"{d}: not a tsckpt checkpoint (no root zarr.json)")
    assert isinstance(ei.value, ValueError)


def test_root_zarr_json_that_is_not_json(saved):
    with open(os.path.join(saved, "zarr.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(tsckpt.CorruptCheckpointError, match="root zarr.json is not valid JSON"):
        tsckpt.restore(saved)


def test_uncommitted_checkpoint(saved):
    edit_root(saved, lambda m: m.update(state="pending"))
    for fn in (tsckpt.restore, tsckpt.open, tsckpt.metadata):
        with pytest.raises(tsckpt.CheckpointIncompleteError) as ei:
            fn(saved)
        msg = str(ei.value)
        assert msg.startswith(f"{saved}: this checkpoint was never committed (state 'pending')")
        assert "save again with overwrite=True" in msg
        assert isinstance(ei.value, RuntimeError)


def test_newer_format_version(saved):
    edit_root(saved, lambda m: m.update(format_version=999, library="tsckpt 9.0"))
    with pytest.raises(tsckpt.FormatVersionError) as ei:
        tsckpt.open(saved)
    assert str(ei.value) == (
        f"{saved}: written with format version 999 by tsckpt 9.0, but this tsckpt reads versions up to 3; upgrade tsckpt"
    )
    assert isinstance(ei.value, ValueError)


def test_format_version_missing_is_refused(saved):
    edit_root(saved, lambda m: m.pop("format_version"))
    with pytest.raises(tsckpt.FormatVersionError, match="format version None"):
        tsckpt.restore(saved)


def test_malformed_root_metadata(saved):
    edit_root(saved, lambda m: m.pop("arrays"))
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"root metadata is malformed \(KeyError: 'arrays'\)"):
        tsckpt.restore(saved)


def test_leaf_listed_without_record(saved):
    edit_root(saved, lambda m: m["leaves"].append("ghost"))
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"leaves \['ghost'\] are listed but have no record"):
        tsckpt.restore(saved)


def test_flipped_byte_in_a_chunk_file(saved):
    flip_byte(os.path.join(saved, "small", "c.0"), 3)
    with pytest.raises(tsckpt.CorruptCheckpointError) as ei:
        tsckpt.restore(saved)
    msg = str(ei.value)
    assert msg.startswith(f"'small' in {saved}: checksum mismatch: stored bytes were altered; restore from another checkpoint.")
    assert isinstance(ei.value, OSError)
    # the other leaves are intact
    np.testing.assert_array_equal(tsckpt.open(saved)["x"][...], TREE["x"])


def test_flipped_byte_in_a_sharded_chunk_file(saved):
    flip_byte(os.path.join(saved, "x", "c", "1", "0"), 1500)
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"^'x' in .*checksum mismatch"):
        tsckpt.restore(saved, TREE)


def test_flipped_byte_in_a_shard_index(saved):
    path = os.path.join(saved, "x", "c", "0", "0")
    flip_byte(path, os.path.getsize(path) - 10)
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"^'x' in .*checksum mismatch"):
        tsckpt.restore(saved)


@pytest.mark.parametrize("leaf, chunk, keep", [("small", "c.0", -3), ("x", "c/1/0", 100), ("x", "c/0/0", 0)])
def test_truncated_chunk_file(saved, leaf, chunk, keep):
    path = os.path.join(saved, leaf, *chunk.split("/"))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:keep])
    with pytest.raises(tsckpt.CorruptCheckpointError) as ei:
        tsckpt.restore(saved)
    msg = str(ei.value)
    assert msg.startswith(f"'{leaf}' in {saved}: ") and "restore from another checkpoint" in msg


@pytest.mark.parametrize("leaf, chunk", [("small", "c.0"), ("x", "c/1/0")])
def test_deleted_chunk_file(saved, leaf, chunk):
    os.remove(os.path.join(saved, leaf, *chunk.split("/")))
    with pytest.raises(tsckpt.CorruptCheckpointError) as ei:
        tsckpt.restore(saved)
    assert str(ei.value).startswith(f"'{leaf}' in {saved}: a chunk file is missing; restore from another checkpoint.")
    with pytest.raises(tsckpt.CorruptCheckpointError, match="a chunk file is missing"):
        tsckpt.open(saved)[leaf][...]


def test_target_tree_of_the_wrong_structure(saved):
    with pytest.raises(tsckpt.StructureMismatchError) as ei:
        tsckpt.restore(saved, [TREE["x"], TREE["small"]])
    assert str(ei.value) == (
        f"{saved}: target tree and checkpoint differ; missing from the checkpoint: 2 ('0', '1'); "
        "in the checkpoint but not in the target: 3 ('small', 'step', 'x'). "
        "Not one leaf of the target is in the checkpoint, so a restore would load nothing; "
        "check that this is the checkpoint meant, and the target its tree"
    )
    with pytest.raises(KeyError):
        tsckpt.restore(saved, {"x": {"nested": TREE["x"]}, "small": TREE["small"], "step": 1})


def test_save_over_existing_checkpoint_raises_and_touches_nothing(saved):
    before = snapshot(saved)
    assert "zarr.json" in before and "x/c/1/0" in before
    with pytest.raises(tsckpt.CheckpointExistsError) as ei:
        tsckpt.save(saved, {"y": torch.ones(3)})
    assert str(ei.value) == (
        f"{saved}: a checkpoint (or other data) already exists here; pass overwrite=True to replace it, "
        "or save to a new directory"
    )
    assert isinstance(ei.value, FileExistsError)
    assert snapshot(saved) == before
    np.testing.assert_array_equal(tsckpt.restore(saved)["x"], TREE["x"])


def test_save_into_a_directory_with_other_files_raises(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="already exists here"):
        tsckpt.save(str(d), {"a": 1})
    assert os.listdir(d) == ["keep.txt"] and (d / "keep.txt").read_text() == "precious"


def test_save_into_an_existing_empty_directory(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    tsckpt.save(str(d), {"a": 1})
    assert tsckpt.restore(str(d)) == {"a": 1}


def test_overwrite_replaces_everything(saved):
    tsckpt.save(saved, {"y": torch.arange(3)}, overwrite=True)
    assert sorted(os.listdir(saved)) == ["y", "zarr.json"]  # old leaves' files are gone
    back = tsckpt.restore(saved)
    assert list(back) == ["y"] and back["y"].tolist() == [0, 1, 2]


def test_overwrite_replaces_an_uncommitted_checkpoint(saved):
    edit_root(saved, lambda m: m.update(state="pending"))
    tsckpt.save(saved, {"z": 2}, overwrite=True)
    assert tsckpt.restore(saved) == {"z": 2}


def test_failed_save_leaves_no_committed_checkpoint(ckdir):
    with pytest.raises(tsckpt.LeafTypeError):
        tsckpt.save(ckdir, {"a": torch.ones(2), "b": object()})
    with pytest.raises(tsckpt.CheckpointNotFoundError):
        tsckpt.restore(ckdir)


def test_failed_overwrite_keeps_the_old_checkpoint_when_rejected_early(saved):
    before = snapshot(saved)
    with pytest.raises(tsckpt.LeafTypeError):
        tsckpt.save(saved, {"bad": object()}, overwrite=True)  # rejected while planning, before any I/O
    assert snapshot(saved) == before


def test_error_hierarchy():
    for cls, builtin in [
        (tsckpt.CheckpointNotFoundError, FileNotFoundError),
        (tsckpt.NotACheckpointError, ValueError),
        (tsckpt.CheckpointIncompleteError, RuntimeError),
        (tsckpt.CheckpointExistsError, FileExistsError),
        (tsckpt.FormatVersionError, ValueError),
        (tsckpt.StructureMismatchError, KeyError),
        (tsckpt.ShapeMismatchError, ValueError),
        (tsckpt.LeafTypeError, TypeError),
        (tsckpt.CorruptCheckpointError, OSError),
        (tsckpt.LinkRefusedError, PermissionError),
        (tsckpt.LayoutError, ValueError),
    ]:
        assert issubclass(cls, tsckpt.TsckptError) and issubclass(cls, builtin), cls


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.empty(3, device="meta"), "'model/w': a tensor on the meta device has no data to save; materialize"),
        (lambda: torch.eye(3).to_sparse(), "'model/w': a torch.sparse_coo tensor cannot be saved (tsckpt stores dense arrays)"),
        (lambda: torch.eye(3).to_sparse_csr(), "'model/w': a torch.sparse_csr tensor cannot be saved"),
    ],
    ids=["meta", "sparse_coo", "sparse_csr"],
)
@pytest.mark.parametrize("how", ["save", "save_async"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_unsavable_tensor_is_refused_before_anything_is_written(tmp_path, make, message, how):
    d = tmp_path / "ck"
    tree = {"model": {"w": make(), "b": torch.ones(2)}, "step": 1}
    with pytest.raises(tsckpt.LeafTypeError) as info:
        if how == "save":
            tsckpt.save(d, tree)
        else:
            tsckpt.save_async(d, tree).result()
    assert str(info.value).startswith(message)
    assert not d.exists()  # nothing claimed: a plain retry with a fixed tree works
    tree["model"]["w"] = torch.zeros(3)
    tsckpt.save(d, tree)
    assert tsckpt.restore(d)["model"]["w"].tolist() == [0.0, 0.0, 0.0]


def _set_record_field(field, value):
    def edit(meta):
        rec = next(a for a in meta["arrays"] if a["path"] == "x")
        rec[field] = value

    return edit


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("dtype", "float128x", "'dtype' 'float128x' is not a dtype this tsckpt reads (written by a newer tsckpt?)"),
        ("dtype", 7, "'dtype' 7 is not a dtype this tsckpt reads"),
        ("shape", [8, -256], "'shape' [8, -256] is not a list of non-negative integers"),
        ("shape", "8x256", "'shape' '8x256' is not a list of non-negative integers"),
        ("shape", [8, True], "'shape' [8, True] is not a list of non-negative integers"),
        ("shard_shape", [8], "'shard_shape' [8] is not a list of 2 positive integers"),
        ("shard_shape", [0, 256], "'shard_shape' [0, 256] is not a list of 2 positive integers"),
        ("chunk_shape", [3, 256], "'chunk_shape' [3, 256] does not divide 'shard_shape'"),
        ("kind", "pickle", "'kind' is 'pickle', expected one of ['torch', 'numpy', 'numpy_scalar']"),
    ],
)
def test_invalid_array_record_is_named_before_any_read(saved, field, value, why):
    edit_root(saved, _set_record_field(field, value))
    want = f"the record of array 'x' in the root metadata is invalid: {why}"
    for call in (tsckpt.restore, tsckpt.open, tsckpt.metadata):
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            call(saved)
        assert str(info.value).startswith(f"{saved}: {want}"), str(info.value)
    report = tsckpt.verify(saved)  # reports it, with every other bad leaf
    assert not report.ok and list(report.bad) == ["x"] and report.bad["x"].startswith(want)


@pytest.mark.parametrize("path", ["../outside", "/abs", "a//b", "a/./b", ""])
def test_record_path_outside_the_checkpoint_is_refused(saved, path):
    def edit(meta):
        rec = next(a for a in meta["arrays"] if a["path"] == "x")
        rec["path"] = path
        meta["leaves"] = [path if p == "x" else p for p in meta["leaves"]]

    edit_root(saved, edit)
    with pytest.raises(tsckpt.CorruptCheckpointError, match=f"'path' {path!r} is not a relative path inside the checkpoint"):
        tsckpt.restore(saved)


def test_invalid_record_through_the_cli_is_one_line(saved, capsys):
    from tsckpt._cli import main

    edit_root(saved, _set_record_field("dtype", "float128x"))
    assert main(["ls", saved]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the record of array 'x' in the root metadata is invalid: 'dtype'" in err[0]


def _nested_lists(depth: int) -> dict:
    node = {"type": "list", "children": [None]}
    for _ in range(depth - 1):
        node = {"type": "list", "children": [node]}
    return node


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda s: s.update(type="evil"), "it has a node of unknown type 'evil'"),
        (lambda s: s["children"].append(None), "it has a dict node whose keys do not match its 4 children"),
        (lambda s: (s.pop("order", None), s["keys"].append("extra"), s["children"].append(None)),
         "it has 4 leaves but the checkpoint lists 3"),
        (lambda s: s.update(order=[0, 0, 1]), "it has a dict node whose order is not a permutation of its children"),
        (lambda s: s.update(children="abc"), "it has a dict node without a list of children"),
        (lambda s: s["children"].__setitem__(0, _nested_lists(300)), "it is nested more than 200 levels deep"),
    ],
)
def test_invalid_structure_is_named_by_every_entry_point(saved, edit, why):
    edit_root(saved, lambda meta: edit(meta["structure"]))
    want = f"the tree structure in the root metadata is invalid: {why}"
    for call in (tsckpt.restore, tsckpt.open, tsckpt.metadata):
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            call(saved)
        assert str(info.value).startswith(f"{saved}: {want}"), str(info.value)
    report = tsckpt.verify(saved)
    assert not report.ok and report.bad == {} and report.tree_problem == want


def test_structure_nested_too_deep_to_parse(saved, capsys):
    path = os.path.join(saved, "zarr.json")
    with open(path) as f:
        text = f.read()
    depth = 100_000
    deep = '{"type":"list","children":[' * depth + "null" + "]}" * depth
    with open(path, "w") as f:
        f.write(text.replace('"structure":', f'"structure":{deep},"old_structure":', 1))
    with pytest.raises(tsckpt.CorruptCheckpointError, match="root zarr.json is not valid JSON"):
        tsckpt.restore(saved)
    from tsckpt._cli import main

    assert main(["verify", saved]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "root zarr.json is not valid JSON" in err[0]
