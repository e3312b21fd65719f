"""torch.distributed coordination over a dedicated gloo group.

Planning exchanges only small descriptors (paths, shapes, offsets, checksums),
never tensor data, and always over gloo on the CPU: a job whose default
backend is NCCL gets a side gloo group, so planning never touches GPU memory
or interleaves with the training loop's own collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import threading
import time
from typing import Any

import numpy as np

from .jaxdist import coordinator as jax_coordinator
from .protocol import Coordinator, Solo

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
# After a collective failed: how long a rank waits for each peer to answer its probe
# (a peer whose process is gone fails at once; a surviving peer answers as soon as its
# own collective fails too), and the tag the probes use, apart from exchange()'s.
PROBE_SECONDS = 5.0
PROBE_TAG = 0x75C6
LEAVE_TAG = 0x75C7  # the receive that closes a rank's connections when it leaves (DistCoordinator.leave)

_groups: dict[tuple[Any, str], list[Any]] = {}  # (ranks, channel) -> [the gloo group, its timeout now]
_departed: dict[int, list[int]] = {}  # id of each group this process left -> the ranks it found lost then


class DistCoordinator:
    """Coordinator over the ranks of ``group``, talking through a gloo group."""

    def __init__(self, group: Any, timeout: datetime.timedelta, channel: str) -> None:
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
        key = (ranks, channel)
        if key not in _groups:
            # new_group is collective over the default group: every rank calls
            # save/restore, so every rank reaches this line in the same order.
            made = dist.new_group(ranks=list(ranks) if ranks else None, backend="gloo", timeout=timeout)
            _groups[key] = [made, timeout]
        elif _groups[key][1] != timeout:
            # another timeout than the group was made with: set on this rank's group, never a new group, which
            # would be a collective that only the ranks whose timeout changed enter (the others wait in this save)
            _set_timeout(_groups[key][0], timeout)
            _groups[key][1] = timeout
        self.group = _groups[key][0]
        self.timeout = timeout
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def most(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """One all-reduce of an int64 tensor: on one host a third of the time of
        :meth:`all_gather` of a small object (two collectives and pickling; RESULTS.md)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in t.tolist())

    def gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        import torch.distributed as dist

        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=dist.get_global_rank(self.group, 0), group=self.group)
        return out[0]

    def exchange(
        self, sends: list[tuple[int, int, np.ndarray]], recvs: list[tuple[int, int, int]]
    ) -> dict[int, np.ndarray]:
        """Point-to-point bytes: ``sends`` are (dst, tag, array), ``recvs`` (src, tag, nbytes)."""
        import torch
        import torch.distributed as dist

        works = []
        for dst, tag, arr in sends:
            t = torch.from_numpy(arr.reshape(-1).view(np.uint8))
            works.append(dist.isend(t, dst=dist.get_global_rank(self.group, dst), group=self.group, tag=tag))
        out = {}
        for src, tag, nbytes in recvs:
            out[tag] = torch.empty(nbytes, dtype=torch.uint8)
            works.append(dist.irecv(out[tag], src=dist.get_global_rank(self.group, src), group=self.group, tag=tag))
        for w in works:
            if w is not None:
                w.wait()
        return {tag: t.numpy() for tag, t in out.items()}

    def unreachable(self) -> list[int]:
        """After a collective of this rank failed (see :meth:`Coordinator.unreachable`): the
        other ranks known to be gone (:meth:`probe`); then this rank leaves the group
        (:meth:`leave`), so that no surviving peer waits on it until the timeout. In a group
        left before (every later collective on it fails at once), the ranks found lost then."""
        if id(self.group) in _departed:
            return _departed[id(self.group)]
        lost = self.probe()
        self.leave(lost)
        return lost

    def probe(self) -> list[int]:
        """The other ranks whose connection to this one is gone, leaving aside those that
        left the group themselves (:meth:`leave`): each is sent one byte and expected to
        send one back; a peer whose process or host is gone fails at once (its connection
        closed), a live one answers as soon as it probes too (its own collective failed).
        Waits at most ``PROBE_SECONDS`` (and the group's timeout); a peer silent until then
        (busy elsewhere, or its host cut off without closing the connection) is not named.

        Why not gloo's own timed wait: a wait that times out makes gloo close every
        connection of the group ("Application timeout caused pair closure"), so every live
        peer still probing would then find this rank gone and name it. The waits here
        are unbounded ones in helper threads, which this rank stops waiting for at the
        bound; each also waits for its own byte to be taken, since gloo drops a send whose
        work is freed before the peer asked for it (the peer would then wait in vain)."""
        wait = min(PROBE_SECONDS, self.timeout.total_seconds())
        outcome: dict[int, BaseException | None] = {}  # peer -> None (it answered) or the error

        def answered(r: int, works: list[Any]) -> None:
            try:
                for work in works:
                    work.wait()
                outcome[r] = None
            except Exception as e:  # noqa: BLE001 - its connection broke
                outcome[r] = e

        threads = []
        for r in self._peers():
            try:
                works = self._probe(r)
            except Exception as e:  # noqa: BLE001 - the connection to that peer is already broken
                outcome[r] = e
                continue
            threads.append(threading.Thread(target=answered, args=(r, works), name=f"tsckpt-probe-{r}", daemon=True))
            threads[-1].start()
        deadline = time.monotonic() + wait
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        closed = [r for r, e in dict(outcome).items() if e is not None and _closed_by_peer(e)]
        return sorted(r for r in closed if not self._left(r))

    def leave(self, lost: list[int]) -> None:
        """Leave the group after a failure that ends the job: record in the job's store that
        this rank left (and whom it found ``lost``), then close this rank's connections in
        the group, so a peer still waiting on it in a collective (e.g. a gather it already
        sent its part of) fails at once instead of after the timeout; its probe then finds
        this rank's connection closed, and the record tells it that this rank left rather
        than died. The group is the coordination's own, not the training loop's, and no
        later collective on it can succeed with a rank lost."""
        store = job_store()
        if store is not None:
            with contextlib.suppress(Exception):  # the store's host may be the one lost
                store.set(self._left_key(self.rank), json.dumps(lost))
        _departed[id(self.group)] = lost
        self._close()

    def _peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _probe(self, r: int) -> list[Any]:
        """The probe's send to and receive from rank ``r``, started."""
        import torch
        import torch.distributed as dist

        peer = dist.get_global_rank(self.group, r)
        send = dist.isend(torch.ones(1, dtype=torch.uint8), dst=peer, group=self.group, tag=PROBE_TAG)
        recv = dist.irecv(torch.zeros(1, dtype=torch.uint8), src=peer, group=self.group, tag=PROBE_TAG)
        return [w for w in (recv, send) if w is not None]

    def _close(self) -> None:
        """Close every connection of this rank in the group. gloo offers no call for it but
        does it when a wait times out, so: a receive nobody sends to, given a 1 ms wait.
        Tried on every peer, not only the first: a peer that left just before may fail the
        wait at once ("connection closed") rather than let it time out, which closes
        nothing else; after a timeout, the other peers' receives fail at once."""
        import torch
        import torch.distributed as dist

        for r in self._peers():
            try:
                work = dist.irecv(
                    torch.zeros(1, dtype=torch.uint8), src=dist.get_global_rank(self.group, r), group=self.group,
                    tag=LEAVE_TAG,
                )
            except Exception:  # noqa: BLE001 - that connection is closed already
                continue
            if work is None:
                continue
            with contextlib.suppress(Exception):  # the timeout that closes them all, or that peer gone
                work.wait(datetime.timedelta(milliseconds=1))

    def _left_key(self, r: int) -> str:
        return f"tsckpt/left/{self.group.group_name}/{r}"

    def _left(self, r: int) -> bool:
        """Whether rank ``r`` recorded that it left the group (:meth:`leave`)."""
        store = job_store()
        try:
            return store is not None and bool(store.check([self._left_key(r)]))
        except Exception:  # noqa: BLE001 - no store to ask: as far as can be told, it did not
            return False


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """Bound this rank's waits in ``group`` by ``timeout`` from now on. torch's call for it
    (``_set_pg_timeout``, documented for this use) is not public: where it is missing, the
    group keeps the timeout it was made with."""
    import torch.distributed.distributed_c10d as c10d

    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timeout, group)


