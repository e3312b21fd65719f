"""Exact resumption: train N steps, save, resume in fresh processes, train M more."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt.torch as tt
from tests import torch_scenarios as sc
from tests.dist_helpers import run_ranks

pytestmark = pytest.mark.slow  # every test here starts processes

N, M = 5, 4


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_single_process_resume_is_bit_identical(tmp_path):
    d = str(tmp_path / "ck")
    # the uninterrupted run saves after N steps and goes on; it also checks that a run
    # which never saved gives the very same losses (saving changes nothing)
    ref = sc.run_solo(sc.train_save_continue, d, N, M, False)
    got = sc.run_solo(sc.resume, d, M, False)
    assert got["step"] == N
    assert got["nan_left"] == []
    assert got["tied"]
    assert got["after"] == ref["after"]  # losses, bit for bit (dropout and data use the restored RNGs)
    _same(got["params"], ref["params"])
    _same(got["optim"], ref["optim"])
    assert got["lr"] == ref["lr"] and got["consumed"] == ref["consumed"]
    root = json.load(open(os.path.join(d, "zarr.json")))["attributes"]["tsckpt"]
    assert root["aliases"] == {"model/tok.weight": "model/head.weight"}  # the tied embedding, stored once
    assert "optim/state/tok.weight/exp_avg" in root["leaves"]
    assert root["values"]["extra/step"]["value"] == N


def test_fsdp2_4_ranks_resumed_on_4_exactly_and_on_2_closely(tmp_path):
    d, plain = str(tmp_path / "fsdp"), str(tmp_path / "plain")
    # a single-process checkpoint, to restore into a sharded model too (unsharded -> FSDP2)
    model = sc.gpt(3, dropout=0.0)
    opt = sc.make_optimizer(model)
    sc.train(model, opt, sc.scheduler(opt), sc.Cursor(), 2)
    tt.save(plain, model, opt, rng=False)

    ref = run_ranks(sc.train_save_continue, 4, d, N, M, True)
    root = json.load(open(os.path.join(d, "zarr.json")))["attributes"]["tsckpt"]
    assert root["aliases"] == {"model/tok.weight": "model/head.weight"}  # tied under FSDP2: stored once
    assert root["world_size"] == 4 and "ranks/3/data/gen" in root["leaves"]

    four = run_ranks(sc.resume, 4, d, M, True)
    two = run_ranks(sc.resume, 2, d, M, True, "adamw", plain)
    for got in four + two:
        assert got["step"] == N and got["nan_left"] == [] and got["tied"]
    r0 = ref[0]
    assert [g["after"] for g in four] == [r0["after"]] * 4  # bit-identical losses on every rank
    _same(four[0]["params"], r0["params"])
    _same(four[0]["optim"], r0["optim"])
    assert [g["consumed"] for g in four] == [r["consumed"] for r in ref]  # per-rank sampler state

    # another world size: the same global batches, summed in another order
    np.testing.assert_allclose(two[0]["after"], r0["after"], rtol=1e-5)
    for k, v in r0["params"].items():
        np.testing.assert_allclose(two[0]["params"][k], v, rtol=1e-3, atol=1e-4, err_msg=k)  # Adam's steps are ~3e-3
    assert two[1]["consumed"] == N * 2 + M * 4  # rank 1's sampler: 2 rows a step on 4 ranks, then 4 on 2

    # the single-process checkpoint went into the 2-rank FSDP2 model: every value, no NaN left
    assert two[0]["unsharded_nan_left"] == []
    want = tsckpt.restore(plain)
    for k, v in two[0]["unsharded"].items():
        np.testing.assert_array_equal(v, want["model"][k], err_msg=k)
    for k, v in two[0]["unsharded_optim"].items():
        name, key = k.split("/")
        np.testing.assert_array_equal(v, want["optim"]["state"][name][key], err_msg=k)
    # and into a DDP-wrapped model on each of the 2 ranks
    assert two[1]["ddp_names"] == ["blocks.0.ln1.bias", "blocks.0.ln1.weight", "blocks.0.ln2.bias"]
    assert two[1]["ddp_nan_left"] == []
    for k, v in two[1]["ddp"].items():
        np.testing.assert_array_equal(v, want["model"][k], err_msg=k)

    # and the 4-rank FSDP2 checkpoint into a plain model, in this process without torch.distributed
    flat = sc.gpt(8, dropout=0.0)
    flat_opt = sc.make_optimizer(flat)
    sc.fill_nan(flat, flat_opt)
    tt.restore(d, flat, flat_opt, rng=False)
    assert sc.nan_left(flat, flat_opt) == []
    saved = tsckpt.restore(d)
    for k, v in flat.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), saved["model"][k], err_msg=k)
    assert torch.equal(flat_opt.state[flat.tok.weight]["step"], torch.tensor(float(N)))


def test_example_saves_and_resumes(tmp_path):
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "train_fsdp.py")
    d = str(tmp_path / "ck")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    first = subprocess.run([sys.executable, script, "--ckpt", d, "--steps", "6", "--every", "2"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"saved steps [4, 6] to {d}" in first.stdout  # keep_last=2 of steps 2, 4, 6
    second = subprocess.run([sys.executable, script, "--ckpt", d, "--steps", "10"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resumed {d} at step 6 on 1 rank(s)" in second.stdout and "step  10  loss" in second.stdout
    assert f"saved steps [6, 10] to {d}" in second.stdout


def per_rank_values(rank: int, world: int, directory: str) -> dict:
    """Each rank saves plain per-rank values and a pytree of its own, then restores them."""
    model = sc.gpt(0, dropout=0.0)  # replicated on every rank
    mine = {"seen": 100 + rank, "window": {"start": rank, "ids": torch.full((3,), rank)}}
    tt.save(directory, model, extra={"seen": 7}, per_rank=mine)
    ids = torch.zeros(3, dtype=torch.int64)
    out = tt.restore(directory, sc.gpt(1, dropout=0.0), extra={"seen": 0},
                     per_rank={"seen": -1, "window": {"start": -1, "ids": ids}})
    window = out.per_rank["window"]
    return {"extra": dict(out), "names": sorted(out.per_rank), "seen": out.per_rank["seen"],
            "start": window["start"], "ids": ids.tolist(), "in_place": window["ids"] is ids}


def test_per_rank_values_come_back_to_their_own_rank(tmp_path):
    d = str(tmp_path / "ck")
    got = run_ranks(per_rank_values, 2, d)
    assert got == [
        {"extra": {"seen": 7}, "names": ["seen", "window"], "seen": 100 + r, "start": r, "ids": [r] * 3, "in_place": True}
        for r in range(2)
    ]
    stored = tsckpt.restore(d)["ranks"]
    assert [stored[r]["seen"] for r in range(2)] == [100, 101]  # one entry per rank in the checkpoint
