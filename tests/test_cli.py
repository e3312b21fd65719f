"""The tsckpt command line: in-process through main(argv), and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tsckpt
from tsckpt._cli import human_bytes, main, parse_target

TIMEOUT = 120  # seconds for one subprocess (imports torch and tensorstore)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tsckpt", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )


def model_tree() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g).to(torch.bfloat16),
            "b": torch.arange(8, dtype=torch.float32),
            "f8": torch.linspace(-2, 2, 6).to(torch.float8_e4m3fn),
            "c": torch.complex(torch.ones(3), torch.arange(3.0)).to(torch.complex32),
        },
        "opt": [np.arange(5, dtype=np.int64), np.float32(2.5)],
        "step": 7,
        "lr": 0.001,
        "name": "run-1",
        "blob": b"\x00\x01",
    }


@pytest.fixture
def ck(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save(path, model_tree())
    return path


@pytest.fixture
def multi(tmp_path, small_chunks):
    """A checkpoint whose arrays span several shard files with several inner chunks each."""
    path = str(tmp_path / "multi")
    tsckpt.save(path, {"big": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32), "other": torch.ones(300)})
    return path


def _files(root: str, leaf: str) -> list[str]:
    """The chunk files of ``leaf``: its ``c.0...`` (or a 0-d array's ``c``), or those below its ``c/``."""
    base = os.path.join(root, *leaf.split("/"))
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs if f != "zarr.json")


def _flip(path: str, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


# ---- helpers -------------------------------------------------------------------


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 20) == "3.0 MiB"
    assert human_bytes(5 << 40) == "5.0 TiB"


@pytest.mark.parametrize(
    "text, path, index",
    [
        ("model/w", "model/w", None),
        ("model/w[5:9, :3]", "model/w", (slice(5, 9), slice(None, 3))),
        ("w[-1]", "w", (-1,)),
        ("w[..., 0]", "w", (Ellipsis, 0)),
        ("w[::-2]", "w", (slice(None, None, -2),)),
        ("w[1:-1:3,]", "w", (slice(1, -1, 3),)),
        ("w[ +2 , : ]", "w", (2, slice(None))),
        ("[0:2]", "", (slice(0, 2),)),
    ],
)
def test_parse_target(text, path, index):
    got_path, got_index, _ = parse_target(text)
    assert got_path == path
    assert got_index == index


@pytest.mark.parametrize(
    "text",
    ["w[", "w]", "w[]", "w[1][2]", "w[1,,2]", "w[a]", "w[1.5]", "w[1:2:3:4]", "w[__import__('os')]", "w[None]"],
)
def test_parse_target_rejects(text):
    from tsckpt._cli import UsageError

    with pytest.raises(UsageError):
        parse_target(text)


# ---- ls ------------------------------------------------------------------------------


