"""Run a scenario function on N gloo ranks in fresh processes, with a hard timeout.

Scenarios are plain module-level functions ``fn(rank, world_size, *args)``;
their return values come back to the test, and an exception on any rank fails
the test with that rank's traceback, and a rank that dies without reporting (killed by a
signal) fails it as such. A hung rank is killed after ``timeout``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

# forkserver: torch and tsckpt are imported once in the server, then each rank
# is forked from it, which is several times faster than spawn on a small machine.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "tsckpt", "tests.dist_scenarios"])


# The checkpoint layout of the test (set by the `layout` fixture), and so of the ranks it
# starts: scenarios pass ``layout=rank_layout()`` to what they save.
LAYOUT_ENV = "TSCKPT_TEST_LAYOUT"


def rank_layout() -> str:
    """The checkpoint layout a scenario running on ranks of :func:`run_ranks` saves in."""
    return os.environ[LAYOUT_ENV]


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port for a server that cannot be given port 0 (jax.distributed's coordinator, a gRPC
    server), reserved while the context lasts: bound here with SO_REUSEPORT and never listened
    on, so only another socket of this user that sets SO_REUSEPORT too (as gRPC's do) can bind
    it, and no other test or job takes it meanwhile. Ranks of torch.distributed rendezvous
    through :func:`rendezvous` instead."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def rendezvous() -> Any:
    """The store one job's ranks rendezvous through: a TCPStore this process serves on a
    port the kernel chose (port 0), held until the store is dropped, so no other job or test
    can take it (as it could a port found free and bound again later by rank 0). Pass its
    ``port`` to the ranks, which :func:`join` it; it outlives any rank killed meanwhile."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=default_pg_timeout)


def join(port: int, rank: int, world: int, backend: str = "gloo") -> None:
    """In a rank: init_process_group through the :func:`rendezvous` store at ``port``."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=default_pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], q: Any, layout: str,
    backend: str = "gloo",
) -> None:
    # forked from the fork server, a rank has the server's environment, not the test's
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    os.environ[LAYOUT_ENV] = layout
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    try:
        if backend == "nccl":  # one GPU per rank
            import torch

            torch.cuda.set_device(rank)
        join(port, rank, world, backend)
        result = fn(rank, world, *args)
        q.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - sent to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        q.close()
        q.join_thread()  # flush the result before skipping teardown
        # skip interpreter teardown: gloo's destructors can abort at exit
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120, layout: str | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on ``world`` ranks; return each rank's result, or raise with the failures.
    ``backend`` is the default group's (``"nccl"``: rank r uses GPU r).
    ``layout`` is the checkpoint layout scenarios read with :func:`rank_layout` (default: the
    `layout` fixture's, else plain)."""
    store = rendezvous()  # served until the ranks are done
    port = store.port
    q = _CTX.Queue()
    layout = layout or os.environ.get(LAYOUT_ENV, "plain")
    procs = [
        _CTX.Process(target=_entry, args=(fn, r, world, port, args, q, layout, backend), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        _collect(q, procs, results, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del store
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors:
        raise RankError(errors, {r: v for r, (s, v) in results.items() if s == "ok"})
    return [results[r][1] for r in range(world)]


def _collect(q: Any, procs: list[Any], results: dict[int, tuple[str, Any]], timeout: float) -> None:
    """Fill ``results`` with each rank's report; a rank that exited without one (killed by
    a signal) is reported as an error; raise TimeoutError when some rank hangs."""
    deadline = time.monotonic() + timeout
    gone: set[int] = set()  # ranks seen exited without a report, one poll ago
    while len(results) < len(procs):
        try:
            rank, status, value = q.get(timeout=0.2)
            results[rank] = (status, value)
            continue
        except queue.Empty:
            pass
        for r in gone - set(results):  # exited a whole poll ago: its report, if any, has arrived
            results[r] = ("error", f"died without reporting (exit code {procs[r].exitcode})")
        gone = {r for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(results))
            raise TimeoutError(f"ranks {missing} did not finish in {timeout}s")


class RankError(Exception):
    """One or more ranks raised or died; ``errors`` maps rank -> message with traceback,
    ``results`` the ranks that finished to what they returned."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any] | None = None) -> None:
        self.errors = errors
        self.results = results or {}
        super().__init__("\n".join(f"--- rank {r}: {m}" for r, m in sorted(errors.items())))
