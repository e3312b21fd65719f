"""Files tsckpt encodes itself must be byte-identical to TensorStore's for the same metadata."""

from __future__ import annotations

import os

import pytest
import tensorstore as ts
import torch

import tsckpt
from tsckpt._arrays import array_node
from tsckpt._reader import load


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
    rec = load(d).arrays["x"]
    ref_dir = str(tmp_path / "ref")
    ref = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": ref_dir}, "metadata": array_node(rec), "create": True}).result()
    ref.write(tsckpt._dtypes.tensor_to_numpy(t)).result()
    mine, theirs = _files(os.path.join(d, "x")), _files(ref_dir)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert mine[key] == theirs[key], key
    return load(d).array_metadata("x")


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