def test_ls(ck, capsys):
    code, out, err = run_main(capsys, "ls", ck)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["PATH", "DTYPE", "SHAPE", "SIZE", "VALUE"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {"model/w", "model/b", "model/f8", "model/c", "opt/0", "opt/1", "step", "lr", "name", "blob"}
    assert rows["model/w"].split() == ["model/w", "bfloat16", "[16,", "8]", "256", "B"]
    assert rows["model/c"].split()[1:3] == ["complex32", "[3]"]
    assert rows["model/c"].split()[3:] == ["12", "B"]
    assert rows["opt/1"].split() == ["opt/1", "float32", "[]", "4", "B"]
    assert rows["step"].split() == ["step", "int", "7"]
    assert rows["name"].split() == ["name", "str", "'run-1'"]
    assert rows["blob"].split() == ["blob", "bytes", r"b'\x00\x01'"]
    # 256 + 32 + 6 + 12 + 40 + 4 bytes
    assert lines[-1] == "total 10 leaves: 6 arrays (350 B), 4 values"


def test_ls_long_and_prefix(multi, capsys):
    code, out, _ = run_main(capsys, "ls", "-l", multi, "big")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["PATH", "DTYPE", "SHAPE", "SIZE", "CHUNK", "SHARD", "VALUE"]
    assert len(lines) == 3 and lines[1].startswith("big ")
    md = tsckpt.open(multi)["big"].metadata
    assert md.shard_shape != md.chunk_shape  # the fixture really has inner chunks
    assert f"[{md.chunk_shape[0]}, {md.chunk_shape[1]}]" in lines[1]
    assert lines[-1] == "total 1 leaf: 1 array (8.0 KiB), 0 values"

    code, _, err = run_main(capsys, "ls", multi, "nothing/here")
    assert code == 2 and "nothing/here" in err


def test_ls_map_shows_what_a_mapping_makes(tmp_path, capsys):
    params = {"l1": {"kernel": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)},
              "qkv": np.zeros((6, 2), np.float32)}
    tsckpt.save(tmp_path / "c", {"params": params, "step": 3})
    code, out, err = run_main(capsys, "ls", str(tmp_path / "c"), "--map", "flax-to-torch:params/")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["PATH", "DTYPE", "SHAPE", "SIZE", "VALUE", "FROM"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert rows["l1.weight"] == ["l1.weight", "float32", "[4,", "3]", "48", "B", "params/l1/kernel", "|",
                                 "Transpose(perm=(1,", "0))"]
    assert rows["l1.bias"][-1] == "params/l1/bias" and rows["step"][-1] == "step"
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [
        {"stored": "params/qkv", "target": ["q", "k", "v"], "views": [{"split": {"axis": 0, "parts": 3}}]}]}))
    code, out, err = run_main(capsys, "ls", str(tmp_path / "c"), "--map", str(rules), "--long")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert "[2, 2]" in rows["k"] and rows["k"].endswith("params/qkv | Split(axis=0)[2:4]")
    rules.write_text(json.dumps({"rules": [{"stored": "params/qkv", "target": "half", "dtype": "bfloat16"}]}))
    code, out, err = run_main(capsys, "ls", str(tmp_path / "c"), "--map", str(rules), "--long")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("half "))
    assert "bfloat16" in row and row.endswith("params/qkv | float32 as bfloat16")
    rules.write_text(json.dumps({"rules": [{"stored": "params/qkv", "target": "w", "views": [{"spin": 1}]}]}))
    code, _, err = run_main(capsys, "ls", str(tmp_path / "c"), "--map", str(rules))
    assert code == 2 and "rule 0" in err and "'spin'" in err
    code, _, err = run_main(capsys, "ls", str(tmp_path / "c"), "--map", "no-such-set")
    assert code == 2 and "flax-to-torch, torch-to-flax" in err


def test_ls_missing_directory_is_one_line(tmp_path, capsys):
    code, out, err = run_main(capsys, "ls", str(tmp_path / "nope"))
    assert code == 1
    assert out == ""
    assert err.count("\n") == 1 and "no such directory" in err and "Traceback" not in err


# ---- show ----------------------------------------------------------------------------


def test_show_slices(ck, capsys):
    w = model_tree()["model"]["w"].float().numpy()
    code, out, err = run_main(capsys, "show", ck, "model/w[5:9, :3]")
    assert code == 0, err
    header, *body = out.splitlines()
    assert header == "model/w[5:9, :3]: bfloat16 [4, 3] (printed as float32)"
    with np.printoptions(threshold=1000):
        assert "\n".join(body) == str(w[5:9, :3])

    for text, expected in [("model/w[-1]", w[-1]), ("model/w[..., 0]", w[..., 0]), ("model/w[::-5, 2]", w[::-5, 2])]:
        code, out, _ = run_main(capsys, "show", ck, text)
        assert code == 0
        assert "\n".join(out.splitlines()[1:]) == str(expected)


