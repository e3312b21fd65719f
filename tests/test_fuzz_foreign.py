"""Fuzzing other libraries' metadata: a damaged safetensors header, Hugging Face index, DCP
metadata (read with allow_pickle=True), Orbax ``_METADATA`` or array node, or torch.save
pickle never crashes a reader, nor makes it read outside the checkpoint.

Small checkpoints of each format are made once, with a *canary* beside them: files of each
format holding the value CANARY, which no checkpoint holds. Each example copies one
checkpoint and damages its metadata (JSON mutations as for tsckpt's own metadata; pickled
DCP metadata edited field by field; a path pointed at the canary; a link to it; bytes of a
pickle flipped), then every reader of that format runs on it in the worker process of
tests/test_fuzz_metadata.py, whose address space is bounded: convert (API and CLI) and, for
Orbax, open, lazy reads, restore, metadata and verify. Every failure must be a TsckptError
(the CLI: exit status 1 or 2 and one line on stderr) and leave no output behind; nothing may
hang, crash or allocate gigabytes; no file of the canary may be opened, and no value read
may be the canary's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import sys
import warnings
import zipfile
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tsckpt
from tests.conftest import examples
from tests.foreign import zstd_zeros
from tests.strategies import HUGE_AND_NEGATIVE, dumps, json_mutations, mutate
from tests.test_fuzz_metadata import RSS_GROWTH_LIMIT, Worker, read_leaf, reader_call

CANARY = -7777.25  # a float32 no checkpoint here holds: a value read outside the checkpoint
FORMATS = ("safetensors", "hf", "dcp", "orbax", "orbax-ocdbt", "torch", "torch-legacy")
# Paths a damaged field may name instead of its own file: below, beside and far outside.
ESCAPES = ("..", "/", "a/../..", "./x", "", "x\0y")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 5, generator=g), "b": torch.arange(5, dtype=torch.int32)},
        "layers": [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 2)],
        "step": 4,
    }


def _canary_state() -> dict[str, Any]:
    """Larger than the checkpoints' own state, so that their offsets fall inside its files."""
    return {"model": {"w": torch.full((64, 64), CANARY), "b": torch.full((64,), CANARY)}}


def _dcp_save(state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _orbax_save(state: dict[str, Any], path: str, ocdbt: bool) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"model": {k: v.float().numpy() for k, v in state["model"].items()}, "step": 4}
    if "layers" in state:
        tree["layers"] = [t.float().numpy() for t in state["layers"]]
    ocp.PyTreeCheckpointer(use_ocdbt=ocdbt, use_zarr3=ocdbt).save(path, tree)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Any]:
    """Each format's checkpoint, and the canary beside them: {"dirs": format -> path, "canary": dir}."""
    root = tmp_path_factory.mktemp("foreign")
    state = _state(0)
    own = str(root / "own")
    tsckpt.save(own, state)
    dirs = {
        "safetensors": str(root / "model.safetensors"),
        "hf": str(root / "hf"),
        "dcp": str(root / "dcp"),
        "orbax": str(root / "orbax"),
        "orbax-ocdbt": str(root / "orbax-ocdbt"),
        "torch": str(root / "state.pt"),
        "torch-legacy": str(root / "legacy.pt"),
    }
    tsckpt.convert(own, dirs["safetensors"])
    tsckpt.convert(own, dirs["hf"], to_format="safetensors", max_shard_size="100B")
    _dcp_save(state, dirs["dcp"])
    _orbax_save(state, dirs["orbax"], ocdbt=False)
    _orbax_save(state, dirs["orbax-ocdbt"], ocdbt=True)
    torch.save(state, dirs["torch"])
    torch.save(state, dirs["torch-legacy"], _use_new_zipfile_serialization=False)
    canary = root / "canary"
    canary.mkdir()
    tsckpt.save(str(root / "own-canary"), _canary_state())
    tsckpt.convert(str(root / "own-canary"), str(canary / "canary.safetensors"))
    _dcp_save(_canary_state(), str(root / "dcp-canary"))
    (data,) = [f for f in os.listdir(root / "dcp-canary") if f.endswith(".distcp")]
    shutil.copy(root / "dcp-canary" / data, canary / "canary.distcp")
    _orbax_save(_canary_state(), str(root / "orbax-canary"), ocdbt=False)
    shutil.copytree(root / "orbax-canary" / "model.w", canary / "array")
    return {"dirs": dirs, "canary": str(canary)}


# ---- the worker: every reader of a format on one damaged checkpoint --------------------------


def _cli(argv: list[str]) -> tuple[int, str]:
    from tsckpt._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _canary_values(tree: Any) -> bool:
    """Whether any array of ``tree`` holds CANARY."""
    from tsckpt.tree import flatten

    for leaf in flatten(tree).leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            if bool((leaf.float() == CANARY).any()):
                return True
        elif isinstance(leaf, np.ndarray) and leaf.dtype.kind == "f":
            if bool((leaf.astype(np.float64) == CANARY).any()):
                return True
    return False


