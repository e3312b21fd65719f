"""Where a checkpoint lives: kvstore specs, the process's TensorStore context, and the
object-store environment.

All I/O goes through TensorStore kvstores so local disks, memory and object
stores (s3, gcs) share one code path. One TensorStore context is shared by the
whole process: ``memory://`` stores live in a context, and sharing it also
shares TensorStore's thread pools and cache.

s3 locations take their credentials and profile from the AWS environment
(TensorStore reads those itself); the endpoint and region are filled in here
from ``AWS_ENDPOINT_URL`` and ``AWS_REGION``, which TensorStore ignores. Keys of
a spec dict always win, and a spec's own ``context`` overrides the retry policy
and credentials set here.

The stall limit of TensorStore's HTTP requests (``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``
and ``TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES``, see :data:`STALL_SECONDS`) is set in
``os.environ`` when :func:`resolve` first meets a location whose driver talks HTTP
(s3, gcs, http), before tsckpt's first request to it, and only where the variable is
unset: a value of the user's wins. Importing tsckpt sets nothing, so a process that
never uses an object store through tsckpt keeps TensorStore's own defaults. TensorStore
reads the variables once, at its first HTTP request: one made by the process before
tsckpt resolved such a location fixes them (without tsckpt's limit).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from typing import Any, Union

import tensorstore as ts

from .._errors import StorageError
from . import hfcache

Directory = Union[str, "os.PathLike[str]", dict]

# How long one request to an object store may take, retries included. TensorStore's s3
# driver sets no deadline on a request (no curl timeout), so a request is bounded by two
# settings: its retry policy (context resource ``s3_request_retries``; TensorStore's
# default, 32 attempts with backoff up to 32 s, waits many minutes) and the stall limit
# (``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``: an attempt that moves no byte for this
# long fails and is retried; read by TensorStore once, at its first HTTP request). These
# defaults give 7 attempts of at most 6 s, with at most 12.75 s of backoff between them:
# a request fails within about 55 s (request_seconds()), a failing request answered at
# once within about 13 s. A spec's ``context`` overrides the retries; the environment
# variable, set before the first request, the stall limit.
S3_REQUEST_RETRIES = {"max_retries": 6, "initial_delay": "0.25s", "max_delay": "4s"}
STALL_SECONDS = 6
STALL_ENVIRONMENT = {
    "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": str(STALL_SECONDS),
    "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1",
}
# TensorStore's kvstore drivers whose requests go through its HTTP transport (curl), and
# their URLs' schemes.
CURL_DRIVERS = frozenset({"s3", "gcs", "http"})
_CURL_SCHEMES = ("s3://", "gs://", "http://", "https://")


def set_stall_limit() -> None:
    """Put :data:`STALL_ENVIRONMENT` in ``os.environ`` where unset (a user's value wins)."""
    for name, value in STALL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def _seconds(text: Any) -> float:
    """A duration of a TensorStore context ("250ms", "0.25s", "4s", "1m") in seconds."""
    m = re.fullmatch(r"([0-9.]+)(ms|s|m|h)", str(text).strip())
    if not m:
        raise ValueError(f"not a duration: {text!r} (expected e.g. '250ms', '4s')")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]


def request_seconds(retries: dict[str, Any] | None = None, stall: float | None = None) -> float:
    """The longest one object-store request may take under retry policy ``retries`` (default
    tsckpt's) and stall limit ``stall`` (default the environment's): each attempt ends after
    ``stall`` seconds without a byte, and TensorStore
    waits ``min(initial_delay * (2**k + 1), max_delay)`` at most before retry ``k``."""
    policy = {**S3_REQUEST_RETRIES, **(retries or {})}
    if stall is None:
        stall = float(os.environ.get("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", STALL_SECONDS))
    tries = int(policy["max_retries"]) + 1
    first, most = _seconds(policy["initial_delay"]), _seconds(policy["max_delay"])
    backoff = sum(min(first * (2**k + 1), most) for k in range(tries - 1))
    return tries * stall + backoff


# Chunk files are written without a per-file fsync; durable.sync_data() makes them
# durable in bulk before the commit object is written (see _save/protocol.py).
# The OCDBT cache pool keeps B-tree nodes of compact checkpoints in memory, so
# opening thousands of arrays does not re-read the tree for each. Writers keep
# nothing cached once a save is done: a save that replaces a database at the same
# location in this process would otherwise build on the replaced one's nodes.
WRITE_CACHE_POOL = "cache_pool#ocdbt-write"
READ_CACHE_POOL = "cache_pool#ocdbt"
READ_CACHE_BYTES = 100_000_000
CONTEXT = ts.Context(
    {
        "file_io_sync": False,
        "s3_request_retries": S3_REQUEST_RETRIES,
        READ_CACHE_POOL: {"total_bytes_limit": READ_CACHE_BYTES},
        WRITE_CACHE_POOL: {"total_bytes_limit": 0},
    }
)


