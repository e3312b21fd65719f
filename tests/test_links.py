"""Symbolic links inside a local checkpoint are refused by every reader of its data."""

import os

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._links import owner, symlinks


@pytest.fixture
def linked(tmp_path, small_chunks):
    """A checkpoint whose chunk file of 'm/b' is a link to a copy of its bytes outside."""
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"m": {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(3)}, "n": 1})
    chunk = os.path.join(path, "m", "b", "c", "0")
    outside = tmp_path / "elsewhere"
    outside.write_bytes(open(chunk, "rb").read())
    os.remove(chunk)
    os.symlink(outside, chunk)
    return path, str(outside)


def _message(path: str, outside: str) -> str:
    return (
        f"{path}: leaf 'm/b': m/b/c/0 is a symbolic link (to {outside}); a checkpoint holds its own files and "
        "tsckpt does not follow links out of it: replace each link with a copy of its file (`tsckpt verify` "
        "lists them)"
    )


def test_restore_refuses_a_linked_file(linked):
    path, outside = linked
    for target in (None, {"m": {"w": torch.zeros(64, 64), "b": torch.zeros(3)}, "n": 0}):
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            tsckpt.restore(path, target)
        assert str(info.value) == _message(path, outside)


def test_open_and_convert_refuse_a_linked_file(linked, tmp_path):
    path, outside = linked
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.open(path)
    assert str(info.value) == _message(path, outside)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="m/b/c/0 is a symbolic link"):
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
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"^.*: leaf 'w': w/c is a symbolic link"):
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
