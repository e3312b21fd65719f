"""A file of a checkpoint swapped for a link AFTER it was checked is never read through the
link: every reader reads through descriptors opened with no link followed (tsckpt's own
readers, TensorStore through its mirror, safetensors, torch.save files, DCP, Orbax)."""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import tsckpt
from tests.races import swap_with_link
from tsckpt._errors import TsckptError
from tsckpt._formats import torchfile
from tsckpt._ondisk.checkpoint import Checkpoint
from tsckpt._storage import beneath, confine, mirror, native
from tsckpt._storage.confine import Root, confined, open_read

SECRET = 7.0  # every element of the data outside the checkpoint
REAL = 1.0  # every element of the checkpoint's own data
RACE_SECONDS = 1.0  # how long the race runs (a thread, no process: the fast tier)


@pytest.fixture(params=["openat2", "nofollow"])
def opens(request, monkeypatch):
    """Each test twice: with openat2, and with the O_NOFOLLOW walk where openat2 is missing."""
    if request.param == "openat2" and not native.has_openat2():
        pytest.skip("openat2 (Linux 5.6) is refused or missing here")
    if request.param == "nofollow":
        monkeypatch.setattr(native, "has_openat2", lambda: False)
    return request.param


def _swap_for_link(path: str, target: str) -> None:
    """Replace the file or directory ``path`` with a symbolic link to ``target``."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
    os.symlink(target, path)


def _own_pair(tmp_path) -> tuple[str, str]:
    """A checkpoint (REAL) and one outside it of the same tree (SECRET): its chunk files are
    valid ones, the most a link could lead a reader to."""
    real, secret = str(tmp_path / "ck"), str(tmp_path / "secret")
    tsckpt.save(real, {"w": torch.full((64, 64), REAL), "n": 1})
    tsckpt.save(secret, {"w": torch.full((64, 64), SECRET), "n": 2})
    return real, secret


def _chunk_files(root: str, array: str) -> list[str]:
    """The chunk files of ``array`` (``c.0.0`` beside its zarr.json, or those below its ``c/``)."""
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(os.path.join(root, array)) for f in fs
        if f != "zarr.json"
    )


# ---- the opens themselves ----------------------------------------------------------------


def test_open_beneath_refuses_a_link_anywhere(tmp_path, opens):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(b"inside")
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", tmp_path / "d" / "link")
    os.symlink(tmp_path / "d" / "e", tmp_path / "d" / "dirlink")
    top = beneath.open_directory(str(tmp_path / "d"))
    try:
        fd = beneath.open_beneath(top, "e/f")
        assert os.read(fd, 10) == b"inside"
        os.close(fd)
        for rel in ("link", "dirlink/f"):
            with pytest.raises(OSError) as info:
                beneath.open_beneath(top, rel)
            assert info.value.errno in beneath.LINK_ERRNOS
        with pytest.raises(OSError) as info:
            beneath.open_beneath(top, "dirlink", directory=True)
        assert info.value.errno in beneath.LINK_ERRNOS
    finally:
        os.close(top)


def test_a_confined_path_checked_clean_refuses_a_link_planted_after(tmp_path, opens):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "weights").write_bytes(b"inside")
    (tmp_path / "key").write_bytes(b"PRIVATE KEY")
    path = confined(Root(str(tmp_path / "ck")), "weights", where="index.json", field="weight_map['w']")
    assert isinstance(path, confine.Confined) and path == str(tmp_path / "ck" / "weights")
    _swap_for_link(path, str(tmp_path / "key"))
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        open_read(path)
    assert str(info.value).startswith(
        f"index.json: weight_map['w'] 'weights': weights is a symbolic link (to {tmp_path / 'key'}); "
        "tsckpt does not follow symbolic links in a checkpoint"
    )


def test_a_file_on_the_way_is_left_to_the_caller_as_missing(tmp_path, opens):
    (tmp_path / "a").write_bytes(b"a file, not a directory")
    path = confined(str(tmp_path), "a/b", where="index.json", field="weight_map['w']")
    assert path == str(tmp_path / "a" / "b") and not os.path.isfile(path)
    with pytest.raises(NotADirectoryError):
        open_read(path)


def test_the_checkpoint_directory_is_opened_once(tmp_path, opens):
    """Renaming the checkpoint's directory and putting another in its place changes nothing
    for a path already confined: it reads the directory that was opened."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "f").write_bytes(b"first")
    path = confined(str(tmp_path / "ck"), "f", where="w", field="f")
    os.rename(tmp_path / "ck", tmp_path / "moved")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "f").write_bytes(b"other")
    fd = open_read(path)
    try:
        assert os.read(fd, 10) == b"first"
    finally:
        os.close(fd)


