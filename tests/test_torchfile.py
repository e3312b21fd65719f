"""torch.save files read as a tsckpt source tree (tsckpt._formats.torchfile)."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import tsckpt
from tsckpt._errors import CheckpointNotFoundError, CorruptCheckpointError, LeafTypeError, NotACheckpointError
from tsckpt._formats.torchfile import read_torch_file
from tests.strategies import assert_same


class Pickled:  # a class weights_only=True refuses to unpickle
    pass


def _training_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    return {
        "model": model.state_dict(),
        "opt": {
            "state": {0: {"exp_avg": torch.randn(3, 4), "step": torch.tensor(5.0)}},
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.999), "name": None}],
        },
        "step": 7,
        "scale": torch.tensor(2**16, dtype=torch.int64),
    }


def test_training_state_reads_saves_and_restores_exactly(tmp_path):
    state = _training_state()
    src = str(tmp_path / "state.pt")
    torch.save(state, src)
    tree = read_torch_file(src)
    assert_same(tree, state)
    assert tree["model"]["0.weight"].dtype == torch.bfloat16
    assert list(tree["opt"]["state"]) == [0]  # int keys stay int

    d = str(tmp_path / "ck")
    tsckpt.save(d, tree, max_inflight_bytes=1 << 10)
    out = tsckpt.restore(d, as_saved=True)
    assert_same(out, state)  # containers too: the state_dict comes back an OrderedDict


def test_zip_files_are_memory_mapped(tmp_path):
    src = str(tmp_path / "w.pt")
    torch.save({"w": torch.arange(1000.0)}, src)
    w = read_torch_file(src)["w"]
    assert torch.equal(w, torch.arange(1000.0))
    assert not w.untyped_storage().resizable()  # torch.load's heap storages are resizable
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            assert src in f.read()


def test_tied_tensors_share_memory_and_are_stored_once(tmp_path):
    w = torch.randn(6, 4)
    src = str(tmp_path / "tied.pt")
    torch.save({"emb": w, "head": w, "same_view": w[:], "row": w[2], "other": w.clone()}, src)
    tree = read_torch_file(src)
    assert tree["emb"].data_ptr() == tree["head"].data_ptr() == tree["same_view"].data_ptr()
    assert tree["row"].untyped_storage().data_ptr() == tree["emb"].untyped_storage().data_ptr()
    assert tree["other"].data_ptr() != tree["emb"].data_ptr()

    d = str(tmp_path / "ck")
    tsckpt.save(d, tree)
    aliases = tsckpt.open(d).checkpoint.aliases
    assert aliases == {"head": "emb", "same_view": "emb"}
    assert sorted(tsckpt.open(d).checkpoint.arrays) == ["emb", "other", "row"]
    out = tsckpt.restore(d, as_saved=True)
    assert torch.equal(out["head"], w) and torch.equal(out["row"], w[2])


def test_legacy_format_reads_without_mmap(tmp_path):
    state = {"w": torch.randn(3, 2, dtype=torch.bfloat16), "n": [1, 2.5, "x"], "t": torch.arange(4)}
    state["tied"] = state["t"]
    src = str(tmp_path / "legacy.pt")
    torch.save(state, src, _use_new_zipfile_serialization=False)
    tree = read_torch_file(src)
    assert_same(tree, state)
    assert tree["tied"].data_ptr() == tree["t"].data_ptr()


def test_sizes_become_tuples_and_single_tensors_read(tmp_path):
    src = str(tmp_path / "misc.pt")
    torch.save({"shape": torch.Size([2, 3]), "od": collections.OrderedDict(b=1, a=2)}, src)
    tree = read_torch_file(src)
    assert tree["shape"] == (2, 3) and type(tree["shape"]) is tuple
    assert list(tree["od"].items()) == [("b", 1), ("a", 2)]
    one = str(tmp_path / "one.pt")
    torch.save(torch.ones(2), one)
    assert torch.equal(read_torch_file(one), torch.ones(2))


def test_leaf_that_is_not_a_tensor_or_plain_value_is_named(tmp_path):
    src = str(tmp_path / "set.pt")
    torch.save({"cfg": {"tags": {1, 2}}}, src)
    with pytest.raises(LeafTypeError) as e:
        read_torch_file(src)
    assert src in str(e.value) and "'cfg/tags'" in str(e.value) and "set" in str(e.value)


def test_missing_file(tmp_path):
    src = str(tmp_path / "nope.pt")
    with pytest.raises(CheckpointNotFoundError, match="no such file") as e:
        read_torch_file(src)
    assert src in str(e.value)


@pytest.mark.parametrize("content", [b"hello, world\n", b""], ids=["text", "empty"])
def test_not_a_torch_file(tmp_path, content):
    src = str(tmp_path / "notes.pt")
    with open(src, "wb") as f:
        f.write(content)
    with pytest.raises(NotACheckpointError, match="not a torch.save file") as e:
        read_torch_file(src)
    assert src in str(e.value) and "\n" not in str(e.value)


def test_safetensors_file_is_not_a_torch_file(tmp_path):
    from safetensors.torch import save_file

    src = str(tmp_path / "weights.bin")
    save_file({"w": torch.ones(2)}, src)
    with pytest.raises(NotACheckpointError, match="safetensors file, not a torch.save file") as e:
        read_torch_file(src)
    assert src in str(e.value)


def test_file_that_needs_full_unpickling_is_refused(tmp_path):
    src = str(tmp_path / "obj.pt")
    torch.save({"w": torch.ones(2), "obj": Pickled()}, src)
    with pytest.raises(NotACheckpointError) as e:
        read_torch_file(src)
    msg = str(e.value)
    assert src in msg and "\n" not in msg
    assert "weights_only=True" in msg and "can run code" in msg and "state_dict" in msg
    assert "Pickled" in msg  # names what was refused


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_truncated_file_is_corrupt(tmp_path, legacy):
    src = str(tmp_path / "cut.pt")
    torch.save({"w": torch.randn(64, 64)}, src, _use_new_zipfile_serialization=not legacy)
    with open(src, "rb") as f:
        data = f.read()
    with open(src, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt") as e:
        read_torch_file(src)
    assert src in str(e.value) and "\n" not in str(e.value)


def test_damaged_pickle_is_corrupt_not_refused(tmp_path):
    src = str(tmp_path / "bad.pt")
    with open(src, "wb") as f:
        f.write(b"\x80\x02" + b"\xff" * 32)  # a pickle header, then opcodes that do not exist
    with pytest.raises(CorruptCheckpointError, match="corrupt torch.save file") as e:
        read_torch_file(src)
    assert src in str(e.value) and "\n" not in str(e.value)


def test_directory_is_not_a_torch_file(tmp_path):
    with pytest.raises(NotACheckpointError, match="is a directory"):
        read_torch_file(str(tmp_path))


class _Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_only_weights_only_loads_so_a_payload_never_runs(tmp_path, monkeypatch, legacy):
    src = str(tmp_path / "evil.pt")
    marker = tmp_path / "ran"
    torch.save({"w": torch.ones(2), "x": _Payload(str(marker))}, src, _use_new_zipfile_serialization=not legacy)
    loads = []
    real = torch.load

    def recorded(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recorded)
    with pytest.raises(NotACheckpointError, match="weights_only=True"):
        tsckpt.convert(src, str(tmp_path / "out"))
    assert loads == [True] and not marker.exists() and not (tmp_path / "out").exists()


def test_an_expanded_view_is_refused_before_anything_is_written(tmp_path, capsys):
    """1 stored float viewed as 2**28 (stride 0): a file of a few KB that would convert into 1 GiB."""
    src = str(tmp_path / "expand.pt")
    torch.save({"w": torch.ones(1).expand(2**28)}, src)
    assert os.path.getsize(src) < 8 << 10
    with pytest.raises(LeafTypeError) as e:
        read_torch_file(src)
    assert str(e.value) == (
        f"{src}: leaf 'w': its 268435456 elements [268435456] (strides [0]) view a storage of 4 bytes, so written "
        "out they would take 1073741824: a view with stride 0 or overlapping strides (e.g. from expand()) is "
        "refused; save tensor.clone() in the source instead"
    )
    from tsckpt._cli import main

    assert main(["convert", src, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "view a storage of 4 bytes" in err and not (tmp_path / "out").exists()


def test_views_within_their_storage_are_read(tmp_path):
    """An expand that adds a dimension of 1 (HF's position_ids), or a strided slice, needs no
    more bytes than its storage holds."""
    src = str(tmp_path / "views.pt")
    state = {"position_ids": torch.arange(512).expand((1, -1)), "every_other": torch.arange(8.0)[::2]}
    torch.save(state, src)
    got = read_torch_file(src)
    assert torch.equal(got["position_ids"], state["position_ids"]) and torch.equal(got["every_other"], state["every_other"])


# ---- a Hugging Face directory of torch.save shards (pytorch_model-*.bin and their index) ----------


@pytest.fixture
def sharded_bin(tmp_path):
    """A tiny GPT-2 as save_pretrained(safe_serialization=False) shards it: pytorch_model-0000N-of-0000M.bin
    files and pytorch_model.bin.index.json."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    d = tmp_path / "bin"
    model.save_pretrained(d, safe_serialization=False, max_shard_size="1KB")
    assert (d / "pytorch_model.bin.index.json").is_file() and len(list(d.glob("pytorch_model-*.bin"))) > 2
    return str(d), model


def test_a_sharded_pytorch_model_bin_directory_is_read_through_its_index(sharded_bin, tmp_path, capsys):
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM

    from tsckpt._cli import main

    d, model = sharded_bin
    state = model.state_dict()
    names = sorted(json.loads(open(os.path.join(d, "pytorch_model.bin.index.json")).read())["weight_map"])
    reader = tsckpt.open(d)
    assert reader.checkpoint.format == "torch" and sorted(reader) == names == sorted(state)
    for name in names:
        np.testing.assert_array_equal(reader[name][...], state[name].numpy())
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    out = tsckpt.restore(d, target)
    assert all(torch.equal(out[k], state[k]) for k in state)
    # into a Hugging Face safetensors directory transformers loads: the same logits
    hf = str(tmp_path / "hf")
    r = tsckpt.convert(d, hf, to_format="safetensors", copy_from=d)
    assert r.src_format == "torch" and r.n_tied == 1  # lm_head.weight is the embedding, in one shard
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits, model(ids).logits)
    for argv in (["ls", d], ["verify", d], ["convert", d, str(tmp_path / "ck"), "--from", "torch"]):
        code = main(argv)
        assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ["transformer.h.1.mlp.c_proj.weight", "float32", "[32,", "8]"] in [line.split()[:4] for line in out.splitlines()]
    assert "OK: " in out and "(tied: stored as " in out
    back = tsckpt.restore(str(tmp_path / "ck"))
    assert all(torch.equal(torch.as_tensor(back[k]), state[k]) for k in state)


