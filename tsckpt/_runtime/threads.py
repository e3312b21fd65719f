"""Short jobs handed to threads that already exist.

A call that starts a thread waits until the new thread has run (``Thread.start``), which
takes the interpreter away from the caller for a scheduling round, longer when the CPUs
are busy; ``save_async``'s call hands off two jobs per save (the deferred copies and the
message that waits for them), so its threads are kept and reused here
(benchmarks/RESULTS.md, "save_async call time"). A job runs under the name it is given,
and the thread is named :data:`IDLE` again when it ends, so a thread list shows what runs.
Jobs that must yield to the training loop (``nice``) run in threads of their own, kept at a
lower scheduling priority (a thread's priority can be lowered, never raised back). Once
the interpreter exits and concurrent.futures takes no new work, a job runs in the caller
(:func:`run_here`, which :class:`tsckpt._codec.threads.Workers` uses too).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable

# The name of a kept thread between jobs.
IDLE = "tsckpt-idle"
# At most this many jobs run at once (more wait for a thread); each waits for little.
MAX_THREADS = 8

_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_lock = threading.Lock()


def run_soon(fn: Callable[[], Any], *, name: str, nice: int = 0) -> concurrent.futures.Future[Any]:
    """Run ``fn()`` in a kept thread named ``name`` while it runs, whose nice value is raised
    by ``nice`` (Linux: per thread); returns its future (an exception ``fn`` raises is only
    kept there)."""
    with _lock:
        pool = _pools.get(nice)
        if pool is None:
            pool = _pools[nice] = concurrent.futures.ThreadPoolExecutor(
                MAX_THREADS, thread_name_prefix=IDLE, initializer=lower_priority, initargs=(nice,)
            )
    try:
        return pool.submit(_named, fn, name)
    except RuntimeError:  # the interpreter is exiting (a save finished at exit): no new work taken
        return run_here(fn)


def run_here(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Run ``fn(*args)`` in the caller, its outcome in a future as a pool would give it: the
    work a pool refuses once the interpreter exits (a save finishing at exit still runs)."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - delivered through the future, as the pool would
        done.set_exception(e)
    return done


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: per thread); elsewhere, nothing."""
    if not nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def _named(fn: Callable[[], Any], name: str) -> Any:
    me = threading.current_thread()
    me.name = name
    try:
        return fn()
    finally:
        me.name = IDLE
