"""The lazy offline reader: tsckpt.open, indexing, partial reads, tsckpt.metadata."""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
from hypothesis import given
from hypothesis import strategies as st

import tsckpt
from tests.stored import array_store, read_key, write_key
from tsckpt._ondisk.arrays import array_node, stored_files, stored_size
from tsckpt._ondisk.records import ArrayRecord

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


# ---- records checked against the bytes stored, before anything is allocated -----------

def damage_record(ck: str, leaf: str, **fields) -> None:
    """Change fields of ``leaf``'s record and write its array node to agree, so that opening
    the array succeeds and the damage reaches the reads."""
    with open(os.path.join(ck, "zarr.json")) as f:
        root = json.load(f)
    rec = next(a for a in root["attributes"]["tsckpt"]["arrays"] if a["path"] == leaf)
    rec.update(fields)
    with open(os.path.join(ck, "zarr.json"), "w") as f:
        json.dump(root, f)
    write_key(ck, f"{leaf}/zarr.json", json.dumps(array_node(ArrayRecord.from_json(rec))).encode())


def in_subprocess(code: str) -> str:
    """Run ``code`` with this tsckpt in a fresh process (a crash there fails the test instead
    of killing the test run); its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(tsckpt.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


_HUGE = 10**15
_EVERY_READER = '''
import sys, numpy as np, tsckpt
d, leaf = sys.argv[1], sys.argv[2]
def attempt(name, fn):
    try:
        fn()
        print(name, "ok")
    except tsckpt.TsckptError as e:
        print(name, type(e).__name__, str(e).replace("\\n", " "))
attempt("lazy", lambda: tsckpt.open(d)[leaf][:4])
attempt("restore", lambda: tsckpt.restore(d))
attempt("restore_into", lambda: tsckpt.restore(d, {"x": np.zeros((8, 256), np.float32), "small": np.zeros(3, np.float32)}))
r = tsckpt.verify(d, progress=False)
print("verify", r.ok, r.bad.get(leaf, "").replace("\\n", " "))
'''


def _every_reader(ck: str, leaf: str) -> dict[str, str]:
    out = in_subprocess(f"import sys; sys.argv = ['', {ck!r}, {leaf!r}]\n" + _EVERY_READER)
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.fixture
def two(ckdir, small_chunks, layout):
    tsckpt.save(ckdir, {"x": X, "small": np.array([1.5, 2.5, 3.5], np.float32)}, layout=layout)
    return ckdir


@pytest.mark.slow
@pytest.mark.parametrize(
    "leaf, fields, want",
    [
        # a plain chunk said to hold 4 PB: TensorStore allocated the chunk before reading it
        ("small", {"shape": [_HUGE], "shard_shape": [_HUGE]}, "small/c.0 holds fewer than the 4000000000000004 bytes"),
        ("small", {"shard_shape": [_HUGE]}, "small/c.0 holds fewer than the 4000000000000004 bytes"),
        # 3 * 10**14 shard files said to exist: the first missing one is named
        ("small", {"shape": [_HUGE], "shard_shape": [3]}, "a chunk file is missing (small/c/0 does not exist;"),
        # sharded: inner chunks and a shard index far larger than the files
        ("x", {"shape": [8, _HUGE], "shard_shape": [4, _HUGE], "chunk_shape": [1, _HUGE]}, "x/c/0/0 holds fewer than"),
        ("x", {"shard_shape": [4, 2**40], "chunk_shape": [1, 256]}, "x/c/0/0 holds fewer than"),
        # a shard said to hold 2**62 bytes or more: no file can
        ("x", {"dtype": "complex128", "shard_shape": [2**20, 2**38], "chunk_shape": [2**20, 2**38]},
         "x/c.0.0 cannot hold the 4611686018427387928 bytes"),  # index 20 + chunk 2**62 + 4
        # a million 1-byte inner chunks: TensorStore's bookkeeping alone took a gigabyte
        ("small", {"dtype": "int8", "shape": [2**20], "shard_shape": [2**20], "chunk_shape": [1]}, "small/c.0 holds fewer than"),
    ],
)
def test_a_record_larger_than_its_files_is_refused_before_any_allocation(two, leaf, fields, want):
    damage_record(two, leaf, **fields)
    got = _every_reader(two, leaf)
    assert got["restore"].startswith(f"CorruptCheckpointError '{leaf}' in {two}: {want}"), got["restore"]
    assert "'shape'" in got["restore"] and "'shard_shape'" in got["restore"], got["restore"]  # the fields it blames
    # a read of 4 elements touches one or two files: beyond them, missing files do not matter
    assert got["lazy"].startswith(f"CorruptCheckpointError '{leaf}' in {two}: "), got["lazy"]
    assert want in got["lazy"] or "a chunk file is missing" in got["lazy"], got["lazy"]
    assert got["verify"].startswith(f"False {want}"), got["verify"]
    assert got["restore_into"].startswith(("ShapeMismatchError", f"CorruptCheckpointError '{leaf}' in {two}: {want}"))


def test_an_empty_array_with_huge_extents_is_read_without_enumerating_them(two):
    damage_record(two, "small", shape=[0, 2**40], shard_shape=[1, 1])
    assert tsckpt.restore(two)["small"].shape == (0, 2**40)
    assert tsckpt.open(two)["small"][...].shape == (0, 2**40)
    assert tsckpt.verify(two, progress=False).ok


@pytest.mark.parametrize("shape", [[0, 2**61], [2**30, 2**29], [2**59]])
def test_extents_too_large_for_any_array_are_an_invalid_record(two, shape):
    damage_record(two, "small", shape=shape, shard_shape=[1] * len(shape))
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(two)
    assert f"'shape' {shape} is not a list of non-negative integers with a product under 2**59" in str(info.value)


def test_probes_agree_with_the_files_of_a_valid_checkpoint(ckdir, small_chunks, layout, monkeypatch):
    """The sizes the check expects are exactly those TensorStore writes: full and edge shards,
    inner chunks past the array's end, complex32's extra dimension, 0-d and bool arrays."""
    import tsckpt._ondisk.backing as backing

    tree = {
        "edge": np.arange(10 * 300, dtype=np.float32).reshape(10, 300),  # shards (3, 300) of (1, 150) chunks
        "c32": torch.complex(torch.arange(700.0), torch.ones(700)).to(torch.complex32),
        "scalar": np.float64(2.5),
        "flags": np.arange(5000) % 3 == 0,
        "empty": np.zeros((0, 7), np.int16),
    }
    tsckpt.save(ckdir, tree, layout=layout)
    ck = tsckpt.open(ckdir).checkpoint
    store = array_store(ckdir)
    for path, rec in ck.arrays.items():
        expected = dict(stored_files(rec))
        listed = store.list(ts.KvStore.KeyRange(f"{path}/".encode(), f"{path}0".encode())).result()
        assert sorted(expected) == sorted(k.decode() for k in listed if not k.endswith(b"/zarr.json")), path
        sizes = {key: len(store.read(key).result().value) for key in expected}
        assert sizes == expected, path
        assert stored_size(rec).nbytes == sum(sizes.values()) and stored_size(rec).files == len(sizes)
    monkeypatch.setattr(backing, "UNCHECKED_BYTES", 0)  # every read is checked
    out = tsckpt.restore(ckdir)
    np.testing.assert_array_equal(out["edge"], tree["edge"])
    np.testing.assert_array_equal(tsckpt.open(ckdir)["flags"][4990:], tree["flags"][4990:])
    assert tsckpt.verify(ckdir, progress=False).ok
    write_key(ckdir, "edge/c/3/0", read_key(ckdir, "edge/c/3/0")[:-1])  # the edge shard, one byte short
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"^'edge' in .*: edge/c/3/0 holds fewer than the 1308 bytes"):
        tsckpt.open(ckdir)["edge"][9]
    np.testing.assert_array_equal(tsckpt.open(ckdir)["edge"][:9], tree["edge"][:9])  # the rest still reads


def test_a_read_checks_only_the_files_it_touches(two, monkeypatch):
    import tsckpt._ondisk.backing as backing

    monkeypatch.setattr(backing, "UNCHECKED_BYTES", 0)
    write_key(two, "x/c/1/0", None)  # rows 4..7
    arr = tsckpt.open(two)["x"]
    np.testing.assert_array_equal(arr[:4], X[:4])
    with pytest.raises(tsckpt.CorruptCheckpointError, match=r"a chunk file is missing \(x/c/1/0 does not exist"):
        arr[3:5]


@pytest.mark.slow
def test_an_array_node_nested_too_deeply_is_corrupt_not_a_crash(two):
    """TensorStore crashed the process parsing such a node; restore raised RecursionError."""
    for depth in (1000, 100_000):
        write_key(two, "x/zarr.json", ("[" * depth + "]" * depth).encode())
        write_key(two, "small/zarr.json", ("[" * depth + "]" * depth).encode())
        out = in_subprocess(f"""
