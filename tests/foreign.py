"""Helpers for tests of other libraries' checkpoints made hostile: compressed data that
decodes to far more than it stores, and running a reader in a process whose address space
is capped, so that a reader that allocates without bound fails there, not in the test runner."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_BLOCK = 128 << 10  # the largest block a zstd frame may hold
_ZSTD_RLE = 1  # block type: one byte, repeated


def zstd_zeros(n: int) -> bytes:
    """A zstd frame that decodes to ``n`` zero bytes: RLE blocks of 128 KiB, 4 bytes each, so
    4 GiB take 128 KiB. Written by hand (format: RFC 8878) so no zstd library is needed."""
    # frame header: 8-byte content size, single segment (no window descriptor), no checksum
    out = [_ZSTD_MAGIC, bytes([0b1110_0000]), struct.pack("<Q", n)]
    left = n
    while True:
        size = min(_ZSTD_BLOCK, left)
        left -= size
        last = int(left == 0)
        out.append(struct.pack("<I", last | _ZSTD_RLE << 1 | size << 3)[:3] + b"\0")
        if last:
            return b"".join(out)


# Runs in the child: warms the readers on a good checkpoint (thread pools map their stacks on
# first use), then caps the address space at what is mapped plus HEADROOM, then runs BODY.
_CAPPED = """
import json, os, resource, sys
import tsckpt
from tsckpt._cli import main
def mapped():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
warm = sys.argv[1]
if warm:
    reader = tsckpt.open(warm)
    for leaf in reader:
        reader[leaf][...] if isinstance(reader[leaf], tsckpt.LazyArray) else None
limit = mapped() + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
"""

HEADROOM = 1 << 30


def run_capped(body: str, warm: str = "", headroom: int = HEADROOM, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``body`` (Python, with ``tsckpt`` and the CLI's ``main`` imported) in a child whose
    address space is capped at what it maps after reading ``warm`` (a good checkpoint) plus
    ``headroom``. A reader that tries to allocate gigabytes dies or raises there."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__import__("tsckpt").__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pkg, root, os.environ.get("PYTHONPATH", "")])}
    code = _CAPPED + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code, warm, str(headroom)], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL, cwd=root)