def test_show_dtypes_and_values(ck, capsys):
    tree = model_tree()
    code, out, _ = run_main(capsys, "show", ck, "model/f8")
    assert code == 0
    assert out.splitlines()[0] == "model/f8: float8_e4m3fn [6] (printed as float32)"
    assert "\n".join(out.splitlines()[1:]) == str(tree["model"]["f8"].float().numpy())

    code, out, err = run_main(capsys, "show", ck, "model/c[1:]")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == "model/c[1:]: complex32 [2] (printed as complex64)"
    assert "\n".join(out.splitlines()[1:]) == str(np.array([1 + 1j, 1 + 2j], dtype=np.complex64))

    code, out, _ = run_main(capsys, "show", ck, "opt/0[1:4]")
    assert out.splitlines() == ["opt/0[1:4]: int64 [3]", "[1 2 3]"]
    code, out, _ = run_main(capsys, "show", ck, "opt/1")
    assert out.splitlines() == ["opt/1: float32 []", "2.5"]
    assert run_main(capsys, "show", ck, "step")[1] == "7\n"
    assert run_main(capsys, "show", ck, "name")[1] == "run-1\n"
    assert run_main(capsys, "show", ck, "lr")[1] == "0.001\n"


def test_show_full_prints_every_element(tmp_path, capsys):
    path = str(tmp_path / "long")
    tsckpt.save(path, {"x": np.arange(3000)})
    _, out, _ = run_main(capsys, "show", path, "x")
    assert "..." in out and "1500" not in out
    _, out, _ = run_main(capsys, "show", path, "x", "--full")
    assert "..." not in out and " 1500 " in out


def test_show_single_leaf_tree(tmp_path, capsys):
    path = str(tmp_path / "lone")
    tsckpt.save(path, torch.arange(4))
    code, out, _ = run_main(capsys, "show", path, "[1:3]")
    assert code == 0 and out.splitlines() == ["%root[1:3]: int64 [2]", "[1 2]"]
    code, out, _ = run_main(capsys, "show", path, "%root[-1]")
    assert code == 0 and out.splitlines()[1] == "3"


@pytest.mark.parametrize(
    "target, words",
    [
        ("model/w[16]", "out of bounds"),
        ("model/w[0, 0, 0]", "too many indices"),
        ("model/w[1:2:0]", "step cannot be zero"),
        ("model/w[x]", "bad index"),
        ("model/w[0", "bad index"),
        ("step[0]", "cannot be indexed"),
        ("model", "leaves below it"),
        ("nope", "not a leaf"),
    ],
)
def test_show_usage_errors(ck, capsys, target, words):
    code, out, err = run_main(capsys, "show", ck, target)
    assert code == 2
    assert out == ""
    assert words in err and err.count("\n") == 1


def test_show_refuses_huge_selection(ck, capsys, monkeypatch):
    import tsckpt._cli as cli

    monkeypatch.setattr(cli, "SHOW_MAX_BYTES", 100)
    code, _, err = run_main(capsys, "show", ck, "model/w")
    assert code == 2 and "smaller slice" in err
    code, out, _ = run_main(capsys, "show", ck, "model/w[:2]")
    assert code == 0 and out.startswith("model/w[:2]: bfloat16 [2, 8]")


# ---- leaf names as users type them -----------------------------------------------------


@pytest.fixture
def named(tmp_path):
    """Leaf paths of every spelling: nested keys, Hugging Face names inside one key, list indices."""
    path = str(tmp_path / "named")
    tsckpt.save(path, {
        "model": {  # as tsckpt.torch.save writes a module's state dict
            "model.layers.0.mlp.weight": torch.arange(4.0),
            "model.layers.0.mlp.bias": torch.zeros(2),
            "model.layers.01.w": torch.ones(1),
        },
        "model.layers.0.norm": torch.full((2,), 3.0),  # a flat safetensors-like name
        "enc": {"layers": [{"w": torch.full((1,), float(i))} for i in range(11)]},
        "a": {"b": {"c": torch.zeros(1)}},
        "a.b": {"c": torch.ones(1)},
    })
    return path


def _listed(capsys, *argv: str) -> list[str]:
    code, out, err = run_main(capsys, "ls", *argv)
    assert code == 0, err
    return [line.split()[0] for line in out.splitlines()[1:-1]]


