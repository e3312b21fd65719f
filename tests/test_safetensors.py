"""safetensors files and Hugging Face directories: reading, streaming writes, bad files."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tsckpt import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LeafTypeError,
    LinkRefusedError,
)
from tsckpt import NotACheckpointError
from tsckpt._base import dtypes as _dtypes
from tsckpt._errors import CheckpointReplacedError, short_repr
from tsckpt._ondisk.records import MAX_NDIM
from tsckpt._formats import safetensors as _safetensors
from tsckpt._formats.safetensors import OutTensor, plan_shards, read_dir, read_file, read_header, write
from tsckpt._base.types import LazySource
from tests.conftest import examples
from tests.strategies import dumps, json_mutations, mutate


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "emb.weight": torch.randn(10, 6, generator=g),
        "layers.0.w": torch.randn(3, 4, 5, generator=g).to(torch.bfloat16),
        "layers.0.b": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "f8": torch.linspace(-1, 1, 5).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 3),
        "u16": torch.arange(7, dtype=torch.int32).to(torch.uint16),
    }


def out(name: str, t: torch.Tensor) -> OutTensor:
    arr = _dtypes.tensor_to_numpy(t)
    return OutTensor(name, _dtypes.torch_name(t.dtype), tuple(t.shape), lambda box: arr[box])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (float8 has no ==; NaN-safe)."""
    return a.dtype == b.dtype and a.shape == b.shape and (
        _dtypes.tensor_to_numpy(a.contiguous()).tobytes() == _dtypes.tensor_to_numpy(b.contiguous()).tobytes()
    )


def read_all(src: LazySource) -> torch.Tensor:
    return _dtypes.numpy_to_tensor(np.asarray(src[tuple(slice(0, n) for n in src.shape)]), _dtypes.torch_name(src.dtype))


# ---- the byte layout --------------------------------------------------------------------


def test_written_file_is_byte_identical_to_save_file(tmp_path):
    ts = tensors()
    ref, mine = str(tmp_path / "ref.safetensors"), str(tmp_path / "mine.safetensors")
    save_file(ts, ref, metadata={"format": "pt"})
    assert write(mine, [out(n, t) for n, t in ts.items()], None, directory=False) == [mine]
    with open(ref, "rb") as a, open(mine, "rb") as b:
        assert a.read() == b.read()


def test_written_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(_safetensors, "BLOCK_BYTES", 64)
    t = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)  # 32-byte rows: 2 rows a block
    boxes = []
    arr = t.numpy()

    def read(box):
        boxes.append(box)
        return arr[box]

    write(str(tmp_path / "x.safetensors"), [OutTensor("t", "float32", (40, 8), read)], None, directory=False)
    assert len(boxes) == 20 and all(b[0].stop - b[0].start == 2 for b in boxes)
    assert torch.equal(load_file(str(tmp_path / "x.safetensors"))["t"], t)


def test_read_file_is_lazy_and_exact(tmp_path):
    ts = tensors()
    path = str(tmp_path / "x.safetensors")
    save_file(ts, path)
    tree = read_file(path)
    assert list(tree) == sorted(ts)
    for name, t in ts.items():
        src = tree[name]
        assert isinstance(src, LazySource) and src.shape == tuple(t.shape) and src.dtype == t.dtype
        assert same_bytes(read_all(src), t), name
    w = ts["layers.0.w"]
    box = (slice(1, 3), slice(2, 4), slice(0, 5))
    got = _dtypes.numpy_to_tensor(tree["layers.0.w"][box], "bfloat16")
    assert torch.equal(got, w[1:3, 2:4, :])


# ---- sharding and the Hugging Face index -------------------------------------------------


