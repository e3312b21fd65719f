"""Coordination between ranks: gathering small objects and agreeing on failure.

``Solo`` is the single-process case. The torch.distributed implementation lives
in ``_dist.py``; both offer the same operations, so save and restore are
written once.

A rank lost meanwhile (its process killed, its host gone) breaks the collective
every surviving rank is in, or enters next: the communication library raises its
own error (gloo: "Connection closed by peer"). Every collective here turns that
into a :class:`DistributedError` naming the phase and the ranks that are gone
(:meth:`Coordinator.unreachable`, which also lets peers still waiting on this
rank go), so survivors raise tsckpt's error and clean up what they can (a save's
rank 0 removes its pending root).
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Callable, NoReturn, Protocol, TypeVar

from .._errors import DistributedError, TsckptError

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def most(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """The element-wise largest of every rank's ``values`` (of one length on every rank): one
        small reduction, for decisions every rank takes alike and that are rarely other than
        the usual (a flag set on any rank), without gathering every rank's objects."""
        ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, None on the others."""
        ...

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank 0 passes one object per rank; each rank gets its own."""
        ...

    def exchange(self, sends: list[Any], recvs: list[Any]) -> dict[int, Any]: ...

    def unreachable(self) -> list[int]:
        """After a collective of this rank failed, which ends the job: the other ranks
        known to be gone (their process or host), never a live one; a rank silent within
        a bounded wait is not named. The rank may also leave the coordination here, so
        that no surviving peer waits on it until the timeout."""
        ...


class Solo:
    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def most(self, values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(values)

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def scatter(self, objs: list[Any] | None) -> Any:
        return objs[0] if objs else None

    def exchange(self, sends: list[Any], recvs: list[Any]) -> dict[int, Any]:
        raise RuntimeError("a single process has no peers to exchange data with")

    def unreachable(self) -> list[int]:
        return []


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - reported to peers, then re-raised
        return None, e


def collective(coord: Coordinator, what: str, fn: Callable[[], T]) -> T:
    """Run the collective ``fn`` of the phase ``what``; if it fails (a peer lost, a wait on
    one timed out), raise a DistributedError naming the phase and the unreachable ranks."""
    try:
        return fn()
    except TsckptError:
        raise
    except Exception as e:  # noqa: BLE001 - the communication library's own error, e.g. gloo's RuntimeError
        lost = coord.unreachable()
        error = DistributedError(_lost_message(what, lost, e))
        error.lost = tuple(lost)
        raise error from e


def _lost_message(what: str, lost: list[int], cause: BaseException) -> str:
    """What a rank that lost contact with its peers says: the phase, who is gone, and the cause."""
    first = (str(cause).splitlines() or [""])[0]
    cause_text = f"{type(cause).__name__}: {first[:300]}"
    who = (
        f"rank(s) {lost}, whose process or host is gone" if lost
        else "another rank (none is known to be gone: one stopped answering, its host was cut off, or it never "
        "made this call: every rank of the group makes it; one process alone reads with tsckpt.open)"
    )
    return f"{what} failed: lost contact with {who} ({cause_text}); {RESTART}"


# What a rank that lost its peers is told to do (a writer process's trainer is told more: writer.py).
RESTART = "the job cannot go on: restart it and restore the last committed checkpoint"


def _report(error: BaseException | None) -> str | None:
    if error is None:
        return None
    report = f"{type(error).__name__}: {error}"
    if not isinstance(error, TsckptError):
        report = f"{report}\n{''.join(traceback.format_exception(error)[-3:])}"
    return report


def _failure(what: str, reports: list[str | None]) -> str | None:
    """The message naming the failed ranks and their messages; None if none failed."""
    failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
    if not failed:
        return None
    detail = "; ".join(f"rank {r}: {msg.splitlines()[0]}" for r, msg in failed[:4])
    return f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}"


def _settle(what: str, error: BaseException | None, reports: list[str | None]) -> None:
    """Raise on every rank if any rank failed: the failing rank its own exception,
    the others a DistributedError naming the failed ranks and their messages."""
    if error is not None:
        raise error
    message = _failure(what, reports)
    if message is not None:
        raise DistributedError(message)


def phase(coord: Coordinator, what: str, fn: Callable[[], T], *, ranks: set[int] | None = None) -> T | None:
    """Run ``fn`` on ``ranks`` (all by default), then make every rank agree on the outcome.

    If any rank raised, every rank raises, so no rank is left waiting for a
    peer that gave up.
    """
    result, error = _attempt(fn) if ranks is None or coord.rank in ranks else (None, None)
    if coord.world_size == 1:
        _settle(what, error, [])
        return result
    _settle(what, error, collective(coord, what, lambda: coord.all_gather(_report(error))))
    return result


@dataclasses.dataclass(frozen=True)
class _Failed:
    """Sent instead of an answer: what every rank that did not fail raises."""

    message: str
    error: TsckptError | None = None  # rank 0's own deliberate error, raised as is everywhere


def ask_root(
    coord: Coordinator, what: str, fn: Callable[[], tuple[T, Any]], answer: Callable[[list[Any]], list[Any]]
) -> tuple[T, Any]:
    """One round trip through rank 0: ``fn`` runs on every rank and returns (local result,
    payload); rank 0 gets every payload and ``answer`` returns one reply per rank; each
    rank gets its reply. What a rank receives is its reply alone, whatever the world size.

    If ``fn`` failed on any rank, or ``answer`` raised, every rank raises: the failing
    rank its own exception; the others the same deliberate error (a TsckptError
    ``answer`` raised, e.g. overlapping regions) or a DistributedError naming the
    failed ranks.
    """
    out, error = _attempt(fn)
    result, payload = out if out is not None else (None, None)
    gathered = collective(coord, what, lambda: coord.gather((_report(error), payload)))
    replies: list[Any] | None = None
    mine: Any = None
    if coord.rank == 0:
        everyone = gathered or []
        message = _failure(what, [g[0] for g in everyone])
        root_error: BaseException | None = None
        if message is None:
            replies, root_error = _attempt(lambda: answer([g[1] for g in everyone]))
            if root_error is not None:
                message = _failure(what, [_report(root_error)])
        if message is not None or replies is None:
            shared = root_error if isinstance(root_error, TsckptError) else None
            replies = [_Failed(message or f"{what} failed on rank 0", shared)] * coord.world_size
        if error is None and root_error is not None:
            error = root_error
        mine = replies[0]
        replies = [None, *replies[1:]]  # rank 0 keeps its own reply: never pickled, never padded into others'
    if coord.world_size > 1:
        sent = replies
        got = collective(coord, what, lambda: coord.scatter(sent))
        mine = mine if coord.rank == 0 else got
    if error is not None:
        raise error
    if isinstance(mine, _Failed):
        raise mine.error if mine.error is not None else DistributedError(mine.message)
    return result, mine  # type: ignore[return-value]


def refuse(coord: Coordinator, what: str, error: BaseException, *, through_root: bool = False) -> NoReturn:
    """Raise ``error``, found on this rank before the verb's first exchange (a bad option), from
    within that exchange, ``what``: a :func:`phase`, or with ``through_root`` an :func:`ask_root`
    round trip, as the other ranks take it. They raise with this rank (a DistributedError
    naming it and the error) instead of waiting for it until the timeout."""

    def fail() -> NoReturn:
        raise error

    if through_root:
        ask_root(coord, what, fail, lambda payloads: [None] * len(payloads))
    else:
        phase(coord, what, fail)
    raise error  # not reached: both raise this rank's own error
