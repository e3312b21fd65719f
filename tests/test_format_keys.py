"""Chunk keys (docs/format.md, "Chunk keys"): an array stored as one file names it with the
'.' separator (``c.0.0`` beside its zarr.json, no ``c/`` directory), from format version 3;
checkpoints of older versions ('/' everywhere) still restore, verify, diff and share; zarr-python
and TensorStore read both."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorstore as ts
import torch

import tsckpt
from tests.stored import array_store
from tsckpt._codec import files as codec_files
from tsckpt._ondisk.arrays import chunk_key, same_cell_key, stored_files
from tsckpt._ondisk.records import FORMAT_VERSION, ArrayRecord, Chunking
from tsckpt._storage.faults import leaf_of_key

zarr = pytest.importorskip("zarr")
import tsckpt_zarr  # noqa: E402


def _tree() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "m": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)},
        "big": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32),  # several files (small_chunks)
        "s": torch.tensor(2.5),
        "h": torch.randn(5, generator=g).to(torch.bfloat16),
        "z": torch.randn(3, generator=g).to(torch.complex32),
        "e": torch.zeros(0, 4),
        "step": 7,
    }


def _entries(directory, leaf: str) -> list[str]:
    """Every file and directory below array ``leaf``, relative to it."""
    base = os.path.join(directory, *leaf.split("/"))
    out = []
    for d, dirs, files in os.walk(base):
        out += [os.path.relpath(os.path.join(d, n), base) + ("/" if n in dirs else "") for n in dirs + files]
    return sorted(out)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, dict):
            _same(v, b[k])
        elif isinstance(v, torch.Tensor):
            got = torch.as_tensor(b[k])
            if v.dtype == torch.complex32:  # no equal for it: compare the float16 pairs
                got, v = got.view(torch.float16), v.view(torch.float16)
            assert torch.equal(got, v), k
        else:
            assert v == b[k], k


def _root(directory) -> dict:
    with open(os.path.join(directory, "zarr.json")) as f:
        return json.load(f)


def _write_root(directory, root: dict) -> None:
    with open(os.path.join(directory, "zarr.json"), "w") as f:
        json.dump(root, f)


def to_slash_keys(directory) -> None:
    """Rewrite a plain checkpoint of this tsckpt as a writer before format 3 wrote it, by hand:
    each one-file array's ``c.0.0`` moved to ``c/0/0`` (a rename keeps its inode and mtime),
    its zarr.json's separator '/', the content hashes' keys renamed, format version 1."""
    root = _root(directory)
    meta = root["attributes"]["tsckpt"]
    renamed = {}
    for rec in meta["arrays"]:
        node_path = os.path.join(directory, rec["path"], "zarr.json")
        with open(node_path) as f:
            node = json.load(f)
        if node["chunk_key_encoding"]["configuration"]["separator"] == "/":
            continue
        node["chunk_key_encoding"]["configuration"]["separator"] = "/"
        with open(node_path, "w") as f:
            json.dump(node, f)
        for name in os.listdir(os.path.join(directory, rec["path"])):
            if name.startswith("c."):
                old, new = f"{rec['path']}/{name}", f"{rec['path']}/{name.replace('.', '/')}"
                os.makedirs(os.path.dirname(os.path.join(directory, new)), exist_ok=True)
                os.rename(os.path.join(directory, old), os.path.join(directory, new))
                renamed[old] = new
    if "content" in meta:
        meta["content"]["files"] = {renamed.get(k, k): v for k, v in meta["content"]["files"].items()}
    meta["format_version"] = 1
    _write_root(directory, root)


def older_writer(monkeypatch, directory, tree, layout: str) -> None:
    """Save ``tree`` with every chunk key '/'-separated and the version of that time (1 plain,
    2 compact), as tsckpt wrote before format 3 (the compact layout's keys live in its
    database, so they cannot be renamed by hand)."""
    with monkeypatch.context() as m:
        m.setattr(ArrayRecord, "separator", property(lambda self: "/"))
        tsckpt.save(directory, tree, layout=layout)
    codec_files._one_chunk_template.cache_clear()  # nodes made while patched
    root = _root(directory)
    root["attributes"]["tsckpt"]["format_version"] = {"plain": 1, "compact": 2}[layout]
    _write_root(directory, root)


# ---- what this tsckpt writes ----------------------------------------------------------


def test_one_file_arrays_name_their_file_with_dots(tmp_path, small_chunks):
    d = tmp_path / "ck"
    tsckpt.save(d, _tree())
    assert _root(d)["attributes"]["tsckpt"]["format_version"] == FORMAT_VERSION == 3
    assert _entries(d, "m/w") == ["c.0.0", "zarr.json"]
    assert _entries(d, "m/b") == ["c.0", "zarr.json"]
    assert _entries(d, "s") == ["c", "zarr.json"]  # a 0-d array's one key is "c" (zarr's default encoding)
    assert _entries(d, "h") == ["c.0", "zarr.json"]
    assert _entries(d, "z") == ["c.0.0", "zarr.json"]  # complex32: its (re, im) pairs dimension
    assert _entries(d, "e") == ["zarr.json"]  # a zero-length dimension: no file
    assert _entries(d, "big") == ["c/", "c/0/", "c/0/0", "c/1/", "c/1/0", "zarr.json"]  # unchanged: '/'
    seps = {leaf: json.loads((d / leaf / "zarr.json").read_text())["chunk_key_encoding"]["configuration"]["separator"]
            for leaf in ("m/w", "s", "e", "big")}
    assert seps == {"m/w": ".", "s": ".", "e": ".", "big": "/"}
    content = _root(d)["attributes"]["tsckpt"]["content"]["files"]
    assert sorted(content) == ["big/c/0/0", "big/c/1/0", "h/c.0", "m/b/c.0", "m/w/c.0.0", "s/c", "z/c.0.0"]
    _same(_tree(), tsckpt.restore(d, as_saved=True))


def test_the_compact_database_holds_the_same_keys(tmp_path, small_chunks):
    d = tmp_path / "ck"
    tsckpt.save(d, _tree(), layout="compact")
    keys = {k.decode() for k in array_store(d).list().result()}
    assert {"m/w/c.0.0", "m/b/c.0", "s/c", "big/c/0/0", "big/c/1/0"} <= keys
    assert not any(k.startswith("m/w/c/") for k in keys)
    _same(_tree(), tsckpt.restore(d, as_saved=True))


def test_keys_of_a_record():
    one = ArrayRecord("a/w", (4, 3), "float32", "numpy", Chunking((4, 3), None))
    old = ArrayRecord("a/w", (4, 3), "float32", "numpy", Chunking((4, 3), None), slash_keys=True)
    two = ArrayRecord("a/w", (8, 3), "float32", "numpy", Chunking((4, 3), None))
    assert (chunk_key(one, (0, 0)), chunk_key(old, (0, 0)), chunk_key(two, (4, 0))) == ("a/w/c.0.0", "a/w/c/0/0", "a/w/c/1/0")
    assert [k for k, _ in stored_files(one)] == ["a/w/c.0.0"] and [k for k, _ in stored_files(two)] == ["a/w/c/0/0", "a/w/c/1/0"]
    assert (same_cell_key("a/w/c.0.0", one, old), same_cell_key("a/w/c/0/0", old, one)) == ("a/w/c/0/0", "a/w/c.0.0")
    assert same_cell_key("a/w/c/1/0", two, two) == "a/w/c/1/0"
    scalar = ArrayRecord("s", (), "float32", "numpy", Chunking((), None))
    assert chunk_key(scalar, ()) == "s/c" == same_cell_key("s/c", scalar, dataclass_replace(scalar, slash_keys=True))
    assert ArrayRecord.from_json(one.to_json(), version=1).slash_keys and not ArrayRecord.from_json(one.to_json()).slash_keys


def dataclass_replace(rec: ArrayRecord, **kw) -> ArrayRecord:
    import dataclasses

    return dataclasses.replace(rec, **kw)


def test_leaf_of_key_reads_both_encodings():
    assert [leaf_of_key(k) for k in ("m/w/c.0.1", "m/w/c/0/1", "m/w/c", "m/w/zarr.json", "zarr.json", "m/w/c.x")] == [
        "m/w", "m/w", "m/w", "m/w", None, None,
    ]


# ---- older checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["plain by hand", "plain", "compact"])
def test_a_checkpoint_of_an_older_format_reads_as_before(tmp_path, monkeypatch, small_chunks, how):
    d = tmp_path / "old"
    if how == "plain by hand":
        tsckpt.save(d, _tree())
        to_slash_keys(d)
    else:
        older_writer(monkeypatch, d, _tree(), how)
    if how != "compact":
        assert _entries(d, "m/b") == ["c/", "c/0", "zarr.json"] and _entries(d, "s") == ["c", "zarr.json"]
    _same(_tree(), tsckpt.restore(d, as_saved=True))
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in _tree().items()}
    target["m"] = {k: torch.empty_like(v) for k, v in _tree()["m"].items()}
    _same(_tree(), tsckpt.restore(d, target, inplace=True))
    assert torch.equal(torch.as_tensor(tsckpt.open(d)["m/w"][2:5]), _tree()["m"]["w"][2:5])
    report = tsckpt.verify(d, progress=False)
    assert report.ok and report.files_read == 7  # every file found under its old key
    tsckpt.save(tmp_path / "new", _tree())
    assert tsckpt.diff(d, tmp_path / "new").equal


def test_an_older_file_damaged_is_still_reported(tmp_path):
    d = tmp_path / "old"
    tsckpt.save(d, {"w": torch.arange(10.0)})
    to_slash_keys(d)
    with open(d / "w" / "c" / "0", "r+b") as f:
        f.seek(5)
        f.write(b"\xff")
    with pytest.raises(tsckpt.CorruptCheckpointError, match="^'w' in .*: checksum mismatch"):
        tsckpt.restore(d)
    assert "checksum" in tsckpt.verify(d, progress=False).bad["w"]


def test_an_incremental_save_shares_an_older_bases_files_under_the_new_keys(tmp_path, small_chunks):
    base = tmp_path / "old"
    tsckpt.save(base, _tree())
    to_slash_keys(base)
    tsckpt.save(tmp_path / "new", _tree(), base=base)
    new = tmp_path / "new"
    assert os.stat(new / "m" / "w" / "c.0.0").st_ino == os.stat(base / "m" / "w" / "c" / "0" / "0").st_ino
    assert os.stat(new / "big" / "c" / "1" / "0").st_ino == os.stat(base / "big" / "c" / "1" / "0").st_ino
    assert _entries(new, "m/w") == ["c.0.0", "zarr.json"]
    assert tsckpt.verify(new, progress=False).ok
    _same(_tree(), tsckpt.restore(new, as_saved=True))


# ---- other readers ---------------------------------------------------------------------


@pytest.mark.parametrize("older", [False, True])
def test_zarr_python_and_tensorstore_read_both_encodings(tmp_path, small_chunks, older):
    d = tmp_path / "ck"
    tree = _tree()
    tsckpt.save(d, tree)
    if older:
        to_slash_keys(d)
    tsckpt_zarr.register()
    flat = {"m/w": tree["m"]["w"], "m/b": tree["m"]["b"], "big": tree["big"], "s": tree["s"], "e": tree["e"],
            "h": tree["h"]}
    for leaf, want in flat.items():
        expected = want.float().numpy() if want.dtype == torch.bfloat16 else want.numpy()
        got = zarr.open_array(str(d / leaf), mode="r")[...]
        np.testing.assert_array_equal(np.asarray(got, dtype=expected.dtype), expected, err_msg=leaf)
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{d}/{leaf}/"}}, read=True).result()
        np.testing.assert_array_equal(np.asarray(store.read().result(), dtype=expected.dtype), expected, err_msg=leaf)
