"""Opening one stored array through TensorStore's zarr3 driver."""

from __future__ import annotations

from typing import Any

import tensorstore as ts

from . import _dtypes, _store
from ._format import ArrayRecord, Layout, array_metadata
from ._store import Location


def array_node(rec: ArrayRecord) -> dict[str, Any]:
    """The array's zarr.json; complex32 is stored as float16 with a trailing (re, im) dim."""
    layout = rec.layout
    if rec.dtype == "complex32":
        layout = Layout((*layout.shard_shape, 2), None if layout.chunk_shape is None else (*layout.chunk_shape, 2))
    return array_metadata(
        _dtypes.storage_shape(rec.dtype, rec.shape),
        _dtypes.storage_dtype(rec.dtype),
        layout,
        {"tsckpt": {"dtype": rec.dtype, "kind": rec.kind}},
    )


def open_array(loc: Location, rec: ArrayRecord, *, write: bool = False) -> ts.TensorStore:
    return open_array_future(loc, rec, write=write).result()


def open_array_future(loc: Location, rec: ArrayRecord, *, write: bool = False) -> ts.Future:
    """Open with missing chunks reported as errors rather than read as fill values.

    Writers do not read zarr.json (the root metadata already has everything, and
    rank 0 may write the node after other ranks start). Readers do: TensorStore
    then checks the stored zarr.json against the root metadata's record (shape,
    dtype, chunking, codecs), so metadata that disagrees with the data is an error
    rather than a silent misreading.
    """
    meta = array_node(rec)
    del meta["attributes"]
    spec = {
        "driver": "zarr3",
        "kvstore": loc.sub(rec.path),
        "metadata": meta,
        "assume_metadata": write,
        # Every chunk is written, even all-zero ones, so that a missing file is
        # always an error and never silently read back as zeros.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }
    return ts.open(spec, context=_store.CONTEXT, read=not write, write=write)
