"""The own codec's routing rule and switch (tsckpt/_codec/route.py), its shard index and chunk
encoding, and the own reader pinned to TensorStore: files TensorStore writes alone are read
by the own reader with the same values, and files the own writer writes are TensorStore's
bytes and read by TensorStore."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import crc32c
import google_crc32c  # an independent crc32c to check the stored bytes against
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch

import tsckpt
import tsckpt._save.plan as plan
from tsckpt._read import engine as _restore
from tsckpt._save import write as _save
from tsckpt._ondisk.arrays import MISSING_CHUNK, array_node
from tsckpt._codec import route as _route
from tsckpt._codec import chunkread, shardwrite
from tsckpt._codec.encode import decode_chunk, encode_chunk
from tsckpt._codec.files import ShardIndex, node_agrees, opened_directory, stored_shapes, written_node
from tsckpt._codec.route import Place, Route, place, route
from tsckpt._ondisk.records import ArrayRecord, Chunking
from tsckpt._formats.sources import open_checkpoint
from tsckpt._storage import native

LOCAL = {"driver": "file", "path": "/ck/"}


def rec(shape, shard, inner=None, dtype="float32") -> ArrayRecord:
    return ArrayRecord("x", tuple(shape), dtype, "numpy", Chunking(tuple(shard), None if inner is None else tuple(inner)))


# ---- the rule ----------------------------------------------------------------------------------


def test_route_by_chunking_and_place():
    files = place(LOCAL, "plain")
    memory = place({"driver": "memory", "path": "ck/"}, "plain")
    compact = place({"driver": "ocdbt", "base": LOCAL}, "compact")
    assert files == Place(True, "/ck/") and memory == Place(True, None) and compact == Place(True, None)
    sharded = rec((64, 64), (32, 64), (8, 64))
    for dtype in ("float32", "bool", "int4", "float4_e2m1fn", "bfloat16", "float8_e5m2", "complex64", "complex32"):
        r = rec((64, 64), (32, 64), (8, 64), dtype)
        assert [route(r, p) for p in (files, memory, compact)] == [Route.SHARD, Route.TENSORSTORE, Route.TENSORSTORE]
    for unsharded in (rec((5, 7), (5, 7)), rec((10, 7), (4, 4)), rec((), ())):
        assert [route(unsharded, p) for p in (files, memory, compact)] == [Route.CHUNK] * 3
    assert route(rec((0, 64), (1, 64), (1, 8)), files) is Route.TENSORSTORE  # empty: no files
    assert route(rec((0, 4), (1, 4)), files) is Route.TENSORSTORE
    assert route(rec((64, 64), (30, 64), (8, 64)), files) is Route.TENSORSTORE  # shard not a multiple
    foreign = place(LOCAL, "plain", foreign=True)
    assert foreign == Place(False, None, "arrays of another format")
    assert route(sharded, foreign) is Route.TENSORSTORE and route(rec((5,), (5,)), foreign) is Route.TENSORSTORE
    assert place(LOCAL, "plain", shard_files=False) == Place(True, None)  # save's OWN_SHARD_FILES off
    assert place({**LOCAL, "file_io_sync": False}, "plain") == Place(True, None)  # options: TensorStore's files


def test_the_switch(tmp_path, monkeypatch):
    monkeypatch.delenv(_route.ENV, raising=False)
    assert _route.setting() == "auto" and place(LOCAL, "plain").own
    monkeypatch.setenv(_route.ENV, "tensorstore")  # read at every call
    assert place(LOCAL, "plain") == Place(False, None, "TSCKPT_CODEC=tensorstore")
    assert route(rec((5,), (5,)), place(LOCAL, "plain")) is Route.TENSORSTORE
    monkeypatch.setattr(_route, "CODEC", "auto")  # the module's setting wins over the environment
    assert place(LOCAL, "plain").own
    monkeypatch.setattr(_route, "CODEC", None)
    monkeypatch.setenv(_route.ENV, "TensorStore")
    with pytest.raises(ValueError) as info:
        place(LOCAL, "plain")
    assert str(info.value) == (
        "the environment variable TSCKPT_CODEC is 'TensorStore'; set it to 'auto' (tsckpt's own codec where it "
        "applies, the default) or 'tensorstore' (every read and write through TensorStore)"
    )
    monkeypatch.setattr(_route, "CODEC", "own")
    with pytest.raises(ValueError, match=r"^tsckpt._codec.route.CODEC is 'own'; set it to 'auto'") as info:
        tsckpt.save(tmp_path / "ck", {"x": np.zeros(3)})
    assert not (tmp_path / "ck").exists()  # refused before the claim: nothing was written
    assert not getattr(info.value, "__notes__", [])  # no clean-up was needed
    monkeypatch.setattr(_route, "CODEC", None)
    monkeypatch.delenv(_route.ENV)
    tsckpt.save(tmp_path / "ok", {"x": np.arange(3.0)})
    monkeypatch.setenv(_route.ENV, "TensorStore")
    with pytest.raises(ValueError, match=r"^the environment variable TSCKPT_CODEC is 'TensorStore'"):
        tsckpt.restore(tmp_path / "ok")


# ---- spies -------------------------------------------------------------------------------------


class Seen(dict):
    def reset(self) -> None:
        for calls in self.values():
            calls.clear()


@pytest.fixture
def own_io(monkeypatch):
    """Counts what the own codec writes and reads, and the arrays TensorStore opens to read."""
    seen = Seen({name: [] for name in ("shard files", "chunk files", "read chunks", "read shards", "tensorstore")})
    write_shard, encode, write_chunk = shardwrite.write_shard, _save.encode_chunk, shardwrite.write_chunk
    read_chunks, read_sharded, open_all = _restore.read_chunks, _restore.read_sharded, _restore._open_all

    def spy(name, real, count=lambda *a: 1):
        def run(*args, **kwargs):
            seen[name].append(count(*args))
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(shardwrite, "write_shard", spy("shard files", write_shard))
    monkeypatch.setattr(_save, "encode_chunk", spy("chunk files", encode))  # into a kvstore
    monkeypatch.setattr(shardwrite, "write_chunk", spy("chunk files", write_chunk))  # a local file
    monkeypatch.setattr(_restore, "read_chunks", spy("read chunks", read_chunks, lambda ck, dests, *a: len(dests)))
    monkeypatch.setattr(_restore, "read_sharded", spy("read shards", read_sharded, lambda ck, directory, dests, *a: len(dests)))
    monkeypatch.setattr(_restore, "_open_all", spy("tensorstore", open_all, lambda ck, paths: list(paths)))
    return seen


@pytest.fixture
def chunking_of(monkeypatch):
    """Save arrays with the chunking given per array shape."""
    chosen: dict[tuple[int, ...], Chunking] = {}
    monkeypatch.setattr(plan, "choose_chunking", lambda shape, itemsize, cuts=(), **_: chosen[tuple(shape)])

    def set_chunking(shape, shard, inner):
        chosen[tuple(shape)] = Chunking(tuple(shard), None if inner is None else tuple(inner))

    return set_chunking


def files_of(root) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if os.path.relpath(p, root) != "zarr.json":  # the root differs (time stamps)
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = f.read()
    return out


# ---- the own reader pinned to TensorStore, and the own writer to TensorStore ----------------------

CHUNKINGS = {
    # name: (shape, shard shape, inner chunk shape)
    "sharded": ((32, 16), (16, 16), (8, 16)),
    "edges": ((30, 18), (16, 16), (4, 8)),  # partial edge shards; inner chunks wholly outside are not stored
    "1d": ((1000,), (256,), (64,)),
    "3d": ((7, 9, 12), (4, 6, 12), (2, 3, 4)),
    "one chunk": ((5, 7), (5, 7), None),
    "chunks": ((10, 7), (4, 4), None),  # unsharded, edge chunks padded
}
DTYPES = ["float32", "bool", "int8", "uint64", "int4", "float4_e2m1fn", "bfloat16", "float8_e4m3fn", "float8_e5m2",
          "float8_e8m0fnu", "complex64", "complex32"]


def values(shape, dtype, seed=0):
    """A numpy array (a torch tensor for complex32) of ``dtype`` with varied values."""
    rng = np.random.default_rng(seed)
    if dtype == "complex32":
        return torch.from_numpy(rng.standard_normal((*shape, 2)).astype(np.float16)).view(torch.complex32).reshape(shape)
    x = rng.standard_normal(shape) * 20
    if dtype == "bool":
        return x > 0
    if dtype in ("int4", "int8", "uint64"):
        lo, hi = {"int4": (-8, 8), "int8": (-128, 128), "uint64": (0, 2**63)}[dtype]
        return rng.integers(lo, hi, shape).astype(getattr(ml_dtypes, dtype, None) or np.dtype(dtype))
    if dtype == "complex64":
        return (x + 1j * rng.standard_normal(shape)).astype(np.complex64)
    if dtype in ("float4_e2m1fn", "float8_e8m0fnu"):
        return (2.0 ** rng.integers(-2, 3, shape) * (np.sign(x) if dtype == "float4_e2m1fn" else 1)).astype(
            getattr(ml_dtypes, dtype)
        )
    return x.astype(getattr(ml_dtypes, dtype, None) or np.dtype(dtype))


def raw(a) -> np.ndarray:
    """The bytes of a restored or original leaf, with its shape."""
    a = tsckpt._base.dtypes.tensor_to_numpy(a) if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape + (-1,))


def zeros_like(x):
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else np.zeros_like(x)


@pytest.mark.parametrize("name", list(CHUNKINGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensorstores_files_read_by_the_own_reader(tmp_path, chunking_of, own_io, monkeypatch, name, dtype):
    shape, shard, inner = CHUNKINGS[name]
    chunking_of(shape, shard, inner)
    x = values(shape, dtype)
    theirs, mine = tmp_path / "tensorstore", tmp_path / "own"
    monkeypatch.setenv(_route.ENV, "tensorstore")
    tsckpt.save(theirs, {"x": x})
    assert own_io["shard files"] == own_io["chunk files"] == []  # TensorStore wrote every file
    monkeypatch.delenv(_route.ENV)
    tsckpt.save(mine, {"x": x})
    assert len(own_io["shard files" if inner else "chunk files"]) == len(files_of(mine / "x"))  # every file
    assert files_of(theirs) == files_of(mine)  # byte for byte

    # the own reader reads TensorStore's files: whole, in place, and a partial box
    own_io.reset()
    target = zeros_like(x)
    tsckpt.restore(theirs, {"x": target}, inplace=True)
    assert np.array_equal(raw(target), raw(x))
    lo = tuple(n // 3 for n in shape)
    box = tuple(slice(a, n - n // 4) for a, n in zip(lo, shape))
    part = tsckpt.ShardedArray(zeros_like(x[box]), shape, lo)
    assert np.array_equal(raw(tsckpt.restore(theirs, {"x": part})["x"].local), raw(x[box]))
    tier = "read shards" if inner else "read chunks"
    assert own_io[tier] == [1, 1] and own_io["tensorstore"] == []  # TensorStore opened no array

    # TensorStore reads the own writer's files (the switch on, for restores too)
    monkeypatch.setenv(_route.ENV, "tensorstore")
    own_io.reset()
    target = zeros_like(x)
    tsckpt.restore(mine, {"x": target}, inplace=True)
    assert np.array_equal(raw(target), raw(x))
    assert own_io["read chunks"] == own_io["read shards"] == [] and own_io["tensorstore"] == [["x"]]


def test_int4_is_stored_one_element_a_byte(tmp_path, chunking_of, monkeypatch):
    """A 64 x 64 int4 array in 32 x 32 inner chunks: one 4,180-byte shard file, whoever writes it."""
    chunking_of((64, 64), (64, 64), (32, 32))
    x = values((64, 64), "int4")
    for codec in ("tensorstore", "auto"):
        monkeypatch.setenv(_route.ENV, codec)
        tsckpt.save(tmp_path / codec, {"x": x})
        data = (tmp_path / codec / "x/c.0.0").read_bytes()
        assert len(data) == 4 * (1024 + 4) + 4 * 16 + 4 == 4180
        assert data[:32] == x[0, :32].view(np.uint8).tobytes()


@pytest.mark.parametrize("name", ["edges", "chunks"])
def test_chunks_missing_from_tensorstores_files_are_errors_for_both_readers(tmp_path, chunking_of, monkeypatch, name):
    """TensorStore leaves out chunks equal to the fill value unless told to store them
    (tsckpt always stores them): the own reader and TensorStore both report such a chunk
    as missing, never read it as zeros."""
    shape, shard, inner = CHUNKINGS[name]
    chunking_of(shape, shard, inner)
    x = values(shape, "float32") + 1
    ck = tmp_path / "ck"
    tsckpt.save(ck, {"x": x})
    r = open_checkpoint(ck).arrays["x"]
    zero_first_chunk = x.copy()
    zero_first_chunk[tuple(slice(0, n) for n in (inner or shard))] = 0
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ck / "x")}, "metadata": array_node(r),
            "store_data_equal_to_fill_value": False}
    ts.open(spec).result().write(zero_first_chunk).result()  # rewrites every file, the zero chunk left out
    messages = []
    for codec in ("auto", "tensorstore"):
        monkeypatch.setenv(_route.ENV, codec)
        with pytest.raises(tsckpt.CorruptCheckpointError) as info:
            tsckpt.restore(ck, {"x": np.zeros_like(x)}, inplace=True)
        messages.append(str(info.value))
    for msg in messages:
        assert msg.startswith(f"'x' in {ck}: a chunk file is missing; restore from another checkpoint."), msg
    # the other chunks read as written
    monkeypatch.setenv(_route.ENV, "auto")
    lo = tuple(n - 2 for n in shape)
    part = tsckpt.ShardedArray(np.zeros((2,) * len(shape), np.float32), shape, lo)
    np.testing.assert_array_equal(tsckpt.restore(ck, {"x": part})["x"].local, x[tuple(slice(a, None) for a in lo)])


def test_without_a_hardware_crc32c_tensorstore_does_all_io(tmp_path, own_io, monkeypatch, small_chunks, caplog):
    monkeypatch.setattr(crc32c, "hardware_based", False)
    monkeypatch.setattr(_route, "_told", set())
    monkeypatch.delenv(_route.ENV, raising=False)
    tree = {"big": np.arange(3000, dtype=np.float32), "small": np.arange(5, dtype=np.int16)}
    with caplog.at_level(logging.WARNING, logger="tsckpt"):
        tsckpt.save(tmp_path / "ck", tree)
        out = tsckpt.restore(tmp_path / "ck")
        tsckpt.restore(tmp_path / "ck")
    assert all(np.array_equal(out[k], v) for k, v in tree.items())
    assert own_io["shard files"] == own_io["chunk files"] == own_io["read chunks"] == own_io["read shards"] == []
    assert sorted(own_io["tensorstore"][0]) == ["big", "small"]
    warned = [r.getMessage() for r in caplog.records if "crc32c instruction" in r.getMessage()]
    assert warned == [  # once per process
        "tsckpt: the CPU has no crc32c instruction crc32c can use (its table-driven crc32c is no faster than "
        "TensorStore's); every file is read and written through TensorStore"
    ]


# ---- the shard index and chunk encoding ---------------------------------------------------------


def test_shard_index_round_trip_and_damage():
    index = ShardIndex.missing((2, 3))
    index.put((0, 1), 0, 68)
    index.put((1, 2), 68, 68)
    raw_bytes, crc = index.stored()
    stored = raw_bytes.tobytes() + crc
    assert len(stored) == ShardIndex.nbytes((2, 3)) == 6 * 16 + 4
    assert crc == google_crc32c.value(raw_bytes.tobytes()).to_bytes(4, "little")
    back = ShardIndex.parse(stored, (2, 3))
    assert back is not None and back.entry((0, 1)) == (0, 68) and back.entry((1, 2)) == (68, 68)
    assert back.entry((0, 0)) is None and int(back.entries[0, 0, 0]) == MISSING_CHUNK
    assert ShardIndex.parse(stored[:-1] + bytes([stored[-1] ^ 1]), (2, 3)) is None  # its crc32c fails
    assert ShardIndex.parse(stored, (3, 3)) is None  # another length


def test_edge_chunks_are_padded_with_zero_bytes():
    src = np.array([[1, 2, 3]], ml_dtypes.float8_e8m0fnu)  # a type without a zero
    data = encode_chunk(src, (2, 4))
    assert data[:8] == src[0].view(np.uint8).tobytes() + b"\0" + b"\0" * 4
    assert data[8:] == google_crc32c.value(data[:8]).to_bytes(4, "little")
    back = decode_chunk(data, src.dtype, (2, 4))
    assert back is not None and back[:1, :3].view(np.uint8).tobytes() == src.view(np.uint8).tobytes()
    assert decode_chunk(data[:-1], src.dtype, (2, 4)) is None  # short
    assert decode_chunk(bytes([data[0] ^ 1]) + data[1:], src.dtype, (2, 4)) is None  # altered


def test_stored_shapes_of_complex32():
    r = rec((6, 10), (4, 10), (2, 5), "complex32")
    assert stored_shapes(r) == ((4, 10, 2), (2, 5, 2), (6, 10, 2)) and stored_shapes(r).grid == (2, 2, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 1, 3)])
def test_written_node_is_the_zarr_json_tsckpt_writes(tmp_path, dtype, shape):
    """The template of a one-chunk array's node gives the bytes save wrote, for every dtype and rank."""
    tsckpt.save(tmp_path / "ck", {"x": values(shape, dtype)})
    rec = open_checkpoint(tmp_path / "ck").arrays["x"]
    assert rec.chunking.chunk_shape is None and tuple(rec.chunking.shard_shape) == shape
    assert written_node(rec) == (tmp_path / "ck" / "x" / "zarr.json").read_bytes()
    assert _agrees(tmp_path / "ck", rec)


