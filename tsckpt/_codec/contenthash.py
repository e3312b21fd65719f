"""The content hash of a stored file's data: what proves two files hold the same bytes.

Incremental saves (:mod:`tsckpt._save.share`) share a file with the base checkpoint only
when its content is proven equal, and a 32-bit crc32c is no proof. The hash is xxh3-128
(the xxhash package: about as fast as the hardware crc32c, where blake2b-128 ran ten
times slower, so it costs a full save little) of the file's data as written: the
C-order, little-endian bytes of the part of the array the file holds (docs/format.md,
"Content hashes"). It is computed on the write threads, from the source memory the file
is written from.

A shard file of several inner chunks also records the hash of each inner chunk's data
(:func:`chunk_digests`; its part inside the array, as a file's), so that diff reads only
the inner chunks that differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from .._base.types import box_slices
from .files import stored_starts


def digest(src: np.ndarray) -> str:
    """The hash (:data:`tsckpt._ondisk.records.CONTENT_HASH`, recorded beside it) of ``src``'s bytes in C order, as 32 lowercase hex digits."""
    data = src if src.flags.c_contiguous else np.ascontiguousarray(src)
    if data.dtype.isbuiltin == 2 or not data.ndim:  # a dtype numpy cannot export (bfloat16, float8), a scalar
        data = data.reshape(-1).view(np.uint8)
    return xxhash.xxh3_128_hexdigest(data.data)


def chunk_digests(src: np.ndarray, inner: Sequence[int]) -> list[str]:
    """The :func:`digest` of each inner chunk of ``inner`` elements of the shard whose part in
    the array is ``src`` (its stored dtype and shape), over the chunk's part in the array, in
    the order a shard file stores them (:func:`.files.stored_starts`)."""
    return [digest(src[box_slices(lo, inner)]) for lo in stored_starts(src.shape, inner)]
