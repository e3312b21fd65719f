"""tsckpt on s3, against moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._save.protocol as save_module
from tests import dist_scenarios as sc
from tests.races import race_two_saves
from tests.dist_helpers import run_ranks
from tests.stored import layout_record, root_layout

BUCKET = "tsckpt-test"
SPEC = {"wte": ((10, 6), "S0"), "proj": ((7, 3), "S1"), "norm": ((6,), "R")}


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 in this process, serving one bucket; yields its endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # a port the kernel chose
    server.start()
    url = "http://{}:{}".format(*server.get_host_and_port())
    _client(url).create_bucket(Bucket=BUCKET)
    yield url
    server.stop()


def _client(url: str):
    import boto3

    return boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )


@pytest.fixture
def dead_endpoint():
    """An endpoint URL where nothing listens: its port is bound here and never listened on,
    so connections are refused, and no other process can take the port meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield "http://{}:{}".format(*s.getsockname())


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS environment pointing at the server; restored after the test."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    env = {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def prefix(s3_env):
    """A fresh key prefix in the bucket (no trailing slash)."""
    return f"{uuid.uuid4().hex}/ck"


def _keys(url: str, prefix: str) -> list[str]:
    pages = _client(url).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _root(url: str, prefix: str) -> dict:
    body = _client(url).get_object(Bucket=BUCKET, Key=f"{prefix}/zarr.json")["Body"].read()
    return json.loads(body)["attributes"]["tsckpt"]


@pytest.fixture
def s3_calls(monkeypatch):
    """Record the object keys the server is asked to GET and the prefixes it is asked to list."""
    import moto.s3.responses as responses

    seen: dict[str, list[str]] = {"get": [], "list": []}
    get, list_v2 = responses.S3Response.get_object, responses.S3Response.list_objects_v2

    def spy_get(self):
        seen["get"].append(self.path)
        return get(self)

    def spy_list(self):
        seen["list"].append(self.querystring.get("prefix", [""])[0])
        return list_v2(self)

    monkeypatch.setattr(responses.S3Response, "get_object", spy_get)
    monkeypatch.setattr(responses.S3Response, "list_objects_v2", spy_list)
    return seen


def _tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 64, generator=g),
        "b": torch.arange(10, dtype=torch.bfloat16),
        "np": np.arange(12, dtype=np.int32).reshape(3, 4),
        "step": seed,
        "name": "run",
    }


def _assert_tree(got: dict, seed: int = 0) -> None:
    """``got`` restored without a target: arrays come back as numpy."""
    ref = _tree(seed)
    np.testing.assert_array_equal(got["w"], ref["w"].numpy())
    np.testing.assert_array_equal(np.asarray(got["b"], dtype=np.float32), ref["b"].float().numpy())
    np.testing.assert_array_equal(got["np"], ref["np"])
    assert (got["step"], got["name"]) == (seed, "run")


# ---- single rank -------------------------------------------------------------


def test_save_restore_open_metadata_verify(s3_server, prefix, small_chunks, s3_calls):
    url = f"s3://{BUCKET}/{prefix}"
    tsckpt.save(url, _tree())
    assert _root(s3_server, prefix)["state"] == "committed"
    _assert_tree(tsckpt.restore(url))

    meta = tsckpt.metadata(url)
    assert meta["w"].shape == (64, 64) and meta["w"].dtype == "float32" and meta["step"] == 0
    chunk_files = [k for k in _keys(s3_server, f"{prefix}/w/c/")]
    assert len(chunk_files) > 1  # small_chunks: several shard files

    s3_calls["get"].clear()
    reader = tsckpt.open(url)
    row = reader["w"].torch[3, 5:9]
    assert torch.equal(row, _tree()["w"][3, 5:9])
    read_chunks = {p for p in s3_calls["get"] if "/w/c/" in p}
    assert 0 < len(read_chunks) < len(chunk_files)  # a slice reads only the files it touches

    report = tsckpt.verify(url)
    assert report.ok and report.n_arrays == 3 and report.location == f"s3://{BUCKET}/{prefix}/"


def test_spec_dict_wins_over_environment(s3_server, prefix, monkeypatch, dead_endpoint):
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead_endpoint)
    spec = {"driver": "s3", "bucket": BUCKET, "path": prefix, "endpoint": s3_server}
    tsckpt.save(spec, _tree(1))
    _assert_tree(tsckpt.restore(spec), 1)
    assert tsckpt._storage.locations.resolve(spec).spec["endpoint"] == s3_server


def test_compact_layout_on_s3(s3_server, prefix):
    url = f"s3://{BUCKET}/{prefix}"
    tree = {"opt": {f"l{i:03d}": torch.full((3, 2), float(i)) for i in range(200)}, **_tree(4)}
    tsckpt.save(url, tree, layout="compact")
    assert _root(s3_server, prefix)["layout"] == "compact"
    assert len(list(_keys(s3_server, f"{prefix}/"))) <= 12  # not one object per leaf
    out = tsckpt.restore(url)
    _assert_tree(out, 4)
    assert out["opt"]["l199"].tolist() == [[199.0] * 2] * 3
    assert tsckpt.open(url)["opt/l007"][1:].tolist() == [[7.0, 7.0]] * 2
    assert tsckpt.verify(url).ok


def _gets(proxy) -> int:
    return sum(r.method == "GET" for r in proxy.seen)


