"""Encoding a plain (unsharded) chunk file, byte for byte as zarr v3 specifies.

Small arrays are written as one kvstore write of their encoded chunk, without
TensorStore's per-array open and write machinery, which dominated saves of
thousands of small leaves. The codec chain is [bytes (little endian), crc32c]
(docs/format.md); tests/test_encode.py checks the files against TensorStore's
own. Sharded arrays are encoded by TensorStore: doing it here was measured
slower (Python-side copies outweighed the faster crc32c).
"""

from __future__ import annotations

import sys

import google_crc32c
import numpy as np

LITTLE_ENDIAN = sys.byteorder == "little"


def _with_crc(data: bytes) -> bytes:
    return data + google_crc32c.value(data).to_bytes(4, "little")


def encode_chunk(src: np.ndarray) -> bytes:
    """One chunk: its C-order bytes, then their crc32c as 4 little-endian bytes."""
    return _with_crc(np.ascontiguousarray(src).tobytes())
