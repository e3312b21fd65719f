"""Encoding and decoding a plain (unsharded) chunk file, byte for byte as zarr v3 specifies.

Small arrays are written as one kvstore write of their encoded chunk, without
TensorStore's per-array open and write machinery, which dominated saves of
thousands of small leaves. The codec chain is [bytes (little endian), crc32c]
(docs/format.md); tests/test_encode.py checks the files against TensorStore's
own. Shard files of a local checkpoint are written by _shardwrite.py (without
the copies that made encoding them here into bytes slower than TensorStore);
elsewhere TensorStore encodes them. Restores decode single chunks here too (one
kvstore read each, no TensorStore array per small leaf).
"""

from __future__ import annotations

import math
import sys

import google_crc32c
import numpy as np

LITTLE_ENDIAN = sys.byteorder == "little"

# CRC-32C of any message followed by its own CRC-32C (little endian): a constant.
_RESIDUE = 0x48674BC7


def _with_crc(data: bytes) -> bytes:
    return data + google_crc32c.value(data).to_bytes(4, "little")


def encode_chunk(src: np.ndarray) -> bytes:
    """One chunk: its C-order bytes, then their crc32c as 4 little-endian bytes."""
    return _with_crc(np.ascontiguousarray(src).tobytes())


def decode_chunk(data: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
    """The array in one chunk written by :func:`encode_chunk`, or None when its length or
    crc32c is not as expected (the caller then lets TensorStore report the damage)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if len(data) != nbytes + 4:
        return None
    if google_crc32c.value(data) != _RESIDUE:  # the crc32c of data + its crc32c, without a copy
        return None
    return np.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)
