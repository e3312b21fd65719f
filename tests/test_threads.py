"""Workers run work inline once the interpreter refuses new threads (a save finishing at exit)."""

import concurrent.futures
import threading

import pytest

from tsckpt._codec.threads import Workers


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