import tsckpt
for name, fn in [("restore", lambda: tsckpt.restore({two!r})), ("lazy", lambda: tsckpt.open({two!r})["x"][0])]:
    try:
        fn()
    except tsckpt.CorruptCheckpointError as e:
        print(name, e)
r = tsckpt.verify({two!r}, progress=False)
print("verify", sorted(r.bad.items()))
""")
        lines = out.splitlines()
        assert lines[0].startswith("restore '") and "/zarr.json is not valid JSON" in lines[0], out
        assert lines[1].startswith(f"lazy 'x' in {two}: x/zarr.json is not valid JSON"), out
        assert "its zarr.json is not valid JSON" in lines[2] and "'small'" in lines[2] and "'x'" in lines[2], out


# ---- the root metadata: every field checked before it is used -------------------------


def edit_root(ck: str, fn) -> None:
    with open(os.path.join(ck, "zarr.json")) as f:
        root = json.load(f)
    fn(root)
    with open(os.path.join(ck, "zarr.json"), "w") as f:
        json.dump(root, f)


@pytest.fixture
def tree_ck(ckdir):
    tsckpt.save(ckdir, {"b": {"z": 1, "a": np.arange(2)}, "c": [2.5, "s"]})
    return ckdir


@pytest.mark.parametrize(
    "edit, error, message",
    [
        # errors before the checks: AttributeError, TypeError (unhashable), struct.error
        (lambda r: r.update(attributes=[1]), tsckpt.NotACheckpointError, "no 'tsckpt' attributes"),
        (lambda r: r["attributes"]["tsckpt"]["values"]["b/z"].update(type=["int"]), tsckpt.CorruptCheckpointError,
         "the value of 'b/z' in the root metadata is invalid: unknown value type ['int']"),
        (lambda r: r["attributes"]["tsckpt"]["values"]["c/0"].update(bits="00"), tsckpt.CorruptCheckpointError,
         "the value of 'c/0' in the root metadata is invalid: 'bits' of a float must be 16 hex digits, found '00'"),
        (lambda r: r["attributes"]["tsckpt"]["values"]["c/1"].update(value=None), tsckpt.CorruptCheckpointError,
         "the value of 'c/1' in the root metadata is invalid: 'value' must be a string for type 'str', found None"),
        (lambda r: r["attributes"]["tsckpt"].update(leaves="b/ab/zc/0c/1"), tsckpt.CorruptCheckpointError,
         "root metadata is malformed ('leaves' is a JSON string, expected a list of leaf paths)"),
        (lambda r: r["attributes"]["tsckpt"].update(aliases=["b/a"]), tsckpt.CorruptCheckpointError,
         "root metadata is malformed ('aliases' is not an object mapping leaf paths to paths)"),
        (lambda r: r["attributes"]["tsckpt"].update(format_version=0), tsckpt.FormatVersionError,
         "'format_version' is 0, which no tsckpt writes (versions start at 1)"),
        (lambda r: r["attributes"]["tsckpt"].update(format_version=True), tsckpt.FormatVersionError,
         "written with format version True by tsckpt"),
        # a dict's keys: unhashable, repeated, or swapped against the leaves
        (lambda r: r["attributes"]["tsckpt"]["structure"]["children"][0]["keys"].__setitem__(0, ["a"]),
         tsckpt.CorruptCheckpointError, "it has a dict node with the key ['a'] (a str or int expected)"),
        (lambda r: r["attributes"]["tsckpt"]["structure"]["children"][0]["keys"].__setitem__(0, "z"),
         tsckpt.CorruptCheckpointError, "it has a dict node with a repeated key"),
        (lambda r: r["attributes"]["tsckpt"]["structure"]["children"][0].update(order=[1, "0"]),
         tsckpt.CorruptCheckpointError, "it has a dict node whose order is not a permutation of its children"),
        # without a structure, the paths themselves must make a tree
        (lambda r: r["attributes"]["tsckpt"].update(structure=None, leaves=["b", "b/a", "b/z", "c/0", "c/1"],
                                                    values={**r["attributes"]["tsckpt"]["values"], "b": {"type": "int", "value": 1}}),
         tsckpt.CorruptCheckpointError, "its leaf 'b' also has leaves below it"),
        (lambda r: r["attributes"]["tsckpt"].update(structure=None, leaves=["b/a", "b/%7A", "c/0", "c/1"], values={
            "b/%7A" if p == "b/z" else p: v for p, v in r["attributes"]["tsckpt"]["values"].items()}),
         tsckpt.CorruptCheckpointError, "its leaf path 'b/%7A' is not a path tsckpt writes"),  # 'z' escaped needlessly
    ],
)
def test_a_damaged_root_field_is_named(tree_ck, edit, error, message):
    edit_root(tree_ck, edit)
    for call in (tsckpt.restore, tsckpt.open, tsckpt.metadata):
        with pytest.raises(error) as info:
            call(tree_ck)
        assert message in str(info.value), str(info.value)


def test_a_null_order_is_no_order(tree_ck):
    edit_root(tree_ck, lambda r: r["attributes"]["tsckpt"]["structure"].update(order=None))
    out = tsckpt.restore(tree_ck)
    assert out["b"]["z"] == 1 and out["c"] == [2.5, "s"]
    assert tsckpt.verify(tree_ck, progress=False).ok


def test_raw_bits_restore_only_into_their_own_dtype(ckdir):
    """A record whose dtype says raw bits made a float target fail inside torch's copy."""
    bits = torch.arange(6, dtype=torch.int16).view(torch.bits16)
    tsckpt.save(ckdir, {"b": bits})
    for target, shown in ((torch.zeros(6, dtype=torch.bfloat16), "torch.bfloat16"), (np.zeros(6, np.uint16), "uint16")):
        with pytest.raises(tsckpt.LeafTypeError) as info:
            tsckpt.restore(ckdir, {"b": target})
        assert str(info.value) == (
            f"'b': stored dtype bits16 cannot be restored into the {shown} target: raw bits cast to no other dtype; "
            "use a target of the stored dtype"
        )
    assert tsckpt.restore(ckdir, {"b": torch.zeros(6, dtype=torch.int16).view(torch.bits16)})["b"].view(torch.int16).tolist() == list(range(6))