@pytest.mark.parametrize("leaves, coalesced", [(1000, True), (100, False)])
def test_compact_restore_reads_by_few_requests(s3_server, prefix, counted, leaves, coalesced, monkeypatch):
    """A compact restore from an object store: OCDBT merges the reads of the arrays' nodes and
    chunks into a few ranged GETs of its data files; without coalescing, about two GETs per
    leaf. The reads that wait for one in flight are merged, so the count grows with the time
    it takes to start them (on a loaded machine too); the bound is 3 per 100 leaves
    (benchmarks/bench_s3.py measures the target, 2 per 100, at 10,000 leaves)."""
    if not coalesced:
        monkeypatch.setattr(tsckpt._ondisk.arrays, "COALESCE", {})
    url = f"s3://{BUCKET}/{prefix}"
    tree = {f"l{i:04d}": torch.full((16 + i % 300,), float(i)) for i in range(leaves)}
    tsckpt.save(url, tree, layout="compact")
    bound = 3 * leaves // 100 if coalesced else None
    for target in (None, {k: torch.zeros_like(v) for k, v in tree.items()}):
        counted.seen.clear()
        out = tsckpt.restore(url, target, inplace=target is not None)
        assert all(np.array_equal(np.asarray(out[k]), v.numpy()) for k, v in tree.items())
        gets = _gets(counted)
        assert gets <= bound if bound is not None else gets > leaves, gets


def test_plain_restore_reads_each_object_once(s3_server, prefix, counted):
    """The plain layout stores one object per chunk: a restore reads each array's node and
    chunk files once (concurrently), and nothing else but the root."""
    url = f"s3://{BUCKET}/{prefix}"
    tree = {f"l{i:02d}": torch.full((8,), float(i)) for i in range(40)}
    tsckpt.save(url, tree)
    counted.seen.clear()
    out = tsckpt.restore(url)
    assert all(out[k].tolist() == v.tolist() for k, v in tree.items())
    keys = [r.key for r in counted.seen if r.method == "GET" and r.key != f"{prefix}/zarr.json"]
    assert sorted(keys) == sorted(f"{prefix}/{k}/{f}" for k in tree for f in ("zarr.json", "c.0"))


@pytest.mark.no_checkpoint_root  # on S3: the layout is checked here
def test_save_async(s3_server, prefix, layout):
    url = f"s3://{BUCKET}/{prefix}"
    tree = _tree(2)
    pending = tsckpt.save_async(url, tree, layout=layout)
    tree["w"].zero_()  # staged already: the save keeps the values it was given
    pending.result(timeout=60)
    assert root_layout(_root(s3_server, prefix)) == layout_record(layout)
    assert tsckpt.open(url).checkpoint.layout == layout
    _assert_tree(tsckpt.restore(url), 2)


def test_convert_local_to_s3_and_to_safetensors(tmp_path, prefix):
    local = str(tmp_path / "ck")
    tsckpt.save(local, _tree(3))
    url = f"s3://{BUCKET}/{prefix}"
    report = tsckpt.convert(local, url)
    assert (report.dst_format, report.n_arrays, report.n_values) == ("tsckpt", 3, 2)
    _assert_tree(tsckpt.restore(url), 3)
    out = str(tmp_path / "model.safetensors")
    tsckpt.convert(url, out)
    from safetensors.torch import load_file

    np.testing.assert_array_equal(load_file(out)["w"].numpy(), _tree(3)["w"].numpy())


# ---- several ranks -----------------------------------------------------------


@pytest.mark.no_checkpoint_root  # on S3: the layout is checked here
def test_4_ranks_save_2_ranks_restore(s3_server, s3_env, prefix, layout):
    url = f"s3://{BUCKET}/{prefix}"
    run_ranks(sc.in_env, 4, s3_env, sc.save_dtensors, url, (4,), SPEC)  # in the layout of the test
    assert root_layout(_root(s3_server, prefix)) == layout_record(layout)
    checked = run_ranks(sc.in_env, 2, s3_env, sc.restore_dtensors, url, (2,), SPEC)
    assert checked[0]["wte"] == 5 * 6  # rank 0 holds half of wte's 10 rows
    out = tsckpt.restore(url)
    for i, (name, (shape, _)) in enumerate(sorted(SPEC.items())):
        np.testing.assert_array_equal(out["model"][name], sc.global_tensor(shape, seed=i).numpy())
    assert out["step"] == 7


# ---- commit protocol ------------------------------------------------------------


def _crash_before_commit(monkeypatch):
    """The save dies before its commit, as a killed process would: no clean-up runs."""
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash before the commit")

    monkeypatch.setattr(save_module, "_commit", crash)
    monkeypatch.setattr(save_module, "_abandon", lambda *args, **kwargs: None)


def test_interrupted_save_never_looks_complete(s3_server, prefix, monkeypatch):
    url = f"s3://{BUCKET}/{prefix}"
    with monkeypatch.context() as m:
        _crash_before_commit(m)
        with pytest.raises(RuntimeError, match="simulated crash"):
            tsckpt.save(url, _tree())
    assert _root(s3_server, prefix)["state"] == "pending"
    assert any("/w/c" in k for k in _keys(s3_server, prefix))  # the data is all there
    with pytest.raises(tsckpt.CheckpointIncompleteError, match="never committed"):
        tsckpt.restore(url)
    with pytest.raises(tsckpt.CheckpointIncompleteError, match="never committed"):
        tsckpt.open(url)
    with pytest.raises(tsckpt.CheckpointExistsError, match="another save into this directory is running, or one crashed"):
        tsckpt.save(url, _tree(1))
    tsckpt.save(url, _tree(1), overwrite=True)
    _assert_tree(tsckpt.restore(url), 1)


