"""Fuzzing the metadata: a damaged root or array zarr.json never crashes a reader.

A small checkpoint is saved once. Each example damages its root ``zarr.json``, an array's
or a group's ``zarr.json``, or an array record together with its array node (rewritten
from the damaged record, so that the two agree and the damage reaches the reads), then
every reader runs on it in a worker process whose address space is bounded: restore with
and without a target, lazy reads, metadata, verify and the CLI. Every failure must be a
TsckptError (the CLI: exit status 1 or 2 and one line on stderr), nothing may hang or
allocate gigabytes for a checkpoint of kilobytes (the worker dies or raises MemoryError
first), a checkpoint that verifies must restore, and every leaf whose metadata was not
touched must come back bit-identical.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import resource
import select
import shutil
import subprocess
import sys
import traceback
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tsckpt
from tests.conftest import examples
from tests.stored import read_key, write_key
from tests.strategies import assert_same, bits, dumps, json_mutations, mutate, record_edits
from tsckpt._ondisk.arrays import array_node
from tsckpt._base.dtypes import is_known
from tsckpt._ondisk.records import ArrayRecord, record_problem
from tsckpt.tree import flatten

pytestmark = pytest.mark.slow  # every test here starts processes

ANSWER_TIMEOUT = 60  # seconds the worker may take for one example before it counts as hung
ADDRESS_SPACE_HEADROOM = 3 << 30  # bytes the worker may map beyond what it maps when warm
RSS_GROWTH_LIMIT = 256 << 20  # bytes of resident memory one example may add at its peak

Point = collections.namedtuple("Point", ["x", "y"])


def original_tree() -> dict[str, Any]:
    """A 2-D float32 array with shards and inner chunks (under the small chunk sizes the
    checkpoint is saved with), small single-chunk arrays, a tied leaf, a numpy scalar,
    plain values and nested dicts, lists, tuples and a namedtuple."""
    emb = (torch.arange(16, dtype=torch.float32).reshape(4, 4) / 3).to(torch.bfloat16)
    return {
        "model": {
            "w": torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64) / 7,
            "b": np.array([1.5, -2.0, 3.25], dtype=np.float32),
            "emb": emb,
            "head": emb,  # tied: stored once, as an alias
        },
        "step": 7,
        "lr": 0.5,
        "name": "run-1",
        "opt": [{"m": np.arange(6, dtype=np.int64)}, (np.float32(2.5), None, b"xy")],
        "pt": Point(x=1, y=torch.ones(2, dtype=torch.float64)),
    }


def target_tree() -> dict[str, Any]:
    """A restore target shaped like :func:`original_tree`, every array zero."""
    tree = original_tree()

    def zero(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, np.ndarray):
            return np.zeros_like(x)
        if isinstance(x, np.generic):
            return type(x)(0)
        return x

    return {
        "model": {k: zero(v) for k, v in tree["model"].items()},
        "step": 0, "lr": 0.0, "name": "", "opt": [{"m": zero(tree["opt"][0]["m"])}, (np.float32(0), None, b"")],
        "pt": Point(x=0, y=zero(tree["pt"].y)),
    }


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """The checkpoint of :func:`original_tree` in each layout."""
    import tsckpt._ondisk.chunking as chunking

    out = {}
    for layout in ("plain", "compact"):
        path = str(tmp_path_factory.mktemp("fuzz") / layout)
        with pytest.MonkeyPatch.context() as mp:  # 1 KiB inner chunks, 4 KiB shards
            mp.setattr(chunking, "INNER_CHUNK_BYTES", 1024)
            mp.setattr(chunking, "SHARD_BYTES", 4096)
            tsckpt.save(path, original_tree(), layout=layout)
        w = tsckpt.metadata(path)["model"]["w"]
        assert (w.shard_shape, w.chunk_shape) == ((16, 64), (4, 64))
        assert _root(path)["attributes"]["tsckpt"]["aliases"] == {"model/head": "model/emb"}
        out[layout] = path
    return out


def _root(path: str) -> Any:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)


# ---- the worker: every reader on one damaged checkpoint ------------------------------


def _leaves(tree: Any) -> dict[str, Any]:
    f = flatten(tree)
    return dict(zip(f.paths, f.leaves))


def _same_leaf(got: Any, want: Any) -> None:
    if isinstance(want, (torch.Tensor, np.ndarray, np.generic)):
        assert bits(np.asarray(got) if isinstance(got, np.generic) else got) == bits(
            np.asarray(want) if isinstance(want, np.generic) else want
        ), "array differs"
    else:
        assert_same(got, want)


def _compare(got: Any, want: Any, job: dict[str, Any]) -> None:
    """``got`` (a restored tree) equals ``want`` on every leaf the damage did not touch."""
    if job["nothing_changed"]:
        assert_same(got, want, loose_arrays=True)
        return
    got_leaves, want_leaves = _leaves(got), _leaves(want)
    if job["tree_unchanged"]:
        assert list(got_leaves) == list(want_leaves), f"{list(got_leaves)} != {list(want_leaves)}"
    for path in job["unchanged"]:
        if path in got_leaves:
            try:
                _same_leaf(got_leaves[path], want_leaves[path])
            except AssertionError as e:
                raise AssertionError(f"leaf '{path}': {e}") from None


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from tsckpt._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def reader_call(failures: list[str]) -> Callable[[str, Any], tuple[bool, Any]]:
    """``call(name, fn)``: run one reader; (True, its result), or (False, the error) for a
    tsckpt error. Any other exception, or resident memory growing past RSS_GROWTH_LIMIT
    above where the example began, is added to ``failures``."""
    start = _peak_rss()

    def call(name: str, fn: Any) -> tuple[bool, Any]:
        try:
            return True, fn()
        except tsckpt.TsckptError as e:
            return False, e
        except Exception as e:  # noqa: BLE001 - anything else is what the fuzzer looks for
            failures.append(f"{name} raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return False, e
        finally:
            grown = _peak_rss() - start
            if grown > RSS_GROWTH_LIMIT and not any("resident memory" in f for f in failures):
                failures.append(f"{name}: resident memory peaked {grown >> 20} MiB above where the example began")

    return call


def check(path: str, job: dict[str, Any]) -> list[str]:
    """Run every reader on the checkpoint at ``path``; the list of what went wrong."""
    failures: list[str] = []
    original = original_tree()
    call = reader_call(failures)

    def expect(name: str, fn: Any) -> None:
        try:
            fn()
        except AssertionError as e:
            failures.append(f"{name}: {e}")

    restored_ok, restored = call("restore", lambda: tsckpt.restore(path, progress=False))
    if restored_ok:
        expect("restore", lambda: _compare(restored, original, job))
    ok, into = call("restore into a target", lambda: tsckpt.restore(path, target_tree(), progress=False))
    if ok:
        expect("restore into a target", lambda: _compare(into, original, {**job, "nothing_changed": False}))
    saved_ok, as_saved = call("restore as saved", lambda: tsckpt.restore(path, as_saved=True, progress=False))
    call("metadata", lambda: tsckpt.metadata(path))
    ok, reader = call("open", lambda: tsckpt.open(path))
    want = _leaves(original)
    for leaf in list(reader) if ok else []:
        ok, got = call(f"open(...)['{leaf}']", lambda: read_leaf(reader, leaf))
        if ok and leaf in job["unchanged"]:
            expect(f"lazy read of '{leaf}'", lambda: _same_leaf(got, want[leaf]))
    verified, report = call("verify", lambda: tsckpt.verify(path, progress=False))
    for ok, error in ((restored_ok, restored), (saved_ok, as_saved)):
        if verified and report.ok and not ok:
            failures.append(f"verify passed but restore raised {type(error).__name__}: {error}")
    for argv in (["ls", "-l", path], ["verify", path], ["show", path, "model/w[:1, :3]"], ["show", path, "step"]):
        ok, answer = call(f"tsckpt {' '.join(argv)}", lambda: _cli(argv))
        if not ok:
            continue
        code, out, err = answer
        lines = err.splitlines()
        if code != 0 and (len(lines) != 1 or "Traceback" in err or "bug in tsckpt" in err or code not in (1, 2)):
            failures.append(f"tsckpt {' '.join(argv)} exited {code} with stderr {err!r}")
        if argv[0] == "verify" and verified and code != (0 if report.ok else 1):
            failures.append(f"tsckpt verify exited {code} but verify() said ok={report.ok}")
    return failures


def read_leaf(reader: Any, leaf: str) -> Any:
    """A leaf's value, or (an array) its first row, or all of it up to 1 MiB."""
    value = reader[leaf]
    if not isinstance(value, tsckpt.LazyArray):
        return value
    if value.metadata.nbytes <= 1 << 20:
        return value[...]
    return value[(slice(0, 1),) * min(1, len(value.shape))]


