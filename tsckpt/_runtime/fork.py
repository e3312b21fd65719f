"""Refusing to run in a process forked after tsckpt was used.

TensorStore runs its I/O on thread pools, and threads do not survive
``fork()``: a forked child that calls into TensorStore after its parent used it
is aborted by TensorStore's own guard (SIGABRT, "fork() use detected"), which
kills a DataLoader worker or a ``multiprocessing`` child with no Python error.
tsckpt notes when this process first uses it (:func:`enter`, at every verb and
every lazy read), and a child forked after that raises
:class:`ForkedProcessError` at its first tsckpt call instead, naming the fix.
"""

from __future__ import annotations

import os

from .._errors import ForkedProcessError

_used = False  # this process has called tsckpt (so TensorStore's threads may be running)
_forked_after_use = False  # this process is a child forked after its parent used tsckpt


def _after_fork_in_child() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _used


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def enter(what: str) -> None:
    """Called as ``what`` starts: raise in a child forked after tsckpt ran in its parent."""
    global _used
    if _forked_after_use:
        raise ForkedProcessError(
            f"{what}: this process was forked from one that had already used tsckpt, and TensorStore's "
            "threads do not survive fork() (calling it here would abort the process). Start worker "
            "processes with the 'spawn' or 'forkserver' start method (multiprocessing.get_context('spawn'), "
            "DataLoader(multiprocessing_context='spawn')), or fork them before the first tsckpt call"
        )
    _used = True
