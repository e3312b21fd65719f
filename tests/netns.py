"""Two hosts on one machine: two network namespaces joined by a veth pair.

Each "host" is a network namespace with one end of a veth pair, addressed 10.x.y.1 and
10.x.y.2; processes started in it (:meth:`Hosts.command`) reach the other host only over
the veth, as two machines reach each other over their network, while sharing this
machine's file system (the "shared directory" of a multi-host job). Killing every process
of one namespace (:meth:`Hosts.kill_all`) is that host dying: the kernel closes their
connections, and the peers see them closed.

Creating namespaces needs root (CAP_NET_ADMIN) and the ``ip`` command: :func:`two_hosts`
raises :class:`Unavailable`, with the reason, where they cannot be created, so a test can
skip. Everything it creates is removed when the ``with`` block ends, whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

IP_TIMEOUT_S = 10


class Unavailable(Exception):
    """Network namespaces cannot be created here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Host:
    namespace: str
    interface: str  # its end of the veth pair
    address: str


@dataclasses.dataclass(frozen=True)
class Hosts:
    first: Host
    second: Host

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def pids(self, host: Host) -> list[int]:
        """The processes running in ``host``'s namespace."""
        out = _ip("netns", "pids", host.namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, host: Host) -> list[int]:
        """SIGKILL every process of ``host`` (the host dies); the pids killed."""
        killed = []
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return killed


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise Unavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair, both ends up, with a fresh subnet; removed
    (their processes killed first) on exit. Raises Unavailable where they cannot be made."""
    if shutil.which("ip") is None:
        raise Unavailable("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise Unavailable("creating network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    hosts = Hosts(
        Host(f"tsckpt{tag}a", f"tv{tag}a", f"{subnet}.1"),
        Host(f"tsckpt{tag}b", f"tv{tag}b", f"{subnet}.2"),
    )
    made: list[Host] = []
    try:
        for host in (hosts.first, hosts.second):
            _ip("netns", "add", host.namespace)
            made.append(host)
        _ip("link", "add", hosts.first.interface, "type", "veth", "peer", "name", hosts.second.interface)
        for host in (hosts.first, hosts.second):
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in made:
            hosts.kill_all(host)
            _ip("netns", "del", host.namespace, check=False)  # removes its end of the veth, and so the pair
        _ip("link", "del", hosts.first.interface, check=False)  # in case it never moved into a namespace