_opened_canary: list[str] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    """Record every file Python opens inside the canary (TensorStore's own reads are C++:
    the canary's values catch those)."""
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0]) if not isinstance(args[0], os.PathLike) else os.fspath(args[0])
        canary = os.environ.get("TSCKPT_FUZZ_CANARY")
        if canary and os.path.realpath(path).startswith(canary + os.sep):
            _opened_canary.append(path)


def check(path: str, job: dict[str, Any]) -> list[str]:
    """Run every reader of the job's format on the checkpoint at ``path``; what went wrong."""
    if job["format"] == "warm":
        return [f for fmt, p in job["dirs"].items() for f in check(p, {**job, "format": fmt, "out": job["out"]})]
    os.environ["TSCKPT_FUZZ_CANARY"] = os.path.realpath(job["canary"])
    if not getattr(check, "audited", False):
        sys.addaudithook(_audit)
        check.audited = True  # type: ignore[attr-defined]
    failures: list[str] = []
    call = reader_call(failures)
    out = job["out"]
    del _opened_canary[:]

    pickle_ok = {"allow_pickle": True} if job["format"] == "dcp" else {}
    dst = os.path.join(out, "converted")
    ok, _ = call("convert", lambda: tsckpt.convert(path, dst, progress=False, **pickle_ok))
    if ok:
        restored_ok, restored = call("restore of the converted", lambda: tsckpt.restore(dst, as_saved=True, progress=False))
        if restored_ok and _canary_values(restored):
            failures.append("convert copied values from outside the checkpoint")
    elif os.path.exists(dst):
        failures.append(f"convert failed but left {os.listdir(dst) if os.path.isdir(dst) else dst}")
    argv = ["convert", path, os.path.join(out, "cli.safetensors")] + (["--allow-pickle"] if pickle_ok else [])
    commands = [argv]
    if job["format"].startswith("orbax"):
        _read_orbax(path, call, failures)
        commands.append(["verify", path])
    for argv in commands:
        ok, answer = call(f"tsckpt {' '.join(argv)}", lambda: _cli(argv))
        if ok:
            code, err = answer
            lines = err.splitlines()
            if code != 0 and (len(lines) != 1 or "Traceback" in err or "bug in tsckpt" in err or code not in (1, 2)):
                failures.append(f"tsckpt {' '.join(argv)} exited {code} with stderr {err!r}")
            if argv[0] == "convert" and code != 0 and os.path.exists(argv[2]):
                failures.append(f"tsckpt convert exited {code} but left {argv[2]}")
    if _opened_canary:
        failures.append(f"opened files outside the checkpoint: {sorted(set(_opened_canary))}")
    shutil.rmtree(out, ignore_errors=True)
    return failures


def _read_orbax(path: str, call: Any, failures: list[str]) -> None:
    """The read verbs on an Orbax checkpoint: lazy reads of every leaf, restore, metadata, verify."""
    ok, reader = call("open", lambda: tsckpt.open(path))
    for leaf in list(reader) if ok else []:
        ok, got = call(f"open(...)['{leaf}']", lambda: read_leaf(reader, leaf))
        if ok and _canary_values({"x": got}):
            failures.append(f"a lazy read of '{leaf}' returned values from outside the checkpoint")
    ok, restored = call("restore", lambda: tsckpt.restore(path, progress=False))
    if ok and _canary_values(restored):
        failures.append("restore returned values from outside the checkpoint")
    call("metadata", lambda: tsckpt.metadata(path))
    call("verify", lambda: tsckpt.verify(path, progress=False))


def worker() -> None:
    from tests.test_fuzz_metadata import worker as run

    run(check)


