"""restore detects damaged checkpoints, one kind of damage at a time, and names the leaf."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._layout as layout
from tsckpt._format import ROOT_KEY


@pytest.fixture
def ck(tmp_path, monkeypatch):
    """A checkpoint whose big leaf spans several shard files, each of several inner chunks,
    and whose small leaf is a single plain chunk."""
    monkeypatch.setattr(layout, "INNER_CHUNK_BYTES", 1024)
    monkeypatch.setattr(layout, "SHARD_BYTES", 4096)
    tree = {
        "layer": {"w": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)},
        "bias": np.arange(10, dtype=np.int64),
        "step": 3,
    }
    path = tmp_path / "ck"
    tsckpt.save(path, tree)
    return path


def _files(ck: Path, leaf: str) -> list[Path]:
    return sorted(p for p in (ck / leaf / "c").rglob("*") if p.is_file())


def _restore_fails(ck: Path, leaf: str, what: str) -> str:
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(ck)
    msg = str(info.value)
    assert msg.startswith(f"'{leaf}' in {ck}: "), msg
    assert what in msg, msg
    return msg


def test_layout_of_the_fixture(ck):
    assert len(_files(ck, "layer/w")) == 2  # 8 KiB in 4 KiB shards
    assert len(_files(ck, "bias")) == 1
    meta = tsckpt.metadata(ck)["layer"]["w"]
    assert meta.shard_shape == (32, 32) and meta.chunk_shape == (8, 32)


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
def test_flipped_byte_anywhere(ck, leaf):
    for f in _files(ck, leaf):
        data = f.read_bytes()
        # chunk data at the start and middle, and the shard index (with its crc) at the end
        for pos in sorted({0, len(data) // 2, len(data) - 1, len(data) - 5}):
            damaged = bytearray(data)
            damaged[pos] ^= 0x10
            f.write_bytes(bytes(damaged))
            _restore_fails(ck, leaf, "checksum mismatch: stored bytes were altered")
            f.write_bytes(data)
    out = tsckpt.restore(ck)  # repaired: reads again
    assert out["bias"].tolist() == list(range(10))


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
def test_missing_chunk_file(ck, leaf):
    for f in _files(ck, leaf):
        data = f.read_bytes()
        f.unlink()
        _restore_fails(ck, leaf, "a chunk file is missing")
        f.write_bytes(data)


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
@pytest.mark.parametrize("keep", [0, 0.5, -1])
def test_truncated_file(ck, leaf, keep):
    f = _files(ck, leaf)[-1]
    data = f.read_bytes()
    n = {0: 0, 0.5: len(data) // 2, -1: len(data) - 1}[keep]
    f.write_bytes(data[:n])
    msg = _restore_fails(ck, leaf, "; restore from another checkpoint")
    # a shard's index sits at its end, so a cut shard fails the index checksum
    assert "checksum mismatch" in msg or "could not be decoded (truncated or damaged file)" in msg, msg


@pytest.mark.parametrize("leaf", ["layer/w", "bias"])
def test_missing_array(ck, leaf):
    shutil.rmtree(ck / leaf)
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
    _edit(ck / "layer/w" / ROOT_KEY, lambda node: node.__setitem__("shape", [128, 32]))
    _restore_fails(ck, "layer/w", 'Expected "shape" of [64,32] but received: [128,32]')


def test_detected_with_a_target_and_by_the_lazy_reader(ck):
    f = _files(ck, "layer/w")[0]
    data = bytearray(f.read_bytes())
    data[3] ^= 1
    f.write_bytes(bytes(data))
    target = {"layer": {"w": torch.zeros(64, 32)}, "bias": np.zeros(10, dtype=np.int64), "step": 0}
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'layer/w' in .*checksum mismatch"):
        tsckpt.restore(ck, target)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'layer/w' in .*checksum mismatch"):
        tsckpt.restore(ck, target, inplace=True)
    reader = tsckpt.open(ck)
    assert reader["layer/w"][40:48].shape == (8, 32)  # other shard file: intact
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'layer/w' in .*checksum mismatch"):
        reader["layer/w"][0:8]
    shutil.rmtree(ck / "bias")
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"'bias' in .*the array is missing \(bias/zarr.json"):
        tsckpt.open(ck)["bias"][:]


def test_damaged_root_metadata(ck):
    (ck / ROOT_KEY).write_bytes((ck / ROOT_KEY).read_bytes()[:40])
    with pytest.raises(tsckpt.CorruptCheckpointError, match="root zarr.json is not valid JSON"):
        tsckpt.restore(ck)


def test_flipped_byte_in_a_memory_store():
    loc = "memory://integrity/ck"
    tsckpt.save(loc, {"w": np.arange(100, dtype=np.float32)})
    kv = tsckpt._store.resolve(loc).kvstore()
    key = next(k for k in kv.list().result() if k.startswith(b"w/c/"))
    data = bytearray(kv.read(key).result().value)
    data[7] ^= 0x01
    kv.write(key, bytes(data)).result()
    with pytest.raises(tsckpt.CorruptCheckpointError, match="^'w' in memory://integrity/ck/: checksum mismatch"):
        tsckpt.restore(loc)