def reader_context() -> ts.Context:
    """A context for reading one opened checkpoint: :data:`CONTEXT`'s, with a cache pool of
    its own. TensorStore keeps one OCDBT driver per spec and cache pool, and a driver
    remembers the database it first read (its uuid): a checkpoint saved again in its
    place (overwrite=True) has a new database, which a driver shared with a reader of the
    replaced one refuses ("Configuration mismatch on uuid"). Each opened checkpoint gets
    its own driver, so a new open reads the new database, and a reader of the replaced
    one fails (reported as the checkpoint replaced while it was read)."""
    return ts.Context({READ_CACHE_POOL: {"total_bytes_limit": READ_CACHE_BYTES}}, parent=CONTEXT)


@dataclasses.dataclass(frozen=True)
class Location:
    """A checkpoint directory as a kvstore spec whose ``path`` ends in '/'."""

    spec: dict[str, Any]
    local: str | None  # filesystem path when the driver is "file"

    def __str__(self) -> str:
        if self.local is not None:
            return self.local
        return f"{self.spec.get('driver')}://{self.spec.get('bucket', '')}/{self.spec.get('path', '')}".replace(":///", "://")

    def sub(self, path: str) -> dict[str, Any]:
        """kvstore spec of a node below the checkpoint root."""
        base = self.spec.get("path", "")
        return {**self.spec, "path": f"{base}{path}/" if path else base}

    def kvstore(self) -> ts.KvStore:
        return ts.KvStore.open(self.spec, context=CONTEXT).result()


def resolve(directory: Directory, *, write: bool = False) -> Location:
    """Accept a local path, a kvstore URL (``memory://``, ``s3://``...) or a kvstore spec dict;
    ``hf://ORG/NAME[@REVISION]``: the snapshot of the local Hugging Face cache
    (:func:`hfcache.snapshot_path`), for reading only (``write``: ValueError)."""
    if isinstance(directory, dict):
        spec = dict(directory)
        if isinstance(spec.get("path"), str):
            _check_path(spec["path"])
    else:
        text = os.fsdecode(directory)  # a bytes path too
        _check_path(text)
        if text.startswith(hfcache.SCHEME):
            if write:
                raise ValueError(
                    f"{text}: an hf:// location is a download in the Hugging Face cache, which tsckpt only reads; "
                    "write to a path"
                )
            spec = {"driver": "file", "path": hfcache.snapshot_path(text)}
        elif "://" not in text:
            spec = {"driver": "file", "path": os.path.abspath(text)}
        else:
            spec = ts.KvStore.Spec(text).to_json()
    path = spec.get("path", "")
    if path and not path.endswith("/"):
        path += "/"
    spec["path"] = path
    local = path.rstrip("/") or "/" if spec.get("driver") == "file" else None
    if spec.get("driver") == "s3":
        _fill_from_environment(spec)
    if _over_http(spec):
        set_stall_limit()
    return Location(spec, local)


def _check_path(text: str) -> None:
    """Refuse a path TensorStore cannot take: its paths are UTF-8 strings, so a name that is not
    valid UTF-8 (a bytes path, or a str holding the surrogate escapes Python decodes such bytes
    to) cannot be encoded for it, nor can a NUL byte pass."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raw = b"".join(  # the bytes Python decoded to surrogate escapes, other surrogates spelled out
            c.encode("utf-8", "surrogateescape" if "\udc80" <= c <= "\udcff" else "backslashreplace") for c in text
        )
        what = f"byte {ord(bad) - 0xDC00:#04x}" if "\udc80" <= bad <= "\udcff" else f"the lone surrogate {ascii(bad)}"
        raise StorageError(
            f"{raw!r}: the path cannot be encoded for the storage layer: TensorStore takes paths as UTF-8, and "
            f"this one is not valid UTF-8 ({what} at character {e.start}); rename or move the checkpoint to a "
            "UTF-8 path, or reach it through a symbolic link whose path is UTF-8",
            errno=errno.EILSEQ, filename=repr(raw),
        ) from None
    if "\0" in text:
        raise StorageError(
            f"{text!r}: the path cannot be encoded for the storage layer: it holds a NUL character, which no file "
            "name can; remove it",
            errno=errno.EINVAL, filename=repr(text),
        )


def _over_http(spec: Any) -> bool:
    """Whether a kvstore spec (a dict or a URL), or one it is layered on (``base``), talks HTTP."""
    while isinstance(spec, dict):
        if spec.get("driver") in CURL_DRIVERS:
            return True
        spec = spec.get("base")
    return isinstance(spec, str) and spec.startswith(_CURL_SCHEMES)


def _fill_from_environment(spec: dict[str, Any]) -> None:
    """Endpoint and region from the AWS environment, where the spec names none."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint" not in spec:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region and "aws_region" not in spec:
        spec["aws_region"] = region