def test_dtypes_torch_cannot_cast_are_refused_for_tensor_targets(ckdir):
    """A record whose dtype says int4 made a float tensor target fail inside torch's copy
    (NotImplementedError); one torch has no dtype for, with a KeyError."""
    tsckpt.save(ckdir, {"i4": np.arange(-3, 3).astype(ml_dtypes.int4), "e3": np.ones(2, ml_dtypes.float8_e3m4)})
    target = {"i4": np.zeros(6, np.int8), "e3": np.zeros(2, np.float32)}
    for leaf, tensor in (("i4", torch.zeros(6)), ("e3", torch.zeros(2))):
        with pytest.raises(tsckpt.LeafTypeError) as info:
            tsckpt.restore(ckdir, {**target, leaf: tensor})
        stored = "int4" if leaf == "i4" else "float8_e3m4"
        assert str(info.value) == (
            f"'{leaf}': stored dtype {stored} cannot be cast to torch.float32 by torch; use a {stored} tensor or a "
            "numpy array as the target"
        )
    out = tsckpt.restore(ckdir, target)
    assert out["i4"].tolist() == list(range(-3, 3)) and out["e3"].tolist() == [1.0, 1.0]


def test_a_torch_kind_needs_a_torch_dtype(ckdir):
    tsckpt.save(ckdir, {"e3": np.ones(2, ml_dtypes.float8_e3m4)})
    edit_root(ckdir, lambda r: r["attributes"]["tsckpt"]["arrays"][0].update(kind="torch"))
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(ckdir, as_saved=True)  # raised KeyError
    assert "the record of array 'e3' in the root metadata is invalid: 'kind' is 'torch' but torch has no dtype " \
        "'float8_e3m4'" in str(info.value)


