"""Symbolic links inside a local checkpoint are refused by every reader of its data."""

import errno
import os

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._storage import confine as _links
from tsckpt._storage import native
from tsckpt._storage.confine import confined_opens, odd_files, open_beneath, owner


def symlinks(root: str) -> dict[str, str]:
    """Relative path -> link target, for every symbolic link the walk finds below ``root``."""
    return {rel: odd.target for rel, odd in odd_files(root).items() if odd.target is not None}


@pytest.fixture
def linked(tmp_path, small_chunks):
    """A checkpoint whose chunk file of 'm/b' is a link to a copy of its bytes outside."""
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"m": {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(3)}, "n": 1})
    chunk = os.path.join(path, "m", "b", "c.0")
    outside = tmp_path / "elsewhere"
    outside.write_bytes(open(chunk, "rb").read())
    os.remove(chunk)
    os.symlink(outside, chunk)
    return path, str(outside)


def _message(path: str, outside: str) -> str:
    return (
        f"{path}: leaf 'm/b': m/b/c.0 is a symbolic link (to {outside}); tsckpt does not follow symbolic links in a "
        "checkpoint, which must hold its own files (a link could lead anywhere; docs/security.md): replace each "
        "link with a copy of its file (`tsckpt verify` lists them)"
    )


def test_restore_refuses_a_linked_file(linked):
    path, outside = linked
    for target in (None, {"m": {"w": torch.zeros(64, 64), "b": torch.zeros(3)}, "n": 0}):
        with pytest.raises(tsckpt.LinkRefusedError) as info:
            tsckpt.restore(path, target)
        assert str(info.value) == _message(path, outside)


def test_open_and_convert_refuse_a_linked_file(linked, tmp_path):
    path, outside = linked
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        tsckpt.open(path)
    assert str(info.value) == _message(path, outside)
    with pytest.raises(tsckpt.LinkRefusedError, match="m/b/c.0 is a symbolic link"):
        tsckpt.convert(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_metadata_alone_is_still_readable(linked):
    """Listing a checkpoint reads no array data, so it does not need the walk."""
    path, _ = linked
    meta = tsckpt.metadata(path)
    assert meta["m"]["b"].shape == (3,) and meta["n"] == 1


def test_a_linked_directory_is_reported_and_not_followed(tmp_path, small_chunks):
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"w": torch.arange(4096.0).reshape(64, 64)})
    moved = tmp_path / "moved"
    os.rename(os.path.join(path, "w", "c"), moved)
    os.symlink(moved, os.path.join(path, "w", "c"))
    assert symlinks(path) == {"w/c": str(moved)}  # the walk does not descend into the linked directory
    with pytest.raises(tsckpt.LinkRefusedError, match=r"^.*: leaf 'w': w/c is a symbolic link"):
        tsckpt.restore(path)


def test_a_linked_checkpoint_directory_is_fine(tmp_path):
    """`latest -> step_100` is how people point at a checkpoint: the root itself may be a link."""
    real = str(tmp_path / "step_100")
    tsckpt.save(real, {"w": np.arange(5.0)})
    os.symlink(real, tmp_path / "latest")
    assert symlinks(str(tmp_path / "latest")) == {}
    np.testing.assert_array_equal(tsckpt.restore(str(tmp_path / "latest"))["w"], np.arange(5.0))
    np.testing.assert_array_equal(tsckpt.open(str(tmp_path / "latest"))["w"][1:3], [1.0, 2.0])


def test_owner_is_the_longest_array_prefix():
    arrays = ("m", "m/w", "mx")
    assert owner("m/w/c/0", arrays) == "m/w"
    assert owner("m/c/0", arrays) == "m"
    assert owner("mx/zarr.json", arrays) == "mx"
    assert owner("other/file", arrays) is None


needs_openat2 = pytest.mark.skipif(not confined_opens(), reason="openat2 (Linux 5.6) is refused or missing here")


@needs_openat2
def test_open_beneath_refuses_links_and_escapes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"inside")
    (tmp_path / "secret").write_bytes(b"outside")
    os.symlink(tmp_path / "secret", tmp_path / "d" / "file_link")
    os.symlink(tmp_path, tmp_path / "d" / "dir_link")
    fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        f = open_beneath(fd, "f")
        assert os.read(f, 10) == b"inside"
        os.close(f)
        for rel, code in (("file_link", errno.ELOOP), ("dir_link/secret", errno.ELOOP), ("../secret", errno.EXDEV)):
            with pytest.raises(OSError) as info:
                open_beneath(fd, rel)
            assert info.value.errno == code and info.value.filename == rel
        with pytest.raises(FileNotFoundError):
            open_beneath(fd, "missing")
    finally:
        os.close(fd)


