"""Where arrays live (per layout) and opening one through TensorStore's zarr3 driver."""

from __future__ import annotations

from typing import Any

import tensorstore as ts

from . import _dtypes, _store
from ._format import LAYOUT_PLAIN, ArrayRecord, Layout, array_metadata
from ._store import Location

# The compact layout's per-rank databases: ``ocdbt.r<rank>/`` below the root.
OCDBT_PREFIX = "ocdbt.r"
MANIFEST = "manifest.ocdbt"


def data_spec(loc: Location, layout: str, *, writer: int | None = None) -> dict[str, Any]:
    """kvstore spec under which the array keys (``<path>/zarr.json``, ``<path>/c/...``) live.

    Plain: the checkpoint directory itself. Compact: an OCDBT database, the
    merged one at the root for readers, rank ``writer``'s own for a writer.
    """
    if layout == LAYOUT_PLAIN:
        return loc.spec
    base = loc.spec if writer is None else loc.sub(f"{OCDBT_PREFIX}{writer}")
    return {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#ocdbt"}


def below(spec: dict[str, Any], path: str) -> dict[str, Any]:
    """The same kvstore, with keys below ``path``."""
    return {**spec, "path": f"{spec.get('path', '')}{path}/"}


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


def chunk_key(rec: ArrayRecord, offsets: tuple[int, ...]) -> str:
    """Key of the file holding the shard that starts at ``offsets`` (default chunk key encoding)."""
    cell = [str(o // g) for o, g in zip(offsets, rec.layout.shard_shape)]
    cell += ["0" for _ in _dtypes.storage_extra_dims(rec.dtype)]  # complex32's (re, im) dim
    return "/".join([rec.path, "c", *cell])


def node_problem(node: Any, rec: ArrayRecord) -> str | None:
    """Why an array's parsed zarr.json disagrees with its record in the root metadata, or None."""
    expected = array_node(rec)
    if not isinstance(node, dict) or node.get("node_type") != "array":
        return "its zarr.json is not a zarr array node"
    for key in ("zarr_format", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"):
        if node.get(key) != expected[key]:
            return f"its zarr.json disagrees with the root metadata on '{key}' ({node.get(key)!r} != {expected[key]!r})"
    return None


def open_array(data: dict[str, Any], rec: ArrayRecord, *, write: bool = False) -> ts.TensorStore:
    return open_array_future(data, rec, write=write).result()


def open_array_future(data: dict[str, Any], rec: ArrayRecord, *, write: bool = False) -> ts.Future:
    """Open ``rec`` in the kvstore ``data`` (see :func:`data_spec`), with missing
    chunks reported as errors rather than read as fill values.

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
        "kvstore": below(data, rec.path),
        "metadata": meta,
        "assume_metadata": write,
        # Every chunk is written, even all-zero ones, so that a missing file is
        # always an error and never silently read back as zeros.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }
    return ts.open(spec, context=_store.CONTEXT, read=not write, write=write)
