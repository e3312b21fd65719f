"""Targets without memory a restore can write: freed storage, read-only memory; and ties,
recognised only between leaves that really share memory."""

from __future__ import annotations

import mmap
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tsckpt


def freed(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype)
    t.untyped_storage().resize_(0)  # as FSDP does to unsharded parameters
    return t


@pytest.fixture
def saved(ckdir):
    tsckpt.save(ckdir, {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)})
    return ckdir


# ---- ties only between leaves that share memory ---------------------------------------


def test_freed_leaves_missing_from_the_checkpoint_are_not_taken_for_tied(saved):
    # every freed tensor has data pointer 0: 'extra' looked like 'b' (same shape, stride, dtype)
    with pytest.raises(tsckpt.StructureMismatchError, match=r"missing from the checkpoint: 1 \('extra'\)"):
        tsckpt.restore(saved, {"w": torch.empty(2, 3), "b": freed(3), "extra": freed(3)})


def test_a_missing_freed_leaf_never_gets_another_leafs_values(saved):
    with pytest.warns(tsckpt.RestoreWarning, match="'extra'"):
        out = tsckpt.restore(saved, {"w": torch.empty(2, 3), "b": freed(3), "extra": freed(3)}, strict=False)
    assert out["b"].tolist() == [1.0, 1.0, 1.0]
    assert out["extra"].untyped_storage().nbytes() == 0  # the target's own leaf, not 'b'


def test_meta_leaves_missing_from_the_checkpoint_are_not_taken_for_tied(saved):
    meta = {k: torch.empty(s, device="meta") for k, s in {"w": (2, 3), "b": (3,), "extra": (3,)}.items()}
    with pytest.raises(tsckpt.StructureMismatchError, match=r"missing from the checkpoint: 1 \('extra'\)"):
        tsckpt.restore(saved, meta)


def test_empty_tensors_are_not_tied(ckdir):
    tsckpt.save(ckdir, {"a": torch.empty(0)})
    with pytest.raises(tsckpt.StructureMismatchError, match=r"missing from the checkpoint: 1 \('b'\)"):
        tsckpt.restore(ckdir, {"a": torch.empty(0), "b": torch.empty(0)})


def test_really_tied_targets_are_still_recognised(ckdir):
    w = torch.randn(4, 3)
    tsckpt.save(ckdir, {"emb": w})  # a Hugging Face file leaves out the tied head
    t = torch.empty(4, 3)
    out = tsckpt.restore(ckdir, {"emb": t, "head": t}, inplace=True)
    assert out["head"] is t and torch.equal(t, w)


def test_freed_source_is_not_the_same_memory_as_a_freed_destination():
    from tsckpt.torch._state import same_memory

    both_freed = bool(same_memory(freed(3), freed(3)))  # (pytest's repr of a freed tensor crashes)
    assert both_freed is False
    a = torch.ones(3)
    assert same_memory(a, a.view(3)) and not same_memory(a, a.clone())


# ---- targets a restore cannot write --------------------------------------------------------


def test_inplace_into_freed_storage_is_refused_naming_the_leaf(saved):
    # it wrote nothing and succeeded
    with pytest.raises(tsckpt.LeafTypeError, match=r"'w': .*storage holds 0 bytes.*needs 24.*inplace=False") as ei:
        tsckpt.restore(saved, {"w": freed(2, 3), "b": torch.empty(3)}, inplace=True)
    assert isinstance(ei.value, TypeError)


@pytest.mark.slow
def test_inplace_with_a_cast_into_freed_storage_is_refused(tmp_path):
    # a cast raised torch's "data is not allocated yet", or crashed the process: in a fresh one
    r = _run(_FREED_CAST, tmp_path)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "refused: 'w': " in r.stdout and "0 bytes" in r.stdout, r.stdout


def test_inplace_into_a_shrunk_storage_is_refused(saved):
    t = torch.empty(2, 3)
    t.untyped_storage().resize_(8)  # two of six floats left: a write would run past it
    with pytest.raises(tsckpt.LeafTypeError, match=r"'w': .*storage holds 8 bytes.*needs 24"):
        tsckpt.restore(saved, {"w": t, "b": torch.empty(3)}, inplace=True)


def test_freed_storage_is_fine_as_a_target_not_written_in_place(saved):
    out = tsckpt.restore(saved, {"w": freed(2, 3), "b": freed(3)})
    assert out["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_a_freed_tensor_is_refused_by_save(ckdir):
    with pytest.raises(tsckpt.LeafTypeError, match=r"'w': .*storage"):
        tsckpt.save(ckdir, {"w": freed(2, 3)})


def _run(script: str, tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh process, so a crash (SIGSEGV) fails the test rather than killing pytest."""
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ck"), *args], capture_output=True, text=True, timeout=120
    )


_FREED_CAST = textwrap.dedent(
    """
    import sys, torch, tsckpt
    d = sys.argv[1]
    tsckpt.save(d, {"w": torch.arange(6.0).reshape(2, 3)})
    t = torch.empty(2, 3, dtype=torch.float16)
    t.untyped_storage().resize_(0)
    try:
        tsckpt.restore(d, {"w": t}, inplace=True)
    except tsckpt.LeafTypeError as e:
        print("refused:", e)
        sys.exit(3)
    print("restored")
    """
)


_READ_ONLY = textwrap.dedent(
    """
    import mmap, sys, warnings
    import numpy as np, torch, tsckpt
    warnings.simplefilter("ignore")
    d, how = sys.argv[1], sys.argv[2]
    tsckpt.save(d, {"w": torch.arange(4096.0), "small": torch.arange(6.0)})
    with open(d + ".bin", "wb") as f:
        f.write(bytes(4096 * 8))
    f = open(d + ".bin", "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.float32)[:4096]
    if how == "torch":
        target = torch.from_numpy(arr)
    elif how == "cast":  # float32 read, cast and copied in
        target = torch.from_numpy(np.frombuffer(mm, dtype=np.float64))
    elif how == "view":
        target = torch.from_numpy(arr).numpy()  # numpy says writable: torch does not know
    try:
        tsckpt.restore(d, {"w": target, "small": torch.empty(6)}, inplace=True)
    except tsckpt.LeafTypeError as e:
        print("refused:", e)
        sys.exit(3)
    print("restored")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch", "cast", "view"])
def test_inplace_into_read_only_memory_is_refused_not_a_crash(tmp_path, how):
    # it crashed the process (SIGSEGV): run in a fresh one
    r = _run(_READ_ONLY, tmp_path, how)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "refused: 'w': " in r.stdout and "read-only" in r.stdout, r.stdout


def test_read_only_memory_check_finds_the_mapping(tmp_path):
    from tsckpt._runtime.memory import unwritable

    path = tmp_path / "f.bin"
    path.write_bytes(bytes(3 * mmap.PAGESIZE))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        ro = np.frombuffer(mm, dtype=np.uint8)
        rw = np.zeros(1 << 20, dtype=np.uint8)
        start = ro.__array_interface__["data"][0]
        spans = [(start, ro.nbytes), (rw.__array_interface__["data"][0], rw.nbytes), (start + 10, 1), (0, 0)]
        assert unwritable(spans) == [0, 2]
        del ro
        mm.close()
