"""The read verbs on every format: safetensors files, Hugging Face directories, torch.save
files, DCP directories (and tsckpt), read lazily region by region, ties by memory, and
DTensor targets reading only their byte ranges."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import tsckpt
from tests.dist_helpers import run_ranks
from tsckpt import NotACheckpointError, StructureMismatchError
from tsckpt._cli import main
from tsckpt._formats import safetensors as st

STATE = {
    "embed.weight": torch.arange(48, dtype=torch.float32).reshape(12, 4),
    "proj.weight": torch.arange(35, dtype=torch.bfloat16).reshape(5, 7),
    "norm.bias": torch.linspace(-1, 1, 6, dtype=torch.float16),
    "count": torch.tensor(7, dtype=torch.int64),
}


def _write(fmt: str, where: Any) -> str:
    """STATE saved as ``fmt`` under ``where``; the path the read verbs are given."""
    if fmt == "safetensors":
        save_file(STATE, str(where / "m.safetensors"))
        return str(where / "m.safetensors")
    if fmt == "hf":  # sharded: two files and the index transformers writes
        d = where / "hf"
        d.mkdir()
        names = sorted(STATE)
        files = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for fname, keys in files.items():
            save_file({k: STATE[k] for k in keys}, str(d / fname))
        index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
        (d / st.INDEX_NAME).write_text(json.dumps(index))
        return str(d)
    if fmt == "torch":
        torch.save(STATE, where / "m.pt")
        return str(where / "m.pt")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled"
        dcp.save(dict(STATE), checkpoint_id=str(where / "dcp"), no_dist=True)
    return str(where / "dcp")


FORMATS = {"safetensors": "safetensors", "hf": "safetensors", "torch": "torch", "dcp": "dcp"}


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_every_read_verb_reads_every_format(tmp_path, kind, capsys):
    src = _write(kind, tmp_path)
    pickle = {"allow_pickle": True} if kind == "dcp" else {}
    md = tsckpt.metadata(src, **pickle)
    assert {k: (m.shape, m.dtype) for k, m in md.items()} == {
        "embed.weight": ((12, 4), "float32"), "proj.weight": ((5, 7), "bfloat16"),
        "norm.bias": ((6,), "float16"), "count": ((), "int64"),
    }
    reader = tsckpt.open(src, **pickle)
    np.testing.assert_array_equal(reader["embed.weight"][3:5, 1:3], STATE["embed.weight"].numpy()[3:5, 1:3])
    assert torch.equal(reader["proj.weight"].torch[1:3, 2:], STATE["proj.weight"][1:3, 2:])
    target = {k: torch.zeros_like(v) for k, v in STATE.items()}
    out = tsckpt.restore(src, target, **pickle)
    assert all(torch.equal(out[k], v) and out[k].dtype == v.dtype for k, v in STATE.items())
    saved = tsckpt.restore(src, as_saved=True, **pickle)
    assert all(torch.equal(saved[k], v) for k, v in STATE.items())
    report = tsckpt.verify(src, **pickle)
    assert report.ok and report.n_arrays == 4 and report.bytes_read == sum(v.nbytes for v in STATE.values())
    flags = ["--allow-pickle"] if kind == "dcp" else []
    assert main(["ls", src, *flags]) == 0
    listing = capsys.readouterr().out
    assert "proj.weight   bfloat16  [5, 7]   70 B" in listing and "total 4 leaves: 4 arrays" in listing
    assert main(["show", src, "embed.weight[2, 1:3]", *flags]) == 0
    assert capsys.readouterr().out == "embed.weight[2, 1:3]: float32 [2]\n[ 9. 10.]\n"
    assert main(["verify", src, *flags]) == 0


def test_format_forces_the_reader_and_is_checked(tmp_path):
    src = _write("safetensors", tmp_path)
    assert tsckpt.metadata(src, format="safetensors")["count"].shape == ()
    with pytest.raises(NotACheckpointError, match=r"m.safetensors.*not a torch.save file|m.safetensors: is a safetensors"):
        tsckpt.open(src, format="torch")
    with pytest.raises(ValueError, match=r"format must be None \(detected\) or one of tsckpt, safetensors, torch"):
        tsckpt.restore(src, format="pickle")


def test_dcp_is_read_only_with_allow_pickle(tmp_path, capsys):
    src = _write("dcp", tmp_path)
    for read in (tsckpt.open, tsckpt.metadata, tsckpt.restore, tsckpt.verify):
        with pytest.raises(NotACheckpointError, match=r"\.metadata: .* is a Python pickle.* pass allow_pickle=True"):
            read(src)
    assert main(["ls", src]) == 1
    assert "--allow-pickle" in capsys.readouterr().err


def test_torch_file_ties_are_stored_once_and_restored_tied(tmp_path):
    w = torch.randn(6, 3)
    torch.save({"a": w, "b": w, "step": 3}, tmp_path / "t.pt")
    ck = tsckpt.open(tmp_path / "t.pt").checkpoint
    assert ck.aliases == {"b": "a"} and list(ck.arrays) == ["a"] and ck.values == {"step": 3}
    out = tsckpt.restore(tmp_path / "t.pt", as_saved=True)
    assert out["a"] is out["b"] and torch.equal(out["a"], w) and out["step"] == 3


# ---- Hugging Face conventions: ties left out of the files --------------------------------------


def _gpt2(seed: int) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=500, n_positions=32)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _llama(seed: int) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, tie_word_embeddings=True,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("build, shard", [(_gpt2, "100KB"), (_llama, None)])
@pytest.mark.parametrize("inplace", [True, False])
def test_hugging_face_model_with_a_tied_head_restores_bit_for_bit(tmp_path, build, shard, inplace):
    saved, fresh = build(0), build(1)
    kwargs = {"max_shard_size": shard} if shard else {}
    saved.save_pretrained(tmp_path, **kwargs)
    assert (shard is None) == os.path.isfile(tmp_path / st.SINGLE_NAME)
    stored = tsckpt.metadata(tmp_path)
    assert "lm_head.weight" not in stored  # transformers leaves the tied head out
    target = fresh.state_dict()
    assert target["lm_head.weight"].data_ptr() == target["model.embed_tokens.weight" if build is _llama else
                                                        "transformer.wte.weight"].data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RestoreWarning, nothing else either
        out = tsckpt.restore(tmp_path, target, inplace=inplace)
    if not inplace:
        fresh.load_state_dict(out)
    embed = "model.embed_tokens.weight" if build is _llama else "transformer.wte.weight"
    assert (out["lm_head.weight"] is out[embed]) != inplace  # a fresh result keeps the tie as one tensor
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, fresh(ids).logits)


def test_a_missing_leaf_that_is_not_tied_still_raises(tmp_path):
    save_file({"a": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(StructureMismatchError, match=r"missing from the checkpoint: 1 \('b'\)|missing from the checkpoint: .*'b'"):
        tsckpt.restore(tmp_path / "m.safetensors", {"a": torch.zeros(3), "b": torch.zeros(3)})


# ---- slice-only reads --------------------------------------------------------------------------


def recording(real: Any, log: list[tuple[str, int, int]]) -> Any:
    """``os.preadv`` that also logs (file name, offset, bytes) of each read of a safetensors file."""

    def preadv(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        got = real(fd, buffers, offset, *rest)
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(".safetensors"):
            log.append((os.path.basename(name), offset, got))
        return int(got)

    return preadv


def preads(monkeypatch: Any) -> list[tuple[str, int, int]]:
    """(file name, offset, bytes) of every positional read of a safetensors file from now on."""
    log: list[tuple[str, int, int]] = []
    monkeypatch.setattr(os, "preadv", recording(os.preadv, log))
    return log


def test_a_slice_of_a_safetensors_tensor_reads_only_its_byte_runs(tmp_path, monkeypatch):
    w = torch.arange(20 * 30, dtype=torch.float32).reshape(20, 30)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    start = st.read_header(str(tmp_path / "m.safetensors")).entries["w"].begin
    log = preads(monkeypatch)
    got = tsckpt.open(tmp_path / "m.safetensors")["w"][4:7, 10:15]
    np.testing.assert_array_equal(got, w.numpy()[4:7, 10:15])
    assert log == [("m.safetensors", start + (r * 30 + 10) * 4, 20) for r in range(4, 7)]
    log.clear()
    np.testing.assert_array_equal(tsckpt.open(tmp_path / "m.safetensors")["w"][5:9], w.numpy()[5:9])
    assert log == [("m.safetensors", start + 5 * 30 * 4, 4 * 30 * 4)]  # whole rows: one run


def test_a_sharded_array_target_reads_its_region_of_a_torch_file(tmp_path):
    w = torch.randn(16, 8)
    torch.save({"w": w}, tmp_path / "m.pt")
    part = tsckpt.ShardedArray(torch.zeros(4, 3), (16, 8), (8, 5))
    out = tsckpt.restore(tmp_path / "m.pt", {"w": part})
    assert torch.equal(out["w"].local, w[8:12, 5:8])


# ---- DTensor targets under torch.distributed ------------------------------------------------------


def _hf_dir_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(10, 6, generator=g), "b": torch.randn(7, 12, generator=g), "c": torch.randn(9, generator=g)}


def _hf_dir(d: Any) -> dict[str, torch.Tensor]:
    """A sharded Hugging Face-style directory of two 2-D tensors and a vector, one per file."""
    state = _hf_dir_state()
    files = {n: f"model-0000{i + 1}-of-00003.safetensors" for i, n in enumerate(sorted(state))}
    for n, f in files.items():
        save_file({n: state[n]}, str(d / f))
    (d / st.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return state


def restore_hf_dtensors(rank: int, world: int, directory: str) -> list[tuple[str, int, int]]:
    """Rank scenario: restore a (Shard(0)), b (Shard(1)) and c (Shard(0)) from the HF directory;
    checks the values and returns the positional reads of safetensors files this rank made."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    state = _hf_dir_state()
    mesh = init_device_mesh("cpu", (world,))
    placements = {"a": Shard(0), "b": Shard(1), "c": Shard(0)}
    target = {n: distribute_tensor(torch.zeros_like(t), mesh, [placements[n]]) for n, t in state.items()}
    log: list[tuple[str, int, int]] = []
    real = os.preadv
    os.preadv = recording(real, log)
    try:
        out = tsckpt.restore(directory, target)
    finally:
        os.preadv = real
    for n, t in state.items():
        assert isinstance(out[n], DTensor) and torch.equal(out[n].full_tensor(), t), n
    return log


@pytest.mark.slow
def test_two_ranks_restore_dtensors_reading_only_their_byte_ranges(tmp_path):
    state = _hf_dir(tmp_path)
    logs = run_ranks(restore_hf_dtensors, 2, str(tmp_path))
    files = {n: f"model-0000{i + 1}-of-00003.safetensors" for i, n in enumerate(sorted(state))}
    begin = {n: st.read_header(str(tmp_path / f)).entries[n].begin for n, f in files.items()}
    for rank, log in enumerate(logs):
        want = [  # a: rows 5 x 6 floats per rank; b: 7 rows of 6 of its 12 columns; c: 5 then 4 floats
            (files["a"], begin["a"] + rank * 5 * 6 * 4, 5 * 6 * 4),
            *[(files["b"], begin["b"] + (r * 12 + rank * 6) * 4, 6 * 4) for r in range(7)],
            (files["c"], begin["c"] + rank * 5 * 4, (5 - rank) * 4),
        ]
        assert sorted(log) == sorted(want), rank
    total = sum(n for log in logs for _, _, n in log)
    assert total == sum(t.nbytes for t in state.values())  # every byte read once, by one rank