def test_failed_save_is_removed_and_saving_again_needs_no_overwrite(s3_server, prefix, monkeypatch):
    url = f"s3://{BUCKET}/{prefix}"
    real = save_module._write_regions

    def refused(*args, **kwargs):
        real(*args, **kwargs)  # the data is written, then a request is refused, as TensorStore reports it
        raise ValueError(f"PERMISSION_DENIED: Error writing \"{prefix}/w/c/0\" [http_response_code='403']")

    with monkeypatch.context() as m:
        m.setattr(save_module, "_write_regions", refused)
        with pytest.raises(tsckpt.StorageError) as e:
            tsckpt.save(url, _tree())
    assert e.value.errno == errno.EACCES and isinstance(e.value, OSError)
    assert str(e.value).startswith(f"{url}/: access denied by {s3_server}")
    assert str(e.value).endswith("the partial checkpoint was removed, so saving again needs no overwrite=True")
    assert _keys(s3_server, prefix + "/") == []
    tsckpt.save(url, _tree(1))
    _assert_tree(tsckpt.restore(url), 1)


def test_overwrite_refuses_a_save_still_running(s3_server, prefix, monkeypatch):
    """The running save's claim is in its pending root; overwrite=True leaves it alone."""
    url = f"s3://{BUCKET}/{prefix}"
    writing, release = threading.Event(), threading.Event()
    real = save_module._write

    def slow_write(*args, **kwargs):
        writing.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "_write", slow_write)
    outcome: list[BaseException | None] = []
    t = threading.Thread(target=lambda: outcome.append(_outcome(lambda: tsckpt.save(url, _tree(1)))))
    t.start()
    try:
        assert writing.wait(30)
        assert _root(s3_server, prefix)["claim"]["pid"] == os.getpid()
        running = f"^{url}/: another save into this directory is still running"
        with pytest.raises(tsckpt.SaveInProgressError, match=running):
            tsckpt.save(url, _tree(2), overwrite=True)
    finally:
        release.set()
        t.join(60)
    assert outcome == [None]
    _assert_tree(tsckpt.restore(url), 1)


