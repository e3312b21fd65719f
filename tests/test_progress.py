"""Progress bars on rank 0 and a closing log line: save, restore, verify."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import tsckpt
from tests import dist_scenarios as sc
from tests.dist_helpers import run_ranks


TREE = {"w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64), "b": np.ones(10, np.int16), "n": 1}
NBYTES = 64 * 64 * 4 + 10 * 2


def test_save_restore_verify_show_bytes_and_log(tmp_path, bars, caplog, capsys):
    d = tmp_path / "ck"
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        tsckpt.save(d, TREE, progress=True)
        out = tsckpt.restore(d, progress=True)
        assert tsckpt.verify(d, progress=True).ok
    assert bars == [("save", NBYTES, NBYTES), ("restore", NBYTES, NBYTES), ("verify", NBYTES, NBYTES)]
    assert np.array_equal(out["w"], TREE["w"].numpy())
    lines = [r.getMessage() for r in caplog.records if r.name == "tsckpt"]
    assert [line.split(" ", 1)[0] for line in lines] == ["save", "restore", "verify"]
    assert lines[0].startswith(f"save {d}: 16.0 KiB in 2 files, ") and lines[0].endswith("/s)")
    assert lines[1].startswith(f"restore {d}: 16.0 KiB in 2 reads, ")  # regions read, not files
    assert "save:" in capsys.readouterr().err  # the bar itself, on stderr


def test_no_bar_when_asked_or_not_a_terminal(tmp_path, bars, capsys):
    tsckpt.save(tmp_path / "a", TREE, progress=False)
    tsckpt.save(tmp_path / "b", TREE)  # stderr is captured, not a terminal
    tsckpt.restore(tmp_path / "b")
    tsckpt.verify(tmp_path / "b")
    assert bars == [] and capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.usefixtures("layout")  # the ranks save in it
def test_only_rank_0_shows_a_bar(tmp_path):
    per_rank = run_ranks(sc.save_and_restore_with_progress, 2, str(tmp_path / "ck"))
    rank0_bytes = 16 * 16 * 4  # its own rows: each rank writes and reads its share
    assert per_rank == [[("save", rank0_bytes, rank0_bytes), ("restore", rank0_bytes, rank0_bytes)], []]
