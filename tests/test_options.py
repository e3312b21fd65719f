"""One definition per option: twin verbs take the same options, and each option takes effect."""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import threading
import typing
from typing import Any

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._read.restore as restore_module
import tsckpt._save.protocol as save_module
import tsckpt.torch as tt
from tsckpt._options import (
    READ_WINDOW_BYTES,
    VERBS,
    WRITE_WINDOW_BYTES,
    AsyncOptions,
    RestoreOptions,
    SaveOptions,
    signature_problems,
    timeout_seconds,
)

# Every verb of tsckpt/_options.py VERBS, as users reach it.
VERB_OBJECTS: dict[str, Any] = {
    "tsckpt.save": tsckpt.save,
    "tsckpt.save_async": tsckpt.save_async,
    "tsckpt.torch.save": tt.save,
    "tsckpt.torch.save_async": tt.save_async,
    "CheckpointManager": tsckpt.CheckpointManager.__init__,
    "CheckpointManager.save": tsckpt.CheckpointManager.save,
    "CheckpointManager.save_async": tsckpt.CheckpointManager.save_async,
    "tsckpt.restore": tsckpt.restore,
    "CheckpointManager.restore": tsckpt.CheckpointManager.restore,
    "tsckpt.torch.restore": tt.restore,
    "tsckpt.convert": tsckpt.convert,
    "tsckpt.open": tsckpt.open,
    "tsckpt.metadata": tsckpt.metadata,
    "tsckpt.verify": tsckpt.verify,
    "tsckpt.diff": tsckpt.diff,
    "tsckpt.torch.StorageWriter": tt.StorageWriter.__init__,
    "tsckpt.torch.StorageReader": tt.StorageReader.__init__,
}

# The twin each verb is compared with, for each option set.
REFERENCE = {SaveOptions: "tsckpt.save", AsyncOptions: "tsckpt.save_async", RestoreOptions: "tsckpt.restore"}


def keyword_options(fn: Any) -> dict[str, tuple[type, Any, Any]]:
    """Keyword-only parameters of ``fn``: name -> (type of the default, default, evaluated annotation)."""
    params = inspect.signature(fn, eval_str=True).parameters.values()
    return {p.name: (type(p.default), p.default, p.annotation) for p in params if p.kind is p.KEYWORD_ONLY}


def twin_drift(name: str) -> list[str]:
    """How verb ``name`` differs from its twins, read from the signatures alone."""
    mine = keyword_options(VERB_OBJECTS[name])
    problems = []
    supplied = set()
    for options, not_taken in VERBS[name].items():
        ref_name = REFERENCE[options]
        ref = keyword_options(VERB_OBJECTS[ref_name])
        for f in dataclasses.fields(options):
            if f.name in not_taken:
                continue
            supplied.add(f.name)
            if f.name not in mine:
                problems.append(f"{name} lacks {f.name!r}, which {ref_name} takes")
            elif mine[f.name] != ref[f.name]:
                problems.append(f"{name}: {f.name!r} is {mine[f.name][1:]}, {ref_name}: {ref[f.name][1:]}")
    for not_taken in VERBS[name].values():
        for option, reason in not_taken.items():
            if option in mine and option not in supplied:
                problems.append(f"{name} takes {option!r}, said to make no sense there ({reason})")
    return problems


@pytest.fixture
def read_windows(monkeypatch):
    """The window of every restore's reads (read_into's ``window``)."""
    windows: list[int] = []
    real = restore_module.read_into

    def recording(ck, dests, progress=None, *, window):
        windows.append(window)
        return real(ck, dests, progress, window=window)

    monkeypatch.setattr(restore_module, "read_into", recording)
    return windows


def _shard_bytes(directory: Any, path: str) -> int:
    """Bytes of one shard file of the array at ``path``."""
    md = tsckpt.open(directory).checkpoint.array_metadata(path)
    return int(np.prod(md.shard_shape)) * md.nbytes // int(np.prod(md.shape))


# ---- the signatures ---------------------------------------------------------------------------


def test_the_table_names_every_verb():
    assert sorted(VERBS) == sorted(VERB_OBJECTS)


