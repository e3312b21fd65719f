"""The stored keys of a checkpoint in either layout, read as docs/format.md describes them
(an outside reader's view: no tsckpt internals).

Plain: every key is a file below the directory. Compact: array keys live in the
OCDBT database at the checkpoint root; TensorStore's ocdbt kvstore reads them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

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
    """The chunk keys of array ``leaf`` after its ``c`` (its chunk key separator included), sorted:
    ``["/0/0", "/1/0"]`` for several files, ``[".0.0"]`` for one (``[""]``: a 0-d array's ``c``)."""
    prefix = f"{leaf}/c".encode()
    keys = array_store(directory).list(ts.KvStore.KeyRange(prefix, prefix[:-1] + b"d")).result()
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


def layout_record(layout: str) -> tuple[str, int]:
    """What the root of a checkpoint in ``layout`` records: (layout, format version)."""
    return layout, {"plain": 3, "compact": 3}[layout]


def root_layout(meta: dict) -> tuple[str, object]:
    """(layout, format version) as the ``tsckpt`` attributes of a root zarr.json record
    them: no "layout" means plain."""
    return str(meta.get("layout", "plain")), meta.get("format_version")


def checkpoint_roots(directory: str | os.PathLike[str]) -> dict[Path, tuple[str, object]]:
    """Every tsckpt checkpoint root below ``directory`` (itself included), committed or
    pending: its directory -> (layout, format version). Roots that are not valid JSON
    (damaged on purpose) are left out."""
    out: dict[Path, tuple[str, object]] = {}
    for parent, _, files in os.walk(directory):
        if "zarr.json" not in files:
            continue
        with open(os.path.join(parent, "zarr.json"), "rb") as f:
            text = f.read()
        if b'"tsckpt"' not in text:
            continue  # a group or array node without tsckpt attributes
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if not isinstance(doc, dict) or doc.get("node_type") != "group":
            continue  # an array node (its attributes name its dtype and kind)
        attrs = doc.get("attributes")
        meta = attrs.get("tsckpt") if isinstance(attrs, dict) else None
        if isinstance(meta, dict):
            out[Path(parent)] = root_layout(meta)
    return out
