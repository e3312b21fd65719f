"""Where arrays live (per layout) and opening one through TensorStore's zarr3 driver."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import tensorstore as ts

from .._base import dtypes as _dtypes
from .._storage import locations as _locations
from .._storage.durable import encode_json
from .._storage.locations import Location
from .records import LAYOUT_PLAIN, ArrayRecord, Chunking, array_metadata

# The compact layout's per-rank databases: ``ocdbt.r<rank>/`` below the root.
OCDBT_PREFIX = "ocdbt.r"
MANIFEST = "manifest.ocdbt"
# Readers of a compact checkpoint on an object store let OCDBT merge their reads: while a
# read of one data file is in flight, the reads of that file that follow wait, and when it
# completes those less than 1 MiB apart become one ranged GET of at most 64 MiB. A restore
# starts the reads of its leaves (up to its window of bytes in flight) as fast as it can,
# so the arrays' nodes and chunks, which a save writes next to each other, come back in a
# few requests instead of two per leaf, and a lone read (a lazy read of tsckpt.open) is
# sent at once. A timer instead (``experimental_read_coalescing_interval``) sends what has
# arrived every interval: for a restore of 10,000 small leaves with 20 ms added to every
# request, 1 ms made 1,739 GETs, 20 ms 141-200, 50 ms 75 (each lazy read 100 ms slower),
# none 74-83 (benchmarks/bench_s3.py's setup). Local disks and memory read without it (a
# request there costs no round trip).
COALESCE: dict[str, Any] = {
    "experimental_read_coalescing_threshold_bytes": 1 << 20,
    "experimental_read_coalescing_merged_bytes": 64 << 20,
}
# The staleness bound of readers' reads of a compact database: anything its cache holds.
# Each opened checkpoint has a cache of its own (_locations.reader_context), so the manifest is
# read once for it, not revalidated by a conditional request every few reads (66 of the
# 267 GETs of a restore of 10,000 leaves from an object store); a checkpoint replaced
# meanwhile is caught by the check of its root after the reads (readfaults.unchanged).
CACHED = float("-inf")


def data_spec(loc: Location, layout: str, *, writer: int | None = None) -> dict[str, Any]:
    """kvstore spec under which the array keys (``<path>/zarr.json``, its chunk keys) live.

    Plain: the checkpoint directory itself. Compact: an OCDBT database, the
    merged one at the root for readers, rank ``writer``'s own for a writer; on an
    object store, readers' reads are coalesced (:data:`COALESCE`).
    """
    if layout == LAYOUT_PLAIN:
        return loc.spec
    base = loc.spec if writer is None else loc.sub(f"{OCDBT_PREFIX}{writer}")
    spec: dict[str, Any] = {"driver": "ocdbt", "base": base, "cache_pool": _locations.READ_CACHE_POOL}
    if writer is None and loc.local is None and loc.spec.get("driver") != "memory":
        spec.update(COALESCE)
    return spec


def below(spec: dict[str, Any], path: str) -> dict[str, Any]:
    """The same kvstore, with keys below ``path``."""
    return {**spec, "path": f"{spec.get('path', '')}{path}/"}


def array_node(rec: ArrayRecord) -> dict[str, Any]:
    """The array's zarr.json; complex32 is stored as float16 with a trailing (re, im) dim."""
    chunking = rec.chunking
    if rec.dtype == "complex32":
        chunking = Chunking((*chunking.shard_shape, 2), None if chunking.chunk_shape is None else (*chunking.chunk_shape, 2))
    return array_metadata(
        _dtypes.storage_shape(rec.dtype, rec.shape),
        _dtypes.storage_dtype(rec.dtype),
        chunking,
        {"tsckpt": {"dtype": rec.dtype, "kind": rec.kind}},
        separator=rec.separator,
    )


