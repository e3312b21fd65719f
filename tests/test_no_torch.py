"""JAX and numpy users do not import torch (tsckpt._base.lazytorch): ``import tsckpt`` and
every verb on numpy and jax trees leave torch out of ``sys.modules``; a torch object, or a
restore that returns tensors, imports it. Each case runs in a fresh interpreter
(tests/notorch_scenarios.py), since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys

import pytest

TIMEOUT = 300


def scenario(name: str, directory: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "tests.notorch_scenarios", name, directory],
        capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.slow
def test_import_alone_leaves_torch_out():
    code = "import sys, tsckpt, tsckpt.tree; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and r.stdout == "[]\n", r.stdout + r.stderr


@pytest.mark.slow
def test_every_verb_on_numpy_and_jax_trees_leaves_torch_out(tmp_path):
    pytest.importorskip("jax")
    assert scenario("numpy_and_jax", str(tmp_path)).splitlines() == ["ok"]


@pytest.mark.slow
def test_torch_is_imported_when_tensors_are_asked_for(tmp_path):
    """A torch-saved checkpoint restores as numpy without torch; as_saved returns tensors, so it imports torch."""
    pytest.importorskip("jax")  # the scenario module sets up jax first
    assert scenario("torch_saved", str(tmp_path)).splitlines() == ["numpy torch [0, 1, 2, 3] torch=True", "ok"]
