"""crc32c of stored bytes, through google-crc32c's public API.

Every chunk and shard index tsckpt stores ends in the crc32c of its bytes, 4 bytes
little endian (docs/format.md). google-crc32c's C extension computes it with the CPU's
crc32c instruction (3.6-13 GB/s measured here, releasing the GIL). Without the C
extension the package falls back to pure Python, measured at 6 MB/s and defined for
bytes only; then the own codec steps aside and TensorStore, with its own table-driven
crc32c (about 1 GB/s), reads and writes every file (:func:`tsckpt._codec.route.place`).
"""

from __future__ import annotations

from typing import Any

import google_crc32c

from .._arrays import CRC_BYTES

# The crc32c of any message followed by its own crc32c (little endian): a constant, so
# a chunk is checked without splitting off its checksum.
RESIDUE = 0x48674BC7


def fast() -> bool:
    """Whether google-crc32c runs its C extension (read at call time, so tests can patch it)."""
    return google_crc32c.implementation == "c"


def value(data: Any) -> int:
    """crc32c of a C-contiguous buffer (bytes, memoryview, numpy array), without a copy."""
    return int(google_crc32c.value(data))


def encoded(data: Any) -> bytes:
    """crc32c of ``data`` as stored after it: :data:`CRC_BYTES` little-endian bytes."""
    return value(data).to_bytes(CRC_BYTES, "little")


def intact(data_and_crc: Any) -> bool:
    """Whether a buffer ends in the crc32c of the bytes before it."""
    return value(data_and_crc) == RESIDUE
