"""Special and huge metadata files (issue 32, item 13): a FIFO, a device or a sparse file of
gigabytes where a checkpoint's metadata should be is refused before it is read, naming the
file, what it is or its size, and the limit; nothing waits on it, nothing reads it whole.

Before: a FIFO as the root zarr.json hung restore, open, verify, metadata, save and a
manager's latest_step() forever, as did restore(fifo, format="torch") and a FIFO index of a
Hugging Face directory; an array's zarr.json that is a device was read without end by
restore; a sparse 6 GiB root zarr.json, array zarr.json or Hugging Face index was read
whole (TensorStore aborted the process, or a raw MemoryError)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import torch

import tsckpt
SPARSE = 6 << 30  # claimed by a sparse file holding a few blocks


def _saved(tmp_path, name: str = "ck", **kwargs) -> str:
    path = str(tmp_path / name)
    tsckpt.save(path, {"w": torch.arange(6.0), "m": {"b": torch.ones(3)}, "s": 3}, **kwargs)
    return path


def _fifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def _readers(path: str):
    return {
        "restore": lambda: tsckpt.restore(path),
        "open": lambda: tsckpt.open(path),
        "metadata": lambda: tsckpt.metadata(path),
        "verify": lambda: tsckpt.verify(path),
    }


@pytest.mark.timeout(60)
def test_a_fifo_as_the_root_is_refused_by_every_verb_never_waited_on(tmp_path, caplog):
    path = _saved(tmp_path)
    _fifo(os.path.join(path, "zarr.json"))
    for name, read in _readers(path).items():
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            read()
        assert str(info.value) == (
            f"{path}: zarr.json is a FIFO, not a regular file; nothing of it was read: it is no checkpoint's root "
            "(tsckpt writes a regular file of a few MiB at most); restore from another checkpoint"
        ), name
    for overwrite in (False, True):
        with pytest.raises(tsckpt.CheckpointExistsError) as info:
            tsckpt.save(path, {"x": np.zeros(2)}, overwrite=overwrite)
        assert str(info.value) == (
            f"{path}: its zarr.json is a FIFO, not a regular file: no checkpoint tsckpt wrote, and one it neither "
            "reads nor replaces (overwrite=True included); remove it, or save elsewhere"
        )
    assert stat.S_ISFIFO(os.lstat(os.path.join(path, "zarr.json")).st_mode)  # left alone


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "sparse"])
def test_a_manager_lists_restores_and_saves_beside_a_step_whose_root_is_not_read(tmp_path, caplog, kind):
    run = tmp_path / "run"
    m = tsckpt.CheckpointManager(run)
    m.save(2, {"x": np.arange(3)})
    _saved(run, "00000001")
    root = str(run / "00000001" / "zarr.json")
    _fifo(root) if kind == "fifo" else os.truncate(root, SPARSE)
    reader = tsckpt.CheckpointManager(run)
    assert reader.all_steps() == [2] and reader.latest_step() == 2
    assert reader.restore()["x"].tolist() == [0, 1, 2]
    with caplog.at_level("WARNING", logger="tsckpt"):
        reader.save(3, {"x": np.arange(4)})
    what = "a FIFO, not a regular file" if kind == "fifo" else f"6.0 GiB ({SPARSE} bytes), more than tsckpt reads"
    assert f"step directory 00000001 is not a checkpoint tsckpt wrote (its root zarr.json is {what}" in caplog.text
    with pytest.raises(tsckpt.CheckpointExistsError, match="step 1: 00000001 holds data tsckpt did not write"):
        reader.save(1, {"x": np.arange(4)}, overwrite=True)
    assert reader.all_steps() == [2, 3] and os.path.lexists(root)


@pytest.mark.timeout(60)
def test_a_sparse_root_is_refused_before_it_is_read(tmp_path):
    path = _saved(tmp_path)
    os.truncate(os.path.join(path, "zarr.json"), SPARSE)
    for name, read in _readers(path).items():
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            read()
        assert str(info.value) == (
            f"{path}: zarr.json is 6.0 GiB ({SPARSE} bytes), more than tsckpt reads of a root zarr.json (256 MiB; "
            "a sparse file can claim that size on a few blocks); nothing of it was read: it is no checkpoint's root "
            "(tsckpt writes a regular file of a few MiB at most); restore from another checkpoint"
        ), name
    with pytest.raises(tsckpt.CheckpointExistsError, match="its zarr.json is 6.0 GiB"):
        tsckpt.save(path, {"x": np.zeros(2)}, overwrite=True)


@pytest.mark.timeout(60)
def test_an_array_zarr_json_that_is_a_device_or_sparse_is_refused(tmp_path):
    """The device is /dev/zero's (made with mknod where allowed): restore read it without end."""
    path = _saved(tmp_path)
    node = os.path.join(path, "w", "zarr.json")
    os.truncate(node, SPARSE)
    for read in (lambda: tsckpt.restore(path), lambda: np.asarray(tsckpt.open(path)["w"][:])):
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            read()
        assert str(info.value) == (
            f"'w' in {path}: w/zarr.json is 6.0 GiB ({SPARSE} bytes), more than tsckpt reads of an array's zarr.json "
            "(16 MiB; a sparse file can claim that size on a few blocks); nothing of it was read: restore from "
            "another checkpoint"
        )
    report = tsckpt.verify(path)
    assert report.bad == {"w": f"its zarr.json is 6.0 GiB ({SPARSE} bytes), more than tsckpt reads of an array's "
                          "zarr.json (16 MiB; a sparse file can claim that size on a few blocks) (not read)"}
    os.truncate(os.path.join(path, "m", "zarr.json"), SPARSE)  # a group's
    assert any("group 'm': zarr.json is 6.0 GiB" in p for p in tsckpt.verify(path).group_problems)
    os.remove(node)
    try:
        os.mknod(node, 0o444 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    except (PermissionError, OSError):
        pytest.skip("this process may not make a device node")
    with pytest.raises(tsckpt.CorruptCheckpointError, match="w/zarr.json is a device, not a regular file"):
        tsckpt.restore(path)


@pytest.mark.timeout(60)
def test_a_compact_checkpoint_whose_manifest_is_a_fifo_or_sparse_is_refused(tmp_path):
    path = _saved(tmp_path, layout="compact")
    manifest = os.path.join(path, "manifest.ocdbt")
    _fifo(manifest)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="manifest.ocdbt is a FIFO, not a regular file"):
        tsckpt.restore(path)
    os.remove(manifest)
    with open(manifest, "wb"):
        pass
    os.truncate(manifest, SPARSE)
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"manifest.ocdbt is 6.0 GiB .* an OCDBT manifest"):
        tsckpt.restore(path)


