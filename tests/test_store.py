"""Durability: every file a save writes is synced before the commit."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._storage.store as store


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def test_every_written_file_and_directory_is_fsynced_before_commit(tmp_path, monkeypatch):
    synced: list[str] = []
    real = store.fsync_path
    monkeypatch.setattr(store, "fsync_path", lambda p: (synced.append(p), real(p)))
    committed_after: list[int] = []
    real_durable = store.write_durable

    def durable(loc, key, data, **kwargs):
        committed_after.append(len(synced))
        return real_durable(loc, key, data, **kwargs)

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
    # the claim (the pending root) before anything else, the commit once, after every data file was synced
    assert committed_after == [0, len(synced)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs is Linux's")
def test_many_files_use_one_filesystem_sync(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(store, "fsync_path", calls.append)
    synced: list[str] = []  # the directory of each syncfs() call, through ctypes' libc
    real_cdll = ctypes.CDLL

    class Libc:  # a library loaded with ctypes; its syncfs records what it syncs
        def __init__(self, *args, **kwargs):
            self._lib = real_cdll(*args, **kwargs)

        def __getattr__(self, name):
            fn = getattr(self._lib, name)
            if name != "syncfs":
                return fn

            def syncfs(fd):
                synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                return fn(fd)

            return syncfs

    monkeypatch.setattr(ctypes, "CDLL", Libc)
    committed_after: list[int] = []
    real_durable = store.write_durable

    def durable(loc, key, data, **kwargs):
        committed_after.append(len(synced))
        return real_durable(loc, key, data, **kwargs)

    monkeypatch.setattr(store, "write_durable", durable)
    ck = tmp_path / "ck"
    tsckpt.save(str(ck), {f"t{i}": torch.ones(2) for i in range(store.FSYNC_FILES_MAX)})
    assert calls == []  # 64 chunk files + 64 array nodes: syncfs instead of 128 fsyncs ...
    assert synced == [os.path.realpath(ck)]  # ... one, of the checkpoint's filesystem ...
    assert committed_after == [0, 1]  # ... after the claim, before the commit