def _agrees(directory, rec) -> bool:
    with opened_directory(str(directory)) as fd:
        return node_agrees(fd, rec)


def test_written_node_only_for_one_chunk_arrays():
    assert written_node(ArrayRecord("x", (8, 8), "float32", "numpy", Chunking((4, 8), None))) is None  # two files
    assert written_node(ArrayRecord("x", (8, 8), "float32", "numpy", Chunking((8, 8), (4, 8)))) is None  # sharded
    assert written_node(ArrayRecord("x", (), "float32", "numpy", Chunking((), None))) is None  # rank 0: parsed


def test_node_agrees_parses_a_node_written_otherwise(tmp_path):
    """A node with other formatting is parsed and compared field by field; one that disagrees is refused."""
    tsckpt.save(tmp_path / "ck", {"x": np.arange(6, dtype=np.int64)})
    rec = open_checkpoint(tmp_path / "ck").arrays["x"]
    node = tmp_path / "ck" / "x" / "zarr.json"
    node.write_text(json.dumps(array_node(rec), indent=2))
    assert node.read_bytes() != written_node(rec) and _agrees(tmp_path / "ck", rec)
    assert not _agrees(tmp_path / "ck", dataclasses.replace(rec, dtype="float64"))  # same size, misread
    node.unlink()
    assert not _agrees(tmp_path / "ck", rec)