def _outcome(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - inspected by the caller
        return e
    return None


def test_concurrent_savers_exactly_one_wins(s3_server, prefix, monkeypatch):
    """Both savers find the location empty; the conditional create (If-None-Match) lets one through."""
    url = f"s3://{BUCKET}/{prefix}"
    winner, loser = race_two_saves(monkeypatch, lambda i: tsckpt.save(url, _tree(i + 1)))
    assert isinstance(loser, tsckpt.CheckpointExistsError)
    assert "claimed it first; nothing was written" in str(loser)
    _assert_tree(tsckpt.restore(url), winner + 1)


# ---- manager ----------------------------------------------------------------------


def test_manager_retention_and_listing(s3_server, prefix, monkeypatch, s3_calls):
    root = f"s3://{BUCKET}/{prefix}"
    m = tsckpt.CheckpointManager(root, keep_last=2)
    for step in range(4):
        m.save(step, _tree(step))
    m.save_async(4, _tree(4)).result(timeout=60)
    with monkeypatch.context() as mp:  # step 5 crashes before its commit
        _crash_before_commit(mp)
        with pytest.raises(RuntimeError, match="simulated crash"):
            m.save(5, _tree(5))
    s3_calls["list"].clear()
    assert m.all_steps() == [3, 4] and m.latest_step() == 4
    # the steps are found by listing the index only, never every key of every step
    assert s3_calls["list"] and all(p == f"{prefix}/.tsckpt-steps/" for p in s3_calls["list"])
    _assert_tree(m.restore(), 4)
    _assert_tree(m.restore(3), 3)
    with pytest.raises(tsckpt.CheckpointIncompleteError):
        m.restore(5)
    # a restarted job removes the crashed step, data, index marker and all, when it first saves
    # (never when it is made: a manager that only reads writes nothing)
    before = _keys(s3_server, prefix + "/")
    m2 = tsckpt.CheckpointManager(root, keep_last=2)
    assert _keys(s3_server, prefix + "/") == before
    m2.save(6, _tree(6))
    tops = {k[len(prefix) + 1 :].split("/")[0] for k in _keys(s3_server, prefix + "/")}
    assert tops == {"00000004", "00000006", ".tsckpt-steps"}
    assert _keys(s3_server, f"{prefix}/.tsckpt-steps/") == [
        f"{prefix}/.tsckpt-steps/.root", *(f"{prefix}/.tsckpt-steps/0000000{s}" for s in (4, 6))
    ]
    assert m2.all_steps() == [4, 6]
    m.close()
    m2.close()


def test_a_step_saved_without_the_manager_is_listed(s3_server, prefix):
    root = f"s3://{BUCKET}/{prefix}"
    m = tsckpt.CheckpointManager(root)
    m.save(1, _tree(1))
    tsckpt.save(m.directory(2), _tree(2))  # the plain verb, into the manager's step directory
    tsckpt.save_async(f"{root}/00000007", _tree(7)).result(timeout=60)
    assert m.all_steps() == [1, 2, 7]
    _assert_tree(m.restore(), 7)
    assert tsckpt.CheckpointManager(root).latest_step() == 7
    # a numbered directory under a root no manager keeps gets no index
    tsckpt.save(f"s3://{BUCKET}/{prefix}-plain/00000003", _tree(3))
    assert _keys(s3_server, f"{prefix}-plain/.tsckpt-steps/") == []
    m.close()


# ---- failures are bounded and explained ---------------------------------------------


@pytest.mark.timeout(60)
def test_unreachable_endpoint_fails_fast(prefix, monkeypatch, dead_endpoint):
    dead = dead_endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    url = f"s3://{BUCKET}/{prefix}"
    start = time.monotonic()
    with pytest.raises(tsckpt.StorageError, match=f"cannot reach {dead}.*check AWS_ENDPOINT_URL") as e:
        tsckpt.save(url, _tree())  # tsckpt's default retry policy
    assert time.monotonic() - start < 30
    assert isinstance(e.value, OSError) and str(e.value).startswith(f"s3://{BUCKET}/{prefix}/:")
    # a spec's own context overrides the retry policy
    quick = {"s3_request_retries": {"max_retries": 2, "initial_delay": "10ms", "max_delay": "20ms"}}
    start = time.monotonic()
    with pytest.raises(tsckpt.StorageError, match="cannot reach"):
        tsckpt.open({"driver": "s3", "bucket": BUCKET, "path": prefix, "context": quick})
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_missing_bucket(s3_server, s3_env):
    url = "s3://no-such-bucket-here/ck"
    start = time.monotonic()
    for call in (lambda: tsckpt.save(url, _tree()), lambda: tsckpt.open(url), lambda: tsckpt.restore(url)):
        with pytest.raises(tsckpt.StorageError, match=f"bucket 'no-such-bucket-here' does not exist at {s3_server}"):
            call()
    with pytest.raises(tsckpt.StorageError, match="does not exist"):
        tsckpt.CheckpointManager("s3://no-such-bucket-here/run").all_steps()
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_bad_credentials(s3_server, prefix, monkeypatch):
    import moto.settings

    url = f"s3://{BUCKET}/{prefix}"
    tsckpt.save(url, _tree())
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server now checks keys
    start = time.monotonic()
    for call in (lambda: tsckpt.save(url + "2", _tree()), lambda: tsckpt.restore(url), lambda: tsckpt.verify(url)):
        with pytest.raises(tsckpt.StorageError, match="access denied by .*check AWS_ACCESS_KEY_ID"):
            call()
    assert time.monotonic() - start < 10


@pytest.mark.timeout(60)
def test_unusable_credentials_spec(prefix):
    spec = {
        "driver": "s3", "bucket": BUCKET, "path": prefix,
        "context": {"aws_credentials": {"type": "profile", "profile": "no-such-profile"}},
    }
    with pytest.raises(tsckpt.StorageError, match="no usable credentials .*check AWS_ACCESS_KEY_ID"):
        tsckpt.open(spec)


_STALLED_OPEN = """
import sys, time, tsckpt
quick = {"s3_request_retries": {"max_retries": 2, "initial_delay": "10ms", "max_delay": "20ms"}}
start = time.monotonic()
try:
    tsckpt.open({"driver": "s3", "bucket": "b-1", "path": "ck", "endpoint": sys.argv[1], "context": quick})
except tsckpt.StorageError as e:
    print(time.monotonic() - start)
    print(e)
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_stalled_endpoint_gives_up_within_the_stated_bound(tmp_path):
    """A server that accepts connections and never answers: each attempt ends at the stall
    limit, and the request, retries included, within request_seconds() of its settings.
    In a fresh process, as TensorStore reads the stall limit once per process."""
    import os
    import socket
    import subprocess
    import sys

    quick = {"max_retries": 2, "initial_delay": "10ms", "max_delay": "20ms"}
    bound = tsckpt._storage.locations.request_seconds(quick, 1)
    assert bound == pytest.approx(3 * 1 + 0.02 + 0.02)  # 3 attempts of 1 s; backoff up to 2 x 20 ms
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        here = os.path.dirname(os.path.dirname(os.path.abspath(tsckpt.__file__)))  # this tsckpt, not another copy
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "1",
               "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}
        out = subprocess.run([sys.executable, "-c", _STALLED_OPEN, endpoint], env=env, capture_output=True,
                             text=True, timeout=50, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    took, message = out.stdout.split("\n", 1)
    assert 3 * 0.9 <= float(took) <= bound + 1.0  # every attempt ran to the stall limit, and no longer
    assert f"cannot reach {endpoint}" in message and "Timeout was reached" in message
    assert f"gives up after at most about {bound:.0f} s" in message


def test_default_request_bound_is_at_most_60_s(monkeypatch):
    """tsckpt's defaults: 7 attempts of at most 6 s each, and at most 12.75 s of backoff."""
    monkeypatch.delenv("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", raising=False)
    assert tsckpt._storage.locations.request_seconds() == pytest.approx(7 * 6 + 0.5 + 0.75 + 1.25 + 2.25 + 4 + 4)
    assert tsckpt._storage.locations.request_seconds() <= 60
    assert tsckpt._storage.locations.request_seconds({"max_retries": 10, "max_delay": "30s"}, 30) > 300  # a spec may lift it
    with pytest.raises(ValueError, match="not a duration"):
        tsckpt._storage.locations.request_seconds({"initial_delay": "soon"})


# ---- lost responses of conditional writes ------------------------------------------------


@pytest.fixture
def lossy(s3_server, s3_env, monkeypatch):
    """A proxy between tsckpt and the server that loses the responses it is told to."""
    from tests.s3proxy import LossyProxy

    proxy = LossyProxy(s3_server, BUCKET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    yield proxy
    proxy.close()


@pytest.fixture
def counted(lossy):
    """The proxy, losing nothing: it records every request (``seen``)."""
    return lossy


def _root_put(prefix: str, header: str):
    """A conditional PUT of the root of ``prefix`` carrying ``header`` (if-none-match: the claim;
    if-match: a renewal or the commit)."""
    return lambda r: r.method == "PUT" and r.key == f"{prefix}/zarr.json" and header in r.headers


def _big_tree(seed: int) -> dict:
    return {**_tree(seed), "opt": {f"l{i:02d}": torch.full((4,), float(i + seed)) for i in range(20)}}


def _assert_big(got: dict, seed: int) -> None:
    _assert_tree(got, seed)
    assert [got["opt"][f"l{i:02d}"].tolist() for i in range(20)] == [[float(i + seed)] * 4 for i in range(20)]


@pytest.mark.no_checkpoint_root  # on S3: the layout is checked here
@pytest.mark.parametrize("lost", ["claim", "commit"])
def test_a_lost_response_of_the_claim_or_commit_is_recognised(s3_server, prefix, lossy, layout, lost):
    """The store applies the PUT, its response is lost, the retry finds the root changed:
    the save reads the root back, finds its own token, and goes on (claim) or returns (commit)."""
    url = f"s3://{BUCKET}/{prefix}"
    lossy.lose(_root_put(prefix, "if-none-match" if lost == "claim" else "if-match"))
    tsckpt.save(url, _big_tree(3), layout=layout)
    assert [r.key for r in lossy.dropped] == [f"{prefix}/zarr.json"]  # the loss happened
    stored = _root(s3_server, prefix)
    assert stored["state"] == "committed" and root_layout(stored) == layout_record(layout)
    _assert_big(tsckpt.restore(url), 3)
    tsckpt.save(url, _big_tree(4), layout=layout, overwrite=True)  # nothing was left behind that refuses
    _assert_big(tsckpt.restore(url), 4)


@pytest.mark.no_checkpoint_root  # on S3: the layout is checked here
def test_a_lost_response_of_a_renewal_keeps_the_lease(s3_server, prefix, lossy, layout, monkeypatch):
    import tsckpt._save.lease as lease_module

    url = f"s3://{BUCKET}/{prefix}"
    monkeypatch.setattr(lease_module, "RENEW_SECONDS", 0.05)
    renewal = _root_put(prefix, "if-match")
    lossy.lose(renewal)
    real = save_module._write

    def slow_write(*args, **kwargs):  # the save runs until a renewal was lost and two more landed
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (lossy.dropped and sum(map(renewal, lossy.seen)) >= 3):
            time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_module, "_write", slow_write)
    tsckpt.save(url, _big_tree(5), layout=layout)
    assert lossy.dropped and sum(map(renewal, lossy.seen)) >= 4  # a lost renewal, two more, the commit
    assert _root(s3_server, prefix)["state"] == "committed"
    _assert_big(tsckpt.restore(url), 5)


def test_manager_step_whose_commit_response_was_lost_is_saved(s3_server, prefix, lossy):
    root = f"s3://{BUCKET}/{prefix}"
    m = tsckpt.CheckpointManager(root, keep_last=2)
    m.save(8, _tree(8))
    lossy.lose(_root_put(f"{prefix}/00000009", "if-match"))
    m.save(9, _tree(9))
    assert len(lossy.dropped) == 1
    assert m.all_steps() == [8, 9]
    _assert_tree(m.restore(9), 9)
    m.close()


# ---- readers of a checkpoint replaced or deleted meanwhile -----------------------------------

REPLACED = "the checkpoint was replaced or deleted while it was being read"


@pytest.mark.no_checkpoint_root  # on S3
def test_a_reader_never_mixes_two_checkpoints_on_s3(s3_server, prefix, layout):
    import gc

    url = f"s3://{BUCKET}/{prefix}"
    tsckpt.save(url, _big_tree(1), layout=layout)
    reader = tsckpt.open(url)
    assert reader["opt/l00"].torch[0].item() == 1.0
    tsckpt.save(url, _big_tree(2), layout=layout, overwrite=True)
    for leaf in ("opt/l07", "opt/l00", "w"):
        with pytest.raises(tsckpt.CheckpointReplacedError, match=REPLACED + ".*its root now says 'committed'"):
            reader[leaf][...]
    del reader
    gc.collect()
    _assert_big(tsckpt.restore(url), 2)


@pytest.mark.no_checkpoint_root  # on S3
def test_a_restore_of_a_step_retention_deletes_on_s3(s3_server, prefix, layout, monkeypatch):
    import tsckpt._read.restore as restore_module

    m = tsckpt.CheckpointManager(f"s3://{BUCKET}/{prefix}", keep_last=1, layout=layout)
    m.save(0, _big_tree(0))
    reader = tsckpt.open(m.directory(0))
    real = restore_module._restore_saved

    def overtaken(*args, **kwargs):
        m.save(1, _big_tree(1))  # retention deletes step 0
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_module, "_restore_saved", overtaken)
    with pytest.raises(tsckpt.CheckpointReplacedError, match=REPLACED + ".*its root zarr.json is gone"):
        m.restore(0)
    with pytest.raises(tsckpt.CheckpointReplacedError, match=REPLACED):
        reader["w"][...]
    assert m.all_steps() == [1]
    m.close()