@pytest.fixture(scope="module")
def fuzz_worker(bases, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fuzz_foreign_worker"))
    warm = {"dir": "", "format": "warm", "dirs": bases["dirs"], "canary": bases["canary"], "out": f"{root}/warm"}
    w = Worker(root, warm, module="tests.test_fuzz_foreign")
    yield w
    w.close()


# ---- damaging a copy of a checkpoint -----------------------------------------------------------


def _escape(data: Any, canary: str, own: str, example: str) -> str:
    """A path for a field that names a file or directory, pointing at the canary ``own``
    (absolute, or relative from the example's directory) or anywhere else odd."""
    kind = data.draw(st.sampled_from(["absolute", "relative", "odd"]), label="escape")
    target = os.path.join(canary, own)
    if kind == "absolute":
        return target
    if kind == "relative":
        return os.path.relpath(target, example)
    return data.draw(st.sampled_from(ESCAPES), label="odd path")


def _st_header(path: str) -> tuple[dict[str, Any], bytes]:
    """(header, data bytes) of a safetensors file."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _st_write(path: str, header: Any, data: bytes) -> None:
    body = dumps(header).encode("utf-8", "surrogatepass")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)


def _damage_safetensors(data: Any, path: str) -> None:
    header, rest = _st_header(path)
    target = data.draw(st.sampled_from(["header", "tsckpt"]), label="target")
    if target == "tsckpt" and "tsckpt" in header.get("__metadata__", {}):
        info = json.loads(header["__metadata__"]["tsckpt"])
        header["__metadata__"]["tsckpt"] = dumps(mutate(info, data.draw(json_mutations(info), label="mutation")))
    else:
        header = mutate(header, data.draw(json_mutations(header), label="mutation"))
    _st_write(path, header, rest)


def _damage_hf(data: Any, path: str, canary: str) -> None:
    index_file = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_file))
    target = data.draw(st.sampled_from(["index", "index", "shard", "path"]), label="target")
    if target == "shard":
        shard = data.draw(st.sampled_from(sorted(set(index["weight_map"].values()))), label="shard")
        _damage_safetensors(data, os.path.join(path, shard))
        return
    if target == "path":
        name = data.draw(st.sampled_from(sorted(index["weight_map"])), label="tensor")
        index["weight_map"][name] = _escape(data, canary, "canary.safetensors", path)
    else:
        index = mutate(index, data.draw(json_mutations(index), label="mutation"))
    with open(index_file, "w") as f:
        f.write(dumps(index))


_NUMBERS = st.sampled_from(HUGE_AND_NEGATIVE) | st.integers(-3, 40)
_JUNK = st.sampled_from([None, 3, "x", [], {}, (1,), 2.5, True])


def _damage_dcp(data: Any, path: str, canary: str) -> None:
    """Edit one field of the unpickled DCP metadata (as a damaged or hostile file would hold
    it), then pickle it back."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata()
    tensors = sorted(k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    indexes = sorted(meta.storage_data, key=lambda i: (i.fqn, tuple(i.offset or ())))
    edits = ["path", "path", "path", "offset", "length", "size", "chunk", "dtype", "drop", "junk", "planner"]
    op = data.draw(st.sampled_from(edits), label="edit")
    if op in ("path", "offset", "length"):
        index = data.draw(st.sampled_from(indexes), label="entry")
        info = meta.storage_data[index]
        if op == "path":
            value: Any = _escape(data, canary, "canary.distcp", path)
        else:
            value = data.draw(_NUMBERS | _JUNK, label=op)
        field = "relative_path" if op == "path" else op
        meta.storage_data[index] = dataclasses.replace(info, **{field: value})
    elif op in ("size", "chunk", "dtype"):
        key = data.draw(st.sampled_from(tensors), label="tensor")
        md = meta.state_dict_metadata[key]
        if op == "size":
            md.size = torch.Size([data.draw(_NUMBERS.filter(lambda n: n >= 0), label="n") for _ in md.size])
        elif op == "chunk":
            c = md.chunks[0]
            which = data.draw(st.sampled_from(["offsets", "sizes"]), label="which")
            n = [data.draw(_NUMBERS.filter(lambda n: n >= 0), label="n") for _ in getattr(c, which)]
            setattr(c, which, torch.Size(n))
        else:
            md.properties.dtype = data.draw(st.sampled_from([torch.float64, torch.int8, torch.complex64, "x", None]))
    elif op == "drop":
        if data.draw(st.booleans(), label="storage"):
            del meta.storage_data[data.draw(st.sampled_from(indexes), label="entry")]
        else:
            del meta.state_dict_metadata[data.draw(st.sampled_from(sorted(meta.state_dict_metadata)), label="entry")]
    elif op == "junk":
        key = data.draw(st.sampled_from(sorted(meta.state_dict_metadata)), label="entry")
        meta.state_dict_metadata[key] = data.draw(_JUNK, label="junk")
    else:
        key = data.draw(st.sampled_from(sorted(meta.planner_data)), label="entry")
        meta.planner_data[key] = data.draw(
            st.sampled_from([("a",) * 5000, (), ("\ud800",), (10**5000,), ("model", -1), None, ("step", "x")]),
            label="path",
        )
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _damage_orbax(data: Any, path: str, canary: str) -> None:
    meta_file = os.path.join(path, "_METADATA")
    meta = json.load(open(meta_file))
    arrays = sorted(
        d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)) and d != "d" and not d.startswith("ocdbt.")
    )
    target = data.draw(st.sampled_from(["_METADATA", "_METADATA", "node", "key", "link", "bomb"]), label="target")
    if target == "bomb" and arrays and not meta.get("use_zarr3"):
        _bomb(data, os.path.join(path, data.draw(st.sampled_from(arrays), label="array")))
        return
    if target == "node" and arrays:
        name = data.draw(st.sampled_from(arrays), label="array")
        node_file = os.path.join(path, name, "zarr.json" if meta.get("use_zarr3") else ".zarray")
        node = json.load(open(node_file))
        with open(node_file, "w") as f:
            f.write(dumps(mutate(node, data.draw(json_mutations(node), label="mutation"))))
        return
    if target == "link" and arrays:
        name = data.draw(st.sampled_from(arrays), label="array")
        shutil.rmtree(os.path.join(path, name))
        os.symlink(os.path.join(canary, "array"), os.path.join(path, name))
        return
    entries = meta["tree_metadata"]
    if target == "key":
        entry = entries[data.draw(st.sampled_from(sorted(entries)), label="entry")]
        entry["key_metadata"] = [{"key": _escape(data, canary, "array", path), "key_type": 2}]
    else:
        meta = mutate(meta, data.draw(json_mutations(meta), label="mutation"))
    with open(meta_file, "w") as f:
        f.write(dumps(meta))