def test_a_torch_kind_needs_a_torch_dtype_where_torch_was_not_imported_on_load(ckdir, monkeypatch):
    """A process without torch skips the load's check (it reads the array as numpy); as_saved imports
    torch and refuses the record then."""
    from tsckpt._ondisk import root

    tsckpt.save(ckdir, {"e3": np.ones(2, ml_dtypes.float8_e3m4)})
    edit_root(ckdir, lambda r: r["attributes"]["tsckpt"]["arrays"][0].update(kind="torch"))
    monkeypatch.setattr(root, "loaded", lambda: None)
    assert tsckpt.restore(ckdir)["e3"].tolist() == [1.0, 1.0]
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(ckdir, as_saved=True)
    assert str(info.value) == (
        "'e3': its record's 'kind' is 'torch' but torch has no dtype 'float8_e3m4'; restore it without "
        "as_saved=True to read it as a numpy array"
    )


# ---- a checkpoint replaced or deleted while it is read ---------------------------------------


def _leaves(seed: int) -> dict:
    return {f"l{i:02d}": np.full((16, 8), seed * 100 + i, dtype=np.int64) for i in range(12)}


REPLACED = "the checkpoint was replaced or deleted while it was being read .*; nothing read since it was opened is returned"
DELETED = REPLACED + ".*its root zarr.json is gone"


