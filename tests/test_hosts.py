"""A host lost in the middle of a distributed save, with two real hosts.

Two network namespaces joined by a veth pair (tests/netns.py) are the two hosts of a job
started as a multi-host job is: one ``torchrun --nnodes 2 --nproc-per-node 2`` per host,
meeting at the first host's address, gloo over the veth, one shared directory. Each of
the four ranks saves a quarter of a 256 MiB array; once the save is in flight (its pending
root written) the second host dies (every process in its namespace SIGKILLed), or a single
rank of it does. The first host's ranks must raise tsckpt's DistributedError naming the
phase and exactly the lost ranks, within seconds (not gloo's raw error, not after the
collectives' 10 minute timeout), and leave no pending root: saving again into the same
directory needs no overwrite=True.

Where network namespaces cannot be created (not root, no ``ip``), the tests skip.

This module is also the ranks' script: ``torchrun ... -m tests.test_hosts DIR OUT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import netns

pytestmark = pytest.mark.slow  # every test here starts processes

ROWS, COLS = 4096, 4096  # float32 rows of each of the 4 ranks: 64 MiB each, 256 MiB in all
PORT = 29500  # a fresh namespace has nothing listening
START_S = 240  # four ranks importing torch on a small machine, then planning
RAISE_WITHIN_S = 20  # far below the collectives' 10 minutes: the loss is seen, not waited out
REPORT_S = 90  # what a test waits at most for the survivors' reports


def _rank_main(directory: str, out: str) -> None:
    """One rank: save its quarter, report how the save ended (out/result-RANK.json)."""
    import torch
    import torch.distributed as dist

    import tsckpt
    import tsckpt._save.protocol as save_mod

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _write(Path(out) / f"pid-{rank}.json", {"pid": os.getpid()})
    write_regions = save_mod._write_regions

    def writing(*args: Any, **kwargs: Any) -> Any:  # the rank has its part of the plan, and writes
        _write(Path(out) / f"writing-{rank}.json", {"at": time.time()})
        return write_regions(*args, **kwargs)

    save_mod._write_regions = writing  # type: ignore[assignment]
    local = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(rank))
    state = {"w": tsckpt.ShardedArray(local, (ROWS * world, COLS), (ROWS * rank, 0))}
    report: dict[str, Any] = {"kind": None}
    try:
        tsckpt.save(directory, state)
    except Exception as e:  # noqa: BLE001 - reported to the test
        report = {"kind": type(e).__name__, "message": str(e), "notes": list(getattr(e, "__notes__", []))}
    report["at"] = time.time()
    _write(Path(out) / f"result-{rank}.json", report)
    os._exit(0)  # gloo's teardown with peers gone can abort; the report is what counts


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _torchrun(hosts: netns.Hosts, host: netns.Host, node_rank: int, directory: str, out: str) -> list[str]:
    env = [
        f"PYTHONPATH={Path(__file__).resolve().parents[1]}",
        f"GLOO_SOCKET_IFNAME={host.interface}",
        "OMP_NUM_THREADS=1",
    ]
    argv = [
        "env", *env, sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node_rank),
        "--master-addr", hosts.first.address, "--master-port", str(PORT),
        "--max-restarts", "0", "--monitor-interval", "60",  # its agent leaves a killed worker's sibling alone
        "-m", "tests.test_hosts", directory, out,
    ]
    return hosts.command(host, argv)


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in sorted(out.glob("host-*.log")))


def _wait_for(what: str, found: Any, procs: list[subprocess.Popen[bytes]], out: Path, seconds: float) -> Any:
    """Poll ``found()`` until it returns something; fail with the hosts' logs when a host's
    torchrun exits first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a host's torchrun exited before {what}:\n{_logs(out)}")
        time.sleep(0.005)
    pytest.fail(f"no {what} within {seconds}s:\n{_logs(out)}")


def _pending(directory: Path) -> bool:
    try:
        return json.loads((directory / "zarr.json").read_text())["attributes"]["tsckpt"]["state"] == "pending"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _writing(out: Path) -> bool:
    """Whether every rank has its part of the plan and writes its data."""
    return all((out / f"writing-{r}.json").exists() for r in range(4))


def _reports(out: Path, ranks: list[int]) -> dict[int, dict[str, Any]] | None:
    paths = {r: out / f"result-{r}.json" for r in ranks}
    if not all(p.exists() for p in paths.values()):
        return None
    return {r: json.loads(p.read_text()) for r, p in paths.items()}


