"""Coordination of a multi-process JAX job (``jax.distributed``) without torch.distributed.

The save and restore protocols exchange only small objects through rank 0 (plus,
rarely, pieces of straddling shards). Here they go through the key-value store of
JAX's coordination service, the service ``jax.distributed.initialize`` starts,
rather than through device collectives: planning never touches device memory,
never interleaves with the training step's collectives, and needs no cross-process
collectives on CPU devices. jax exposes that store only through its private
``global_state`` (as Orbax uses it too); this module is its one user in tsckpt.

Every key is read by exactly one process, which deletes it once read. Operations
are numbered per channel in the order every process calls them (as collectives
are), so the keys of successive operations never meet. Values are pickled, as
torch.distributed's object collectives do, and cut into pieces of at most
:data:`PIECE_BYTES`.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import threading
from typing import Any

import numpy as np

from .._errors import DistributedError

PIECE_BYTES = 1 << 20  # well under the coordination service's message limit
_counters: dict[str, int] = {}


def _client() -> Any:
    """The coordination service's client when jax.distributed is initialized, else None."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return None
    from jax._src import distributed

    return distributed.global_state.client


class JaxCoordinator:
    """The processes of a jax.distributed job (rank: ``jax.process_index()``)."""

    def __init__(self, client: Any, timeout: datetime.timedelta, channel: str) -> None:
        import jax

        self.rank = jax.process_index()
        self.world_size = jax.process_count()
        self._client = client
        self._ms = max(int(timeout.total_seconds() * 1000), 1)
        self._channel = channel
        self._counters = _counters  # this process's numbering, continued by every coordinator it makes

    def _op(self) -> str:
        """The key prefix of the next operation of this channel (the same on every process)."""
        n = self._counters.get(self._channel, 0)
        self._counters[self._channel] = n + 1
        return f"tsckpt/{self._channel}/{n}"

    def _put(self, key: str, data: bytes) -> None:
        pieces = [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)] or [b""]
        for i, piece in enumerate(pieces):
            self._client.key_value_set_bytes(f"{key}/{i}", piece)
        self._client.key_value_set(f"{key}/n", str(len(pieces)))

    def _take(self, key: str, src: int) -> bytes:
        try:
            n = int(self._client.blocking_key_value_get(f"{key}/n", self._ms))
            pieces = [self._client.blocking_key_value_get_bytes(f"{key}/{i}", self._ms) for i in range(n)]
        except Exception as e:  # noqa: BLE001 - jax raises its runtime error type for a timeout
            raise DistributedError(
                f"process {self.rank}: no answer from process {src} of the jax.distributed job within "
                f"{self._ms / 1000:.0f} s ({e}); did every process call the same tsckpt verb?"
            ) from e
        for i in range(n):
            self._client.key_value_delete(f"{key}/{i}")
        self._client.key_value_delete(f"{key}/n")
        return b"".join(pieces)

    def gather(self, obj: Any) -> list[Any] | None:
        op = self._op()
        if self.rank != 0:
            self._put(f"{op}/{self.rank}", pickle.dumps(obj))
            return None
        return [obj] + [pickle.loads(self._take(f"{op}/{r}", r)) for r in range(1, self.world_size)]

    def scatter(self, objs: list[Any] | None) -> Any:
        op = self._op()
        if self.rank != 0:
            return pickle.loads(self._take(f"{op}/{self.rank}", 0))
        if objs is None or len(objs) != self.world_size:
            raise ValueError(f"scatter from rank 0 needs one object per rank ({self.world_size})")
        for r in range(1, self.world_size):
            self._put(f"{op}/{r}", pickle.dumps(objs[r]))
        return objs[0]

    def all_gather(self, obj: Any) -> list[Any]:
        everyone = self.gather(obj)
        return self.scatter([everyone] * self.world_size if self.rank == 0 else None)

    def most(self, values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(max(column) for column in zip(*self.all_gather(tuple(values))))

    def unreachable(self) -> list[int]:
        """Which processes are gone cannot be told through the key-value store without waiting
        for each (a silent peer is already a DistributedError after the timeout): none named."""
        return []

    def exchange(
        self, sends: list[tuple[int, int, np.ndarray]], recvs: list[tuple[int, int, int]]
    ) -> dict[int, np.ndarray]:
        """Point-to-point bytes: ``sends`` are (dst, tag, array), ``recvs`` (src, tag, nbytes). Only
        the processes with transfers call it, so it takes no operation number: its keys use the
        number the next operation will take, which no earlier or later one uses for transfers."""
        base = f"tsckpt/{self._channel}/{self._counters.get(self._channel, 0)}x"
        for _, tag, arr in sends:
            self._put(f"{base}/{tag}", np.ascontiguousarray(arr).reshape(-1).view(np.uint8).tobytes())
        out = {}
        for src, tag, nbytes in recvs:
            got = np.frombuffer(self._take(f"{base}/{tag}", src), np.uint8)
            if got.size != nbytes:
                raise DistributedError(f"process {self.rank}: transfer {tag} from process {src} has {got.size} bytes, "
                                       f"{nbytes} expected")
            out[tag] = got.copy()
        return out


def coordinator(timeout: datetime.timedelta) -> JaxCoordinator | None:
    """A coordinator over the processes of the jax.distributed job, None when there is none (jax
    not imported, not initialized, or one process). Saves from other threads than the main one
    (async saves) number their operations on a channel of their own."""
    client = _client()
    if client is None:
        return None
    channel = "main" if threading.current_thread() is threading.main_thread() else "background"
    coord = JaxCoordinator(client, timeout, channel)
    return coord if coord.world_size > 1 else None
