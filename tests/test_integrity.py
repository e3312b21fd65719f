"""restore detects damaged checkpoints, one kind of damage at a time, and names the leaf."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._ondisk.checkpoint as _checkpoint
import tsckpt._ondisk.chunking as chunking
from tsckpt._ondisk.records import ROOT_KEY
from tests.stored import chunk_keys, delete_prefix, read_key, write_key


@pytest.fixture
def ck(tmp_path, monkeypatch, layout):
    """A checkpoint whose big leaf spans several shard files, each of several inner chunks,
    and whose small leaf is a single plain chunk; in each layout (damage is done to the
    stored chunk keys: files in the plain layout, keys of the database in the compact one)."""
    monkeypatch.setattr(chunking, "INNER_CHUNK_BYTES", 1024)
    monkeypatch.setattr(chunking, "SHARD_BYTES", 4096)
    tree = {
        "layer": {"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)},
        "bias": np.arange(10, dtype=np.int64),
        "step": 3,
    }
    path = tmp_path / "ck"
    tsckpt.save(path, tree, layout=layout)
    return path


def _chunks(ck: Path, leaf: str) -> list[str]:
    return [f"{leaf}/c{k}" for k in chunk_keys(ck, leaf)]


def _restore_fails(ck: Path, leaf: str, what: str) -> str:
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(ck)
    msg = str(info.value)
    assert msg.startswith(f"'{leaf}' in {ck}: "), msg
    assert what in msg, msg
    return msg


def test_layout_of_the_fixture(ck):
    assert len(_chunks(ck, "layer/w")) == 2  # 8 KiB in 4 KiB shards
    assert len(_chunks(ck, "bias")) == 1
    meta = tsckpt.metadata(ck)["layer"]["w"]
    assert meta.shard_shape == (32, 32) and meta.chunk_shape == (8, 32)


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
def test_flipped_byte_anywhere(ck, leaf):
    for key in _chunks(ck, leaf):
        data = read_key(ck, key)
        # chunk data at the start and middle, and the shard index (with its crc) at the end
        for pos in sorted({0, len(data) // 2, len(data) - 1, len(data) - 5}):
            damaged = bytearray(data)
            damaged[pos] ^= 0x10
            write_key(ck, key, bytes(damaged))
            _restore_fails(ck, leaf, "checksum mismatch: stored bytes were altered")
            write_key(ck, key, data)
    out = tsckpt.restore(ck)  # repaired: reads again
    assert out["bias"].tolist() == list(range(10))


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
def test_missing_chunk_file(ck, leaf):
    for key in _chunks(ck, leaf):
        data = read_key(ck, key)
        write_key(ck, key, None)
        _restore_fails(ck, leaf, "a chunk file is missing")
        write_key(ck, key, data)


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
@pytest.mark.parametrize("keep", [0, 0.5, -1])
def test_truncated_file(ck, leaf, keep):
    key = _chunks(ck, leaf)[-1]
    data = read_key(ck, key)
    n = {0: 0, 0.5: len(data) // 2, -1: len(data) - 1}[keep]
    write_key(ck, key, data[:n])
    msg = _restore_fails(ck, leaf, "; restore from another checkpoint")
    # a shard's index sits at its end, so a cut shard fails the index checksum
    assert "checksum mismatch" in msg or "could not be decoded (truncated or damaged file)" in msg, msg


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
def test_missing_array(ck, leaf):
    delete_prefix(ck, f"{leaf}/")
    _restore_fails(ck, leaf, f"the array is missing ({leaf}/zarr.json does not exist)")


def _edit(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def _record(root: dict, leaf: str) -> dict:
    return next(a for a in root["attributes"]["tsckpt"]["arrays"] if a["path"] == leaf)


@pytest.mark.parametrize(
    "leaf, field, value, detail",
    [
        ("layer/w", "shape", [32, 32], 'Expected "shape" of [32,32] but received: [64,32]'),
        ("bias", "shape", [5], 'Expected "shape" of [5] but received: [10]'),
        ("bias", "dtype", "float64", 'Expected "data_type"'),  # same itemsize: would misread silently
        ("layer/w", "dtype", "int32", 'Expected "data_type"'),
        ("layer/w", "chunk_shape", [16, 32], "chunk_shape"),
    ],
)
def test_root_metadata_disagrees_with_the_array(ck, leaf, field, value, detail):
    _edit(ck / ROOT_KEY, lambda root: _record(root, leaf).__setitem__(field, value))
    msg = _restore_fails(ck, leaf, f"{leaf}/zarr.json does not match the root metadata")
    assert detail in msg


def test_array_metadata_disagrees_with_the_root(ck):
    node = json.loads(read_key(ck, f"layer/w/{ROOT_KEY}"))
    node["shape"] = [128, 32]
    write_key(ck, f"layer/w/{ROOT_KEY}", json.dumps(node).encode())
    _restore_fails(ck, "layer/w", 'Expected "shape" of [64,32] but received: [128,32]')


def test_a_node_rewritten_after_a_restore_found_it_right_is_still_caught(ck):
    """Stored nodes found right are remembered by their bytes (records alike skip the parse):
    a node rewritten since, to another dtype of the same size, is parsed and refused."""
    tsckpt.restore(ck)  # every node found right, and remembered
    node = json.loads(read_key(ck, f"bias/{ROOT_KEY}"))
    assert node["data_type"] == "int64"
    node["data_type"] = "float64"
    write_key(ck, f"bias/{ROOT_KEY}", json.dumps(node).encode())
    msg = _restore_fails(ck, "bias", "bias/zarr.json does not match the root metadata")
    assert "data_type" in msg


def test_detected_with_a_target_and_by_the_lazy_reader(ck):
    key = _chunks(ck, "layer/w")[0]
    data = bytearray(read_key(ck, key))
    data[3] ^= 1
    write_key(ck, key, bytes(data))
    target = {"layer": {"w": torch.zeros(64, 32)}, "bias": np.zeros(10, dtype=np.int64), "step": 0}
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'layer/w' in .*checksum mismatch"):
        tsckpt.restore(ck, target)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'layer/w' in .*checksum mismatch"):
        tsckpt.restore(ck, target, inplace=True)
    reader = tsckpt.open(ck)
    assert reader["layer/w"][40:48].shape == (8, 32)  # other shard file: intact
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'layer/w' in .*checksum mismatch"):
        reader["layer/w"][0:8]
    delete_prefix(ck, "bias/")
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"'bias' in .*the array is missing \(bias/zarr.json"):
        tsckpt.open(ck)["bias"][:]


@pytest.mark.no_checkpoint_root  # the root is damaged: no layout to read
def test_damaged_root_metadata(ck):
    (ck / ROOT_KEY).write_bytes((ck / ROOT_KEY).read_bytes()[:40])
    with pytest.raises(tsckpt.CorruptCheckpointError, match="root zarr.json is not valid JSON"):
        tsckpt.restore(ck)


def test_flipped_byte_in_a_memory_store():
    loc = "memory://integrity/ck"
    tsckpt.save(loc, {"w": np.arange(100, dtype=np.float32)})
    kv = tsckpt._storage.locations.resolve(loc).kvstore()
    key = next(k for k in kv.list().result() if k.startswith(b"w/c."))
    data = bytearray(kv.read(key).result().value)
    data[7] ^= 0x01
    kv.write(key, bytes(data)).result()
    with pytest.raises(tsckpt.CorruptCheckpointError, match="^'w' in memory://integrity/ck/: checksum mismatch"):
        tsckpt.restore(loc)


# bias/c.0 as written: its 10 int64, then their crc32c
_BIAS_SIZES = "the 84 bytes its record gives it (the chunk's 80 bytes, then their 4-byte crc32c)"


@pytest.mark.parametrize("codec", ["auto", "tensorstore"])
@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_an_unsharded_chunk_file_of_another_size(ck, layout, monkeypatch, codec, change):
    """Bytes after a chunk file's crc32c, which TensorStore reads past and zarr readers refuse,
    or a file cut short: the restore names the leaf, the file and both sizes, whichever codec
    reads (TSCKPT_CODEC), as does the lazy reader."""
    if codec == "tensorstore" and layout == "compact" and change == "longer":
        pytest.skip("TensorStore reads the compact layout's database, which shows no file's size (verify reads past it)")
    monkeypatch.setenv("TSCKPT_CODEC", codec)
    data = read_key(ck, "bias/c.0")
    assert data is not None and len(data) == 84
    write_key(ck, "bias/c.0", data + b"\0" * 4 if change == "longer" else data[:-1])
    detail = {
        "longer": f"bias/c.0 is 88 bytes, 4 more than {_BIAS_SIZES}; zarr readers refuse bytes after the crc32c",
        "shorter": f"bias/c.0 is 83 bytes, 1 fewer than {_BIAS_SIZES}",
    }[change]
    msg = _restore_fails(ck, "bias", "stored data could not be decoded (truncated or damaged file)")
    if codec == "tensorstore" and layout == "compact":  # TensorStore's own words for the short value
        assert 'Error reading "bias/c.0" in OCDBT database' in msg and "Unexpected end of input" in msg, msg
        return
    assert msg == (
        f"'bias' in {ck}: stored data could not be decoded (truncated or damaged file); restore from another "
        f"checkpoint. ({detail})"
    )
    if layout == "plain":  # the lazy reader copies through TensorStore here (the mapped read refuses the file)
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            tsckpt.open(ck)["bias"][:]
        assert str(info.value) == msg
    write_key(ck, "bias/c.0", data)
    assert tsckpt.restore(ck)["bias"].tolist() == list(range(10))


@pytest.mark.parametrize("codec", ["auto", "tensorstore"])
def test_bytes_after_a_shard_index(ck, monkeypatch, codec):
    """A shard file's index is its last bytes (zarr's sharding codec, index at the end), so
    bytes appended after it are read as the index, which fails its crc32c, as zarr readers find."""
    monkeypatch.setenv("TSCKPT_CODEC", codec)
    key = _chunks(ck, "layer/w")[0]
    write_key(ck, key, read_key(ck, key) + b"\0" * 4)
    _restore_fails(ck, "layer/w", "checksum mismatch: stored bytes were altered")
    assert tsckpt.verify(ck, progress=False).bad["layer/w"].startswith("checksum mismatch: stored bytes were altered")


def test_a_chunk_file_of_another_size_among_files_walked(ck, layout, monkeypatch):
    """An array whose files TensorStore's read finds by walking its directory (more than it
    opens by name) has their sizes checked too."""
    if layout == "compact":
        pytest.skip("the compact layout's files are the database's")
    monkeypatch.setattr(_checkpoint, "_NAMED_FILES", 0)
    monkeypatch.setenv("TSCKPT_CODEC", "tensorstore")
    write_key(ck, "bias/c.0", read_key(ck, "bias/c.0") + b"\0")
    _restore_fails(ck, "bias", f"(bias/c.0 is 85 bytes, 1 more than {_BIAS_SIZES}; zarr readers refuse")


def test_a_damaged_chunk_is_named_where_it_is_not_where_tensorstore_read_it(tmp_path):
    """TensorStore reads a local checkpoint through a private directory of links
    (tsckpt/_storage/mirror.py); its messages name the checkpoint's own file."""
    d = tmp_path / "ck"
    tsckpt.save(d, {"x": np.arange(100 * 1000, dtype=np.float32).reshape(100, 1000)})
    (f,) = sorted((d / "x").glob("c*"))[:1]
    data = bytearray(f.read_bytes())
    data[10] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(tsckpt.CorruptCheckpointError) as e:
        tsckpt.open(d)["x"][2:5, 3:9]
    assert f'Error reading local file "{f}"' in str(e.value) and "tsckpt-read-" not in str(e.value)
    assert f'"{f}"' in tsckpt.verify(d).bad["x"]
