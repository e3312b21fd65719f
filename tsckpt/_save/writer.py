"""save_async's writer process: the save runs outside the training process's interpreter.

A save in a thread of the training process holds the interpreter for its per-leaf work
(describing, planning, encoding, checksums) while the training thread waits for it. Here
the training process only stages (tsckpt/_save/background.py) into buffers that are shared
memory (:class:`SharedStaging`: one block, tsckpt/_runtime/sharedmem.py), and hands a small
message to a writer process of its own: the leaf paths, the tree's structure, the plain
values and, for each array, its place in the block. The writer rebuilds the leaves as
views of the block (no array data is pickled or copied) and runs the ordinary save on them,
with the commit protocol, the lease and the retention of a synchronous save.

The writer of one rank never imports torch (its libraries are most of a writer's resident
memory): the message names tensors' dtypes (no torch object is pickled in it), and a
tensor's buffer becomes a numpy view in the numpy or ml_dtypes dtype of the same name,
saved as the tensor is (:class:`TorchRegion`: the same records, bytes and hashes). Only
tensors of dtypes numpy lacks (complex32, packed and bit dtypes) are torch views, importing
torch then; the writers of several ranks import it anyway (torch.distributed) and keep
torch views. Plain values of subclasses of builtin types (enums) travel as the builtin
values they are saved as, so the writer needs no module of the training script's. A
message the writer cannot read (a job's class it cannot import) fails its save with why,
and the writer leaves (the next save starts a new one).

One writer per training process, started at the first save that goes to it and reused
after (the same process id), made again after it died. It is a fresh interpreter
(``python -c``, never a fork of the training process, whose threads a fork would not
carry; nor multiprocessing's spawn, which imports the caller's main module again, so a
training script without a ``__main__`` guard would run twice), run at a lower scheduling
priority. It ends with :meth:`AsyncSaver.close` (the manager's close), at interpreter
exit once the save in flight committed, and when the training process is gone: it
watches its end of the socket and its parent, and leaves at once, mid-save if need be,
so no writer outlives its trainer; a save cut short never committed, so no step looks
complete (its pending root names the writer, whose death makes it a leftover that a
manager removes).

Under torch.distributed the writers of the ranks coordinate among themselves, never
through the training loop's process groups: rank 0's training process serves a TCPStore
on a port the system picks, and the writers form a gloo group of their own through it,
under a prefix new at every start. The save protocol then runs on that group as on any:
every rank raises when one fails, lost peers are named. The training processes agree at
each save, in one small gather over their background group (the one a save in a thread
uses; save_async is collective anyway), whether it goes to the writers and whether new
writers start: when one rank must save in a thread, all do; when one rank's writer died or
failed a save, every rank starts a new one (a group that lost a member is unusable), so the
ranks' writers always run the same saves in one group. The store's address travels with
that gather when writers start.

CUDA tensors go to the writer too: their host buffers are views of the shared block, which
:class:`SharedStaging` page-locks once when it makes it (registered with CUDA through
:class:`DeviceOps`, unregistered before the block is given up). background.py's staging
issues their copies on one reused side stream per device, after the work queued on the
training stream, and waits for them once (an event) within the call, before the message
leaves: CUDA copies are never deferred past the call (guard.py says why). Where the block
cannot be page-locked, a warning says why, those tensors are staged in background.py's
private page-locked slab, and saves that hold them run in the thread.

What a writer process cannot take is saved by the thread instead: jax arrays (their staging
is jax's own host copies, not the shared block), CUDA tensors where the block could not be
page-locked, lazy sources (they read another file through the caller's open readers), a ``memory://``
location (it lives in the caller's memory), a jax.distributed job without torch.distributed
(the writers coordinate over torch.distributed), and platforms without anonymous shared
memory files (Linux has them).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._base import dtypes as _dtypes
from .._base.lazytorch import is_tensor, loaded
from .._base.types import LazySource, ShardedArray, TorchRegion
from .._coord.protocol import RESTART
from .._coord.torchdist import DEFAULT_TIMEOUT, coordinator_for, is_distributed, job_store, torch_initialized
from .._errors import DistributedError, WriterLostError
from .._leaves.jaxarray import JaxRegion
from .._ondisk.records import ROOT_KEY, STATE_COMMITTED
from .._ondisk.root import read_roots
from .._runtime import devicecopy as _devicecopy
from .._runtime import sharedmem
from .._runtime.threads import run_soon
from .._storage.locations import resolve
from ..tree import Flat, structure_to_json
from .background import BACKGROUND_NICE, TIDY_BEHIND, AsyncSave, tidy
from .lease import claims_named, save_id_of
from .protocol import Staged

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

log = logging.getLogger("tsckpt")

# How often an idle writer checks that its parent is alive (beside the socket's end of file).
PARENT_POLL_S = 1.0
# The exit status of a writer that left because its training process was gone.
ORPHANED = 3
# How long close() waits for a writer with no save in flight to leave before killing it.
CLOSE_WAIT_S = 30.0
# The exit status of a writer that could not read a save's message (after failing that save with why).
UNREADABLE = 4
# How often a writer says it is alive while it runs (its training process kills one silent for the
# save's timeout: stopped by SIGSTOP, or stuck, it would otherwise be waited for without end).
BEAT_S = 2.0
SILENT_BEATS = 3  # beats a writer may miss before its training process judges it stopped, whatever the timeout


# ---- the training process's side ------------------------------------------------------------


class SharedStaging:
    """The staging's host buffers (numpy arrays, CPU tensors, and the CUDA tensors' host
    copies) as views of one shared block, made again, all at once, when the state's arrays
    change (the old block given up first, so staging holds at most one copy of the state):
    ``reserve`` of background.py's staging.

    A block that holds CUDA tensors' buffers is page-locked once, when made (registered with
    CUDA: :meth:`DeviceOps.register`), so the copies from the device into it run
    asynchronously, and unregistered before it is given up. Where registration fails, the
    block is made again without them (they go to background.py's private page-locked slab),
    ``unpinned`` says why, and such saves run in the thread (:meth:`WriterSlot._refused`)."""

    def __init__(self) -> None:
        self.block: sharedmem.SharedBlock | None = None
        self.on_release: Any = None  # called with a block given up (the writer drops its mapping)
        self.unpinned: str | None = None  # why the block could not hold the CUDA tensors' buffers
        self.refused: str | None = None  # why the last block could not be made (the thread saves)
        self._unregister: weakref.finalize | None = None  # undoes the block's registration, once

    def reserve(self, buffers: dict[tuple[Any, ...], Any], keys: list[tuple[Any, ...]]) -> None:
        """Put a view of the block in ``buffers`` for each of ``keys`` (the host arrays to copy,
        and the device tensors to copy into page-locked memory): the block of the last save
        while it has them all, else a new one for exactly these."""
        if all(k in buffers for k in keys) and self.block is not None:
            return
        for k in keys:
            buffers.pop(k, None)
        self.release()
        self.unpinned = None
        on_device = [k for k in keys if k[1] == "torch" and k[-1]]
        try:
            block = self._make(keys)
        except OSError as e:  # a file-size limit (ulimit -f counts memory files), no memory: the staging's own buffers
            if self.refused is None:
                log.warning("tsckpt: asynchronous saves run in a thread of this process: %s", _no_block(e))
            self.refused = _no_block(e)
            return
        self.refused = None
        if on_device:
            try:
                _devicecopy.ops().register(block.pointer, block.size)
            except Exception as e:  # noqa: BLE001 - any refusal: the thread saves, as before
                self.unpinned = f"page-locking the shared staging block failed ({type(e).__name__}: {e})"
                log.warning(
                    "tsckpt: asynchronous saves of CUDA tensors run in a thread of this process: %s", self.unpinned
                )
                block.close()
                keys = [k for k in keys if not (k[1] == "torch" and k[-1])]
                block = self._make(keys)
            else:  # undone by release(), or when the block is dropped unreleased (before its unmapping)
                self._unregister = weakref.finalize(block, _devicecopy.ops().unregister, block.pointer)
                self._unregister.atexit = False  # not after CUDA is torn down
        offsets, _ = sharedmem.layout([_key_bytes(k) for k in keys])
        for k, offset in zip(keys, offsets):
            if k[1] == "torch":
                buffers[k] = block.torch(offset, k[3], k[2])
            else:
                buffers[k] = block.numpy(offset, k[3], k[2])
        self.block = block

    @staticmethod
    def _make(keys: list[tuple[Any, ...]]) -> sharedmem.SharedBlock:
        _, size = sharedmem.layout([_key_bytes(k) for k in keys])
        return sharedmem.SharedBlock(size)

    def release(self) -> None:
        """Give up the block (its buffers must be gone from the staging already), unregistered first."""
        block, self.block = self.block, None
        unregister, self._unregister = self._unregister, None
        if unregister is not None:
            unregister()
        if block is not None:
            if self.on_release is not None:
                self.on_release(block)
            block.close()


def _no_block(e: OSError) -> str:
    return (
        f"the shared staging memory for the writer process could not be made ({e.strerror or e}; a file-size "
        "limit, ulimit -f, counts memory files too)"
    )


def _key_bytes(key: tuple[Any, ...]) -> int:
    count = int(np.prod(key[2], dtype=np.int64))
    if key[1] == "torch":
        return count * torch.empty((), dtype=key[3]).element_size()
    return count * np.dtype(key[3]).itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class _Arrays:
    """The array leaves of a save's message: leaf index -> its buffer. Sent whole once per writer
    and reused by the next saves while the same object (:meth:`_Writer._deliver`)."""

    buffers: dict[int, _Buffer]


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """A save's leaves: the arrays' buffers and every other leaf's value, by leaf index."""

    arrays: _Arrays
    values: dict[int, Any]


@dataclasses.dataclass(frozen=True)
class _Buffer:
    """An array leaf in the message to the writer: its place in the shared block. A tensor's
    dtype travels as its name: a torch dtype would import torch where it is unpickled."""

    offset: int
    tensor: bool  # a tensor (else a numpy array)
    dtype: Any  # a tensor's: its name (tsckpt/_base/dtypes.py); a numpy array's: its numpy dtype
    shape: tuple[int, ...]
    where: tuple[tuple[int, ...], tuple[int, ...]] | None  # a region's (global_shape, offsets)


class WriterSlot:
    """An AsyncSaver's writer process: started when a save first goes to it, made again after
    it died or (with several ranks) after a failed save."""

    def __init__(self) -> None:
        self._writer: _Writer | None = None
        self._shared: SharedStaging | None = None
        self._store: Any = None  # rank 0: the TCPStore the ranks' writers meet through
        self._key: Any = None  # the group and timeout the writer was started for
        self._structure: tuple[Any, Any] = (None, None)  # the last tree's spec and its structure JSON
        self._last_arrays: tuple[Any, _Arrays] | None = None  # the last save's copies and their buffers

    @property
    def pid(self) -> int | None:
        w = self._writer
        return w.proc.pid if w is not None and w.alive() else None

    def share(self, staging: Any) -> None:
        """Make ``staging``'s host buffers shared memory, for saves through a writer (where the
        platform has it; the buffers kept so far are dropped once)."""
        if not sharedmem.supported() or self._shared is not None:
            return
        self._shared = SharedStaging()
        self._shared.on_release = self._released
        staging.reserve = self._shared.reserve

    def _released(self, block: sharedmem.SharedBlock) -> None:
        if self._writer is not None:
            self._writer.drop(block)

    def send(
        self, handle: AsyncSave, job: Any, flat: Flat, leaves: list[Any], regions: list[tuple[int, Any, Any, Any]],
        copies: list[Any], *, ready: Callable[[], None] | None = None,
    ) -> bool:
        """Hand the staged save to the writer process (starting one where needed); False when it
        cannot go there (then the caller's thread saves it). Under torch.distributed the ranks
        agree first (:meth:`_agree`), so that all take the same path."""
        group, timeout = job.options.group, job.options.timeout
        reason = self._refused(job, leaves, regions)
        key = (_group_ranks(group), timeout)
        w = self._writer
        stale = w is None or not w.alive() or (w.failed and w.ranks > 1) or key != self._key
        reason, meet = self._agree(group, timeout, reason, stale)
        if reason is not None:
            log.debug("tsckpt: the asynchronous save to %s runs in a thread: %s", handle.directory, reason)
            return False
        remote = job.in_writer()
        block = self._shared.block if self._shared is not None else None
        arrays = self._arrays(block, flat, regions, copies)
        values = {i: _builtin(leaf) for i, leaf in enumerate(leaves) if i not in arrays.buffers}
        if w is None or meet is not False:  # a new writer: none yet, or the ranks agreed to start new ones
            self.close()
            w = self._writer = _Writer(meet if isinstance(meet, dict) else None)
            self._key = key
        if self._structure[0] is None or self._structure[0] != flat.spec:  # made once for a loop's saves
            self._structure = (flat.spec, structure_to_json(flat.spec))
        w.save(handle, remote, block, flat.paths, self._structure[1], _Leaves(arrays, values), job, ready)
        return True

    def _arrays(
        self, block: sharedmem.SharedBlock | None, flat: Flat, regions: list[tuple[int, Any, Any, Any]],
        copies: list[Any],
    ) -> _Arrays:
        """The array leaves' places in the block: those of the last save where its staged copies
        are the same buffers for the same leaves (a training loop's saves), else found again."""
        key = (block, [id(c) for c in copies], [(i, where) for i, _, _, where in regions])
        last = self._last_arrays
        if last is not None and last[0] == key:
            return last[1]
        buffers = {}
        for (i, _, _, where), copy in zip(regions, copies):
            offset = block.address(copy) if block is not None and math.prod(copy.shape) else 0  # no bytes: anywhere
            if offset is None:
                raise RuntimeError(f"a staged copy of {flat.paths[i]!r} is not in the shared staging block")
            tensor = is_tensor(copy)
            dtype = _dtypes.torch_name(copy.dtype) if tensor else copy.dtype
            buffers[i] = _Buffer(offset, tensor, dtype, tuple(copy.shape), where)
        arrays = _Arrays(buffers)
        self._last_arrays = (key, arrays)
        return arrays

    def _refused(self, job: Any, leaves: list[Any], regions: list[tuple[int, Any, Any, Any]]) -> str | None:
        """Why this save cannot go to a writer process, or None."""
        if not isinstance(self._shared, SharedStaging):
            return "this platform has no anonymous shared memory files"
        if getattr(job, "in_writer", None) is None or job.in_writer() is None:
            return "its location lives in this process's memory"
        if any(isinstance(where, JaxRegion) for _, _, _, where in regions):
            return "it holds jax arrays"
        if self._shared.refused is not None:
            return self._shared.refused
        unpinned = self._shared.unpinned
        if unpinned is not None and any(is_tensor(d) and _devicecopy.on_device(d) for _, _, d, _ in regions):
            return f"it holds CUDA tensors and {unpinned}"
        if any(isinstance(leaf, LazySource) for leaf in leaves):
            return "it holds lazy sources"
        if not torch_initialized() and is_distributed():
            return "a jax.distributed job: the writer processes coordinate over torch.distributed"
        return None

    def _agree(
        self, group: Any, timeout: datetime.timedelta | None, reason: str | None, stale: bool
    ) -> tuple[str | None, dict[str, Any] | None | bool]:
        """Whether this save goes to a writer process, and whether new writers start, decided by
        every rank alike: ``(why not, or None; False: the running writer saves it, else the
        rendezvous of new ones, None for one rank)``. With several ranks, one small gather over
        the training processes' background group per save (no per-leaf work): a rank that must
        save in a thread takes every rank there, a rank whose writer died or failed a save makes
        every rank start a new one (the writers' group lost a member: none can be used again),
        so the ranks' writers always run the same saves, in one group. Rank 0 serves the store
        the writers meet through (made once, on a port the system picks)."""
        if not torch_initialized():
            return reason, (None if stale else False)
        import torch.distributed as dist

        coord = coordinator_for(group, timeout, channel="background")
        if coord.world_size == 1:
            return reason, (None if stale else False)
        wait = timeout or DEFAULT_TIMEOUT
        offer = None
        if coord.rank == 0:
            if self._store is None:
                self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
            offer = {
                "port": int(self._store.port), "host": os.environ.get("MASTER_ADDR") or socket.gethostname(),
                "prefix": f"tsckpt-writers/{uuid.uuid4().hex}/",
            }
        found = coord.all_gather((reason, stale, socket.gethostname(), offer))
        refused = [f"rank {r}: {why}" for r, (why, _, _, _) in enumerate(found) if why is not None]
        if refused:
            return "; ".join(refused), False
        if not any(renew for _, renew, _, _ in found):
            return None, False
        first = found[0][3]
        same_host = {name for _, _, name, _ in found} == {found[0][2]}
        return None, {
            "host": "127.0.0.1" if same_host else first["host"], "port": first["port"], "prefix": first["prefix"],
            "rank": coord.rank, "world_size": coord.world_size, "timeout_s": wait.total_seconds(),
        }

    def close(self) -> None:
        """Stop the writer (after the save in flight, if it is alive)."""
        w, self._writer = self._writer, None
        if w is not None:
            w.close()

    def give_up(self) -> None:
        """:meth:`close`, and give up the shared block (its memory is freed once the staging's
        views of it are gone): the saver is closed."""
        self.close()
        if self._shared is not None:
            self._shared.release()


# The builtin types of plain values, each with what takes a subclass's value as exactly that
# type (not through methods a subclass may override: a str enum's str() is its name).
_EXACT: tuple[tuple[type, Callable[[Any], Any]], ...] = (
    (int, int.__int__), (float, float.__float__), (str, str.__str__), (bytes, bytes)
)


def _builtin(value: Any) -> Any:
    """A plain value of a subclass of a builtin type (an IntEnum's member, a str enum's) as that
    builtin's value, which is what its record stores: the writer would import the subclass's
    module to unpickle it (torch's, or a training script's ``__main__``, which it has not).
    numpy scalars stay as they are (they are saved as arrays)."""
    if type(value) in (bool, int, float, str, bytes) or isinstance(value, np.generic):
        return value
    for base, exact in _EXACT:
        if isinstance(value, base):
            return exact(value)
    return value


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    if group is None or not torch_initialized():
        return None
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


_live: weakref.WeakSet[_Writer] = weakref.WeakSet()
_exit_registered = False


def live_writers() -> list[int]:
    """The process ids of this process's writer processes still running."""
    return [w.proc.pid for w in list(_live) if w.proc.poll() is None]


def _close_at_exit() -> None:
    """At interpreter exit: let every writer finish its save in flight, then stop it."""
    for w in list(_live):
        w.close()


class _Writer:
    """One writer process and the thread that waits for its replies."""

    def __init__(self, rendezvous: dict[str, Any] | None) -> None:
        global _exit_registered
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        fd = theirs.detach()
        setup = json.dumps({"parent": os.getpid(), "rendezvous": rendezvous, "log_level": log.getEffectiveLevel()})
        try:
            # a session and process group of its own: a terminal's Ctrl-C (SIGINT, and SIGTSTP, SIGQUIT) goes to
            # the training process, which decides; the writer ends with it (close, or its death seen)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WRITER_MAIN, str(fd), setup],
                pass_fds=[fd], env=_child_environment(), stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            os.close(fd)
        self.ranks = rendezvous["world_size"] if rendezvous else 1
        self._rendezvous = rendezvous
        self.failed = False  # a save through it failed
        self.leaving = False  # it could not read a save's message: it leaves, and is not used again
        self.block: sharedmem.SharedBlock | None = None  # the block the writer maps
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()  # _pending and _closed, between the caller and the watch thread
        self._pending: dict[int, tuple[AsyncSave, str, str]] = {}  # seq -> handle, what, the id its claim takes
        self._silent_s = DEFAULT_TIMEOUT.total_seconds()  # the longest it may say nothing while it saves
        self.stalled: float | None = None  # set when it was killed for saying nothing that long
        self._tidying: dict[int, AsyncSave] = {}  # saves settled whose housekeeping the writer still runs
        self._seq = 0
        self._closed = False
        self._sent: tuple[Any, Any, Any] = (None, None, None)  # the paths, structure and arrays the writer has
        self._watch = threading.Thread(target=self._replies, name="tsckpt-writer-watch", daemon=True)
        self._watch.start()
        _live.add(self)
        if not _exit_registered:  # after background.py's report of unchecked failures: runs before it
            atexit.register(_close_at_exit)
            _exit_registered = True

    def alive(self) -> bool:
        return self.proc.poll() is None and not self._closed and not self.leaving

    def _send(self, *message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)

    def drop(self, block: sharedmem.SharedBlock) -> None:
        """Tell the writer to unmap ``block`` (the training process gave it up)."""
        if self.block is block:
            self.block = None
            if self.alive():
                try:
                    self._send("drop")
                except OSError:
                    pass  # the writer is gone: its mapping with it

    def save(
        self, handle: AsyncSave, job: Any, block: sharedmem.SharedBlock | None, paths: list[str], structure: Any,
        leaves: _Leaves, caller_job: Any, ready: Callable[[], None] | None = None,
    ) -> None:
        """Send one save; ``handle`` is settled by the writer's reply (or its death). ``ready``:
        waits for the copies left after the call (overlapped staging) and raises the failure of
        one; the message then leaves from a thread of its own, once they are made, so the writer
        never reads a buffer still being filled."""
        self._seq += 1
        timeout = getattr(getattr(caller_job, "options", None), "timeout", None)
        # a few beats at least: a timeout shorter than that would kill a writer that is only between two beats
        self._silent_s = max((timeout or DEFAULT_TIMEOUT).total_seconds(), SILENT_BEATS * BEAT_S)
        step = getattr(caller_job, "step", None)
        what = f"{handle.directory}" + (f" (step {step})" if step is not None else "")
        handle.set_running_or_notify_cancel()
        with self._state_lock:
            if self._closed:  # died since it was judged alive: nothing will answer
                handle.tidied()
                handle.settle(self._lost(what))
                return
            claim = self._pending[self._seq] = (handle, what, uuid.uuid4().hex)
        seq, save_id = self._seq, claim[2]
        if ready is None:
            self._deliver(seq, save_id, block, job, paths, structure, leaves)
            return

        def deliver_when_ready() -> None:
            try:
                ready()
            except BaseException as e:  # noqa: BLE001 - delivered through the handle
                with self._state_lock:
                    self._pending.pop(seq, None)
                handle.tidied()
                handle.settle(e)
                return
            self._deliver(seq, save_id, block, job, paths, structure, leaves)

        run_soon(deliver_when_ready, name="tsckpt-staging-send")

    def _deliver(
        self, seq: int, save_id: str, block: sharedmem.SharedBlock | None, job: Any, paths: list[str], structure: Any,
        leaves: _Leaves,
    ) -> None:
        """Send the message of save ``seq``, whose claim takes ``save_id`` (its shared block
        first, where new)."""
        try:
            with self._send_lock:
                if block is not None and block is not self.block:
                    self.conn.send(("block", block.size))
                    send_handle(self.conn, block.fd, self.proc.pid)
                    self.block = block
                # what the writer has from the last save is not sent again (None: as before); the
                # save's part pickled apart, so that a writer that cannot read it fails this save
                had_paths, had_structure, had_arrays = self._sent
                payload = pickle.dumps((
                    job,
                    None if paths == had_paths else paths,
                    None if structure is had_structure else structure,
                    leaves.values if leaves.arrays is had_arrays else leaves,
                ), protocol=pickle.HIGHEST_PROTOCOL)
                self.conn.send(("save", seq, payload, save_id))
                self._sent = (paths, structure, leaves.arrays)
        except OSError:
            pass  # the writer died: the watch thread reports it through the handle

    def _replies(self) -> None:
        """Settle each save's handle from the writer's reply; when the writer is gone, fail the
        saves it still had."""
        heard = time.monotonic()
        while True:
            try:
                if not self.conn.poll(BEAT_S):
                    self._check_heard(heard)
                    continue
                reply = self.conn.recv()
            except (EOFError, OSError):
                break
            heard = time.monotonic()
            if reply[0] == "beat":
                continue
            kind, seq, peak, records = reply[0], reply[1], reply[2], reply[3]
            for record in records:  # the save's log lines, as a save in this process logs them
                log.handle(record)
            if kind == "tidied":
                with self._state_lock:
                    self._tidying.pop(seq).tidied()
                continue
            with self._state_lock:
                handle, _, _ = self._pending.pop(seq)
                if kind != "unreadable":  # the writer leaves at once: no housekeeping follows
                    self._tidying[seq] = handle
            if kind == "unreadable":
                handle.tidied()
            handle.writer_peak_bytes = peak
            if kind != "done":
                self.failed = True
            if kind == "unreadable":  # before the handle wakes its caller, whose next save starts a new writer
                self.leaving = True
            handle.settle(
                None if kind == "done" else _named(_rebuilt(reply[4], reply[5]), handle.directory, self._rendezvous)
            )
        self.proc.wait()
        with self._state_lock:
            self._closed = True
            lost, self._pending = self._pending, {}
            cut, self._tidying = self._tidying, {}
        for handle in cut.values():  # the writer is gone: the next save's clean-up removes what it left
            handle.tidied()
        if lost and self.stalled is None:
            self._record_loss(_death(self.proc.wait()))
        for _, (handle, what, save_id) in sorted(lost.items()):
            self.failed = True
            handle.tidied()
            if self.ranks == 1 and _committed_as(handle.directory, save_id):
                log.warning(
                    "tsckpt: the writer process (pid %s) of the asynchronous save to %s %s after the save committed: "
                    "the step is complete; the next save starts a new writer", self.proc.pid, what, _death(self.proc.wait()),
                )
                handle.settle(None)
            else:
                handle.settle(self._lost(what))

    def _check_heard(self, heard: float) -> None:
        """Kill the writer when it has said nothing (no reply, no beat) for longer than its
        save's timeout while a save is pending: the saves it had then fail (:meth:`_lost`)."""
        silent = time.monotonic() - heard
        if self._pending and silent > self._silent_s and self.proc.poll() is None:
            self.stalled = silent
            self._record_loss(_stall(silent))  # before the kill, so the other ranks' writers find it
            self.proc.kill()

    def _record_loss(self, why: str) -> None:
        """Tell the other ranks why this rank's writer is gone (:func:`_losses`): in the job's
        store, under the writers' group. Nothing without one."""
        if self._rendezvous is not None:
            record_loss(self._rendezvous, why)

    def _lost(self, what: str) -> WriterLostError:
        """The error of a save whose writer died: before its commit (one rank: the root read says
        so), or, with several ranks, at a moment only rank 0's writer knew (its claim's id is its own)."""
        if self.ranks == 1:
            outcome = "before the save committed: nothing of it is listed as a checkpoint"
        else:
            outcome = (
                "before it replied: rank 0's writer commits the save, so whether the step is listed as a checkpoint "
                "is what the manager's all_steps() (rank 0's outcome) says"
            )
        death = _death(self.proc.wait()) if self.stalled is None else _stall(self.stalled)
        return WriterLostError(
            f"the writer process (pid {self.proc.pid}) of the asynchronous save to {what} {death} "
            f"{outcome}; the next save starts a new writer"
        )

    def close(self) -> None:
        """Stop the writer once its save in flight is over (it is killed if it does not leave)."""
        if not self._closed and self.proc.poll() is None:
            try:
                self._send("close")
            except OSError:
                pass
        try:
            if self._pending:  # a save in flight: as long as it takes (it has timeouts of its own)
                self.proc.wait()
            self.proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._watch.join()
        self.conn.close()
        _live.discard(self)


def _committed_as(directory: Any, save_id: str) -> bool:
    """Whether the root at ``directory`` is a committed one of the save whose claim was
    ``save_id`` (its writer died between its commit and its reply); False when it cannot be read."""
    try:
        loc = resolve(directory)
        ((found, _),) = read_roots(loc, [ROOT_KEY]).values()
    except Exception:  # noqa: BLE001 - unreadable: the save is reported lost, as it may be
        return False
    return found.state == STATE_COMMITTED and save_id_of(found) == save_id


def _stall(silent: float) -> str:
    return f"said nothing for {silent:.0f} s, more than the save's timeout (stopped, or stuck), and was killed"


# How long a rank whose writers lost one waits for that rank's record of why (its training process
# writes it once it sees its writer gone), and the most ranks it looks up when none is named.
LOSS_WAIT_S = 2.0
LOSS_LOOKUPS = 64


def _loss_key(rendezvous: dict[str, Any], rank: int) -> str:
    return f"tsckpt/writer-lost/{rendezvous['prefix']}{rank}"


def record_loss(rendezvous: dict[str, Any], why: str) -> None:
    """Record in the job's store why this rank's writer of the group ``rendezvous`` is gone."""
    store = job_store()
    if store is not None:
        with contextlib.suppress(Exception):  # the store's host may be gone too
            store.set(_loss_key(rendezvous, rendezvous["rank"]), why)


def _losses(rendezvous: dict[str, Any] | None, lost: tuple[int, ...]) -> dict[int, str]:
    """Why other ranks' writers of the group ``rendezvous`` are gone, as their training processes
    recorded it (:func:`record_loss`): of the ranks ``lost`` names, else of any (a stopped writer
    is not seen gone until its training process kills it), waiting up to LOSS_WAIT_S for them."""
    store = job_store() if rendezvous is not None else None
    if store is None or rendezvous is None:
        return {}
    ranks = [r for r in (lost or range(rendezvous["world_size"])) if r != rendezvous["rank"]][:LOSS_LOOKUPS]
    deadline = time.monotonic() + LOSS_WAIT_S
    while True:
        found = {}
        for r in ranks:
            key = _loss_key(rendezvous, r)
            with contextlib.suppress(Exception):  # not recorded: that rank's process may be gone too
                if store.check([key]):
                    found[r] = store.get(key).decode(errors="replace")
        if (len(found) == len(ranks) if lost else found) or time.monotonic() >= deadline:
            return found
        time.sleep(LOSS_WAIT_S / 10)


def _death(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (as the kernel's out-of-memory killer does)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with status {code}"


class _RemoteTraceback(Exception):
    """The writer process's traceback of an error it raised (shown as the error's cause)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _rebuilt(pickled: bytes | None, text: str) -> BaseException:
    """The writer's error, with its traceback as the cause."""
    err: BaseException
    try:
        err = pickle.loads(pickled) if pickled is not None else RuntimeError(text.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - an error that does not survive pickling: its text
        err = RuntimeError(text.strip().splitlines()[-1])
    err.__cause__ = _RemoteTraceback(f"\n\nin the writer process:\n{text}")
    return err


def _named(err: BaseException, directory: str, rendezvous: dict[str, Any] | None = None) -> BaseException:
    """A writer's error as its trainer tells it: a lost contact between the writers (a writer
    of another rank killed, or its trainer) names the save, why that rank's writer is gone where
    its training process recorded it (:func:`_losses`), and says that the job may go on (every
    trainer alive: the next save starts new writers on every rank)."""
    if not isinstance(err, DistributedError) or RESTART not in str(err):
        return err
    why = "".join(f"rank {r}'s writer {text}; " for r, text in sorted(_losses(rendezvous, err.lost).items()))
    named = DistributedError(
        f"the asynchronous save to {directory}: "
        + str(err).replace(
            RESTART, f"{why}the writer processes lost one of theirs (a writer, or the training process it served, "
            "is gone): if every training process is still running, the next save starts new writers on every rank; "
            "if one is gone, restart the job and restore the last committed checkpoint",
        )
    )
    named.lost = getattr(err, "lost", ())
    named.__cause__ = err.__cause__
    return named


def _child_environment() -> dict[str, str]:
    """The writer's environment: this process's, with its import path (so the writer imports
    the same tsckpt, and the modules of a job's classes)."""
    env = dict(os.environ)
    paths = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


# ---- the writer process's side ---------------------------------------------------------------


# The writer's command: SIGINT ignored before anything else (a SIGINT sent to it alone, say by
# a job's kill of every process it started, would otherwise end its loop in the middle of a
# thread's start and leave it alive and deaf: the training process waiting on it for ever).
_WRITER_MAIN = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); from tsckpt._save.writer import main; main()"
)


def main() -> None:
    """The writer process: receive saves from the training process and run them, one at a time."""
    fd, setup = int(sys.argv[1]), json.loads(sys.argv[2])
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass
    conn = Connection(fd)
    kept = _Kept()
    log.setLevel(setup["log_level"])
    log.addHandler(kept)
    log.propagate = False  # each record goes to the training process, which logs it
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    threading.Thread(target=_listen, args=(conn, inbox, setup["parent"]), name="tsckpt-writer-listen", daemon=True).start()
    threading.Thread(target=_beat, args=(conn,), name="tsckpt-writer-beat", daemon=True).start()
    joined: BaseException | None = None
    if setup["rendezvous"] is not None:
        try:
            _join(setup["rendezvous"])
        except Exception as e:  # noqa: BLE001 - every save through this writer fails with it
            first = (str(e).splitlines() or [""])[0][:300]
            joined = DistributedError(
                f"the writer processes could not form their group ({type(e).__name__}: {first}): a writer of "
                f"another rank died or stopped while starting; {RESTART}"
            )
    block: sharedmem.SharedBlock | None = None
    last: tuple[Any, Any, Any] = (None, None, None)  # the last save's paths, structure and arrays
    tidying: collections.deque[concurrent.futures.Future[Any]] = collections.deque()  # the saves' housekeeping
    while True:
        message = inbox.get()
        kind = message[0]
        if kind == "close":
            break
        if kind in ("block", "drop") and block is not None:
            block.close()
            block = None
        if kind == "block":
            block = sharedmem.SharedBlock(message[1], fd=message[2])
        elif kind == "save":
            seq = message[1]
            try:
                job, paths, structure, leaves = pickle.loads(message[2])
            except BaseException as e:  # noqa: BLE001 - e.g. a class the writer cannot import
                # what this writer holds of the last saves no longer matches the training
                # process's idea of it: the save fails with why, the writer leaves, the next starts anew
                with _SENDING:
                    conn.send(("unreadable", seq, _peak(), kept.take(), _portable(e), traceback.format_exc()))
                conn.close()
                os._exit(UNREADABLE)
            paths = last[0] if paths is None else paths  # None: as the last save's
            structure = last[1] if structure is None else structure
            arrays = leaves.arrays if isinstance(leaves, _Leaves) else last[2]
            values = leaves.values if isinstance(leaves, _Leaves) else leaves
            last = (paths, structure, arrays)
            while len(tidying) > TIDY_BEHIND:  # the housekeeping of the saves before the last: over first
                concurrent.futures.wait([tidying.popleft()])
            try:
                if joined is not None:
                    raise joined
                with claims_named(message[3]):  # so the training process can tell a commit it missed
                    job(Staged(paths, _views(block, _merged(arrays, values, len(paths))), structure))
            except BaseException as e:  # noqa: BLE001 - sent to the training process
                with _SENDING:
                    conn.send(("failed", seq, _peak(), kept.take(), _portable(e), traceback.format_exc()))
            else:
                with _SENDING:
                    conn.send(("done", seq, _peak(), kept.take()))
            # after the reply (the save is over at its commit), beside the next save: its own files only
            tidying.append(run_soon(functools.partial(_tidy_then_say, job, seq, conn, kept), name="tsckpt-tidy"))
    conn.close()
    os._exit(0)  # no interpreter teardown: gloo's destructors can abort at exit


def _tidy_then_say(job: Any, seq: int, conn: Connection, kept: _Kept) -> None:
    """A save's housekeeping (:func:`tidy`), then the message that it is over."""
    try:
        tidy(job)
    finally:
        with _SENDING:
            conn.send(("tidied", seq, _peak(), kept.take()))


# The writer's replies leave from its main loop and from its housekeeping: one at a time.
_SENDING = threading.Lock()


def _beat(conn: Connection) -> None:
    """Tell the training process every :data:`BEAT_S` that this writer is alive and running."""
    while True:
        time.sleep(BEAT_S)
        try:
            with _SENDING:
                conn.send(("beat",))
        except OSError:
            return


class _Kept(logging.Handler):
    """The records the "tsckpt" logger emits in the writer during a save, sent with its reply."""

    def __init__(self) -> None:
        super().__init__()
        self._records: list[logging.LogRecord] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args, record.exc_info = record.getMessage(), None, None  # picklable
        with self._lock2:
            self._records.append(record)

    def take(self) -> list[logging.LogRecord]:
        with self._lock2:
            out, self._records = self._records, []
        return out


def _listen(conn: Connection, inbox: queue.Queue[tuple[Any, ...]], parent: int) -> None:
    """Read the training process's messages; leave the process at once when it is gone."""
    while True:
        try:
            if not conn.poll(PARENT_POLL_S):
                if os.getppid() != parent:
                    os._exit(ORPHANED)
                continue
            message = conn.recv()
            if message[0] == "block":
                message = (*message, recv_handle(conn))
        except (EOFError, OSError):
            os._exit(ORPHANED)  # mid-save too: a save cut short never commits
        inbox.put(message)
        if message[0] == "close":
            return


def _join(r: dict[str, Any]) -> None:
    """Form the writers' gloo group with the other ranks' writers."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=r["timeout_s"])
    store = dist.TCPStore(r["host"], r["port"], is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(r["prefix"], store), rank=r["rank"], world_size=r["world_size"], timeout=timeout
    )


def _merged(arrays: _Arrays, values: dict[int, Any], count: int) -> list[Any]:
    """A save's leaves in order from its message: the arrays' buffers and the other values."""
    out: list[Any] = [None] * count
    for i, buffer in arrays.buffers.items():
        out[i] = buffer
    for i, value in values.items():
        out[i] = value
    return out


def _views(block: sharedmem.SharedBlock | None, leaves: list[Any]) -> list[Any]:
    """The message's leaves with each array a view of the shared block (the same view for the
    same buffer: tied leaves stay tied).

    A tensor's buffer becomes a numpy view in the numpy (or ml_dtypes) dtype of the same name,
    saved as the tensor is (:class:`TorchRegion`), so that this process never imports torch
    for it (its libraries are most of a writer's resident memory); a tensor view where
    numpy has no such dtype (complex32, packed and bit dtypes), or where torch is imported
    already (the writers of several ranks, which talk over torch.distributed)."""
    made: dict[tuple[Any, ...], tuple[Any, bool]] = {}  # buffer -> its view, and whether a tensor's in numpy
    out = []
    for leaf in leaves:
        if not isinstance(leaf, _Buffer):
            out.append(leaf)
            continue
        if block is None:
            raise RuntimeError("a save names shared staging buffers but no block was received")
        key = (leaf.offset, leaf.tensor, leaf.dtype, leaf.shape)
        if key not in made:
            made[key] = _view(block, leaf)
        view, as_numpy = made[key]
        if as_numpy:
            out.append(TorchRegion(view, *(leaf.where or (leaf.shape, (0,) * len(leaf.shape)))))
        else:
            out.append(view if leaf.where is None else ShardedArray(view, *leaf.where))
    return out


def _view(block: sharedmem.SharedBlock, leaf: _Buffer) -> tuple[Any, bool]:
    """A buffer's view of the block, and whether it is a tensor's held as a numpy array."""
    if not leaf.tensor:
        return block.numpy(leaf.offset, leaf.dtype, leaf.shape), False
    twin = _dtypes.numpy_twin(leaf.dtype) if loaded() is None else None
    if twin is None:
        return block.torch(leaf.offset, _dtypes.torch_dtype(leaf.dtype), leaf.shape), False
    return block.numpy(leaf.offset, twin, leaf.shape), True


def _peak() -> int:
    """This process's peak resident memory so far, in bytes: Linux's ``VmHWM``, not getrusage's
    ``ru_maxrss``, which a process started by another begins at its starter's resident memory
    (exec keeps the larger of the two), so it would report the training process's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource  # Unix only, as writer processes are

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


def _portable(e: BaseException) -> bytes | None:
    """The error pickled, if it survives the trip (else the training process rebuilds it from its text)."""
    try:
        data = pickle.dumps(e)
        pickle.loads(data)
    except Exception:  # noqa: BLE001
        return None
    return data
