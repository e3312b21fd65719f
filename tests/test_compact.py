"""The compact layout: few files whatever the number of leaves, read by every verb with no option."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorstore as ts
import torch

import tsckpt
import tsckpt.torch
from tests import dist_scenarios as sc
from tests.dist_helpers import run_ranks
from tests.stored import count_files
from tests.strategies import assert_same


def _tree(n: int) -> dict:
    return {"opt": {f"l{i:04d}": {"m": torch.full((4, 3), float(i)), "v": np.arange(3) + i} for i in range(n)}, "step": 9}


def test_file_count_does_not_grow_with_leaves(tmp_path):
    counts = []
    for n in (10, 1000):
        tsckpt.save(tmp_path / f"c{n}", _tree(n), layout="compact")
        counts.append(count_files(tmp_path / f"c{n}"))  # root, manifests, a few database files
    assert max(counts) <= 4 * 1 + 16, counts  # the bound, 4 x ranks + 16, for one rank
    tsckpt.save(tmp_path / "p", _tree(1000))
    assert count_files(tmp_path / "p") > 4000  # the plain layout: two files per array
    assert_same(tsckpt.restore(tmp_path / "c1000", _tree(1000)), _tree(1000))


@pytest.mark.slow
def test_1000_leaves_on_4_ranks_within_4_files_a_rank_plus_16(tmp_path):
    d = str(tmp_path / "ck")
    run_ranks(sc.many_leaves, 4, d, 1000, layout="compact")
    assert count_files(d) <= 4 * 4 + 16
    out = tsckpt.restore(d)
    assert out["step"] == 5 and len(out["opt"]) == 1000
    np.testing.assert_array_equal(out["opt"]["l0999"], np.arange(48, dtype=np.float32).reshape(16, 3) + 999)
    assert sorted(n for n in os.listdir(d) if n.startswith("ocdbt.")) == [f"ocdbt.r{r}" for r in range(4)]


def test_root_records_the_layout_and_version(tmp_path):
    tsckpt.save(tmp_path / "c", {"w": np.arange(4)}, layout="compact")
    tsckpt.save(tmp_path / "p", {"w": np.arange(4)})
    meta = json.loads((tmp_path / "c" / "zarr.json").read_text())["attributes"]["tsckpt"]
    assert meta["layout"] == "compact" and meta["format_version"] == 3
    meta = json.loads((tmp_path / "p" / "zarr.json").read_text())["attributes"]["tsckpt"]
    assert "layout" not in meta and meta["format_version"] == 3  # one-file arrays' keys c.0: older readers refuse both


def test_tensorstore_alone_reads_the_arrays(tmp_path):
    """docs/format.md: a zarr3 array over the ocdbt kvstore at the checkpoint root."""
    w = torch.randn(300, 70)
    tsckpt.save(tmp_path / "c", {"model": {"w": w}}, layout="compact")
    kvstore = {"driver": "ocdbt", "base": f"file://{tmp_path / 'c'}/", "path": "model/w/"}
    arr = ts.open({"driver": "zarr3", "kvstore": kvstore}, read=True).result()
    np.testing.assert_array_equal(arr[10:20].read().result(), w[10:20].numpy())
    node = json.loads(ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path / 'c'}/"}).result().read("model/zarr.json").result().value)
    assert node["node_type"] == "group"


def test_every_verb_reads_it_with_no_option(tmp_path, capsys):
    d = tmp_path / "c"
    tree = {"model": {"w": torch.randn(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "step": 3}
    tsckpt.save(d, tree, layout="compact")
    assert_same(tsckpt.restore(d, tree), tree)
    assert tsckpt.open(d)["model/w"][5:9].tolist() == tree["model"]["w"][5:9].tolist()
    assert tsckpt.metadata(d)["model"]["w"].shape == (64, 8)
    assert tsckpt.verify(d).ok
    from tsckpt._cli import main

    assert main(["verify", str(d)]) == 0
    assert main(["ls", str(d)]) == 0
    assert "model/w" in capsys.readouterr().out
    into = {"model": {"w": torch.empty(64, 8), "b": torch.empty(8, dtype=torch.bfloat16)}, "step": 0}
    tsckpt.restore(d, into, inplace=True)
    assert_same(into["model"], tree["model"])


def test_async_manager_convert_and_torch_save_take_the_layout(tmp_path):
    tree = {"w": torch.arange(12.0).reshape(3, 4), "n": 1}
    tsckpt.save_async(tmp_path / "a", tree, layout="compact").result()
    with tsckpt.CheckpointManager(tmp_path / "run", keep_last=1, layout="compact") as m:
        m.save(1, tree)
        m.save_async(2, tree).result()
    report = tsckpt.convert(tmp_path / "a", tmp_path / "conv", layout="compact")
    assert report.n_arrays == 1
    model = torch.nn.Linear(3, 2)
    tsckpt.torch.save(tmp_path / "t", model, layout="compact")
    for d in (tmp_path / "a", tmp_path / "run" / "00000002", tmp_path / "conv", tmp_path / "t"):
        assert json.loads((d / "zarr.json").read_text())["attributes"]["tsckpt"]["layout"] == "compact", d
        assert (d / "manifest.ocdbt").is_file()
    assert_same(tsckpt.restore(tmp_path / "run" / "00000002", tree), tree)
    assert os.listdir(tmp_path / "run") == ["00000002"]


def test_unknown_layout_is_refused_before_anything_is_written(tmp_path):
    msg = "layout must be one of 'plain', 'compact', not 'ocdbt'"
    with pytest.raises(ValueError, match=msg):
        tsckpt.save(tmp_path / "x", {"w": np.arange(3)}, layout="ocdbt")
    with pytest.raises(ValueError, match=msg):
        tsckpt.save_async(tmp_path / "x", {"w": np.arange(3)}, layout="ocdbt")
    with pytest.raises(ValueError, match=msg):
        tsckpt.CheckpointManager(tmp_path / "run", layout="ocdbt")
    with pytest.raises(ValueError, match="layout='compact' applies to a tsckpt destination, not safetensors"):
        tsckpt.convert(tmp_path / "x", tmp_path / "y.safetensors", layout="compact")
    assert not (tmp_path / "x").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("first, second", [("plain", "compact"), ("compact", "plain")])
def test_overwrite_across_layouts_leaves_nothing_stale(tmp_path, first, second):
    d = tmp_path / "c"
    tsckpt.save(d, _tree(20), layout=first)
    tsckpt.save(d, {"w": np.arange(5)}, layout=second, overwrite=True)
    names = set(os.listdir(d))
    if second == "plain":
        assert names == {"zarr.json", "w"}
    else:
        assert names == {"zarr.json", "manifest.ocdbt", "d", "ocdbt.r0"}
    assert tsckpt.restore(d)["w"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("replaced_open", [True, False])
def test_saved_again_in_place_is_read_anew_in_the_same_process(tmp_path, replaced_open):
    """A compact checkpoint saved again with overwrite=True has a new database; opening and
    restoring it again in the same process reads that one (a reader of the replaced one, kept
    open or not, once made TensorStore refuse it: "Configuration mismatch on uuid"), and a
    reader still holding the replaced one gets the replaced error, never a mix."""
    d = tmp_path / "c"

    def tree(v: float) -> dict:
        return {"w": torch.full((4, 3), v), "b": np.arange(5) + int(v)}

    tsckpt.save(d, tree(1), layout="compact")
    old = tsckpt.open(d)
    assert old["w"][...].tolist() == [[1.0] * 3] * 4
    assert_same(tsckpt.restore(d, tree(0)), tree(1))
    if not replaced_open:
        del old
    tsckpt.save(d, tree(2), layout="compact", overwrite=True)
    assert tsckpt.open(d)["w"][...].tolist() == [[2.0] * 3] * 4
    assert_same(tsckpt.restore(d, tree(0)), tree(2))
    assert tsckpt.verify(d).ok
    if replaced_open:
        with pytest.raises(tsckpt.CheckpointReplacedError, match="replaced or deleted while it was being read"):
            old["b"][...]


def test_a_memory_store(tmp_path):
    loc = "memory://compact/ck"
    tsckpt.save(loc, _tree(30), layout="compact")
    assert_same(tsckpt.restore(loc, _tree(30)), _tree(30))
    assert tsckpt.verify(loc).ok


def _database_files(d) -> list:
    return sorted(p for p in d.rglob("*") if p.is_file() and p.parent.name == "d")


def _restored_or_refused(d, tree) -> bool:
    """True if restore refused the damage; otherwise what it returned must be exact
    (a rank's own B-tree nodes are unused once merged into the root database)."""
    try:
        out = tsckpt.restore(d, tree)
    except tsckpt.CorruptCheckpointError as e:
        assert f"in {d}: " in str(e) and "restore from another checkpoint" in str(e), e
        assert not tsckpt.verify(d).ok
        return True
    assert_same(out, tree)
    assert tsckpt.verify(d).ok
    return False


def test_damaged_database_files_are_detected_never_misread(tmp_path):
    d = tmp_path / "c"
    tree = _tree(20)
    tsckpt.save(d, tree, layout="compact")
    files = _database_files(d)
    flipped, deleted = set(), set()
    for f in files:
        data = f.read_bytes()
        for pos in (0, len(data) // 3, len(data) // 2, len(data) - 1):
            damaged = bytearray(data)
            damaged[pos] ^= 0x10
            f.write_bytes(bytes(damaged))
            if _restored_or_refused(d, tree):
                flipped.add(f)
        f.unlink()
        if _restored_or_refused(d, tree):
            deleted.add(f)
        f.write_bytes(data)
    root_nodes = [f for f in files if f.parent == d / "d"]
    values = [f for f in files if f.stat().st_size > 20 * 4 * 3 * 4]  # holds the arrays' chunks
    assert root_nodes and values
    assert set(root_nodes + values) <= flipped & deleted
    assert_same(tsckpt.restore(d, tree), tree)


def test_missing_manifest_is_named(tmp_path):
    d = tmp_path / "c"
    tsckpt.save(d, _tree(3), layout="compact")
    (d / "manifest.ocdbt").unlink()
    msg = f"{d}: the array database of this compact checkpoint is missing (manifest.ocdbt does not exist)"
    with pytest.raises(tsckpt.CorruptCheckpointError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        tsckpt.open(d)


@pytest.mark.slow
def test_ranks_must_agree_on_the_layout(tmp_path):
    from tests.dist_helpers import RankError

    d = str(tmp_path / "ck")
    with pytest.raises(RankError) as info:
        run_ranks(sc.save_with_layouts, 2, d, ["plain", "compact"], timeout=60)
    assert sorted(info.value.errors) == [0, 1]
    for msg in info.value.errors.values():  # the same error on every rank, naming the ranks
        assert "LayoutError: ranks passed different layout options (rank 0 'plain', rank 1 'compact'); every rank " \
            "must save with the same" in msg
    assert not os.path.exists(os.path.join(d, "zarr.json"))