def test_a_reader_never_mixes_two_checkpoints(ckdir, layout):
    """Another save overwrites the checkpoint while a reader holds it: every later read raises
    CheckpointReplacedError, none returns the new checkpoint's data."""
    tsckpt.save(ckdir, _leaves(1), layout=layout)
    reader = tsckpt.open(ckdir)
    assert reader["l00"][0, 0] == 100
    tsckpt.save(ckdir, _leaves(2), layout=layout, overwrite=True)
    for leaf in ("l05", "l00"):  # not yet read, and read before
        with pytest.raises(tsckpt.CheckpointReplacedError, match=REPLACED) as e:
            reader[leaf][...]
        assert isinstance(e.value, RuntimeError) and str(e.value).startswith(f"{os.path.abspath(ckdir)}: ")
    del reader, e  # compact: this process opens the new database once no reader holds the replaced one
    gc.collect()
    assert tsckpt.open(ckdir)["l05"][0, 0] == 205  # opened again: the new checkpoint


@pytest.mark.no_checkpoint_root  # deleted
def test_a_reader_of_a_deleted_checkpoint(ckdir, layout):
    tsckpt.save(ckdir, _leaves(1), layout=layout)
    reader = tsckpt.open(ckdir)
    shutil.rmtree(ckdir)
    with pytest.raises(tsckpt.CheckpointReplacedError, match=DELETED):
        reader["l03"][...]


def test_a_restore_overtaken_by_an_overwrite_raises(ckdir, layout, monkeypatch):
    """The overwrite lands between the restore's opening and its reads (plain: the new files
    would be read under the old records; compact: the old database is gone)."""
    import tsckpt._read.restore as restore_module

    tsckpt.save(ckdir, _leaves(1), layout=layout)
    real = restore_module._restore_saved

    def overtaken(*args, **kwargs):
        tsckpt.save(ckdir, _leaves(2), layout=layout, overwrite=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_module, "_restore_saved", overtaken)
    with pytest.raises(tsckpt.CheckpointReplacedError, match=REPLACED + ".*its root now says 'committed'"):
        tsckpt.restore(ckdir)
    monkeypatch.undo()
    assert tsckpt.restore(ckdir)["l07"][0, 0] == 207


def test_a_restore_of_a_step_retention_deletes(tmp_path, layout, monkeypatch):
    import tsckpt._read.restore as restore_module

    m = tsckpt.CheckpointManager(str(tmp_path / "run"), keep_last=1, layout=layout)
    m.save(0, _leaves(0))
    real = restore_module._restore_saved

    def overtaken(*args, **kwargs):
        m.save(1, _leaves(1))  # retention deletes step 0
        return real(*args, **kwargs)

    monkeypatch.setattr(restore_module, "_restore_saved", overtaken)
    with pytest.raises(tsckpt.CheckpointReplacedError, match=DELETED):
        m.restore(0)
    assert m.all_steps() == [1]
    m.close()
