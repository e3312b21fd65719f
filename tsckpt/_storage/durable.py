"""Durable writes, bulk sync and deletion: small JSON objects written atomically and
durably, the files of a save made durable together before its commit, and a checkpoint's
keys removed.

Chunk files are written without a per-file fsync (the context's ``file_io_sync`` is
off); :func:`sync_data` makes them durable in bulk before the commit object is written
with :func:`write_durable` (see _save/protocol.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from typing import Any

import tensorstore as ts

from . import native
from .faults import storage_errors
from .locations import CONTEXT, Location


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def durable_kvstore(loc: Location) -> ts.KvStore:
    """The kvstore of ``loc`` whose writes are atomic and durable (file: temp + fsync +
    rename + dir fsync; object stores: a single PUT)."""
    spec = dict(loc.spec)
    if spec.get("driver") == "file":
        spec["file_io_sync"] = True
    return ts.KvStore.open(spec, context=CONTEXT).result()


def write_durable(loc: Location, key: str, data: bytes | None, *, if_equal: bytes | None = None) -> bytes:
    """Write (None: delete) one object atomically and durably; with ``if_equal``, only if
    its generation is still that one. Returns the new generation, empty when the
    condition failed and nothing was written."""
    kv = durable_kvstore(loc)
    done = kv.write(key, data).result() if if_equal is None else kv.write(key, data, if_equal=if_equal).result()
    return bytes(done.generation)


# Up to this many files are fsynced one by one; more are flushed with syncfs().
FSYNC_FILES_MAX = 64


def fsync_path(path: str) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # name the file: fsync's own error does not
        raise OSError(e.errno, e.strerror, path) from e
    finally:
        os.close(fd)


def sync_data(loc: Location, keys: list[str], *, linked: Collection[str] = ()) -> None:
    """Make the files at ``keys`` (written below ``loc``) durable, with their directories,
    and the directory entries of the files at ``linked`` (hard links to files already
    durable: their directories only, an fsync of each would commit the journal for its
    changed link count alone).

    A rank that wrote few files fsyncs just those and the directories that hold
    them. One that wrote many (thousands of small arrays) uses Linux's
    syncfs() (:func:`native.syncfs`), which flushes the whole filesystem in one
    call, far cheaper than an fsync per file. Object stores acknowledge writes
    durably, so there is nothing to do.
    """
    if loc.local is None or not os.path.isdir(loc.local):
        return
    if len(keys) + len(linked) > FSYNC_FILES_MAX and native.has_syncfs():
        fd = os.open(loc.local, os.O_RDONLY)
        try:
            native.syncfs(fd, loc.local)
        finally:
            os.close(fd)
        return
    dirs = {loc.local}
    for key in keys:
        fsync_path(os.path.join(loc.local, key))
    for key in (*keys, *linked):
        parts = key.split("/")[:-1]
        dirs.update(os.path.join(loc.local, *parts[:i]) for i in range(1, len(parts) + 1))
    for d in sorted(dirs, key=len, reverse=True):  # new entries first, then their parents
        fsync_path(d)


def sync_paths(loc: Location, paths: list[str]) -> None:
    """Make the files and directory trees at ``paths`` (below ``loc``) durable, with ``loc``
    itself. For databases whose file names TensorStore chooses (the compact layout):
    they hold few files, so each is fsynced. Object stores have nothing to do."""
    if loc.local is None:
        return
    for rel in paths:
        top = os.path.join(loc.local, rel)
        if os.path.isfile(top):
            fsync_path(top)
        for root, _, files in os.walk(top, topdown=False):
            for f in files:
                fsync_path(os.path.join(root, f))
            fsync_path(root)
    fsync_path(loc.local)


def delete_all(loc: Location) -> None:
    """Remove every key below ``loc`` (and the empty directories, on a local disk)."""
    kv = loc.kvstore()
    kv.delete_range(ts.KvStore.KeyRange()).result()
    if loc.local is not None and os.path.isdir(loc.local):
        for root, dirs, _ in os.walk(loc.local, topdown=False):
            for d in dirs:
                try:
                    os.rmdir(os.path.join(root, d))
                except OSError:
                    pass


def has_any_key(loc: Location) -> bool:
    if loc.local is not None:
        return os.path.isdir(loc.local) and any(os.scandir(loc.local))
    with storage_errors(loc):
        return bool(loc.kvstore().list().result())