@pytest.mark.parametrize("change", ["longer", "shorter", "flipped"])
def test_one_chunk_files_not_as_written_are_left_to_the_kvstore_path(tmp_path, own_io, change):
    """A one-chunk file of another length or failing its crc32c is not taken by the positional read:
    the kvstore path reads it, and refuses one of another length itself (TensorStore would read a
    file with bytes after its crc32c, which zarr readers refuse); one failing its crc32c is left to
    TensorStore, which reports the damage as before."""
    x = np.arange(100, dtype=np.float32)
    tsckpt.save(tmp_path / "ck", {"x": x})
    f = tmp_path / "ck" / "x" / "c.0"
    data = f.read_bytes()
    f.write_bytes({"longer": data + b"\0", "shorter": data[:-1], "flipped": data[:7] + bytes([data[7] ^ 1]) + data[8:]}[change])
    with pytest.raises(tsckpt.CorruptCheckpointError) as info:
        tsckpt.restore(tmp_path / "ck", {"x": np.zeros_like(x)}, inplace=True)
    where = f"'x' in {tmp_path / 'ck'}: "
    size = {
        "longer": "x/c.0 is 405 bytes, 1 more than the 404 bytes its record gives it (the chunk's 400 bytes, then "
        "their 4-byte crc32c); zarr readers refuse bytes after the crc32c",
        "shorter": "x/c.0 is 403 bytes, 1 fewer than the 404 bytes its record gives it (the chunk's 400 bytes, then "
        "their 4-byte crc32c)",
    }
    if change in size:
        assert str(info.value) == (
            f"{where}stored data could not be decoded (truncated or damaged file); restore from another checkpoint. "
            f"({size[change]})"
        )
        assert own_io["read chunks"] == [1] and own_io["tensorstore"] == []
    else:
        assert str(info.value).startswith(f"{where}checksum mismatch") and own_io["tensorstore"] == [["x"]]
    own_io.reset()
    f.write_bytes(data)
    target = np.zeros_like(x)
    tsckpt.restore(tmp_path / "ck", {"x": target}, inplace=True)
    assert np.array_equal(target, x) and own_io["tensorstore"] == []  # the intact file: read without TensorStore


