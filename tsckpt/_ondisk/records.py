"""The on-disk format: version, node JSON, and per-leaf records (docs/format.md)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import short_repr
from .._storage.confine import path_problem

# The version this tsckpt writes and the newest it reads (docs/format.md, "Versioning"): 1
# plain and 2 compact checkpoints of older writers, every chunk key '/'-separated; 3 (either
# layout) names the file of an array stored as one chunk file with the '.' separator
# (``<path>/c.0.0`` beside its zarr.json, no ``c/`` directories), which older readers
# would not find, so they refuse it.
FORMAT_VERSION = 3
# The first version whose one-file arrays use the '.' chunk key separator.
DOT_KEYS_VERSION = 3
ROOT_KEY = "zarr.json"
STATE_PENDING = "pending"
STATE_COMMITTED = "committed"

# Where array data lives (docs/format.md, "Layouts"): a file per shard, or one
# OCDBT database per writing rank merged into one at the commit.
LAYOUT_PLAIN = "plain"
LAYOUT_COMPACT = "compact"
LAYOUTS = (LAYOUT_PLAIN, LAYOUT_COMPACT)


def check_layout(layout: str) -> None:
    """Refuse a ``layout=`` option tsckpt does not write."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, not {layout!r}")


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How one global array is cut into files.

    ``shard_shape`` is the zarr chunk grid: one file per grid cell, written by
    exactly one rank. ``chunk_shape`` is the inner chunk grid inside each file
    (zarr ``sharding_indexed``), the unit of partial reads; ``None`` means the
    file holds a single chunk (used for arrays smaller than one inner chunk).
    """

    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
    """One array leaf as recorded in the root metadata."""

    path: str
    shape: tuple[int, ...]  # logical shape (complex32 adds a trailing 2 in storage)
    dtype: str  # logical dtype name
    kind: str  # "torch" | "numpy" | "numpy_scalar" | "jax_key:<impl>": what restore(target=None) returns
    chunking: Chunking
    # read from a checkpoint older than DOT_KEYS_VERSION: every chunk key '/'-separated
    slash_keys: bool = False

    @property
    def one_file(self) -> bool:
        """Whether the array is stored as (at most) one chunk file: one cell of its chunk grid."""
        return all(n <= g for n, g in zip(self.shape, self.chunking.shard_shape))

    @property
    def separator(self) -> str:
        """The chunk key separator of the array's files (zarr's default chunk key encoding):
        '.' for an array stored as one file (``<path>/c.0.0``: no directory below the
        array's own), '/' for more files (``<path>/c/0/1``) or a checkpoint of an older format."""
        return "." if self.one_file and not self.slash_keys else "/"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "shard_shape": list(self.chunking.shard_shape),
            "chunk_shape": None if self.chunking.chunk_shape is None else list(self.chunking.chunk_shape),
        }

    @staticmethod
    def from_json(j: dict[str, Any], *, version: int = FORMAT_VERSION) -> ArrayRecord:
        """The record ``j`` of a root of format ``version`` (which says its chunk keys)."""
        chunk = j.get("chunk_shape")
        return ArrayRecord(
            path=j["path"],
            shape=tuple(j["shape"]),
            dtype=j["dtype"],
            kind=j["kind"],
            chunking=Chunking(tuple(j["shard_shape"]), None if chunk is None else tuple(chunk)),
            slash_keys=version < DOT_KEYS_VERSION,
        )


KINDS = ("torch", "numpy", "numpy_scalar")
# Typed JAX PRNG keys: their uint32 key data, with the name of the key implementation
# (jax.random.key_impl) that gives them back as keys, e.g. "jax_key:threefry2x32".
KEY_KIND_PREFIX = "jax_key:"
_KEY_KIND = re.compile(re.escape(KEY_KIND_PREFIX) + r"[A-Za-z0-9_]{1,64}")


