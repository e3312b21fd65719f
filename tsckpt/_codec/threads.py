"""Worker threads for file I/O that keep working while the interpreter exits.

concurrent.futures refuses new work once the interpreter has begun to exit, but
a save still in flight then (``save_async`` finishes pending saves at exit) must
write its files all the same: such work runs in the calling thread instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable

from .._runtime.threads import run_here


def cpus() -> int:
    """The CPUs this process may run on (its affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


class Workers:
    """A thread pool made on first use; ``submit`` runs inline once the pool is refused."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads, self._name = threads, name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inline = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        if not self._inline:
            try:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
                return self._pool.submit(fn, *args)
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
                self._inline = True
        return run_here(fn, *args)

    def shutdown(self) -> None:
        """Wait for the work in flight; drop what has not started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def settle(futures: list[concurrent.futures.Future[Any]]) -> None:
        """Drop those of ``futures`` that have not started and wait for the others: what
        :meth:`shutdown` does for one caller's work in a pool that others go on using."""
        for fut in futures:
            fut.cancel()
        concurrent.futures.wait(futures)


_SHARED: dict[tuple[str, int], Workers] = {}
_SHARED_LOCK = threading.Lock()


def shared(threads: int, name: str) -> Workers:
    """The process's pool of ``threads`` threads named ``name``, made once and kept: a
    restore that reads in many small calls (a device target's batches) starts no threads
    per call. Callers never shut it down; they :meth:`Workers.settle` their own work."""
    with _SHARED_LOCK:
        pool = _SHARED.get((name, threads))
        if pool is None:
            pool = _SHARED[(name, threads)] = Workers(threads, name)
        return pool