@pytest.mark.parametrize("options, reference", [(SaveOptions, tsckpt.save), (RestoreOptions, tsckpt.restore)])
def test_the_references_take_exactly_their_options(options, reference):
    hints = typing.get_type_hints(options)
    want = {f.name: (type(f.default), f.default, hints[f.name]) for f in dataclasses.fields(options)}
    assert keyword_options(reference) == want


def test_save_async_takes_the_save_and_background_options():
    fields = [*dataclasses.fields(SaveOptions), *dataclasses.fields(AsyncOptions)]
    assert sorted(keyword_options(tsckpt.save_async)) == sorted(f.name for f in fields)


def test_the_bridge_twins_take_the_same_state_as_train_state():
    """tsckpt.torch.save, save_async and restore describe the state as TrainState does."""

    def state_params(fn: Any) -> list[tuple[str, Any, Any]]:
        options = {f.name for o in (SaveOptions, AsyncOptions, RestoreOptions) for f in dataclasses.fields(o)}
        params = inspect.signature(fn).parameters.values()
        return [(p.name, p.kind, p.default) for p in params if p.name not in options | {"directory", "self"}]

    state = state_params(tt.TrainState.__init__)
    assert state_params(tt.save) == state_params(tt.save_async) == [s for s in state if s[0] != "resize"]
    assert state_params(tt.restore) == state


def test_defaults_are_unchanged():
    assert keyword_options(tsckpt.save)["max_inflight_bytes"][1] == WRITE_WINDOW_BYTES == 512 << 20
    assert keyword_options(tsckpt.restore)["max_inflight_bytes"][1] == READ_WINDOW_BYTES == 32 << 20
    assert keyword_options(tsckpt.convert)["max_inflight_bytes"][1] == 32 << 20  # convert's window as before
    assert keyword_options(tsckpt.save)["layout"][1] == "plain"
    assert keyword_options(tsckpt.restore)["casting"][1] == "same_kind"
    assert keyword_options(tsckpt.save_async)["staging"][1] == "overlapped"  # benchmarks/RESULTS.md


@pytest.mark.parametrize("name", sorted(VERB_OBJECTS))
def test_twins_take_the_same_options(name):
    assert twin_drift(name) == []
    assert signature_problems(VERB_OBJECTS[name], name) == []


@pytest.mark.parametrize("name", sorted(VERB_OBJECTS))
def test_data_is_positional_and_options_keyword_only(name):
    params = inspect.signature(VERB_OBJECTS[name]).parameters.values()
    options = {f.name for o in VERBS[name] for f in dataclasses.fields(o)}
    assert [p.name for p in params if p.name in options and p.kind is not p.KEYWORD_ONLY] == []


def test_options_shared_by_both_sides_agree():
    save = {f.name: f for f in dataclasses.fields(SaveOptions)}
    read = {f.name: f for f in dataclasses.fields(RestoreOptions)}
    shared = sorted(save.keys() & read.keys())
    assert shared == ["group", "max_inflight_bytes", "progress", "timeout"]
    for name in ["group", "progress", "timeout"]:
        assert (save[name].default, save[name].type) == (read[name].default, read[name].type)
    # the one deliberate difference: writing and reading windows
    assert (save["max_inflight_bytes"].default, read["max_inflight_bytes"].default) == (512 << 20, 32 << 20)


def test_every_option_and_exclusion_says_why():
    for options in (SaveOptions, AsyncOptions, RestoreOptions):
        for f in dataclasses.fields(options):
            assert len(f.metadata["doc"]) > 20, f.name
    for name, sets in VERBS.items():
        for not_taken in sets.values():
            assert all(len(reason) > 20 for reason in not_taken.values()), name


def test_a_drifted_twin_is_caught(monkeypatch):
    monkeypatch.setitem(tsckpt.save_async.__wrapped__.__kwdefaults__, "progress", False)  # under the verb wrapper
    assert twin_drift("tsckpt.save_async") == [
        "tsckpt.save_async: 'progress' is (False, bool | None), tsckpt.save: (None, bool | None)"
    ]
    assert signature_problems(tsckpt.save_async, "tsckpt.save_async") == [
        "'progress' defaults to False, not None as SaveOptions.progress"
    ]