@contextlib.contextmanager
def _job(tmp_path: Path) -> Any:
    """The two hosts, each running its torchrun of the save; everything killed at the end."""
    directory, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    try:
        hosts_cm = netns.two_hosts()
        hosts = hosts_cm.__enter__()
    except netns.Unavailable as e:
        pytest.skip(f"two hosts need network namespaces: {e}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node_rank, host in enumerate((hosts.first, hosts.second)):
            with open(out / f"host-{node_rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    _torchrun(hosts, host, node_rank, str(directory), str(out)),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                ))
        yield hosts, procs, directory, out
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        hosts_cm.__exit__(None, None, None)  # kills what is left in the namespaces, removes them
        for p in procs:
            p.wait(timeout=30)


LOST = re.compile(r"save \((?P<phase>[a-z ]+)\) failed: lost contact with rank\(s\) \[(?P<ranks>[0-9, ]+)\], ")


def _lose(hosts: netns.Hosts, out: Path, lost: str) -> tuple[list[int], list[int]]:
    """Kill ``lost`` ("host": the second host, "rank": rank 2 alone, "first host": the one
    of rank 0 and of the job's store); the ranks gone and the survivors."""
    if lost == "rank":
        os.kill(json.loads((out / "pid-2.json").read_text())["pid"], signal.SIGKILL)
        return [2], [0, 1, 3]
    first = lost == "first host"
    assert len(hosts.kill_all(hosts.first if first else hosts.second)) >= 3, _logs(out)  # torchrun, 2 ranks
    return ([0, 1], [2, 3]) if first else ([2, 3], [0, 1])


def _run_and_lose(tmp_path: Path, lost: str, when: str) -> tuple[Path, dict[int, dict[str, Any]]]:
    """Start the job, lose ``lost`` once the save is ``when``; the directory and the
    survivors' reports, checked: each raised DistributedError naming exactly the ranks
    gone, within RAISE_WITHIN_S."""
    with _job(tmp_path) as (hosts, procs, directory, out):
        in_flight = {"claimed": lambda: _pending(directory), "writing": lambda: _writing(out)}[when]
        _wait_for(f"a save {when}", in_flight, procs, out, START_S)
        gone, survivors = _lose(hosts, out, lost)
        killed_at = time.time()
        alive = procs[1:] if lost == "first host" else procs[:1]
        reports = _wait_for("reports of the survivors", lambda: _reports(out, survivors), alive, out, REPORT_S)
    for rank, report in reports.items():
        assert report["kind"] == "DistributedError", (rank, report)
        match = LOST.match(report["message"])
        assert match is not None, (rank, report["message"])
        assert [int(r) for r in match["ranks"].split(",")] == gone, (rank, report["message"])
        assert re.search(r"\(RuntimeError: .*Connection (closed|reset) by peer", report["message"]), (rank, report)
        assert report["at"] - killed_at < RAISE_WITHIN_S, (rank, report["at"] - killed_at, report["message"])
    return directory, reports


@pytest.mark.parametrize("when", ["claimed", "writing"])
@pytest.mark.parametrize("lost", ["host", "rank"])
def test_host_lost_mid_save_survivors_raise_and_clean_up(tmp_path, lost, when):
    directory, reports = _run_and_lose(tmp_path, lost, when)
    assert "the partial checkpoint was removed, so saving again needs no overwrite=True" in reports[0]["message"]
    assert not (directory / "zarr.json").exists()  # no pending root left behind

    import tsckpt

    again = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    tsckpt.save(str(directory), again)  # no overwrite=True needed
    np.testing.assert_array_equal(tsckpt.restore(str(directory))["w"], again["w"])


def test_host_of_rank_0_lost_mid_save_survivors_raise_and_clean_up(tmp_path):
    """Rank 0's host lost (with the job's store): the survivors raise, and the lowest of
    them removes the save's pending root and data, so saving again needs no overwrite=True."""
    import tsckpt

    directory, reports = _run_and_lose(tmp_path, "first host", "writing")
    assert "rank 0 was lost, and this rank removed the partial checkpoint" in reports[2]["message"], reports[2]
    assert "removed" not in reports[3]["message"], reports[3]
    assert not (directory / "zarr.json").exists()
    again = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    tsckpt.save(str(directory), again)
    np.testing.assert_array_equal(tsckpt.restore(str(directory))["w"], again["w"])


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