def test_plan_shards_fills_in_order_like_transformers():
    sizes = {"a": 40, "b": 40, "c": 100, "d": 10, "e": 10}
    ts = [OutTensor(n, "uint8", (s,), lambda box: None) for n, s in sizes.items()]
    plan = plan_shards(ts, 90)
    assert plan.total_size == 200
    assert [names for _, names in plan.files] == [("a", "b"), ("c",), ("d", "e")]  # c alone: over the limit
    assert [f for f, _ in plan.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert plan_shards(ts, None).files == (("model.safetensors", ("a", "b", "c", "d", "e")),)
    assert plan_shards(ts, 10**9).files[0][0] == "model.safetensors"


def test_sharded_directory_as_transformers_writes_it(tmp_path):
    ts = tensors()
    d = str(tmp_path / "hf")
    os.makedirs(d)
    (tmp_path / "hf" / "config.json").write_text("{}")
    files = write(d, [out(n, t) for n, t in ts.items()], None, directory=True, max_shard_size=200)
    names = sorted(os.listdir(d))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and "config.json" in names and "model.safetensors.index.json" in names
    assert sorted(os.path.basename(f) for f in files) == sorted(shards + ["model.safetensors.index.json"])
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    assert sorted(index["weight_map"]) == sorted(ts) and set(index["weight_map"].values()) == set(shards)
    loaded = {}
    for shard in shards:
        part = load_file(os.path.join(d, shard))
        with safe_open(os.path.join(d, shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
        assert all(index["weight_map"][n] == shard for n in part)
        loaded.update(part)
    for n, t in ts.items():
        assert same_bytes(loaded[n], t), n
    tree = read_dir(d)
    assert sorted(tree) == sorted(ts) and torch.equal(read_all(tree["emb.weight"]), ts["emb.weight"])


def test_overwrite_replaces_stale_shards_and_keeps_other_files(tmp_path):
    d = str(tmp_path / "hf")
    ts = tensors()
    write(d, [out(n, t) for n, t in ts.items()], None, directory=True, max_shard_size=100)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match="already exists; pass overwrite=True"):
        write(d, [out("x", torch.ones(2))], None, directory=True)
    write(d, [out("x", torch.ones(2))], None, directory=True, overwrite=True)
    assert sorted(os.listdir(d)) == ["model.safetensors", "tokenizer.json"]
    assert list(load_file(os.path.join(d, "model.safetensors"))) == ["x"]


def test_failed_write_leaves_nothing(tmp_path):
    def boom(box):
        raise OSError("disk on fire")

    d = str(tmp_path / "hf")
    ts = [out("a", torch.ones(100)), OutTensor("b", "float32", (100,), boom)]
    with pytest.raises(OSError, match="disk on fire"):
        write(d, ts, None, directory=True, max_shard_size=100)
    assert not os.path.exists(d)
    f = str(tmp_path / "x.safetensors")
    with pytest.raises(OSError, match="disk on fire"):
        write(f, ts, None, directory=False)
    assert os.listdir(tmp_path) == []


def test_unsupported_dtype_and_name_collisions(tmp_path):
    with pytest.raises(LeafTypeError, match="'c': dtype complex32 has no safetensors equivalent"):
        write(str(tmp_path / "x.safetensors"), [OutTensor("c", "complex32", (2,), lambda b: None)], None,
              directory=False)
    with pytest.raises(ValueError, match="two leaves map to the tensor name 'a'"):
        write(str(tmp_path / "x.safetensors"), [out("a", torch.ones(1)), out("a", torch.ones(1))], None,
              directory=False)
    assert not os.path.exists(tmp_path / "x.safetensors")


# ---- bad files -------------------------------------------------------------------------------


def _with_header(path, header: dict, data: bytes) -> None:
    body = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize(
    "header, data, match",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12),
         r"tensor 'b' at data offset 4 overlaps another tensor"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
         r"tensor 'a': F32\[3\] needs 12 bytes but its offsets \[0, 8\] span 8"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12),
         r"tensor 'a' at data offset 4 leaves a gap of 4 bytes before it"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8),
         r"truncated: the header describes 16 data bytes but the file holds 8"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12),
         r"4 bytes follow the last tensor"),
        ({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
         r"tensor 'a': 'dtype' is 'Q7', expected one of \['BF16', 'BOOL', "),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}}, b"",
         rf"tensor 'a': 'shape' is \[-2\], expected a list of at most {MAX_NDIM} non-negative integers with a product "
         r"under 2\*\*59"),
        ({"a": {"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]}}, b"",
         rf"tensor 'a': 'shape' is \[1180591620717411303424, 0\], expected a list of at most {MAX_NDIM}"),
        ({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8),
         r"tensor 'a': 'shape' is \[2.0\], expected"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4),
         r"tensor 'a': 'shape' is \[True\], expected"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8),
         r"tensor 'a': 'data_offsets' is \[8, 0\], expected \[begin, end\], integers with 0 <= begin <= end < 2\*\*63"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 2**64]}}, bytes(8),
         r"tensor 'a': 'data_offsets' is \[0, 18446744073709551616\], expected"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, bytes(12),
         r"tensor 'a': F32\[2\] needs 8 bytes but its offsets \[0, 12\] span 12"),
        ({"a": [1, 2]}, b"", r"tensor 'a': 'dtype' is None, expected one of"),
        ({"__metadata__": {"x": 1}}, b"", r"its __metadata__ is not a map of strings"),
        ({"__metadata__": 0}, b"", r"its __metadata__ is not a map of strings"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": json.loads("[" * 126 + "]" * 126)}},
         bytes(8), r"tensor 'a': its field 'x' nests more than 125 levels deep \(the header more than 127\)"),
    ],
)
def test_header_that_lies_is_refused(tmp_path, header, data, match):
    path = str(tmp_path / "bad.safetensors")
    _with_header(path, header, data)
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        read_header(path)
    assert str(e.value).startswith(path + ": ") and "\n" not in str(e.value)
    assert str(e.value).endswith("; the file is damaged or was not fully written, get a good copy")


