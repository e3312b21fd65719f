"""tsckpt.verify(): the library's full check, reported per leaf (the CLI prints it)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._read.reader import read_subtree
from tests.stored import array_store


@pytest.fixture
def ck(tmp_path, small_chunks):
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"m": {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(3)}, "n": 1, "s": np.int8(2)})
    return path


def test_healthy_checkpoint(ck):
    r = tsckpt.verify(ck, progress=False)
    assert r.ok and r.bad == {} and r.group_problems == ()
    assert (r.n_arrays, r.n_values, r.leaves) == (3, 1, ("m/b", "m/w", "n", "s"))
    assert r.bytes_read == 4096 * 4 + 3 * 4 + 1
    assert r.files_read == 4 + 1 + 1  # 16 KiB of w in 4 KiB shards


def test_every_damaged_leaf_is_listed(ck):
    with open(os.path.join(ck, "m/w/c/1/0"), "r+b") as f:
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    os.remove(os.path.join(ck, "m/b/c.0"))
    node = os.path.join(ck, "s/zarr.json")
    meta = json.load(open(node))
    meta["shape"] = [5]
    json.dump(meta, open(node, "w"))
    os.remove(os.path.join(ck, "m/zarr.json"))
    r = tsckpt.verify(ck)
    assert not r.ok
    assert list(r.bad) == ["m/b", "m/w", "s"]
    assert r.bad["m/w"].startswith("checksum mismatch: stored bytes were altered")
    assert r.bad["m/b"].startswith("a chunk file is missing")
    assert r.bad["s"] == "its zarr.json disagrees with the root metadata on 'shape' ([5] != [])"
    assert r.group_problems == ("group 'm': zarr.json is missing or not a zarr group node",)


def test_an_uncommitted_checkpoint_raises(tmp_path):
    with pytest.raises(tsckpt.CheckpointNotFoundError):
        tsckpt.verify(str(tmp_path / "nothing"))


def test_restore_as_saved_gives_each_kind_back(tmp_path):
    path = str(tmp_path / "ck")
    tree = {"t": torch.arange(3, dtype=torch.bfloat16), "a": np.arange(2), "s": np.float32(1.5), "v": 3}
    tsckpt.save(path, tree)
    plain = tsckpt.restore(path)
    assert isinstance(plain["t"], np.ndarray) and plain["t"].dtype.name == "bfloat16"
    saved = tsckpt.restore(path, as_saved=True)
    assert isinstance(saved["t"], torch.Tensor) and saved["t"].dtype == torch.bfloat16
    assert torch.equal(saved["t"], tree["t"])
    assert isinstance(saved["a"], np.ndarray) and np.array_equal(saved["a"], tree["a"])
    assert type(saved["s"]) is np.float32 and saved["s"] == 1.5 and saved["v"] == 3


def test_subtree_reads_one_branch_with_its_containers(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"opt": {"groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "state": {"w": np.ones(2)}}, "x": 1})
    ck = tsckpt.open(path).checkpoint
    assert read_subtree(ck, "opt/groups") == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    state = read_subtree(ck, "opt/state")
    assert list(state) == ["w"] and np.array_equal(state["w"], np.ones(2))
    assert read_subtree(ck, "opt/missing") is None


def test_a_symlinked_chunk_file_is_reported(ck, tmp_path, capsys):
    """The link points at a copy of the very bytes, outside the checkpoint: the data reads
    back fine, but the checkpoint no longer holds its own files."""
    chunk = os.path.join(ck, "m", "b", "c.0")
    outside = tmp_path / "elsewhere"
    outside.write_bytes(open(chunk, "rb").read())
    os.remove(chunk)
    os.symlink(outside, chunk)
    r = tsckpt.verify(ck, progress=False)
    assert not r.ok and list(r.bad) == ["m/b"]
    assert r.bad["m/b"] == (
        f"m/b/c.0 is a symbolic link (to {outside}); tsckpt does not follow symbolic links in a checkpoint, which "
        "must hold its own files (a link could lead anywhere; docs/security.md): replace each link with a copy of "
        "its file"
    )
    from tsckpt._cli import main

    assert main(["verify", ck]) == 1
    assert "FAIL  m/b: m/b/c.0 is a symbolic link" in capsys.readouterr().out


def _edit_root(path, fn):
    with open(os.path.join(path, "zarr.json")) as f:
        root = json.load(f)
    fn(root["attributes"]["tsckpt"])
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(root, f)


def test_every_bad_leaf_of_the_root_metadata_is_reported(tmp_path):
    """A bad record no longer aborts the whole check: each bad entry is named, the rest is read."""
    path = str(tmp_path / "ck")
    w = torch.ones(4)
    tsckpt.save(path, {"a": torch.zeros(2), "b": np.arange(3), "w": w, "x": w, "lr": 0.5, "n": 3, "ok": np.ones(2)})

    def damage(meta):
        rec = {r["path"]: r for r in meta["arrays"]}
        rec["a"]["dtype"] = "float128x"
        rec["w"]["shape"] = [-4]
        meta["values"]["lr"] = {"type": "float", "value": 0.5, "bits": "zz"}
        meta["values"]["n"] = {"type": "int", "value": "3"}
        meta["arrays"].remove(rec["b"])

    _edit_root(path, damage)
    r = tsckpt.verify(path, progress=False)
    assert not r.ok and r.tree_problem is None
    assert r.bad == {
        "a": "the record of array 'a' in the root metadata is invalid: 'dtype' 'float128x' is not a dtype this "
        "tsckpt reads (written by a newer tsckpt?)",
        "b": "leaves ['b'] are listed but have no record",
        "lr": "the value of 'lr' in the root metadata is invalid: 'bits' of a float must be 16 hex digits, found 'zz'",
        "n": "the value of 'n' in the root metadata is invalid: 'value' must be an integer for type 'int', found '3'",
        "w": "the record of array 'w' in the root metadata is invalid: 'shape' [-4] is not a list of non-negative "
        "integers with a product under 2**59",
        "x": "aliases ['x -> w'] name an array whose record is invalid",
    }
    assert r.n_arrays == 3 and r.files_read == 1  # records of a, w and ok; the intact one was read
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:  # restore refuses, naming the first and how many
        tsckpt.restore(path)
    assert str(info.value).startswith(f"{path}: the record of array 'a' in the root metadata is invalid: 'dtype'")
    assert str(info.value).endswith("(also bad: 5 ('w', 'lr', 'n', 'x', 'b'))")


def test_a_tree_that_does_not_give_the_listed_leaves_is_reported(ck):
    """Swapped leaves gave each leaf the other's value; verify and restore now refuse them."""
    _edit_root(ck, lambda meta: meta["leaves"].__setitem__(slice(0, 2), meta["leaves"][1::-1]))
    r = tsckpt.verify(ck, progress=False)
    assert not r.ok and r.bad == {}
    assert r.tree_problem == (
        "the tree structure in the root metadata is invalid: its leaf 'm/b' is listed in 'leaves' as 'm/w'"
    )
    with pytest.raises(tsckpt.CorruptCheckpointError, match="its leaf 'm/b' is listed in 'leaves' as 'm/w'"):
        tsckpt.restore(ck)


