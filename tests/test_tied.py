"""Tied and shared leaves: stored once, recorded as aliases, every name restored."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._read.restore as restore_mod
from tsckpt._save.plan import plan_aliases
from tsckpt._base.types import LeafDesc


def _meta(d: str) -> dict:
    with open(os.path.join(d, "zarr.json")) as f:
        return json.load(f)["attributes"]["tsckpt"]


def test_same_tensor_is_stored_once_and_restored_under_every_name(ckdir):
    w = torch.randn(5, 3)
    tree = {"emb": w, "head": w, "other": w.clone(), "view": w[1:], "t": w.t(), "n": np.arange(4)}
    tree["n2"] = tree["n"]
    tsckpt.save(ckdir, tree)
    meta = _meta(ckdir)
    assert meta["aliases"] == {"head": "emb", "n2": "n"}
    assert meta["leaves"] == ["emb", "head", "n", "n2", "other", "t", "view"]
    assert sorted(a["path"] for a in meta["arrays"]) == ["emb", "n", "other", "t", "view"]
    assert not os.path.exists(os.path.join(ckdir, "head"))  # no array node for an alias

    out = tsckpt.restore(ckdir)
    assert out["head"] is out["emb"] and out["n2"] is out["n"]  # tied again, as when saved
    np.testing.assert_array_equal(out["head"], w.numpy())
    np.testing.assert_array_equal(out["view"], w[1:].numpy())
    assert tsckpt.open(ckdir)["head"][4].tolist() == w[4].tolist()
    assert tsckpt.metadata(ckdir)["head"].shape == (5, 3)
    assert tsckpt.metadata(ckdir)["head"].path == "head"


def test_untied_target_gets_each_leaf_in_its_own_dtype(ckdir):
    w = torch.randn(4, 2)
    tsckpt.save(ckdir, {"emb": w, "head": w})
    out = tsckpt.restore(ckdir, {"emb": torch.empty(4, 2, dtype=torch.float64), "head": torch.empty(4, 2, dtype=torch.bfloat16)})
    assert out["emb"].dtype == torch.float64 and out["head"].dtype == torch.bfloat16
    torch.testing.assert_close(out["emb"], w.double(), rtol=0, atol=0)
    torch.testing.assert_close(out["head"], w.bfloat16(), rtol=0, atol=0)


def test_inplace_into_tied_target_reads_once(ckdir, monkeypatch):
    w = torch.randn(6, 3)
    tsckpt.save(ckdir, {"emb": w, "head": w, "b": torch.ones(2)})
    seen: list[list[str]] = []
    real = restore_mod.read_into

    def recording(ck, dests, *rest, **kw):
        seen.append([d.item.path for d in dests])
        return real(ck, dests, *rest, **kw)

    monkeypatch.setattr(restore_mod, "read_into", recording)
    live = torch.full((6, 3), float("nan"))
    out = tsckpt.restore(ckdir, {"emb": live, "head": live, "b": torch.zeros(2)}, inplace=True)
    assert seen == [["b", "emb"]]
    assert torch.equal(live, w) and out["head"] is live and out["emb"] is live


def test_different_dtype_views_and_values_are_not_aliases(ckdir):
    w = torch.randn(4)
    tsckpt.save(ckdir, {"a": w, "b": w.view(torch.int32), "c": 3, "d": 3, "e": torch.empty(0), "f": torch.empty(0)})
    assert "aliases" not in _meta(ckdir)


def _d(path: str, offsets=(0,), lengths=(4,)) -> LeafDesc:
    return LeafDesc(path, "torch", "float32", 4, (8,), offsets, lengths)


def test_plan_aliases_needs_every_holding_rank_to_agree():
    # rank 0 and 1 both hold a and b as the same memory
    both = [[_d("a"), _d("b")], [_d("a", (4,)), _d("b", (4,))]]
    assert plan_aliases(both, [{"b": "a"}, {"b": "a"}]) == {"b": "a"}
    # rank 1 holds them as different memory: both stay stored
    assert plan_aliases(both, [{"b": "a"}, {}]) == {}
    # rank 1's shard is empty: it proves nothing, and holds a with the same region
    empty = [[_d("a"), _d("b")], [_d("a", (8,), (0,)), _d("b", (8,), (0,))]]
    assert plan_aliases(empty, [{"b": "a"}, {}]) == {"b": "a"}
    # rank 1 holds b (empty) but not a: no alias
    assert plan_aliases([[_d("a"), _d("b")], [_d("b", (8,), (0,))]], [{"b": "a"}, {}]) == {}
    # ranks disagree on which leaf b is tied to
    three = [[_d("a"), _d("b"), _d("c")]] * 2
    assert plan_aliases(three, [{"b": "a", "c": "a"}, {"c": "a", "b": "c"}]) == {"c": "a"}


@pytest.mark.parametrize("bad", [{"x": "nope"}, ["x"]])
def test_dangling_or_malformed_aliases_are_corrupt(ckdir, bad):
    tsckpt.save(ckdir, {"w": torch.ones(2), "x": torch.ones(2)})
    path = os.path.join(ckdir, "zarr.json")
    with open(path) as f:
        root = json.load(f)
    root["attributes"]["tsckpt"]["aliases"] = bad
    with open(path, "w") as f:
        json.dump(root, f)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="alias|malformed"):
        tsckpt.restore(ckdir)


def test_tied_model_state_dict_keeps_both_names_and_stores_once(ckdir):
    import tsckpt.torch as tt
    from tests import torch_scenarios as sc

    model = sc.gpt(0, dropout=0.0)
    sd = tt.get_state_dict(model)
    assert "tok.weight" in sd["model"] and "head.weight" in sd["model"]  # named_parameters would drop one
    tsckpt.save(ckdir, sd)
    assert _meta(ckdir)["aliases"] == {"model/tok.weight": "model/head.weight"}
    assert not os.path.exists(os.path.join(ckdir, "model", "tok.weight"))

    # strict restore into a fresh tied model: neither name missing nor unexpected, the tie kept
    fresh = sc.gpt(1, dropout=0.0)
    live = tt.get_state_dict(fresh)
    out = tsckpt.restore(ckdir, live, inplace=True)
    assert torch.equal(fresh.tok.weight, model.tok.weight) and fresh.head.weight is fresh.tok.weight
    assert out["model"]["head.weight"].data_ptr() == fresh.tok.weight.data_ptr()

    # an untied model of the same names gets the value under both
    untied = sc.gpt(2, dropout=0.0, tied=False)
    tt.set_state_dict(untied, None, tsckpt.restore(ckdir))
    assert torch.equal(untied.tok.weight, model.tok.weight) and torch.equal(untied.head.weight, model.tok.weight)
    assert untied.head.weight.data_ptr() != untied.tok.weight.data_ptr()
    # and an untied model saves both
    tsckpt.save(ckdir, tt.get_state_dict(untied), overwrite=True)
    assert "aliases" not in _meta(ckdir)