def test_fields_safetensors_ignores_are_read_past(tmp_path):
    """An entry's extra fields, nested as deeply as the library reads them, and a null
    ``__metadata__``, are read as the library reads them."""
    path = str(tmp_path / "x.safetensors")
    deep = json.loads("[" * 125 + "]" * 125)
    _with_header(path, {"__metadata__": None, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": deep}},
                 bytes(8))
    assert not _library_refuses(path)
    h = read_header(path)
    assert h.metadata == {} and h.entries["a"].shape == (2,)


def test_a_header_nested_too_deeply_is_corrupt_not_a_recursion_error(tmp_path):
    path = str(tmp_path / "deep.safetensors")
    body = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
    with pytest.raises(CorruptCheckpointError) as e:
        read_header(path)
    assert str(e.value) == (
        f"{path}: its header is not valid JSON (nested too deeply to parse); the file is damaged or was not fully "
        "written, get a good copy"
    )


def _library_refuses(path: str) -> bool:
    """Whether the safetensors library refuses the file: opening it, or reading any tensor of it."""
    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                f.get_slice(name)[...]
    except BaseException as e:  # pyo3's PanicException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return True
    return False


@settings(max_examples=examples(5), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hst.data())
def test_a_header_the_library_refuses_is_refused_here_too(tmp_path, data):
    """Differential: a good file's header mutated as the fuzz tests mutate JSON, and its data
    cut short or extended. Whatever the safetensors library refuses, read_header refuses as a
    TsckptError naming the file; what both accept, both read as the same tensors. (The reverse
    need not hold: this reader also refuses over MAX_NDIM dimensions, a space before the JSON
    and dtypes tsckpt cannot hold.)"""
    good = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
            "c": {"dtype": "I64", "shape": [], "data_offsets": [32, 40]},
            "d": {"dtype": "U8", "shape": [0, 5], "data_offsets": [40, 40]}}
    header = mutate(good, data.draw(json_mutations(good), label="mutation"))
    body = dumps(header).encode("utf-8", "surrogatepass")
    body += b" " * data.draw(hst.sampled_from([0, 0, 3]), label="padding")
    extra = data.draw(hst.sampled_from([0, 0, 0, -1, -8, 1, 8]), label="data bytes added")
    path = str(tmp_path / "x.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + bytes(max(0, 40 + extra)))
    refused = _library_refuses(path)
    try:
        h = read_header(path)
    except (CorruptCheckpointError, NotACheckpointError) as e:
        assert str(e).startswith(path + ": ") and "\n" not in str(e)
        return
    assert not refused, f"the library refuses {header!r}, read_header accepts it"
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(h.entries)
        for name, entry in h.entries.items():
            s = f.get_slice(name)
            assert (s.get_dtype(), tuple(s.get_shape())) == (_safetensors._NAMES[entry.dtype], entry.shape), name


def test_a_file_that_shrinks_under_a_read_is_corrupt(tmp_path):
    """A read past the end (the file cut after its header was read) is an error naming the
    tensor, not a short array nor, as through a map of the file, SIGBUS."""
    path = str(tmp_path / "x.safetensors")
    save_file({"a": torch.ones(64, 64)}, path)
    entry = read_header(path).entries["a"]
    os.truncate(path, entry.begin + 1000)
    with pytest.raises(CheckpointReplacedError, match="replaced or rewritten since its header was read"):
        _safetensors.read_box(entry, path, (slice(10, 20),))  # cut before the read: seen when it opens
    with pytest.raises(CorruptCheckpointError) as e:  # cut after the open's check, as the reads go
        _safetensors.read_box(dataclasses.replace(entry, stamp=()), path, (slice(10, 20),))
    assert str(e.value) == (
        f"{path}: tensor 'a' ends early (the file shrank while it was read); the file is damaged or was not fully "
        "written, get a good copy"
    )


def test_short_reads_are_read_again_to_the_end(tmp_path, monkeypatch):
    path = str(tmp_path / "x.safetensors")
    w = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    save_file({"w": w}, path)
    entry = read_header(path).entries["w"]
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: real(fd, [memoryview(bufs[0])[:7]], at))
    for box in [(slice(2, 9), slice(3, 8)), (slice(0, 12),)]:
        np.testing.assert_array_equal(_safetensors.read_box(entry, path, box), w.numpy()[box])


