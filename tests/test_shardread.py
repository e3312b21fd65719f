"""The fast read path of sharded arrays (tsckpt/_codec/shardread.py): values for many layouts,
dtypes and boxes; damage raises CorruptCheckpointError naming the leaf; which path reads what.
Every test runs twice: reading through the page cache, and with direct I/O wherever the file
system allows it (the path of files the cache does not hold)."""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

import google_crc32c
import ml_dtypes
import numpy as np
import pytest
import torch

import tsckpt
import tsckpt._save.plan as plan
from tsckpt._read import engine as _restore
from tsckpt._codec import pagecache as _pagecache
from tsckpt._codec import shardread as _shardread
from tsckpt._ondisk.records import Chunking
from tsckpt._storage import native

LAYOUTS = {
    # name: (shape, shard_shape, chunk_shape); edges are not multiples of either
    "1d": ((1000,), (256,), (64,)),
    "columns": ((50, 40), (16, 40), (8, 10)),
    "rows": ((50, 40), (16, 40), (4, 40)),
    "3d": ((7, 9, 12), (4, 6, 12), (2, 3, 4)),
    "3d-rows": ((6, 5, 8), (4, 5, 8), (1, 5, 8)),
}
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.bool_, np.float64]


def values(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 50
    return (x > 0) if dtype == np.bool_ else x.astype(dtype)


@pytest.fixture(autouse=True, params=["buffered", "direct", "mapped"])
def io_mode(request, monkeypatch):
    """Read every file through the page cache, with direct I/O where the file system has it, or
    through a mapping of the file."""
    monkeypatch.setattr(_shardread, "DIRECT_BELOW", 2.0 if request.param == "direct" else 0.0)
    monkeypatch.setattr(_shardread, "MAPPED_FROM", 0.0 if request.param == "mapped" else 2.0)
    return request.param


def direct_io_works(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _pagecache.resident_fraction(fd, 0, 1) is not None and _pagecache.set_direct(fd)
    finally:
        os.close(fd)


def cached(path) -> float | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _pagecache.resident_fraction(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@pytest.fixture
def layout_of(monkeypatch):
    """Save arrays with the (shard, chunk) shapes given per array shape."""
    chosen: dict[tuple[int, ...], Chunking] = {}

    def choose(shape, itemsize, cuts=(), **_):
        return chosen[tuple(shape)]

    monkeypatch.setattr(plan, "choose_chunking", choose)

    def set_layout(shape, shard, chunk):
        chosen[tuple(shape)] = Chunking(tuple(shard), tuple(chunk))

    return set_layout


@pytest.fixture
def calls(monkeypatch):
    """Shard files read by the fast path, and arrays TensorStore opened."""
    seen: dict[str, list] = {"fast": [], "tensorstore": []}
    read_shard, open_all = _shardread._read_shard, _restore._open_all

    def counting_read(ck, dir_fd, job, *args):
        seen["fast"].append((job.rec.path, job.offsets, job.lengths))
        return read_shard(ck, dir_fd, job, *args)

    def counting_open(ck, paths):
        seen["tensorstore"] += paths
        return open_all(ck, paths)

    monkeypatch.setattr(_shardread, "_read_shard", counting_read)
    monkeypatch.setattr(_restore, "_open_all", counting_open)
    return seen


def saved(tmp_path, layout_of, name, dtype=np.float32, seed=0):
    shape, shard, chunk = LAYOUTS[name]
    layout_of(shape, shard, chunk)
    x = values(shape, dtype, seed)
    ck = tmp_path / "ck"
    tsckpt.save(ck, {"w": x})
    meta = tsckpt.metadata(ck)["w"]
    assert (meta.shard_shape, meta.chunk_shape) == (shard, chunk)
    return ck, x


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_whole_array_every_layout_and_dtype(tmp_path, layout_of, calls, dirty_empty, name, dtype):
    ck, x = saved(tmp_path, layout_of, name, dtype)
    same(tsckpt.restore(ck)["w"], x)
    target = np.zeros_like(x)
    out = tsckpt.restore(ck, {"w": target}, inplace=True)
    assert out["w"] is target
    same(target, x)
    n_shards = np.prod([-(-n // s) for n, s in zip(*LAYOUTS[name][:2])])
    assert len(calls["fast"]) == 2 * n_shards and calls["tensorstore"] == []


@pytest.mark.parametrize("name", ["rows", "columns", "1d"])
def test_torch_targets(tmp_path, layout_of, calls, name):
    ck, x = saved(tmp_path, layout_of, name, np.float16)
    t = torch.zeros(x.shape, dtype=torch.float16)
    tsckpt.restore(ck, {"w": t}, inplace=True)
    same(t.numpy(), x)
    fresh = tsckpt.restore(ck, {"w": torch.zeros(x.shape, dtype=torch.float16)})["w"]
    same(fresh.numpy(), x)
    assert calls["tensorstore"] == []


def boxes(shape):
    """Regions of ``shape`` a rank may own: halves, row ranges, single elements, odd boxes."""
    out = []
    for d in range(len(shape)):
        h = shape[d] // 2
        for lo, hi in ((0, h), (h, shape[d]), (1, shape[d] - 1)):
            out.append(tuple((lo, hi) if i == d else (0, n) for i, n in enumerate(shape)))
    out.append(tuple((n - 1, n) for n in shape))  # the last element
    out.append(tuple((n // 3, n // 3 + 1) for n in shape))  # one element inside
    out.append(tuple((n // 5, n - n // 4) for n in shape))  # straddles chunks and shards
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_partial_boxes(tmp_path, layout_of, calls, dirty_empty, name):
    ck, x = saved(tmp_path, layout_of, name, np.float32)
    for box in boxes(x.shape):
        sel = tuple(slice(a, b) for a, b in box)
        local = np.empty(x[sel].shape, np.float32)
        target = tsckpt.ShardedArray(local, x.shape, tuple(a for a, _ in box))
        out = tsckpt.restore(ck, {"w": target}, inplace=True)["w"]
        same(out.local, x[sel])
        fresh = tsckpt.restore(ck, {"w": tsckpt.ShardedArray(np.zeros_like(local), x.shape, target.offsets)})["w"]
        same(fresh.local, x[sel])
    assert calls["tensorstore"] == [] and calls["fast"]


def test_resharded_boxes(tmp_path, layout_of, calls):
    """Rows saved in 4 shards, restored as 2 column halves and as 3 uneven row blocks."""
    layout_of((64, 48), (16, 48), (4, 12))
    x = values((64, 48), np.float32)
    ck = tmp_path / "ck"
    tsckpt.save(ck, {"w": x})
    for cols in ((0, 24), (24, 48)):
        t = tsckpt.ShardedArray(np.zeros((64, 24), np.float32), (64, 48), (0, cols[0]))
        same(tsckpt.restore(ck, {"w": t}, inplace=True)["w"].local, x[:, cols[0] : cols[1]])
    for rows in ((0, 22), (22, 43), (43, 64)):
        t = tsckpt.ShardedArray(np.zeros((rows[1] - rows[0], 48), np.float32), (64, 48), (rows[0], 0))
        same(tsckpt.restore(ck, {"w": t}, inplace=True)["w"].local, x[rows[0] : rows[1]])
    assert calls["tensorstore"] == []


def test_non_contiguous_targets(tmp_path, layout_of, calls):
    ck, x = saved(tmp_path, layout_of, "rows", np.float64)
    big = np.zeros((50, 80), np.float64)
    out = tsckpt.restore(ck, {"w": big[:, ::2]}, inplace=True)["w"]
    same(big[:, ::2], x)
    assert not big[:, 1::2].any() and out.base is big
    t = torch.zeros(40, 50, dtype=torch.float64)
    tsckpt.restore(ck, {"w": t.T}, inplace=True)
    same(t.T.numpy(), x)
    assert calls["tensorstore"] == []


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_threads_window_and_progress(tmp_path, layout_of, monkeypatch, threads):
    """Any thread count and window gives the same values; progress counts each shard's bytes."""
    ck, x = saved(tmp_path, layout_of, "columns", np.float32)
    monkeypatch.setattr(_shardread, "RUN_BYTES", 3 * 324)  # three inner chunks a read
    ckpt = tsckpt._formats.sources.open_checkpoint(ck)
    target = np.zeros_like(x)
    dest = tsckpt._leaves.registry.destination(ckpt.arrays["w"], "w", target, True)

    class Count:
        nbytes = files = 0

        def update(self, nbytes, files=0):
            self.nbytes += nbytes
            self.files += files

    count = Count()
    for window in (1, 1000, 1 << 20):
        target[...] = 0
        rest = _shardread.read_sharded(ckpt, str(ck), [dest], _restore._view, count, window, threads=threads)
        assert rest == []
        same(target, x)
    assert (count.nbytes, count.files) == (3 * x.nbytes, 3 * 4)


def test_many_chunks_per_read(tmp_path, layout_of):
    """A shard of 2048 tiny chunks: reads are split at the kernel's limit of buffers per call."""
    layout_of((5000,), (4096,), (2,))
    x = values((5000,), np.float64)
    tsckpt.save(tmp_path / "ck", {"w": x})
    same(tsckpt.restore(tmp_path / "ck")["w"], x)


def test_tensorstore_reads_casts_compact_and_memory(tmp_path, layout_of, calls):
    ck, x = saved(tmp_path, layout_of, "rows", np.float32)
    out = tsckpt.restore(ck, {"w": np.zeros(x.shape, np.float64)})["w"]
    np.testing.assert_array_equal(out, x.astype(np.float64))
    assert calls["fast"] == [] and calls["tensorstore"] == ["w"]
    calls["tensorstore"].clear()
    tsckpt.save(tmp_path / "compact", {"w": x}, layout="compact")
    same(tsckpt.restore(tmp_path / "compact")["w"], x)
    loc = f"memory://shardread/{tmp_path.name}/ck"
    tsckpt.save(loc, {"w": x})
    same(tsckpt.restore(loc)["w"], x)
    assert calls["fast"] == [] and calls["tensorstore"] == ["w", "w"]


# ---- damage ------------------------------------------------------------------


@pytest.fixture
def damaged(tmp_path, layout_of):
    """A checkpoint of one array in 2 x 2 shard files of 2 x 4 inner chunks of 4 x 4 float32."""
    ck, x = tmp_path / "ck", values((16, 32), np.float32)
    layout_of((16, 32), (8, 16), (4, 4))
    tsckpt.save(ck, {"w": x})
    return ck, x


def _index(path: Path) -> tuple[bytes, np.ndarray]:
    data = path.read_bytes()
    return data, np.frombuffer(data[-4 - 16 * 8 : -4], "<u8").reshape(2, 4, 2).copy()


def _write_index(path: Path, data: bytes, index: np.ndarray) -> None:
    raw = index.astype("<u8").tobytes()
    path.write_bytes(data[: -4 - len(raw)] + raw + google_crc32c.value(raw).to_bytes(4, "little"))


def _fails(ck, detail: str, *, inplace: bool = True) -> str:
    target = np.full((16, 32), 7.0, np.float32)
    for args in ((), ({"w": target},)):
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            tsckpt.restore(ck, *args, inplace=inplace)
        msg = str(info.value)
        assert msg.startswith(f"'w' in {ck}: "), msg
        assert detail in msg, msg
    return msg


def test_flipped_byte_in_an_inner_chunk(damaged, calls):
    ck, x = damaged
    f = ck / "w/c/1/0"
    data, index = _index(f)
    start = int(index[1, 2, 0])  # inner chunk (1, 2)
    bad = bytearray(data)
    bad[start + 17] ^= 0x01
    f.write_bytes(bytes(bad))
    msg = _fails(ck, "checksum mismatch: stored bytes were altered; restore from another checkpoint.")
    assert msg.endswith("(w/c/1/0: inner chunk [1, 2] fails its crc32c)"), msg
    assert calls["tensorstore"] == []
    f.write_bytes(data)
    same(tsckpt.restore(ck)["w"], x)
    # the rows of the other shard files are not affected
    part = tsckpt.ShardedArray(np.zeros((8, 32), np.float32), (16, 32), (0, 0))
    same(tsckpt.restore(ck, {"w": part})["w"].local, x[:8])


def test_flipped_byte_in_the_index(damaged):
    ck, _ = damaged
    f = ck / "w/c/0/1"
    bad = bytearray(f.read_bytes())
    bad[-20] ^= 0x80
    f.write_bytes(bytes(bad))
    msg = _fails(ck, "checksum mismatch: stored bytes were altered")
    assert msg.endswith("(w/c/0/1: the shard index fails its crc32c)"), msg


@pytest.mark.parametrize("keep", [0, 100, -1])
def test_truncated_file(damaged, keep):
    ck, _ = damaged
    f = ck / "w/c/1/1"
    data = f.read_bytes()
    f.write_bytes(data[: keep % len(data)])
    msg = _fails(ck, "; restore from another checkpoint. (w/c/1/1")
    if keep == -1:  # the index moved by one byte
        assert "checksum mismatch: stored bytes were altered" in msg and "shard index fails its crc32c" in msg, msg
    else:
        size = keep % len(data)
        assert msg.endswith(
            f"could not be decoded (truncated or damaged file); restore from another checkpoint. "
            f"(w/c/1/1 is {size} bytes, shorter than its shard index of 132)"
        ), msg


@pytest.mark.parametrize(
    "entry, detail",
    [
        ((1 << 40, 68), "bytes [1099511627776, 1099511627844) of a"),
        ((None, 68), "bytes [{size}, {end}) of a"),  # starts at the end of the file
        ((0, 1 << 62), "bytes [0, 4611686018427387904) of a"),
        ((0, 64), "bytes [0, 64) of a"),
        (((1 << 64) - 1, 68), "bytes [18446744073709551615, 18446744073709551683) of a"),
    ],
)
def test_index_entry_out_of_bounds(damaged, entry, detail):
    ck, x = damaged
    f = ck / "w/c/0/0"
    data, index = _index(f)
    start, nbytes = entry
    start = len(data) if start is None else start
    index[1, 3] = (start, nbytes)
    _write_index(f, data, index)
    detail = detail.format(size=len(data), end=len(data) + 68)
    msg = _fails(ck, "stored data could not be decoded (truncated or damaged file); restore from another checkpoint.")
    assert msg.endswith(
        f"(w/c/0/0: the shard index gives inner chunk [1, 3] {detail} {len(data)}-byte file; "
        "expected 68 bytes inside the file)"
    ), msg


def test_missing_inner_chunk_is_an_error_as_with_tensorstore(damaged, calls):
    """tsckpt never reads a missing chunk as the fill value: both read paths report it."""
    ck, _ = damaged
    f = ck / "w/c/1/1"
    data, index = _index(f)
    index[0, 1] = ((1 << 64) - 1, (1 << 64) - 1)
    _write_index(f, data, index)
    msg = _fails(ck, "a chunk file is missing; restore from another checkpoint.")
    assert msg.endswith("(w/c/1/1: inner chunk [0, 1] is missing from the shard index)"), msg
    with pytest.raises(tsckpt.CorruptCheckpointError, match=f"^'w' in {ck}: a chunk file is missing; restore"):
        tsckpt.restore(ck, {"w": np.zeros((16, 32), np.float64)})  # a cast: TensorStore reads
    assert calls["tensorstore"] == ["w"]
    # a box that does not touch the missing chunk reads
    part = tsckpt.ShardedArray(np.zeros((8, 16), np.float32), (16, 32), (0, 0))
    assert tsckpt.restore(ck, {"w": part})["w"].local.shape == (8, 16)


def test_missing_shard_file(damaged):
    ck, _ = damaged
    os.remove(ck / "w/c/0/1")
    msg = _fails(ck, "a chunk file is missing; restore from another checkpoint.")
    assert msg.endswith("(w/c/0/1 does not exist)"), msg


def test_array_node_problems_are_left_to_tensorstore(damaged, calls):
    ck, _ = damaged
    os.remove(ck / "w/zarr.json")
    _fails(ck, "the array is missing (w/zarr.json does not exist)")
    assert calls["fast"] == [] and calls["tensorstore"] == ["w", "w"]


def test_unreadable_file_is_left_to_tensorstore(damaged, calls):
    """A shard path that is not a readable file (here a directory): TensorStore reports it."""
    ck, _ = damaged
    os.remove(ck / "w/c/1/0")
    os.mkdir(ck / "w/c/1/0")
    with pytest.raises(tsckpt.CorruptCheckpointError, match=f"^'w' in {ck}: "):
        tsckpt.restore(ck)
    assert calls["tensorstore"] == ["w"]


# ---- choosing between the page cache and direct I/O --------------------------------------------


@pytest.fixture
def reads(monkeypatch):
    """Runs read with direct I/O and through the page cache."""
    seen = {"direct": 0, "buffered": 0, "mapped": 0}
    direct, buffered, mapped = _shardread._preadv_direct, _shardread._preadv_buffered, _shardread._copy_mapped

    def counting_direct(*args):
        seen["direct"] += 1
        return direct(*args)

    def counting_buffered(*args):
        seen["buffered"] += 1
        return buffered(*args)

    def counting_mapped(*args):
        seen["mapped"] += 1
        return mapped(*args)

    monkeypatch.setattr(_shardread, "_copy_mapped", counting_mapped)
    monkeypatch.setattr(_shardread, "_preadv_direct", counting_direct)
    monkeypatch.setattr(_shardread, "_preadv_buffered", counting_buffered)
    return seen


def evict(ck: Path) -> None:
    """Drop the checkpoint's files from the page cache (written back first)."""
    for f in ck.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_resident_fraction(tmp_path):
    f = tmp_path / "data"
    f.write_bytes(os.urandom(1 << 20))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.read(fd, 1 << 20)
        assert _pagecache.resident_fraction(fd, 0, 1 << 20) == 1.0
        assert _pagecache.resident_fraction(fd, 5000, 5001) == 1.0  # one page, not page aligned
        assert _pagecache.resident_fraction(fd, 10, 10) is None
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        after = _pagecache.resident_fraction(fd, 0, 1 << 20)
    finally:
        os.close(fd)
    assert after is not None and (after < 0.5 or fs_type(tmp_path) in ("tmpfs", "ramfs")), after  # those keep pages


def fs_type(path: Path) -> str:
    """The type of the file system holding ``path`` (its longest mount point)."""
    where, kind = "", ""
    with open("/proc/self/mountinfo") as m:
        for line in m:
            mount, fstype = line.split()[4], line.split(" - ")[1].split()[0]
            if str(path.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) >= len(where):
                where, kind = mount, fstype
    return kind


def test_cold_files_read_with_direct_io(tmp_path, layout_of, reads, monkeypatch, io_mode):
    """With the default thresholds, files out of the cache are read directly, cached ones through
    a mapping of the file, files partly cached through the cache."""
    monkeypatch.setattr(_shardread, "DIRECT_BELOW", 0.5)
    monkeypatch.setattr(_shardread, "MAPPED_FROM", 1.0)
    ck, x = saved(tmp_path, layout_of, "columns", np.float32)
    for f in ck.rglob("*"):
        if f.is_file():
            f.read_bytes()
    same(tsckpt.restore(ck)["w"], x)
    assert reads == {"direct": 0, "buffered": 0, "mapped": 4}  # every page cached
    evict(ck)
    if not direct_io_works(ck / "w/c/0/0") or cached(ck / "w/c/0/0") == 1.0:
        pytest.skip("this file system has no direct I/O, or keeps evicted pages: reads stay buffered (checked above)")
    target = np.zeros_like(x)
    tsckpt.restore(ck, {"w": target}, inplace=True)
    same(target, x)
    assert reads == {"direct": 4, "buffered": 0, "mapped": 4}


def test_direct_io_refused_at_read_time_falls_back(tmp_path, layout_of, reads, monkeypatch, io_mode):
    """A file system that takes O_DIRECT but fails its reads with EINVAL is read through the cache."""
    ck, x = saved(tmp_path, layout_of, "rows", np.float32)
    if io_mode != "direct":
        pytest.skip("refused direct reads need reads that try direct I/O")
    if not direct_io_works(ck / "w/c/0/0"):
        pytest.skip("this file system has no direct I/O")
    preadv = os.preadv

    def no_direct(fd, buffers, offset, *args):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(_shardread.os, "preadv", no_direct)
    monkeypatch.setattr(_shardread, "RUN_BYTES", 3 * 644)  # several runs per file: later ones stay buffered
    same(tsckpt.restore(ck)["w"], x)
    assert reads["direct"] == 4 and reads["buffered"] > 4, reads


def test_files_the_page_cache_holds_are_read_by_one_thread_per_cpu(tmp_path, small_chunks, monkeypatch):
    """Shard files the page cache holds (read just before): CACHED_THREADS threads (more than the
    CPUs only contend); where the page cache cannot be asked, READ_THREADS, which wait for storage
    in turn."""
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    tsckpt.save(tmp_path / "ck", {"x": x})
    for f in (tmp_path / "ck" / "x" / "c").rglob("*"):
        if f.is_file():
            f.read_bytes()
    used: list[int] = []
    real = _shardread._run
    monkeypatch.setattr(_shardread, "_run", lambda *a: used.append(a[-1]) or real(*a))
    for libc in ("real", None):
        if libc is None:
            monkeypatch.setattr(native, "has_mincore", lambda: False)
        target = np.zeros_like(x)
        tsckpt.restore(tmp_path / "ck", {"x": target}, inplace=True)
        assert np.array_equal(target, x)
    expected_cached = _shardread.CACHED_THREADS if sys.platform == "linux" else _shardread.READ_THREADS
    assert used == [expected_cached, _shardread.READ_THREADS]
    assert _shardread.CACHED_THREADS == min(_shardread.READ_THREADS, len(os.sched_getaffinity(0)))


# ---- inner chunks as stored (read_stored, for diff) ---------------------------------------------


def _stored_checkpoint(ck):
    from tsckpt._read.open import open as open_reader

    return open_reader(str(ck)).checkpoint


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_read_stored_gives_each_inner_chunk_as_stored(tmp_path, layout_of, io_mode, name):
    """Every inner chunk of every shard file, in any order asked: its bytes as the file stores
    them (the array's elements where it lies in the array, then their crc32c); unchecked.
    Read into the memory asked for, or views of the file's mapping (files the cache holds)."""
    from tsckpt._codec.files import opened_directory
    from tsckpt._ondisk.arrays import chunk_key
    from tsckpt._ondisk.chunking import shard_boxes

    ck, x = saved(tmp_path, layout_of, name, np.float64)
    shape, shard, chunk = LAYOUTS[name]
    checkpoint = _stored_checkpoint(ck)
    rec = checkpoint.arrays["w"]
    taken: list[int] = []

    def buffer(n):
        taken.append(n)
        return native.aligned_empty(n)

    with opened_directory(str(ck)) as fd:
        for origin, lengths in shard_boxes((0,) * len(shape), shape, rec.chunking):
            grid = [range(-(-n // c)) for n, c in zip(lengths, chunk)]
            cells = [tuple(int(i) for i in c) for c in np.ndindex(*[len(g) for g in grid])][::-1]  # any order
            found = _shardread.read_stored(checkpoint, fd, rec, origin, cells, buffer)
            assert [c.cell for c in found] == cells
            raw = (ck / chunk_key(rec, origin)).read_bytes()
            index = _entries(raw, shard, chunk)
            for c in found:
                start, nbytes = (int(v) for v in index[c.cell])
                assert c.stored.tobytes() == raw[start : start + nbytes]
                assert c.stored[-4:].tobytes() == google_crc32c.value(c.data.tobytes()).to_bytes(4, "little")
                assert c.key == chunk_key(rec, origin)
                first = [o + k * n for o, k, n in zip(origin, c.cell, chunk)]
                inside = tuple(slice(0, min(n, s - f)) for n, f, s in zip(chunk, first, shape))
                region = tuple(slice(f, f + sl.stop) for f, sl in zip(first, inside))
                same(c.data.view(np.float64).reshape(chunk)[inside], x[region])
                _shardread.check_stored(checkpoint, "w", c)  # intact
    assert bool(taken) == (io_mode != "mapped") and all(n % native.ALIGN == 0 for n in taken)


def _entries(raw: bytes, shard, chunk) -> np.ndarray:
    """A shard file's index: (offset, length) per inner chunk of its grid."""
    grid = [s // c for s, c in zip(shard, chunk)]
    return np.frombuffer(raw[-4 - 16 * int(np.prod(grid)) : -4], "<u8").reshape(*grid, 2)


def test_read_stored_damage_and_files_left_to_the_engine(damaged):
    """A missing shard file is damage; a link on the way is left to the engine (None); a
    flipped byte is found by check_stored, naming the leaf, the file and the chunk."""
    from tsckpt._codec.files import opened_directory

    ck, _ = damaged
    checkpoint = _stored_checkpoint(ck)
    rec = checkpoint.arrays["w"]
    f = ck / "w/c/1/0"
    data, index = _index(f)
    bad = bytearray(data)
    bad[int(index[1, 2, 0]) + 17] ^= 0x01
    f.write_bytes(bytes(bad))
    with opened_directory(str(ck)) as fd:
        found = _shardread.read_stored(checkpoint, fd, rec, (8, 0), [(1, 2), (0, 0)], native.aligned_empty)
        _shardread.check_stored(checkpoint, "w", found[1])
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            _shardread.check_stored(checkpoint, "w", found[0])
        assert str(info.value).startswith(f"'w' in {ck}: checksum mismatch")
        assert str(info.value).endswith("(w/c/1/0: inner chunk [1, 2] fails its crc32c)")
        os.rename(f, ck / "elsewhere")
        os.symlink(ck / "elsewhere", f)
        assert _shardread.read_stored(checkpoint, fd, rec, (8, 0), [(0, 0)], native.aligned_empty) is None
        os.remove(f)
        with pytest.raises(tsckpt.CorruptCheckpointError, match="w/c/1/0 does not exist"):
            _shardread.read_stored(checkpoint, fd, rec, (8, 0), [(0, 0)], native.aligned_empty)