def _closed_by_peer(error: BaseException) -> bool:
    """Whether a probe's error says the peer is gone, rather than that this rank's own
    gloo closed its connections after one of its waits timed out (which tells nothing
    about the peer)."""
    return "Application timeout caused pair closure" not in str(error)


def job_store() -> Any:
    """The key-value store the job rendezvoused through (torchrun's, or the one of
    init_process_group's init_method), or None. torch has no public accessor for it."""
    try:
        import torch.distributed.distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a torch without it
        return None


def torch_initialized() -> bool:
    """Whether torch.distributed has a default process group; asked without importing torch,
    as none exists before torch.distributed is imported (a JAX or numpy process)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def rank_of(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the default group); without torch.distributed,
    its process index in a jax.distributed job, else 0."""
    if not torch_initialized():
        jax = jax_coordinator(DEFAULT_TIMEOUT)
        return jax.rank if jax is not None else 0
    import torch.distributed as dist

    return dist.get_rank(group) if group is not None else dist.get_rank()


def is_distributed() -> bool:
    """torch.distributed is initialized with more than one rank, or a jax.distributed job has
    more than one process."""
    if not torch_initialized():
        return jax_coordinator(DEFAULT_TIMEOUT) is not None
    import torch.distributed as dist

    return dist.get_world_size() > 1


class _ThisProcess:
    """The ranks of a save or restore that one process runs by itself while torch.distributed
    runs several (tsckpt.convert): coordinated as :class:`Solo`, and no group is made for it,
    which would be a collective the other ranks never join."""

    def __repr__(self) -> str:
        return "THIS_PROCESS"


THIS_PROCESS: Any = _ThisProcess()


def coordinator_for(
    group: Any = None, timeout: datetime.timedelta | None = None, *, channel: str | None = None
) -> Coordinator:
    """The ranks of ``group`` (default: the default process group) when torch.distributed is
    initialized; else the processes of a jax.distributed job (tsckpt._coord.jaxdist); else Solo.
    A group of this process alone is Solo too: it needs no coordination, so one rank may save
    or restore by itself while the others go on (a framework that checkpoints from rank 0).

    Each ``channel`` has its own gloo group; by default saves from the main
    thread use "main" and saves from other threads (async saves) "background",
    so a background commit never interleaves its collectives with a save or
    restore the training loop runs meanwhile.
    """
    if group is THIS_PROCESS:
        return Solo()
    if not torch_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return jax_coordinator(timeout or DEFAULT_TIMEOUT) or Solo()
    import torch.distributed as dist

    if group is not None and dist.get_world_size(group) == 1:
        return Solo()
    if channel is None:
        channel = "main" if threading.current_thread() is threading.main_thread() else "background"
    return DistCoordinator(group, timeout or DEFAULT_TIMEOUT, channel)
