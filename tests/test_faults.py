"""Storage faults and interrupted saves: faults are OSErrors with errno, file and leaf; a
failed save leaves nothing behind; overwrite=True never removes a save still running.

Real faults where the machine allows them (a full tmpfs needs root to mount; an
unreadable file needs a process without the capability to override permissions);
the same assertions by fault injection everywhere: the write or read step raises
what TensorStore raises.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._save.commit as commit_module
import tsckpt._save.lease as lease_module
import tsckpt._read.restore as restore_module
import tsckpt._save.protocol as save_module
import tsckpt._storage.durable as durable
from tsckpt._storage.faults import storage_problem
from tsckpt._storage.locations import resolve
from tsckpt._ondisk.records import ROOT_KEY

ROOT_DIR = str(Path(tsckpt.__file__).resolve().parent.parent)  # this tsckpt, for child processes


def _tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(600_000, generator=g), "b": torch.arange(10.0) + seed, "step": seed}


def _check(out: dict, seed: int) -> None:
    ref = _tree(seed)
    np.testing.assert_array_equal(np.asarray(out["a"]), ref["a"].numpy())
    np.testing.assert_array_equal(np.asarray(out["b"]), ref["b"].numpy())
    assert out["step"] == seed


def _enospc(path: str) -> ValueError:
    """What TensorStore raises when a chunk file cannot be written on a full disk."""
    return ValueError(
        f'RESOURCE_EXHAUSTED: Error writing local file "{path}": Failed writing: "{path}.__lock": '
        "Failed to write 1359720 bytes to file 4: No space left on device [os_error_code='28']"
    )


def _eacces_read(path: str) -> ValueError:
    """What TensorStore raises when a chunk file cannot be opened for reading."""
    return ValueError(
        f'PERMISSION_DENIED: Error reading shard entry {{0}}/{{5}} in local file "{path}": Failed to open: '
        f"\"{path}\": Permission denied [os_error_code='13']"
    )


def _root(directory: str) -> dict:
    with open(os.path.join(directory, ROOT_KEY)) as f:
        return json.load(f)["attributes"]["tsckpt"]


def _assert_disk_full(err: BaseException, ckdir: str) -> None:
    assert isinstance(err, tsckpt.StorageFullError) and isinstance(err, tsckpt.StorageError)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    file = os.path.join(ckdir, "a", "c.0")
    assert err.filename == file and err.leaf == "a"
    msg = str(err)
    assert msg.startswith(f"{ckdir}: no space left on device (ENOSPC) while writing leaf 'a' (")
    assert file in msg  # quoted in TensorStore's message; shard files tsckpt writes itself name it plainly
    assert f"free space on the filesystem holding {ckdir} (or save elsewhere), then save again" in msg
    assert msg.endswith("the partial checkpoint was removed, so saving again needs no overwrite=True")


# ---- the error itself ---------------------------------------------------------------


def test_storage_error_is_an_oserror_that_keeps_its_message_and_pickles():
    err = tsckpt.StorageFullError("/ck: no space left", errno=errno.ENOSPC, filename="/ck/w/c/0", leaf="w")
    assert isinstance(err, tsckpt.StorageError) and isinstance(err, OSError)
    assert str(err) == "/ck: no space left"  # not OSError's "[Errno 28] ..."
    assert (err.errno, err.filename, err.leaf) == (errno.ENOSPC, "/ck/w/c/0", "w")
    assert err.strerror == os.strerror(errno.ENOSPC)
    back = pickle.loads(pickle.dumps(err))  # rank 0's errors reach the other ranks pickled
    assert type(back) is tsckpt.StorageFullError and str(back) == str(err)
    assert (back.errno, back.filename, back.leaf) == (errno.ENOSPC, "/ck/w/c/0", "w")


@pytest.mark.parametrize(
    "text, code, cls, fix",
    [
        ("RESOURCE_EXHAUSTED: Error writing local file \"{f}\": No space left on device [os_error_code='28']",
         errno.ENOSPC, tsckpt.StorageFullError, "free space on the filesystem holding {d}"),
        ("RESOURCE_EXHAUSTED: Error writing local file \"{f}\": Disk quota exceeded [os_error_code='122']",
         errno.EDQUOT, tsckpt.StorageFullError, "free space within your disk quota"),
        ("PERMISSION_DENIED: Failed to create directory: \"{f}\": Read-only file system [os_error_code='30']",
         errno.EROFS, tsckpt.StorageError, "is mounted read-only: save to a writable location"),
        ("PERMISSION_DENIED: Error writing local file \"{f}\": Permission denied [os_error_code='13']",
         errno.EACCES, tsckpt.StorageError, "give the user running this process write access to {d}"),
        ("UNKNOWN: Error writing local file \"{f}\": Input/output error [os_error_code='5']",
         errno.EIO, tsckpt.StorageError, "the storage device reported an I/O error"),
        ("RESOURCE_EXHAUSTED: Error writing local file \"{f}\": No space left on device",
         errno.ENOSPC, tsckpt.StorageFullError, "free space"),  # no code: read off the text
    ],
)
def test_tensorstore_os_errors_become_storage_errors(tmp_path, text, code, cls, fix):
    d = str(tmp_path / "ck")
    f = os.path.join(d, "model", "w", "c", "1", "0")
    err = storage_problem(resolve(d), ValueError(text.format(f=f)))
    assert type(err) is cls and err.errno == code
    assert err.filename == f and err.leaf == "model/w"
    assert str(err).startswith(f"{d}: {os.strerror(code)[0].lower()}{os.strerror(code)[1:]} ({errno.errorcode[code]}) "
                               "while writing leaf 'model/w' (")
    assert fix.format(d=d) in str(err)


def test_a_tensorstore_message_joining_a_key_by_nul_reads_with_a_slash(tmp_path):
    d = str(tmp_path / "ck")
    text = f"PERMISSION_DENIED: Failed to create directory: \"{d}/00000003\x00zarr.json\": Operation not permitted [os_error_code='1']"
    err = storage_problem(resolve(d), ValueError(text))
    assert "\x00" not in str(err) and f'"{d}/00000003/zarr.json"' in str(err)


def test_missing_files_stay_damage_not_storage_faults(tmp_path):
    loc = resolve(tmp_path / "ck")
    text = "NOT_FOUND: Error reading local file \"/x/w/c/0\": No such file or directory [os_error_code='2']"
    assert storage_problem(loc, ValueError(text)) is None
    assert storage_problem(loc, FileNotFoundError(errno.ENOENT, "gone", "/x")) is None
    assert storage_problem(loc, ValueError("DATA_LOSS: digest mismatch")) is None


# ---- a disk that fills up during a save ------------------------------------------------


def test_disk_full_injected(ckdir, layout, monkeypatch):
    """Runs everywhere: the write step writes its data, then fails as TensorStore does on a full disk."""
    real = save_module._write_regions

    def full(*args, **kwargs):
        real(*args, **kwargs)
        raise _enospc(os.path.join(ckdir, "a", "c.0"))

    monkeypatch.setattr(save_module, "_write_regions", full)
    with pytest.raises(OSError) as e:
        tsckpt.save(ckdir, _tree(), layout=layout)
    _assert_disk_full(e.value, ckdir)
    assert not os.path.exists(ckdir)  # nothing that looks like a checkpoint, nothing to clear
    monkeypatch.undo()  # space was freed
    tsckpt.save(ckdir, _tree(), layout=layout)  # no overwrite=True needed
    _check(tsckpt.restore(ckdir), 0)


def test_compact_checkpoint_replaced_in_the_same_process(ckdir):
    """The replaced database's B-tree, cached by the first save, is not built upon."""
    tsckpt.save(ckdir, _tree(0), layout="compact")
    _check(tsckpt.restore(ckdir), 0)
    tsckpt.save(ckdir, _tree(1), layout="compact", overwrite=True)
    _check(tsckpt.restore(ckdir), 1)
    assert tsckpt.verify(ckdir).ok


