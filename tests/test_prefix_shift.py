"""Names shifted by a prefix (a Hugging Face directory given to tsckpt.torch.restore, a
checkpoint of {"model": sd} restored into sd): said so, with the restore that works; a
restore that would load nothing raises even with strict=False; strict=False says what it left."""

from __future__ import annotations

import logging

import pytest
import torch

import tsckpt
import tsckpt.torch

transformers = pytest.importorskip("transformers")


def gpt2(meta: bool = False) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    if meta:
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(cfg).eval()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    gpt2().save_pretrained(d)  # model.safetensors, lm_head.weight left out (tied to the embedding)
    return str(d)


def _fresh() -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _same_outputs(model: torch.nn.Module) -> bool:
    idx = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        return torch.equal(model(idx).logits, gpt2()(idx).logits)


def test_torch_restore_of_a_hugging_face_directory_names_the_missing_prefix(hf_dir):
    with pytest.raises(tsckpt.StructureMismatchError) as ei:
        tsckpt.torch.restore(hf_dir, _fresh())
    msg = str(ei.value)
    assert "another architecture" not in msg  # it was called that: the names are the same, shifted
    assert "16 of the 17 missing names are at the top of the checkpoint, without the 'model/' prefix" in msg
    assert "has no option to select or strip a prefix" in msg
    assert "tsckpt.restore(directory, model.state_dict(), inplace=True)" in msg


def test_torch_restore_matching_nothing_raises_even_with_strict_false(hf_dir):
    model = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(tsckpt.StructureMismatchError, match=r"would load nothing \(strict=False too\).*'model/' prefix"):
        tsckpt.torch.restore(hf_dir, model, strict=False)  # it loaded 0 bytes and said nothing
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_advice_restores_the_model(hf_dir):
    model = _fresh()
    tsckpt.restore(hf_dir, model.state_dict(), inplace=True)
    assert _same_outputs(model)


def test_the_advice_for_a_meta_model(hf_dir):
    model = gpt2(meta=True)
    out = tsckpt.restore(hf_dir, model.state_dict())  # the tied head shares the embedding's meta storage
    assert out["lm_head.weight"] is out["transformer.wte.weight"]
    model.load_state_dict(out, assign=True)
    model.tie_weights()
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert _same_outputs(model)


def test_torch_restore_partial_match_with_strict_false_logs_once(ckdir, caplog):
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    tsckpt.torch.save(ckdir, saved, rng=False)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="tsckpt"):
        tsckpt.torch.restore(ckdir, model, rng=False, strict=False)
    (rec,) = [r for r in caplog.records if r.name == "tsckpt"]
    assert "loaded 4 of the model's 6 tensors" in rec.getMessage()
    assert "'2.bias', '2.weight'" in rec.getMessage()
    assert torch.equal(model[0].weight, saved[0].weight)


def test_torch_restore_names_a_prefix_inside_the_model_names(ckdir):
    # a wrapper's names ("model.layers.0") saved, a bare model's ("layers.0") restored
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    wrapper = torch.nn.Module()
    wrapper.model = inner
    tsckpt.torch.save(ckdir, wrapper, rng=False)
    with pytest.raises(tsckpt.StructureMismatchError) as ei:
        tsckpt.torch.restore(ckdir, torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), rng=False)
    msg = str(ei.value)
    assert "4 of the 4 missing names are in the checkpoint under the prefix 'model.'" in msg
    assert "{'model.' + k: v for k, v in model.state_dict().items()}" in msg


# ---- tsckpt.restore ---------------------------------------------------------------------


def test_restore_names_a_prefix_the_checkpoint_adds(ckdir):
    sd = {"a": torch.ones(2), "b": torch.zeros(3)}
    tsckpt.save(ckdir, {"model": sd})
    with pytest.raises(tsckpt.StructureMismatchError) as ei:
        tsckpt.restore(ckdir, sd, strict=False)
    msg = str(ei.value)
    assert "would load nothing (strict=False too)" in msg
    assert "2 of the 2 missing leaves are in the checkpoint under the prefix 'model/'" in msg
    assert "tsckpt.restore(directory, {'model': target})['model']" in msg
    assert tsckpt.restore(ckdir, {"model": sd})["model"]["a"].tolist() == [1.0, 1.0]  # the advice works


def test_restore_names_a_prefix_the_target_adds(hf_dir):
    with pytest.raises(tsckpt.StructureMismatchError, match=r"without the prefix 'model/'.*target\['model'\]"):
        tsckpt.restore(hf_dir, {"model": _fresh().state_dict()})


def test_restore_names_a_prefix_inside_names(ckdir):
    tsckpt.save(ckdir, {"model.w": torch.ones(2), "model.b": torch.ones(1), "lm_head": torch.ones(1)})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"under the prefix 'model\.'.*\{'model\.' \+ k: v for k, v in target\.items\(\)\}"):
        tsckpt.restore(ckdir, {"w": torch.empty(2), "b": torch.empty(1), "lm_head": torch.empty(1)})


def test_restore_matching_nothing_raises_even_with_strict_false(ckdir):
    tsckpt.save(ckdir, {"w": torch.ones(2)})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"Not one leaf of the target is in the checkpoint"):
        tsckpt.restore(ckdir, {"x": torch.empty(2)}, strict=False)
    assert tsckpt.restore(ckdir, {}, strict=False) == {}  # an empty target asks for nothing


def test_restore_partial_match_with_strict_false_says_how_many(ckdir):
    tsckpt.save(ckdir, {"w": torch.ones(2), "b": torch.ones(1)})
    with pytest.warns(tsckpt.RestoreWarning, match=r"restored the common leaves \(1 of the target's 2\)"):
        tsckpt.restore(ckdir, {"w": torch.empty(2), "x": torch.empty(1)}, strict=False)


def test_prefix_shift_needs_most_names():
    from tsckpt.tree import prefix_shift

    assert prefix_shift(["model/a", "model/b"], ["a", "b"]) == ("model/", "", 2, 2)
    assert prefix_shift(["a", "b"], ["m/a", "m/b"]) == ("", "m/", 2, 2)
    assert prefix_shift(["a", "b", "c"], ["m/a"]) is None  # one of three: another tree
    # two names found inside a larger tree: another architecture, not a shift
    assert prefix_shift(["proj.weight", "proj.bias"], ["b.0.proj.weight", "b.0.proj.bias", "b.0.fc.weight", "b.0.fc.bias", "ln"]) is None
    assert prefix_shift(["x"], ["y"]) is None