@pytest.mark.parametrize(
    "prefix, paths",
    [
        ("model.layers.0", ["model.layers.0.norm"]),
        ("model/model.layers.0", ["model/model.layers.0.mlp.bias", "model/model.layers.0.mlp.weight"]),
        ("model.model.layers.0.", ["model/model.layers.0.mlp.bias", "model/model.layers.0.mlp.weight"]),
        ("model/model.layers.0.mlp.weight", ["model/model.layers.0.mlp.weight"]),
        ("model.model.layers.01", ["model/model.layers.01.w"]),
        ("enc.layers.1", ["enc/layers/1/w"]),
        ("enc/layers/1/", ["enc/layers/1/w"]),
        ("a.b", ["a/b/c", "a.b/c"]),
    ],
)
def test_ls_prefix_with_slashes_or_dots(named, capsys, prefix, paths):
    assert _listed(capsys, named, prefix) == paths


def test_ls_prefix_stops_at_component_boundaries(named, capsys):
    code, _, err = run_main(capsys, "ls", named, "model.layers.0.mlp.w")
    assert (code, err) == (2, f"tsckpt ls: error: no leaf at or below 'model.layers.0.mlp.w' in {named}; did you "
                              "mean 'model/model.layers.0.mlp.weight'?\n")
    assert _listed(capsys, named, "enc.layers") == [f"enc/layers/{i}/w" for i in range(11)]


@pytest.mark.parametrize(
    "target, header",
    [
        ("enc.layers.10.w", "enc/layers/10/w: float32 [1]"),
        ("model.model.layers.0.mlp.weight[1:3]", "model/model.layers.0.mlp.weight[1:3]: float32 [2]"),
        ("model/model.layers.01", "model/model.layers.01.w: float32 [1]"),  # the one leaf below it
        ("a.b/c", "a.b/c: float32 [1]"),  # an exact path wins over its other spellings
    ],
)
def test_show_names_a_leaf_with_slashes_or_dots(named, capsys, target, header):
    code, out, err = run_main(capsys, "show", named, target)
    assert code == 0, err
    assert out.splitlines()[0] == header


def test_show_refuses_an_ambiguous_name_listing_candidates(named, capsys):
    code, out, err = run_main(capsys, "show", named, "a/b.c")
    assert (code, out) == (2, "")
    assert err == "tsckpt show: error: 'a/b.c' may name 2 leaves ('a/b/c', 'a.b/c'); give the path of one as ls writes it\n"
    code, out, err = run_main(capsys, "show", named, "model.model.layers.0")
    assert (code, out) == (2, "")
    assert err == (
        "tsckpt show: error: 'model.model.layers.0' is not a leaf; 2 leaves below it "
        "('model/model.layers.0.mlp.bias', 'model/model.layers.0.mlp.weight'); give the full path of one\n"
    )


# ---- verify --------------------------------------------------------------------------


def test_verify_ok(ck, multi, capsys):
    code, out, err = run_main(capsys, "verify", ck)
    assert code == 0, out + err
    assert out.startswith("OK: ") and "all 10 leaves present" in out and "6 arrays" in out and "4 values" in out

    code, out, _ = run_main(capsys, "verify", "-v", multi)
    assert code == 0
    assert "ok    big" in out and "ok    other" in out
    assert len(_files(multi, "big")) > 1  # several shard files, each read
    assert f"from {len(_files(multi, 'big')) + len(_files(multi, 'other'))} stored shards" in out


def test_verify_flipped_byte_names_the_leaf(multi, capsys):
    files = _files(multi, "big")
    _flip(files[-1], 10)  # a data byte of the last shard
    code, out, err = run_main(capsys, "verify", multi)
    assert code == 1
    assert "FAIL  big: checksum mismatch" in out
    assert "other" not in out  # the intact leaf is not blamed
    assert "'big'" in err and "1 of 2 arrays bad" in err


def test_verify_flipped_index_byte(multi, capsys):
    f = _files(multi, "big")[0]
    _flip(f, os.path.getsize(f) - 6)  # inside the shard index at the end of the file
    code, out, _ = run_main(capsys, "verify", multi)
    assert code == 1 and "FAIL  big: checksum mismatch" in out


