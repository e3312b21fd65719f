"""Zero-copy restores (``copy=False``; tsckpt/_read/zerocopy.py, _codec/chunkmap.py,
_storage/filemap.py): results view copy-on-write mappings of their files, bit-exact, every
crc32c checked first; writes stay private; leaves a mapping cannot serve are copied and logged;
safetensors files map once per file."""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pytest
import torch

import tsckpt
import tsckpt.torch
import tsckpt._save.plan as plan
from tsckpt._base.types import ReadItem
from tsckpt._codec.chunkmap import map_chunks
from tsckpt._codec.route import place
from tsckpt._errors import CorruptCheckpointError
from tsckpt._ondisk.arrays import chunk_key
from tsckpt._ondisk.records import Chunking

safetensors_torch = pytest.importorskip("safetensors.torch")


def chunk_file(ck_dir, leaf, offsets=None) -> str:
    """The path of the chunk file of ``leaf`` starting at ``offsets`` (default: the first), as tsckpt names it."""
    rec = tsckpt.open(ck_dir).checkpoint.arrays[leaf]
    return os.path.join(str(ck_dir), chunk_key(rec, offsets or (0,) * len(rec.shape)))


def address(x) -> int:
    return x.data_ptr() if isinstance(x, torch.Tensor) else x.__array_interface__["data"][0]


def mapping_of(x) -> dict:
    """The /proc/self/smaps entry of the mapping holding ``x``'s first byte: its ``file``
    ("" for anonymous memory) and its fields in kB (``Anonymous``: pages copied into the process)."""
    at = address(x)
    entry: dict | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
                if entry is not None:
                    break
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                if lo <= at < hi:
                    entry = {"file": " ".join(head[5:])}
            elif entry is not None and head[0].endswith(":") and len(head) > 1 and head[1].isdigit():
                entry[head[0][:-1]] = int(head[1])
    assert entry is not None, "no mapping holds it"
    return entry


