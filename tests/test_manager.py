"""CheckpointManager: steps, latest, retention, incomplete steps, storage drivers."""

from __future__ import annotations

import errno
import gc
import json
import os
import uuid

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._manager as manager_module
from tests.races import race_two_saves
from tsckpt._ondisk.records import ROOT_KEY
from tsckpt._storage import mirror as _mirror


def _state(step: int) -> dict:
    return {"w": torch.full((3, 4), float(step)), "a": np.arange(5) * step, "step": step}


def _check(out: dict, step: int) -> None:
    assert out["step"] == step
    assert np.asarray(out["w"]).tolist() == [[float(step)] * 4] * 3
    assert np.asarray(out["a"]).tolist() == [i * step for i in range(5)]


@pytest.fixture(params=["file", "memory"])
def root(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "run")
    return f"memory://manager-{uuid.uuid4().hex}/run"


def test_save_list_restore(root):
    m = tsckpt.CheckpointManager(root)
    assert m.all_steps() == [] and m.latest_step() is None
    with pytest.raises(tsckpt.CheckpointNotFoundError, match="no complete checkpoint to restore yet"):
        m.restore()
    for step in (0, 5, 10):
        m.save(step, _state(step))
    m.save_async(20, _state(20)).result(timeout=30)
    assert m.all_steps() == [0, 5, 10, 20] and m.latest_step() == 20
    _check(m.restore(), 20)
    _check(m.restore(5), 5)
    target = {"w": torch.zeros(3, 4, dtype=torch.float64), "a": np.zeros(5, dtype=np.int64), "step": 0}
    out = m.restore(10, target)
    assert out["w"].dtype == torch.float64
    _check(out, 10)
    _check(tsckpt.restore(m.directory(5)), 5)  # plain directories, readable without the manager
    with pytest.raises(tsckpt.CheckpointNotFoundError):
        m.restore(7)