def test_verify_deleted_and_truncated_chunks(ck, capsys):
    os.remove(_files(ck, "model/b")[0])
    with open(_files(ck, "opt/0")[0], "r+b") as f:
        f.truncate(3)
    code, out, err = run_main(capsys, "verify", ck)
    assert code == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 2
    assert fails[0].startswith("FAIL  model/b: a chunk file is missing")
    assert fails[1].startswith("FAIL  opt/0: ")
    assert "'model/b'" in err and "'opt/0'" in err and "2 of 6 arrays bad" in err


def test_verify_missing_nodes(ck, capsys):
    os.remove(os.path.join(ck, "model", "w", "zarr.json"))
    os.remove(os.path.join(ck, "opt", "zarr.json"))
    code, out, _ = run_main(capsys, "verify", ck)
    assert code == 1
    assert "FAIL  model/w: its zarr.json is missing" in out
    assert "FAIL  group 'opt'" in out


def test_verify_node_that_disagrees(ck, capsys):
    node_path = os.path.join(ck, "model", "b", "zarr.json")
    node = json.load(open(node_path))
    node["shape"] = [9]
    with open(node_path, "w") as f:
        json.dump(node, f)
    code, out, _ = run_main(capsys, "verify", ck)
    assert code == 1 and "FAIL  model/b: its zarr.json disagrees with the root metadata on 'shape'" in out


def test_verify_uncommitted(ck, capsys):
    root = os.path.join(ck, "zarr.json")
    meta = json.load(open(root))
    meta["attributes"]["tsckpt"]["state"] = "pending"
    with open(root, "w") as f:
        json.dump(meta, f)
    code, out, err = run_main(capsys, "verify", ck)
    assert code == 1 and out == ""
    assert "never committed" in err and err.count("\n") == 1


def _damage_record(ck: str, leaf: str, **fields) -> None:
    """Change fields of ``leaf``'s record and rewrite its array node to agree."""
    from tsckpt._ondisk.arrays import array_node
    from tsckpt._ondisk.records import ArrayRecord

    root_path = os.path.join(ck, "zarr.json")
    root = json.load(open(root_path))
    rec = next(a for a in root["attributes"]["tsckpt"]["arrays"] if a["path"] == leaf)
    rec.update(fields)
    with open(root_path, "w") as f:
        json.dump(root, f)
    with open(os.path.join(ck, leaf, "zarr.json"), "w") as f:
        json.dump(array_node(ArrayRecord.from_json(rec)), f)


def test_verify_names_every_bad_leaf_of_the_root_metadata(ck, capsys):
    """A bad record aborted verify with one error; now each bad leaf gets its FAIL line."""
    root_path = os.path.join(ck, "zarr.json")
    root = json.load(open(root_path))
    meta = root["attributes"]["tsckpt"]
    next(a for a in meta["arrays"] if a["path"] == "model/b")["dtype"] = "float128x"
    meta["values"]["step"] = {"type": "int", "value": True}
    with open(root_path, "w") as f:
        json.dump(root, f)
    code, out, err = run_main(capsys, "verify", ck)
    assert code == 1
    assert [line for line in out.splitlines() if line.startswith("FAIL")] == [
        "FAIL  model/b: the record of array 'model/b' in the root metadata is invalid: 'dtype' 'float128x' is not a "
        "dtype this tsckpt reads (written by a newer tsckpt?)",
        "FAIL  step: the value of 'step' in the root metadata is invalid: 'value' must be an integer for type 'int', "
        "found True",
    ]
    assert err == (
        f"tsckpt verify: error: verification failed for {ck}: 1 of 6 arrays bad ('model/b'), 1 other leaf bad ('step')\n"
    )
    for command in (["ls", ck], ["show", ck, "model/w[0]"]):  # the other commands refuse it in one line
        code, out, err = run_main(capsys, *command)
        assert code == 1 and err.count("\n") == 1 and "the record of array 'model/b'" in err


