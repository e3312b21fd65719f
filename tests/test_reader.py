"""The lazy offline reader: tsckpt.open, indexing, partial reads, tsckpt.metadata."""

from __future__ import annotations

import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tsckpt

X = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)  # small_chunks: 2 shards of 4 rows, 1-row inner chunks


@pytest.fixture
def sharded(ckdir, small_chunks):
    tsckpt.save(ckdir, {"x": X, "bf": torch.arange(12.0).reshape(3, 4).to(torch.bfloat16), "step": 3, "g": {"a": np.arange(5)}})
    md = tsckpt.metadata(ckdir)["x"]
    assert (md.shard_shape, md.chunk_shape) == ((4, 256), (1, 256))
    return ckdir


@pytest.mark.parametrize(
    "index",
    [
        np.s_[5:9, :3],
        np.s_[5, :3],
        np.s_[-1],
        np.s_[-3:-1, -4:],
        np.s_[::3, 1:200:50],
        np.s_[7:1:-2, ::-100],
        np.s_[::-1],
        np.s_[..., 7],
        np.s_[2, ...],
        np.s_[1:3, ..., 4:6],
        np.s_[...],
        np.s_[:],
        np.s_[3, 255],
        np.s_[np.int64(2), -256],
        np.s_[4:4],
        np.s_[100:],
        np.s_[2:6],
    ],
)
def test_indexing_matches_numpy(sharded, index):
    arr = tsckpt.open(sharded)["x"]
    got = arr[index]
    want = X[index]
    assert type(got) is type(want) and got.dtype == np.float32  # a full int index gives a numpy scalar, as in numpy
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    t = arr.torch[index]
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), want)


basic_index = st.one_of(
    st.integers(-8, 7),
    st.builds(slice, st.none() | st.integers(-10, 10), st.none() | st.integers(-10, 10), st.none() | st.sampled_from([-3, -2, -1, 1, 2, 5])),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(basic_index, max_size=2), st.booleans())
def test_random_basic_indices_match_numpy(tmp_path_factory, idx, ellipsis_first):
    key = "x"
    d = tmp_path_factory.getbasetemp() / "reader_prop"
    if not d.exists():
        tsckpt.save(str(d), {key: X[:, :10]})
    want_src = X[:, :10]
    index = tuple(idx)
    if ellipsis_first:
        index = (Ellipsis, *index[1:])
    arr = tsckpt.open(str(d))[key]
    np.testing.assert_array_equal(arr[index], want_src[index])


def test_torch_view_has_the_logical_dtype(sharded):
    r = tsckpt.open(sharded)
    bf = r["bf"]
    assert bf.dtype == "bfloat16" and bf.shape == (3, 4)
    raw = bf[1:, ::2]
    assert raw.dtype == ml_dtypes.bfloat16
    t = bf.torch[1:, ::2]
    assert t.dtype == torch.bfloat16
    assert t.tolist() == [[4.0, 6.0], [8.0, 10.0]]
    assert bf.torch[::-1, -1].tolist() == [11.0, 7.0, 3.0]  # negative steps give a valid tensor
    assert bf.torch[2, 3].shape == () and bf.torch[2, 3].item() == 11.0


def test_complex32_reads(ckdir):
    c = torch.tensor([1 + 2j, 3 - 4j, 0.5j], dtype=torch.complex64).to(torch.complex32)
    tsckpt.save(ckdir, {"c": c})
    arr = tsckpt.open(ckdir)["c"]
    assert arr.shape == (3,) and arr.dtype == "complex32"
    pairs = arr[1:]  # numpy: float16 (re, im) pairs in a trailing dimension
    assert pairs.dtype == np.float16 and pairs.tolist() == [[3.0, -4.0], [0.0, 0.5]]
    t = arr.torch[::2]
    assert t.dtype == torch.complex32
    assert torch.view_as_real(t).tolist() == [[1.0, 2.0], [0.0, 0.5]]


def test_reader_mapping_and_values(sharded):
    r = tsckpt.open(sharded)
    assert list(r) == ["bf", "g/a", "step", "x"]
    assert len(r) == 4 and "x" in r and "g" not in r
    assert r["step"] == 3
    assert repr(r["x"]) == "LazyArray('x', shape=[8, 256], dtype=float32)"
    np.testing.assert_array_equal(np.asarray(r["g/a"]), np.arange(5))
    with pytest.raises(KeyError, match=r"'g' is not a leaf of .*; leaves below it: \['g/a'\]"):
        r["g"]
    with pytest.raises(KeyError, match=r"'nope' is not a leaf of .*`tsckpt ls` lists the paths"):
        r["nope"]