# ---- tsckpt's own format: TensorStore reads through the mirror ----------------------------


@pytest.mark.parametrize("swapped", ["chunk", "array directory", "zarr.json"])
def test_a_lazy_reader_never_reads_a_link_planted_after_open(tmp_path, opens, swapped):
    real, secret = _own_pair(tmp_path)
    reader = tsckpt.open(real)  # checks for links: none yet
    rel = {"chunk": _chunk_files(real, "w")[0], "array directory": "w", "zarr.json": "w/zarr.json"}[swapped]
    _swap_for_link(os.path.join(real, rel), os.path.join(secret, rel))
    with pytest.raises(tsckpt.LinkRefusedError, match=r"leaf 'w': the file 'w/.*' is a symbolic link|leaf 'w': the file"):
        reader["w"][:4, :4]


def test_a_restore_through_tensorstore_never_reads_a_link_planted_after_the_check(tmp_path, opens, monkeypatch):
    """The walk for links passes; the chunk file is swapped right after it (the race's window,
    made certain); the restore reads through TensorStore (a cast) and must refuse."""
    real, secret = _own_pair(tmp_path)
    chunk = _chunk_files(real, "w")[0]
    checked = Checkpoint.check_links

    def check_then_swap(self, *, deferred=False):
        checked(self, deferred=deferred)
        if self._cache.get("links") == "checked" and not os.path.islink(os.path.join(real, chunk)):  # the walk ran
            _swap_for_link(os.path.join(real, chunk), os.path.join(secret, chunk))

    monkeypatch.setattr(Checkpoint, "check_links", check_then_swap)
    target = {"w": torch.zeros(64, 64, dtype=torch.float64), "n": 0}
    with pytest.raises(tsckpt.LinkRefusedError, match="leaf 'w': the file 'w/c.0.0'"):
        tsckpt.restore(real, target, inplace=True)
    assert not (target["w"] == SECRET).any()


def test_a_compact_checkpoints_database_is_read_as_it_was_opened(tmp_path, opens):
    """A compact checkpoint's few files are all held once TensorStore first reads it: its
    database swapped for links to another checkpoint's afterwards is never read."""
    real, secret = str(tmp_path / "ck"), str(tmp_path / "secret")
    tsckpt.save(real, {"w": torch.full((64, 64), REAL)}, layout="compact")
    tsckpt.save(secret, {"w": torch.full((64, 64), SECRET)}, layout="compact")
    reader = tsckpt.open(real)
    for entry in os.listdir(real):  # the manifest and the data directories: the whole database
        if entry != "zarr.json":
            _swap_for_link(os.path.join(real, entry), os.path.join(secret, entry))
    try:
        got = np.asarray(reader["w"][:])
    except TsckptError:
        return  # refused: as good
    assert (got == REAL).all()


def test_a_root_zarr_json_that_is_a_link_is_refused(tmp_path, opens):
    real, secret = _own_pair(tmp_path)
    _swap_for_link(os.path.join(real, "zarr.json"), os.path.join(secret, "zarr.json"))
    with pytest.raises(tsckpt.LinkRefusedError, match="the root metadata 'zarr.json': zarr.json is a symbolic link"):
        tsckpt.restore(real)