def test_compact_save_retried_after_a_failure_between_windows(ckdir, monkeypatch):
    """Compact layout: the disk fills after some windows of the database were committed.
    Before: retrying in the same process failed with a raw ``ValueError NOT_FOUND ... OCDBT``
    (the database driver of the failed save, still alive and cached in the process's context,
    remembered the removed database), however often it was retried, though the error said
    saving again needs no overwrite=True. Each save now writes through a context of its own."""
    real = tsckpt._save.write._Writers.commit
    windows: list[int] = []

    def full(self, window):
        windows.append(len(window))
        if len(windows) == 2:  # the first window's transaction is committed in the database
            raise _enospc(os.path.join(ckdir, "ocdbt.r0", "d", "0"))
        return real(self, window)

    monkeypatch.setattr(tsckpt._save.write._Writers, "commit", full)
    tree = {f"l{i}": torch.arange(100_000, dtype=torch.float32) + i for i in range(6)}
    for run in (ckdir, os.path.join(os.path.dirname(ckdir), "run")):
        windows.clear()
        with pytest.raises(tsckpt.StorageFullError, match="saving again needs no overwrite=True"):
            if run == ckdir:
                tsckpt.save(run, tree, layout="compact", max_inflight_bytes=500_000)
            else:
                tsckpt.CheckpointManager(run, layout="compact").save(1, tree, max_inflight_bytes=500_000)
        assert len(windows) == 2
    monkeypatch.undo()  # space was freed
    tsckpt.save(ckdir, tree, layout="compact", max_inflight_bytes=500_000)
    m = tsckpt.CheckpointManager(os.path.join(os.path.dirname(ckdir), "run"), layout="compact")
    m.save(1, tree, max_inflight_bytes=500_000)
    for out in (tsckpt.restore(ckdir), m.restore(1)):
        assert {k: v.tolist() for k, v in out.items()} == {k: v.tolist() for k, v in tree.items()}
    assert tsckpt.verify(ckdir).ok


