"""A loopback HTTP proxy between tsckpt and a local S3 server that loses chosen responses.

Each request is forwarded to the server; when ``drop`` says so, the server's response
is thrown away and the client's connection closed, as when a response is lost on the
network after the store applied the request. The client (TensorStore) then retries.
"""

from __future__ import annotations

import dataclasses
import http.client
import socket
import threading
import urllib.parse
from collections.abc import Callable

_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    key: str  # the object key (path without the bucket), unquoted
    headers: dict[str, str]  # lower-cased names

    @property
    def conditional(self) -> bool:
        return "if-match" in self.headers or "if-none-match" in self.headers


class LossyProxy:
    """Forward every request to ``upstream``; lose the response of each request ``drop``
    chooses (called with the request and how many earlier requests it chose)."""

    def __init__(self, upstream: str, bucket: str) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self._bucket = bucket
        self.drop: Callable[[Request], bool] = lambda r: False
        self.limit = 1  # responses lost at most
        self.dropped: list[Request] = []
        self.seen: list[Request] = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))  # a port the kernel chose, held from now on
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def lose(self, when: Callable[[Request], bool], limit: int = 1) -> None:
        """Lose the responses of the first ``limit`` requests ``when`` accepts."""
        with self._lock:
            self.drop, self.limit, self.dropped = when, limit, []

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                raw: list[tuple[str, str]] = []
                while True:
                    h = f.readline().decode("latin-1")
                    if h in ("\r\n", "\n", ""):
                        break
                    name, value = h.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
                    raw.append((name.strip(), value.strip()))
                if headers.get("expect", "").lower() == "100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                if "chunked" in headers.get("transfer-encoding", "").lower():
                    raise NotImplementedError("chunked request bodies")
                body = f.read(int(headers.get("content-length", "0") or 0))
                path = urllib.parse.unquote(urllib.parse.urlparse(target).path)
                key = path.lstrip("/").removeprefix(self._bucket).lstrip("/")
                req = Request(method, key, headers)
                status, reason, out_headers, out = self._forward(method, target, raw, body)
                with self._lock:
                    self.seen.append(req)
                    lose = len(self.dropped) < self.limit and self.drop(req)
                    if lose:
                        self.dropped.append(req)
                if lose:
                    return  # the store applied it; the client never hears
                head = [f"HTTP/1.1 {status} {reason}"]
                head += [f"{n}: {v}" for n, v in out_headers if n.lower() not in _HOP and n.lower() != "content-length"]
                head.append(f"Content-Length: {len(out)}")
                conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (b"" if method == "HEAD" else out))
        except (OSError, ValueError):
            return
        finally:
            f.close()
            conn.close()

    def _forward(self, method: str, target: str, raw: list[tuple[str, str]], body: bytes):
        up = http.client.HTTPConnection(self._host, self._port, timeout=60)
        try:
            up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in raw:
                if name.lower() not in _HOP and name.lower() != "content-length":
                    up.putheader(name, value)
            up.putheader("Content-Length", str(len(body)))
            up.endheaders(body)
            resp = up.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            up.close()
