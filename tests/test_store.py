"""Durability: every file a save writes is synced before the commit; and what resolving a
location sets in the environment (the object-store stall limit)."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._storage.durable as durable
import tsckpt._storage.native as native
from tsckpt._storage.locations import resolve


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
    assert {"a", "a/w", "c", "."} <= rel  # new directories too (one-file arrays have no c/ below)
    # the claim (the pending root) before anything else, the commit once, after every data file was synced
    assert committed_after == [0, len(synced)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="syncfs is Linux's")
def test_many_files_use_one_filesystem_sync(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(durable, "fsync_path", calls.append)
    synced: list[str] = []  # the directory of each syncfs() call
    real_syncfs = native.syncfs

    def syncfs(fd, *args, **kwargs):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_syncfs(fd, *args, **kwargs)

    monkeypatch.setattr(native, "syncfs", syncfs)
    committed_after: list[int] = []
    real_durable = durable.write_durable

    def write_durable(loc, key, data, **kwargs):
        committed_after.append(len(synced))
        return real_durable(loc, key, data, **kwargs)

    monkeypatch.setattr(durable, "write_durable", write_durable)
    ck = tmp_path / "ck"
    tsckpt.save(str(ck), {f"t{i}": torch.ones(2) for i in range(durable.FSYNC_FILES_MAX)})
    assert calls == []  # 64 chunk files + 64 array nodes: syncfs instead of 128 fsyncs ...
    assert synced == [os.path.realpath(ck)]  # ... one, of the checkpoint's filesystem ...
    assert committed_after == [0, 1]  # ... after the claim, before the commit


_STALL = ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES")
_IMPORT_THEN_RESOLVE = """
import json, os, sys
import tsckpt
from tsckpt._storage.locations import resolve
seen = {"imported": [os.environ.get(n) for n in sys.argv[1:3]]}
for where in sys.argv[3:]:
    resolve(where)
    seen[where] = [os.environ.get(n) for n in sys.argv[1:3]]
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_stall_limit_is_set_when_an_object_store_location_is_first_resolved(tmp_path):
    """Importing tsckpt leaves TensorStore's HTTP stall limit alone; resolving an s3 location
    (no request is made) sets it, and a local or memory location does not. In a fresh process
    whose environment lacks the variables."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(tsckpt.__file__)))  # this tsckpt, not another copy
    env = {k: v for k, v in os.environ.items() if k not in _STALL}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    wheres = [str(tmp_path), "memory://m/", "s3://bucket/run/step-1"]
    out = subprocess.run([sys.executable, "-c", _IMPORT_THEN_RESOLVE, *_STALL, *wheres], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    unset = [None, None]
    assert json.loads(out.stdout) == {"imported": unset, wheres[0]: unset, wheres[1]: unset, wheres[2]: ["6", "1"]}


@pytest.mark.parametrize("where", ["s3://bucket/run", "gs://bucket/run", {"driver": "ocdbt", "base": "s3://bucket/db/"},
                                   {"driver": "ocdbt", "base": {"driver": "gcs", "bucket": "b"}}])
def test_a_stall_limit_set_by_the_user_wins(monkeypatch, where):
    """Resolving an object-store location (or a store layered on one) sets only the stall
    variables the environment lacks."""
    monkeypatch.setenv(_STALL[0], "30")
    monkeypatch.delenv(_STALL[1], raising=False)
    resolve(where)
    assert [os.environ.get(n) for n in _STALL] == ["30", "1"]