def test_a_verb_that_drifts_is_caught():
    def drifted(directory: str, *, overwrite: int = False, progress: bool | None = None, strict: bool = True,
                group: Any = None, timeout: datetime.timedelta | None = None) -> None:
        """Lacks options, annotates one wrongly, takes one that makes no sense on it."""

    problems = signature_problems(drifted, "CheckpointManager.save")
    assert "'overwrite' is annotated int, not bool as SaveOptions.overwrite" in problems
    assert "lacks the option 'max_inflight_bytes' (SaveOptions.max_inflight_bytes)" in problems
    assert any(p.startswith("takes 'group', which makes no sense there (given to CheckpointManager(...) once") for p in problems)
    assert any(p.startswith("takes 'timeout', which makes no sense there") for p in problems)
    assert not any("'strict'" in p for p in problems)  # not an option of a saving verb: a verb's own keyword


def test_every_verb_is_declared_and_checked():
    """Each verb passes through ``verb`` (the fork check), so the drift test above covers it."""
    for name, fn in VERB_OBJECTS.items():
        assert hasattr(fn, "__wrapped__"), name


def test_an_option_taken_positionally_is_caught():
    def positional(directory: str, overwrite: bool = False) -> None:
        """Takes an option positionally."""

    assert "takes 'overwrite' positionally; options are keyword-only (put it after '*')" in signature_problems(
        positional, "tsckpt.save"
    )


# ---- values are checked before any work ---------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda d: tsckpt.save(d, {"x": 1}, max_inflight_bytes=0), ValueError,
         "max_inflight_bytes must be at least 1 byte, not 0"),
        (lambda d: tsckpt.save(d, {"x": 1}, timeout=30), TypeError,
         "timeout must be a datetime.timedelta or None, not 30 (int); write e.g. timeout=datetime.timedelta(minutes=10)"),
        (lambda d: tsckpt.save_async(d, {"x": 1}, layout="dense"), ValueError,
         "layout must be one of 'plain', 'compact', not 'dense'"),
        (lambda d: tsckpt.save_async(d, {"x": 1}, max_staging_bytes=-1), ValueError,
         "max_staging_bytes must be at least 0 bytes, not -1"),
        (lambda d: tsckpt.save_async(d, {"x": 1}, staging="fast"), ValueError,
         "staging must be 'blocking' or 'overlapped', not 'fast'"),
        (lambda d: tsckpt.CheckpointManager(d, staging=None), ValueError,
         "staging must be 'blocking' or 'overlapped', not None"),
        (lambda d: tsckpt.restore(d, progress="yes"), TypeError,
         "progress must be True (show a bar), False (never) or None (when stderr is a terminal), not 'yes' (str)"),
        (lambda d: tsckpt.CheckpointManager(d, timeout=datetime.timedelta(0)), ValueError,
         "timeout must be positive, not 0:00:00"),
        (lambda d: tsckpt.CheckpointManager(d).save(1, {"x": 1}, overwrite="yes"), TypeError,
         "overwrite must be True or False, not 'yes' (str)"),
        (lambda d: tt.save(d, torch.nn.Linear(2, 2), layout="dense"), ValueError,
         "layout must be one of 'plain', 'compact', not 'dense'"),
        (lambda d: tt.restore(d, torch.nn.Linear(2, 2), casting="always"), ValueError,
         "casting must be one of 'no', 'equiv', 'safe', 'same_kind', 'unsafe', not 'always'"),
        (lambda d: tsckpt.save(d, {"x": 1}, base=42), TypeError,
         "base must be a directory (a str or path, or a kvstore spec dict) or None, not 42 (int)"),
        (lambda d: tsckpt.convert(d, d + "-out", max_inflight_bytes=1.5), TypeError,
         "max_inflight_bytes must be an int number of bytes, not 1.5 (float)"),
    ],
)
def test_a_bad_option_raises_before_anything_is_done(tmp_path, call, error, message):
    d = str(tmp_path / "ck")
    with pytest.raises(error) as e:
        call(d)
    assert str(e.value) == message
    assert not (tmp_path / "ck").exists()