def test_directory_names(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run")
    m.save(42, _state(42))
    assert os.listdir(tmp_path / "run") == ["00000042"]
    assert m.directory(42) == str(tmp_path / "run" / "00000042")
    with pytest.raises(ValueError, match="step must be a non-negative int, not -1"):
        m.save(-1, _state(1))
    with pytest.raises(ValueError, match="step must be a non-negative int, not 1.5"):
        m.directory(1.5)


def test_existing_step_needs_overwrite(root):
    m = tsckpt.CheckpointManager(root)
    m.save(3, _state(3))
    with pytest.raises(tsckpt.CheckpointExistsError, match="step 3 already has a complete checkpoint; pass overwrite=True"):
        m.save(3, _state(4))
    with pytest.raises(tsckpt.CheckpointExistsError, match="step 3 already has a complete checkpoint"):
        m.save_async(3, _state(4))
    _check(m.restore(3), 3)
    m.save(3, _state(4), overwrite=True)
    _check(m.restore(3), 4)
    m.save_async(3, _state(5), overwrite=True).result(timeout=30)
    _check(m.restore(3), 5)


@pytest.mark.parametrize(
    "keep_last, keep_every, expected",
    [
        (None, None, list(range(12))),
        (3, None, [9, 10, 11]),
        (1, None, [11]),
        (2, 5, [0, 5, 10, 11]),
        (None, 4, [0, 4, 8, 11]),  # the latest is kept although 11 % 4 != 0
    ],
)
def test_retention(tmp_path, keep_last, keep_every, expected):
    m = tsckpt.CheckpointManager(tmp_path / "run", keep_last=keep_last, keep_every=keep_every)
    for step in range(12):
        if step % 2:
            m.save_async(step, _state(step))
        else:
            m.save(step, _state(step))
    m.wait()
    assert m.all_steps() == expected
    assert sorted(os.listdir(tmp_path / "run")) == [f"{s:08d}" for s in expected]
    for step in expected:
        _check(m.restore(step), step)


def test_retention_never_deletes_the_latest(root):
    m = tsckpt.CheckpointManager(root, keep_last=1)
    m.save(10, _state(10))
    m.save(4, _state(4))  # an older step saved later: the latest complete one is still 10
    assert m.all_steps() == [10]
    _check(m.restore(), 10)


def test_retention_on_memory_store():
    root = f"memory://manager-{uuid.uuid4().hex}/run"
    m = tsckpt.CheckpointManager(root, keep_last=2)
    for step in range(5):
        m.save_async(step, _state(step))
    m.close()
    assert m.all_steps() == [3, 4]
    kv = tsckpt._storage.locations.resolve(root).kvstore()
    keys = kv.list().result()
    assert {k.split(b"/")[0] for k in keys} == {b"00000003", b"00000004", b".tsckpt-steps"}
    assert {k for k in keys if k.startswith(b".tsckpt-steps/")} == {
        b".tsckpt-steps/.root", b".tsckpt-steps/00000003", b".tsckpt-steps/00000004"
    }


def test_bad_retention_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        tsckpt.CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_every must be a positive step interval, not 0"):
        tsckpt.CheckpointManager(tmp_path, keep_every=0)


def _make_incomplete(m: tsckpt.CheckpointManager, step: int) -> None:
    """What a crashed save leaves: a pending root and part of the data (and, on an
    object store, the step's index marker, written before the save began)."""
    import tsckpt._save.protocol as save_module
    from tsckpt._ondisk.stepindex import mark_if_managed
    from tsckpt._storage.locations import resolve

    loc = resolve(m.directory(step))
    mark_if_managed(loc)  # as every save does first
    save_module._begin(loc, overwrite=False)
    loc.kvstore().write("w/c/0/0", b"partial").result()


def test_incomplete_steps_are_ignored_and_cleaned(root):
    m = tsckpt.CheckpointManager(root)
    m.save(1, _state(1))
    _make_incomplete(m, 2)
    assert m.all_steps() == [1] and m.latest_step() == 1
    _check(m.restore(), 1)
    with pytest.raises(tsckpt.CheckpointIncompleteError, match="never committed"):
        m.restore(2)
    # a fresh manager (a restarted job) removes it when it first saves, never when it is made
    m2 = tsckpt.CheckpointManager(root)
    assert m2.all_steps() == [1]
    kv = tsckpt._storage.locations.resolve(root).kvstore()
    assert [k for k in kv.list().result() if k.startswith(b"00000002")]
    m2.save(0, _state(0))
    assert not [k for k in kv.list().result() if k.startswith(b"00000002")]
    # so does the next commit
    _make_incomplete(m2, 7)
    m2.save(3, _state(3))
    assert not [k for k in kv.list().result() if k.startswith(b"00000007")]
    assert m2.all_steps() == [0, 1, 3]


def test_incomplete_step_is_replaced_by_its_save(root):
    m = tsckpt.CheckpointManager(root)
    _make_incomplete(m, 4)
    m.save(4, _state(4))
    _check(m.restore(4), 4)
    _make_incomplete(m, 6)
    m.save_async(6, _state(6)).result(timeout=30)
    _check(m.restore(), 6)


def test_leftovers_on_local_disk(tmp_path, caplog):
    run = tmp_path / "run"
    m = tsckpt.CheckpointManager(run)
    m.save(1, _state(1))
    m.save(2, _state(2))
    _make_incomplete(m, 5)  # a crashed save: tsckpt's pending root, its claim of a save that is over
    (run / ".tsckpt-deleting-00000000-0123abcd" / "w").mkdir(parents=True)  # a deletion cut short
    (run / "00000003").mkdir()
    (run / "00000003" / ROOT_KEY).write_text("{not json")  # unreadable: never listed, never deleted
    (run / "00000004" / "w").mkdir(parents=True)  # no root: not provably tsckpt's
    (run / "00000006").mkdir()  # empty: nothing to lose
    (run / "00000009").mkdir()
    (run / "00000009" / f"{ROOT_KEY}.__lock").write_bytes(b"")  # a save killed writing its root: nothing to lose
    (run / "notes").mkdir()  # not a step
    assert m.all_steps() == [1, 2]
    with caplog.at_level("WARNING", logger="tsckpt"):
        tsckpt.CheckpointManager(run, keep_last=1).save(2, _state(2), overwrite=True)  # cleans up first
    assert sorted(os.listdir(run)) == ["00000002", "00000003", "00000004", "notes"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{run}: step directory 00000003 is not a checkpoint tsckpt wrote (its root zarr.json is not valid JSON "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))); the manager leaves it "
        "alone: it is not listed, restored, counted for retention or deleted",
        f"{run}: step directory 00000004 is not a checkpoint tsckpt wrote (no tsckpt root zarr.json: another "
        "library's checkpoint, or other data); the manager leaves it alone: it is not listed, restored, counted "
        "for retention or deleted",
    ]


def test_deletion_makes_a_step_incomplete_first(tmp_path, monkeypatch):
    """A deletion interrupted at any point never leaves a step that looks complete."""
    run = tmp_path / "run"
    m = tsckpt.CheckpointManager(run, keep_last=1)
    m.save(1, _state(1))

    def crash(path, *a, **k):
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(manager_module.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        m.save(2, _state(2))
    monkeypatch.undo()
    assert m.all_steps() == [2]  # step 1 is already out of sight
    assert [n for n in os.listdir(run) if n.startswith(".tsckpt-deleting-00000001")]
    m2 = tsckpt.CheckpointManager(run, keep_last=1)
    m2.save(3, _state(3))  # a manager's first save cleans up what a deletion left
    assert sorted(os.listdir(run)) == ["00000003"]


def test_only_rank_zero_deletes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    m0 = tsckpt.CheckpointManager(run, keep_last=1)
    m0.save(1, _state(1))
    _make_incomplete(m0, 5)
    monkeypatch.setattr(tsckpt._coord.torchdist, "rank_of", lambda group=None: 1)
    m1 = tsckpt.CheckpointManager(run, keep_last=1)  # rank 1 does not clean up
    m1.save(2, _state(2))  # ... nor apply retention
    assert m1.all_steps() == [1, 2]
    assert (run / "00000005").exists()
    monkeypatch.undo()
    m0.save(3, _state(3))
    assert m0.all_steps() == [3] and sorted(os.listdir(run)) == ["00000003"]


def test_manager_save_waits_for_its_async_save(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path / "run", keep_last=2, if_busy="error")
    w = torch.zeros(1000)
    h = m.save_async(1, {"w": w})
    w.fill_(1)
    try:
        m.save(2, {"w": w})
    except tsckpt.SaveInProgressError as e:
        assert "still running" in str(e)
        h.result(timeout=30)
        m.save(2, {"w": w})
    assert m.staging_bytes == 4000
    assert tsckpt.restore(m.directory(1))["w"].sum() == 0
    assert tsckpt.restore(m.directory(2))["w"].sum() == 1000
    root = json.loads((tmp_path / "run" / "00000002" / ROOT_KEY).read_text())
    assert root["attributes"]["tsckpt"]["state"] == "committed"
    with tsckpt.CheckpointManager(tmp_path / "run") as m2:
        m2.save_async(3, {"w": w})
    assert m2.latest_step() == 3  # leaving the block waited for the commit


# ---- two managers on one root ------------------------------------------------------


def _hold_step(monkeypatch, m: tsckpt.CheckpointManager, step: int, tree: dict):
    """``m`` saves ``step`` asynchronously and is held in its write step until released."""
    import threading

    import tsckpt._save.protocol as save_module

    writing, release = threading.Event(), threading.Event()
    real = save_module._write
    held = str(tsckpt._storage.locations.resolve(m.directory(step)))

    def slow_write(loc, *args, **kwargs):
        if str(loc) == held:
            writing.set()
            release.wait(60)
        return real(loc, *args, **kwargs)

    monkeypatch.setattr(save_module, "_write", slow_write)
    handle = m.save_async(step, tree)
    assert writing.wait(60)
    return handle, release


def test_two_managers_never_remove_each_others_saves_in_progress(root, monkeypatch):
    a = tsckpt.CheckpointManager(root)
    b = tsckpt.CheckpointManager(root, keep_last=1)
    handle, release = _hold_step(monkeypatch, a, 5, _state(5))
    try:
        b.save(6, _state(6))
        b.save(7, _state(7))  # retention and clean-up after the commit: 6 goes, 5 is running
        tsckpt.CheckpointManager(root)  # so is the clean-up of a manager starting
        assert b.all_steps() == [7]
        with pytest.raises(tsckpt.CheckpointIncompleteError):
            b.restore(5)  # still there, still pending
        with pytest.raises(tsckpt.SaveInProgressError) as e:
            b.save(5, _state(50))
        assert str(e.value).startswith(f"{tsckpt._storage.locations.resolve(root)}: step 5 is being saved by another save that "
                                       f"is still running (pid {os.getpid()} on host ")
        assert "wait for it, or save another step" in str(e.value)
        with pytest.raises(tsckpt.SaveInProgressError, match="step 5 is being saved"):
            b.save(5, _state(50), overwrite=True)
    finally:
        release.set()
    handle.result(timeout=60)
    assert a.all_steps() == [5, 7]  # a keeps everything; b's retention counts a's steps too
    _check(a.restore(5), 5)
    b.save(8, _state(8))
    assert b.all_steps() == [8]
    a.close()
    b.close()


def test_two_managers_racing_for_one_step_one_wins(root, monkeypatch):
    """Both find step 3 free; the conditional claim lets exactly one save it."""
    managers = [tsckpt.CheckpointManager(root) for _ in range(2)]
    winner, loser = race_two_saves(monkeypatch, lambda i: managers[i].save(3, _state(10 + i)))
    assert isinstance(loser, tsckpt.CheckpointExistsError)
    assert "another save into this directory started at the same time and claimed it first" in str(loser)
    _check(managers[0].restore(3), 10 + winner)


# ---- directories the manager did not write -------------------------------------------------------


def _files(root) -> dict[str, bytes]:
    """Every file below ``root`` (relative path -> bytes)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def test_an_orbax_manager_root_is_never_touched(tmp_path, caplog):
    """CheckpointManager(root) on an Orbax CheckpointManager's root deleted every Orbax step at
    construction: a numbered directory without a tsckpt root counted as an incomplete save."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ocp = pytest.importorskip("orbax.checkpoint")
    run = tmp_path / "run"
    with ocp.CheckpointManager(run) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, args=ocp.args.StandardSave({"w": np.arange(4.0) * s}))
        mgr.wait_until_finished()
    before = _files(run)
    assert sorted(os.listdir(run)) == ["1", "2", "3"] and before
    with caplog.at_level("WARNING", logger="tsckpt"):
        m = tsckpt.CheckpointManager(run, keep_last=1, step_digits=1)
        assert m.all_steps() == [] and m.latest_step() is None
        m.save(4, _state(4))
        m.save(5, _state(5))  # retention: step 4 goes, the Orbax steps stay
        with pytest.raises(tsckpt.CheckpointExistsError) as e:
            m.save(2, _state(2), overwrite=True)
    assert str(e.value) == (
        f"{run}: step 2: 2 holds data tsckpt did not write (no tsckpt root zarr.json: another library's checkpoint, "
        "or other data); the manager never deletes what it cannot identify: move it away, or save another step"
    )
    assert m.all_steps() == [5] and sorted(os.listdir(run)) == ["1", "2", "3", "5"]
    assert {k: v for k, v in _files(run).items() if not k.startswith("5")} == before
    warned = [r.getMessage() for r in caplog.records if r.name == "tsckpt"]
    assert warned == [
        f"{run}: step directory {s} is not a checkpoint tsckpt wrote (no tsckpt root zarr.json: another library's "
        "checkpoint, or other data); the manager leaves it alone: it is not listed, restored, counted for retention "
        "or deleted"
        for s in (1, 2, 3)
    ]  # once each, not again after every commit
    with ocp.CheckpointManager(run) as mgr:  # Orbax still restores its own steps
        np.testing.assert_array_equal(mgr.restore(3, args=ocp.args.StandardRestore())["w"], np.arange(4.0) * 3)


@pytest.mark.parametrize("root", ["file", "memory"], indirect=True)
def test_an_unidentified_step_holding_a_file_is_kept_and_never_saved_over(root, caplog):
    loc = tsckpt._storage.locations.resolve(root)
    kv = loc.kvstore()
    m = tsckpt.CheckpointManager(root, keep_last=1)
    kv.write("00000007/notes.txt", b"mine").result()
    kv.write("00000008/zarr.json", b'{"zarr_format": 3, "node_type": "group"}').result()  # zarr, not tsckpt
    if loc.local is None:  # an object store lists its steps by marker
        kv.write(".tsckpt-steps/00000007", b"").result()
        kv.write(".tsckpt-steps/00000008", b"").result()
    with caplog.at_level("WARNING", logger="tsckpt"):
        m2 = tsckpt.CheckpointManager(root, keep_last=1)
        for step in (1, 2, 3):
            m2.save(step, _state(step))
    assert m2.all_steps() == [3]
    assert kv.read("00000007/notes.txt").result().value == b"mine"
    assert kv.read("00000008/zarr.json").result().state == "value"
    assert [r.getMessage().split(" is not")[0] for r in caplog.records if r.name == "tsckpt"] == [
        f"{loc}: step directory 00000007", f"{loc}: step directory 00000008"]
    assert "its root zarr.json has no tsckpt metadata" in caplog.records[1].getMessage()
    for step in (7, 8):
        with pytest.raises(tsckpt.CheckpointExistsError, match=f"step {step}: 0000000{step} holds data tsckpt did not"):
            m2.save(step, _state(step))
    assert kv.read("00000007/notes.txt").result().value == b"mine"


def test_an_empty_step_directory_is_saved_into(tmp_path):
    run = tmp_path / "run"
    (run / "00000002").mkdir(parents=True)
    m = tsckpt.CheckpointManager(run)
    m.save(2, _state(2))
    _check(m.restore(2), 2)


# ---- nothing committed is deleted without overwrite=True (issue 32) --------------------------------


def test_save_async_never_deletes_a_step_another_job_committed_meanwhile(root, monkeypatch):
    """save_async judged step 5 a crashed save's (to be cleared) when it was submitted; another
    job committed step 5 before the background worker started. Before: the worker checked only
    that no save was *running* there, deleted the committed step and saved over it, and both
    saves reported success."""
    import tsckpt._save.background as background

    mine, other = tsckpt.CheckpointManager(root), tsckpt.CheckpointManager(root)
    _make_incomplete(mine, 5)
    real_run = background.AsyncSave.run
    started = []

    def run(handle, job, tree, *behind):  # the worker starts: the other job commits step 5 first
        if not started:
            started.append(True)
            other.save(5, _state(55))
        return real_run(handle, job, tree, *behind)

    monkeypatch.setattr(background.AsyncSave, "run", run)
    handle = mine.save_async(5, _state(5))
    with pytest.raises(tsckpt.CheckpointExistsError, match="step 5 already has a complete checkpoint"):
        handle.result(timeout=60)
    assert started
    _check(mine.restore(5), 55)  # the other job's checkpoint, untouched
    monkeypatch.undo()
    mine.save_async(5, _state(6), overwrite=True).result(timeout=60)  # overwrite=True still replaces it
    _check(mine.restore(5), 6)
    mine.close()
    other.close()


def _read_only(monkeypatch) -> list[str]:
    """Make every write this process could make to storage fail as on a read-only mount
    (EROFS; tests run as root, whom chmod does not stop), and record each attempt. A
    reader's own private directory of links to the files it reads (tsckpt._storage.mirror,
    in a memory file system) is no storage: it is let be made, and its removal (which
    unlinks by relative names) waits in the returned list until the test removes it."""
    import errno
    import shutil

    import tensorstore as ts

    tried: list[str] = []
    real_unlink = os.unlink

    def refuse(name):
        module, _, attr = name.partition(".")
        real = getattr({"os": os, "shutil": shutil}.get(module), attr, None)

        def call(*args, **kwargs):
            if real is not None and args and str(args[0]).startswith(os.path.join(_mirror.BASE, _mirror.PREFIX)):
                return real(*args, **kwargs)  # a mirror being made
            tried.append(f"{name}{args[:2]!r}")
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]) if args else None)

        return call

    for name in ("rename", "replace", "rmdir", "unlink", "remove", "mkdir", "makedirs", "truncate"):
        monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    monkeypatch.setattr(shutil, "rmtree", refuse("shutil.rmtree"))
    monkeypatch.setattr(ts.KvStore, "write", refuse("KvStore.write"))
    monkeypatch.setattr(ts.KvStore, "delete_range", refuse("KvStore.delete_range"))
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            tried.append(f"os.open({path!r}, {flags:#o})")
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    release = _mirror._release

    def release_later(*args):  # while writes are refused: once they work again, as usual
        if os.unlink is real_unlink:
            release(*args)
        else:
            tried.append(("mirror", args))

    monkeypatch.setattr(_mirror, "_release", release_later)
    return tried