def chunk_key(rec: ArrayRecord, offsets: tuple[int, ...]) -> str:
    """Key of the file holding the shard that starts at ``offsets`` (zarr's default chunk key
    encoding with the record's separator: ``<path>/c.0.0`` or ``<path>/c/0/1``; ``<path>/c``
    for a 0-d array)."""
    cell = [str(o // g) for o, g in zip(offsets, rec.chunking.shard_shape)]
    cell += ["0" for _ in _dtypes.storage_extra_dims(rec.dtype)]  # complex32's (re, im) dim
    return f"{rec.path}/{rec.separator.join(['c', *cell])}"


def same_cell_key(key: str, rec: ArrayRecord, other: ArrayRecord) -> str:
    """The key of the file ``key`` of ``rec`` (one of its chunk keys) under the key encoding of
    ``other``, a record of the same array in another checkpoint (one older than
    DOT_KEYS_VERSION names a one-file array's file ``c/0`` where a newer one names it ``c.0``)."""
    mine, theirs = rec.separator, other.separator
    if mine == theirs:
        return key
    prefix = f"{rec.path}/c"
    return f"{other.path}/c{key[len(prefix):].replace(mine, theirs)}"


# Bytes a stored file adds to its data: the crc32c of a chunk, and each entry of a shard index.
CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16
MISSING_CHUNK = 2**64 - 1  # offset and length of an inner chunk a shard does not store


def _grid(rec: ArrayRecord, box: tuple[slice, ...] | None) -> list[tuple[int, int, int, int]] | None:
    """Per dimension: (first, end) shard cell the box touches, inner chunks per shard, and
    inner chunks of the array; None when the box is empty (no file is read)."""
    chunking = rec.chunking
    chunk = chunking.chunk_shape or chunking.shard_shape
    dims = []
    for d, (n, g, c) in enumerate(zip(rec.shape, chunking.shard_shape, chunk)):
        lo, hi = (0, n) if box is None else (box[d].start, box[d].stop)
        if hi <= lo:
            return None
        dims.append((lo // g, -(-hi // g), g // c, -(-n // c)))
    return dims


def chunk_file_bytes(rec: ArrayRecord, shape: tuple[int, ...] | None = None) -> int:
    """Bytes of a file of ``rec`` holding one chunk of ``shape`` (default: its shard shape, an
    unsharded chunk file): the chunk's elements at the full shape (zarr pads the array's edge),
    then their crc32c. A file of any other size is not as written (zarr readers refuse it)."""
    return math.prod(rec.chunking.shard_shape if shape is None else shape) * _dtypes.itemsize(rec.dtype) + CRC_BYTES


def chunk_size_problem(rec: ArrayRecord, key: str, size: int | None) -> str | None:
    """Why the unsharded chunk file ``key`` of ``rec``, of ``size`` bytes (None: more than
    :func:`chunk_file_bytes`, by how much unknown), is not as written, or None when it is of
    its size; a phrase for the damage reports, which say what to do."""
    expected = chunk_file_bytes(rec)
    if size == expected:
        return None
    what = f"the chunk's {expected - CRC_BYTES} bytes, then their {CRC_BYTES}-byte crc32c"
    if size is None or size > expected:
        found = "holds more than" if size is None else f"is {size} bytes, {size - expected} more than"
        return f"{key} {found} the {expected} bytes its record gives it ({what}); zarr readers refuse bytes after the crc32c"
    return f"{key} is {size} bytes, {expected - size} fewer than the {expected} bytes its record gives it ({what})"


class StoredSize(NamedTuple):
    """What the shard files of (part of) an array hold when written as its record says."""

    files: int
    chunks: int  # chunks decoded to read them all: inner chunks, or the files when unsharded
    nbytes: int


def stored_size(rec: ArrayRecord, box: tuple[slice, ...] | None = None) -> StoredSize:
    """What the shard files touched by ``box`` (default: the whole array) hold when written
    as the record says: every chunk inside the array at its decoded size plus its crc32c,
    and each shard's index. Closed form: nothing is enumerated."""
    dims = _grid(rec, box)
    if dims is None:
        return StoredSize(0, 0, 0)
    files = math.prod(hi - lo for lo, hi, _, _ in dims)
    if rec.chunking.chunk_shape is None:
        return StoredSize(files, files, files * chunk_file_bytes(rec))
    index = INDEX_ENTRY_BYTES * math.prod(per for _, _, per, _ in dims) + CRC_BYTES
    inner = math.prod(min(hi * per, total) - lo * per for lo, hi, per, total in dims)
    return StoredSize(files, inner, files * index + inner * chunk_file_bytes(rec, rec.chunking.chunk_shape))


def _cells(ranges: list[tuple[int, int]]) -> Iterator[tuple[int, ...]]:
    """Grid cells in C order, generated one at a time (itertools.product would first
    materialize each range, however long the record says it is)."""
    cell = [lo for lo, _ in ranges]
    while True:
        yield tuple(cell)
        d = len(cell) - 1
        while d >= 0:
            cell[d] += 1
            if cell[d] < ranges[d][1]:
                break
            cell[d] = ranges[d][0]
            d -= 1
        if d < 0:
            return


def stored_files(rec: ArrayRecord, box: tuple[slice, ...] | None = None) -> Iterator[tuple[str, int]]:
    """(key, bytes) of each shard file ``box`` touches, in C order, generated lazily."""
    dims = _grid(rec, box)
    if dims is None:
        return
    extra = ["0" for _ in _dtypes.storage_extra_dims(rec.dtype)]
    if rec.chunking.chunk_shape is None:
        size = chunk_file_bytes(rec)
    else:
        index = INDEX_ENTRY_BYTES * math.prod(per for _, _, per, _ in dims) + CRC_BYTES
        chunk = chunk_file_bytes(rec, rec.chunking.chunk_shape)
    sep = rec.separator
    for cell in _cells([(lo, hi) for lo, hi, _, _ in dims]):
        if rec.chunking.chunk_shape is not None:
            inner = math.prod(min(per, total - i * per) for i, (_, _, per, total) in zip(cell, dims))
            size = index + inner * chunk
        yield f"{rec.path}/{sep.join(['c', *map(str, cell), *extra])}", size


def node_problem(node: Any, rec: ArrayRecord) -> str | None:
    """Why an array's parsed zarr.json disagrees with its record in the root metadata, or None."""
    expected = array_node(rec)
    if not isinstance(node, dict) or node.get("node_type") != "array":
        return "its zarr.json is not a zarr array node"
    for key in ("zarr_format", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"):
        if node.get(key) != expected[key]:
            return f"its zarr.json disagrees with the root metadata on '{key}' ({node.get(key)!r} != {expected[key]!r})"
    return None


def parse_node(raw: bytes) -> Any:
    """The JSON of a stored zarr.json; ValueError when it is not JSON, or is nested too
    deeply to parse (TensorStore itself crashes on such a node, so it never sees one)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def _node_key(rec: ArrayRecord) -> tuple[Any, ...]:
    """What an array's zarr.json depends on (not its path), as a tuple: hashing the record
    itself (nested frozen dataclasses) costs more than parsing a node."""
    c = rec.chunking
    return (rec.shape, rec.dtype, rec.kind, c.shard_shape, c.chunk_shape, rec.separator)


def node_bytes(rec: ArrayRecord) -> bytes:
    """An array's zarr.json as tsckpt writes it, encoded once per process for records alike
    (a manager saves the same records at every step)."""
    key = _node_key(rec)
    got = _ENCODED.get(key)
    if got is None:
        got = _kept(_ENCODED)[key] = encode_json(array_node(rec))
    return got


NODES_KEPT = 4096  # distinct array nodes kept, encoded or found right (an array's shape, dtype and chunking)
NODE_KEPT_BYTES = 4096  # the largest stored node kept (tsckpt's are under 1 KiB; a hostile one may be large)
_ENCODED: dict[tuple[Any, ...], bytes] = {}
_FOUND_RIGHT: dict[tuple[Any, ...], bytes] = {}  # the stored bytes of a node found to agree with such records


def _kept(cache: dict[tuple[Any, ...], bytes]) -> dict[tuple[Any, ...], bytes]:
    if len(cache) >= NODES_KEPT:
        cache.clear()
    return cache


def stored_node_problem(raw: bytes, rec: ArrayRecord) -> str | None:
    """:func:`node_problem` of the stored bytes of an array's zarr.json. The same bytes found
    right for records alike before (a model's layers share shapes) are right at once."""
    key = _node_key(rec)
    if _FOUND_RIGHT.get(key) == raw:
        return None
    problem = _parsed_node_problem(raw, rec)
    if problem is None and len(raw) <= NODE_KEPT_BYTES:
        _kept(_FOUND_RIGHT)[key] = raw
    return problem


def _parsed_node_problem(raw: bytes, rec: ArrayRecord) -> str | None:
    try:
        node = parse_node(raw)
    except ValueError as e:
        return f"its zarr.json is not valid JSON ({' '.join(str(e).split())})"
    return node_problem(node, rec)


def open_array(
    data: dict[str, Any], rec: ArrayRecord, *, write: bool = False, context: ts.Context | None = None
) -> ts.TensorStore:
    return open_array_future(data, rec, write=write, context=context).result()


def open_array_future(
    data: dict[str, Any], rec: ArrayRecord, *, write: bool = False, checked: bool = False,
    context: ts.Context | None = None,
) -> ts.Future:
    """Open ``rec`` in the kvstore ``data`` (see :func:`data_spec`), with missing
    chunks reported as errors rather than read as fill values.

    Writers do not read zarr.json (the root metadata already has everything, and
    rank 0 may write the node after other ranks start). Readers do: TensorStore
    then checks the stored zarr.json against the root metadata's record (shape,
    dtype, chunking, codecs), so metadata that disagrees with the data is an error
    rather than a silent misreading. ``checked``: the caller has read the node and
    found it agrees with the record (:func:`stored_node_problem`), so it is not read again.
    ``context``: the opened checkpoint's (:func:`_locations.reader_context`), default the process's.
    """
    meta = array_node(rec)
    del meta["attributes"]
    spec = {
        "driver": "zarr3",
        "kvstore": below(data, rec.path),
        "metadata": meta,
        "assume_metadata": write or checked,
        # Every chunk is written, even all-zero ones, so that a missing file is
        # always an error and never silently read back as zeros.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }
    if not write and data.get("driver") == "ocdbt":  # read at :data:`CACHED`
        spec.update({"recheck_cached_data": False, "recheck_cached_metadata": False})
    return ts.open(spec, context=context or _locations.CONTEXT, read=not write, write=write)
