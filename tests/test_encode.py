"""Files tsckpt encodes itself must be byte-identical to TensorStore's for the same metadata."""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import threading

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
import zarr

import tsckpt
from tsckpt._ondisk import chunking as _chunking
from tsckpt._codec import route as _route
from tsckpt._codec import shardwrite as _shardwrite
from tsckpt._codec.files import stored_shapes
from tsckpt._ondisk.arrays import array_node, chunk_key
from tsckpt._ondisk.records import ArrayRecord, Chunking
from tsckpt._leaves.registry import describe
from tsckpt._save.descs import gather_descs, pack_descs
from tsckpt._save.plan import plan_save, split_plan
from tsckpt._runtime.progress import Progress
from tsckpt._formats.sources import open_checkpoint
from tsckpt._save import write as _write_module
from tsckpt._save.write import whole_shard as _whole_shard
from tsckpt._save.write import write_regions as _write_regions


def _file_writer(rec: ArrayRecord, offsets: tuple[int, ...], src: np.ndarray):
    """What save's own shard writer does with the shard file at ``offsets`` (a function of
    its path), or None when the own codec does not write it."""
    where = _route.place({"driver": "file", "path": "/"}, "plain")
    layout = stored_shapes(rec)
    if _route.route(rec, where) is not _route.Route.SHARD or not _whole_shard(rec, offsets, src.shape[: len(offsets)]):
        return None
    return lambda path: _shardwrite.write_shard(path, src, layout.shard, layout.inner)


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n != "zarr.json":
                with open(os.path.join(d, n), "rb") as f:
                    out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


def _same_as_tensorstore(tmp_path, t: torch.Tensor) -> tsckpt.ArrayMetadata:
    d = str(tmp_path / "ck")
    tsckpt.save(d, {"x": t})
    rec = open_checkpoint(d).arrays["x"]
    ref_dir = str(tmp_path / "ref")
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": ref_dir}, "metadata": array_node(rec), "create": True,
            "store_data_equal_to_fill_value": True}
    ref = ts.open(spec).result()
    ref.write(tsckpt._base.dtypes.tensor_to_numpy(t)).result()
    mine, theirs = _files(os.path.join(d, "x")), _files(ref_dir)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert mine[key] == theirs[key], key
    return open_checkpoint(d).array_metadata("x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex64, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(), (5,), (3, 7)])
def test_single_chunk_files(tmp_path, dtype, shape):
    t = (torch.randn(shape) * 8).to(dtype) if dtype != torch.complex64 else torch.randn(shape, dtype=dtype)
    md = _same_as_tensorstore(tmp_path, t)
    assert md.shard_shape == md.chunk_shape  # one plain chunk


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((64, 64), torch.float32),  # whole shards
        ((67, 45), torch.float32),  # edge shards and padded edge chunks
        ((3, 5, 50), torch.bfloat16),
        ((2000,), torch.int16),
        ((40, 30), torch.bool),
    ],
)
def test_sharded_files_including_edges(tmp_path, small_chunks, shape, dtype):
    t = (torch.randn(shape) * 100).to(dtype)
    md = _same_as_tensorstore(tmp_path, t)
    assert md.shard_shape != md.chunk_shape  # really sharded
    out = tsckpt.restore(str(tmp_path / "ck"), {"x": torch.empty(shape, dtype=dtype)})["x"]
    assert torch.equal(out, t)


# ---- shard files written by tsckpt's own writer (tsckpt/_codec/shardwrite.py) ----------------

NP_DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16, "int8": np.int8, "uint64": np.uint64,
    "bool": np.bool_, "complex64": np.complex64, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu, "int4": ml_dtypes.int4, "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
}