def test_a_manager_on_a_read_only_mount_reads_without_writing(root, monkeypatch):
    """An evaluation job reading a run from a read-only mount: before, the constructor's clean-up
    of a step abandoned by a crash raised a raw OSError EROFS, so latest_step() and restore() were
    unusable. Readers write nothing; clean-up happens when a manager saves."""
    m = tsckpt.CheckpointManager(root)
    m.save(1, _state(1))
    _make_incomplete(m, 2)  # a crashed save's step: cleaned by the next save, never by a reader
    loc = tsckpt._storage.locations.resolve(root)
    if loc.local is not None:
        os.makedirs(os.path.join(loc.local, "00000003"))  # an empty step directory: also a save's to clear
        os.makedirs(os.path.join(loc.local, ".tsckpt-deleting-00000000-0123abcd", "w"))  # a deletion cut short
    before = sorted(k for k in loc.kvstore().list().result())
    tried = _read_only(monkeypatch)
    reader = tsckpt.CheckpointManager(root, keep_last=1)
    assert reader.all_steps() == [1] and reader.latest_step() == 1
    _check(reader.restore(), 1)
    _check(reader.restore(1), 1)
    with pytest.raises(tsckpt.CheckpointIncompleteError):
        reader.restore(2)
    assert tsckpt.open(reader.directory(1))["step"] == 1
    assert [t for t in tried if t[0] != "mirror"] == []  # the readers' own mirrors: removed once writes work
    with pytest.raises(tsckpt.StorageError) as e:  # saving is refused precisely, on the save path
        reader.save(4, _state(4))
    assert e.value.errno == errno.EROFS and "read-only" in str(e.value)
    reader.close()
    gc.collect()
    monkeypatch.undo()
    for args in [t[1] for t in tried if t[0] == "mirror"]:
        _mirror._release(*args)
    assert sorted(k for k in loc.kvstore().list().result()) == before
    writer = tsckpt.CheckpointManager(root)
    writer.save(4, _state(4))  # a writer's first save cleans up
    assert writer.all_steps() == [1, 4]
    assert not [k for k in loc.kvstore().list().result() if k.startswith((b"00000002", b"00000003"))]
    if loc.local is not None:
        assert sorted(os.listdir(loc.local)) == ["00000001", "00000004"]
    writer.close()


