"""The root ``zarr.json`` of a save: its claim, its commit, and the clean-up after a failure.

A save becomes visible in one atomic write of the root. Around it, in the
numbering of save()'s protocol (tsckpt/_save/protocol.py), all on rank 0:

4. Claim (:func:`begin`): refuse what is in the directory, or (``overwrite``)
   judge it clearable (never a save that may still be running:
   tsckpt/_save/lease.py); then write the root with state "pending" and the
   save's claim, conditioned on the root being still the one judged (missing,
   or the old root it replaces), so of several savers racing for one directory
   exactly one proceeds, and only then clear what else is there. The claim's
   lease is renewed from then on.
7. Commit: in the compact layout, :func:`merge_databases` first links the
   writing ranks' databases into the root one; :func:`commit` then rewrites the
   root with state "committed", conditioned on the pending root being still
   this save's.
8. Clean-up (:func:`abandon`, after a failure once every rank knows of it):
   the partial checkpoint is removed (the pending root first, if still this
   save's), so saving again needs no ``overwrite=True``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from typing import Any

import tensorstore as ts

from .._errors import CheckpointExistsError, SaveInProgressError, amend
from .._ondisk.arrays import MANIFEST
from .._ondisk.records import FORMAT_VERSION, LAYOUT_PLAIN, ROOT_KEY, STATE_COMMITTED, STATE_PENDING, group_metadata
from .._ondisk.root import root_file_problem, root_state
from .._storage import durable as _durable
from .._storage import faults as _faults
from .._storage import locations as _locations
from .._storage.locations import Location
from .._version import __version__
from . import lease as _lease


def root_json(state: str, extra: dict[str, Any] | None = None, *, layout: str = LAYOUT_PLAIN) -> bytes:
    """The root ``zarr.json`` of a save in ``state``, with ``extra`` tsckpt metadata."""
    meta: dict[str, Any] = {"format_version": FORMAT_VERSION, "state": state, "library": f"tsckpt {__version__}"}
    if layout != LAYOUT_PLAIN:
        meta["layout"] = layout
    meta.update(extra or {})
    return _durable.encode_json(group_metadata({"tsckpt": meta}))


def pending_root(layout: str) -> Callable[[dict[str, Any]], bytes]:
    """The pending root recording a claim, as a function of the claim (the lease rewrites it)."""
    return lambda claim: root_json(STATE_PENDING, {"claim": claim}, layout=layout)


def begin(loc: Location, overwrite: bool, layout: str = LAYOUT_PLAIN, lease: _lease.Lease | None = None) -> None:
    """Step 4, rank 0: refuse an existing checkpoint, or claim the directory (clearing it).

    The pending root is written conditioned on the root's generation as it was
    read and judged: while it is missing (a create, which succeeds only if no root
    exists), or, with ``overwrite``, the old root it replaces in the same write. So
    of several savers racing for one directory exactly one proceeds; the others
    raise CheckpointExistsError and touch nothing; and nothing is deleted before
    the directory is this save's. Only then is every other key removed: a crash
    from there on leaves this save's pending root (a crashed save, which
    ``overwrite=True`` and a manager's clean-up remove), never data without a
    root, nor a damaged checkpoint that looks complete. A failed condition is
    reported by TensorStore as an empty generation, not an error. On object stores
    the create is a PUT with ``If-None-Match: *``. The pending root records
    ``lease``'s claim, which is renewed from then on; without a lease (tests) the
    claim is one of no running save.
    """
    with _faults.storage_errors(loc, doing="writing"):
        _claim(loc, overwrite, layout, lease)


def _claim(loc: Location, overwrite: bool, layout: str, lease: _lease.Lease | None) -> None:
    problem = root_file_problem(loc)
    if problem is not None:  # never read: TensorStore would wait on a FIFO, or read gigabytes
        raise CheckpointExistsError(
            f"{loc}: its zarr.json {problem}: no checkpoint tsckpt wrote, and one it neither reads nor replaces "
            "(overwrite=True included); remove it, or save elsewhere"
        )
    kv = loc.kvstore()
    current = kv.read(ROOT_KEY).result()
    judged = bytes(current.stamp.generation)  # of the root judged (or of a missing one): the claim's condition
    clear = current.state == "value" or _durable.has_any_key(loc)
    if clear:
        _refuse_unless_free(loc, overwrite, current.value if current.state == "value" else None)
    body = lease.root() if lease is not None else pending_root(layout)(_lease.new_claim())
    try:
        claimed, _ = _lease.write_root(loc, body, if_equal=judged)
    except ValueError as e:
        if not _vanished(loc, e):
            raise
        claimed = b""
    if not claimed and current.state == "value":
        raise CheckpointExistsError(f"{loc}: another save claimed this directory first; nothing was changed")
    if not claimed:
        raise CheckpointExistsError(
            f"{loc}: another save into this directory started at the same time and claimed it first; "
            "nothing was written. Save each checkpoint from one job, or use distinct directories"
        )
    if lease is not None:
        lease.start(claimed)
    if clear:
        _lease.delete_below_root(loc)  # the directory is this save's now


def _vanished(loc: Location, err: ValueError) -> bool:
    """Whether a failed claim on a local disk means the directory was removed under it
    (ENOENT renaming TensorStore's lock file into place): another saver, or a manager
    clearing the step for its own save, got there first, so this save lost the race."""
    fault = _faults.storage_problem(loc, err, doing="writing")
    return loc.local is not None and fault is not None and fault.errno == errno.ENOENT


def _refuse_unless_free(loc: Location, overwrite: bool, value: bytes | None) -> None:
    """Raise unless the directory holding root ``value`` (None: none) may be cleared for a new save."""
    root = root_state(value)
    claim = _lease.claim_of(root)
    alive = _lease.save_running(root)
    if alive and overwrite:
        raise SaveInProgressError(
            f"{loc}: another save into this directory is still running ({_lease.describe(claim)}); "
            "overwrite=True never removes a running save. Wait for it to finish, or save elsewhere; if its "
            f"process is gone, save again once its lease has expired ({_lease.lease_seconds(claim)} s after "
            "its last renewal)"
        )
    if overwrite:
        return
    if alive:
        what = f"another save into this directory is still running ({_lease.describe(claim)})"
    elif root.state == STATE_PENDING:
        what = (
            "another save into this directory is running, or one crashed (its root zarr.json says "
            f"'pending'; written by {_lease.describe(claim)})"
        )
    else:
        what = "a checkpoint (or other data) already exists here"
    raise CheckpointExistsError(f"{loc}: {what}; pass overwrite=True to replace it, or save to a new directory")


def merge_databases(
    loc: Location, root: dict[str, Any], databases: Sequence[dict[str, Any]], context: ts.Context | None = None
) -> None:
    """Step 7, rank 0, compact layout: link the writing ranks' ``databases`` (kvstore
    specs) into the ``root`` one, then make the root database durable.

    OCDBT copies B-tree references, not data: the root database points into the
    ranks' data files, so readers open one database and outside TensorStore
    users see one zarr hierarchy.
    """
    context = context or _locations.CONTEXT  # a save's own (protocol.write_context)
    into = ts.KvStore.open(root, context=context).result()
    txn = ts.Transaction(atomic=True)
    for spec in databases:
        db = ts.KvStore.open(spec, context=context).result()
        db.experimental_copy_range_to(into.with_transaction(txn)).result()
    txn.commit_async().result()
    _durable.sync_paths(loc, [MANIFEST, "d"])


def commit(loc: Location, meta: dict[str, Any], layout: str, lease: _lease.Lease | None = None) -> None:
    """Step 7, rank 0: the one atomic write of the committed root (tsckpt metadata
    ``meta``) that makes the checkpoint visible, if the pending root is still this
    save's (``lease``: its renewals stop first). The root records the save's id, so
    that a commit whose response was lost is recognised as landed (_lease.write_root)."""
    if lease is not None:
        lease.stop_renewals()
    save_id = lease.save_id if lease is not None else _lease.new_claim()["id"]
    body = root_json(STATE_COMMITTED, {**meta, "save_id": save_id}, layout=layout)
    with _faults.storage_errors(loc):
        if lease is None:
            _durable.write_durable(loc, ROOT_KEY, body)
            return
        if lease.lost or not _commit_root(loc, body, lease):
            lease.lost = True
            raise CheckpointExistsError(
                f"{loc}: the pending root of this save was replaced or removed by another process while it ran "
                "(a save with overwrite=True, or a manager's clean-up, that judged this save dead); nothing was "
                "committed. Save again, to a directory no other job uses"
            )
        lease.committed = True


def _commit_root(loc: Location, body: bytes, lease: _lease.Lease) -> bool:
    """Write the committed root ``body`` over this save's pending root; whether it landed.
    A failed condition that finds this save's pending root rewritten by a renewal whose
    outcome went unheard is retried on that generation (renewals have stopped)."""
    for _ in range(3):
        generation, found = _lease.write_root(loc, body, if_equal=lease.generation or b"")
        if generation:
            lease.generation = generation
            return True
        if found is None or not lease.adopt(found):
            return False
    return False


def abandon(loc: Location, lease: _lease.Lease, err: BaseException, agreed: bool) -> None:
    """Step 8, rank 0 after a failed save that claimed ``loc``: remove the partial
    checkpoint (best effort; only when every rank knows of the failure, ``agreed``)
    and say in ``err`` whether saving again needs overwrite=True. A save that failed
    after its commit landed (a peer lost in the commit's last agreement) is complete
    and left alone."""
    lease.end()
    if lease.committed:
        amend(err, f"the checkpoint at {loc} was committed before the failure and is complete")
        return
    if not agreed:
        amend(err, (
            f"the partial checkpoint at {loc} was left in place, as other ranks may still be writing to it; "
            "once the job has stopped, save again with overwrite=True"
        ))
        return
    if lease.lost:
        amend(err, f"{loc} was taken over by another save meanwhile and was left to it")
        return
    removed = _lease.remove_partial(loc, lease.generation, lease.root(), err)
    if removed is False:
        amend(err, f"{loc} was taken over by another save meanwhile and was left to it")
    elif removed:
        amend(err, "the partial checkpoint was removed, so saving again needs no overwrite=True")
