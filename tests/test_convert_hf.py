"""convert() to a Hugging Face directory: which of tied names is written, the config and
tokenizer files copied beside the weights (copy_from), and loading the result in transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tsckpt
import tsckpt.torch
from tsckpt._cli import main
from tsckpt import _convert as convert_module


def gpt2_like() -> dict:
    """A tied state dict in the order transformers writes it: the input embedding first,
    the head last (so the head's name sorts first, the order tsckpt flattens in)."""
    g = torch.Generator().manual_seed(0)
    wte = torch.randn(16, 4, generator=g)
    return {"transformer.wte.weight": wte, "transformer.h.0.w": torch.randn(4, 4, generator=g), "lm_head.weight": wte}


def keys(path: str) -> list[str]:
    with safe_open(path, "pt") as f:
        return sorted(f.keys())


# ---- tied names --------------------------------------------------------------------------


@pytest.mark.parametrize("dst_name, to", [("m.safetensors", None), ("hf", "safetensors")])
def test_tied_leaves_keep_the_name_written_first(tmp_path, dst_name, to):
    src, dst = str(tmp_path / "ck"), str(tmp_path / dst_name)
    state = gpt2_like()
    tsckpt.save(src, {"model": state, "step": 3})
    r = tsckpt.convert(src, dst, to_format=to, subtree="model")
    assert (r.n_arrays, r.n_tied) == (2, 1)
    file = dst if dst.endswith(".safetensors") else os.path.join(dst, "model.safetensors")
    assert keys(file) == ["transformer.h.0.w", "transformer.wte.weight"]
    with safe_open(file, "pt") as f:
        info = json.loads(f.metadata()["tsckpt"])
    assert info["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    back = tsckpt.restore(tsckpt.convert(dst, str(tmp_path / "back")).dst, as_saved=True)
    assert list(back) == list(state) and all(torch.equal(back[k], v) for k, v in state.items())


def test_tied_leaves_renamed_keep_the_name_written_first(tmp_path):
    src, dst = str(tmp_path / "ck"), str(tmp_path / "m.safetensors")
    tsckpt.save(src, {"model": gpt2_like()})
    tsckpt.convert(src, dst, subtree="model", add_prefix="base.")
    assert keys(dst) == ["base.transformer.h.0.w", "base.transformer.wte.weight"]


def test_tied_module_saved_by_tsckpt_torch(tmp_path):
    """A plain torch module whose head is its embedding (whose name sorts after the head's),
    saved as training state."""

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word_embeddings = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.word_embeddings.weight

    torch.manual_seed(0)
    m = Tiny()
    src, dst = str(tmp_path / "ck"), str(tmp_path / "hf")
    tsckpt.torch.save(src, m)
    tsckpt.convert(src, dst, to_format="safetensors", subtree="model")
    got = load_file(os.path.join(dst, "model.safetensors"))
    assert sorted(got) == ["proj.bias", "proj.weight", "word_embeddings.weight"]
    assert torch.equal(got["word_embeddings.weight"], m.word_embeddings.weight.detach())


# ---- transformers loads what convert writes ------------------------------------------------


def _configs() -> list:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "tie_word_embeddings": True}
    return [
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=64),
        transformers.Qwen2Config(**small),
        transformers.LlamaConfig(**small),
    ]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["gpt2", "qwen2", "llama"])