def test_an_unexpected_error_is_one_line_too(ck, capsys, monkeypatch):
    import tsckpt._cli as cli

    def broken(directory, **options):
        raise RuntimeError("something\nunforeseen")

    monkeypatch.setattr(cli, "open_checkpoint", broken)
    code, out, err = run_main(capsys, "ls", ck)
    assert (code, out) == (1, "")
    assert err == "tsckpt ls: error: unexpected RuntimeError: something unforeseen (this is a bug in tsckpt; please report it)\n"


# ---- convert -------------------------------------------------------------------------


def _same_checkpoint(a: str, b: str) -> None:
    ra, rb = tsckpt.open(a), tsckpt.open(b)
    assert list(ra) == list(rb)
    ca, cb = ra.checkpoint, rb.checkpoint
    assert ca.structure == cb.structure
    for p in ra:
        if p in ca.arrays:
            assert ca.arrays[p] == cb.arrays[p]
            x, y = ra[p][...], rb[p][...]
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), p
        else:
            assert ra[p] == rb[p] and type(ra[p]) is type(rb[p])


def test_convert_checkpoint_copy(ck, tmp_path, capsys):
    dst = str(tmp_path / "copy")
    code, out, err = run_main(capsys, "convert", ck, dst)
    assert code == 0, err
    assert out.strip() == f"converted {ck} (tsckpt) -> {dst} (tsckpt): 6 arrays (350 B), 4 values"
    _same_checkpoint(ck, dst)
    restored = tsckpt.restore(dst)
    assert isinstance(restored["opt"], list) and isinstance(restored["opt"][1], np.float32)

    code, _, err = run_main(capsys, "convert", ck, dst)
    assert code == 1 and "--overwrite" in err
    assert run_main(capsys, "convert", ck, dst, "--overwrite")[0] == 0


def test_convert_through_safetensors_round_trip(multi, tmp_path, capsys):
    from safetensors.torch import load_file

    st = str(tmp_path / "model.safetensors")
    back = str(tmp_path / "back")
    assert run_main(capsys, "convert", multi, st)[0] == 0
    tensors = load_file(st)
    assert set(tensors) == {"big", "other"}
    assert torch.equal(tensors["big"], torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32))
    assert run_main(capsys, "convert", st, back)[0] == 0
    assert tsckpt.open(back)["big"][3, 4] == 3 * 32 + 4
    assert torch.equal(tsckpt.open(back)["other"].torch[...], torch.ones(300))


def test_convert_tree_with_values_through_safetensors(tmp_path, capsys):
    src = str(tmp_path / "src")
    tree = model_tree()
    del tree["model"]["c"]  # complex32 has no safetensors dtype
    tsckpt.save(src, tree)
    st = str(tmp_path / "x.safetensors")
    back = str(tmp_path / "back")
    assert run_main(capsys, "convert", src, st)[0] == 0
    assert run_main(capsys, "convert", st, back)[0] == 0
    _same_checkpoint(src, back)  # values, numpy kinds and the structure come back


def test_convert_plain_safetensors(tmp_path, capsys):
    from safetensors.torch import save_file

    st = str(tmp_path / "hf.safetensors")
    weights = {"layers.0.weight": torch.randn(4, 4).to(torch.bfloat16), "layers.0.bias": torch.zeros(4)}
    save_file(weights, st, metadata={"format": "pt"})
    dst = str(tmp_path / "ck")
    code, out, _ = run_main(capsys, "convert", st, dst)
    assert code == 0 and "2 arrays (48 B), 0 values" in out
    back = tsckpt.restore(dst, {k: torch.empty_like(v) for k, v in weights.items()})
    for k, v in weights.items():
        assert torch.equal(back[k], v)


def test_convert_errors(ck, tmp_path, capsys):
    code, _, err = run_main(capsys, "convert", ck, str(tmp_path / "y.safetensors"))
    assert code == 1 and "'model/c'" in err and "complex32" in err
    assert not os.path.exists(tmp_path / "y.safetensors") and not os.path.exists(tmp_path / "y.safetensors.tmp")
    code, _, err = run_main(capsys, "convert", str(tmp_path / "missing.safetensors"), str(tmp_path / "z"))
    assert code == 1 and "no such file" in err
    code, _, err = run_main(capsys, "convert", ck, ck)
    assert code == 2
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    code, _, err = run_main(capsys, "convert", str(garbage), str(tmp_path / "w"))
    assert code == 1 and "not a safetensors file" in err and str(garbage) in err and err.count("\n") == 1


