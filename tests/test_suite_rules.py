"""The suite's own rules (tests/conftest.py, tests/stored.py): which tests are slow, and
how the layout fixture reads the layout of the checkpoints a test left."""

from __future__ import annotations

import numpy as np

import tsckpt
from tests import conftest, test_cli, test_crash, test_distributed, test_fuzz_metadata, test_reader, test_tree
from tests.stored import checkpoint_roots, layout_record


def _slow(module, name: str) -> bool:
    # by name: a test that named the function itself would be slow by the rule
    return conftest.starts_processes(getattr(module, name))


def test_tests_that_start_processes_are_slow():
    assert _slow(test_distributed, "test_uneven_rows_on_three_ranks")  # run_ranks
    assert _slow(test_crash, "test_sigkill_at_random_moments")  # its savers, through _context: get_context
    assert _slow(test_cli, "test_subprocess_ls_show_verify")  # through run_cli: subprocess
    assert _slow(test_reader, "test_a_record_larger_than_its_files_is_refused_before_any_allocation")  # two calls down
    assert _slow(test_fuzz_metadata, "fuzz_worker")  # a fixture, through the methods of its class


def test_tests_in_this_process_are_not():
    assert not _slow(test_cli, "test_ls")
    assert not _slow(test_tree, "test_escape_is_injective")  # a Hypothesis test: the test itself is read
    assert not _slow(test_crash, "test_claim_lost_between_check_and_create")


def test_checkpoint_roots_reads_the_layout_of_each_root(tmp_path):
    tree = {"model": {"w": np.arange(6.0)}, "step": 1}
    tsckpt.save(tmp_path / "p", tree, layout="plain")
    tsckpt.save(tmp_path / "runs" / "c", tree, layout="compact")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "zarr.json").write_text('{"attributes": {"tsckpt": {"layout"')
    # the array and group nodes of the plain checkpoint are no roots
    assert checkpoint_roots(tmp_path) == {tmp_path / "p": ("plain", 1), tmp_path / "runs" / "c": ("compact", 2)}
    assert (layout_record("plain"), layout_record("compact")) == (("plain", 1), ("compact", 2))