# ---- every option takes effect where it is taken -----------------------------------------------

TREE_BYTES = 64 * 64 * 4


def _tree() -> dict:
    return {"w": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64), "n": 3}


def _layout_of(directory: Any) -> str:
    root = json.loads((directory / "zarr.json").read_text())["attributes"]["tsckpt"]
    return root.get("layout", "plain")


def test_save_async_takes_every_option_of_save(tmp_path, small_chunks, bars):
    tsckpt.save(tmp_path / "sync", _tree())
    assert _shard_bytes(tmp_path / "sync", "w") == 4096  # small_chunks' shard target
    handle = tsckpt.save_async(
        tmp_path / "a", _tree(), max_inflight_bytes=2048, progress=True, layout="compact", check_replicas=False
    )
    handle.result(timeout=datetime.timedelta(seconds=60))
    assert _shard_bytes(tmp_path / "a", "w") == 2048  # the window bounds the shard files
    assert _layout_of(tmp_path / "a") == "compact"
    assert bars == [("save", TREE_BYTES, TREE_BYTES)]  # the background save's bar
    assert np.array_equal(tsckpt.restore(tmp_path / "a")["w"], _tree()["w"].numpy())


def test_save_async_has_a_staging_limit_of_its_own(tmp_path):
    with pytest.warns(RuntimeWarning, match="state has 16384 bytes of arrays, more than max_staging_bytes=1000"):
        handle = tsckpt.save_async(tmp_path / "a", _tree(), max_staging_bytes=1000)
    assert handle.done() and handle.staged_bytes == 0  # saved in the caller, no copy
    assert tsckpt.restore(tmp_path / "a")["n"] == 3
    handle = tsckpt.save_async(tmp_path / "b", _tree(), max_staging_bytes=TREE_BYTES)  # fits: staged
    handle.result(timeout=60)
    assert handle.staged_bytes == TREE_BYTES


def test_manager_takes_the_per_call_options_of_save_and_restore(tmp_path, small_chunks, bars, read_windows):
    with tsckpt.CheckpointManager(tmp_path / "run", layout="compact") as m:
        m.save(1, _tree(), max_inflight_bytes=2048, progress=True)
        m.save_async(2, _tree(), max_inflight_bytes=1024, progress=True).result(timeout=60)
        m.save(3, _tree(), progress=False)
        assert [_shard_bytes(m.directory(s), "w") for s in (1, 2, 3)] == [2048, 1024, 4096]
        assert {_layout_of(tmp_path / "run" / f"0000000{s}") for s in (1, 2, 3)} == {"compact"}
        assert bars == [("save", TREE_BYTES, TREE_BYTES)] * 2
        bars.clear()
        out = m.restore(as_saved=True, progress=True, max_inflight_bytes=4096)
        assert isinstance(out["w"], torch.Tensor) and torch.equal(out["w"], _tree()["w"])
        assert isinstance(m.restore(2)["w"], np.ndarray)
        assert bars == [("restore", TREE_BYTES, TREE_BYTES)]
        assert read_windows == [4096, READ_WINDOW_BYTES]


def test_torch_save_and_restore_take_the_options_of_save_and_restore(tmp_path, small_chunks, bars, read_windows):
    model = torch.nn.Linear(64, 64, bias=False)
    tt.save(tmp_path / "ck", model, max_inflight_bytes=2048, progress=True, check_replicas=False, rng=False)
    assert _shard_bytes(tmp_path / "ck", "model/weight") == 2048
    assert bars == [("save", TREE_BYTES, TREE_BYTES)]
    fresh = torch.nn.Linear(64, 64, bias=False)
    tt.restore(tmp_path / "ck", fresh, rng=False, progress=True, max_inflight_bytes=1024)
    assert torch.equal(fresh.weight, model.weight)
    assert bars[1:] == [("restore", TREE_BYTES, TREE_BYTES)] and read_windows == [1024]