# ---- incremental saves: server-side copies ------------------------------------------------


@pytest.fixture(autouse=True)
def copy_small_objects(request, monkeypatch):
    """The tests' objects are of a few bytes: copied as large ones are (share.COPY_MIN_BYTES: 0),
    except in the test of that threshold."""
    if "copy_threshold" not in request.keywords:
        from tsckpt._save import share

        monkeypatch.setattr(share, "COPY_MIN_BYTES", 0)


@pytest.fixture
def copy_conditions(monkeypatch):
    """moto honours ``x-amz-copy-source-if-match`` as S3 does (moto ignores it): a copy whose
    source's ETag is another fails with 412 Precondition Failed."""
    import moto.s3.responses as responses
    from moto.s3.exceptions import PreconditionFailed
    from urllib.parse import unquote, urlparse

    copy = responses.S3Response.copy_object

    def conditional(self):
        want = self.headers.get("x-amz-copy-source-if-match")
        if want is not None:
            bucket, key = unquote(urlparse(self.headers["x-amz-copy-source"]).path).lstrip("/").split("/", 1)
            src = self.backend.get_object(bucket, key)
            if src is None or src.etag != want:
                raise PreconditionFailed(failed_condition="x-amz-copy-source-If-Match")
        return copy(self)

    monkeypatch.setattr(responses.S3Response, "copy_object", conditional)