def test_the_package_never_imports_the_safetensors_library():
    """The library is a test dependency only (pyproject's test extra): tsckpt reads and writes
    safetensors itself (the module docstring of tsckpt/_formats/safetensors.py says why)."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tsckpt")
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                file = os.path.join(folder, name)
                with open(file, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                    found += [f"{file}:{node.lineno}" for m in mods if m.split(".")[0] == "safetensors"]
    assert found == []


# ---- tsckpt's metadata in a file -------------------------------------------------------------


def _with_info(path, info) -> None:
    """A file of one tensor 'w' (float32 [2]) whose tsckpt metadata is ``info`` (JSON text as given)."""
    text = info if isinstance(info, str) else json.dumps(info)
    _with_header(path, {"__metadata__": {"tsckpt": text}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                 bytes(8))


GOOD_INFO = {"format_version": 1, "structure": None, "leaves": ["w", "n"], "kinds": {"w": "numpy"},
             "values": {"n": {"type": "int", "value": 3}}}


@pytest.mark.parametrize(
    "change, why",
    [
        ({"kinds": {"w": "bogus"}}, "'kinds' of leaf 'w' is 'bogus', expected one of ['torch', 'numpy', 'numpy_scalar']"),
        ({"kinds": {"w": "numpy_scalar"}}, "'kinds' of leaf 'w' is 'numpy_scalar', but its tensor has shape [2]"),
        ({"kinds": []}, "'kinds' is [], expected an object"),
        ({"leaves": ["w", 3]}, "'leaves' is ['w', 3], expected a list of leaf paths"),
        ({"leaves": ["w", "n", "ghost"]}, "lists leaf 'ghost', which is no value, tie or tensor of the file"),
        ({"leaves": ["n"]}, "does not list the tensor 'w' in 'leaves'"),
        ({"values": {"n": {"type": "int", "value": "3"}}}, "'values' of leaf 'n': 'value' must be an integer for type 'int'"),
        ({"aliases": {"v": "ghost"}}, "'aliases' ties 'v' to 'ghost', which is no tensor of the file"),
        ({"structure": {"type": "dict", "keys": ["w"], "children": [None]}},
         "'structure' is invalid: it has 1 leaves but the checkpoint lists 2"),
        ({"structure": json.loads("[" * 50 + "]" * 50)}, "'structure' is invalid: it has a node of unknown type 'list'"),
    ],
)
def test_tsckpt_metadata_is_checked_before_the_tree_is_built(tmp_path, change, why):
    path = str(tmp_path / "x.safetensors")
    _with_info(path, {**GOOD_INFO, **change})
    with pytest.raises(CorruptCheckpointError) as e:
        read_file(path)
    assert str(e.value).startswith(f"{path}: its 'tsckpt' metadata {why}")
    assert str(e.value).endswith("; it is damaged: remove it to read the tensors as a flat dict (names: e.g. 'w')")


def test_tsckpt_metadata_that_is_good_builds_the_tree(tmp_path):
    path = str(tmp_path / "x.safetensors")
    _with_info(path, GOOD_INFO)
    tree = read_file(path)
    assert tree["n"] == 3 and tree["w"].kind == "numpy" and tree["w"].shape == (2,)


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000 + "]" * 100_000, '"a string"'])
def test_tsckpt_metadata_that_is_no_object_is_corrupt(tmp_path, text):
    path = str(tmp_path / "x.safetensors")
    _with_info(path, text)
    with pytest.raises(CorruptCheckpointError, match=r"its 'tsckpt' metadata (is not valid JSON|is str, expected)"):
        read_file(path)


def test_unknown_kind_fails_convert_with_exit_1_and_writes_nothing(tmp_path, capsys):
    from tsckpt._cli import main

    path = str(tmp_path / "x.safetensors")
    _with_info(path, {**GOOD_INFO, "kinds": {"w": "bogus"}})
    assert main(["convert", path, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'kinds' of leaf 'w' is 'bogus'" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "out")


def test_truncated_and_foreign_files(tmp_path):
    path = str(tmp_path / "x.safetensors")
    save_file(tensors(), path)
    whole = open(path, "rb").read()
    (n,) = struct.unpack("<Q", whole[:8])
    for cut, match in ((len(whole) - 5, "truncated: the header describes"), (8 + n // 2, "truncated: the header needs")):
        with open(path, "wb") as f:
            f.write(whole[:cut])
        with pytest.raises(CorruptCheckpointError, match=match):
            read_file(path)
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 a zip file, not safetensors")
    with pytest.raises(NotACheckpointError, match=r"not a safetensors file"):
        read_file(path)
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        read_file(str(tmp_path / "missing.safetensors"))


def test_directory_with_missing_or_wrong_shard(tmp_path):
    d = tmp_path / "hf"
    write(str(d), [out(n, t) for n, t in tensors().items()], None, directory=True, max_shard_size=100)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = index["weight_map"]["emb.weight"]
    index["weight_map"]["ghost"] = first
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=rf"{first}: has no tensor 'ghost', but model.safetensors.index"):
        read_dir(str(d))
    del index["weight_map"]["ghost"]
    for outside in ("../elsewhere.safetensors", str(d / first)):
        index["weight_map"]["emb.weight"] = outside
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CorruptCheckpointError) as e:
            read_dir(str(d))
        assert str(e.value) == (
            f"{d}/model.safetensors.index.json: weight_map['emb.weight'] {short_repr(outside)} is not a relative path "
            "inside the checkpoint; the checkpoint is damaged or made to read elsewhere: use a trusted copy"
        )
    index["weight_map"]["emb.weight"] = first
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    os.remove(d / first)
    with pytest.raises(CorruptCheckpointError, match=rf"{first}: missing, but model.safetensors.index.json maps"):
        read_dir(str(d))


@pytest.mark.parametrize(
    "index, why",
    [
        ("[" * 100_000 + "]" * 100_000, "it is not JSON (nested too deeply to parse); restore it"),
        ('{"weight_map": {"w": 3}}', "'weight_map' is {'w': 3}, expected an object mapping each tensor name to the "
         "file holding it; restore the index"),
        ('{"weight_map": ["w"]}', "'weight_map' is ['w'], expected an object mapping"),
        ("[1]", "'weight_map' is a JSON list, expected an object mapping"),
        ('{"weight_map": {}, "metadata": 7}', "'metadata' is 7, expected an object; restore the index"),
    ],
)
def test_an_index_that_is_malformed_is_corrupt(tmp_path, index, why):
    d = tmp_path / "hf"
    write(str(d), [out(n, t) for n, t in tensors().items()], None, directory=True, max_shard_size=100)
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CorruptCheckpointError) as e:
        read_dir(str(d))
    assert str(e.value).startswith(f"{d}/model.safetensors.index.json: not a valid index: {why}")
    assert str(e.value).endswith("; restore it" if "JSON (" in why else "; restore the index")


def test_a_linked_shard_or_weights_file_is_refused(tmp_path):
    d = tmp_path / "hf"
    write(str(d), [out(n, t) for n, t in tensors().items()], None, directory=True, max_shard_size=100)
    first = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]["emb.weight"]
    os.rename(d / first, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", d / first)
    with pytest.raises(LinkRefusedError) as e:
        read_dir(str(d))
    assert str(e.value) == (
        f"{d}/model.safetensors.index.json: weight_map['emb.weight'] {first!r}: {first} is a symbolic link (to "
        f"{tmp_path / 'elsewhere'}); tsckpt does not follow symbolic links in a checkpoint, which must hold its own "
        "files (a link could lead anywhere; docs/security.md): replace each link with a copy of its file"
    )
    one = tmp_path / "one"
    one.mkdir()
    save_file(tensors(), str(tmp_path / "real.safetensors"))
    os.symlink(tmp_path / "real.safetensors", one / "model.safetensors")
    with pytest.raises(LinkRefusedError, match=r"the weights file 'model.safetensors': model.safetensors is a "
                       r"symbolic link"):
        read_dir(str(one))
    assert set(read_file(str(one / "model.safetensors"))) == set(tensors())  # the file named itself may be a link