# ---- the real command ----------------------------------------------------------------


@pytest.mark.slow
def test_subprocess_ls_show_verify(ck):
    r = run_cli("ls", ck)
    assert r.returncode == 0, r.stderr
    assert ["model/w", "bfloat16", "[16,", "8]", "256", "B"] in [line.split() for line in r.stdout.splitlines()]
    assert r.stdout.splitlines()[-1].startswith("total 10 leaves")

    r = run_cli("show", ck, "model/b[2:5]")
    assert r.returncode == 0 and r.stdout.splitlines() == ["model/b[2:5]: float32 [3]", "[2. 3. 4.]"]
    assert r.stderr == ""

    r = run_cli("verify", ck)
    assert r.returncode == 0 and r.stdout.startswith("OK: ")


@pytest.mark.slow
def test_subprocess_errors_have_no_traceback(ck, tmp_path):
    os.remove(_files(ck, "model/w")[0])
    r = run_cli("verify", ck)
    assert r.returncode == 1
    assert "FAIL  model/w: a chunk file is missing" in r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1

    r = run_cli("show", ck, "model/w[0")
    assert r.returncode == 2 and "Traceback" not in r.stderr

    r = run_cli("ls", str(tmp_path / "missing"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr

    r = run_cli("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"tsckpt {tsckpt.__version__}"


@pytest.mark.slow
def test_subprocess_on_a_record_far_larger_than_its_files(ck):
    """TensorStore aborted the process (std::bad_alloc) reading a chunk the record said held 4 PB."""
    _damage_record(ck, "model/b", shape=[10**15], shard_shape=[10**15])
    want = "model/b/c.0 holds fewer than the 4000000000000004 bytes that its record's 'shape' [1000000000000000]"
    r = run_cli("verify", ck)
    assert r.returncode == 1 and f"FAIL  model/b: {want}" in r.stdout, r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "1 of 6 arrays bad ('model/b')" in r.stderr
    r = run_cli("show", ck, "model/b[:4]")
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"tsckpt show: error: 'model/b' in {ck}: {want}")


def test_main_help_and_usage(capsys):
    assert main(["--help"]) == 0
    assert "verify" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["show", "only-one-arg"]) == 2


@pytest.mark.slow
def test_examples_demo_runs():
    """The README's first set-up command ends with this demo; it must keep working."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "demo.py")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model/0.weight" in r.stdout and "bfloat16" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("restored ") and "match the saved ones" in r.stdout


def test_ls_and_convert_with_tied_leaves(tmp_path, capsys):
    import torch

    w = torch.arange(12.0).reshape(4, 3)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tsckpt.save(src, {"wte": w, "head": w})
    assert main(["ls", src]) == 0
    out = capsys.readouterr().out
    assert "(tied: stored as head)" in out and "total 2 leaves: 2 arrays (48 B)" in out
    assert main(["convert", src, dst]) == 0
    got = tsckpt.restore(dst)
    np.testing.assert_array_equal(got["wte"], w.numpy())
    np.testing.assert_array_equal(got["head"], w.numpy())


# ---- a CheckpointManager's root --------------------------------------------------------------


def _pending(step_dir, claim: dict) -> None:
    """A step directory whose root is tsckpt's pending one recording ``claim`` (a save under way, or
    one that is over without committing)."""
    from tsckpt._ondisk.records import LAYOUT_PLAIN
    from tsckpt._save.commit import pending_root

    os.makedirs(step_dir)
    with open(os.path.join(step_dir, "zarr.json"), "wb") as f:
        f.write(pending_root(LAYOUT_PLAIN)(claim))


def test_ls_lists_the_steps_of_a_manager_root_without_writing(tmp_path, capsys):
    import time

    run = str(tmp_path / "run")
    m = tsckpt.CheckpointManager(run)
    m.save(100, {"w": np.ones(3)})
    m.save(200, {"w": np.ones(3), "b": np.zeros(2, np.float32)})
    _pending(os.path.join(run, "00000300"), {"id": "a", "host": "elsewhere", "pid": 7, "started": "2025-01-01T00:00:00Z",
                                             "renewed": time.time() + 3600, "lease_s": 60.0})
    _pending(os.path.join(run, "00000400"), {"id": "b", "host": "elsewhere", "pid": 8, "started": "2025-01-01T00:00:00Z",
                                             "renewed": 0.0, "lease_s": 60.0})
    os.makedirs(os.path.join(run, "00000500"))
    (tmp_path / "run" / "00000500" / "data.bin").write_bytes(b"x")
    before = sorted((d, tuple(sorted(fs))) for d, _, fs in os.walk(run))
    code, out, err = run_main(capsys, "ls", run)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "DIRECTORY  STEP  STATE     LEAVES  SIZE  NOTE",
        "00000100   100   complete  1       24 B",
        "00000200   200   complete  2       32 B",
        "00000300   300   saving                  a save is under way (pid 7 on host 'elsewhere', started "
        "2025-01-01T00:00:00Z, lease renewed 0 s ago)",
        "00000400   400   partial                 a save that ended without committing (pid 8 on host 'elsewhere', "
        "started 2025-01-01T00:00:00Z); a CheckpointManager on this root removes it",
        "00000500   500   other                   not a checkpoint tsckpt wrote (no tsckpt root zarr.json: another "
        "library's checkpoint, or other data); a CheckpointManager leaves it alone",
        f"{run}: a CheckpointManager root, 5 step directories: 2 complete (latest: tsckpt ls {run}/00000200), "
        "1 saving, 1 partial, 1 other",
    ]
    assert sorted((d, tuple(sorted(fs))) for d, _, fs in os.walk(run)) == before  # nothing written or removed
    for argv in (["ls", run, "w"], ["show", run, "w"], ["verify", run]):
        code, out, err = run_main(capsys, *argv)
        assert code == 2 and out == ""
        assert err == (
            f"tsckpt {argv[0]}: error: {run} is a CheckpointManager root (2 complete steps, the latest 200), not one "
            f"checkpoint; give a step's directory, e.g. tsckpt {argv[0]} {run}/00000200{' w' if len(argv) > 2 else ''}\n"
        ), err


# ---- did you mean ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, error",
    [
        (["ls", "{d}", "enc.layer"], "no leaf at or below 'enc.layer' in {d}; did you mean 'enc/layers'?"),
        (["ls", "{d}", "model/model.layers.0.mlp.wieght"],
         "no leaf at or below 'model/model.layers.0.mlp.wieght' in {d}; did you mean "
         "'model/model.layers.0.mlp.weight'?"),
        (["show", "{d}", "enc.layers.3.v[0]"],
         "'enc.layers.3.v' is not a leaf of {d}; did you mean 'enc/layers/3/w'?"),
        (["show", "{d}", "model.layers.0.nrom"],
         "'model.layers.0.nrom' is not a leaf of {d}; did you mean 'model.layers.0.norm'?"),
        (["show", "{d}", "mlp.weight"], "'mlp.weight' is not a leaf of {d}; did you mean "
         "'model/model.layers.0.mlp.weight'?"),
        (["ls", "{d}", "layers.1"], "no leaf at or below 'layers.1' in {d}; did you mean 'enc/layers/1' or "
         "'enc/layers/10'?"),
        (["ls", "{d}", "zzz"], "no leaf at or below 'zzz' in {d}; `tsckpt ls {d}` lists every leaf"),
        (["show", "{d}", "zzz"], "'zzz' is not a leaf of {d}; `tsckpt ls {d}` lists every leaf"),
    ],
)
def test_a_name_that_matches_nothing_suggests_the_closest_leaves(named, capsys, argv, error):
    code, out, err = run_main(capsys, *[a.format(d=named) for a in argv])
    assert (code, out) == (2, "")
    assert err == f"tsckpt {argv[0]}: error: {error.format(d=named)}\n"