def _data(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 50
    if dtype == "complex64":
        return (x + 1j * rng.standard_normal(shape)).astype(np.complex64)
    if dtype == "int4":
        return rng.integers(-8, 8, shape).astype(ml_dtypes.int4)
    if dtype in ("float4_e2m1fn", "float8_e8m0fnu"):  # values each type holds (e8m0: powers of two)
        return (2.0 ** rng.integers(-2, 3, shape) * np.sign(x if dtype == "float4_e2m1fn" else 1)).astype(NP_DTYPES[dtype])
    return (x > 0) if dtype == "bool" else x.astype(NP_DTYPES[dtype])


def _tensorstore_files(root: str, rec: ArrayRecord, full: np.ndarray) -> dict[str, bytes]:
    """The chunk files TensorStore writes for ``full`` under the array node of ``rec``."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": root}, "metadata": array_node(rec), "create": True,
            "store_data_equal_to_fill_value": True}
    ts.open(spec).result().write(full).result()
    return _files(root)


def _shard_cells(shape: tuple[int, ...], shard: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(0, n, s) for n, s in zip(shape, shard))))


LAYOUTS = [
    # (array shape, shard shape, inner chunk shape, storage dtype)
    ((1000,), (256,), (64,), "float32"),  # 1-D; the last shard is short: chunks padded and chunks left out
    ((64, 96), (16, 96), (8, 24), "float32"),  # column pieces: inner chunks not contiguous in the source
    ((64, 96), (16, 96), (4, 96), "float32"),  # whole rows: inner chunks are views of the source
    ((6, 10, 12), (4, 8, 12), (2, 4, 6), "int8"),  # 3-D, edges in two dims
    ((67, 45), (16, 48), (4, 12), "float32"),  # neither a multiple of the shard nor of the inner chunk
    ((17, 8), (16, 8), (4, 8), "float64"),  # the edge shard holds one (padded) inner chunk
    ((16, 8), (8, 8), (8, 8), "bfloat16"),  # a shard that is a single inner chunk
    ((40, 30), (8, 32), (2, 8), "bool"),
    ((33, 20), (16, 20), (4, 10), "bfloat16"),
    ((9, 7), (4, 8), (2, 4), "complex64"),
    ((30, 16), (8, 16), (4, 8), "uint64"),
    ((30, 16), (8, 16), (4, 8), "float8_e4m3fn"),
    ((30, 16), (8, 16), (4, 8), "float8_e8m0fnu"),  # no zero: padding is zero bytes all the same
    ((64, 64), (64, 64), (32, 32), "int4"),  # one byte an element: 4 x (1,024 + 4) + 68 = 4,180 bytes
    ((30, 18), (16, 16), (4, 8), "int4"),
    ((30, 18), (16, 16), (4, 8), "float4_e2m1fn"),
    ((300, 40), (128, 40), (64, 40), "float16"),
    ((520, 96), (256, 96), (32, 24), "float32"),  # 96 KiB files: many direct writes of 8 KiB
]


@pytest.fixture(params=["buffered", "direct"])
def writer_io(request, monkeypatch):
    """Shard files written through the page cache, or with direct I/O in 8 KiB writes (where
    the file system has it): both must give TensorStore's bytes. Returns the paths opened directly."""
    monkeypatch.setattr(_shardwrite, "DIRECT", request.param == "direct")
    monkeypatch.setattr(_shardwrite, "DIRECT_BYTES", 8192)
    monkeypatch.setattr(_shardwrite, "_local", threading.local())  # no larger buffer from before
    direct: list[str] = []
    real = _shardwrite._DirectFile.__init__

    def counting(self, fd, path, chunk_bytes):
        direct.append(path)
        real(self, fd, path, chunk_bytes)

    monkeypatch.setattr(_shardwrite._DirectFile, "__init__", counting)
    return direct


def _direct_io_works(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("shape, shard, inner, dtype", LAYOUTS)
def test_shard_files_are_tensorstores(tmp_path, writer_io, shape, shard, inner, dtype):
    full = _data(shape, dtype)
    rec = ArrayRecord("x", shape, dtype, "numpy", Chunking(shard, inner))
    theirs = _tensorstore_files(str(tmp_path / "ref"), rec, full)
    mine_root = str(tmp_path / "mine")
    for off in _shard_cells(shape, shard):
        src = full[tuple(slice(o, o + s) for o, s in zip(off, shard))]
        writer = _file_writer(rec, off, src)
        assert writer is not None
        path = os.path.join(mine_root, chunk_key(rec, off))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        writer(path)
    mine = {k.removeprefix("x" + os.sep): v for k, v in _files(mine_root).items()}
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert mine[key] == theirs[key], key
    direct = _shardwrite.DIRECT and _direct_io_works(str(tmp_path / "probe"))
    assert len(writer_io) == (len(mine) if direct else 0)
    # TensorStore reads the files back (with their crc32c checked)
    with open(os.path.join(mine_root, "x", "zarr.json"), "w") as f:
        json.dump(array_node(rec), f)
    got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(mine_root, "x")}}).result().read().result()
    np.testing.assert_array_equal(got, full)


