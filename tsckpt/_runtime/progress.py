"""Progress of long operations: a tqdm bar on one rank, and a closing log line on every rank."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

logger = logging.getLogger("tsckpt")


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; bytes below 1 KiB are exact."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


class Progress:
    """Bytes and files done by one operation (``verb`` on ``where``).

    A bar is shown when ``show`` is True, or when it is None and stderr is a
    terminal, and only on rank 0 (other ranks do the same work in step). When
    the operation ends, :meth:`close` logs bytes, files and throughput at INFO
    on the ``tsckpt`` logger, on every rank.
    """

    def __init__(
        self, verb: str, where: Any, *, show: bool | None, rank: int = 0, total: int | None = None, unit: str = "files"
    ) -> None:
        self.verb = verb
        self.unit = unit  # what update()'s counts count (files written, reads)
        self.where = str(where)
        self.rank = rank
        self.nbytes = 0
        self.files = 0
        self._t0 = time.perf_counter()
        self._bar: Any = None
        if rank == 0 and (sys.stderr.isatty() if show is None else show):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=verb, file=sys.stderr, leave=False
            )

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._bar.reset(total=total)
            self._bar.update(self.nbytes)

    def update(self, nbytes: int, files: int = 0) -> None:
        self.nbytes += nbytes
        self.files += files
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self, *, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if failed:
            return
        seconds = max(time.perf_counter() - self._t0, 1e-9)
        logger.info(
            "%s %s: %s%s, %.2f s (%s/s)%s",
            self.verb, self.where, human_bytes(self.nbytes), f" in {self.files} {self.unit}" if self.files else "",
            seconds, human_bytes(self.nbytes / seconds), f", rank {self.rank}" if self.rank else "",
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)
