"""Chunk and shard shapes (tsckpt._ondisk.chunking): pure functions, plus what save writes."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tsckpt
from tsckpt._ondisk.records import Chunking
import tsckpt._ondisk.chunking as chunking
from tsckpt._ondisk.chunking import choose_chunking, largest_divisor_at_most, pieces, steps_from_cuts
from tests.conftest import examples


@pytest.mark.parametrize(
    "n, limit, want",
    [(12, 5, 4), (13, 5, 1), (12, 100, 12), (36, 6, 6), (36, 5, 4), (1, 1, 1), (7, 7, 7), (100, 0, 1)],
)
def test_largest_divisor_at_most(n, limit, want):
    assert largest_divisor_at_most(n, limit) == want


def test_steps_from_cuts():
    assert steps_from_cuts((8, 10), [[0, 4], [0]]) == ([4, 10], [True, False])
    assert steps_from_cuts((12,), [[0, 4, 6]]) == ([2], [True])  # gcd of interior starts
    assert steps_from_cuts((12,), [[0, 12]]) == ([12], [False])  # 12 is the end, not an interior start
    assert steps_from_cuts((0, 3), []) == ([1, 3], [False, False])  # zero-size dims still get a step of 1


def test_pieces_are_the_cells_of_the_cuts_inside_the_region():
    region, big = ((4, 0), (8, 6)), 1 << 20  # 48 MiB of 1 MiB items
    assert pieces(region, (), big) == [region]
    # cuts at or outside the region's edges are ignored; a dimension without cuts stays whole
    assert pieces(region, ((0, 4, 8, 12, 20), ()), big) == [((4, 0), (4, 6)), ((8, 0), (4, 6))]
    assert pieces(region, ((8,), (3,)), big) == [((4, 0), (4, 3)), ((4, 3), (4, 3)), ((8, 0), (4, 3)), ((8, 3), (4, 3))]
    # a region of at most one inner chunk stays one piece (one small file)
    assert pieces(region, ((8,), (3,)), chunking.INNER_CHUNK_BYTES // 48) == [region]
    assert len(pieces(region, ((8,), (3,)), chunking.INNER_CHUNK_BYTES // 48 + 1)) == 4


def test_scalar_and_small_arrays_are_one_plain_chunk():
    assert choose_chunking((), 4) == Chunking((), None)
    assert choose_chunking((10,), 4) == Chunking((10,), None)
    assert choose_chunking((3, 4, 5), 8) == Chunking((3, 4, 5), None)
    assert choose_chunking((0, 3), 4) == Chunking((1, 3), None)  # chunk dims are never 0


def test_default_targets_half_mib_inner_chunks_in_one_shard():
    # 4 MiB of float32: the last dim in 4 pieces of 256, 512 rows per 512 KiB inner chunk, one shard
    assert choose_chunking((1024, 1024), 4) == Chunking((1024, 1024), (512, 256))


def test_trailing_dim_pieces_serve_column_slices_and_rows():
    # 1 GiB float32: one row touches 4 chunks of 512 KiB (2 MiB); halves and quarters of columns align
    layout = choose_chunking((16384, 16384), 4)
    assert layout.chunk_shape == (32, 4096)
    assert layout.shard_shape == (4096, 16384)
    # too narrow for 4 pieces of >= 256 elements: 2 pieces
    assert choose_chunking((50257, 768), 2).chunk_shape == (680, 384)
    # 1-D arrays are never cut that way
    assert choose_chunking((1 << 20,), 4).chunk_shape == (131072,)
    # a dim writers already cut is left to their regions
    assert choose_chunking((8192, 1024), 4, [[], [0, 512]]) == Chunking((8192, 512), (256, 512))


def test_inner_chunks_fill_trailing_dims_first():
    assert choose_chunking((8, 256), 4, inner_bytes=1024, shard_bytes=4096) == Chunking((4, 256), (1, 256))
    # a trailing dim larger than the inner budget is itself cut, into even pieces (150 + 150, not 256 + 44)
    assert choose_chunking((4, 300), 4, inner_bytes=1024, shard_bytes=4096) == Chunking((2, 300), (1, 150))


def test_writer_boundaries_constrain_shards():
    # writers start at rows 0 and 4: no shard may cross row 4
    assert choose_chunking((8, 256), 4, [[0, 4]], inner_bytes=1024, shard_bytes=1 << 20) == Chunking((4, 256), (1, 256))
    # writers every 2 rows: shards of 2 rows, small enough for one plain chunk each
    assert choose_chunking((8, 256), 4, [[0, 2, 4, 6]], inner_bytes=4096, shard_bytes=1 << 20) == Chunking((2, 256), None)
    # a 2x2 grid of writers on a 6x10 array
    assert choose_chunking((6, 10), 4, [[0, 3], [0, 5]], inner_bytes=16, shard_bytes=1 << 20) == Chunking((3, 5), (1, 1))


def test_module_targets_are_read_at_call_time(small_chunks):
    assert choose_chunking((8, 256), 4) == Chunking((4, 256), (1, 256))


@st.composite
def shapes_and_cuts(draw):
    shape = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    cuts = []
    for n in shape:
        starts = draw(st.sets(st.integers(0, n - 1), max_size=3))
        cuts.append(sorted(starts | {0}))
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 16]))
    inner = draw(st.sampled_from([16, 64, 256, 1024]))
    shard = inner * draw(st.sampled_from([1, 2, 4, 16]))
    return shape, cuts, itemsize, inner, shard


@settings(max_examples=examples(3))  # cheap, and the shapes vary a lot
@given(shapes_and_cuts())
def test_layout_invariants(args):
    shape, cuts, itemsize, inner_bytes, shard_bytes = args
    layout = choose_chunking(shape, itemsize, cuts, inner_bytes=inner_bytes, shard_bytes=shard_bytes)
    shard = layout.shard_shape
    inner = layout.chunk_shape or shard
    assert len(shard) == len(inner) == len(shape)
    assert all(s >= 1 for s in shard) and all(c >= 1 for c in inner)
    # shards are whole multiples of the inner chunk
    assert all(s % c == 0 for s, c in zip(shard, inner))
    # no shard (file) crosses a writer's region start: each file has one writer
    for d, starts in enumerate(cuts):
        for c in starts:
            assert c % shard[d] == 0, (shape, cuts, layout)
    # byte targets hold (a single element may exceed them)
    assert math.prod(inner) * itemsize <= max(inner_bytes, itemsize)
    assert math.prod(shard) * itemsize <= max(shard_bytes, math.prod(inner) * itemsize)
    if layout.chunk_shape is not None:
        assert layout.chunk_shape != layout.shard_shape


def test_saved_array_uses_sharding_codec_with_crc32c(ckdir, small_chunks):
    tsckpt.save(ckdir, {"x": np.zeros((8, 256), np.float32), "small": np.zeros(3, np.int16)})
    with open(os.path.join(ckdir, "x", "zarr.json")) as f:
        node = json.load(f)
    assert node["chunk_grid"] == {"name": "regular", "configuration": {"chunk_shape": [4, 256]}}
    assert node["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "/"}}
    checked = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    assert node["codecs"] == [
        {
            "name": "sharding_indexed",
            "configuration": {"chunk_shape": [1, 256], "codecs": checked, "index_codecs": checked, "index_location": "end"},
        }
    ]
    # one file per shard, all-zero chunks included: a missing file is always an error
    assert sorted(os.listdir(os.path.join(ckdir, "x", "c"))) == ["0", "1"]
    assert os.listdir(os.path.join(ckdir, "x", "c", "0")) == ["0"]
    # 4 inner chunks of 1024 bytes + crc32c each, then the index (4 x 16 bytes + crc32c)
    assert os.path.getsize(os.path.join(ckdir, "x", "c", "1", "0")) == 4 * 1028 + 4 * 16 + 4

    with open(os.path.join(ckdir, "small", "zarr.json")) as f:
        small = json.load(f)
    assert small["codecs"] == checked and small["chunk_grid"]["configuration"]["chunk_shape"] == [3]
    # one file: named with the "." separator, beside the zarr.json (no "c/" directory)
    assert small["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "."}}
    assert sorted(os.listdir(os.path.join(ckdir, "small"))) == ["c.0", "zarr.json"]
    assert os.path.getsize(os.path.join(ckdir, "small", "c.0")) == 3 * 2 + 4

    md = tsckpt.metadata(ckdir)["x"]
    assert (md.chunk_shape, md.shard_shape, md.nbytes) == ((1, 256), (4, 256), 8 * 256 * 4)


def test_without_inner_chunks_each_shard_is_one_chunk_of_whole_trailing_dimensions():
    # a 12 MiB matrix: one chunk (the default cuts it into inner chunks of column quarters)
    assert choose_chunking((4096, 768), 4).chunk_shape is not None
    assert choose_chunking((4096, 768), 4, inner_chunks=False) == Chunking((4096, 768), None)
    # each writer's region one chunk; above the shard bound, row blocks of whole rows
    assert choose_chunking((4096, 768), 4, [[2048]], inner_chunks=False) == Chunking((2048, 768), None)
    assert choose_chunking((4096, 768), 4, shard_bytes=4 << 20, inner_chunks=False) == Chunking((1024, 768), None)
    assert choose_chunking((), 4, inner_chunks=False) == Chunking((), None)
