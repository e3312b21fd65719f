"""Coordination between ranks: gathering small objects and agreeing on failure.

``Solo`` is the single-process case. The torch.distributed implementation lives
in ``_dist.py``; both offer the same three operations, so save and restore are
written once.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Protocol, TypeVar

from ._errors import DistributedError, TsckptError

T = TypeVar("T")


class Coordinator(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def exchange(self, sends: list[Any], recvs: list[Any]) -> dict[int, Any]: ...


class Solo:
    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def exchange(self, sends: list[Any], recvs: list[Any]) -> dict[int, Any]:
        raise RuntimeError("a single process has no peers to exchange data with")


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return fn(), None
    except BaseException as e:  # noqa: BLE001 - reported to peers, then re-raised
        return None, e


def _report(error: BaseException | None) -> str | None:
    if error is None:
        return None
    report = f"{type(error).__name__}: {error}"
    if not isinstance(error, TsckptError):
        report = f"{report}\n{''.join(traceback.format_exception(error)[-3:])}"
    return report


def _settle(what: str, error: BaseException | None, reports: list[str | None]) -> None:
    """Raise on every rank if any rank failed: the failing rank its own exception,
    the others a DistributedError naming the failed ranks and their messages."""
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {msg.splitlines()[0]}" for r, msg in failed[:4])
        raise DistributedError(f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}")


def phase(coord: Coordinator, what: str, fn: Callable[[], T], *, ranks: set[int] | None = None) -> T | None:
    """Run ``fn`` on ``ranks`` (all by default), then make every rank agree on the outcome.

    If any rank raised, every rank raises, so no rank is left waiting for a
    peer that gave up.
    """
    result, error = _attempt(fn) if ranks is None or coord.rank in ranks else (None, None)
    if coord.world_size == 1:
        _settle(what, error, [])
        return result
    _settle(what, error, coord.all_gather(_report(error)))
    return result


def gather_phase(coord: Coordinator, what: str, fn: Callable[[], tuple[T, Any]]) -> tuple[T, list[Any]]:
    """Like :func:`phase` on all ranks, where ``fn`` returns (local result, payload):
    the outcome and every rank's payload travel in one all_gather."""
    out, error = _attempt(fn)
    result, payload = out if out is not None else (None, None)
    gathered = coord.all_gather((_report(error), payload)) if coord.world_size > 1 else [(None, payload)]
    _settle(what, error, [g[0] for g in gathered])
    return result, [g[1] for g in gathered]  # type: ignore[return-value]