def test_tied_model_through_tsckpt_torch_loads_in_transformers(tmp_path, which):
    from transformers import AutoModelForCausalLM

    config = _configs()[which]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    src, cfg_dir, hf = str(tmp_path / "ck"), str(tmp_path / "cfg"), str(tmp_path / "hf")
    tsckpt.torch.save(src, model)
    config.save_pretrained(cfg_dir)
    r = tsckpt.convert(src, hf, to_format="safetensors", subtree="model", copy_from=cfg_dir)
    assert r.n_tied == 1 and sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in keys(os.path.join(hf, "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    assert torch.equal(got, want)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


# ---- copy_from -------------------------------------------------------------------------------


@pytest.fixture
def ck(tmp_path):
    path = str(tmp_path / "ck")
    tsckpt.save(path, {"model": gpt2_like()})
    return path


@pytest.fixture
def base(tmp_path):
    """A model directory as save_pretrained and a tokenizer leave it, and files convert does not copy."""
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{\n  "model_type": "gpt2",\n  "torch_dtype": "float32",\n  "n_layer": 1\n}\n')
    (d / "generation_config.json").write_text('{"bos_token_id": 0}')
    (d / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": {"vocab": {"\xc3\xa9": 0}}}')
    (d / "merges.txt").write_text("#version: 0.2\na b\n")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "README.md").write_text("not copied")
    (d / "model.safetensors").write_bytes(b"not copied either")
    return d


def test_copy_from_copies_the_known_files_byte_for_byte(ck, base, tmp_path):
    hf = tmp_path / "hf"
    r = tsckpt.convert(ck, str(hf), to_format="safetensors", subtree="model", copy_from=str(base))
    copied = ["chat_template.jinja", "config.json", "generation_config.json", "merges.txt", "tokenizer.json"]
    assert sorted(os.listdir(hf)) == sorted(copied + ["model.safetensors"])
    assert sorted(os.path.basename(f) for f in r.files) == sorted(copied + ["model.safetensors"])
    for name in copied:
        assert (hf / name).read_bytes() == (base / name).read_bytes(), name


@pytest.mark.parametrize(
    "config, want",
    [
        ({"torch_dtype": "float32", "a": 1}, {"torch_dtype": "bfloat16", "a": 1}),  # transformers 4.x
        ({"dtype": "float32", "a": 1}, {"dtype": "bfloat16", "a": 1}),  # 5.x
        ({"a": 1, "dtype": "float32", "torch_dtype": "float32"}, {"a": 1, "dtype": "bfloat16", "torch_dtype": "bfloat16"}),
        ({"a": 1}, {"a": 1, "torch_dtype": "bfloat16"}),
    ],
)
def test_dtype_names_the_new_dtype_in_the_copied_config(ck, tmp_path, config, want):
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    hf = tmp_path / "hf"
    tsckpt.convert(ck, str(hf), to_format="safetensors", subtree="model", copy_from=str(d), dtype="bfloat16")
    text = (hf / "config.json").read_text()
    assert json.loads(text) == want and list(json.loads(text)) == list(want) and text.endswith("}\n")
    assert {v.dtype for v in load_file(str(hf / "model.safetensors")).values()} == {torch.bfloat16}


def test_copy_from_refuses_links_and_odd_files_before_writing(ck, base, tmp_path, monkeypatch):
    hf = str(tmp_path / "hf")

    def refused(match: str, error: type = ValueError) -> None:
        with pytest.raises(error, match=match):
            tsckpt.convert(ck, hf, to_format="safetensors", subtree="model", copy_from=str(base))
        assert not os.path.exists(hf)

    os.remove(base / "merges.txt")
    os.symlink(base / "README.md", base / "merges.txt")
    refused(rf"^copy_from: {base / 'merges.txt'} is a symbolic link \(to {base / 'README.md'}\); tsckpt does not "
            r"follow symbolic links in a checkpoint, which must hold its own files \(a link could lead anywhere; "
            r"docs/security.md\): replace each link with a copy of its file$", tsckpt.LinkRefusedError)
    os.remove(base / "merges.txt")
    os.mkdir(base / "vocab.json")
    refused(rf"^copy_from: {base / 'vocab.json'} is not a regular file$")
    os.rmdir(base / "vocab.json")
    monkeypatch.setattr(convert_module, "MAX_SIDE_FILE_BYTES", 50)
    refused(rf"^copy_from: {base / 'config.json'} holds 71 bytes, more than the 50 a model's config or "
            "tokenizer file has; copy it yourself if it is right$")
    monkeypatch.undo()
    (base / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json is not a JSON object, as a model's config.json is$"):
        tsckpt.convert(ck, hf, to_format="safetensors", subtree="model", copy_from=str(base), dtype="float16")
    (base / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(.*\), so its dtype cannot be set to the "
                       r"weights' \(float16\); fix it, or convert without copy_from \(--copy-from\)$"):
        tsckpt.convert(ck, hf, to_format="safetensors", subtree="model", copy_from=str(base), dtype="float16")
    assert not os.path.exists(hf)


def test_copy_from_needs_a_model_directory_and_a_directory_destination(ck, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"^copy_from: .*empty holds none of the files it copies \(config.json, "):
        tsckpt.convert(ck, str(tmp_path / "hf"), to_format="safetensors", copy_from=str(empty))
    with pytest.raises(ValueError, match=r"^copy_from: .*nope is not a directory; give the model directory"):
        tsckpt.convert(ck, str(tmp_path / "hf"), to_format="safetensors", copy_from=str(tmp_path / "nope"))
    for dst, to in [("m.safetensors", None), ("out", None)]:
        with pytest.raises(ValueError, match=r"^copy_from applies to a Hugging Face directory destination"):
            tsckpt.convert(ck, str(tmp_path / dst), to_format=to, copy_from=str(empty))
    assert sorted(os.listdir(tmp_path)) == ["ck", "empty"]


def test_copied_files_are_part_of_the_one_atomic_write(ck, base, tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    real = convert_module._read_side

    def failing(path: str, out=None) -> bytes:
        if path.endswith("tokenizer.json"):
            raise OSError(f"{path}: read failed")
        return real(path, out)

    monkeypatch.setattr(convert_module, "_read_side", failing)
    with pytest.raises(OSError, match="tokenizer.json: read failed"):
        tsckpt.convert(ck, str(hf), to_format="safetensors", subtree="model", copy_from=str(base), max_shard_size="100B")
    assert not hf.exists()
    # into a directory that holds files already: they are kept, nothing is added
    hf.mkdir()
    (hf / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="tokenizer.json: read failed"):
        tsckpt.convert(ck, str(hf), to_format="safetensors", subtree="model", copy_from=str(base))
    assert os.listdir(hf) == ["notes.txt"]


def test_existing_side_files_are_replaced_only_with_overwrite(ck, base, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(tsckpt.CheckpointExistsError, match=r"config.json already exists; pass overwrite=True"):
        tsckpt.convert(ck, str(hf), to_format="safetensors", subtree="model", copy_from=str(base))
    assert os.listdir(hf) == ["config.json"]
    tsckpt.convert(ck, str(hf), to_format="safetensors", subtree="model", copy_from=str(base), overwrite=True)
    assert (hf / "config.json").read_bytes() == (base / "config.json").read_bytes()


def test_copy_from_on_the_command_line(ck, base, tmp_path, capsys):
    hf = str(tmp_path / "hf")
    code = main(["convert", ck, hf, "--to", "safetensors", "--subtree", "model", "--copy-from", str(base),
                 "--dtype", "float16"])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == (
        f"converted {ck} (tsckpt) -> {hf} (safetensors): 2 arrays (160 B) in 6 files, 0 values, 1 tied leaf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {
        "model_type": "gpt2", "torch_dtype": "float16", "n_layer": 1}
    code = main(["convert", ck, str(tmp_path / "x.safetensors"), "--copy-from", str(base)])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "tsckpt convert: error: copy_from applies to a Hugging Face directory destination (--to safetensors, "
        "not a file)\n")


# ---- the copied config's dtype follows the weights written -----------------------------------


@pytest.fixture
def bf16_base(tmp_path):
    """A tiny GPT-2 saved by save_pretrained in bfloat16, and its weights in float32 in a tsckpt checkpoint."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "base")
    src = str(tmp_path / "ck")
    tsckpt.save(src, {"model": {k: v.float() for k, v in model.state_dict().items()}})
    return src, tmp_path / "base"


def test_the_copied_config_names_the_dtype_of_the_weights_written(bf16_base, tmp_path, capsys):
    """Weights written in float32 beside a bfloat16 model's config: the config says float32, so
    transformers (dtype="auto", the default of later versions) loads float32."""
    from transformers import AutoModelForCausalLM

    src, base = bf16_base
    keys_before = {k for k in json.loads((base / "config.json").read_text()) if k in ("dtype", "torch_dtype")}
    assert keys_before and all(json.loads((base / "config.json").read_text())[k] == "bfloat16" for k in keys_before)
    hf = tmp_path / "hf"
    code = main(["convert", src, str(hf), "--to", "safetensors", "--subtree", "model", "--copy-from", str(base)])
    assert code == 0, capsys.readouterr().err
    config = json.loads((hf / "config.json").read_text())
    assert {k: config[k] for k in keys_before} == dict.fromkeys(keys_before, "float32")
    assert AutoModelForCausalLM.from_pretrained(hf, dtype="auto").dtype == torch.float32
    # with --dtype, the config names the cast dtype, and transformers loads that
    code = main(["convert", src, str(tmp_path / "hf16"), "--to", "safetensors", "--subtree", "model",
                 "--copy-from", str(base), "--dtype", "float16"])
    assert code == 0, capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", dtype="auto").dtype == torch.float16


def test_weights_of_several_dtypes_need_dtype_to_copy_a_config(bf16_base, tmp_path, capsys):
    src, base = bf16_base
    mixed = str(tmp_path / "mixed")
    state = tsckpt.restore(src, as_saved=True)["model"]
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"].bfloat16()
    tsckpt.save(mixed, {"model": state, "step": 7})
    hf = tmp_path / "hf"
    code = main(["convert", mixed, str(hf), "--to", "safetensors", "--subtree", "model", "--copy-from", str(base)])
    err = capsys.readouterr().err
    assert code == 2 and not hf.exists()
    assert err.startswith(
        f"tsckpt convert: error: copy_from: the floating-point weights written are of 2 dtypes (bfloat16: 1 "
        f"array, e.g. 'transformer.ln_f.weight'; float32: "
    ), err
    assert err.endswith(
        f"so {base / 'config.json'} cannot name one dtype for them (transformers would load them all as "
        "bfloat16); pass --dtype (dtype=) to cast them to one, or convert without --copy-from and write "
        "the config yourself\n"
    ), err
    assert main(["convert", mixed, str(hf), "--to", "safetensors", "--subtree", "model", "--copy-from", str(base),
                 "--dtype", "bfloat16"]) == 0
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
