"""Inputs past what tsckpt can represent get a precise error, never a raw RecursionError or a
pybind11 RuntimeError: trees nested deeper than a checkpoint's structure may be (a torch.save
file, a tree to save), paths TensorStore cannot take (not UTF-8, a NUL)."""

from __future__ import annotations

import errno
import os
import sys

import pytest
import torch

import tsckpt
from tests.test_cli import run_main
from tsckpt._storage.locations import resolve


def nested(levels: int, leaf=None):
    x = torch.ones(2) if leaf is None else leaf
    for _ in range(levels):
        x = [x]
    return x


@pytest.fixture(scope="module")
def deep_pt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deep") / "deep.pt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save's pickler recurses once per level
    try:
        torch.save(nested(3000), path)
    finally:
        sys.setrecursionlimit(limit)
    return str(path)


# ---- depth ------------------------------------------------------------------------------


@pytest.mark.parametrize("verb", ["restore", "open", "metadata", "verify"])
def test_deep_torch_save_file_names_the_depth_limit(deep_pt, verb):
    with pytest.raises(tsckpt.LeafTypeError, match=r"deep\.pt: the tree nests more than 200 levels deep") as ei:
        getattr(tsckpt, verb)(deep_pt)
    assert isinstance(ei.value, TypeError)


def test_deep_torch_save_file_convert(deep_pt, tmp_path):
    with pytest.raises(tsckpt.LeafTypeError, match=r"more than 200 levels deep"):
        tsckpt.convert(deep_pt, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_cli_deep_torch_save_file_one_line_exit_1(deep_pt, capsys):
    code, out, err = run_main(capsys, "ls", deep_pt)
    assert code == 1
    assert err.count("\n") == 1 and "more than 200 levels deep" in err
    assert "bug in tsckpt" not in err and "RecursionError" not in err


@pytest.mark.parametrize("levels", [200, 3000])
def test_save_refuses_a_tree_deeper_than_a_checkpoint_holds(ckdir, levels):
    # 200 levels saved and could not be read back; 3000 raised a RecursionError
    with pytest.raises(tsckpt.LeafTypeError, match="more than 200 levels deep"):
        tsckpt.save(ckdir, {"deep": nested(levels)})
    assert not os.path.exists(ckdir)


def test_save_refuses_empty_containers_nested_too_deep(ckdir):
    with pytest.raises(tsckpt.LeafTypeError, match="more than 200 levels deep"):
        tsckpt.save(ckdir, {"w": torch.ones(1), "deep": nested(250, leaf={})})


def test_deepest_tree_a_checkpoint_holds_round_trips(ckdir):
    tsckpt.save(ckdir, nested(199))
    back = tsckpt.restore(ckdir)
    for _ in range(199):
        back = back[0]
    assert back.tolist() == [1.0, 1.0]


def test_deep_restore_target_names_the_limit(ckdir):
    tsckpt.save(ckdir, {"w": torch.ones(2)})
    with pytest.raises(tsckpt.LeafTypeError, match="more than 200 levels deep"):
        tsckpt.restore(ckdir, {"w": nested(3000)})


# ---- paths ------------------------------------------------------------------------------

NOT_UTF8 = os.fsencode("/tmp/tsckpt-test-") + b"\xff"


@pytest.mark.parametrize("path", [NOT_UTF8, os.fsdecode(NOT_UTF8)], ids=["bytes", "surrogate-escaped str"])
@pytest.mark.parametrize("verb", ["save", "restore", "open", "metadata", "verify", "manager"])
def test_path_not_utf8_cannot_be_encoded_for_the_storage_layer(path, verb):
    calls = {
        "save": lambda: tsckpt.save(path, {"w": torch.ones(2)}),
        "restore": lambda: tsckpt.restore(path),
        "open": lambda: tsckpt.open(path),
        "metadata": lambda: tsckpt.metadata(path),
        "verify": lambda: tsckpt.verify(path),
        "manager": lambda: tsckpt.CheckpointManager(path),
    }
    with pytest.raises(tsckpt.StorageError, match=r"cannot be encoded for the storage layer.*not valid UTF-8 \(byte 0xff at character 17\)") as ei:
        calls[verb]()
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.EILSEQ
    assert r"b'/tmp/tsckpt-test-\xff'" in str(ei.value)


def test_path_with_a_nul_is_refused():
    with pytest.raises(tsckpt.StorageError, match="NUL"):
        tsckpt.restore("/tmp/a\0b")


def test_a_utf8_bytes_path_works(tmp_path):
    d = os.fsencode(str(tmp_path)) + "/café".encode()
    tsckpt.save(d, {"w": torch.arange(3.0)})
    assert tsckpt.restore(d)["w"].tolist() == [0.0, 1.0, 2.0]
    assert str(resolve(d)) == os.fsdecode(d)


def test_cli_path_not_utf8_one_line_exit_1(capsys):
    code, out, err = run_main(capsys, "ls", os.fsdecode(NOT_UTF8))  # how Python hands such an argv over
    assert code == 1
    assert err.count("\n") == 1 and "cannot be encoded for the storage layer" in err
    assert "bug in tsckpt" not in err and "pybind11" not in err