def test_convert_window_is_an_option(tmp_path, small_chunks):
    tsckpt.save(tmp_path / "src", _tree())
    tsckpt.convert(str(tmp_path / "src"), str(tmp_path / "a"), max_inflight_bytes=1024, progress=False)
    tsckpt.convert(str(tmp_path / "src"), str(tmp_path / "b"), progress=False)
    assert [_shard_bytes(tmp_path / x, "w") for x in ("a", "b")] == [1024, 4096]


def test_convert_window_on_the_command_line(tmp_path, small_chunks, capsys):
    from tsckpt._cli import main

    tsckpt.save(tmp_path / "src", _tree())
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "a"), "--max-inflight-bytes", "2KiB"]) == 0
    assert _shard_bytes(tmp_path / "a", "w") == 2048
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "b"), "--max-inflight-bytes", "lots"]) == 2
    assert capsys.readouterr().err == (
        "tsckpt convert: error: --max-inflight-bytes 'lots': expected a byte count such as 5GB, 500MB or 2GiB\n"
    )


def test_convert_takes_kvstore_specs_for_tsckpt_checkpoints(tmp_path):
    tsckpt.save(tmp_path / "src", _tree())
    src = {"driver": "file", "path": str(tmp_path / "src")}
    dst = {"driver": "memory", "path": "options-test/converted"}
    report = tsckpt.convert(src, dst, progress=False)
    assert (report.src, report.dst, report.src_format, report.dst_format) == (
        str(tmp_path / "src"), "memory://options-test/converted/", "tsckpt", "tsckpt"
    )
    out = tsckpt.restore(dst)
    assert out["n"] == 3 and np.array_equal(out["w"], _tree()["w"].numpy())
    with pytest.raises(ValueError) as e:
        tsckpt.convert(src, {"driver": "memory", "path": "options-test/st"}, to_format="safetensors")
    assert str(e.value) == (
        "a safetensors destination is a local path (a .safetensors file or a directory), not a kvstore spec "
        "dict; a spec dict is a tsckpt destination only"
    )
    with pytest.raises(ValueError) as e:
        tsckpt.convert(src, str(tmp_path / "x"), from_format="safetensors")
    assert str(e.value) == (
        "a kvstore spec source must be a tsckpt or Orbax checkpoint, not safetensors: safetensors sources are "
        "read from a local path; pass the path instead of the spec"
    )
    with pytest.raises(ValueError, match="convert: source and destination are the same"):
        tsckpt.convert(src, str(tmp_path / "src"))
    assert not (tmp_path / "x").exists()


# ---- AsyncSave's timeout: a timedelta, as on every verb (seconds too, as on a Future) -----------


def test_async_result_takes_a_timedelta_or_seconds(tmp_path, monkeypatch):
    gate = threading.Event()
    real = save_module.save

    def held(*args, **kwargs):
        assert gate.wait(60), "test gate never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "save", held)
    handle = tsckpt.save_async(tmp_path / "ck", _tree())
    with pytest.raises(TimeoutError) as e:
        handle.result(timeout=datetime.timedelta(milliseconds=50))
    assert str(e.value) == f"asynchronous save to {tmp_path / 'ck'} still running after 0.05 s"
    with pytest.raises(TimeoutError, match="still running after 0.02 s"):
        handle.exception(timeout=datetime.timedelta(milliseconds=20))
    with pytest.raises(TimeoutError, match="still running after 0.01 s"):
        handle.result(0.01)  # float seconds, as concurrent.futures.Future takes
    with pytest.raises(TypeError) as e:
        handle.result(timeout="1s")
    assert str(e.value) == "timeout must be a datetime.timedelta, float seconds or None, not '1s' (str)"
    gate.set()
    assert handle.result(timeout=datetime.timedelta(seconds=60)) is None
    assert handle.exception(timeout=datetime.timedelta(seconds=1)) is None


def test_timeout_seconds():
    assert timeout_seconds(None) is None
    assert timeout_seconds(datetime.timedelta(minutes=2)) == 120.0
    assert timeout_seconds(3) == 3.0
    with pytest.raises(TypeError):
        timeout_seconds(True)


