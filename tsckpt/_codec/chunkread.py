"""Restore's reads of unsharded chunk files (:mod:`.encode`) into CPU memory.

Each array's zarr.json is read once and checked against its root record, as TensorStore
would check it, and each chunk file is one kvstore read, checked by its crc32c and
copied into the destination: opening a TensorStore array per leaf dominated restores of
thousands of small leaves. Works in any kvstore (local, object stores, memory, the
compact layout's database). Which arrays are read here is :func:`.route.route`'s rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from .. import _store
from .._arrays import chunk_key, stored_node_problem
from .._format import ROOT_KEY
from .._plan import shard_boxes
from .._progress import Progress
from .._reader import Checkpoint
from .._types import Dest
from .._window import Window
from .encode import decode_chunk
from .layout import storage_box, storage_layout


@dataclasses.dataclass(frozen=True)
class _Read:
    """One chunk file's part of one destination, its read started."""

    dest: Dest
    view: np.ndarray  # the destination memory in the stored dtype and shape
    chunk: tuple[int, ...]  # the stored chunk shape
    read: Any  # the kvstore read of the chunk file
    src: tuple[slice, ...]  # the part wanted, in the chunk
    dst: tuple[slice, ...]  # where it goes, in the destination
    nbytes: int


def read_chunks(
    ck: Checkpoint, targets: Sequence[tuple[Dest, np.ndarray]], progress: Progress | None, window: int
) -> list[tuple[Dest, np.ndarray]]:
    """Read each destination of ``targets`` (with its memory as a writable view in the
    stored dtype and shape), an array without inner chunks; returns the targets left for
    TensorStore: any whose zarr.json or chunk is not exactly as expected, so that
    TensorStore reports the damage as usual. ``window`` bounds the bytes of reads in flight."""
    kv = ts.KvStore.open(ck.data(), context=_store.CONTEXT).result()
    nodes: dict[str, Any] = {}  # path: the read of its zarr.json
    node_ok: dict[str, bool] = {}
    left: dict[int, tuple[Dest, np.ndarray]] = {}

    def settle(r: _Read) -> None:
        path = r.dest.item.path
        if id(r.dest) in left:
            return
        try:
            if path not in node_ok:
                node = nodes[path].result()
                node_ok[path] = node.state == "value" and stored_node_problem(node.value, ck.arrays[path]) is None
            chunk = r.read.result()
        except ValueError:  # unreadable: TensorStore says why
            node_ok.setdefault(path, False)
            chunk = None
        data = None
        if node_ok[path] and chunk is not None and chunk.state == "value":
            data = decode_chunk(chunk.value, r.view.dtype, r.chunk)
        if data is None:
            left[id(r.dest)] = (r.dest, r.view)
            return
        r.view[r.dst] = data[r.src]
        if progress is not None:
            progress.update(r.nbytes, 1)

    in_flight: Window[_Read] = Window(window, settle)
    for dest, view in targets:
        item = dest.item
        rec = ck.arrays[item.path]
        shard = storage_layout(rec).shard
        if rec.path not in nodes:
            nodes[rec.path] = kv.read(f"{rec.path}/{ROOT_KEY}")
        base, _ = storage_box(rec, item.storage_offsets, item.lengths)
        for off, ln in shard_boxes(item.storage_offsets, item.lengths, rec.chunking):
            offsets, lengths = storage_box(rec, off, ln)
            first = tuple(o // g * g for o, g in zip(offsets, shard))
            src = tuple(slice(o - f, o - f + n) for o, f, n in zip(offsets, first, lengths))
            dst = tuple(slice(o - b, o - b + n) for o, b, n in zip(offsets, base, lengths))
            nbytes = math.prod(lengths) * view.dtype.itemsize
            in_flight.add(_Read(dest, view, shard, kv.read(chunk_key(rec, off)), src, dst, nbytes), nbytes)
    in_flight.drain()
    return list(left.values())
