"""A bounded window of work in flight: the one way tsckpt keeps reads, writes and probes
overlapping without holding more than a set amount of memory or requests at once.

Work is started by the caller and handed to :class:`Window` with its size (bytes, or 1
for a request). Once the sizes in flight exceed the limit, the oldest work is settled
first (FIFO), by the caller's ``settle`` function, until they fit again; ``drain``
settles the rest. A window in batch mode settles everything in flight together (a
transaction committed per window).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Window(Generic[T]):
    """Work in flight, at most ``limit`` in size once :meth:`add` returns (an item larger
    than the limit is settled at once, after everything before it).

    ``settle(item)`` waits for one item and consumes its result; with ``batch``,
    ``batch(items)`` settles every item in flight at once instead. ``settled`` counts
    the size settled so far (callers give memory back every window's worth).
    """

    def __init__(
        self,
        limit: int,
        settle: Callable[[T], None] | None = None,
        *,
        batch: Callable[[list[T]], None] | None = None,
    ) -> None:
        if (settle is None) == (batch is None):
            raise TypeError("Window needs exactly one of settle and batch")
        self.limit = limit
        self._settle = settle
        self._batch = batch
        self._pending: collections.deque[tuple[T, int]] = collections.deque()
        self.in_flight = 0
        self.settled = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, item: T, size: int = 1) -> None:
        """Track ``item`` (already started) of ``size``; settle the oldest while over the limit."""
        self._pending.append((item, size))
        self.in_flight += size
        if self.in_flight > self.limit:
            self._shrink(self.limit)

    def settle_oldest(self) -> bool:
        """Settle the oldest item in flight (in batch mode, every item); False when none is.
        Callers that hold memory for work in flight make room this way."""
        if not self._pending:
            return False
        if self._batch is not None:
            self._shrink(-1)
            return True
        self._settle_one()
        return True

    def drain(self) -> None:
        """Settle everything still in flight (items of size 0 too), oldest first."""
        self._shrink(-1)

    def _shrink(self, keep: int) -> None:
        if self._batch is not None:
            if self._pending:
                items = [item for item, _ in self._pending]
                size = self.in_flight
                self._pending.clear()
                self.in_flight = 0
                self._batch(items)
                self.settled += size
            return
        while self.in_flight > keep and self._pending:
            self._settle_one()

    def _settle_one(self) -> None:
        item, size = self._pending.popleft()
        self.in_flight -= size
        if self._settle is not None:
            self._settle(item)
        self.settled += size
