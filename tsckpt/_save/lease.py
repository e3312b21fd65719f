"""Who is saving into a directory, and whether that save is still running.

A save's pending root ``zarr.json`` records its *claim*: the host and process
that claimed the directory, and a lease. Rank 0 of the save renews the lease
(rewrites the pending root with the time of renewal, conditionally on the
generation it last wrote) every ``RENEW_SECONDS`` from a daemon thread until the
save commits or fails. A pending checkpoint may be removed (``overwrite=True``,
a manager's clean-up) only when its save is clearly dead:

- it was started by this very process and no longer runs here; or
- on the same machine (host name, boot and process namespace alike) its process
  is gone (or is a different process with the same pid); or
- its lease was last renewed more than ``lease_s`` seconds ago (hosts' clocks
  must agree to well within that).

A pending root without a claim (written by an older tsckpt) is a dead save. The
commit is conditional on the generation of the last renewal, so a save whose
directory was taken over meanwhile fails instead of committing into it.

Every conditional write of a root (the claim, each renewal, the commit) names
its save: the claim's ``id`` while pending, ``save_id`` once committed. On an
object store a write can land while its response is lost; the client's retry
then finds the object changed and reports a failed condition. So a failed
condition is never taken at its word: :func:`write_root` reads the root back,
and the write landed when the root holds what it wrote, or (:func:`save_id_of`)
names this save.

:func:`save_running` is the one test of whether a pending root's save may
still be running: the claim of a new save, a manager's clean-up and its
saves all ask it before they remove or replace a pending checkpoint.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import tensorstore as ts

from .._errors import amend
from .._ondisk.records import ROOT_KEY, STATE_COMMITTED, STATE_PENDING
from .._ondisk.root import RootState, root_file_problem, root_state
from .._storage import durable as _durable
from .._storage import faults as _faults
from .._storage.locations import Location

log = logging.getLogger("tsckpt")

# A claim whose lease was not renewed for this long belongs to a dead save.
LEASE_SECONDS = 60.0
# How often rank 0 of a running save renews its lease.
RENEW_SECONDS = 5.0

_running: set[str] = set()  # ids of the claims whose save runs in this process
_running_lock = threading.Lock()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    """This machine and process namespace: where a pid means the same process."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{_read('/proc/sys/kernel/random/boot_id')}/{ns}"