def test_a_mirror_links_only_held_descriptors_and_goes_with_its_checkpoint(tmp_path, opens):
    real, _ = _own_pair(tmp_path)
    m = mirror.Mirror(real, real)
    m.add(["w/zarr.json", "missing/zarr.json"])
    m.add_tree("w")
    links = {
        os.path.relpath(os.path.join(d, f), m.path): os.readlink(os.path.join(d, f))
        for d, _, fs in os.walk(m.path) for f in fs
    }
    assert sorted(links) == sorted(["w/zarr.json", *_chunk_files(real, "w")])
    assert all(t.startswith(f"{mirror.FD_DIR}/") for t in links.values())
    os.remove(os.path.join(real, "w", "zarr.json"))  # the held descriptor still reads the file
    with open(os.path.join(m.path, "w", "zarr.json"), "rb") as f:
        assert b"zarr_format" in f.read()
    path = m.path
    del m  # removed by the removal thread, soon
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(path)


def test_without_descriptor_names_tensorstore_reads_are_refused_loudly(tmp_path, monkeypatch):
    real, _ = _own_pair(tmp_path)
    monkeypatch.setattr(mirror, "FD_DIR", str(tmp_path / "no-proc"))
    with pytest.raises(tsckpt.StorageError, match=r"which this system lacks \(is /proc mounted\?\)"):
        tsckpt.open(real)["w"][:]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_forked_child_letting_its_reader_go_leaves_the_parents_mirror_be(tmp_path):
    """A forked child (a data loader's worker) that drops its copy of an opened reader must
    not remove the mirror its parent still reads through."""
    real, _ = _own_pair(tmp_path)
    reader = tsckpt.open(real)
    assert (np.asarray(reader["w"][:2, :2]) == REAL).all()  # the mirror holds the array's files
    pid = os.fork()
    if pid == 0:
        try:
            del reader
            import gc

            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert (np.asarray(reader["w"][:]) == REAL).all()  # read again: the parent's mirror is still there


# ---- other formats -----------------------------------------------------------------------


def _safetensors_dir(tmp_path) -> tuple[str, str]:
    """A one-file Hugging Face directory (REAL) and, outside it, a private key."""
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.full((16,), REAL)}, str(d / "model.safetensors"))
    key = tmp_path / "id_rsa"
    # bytes a safetensors reader would accept as this tensor's, had it followed the link
    key.write_bytes((d / "model.safetensors").read_bytes()[:-64] + np.full(16, SECRET, np.float32).tobytes())
    return str(d), str(key)


def test_safetensors_reads_never_follow_a_link_planted_after_open(tmp_path, opens):
    d, key = _safetensors_dir(tmp_path)
    reader = tsckpt.open(d)
    _swap_for_link(os.path.join(d, "model.safetensors"), key)
    with pytest.raises(tsckpt.LinkRefusedError, match="model.safetensors is a symbolic link"):
        reader["w"][:]


