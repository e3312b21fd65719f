"""Encoding and decoding an unsharded chunk file, byte for byte as zarr v3 specifies.

Arrays stored without inner chunks (small arrays, and the pieces of arrays whose
writers each hold a small region) are written and read as one kvstore operation per
chunk file, without TensorStore's per-array open and write machinery, which dominated
saves and restores of thousands of small leaves. The codec chain is [bytes (little
endian), crc32c] (docs/format.md); a chunk at the array's edge is stored at the full
chunk shape, the part outside the array zero (the fill value), as TensorStore stores
it. tests/test_encode.py checks the files against TensorStore's own.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from .._ondisk.arrays import CRC_BYTES
from . import crc

LITTLE_ENDIAN = sys.byteorder == "little"


def chunk_parts(src: np.ndarray, chunk: tuple[int, ...]) -> tuple[np.ndarray, bytes]:
    """One chunk file as its two parts: the C-order bytes of ``src`` placed at the start of
    a zero array of shape ``chunk`` (``src`` is that chunk's part inside the array; a view
    of it, no copy, when it is the whole chunk and contiguous), then their crc32c."""
    if src.shape != chunk:
        full = np.zeros(chunk, src.dtype)
        full[tuple(slice(0, n) for n in src.shape)] = src
        src = full
    data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    return data, crc.encoded(data)


def encode_chunk(src: np.ndarray, chunk: tuple[int, ...]) -> bytes:
    """One chunk file (:func:`chunk_parts`) as one bytes object, for a kvstore write."""
    data, checksum = chunk_parts(src, chunk)
    return data.tobytes() + checksum


def decode_chunk(data: bytes, dtype: np.dtype, chunk: tuple[int, ...]) -> np.ndarray | None:
    """The array of shape ``chunk`` in one chunk file written by :func:`encode_chunk`, or
    None when its length or crc32c is not as expected (the caller then lets TensorStore
    report the damage)."""
    nbytes = math.prod(chunk) * dtype.itemsize
    if len(data) != nbytes + CRC_BYTES or not crc.intact(data):
        return None
    return np.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize).reshape(chunk)
