"""Incremental saves: unchanged files shared with the base by hard links, only when proven equal."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zarr

import tsckpt
from tsckpt._codec import shardwrite
from tsckpt._codec.contenthash import digest


def _state(step: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "frozen": {"w": rng.standard_normal((256, 1024)).astype(np.float32), "b": np.arange(7.0)},
        "adapter": np.full((64, 32), float(step), np.float32),
        "opt": {"m": np.full((64, 32), step * 0.5, np.float32)},
        "step": step,
    }


def _files(directory: str) -> dict[str, os.stat_result]:
    """Every chunk file below ``directory`` (not the zarr.json nodes), by key."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name != "zarr.json":
                path = os.path.join(root, name)
                out[os.path.relpath(path, directory)] = os.stat(path)
    return out


def _equal(out: dict, want: dict) -> None:
    assert out["step"] == want["step"]
    for path in ("adapter",):
        assert np.array_equal(out[path], want[path])
    assert np.array_equal(out["frozen"]["w"], want["frozen"]["w"])
    assert np.array_equal(out["frozen"]["b"], want["frozen"]["b"])
    assert np.array_equal(out["opt"]["m"], want["opt"]["m"])


def test_a_manager_writes_only_what_changed(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run")
    m.save(1, _state(1), max_inflight_bytes=1 << 18)  # the frozen weight in several shard files
    m.save(2, _state(2), max_inflight_bytes=1 << 18)
    first, second = _files(m.directory(1)), _files(m.directory(2))
    assert sum(k.startswith("frozen/w/c/") for k in second) > 1
    shared = {k for k, st in second.items() if st.st_nlink == 2}
    assert shared == {k for k in second if k.startswith("frozen/")}
    assert all(second[k].st_ino == first[k].st_ino for k in shared)
    written = {k for k, st in second.items() if st.st_nlink == 1}
    assert written == {"adapter/c.0.0", "opt/m/c.0.0"}
    _equal(m.restore(2), _state(2))
    _equal(m.restore(1), _state(1))


def test_the_content_hashes_are_recorded_per_file(tmp_path):
    state = _state(1)
    tsckpt.save(tmp_path / "a", state)
    content = json.loads((tmp_path / "a" / "zarr.json").read_text())["attributes"]["tsckpt"]["content"]
    assert content["algorithm"] == "xxh3-128"
    entry = content["files"]["adapter/c.0.0"]
    st = os.stat(tmp_path / "a" / "adapter" / "c.0.0")
    assert entry == [digest(state["adapter"]), st.st_size, st.st_mtime_ns, st.st_ino]
    tsckpt.save(tmp_path / "off", state, incremental=False)
    assert "content" not in json.loads((tmp_path / "off" / "zarr.json").read_text())["attributes"]["tsckpt"]


def test_a_step_outlives_its_base_and_reads_without_it(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run", keep_last=1)
    m.save(1, _state(1))
    m.save(2, _state(2))
    assert m.all_steps() == [2] and not os.path.exists(m.directory(1))
    assert all(st.st_nlink == 1 for st in _files(m.directory(2)).values())
    report = tsckpt.verify(m.directory(2))
    assert report.ok, report
    _equal(m.restore(2), _state(2))
    # any zarr v3 reader, knowing nothing of the base
    w = zarr.open_array(os.path.join(m.directory(2), "frozen", "w"), mode="r")
    assert np.array_equal(w[...], _state(2)["frozen"]["w"])


def test_a_base_file_edited_after_its_save_is_not_shared(tmp_path):
    state = _state(1)
    tsckpt.save(tmp_path / "a", state)
    path = tmp_path / "a" / "frozen" / "w" / "c.0.0"
    with open(path, "r+b") as f:  # same size, other bytes, the same inode
        f.seek(16)
        f.write(b"\xff" * 8)
    tsckpt.save(tmp_path / "b", state, base=tmp_path / "a")
    assert os.stat(tmp_path / "b" / "frozen" / "w" / "c.0.0").st_nlink == 1
    assert os.stat(tmp_path / "b" / "frozen" / "b" / "c.0").st_nlink == 2
    _equal(tsckpt.restore(tmp_path / "b"), state)


def test_a_base_file_replaced_or_gone_is_written(tmp_path):
    state = _state(1)
    tsckpt.save(tmp_path / "a", state)
    w = tmp_path / "a" / "frozen" / "w" / "c.0.0"
    data = w.read_bytes()
    w.unlink()
    w.write_bytes(data)  # the same bytes in a new file: not the file the base recorded
    os.unlink(tmp_path / "a" / "frozen" / "b" / "c.0")
    tsckpt.save(tmp_path / "b", state, base=tmp_path / "a")
    files = _files(str(tmp_path / "b"))
    assert files["frozen/w/c.0.0"].st_nlink == 1 and files["frozen/b/c.0"].st_nlink == 1
    assert files["adapter/c.0.0"].st_nlink == 2
    _equal(tsckpt.restore(tmp_path / "b"), state)


def test_a_changed_dtype_shape_or_chunking_writes_the_leaf(tmp_path):
    state = _state(1)
    tsckpt.save(tmp_path / "a", state)
    changed = dict(state, adapter=state["adapter"].astype(np.float64), frozen={
        "w": state["frozen"]["w"].reshape(512, 512),  # the same bytes, so the same hash: another record
        "b": state["frozen"]["b"],
    })
    tsckpt.save(tmp_path / "b", changed, base=tmp_path / "a")
    files = _files(str(tmp_path / "b"))
    assert files["adapter/c.0.0"].st_nlink == 1 and files["frozen/w/c.0.0"].st_nlink == 1
    assert files["frozen/b/c.0"].st_nlink == 2 and files["opt/m/c.0.0"].st_nlink == 2
    out = tsckpt.restore(tmp_path / "b")
    assert out["adapter"].dtype == np.float64 and np.array_equal(out["frozen"]["w"], changed["frozen"]["w"])
    # the chunking: a smaller window cuts the same array into other files
    tsckpt.save(tmp_path / "c", state, base=tmp_path / "a", max_inflight_bytes=1 << 18)
    assert all(st.st_nlink == 1 for k, st in _files(str(tmp_path / "c")).items() if k.startswith("frozen/w/"))


def test_a_crash_mid_save_lists_no_partial_step(tmp_path, monkeypatch):
    m = tsckpt.CheckpointManager(tmp_path / "run")
    m.save(1, _state(1))
    real = shardwrite.write_chunk
    calls = []

    def failing(path, src, chunk, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(5, "injected", path)
        return real(path, src, chunk, **kw)

    monkeypatch.setattr(shardwrite, "write_chunk", failing)
    with pytest.raises(OSError, match="injected"):
        m.save(2, _state(2))
    monkeypatch.undo()
    assert m.all_steps() == [1]
    _equal(m.restore(1), _state(1))
    assert tsckpt.verify(m.directory(1)).ok
    m.save(2, _state(2))
    assert m.all_steps() == [1, 2]
    _equal(m.restore(2), _state(2))
    assert _files(m.directory(2))["frozen/w/c.0.0"].st_nlink == 2


def test_off_and_bad_bases(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run", incremental=False)
    m.save(1, _state(1))
    m.save(2, _state(2))
    assert all(st.st_nlink == 1 for st in _files(m.directory(2)).values())
    with pytest.raises(tsckpt.CheckpointNotFoundError, match="base"):
        tsckpt.save(tmp_path / "x", _state(1), base=tmp_path / "missing")
    assert not os.path.exists(tmp_path / "x" / "zarr.json")
    tsckpt.save(tmp_path / "a", _state(1))
    with pytest.raises(ValueError, match="is the checkpoint being saved"):
        tsckpt.save(tmp_path / "a", _state(1), base=tmp_path / "a", overwrite=True)
    _equal(tsckpt.restore(tmp_path / "a"), _state(1))  # refused before its claim: nothing cleared
    tsckpt.save(tmp_path / "compact", _state(1), layout="compact")
    tsckpt.save(tmp_path / "y", _state(1), base=tmp_path / "compact")  # nothing to share: every file written
    assert all(st.st_nlink == 1 for st in _files(str(tmp_path / "y")).values())


def test_a_base_that_is_no_checkpoint_or_unused_is_refused_before_the_claim(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run")
    m.save(3, _state(1))
    with pytest.raises(tsckpt.NotACheckpointError, match=r"run: not a tsckpt checkpoint, no zarr.json there \(it holds "
                       r"steps of a CheckpointManager, such as 00000003: pass one of them\)"):
        tsckpt.save(tmp_path / "x", _state(1), base=tmp_path / "run")
    (tmp_path / "plain").mkdir()
    with pytest.raises(tsckpt.NotACheckpointError, match="plain: not a tsckpt checkpoint, no zarr.json there; pass"):
        tsckpt.save(tmp_path / "x", _state(1), base=tmp_path / "plain")
    (tmp_path / "m.safetensors").write_bytes(b"12345678")
    with pytest.raises(tsckpt.NotACheckpointError, match="a file, not a tsckpt checkpoint's directory"):
        tsckpt.save(tmp_path / "x", _state(1), base=tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="with incremental=False: a base is shared with only by an incremental save"):
        tsckpt.save(tmp_path / "x", _state(1), base=m.directory(3), incremental=False)
    assert not os.path.exists(tmp_path / "x" / "zarr.json")  # refused before its claim
    tsckpt.save(tmp_path / "x", _state(1), base=m.directory(3))
    assert all(st.st_nlink == 2 for st in _files(str(tmp_path / "x")).values() if st.st_size > 1000)


def test_verify_checks_the_content_hashes(tmp_path):
    """A file that passes its crc32c but holds other data than its save hashed is found."""
    from tsckpt._codec import crc

    state = _state(1)
    tsckpt.save(tmp_path / "a", state)
    assert tsckpt.verify(tmp_path / "a").ok
    path = tmp_path / "a" / "adapter" / "c.0.0"
    forged = np.full((64, 32), 9.0, np.float32).tobytes()
    with open(path, "r+b") as f:  # other data with a valid crc32c, in place
        f.write(forged + crc.encoded(forged))
    report = tsckpt.verify(tmp_path / "a")
    assert list(report.bad) == ["adapter"]
    assert "its file adapter/c.0.0 does not hold the data its save hashed" in report.bad["adapter"]


@pytest.mark.slow  # starts rank processes
def test_ranks_share_their_own_files(tmp_path):
    import torch

    from tests import dist_scenarios as sc
    from tests.dist_helpers import run_ranks

    root = str(tmp_path / "run")
    run_ranks(sc.incremental_steps, 2, root, layout="plain")
    m = tsckpt.CheckpointManager(root)
    second = _files(m.directory(2))
    assert {k for k, st in second.items() if st.st_nlink == 2} == {"frozen/c/0/0", "frozen/c/1/0"}
    assert second["adapter/c.0.0"].st_nlink == 1
    out = m.restore(2)
    assert np.array_equal(out["frozen"], sc.global_tensor((128, 256)).numpy())
    assert np.array_equal(out["adapter"], torch.full((8, 8), 2.0).numpy())
    assert tsckpt.verify(m.directory(2)).ok


def test_background_saves_share_too(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run", writer="thread")
    m.save_async(1, _state(1)).result(timeout=60)
    m.save_async(2, _state(2)).result(timeout=60)
    assert _files(m.directory(2))["frozen/w/c.0.0"].st_nlink == 2
    tsckpt.save_async(tmp_path / "b", _state(3), base=m.directory(2), writer="thread").result(timeout=60)
    files = _files(str(tmp_path / "b"))
    assert files["frozen/w/c.0.0"].st_nlink == 3 and files["adapter/c.0.0"].st_nlink == 1
    _equal(tsckpt.restore(tmp_path / "b"), _state(3))


@pytest.mark.slow  # starts the writer process
def test_the_writer_process_shares(tmp_path, writer_process):
    with tsckpt.CheckpointManager(tmp_path / "run") as m:
        m.save_async(1, _state(1)).result(timeout=120)
        m.save_async(2, _state(2)).result(timeout=120)
        assert _files(m.directory(2))["frozen/w/c.0.0"].st_nlink == 2
        _equal(m.restore(2), _state(2))


def test_a_link_on_the_way_in_the_base_is_never_followed(tmp_path):
    """A base whose directory on the way to a file is a symbolic link (to a copy elsewhere,
    its recorded times and inode intact) shares nothing through it."""
    state = _state(1)
    tsckpt.save(tmp_path / "a", state)
    os.rename(tmp_path / "a" / "frozen", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "a" / "frozen")
    tsckpt.save(tmp_path / "b", state, base=tmp_path / "a")
    files = _files(str(tmp_path / "b"))
    assert files["frozen/w/c.0.0"].st_nlink == 1 and files["frozen/b/c.0"].st_nlink == 1
    assert files["adapter/c.0.0"].st_nlink == 2
    _equal(tsckpt.restore(tmp_path / "b"), state)


def test_the_torch_bridge_takes_a_base(tmp_path):
    import torch

    import tsckpt.torch as tt

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tt.save(tmp_path / "a", model, opt, rng=False)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    tt.save(tmp_path / "b", model, opt, rng=False, base=tmp_path / "a")
    files = _files(str(tmp_path / "b"))
    frozen = {k for k in files if k.startswith("model/0.")}
    assert frozen and all(files[k].st_nlink == 2 for k in frozen)
    assert all(files[k].st_nlink == 1 for k in files if k.startswith("model/1."))
    assert tsckpt.verify(tmp_path / "b").ok


def test_a_file_changed_right_after_a_save_gets_a_later_time(tmp_path):
    """The settle after recording the files' times: another file written right after it is
    stamped later than the newest time recorded (the stamp clock has ticked past it)."""
    from tsckpt._save import share

    recorded, later = tmp_path / "recorded", tmp_path / "later"
    for i in range(20):
        recorded.write_bytes(bytes([i]))
        newest = os.stat(recorded).st_mtime_ns
        share.settle_clock(newest, fine=True)
        later.write_bytes(bytes([i]))
        assert os.stat(later).st_mtime_ns > newest


def test_the_settle_waits_until_the_stamp_clock_has_passed_the_newest_time(monkeypatch):
    """(On a kernel whose stamps are never equal across files the test above cannot fail; this
    one checks the wait itself, with a stamp clock that lags.)"""
    import time

    from tsckpt._save import share

    newest, reads = time.time_ns(), []

    def lagging(clock: int) -> int:
        reads.append(clock)
        return newest - 1 if len(reads) < 4 else newest + 1

    monkeypatch.setattr(share.time, "clock_gettime_ns", lagging)
    share.settle_clock(newest, fine=True)
    assert reads == [share.STAMP_CLOCK] * 4


def test_the_settle_waits_a_whole_tick_where_the_stamp_clock_cannot_be_read(monkeypatch):
    import time

    from tsckpt._save import share

    monkeypatch.setattr(share, "STAMP_CLOCK", None)
    newest = time.time_ns()
    share.settle_clock(newest, fine=True)
    assert time.time_ns() >= newest + share.CLOCK_TICK_NS


# ---- object stores: the ETags recorded, the copier (the copies themselves: tests/test_s3.py) ----


def test_recorded_etags_are_taken_only_when_valid():
    from tsckpt._ondisk.records import content_entries, content_etags, content_field

    entry = ("0" * 32, 36, 0, 0)
    meta = {"content": content_field({"a/c.0": entry, "b/c.0": entry}, {"a/c.0": '"9a02"', "b/c.0": '"x"'})}
    assert json.loads(json.dumps(meta))["content"]["etags"] == {"a/c.0": '"9a02"', "b/c.0": '"x"'}
    assert content_etags(meta) == {"a/c.0": '"9a02"', "b/c.0": '"x"'}
    assert "etags" not in content_field({"a/c.0": entry})  # a local save records none
    bad = {"a/c.0": "9a02", "b/c.0": '"' + "f" * 300 + '"', "c/c.0": '"caf\u00e9"', "d/c.0": 7, "e/c.0": '"ok"'}
    files = {k: list(entry) for k in ("a/c.0", "b/c.0", "c/c.0", "d/c.0")}  # e/c.0: an ETag without an entry
    meta = {"content": {"algorithm": "xxh3-128", "files": files, "etags": bad}}
    assert content_etags(meta) == {} and len(content_entries(meta)) == 4
    assert content_etags({"content": {"algorithm": "xxh3-128", "files": files, "etags": ["no"]}}) == {}


def test_an_etag_from_tensorstores_generation():
    from tsckpt._storage.s3copy import etag_of

    assert etag_of(b'\x00"5d41402abc4b2a76b9719d911017c592"') == '"5d41402abc4b2a76b9719d911017c592"'
    assert etag_of(b'"abc"') == '"abc"'
    assert etag_of(b"") is None and etag_of(b"\x00\xff\xfe") is None and etag_of(b"\x00abc") is None


def test_copies_only_within_one_bucket_and_endpoint(monkeypatch, caplog):
    import logging

    from tsckpt._storage import s3copy
    from tsckpt._storage.locations import resolve

    monkeypatch.setattr(s3copy, "_told", set())
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    a, b = resolve("s3://bucket-a/run/1"), resolve("s3://bucket-a/run/2")
    other = resolve("s3://bucket-b/run/1")
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        assert s3copy.Copier.between(other, b) is None
        assert s3copy.Copier.between(resolve({**a.spec, "endpoint": "http://127.0.0.1:9"}), b) is None
        assert s3copy.Copier.between(resolve("/nonexistent/x"), b) is None  # not on S3: said elsewhere
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("not in the bucket and endpoint of s3://bucket-a/run/2/" in m for m in said)
    copier = s3copy.Copier.between(a, b)
    assert copier is not None and (copier.bucket, copier.source, copier.target) == ("bucket-a", "run/1/", "run/2/")

    from botocore.exceptions import ClientError

    class Refusing:  # a store that refuses every copy (412, 403, gone): the file is written
        def copy_object(self, **kw):
            raise ClientError({"Error": {"Code": "PreconditionFailed"}}, "CopyObject")

    copier.client = Refusing()
    assert copier.copy("w/c.0", "w/c.0", '"e"') is None and copier.refused == 1

    class Other:  # a store that ignored the condition and copied other bytes
        def copy_object(self, **kw):
            return {"CopyObjectResult": {"ETag": '"other"'}}

    copier.client = Other()
    assert copier.copy("w/c.0", "w/c.0", '"e"') is None and copier.refused == 2


def _inner_hashes(src: np.ndarray, inner: list[int]) -> list[str]:
    """xxh3-128 of each inner chunk's part in the array (C-order bytes), in C order of the
    chunks holding part of it: computed from the definition (docs/format.md), not by tsckpt."""
    import itertools

    import xxhash

    starts = itertools.product(*(range(0, n, c) for n, c in zip(src.shape, inner)))
    return [
        xxhash.xxh3_128_hexdigest(np.ascontiguousarray(src[tuple(slice(o, o + c) for o, c in zip(lo, inner))]).tobytes())
        for lo in starts
    ]


def _meta(directory) -> dict:
    return json.loads((directory / "zarr.json").read_text())["attributes"]["tsckpt"]


def test_the_inner_chunks_of_shard_files_are_hashed(tmp_path, small_chunks):
    """Each shard file of several inner chunks records their hashes, computed as the writer
    writes them; a file of one chunk (its hash is the file's) and unsharded files record none."""
    state = {"w": np.arange(70 * 50, dtype=np.float32).reshape(70, 50), "b": np.arange(7.0)}
    tsckpt.save(tmp_path / "a", state)
    meta = _meta(tmp_path / "a")
    (rec,) = [r for r in meta["arrays"] if r["path"] == "w"]
    shard, inner = rec["shard_shape"], rec["chunk_shape"]
    chunks = meta["content"]["chunks"]
    want = {}
    for lo in np.ndindex(*(-(-n // s) for n, s in zip(state["w"].shape, shard))):
        box = state["w"][tuple(slice(i * s, (i + 1) * s) for i, s in zip(lo, shard))]
        if len(_inner_hashes(box, inner)) > 1:
            want["w/c/" + "/".join(map(str, lo))] = _inner_hashes(box, inner)
    assert want and chunks == want  # the edge shard's chunks: their part in the array
    assert set(chunks) <= set(meta["content"]["files"])
    tsckpt.save(tmp_path / "off", state, incremental=False)
    assert "content" not in _meta(tmp_path / "off")


@pytest.mark.parametrize("incremental", [True, "versions"])
def test_shared_files_keep_their_inner_chunk_hashes(tmp_path, small_chunks, incremental):
    torch = pytest.importorskip("torch")
    state = {"w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48), "v": torch.ones(64, 48)}
    tsckpt.save(tmp_path / "a", state, incremental=incremental)
    state["v"][0, 0] = 2.0  # one file of v rewritten: its chunk hashes its own
    tsckpt.save(tmp_path / "b", state, base=tmp_path / "a", incremental=incremental)
    a, b = _meta(tmp_path / "a")["content"]["chunks"], _meta(tmp_path / "b")["content"]["chunks"]
    assert a.keys() == b.keys()
    changed = [k for k in a if a[k] != b[k]]
    assert changed == ["v/c/0/0"] and sum(x != y for x, y in zip(a["v/c/0/0"], b["v/c/0/0"])) == 1
    linked = [k for k in b if os.stat(tmp_path / "b" / k).st_nlink == 2]
    assert sorted(linked) == sorted(k for k in b if k != "v/c/0/0")  # carried over with their files
    (rec,) = [r for r in _meta(tmp_path / "b")["arrays"] if r["path"] == "v"]
    box = state["v"].numpy()[tuple(slice(0, s) for s in rec["shard_shape"])]
    assert b["v/c/0/0"] == _inner_hashes(box, rec["chunk_shape"])


def test_recorded_inner_chunk_hashes_are_taken_only_when_valid():
    from tsckpt._ondisk.records import content_chunks, content_field

    entry = ("0" * 32, 36, 0, 0)
    good = ["a" * 32, "b" * 32]
    meta = {"content": content_field({"a/c/0": entry, "b/c/0": entry}, None, {"a/c/0": good, "x/c/0": good})}
    assert json.loads(json.dumps(meta))["content"]["chunks"] == {"a/c/0": good}  # x: no file entry, left out
    assert content_chunks(meta) == {"a/c/0": tuple(good)}
    assert "chunks" not in content_field({"a/c/0": entry})
    bad = {
        "a/c/0": ["A" * 32, "b" * 32], "b/c/0": ["a" * 31, "b" * 32], "c/c/0": ["a" * 32], "d/c/0": "a" * 64,
        "e/c/0": ["a" * 32, 7], "f/c/0": good,  # f: no file entry
    }
    files = {k: list(entry) for k in ("a/c/0", "b/c/0", "c/c/0", "d/c/0", "e/c/0")}
    assert content_chunks({"content": {"algorithm": "xxh3-128", "files": files, "chunks": bad}}) == {}
    assert content_chunks({"content": {"algorithm": "xxh3-128", "files": files, "chunks": [good]}}) == {}
    assert content_chunks({"content": {"algorithm": "other", "files": files, "chunks": {"a/c/0": good}}}) == {}


def test_verify_checks_the_inner_chunk_hashes(tmp_path, small_chunks):
    """A root whose inner chunk hashes do not match its file's data is reported; one of
    another length than the file's inner chunks is read as none."""
    tsckpt.save(tmp_path / "a", {"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48)})
    root = tmp_path / "a" / "zarr.json"
    raw = json.loads(root.read_text())
    chunks = raw["attributes"]["tsckpt"]["content"]["chunks"]
    key = min(chunks)
    real = list(chunks[key])
    chunks[key] = [real[1], real[0], *real[2:]]
    root.write_text(json.dumps(raw))
    report = tsckpt.verify(tmp_path / "a")
    assert list(report.bad) == ["w"]
    assert f"its file {key} does not hold the data its save hashed (inner chunk 0 in C order" in report.bad["w"]
    chunks[key] = real[1:]
    root.write_text(json.dumps(raw))
    assert tsckpt.verify(tmp_path / "a").ok


def save_rows_with_small_chunks(rank: int, world: int, directory: str) -> None:
    """Each rank saves its 64 rows of a (128, 64) array with 1 KiB inner chunks and 4 KiB shards."""
    import tsckpt._ondisk.chunking as chunking

    chunking.INNER_CHUNK_BYTES, chunking.SHARD_BYTES = 1024, 4096
    full = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    rows = slice(64 * rank, 64 * (rank + 1))
    tsckpt.save(directory, {"w": tsckpt.ShardedArray(full[rows].copy(), full.shape, (64 * rank, 0))})


@pytest.mark.slow
def test_every_ranks_inner_chunk_hashes_reach_the_root(tmp_path):
    """Each rank hashes the inner chunks of the shard files it writes; rank 0 records all of them."""
    from tests.dist_helpers import run_ranks

    run_ranks(save_rows_with_small_chunks, 2, str(tmp_path / "a"), timeout=120)
    full = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    meta = _meta(tmp_path / "a")
    (rec,) = [r for r in meta["arrays"] if r["path"] == "w"]
    shard, inner = rec["shard_shape"], rec["chunk_shape"]
    want = {}
    for lo in np.ndindex(*(-(-n // s) for n, s in zip(full.shape, shard))):
        box = full[tuple(slice(i * s, (i + 1) * s) for i, s in zip(lo, shard))]
        if len(_inner_hashes(box, inner)) > 1:
            want["w/c/" + "/".join(map(str, lo))] = _inner_hashes(box, inner)
    files = meta["content"]["files"]
    assert len(want) == 8 and meta["content"]["chunks"] == want and set(want) <= set(files)  # 4 files per rank
