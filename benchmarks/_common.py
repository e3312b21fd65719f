"""What the benchmark scripts share: a description of the machine and code they ran on."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _first(path: str, prefix: str) -> str | None:
    with open(path) as f:
        for line in f:
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return None


def machine_info() -> dict[str, Any]:
    """Date, CPU, memory, library versions, tsckpt commit, and load average."""
    import torch

    mem_kib = (_first("/proc/meminfo", "MemTotal:") or "0 kB").split()[0]
    try:
        rev = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../tsckpt"], capture_output=True, text=True).stdout.strip()
        rev = rev + (" + uncommitted changes to tsckpt/" if dirty else "")
    except OSError:
        rev = "unknown"
    try:
        st_version = version("safetensors")
    except PackageNotFoundError:
        st_version = "not installed"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "mem_gib": int(mem_kib) * 1024 / (1 << 30),
        "cpu": _first("/proc/cpuinfo", "model name") or "unknown",
        "python": platform.python_version(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "tensorstore": version("tensorstore"),
        "safetensors": st_version,
        "tsckpt": version("tsckpt"),
        "tsckpt_rev": rev,
        "load_avg": os.getloadavg(),
    }


RESULTS_MD = os.path.join(HERE, "RESULTS.md")
NOTES = "### Notes"  # kept verbatim when a section is regenerated


def write_section(title: str, body: str) -> None:
    """Replace (or append) the ``title`` section of RESULTS.md, keeping its hand-written Notes."""
    text = open(RESULTS_MD).read() if os.path.exists(RESULTS_MD) else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == title), None)
    notes = ""
    if start is None:
        head, tail = text.rstrip("\n") + "\n\n", ""
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        old = "".join(lines[start:end])
        k = old.find("\n" + NOTES)
        if k >= 0:
            notes = old[k + 1 :].rstrip("\n") + "\n"
        head, tail = "".join(lines[:start]), "".join(lines[end:])
    new = body.rstrip("\n") + "\n" + ("\n" + notes if notes else "")
    with open(RESULTS_MD, "w") as f:
        f.write(head + new + ("\n" + tail if tail else ""))


# ---- measuring one case in a fresh process ---------------------------------------------------


def rss(field: str = "VmRSS:") -> int:
    """Bytes of a /proc/self/status memory field (VmRSS: now, VmHWM: peak since reset_peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Restart VmHWM from the current RSS, so a peak measures one call."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def drop_caches() -> bool:
    """Drop the whole page cache (needs root); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def evict(path: str) -> None:
    """Drop one file's or directory tree's pages from the page cache (no root needed:
    clean pages of a file can always be given up with posix_fadvise)."""
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_child(script: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``script --child SPEC`` in a fresh interpreter; its last stdout line is the JSON result."""
    import json
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{spec}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_parser(doc: str | None, repeats: int) -> "argparse.ArgumentParser":
    """The options every interop benchmark takes (``--child`` runs one case)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small workload, a smoke run")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--dir", default=None, help="where to write (a temporary directory below it)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per case")
    p.add_argument("--write-results", action="store_true", help="rewrite this script's section of RESULTS.md")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p