def test_a_sharded_bin_index_that_lies_is_named(sharded_bin, capsys):
    import json

    from tsckpt._cli import main

    d, _ = sharded_bin
    index_file = os.path.join(d, "pytorch_model.bin.index.json")
    index = json.loads(open(index_file).read())
    first = index["weight_map"]["transformer.wte.weight"]
    index["weight_map"]["ghost"] = first
    with open(index_file, "w") as f:
        json.dump(index, f)
    with pytest.raises(CorruptCheckpointError) as e:
        tsckpt.open(d)
    assert str(e.value) == (
        f"{os.path.join(d, first)}: holds no tensor 'ghost', but pytorch_model.bin.index.json maps it there"
    )
    del index["weight_map"]["ghost"]
    index["weight_map"]["transformer.wte.weight"] = "pytorch_model-99999-of-99999.bin"
    with open(index_file, "w") as f:
        json.dump(index, f)
    assert main(["ls", d]) == 1
    assert capsys.readouterr().err == (
        f"tsckpt ls: error: {os.path.join(d, 'pytorch_model-99999-of-99999.bin')}: missing, but "
        "pytorch_model.bin.index.json maps 'transformer.wte.weight' to it\n"
    )
    with open(index_file, "w") as f:
        f.write("{oops")
    with pytest.raises(CorruptCheckpointError, match=r"pytorch_model.bin.index.json: not a valid index: it is not JSON"):
        tsckpt.open(d)


def test_a_directory_of_one_pytorch_model_bin_is_read(tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    torch.save({"w": torch.arange(3.0)}, d / "pytorch_model.bin")
    assert tsckpt.restore(str(d), {"w": torch.zeros(3)})["w"].tolist() == [0.0, 1.0, 2.0]