def _frozen() -> dict:
    """A frozen base: a sharded array (TensorStore writes it, several files with small_chunks)
    and one-file arrays (the own codec writes them)."""
    g = torch.Generator().manual_seed(7)
    return {"big": torch.randn(64, 64, generator=g), "small": torch.randn(10, generator=g), "bf": torch.arange(6, dtype=torch.bfloat16)}


def _copies(proxy, prefix: str) -> dict[str, str]:
    """Key (below ``prefix``) -> the ETag its CopyObject request was conditional on."""
    return {
        r.key[len(prefix) + 1 :]: r.headers.get("x-amz-copy-source-if-match", "")
        for r in proxy.seen if r.method == "PUT" and "x-amz-copy-source" in r.headers and r.key.startswith(prefix + "/")
    }


def _data_puts(proxy, prefix: str) -> dict[str, int]:
    """Key (below ``prefix``) -> bytes of each PUT of a data file (no copy, no zarr.json)."""
    return {
        r.key[len(prefix) + 1 :]: int(r.headers.get("content-length", "0"))
        for r in proxy.seen
        if r.method == "PUT" and "x-amz-copy-source" not in r.headers and r.key.startswith(prefix + "/")
        and not r.key.endswith("zarr.json")
    }


def _content(url: str, prefix: str) -> tuple[dict, dict]:
    content = _root(url, prefix)["content"]
    return content["files"], content.get("etags", {})


def test_incremental_steps_copy_unchanged_objects_on_the_store(s3_server, prefix, counted, small_chunks, copy_conditions):
    """A frozen base and a changing adapter: step 1's base objects are made by conditional
    CopyObject requests on the store (no byte through the client), only the adapter's file
    is PUT; each step records its own objects' ETags; step 0 deleted by the retention, step
    1 restores exactly and verifies."""
    root = f"s3://{BUCKET}/{prefix}"
    base = _frozen()
    m = tsckpt.CheckpointManager(root, keep_last=1)
    m.save(0, {"base": base, "adapter": torch.full((8,), 0.0)})
    files0, etags0 = _content(s3_server, f"{prefix}/00000000")
    frozen = sorted(k for k in files0 if k.startswith("base/"))
    assert len(frozen) > 3 and set(etags0) == set(files0)  # several shard files, and every file's ETag
    chunks0 = _root(s3_server, f"{prefix}/00000000")["content"]["chunks"]
    assert chunks0 and set(chunks0) <= set(frozen)
    # each ETag from its write's response: no request reads one back
    assert [r.key for r in counted.seen if r.method == "HEAD" and not r.key.endswith("zarr.json")] == []
    counted.seen.clear()
    m.save(1, {"base": base, "adapter": torch.full((8,), 1.0)})
    step1 = f"{prefix}/00000001"
    assert _copies(counted, step1) == {k: etags0[k] for k in frozen}
    assert list(_data_puts(counted, step1)) == ["adapter/c.0"]  # 8 float32s and their crc32c
    assert _data_puts(counted, step1)["adapter/c.0"] == 36
    files1, etags1 = _content(s3_server, step1)
    assert set(files1) == set(files0) and all(files1[k] == files0[k] for k in frozen)
    # the inner chunks' hashes of each shard file of several: hashed as it was PUT, kept with its copy
    assert _root(s3_server, step1)["content"]["chunks"] == chunks0
    client = _client(s3_server)
    for key, (_, size, _, _) in files1.items():  # each object's own ETag and size, as recorded
        head = client.head_object(Bucket=BUCKET, Key=f"{step1}/{key}")
        assert (head["ETag"], head["ContentLength"]) == (etags1[key], size), key
    m.close()
    assert _keys(s3_server, f"{prefix}/00000000/") == []  # the retention deleted the base step
    out = tsckpt.restore(f"{root}/00000001")
    for k, v in base.items():
        np.testing.assert_array_equal(np.asarray(out["base"][k], dtype=np.float32), v.float().numpy())
    assert out["adapter"].tolist() == [1.0] * 8
    assert tsckpt.verify(f"{root}/00000001").ok
    counted.seen.clear()  # a step copies from a step that was itself copied
    tsckpt.save(f"{root}/next", {"base": base, "adapter": torch.full((8,), 2.0)}, base=f"{root}/00000001")
    assert _copies(counted, f"{prefix}/next") == {k: etags1[k] for k in frozen}