def _pid_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None where unknown or a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 2 :].split() if stat else []
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def _pid_alive(pid: int, start: Any) -> bool:
    """Process ``pid`` of this machine exists and, where known, started at ``start``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    if os.path.isdir("/proc/self"):
        now = _pid_start(pid)
        return now is not None and (not isinstance(start, int) or now == start)
    return True


# The id the next claims of this context take, where the process that asked for the save
# named it (a writer process's training process: it can then tell, should the writer die
# before replying, whether the step its save claimed was committed).
_named_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tsckpt_claim_id", default=None)


@contextlib.contextmanager
def claims_named(save_id: str) -> Iterator[None]:
    """The saves run in this context claim their step under ``save_id``."""
    token = _named_id.set(save_id)
    try:
        yield
    finally:
        _named_id.reset(token)


def new_claim() -> dict[str, Any]:
    """The claim of a save started now by this process (its id: :func:`claims_named`'s, else new)."""
    now = time.time()
    return {
        "id": _named_id.get() or uuid.uuid4().hex,
        "host": socket.gethostname(),
        "machine": _machine(),
        "pid": os.getpid(),
        "pid_start": _pid_start(os.getpid()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "renewed": now,
        "lease_s": LEASE_SECONDS,
    }


def describe(claim: Any) -> str:
    """'pid 12 on host h, started 2025-01-31T12:00:00Z, lease renewed 3 s ago' (for messages)."""
    if not isinstance(claim, Mapping):
        return "an unknown process (the pending root records no claim)"
    text = f"pid {claim.get('pid')} on host {claim.get('host')!r}, started {claim.get('started')}"
    renewed = claim.get("renewed")
    if isinstance(renewed, (int, float)):
        text += f", lease renewed {max(0.0, time.time() - renewed):.0f} s ago"
    return text


def lease_seconds(claim: Any) -> str:
    """How long ``claim``'s lease lasts after a renewal, in seconds, for messages ("?" where unknown)."""
    lease_s = claim.get("lease_s") if isinstance(claim, Mapping) else None
    return f"{lease_s:g}" if isinstance(lease_s, (int, float)) else "?"


def claim_of(root: RootState) -> Any:
    """The claim a pending root records (None for any other root, or a pending one without)."""
    return root.meta.get("claim") if root.state == STATE_PENDING and root.meta is not None else None


def save_running(root: RootState) -> bool:
    """Whether ``root`` (a root zarr.json's state) is the pending root of a save that may
    still be running, in this process or another: such a checkpoint is never removed."""
    return root.state == STATE_PENDING and _claim_running(claim_of(root))


def _claim_running(claim: Any, now: float | None = None) -> bool:
    """Whether the save that wrote ``claim`` (a pending root's ``claim``) may still be running."""
    if not isinstance(claim, Mapping):
        return False
    with _running_lock:
        if claim.get("id") in _running:
            return True
    pid, host, machine = claim.get("pid"), claim.get("host"), claim.get("machine")
    if isinstance(pid, int) and host == socket.gethostname() and machine == _machine():
        if pid == os.getpid() and claim.get("pid_start") == _pid_start(pid):
            return False  # this process, and not among its running saves
        if not _pid_alive(pid, claim.get("pid_start")):
            return False
    renewed, lease = claim.get("renewed"), claim.get("lease_s")
    if not isinstance(renewed, (int, float)) or not isinstance(lease, (int, float)):
        return False
    return (time.time() if now is None else now) - renewed < lease


def save_id_of(root: RootState) -> str | None:
    """The id of the save that wrote ``root``: its claim's while pending, its ``save_id``
    once committed (None for a root that names none: an older tsckpt's, a deletion's)."""
    meta = root.meta or {}
    if root.state == STATE_PENDING:
        claim = meta.get("claim")
        found = claim.get("id") if isinstance(claim, Mapping) else None
    else:
        found = meta.get("save_id") if root.state == STATE_COMMITTED else None
    return found if isinstance(found, str) else None


@dataclasses.dataclass(frozen=True)
class RootRead:
    """A root ``zarr.json`` as read: its generation and bytes (empty and None when there is none)."""

    generation: bytes
    value: bytes | None

    @property
    def root(self) -> RootState:
        return root_state(self.value)


def read_root(loc: Location) -> RootRead:
    """The root at ``loc`` now, read through the durable kvstore that writes it (a file that is
    not read, :func:`root_file_problem`, as an unreadable root of no save)."""
    if root_file_problem(loc) is not None:
        return RootRead(b"", b"")
    found = _durable.durable_kvstore(loc).read(ROOT_KEY).result()
    value = bytes(found.value) if found.state == "value" else None
    return RootRead(bytes(found.stamp.generation) if value is not None else b"", value)


def write_root(loc: Location, body: bytes, *, if_equal: bytes) -> tuple[bytes, RootRead | None]:
    """Write the root ``body`` if the root's generation is still ``if_equal`` (the empty
    generation of a missing root for a create). Returns the generation written and None;
    or, when the condition failed, an empty generation and the root found instead.

    A failed condition may be a retry's view of this very write, landed with its
    response lost: the root is then read back, and it is this write's when it holds
    ``body``, which names its save (and, for a renewal, the time of the renewal)."""
    generation = _durable.write_durable(loc, ROOT_KEY, body, if_equal=if_equal)
    if generation:
        return generation, None
    found = read_root(loc)
    if found.value == body:
        return found.generation, None
    return b"", found


def delete_below_root(loc: Location) -> None:
    """Remove every key below ``loc`` but its root ``zarr.json`` (and the directories left
    empty, on a local disk): what a directory holds beside the root of the save that
    claimed it, or of the removal that holds it."""
    kv = loc.kvstore()
    kv.delete_range(ts.KvStore.KeyRange("", ROOT_KEY)).result()
    kv.delete_range(ts.KvStore.KeyRange(ROOT_KEY + "\0", "")).result()
    if loc.local is not None and os.path.isdir(loc.local):
        for top, dirs, _ in os.walk(loc.local, topdown=False):
            for d in dirs:
                with contextlib.suppress(OSError):  # not empty: not tsckpt's to remove
                    os.rmdir(os.path.join(top, d))


def remove_partial(loc: Location, generation: bytes | None, body: bytes, err: BaseException) -> bool | None:
    """Remove a failed save's partial checkpoint, its pending root last: the root is first
    rewritten (``body``, the same pending root) conditionally on ``generation`` (the version
    this save last wrote or read), which fails if another save took the directory over; then
    every other key below ``loc`` goes, then the root (conditionally on that rewrite) and, on a
    local disk, the directory when nothing else is in it. A crash in the middle leaves the
    pending root of a save that is over, which overwrite=True and a manager's clean-up
    remove, never data without a root. Where the root cannot be rewritten (a full disk),
    it is removed first, conditionally, as before (a removal needs no space). True: removed;
    False: the root had changed (another save took over, and the checkpoint is left to it);
    None: the removal failed, as said in ``err``."""
    try:
        with _faults.storage_errors(loc, doing="writing"):
            try:
                held: bytes | None = write_root(loc, body, if_equal=generation or b"")[0]
            except (ValueError, OSError) as e:
                if _faults.storage_problem(loc, e, doing="writing") is None:
                    raise
                held = None  # no room to rewrite it: the root goes first
            if held is None:
                if not _durable.write_durable(loc, ROOT_KEY, None, if_equal=generation):
                    return False
                delete_below_root(loc)
            elif not held:
                return False
            else:
                delete_below_root(loc)
                if not _durable.write_durable(loc, ROOT_KEY, None, if_equal=held) and read_root(loc).value is not None:
                    return False  # (a failed condition finding no root: this removal's retry, its response lost)
        if loc.local is not None:
            with contextlib.suppress(OSError):  # the directory itself, when nothing else is in it
                os.rmdir(loc.local)
    except Exception as cleanup:  # noqa: BLE001 - reported in the save's own error
        _not_removed(loc, err, cleanup)
        return None
    return True


def _not_removed(loc: Location, err: BaseException, cause: BaseException) -> None:
    """Say in ``err`` that the partial checkpoint at ``loc`` could not be removed, and why."""
    amend(err, f"the partial checkpoint at {loc} could not be removed ({cause}); pass overwrite=True when saving again")


def abandon_lost(loc: Location, save_id: str, err: BaseException) -> None:
    """A surviving rank after rank 0 of save ``save_id`` was lost: remove that save's
    partial checkpoint (best effort), saying in ``err`` what became of it. The pending root
    goes only while it is still that save's (as just read, removed conditionally on that
    generation: rank 0 is gone, so nothing renews it; a root committed, replaced or removed
    meanwhile is left alone), then every key below ``loc``."""
    try:
        with _faults.storage_errors(loc, doing="reading"):
            found = read_root(loc)
    except Exception as failed:  # noqa: BLE001 - reported in the save's own error
        _not_removed(loc, err, failed)
        return
    if found.value is None or found.root.state != STATE_PENDING or save_id_of(found.root) != save_id:
        return  # rank 0 finished or cleaned up before it was lost, or another save took over
    if remove_partial(loc, found.generation, found.value, err):
        amend(err, "rank 0 was lost, and this rank removed the partial checkpoint, so saving again needs no overwrite=True")


class Lease:
    """Rank 0 of a save: its claim, counted as running in this process from creation
    until :meth:`end`, and renewed in the pending root once :meth:`start` is called."""

    def __init__(self, loc: Location, pending_root: Callable[[dict[str, Any]], bytes]) -> None:
        self.loc = loc
        self.claim = new_claim()
        self.generation: bytes | None = None  # of the pending root last written; None before the claim
        self.lost = False  # the pending root was replaced or removed by someone else
        self.committed = False  # the committed root landed: nothing is to be cleaned up any more
        self._root = pending_root
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        with _running_lock:
            _running.add(self.claim["id"])

    def root(self) -> bytes:
        return self._root(self.claim)

    def start(self, generation: bytes) -> None:
        """The pending root was written with ``generation``: renew it from now on."""
        self.generation = generation
        self._thread = threading.Thread(target=self._renew_loop, name="tsckpt-lease", daemon=True)
        self._thread.start()

    @property
    def save_id(self) -> str:
        """The token naming this save in every root it writes."""
        return str(self.claim["id"])

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            claim = {**self.claim, "renewed": time.time()}
            try:
                generation, found = write_root(self.loc, self._root(claim), if_equal=self.generation or b"")
            except Exception as e:  # noqa: BLE001 - a missed renewal is retried; the save reports its own faults
                log.debug("%s: renewing the save's lease failed: %s", self.loc, e)
                continue
            if found is not None and self.adopt(found):
                continue
            if not generation:
                self.lost = True
                log.warning("%s: the pending root of this save was replaced or removed by another process", self.loc)
                return
            self.claim, self.generation = claim, generation

    def adopt(self, found: RootRead) -> bool:
        """Whether ``found`` (the root read after a failed condition) is still this save's
        pending root, rewritten by a renewal whose outcome was not heard (it raised, its
        response lost): if so, it is the generation to condition on from now on."""
        root = found.root
        if root.state != STATE_PENDING or save_id_of(root) != self.save_id:
            return False
        self.generation = found.generation
        claim = claim_of(root)
        if isinstance(claim, Mapping):
            self.claim = dict(claim)
        return True

    def stop_renewals(self) -> None:
        """Stop renewing, waiting for a renewal in flight (before the commit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def end(self) -> None:
        """The save no longer runs: stop renewing, and stop counting it as running here."""
        self.stop_renewals()
        with _running_lock:
            _running.discard(self.claim["id"])