def _bomb(data: Any, array: str) -> None:
    """Make a zarr v2 array one chunk of float32 whose zstd data (128 KiB per 4 GiB) decodes to
    the gigabytes its metadata claims: chunks over 2 GiB, or larger than the array."""
    node = json.load(open(os.path.join(array, ".zarray")))
    chunk = data.draw(st.sampled_from([2**20, 2**29 + 1, 2**30]), label="chunk")
    shape = data.draw(st.sampled_from([4, chunk - 1, chunk]).filter(lambda n: n < chunk or chunk > 2**29), label="shape")
    node.update(shape=[shape], chunks=[chunk], dtype="<f4", compressor={"id": "zstd", "level": 1}, filters=None)
    for f in os.listdir(array):
        os.remove(os.path.join(array, f))
    with open(os.path.join(array, ".zarray"), "w") as f:
        json.dump(node, f)
    with open(os.path.join(array, "0"), "wb") as f:
        f.write(zstd_zeros(chunk * 4))


def _damage_torch(data: Any, path: str) -> None:
    """Flip, drop or insert bytes of the pickle (the zip's data.pkl, or a legacy file)."""
    raw = open(path, "rb").read()
    zipped = raw.startswith(b"PK")
    if zipped:
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
        name = next(n for n in members if n.endswith("data.pkl"))
        raw = members[name]
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, len(buf) - 1), label="at")
        op = data.draw(st.sampled_from(["flip", "set", "drop", "insert"]), label="op")
        if op == "flip":
            buf[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "set":
            buf[at] = data.draw(st.integers(0, 255), label="byte")
        elif op == "drop":
            del buf[at]
        else:
            buf[at:at] = bytes([data.draw(st.integers(0, 255), label="byte")])
    if zipped:
        members[name] = bytes(buf)
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for n, b in members.items():
                z.writestr(n, b)
    else:
        with open(path, "wb") as f:
            f.write(bytes(buf))


def damage(data: Any, bases: dict[str, Any], fmt: str, example: str) -> dict[str, Any]:
    """Copy the checkpoint of ``fmt`` into ``example`` and damage its metadata; the worker's job."""
    src = bases["dirs"][fmt]
    os.makedirs(example)
    path = os.path.join(example, os.path.basename(src))
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, path)
    canary = bases["canary"]
    if fmt == "safetensors":
        _damage_safetensors(data, path)
    elif fmt == "hf":
        _damage_hf(data, path, canary)
    elif fmt == "dcp":
        _damage_dcp(data, path, canary)
    elif fmt.startswith("orbax"):
        _damage_orbax(data, path, canary)
    else:
        _damage_torch(data, path)
    return {"dir": path, "format": fmt, "canary": canary, "out": os.path.join(example, "out")}


_counter = iter(range(10**9))


@pytest.mark.slow
@settings(
    max_examples=examples(3),  # a fuzzer: three times the profile's examples (about 10 s per 100)
    deadline=timedelta(seconds=30),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_damaged_foreign_metadata_never_crashes_a_reader(bases, fuzz_worker, tmp_path_factory, data):
    example = str(tmp_path_factory.getbasetemp() / "fuzz_foreign_examples" / f"ex{next(_counter)}")
    fmt = data.draw(st.sampled_from(FORMATS), label="format")
    try:
        job = damage(data, bases, fmt, example)
        answer = fuzz_worker.ask(job)
        assert answer["failures"] == [], "\n".join(answer["failures"])
        assert answer["rss_growth"] < RSS_GROWTH_LIMIT, f"resident memory grew by {answer['rss_growth']} bytes"
    finally:
        shutil.rmtree(example, ignore_errors=True)