@pytest.mark.parametrize("shape, shard, inner, dtype", LAYOUTS)
def test_shard_files_built_in_memory_are_tensorstores(tmp_path, shape, shard, inner, dtype):
    """shard_bytes (an object store's body) holds the file TensorStore writes, byte for byte."""
    full = _data(shape, dtype)
    rec = ArrayRecord("x", shape, dtype, "numpy", Chunking(shard, inner))
    theirs = _tensorstore_files(str(tmp_path / "ref"), rec, full)
    layout = stored_shapes(rec)
    mine = {}
    for off in _shard_cells(shape, shard):
        src = full[tuple(slice(o, o + s) for o, s in zip(off, shard))]
        assert _route.regular_shards(rec) and _whole_shard(rec, off, src.shape[: len(off)])
        mine[chunk_key(rec, off).removeprefix("x/").replace("/", os.sep)] = _shardwrite.shard_bytes(src, layout.shard, layout.inner)
    assert mine == theirs


def _inner_hashes(src: np.ndarray, inner: tuple[int, ...]) -> list[str]:
    """xxh3-128 of each inner chunk's part in the array, its bytes in C order, computed here
    from the definition (docs/format.md, "Content hashes"), not by the writer's code."""
    import xxhash

    starts = itertools.product(*(range(0, n, c) for n, c in zip(src.shape, inner)))
    return [
        xxhash.xxh3_128_hexdigest(np.ascontiguousarray(src[tuple(slice(o, o + c) for o, c in zip(lo, inner))]).tobytes())
        for lo in starts
    ]


@pytest.mark.parametrize("shape, shard, inner, dtype", LAYOUTS)
def test_the_writer_hashes_each_inner_chunk_as_it_writes_it(tmp_path, writer_io, shape, shard, inner, dtype):
    """write_shard(hashes=True) and shard_bytes give each stored inner chunk's content hash, in
    the order of the file's index, and the same file as without them."""
    full = _data(shape, dtype)
    rec = ArrayRecord("x", shape, dtype, "numpy", Chunking(shard, inner))
    layout = stored_shapes(rec)
    for i, off in enumerate(_shard_cells(shape, shard)):
        src = full[tuple(slice(o, o + s) for o, s in zip(off, shard))]
        want = _inner_hashes(src, layout.inner)
        path = tmp_path / f"{i}"
        assert _shardwrite.write_shard(str(path), src, layout.shard, layout.inner) is None
        plain = path.read_bytes()
        assert _shardwrite.write_shard(str(path), src, layout.shard, layout.inner, hashes=True) == want
        digests: list[str] = []
        assert _shardwrite.shard_bytes(src, layout.shard, layout.inner, digests) == path.read_bytes() == plain
        assert digests == want


def test_direct_writes_refused_at_write_time(tmp_path, writer_io, monkeypatch):
    """A file system that takes O_DIRECT at open but fails its writes with EINVAL gets the
    same file through the page cache."""
    if not _shardwrite.DIRECT:
        pytest.skip("writes through the page cache try no direct I/O")
    if not _direct_io_works(str(tmp_path / "probe")):
        pytest.skip("this file system has no direct I/O: nothing is written directly (checked above)")
    pwritev = os.pwritev

    def no_direct(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwritev(fd, buffers, offset)

    monkeypatch.setattr(_shardwrite.os, "pwritev", no_direct)
    shape, shard, inner = (520, 96), (256, 96), (32, 24)
    full = _data(shape, "float32")
    rec = ArrayRecord("x", shape, "float32", "numpy", Chunking(shard, inner))
    theirs = _tensorstore_files(str(tmp_path / "ref"), rec, full)
    path = str(tmp_path / "mine" / chunk_key(rec, (256, 0)))
    os.makedirs(os.path.dirname(path))
    _file_writer(rec, (256, 0), full[256:512])(path)
    assert writer_io == [path]
    with open(path, "rb") as f:
        assert f.read() == theirs[os.path.join("c", "1", "0")]


def test_a_direct_write_error_names_the_file(tmp_path, writer_io, monkeypatch):
    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_shardwrite.os, "pwritev", full)
    rec = ArrayRecord("x", (520, 96), "float32", "numpy", Chunking((256, 96), (32, 24)))
    path = str(tmp_path / "x.bin")
    with pytest.raises(OSError) as info:
        _file_writer(rec, (0, 0), _data((256, 96), "float32"))(path)
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, path)