@needs_openat2
def test_a_restore_read_whole_by_the_own_readers_walks_nothing(tmp_path, small_chunks, monkeypatch):
    """Own readers refuse links as they open, so the walk waits for TensorStore, which is never needed here."""
    tree = {"m": {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(3)}}
    tsckpt.save(tmp_path / "ck", tree)
    walks: list[str] = []
    real = _links.odd_files
    monkeypatch.setattr(_links, "odd_files", lambda root: walks.append(root) or real(root))
    out = tsckpt.restore(tmp_path / "ck", {"m": {"w": torch.zeros(64, 64), "b": torch.zeros(3)}})
    assert torch.equal(out["m"]["w"], tree["m"]["w"]) and torch.equal(out["m"]["b"], tree["m"]["b"])
    assert walks == []
    tsckpt.open(tmp_path / "ck")  # a lazy reader reads through TensorStore: it walks up front
    assert walks == [str(tmp_path / "ck")]


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "walk-first"])
@pytest.mark.parametrize("linked_part", ["shard", "node", "directory"])
def test_restore_refuses_links_into_a_sharded_array(tmp_path, small_chunks, monkeypatch, openat2, linked_part):
    """A link met by the shard reader is reported as the walk reports it, with or without openat2;
    nothing from outside lands in an in-place target."""
    if openat2 and not confined_opens():
        pytest.skip("openat2 (Linux 5.6) is refused or missing here")
    if not openat2:
        monkeypatch.setattr(native, "has_openat2", lambda: False)
    w = torch.arange(4096.0).reshape(64, 64)
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"w": w, "b": torch.ones(3)})
    rel = {"shard": "w/c/1/0", "node": "w/zarr.json", "directory": "w/c"}[linked_part]
    moved = tmp_path / "outside"
    os.rename(os.path.join(path, rel), moved)
    os.symlink(moved, os.path.join(path, rel))
    target = {"w": torch.zeros(64, 64), "b": torch.zeros(3)}
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        tsckpt.restore(path, target, inplace=True)
    assert str(info.value) == (
        f"{path}: leaf 'w': {rel} is a symbolic link (to {moved}); tsckpt does not follow symbolic links in a "
        "checkpoint, which must hold its own files (a link could lead anywhere; docs/security.md): replace each "
        "link with a copy of its file (`tsckpt verify` lists them)"
    )
    if linked_part != "node":  # the linked shard's rows were not read from outside
        assert not torch.equal(target["w"][16:32], w[16:32])


@needs_openat2
def test_a_link_the_restore_never_meets_is_left_to_open_and_verify(linked):
    """Restoring only 'm/w' opens nothing of 'm/b', whose chunk file is a link: the restore reads
    nothing through it and succeeds; open and verify still report it."""
    path, outside = linked
    with pytest.warns(tsckpt.RestoreWarning):
        out = tsckpt.restore(path, {"m": {"w": torch.zeros(64, 64)}}, strict=False)
    assert torch.equal(out["m"]["w"], torch.arange(4096.0).reshape(64, 64))
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        tsckpt.open(path)
    assert str(info.value) == _message(path, outside)
    report = tsckpt.verify(path)
    assert not report.ok and "m/b/c.0 is a symbolic link" in report.bad["m/b"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fifo", ["b/c.0", "w/c/1/0", "w/zarr.json"])
def test_a_fifo_in_a_checkpoint_is_refused_never_waited_on(tmp_path, small_chunks, fifo):
    """Opening a FIFO waits for a writer forever: restore and open refuse it, naming it, and
    verify lists it without reading it (nor anything else of its array)."""
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(3)})
    os.remove(os.path.join(path, fifo))
    os.mkfifo(os.path.join(path, fifo))
    leaf = fifo.split("/")[0]
    expected = (
        f"{path}: leaf '{leaf}': {fifo} is a FIFO, not a regular file; a checkpoint holds only directories and "
        "regular files: replace it with a copy of its file (`tsckpt verify` lists them)"
    )
    for read in (lambda: tsckpt.restore(path), lambda: tsckpt.open(path)):
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            read()
        assert str(info.value) == expected
    report = tsckpt.verify(path)
    assert report.bad == {
        leaf: f"{fifo} is a FIFO, not a regular file; a checkpoint holds only directories and regular files: "
        "replace it with a copy of its file"
    }


# ---- a Hugging Face cache snapshot's subfolder: an intact download, refused as links, never called corrupt ----
# (the snapshot itself is read, its links confined to its repository's blobs/: tests/test_hfcache.py)


HF_REV = "0123456789abcdef0123456789abcdef01234567"


def hf_cache_snapshot(tmp_path, files: dict[str, bytes], repo: str = "models--org--tiny") -> str:
    """The layout huggingface_hub's cache gives a download whose files lie in a subfolder: each
    file of snapshots/<rev>/sub/ a relative link to its content in ../../../blobs/<hash>. The
    subfolder, which tsckpt reads only as part of its snapshot."""
    import hashlib

    top = tmp_path / "hub" / repo
    (top / "blobs").mkdir(parents=True)
    folder = top / "snapshots" / HF_REV / "sub"
    folder.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (top / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../../blobs/{blob}", folder / name)
    return str(folder)


def _safetensors_bytes(tmp_path, tensors: dict) -> bytes:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "made.safetensors"))
    return (tmp_path / "made.safetensors").read_bytes()