@pytest.mark.parametrize("honoured", [True, False], ids=["store-checks-etag", "store-ignores-condition"])
def test_a_base_object_changed_since_its_save_is_written_not_copied(s3_server, prefix, counted, small_chunks, honoured, request):
    """A base object overwritten with other bytes of the same size after its save: its ETag
    is no longer the recorded one, so its copy is refused (by the store, or found by the
    copy's ETag where the store ignores the condition) and the file is written."""
    if honoured:
        request.getfixturevalue("copy_conditions")
    tree = {"base": _frozen(), "adapter": torch.full((8,), 0.0)}
    tsckpt.save(f"s3://{BUCKET}/{prefix}/a", tree)
    files, _ = _content(s3_server, f"{prefix}/a")
    client = _client(s3_server)
    key = f"{prefix}/a/base/small/c.0"
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(b ^ 0xFF for b in body))  # same size, other bytes
    counted.seen.clear()
    tsckpt.save(f"s3://{BUCKET}/{prefix}/b", tree, base=f"s3://{BUCKET}/{prefix}/a")
    puts = _data_puts(counted, f"{prefix}/b")
    assert "base/small/c.0" in puts and puts["base/small/c.0"] == len(body)
    assert set(puts) == {"base/small/c.0"}  # only it: every other file copied
    assert set(_copies(counted, f"{prefix}/b")) == set(files)  # its copy too, refused
    out = tsckpt.restore(f"s3://{BUCKET}/{prefix}/b")
    np.testing.assert_array_equal(out["base"]["small"], tree["base"]["small"].numpy())
    np.testing.assert_array_equal(out["base"]["big"], tree["base"]["big"].numpy())
    assert tsckpt.verify(f"s3://{BUCKET}/{prefix}/b").ok


def test_without_boto3_every_file_is_written(s3_server, prefix, counted, small_chunks, monkeypatch, caplog):
    import sys

    import tsckpt._storage.s3copy as s3copy

    tree = {"base": _frozen(), "adapter": torch.full((8,), 0.0)}
    tsckpt.save(f"s3://{BUCKET}/{prefix}/a", tree)
    files, _ = _content(s3_server, f"{prefix}/a")
    monkeypatch.setattr(s3copy, "_told", set())
    counted.seen.clear()
    with monkeypatch.context() as mp, caplog.at_level(logging.INFO, logger="tsckpt"):
        mp.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
        tsckpt.save(f"s3://{BUCKET}/{prefix}/b", tree, base=f"s3://{BUCKET}/{prefix}/a")
        tsckpt.save(f"s3://{BUCKET}/{prefix}/c", tree, base=f"s3://{BUCKET}/{prefix}/a")
    told = [r.getMessage() for r in caplog.records if "boto3 is not installed" in r.getMessage()]
    assert len(told) == 1 and "every file is written" in told[0]
    assert _copies(counted, f"{prefix}/b") == {} and set(_data_puts(counted, f"{prefix}/b")) == set(files)
    files_b, etags_b = _content(s3_server, f"{prefix}/b")  # still recorded: a later save with boto3 copies them
    assert files_b == files and set(etags_b) == set(files)
    out = tsckpt.restore(f"s3://{BUCKET}/{prefix}/b")
    np.testing.assert_array_equal(out["base"]["big"], tree["base"]["big"].numpy())
    assert out["adapter"].tolist() == [0.0] * 8


def test_compact_layout_on_s3_shares_nothing_and_says_so(s3_server, prefix, counted, caplog):
    tree = {"base": _frozen(), "adapter": torch.full((8,), 0.0)}
    tsckpt.save(f"s3://{BUCKET}/{prefix}/a", tree, layout="compact")
    counted.seen.clear()
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        tsckpt.save(f"s3://{BUCKET}/{prefix}/b", tree, layout="compact", base=f"s3://{BUCKET}/{prefix}/a")
    assert any("shares nothing with its base (the compact layout" in r.getMessage() for r in caplog.records)
    assert _copies(counted, f"{prefix}/b") == {} and "content" not in _root(s3_server, f"{prefix}/b")
    out = tsckpt.restore(f"s3://{BUCKET}/{prefix}/b")
    np.testing.assert_array_equal(out["base"]["big"], tree["base"]["big"].numpy())


def test_a_base_that_is_the_target_is_refused_on_s3(s3_server, prefix):
    url = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(ValueError, match="is the checkpoint being saved"):
        tsckpt.save(url, _tree(), base=url)