def _mount(*args: str) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, where the system lets this process mount one (root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)):
        pytest.skip("cannot mount a tmpfs here; test_disk_full_injected makes the same assertions")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.mark.slow
def test_disk_full_on_a_small_tmpfs(small_tmpfs):
    ckdir = str(small_tmpfs / "ck")
    with pytest.raises(OSError) as e:
        tsckpt.save(ckdir, _tree())  # 2.4 MB of data on a 1 MiB filesystem
    _assert_disk_full(e.value, ckdir)
    assert os.listdir(small_tmpfs) == []
    assert _mount("-o", "remount,size=8m", str(small_tmpfs))  # space is freed
    tsckpt.save(ckdir, _tree())
    _check(tsckpt.restore(ckdir), 0)


def test_failed_sync_is_a_storage_error(ckdir, monkeypatch):
    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(durable.os, "fsync", eio)
    with pytest.raises(tsckpt.StorageError) as e:
        tsckpt.save(ckdir, {"w": np.arange(4.0)})
    assert e.value.errno == errno.EIO and e.value.filename.startswith(ckdir)
    assert str(e.value).startswith(f"{ckdir}: input/output error (EIO) while writing")
    assert "check the disk and the system log (dmesg), then save again" in str(e.value)
    monkeypatch.undo()
    tsckpt.save(ckdir, {"w": np.arange(4.0)})