def test_source_that_is_a_column_slice(tmp_path):
    """A region that is a non-contiguous view of a larger tensor (a rank's column shard)."""
    big = _data((32, 64), "float32")
    src = big[:, 16:48]
    rec = ArrayRecord("x", (32, 32), "float32", "numpy", Chunking((16, 32), (4, 32)))
    theirs = _tensorstore_files(str(tmp_path / "ref"), rec, np.ascontiguousarray(src))
    for off in _shard_cells((32, 32), (16, 32)):
        writer = _file_writer(rec, off, src[off[0] : off[0] + 16])
        assert writer is not None
        path = str(tmp_path / "mine" / chunk_key(rec, off))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        writer(path)
    assert {k.removeprefix("x" + os.sep): v for k, v in _files(str(tmp_path / "mine")).items()} == theirs


@pytest.mark.parametrize(
    "shape, dtype, regions",
    [
        ((96, 64), "float32", "rows"),  # Shard(0) over 3 writers
        ((48, 128), "bfloat16", "cols"),  # Shard(1) over 2 writers: their locals are whole tensors
        ((50, 40), "float64", "grid"),  # 2 x 2 writers, edges in both dims
        ((36, 20, 12), "int8", "rows"),
        ((64, 32), "bool", "cols"),
    ],
)
def test_files_of_several_writers_are_tensorstores(tmp_path, writer_io, monkeypatch, shape, dtype, regions):
    """Regions as DTensor shards give them, planned and written by save's own functions
    (one rank after the other, in one process); every file equals TensorStore's."""
    monkeypatch.setattr(_chunking, "INNER_CHUNK_BYTES", 512)
    monkeypatch.setattr(_chunking, "SHARD_BYTES", 2048)
    rec, mine, theirs, calls = _several_writers(tmp_path, monkeypatch, shape, dtype, regions, "write_shard")
    assert rec.chunking.chunk_shape is not None
    assert len(calls) == len(mine) >= {"rows": 3, "cols": 2, "grid": 4}[regions]  # every file by the own writer
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert mine[key] == theirs[key], key


@pytest.mark.parametrize(
    "shape, dtype, regions",
    [
        ((50, 40), "float32", "rows"),  # 3 writers of 17, 17 and 16 rows: the last chunk padded
        ((9, 7), "float64", "grid"),  # padded in both dims
        ((10, 7), "bool", "cols"),
        ((32, 4, 3), "bfloat16", "rows"),
    ],
)
def test_unsharded_files_of_several_writers_are_tensorstores(tmp_path, monkeypatch, shape, dtype, regions):
    """Writers of small regions store each as one unsharded chunk file (padded at the
    array's edge), written into the local directory by the own writer's batches; every
    file equals TensorStore's."""
    monkeypatch.setattr(_chunking, "INNER_CHUNK_BYTES", 1 << 20)
    rec, mine, theirs, calls = _several_writers(tmp_path, monkeypatch, shape, dtype, regions, "write_chunk")
    assert rec.chunking.chunk_shape is None
    assert any(s % g for s, g in zip(rec.shape, rec.chunking.shard_shape))  # an edge chunk is padded
    assert len(calls) == len(mine) == {"rows": 3, "cols": 2, "grid": 4}[regions]
    assert mine == theirs


