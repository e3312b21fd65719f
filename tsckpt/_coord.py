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


def phase(coord: Coordinator, what: str, fn: Callable[[], T], *, ranks: set[int] | None = None) -> T | None:
    """Run ``fn`` on ``ranks`` (all by default), then make every rank agree on the outcome.

    If any rank raised, every rank raises: the failing rank re-raises its own
    exception, the others a DistributedError naming the failed ranks and their
    messages. No rank is left waiting for a peer that gave up.
    """
    result: T | None = None
    error: BaseException | None = None
    if ranks is None or coord.rank in ranks:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - reported to peers, then re-raised
            error = e
    if coord.world_size == 1:
        if error is not None:
            raise error
        return result
    report = None if error is None else f"{type(error).__name__}: {error}"
    if error is not None and not isinstance(error, TsckptError):
        report = f"{report}\n{''.join(traceback.format_exception(error)[-3:])}"
    reports = coord.all_gather(report)
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {msg.splitlines()[0]}" for r, msg in failed[:4])
        raise DistributedError(f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}")
    return result