def test_a_record_larger_than_its_files_is_reported_per_leaf(ck, monkeypatch):
    import tsckpt._ondisk.backing as backing

    monkeypatch.setattr(backing, "UNCHECKED_BYTES", 0)

    def damage(meta):
        rec = next(r for r in meta["arrays"] if r["path"] == "m/b")
        rec["shape"] = rec["shard_shape"] = [10**15]

    _edit_root(ck, damage)
    node = os.path.join(ck, "m/b/zarr.json")
    meta = json.load(open(node))
    meta["shape"] = [10**15]
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [10**15]
    json.dump(meta, open(node, "w"))
    r = tsckpt.verify(ck, progress=False)
    assert list(r.bad) == ["m/b"] and r.bad["m/b"].startswith(
        "m/b/c.0 holds fewer than the 4000000000000004 bytes that its record's 'shape' [1000000000000000], "
        "'shard_shape' [1000000000000000], 'chunk_shape' None and 'dtype' 'float32' give it"
    )
    assert r.files_read == 4 + 1  # the other arrays were read


def test_an_entry_for_no_listed_leaf_is_bad(ck):
    """verify read such a record while restore ignored it: the two must agree."""

    def damage(meta):
        extra = dict(next(r for r in meta["arrays"] if r["path"] == "m/b"), path="m/extra")
        meta["arrays"].append(extra)
        meta["values"]["ghost"] = {"type": "int", "value": 1}

    _edit_root(ck, damage)
    r = tsckpt.verify(ck, progress=False)
    assert r.bad == {
        "ghost": "'ghost' has an entry in the root metadata but is not listed in 'leaves'",
        "m/extra": "'m/extra' has an entry in the root metadata but is not listed in 'leaves'",
    }
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'m/extra' has an entry in the root metadata but is not listed"):
        tsckpt.restore(ck)


@pytest.mark.parametrize("codec", ["auto", "tensorstore"])  # verify reads through TensorStore either way
@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_chunk_file_of_another_size_is_reported(tmp_path, layout, monkeypatch, codec, change):
    """An unsharded chunk file with bytes after its crc32c (TensorStore reads past them, zarr
    readers refuse the file) or cut short is reported with the file and both sizes: on a local
    plain checkpoint from the size the file had when opened, in the compact layout's database
    by a read just past its size."""
    monkeypatch.setenv("TSCKPT_CODEC", codec)
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"b": torch.ones(3), "n": np.arange(4)}, layout=layout)
    store = array_store(path)
    data = store.read("b/c.0").result().value
    store.write("b/c.0", data + b"\0" * 4 if change == "longer" else data[:-1]).result()
    r = tsckpt.verify(path, progress=False)
    assert not r.ok and list(r.bad) == ["b"]
    assert r.files_read == (1 if layout == "plain" else 2)  # plain: b refused at its open; compact: read, then found
    sizes = "the 16 bytes its record gives it (the chunk's 12 bytes, then their 4-byte crc32c)"
    if change == "shorter" and layout == "compact":  # TensorStore's read says it
        assert r.bad["b"].startswith("stored data could not be decoded (truncated or damaged file) (DATA_LOSS: ")
        return
    detail = {
        ("longer", "plain"): f"b/c.0 is 20 bytes, 4 more than {sizes}; zarr readers refuse bytes after the crc32c",
        ("longer", "compact"): f"b/c.0 holds more than {sizes}; zarr readers refuse bytes after the crc32c",
        ("shorter", "plain"): f"b/c.0 is 15 bytes, 1 fewer than {sizes}",
    }[change, layout]
    assert r.bad["b"] == f"stored data could not be decoded (truncated or damaged file) ({detail})"
    store.write("b/c.0", data).result()
    assert tsckpt.verify(path, progress=False).ok
