"""Where a checkpoint lives: kvstore specs, small JSON objects, bulk sync, deletion.

All I/O goes through TensorStore kvstores so local disks, memory and object
stores (s3, gcs) share one code path. One TensorStore context is shared by the
whole process: ``memory://`` stores live in a context, and sharing it also
shares TensorStore's thread pools and cache.

s3 locations take their credentials and profile from the AWS environment
(TensorStore reads those itself); the endpoint and region are filled in here
from ``AWS_ENDPOINT_URL`` and ``AWS_REGION``, which TensorStore ignores. Keys of
a spec dict always win, and a spec's own ``context`` overrides the retry policy
and credentials set here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, Union

import tensorstore as ts

from .._errors import StorageError, StorageFullError, TsckptError

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
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", str(STALL_SECONDS))
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")


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


# Chunk files are written without a per-file fsync; sync_data() makes them
# durable in bulk before the commit object is written (see _save.py).
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


def resolve(directory: Directory) -> Location:
    """Accept a local path, a kvstore URL (``memory://``, ``s3://``...) or a kvstore spec dict."""
    if isinstance(directory, dict):
        spec = dict(directory)
        if isinstance(spec.get("path"), str):
            _check_path(spec["path"])
    else:
        text = os.fsdecode(directory)  # a bytes path too
        _check_path(text)
        if "://" not in text:
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


def _fill_from_environment(spec: dict[str, Any]) -> None:
    """Endpoint and region from the AWS environment, where the spec names none."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint" not in spec:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region and "aws_region" not in spec:
        spec["aws_region"] = region


# errno values that mean the data is missing rather than that the storage failed: a read
# reports them as a damaged checkpoint (a missing chunk file), never as a storage fault;
# a write (a directory that cannot be made: a file in the way) reports them as faults.
_MISSING = (errno.ENOENT, errno.ENOTDIR)

# Text of TensorStore messages that carry no os_error_code, by errno.
_ERRNO_TEXT = (
    ("no space left on device", errno.ENOSPC),
    ("disk quota exceeded", errno.EDQUOT),
    ("read-only file system", errno.EROFS),
    ("permission denied", errno.EACCES),
    ("operation not permitted", errno.EPERM),
    ("input/output error", errno.EIO),
    ("too many open files", errno.EMFILE),
    ("file too large", errno.EFBIG),
)


def _os_errno(msg: str, local: bool) -> int | None:
    """The errno a TensorStore message reports (``[os_error_code='28']``, or its text)."""
    m = re.search(r"os_error_code='?(\d+)", msg)
    if m:
        return int(m.group(1))
    low = msg.lower()
    for text, code in _ERRNO_TEXT:
        if text in low:
            return code
    if local and msg.startswith("RESOURCE_EXHAUSTED"):
        return errno.ENOSPC
    return None


def _file_of(msg: str) -> str | None:
    """The first absolute file path a TensorStore message quotes (its temporary-file
    suffix dropped; a NUL between a directory and a key written as '/')."""
    m = re.search(r'"(/[^"]+)"', msg)
    if not m:
        return None
    path = m.group(1).replace("\\x00", "/").replace("\x00", "/")
    return path[: -len(".__lock")] if path.endswith(".__lock") else path


def leaf_of_key(key: str) -> str | None:
    """The leaf path a key below a checkpoint belongs to (``w/c/0/1`` and ``w/zarr.json``
    give ``w``); None for the root and the compact layout's database files."""
    m = re.fullmatch(r"(.+)/c(?:/[0-9]+)*", key) or re.fullmatch(r"(.+)/zarr\.json", key)
    return m.group(1) if m else None


def _fix(code: int, doing: str, loc: Location, filename: str) -> str:
    """What to do about an operating-system error, by errno."""
    again = "save again" if doing == "writing" else "try again"
    where = loc.local or str(loc)
    if code == errno.ENOSPC:
        return f"free space on the filesystem holding {where} (or save elsewhere), then {again}"
    if code == errno.EDQUOT:
        return f"free space within your disk quota on the filesystem holding {where} (or save elsewhere), then {again}"
    if code in (errno.EACCES, errno.EPERM):
        if doing == "writing":
            return (
                f"give the user running this process write access to {where} and the directories above it, "
                "or save elsewhere"
            )
        return f"give the user running this process read access to {filename} and the directories above it"
    if code == errno.EROFS:
        return (
            f"the filesystem holding {where} is mounted read-only: save to a writable location, or remount it "
            "read-write"
        )
    if code == errno.EIO:
        return f"the storage device reported an I/O error: check the disk and the system log (dmesg), then {again}"
    if code in (errno.EMFILE, errno.ENFILE):
        return f"raise the limit on open files (ulimit -n), then {again}"
    if code == errno.EFBIG:
        return (
            "a file grew past the filesystem's size limit: pass a smaller max_inflight_bytes (no shard file is "
            "larger), or save elsewhere"
        )
    return f"check the storage, then {again}"


def os_fault(
    loc: Location, code: int, detail: str, *, filename: str | None = None, leaf: str | None = None,
    doing: str = "accessing",
) -> StorageError:
    """The StorageError (StorageFullError for ENOSPC and EDQUOT) of an operating-system error
    ``code`` while ``doing`` ("writing", "reading") ``filename`` below ``loc``."""
    filename = filename or str(loc)
    if leaf is None and loc.local is not None and filename.startswith(loc.local.rstrip("/") + "/"):
        leaf = leaf_of_key(filename[len(loc.local.rstrip("/")) + 1 :])
    what = os.strerror(code)
    what = what[:1].lower() + what[1:]
    name = errno.errorcode.get(code, str(code))
    about = f" leaf '{leaf}'" if leaf else ""
    message = f"{loc}: {what} ({name}) while {doing}{about} ({detail}); {_fix(code, doing, loc, filename)}"
    cls = StorageFullError if code in (errno.ENOSPC, errno.EDQUOT) else StorageError
    return cls(message, errno=code, filename=filename, leaf=leaf)


def storage_problem(
    loc: Location, err: BaseException, *, leaf: str | None = None, doing: str | None = None
) -> StorageError | None:
    """The StorageError a failed request means, or None when ``err`` is not a storage fault
    (a missing key, damaged data, an error of tsckpt's own).

    An operating-system error (no space, permission denied, read-only file system, I/O
    error; any driver) carries its errno, the file and the leaf path (``leaf``, or read
    off the file's path); ``doing`` ("writing", "reading") is read off TensorStore's
    message unless given. An object store that refuses or cannot be reached is named
    with what to check."""
    if isinstance(err, TsckptError):
        return None
    if isinstance(err, OSError):
        if err.errno is None or (err.errno in _MISSING and doing != "writing"):
            return None
        detail = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
        return os_fault(loc, err.errno, detail, filename=err.filename, leaf=leaf, doing=doing or "accessing")
    msg = " ".join(str(err).split())
    detail = msg.split(" [tensorstore_spec")[0]
    code = _os_errno(msg, loc.local is not None)
    if code is not None and (code not in _MISSING or doing == "writing"):
        low = msg.lower()
        doing = doing or (
            "writing" if re.search(r"writ|creat|renam|delet|lock|sync", low)
            else "reading" if re.search(r"read|open|list", low) else "accessing"
        )
        return os_fault(loc, code, detail, filename=_file_of(msg), leaf=leaf, doing=doing)
    if loc.local is not None or loc.spec.get("driver") in ("memory", None):
        return None
    detail = msg.split(" [")[0]
    driver = loc.spec.get("driver")
    where = loc.spec.get("endpoint") or f"the default {driver} endpoint"
    aws = driver == "s3"
    if "NoSuchBucket" in msg or "bucket does not exist" in msg.lower():
        fix = "AWS_ENDPOINT_URL (or the spec's 'endpoint')" if aws else "the spec's endpoint"
        return StorageError(
            f"{loc}: bucket {loc.spec.get('bucket')!r} does not exist at {where}; create it, or check the "
            f"bucket name and {fix}",
            errno=errno.ENOENT, filename=str(loc),
        )
    if "PERMISSION_DENIED" in msg or "UNAUTHENTICATED" in msg or re.search(r"http_response_code='40[13]'", msg):
        fix = (
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or the spec's context "
            "'aws_credentials'" if aws else "the credentials"
        )
        return StorageError(
            f"{loc}: access denied by {where} ({detail}); check {fix} and the bucket's permissions",
            errno=errno.EACCES, filename=str(loc),
        )
    if "credentials" in msg.lower() and ("provider" in msg.lower() or "spec" in msg.lower()):
        fix = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the context 'aws_credentials'"
        return StorageError(
            f"{loc}: no usable credentials ({detail}); check {fix if aws else 'the credentials'}",
            errno=errno.EACCES, filename=str(loc),
        )
    if "CURL error" in msg or "retry attempts failed" in msg:
        fix = "AWS_ENDPOINT_URL (or the spec's 'endpoint')" if aws else "the spec's endpoint"
        return StorageError(
            f"{loc}: cannot reach {where} ({detail}); check {fix} and the network. A request gives up after "
            f"at most about {request_seconds(_retries_of(loc)):.0f} s (the context resource 's3_request_retries' "
            "and TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS set the bound)",
            filename=str(loc),
        )
    return None


def _retries_of(loc: Location) -> dict[str, Any] | None:
    """The retry policy a location's spec sets in its own context, if any."""
    context = loc.spec.get("context")
    found = context.get("s3_request_retries") if isinstance(context, dict) else None
    return found if isinstance(found, dict) else None


@contextlib.contextmanager
def storage_errors(loc: Location, *, leaf: str | None = None, doing: str | None = None) -> Iterator[None]:
    """Turn a storage fault inside the block (TensorStore's ValueError, or an OSError of
    the operating system) into a StorageError; other errors pass unchanged."""
    try:
        yield
    except (ValueError, OSError) as e:  # TensorStore reports failed requests as ValueError
        err = storage_problem(loc, e, leaf=leaf, doing=doing)
        if err is None:
            raise
        raise err from e


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


def sync_data(loc: Location, keys: list[str]) -> None:
    """Make the files at ``keys`` (written below ``loc``) durable, with their directories.

    A rank that wrote few files fsyncs just those and the directories that hold
    them. One that wrote many (thousands of small arrays) uses Linux's
    syncfs(), which flushes the whole filesystem in one call, far cheaper than
    an fsync per file; no library wraps it, hence ctypes. Object stores
    acknowledge writes durably, so there is nothing to do.
    """
    if loc.local is None or not os.path.isdir(loc.local):
        return
    if len(keys) > FSYNC_FILES_MAX and sys.platform.startswith("linux"):
        fd = os.open(loc.local, os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs failed: {os.strerror(err)}", loc.local)
        finally:
            os.close(fd)
        return
    dirs = {loc.local}
    for key in keys:
        fsync_path(os.path.join(loc.local, key))
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