HF_FIX = (
    "tsckpt does not follow symbolic links in a checkpoint, which must hold its own files (a link could lead "
    "anywhere; docs/security.md): this is a Hugging Face cache snapshot, whose files link into the cache's blobs/ "
    f"(the download is intact): get a copy that holds the files themselves with `hf download org/tiny --revision "
    f"{HF_REV} --local-dir DIR` (or huggingface_hub.snapshot_download('org/tiny', revision='{HF_REV}', "
    "local_dir=DIR)) and give DIR"
)


def test_a_hugging_face_cache_snapshots_subfolder_is_refused_as_links_never_as_corrupt(tmp_path, capsys):
    from tsckpt._cli import main

    weights = _safetensors_bytes(tmp_path, {"w": torch.ones(2, 3)})
    snap = hf_cache_snapshot(tmp_path, {"model.safetensors": weights, "config.json": b'{"dtype": "float32"}'})
    target = os.readlink(os.path.join(snap, "model.safetensors"))
    want = (
        f"{snap}: the weights file 'model.safetensors': model.safetensors is a symbolic link (to {target}); {HF_FIX}"
    )
    for read in (tsckpt.open, tsckpt.restore, tsckpt.metadata, tsckpt.verify,
                 lambda s: tsckpt.convert(s, str(tmp_path / "out"))):
        with pytest.raises(tsckpt.LinkRefusedError) as info:
            read(snap)
        assert not isinstance(info.value, tsckpt.CorruptCheckpointError)
        assert isinstance(info.value, PermissionError) and str(info.value) == want
        assert (info.value.link, info.value.target) == (os.path.join(snap, "model.safetensors"), target)
    assert not os.path.exists(tmp_path / "out")
    for argv in (["ls", snap], ["verify", snap], ["convert", snap, str(tmp_path / "out")]):
        assert main(argv) == 1
        assert capsys.readouterr().err == f"tsckpt {argv[0]}: error: {want}\n"
    # the file itself may be named: the link is the caller's, not one inside a checkpoint
    np.testing.assert_array_equal(tsckpt.open(os.path.join(snap, "model.safetensors"))["w"][:], np.ones((2, 3)))


def test_a_sharded_hugging_face_cache_snapshots_subfolder_names_the_download_to_make(tmp_path):
    import json

    shard = _safetensors_bytes(tmp_path, {"w": torch.ones(2)})
    index = json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode()
    snap = hf_cache_snapshot(
        tmp_path, {"model.safetensors.index.json": index, "model-00001-of-00001.safetensors": shard},
        repo="datasets--org--tiny",
    )
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        tsckpt.open(snap)
    assert str(info.value).startswith(f"{snap}: the index file 'model.safetensors.index.json': ")
    assert str(info.value).endswith(
        f"`hf download org/tiny --revision {HF_REV} --repo-type dataset --local-dir DIR` (or "
        f"huggingface_hub.snapshot_download('org/tiny', revision='{HF_REV}', repo_type='dataset', local_dir=DIR)) "
        "and give DIR"
    )


def test_copy_from_a_hugging_face_cache_snapshots_subfolder_says_hf_download(tmp_path):
    src = str(tmp_path / "ck")
    tsckpt.save(src, {"w": torch.ones(2)})
    snap = hf_cache_snapshot(tmp_path, {"config.json": b'{"dtype": "float32"}'})
    target = os.readlink(os.path.join(snap, "config.json"))
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        tsckpt.convert(src, str(tmp_path / "hf"), to_format="safetensors", copy_from=snap)
    assert str(info.value) == f"copy_from: {os.path.join(snap, 'config.json')} is a symbolic link (to {target}); {HF_FIX}"
    assert "huggingface-cli" not in str(info.value) and not os.path.exists(tmp_path / "hf")


def test_a_link_in_a_checkpoint_is_refused_as_a_link_and_verify_says_so(linked, capsys):
    from tsckpt._cli import main

    path, outside = linked
    with pytest.raises(tsckpt.LinkRefusedError) as info:
        tsckpt.open(path)
    assert not isinstance(info.value, tsckpt.CorruptCheckpointError)
    assert info.value.link == os.path.join(path, "m", "b", "c.0") and info.value.target == outside
    report = tsckpt.verify(path, progress=False)
    assert report.unread == ("m/b",) and list(report.bad) == ["m/b"]
    assert main(["verify", path]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"FAIL  m/b: m/b/c.0 is a symbolic link (to {outside}); tsckpt does not follow symbolic links in a checkpoint, "
        "which must hold its own files (a link could lead anywhere; docs/security.md): replace each link with a copy "
        "of its file"
    ]
    assert err == (
        f"tsckpt verify: error: verification failed for {path}: 1 not read, as their files include a symbolic link "
        "(never followed) or a special file ('m/b')\n"
    )
