"""Which codec reads and writes an array's files: tsckpt's own, or TensorStore.

One rule, used by save and restore alike, so the own writer and the own reader handle
the same arrays (:func:`route`):

- nothing is own when the switch says ``tensorstore``, the crc32c package lacks the CPU's crc32c
  extension, the host is big-endian, or the arrays are another format's (opened
  through their own TensorStore specs); nor for an empty array (it has no files);
- an array without inner chunks: each chunk file is one kvstore read or write by the
  own codec (:mod:`.encode`), in any kvstore (local, object store, memory, and the
  compact layout's database); on a local disk (a plain checkpoint) save writes the
  file itself, with one open, write and close (:func:`.shardwrite.write_chunk`);
- a sharded array of a plain checkpoint on a local file system: each shard file is
  read and written with positional I/O by the own codec (:mod:`.shardread`,
  :mod:`.shardwrite`); in an incremental save on S3 its shard files are encoded
  in memory by the own codec, each one object write whose response gives its ETag
  (:func:`.shardwrite.shard_bytes`);
- every other array: TensorStore.

Every dtype tsckpt stores is covered: the 4-bit ones (int4, float4_e2m1fn) are stored
one element per byte, exactly as ml_dtypes holds them in memory (TensorStore 0.1.86
writes a 64 x 64 int4 array in 32 x 32 inner chunks as a 4,180-byte file: 4 chunks of
1,024 + 4 bytes and a 68-byte index), and complex32 as its float16 pairs.

The switch: the environment variable ``TSCKPT_CODEC``, read at every save and
restore, or this module's :data:`CODEC`, which wins when set. ``auto`` (the default)
routes as above; ``tensorstore`` sends every read and write through TensorStore
(the files are the same either way).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from .._ondisk.records import LAYOUT_PLAIN, ArrayRecord
from . import crc
from .encode import LITTLE_ENDIAN

log = logging.getLogger("tsckpt")

ENV = "TSCKPT_CODEC"
AUTO = "auto"
TENSORSTORE = "tensorstore"
# The switch in code (tests, benchmarks): None defers to the environment variable.
CODEC: str | None = None


class Route(enum.Enum):
    """Who reads and writes one array's files."""

    TENSORSTORE = "tensorstore"
    CHUNK = "chunk"  # the own codec, one kvstore read or write per unsharded chunk file
    SHARD = "shard"  # the own codec, positional I/O on the local shard files


@dataclasses.dataclass(frozen=True)
class Place:
    """What the own codec may do with the files of one save or restore (:func:`place`)."""

    own: bool  # the own codec runs at all
    directory: str | None  # the local directory of a plain checkpoint: shard files are own too
    why: str = ""  # why the own codec does not run, when it does not


def setting() -> str:
    """The switch: :data:`CODEC` when set, else ``$TSCKPT_CODEC``, else ``auto``."""
    value = CODEC if CODEC is not None else os.environ.get(ENV) or AUTO
    if value not in (AUTO, TENSORSTORE):
        where = "tsckpt._codec.route.CODEC" if CODEC is not None else f"the environment variable {ENV}"
        raise ValueError(
            f"{where} is {value!r}; set it to {AUTO!r} (tsckpt's own codec where it applies, the default) "
            f"or {TENSORSTORE!r} (every read and write through TensorStore)"
        )
    return value


_told: set[str] = set()


def place(spec: Mapping[str, Any], layout: str, *, foreign: bool = False, shard_files: bool = True) -> Place:
    """What the own codec may do with the kvstore ``spec`` of a checkpoint of ``layout``.

    ``foreign``: the arrays are another format's, opened through their own specs.
    ``shard_files=False`` leaves shard files to TensorStore even on a local disk (save's
    ``OWN_SHARD_FILES`` off). Reads the switch, so call it once per save or restore.
    """
    why = ""
    if setting() == TENSORSTORE:
        why = f"{ENV}={TENSORSTORE}"
    elif not crc.fast():
        why = "the CPU has no crc32c instruction crc32c can use (its table-driven crc32c is no faster than TensorStore's)"
        if why not in _told:
            _told.add(why)
            log.warning("tsckpt: %s; every file is read and written through TensorStore", why)
    elif not LITTLE_ENDIAN:
        why = "a big-endian host"
    elif foreign:
        why = "arrays of another format"
    if why:
        return Place(False, None, why)
    local = (
        layout == LAYOUT_PLAIN
        and shard_files
        and spec.get("driver") == "file"
        and not set(spec) - {"driver", "path"}
        and hasattr(os, "preadv")
        and hasattr(os, "pwritev")
    )
    return Place(True, str(spec["path"]) if local else None)


def route(rec: ArrayRecord, where: Place) -> Route:
    """Who reads and writes the files of ``rec`` at ``where`` (the rule in this module's docstring)."""
    if not where.own or math.prod(rec.shape) == 0:
        return Route.TENSORSTORE
    if rec.chunking.chunk_shape is None:
        return Route.CHUNK
    if where.directory is not None and regular_shards(rec):
        return Route.SHARD
    return Route.TENSORSTORE


def regular_shards(rec: ArrayRecord) -> bool:
    """Whether ``rec`` is sharded with shards a whole number of inner chunks, whose files the
    own codec encodes (:mod:`.shardwrite`)."""
    inner = rec.chunking.chunk_shape
    return inner is not None and all(c > 0 and s % c == 0 for s, c in zip(rec.chunking.shard_shape, inner))