@pytest.mark.parametrize(
    "index, error, message",
    [
        (np.s_[8], IndexError, "index 8 is out of bounds for axis with size 8"),
        (np.s_[-9], IndexError, "index -9 is out of bounds for axis with size 8"),
        (np.s_[0, 256], IndexError, "index 256 is out of bounds for axis with size 256"),
        (np.s_[0, 0, 0], IndexError, "too many indices: array is 2-dimensional, but 3 were indexed"),
        (np.s_[..., 0, ...], IndexError, "an index can only have a single ellipsis"),
        (np.s_[[0, 1]], TypeError, "only integers, slices and '...' are valid indices, not list"),
        (np.s_[None], TypeError, "not NoneType"),
    ],
)
def test_bad_indices(sharded, index, error, message):
    with pytest.raises(error) as ei:
        tsckpt.open(sharded)["x"][index]
    assert message in str(ei.value)


# ---- partial reads: a slice reads only the chunks it touches -------------------------


def _shard_index(path, n_chunks):
    """(offset, nbytes) of each inner chunk of a sharding_indexed file (index at the end,
    n_chunks x 2 uint64 little-endian, then its crc32c)."""
    with open(path, "rb") as f:
        data = f.read()
    idx = data[-(16 * n_chunks + 4) : -4]
    vals = struct.unpack(f"<{2 * n_chunks}Q", idx)
    return list(zip(vals[::2], vals[1::2]))


def test_slice_reads_only_the_shard_files_it_touches(sharded):
    os.remove(os.path.join(sharded, "x", "c", "1", "0"))  # rows 4..7
    r = tsckpt.open(sharded)
    np.testing.assert_array_equal(r["x"][0:4], X[0:4])
    np.testing.assert_array_equal(r["x"][-5, 3:9], X[3, 3:9])
    np.testing.assert_array_equal(r["x"].torch[:4:3, -1].numpy(), X[:4:3, -1])
    for index in (np.s_[4], np.s_[3:5], np.s_[-1, :2], np.s_[::4]):
        with pytest.raises(tsckpt.CorruptCheckpointError) as ei:
            r["x"][index]
        assert "'x'" in str(ei.value) and "a chunk file is missing" in str(ei.value)
    with pytest.raises(tsckpt.CorruptCheckpointError, match="'x'"):
        tsckpt.restore(sharded)


def test_slice_reads_only_the_inner_chunks_it_touches(sharded):
    shard_file = os.path.join(sharded, "x", "c", "0", "0")  # rows 0..3, one inner chunk per row
    entries = _shard_index(shard_file, 4)
    assert [n for _, n in entries] == [256 * 4 + 4] * 4  # data + crc32c per chunk
    off, n = entries[2]  # row 2
    with open(shard_file, "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([b[0] ^ 0x01]))
    r = tsckpt.open(sharded)
    # rows 0, 1 and 3 live in the same file, but in other inner chunks: still readable
    np.testing.assert_array_equal(r["x"][0:2, 100:], X[0:2, 100:])
    np.testing.assert_array_equal(r["x"][3], X[3])
    np.testing.assert_array_equal(r["x"][4:], X[4:])
    with pytest.raises(tsckpt.CorruptCheckpointError) as ei:
        r["x"][2, 5]
    msg = str(ei.value)
    assert msg.startswith("'x' in ") and "checksum mismatch" in msg
    with pytest.raises(tsckpt.CorruptCheckpointError, match="checksum mismatch"):
        r["x"][1:3]


def test_metadata_reads_no_array_data(sharded):
    for name in ("x", "bf", "g"):  # chunk files and array nodes gone: only the root is read
        shutil.rmtree(os.path.join(sharded, name))
    md = tsckpt.metadata(sharded)
    assert md["x"] == tsckpt.ArrayMetadata(
        path="x", shape=(8, 256), dtype="float32", chunk_shape=(1, 256), shard_shape=(4, 256), nbytes=8192
    )
    assert md["bf"] == tsckpt.ArrayMetadata(path="bf", shape=(3, 4), dtype="bfloat16", chunk_shape=(3, 4), shard_shape=(3, 4), nbytes=24)
    assert md["g"]["a"].shape == (5,) and md["step"] == 3
    r = tsckpt.open(sharded)
    assert r.metadata() == md
    assert r["x"].metadata.nbytes == 8192 and r["x"].shape == (8, 256)
    with pytest.raises(tsckpt.CorruptCheckpointError):
        r["x"][0]