def _peak_rss() -> int:
    """Peak resident memory (bytes) since :func:`_reset_peak_rss`."""
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    return int(kib) << 10


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def worker(check: Any = check) -> None:
    """The worker process: each line on stdin is a job (a checkpoint and what its damage
    touched); each answer is one line of JSON on stdout: what ``check(dir, job)`` found wrong."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr
    jobs = iter(sys.stdin.readline, "")
    first = json.loads(next(jobs))
    failures = check(first["dir"], first)  # warm: thread pools and caches exist now
    limit = _address_space() + ADDRESS_SPACE_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    answers.write(json.dumps({"failures": failures, "rss_growth": 0}) + "\n")
    answers.flush()
    for line in jobs:
        job = json.loads(line)
        _reset_peak_rss()
        before = _peak_rss()
        failures = check(job["dir"], job)
        answers.write(json.dumps({"failures": failures, "rss_growth": _peak_rss() - before}) + "\n")
        answers.flush()


class Worker:
    """The worker process, restarted after it dies (a crash is a failure of that example).
    ``module`` is the test module whose ``worker()`` it runs."""

    def __init__(self, root: str, warm: dict[str, Any], module: str = "tests.test_fuzz_metadata") -> None:
        self.root, self.warm, self.module = root, warm, module
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(tsckpt.__file__)))
        tests_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        env["PYTHONPATH"] = os.pathsep.join([pkg_parent, tests_parent, env.get("PYTHONPATH", "")])
        self.log = open(os.path.join(self.root, "worker.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from {self.module} import worker; worker()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=tests_parent, env=env,
        )
        answer = self._ask(self.warm)
        assert answer["failures"] == [], answer["failures"]

    def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self._ask(job)

    def _ask(self, job: dict[str, Any]) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], ANSWER_TIMEOUT)
        line = proc.stdout.readline() if ready else ""
        if not line:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            self.proc = None
            what = "hung" if not ready else f"died (exit status {proc.returncode})"
            raise AssertionError(f"the worker {what} on {job['dir']}:\n{tail}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def fuzz_worker(bases, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz_worker"))
    w = Worker(root, {"dir": bases["compact"], "unchanged": list(_leaves(original_tree())), "tree_unchanged": True,
                      "nothing_changed": True})
    yield w
    w.close()


# ---- damaging a copy of the checkpoint ---------------------------------------------


def _read_json(ck: str, key: str) -> Any:
    return json.loads(read_key(ck, key) or b"null")


def _write(ck: str, key: str, doc: Any) -> None:
    """Write a document below the checkpoint: the root zarr.json is a file in both layouts;
    the other keys are files, or keys of the database in the compact layout."""
    if key == "zarr.json":
        with open(os.path.join(ck, key), "w") as f:
            f.write(dumps(doc))
    else:
        write_key(ck, key, dumps(doc).encode())


def _changes(before: Any, after: Any) -> dict[str, Any]:
    """What a damaged root touched: the leaves whose record, value or alias is unchanged,
    whether the tree (structure and leaf list) is unchanged, and whether nothing a reader
    uses changed at all."""
    meta0 = before["attributes"]["tsckpt"]
    try:
        meta1 = after["attributes"]["tsckpt"]
        assert isinstance(meta1, dict)
    except (KeyError, TypeError, AssertionError):
        return {"unchanged": [], "tree_unchanged": False, "nothing_changed": False}

    def entries(meta: Any, path: str) -> Any:
        arrays = meta.get("arrays") if isinstance(meta.get("arrays"), list) else []
        values = meta.get("values") if isinstance(meta.get("values"), dict) else {}
        aliases = meta.get("aliases") if isinstance(meta.get("aliases"), dict) else {}
        stored = aliases.get(path, path)
        records = [r for r in arrays if isinstance(r, dict) and r.get("path") in (path, stored)]
        return dumps([records, values.get(path), aliases.get(path), path in aliases.values()])

    unchanged = [p for p in meta0["leaves"] if entries(meta0, p) == entries(meta1, p)]
    tree_unchanged = all(dumps(meta0.get(k)) == dumps(meta1.get(k)) for k in ("structure", "leaves"))
    used = ("format_version", "state", "layout", "structure", "leaves", "arrays", "values", "aliases")
    nothing = all(dumps(meta0.get(k)) == dumps(meta1.get(k)) for k in used)
    return {"unchanged": unchanged, "tree_unchanged": tree_unchanged, "nothing_changed": nothing}


TARGETS = ("root", "root", "root", "record+node", "record+node", "array node", "group node")
ROOT_PARTS = [(), ("attributes", "tsckpt"), ("attributes", "tsckpt", "arrays"), ("attributes", "tsckpt", "structure"),
              ("attributes", "tsckpt", "values"), ("attributes", "tsckpt", "leaves")]


def damage(data: Any, base: str, path: str) -> dict[str, Any]:
    """Copy ``base`` to ``path`` and damage one or two of its documents, drawing what and how
    from ``data``; returns the job for the worker."""
    shutil.copytree(base, path)
    root0 = _root(base)
    meta0 = root0["attributes"]["tsckpt"]
    docs: dict[str, Any] = {"zarr.json": root0}  # key below the checkpoint -> document to write

    def doc(key: str) -> Any:
        if key not in docs:
            docs[key] = _read_json(base, key)
        return docs[key]

    for _ in range(data.draw(st.integers(1, 2), label="mutations")):
        target = data.draw(st.sampled_from(TARGETS), label="target")
        root = docs["zarr.json"]
        if target == "root":
            under = data.draw(st.sampled_from(ROOT_PARTS), label="under")
            if under and not isinstance(_get(root, under), (dict, list)):
                under = ()
            docs["zarr.json"] = mutate(root, data.draw(json_mutations(root, under), label="mutation"))
        elif target == "record+node":
            i = data.draw(st.integers(0, len(meta0["arrays"]) - 1), label="record")
            under = ("attributes", "tsckpt", "arrays", i)
            if not isinstance(_get(root, under), dict):  # an earlier mutation removed it
                continue
            if data.draw(st.booleans(), label="plausible"):
                edited = data.draw(record_edits(_get(root, under)), label="record")
                root = docs["zarr.json"] = mutate(root, ("replace", under, edited))
            else:
                root = docs["zarr.json"] = mutate(root, data.draw(json_mutations(root, under), label="mutation"))
            rec = _get(root, under)
            path0 = meta0["arrays"][i]["path"]
            if record_problem(rec, is_known) is None and rec["path"] == path0:  # the node agrees with the record
                docs[f"{path0}/zarr.json"] = array_node(ArrayRecord.from_json(rec))
        else:
            if target == "array node":
                leaf = data.draw(st.sampled_from([r["path"] for r in meta0["arrays"]]), label="array")
                key = f"{leaf}/zarr.json"
            else:
                key = "model/zarr.json"
            node = doc(key)
            docs[key] = mutate(node, data.draw(json_mutations(node), label="mutation"))
    for key in sorted(docs, key=lambda k: k == "zarr.json"):  # the root last: the others are found through it
        _write(path, key, docs[key])
    return {"dir": path, **_changes(root0, docs["zarr.json"])}


def _get(doc: Any, where: tuple[Any, ...]) -> Any:
    """The value at ``where`` in ``doc``, None where there is none."""
    for k in where:
        try:
            doc = doc[k]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


_counter = iter(range(10**9))


@settings(
    max_examples=examples(3),  # a fuzzer: three times the profile's examples
    deadline=timedelta(seconds=30),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_damaged_metadata_never_crashes_a_reader(bases, fuzz_worker, tmp_path_factory, data):
    path = str(tmp_path_factory.getbasetemp() / "fuzz_examples" / f"ex{next(_counter)}")
    layout = data.draw(st.sampled_from(["plain", "plain", "plain", "compact"]), label="layout")
    try:
        job = damage(data, bases[layout], path)
        answer = fuzz_worker.ask(job)
        assert answer["failures"] == [], "\n".join(answer["failures"])
        assert answer["rss_growth"] < RSS_GROWTH_LIMIT, f"resident memory grew by {answer['rss_growth']} bytes"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("damage_to, commands", [("record", ("verify", "ls")), ("node", ("verify",))])
def test_the_command_on_damaged_metadata(bases, tmp_path, damage_to, commands):
    """Real processes of the command: a record saying a chunk holds 4 PB (TensorStore aborted
    reading it), an array node nested 100,000 deep (TensorStore crashed parsing it). verify
    exits 1 naming the leaf, with one line on stderr; ls reads only the root and lists it."""
    path = str(tmp_path / "ck")
    shutil.copytree(bases["plain"], path)
    if damage_to == "node":
        _write(path, "model/b/zarr.json", mutate(_read_json(path, "model/b/zarr.json"), ("deep", (), 100_000)))
    else:
        root = _root(path)
        rec = next(r for r in root["attributes"]["tsckpt"]["arrays"] if r["path"] == "model/b")
        rec.update(shape=[10**15], shard_shape=[10**15])
        _write(path, "model/b/zarr.json", array_node(ArrayRecord.from_json(rec)))
        _write(path, "zarr.json", root)
    for command in commands:
        r = subprocess.run([sys.executable, "-m", "tsckpt", command, path], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        if command == "ls":
            assert r.returncode == 0 and r.stderr == "" and "3.6 PiB" in r.stdout, r.stdout + r.stderr
            continue
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr and "bug in tsckpt" not in r.stderr
        assert "FAIL  model/b: " in r.stdout and "1 of 6 arrays bad ('model/b')" in r.stderr
