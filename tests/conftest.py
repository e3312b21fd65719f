from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.dist_helpers import LAYOUT_ENV

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests that use jax run it on the CPU, quietly


def pytest_configure(config):
    # torch warns on complex32 allocations; the tests use complex32 on purpose
    config.addinivalue_line("filterwarnings", "ignore:ComplexHalf support is experimental:UserWarning")


@pytest.fixture(params=["plain", "compact"])
def layout(request, monkeypatch):
    """Runs a test once per checkpoint layout: tsckpt.save (and so every verb built on it)
    defaults to that layout here and in the ranks run_ranks starts."""
    import tsckpt

    monkeypatch.setitem(tsckpt.save.__kwdefaults__, "layout", request.param)
    monkeypatch.setenv(LAYOUT_ENV, request.param)
    return request.param


@pytest.fixture
def ckdir(tmp_path):
    """A checkpoint location that does not exist yet."""
    return str(tmp_path / "ck")


@pytest.fixture
def small_chunks(monkeypatch):
    """Tiny chunk and shard targets (1 KiB inner chunks, 4 KiB shards), so small
    arrays get several shard files, each with several inner chunks."""
    import tsckpt._chunking as layout

    monkeypatch.setattr(layout, "INNER_CHUNK_BYTES", 1024)
    monkeypatch.setattr(layout, "SHARD_BYTES", 4096)


@pytest.fixture
def dirty_empty(monkeypatch):
    """np.empty and torch.empty return buffers full of 0xA5 bytes (bool: 0x01), as
    uninitialized memory may be: a result the read does not fully overwrite shows up
    deterministically instead of by allocator luck."""
    np_empty, torch_empty = np.empty, torch.empty

    def dirty_np(*args, **kwargs):
        a = np_empty(*args, **kwargs)
        if a.size:
            a.reshape(-1).view(np.uint8).fill(1 if a.dtype == np.bool_ else 0xA5)
        return a

    def dirty_torch(*args, **kwargs):
        t = torch_empty(*args, **kwargs)
        if t.numel() and t.device.type == "cpu":
            t.untyped_storage().fill_(1 if t.dtype == torch.bool else 0xA5)
        return t

    monkeypatch.setattr(np, "empty", dirty_np)
    monkeypatch.setattr(torch, "empty", dirty_torch)
