"""tsckpt/_codec/threads.py: workers run work inline once the interpreter refuses new threads (a
save finishing at exit); tsckpt/_runtime/threads.py: short jobs in kept threads, named while they
run, niced where asked, inline once refused."""

import concurrent.futures
import os
import sys
import threading

import pytest

from tsckpt._codec.threads import Workers, shared
from tsckpt._runtime import threads as runtime_threads
from tsckpt._runtime.threads import IDLE, run_soon


def test_work_runs_on_the_pool_threads():
    w = Workers(2, "t")
    names = [w.submit(lambda: threading.current_thread().name).result() for _ in range(3)]
    w.shutdown()
    assert all(n.startswith("t_") for n in names)


def test_a_refused_pool_runs_the_work_inline(monkeypatch):
    def refuse(self, fn, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", refuse)
    w = Workers(2, "t")
    here = threading.current_thread().name
    assert w.submit(lambda x: (x * 2, threading.current_thread().name), 21).result() == (42, here)
    failed = w.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    w.shutdown()


def test_the_shared_pool_is_made_once_and_keeps_its_threads():
    pool = shared(2, "tsckpt-test-shared")
    assert shared(2, "tsckpt-test-shared") is pool and shared(3, "tsckpt-test-shared") is not pool
    names = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(20)}
    again = {pool.submit(lambda: threading.current_thread().name).result() for _ in range(20)}
    assert names | again <= {f"tsckpt-test-shared_{i}" for i in range(2)}


def test_settle_drops_work_not_started_and_waits_for_the_rest():
    pool = shared(1, "tsckpt-test-settle")
    gate, ran = threading.Event(), []
    first = pool.submit(lambda: (gate.wait(5), ran.append(1)))
    rest = [pool.submit(ran.append, 2) for _ in range(3)]
    threading.Timer(0.2, gate.set).start()
    Workers.settle([first, *rest])
    assert ran == [1] and first.done() and all(f.cancelled() for f in rest)


def _seen() -> tuple[str, int]:
    me = threading.current_thread()
    return me.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_a_job_runs_named_and_niced_as_asked_and_the_threads_are_kept():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    name, nice = run_soon(_seen, name="tsckpt-runsoon-job").result(timeout=30)
    assert name == "tsckpt-runsoon-job" and nice == own
    name, nice = run_soon(_seen, name="tsckpt-runsoon-niced", nice=5).result(timeout=30)
    assert name == "tsckpt-runsoon-niced" and nice == min(own + 5, 19)
    assert not [t for t in threading.enumerate() if t.name.startswith("tsckpt-runsoon-")]  # idle again
    before = {t.ident for t in threading.enumerate() if t.name == IDLE}
    run_soon(_seen, name="tsckpt-runsoon-job").result(timeout=30)
    assert {t.ident for t in threading.enumerate() if t.name == IDLE} == before  # no new thread


def test_an_error_stays_in_the_jobs_future():
    def fail() -> None:
        raise ValueError("the job's own")

    with pytest.raises(ValueError, match="the job's own"):
        run_soon(fail, name="tsckpt-runsoon-fail").result(timeout=30)


def test_a_job_runs_in_the_caller_once_the_pool_is_refused(monkeypatch):
    def refuse(self, fn, *args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    run_soon(lambda: None, name="tsckpt-runsoon-job").result(timeout=30)  # the pool exists
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", refuse)
    assert run_soon(threading.get_ident, name="tsckpt-runsoon-job").result(timeout=0) == threading.get_ident()
    assert runtime_threads.IDLE == IDLE