@pytest.mark.timeout(60)
def test_a_fifo_given_as_a_checkpoint_file_is_refused(tmp_path):
    fifo = str(tmp_path / "model.pt")
    os.mkfifo(fifo)
    with pytest.raises(tsckpt.NotACheckpointError) as info:
        tsckpt.restore(fifo, format="torch")
    assert str(info.value) == (
        f"{fifo}: is a FIFO, not a regular file: no torch.save file; give the file torch.save wrote"
    )
    with pytest.raises(tsckpt.NotACheckpointError) as info:
        tsckpt.restore(fifo)  # nothing detected: tsckpt's
    assert str(info.value) == (
        f"{fifo}: is a FIFO, not a checkpoint directory (nothing of it was read); give the directory a save wrote, "
        "or a file of another format (format= names it)"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "sparse"])
def test_a_hugging_face_index_that_is_a_fifo_or_sparse_is_refused(tmp_path, kind):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.zeros(3)}, str(hf / "model-00001-of-00001.safetensors"))
    index = str(hf / "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"weight_map": {"w": "model-00001-of-00001.safetensors"}}, f)
    assert tsckpt.restore(str(hf))["w"].tolist() == [0.0, 0.0, 0.0]
    _fifo(index) if kind == "fifo" else os.truncate(index, SPARSE)
    what = "a FIFO, not a regular file" if kind == "fifo" else (
        f"6.0 GiB ({SPARSE} bytes), more than tsckpt reads of a Hugging Face index (256 MiB; a sparse file can "
        "claim that size on a few blocks)"
    )
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(str(hf))
    assert str(info.value) == f"{index} is {what}; nothing of it was read: restore the index"


def test_read_file_never_reads_past_its_limit(tmp_path, monkeypatch):
    """A file that grows while it is read: its bytes are never read past the limit."""
    from tsckpt._ondisk import bounds

    f = tmp_path / "meta.json"
    f.write_bytes(b"x" * 100)
    assert bounds.read_file(str(f), 100, "a test file", fix="fix it") == b"x" * 100
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"meta.json is 100 bytes, more than tsckpt reads of"):
        bounds.read_file(str(f), 99, "a test file", fix="fix it")
    real = os.fstat
    monkeypatch.setattr(bounds.os, "fstat", lambda fd: os.stat_result((real(fd).st_mode, 0, 0, 0, 0, 0, 10, 0, 0, 0)))
    with pytest.raises(tsckpt.CorruptCheckpointError, match="grew past 50 bytes while it was read"):
        bounds.read_file(str(f), 50, "a test file", fix="fix it")