def test_any_failure_after_the_claim_removes_the_partial_checkpoint(ckdir, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(save_module, "_commit", interrupted)
    with pytest.raises(KeyboardInterrupt) as e:
        tsckpt.save(ckdir, _tree())
    assert e.value.__notes__ == ["the partial checkpoint was removed, so saving again needs no overwrite=True"]
    assert not os.path.exists(ckdir)
    monkeypatch.undo()
    tsckpt.save(ckdir, _tree(1))
    _check(tsckpt.restore(ckdir), 1)


def test_when_removal_fails_the_error_says_overwrite_is_needed(ckdir, monkeypatch):
    real = save_module._write_regions

    def full(*args, **kwargs):
        real(*args, **kwargs)
        raise _enospc(os.path.join(ckdir, "a", "c.0"))

    def refused(loc):
        raise PermissionError(errno.EACCES, "Permission denied", loc.local)

    monkeypatch.setattr(save_module, "_write_regions", full)
    monkeypatch.setattr(tsckpt._save.lease, "delete_below_root", refused)
    with pytest.raises(tsckpt.StorageFullError) as e:
        tsckpt.save(ckdir, _tree())
    msg = str(e.value)
    assert msg.startswith(f"{ckdir}: no space left on device (ENOSPC) while writing leaf 'a'")
    assert f"the partial checkpoint at {ckdir} could not be removed ({ckdir}: permission denied (EACCES)" in msg
    assert msg.endswith("); pass overwrite=True when saving again")
    monkeypatch.undo()
    with pytest.raises(tsckpt.CheckpointExistsError, match="one crashed .* pass overwrite=True"):
        tsckpt.save(ckdir, _tree(1))  # the pending root goes last: what is left is a crashed save's
    tsckpt.save(ckdir, _tree(1), overwrite=True)
    _check(tsckpt.restore(ckdir), 1)


# ---- files the process may not read or write -------------------------------------------

_UNPRIVILEGED = """
import json, sys, numpy as np, tsckpt
what, directory, probe = sys.argv[1:4]
try:
    open(probe, "rb").close()
    print(json.dumps({"privileged": True}))
    sys.exit(0)
except PermissionError:
    pass
try:
    if what == "save":
        tsckpt.save(directory, {"w": np.arange(4.0)})
    else:
        tsckpt.restore(directory)
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"error": [c.__name__ for c in type(e).__mro__], "errno": getattr(e, "errno", None),
                      "filename": getattr(e, "filename", None), "leaf": getattr(e, "leaf", None), "msg": str(e)}))
"""


def _unprivileged(what: str, directory: str, probe: str) -> dict:
    """Run a save or restore in a process that file permissions apply to (root: without the
    capabilities that override them); skip where no such process can be made."""
    cmd = [sys.executable, "-c", _UNPRIVILEGED, what, directory, probe]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root without setpriv: the injected tests make the same assertions")
        drop = "-dac_override,-dac_read_search"
        cmd = [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", *cmd]
    path = os.pathsep.join(p for p in (ROOT_DIR, os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        pytest.skip(f"cannot run an unprivileged process here ({out.stderr.strip()[-300:]})")
    got = json.loads(lines[-1])
    if got.get("privileged"):
        pytest.skip("file permissions do not apply to this process; the injected tests make the same assertions")
    return got


@pytest.mark.slow
def test_unreadable_chunk_file_on_restore(ckdir):
    tsckpt.save(ckdir, _tree())
    file = os.path.join(ckdir, "a", "c.0")
    os.chmod(file, 0)
    try:
        got = _unprivileged("restore", ckdir, file)
    finally:
        os.chmod(file, 0o644)
    assert "StorageError" in got["error"] and "OSError" in got["error"]
    assert (got["errno"], got["filename"], got["leaf"]) == (errno.EACCES, file, "a")
    assert got["msg"].startswith(f"{ckdir}: permission denied (EACCES) while reading leaf 'a' (")
    assert f"give the user running this process read access to {file}" in got["msg"]


def test_unreadable_chunk_file_injected(ckdir, monkeypatch):
    """Runs everywhere: reads of 'a' fail as TensorStore's do on a file without read permission."""
    tsckpt.save(ckdir, _tree())
    file = os.path.join(ckdir, "a", "c.0")

    class Unreadable:
        def __getitem__(self, box):
            return self

        def read(self):
            return self

        def result(self):
            raise _eacces_read(file)

    real = tsckpt._read.engine._open_all
    monkeypatch.setattr(
        tsckpt._read.engine, "_open_all", lambda ck, paths: {**real(ck, paths), "a": Unreadable()}
    )
    target = {"a": torch.zeros(600_000, dtype=torch.float64), "b": torch.zeros(10), "step": 0}  # a cast: read whole
    with pytest.raises(tsckpt.StorageError) as e:
        tsckpt.restore(ckdir, target)
    assert isinstance(e.value, OSError) and not isinstance(e.value, tsckpt.CorruptCheckpointError)
    assert (e.value.errno, e.value.filename, e.value.leaf) == (errno.EACCES, file, "a")
    assert str(e.value).startswith(f"{ckdir}: permission denied (EACCES) while reading leaf 'a' (")
    assert f"give the user running this process read access to {file}" in str(e.value)
    monkeypatch.setattr(tsckpt._read.reader.LazyArray, "tensorstore", lambda self: Unreadable())
    with pytest.raises(tsckpt.StorageError, match="permission denied .* while reading leaf 'a'") as e:
        tsckpt.open(ckdir)["a"][:3]
    assert e.value.errno == errno.EACCES


@pytest.mark.slow
def test_directory_without_write_permission(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    probe = parent / "probe"
    probe.write_bytes(b"")
    os.chmod(probe, 0)
    os.chmod(parent, 0o555)
    ckdir = str(parent / "ck")
    try:
        got = _unprivileged("save", ckdir, str(probe))
    finally:
        os.chmod(parent, 0o755)
    assert "StorageError" in got["error"] and "OSError" in got["error"]
    assert got["errno"] == errno.EACCES and got["filename"].startswith(ckdir)
    assert got["msg"].startswith(f"{ckdir}: permission denied (EACCES) while writing")
    assert f"give the user running this process write access to {ckdir}" in got["msg"]
    assert not os.path.exists(ckdir)
    tsckpt.save(ckdir, {"w": np.arange(4.0)})  # permissions fixed: no overwrite=True needed


# ---- refused before the claim ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, why",
    [
        (torch.empty(3, device="meta"), "on the meta device"),
        (torch.eye(3).to_sparse(), "sparse"),
        (object(), "object"),
    ],
    ids=["meta", "sparse", "object"],
)
def test_refused_save_leaves_nothing_and_a_corrected_retry_works(ckdir, bad, why):
    with pytest.raises(tsckpt.LeafTypeError, match=f"'model/bad'.*{why}"):
        tsckpt.save(ckdir, {"model": {"w": torch.ones(3), "bad": bad}})
    assert not os.path.exists(ckdir)
    tsckpt.save(ckdir, {"model": {"w": torch.ones(3), "bad": torch.zeros(3)}})
    assert tsckpt.restore(ckdir)["model"]["bad"].tolist() == [0.0] * 3


# ---- overwrite=True and a save still running ----------------------------------------------

_BLOCKED_SAVER = """
import sys, time, numpy as np
import tsckpt, tsckpt._save.lease as lease, tsckpt._save.protocol as save_module
lease.RENEW_SECONDS = 0.2
lease.LEASE_SECONDS = float(sys.argv[3])

def stuck(*args, **kwargs):
    print("writing", flush=True)
    time.sleep(600)

save_module._write = stuck
tree = {"w": np.arange(1000.0), "step": 1}
if sys.argv[1] == "manager":
    tsckpt.CheckpointManager(sys.argv[2]).save(3, tree)
else:
    tsckpt.save(sys.argv[2], tree)
"""

LEASE_S = 3.0


def _blocked_saver(kind: str, directory: str) -> subprocess.Popen:
    """A process whose save claimed ``directory`` and then hangs in its write step."""
    path = os.pathsep.join(p for p in (ROOT_DIR, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_SAVER, kind, directory, str(LEASE_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path},
    )
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    if not ready or proc.stdout.readline().strip() != "writing":
        proc.kill()
        raise AssertionError(f"the saver did not start writing: {proc.stderr.read()[-2000:] if not ready else ''}")
    return proc


@pytest.fixture
def saver():
    procs: list[subprocess.Popen] = []

    def start(kind: str, directory: str) -> subprocess.Popen:
        procs.append(_blocked_saver(kind, directory))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait(30)


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.slow
def test_overwrite_refuses_a_save_running_in_another_process(ckdir, saver):
    proc = saver("save", ckdir)
    claim = _root(ckdir)["claim"]
    assert _root(ckdir)["state"] == "pending" and claim["pid"] == proc.pid and claim["lease_s"] == LEASE_S
    deadline = time.monotonic() + 30
    while _root(ckdir)["claim"]["renewed"] == claim["renewed"]:  # the lease is renewed
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.05)
    with pytest.raises(tsckpt.SaveInProgressError) as e:
        tsckpt.save(ckdir, _tree(), overwrite=True)
    msg = str(e.value)
    assert msg.startswith(f"{ckdir}: another save into this directory is still running (pid {proc.pid} on host ")
    assert "overwrite=True never removes a running save. Wait for it to finish, or save elsewhere" in msg
    assert f"once its lease has expired ({LEASE_S:g} s after its last renewal)" in msg
    with pytest.raises(tsckpt.CheckpointExistsError, match="another save into this directory is still running"):
        tsckpt.save(ckdir, _tree())
    assert _root(ckdir)["state"] == "pending"  # untouched
    _kill(proc)
    # on this machine a dead process is a dead save at once
    tsckpt.save(ckdir, _tree(1), overwrite=True)
    _check(tsckpt.restore(ckdir), 1)


@pytest.mark.slow
def test_elsewhere_a_save_is_dead_once_its_lease_expires(ckdir, saver, monkeypatch):
    proc = saver("save", ckdir)
    monkeypatch.setattr(lease_module, "_machine", lambda: "another machine")  # its pid tells us nothing
    _kill(proc)
    renewed = _root(ckdir)["claim"]["renewed"]  # its last renewal
    clock = [renewed + LEASE_S - 0.01]  # the time the lease is judged at (_claim_running's now), not the wall's
    judge = lease_module._claim_running
    monkeypatch.setattr(
        lease_module, "_claim_running", lambda claim, now=None: judge(claim, clock[0] if now is None else now)
    )
    with pytest.raises(tsckpt.SaveInProgressError, match="another save into this directory is still running"):
        tsckpt.save(ckdir, _tree(), overwrite=True)  # the lease has not expired yet
    assert _root(ckdir)["state"] == "pending" and _root(ckdir)["claim"]["renewed"] == renewed  # untouched
    clock[0] = renewed + LEASE_S  # expired: the save is dead
    tsckpt.save(ckdir, _tree(2), overwrite=True)
    _check(tsckpt.restore(ckdir), 2)


def _blocked_in_thread(monkeypatch, directory: str):
    """This process saves into ``directory`` in a thread, held in its write step until released."""
    writing, release = threading.Event(), threading.Event()
    real = save_module._write
    outcome: list[BaseException | None] = []

    def slow_write(*args, **kwargs):
        if args[0].local == directory:
            writing.set()
            release.wait(60)
        return real(*args, **kwargs)

    def run() -> None:
        try:
            tsckpt.save(directory, _tree(5))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            outcome.append(e)

    monkeypatch.setattr(save_module, "_write", slow_write)
    t = threading.Thread(target=run)
    t.start()
    assert writing.wait(60)
    return t, release, outcome


def test_overwrite_refuses_a_save_running_in_this_process(ckdir, monkeypatch):
    t, release, outcome = _blocked_in_thread(monkeypatch, ckdir)
    try:
        with pytest.raises(tsckpt.SaveInProgressError, match=f"pid {os.getpid()} on host"):
            tsckpt.save(ckdir, _tree(), overwrite=True)
    finally:
        release.set()
        t.join(60)
    assert outcome == [None]
    _check(tsckpt.restore(ckdir), 5)


def test_a_save_whose_root_was_taken_over_does_not_commit(ckdir, monkeypatch):
    t, release, outcome = _blocked_in_thread(monkeypatch, ckdir)
    other = commit_module.root_json("pending", {"claim": lease_module.new_claim()})
    durable.write_durable(resolve(ckdir), ROOT_KEY, other)  # as a save that judged ours dead would
    release.set()
    t.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], tsckpt.CheckpointExistsError)
    msg = str(outcome[0])
    assert msg.startswith(f"{ckdir}: the pending root of this save was replaced or removed by another process")
    assert msg.endswith(f"{ckdir} was taken over by another save meanwhile and was left to it")
    with open(os.path.join(ckdir, ROOT_KEY), "rb") as f:
        assert f.read() == other  # the other save's claim is intact


# ---- two managers on one root ----------------------------------------------------------


@pytest.mark.slow
def test_manager_leaves_a_step_another_process_is_saving(tmp_path, saver):
    run = tmp_path / "run"
    proc = saver("manager", str(run))
    m = tsckpt.CheckpointManager(run, keep_last=1)
    m.save(4, {"w": np.ones(2)})  # its clean-up leaves step 3 alone, as do retention and the clean-up after
    assert sorted(os.listdir(run)) == ["00000003", "00000004"]
    assert _root(str(run / "00000003"))["state"] == "pending"
    assert m.all_steps() == [4]
    with pytest.raises(tsckpt.SaveInProgressError) as e:
        m.save(3, {"w": np.ones(2)})
    assert str(e.value).startswith(
        f"{run}: step 3 is being saved by another save that is still running (pid {proc.pid}"
    )
    _kill(proc)
    tsckpt.CheckpointManager(run).save(5, {"w": np.ones(2)})  # its process is gone: step 3 is a crashed save
    assert sorted(os.listdir(run)) == ["00000004", "00000005"]


def test_convert_with_overwrite_leaves_a_save_still_running(tmp_path, monkeypatch):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tsckpt.save(src, {"w": np.arange(4.0)})
    t, release, outcome = _blocked_in_thread(monkeypatch, dst)
    try:
        with pytest.raises(tsckpt.SaveInProgressError, match="another save into this directory is still running"):
            tsckpt.convert(src, dst, overwrite=True)
        assert _root(dst)["state"] == "pending"
    finally:
        release.set()
        t.join(60)
    assert outcome == [None]
    _check(tsckpt.restore(dst), 5)


def test_a_file_in_the_way_is_a_storage_fault_not_damage(tmp_path):
    """ENOTDIR while reading means a missing chunk; while saving, a path that cannot be made."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    with pytest.raises(tsckpt.StorageError) as info:
        tsckpt.save(str(blocker / "ck"), {"x": np.arange(10)})
    assert info.value.errno == errno.ENOTDIR
    assert str(info.value).startswith(f"{blocker / 'ck'}: not a directory (ENOTDIR) while writing")


def test_a_claim_whose_directory_vanished_lost_the_race(tmp_path, monkeypatch):
    """Another manager clearing the step (renaming the directory away) while this save renames
    TensorStore's lock file into place: ENOENT there means the race was lost, and says so."""
    root = str(tmp_path / "run")
    m = tsckpt.CheckpointManager(root)
    real = durable.write_durable

    def vanished(loc, key, data, *, if_equal=None):
        if key == ROOT_KEY and if_equal is not None and data is not None and b'"pending"' in data:
            lock = os.path.join(loc.local, f"{ROOT_KEY}.__lock")
            raise ValueError(f'NOT_FOUND: Error renaming "{lock}": No such file or directory [os_error_code=\'2\']')
        return real(loc, key, data, if_equal=if_equal)

    monkeypatch.setattr(durable, "write_durable", vanished)
    with pytest.raises(tsckpt.CheckpointExistsError, match="started at the same time and claimed it first"):
        m.save(3, _tree())
    monkeypatch.setattr(durable, "write_durable", lambda *a, **k: (_ for _ in ()).throw(  # any other fault stays one
        ValueError("PERMISSION_DENIED: Error writing \"/x\": Permission denied [os_error_code='13']")))
    with pytest.raises(tsckpt.StorageError, match="permission denied"):
        m.save(4, _tree())
    monkeypatch.undo()
    m.save(3, _tree(1))
    _check(m.restore(3), 1)
