"""The stored keys of a checkpoint in either layout, read as docs/format.md describes them
(an outside reader's view: no tsckpt internals).

Plain: every key is a file below the directory. Compact: array keys live in the
OCDBT database at the checkpoint root; TensorStore's ocdbt kvstore reads them.
"""

from __future__ import annotations

import json
import os

import tensorstore as ts


def layout_of(directory: str | os.PathLike[str]) -> str:
    with open(os.path.join(directory, "zarr.json")) as f:
        return str(json.load(f)["attributes"]["tsckpt"].get("layout", "plain"))


def array_store(directory: str | os.PathLike[str]) -> ts.KvStore:
    """The kvstore that holds the array keys (``<path>/zarr.json``, ``<path>/c/...``)."""
    base = {"driver": "file", "path": f"{os.fspath(directory)}/"}
    spec = base if layout_of(directory) == "plain" else {"driver": "ocdbt", "base": base}
    return ts.KvStore.open(spec).result()


def chunk_keys(directory: str | os.PathLike[str], leaf: str) -> list[str]:
    """The chunk keys of array ``leaf`` relative to its ``c/`` prefix, sorted (e.g. ``["0/0", "1/0"]``)."""
    prefix = f"{leaf}/c/".encode()
    keys = array_store(directory).list(ts.KvStore.KeyRange(prefix, prefix[:-1] + b"0")).result()
    return sorted(k[len(prefix):].decode() for k in keys)


def read_key(directory: str | os.PathLike[str], key: str) -> bytes | None:
    r = array_store(directory).read(key).result()
    return bytes(r.value) if r.state == "value" else None


def write_key(directory: str | os.PathLike[str], key: str, value: bytes | None) -> None:
    """Replace (or with None delete) one stored key, as damage on disk would."""
    kv = array_store(directory)
    if value is None:
        kv.delete_range(ts.KvStore.KeyRange(key.encode(), key.encode() + b"\x00")).result()
    else:
        kv.write(key, value).result()


def delete_prefix(directory: str | os.PathLike[str], prefix: str) -> None:
    p = prefix.encode()
    array_store(directory).delete_range(ts.KvStore.KeyRange(p, p[:-1] + bytes([p[-1] + 1]))).result()


def count_files(directory: str | os.PathLike[str]) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))
