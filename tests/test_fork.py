"""A process forked after tsckpt was used gets ForkedProcessError, not TensorStore's SIGABRT."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # every test here starts processes

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    import numpy as np
    import tsckpt

    reader = None  # opened before forking: a forked child inherits it

    def child(q, what, d):
        try:
            if what == "restore":
                q.put(("ok", tsckpt.restore(d)["a"].tolist()))
            elif what == "read":
                q.put(("ok", reader["a"][1:3].tolist()))
            else:
                tsckpt.save(d + "-child", {"a": np.arange(2)})
                q.put(("ok", "saved"))
        except tsckpt.ForkedProcessError as e:
            q.put(("ForkedProcessError", str(e)))

    def run(what, d, start):
        ctx = multiprocessing.get_context(start)
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q, what, d))
        p.start()
        p.join(60)
        print(what, p.exitcode, q.get(timeout=5) if p.exitcode == 0 else None, flush=True)

    if __name__ == "__main__":
        d, start = sys.argv[1], sys.argv[2]
        run("save", d, start)  # nothing of tsckpt ran in this process yet: the child may use it
        tsckpt.save(d, {"a": np.arange(4)})
        reader = tsckpt.open(d)
        run("restore", d, start)
        if start == "fork":
            run("read", d, start)
    """
)


def _run(tmp_path, start: str) -> list[str]:
    script = tmp_path / "forking.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck"), start], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_child_forked_after_use_raises_and_says_to_spawn(tmp_path):
    lines = _run(tmp_path, "fork")
    assert lines[0] == "save 0 ('ok', 'saved')"  # forked before tsckpt ran here: fine
    for line, what in zip(lines[1:], ["restore", "read"]):
        assert line.startswith(f"{what} 0 ('ForkedProcessError', "), line  # exit code 0: no SIGABRT
        assert "forked from one that had already used tsckpt" in line and "'spawn'" in line
    assert "tsckpt.restore: this process was forked" in lines[1]
    assert "reading 'a': this process was forked" in lines[2]


def test_a_spawned_child_reads_as_usual(tmp_path):
    lines = _run(tmp_path, "spawn")
    assert lines == ["save 0 ('ok', 'saved')", "restore 0 ('ok', [0, 1, 2, 3])"]
