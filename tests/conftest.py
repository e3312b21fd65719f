"""Fixtures, markers and Hypothesis settings shared by the test suite.

Tiers. ``python -m pytest -m "not slow"`` runs the fast tier: everything but the
tests marked ``slow``, those that start processes (gloo ranks, a fresh interpreter, the
command line, killed or racing savers, the fuzzers' worker, torchrun) or a server. They
are marked in the source: ``pytestmark = pytest.mark.slow`` in a module whose every test
starts processes, ``@pytest.mark.slow`` on a test elsewhere, and here, at collection
(:func:`pytest_collection_modifyitems`), every test that uses a fixture of
:data:`SLOW_FIXTURES` (moto's S3 server), directly or through another fixture.
A test that starts no process but is too heavy for the fast tier (a JAX compile, a
framework's whole fit, ``torch.compile``) is marked ``@pytest.mark.slow(reason="...")``,
saying why. ``tests/test_suite_rules.py`` checks, from the tests' source, that every test
that starts processes is marked so, and that no other test is marked slow without a
reason. Everything else runs in this process and is fast: its
asynchronous saves run in a thread, and only a test that asks for the ``writer_process``
fixture (a slow one) lets them start tsckpt's writer processes.

Hypothesis. Example counts come from the profile, chosen by the environment
variable ``HYPOTHESIS_PROFILE``, else ``full`` where ``CI=true`` (as ``.ci/run``
sets), else ``quick``; see :data:`PROFILES`. A test that needs more examples than
the others (a fuzzer) asks for :func:`examples` ``(k)``: ``k`` times the profile's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings

from tests.dist_helpers import LAYOUT_ENV

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests that use jax run it on the CPU, quietly
# ... on 4 CPU devices, so that sharded jax.Arrays are tested in this process (set before jax starts)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

# ---- Hypothesis profiles ---------------------------------------------------------------

# name -> examples per test; no deadline (timings on a shared 2-core machine vary too much)
PROFILES = {"quick": 20, "full": 100}
for _name, _count in PROFILES.items():
    settings.register_profile(_name, max_examples=_count, deadline=None, print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or (
    "full" if os.environ.get("CI", "").lower() in ("true", "1") else "quick"
)
settings.load_profile(PROFILE)


def examples(k: int) -> int:
    """``k`` times the examples per test of the loaded profile, for a test that needs more."""
    return k * settings().max_examples


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {PROFILE} ({settings().max_examples} examples per test)"


# ---- markers and the slow tier ---------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    # torch warns on complex32 allocations; the tests use complex32 on purpose
    config.addinivalue_line("filterwarnings", "ignore:ComplexHalf support is experimental:UserWarning")


# a test that uses one of these fixtures (directly or through another) is slow: they start a server
SLOW_FIXTURES = frozenset({"s3_server"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # at collection, so that -m "not slow" deselects them; fixturenames: the fixtures' closure
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


_CALL_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed
    return report


# ---- fixtures --------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _background_saves_in_threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asynchronous saves run in a thread of the test's process, as with ``writer="thread"``
    (a writer process is a fresh interpreter per saver: seconds), except in the tests that
    ask for the writer process (the fixture named below)."""
    if "writer_process" not in request.fixturenames:
        from tsckpt._save import writer

        monkeypatch.setattr(writer.WriterSlot, "_refused", lambda *_: "the test saves in a thread")


@pytest.fixture
def writer_process() -> Iterator[None]:
    """The test's asynchronous saves run in tsckpt's writer processes, as outside the tests
    (so the test is slow); when it ends, every writer it started has left."""
    from tsckpt._save.writer import live_writers

    before = set(live_writers())
    yield
    deadline = time.monotonic() + 30
    while set(live_writers()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(live_writers()) - before, f"writer processes outlived the test: {set(live_writers()) - before}"



@pytest.fixture(params=["plain", "compact"])
def layout(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs a test once per checkpoint layout. The test passes ``layout=layout`` to every
    verb that writes a checkpoint; the ranks run_ranks starts read it from LAYOUT_ENV
    (``tests.dist_helpers.rank_layout()``) and pass it too.

    When the test has passed, every tsckpt checkpoint root it left under ``tmp_path`` must
    record this layout (and its format version), and there must be one: a test that leaves
    none there (its save fails, it damages the root, it saves to S3 and checks the root
    there) says so with ``@pytest.mark.no_checkpoint_root``."""
    from tests.stored import checkpoint_roots, layout_record

    monkeypatch.setenv(LAYOUT_ENV, request.param)
    yield request.param
    if not request.node.stash.get(_CALL_PASSED, False):
        return  # the test failed or was skipped: its own report says why
    roots = checkpoint_roots(tmp_path)
    want = layout_record(request.param)
    wrong = {str(p.relative_to(tmp_path)): got for p, got in roots.items() if got != want}
    if wrong:
        pytest.fail(f"checkpoints not in the {request.param} layout {want} under {tmp_path}: {wrong}", pytrace=False)
    if not roots and request.node.get_closest_marker("no_checkpoint_root") is None:
        pytest.fail(
            f"a test of the {request.param} layout left no tsckpt checkpoint under {tmp_path} whose layout could be "
            "checked (mark it no_checkpoint_root if that is right)",
            pytrace=False,
        )


@pytest.fixture
def ckdir(tmp_path):
    """A checkpoint location that does not exist yet."""
    return str(tmp_path / "ck")


@pytest.fixture
def small_chunks(monkeypatch):
    """Tiny chunk and shard targets (1 KiB inner chunks, 4 KiB shards), so small
    arrays get several shard files, each with several inner chunks."""
    import tsckpt._ondisk.chunking as chunking

    monkeypatch.setattr(chunking, "INNER_CHUNK_BYTES", 1024)
    monkeypatch.setattr(chunking, "SHARD_BYTES", 4096)


@pytest.fixture
def dirty_empty(monkeypatch):
    """np.empty and torch.empty return buffers full of 0xA5 bytes (bool: 0x01), as
    uninitialized memory may be: a result the read does not fully overwrite shows up
    deterministically instead of by allocator luck."""
    np_empty, torch_empty = np.empty, torch.empty

    def dirty_np(*args, **kwargs):
        a = np_empty(*args, **kwargs)
        if a.size:
            a.reshape(-1).view(np.uint8).fill(1 if a.dtype == np.bool_ else 0xA5)
        return a

    def dirty_torch(*args, **kwargs):
        t = torch_empty(*args, **kwargs)
        if t.numel() and t.device.type == "cpu":
            t.untyped_storage().fill_(1 if t.dtype == torch.bool else 0xA5)
        return t

    monkeypatch.setattr(np, "empty", dirty_np)
    monkeypatch.setattr(torch, "empty", dirty_torch)


@pytest.fixture
def bars(monkeypatch):
    """Every progress bar closed: (verb, bytes done, total)."""
    import tqdm

    closed: list[tuple[str, int, int]] = []

    class Recording(tqdm.tqdm):
        def close(self):
            if not self.disable:  # tqdm closes again when collected
                closed.append((self.desc, self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    return closed