def known_kind(kind: Any) -> bool:
    """Whether ``kind`` is a kind of array record this tsckpt reads."""
    return kind in KINDS or (isinstance(kind, str) and _KEY_KIND.fullmatch(kind) is not None)


def key_impl(kind: str) -> str | None:
    """The PRNG key implementation a record of ``kind`` holds the key data of, None for other kinds."""
    return kind[len(KEY_KIND_PREFIX):] if kind.startswith(KEY_KIND_PREFIX) else None

# The most dimensions of an array: TensorStore (and so the zarr readers built on it) opens
# no array of higher rank.
MAX_NDIM = 32
# numpy and TensorStore count bytes in signed 64-bit integers: an array, shard or chunk of
# 16-byte elements whose extents (a zero counted as one) multiply to 2**59 is too big for them.
MAX_ELEMENTS = 2**59


def extent_problem(shape: Sequence[int]) -> str | None:
    """Why an array, shard or chunk of ``shape`` (non-negative extents) is beyond what tsckpt
    reads back, or None. The one definition of these limits: save refuses what restore would."""
    if len(shape) > MAX_NDIM:
        return f"{len(shape)} dimensions, more than the {MAX_NDIM} zarr readers open"
    n = math.prod(max(int(s), 1) for s in shape)
    if n >= MAX_ELEMENTS:
        return f"extents whose product (a zero counted as one) is {n} (2**{math.log2(n):.1f}), not under 2**59"
    return None


def dims_ok(value: Any, *, positive: bool) -> bool:
    """Whether ``value`` is a list of at most MAX_NDIM integers (not bools), each at least 1
    (``positive``) or 0, whose extents pass :func:`extent_problem`. One loop, no generator:
    a root holds one to three of these per array record."""
    least = 1 if positive else 0
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        return False
    for n in value:
        if not isinstance(n, int) or isinstance(n, bool) or n < least:
            return False
    n = math.prod(value)
    return (0 < n < MAX_ELEMENTS) or extent_problem(value) is None


def record_problem(j: Any, known_dtype: Any) -> str | None:
    """Why an array record of the root metadata cannot be read, or None. Checked before
    anything is opened or allocated; ``known_dtype(name)`` tells the dtype names this
    tsckpt reads."""
    if not isinstance(j, dict):
        return "the record is not a JSON object"
    why = path_problem(j.get("path"))
    if why is not None:
        return f"'path' {why}"
    if not known_kind(j.get("kind")):
        return f"'kind' is {short_repr(j.get('kind'))}, expected one of {list(KINDS)} or '{KEY_KIND_PREFIX}<impl>'"
    if not known_dtype(j.get("dtype")):
        return f"'dtype' {short_repr(j.get('dtype'))} is not a dtype this tsckpt reads (written by a newer tsckpt?)"
    shape: Any = j.get("shape")
    shard: Any = j.get("shard_shape")
    chunk: Any = j.get("chunk_shape")
    if not dims_ok(shape, positive=False):
        return f"'shape' {short_repr(shape)} is not a list of non-negative integers with a product under 2**59"
    if not dims_ok(shard, positive=True) or len(shard) != len(shape):
        return (
            f"'shard_shape' {short_repr(shard)} is not a list of {len(shape)} positive integers with a product "
            "under 2**59"
        )
    if chunk is not None and (
        not dims_ok(chunk, positive=True) or len(chunk) != len(shape) or any(s % c for s, c in zip(shard, chunk))
    ):
        return f"'chunk_shape' {short_repr(chunk)} does not divide 'shard_shape' {short_repr(shard)}"
    if j["kind"] == "numpy_scalar" and shape:
        return f"'shape' {shape!r} is not [] although 'kind' is 'numpy_scalar'"
    return None


