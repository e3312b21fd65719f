"""tsckpt/_runtime/threads.py: short jobs in kept threads, named while they run, niced where asked."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tsckpt._runtime.threads import IDLE, run_soon


def _seen() -> tuple[str, int]:
    me = threading.current_thread()
    return me.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_a_job_runs_named_and_niced_as_asked_and_the_threads_are_kept():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    name, nice = run_soon(_seen, name="tsckpt-test-job").result(timeout=30)
    assert name == "tsckpt-test-job" and nice == own
    name, nice = run_soon(_seen, name="tsckpt-test-niced", nice=5).result(timeout=30)
    assert name == "tsckpt-test-niced" and nice == min(own + 5, 19)
    assert not [t for t in threading.enumerate() if t.name.startswith("tsckpt-test-")]  # idle again
    before = {t.ident for t in threading.enumerate() if t.name == IDLE}
    run_soon(_seen, name="tsckpt-test-job").result(timeout=30)
    assert {t.ident for t in threading.enumerate() if t.name == IDLE} == before  # no new thread


def test_an_error_stays_in_the_jobs_future():
    def fail() -> None:
        raise ValueError("the job's own")

    with pytest.raises(ValueError, match="the job's own"):
        run_soon(fail, name="tsckpt-test-fail").result(timeout=30)
