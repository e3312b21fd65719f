"""convert(): every source format into tsckpt and safetensors, options, ties, bad input."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tsckpt
from tsckpt import CheckpointNotFoundError, NotACheckpointError
from tsckpt._cli import main
from tsckpt._convert import open_source
from tsckpt._formats.sources import detect

from .dist_helpers import run_ranks


def model_state() -> dict:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(32, 8, generator=g)
    return {
        "model": {
            "embed.weight": emb,
            "lm_head.weight": emb,  # tied
            "layers.0.w": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "layers.0.b": torch.zeros(8),
            "count": torch.arange(3),
        },
        "step": 12,
    }


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture
def ck(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save(path, model_state())
    return path


# ---- formats ---------------------------------------------------------------------------------


def test_detect(tmp_path, ck):
    st = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(2)}, str(st))
    (tmp_path / "noext").write_bytes(st.read_bytes())
    torch.save({"a": torch.ones(2)}, tmp_path / "w.pt")
    torch.save({"a": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(st, hf / "model.safetensors")
    assert [detect(str(p)) for p in (ck, st, tmp_path / "noext", tmp_path / "w.pt", tmp_path / "old.pt", hf)] == [
        "tsckpt", "safetensors", "safetensors", "torch", "torch", "safetensors"]
    (tmp_path / "text").write_text("hello world, not a checkpoint")
    (tmp_path / "empty").mkdir()
    assert [detect(str(tmp_path / p)) for p in ("text", "empty", "missing")] == [None, None, None]
    with pytest.raises(NotACheckpointError, match=r"text: cannot tell the file's format .* pass it with --from"):
        open_source(str(tmp_path / "text"))
    with pytest.raises(NotACheckpointError, match="cannot tell what this directory holds"):
        open_source(str(tmp_path / "empty"))
    with pytest.raises(CheckpointNotFoundError):
        open_source(str(tmp_path / "missing"))


def test_tsckpt_to_hf_directory_and_back(ck, tmp_path):
    hf = str(tmp_path / "hf")
    r = tsckpt.convert(ck, hf, to_format="safetensors", subtree="model", add_prefix="model.", max_shard_size="600B")
    assert (r.src_format, r.dst_format, r.n_arrays, r.n_tied, r.n_values) == ("tsckpt", "safetensors", 4, 1, 0)
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    assert index["metadata"]["total_size"] == r.nbytes == 32 * 8 * 4 + 8 * 8 * 2 + 8 * 4 + 3 * 8
    # the tied head is written once, under the name tsckpt stores it by, and the index says so
    assert sorted(index["weight_map"]) == ["model.count", "model.embed.weight", "model.layers.0.b", "model.layers.0.w"]
    assert index["metadata"]["tsckpt"]["aliases"] == {"model.lm_head.weight": "model.embed.weight"}
    loaded = {}
    for f in set(index["weight_map"].values()):
        loaded.update(load_file(os.path.join(hf, f)))
    src = model_state()["model"]
    for name in index["weight_map"]:
        assert equal(loaded[name], src[name[len("model."):]]), name
    back = str(tmp_path / "back")
    r2 = tsckpt.convert(hf, back, strip_prefix="model.")
    assert (r2.src_format, r2.n_arrays, r2.n_tied, r2.nbytes) == ("safetensors", 4, 1, r.nbytes)
    got = tsckpt.restore(back, as_saved=True)
    assert sorted(got) == sorted(src) and all(equal(got[k], src[k]) for k in src)
    assert tsckpt.open(back).checkpoint.aliases == {"lm_head.weight": "embed.weight"}


def test_plain_hf_directory_imports_as_flat_dict(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    a = {"model.embed_tokens.weight": torch.randn(6, 4), "lm_head.weight": torch.randn(6, 4)}
    b = {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    save_file(a, str(hf / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(b, str(hf / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 200}, "weight_map": weight_map}))
    dst = str(tmp_path / "ck")
    r = tsckpt.convert(str(hf), dst, add_prefix="model/")
    assert (r.n_arrays, r.n_tied) == (3, 0)
    got = tsckpt.restore(dst, as_saved=True)
    assert list(got) == ["model"] and all(equal(got["model"][k], v) for k, v in {**a, **b}.items())


def test_dtype_cast_on_the_way_out(ck, tmp_path):
    out = str(tmp_path / "m.safetensors")
    r = tsckpt.convert(ck, out, subtree="model", dtype="bfloat16")
    got = load_file(out)
    src = model_state()["model"]
    assert got["embed.weight"].dtype == torch.bfloat16 and equal(got["embed.weight"], src["embed.weight"].bfloat16())
    assert got["count"].dtype == torch.int64  # integers are never cast
    assert r.nbytes == 32 * 8 * 2 + 8 * 8 * 2 + 8 * 2 + 3 * 8
    with pytest.raises(ValueError, match="expected a floating-point torch dtype"):
        tsckpt.convert(ck, str(tmp_path / "x.safetensors"), dtype="int8")


def test_subtree_and_prefix_errors(ck, tmp_path):
    with pytest.raises(KeyError, match="no subtree 'nope'"):
        tsckpt.convert(ck, str(tmp_path / "a"), subtree="nope")
    with pytest.raises(ValueError, match=r"strip_prefix 'layers\.': 3 leaves do not start with it"):
        tsckpt.convert(ck, str(tmp_path / "a"), subtree="model", strip_prefix="layers.")
    with pytest.raises(ValueError, match=r"max_shard_size \(--max-shard-size\) applies to a Hugging Face directory"):
        tsckpt.convert(ck, str(tmp_path / "a.safetensors"), max_shard_size="1GB")
    with pytest.raises(ValueError, match="expected a byte count"):
        tsckpt.convert(ck, str(tmp_path / "a"), to_format="safetensors", max_shard_size="lots")
    assert os.listdir(tmp_path) == ["ck"]


def test_torch_save_file_keeps_ties_and_nesting(tmp_path):
    state = model_state()
    state["opt"] = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.5, "params": [0]}]}
    torch.save(state, tmp_path / "x.pt")
    dst = str(tmp_path / "ck")
    r = tsckpt.convert(str(tmp_path / "x.pt"), dst)
    assert (r.src_format, r.n_tied) == ("torch", 1)
    got = tsckpt.restore(dst, as_saved=True)
    assert got["step"] == 12 and got["opt"]["param_groups"] == [{"lr": 0.5, "params": [0]}]
    assert equal(got["opt"]["state"][0]["exp_avg"], torch.ones(3))
    assert all(equal(got["model"][k], v) for k, v in state["model"].items())
    assert tsckpt.open(dst).checkpoint.aliases == {"model/lm_head.weight": "model/embed.weight"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = model_state()
    del state["model"]["lm_head.weight"]
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dst = str(tmp_path / "ck")
    r = tsckpt.convert(str(tmp_path / "dcp"), dst, allow_pickle=True)
    assert r.src_format == "dcp" and r.n_values == 1
    got = tsckpt.restore(dst, as_saved=True)
    assert got["step"] == 12 and all(equal(got["model"][k], v) for k, v in state["model"].items())


def _save_sharded(rank: int, world: int, directory: str) -> None:
    full = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    rows = 64 // world
    local = full[rank * rows:(rank + 1) * rows].clone()
    tsckpt.save(directory, {"w": tsckpt.ShardedArray(local, (64, 4), (rank * rows, 0)), "step": 3})


@pytest.mark.slow
def test_checkpoint_of_four_ranks_exports_without_a_process_group(tmp_path, small_chunks):
    d = str(tmp_path / "ck")
    run_ranks(_save_sharded, 4, d)
    assert tsckpt.open(d).checkpoint.raw["world_size"] == 4
    out = str(tmp_path / "w.safetensors")
    tsckpt.convert(d, out)
    assert equal(load_file(out)["w"], torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4))


def test_progress_bar(ck, tmp_path, capsys, monkeypatch):
    import tqdm

    closed = []

    class Recording(tqdm.tqdm):
        def close(self):
            closed.append((self.n, self.total, self.unit))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    r = tsckpt.convert(ck, str(tmp_path / "a"), progress=True)
    assert closed[0] == (r.nbytes, r.nbytes, "B")  # every byte read once, tied leaves once
    assert "convert:" in capsys.readouterr().err
    tsckpt.convert(ck, str(tmp_path / "b"), progress=False)
    assert capsys.readouterr().err == "" and set(closed) == {(r.nbytes, r.nbytes, "B")}


# ---- bad input through the command line: one line, exit 1, nothing left behind -------------


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def test_corrupt_chunk_mid_conversion_removes_partial_output(ck, tmp_path, capsys):
    chunk = os.path.join(ck, "model", "layers.0.w", "c.0.0")
    data = bytearray(open(chunk, "rb").read())
    data[3] ^= 0xFF
    open(chunk, "wb").write(bytes(data))
    for dst in (str(tmp_path / "out"), str(tmp_path / "out.safetensors")):
        code, err = _cli(capsys, "convert", ck, dst)
        assert code == 1 and "'model/layers.0.w'" in err and "checksum mismatch" in err and err.count("\n") == 1
        assert not os.path.exists(dst)
    hf = str(tmp_path / "hf")
    code, err = _cli(capsys, "convert", ck, hf, "--to", "safetensors", "--subtree", "model", "--max-shard-size", "1KB")
    assert code == 1 and not os.path.exists(hf)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_bad_sources_through_the_cli(tmp_path, capsys):
    save_file({"a": torch.ones(64)}, str(tmp_path / "good.safetensors"))
    whole = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:-10])
    (tmp_path / "text.txt").write_text("just text")
    torch.save({"a": torch.ones(2)}, tmp_path / "w.pt")
    cases = [
        (["convert", str(tmp_path / "cut.safetensors"), str(tmp_path / "o1")], "cut.safetensors: truncated"),
        (["convert", str(tmp_path / "text.txt"), str(tmp_path / "o2")], "text.txt: cannot tell the file's format"),
        (["convert", str(tmp_path / "w.pt"), str(tmp_path / "o3"), "--from", "safetensors"],
         "w.pt: not a safetensors file"),
        (["convert", str(tmp_path / "good.safetensors"), str(tmp_path / "o4"), "--from", "torch"], "good.safetensors"),
        (["convert", str(tmp_path / "good.safetensors"), str(tmp_path / "o5"), "--from", "dcp"], "good.safetensors"),
    ]
    for argv, words in cases:
        code, err = _cli(capsys, *argv)
        assert code == 1 and words in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
        assert not os.path.exists(argv[2])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_missing_file_through_the_cli(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (data,) = [f for f in os.listdir(tmp_path / "dcp") if f.endswith(".distcp")]
    os.remove(tmp_path / "dcp" / data)
    code, err = _cli(capsys, "convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--allow-pickle")
    assert code == 1 and data in err and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "out")


def test_cli_convert_options_and_summary(ck, tmp_path, capsys):
    hf = str(tmp_path / "hf")
    code = main(["convert", ck, hf, "--to", "safetensors", "--subtree", "model", "--max-shard-size", "600B",
                 "--dtype", "float16"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.strip() == (f"converted {ck} (tsckpt) -> {hf} (safetensors): 4 arrays (680 B) in 3 files, "
                           "0 values, 1 tied leaf")
    assert main(["convert", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "pickle" in help_text and "trusted source" in help_text and "--max-shard-size" in help_text


def test_numpy_and_values_survive_safetensors_round_trip(tmp_path):
    tree = {"a": np.arange(6, dtype=np.int32).reshape(2, 3), "s": np.float32(1.5), "name": "x", "n": None,
            "t": (1, torch.ones(2))}
    src, st, back = str(tmp_path / "src"), str(tmp_path / "x.safetensors"), str(tmp_path / "back")
    tsckpt.save(src, tree)
    tsckpt.convert(src, st)
    tsckpt.convert(st, back)
    got = tsckpt.restore(back, as_saved=True)
    assert isinstance(got["a"], np.ndarray) and np.array_equal(got["a"], tree["a"])
    assert isinstance(got["s"], np.float32) and got["s"] == 1.5
    assert got["name"] == "x" and got["n"] is None and isinstance(got["t"], tuple) and got["t"][0] == 1
    assert equal(got["t"][1], torch.ones(2))




def test_failed_convert_keeps_what_was_there_before(ck, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x0f\x00\x00\x00\x00\x00\x00\x00{not json}     ")
    with pytest.raises(tsckpt.CorruptCheckpointError, match="bad.safetensors: its header is not valid JSON"):
        tsckpt.convert(str(bad), str(other), overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(tsckpt.CheckpointExistsError):
        tsckpt.convert(ck, str(other))
    assert os.listdir(other) == ["notes.txt"]


def test_max_shard_size_error_says_what_the_destination_is(ck, tmp_path, capsys):
    out, one = str(tmp_path / "out"), str(tmp_path / "one.safetensors")
    code, err = _cli(capsys, "convert", ck, out, "--max-shard-size", "1GB")
    assert code == 2 and err == (
        "tsckpt convert: error: max_shard_size (--max-shard-size) applies to a Hugging Face directory destination "
        f"(--to safetensors); {out} is to be a tsckpt checkpoint, whose shard files max_inflight_bytes "
        "(--max-inflight-bytes) bounds\n"
    )
    code, err = _cli(capsys, "convert", ck, one, "--max-shard-size", "1GB")
    assert code == 2 and err == (
        "tsckpt convert: error: max_shard_size (--max-shard-size) applies to a Hugging Face directory destination "
        f"(--to safetensors); {one} is to be one .safetensors file: give a directory path to write shards\n"
    )
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_convert_help_says_it_writes_tsckpt_or_safetensors_only(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("    convert "):].split("\n\n")[0]  # the command's line, wrapped
    assert " ".join(block.split()) == (
        "convert write a checkpoint of any format as tsckpt or safetensors (reads tsckpt, safetensors, torch.save, "
        "DCP and Orbax)"
    )
    assert main(["convert", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "DST is a tsckpt checkpoint (the default) or safetensors" in text
    assert "convert writes no torch.save, DCP or Orbax checkpoint" in text


def test_mapping_writes_the_target_leaves(tmp_path):
    """A Flax-layout checkpoint converted through flax_to_torch is a torch state dict's
    safetensors; the same through the CLI's --map; and back through torch-to-flax."""
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((5, 3)).astype(np.float32)
    tsckpt.save(tmp_path / "flax", {"params": {"fc": {"kernel": kernel, "bias": np.ones(3, np.float32)}}, "step": 2})
    report = tsckpt.convert(tmp_path / "flax", tmp_path / "m.safetensors",
                            mapping=tsckpt.mappings.flax_to_torch(stored_prefix="params/"))
    assert report.n_arrays == 2
    out = load_file(str(tmp_path / "m.safetensors"))
    assert set(out) == {"fc.weight", "fc.bias"} and torch.equal(out["fc.weight"], torch.from_numpy(kernel.T.copy()))
    assert main(["convert", str(tmp_path / "flax"), str(tmp_path / "cli"), "--map", "flax-to-torch:params/"]) == 0
    assert tsckpt.open(tmp_path / "cli")["fc.weight"].shape == (3, 5)
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "back"), "--map", "torch-to-flax"]) == 0
    np.testing.assert_array_equal(tsckpt.open(tmp_path / "back")["fc/kernel"][...], kernel)


def convert_on_rank_0_alone(rank: int, world: int, root: str) -> list[float] | None:
    """Every rank saves; then rank 0 alone converts it into a tsckpt checkpoint (as jobs export
    from rank 0) while rank 1 goes on; both meet at a barrier after. What rank 0 converted."""
    import torch.distributed as dist

    tsckpt.save(os.path.join(root, "a"), {"w": torch.arange(4.0)})
    out = None
    if rank == 0:
        tsckpt.convert(os.path.join(root, "a"), os.path.join(root, "converted"))
        out = tsckpt.open(os.path.join(root, "converted"))["w"][:].tolist()  # offline: no other rank asked
    dist.barrier()
    return out


@pytest.mark.slow
def test_convert_on_one_rank_of_a_distributed_job_saves_alone(tmp_path):
    """convert is one process's verb: under torch.distributed it waited in a collective (the
    save's group) for ranks that never joined, until the 10-minute timeout."""
    from tests.dist_helpers import run_ranks

    assert run_ranks(convert_on_rank_0_alone, 2, str(tmp_path), timeout=120) == [[0.0, 1.0, 2.0, 3.0], None]