def array_metadata(
    storage_shape: tuple[int, ...], data_type: str, chunking: Chunking, attrs: dict[str, Any], *, separator: str
) -> dict[str, Any]:
    """zarr v3 array ``zarr.json``: little-endian bytes and crc32c on every chunk and index;
    chunk keys with ``separator``."""
    checked = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    if chunking.chunk_shape is None:
        codecs: list[Any] = checked
    else:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(chunking.chunk_shape),
                    "codecs": checked,
                    "index_codecs": checked,
                    "index_location": "end",
                },
            }
        ]
    fill: Any = False if data_type == "bool" else [0, 0] if data_type.startswith("complex") else 0
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(storage_shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunking.shard_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": attrs,
    }


def group_metadata(attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attrs or {}}


# ---- content hashes (docs/format.md, "Content hashes") ------------------------

# The hash recorded per file in the root's optional ``content`` field: xxh3-128 of the
# file's data (tsckpt/_codec/contenthash.py), as 32 lowercase hex digits. A root recording
# another algorithm is read as recording none.
CONTENT_HASH = "xxh3-128"
CONTENT_HEX_DIGITS = 32
_HEX_DIGITS = frozenset("0123456789abcdef")

# A file's entry in ``content.files``: its hash, then its size, modification time (ns) and
# inode when its save recorded them (local file systems; on an object store, 0 and 0).
ContentEntry = tuple[str, int, int, int]
# An object's ETag as ``content.etags`` records it (object stores): a quoted token of at
# most this many printable ASCII characters; anything else is read as none recorded.
ETAG_CHARS_MAX = 200


def _digest_ok(value: Any) -> bool:
    """Whether ``value`` is a hash as recorded: :data:`CONTENT_HEX_DIGITS` lowercase hex digits."""
    return isinstance(value, str) and len(value) == CONTENT_HEX_DIGITS and set(value) <= _HEX_DIGITS


def _content_entry(value: Any) -> ContentEntry | None:
    """A stored entry, or None when it is not one (a damaged or hostile root proves nothing)."""
    if not isinstance(value, list) or len(value) != 4:
        return None
    digest, *stat = value
    if not _digest_ok(digest):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in stat):
        return None
    return digest, stat[0], stat[1], stat[2]


