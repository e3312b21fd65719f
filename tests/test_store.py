"""Durability: every file a save writes is synced before the commit."""

from __future__ import annotations

import os

import numpy as np
import torch

import tsckpt
import tsckpt._storage.durable as durable


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def test_every_written_file_and_directory_is_fsynced_before_commit(tmp_path, monkeypatch):
    synced: list[str] = []
    real = durable.fsync_path
    monkeypatch.setattr(durable, "fsync_path", lambda p: (synced.append(p), real(p)))
    committed_after: list[int] = []
    real_durable = durable.write_durable

    def committing(loc, key, data, **kwargs):
        committed_after.append(len(synced))
        return real_durable(loc, key, data, **kwargs)

    monkeypatch.setattr(durable, "write_durable", committing)
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
    # the claim (the pending root) before anything else, the commit once, after every data file was synced
    assert committed_after == [0, len(synced)]


def test_many_files_use_one_filesystem_sync(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(durable, "fsync_path", calls.append)
    tsckpt.save(str(tmp_path / "ck"), {f"t{i}": torch.ones(2) for i in range(durable.FSYNC_FILES_MAX)})
    assert calls == []  # 64 chunk files + 64 array nodes: syncfs instead of 128 fsyncs