def test_a_managers_clean_up_never_removes_a_step_another_job_just_claimed(tmp_path, monkeypatch):
    """Two jobs starting on one run save the same step. Job B's clean-up judged step 7 free to
    remove (a directory holding only the lock file of a root being written) just before job A's
    save claimed it, then removed it: A went on writing into a directory recreated without a
    root, or B saved into it and A's data landed in B's checkpoint. Before: both failed and the
    step was left with array files and no root, which every manager refused from then on.
    Now the removal is conditional on the root judged: exactly one save wins, the other is
    refused, nothing is left blocked."""
    import threading

    import tsckpt._save.protocol as save_module

    run = tmp_path / "run"
    a = tsckpt.CheckpointManager(run)
    (run / "00000007").mkdir(parents=True)
    (run / "00000007" / f"{ROOT_KEY}.__lock").write_bytes(b"")  # a claim being written
    writing, release = threading.Event(), threading.Event()
    real_write, real_holds = save_module._write, manager_module.CheckpointManager._holds_data
    held: list = []

    def write(*args, **kwargs):  # job A's save waits in its write step
        if not writing.is_set():
            writing.set()
            assert release.wait(60)
        return real_write(*args, **kwargs)

    def holds_data(self, name):  # job B judges the step; then job A claims it
        found = real_holds(self, name)
        if self is not a and name == "00000007" and not held:
            held.append(a.save_async(7, _state(70)))
            assert writing.wait(60)
        return found

    monkeypatch.setattr(save_module, "_write", write)
    monkeypatch.setattr(manager_module.CheckpointManager, "_holds_data", holds_data)
    outcome: dict[str, BaseException | None] = {}
    try:
        b = tsckpt.CheckpointManager(run)
        b.save(7, _state(71))
        outcome["b"] = None
    except BaseException as e:  # noqa: BLE001 - judged below
        outcome["b"] = e
    finally:
        release.set()
    assert held, "job A never started"
    outcome["a"] = held[0].exception(timeout=60)
    monkeypatch.undo()
    winners = [k for k, e in outcome.items() if e is None]
    assert len(winners) == 1, outcome
    loser = next(e for e in outcome.values() if e is not None)
    assert isinstance(loser, (tsckpt.CheckpointExistsError, tsckpt.SaveInProgressError)), repr(loser)
    _check(tsckpt.restore(a.directory(7)), 70 if winners == ["a"] else 71)
    c = tsckpt.CheckpointManager(run)
    c.save(8, _state(8))  # nothing left blocked
    assert c.all_steps() == [7, 8]
    a.close()


