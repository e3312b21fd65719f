"""What a failed request means: TensorStore's and the operating system's errors classified
by one table (:data:`TABLE`), and the storage faults among them raised as ``StorageError``.

TensorStore reports a failed request as a ValueError whose message is the only account
of what went wrong (an absl status code, words, sometimes ``os_error_code``). Every
module that reads such a message asks :func:`classify` here, by question:

- :data:`OS_ERROR`: the operating-system error it reports, as an errno;
- :data:`DOING`: whether the request wrote or read, when its caller does not say;
- :data:`OBJECT_STORE`: an object store that refuses or cannot be reached;
- :data:`CHUNK_READ`: what a failed read of stored data means (damage, not a fault);
- :data:`ARRAY_OPEN`: what a failed open of an array (its ``zarr.json``) means;
- :data:`FILE_END`: a read past the end of a file (a file shorter than its record says).

The errno mapping: an errno of :data:`MISSING` means missing data when read (a damaged
checkpoint) and a fault when written; :data:`FULL` errnos raise StorageFullError; every
errno says what to do (:data:`FIXES`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from .._errors import StorageError, StorageFullError, TsckptError
from .locations import Location, request_seconds

# The questions the table answers.
OS_ERROR = "os error"
DOING = "doing"
OBJECT_STORE = "object store"
CHUNK_READ = "chunk read"
ARRAY_OPEN = "array open"
FILE_END = "file end"

# Answers. OS_ERROR: OS_ERROR_CODE (the errno is the number quoted), OS_ERROR_TEXT (the
# errno of the row), EXHAUSTED (no space: on a local disk only).
OS_ERROR_CODE = "os_error_code"
OS_ERROR_TEXT = "os error text"
EXHAUSTED = "resource exhausted"
WRITING = "writing"
READING = "reading"
NO_BUCKET = "no bucket"
ACCESS_DENIED = "access denied"
NO_CREDENTIALS = "no credentials"
UNREACHABLE = "unreachable"
# CHUNK_READ's answers are the words every read path uses (lazy reads, restore, verify, the
# own shard reader); UNDECODABLE where no row matches.
CHECKSUM_MISMATCH = "checksum mismatch: stored bytes were altered"
CHUNK_MISSING = "a chunk file is missing"
UNDECODABLE = "stored data could not be decoded (truncated or damaged file)"
# ARRAY_OPEN's; None where no row matches (the zarr.json cannot be read).
DATABASE_DAMAGED = "database damaged"
ARRAY_MISSING = "array missing"
BEYOND_LIMITS = "beyond limits"
NODE_MISMATCH = "node mismatch"
SHORT_FILE = "short file"


class Rule(NamedTuple):
    """One row of :data:`TABLE`: a message of ``question`` that ``pattern`` finds means ``answer``."""

    question: str
    answer: str
    pattern: re.Pattern[str]
    errno: int | None = None  # the errno the row reports


def _rule(question: str, answer: str, pattern: str, code: int | None = None, flags: int = 0) -> Rule:
    return Rule(question, answer, re.compile(pattern, flags), code)


# Rows are tried in order, first match wins, among those of one question. Messages are
# searched as TensorStore wrote them (whitespace runs made one space, where so noted).
TABLE: tuple[Rule, ...] = (
    # The errno of an operating-system error: quoted, else by its text (TensorStore's
    # messages without os_error_code), else no space on a local disk.
    _rule(OS_ERROR, OS_ERROR_CODE, r"os_error_code='?(\d+)"),
    _rule(OS_ERROR, OS_ERROR_TEXT, "no space left on device", errno.ENOSPC, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "disk quota exceeded", errno.EDQUOT, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "read-only file system", errno.EROFS, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "permission denied", errno.EACCES, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "operation not permitted", errno.EPERM, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "input/output error", errno.EIO, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "too many open files", errno.EMFILE, re.I),
    _rule(OS_ERROR, OS_ERROR_TEXT, "file too large", errno.EFBIG, re.I),
    _rule(OS_ERROR, EXHAUSTED, r"^RESOURCE_EXHAUSTED", errno.ENOSPC),
    # Which way a failed request went.
    _rule(DOING, WRITING, r"writ|creat|renam|delet|lock|sync", flags=re.I),
    _rule(DOING, READING, r"read|open|list", flags=re.I),
    # An object store that refuses or cannot be reached.
    _rule(OBJECT_STORE, NO_BUCKET, r"NoSuchBucket|(?i:bucket does not exist)", errno.ENOENT),
    _rule(OBJECT_STORE, ACCESS_DENIED, r"PERMISSION_DENIED|UNAUTHENTICATED|http_response_code='40[13]'", errno.EACCES),
    _rule(OBJECT_STORE, NO_CREDENTIALS, r"^(?=.*credentials)(?=.*(?:provider|spec))", errno.EACCES, re.I | re.S),
    _rule(OBJECT_STORE, UNREACHABLE, r"CURL error|retry attempts failed"),
    # A failed read of a chunk that is not a storage fault.
    _rule(CHUNK_READ, CHECKSUM_MISMATCH, r"digest mismatch|crc32c|checksum", flags=re.I),
    _rule(CHUNK_READ, CHUNK_MISSING, r"not_found|missing|not found", flags=re.I),
    # A failed open of an array (its zarr.json, read against the root's record).
    _rule(ARRAY_OPEN, DATABASE_DAMAGED, r"^(?=.*ocdbt database)(?=.*(?:manifest|byte range|error decoding|invalid json))",
          flags=re.I | re.S),
    _rule(ARRAY_OPEN, ARRAY_MISSING, r"does not exist|(?i:not found)"),
    _rule(ARRAY_OPEN, BEYOND_LIMITS, r"Cannot create using specified"),
    _rule(ARRAY_OPEN, NODE_MISMATCH, r"Expected|Mismatch|Incompatible"),
    # A read of a byte range past the file's end.
    _rule(FILE_END, SHORT_FILE, r"OUT_OF_RANGE"),
)
_ROWS = {q: tuple(r for r in TABLE if r.question == q) for q in dict.fromkeys(r.question for r in TABLE)}


def find(question: str, text: str) -> tuple[Rule, re.Match[str]] | None:
    """The first row of ``question`` whose pattern finds ``text``, with its match, or None."""
    for rule in _ROWS[question]:
        m = rule.pattern.search(text)
        if m:
            return rule, m
    return None


def classify(question: str, text: str, default: Any = None) -> Any:
    """The answer of the first row of ``question`` that matches ``text``, else ``default``."""
    found = find(question, text)
    return found[0].answer if found else default


# ---- the text of a message -----------------------------------------------------------------

# Directories through which a reader reads another (a mirror of links, :mod:`.mirror`) -> the
# directory they stand for: TensorStore's messages name the files it opened, which are theirs.
_standins: dict[str, str] = {}


def stand_in(path: str, real: str | None) -> None:
    """Name files below ``path`` in messages as below ``real`` (None: no longer)."""
    if real is None:
        _standins.pop(path, None)
    else:
        _standins[path] = real


def one_line(err: BaseException) -> str:
    """An error's message with its whitespace runs made one space, and files a reader read
    through a stand-in directory named where they are (:func:`stand_in`)."""
    msg = " ".join(str(err).split())
    for path, real in list(_standins.items()):
        if path in msg:
            msg = msg.replace(path.rstrip("/") + "/", real.rstrip("/") + "/").replace(path, real)
    return msg


def without_spec(msg: str) -> str:
    """A TensorStore message without the spec it appends (``[tensorstore_spec=...]``)."""
    return msg.split(" [tensorstore_spec")[0]


def without_details(msg: str) -> str:
    """A TensorStore message without the fields it appends (``[source=...]``, ``[tensorstore_spec=...]``)."""
    return msg.split(" [")[0]


def without_response(msg: str) -> str:
    """A message without a store's response details (from the first `` [name='`` on)."""
    return re.sub(r" \[\w+='.*$", "", msg)


def file_of(msg: str) -> str | None:
    """The first absolute file path a TensorStore message quotes (its temporary-file
    suffix dropped; a NUL between a directory and a key written as '/')."""
    m = re.search(r'"(/[^"]+)"', msg)
    if not m:
        return None
    path = m.group(1).replace("\\x00", "/").replace("\x00", "/")
    return path[: -len(".__lock")] if path.endswith(".__lock") else path


# ---- errno -------------------------------------------------------------------------------

# errno values that mean the data is missing rather than that the storage failed: a read
# reports them as a damaged checkpoint (a missing chunk file), never as a storage fault;
# a write (a directory that cannot be made: a file in the way) reports them as faults.
MISSING = (errno.ENOENT, errno.ENOTDIR)
# errno values raised as StorageFullError.
FULL = (errno.ENOSPC, errno.EDQUOT)

_ACCESS = (
    "give the user running this process write access to {where} and the directories above it, or save elsewhere",
    "give the user running this process read access to {filename} and the directories above it",
)
# What to do about an operating-system error, by errno: (writing, otherwise), with {where}
# the location, {filename} the file, {again} "save again" or "try again".
FIXES: dict[int, tuple[str, str]] = {
    code: (fix, fix) if isinstance(fix, str) else fix
    for codes, fix in (
        ((errno.ENOSPC,), "free space on the filesystem holding {where} (or save elsewhere), then {again}"),
        ((errno.EDQUOT,), "free space within your disk quota on the filesystem holding {where} (or save elsewhere), "
                          "then {again}"),
        ((errno.EACCES, errno.EPERM), _ACCESS),
        ((errno.EROFS,), "the filesystem holding {where} is mounted read-only: save to a writable location, or "
                         "remount it read-write"),
        ((errno.EIO,), "the storage device reported an I/O error: check the disk and the system log (dmesg), then "
                       "{again}"),
        ((errno.EMFILE, errno.ENFILE), "raise the limit on open files (ulimit -n), then {again}"),
        ((errno.EFBIG,), "a file grew past the filesystem's size limit: pass a smaller max_inflight_bytes (no shard "
                         "file is larger), or save elsewhere"),
    )
    for code in codes
}
OTHER_FIX = "check the storage, then {again}"


def os_errno(msg: str, local: bool) -> int | None:
    """The errno a TensorStore message reports (``[os_error_code='28']``, or its text; no
    space when a local store's request was RESOURCE_EXHAUSTED)."""
    found = find(OS_ERROR, msg)
    if found is None:
        return None
    rule, m = found
    if rule.answer == OS_ERROR_CODE:
        return int(m.group(1))
    if rule.answer == EXHAUSTED and not local:
        return None
    return rule.errno


def leaf_of_key(key: str) -> str | None:
    """The leaf path a key below a checkpoint belongs to (``w/c/0/1``, ``w/c.0.1`` and
    ``w/zarr.json`` give ``w``); None for the root and the compact layout's database files."""
    m = re.fullmatch(r"(.+)/c(?:(?:/[0-9]+)*|(?:\.[0-9]+)+)", key) or re.fullmatch(r"(.+)/zarr\.json", key)
    return m.group(1) if m else None


def _fix(code: int, doing: str, loc: Location, filename: str) -> str:
    """What to do about an operating-system error, by errno (:data:`FIXES`)."""
    writing, otherwise = FIXES.get(code, (OTHER_FIX, OTHER_FIX))
    again = "save again" if doing == "writing" else "try again"
    fix = writing if doing == "writing" else otherwise
    return fix.format(where=loc.local or str(loc), filename=filename, again=again)


# ---- StorageError ------------------------------------------------------------------------

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
    detail = detail.replace("\x00", "/")  # TensorStore's messages join a directory and a key by a NUL
    message = f"{loc}: {what} ({name}) while {doing}{about} ({detail}); {_fix(code, doing, loc, filename)}"
    cls = StorageFullError if code in FULL else StorageError
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
        if err.errno is None or (err.errno in MISSING and doing != "writing"):
            return None
        detail = f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
        return os_fault(loc, err.errno, detail, filename=err.filename, leaf=leaf, doing=doing or "accessing")
    msg = one_line(err)
    code = os_errno(msg, loc.local is not None)
    if code is not None and (code not in MISSING or doing == "writing"):
        doing = doing or classify(DOING, msg, "accessing")
        return os_fault(loc, code, without_spec(msg), filename=file_of(msg), leaf=leaf, doing=doing)
    if loc.local is not None or loc.spec.get("driver") in ("memory", None):
        return None
    return _object_store_problem(loc, msg)


def _object_store_problem(loc: Location, msg: str) -> StorageError | None:
    """The StorageError of an object store's refusal or silence in ``msg``, or None."""
    found = find(OBJECT_STORE, msg)
    if found is None:
        return None
    rule = found[0]
    detail = without_details(msg)
    driver = loc.spec.get("driver")
    where = loc.spec.get("endpoint") or f"the default {driver} endpoint"
    aws = driver == "s3"
    if rule.answer == NO_BUCKET:
        fix = "AWS_ENDPOINT_URL (or the spec's 'endpoint')" if aws else "the spec's endpoint"
        return StorageError(
            f"{loc}: bucket {loc.spec.get('bucket')!r} does not exist at {where}; create it, or check the "
            f"bucket name and {fix}",
            errno=rule.errno, filename=str(loc),
        )
    if rule.answer == ACCESS_DENIED:
        fix = (
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or the spec's context "
            "'aws_credentials'" if aws else "the credentials"
        )
        return StorageError(
            f"{loc}: access denied by {where} ({detail}); check {fix} and the bucket's permissions",
            errno=rule.errno, filename=str(loc),
        )
    if rule.answer == NO_CREDENTIALS:
        fix = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the context 'aws_credentials'"
        return StorageError(
            f"{loc}: no usable credentials ({detail}); check {fix if aws else 'the credentials'}",
            errno=rule.errno, filename=str(loc),
        )
    fix = "AWS_ENDPOINT_URL (or the spec's 'endpoint')" if aws else "the spec's endpoint"
    return StorageError(  # UNREACHABLE
        f"{loc}: cannot reach {where} ({detail}); check {fix} and the network. A request gives up after "
        f"at most about {request_seconds(_retries_of(loc)):.0f} s (the context resource 's3_request_retries' "
        "and TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS set the bound)",
        filename=str(loc),
    )


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
