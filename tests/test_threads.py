"""Workers run work inline once the interpreter refuses new threads (a save finishing at exit)."""

import concurrent.futures
import threading

import pytest

from tsckpt._codec.threads import Workers, shared


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