def test_ranks_copy_their_own_unchanged_objects(s3_server, s3_env, prefix, counted, copy_conditions):
    """Two ranks, each writing one shard file of a frozen weight: at the second step each
    copies its own file on the store; rank 0 records every rank's hashes and ETags."""
    root = f"s3://{BUCKET}/{prefix}"
    run_ranks(sc.in_env, 2, {**s3_env, "AWS_ENDPOINT_URL": counted.url}, sc.incremental_steps, root, layout="plain")
    files1, etags1 = _content(s3_server, f"{prefix}/00000001")
    files2, etags2 = _content(s3_server, f"{prefix}/00000002")
    assert _copies(counted, f"{prefix}/00000002") == {k: etags1[k] for k in ("frozen/c/0/0", "frozen/c/1/0")}
    assert list(_data_puts(counted, f"{prefix}/00000002")) == ["adapter/c.0.0"]
    assert set(files2) == set(etags2) == {"frozen/c/0/0", "frozen/c/1/0", "adapter/c.0.0"}
    out = tsckpt.restore(f"{root}/00000002")
    np.testing.assert_array_equal(out["frozen"], sc.global_tensor((128, 256)).numpy())
    assert tsckpt.verify(f"{root}/00000002").ok


def test_an_incremental_step_killed_before_its_commit_lists_nothing(s3_server, prefix, counted, small_chunks, monkeypatch):
    """Copies are only another way of writing a file of the pending step: a step killed after
    its copies, before its commit, is not listed, its base is untouched, and the next save
    (after the clean-up of the killed step) copies from the base again."""
    root = f"s3://{BUCKET}/{prefix}"
    base = _frozen()
    m = tsckpt.CheckpointManager(root, keep_last=1)
    m.save(0, {"base": base, "adapter": torch.full((8,), 0.0)})
    files0, etags0 = _content(s3_server, f"{prefix}/00000000")
    counted.seen.clear()
    with monkeypatch.context() as mp:
        _crash_before_commit(mp)
        with pytest.raises(RuntimeError, match="simulated crash"):
            m.save(1, {"base": base, "adapter": torch.full((8,), 1.0)})
    assert set(_copies(counted, f"{prefix}/00000001")) == {k for k in files0 if k.startswith("base/")}
    assert m.all_steps() == [0] and _content(s3_server, f"{prefix}/00000000") == (files0, etags0)
    m.close()
    m = tsckpt.CheckpointManager(root, keep_last=1)
    counted.seen.clear()
    m.save(2, {"base": base, "adapter": torch.full((8,), 2.0)})
    assert set(_copies(counted, f"{prefix}/00000002")) == {k for k in files0 if k.startswith("base/")}
    m.close()
    assert m.all_steps() == [2] and tsckpt.verify(f"{root}/00000002").ok
    np.testing.assert_array_equal(np.asarray(tsckpt.restore(f"{root}/00000002")["base"]["big"]), base["big"].numpy())


@pytest.mark.parametrize("why", ["TSCKPT_CODEC=tensorstore", "large shard files"])
def test_files_tensorstore_writes_record_their_etags_too(s3_server, prefix, counted, small_chunks, copy_conditions, monkeypatch, why):
    """TSCKPT_CODEC=tensorstore, or shard files of write.OBJECT_IN_MEMORY_BYTES and more (encoded
    in memory, they were copied once more on their way to TensorStore): TensorStore writes the
    files, and each one's ETag is read back by one HEAD (reading none of its bytes); the next
    step copies them all the same."""
    if why == "large shard files":
        import tsckpt._save.write as write_module

        monkeypatch.setattr(write_module, "OBJECT_IN_MEMORY_BYTES", 0)
    else:
        monkeypatch.setattr(tsckpt._codec.route, "CODEC", "tensorstore")
    tree = {"base": _frozen(), "adapter": torch.full((8,), 0.0)}
    tsckpt.save(f"s3://{BUCKET}/{prefix}/a", tree)
    files, etags = _content(s3_server, f"{prefix}/a")
    heads = sorted(r.key[len(prefix) + 3 :] for r in counted.seen if r.method == "HEAD" and not r.key.endswith("zarr.json"))
    sharded = sorted(k for k in files if k.startswith("base/big/"))
    assert heads == (sorted(files) if why.startswith("TSCKPT") else sharded) and set(etags) == set(files)
    counted.seen.clear()
    tsckpt.save(f"s3://{BUCKET}/{prefix}/b", tree, base=f"s3://{BUCKET}/{prefix}/a")
    assert _copies(counted, f"{prefix}/b") == etags and _data_puts(counted, f"{prefix}/b") == {}
    assert tsckpt.verify(f"s3://{BUCKET}/{prefix}/b").ok


@pytest.mark.copy_threshold
def test_objects_below_the_copy_threshold_are_written_again(s3_server, prefix, counted):
    """A copy is a request as a PUT is: objects smaller than share.COPY_MIN_BYTES are PUT again;
    larger ones are copied on the store."""
    from tsckpt._save import share

    url = f"s3://{BUCKET}/{prefix}"
    small, large = np.arange(16, dtype=np.float32), np.arange(share.COPY_MIN_BYTES // 4, dtype=np.float32)
    m = tsckpt.CheckpointManager(url)
    m.save(1, {"small": small, "large": large})
    counted.seen.clear()
    m.save(2, {"small": small, "large": large})
    copied = set(_copies(counted, f"{prefix}/00000002"))
    put = set(_data_puts(counted, f"{prefix}/00000002"))
    assert copied == {"large/c.0"} and put == {"small/c.0"}, (copied, put)
    out = m.restore(2)
    assert np.array_equal(out["small"], small) and np.array_equal(out["large"], large)
