"""The root zarr.json's reading: states of many roots, each parsed once while its file stays the same."""

from __future__ import annotations

import json
import os

import numpy as np

from tsckpt._ondisk import root
from tsckpt._storage.locations import resolve


def _write_root(path, state: str, pad: str = "") -> None:
    os.makedirs(path.parent, exist_ok=True)
    body = {"zarr_format": 3, "node_type": "group", "attributes": {"tsckpt": {"state": state, "pad": pad}}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)  # a new file, as a commit writes it


def test_a_root_read_again_unchanged_is_not_parsed_again(tmp_path, monkeypatch):
    for step in ("1", "2"):
        _write_root(tmp_path / step / "zarr.json", "committed")
    loc, keys = resolve(str(tmp_path)), ["1/zarr.json", "2/zarr.json", "3/zarr.json"]
    first = root.read_roots(loc, keys)
    parsed = []
    real = root.root_state
    monkeypatch.setattr(root, "root_state", lambda value: parsed.append(value) or real(value))
    again = root.read_roots(loc, keys)
    assert parsed == [None]  # only the missing root: never kept
    assert again == first
    assert [again[k][0].state for k in keys] == ["committed", "committed", None]


def test_a_root_replaced_or_rewritten_is_read_again(tmp_path):
    path, loc = tmp_path / "1" / "zarr.json", resolve(str(tmp_path))
    _write_root(path, "pending", pad="x" * 10)
    assert root.read_roots(loc, ["1/zarr.json"])["1/zarr.json"][0].state == "pending"
    _write_root(path, "committed", pad="x" * 8)  # replaced: another file, the same size
    assert os.path.getsize(path) == len(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"tsckpt": {"state": "pending", "pad": "x" * 10}}}))
    assert root.read_roots(loc, ["1/zarr.json"])["1/zarr.json"][0].state == "committed"
    before = os.stat(path)
    with open(path, "r+b") as f:  # rewritten in place, the same size and inode, a later time
        body = f.read().replace(b'"committed", "pad": "xxxxxxxx"', b'"aborted", "pad": "xxxxxxxxxx"')
        f.seek(0)
        f.write(body)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert os.stat(path).st_ino == before.st_ino and os.path.getsize(path) == before.st_size
    assert root.read_roots(loc, ["1/zarr.json"])["1/zarr.json"][0].state == "aborted"


def test_the_states_read_leave_the_tables_out(tmp_path):
    """What a manager keeps of each step it has seen is small: a committed root's leaf tables
    are not part of the state read (the writer's memory grew with every step's before)."""
    import tsckpt

    tsckpt.save(tmp_path / "1", {f"w{i}": np.zeros(3) for i in range(50)})
    ((state, _),) = root.read_roots(resolve(str(tmp_path)), ["1/zarr.json"]).values()
    assert state.state == "committed" and state.meta is not None
    assert not {"arrays", "leaves", "structure", "values", "content"} & state.meta.keys()
    assert isinstance(state.meta["save_id"], str) and len(json.dumps(state.meta)) < 500