def test_many_one_chunk_leaves_read_by_the_threads(tmp_path, monkeypatch):
    """Enough leaves to split among the threads: every one lands in its own target."""
    xs = {f"t{i}": np.full(i + 1, i, dtype=np.int32) for i in range(3 * chunkread._SPLIT_FROM)}
    tsckpt.save(tmp_path / "ck", xs)
    targets = {k: np.zeros_like(v) for k, v in xs.items()}
    tsckpt.restore(tmp_path / "ck", targets, inplace=True)
    assert all(np.array_equal(targets[k], v) for k, v in xs.items())


def test_node_agrees_reads_past_the_written_node(tmp_path):
    """The written node is read with one read of one byte more: a longer file is read whole and
    parsed (trailing space: still the same node; trailing bytes that are not JSON: refused)."""
    tsckpt.save(tmp_path / "ck", {"x": np.arange(6, dtype=np.int64)})
    rec = open_checkpoint(tmp_path / "ck").arrays["x"]
    node = tmp_path / "ck" / "x" / "zarr.json"
    written = node.read_bytes()
    assert _agrees(tmp_path / "ck", rec)
    node.write_bytes(written + b" " * 70_000)  # longer than one read of 64 KiB
    assert _agrees(tmp_path / "ck", rec) and not _agrees(tmp_path / "ck", dataclasses.replace(rec, dtype="float64"))
    node.write_bytes(written + b"x")
    assert not _agrees(tmp_path / "ck", rec)
    node.write_bytes(written[:-1])
    assert not _agrees(tmp_path / "ck", rec)
    node.unlink()
    assert not _agrees(tmp_path / "ck", rec)


