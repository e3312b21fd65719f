"""CheckpointManager: one checkpoint directory per training step, with retention.

A step is *complete* when its root ``zarr.json`` says "committed" (the last,
atomic write of a save); a step whose root is tsckpt's "pending" one is
incomplete: a save in flight, one that crashed, or a deletion that was cut
short. Incomplete steps are never listed, restored or counted for retention.

The manager deletes only what tsckpt provably wrote: a step whose pending root
records the claim of a save that is over, a complete step retention expires,
and its own trash; and, on a local disk, a step directory holding nothing, or
only a save's first write of its root cut short (TensorStore's lock file of
it), where there is nothing to lose. Anything else under the root (a numbered directory with no
tsckpt root, such as another library's checkpoint step, or a root it cannot
read) is left alone: clean-up reports it once with a warning on the "tsckpt"
logger naming it, retention never counts it, and saving that step is refused.

Several managers (or jobs) may save under one root, each its own steps. A
pending step whose save may still be running (its claim's lease is fresh and,
on this machine, its process is alive; see tsckpt/_save/lease.py) is never deleted by
clean-up or retention, and saving a step that another save is writing is
refused, so one manager never destroys another's save in progress. Retention
applies to all complete steps under the root, whichever manager wrote them.

Deleting a step first makes it incomplete, in one conditional step as a commit
is: its root ``zarr.json`` is replaced, conditionally on the generation it was
judged at, by a pending root recording the deletion's claim (counted as a
running save while the deletion runs); then on a local disk the directory is
renamed away in one atomic step, elsewhere its keys are deleted, the root last.
So a step another job committed or claimed after it was judged is never
deleted, and a crash in the middle of a deletion never leaves a damaged step
that looks complete, nor one clean-up cannot identify as tsckpt's. A save
judges its step again right before its claim (:meth:`CheckpointManager._clear`).
With several ranks, only rank 0 deletes. Clean-up runs on save paths only (a
manager's first save, and after each commit): a manager that only lists and
restores writes nothing, so it works on a read-only mount.

On object stores the steps are listed through an index of marker objects
(tsckpt/_ondisk/stepindex.py), which a step saved under the root without the manager
(``tsckpt.save`` on ``directory(step)``) joins too; a marker is only a hint and
never makes a step look complete. Local disks are listed directly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterable
from typing import Any

import tensorstore as ts

from ._base.mapping import Rules
from ._coord import torchdist as _dist
from ._coord.protocol import refuse
from ._errors import CheckpointExistsError, CheckpointNotFoundError, SaveInProgressError
from ._leaves.stateful import is_stateful, is_whole_state
from ._ondisk import stepindex as _steps
from ._ondisk.records import LAYOUT_PLAIN, ROOT_KEY, STATE_COMMITTED
from ._ondisk.root import RootState, read_roots
from ._options import (
    READ_WINDOW_BYTES,
    WRITE_WINDOW_BYTES,
    AsyncOptions,
    Copy,
    IfBusy,
    Incremental,
    RestoreOptions,
    SaveOptions,
    Staging,
    Writer,
    verb,
)
from ._save import lease as _lease
from ._save.background import AsyncSave, AsyncSaver, prepare_group, runs_in_writer
from ._storage import durable as _durable
from ._storage.durable import fsync_path
from ._storage.faults import storage_errors
from ._storage.locations import Directory, resolve

log = logging.getLogger("tsckpt")

_TRASH = ".tsckpt-deleting-"
# What TensorStore's file kvstore leaves of a write of a step's root cut short (its lock file,
# written first): a directory holding only this holds nothing of a checkpoint.
_ROOT_LOCK = f"{ROOT_KEY}.__lock"


class CheckpointManager:
    """Checkpoints of a training run under ``root``, one directory per step.

    ``keep_last=N`` keeps the N most recent complete steps, ``keep_every=K``
    additionally keeps every step divisible by K; the latest complete step is
    never deleted. With neither, nothing is deleted. ``root`` is anything
    :func:`tsckpt.save` accepts (a local path, ``memory://...``, ``s3://...``, a
    kvstore spec). Several managers may share a root: a step another save is
    still writing is neither deleted nor saved over (SaveInProgressError), and
    retention counts every complete step under the root.

    The options that hold for every step are given here: ``group``,
    ``timeout``, ``check_replicas`` and ``layout`` as for :func:`tsckpt.save`
    (``group`` and ``timeout`` also for restores), ``if_busy``,
    ``max_staging_bytes``, ``staging`` and ``writer`` as for :func:`tsckpt.save_async`; a bad value raises
    here. ``incremental`` (default True; plain layout on a local file system or S3): each step shares
    with the latest complete step, by hard links (on S3: server-side copies), every file whose content is unchanged, so a
    frozen base model is written once (docs/incremental.md); retention deleting a step never
    breaks a later one. Options of one call (``overwrite``, ``max_inflight_bytes``,
    ``progress``, and the restore options) are keywords of :meth:`save`,
    :meth:`save_async` and :meth:`restore`.
    """

    @verb("CheckpointManager")
    def __init__(
        self,
        root: Directory,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        group: Any = None,
        timeout: datetime.timedelta | None = None,
        check_replicas: bool = True,
        if_busy: IfBusy = "wait",
        max_staging_bytes: int | None = None,
        staging: Staging = "overlapped",
        step_digits: int = 8,
        layout: str = LAYOUT_PLAIN,
        inner_chunks: bool = True,
        writer: Writer = "process",
        incremental: Incremental = True,
    ) -> None:
        self._saving = SaveOptions.of(locals())  # each save adds its own per-call options
        self._reading = RestoreOptions.of(locals())  # each restore adds its own
        background = AsyncOptions.of(locals())
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (the latest complete step is always kept), not {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be a positive step interval, not {keep_every}")
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._loc = resolve(root)
        self._if_busy = background.if_busy
        self._staging = background.staging
        self._digits = step_digits
        self._saver = AsyncSaver(max_staging_bytes=background.max_staging_bytes)
        self._writer = background.writer
        self._rank = _dist.rank_of(group)
        self._reported: set[str] = set()  # steps clean-up found it cannot identify, warned about once
        # Nothing is written until the first save (which cleans up first): a manager that only
        # reads (an evaluation job on a read-only mount) needs no write access.
        self._tidied = False
        self._removals: list[str] = []  # steps retention renamed away, their files still to remove (_tidy)
        self._removing: set[str] = set()  # those _tidy removes now (beside the next save)
        self._removals_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self._loc)!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- naming and listing --------------------------------------------------

    def _name(self, step: int) -> str:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        return f"{step:0{self._digits}d}"

    def directory(self, step: int) -> Directory:
        """Where step ``step`` is (or would be) stored; accepted by tsckpt.open and restore."""
        name = self._name(step)
        if self._loc.local is not None:
            return os.path.join(self._loc.local, name)
        return self._loc.sub(name)

    def _names(self) -> list[str]:
        """Top-level entries under the root (step directories and leftovers)."""
        if self._loc.local is not None:
            if not os.path.isdir(self._loc.local):
                return []
            return [e.name for e in os.scandir(self._loc.local) if e.is_dir()]
        markers = ts.KvStore.KeyRange(_steps.INDEX, _steps.INDEX[:-1] + "0")  # '0' follows '/'
        with storage_errors(self._loc):
            keys = self._loc.kvstore().list(markers, strip_prefix_length=len(_steps.INDEX)).result()
        return sorted(k.decode("utf-8", "replace") for k in keys)

    def _roots(self, names: Iterable[str]) -> dict[str, _Step]:
        """Root of each step directory (its state is "committed", "pending", None (no root) or
        "invalid"), with the generation it was read at."""
        with storage_errors(self._loc):
            roots = read_roots(self._loc, [f"{n}/{ROOT_KEY}" for n in names])
        return {key[: -len(ROOT_KEY) - 1]: _Step(key[: -len(ROOT_KEY) - 1], *found) for key, found in roots.items()}

    def _step_states(self) -> dict[int, _Step]:
        names = [n for n in self._names() if _steps.STEP.fullmatch(n)]
        return {int(n): found for n, found in self._roots(names).items()}

    def all_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, ascending."""
        return sorted(step for step, found in self._step_states().items() if found.root.state == STATE_COMMITTED)

    def latest_step(self) -> int | None:
        """The most recent complete step, or None if there is none yet."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- saving --------------------------------------------------------------

    def _check_free(self, step: int, overwrite: bool, *, judge_running: bool = True) -> None:
        """Raise early, in the caller, if ``step`` may not be saved: it is complete and may not be
        replaced, it holds data tsckpt did not write, or (``judge_running``) a running save is
        writing it. The save judges it again when it claims the step (:meth:`_clear`)."""
        name = self._name(step)
        self._judge(step, self._roots([name])[name], overwrite, judge_running=judge_running)

    def _judge(self, step: int, found: _Step, overwrite: bool, *, judge_running: bool = True) -> bool:
        """Raise if step ``step``, whose root is ``found``, may not be saved; True if its
        directory must be cleared first (a crashed save's, an empty one, or with
        ``overwrite`` a complete one)."""
        name, root = found.name, found.root
        if root.state == STATE_COMMITTED and not overwrite:
            raise CheckpointExistsError(
                f"{self._loc}: step {step} already has a complete checkpoint; pass overwrite=True to replace it"
            )
        if judge_running and _lease.save_running(root):
            raise SaveInProgressError(
                f"{self._loc}: step {step} is being saved by another save that is still running "
                f"({_lease.describe(_lease.claim_of(root))}); wait for it, or save another step. If its process is gone, the step "
                "is removed once its lease has expired"
            )
        if _lease.save_running(root):
            return False  # left to its save (under torch.distributed, judged by rank 0 when the save claims it)
        if root.state == STATE_COMMITTED or _abandoned(root):
            return True
        if not self._holds_data(name):
            return self._loc.local is not None and os.path.lexists(os.path.join(self._loc.local, name))
        raise CheckpointExistsError(
            f"{self._loc}: step {step}: {name} holds data tsckpt did not write ({_unidentified(root)}); the "
            "manager never deletes what it cannot identify: move it away, or save another step"
        )

    def _holds_data(self, name: str) -> bool:
        """Whether anything is stored under step directory ``name`` but an interrupted first write
        of a save's root (on a local disk, TensorStore's lock file of it): nothing to lose."""
        if self._loc.local is not None:
            path = os.path.join(self._loc.local, name)
            if not os.path.isdir(path) or os.path.islink(path):
                return os.path.lexists(path)
            return bool(set(os.listdir(path)) - {_ROOT_LOCK})
        return _durable.has_any_key(resolve(self._loc.sub(name)))

    def _job(self, step: int, options: SaveOptions) -> _StepSave:
        return _StepSave(step, options, self._kept(), self)

    def _kept(self) -> tuple[Any, ...]:
        """What a manager of another process needs to save and clean up as this one does."""
        return (self._loc, self.keep_last, self.keep_every, self._digits)

    def _save_step(self, step: int, tree: Any, options: SaveOptions) -> None:
        """Save ``step`` (the job of save and save_async): rank 0 clears the step where it must
        right before the claim (:meth:`_clear`), and applies retention after the commit."""
        from ._save.protocol import save_with

        # the manager clears the step where it must (_clear): the save itself never replaces one
        plain = dataclasses.replace(options, overwrite=False)

        def clear() -> None:  # rank 0, inside the save, right before its claim
            self._clear(step, options.overwrite)

        # an incremental save shares what is unchanged with the latest complete step (each rank lists it)
        if options.incremental:
            latest = self._latest_other(step)
            plain = dataclasses.replace(plain, base=None if latest is None else self.directory(latest))
        # rank 0 clears (and the save then lists the step in the root's index first)
        save_with(self.directory(step), tree, plain, before_claim=clear if self._rank == 0 else None)
        if self._rank == 0:
            self._after_commit(later=True)  # the expired steps' files: removed by _tidy(), once the save's result is out

    def _latest_other(self, step: int) -> int | None:
        """The most recent complete step other than ``step`` (an incremental save's base), its
        roots read newest first until one is committed."""
        names = sorted((n for n in self._names() if _steps.STEP.fullmatch(n) and int(n) != step), key=int)
        for name in reversed(names):
            if self._roots([name])[name].root.state == STATE_COMMITTED:
                return int(name)
        return None

    def _clear(self, step: int, overwrite: bool) -> None:
        """Rank 0, right before the save of ``step`` claims it: clean up once (the manager's first
        save; with the retention a run killed between a commit and its retention left owed, so
        kills in a row never pile up expired steps), then judge the step again, now, and clear it if it must be. The judgement and the
        deletion are one conditional step (:meth:`_delete`): a step another job committed or
        claimed since it was read is never deleted, whatever was judged when the save was
        submitted; the judgement is then made again on what is there now."""
        if not self._tidied:
            if self._loc.local is None:
                _steps.adopt(self._loc)
            self._after_commit()  # what a crash left: its clean-up, and the retention it left owed
            self._tidied = True
        name = self._name(step)
        for _ in range(3):
            found = self._roots([name])[name]
            if not self._judge(step, found, overwrite) or self._delete(found):
                return
        raise CheckpointExistsError(
            f"{self._loc}: step {step} kept changing while this save tried to clear it (other jobs are saving or "
            "cleaning it); nothing was deleted. Save each step from one job"
        )

    @verb("CheckpointManager.save")
    def save(
        self,
        step: int,
        tree: Any,
        *,
        overwrite: bool = False,
        max_inflight_bytes: int = WRITE_WINDOW_BYTES,
        progress: bool | None = None,
    ) -> None:
        """Save ``tree`` as step ``step`` and apply retention; returns once committed.

        An incomplete directory for ``step`` (a crashed save) is replaced; a
        complete one only with ``overwrite=True``; one another save is still
        writing never (SaveInProgressError). An asynchronous save still in
        flight is waited for first (or, with ``if_busy="error"``, refused).
        ``max_inflight_bytes`` and ``progress`` are as for :func:`tsckpt.save`;
        the other save options are the manager's."""
        options, refused = SaveOptions.checked(locals(), self._saving)  # raised in the save's step 1, on every rank
        if refused is not None and self._solo():
            raise refused  # at once, before waiting for a save in flight

        def run() -> None:
            if refused is not None:  # raised in the save's step 1, on every rank
                coord = _dist.coordinator_for(options.group, options.timeout)
                refuse(coord, "save (describe)", refused, through_root=True)
            if self._solo():  # else rank 0 judges, inside the save (_clear), for every rank: ranks judging
                self._check_free(step, overwrite)  # alone can disagree (the step or overwrite seen differently)
            job = self._job(step, options)
            job(tree)
            job.tidy()

        self._saver.run(run, if_busy=self._if_busy, job=self._job(step, options))

    @verb("CheckpointManager.save_async")
    def save_async(
        self,
        step: int,
        tree: Any,
        *,
        overwrite: bool = False,
        max_inflight_bytes: int = WRITE_WINDOW_BYTES,
        progress: bool | None = None,
    ) -> AsyncSave:
        """Like :meth:`save` (with the same options), but returns once ``tree`` is staged
        (copied to host memory; with the manager's ``staging="overlapped"``, the optimizers'
        large tensors while training goes on, as for :func:`tsckpt.save_async`); writing, the
        commit and retention continue in the background. The handle's ``result()`` returns at
        the commit, the expired steps renamed away; their files are removed after, beside the
        next save (:meth:`wait` and :meth:`close` wait for that too)."""
        options, refused = SaveOptions.checked(locals(), self._saving)  # raised in the call, on every rank
        if refused is not None and self._solo():
            raise refused  # at once, before waiting for a save in flight

        def prepare() -> None:  # an early refusal; the step is judged again when the save claims it
            prepare_group(options.group, options.timeout)
            if refused is not None:
                raise refused
            self._check_free(step, overwrite, judge_running=self._solo())

        label = str(resolve(self.directory(step)))
        handle = self._saver.submit(
            label, tree, self._job(step, options), if_busy=self._if_busy, staging=self._staging, prepare=prepare,
            rank=self._rank,
            writer=self._writer,
        )
        handle.add_done_callback(functools.partial(_log_save, step))
        return handle

    def _solo(self) -> bool:
        """Whether this rank may refuse on its own: ranks can judge a save's liveness
        differently (each sees its own machine's processes), so under torch.distributed
        only save() refuses, on rank 0's judgement, for every rank."""
        return not _dist.is_distributed()

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any; re-raise its failure."""
        self._saver.wait()

    def wait_for_staging(self) -> None:
        """Wait until the asynchronous save in flight, if any, no longer reads the live tensors
        (``staging="overlapped"``: before writing into the optimizers' parameters or state other
        than by their steps); see :meth:`tsckpt.AsyncSave.wait_for_staging`."""
        self._saver.wait_for_staging()

    def close(self) -> None:
        """Wait for the save in flight (re-raising its failure) and stop the background worker."""
        self._saver.close()

    @property
    def staging_bytes(self) -> int:
        """Host memory held by this manager's staging buffers."""
        return self._saver.staging_bytes

    # ---- restoring -----------------------------------------------------------

    @verb("CheckpointManager.restore")
    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        strict: bool = True,
        inplace: bool = False,
        as_saved: bool = False,
        progress: bool | None = None,
        max_inflight_bytes: int = READ_WINDOW_BYTES,
        casting: str = "same_kind",
        mapping: Rules | None = None,
        copy: Copy = True,
    ) -> Any:
        """Restore step ``step`` (default: the latest complete one) with the options of
        :func:`tsckpt.restore` (``strict``, ``inplace``, ``as_saved``, ``progress``,
        ``max_inflight_bytes``, ``casting``, ``mapping``, ``copy``); ``group`` and ``timeout`` are the manager's.

        Returns what :func:`tsckpt.restore` returns; but when ``target`` is an object
        restored in place (a ``tsckpt.torch.TrainState``, or any object with
        ``state_dict()``/``load_state_dict()``), it returns the step restored, where
        the training loop resumes: ``step = manager.restore(target=state)``."""
        options, refused = RestoreOptions.checked(locals(), self._reading)
        from ._read.restore import restore

        if refused is not None:  # raised in the restore's exchange, on every rank
            refuse(_dist.coordinator_for(options.group, options.timeout), "restore", refused)

        if _dist.is_distributed():
            # the background save and restore talk over the same gloo group
            self._saver.wait()
        else:
            self._saver.wait_for_staging()  # a restore in place must not write into what the save still copies
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"{self._loc}: no complete checkpoint to restore yet")
        restored = restore(self.directory(step), target, **options.kwargs())
        return step if is_stateful(target) or is_whole_state(target) else restored

    # ---- retention and cleanup -------------------------------------------------

    def _after_commit(self, *, later: bool = False) -> None:
        """Retention and clean-up. ``later``: an expired step on a local disk is only renamed
        away (no longer a step from then on); its files are removed by :meth:`_tidy`."""
        steps = self._step_states()
        complete = sorted(s for s, found in steps.items() if found.root.state == STATE_COMMITTED)
        for s in self._expired(complete):
            self._delete(steps[s], later=later)  # not when the step was replaced since it was listed
        self._clean(steps)

    def _tidy(self) -> None:
        """Remove the files of the steps the last saves' retention renamed away: after the save's
        result is out (a save is over at its commit; this is housekeeping, which a crash leaves
        to the next save's clean-up). Run by the save's own worker, beside its next save."""
        with self._removals_lock:
            removals, self._removals = self._removals, []
            self._removing.update(removals)
        for trash in removals:
            shutil.rmtree(trash, ignore_errors=True)
            with self._removals_lock:
                self._removing.discard(trash)

    def _expired(self, complete: list[int]) -> list[int]:
        if not complete or (self.keep_last is None and self.keep_every is None):
            return []
        keep = {complete[-1]}
        if self.keep_last is not None:
            keep.update(complete[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in complete if s % self.keep_every == 0)
        return [s for s in complete if s not in keep]

    def _clean(self, steps: dict[int, _Step] | None = None) -> None:
        """Remove what tsckpt provably left behind (on save paths only: never when a manager is
        made or reads): steps whose pending root records a save that is over (never one still
        running), empty step directories, and leftovers of interrupted deletions. Each removal
        is conditional on the root read (:meth:`_delete`). A step directory it cannot identify
        as tsckpt's is reported once and left alone."""
        if steps is None:
            steps = self._step_states()
        for _, found in sorted(steps.items()):
            name, root = found.name, found.root
            if _abandoned(root) or (root.state is None and self._loc.local is not None and not self._holds_data(name)):
                self._delete(found)
            elif root.state != STATE_COMMITTED and not _lease.save_running(root) and name not in self._reported:
                self._report(name, root)
        if self._loc.local is not None:
            with self._removals_lock:
                due = set(self._removals) | self._removing  # this manager's own, left to _tidy()
            for name in self._names():
                trash = os.path.join(self._loc.local, name)
                if name.startswith(_TRASH) and trash not in due:
                    shutil.rmtree(trash, ignore_errors=True)

    def _report(self, name: str, root: RootState) -> None:
        """Warn, once per manager, of a step directory that tsckpt did not provably write."""
        if root.state is None and not self._holds_data(name):
            return  # an object store's marker of a step never saved: nothing to lose, left for its save
        root = self._roots([name])[name].root  # as it is now: another job's save may have claimed it since
        if root.state == STATE_COMMITTED or _lease.save_running(root) or _abandoned(root):
            return
        self._reported.add(name)
        log.warning(
            "%s: step directory %s is not a checkpoint tsckpt wrote (%s); the manager leaves it alone: it is not "
            "listed, restored, counted for retention or deleted", self._loc, name, _unidentified(root),
        )

    def _delete(self, found: _Step, *, later: bool = False) -> bool:
        """Delete one step directory, if its root is still the one ``found`` (as judged): False
        when it changed meanwhile (another job saved, claimed or deleted the step), and nothing
        was deleted.

        The check and the deletion are one conditional step, as a save's commit is: the root
        is first replaced, conditionally on the generation it was judged at (created, where
        there was none), by a pending root recording this deletion's claim, which counts as a
        running save while the deletion runs (so no other job judges the step free, nor its
        save claims it), and which no crash leaves looking complete. Then, on a local disk, the
        directory is renamed away in one atomic step and removed (``later``: by :meth:`_tidy`);
        elsewhere its keys are deleted, the root last."""
        from ._save.commit import pending_root

        name = found.name
        loc = resolve(self._loc.sub(name)) if self._loc.local is None else resolve(os.path.join(self._loc.local, name))
        deletion = _lease.Lease(loc, pending_root(LAYOUT_PLAIN))  # running in this process until end()
        try:
            with storage_errors(loc, doing="writing"):
                taken, _ = _lease.write_root(loc, deletion.root(), if_equal=found.generation)
                if not taken:
                    return False
                if self._loc.local is not None:
                    trash = os.path.join(self._loc.local, f"{_TRASH}{name}-{uuid.uuid4().hex[:8]}")
                    os.rename(os.path.join(self._loc.local, name), trash)
                    fsync_path(self._loc.local)
                    if later:
                        with self._removals_lock:
                            self._removals.append(trash)
                    else:
                        shutil.rmtree(trash, ignore_errors=True)
                    return True
                kv = self._loc.kvstore()
                root = f"{name}/{ROOT_KEY}"
                kv.delete_range(ts.KvStore.KeyRange(f"{name}/", root)).result()
                kv.delete_range(ts.KvStore.KeyRange(root + "\0", f"{name}0")).result()  # '0' follows '/'
                _durable.write_durable(loc, ROOT_KEY, None, if_equal=taken)
                kv.write(f"{_steps.INDEX}{name}", None).result()  # unlisted last
                return True
        finally:
            deletion.end()


def _log_save(step: int, handle: AsyncSave) -> None:
    """Log what an asynchronous save of ``step`` cost: the bytes staged, how long the caller was
    held, and the writer process's peak memory."""
    if handle.cancelled() or concurrent.futures.Future.exception(handle) is not None:
        return  # a failure is the caller's to see through result(): not marked as seen here
    peak = "" if handle.writer_peak_bytes is None else f", writer peak RSS {handle.writer_peak_bytes / (1 << 20):.1f} MiB"
    log.info(
        "step %d committed: %.1f MiB staged, caller held %.3f s%s", step, handle.staged_bytes / (1 << 20),
        handle.blocked_s, peak,
    )


@dataclasses.dataclass(frozen=True)
class _StepSave:
    """The save of one step: the job that save and save_async run. Picklable, so that a
    writer process can run it: there it acts through a manager of its own on the same root
    (made once per writer process, so its first save cleans up once, as this one's does)."""

    step: int
    options: SaveOptions
    kept: tuple[Any, ...]  # CheckpointManager._kept()
    manager: CheckpointManager | None = dataclasses.field(default=None, compare=False)  # the caller's

    def __call__(self, tree: Any) -> None:
        manager = self.manager if self.manager is not None else _writer_manager(self.kept, self.options)
        manager._save_step(self.step, tree, self.options)

    def tidy(self) -> None:
        """After the save's result is out: remove what its retention renamed away (:meth:`CheckpointManager._tidy`)."""
        manager = self.manager if self.manager is not None else _writer_manager(self.kept, self.options)
        manager._tidy()

    def in_writer(self) -> _StepSave | None:
        """The job a writer process runs (its group: the writers' own), None where it cannot run
        there (a memory:// root)."""
        if not runs_in_writer(self.kept[0].spec):
            return None
        return _StepSave(self.step, dataclasses.replace(self.options, group=None), self.kept)


_writer_managers: dict[tuple[Any, ...], CheckpointManager] = {}


def _writer_manager(kept: tuple[Any, ...], options: SaveOptions) -> CheckpointManager:
    """In a writer process: the manager that saves the steps of the caller's one."""
    loc, keep_last, keep_every, digits = kept
    key = (str(loc), keep_last, keep_every, digits, options.timeout, options.check_replicas, options.layout)
    if key not in _writer_managers:
        _writer_managers[key] = CheckpointManager(
            loc.spec if loc.local is None else loc.local, keep_last=keep_last, keep_every=keep_every,
            timeout=options.timeout, check_replicas=options.check_replicas, step_digits=digits, layout=options.layout,
            writer="thread",
        )
    return _writer_managers[key]


@dataclasses.dataclass(frozen=True)
class _Step:
    """A step directory's root as read: what it says, and its generation then (TensorStore's
    generation of a missing key when there is none), the condition of deleting it."""

    name: str
    root: RootState
    generation: bytes


def _abandoned(root: RootState) -> bool:
    """A step tsckpt provably wrote whose save is over without committing: its root is
    tsckpt's pending one, recording the claim of a save that no longer runs."""
    return isinstance(_lease.claim_of(root), dict) and not _lease.save_running(root)


def _unidentified(root: RootState) -> str:
    """Why a step directory is not identified as tsckpt's, from its root."""
    if root.state is None:
        return "no tsckpt root zarr.json: another library's checkpoint, or other data"
    if root.problem == "json":
        return f"its root zarr.json is not valid JSON ({root.detail})"
    if root.problem == "file":
        return f"{root.detail}, and was not read"
    if root.problem == "foreign":
        return "its root zarr.json has no tsckpt metadata"
    return f"its root is in state {root.state!r} without the claim of a tsckpt save"


# ---- listing a root's steps, as `tsckpt ls` does --------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepListing:
    """A step directory under a manager's root, as :func:`list_steps` finds it."""

    name: str  # the directory's name ("00000100")
    step: int
    # "complete"; "saving" (a save under way); "partial" (a save over without committing) or
    # "empty", which a manager's clean-up removes; "other" (not tsckpt's), which it leaves alone
    state: str
    note: str  # why it is in that state (empty for a complete step)
    directory: Directory  # where it is: what the read verbs take


def list_steps(root: Directory) -> list[StepListing] | None:
    """The step directories under ``root`` with their states, if ``root`` is a manager's root
    (it holds no checkpoint of its own, and a step directory holding a tsckpt root); else
    None. Reads only: unlike a manager's construction, it cleans nothing up."""
    loc = resolve(root)
    with storage_errors(loc):
        if loc.local is not None:
            if not os.path.isdir(loc.local) or os.path.lexists(os.path.join(loc.local, ROOT_KEY)):
                return None  # not a directory, or a checkpoint (or what is left of one)
        elif loc.kvstore().read(ROOT_KEY).result().state == "value":
            return None
        names = _steps.step_names(loc)
        if not names:
            return None
        roots = read_roots(loc, [f"{n}/{ROOT_KEY}" for n in names])
    states = {n: roots[f"{n}/{ROOT_KEY}"][0] for n in sorted(names, key=lambda n: (int(n), n))}
    if all(r.state is None for r in states.values()):
        return None  # no step of tsckpt's (none at all, or another library's: Orbax)
    out = []
    for name, state in states.items():
        where = os.path.join(loc.local, name) if loc.local is not None else loc.sub(name)
        if state.state == STATE_COMMITTED:
            kind, note = "complete", ""
        elif _lease.save_running(state):
            kind, note = "saving", f"a save is under way ({_lease.describe(_lease.claim_of(state))})"
        elif _abandoned(state):
            claim = _lease.claim_of(state)
            who = f"pid {claim.get('pid')} on host {claim.get('host')!r}, started {claim.get('started')}"
            kind, note = "partial", f"a save that ended without committing ({who}); a CheckpointManager on this root removes it"
        elif state.state is None and not _holds_anything(where):
            kind, note = "empty", "holds no checkpoint; a CheckpointManager on this root removes it"
        else:
            kind = "other"
            note = f"not a checkpoint tsckpt wrote ({_unidentified(state)}); a CheckpointManager leaves it alone"
        out.append(StepListing(name, int(name), kind, note, where))
    return out



def _holds_anything(where: Directory) -> bool:
    """Whether a step directory holds anything but TensorStore's lock file of a root write cut
    short (as ``CheckpointManager._holds_data`` judges it, for clean-up)."""
    if isinstance(where, str):
        if not os.path.isdir(where) or os.path.islink(where):
            return os.path.lexists(where)
        return bool(set(os.listdir(where)) - {_ROOT_LOCK})
    return _durable.has_any_key(resolve(where))


__all__ = ["CheckpointManager"]