def _several_writers(tmp_path, monkeypatch, shape, dtype, regions, writer):
    """Save's plan and writes of ``shape`` held by several writers as ``regions`` (rows,
    cols or a grid), one writer after the other; returns the record, the files written
    (by key below the array), TensorStore's files of the whole array, and the calls of
    the own ``writer`` (a function of tsckpt/_codec/shardwrite.py)."""
    full = _data(shape, dtype, seed=3)
    n = {"rows": (3, 1), "cols": (1, 2), "grid": (2, 2)}[regions]
    starts = [[-(-shape[0] * i // n[0]) for i in range(n[0])], [-(-shape[1] * j // n[1]) for j in range(n[1])]]
    locals_ = []
    for i, j in itertools.product(range(n[0]), range(n[1])):
        stops = [starts[0][i + 1] if i + 1 < n[0] else shape[0], starts[1][j + 1] if j + 1 < n[1] else shape[1]]
        off = (starts[0][i], starts[1][j], *([0] * (len(shape) - 2)))
        local = torch.from_numpy(full[starts[0][i] : stops[0], starts[1][j] : stops[1]].copy()) if dtype != "bfloat16" else None
        if local is None:  # torch has no numpy bfloat16: build the tensor from its bits
            bits = full[starts[0][i] : stops[0], starts[1][j] : stops[1]].view(np.int16).copy()
            local = torch.from_numpy(bits).view(torch.bfloat16)
        locals_.append(tsckpt.ShardedArray(local, shape, off))
    described = [describe("x", a) for a in locals_]
    plan = plan_save(gather_descs([pack_descs([d.desc]) for d in described]))
    assert not plan.transfers
    (rec,) = plan.arrays
    mine_root = str(tmp_path / "mine")
    calls = []
    real = getattr(_shardwrite, writer)
    monkeypatch.setattr(_shardwrite, writer, lambda *a, **k: calls.append(1) or real(*a, **k))
    for rank, part in enumerate(split_plan(plan)):
        progress = Progress("save", mine_root, show=False, rank=rank)
        _write_regions({"driver": "file", "path": mine_root + "/"}, part, {"x": described[rank]}, {}, 1 << 20,
                       compact=False, progress=progress)
    theirs = _tensorstore_files(str(tmp_path / "ref"), rec, full)
    mine = {k.removeprefix("x" + os.sep): v for k, v in _files(mine_root).items()}
    return rec, mine, theirs, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.complex32])
def test_saved_shards_are_tensorstores_and_zarr_reads_them(tmp_path, small_chunks, monkeypatch, dtype):
    """tsckpt.save writes sharded arrays with its own writer (TensorStore opens no array
    for writing), the files equal TensorStore's, and zarr-python reads them."""
    import tsckpt._save.write as save_mod

    def no_tensorstore(*args, **kwargs):
        raise AssertionError("TensorStore was asked to write")

    monkeypatch.setattr(save_mod, "open_array", no_tensorstore)
    t = (torch.randn(67, 45) * 100).to(dtype) if dtype != torch.complex32 else torch.randn(67, 45, dtype=torch.complex32)
    md = _same_as_tensorstore(tmp_path, t)
    assert md.shard_shape != md.chunk_shape
    want = tsckpt._base.dtypes.tensor_to_numpy(t)
    out = tsckpt.restore(str(tmp_path / "ck"), {"x": torch.zeros_like(t)})["x"]
    assert tsckpt._base.dtypes.tensor_to_numpy(out).tobytes() == want.tobytes()
    if dtype != torch.bfloat16:  # zarr-python has no bfloat16
        z = zarr.open_array(str(tmp_path / "ck" / "x"), mode="r")[...]
        assert z.tobytes() == want.tobytes() and z.shape == want.shape


# ---- unsharded chunk files and nodes of a local plain checkpoint ----------------------------


def test_small_leaves_saved_as_tensorstore_saves_them(tmp_path, monkeypatch):
    """Every file of a plain checkpoint of small leaves in nested groups (chunk files and
    array and group zarr.json) equals the file TensorStore writes for it, and each
    directory is made with one mkdir: one per group and per array, none below an array."""
    tree = {
        "a": {"w": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int16), "s": torch.tensor(2.5)},
        "m": {"deep": {"x": torch.randn(4).to(torch.bfloat16), "y": torch.rand(3) > 0.5}},
        "z": torch.randn(2, 2, dtype=torch.complex64),
    }
    monkeypatch.setenv(_route.ENV, _route.TENSORSTORE)
    tsckpt.save(str(tmp_path / "ref"), tree)
    monkeypatch.delenv(_route.ENV)
    made = []
    real_mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: made.append(os.fspath(path)) or real_mkdir(path, *a, **k))
    tsckpt.save(str(tmp_path / "mine"), tree)
    theirs, mine = _all_files(tmp_path / "ref"), _all_files(tmp_path / "mine")
    assert mine.keys() == theirs.keys() and len(mine) == 6 + 6 + 3  # chunk files, array and group nodes
    for key in mine:
        assert mine[key] == theirs[key], key
    dirs = [os.path.join(d, n) for d, names, _ in os.walk(tmp_path / "mine") for n in names]
    assert len(dirs) == 3 + 6  # groups and arrays: each array's one file is c.0... beside its zarr.json
    assert sorted(made) == sorted(dirs)  # each once