def test_the_first_save_applies_the_retention_a_crash_left_owed(tmp_path, monkeypatch):
    """A run killed between a commit and its retention leaves an expired step; the next run's
    first save removes it before it claims its own step, so kills in a row never pile them up."""
    import tsckpt._save.protocol as save_module

    root = str(tmp_path / "run")
    owed = tsckpt.CheckpointManager(root)  # no retention: as if each run died before applying it
    for step in (1, 2, 3):
        owed.save(step, {"x": torch.full((4,), float(step))})
    manager = tsckpt.CheckpointManager(root, keep_last=2)
    assert manager.all_steps() == [1, 2, 3]  # a manager that only reads removes nothing
    at_claim: list[list[int]] = []
    real = save_module._begin
    monkeypatch.setattr(save_module, "_begin", lambda *a, **k: (at_claim.append(manager.all_steps()), real(*a, **k))[1])
    manager.save(4, {"x": torch.full((4,), 4.0)})
    assert at_claim == [[2, 3]]  # step 1 was owed to retention before step 4 was claimed
    assert manager.all_steps() == [3, 4]
    assert (manager.restore(4)["x"] == 4.0).all()


def test_an_async_saves_result_is_out_at_its_commit_before_retention_removes_files(tmp_path, monkeypatch):
    """Retention renames an expired step away before the result (it is no step from then on) and
    removes its files after: the save is over at its commit."""
    import shutil
    import threading

    release, removing = threading.Event(), threading.Event()
    real = shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):
        if os.path.basename(str(path)).startswith(".tsckpt-deleting-00000001"):
            removing.set()
            assert release.wait(30)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    m = tsckpt.CheckpointManager(tmp_path, keep_last=1, writer="thread")
    m.save_async(1, {"w": np.arange(4.0)}).result(timeout=30)
    handle = m.save_async(2, {"w": np.arange(4.0) + 1})
    handle.result(timeout=30)  # while step 1's files are still being removed
    assert removing.wait(30)
    assert m.all_steps() == [2]
    assert not (tmp_path / "00000001").exists()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tsckpt-deleting-00000001")]
    release.set()
    m.close()  # the worker finishes its housekeeping
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tsckpt-deleting-")]
    assert m.restore(2)["w"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_synchronous_save_returns_with_retention_done(tmp_path):
    m = tsckpt.CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        m.save(step, {"w": np.full(3, float(step))})
    assert m.all_steps() == [3] and sorted(os.listdir(tmp_path)) == [n for n in sorted(os.listdir(tmp_path)) if not n.startswith(".tsckpt-deleting-")]
