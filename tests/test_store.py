"""Durability: every file a save writes is synced before the commit."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._store as store


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def test_every_written_file_and_directory_is_fsynced_before_commit(tmp_path, monkeypatch):
    synced: list[str] = []
    real = store._fsync
    monkeypatch.setattr(store, "_fsync", lambda p: (synced.append(p), real(p)))
    committed_after: list[int] = []
    real_durable = store.write_durable

    def durable(loc, key, data):
        committed_after.append(len(synced))
        real_durable(loc, key, data)

    monkeypatch.setattr(store, "write_durable", durable)
    d = str(tmp_path / "ck")
    tree = {
        "a": {"w": torch.randn(300, 1000), "scalar": np.float32(2.5)},
        "c": torch.zeros(3, dtype=torch.complex32),
        "zero_d": torch.tensor(1.0),
        "n": 5,
    }
    tsckpt.save(d, tree)
    data_files = {f for f in _files(d) if f != "zarr.json"}
    rel = {os.path.relpath(p, d) for p in synced}
    assert data_files <= rel, data_files - rel
    assert {"a", "a/w", "a/w/c", "c/c/0", "."} <= rel  # new directories too
    # the commit is written once, after every data file was synced
    assert committed_after == [len(synced)]


def test_many_files_use_one_filesystem_sync(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(store, "_fsync", calls.append)
    tsckpt.save(str(tmp_path / "ck"), {f"t{i}": torch.ones(2) for i in range(store.FSYNC_FILES_MAX)})
    assert calls == []  # 64 chunk files + 64 array nodes: syncfs instead of 128 fsyncs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex64, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(), (5,), (3, 7)])
def test_small_chunks_written_directly_match_tensorstore_bytes(tmp_path, dtype, shape):
    """Small arrays skip TensorStore on save; their files must be byte-identical to its encoding."""
    import tensorstore as ts

    from tsckpt._arrays import array_node
    from tsckpt._reader import load

    t = (torch.randn(shape) * 8).to(dtype) if dtype != torch.complex64 else torch.randn(shape, dtype=dtype)
    d = str(tmp_path / "ck")
    tsckpt.save(d, {"x": t})
    rec = load(d).arrays["x"]
    assert rec.layout.chunk_shape is None
    meta = array_node(rec)
    ref = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ref")}, "metadata": meta, "create": True}).result()
    ref.write(tsckpt._dtypes.tensor_to_numpy(t)).result()
    key = "c" if not shape else "c/" + "/".join("0" for _ in shape)
    with open(os.path.join(d, "x", key), "rb") as a, open(os.path.join(tmp_path, "ref", key), "rb") as b:
        assert a.read() == b.read()