# ---- a bad option on one rank only: every rank raises at once --------------------------------

LONG = datetime.timedelta(seconds=60)  # what the other ranks would wait for a rank that raised alone


def _one_rank_bad(name: str, directory: str, rank: int) -> Any:
    """Verb ``name`` with max_inflight_bytes=-1 on rank 1 only (the others valid), every wait bounded by LONG."""
    bad = {"max_inflight_bytes": -1} if rank == 1 else {}
    tree = {"w": torch.arange(4.0)}
    if name == "save":
        return tsckpt.save(directory, tree, timeout=LONG, **bad)
    if name == "save_async":
        return tsckpt.save_async(directory, tree, timeout=LONG, writer="thread", **bad).result()
    if name == "restore":
        return tsckpt.restore(directory + "-good", tree, timeout=LONG, **bad)
    if name == "torch.save":
        return tt.save(directory, torch.nn.Linear(2, 2), timeout=LONG, **bad)
    if name == "torch.restore":
        return tt.restore(directory + "-model", torch.nn.Linear(2, 2), timeout=LONG, **bad)
    manager = tsckpt.CheckpointManager(directory, timeout=LONG, writer="thread")
    try:
        if name == "manager.save":
            return manager.save(1, tree, **bad)
        if name == "manager.save_async":
            return manager.save_async(1, tree, **bad).result()
        return manager.restore(7, tree, **bad)
    finally:
        manager.close()


VERBS_ON_RANKS = [
    "save", "save_async", "restore", "torch.save", "torch.restore", "manager.save", "manager.save_async",
    "manager.restore",
]


def bad_option_on_rank_1(rank: int, world: int, root: str) -> dict[str, tuple[float, str, str]]:
    """Each of VERBS_ON_RANKS with a bad option on rank 1: what each rank raised, in how many
    seconds; then a save with good options on every rank, which must succeed."""
    import time

    torch.manual_seed(0)
    tsckpt.save(root + "/restore-good", {"w": torch.arange(4.0)})
    tt.save(root + "/torch.restore-model", torch.nn.Linear(2, 2))
    manager = tsckpt.CheckpointManager(root + "/manager.restore")
    manager.save(7, {"w": torch.arange(4.0)})
    manager.close()
    raised = {}
    for name in VERBS_ON_RANKS:
        start = time.monotonic()
        try:
            _one_rank_bad(name, f"{root}/{name}", rank)
        except Exception as e:  # noqa: BLE001 - reported to the test
            raised[name] = (time.monotonic() - start, type(e).__name__, str(e))
    tsckpt.save(root + "/after", {"w": torch.arange(4.0)}, timeout=LONG)
    return raised


@pytest.mark.slow
def test_a_bad_option_on_one_rank_raises_on_every_rank_at_once(tmp_path):
    """A window computed per rank (from its free memory, say) can be bad on one rank: that rank
    raises its own ValueError, the others a DistributedError naming it, at once, not after the
    timeout; nothing is left committed and the next save succeeds."""
    from tests.dist_helpers import run_ranks

    own = "max_inflight_bytes must be at least 1 byte, not -1"
    ranks = run_ranks(bad_option_on_rank_1, 2, str(tmp_path), timeout=300)
    for rank, raised in enumerate(ranks):
        assert sorted(raised) == sorted(VERBS_ON_RANKS), (rank, raised)
        for name, (elapsed, kind, message) in raised.items():
            assert elapsed < LONG.total_seconds() / 4, (rank, name, elapsed, message)
            if rank == 1:
                assert (kind, message) == ("ValueError", own), (name, kind, message)
            else:
                assert kind == "DistributedError", (name, kind, message)
                assert "rank(s) [1]" in message and f"ValueError: {own}" in message, (name, message)
    for name in ("save", "save_async", "torch.save"):
        assert not (tmp_path / name).exists(), name
    assert tsckpt.CheckpointManager(str(tmp_path / "manager.save")).all_steps() == []
    assert np.array_equal(tsckpt.restore(str(tmp_path / "after"))["w"], np.arange(4.0))
