"""crc32c of stored bytes, through the crc32c package's public API.

Every chunk and shard index tsckpt stores ends in the crc32c of its bytes, 4 bytes
little endian (docs/format.md). The crc32c package computes it with the CPU's crc32c
instruction (about 8 GB/s measured here) and releases the GIL while it does: a save
in the background then never stalls the training loop's Python thread. (google-crc32c,
used before, holds the GIL: a background thread checksumming 64 MiB buffers made a
training step 14x slower, against no change with this package;
benchmarks/bench_train.py measures the loop.) Without the CPU instruction the package
falls back to a table-driven crc32c in C; then the own codec steps aside and
TensorStore, with its own crc32c of the same kind (about 1 GB/s), reads and writes
every file (:func:`tsckpt._codec.route.place`).
"""

from __future__ import annotations

from typing import Any

import crc32c

from .._ondisk.arrays import CRC_BYTES

# The crc32c of any message followed by its own crc32c (little endian): a constant, so
# a chunk is checked without splitting off its checksum.
RESIDUE = 0x48674BC7


def fast() -> bool:
    """Whether crc32c runs on the CPU's crc32c instruction (read at call time, so tests can patch it)."""
    return bool(crc32c.hardware_based)


def value(data: Any) -> int:
    """crc32c of a C-contiguous buffer (bytes, memoryview, numpy array), without a copy,
    with the GIL released."""
    return int(crc32c.crc32c(data))


def encoded(data: Any) -> bytes:
    """crc32c of ``data`` as stored after it: :data:`CRC_BYTES` little-endian bytes."""
    return value(data).to_bytes(CRC_BYTES, "little")


def intact(data_and_crc: Any) -> bool:
    """Whether a buffer ends in the crc32c of the bytes before it."""
    return value(data_and_crc) == RESIDUE