def test_local_reads_take_a_second_thread_only_when_the_files_are_not_all_cached(tmp_path, monkeypatch):
    """Files just written are in the page cache: one thread reads them. Where the page cache
    cannot be asked, or a probed file is missing, the reads keep their threads; the values are
    right either way."""
    tree = {f"t{i}": torch.arange(i, i + 16, dtype=torch.float32) for i in range(80)}
    tsckpt.save(tmp_path / "ck", tree)
    target = {k: torch.empty_like(v) for k, v in tree.items()}
    threads: list[int] = []
    real = chunkread.Workers

    def counting(n, *args, **kwargs):
        threads.append(n + 1)
        return real(n, *args, **kwargs)

    monkeypatch.setattr(chunkread, "Workers", counting)
    out = tsckpt.restore(tmp_path / "ck", target)
    assert all(torch.equal(out[k], v) for k, v in tree.items())
    if sys.platform == "linux":
        assert threads == []  # one thread: no pool made
    monkeypatch.setattr(native, "has_mincore", lambda: False)
    out = tsckpt.restore(tmp_path / "ck", target)
    assert all(torch.equal(out[k], v) for k, v in tree.items()) and threads == [chunkread.LOCAL_THREADS]


@pytest.mark.parametrize("target", ["fresh", "none", "inplace"])
def test_one_reading_thread_has_its_destinations_prefaulted_beside_it(tmp_path, monkeypatch, target):
    """Cached files, one reading thread and a spare CPU: the memory of every destination, in
    the order read, goes to the prefaulting helper; with one CPU, none does. The values are
    right either way."""
    tree = {f"t{i:03d}": torch.arange(i, i + 16 + i, dtype=torch.float32) for i in range(80)}
    tsckpt.save(tmp_path / "ck", tree)
    given: list[list[tuple[int, int]]] = []
    real = chunkread.prefaulted

    def recording(buffers):
        given.append(list(buffers))
        return real(buffers)

    monkeypatch.setattr(chunkread, "prefaulted", recording)
    monkeypatch.setattr(chunkread, "cpus", lambda: 2)
    targets = {k: torch.empty_like(v) for k, v in tree.items()}

    def restore():
        if target == "none":
            return tsckpt.restore(tmp_path / "ck")
        return tsckpt.restore(tmp_path / "ck", targets, inplace=target == "inplace")

    out = restore()
    assert all(np.array_equal(np.asarray(out[k]), v.numpy()) for k, v in tree.items())
    if sys.platform == "linux":  # the cache probe: one thread
        memory = [(np.asarray(out[k]).ctypes.data, v.nbytes) for k, v in sorted(tree.items())]
        assert len(given) == 1 and sorted(given[0]) == sorted(memory)
        if target == "inplace":
            assert [a for a, _ in memory] == [t.data_ptr() for _, t in sorted(targets.items())]
    monkeypatch.setattr(chunkread, "cpus", lambda: 1)
    given.clear()
    out = restore()
    assert all(np.array_equal(np.asarray(out[k]), v.numpy()) for k, v in tree.items())
    assert given == [[]]  # one CPU: nothing to prefault on


def test_the_cache_probe_is_false_for_a_missing_file(tmp_path):
    tree = {f"t{i}": torch.arange(16.0) for i in range(16)}
    tsckpt.save(tmp_path / "ck", tree)
    ck = open_checkpoint(tmp_path / "ck")
    dests = [_kinds_whole_dest(ck, p) for p in tree]
    os.remove(tmp_path / "ck" / "t0" / "c.0")
    assert not chunkread._cached(str(tmp_path / "ck"), ck, dests)
    if sys.platform == "linux":
        assert chunkread._cached(str(tmp_path / "ck"), ck, dests[1:])  # just written: cached


def _kinds_whole_dest(ck, path):
    from tsckpt._leaves.registry import destination

    return destination(ck.arrays[path], path, torch.empty(16), False)