def test_convert_of_safetensors_writes_no_outside_bytes(tmp_path, opens, monkeypatch):
    from tsckpt._formats import safetensors as st

    d, key = _safetensors_dir(tmp_path)
    read_header = st.read_header

    def read_then_swap(path):  # the header is read (checked); then the file becomes a link
        got = read_header(path)
        if not os.path.islink(path):
            _swap_for_link(path, key)
        return got

    monkeypatch.setattr(st, "read_header", read_then_swap)
    with pytest.raises(tsckpt.LinkRefusedError):
        tsckpt.convert(d, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_torch_save_shard_swapped_after_its_check_is_refused(tmp_path, opens, monkeypatch):
    d = tmp_path / "pt"
    d.mkdir()
    torch.save({"w": torch.full((4,), REAL)}, d / "pytorch_model.bin")
    torch.save({"w": torch.full((4,), SECRET)}, tmp_path / "private.bin")
    read = torchfile.read_torch_file

    def swap_then_read(path):  # confined() checked it; the link comes before the read
        _swap_for_link(path, str(tmp_path / "private.bin"))
        return read(path)

    monkeypatch.setattr("tsckpt._formats.torchdir.read_torch_file", swap_then_read)
    with pytest.raises(tsckpt.LinkRefusedError, match="pytorch_model.bin is a symbolic link"):
        tsckpt.restore(str(d))


def test_a_dcp_data_file_swapped_after_open_is_refused(tmp_path, opens):
    import torch.distributed.checkpoint as dcp

    d, outside = str(tmp_path / "dcp"), str(tmp_path / "outside")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.full((8,), REAL)}, checkpoint_id=d, no_dist=True)
        dcp.save({"w": torch.full((8,), SECRET)}, checkpoint_id=outside, no_dist=True)
    reader = tsckpt.open(d, allow_pickle=True)
    data = min(f for f in os.listdir(d) if f.endswith(".distcp"))
    _swap_for_link(os.path.join(d, data), os.path.join(outside, data))
    with pytest.raises(tsckpt.LinkRefusedError, match=f"{data} is a symbolic link"):
        reader["w"][:]


def test_an_orbax_array_swapped_after_open_is_never_read(tmp_path, opens):
    pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    real, outside = tmp_path / "orbax", tmp_path / "outside"
    with ocp.PyTreeCheckpointer() as ckptr:
        for where, value in ((real, REAL), (outside, SECRET)):
            ckptr.save(where, {"w": jnp.full((8,), value)})
    reader = tsckpt.open(str(real))
    # every file of the item (its OCDBT database) held since open: whatever is swapped now
    for d, _, files in os.walk(real):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), real)
            if os.path.exists(outside / rel):
                _swap_for_link(os.path.join(real, rel), str(outside / rel))
    assert np.asarray(reader["w"][:]).tolist() == [REAL] * 8


# ---- the race ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_swapping_race_never_returns_or_writes_outside_bytes(tmp_path):
    """Threads swap a chunk file and a safetensors file with links to outside data, one
    rename at a time, while restores (through TensorStore), lazy reads, safetensors restores
    and converts run for a second: each returns the checkpoint's own bytes or raises."""
    real, secret = _own_pair(tmp_path)
    chunk = _chunk_files(real, "w")[0]
    hf, key = _safetensors_dir(tmp_path)
    keeps = {os.path.join(real, chunk): str(tmp_path / "keep-chunk"), os.path.join(hf, "model.safetensors"): str(tmp_path / "keep-st")}
    targets = {os.path.join(real, chunk): os.path.join(secret, chunk), os.path.join(hf, "model.safetensors"): key}
    stop = threading.Event()
    threads = [swap_with_link(path, targets[path], keep, stop) for path, keep in keeps.items()]
    seen: dict[str, int] = {"ok": 0, "refused": 0}
    outside = 0
    deadline = time.monotonic() + RACE_SECONDS
    try:
        while time.monotonic() < deadline:
            for read in (
                lambda: np.asarray(tsckpt.restore(real, {"w": torch.zeros(64, 64, dtype=torch.float64), "n": 0})["w"]),
                lambda: np.asarray(tsckpt.open(real)["w"][:]),
                lambda: np.asarray(tsckpt.restore(hf)["w"]),
                lambda: _converted(hf, tmp_path),
            ):
                try:
                    got = read()
                except TsckptError:
                    seen["refused"] += 1
                    continue
                outside += int((got == SECRET).any())
                assert (got == REAL).all()
                seen["ok"] += 1
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert outside == 0
    assert seen["ok"] > 0 and seen["refused"] > 0, seen  # the race was run, both ways


def _converted(src: str, tmp_path) -> np.ndarray:
    out = str(tmp_path / "converted")
    shutil.rmtree(out, ignore_errors=True)
    tsckpt.convert(src, out)
    return np.asarray(tsckpt.restore(out)["w"])