def mappings_of(path: str) -> int:
    """How many mappings of the file ``path`` the process holds."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(real))


@pytest.fixture
def one_chunk(monkeypatch):
    """Every array saved as one chunk file (no inner chunks), whatever its size."""
    import tsckpt._ondisk.chunking as chunking

    monkeypatch.setattr(chunking, "INNER_CHUNK_BYTES", 1 << 40)


TREE_DTYPES = {
    "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i8": torch.int8, "f64": torch.float64,
    "b": torch.bool, "i64": torch.int64, "c32": torch.complex32,
}


def tree():
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in TREE_DTYPES.items():
        base = torch.randn(33, 65, generator=g)
        if dtype == torch.complex32:
            out[name] = torch.complex(base, -base).to(torch.complex32)
        else:
            out[name] = (base * 50).to(dtype)
    out["np"] = np.arange(10 * 7, dtype=np.float32).reshape(10, 7)
    return out


def same_bytes(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        a = torch.view_as_real(a) if a.dtype == torch.complex32 else a
        b = torch.view_as_real(b) if b.dtype == torch.complex32 else b
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_results_are_bit_exact_views_of_their_files(tmp_path, one_chunk, caplog):
    want = tree()
    tsckpt.save(tmp_path / "ck", want)
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else np.empty_like(v) for k, v in want.items()}
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore(tmp_path / "ck", target, copy=False)
    assert f"{len(want)} leaves mapped from their files" in caplog.text and "none copied" in caplog.text
    for k, v in want.items():
        assert same_bytes(out[k], v), k
        assert out[k] is not target[k]
        where = mapping_of(out[k])
        assert where["file"] == os.path.realpath(chunk_file(tmp_path / "ck", k)), k
        assert where["Anonymous"] == 0, k  # nothing copied into the process's own memory
    # target=None: numpy arrays (complex32 a torch tensor), mapped too
    saved = tsckpt.restore(tmp_path / "ck", copy=False)
    assert same_bytes(saved["np"], want["np"]) and saved["np"].flags.writeable
    assert mapping_of(saved["f32"])["file"] == os.path.realpath(chunk_file(tmp_path / "ck", "f32"))


def test_writing_a_result_copies_only_that_page_never_the_file(tmp_path, one_chunk):
    w = torch.arange(4096 * 4, dtype=torch.float32)
    tsckpt.save(tmp_path / "ck", {"w": w})
    path = chunk_file(tmp_path / "ck", "w")
    before = open(path, "rb").read()
    out = tsckpt.restore(tmp_path / "ck", {"w": torch.empty_like(w)}, copy=False)
    out["w"][5] = -1.0
    out["w"].mul_(1)  # the training loop writes every page
    assert out["w"][5] == -1.0 and open(path, "rb").read() == before
    assert torch.equal(tsckpt.restore(tmp_path / "ck", {"w": torch.empty_like(w)})["w"], w)
    again = tsckpt.restore(tmp_path / "ck", copy=False)  # a new mapping sees the file, not the writes
    assert again["w"][5] == 5.0


def test_a_damaged_chunk_raises_before_anything_is_returned(tmp_path, one_chunk):
    tsckpt.save(tmp_path / "ck", {"a": torch.ones(1000), "b": torch.zeros(1000)})
    path = chunk_file(tmp_path / "ck", "b")
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="'b'"):
        tsckpt.restore(tmp_path / "ck", {"a": torch.empty(1000), "b": torch.empty(1000)}, copy=False)
    with pytest.raises(CorruptCheckpointError, match="'b'"):
        tsckpt.open(tmp_path / "ck", copy=False)["b"][...]
    assert mappings_of(path) == 0  # the damaged file's mapping went with the failed check


def test_a_cast_is_copied_and_logged(tmp_path, one_chunk, caplog):
    w = torch.randn(100)
    tsckpt.save(tmp_path / "ck", {"w": w, "v": torch.arange(5)})
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore(tmp_path / "ck", {"w": torch.empty(100, dtype=torch.float64), "v": torch.empty(5, dtype=torch.int64)}, copy=False)
    assert torch.equal(out["w"], w.double()) and out["w"].dtype == torch.float64
    assert "1 leaves mapped from their files" in caplog.text
    assert "1 copied instead: 'w': a cast from float32 to float64" in caplog.text
    assert mapping_of(out["w"])["file"] != os.path.realpath(chunk_file(tmp_path / "ck", "w"))  # new memory


def test_a_region_other_than_one_chunk_is_copied_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(plan, "choose_chunking", lambda shape, itemsize, cuts=(), **_: Chunking((4,), None))
    w = np.arange(8, dtype=np.float32)
    tsckpt.save(tmp_path / "ck", {"w": w})
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        whole = tsckpt.restore(tmp_path / "ck", copy=False)["w"]
        half = tsckpt.restore(tmp_path / "ck", {"w": tsckpt.ShardedArray(np.empty(4, np.float32), (8,), (4,))}, copy=False)
    assert whole.tobytes() == w.tobytes() and half["w"].local.tobytes() == w[4:].tobytes()
    assert "'w': the region is not one whole stored chunk (a resharded region" in caplog.text
    assert "'w': its result (a ShardedArray) is built around the memory a read fills" in caplog.text
    # a lazy read of exactly one chunk maps it
    reader = tsckpt.open(tmp_path / "ck", copy=False)
    second = reader["w"][4:8]
    assert second.tobytes() == w[4:].tobytes()
    assert mapping_of(second)["file"] == os.path.realpath(chunk_file(tmp_path / "ck", "w", (4,)))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        assert reader["w"][2:6].tobytes() == w[2:6].tobytes()
    assert "'w': the region is not one whole stored chunk" in caplog.text


def test_a_chunk_file_asked_for_twice_is_mapped_once(tmp_path, one_chunk):
    tsckpt.save(tmp_path / "ck", {"w": torch.arange(100.0)})
    ck = tsckpt.open(tmp_path / "ck").checkpoint
    item = ReadItem("w", (0,), (100,))
    first, second = map_chunks(ck, place(ck.data(), ck.layout), [item, item])
    assert first is second and first.tobytes() == torch.arange(100.0).numpy().tobytes()
    assert mappings_of(chunk_file(tmp_path / "ck", "w")) == 1


def test_inner_chunks_and_in_place_targets_are_copied(tmp_path, small_chunks, caplog):
    w = torch.randn(64, 64)
    tsckpt.save(tmp_path / "ck", {"w": w, "b": torch.ones(3)})
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore(tmp_path / "ck", {"w": torch.empty(64, 64), "b": torch.empty(3)}, copy=False)
        target = {"w": torch.empty(64, 64), "b": torch.empty(3)}
        same = tsckpt.restore(tmp_path / "ck", target, inplace=True, copy=False)
    assert torch.equal(out["w"], w) and torch.equal(same["w"], w) and same["b"] is target["b"]
    assert "'w': it is stored in shard files of inner chunks" in caplog.text
    assert "'b', 'w': in place: it is copied into the target's own memory" in caplog.text


def test_object_storage_is_copied(caplog):
    tsckpt.save("memory://zerocopy/ck", {"w": torch.arange(6)})
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore("memory://zerocopy/ck", {"w": torch.empty(6, dtype=torch.int64)}, copy=False)
    assert out["w"].tolist() == list(range(6))
    assert "'w': the checkpoint is not a plain one on a local file system" in caplog.text


def test_compressed_arrays_of_another_format_are_copied(tmp_path, caplog):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ocp = pytest.importorskip("orbax.checkpoint")
    jnp = pytest.importorskip("jax.numpy")
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)  # zstd-compressed chunks
    ocp.Checkpointer(handler).save(tmp_path / "o", args=ocp.args.PyTreeSave({"w": jnp.arange(64, dtype=jnp.float32)}))
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore(tmp_path / "o", copy=False)
    assert out["w"].tobytes() == np.arange(64, dtype=np.float32).tobytes()
    assert "'w': orbax checkpoints' arrays are encoded by their own codecs (compression)" in caplog.text


def test_a_torch_save_file_is_copied(tmp_path, caplog):
    torch.save({"w": torch.arange(6.0)}, tmp_path / "w.pt")
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore(tmp_path / "w.pt", {"w": torch.empty(6)}, copy=False)
    assert out["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert "'w': torch checkpoints' arrays are read, not mapped (of other formats, only safetensors files map)" in caplog.text


def test_a_safetensors_file_maps_once_for_all_its_tensors(tmp_path, caplog):
    want = {f"layer{i}.weight": torch.randn(17 + i, 8) for i in range(40)}
    want["h"] = torch.randn(5).to(torch.float16)
    want["bf"] = torch.randn(3).to(torch.bfloat16)
    want["i8"] = torch.arange(3, dtype=torch.int8)
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(want, path)
    target = {k: torch.empty_like(v) for k, v in want.items()}
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        out = tsckpt.restore(path, target, copy=False)
    assert all(same_bytes(out[k], v) for k, v in want.items())
    assert f"{len(want)} leaves mapped from their files" in caplog.text
    assert mappings_of(path) == 1
    assert all(mapping_of(v)["file"] == os.path.realpath(path) for v in out.values())
    out["h"].fill_(0)  # copy-on-write: the file keeps its bytes
    assert same_bytes(safetensors_torch.load_file(path)["h"], want["h"])
    # open() maps too: read-only numpy arrays when asked, torch views stay writable
    reader = tsckpt.open(path, copy="read-only")
    arr = reader["layer3.weight"][...]
    assert not arr.flags.writeable and arr.tobytes() == want["layer3.weight"].numpy().tobytes()
    assert mapping_of(arr)["file"] == os.path.realpath(path)
    assert torch.equal(reader["layer3.weight"].torch[...], want["layer3.weight"])


def test_a_hugging_face_directory_maps_each_shard_file_once(tmp_path):
    first = {f"a{i}": torch.randn(9, 4) for i in range(5)}
    second = {f"b{i}": torch.randn(3) for i in range(5)}
    safetensors_torch.save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors_torch.save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tsckpt.restore(str(tmp_path), {k: torch.empty_like(v) for k, v in {**first, **second}.items()}, copy=False)
    assert all(torch.equal(out[k], v) for k, v in {**first, **second}.items())
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert mappings_of(str(tmp_path / name)) == 1


def test_the_option_is_checked_and_a_manager_takes_it(tmp_path, one_chunk):
    with pytest.raises(ValueError, match="copy must be True"):
        tsckpt.restore(tmp_path / "none", copy="yes")
    manager = tsckpt.CheckpointManager(tmp_path / "run")
    manager.save(1, {"w": torch.arange(10.0)})
    manager.wait()
    out = manager.restore(1, {"w": torch.empty(10)}, copy=False)
    assert out["w"].tolist() == list(range(10)) and mapping_of(out["w"])["file"].endswith(
        os.path.relpath(chunk_file(manager.directory(1), "w"), manager.directory(1))
    )
    manager.close()


def test_a_meta_model_restored_with_copy_false_trains_on_mapped_parameters(tmp_path, one_chunk):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    tsckpt.torch.save(tmp_path / "ck", model)
    with torch.device("meta"):
        fresh = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    tsckpt.torch.restore(tmp_path / "ck", fresh, copy=False)
    weight = fresh[0].weight
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert torch.equal(weight, model[0].weight)
    leaf = next(p for p in tsckpt.open(tmp_path / "ck") if p.endswith("0.weight"))
    path = chunk_file(tmp_path / "ck", leaf)
    assert mapping_of(weight)["file"] == os.path.realpath(path)
    before = open(path, "rb").read()
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh(torch.ones(2, 16)).sum().backward()
    opt.step()
    assert not torch.equal(fresh[0].weight, model[0].weight) and open(path, "rb").read() == before


# ---- found trying the product from outside ------------------------------------------------


def test_leaves_saved_as_one_tensor_come_back_apart_where_the_target_keeps_them_apart(tmp_path):
    """A tied pair saved once (an alias) restored into a target holding two tensors: a view of
    one mapping for both would tie them (a write to one shows in the other), so the second is
    copied, and said so; a target holding one object for both gets one mapping."""
    w = torch.zeros(4)
    tsckpt.save(tmp_path / "ck", {"w": w, "w_ema": w})
    for copy in (True, False):
        got = tsckpt.restore(tmp_path / "ck", {"w": torch.empty(4), "w_ema": torch.empty(4)}, copy=copy)
        got["w"].add_(1.0)
        assert got["w_ema"].tolist() == [0.0] * 4, copy
    one = torch.empty(4)
    tied = tsckpt.restore(tmp_path / "ck", {"w": one, "w_ema": one}, copy=False)
    assert address(tied["w"]) == address(tied["w_ema"])


def test_aliases_of_a_safetensors_file_come_back_apart_and_the_log_says_why(tmp_path, caplog):
    w = torch.zeros(4)
    tsckpt.save(tmp_path / "ck", {"w": w, "w_ema": w})
    tsckpt.convert(tmp_path / "ck", tmp_path / "m.safetensors")
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        got = tsckpt.restore(tmp_path / "m.safetensors", {"w": torch.empty(4), "w_ema": torch.empty(4)}, copy=False)
    got["w"].fill_(5.0)
    assert got["w_ema"].tolist() == [0.0] * 4
    assert "1 leaves mapped from their files (16 B); 1 copied instead: 'w_ema': it was saved as the same tensor as 'w'" in caplog.text


@pytest.mark.parametrize("copy", [True, False])
def test_a_safetensors_file_replaced_after_open_is_refused_not_decoded_with_the_old_header(tmp_path, copy):
    f = str(tmp_path / "m.safetensors")
    safetensors_torch.save_file({"a": torch.full((16,), 1.0), "b": torch.full((16,), 2.0)}, f)
    ck = tsckpt.open(f, copy=copy)
    safetensors_torch.save_file({"b": torch.full((16,), 9.0), "a": torch.full((15,), 8.0)}, f + ".new")
    os.replace(f + ".new", f)
    with pytest.raises(tsckpt.CheckpointReplacedError, match=r"m\.safetensors: replaced or rewritten since its header was read \(tensor 'a'"):
        ck["a"][...]


def test_a_safetensors_file_rewritten_in_place_at_the_same_size_is_refused(tmp_path):
    f = str(tmp_path / "m.safetensors")
    safetensors_torch.save_file({"a": torch.full((16,), 1.0)}, f)
    ck = tsckpt.open(f, copy=False)
    st = os.stat(f)
    with open(f, "r+b") as out:  # the same size, new bytes, a later time
        out.seek(st.st_size - 4)
        out.write(b"\x00\x00\x80\x7f")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(tsckpt.CheckpointReplacedError):
        ck["a"][...]


def test_mapped_results_hold_no_file_descriptor(tmp_path, one_chunk):
    tsckpt.save(tmp_path / "ck", {f"l{i}": np.full(8, float(i), np.float32) for i in range(64)})
    before = len(os.listdir("/proc/self/fd"))
    got = tsckpt.restore(tmp_path / "ck", copy=False)
    assert mapping_of(got["l7"])["file"].endswith("l7/c.0")  # mapped: the one-chunk file of the array
    assert len(os.listdir("/proc/self/fd")) == before
    assert [float(got[f"l{i}"][0]) for i in range(64)] == [float(i) for i in range(64)]


def test_a_small_tensor_of_a_large_safetensors_file_reads_only_its_pages(tmp_path):
    f = str(tmp_path / "big.safetensors")
    safetensors_torch.save_file({"small": torch.ones(16), "big": torch.randn(2048, 1024)}, f)  # 8 MiB
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    got = tsckpt.open(f, copy=False)["small"][...]
    resident = mapping_of(got)["Rss"]
    assert got.tolist() == [1.0] * 16
    assert resident <= 1024, f"{resident} kB of the 8 MiB file faulted in for a 64-byte tensor"


def test_read_only_results_are_read_only_whether_mapped_or_copied(tmp_path):
    tsckpt.save(tmp_path / "ck", {"embed": np.zeros((1024, 256), np.float32), "norm": np.ones(64, np.float32)})
    ck = tsckpt.open(tmp_path / "ck", copy="read-only")
    assert [ck[k][...].flags.writeable for k in ("embed", "norm")] == [False, False]  # embed: shard files, copied
    got = tsckpt.restore(tmp_path / "ck", copy="read-only")
    assert {k: v.flags.writeable for k, v in got.items()} == {"embed": False, "norm": False}
    with pytest.raises(ValueError, match="read-only"):
        got["embed"][0, 0] = 1.0


def test_np_array_of_a_lazy_array_is_an_array_of_its_own(tmp_path):
    tsckpt.save(tmp_path / "ck", {"a": np.arange(8, dtype=np.float32)})
    for copy in (True, False, "read-only"):
        lazy = tsckpt.open(tmp_path / "ck", copy=copy)["a"]
        a = np.array(lazy)
        a[0] = 7.0  # writable and its own
        assert a.flags.owndata and np.array(lazy)[0] == 0.0, copy
        assert np.array(lazy, dtype=np.float64).dtype == np.float64


def test_lazy_reads_log_each_reason_once_per_reader(tmp_path, caplog):
    tsckpt.save(tmp_path / "ck", {f"l{i}": np.zeros((512, 512), np.float32) for i in range(5)})  # shard files
    ck = tsckpt.open(tmp_path / "ck", copy=False)
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        for i in range(5):
            ck[f"l{i}"][...]
    assert caplog.text.count("it is stored in shard files of inner chunks") == 1


def test_a_save_without_inner_chunks_restores_mapped_and_reads_slices(tmp_path, caplog):
    """Arrays above the inner chunk size, saved with inner_chunks=False (also through convert),
    are mapped by copy=False; a slice still reads (the whole file's chunk)."""
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 768, generator=g) for i in range(3)}  # 3 MiB each
    tsckpt.save(tmp_path / "ck", state, inner_chunks=False)
    assert sorted(os.listdir(tmp_path / "ck" / "w0")) == ["c.0.0", "zarr.json"]
    with caplog.at_level(logging.INFO, logger="tsckpt"):
        got = tsckpt.restore(tmp_path / "ck", {k: torch.empty_like(v) for k, v in state.items()}, copy=False)
    assert "3 leaves mapped from their files (9.0 MiB), none copied" in caplog.text
    assert all(torch.equal(got[k], v) and mapping_of(got[k])["file"].endswith(f"{k}/c.0.0") for k, v in state.items())
    assert np.array_equal(tsckpt.open(tmp_path / "ck")["w1"][5:9, 100:104], state["w1"][5:9, 100:104].numpy())
    safetensors_torch.save_file(state, str(tmp_path / "m.safetensors"))
    tsckpt.convert(tmp_path / "m.safetensors", tmp_path / "conv", inner_chunks=False, max_inflight_bytes=64 << 20)
    assert sorted(os.listdir(tmp_path / "conv" / "w2")) == ["c.0.0", "zarr.json"]
    with pytest.raises(ValueError, match="inner_chunks=False applies to a tsckpt destination, not safetensors"):
        tsckpt.convert(tmp_path / "ck", tmp_path / "x.safetensors", inner_chunks=False)


@pytest.mark.parametrize("copy", [False, "read-only"])
def test_a_safetensors_file_rewritten_after_its_first_tensor_was_mapped_is_refused(tmp_path, copy):
    """The file's one mapping is made at its first mapped tensor; every later one checks the
    file again (a rewrite in place would show its new bytes through the mapping), even when
    the rewrite set the modification time back."""
    f = str(tmp_path / "m.safetensors")
    safetensors_torch.save_file({"a": torch.full((3,), 1.0), "b": torch.tensor([5.0, 6.0, 7.0])}, f)
    ck = tsckpt.open(f, copy=copy)
    assert ck["a"][...].tolist() == [1.0] * 3
    st = os.stat(f)
    data = bytearray(open(f, "rb").read())
    data[-12:] = bytes(12)  # b's bytes, in place
    with open(f, "r+b") as out:
        out.write(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old modification time back
    with pytest.raises(tsckpt.CheckpointReplacedError, match="replaced or rewritten since its header was read"):
        ck["b"][...]