def test_a_one_file_arrays_node_is_written_with_its_chunk_file(tmp_path, monkeypatch, small_chunks):
    """The batch that writes a one-file array's chunk file writes its zarr.json too (its
    directory made and filled by one task); the nodes of groups and of arrays of several
    files are left to write_nodes."""
    import tsckpt._save.protocol as protocol

    left, batches = [], []
    real_nodes, real_batch = protocol._write_nodes, _write_module._write_chunk_files
    monkeypatch.setattr(protocol, "_write_nodes", lambda data, nodes, **kw: left.append(sorted(nodes)) or real_nodes(data, nodes, **kw))
    monkeypatch.setattr(_write_module, "_write_chunk_files", lambda d, files, nodes, *a: batches.append(
        ([k for k, *_ in files], [k for k, _ in nodes])) or real_batch(d, files, nodes, *a))
    tree = {"g": {"a": torch.randn(3), "b": torch.randn(2, 2)}, "big": torch.zeros(64, 32)}  # big: several files
    tsckpt.save(tmp_path / "ck", tree)
    assert left == [["big/zarr.json", "g/zarr.json"]]
    assert batches == [(["g/a/c.0", "g/b/c.0.0"], ["g/a/zarr.json", "g/b/zarr.json"])]
    assert json.loads((tmp_path / "ck" / "g" / "b" / "zarr.json").read_text())["shape"] == [2, 2]
    assert torch.equal(torch.as_tensor(tsckpt.restore(tmp_path / "ck")["g"]["b"]), tree["g"]["b"])


def _all_files(root) -> dict[str, bytes]:
    """Every file below ``root`` but the root's own zarr.json (its time stamp differs)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != "zarr.json":
                with open(os.path.join(d, n), "rb") as f:
                    out[rel] = f.read()
    return out


def test_make_parents_makes_each_directory_once(tmp_path, monkeypatch):
    (tmp_path / "old").mkdir()  # made by another rank: fine
    made = []
    real_mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: made.append(os.fspath(path)) or real_mkdir(path, *a, **k))
    known = {"k"}  # known to exist: not asked again
    _shardwrite.make_parents(str(tmp_path), ["a/c/0", "a/c/1", "a/zarr.json", "old/c/0", "b/x/y/c/0/0", "k/c"], known)
    want = ["a", "a/c", "b", "b/x", "b/x/y", "b/x/y/c", "b/x/y/c/0", "old", "old/c"]
    assert made == [str(tmp_path / d) for d in want]  # parents first, each once
    assert all((tmp_path / d).is_dir() for d in want)
    assert known == {"k", *want}
    made.clear()
    _shardwrite.make_parents(str(tmp_path), ["a/c/2", "b/x/y/c/0/1"], known)
    assert made == []
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(FileExistsError):  # a file where a directory belongs
        _shardwrite.make_parents(str(tmp_path), ["f/c/0"], set())
    _shardwrite.make_parents(str(tmp_path / "new" / "root"), ["q/c/0"], set())  # the root too, when missing
    assert (tmp_path / "new" / "root" / "q" / "c").is_dir()