def content_field(
    files: Mapping[str, ContentEntry], etags: Mapping[str, str] | None = None,
    chunks: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The root metadata's ``content`` field for ``files`` (key -> entry), keys sorted, with
    the ``etags`` of the objects (key -> ETag as written) and the ``chunks`` hashes of shard
    files' inner chunks (key -> hashes) where there are any (of files in ``files`` only)."""
    out: dict[str, Any] = {"algorithm": CONTENT_HASH, "files": {k: list(v) for k, v in sorted(files.items())}}
    if etags:
        out["etags"] = dict(sorted(etags.items()))
    kept = {k: list(v) for k, v in sorted((chunks or {}).items()) if k in files}
    if kept:
        out["chunks"] = kept
    return out


def content_chunks(meta: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """The hashes of the inner chunks of each shard file a root's ``content`` field records
    them for (``chunks``: key -> hashes, in C order of the inner chunks holding part of the
    array), for keys with a valid entry in ``files``; a list that is not of at least two
    hashes is left out. Whether a list has as many hashes as its file has inner chunks is the
    reader's to check (it knows the file's box): one of another length is read as absent."""
    content = meta.get("content")
    chunks = content.get("chunks") if isinstance(content, dict) else None
    if not isinstance(chunks, dict):
        return {}
    entries = content_entries(meta)
    return {
        k: tuple(v) for k, v in chunks.items()
        if k in entries and isinstance(v, list) and len(v) > 1 and _digests_ok(v)
    }


_HEX_RUN = re.compile(f"(?:[0-9a-f]{{{CONTENT_HEX_DIGITS}}})+")


def _digests_ok(values: list[Any]) -> bool:
    """Whether every one of ``values`` passes :func:`_digest_ok`, checked as one string (a root
    holds a list per shard file: a loop over each digit's set cost most of reading them)."""
    try:
        joined = "".join(values)
    except TypeError:  # not all strings
        return False
    return (
        len(joined) == CONTENT_HEX_DIGITS * len(values) and _HEX_RUN.fullmatch(joined) is not None
        and all(len(d) == CONTENT_HEX_DIGITS for d in values)
    )


def valid_etag(value: Any) -> bool:
    """Whether ``value`` is an ETag as an object store gives one (:data:`ETAG_CHARS_MAX`)."""
    return (
        isinstance(value, str) and 2 <= len(value) <= ETAG_CHARS_MAX and value.isascii() and value.isprintable()
        and value.startswith(("\"", 'W/"')) and value.endswith('"')
    )


def content_etags(meta: Mapping[str, Any]) -> dict[str, str]:
    """The valid ETags of a root's ``content`` field by key (object stores); none where none
    is recorded, for another algorithm, or for a key without a valid entry."""
    content = meta.get("content")
    etags = content.get("etags") if isinstance(content, dict) else None
    if not isinstance(etags, dict):
        return {}
    entries = content_entries(meta)
    return {k: v for k, v in etags.items() if k in entries and valid_etag(v)}


def content_entries(meta: Mapping[str, Any]) -> dict[str, ContentEntry]:
    """The valid entries of a root's ``content`` field by key (none for another algorithm,
    or where none is recorded); invalid entries are left out."""
    content = meta.get("content")
    if not isinstance(content, dict) or content.get("algorithm") != CONTENT_HASH:
        return {}
    files = content.get("files")
    if not isinstance(files, dict):
        return {}
    out = {}
    for key, value in files.items():
        e = _content_entry(value)
        if isinstance(key, str) and e is not None:
            out[key] = e
    return out


# ---- non-array leaves as JSON ------------------------------------------------


def encode_value(v: Any) -> dict[str, Any] | None:
    """JSON for a plain Python leaf, exact (floats keep their bits), or None if unsupported."""
    if isinstance(v, bool):
        return {"type": "bool", "value": v}
    if isinstance(v, int):
        return {"type": "int", "value": int(v)}
    if isinstance(v, float):
        bits = struct.pack("<d", v).hex()
        return {"type": "float", "value": v if math.isfinite(v) else repr(v), "bits": bits}
    if isinstance(v, str):
        return {"type": "str", "value": v}
    if isinstance(v, (bytes, bytearray)):
        return {"type": "bytes", "value": base64.b64encode(bytes(v)).decode("ascii")}
    return None


_VALUE_TYPES = {"bool": bool, "int": int, "str": str}
_JSON_NAMES = {"bool": "true or false", "int": "an integer", "str": "a string"}
_HEX = frozenset("0123456789abcdefABCDEF")


def decode_value(j: Any) -> Any:
    """The plain value of :func:`encode_value`'s JSON; ValueError naming what is wrong."""
    if not isinstance(j, dict):
        raise ValueError(f"expected an object with 'type' and 'value', found {type(j).__name__}")
    t, v = j.get("type"), j.get("value")
    if t == "float":
        b = j.get("bits")
        if not isinstance(b, str) or len(b) != 16 or not set(b) <= _HEX:
            raise ValueError(f"'bits' of a float must be 16 hex digits, found {short_repr(b)}")
        return struct.unpack("<d", bytes.fromhex(b))[0]
    if t == "bytes":
        if not isinstance(v, str):
            raise ValueError(f"'value' of bytes must be a base64 string, found {short_repr(v)}")
        try:
            return base64.b64decode(v, validate=True)
        except binascii.Error as e:
            raise ValueError(f"'value' of bytes is not base64 ({e})") from None
    if isinstance(t, str) and t in _VALUE_TYPES:
        want = _VALUE_TYPES[t]
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ValueError(f"'value' must be {_JSON_NAMES[t]} for type {t!r}, found {short_repr(v)}")
        return v
    raise ValueError(f"unknown value type {short_repr(t)}")
