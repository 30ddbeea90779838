"""A byte-counting HTTP proxy on loopback: put it between a client and the loopback Hub to measure the traffic.

    with CountingProxy("http://127.0.0.1:8000") as proxy:   # HF_ENDPOINT=proxy.url
        ...
    proxy.totals()   # {(method, kind): [requests, request body bytes, response body bytes]}

Every request is forwarded as is (the ``Host`` header too, so URLs the Hub hands back point at the proxy) over one
upstream keep-alive connection per client connection, and both bodies are streamed through a 1 MiB buffer and
counted. ``kind`` is what ``classify(method, path)`` says (default: the first path segment). Standard library only.

``rate`` (bytes per second) makes it a link of that speed in each direction, shared by every connection (and by
another proxy given the same ``link``): request
bodies (uploads) and response bodies (downloads) are each paced to at most ``rate`` on average (a burst of one
chunk), as a runner's network link would be (benchmarks/bench_publish.py ``--bandwidth``).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

CHUNK = 1 << 20
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class _Pace:
    """One direction of a link of ``rate`` bytes per second: ``take(n)`` returns when n more bytes may have passed."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.start: float | None = None
        self.passed = 0

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            if self.start is None or now - (self.start + self.passed / self.rate) > 1.0:
                self.start, self.passed = now, 0  # idle for over a second: a link does not save up unused bandwidth
            self.passed += n
            due = self.start + self.passed / self.rate
        if due > now:
            time.sleep(due - now)


class Link:
    """A link of ``rate`` bytes per second each way; proxies given the same Link share it (the Hub and its storage
    bridge are two origins behind one network link)."""

    def __init__(self, rate: float | None) -> None:
        self.up, self.down = _Pace(rate), _Pace(rate)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as the loopback Hub: no delayed-ACK stall between a response's headers and body
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    _conn: http.client.HTTPConnection | None = None

    def _upstream(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.server.host, self.server.port, timeout=3600)
        return self._conn

    def _forward(self) -> None:
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        length = int(self.headers.get("Content-Length") or 0)
        sent = 0
        conn = self._upstream()
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for key, value in self.headers.items():
                if key.lower() not in _HOP and key.lower() != "content-length":
                    conn.putheader(key, value)
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            elif length or self.command in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(length))
            conn.endheaders()
            if chunked:
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        conn.send(b"0\r\n\r\n")
                        break
                    data = self.rfile.read(size)
                    self.rfile.read(2)
                    self.server.up.take(len(data))
                    conn.send(b"%x\r\n" % len(data) + data + b"\r\n")
                    sent += len(data)
            else:
                left = length
                while left:
                    data = self.rfile.read(min(CHUNK, left))
                    if not data:
                        raise ConnectionError("client closed the connection mid-body")
                    self.server.up.take(len(data))
                    conn.send(data)
                    left -= len(data)
                    sent += len(data)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            self._conn = None
            self.close_connection = True
            self.server.count(self.command, self.path, sent, 0)
            return
        self.send_response_only(resp.status, resp.reason)
        for key, value in resp.getheaders():
            if key.lower() not in _HOP:
                self.send_header(key, value)
        self.end_headers()
        received = 0
        try:
            while self.command != "HEAD":
                data = resp.read(CHUNK)
                if not data:
                    break
                self.server.down.take(len(data))
                self.wfile.write(data)
                received += len(data)
        except OSError:
            self.close_connection = True
        finally:
            if resp.will_close:
                self._conn = None
            self.server.count(self.command, self.path, sent, received)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _forward


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, upstream: str, classify: Callable[[str, str], str], link: Link) -> None:
        split = urlsplit(upstream)
        self.host, self.port = split.hostname or "127.0.0.1", split.port or 80
        self.classify = classify
        self.up, self.down = link.up, link.down
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, str], list[int]] = {}
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up (a stopped upload, a closed pool) is not an error of the proxy

    def count(self, method: str, path: str, sent: int, received: int) -> None:
        key = (method, self.classify(method, path))
        with self.lock:
            row = self.counts.setdefault(key, [0, 0, 0])
            row[0] += 1
            row[1] += sent
            row[2] += received


class CountingProxy:
    def __init__(self, upstream: str, classify: Callable[[str, str], str] | None = None, rate: float | None = None,
                 link: Link | None = None) -> None:
        self.link = link or Link(rate)
        self._server = _Server(upstream, classify or (lambda method, path: path.split("/")[1] if "/" in path else path),
                               self.link)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)

    def start(self) -> CountingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def totals(self) -> dict[tuple[str, str], list[int]]:
        with self._server.lock:
            return {k: list(v) for k, v in self._server.counts.items()}

    def reset(self) -> None:
        with self._server.lock:
            self._server.counts.clear()

    def __enter__(self) -> CountingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
