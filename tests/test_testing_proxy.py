"""publisher/testing/proxy.py: bytes counted in both directions, and, with ``rate``, a link of that speed."""

from __future__ import annotations

import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from publisher.testing.proxy import CountingProxy

BODY = 3 * (1 << 20)


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self.send_response(200)
        self.send_header("Content-Length", str(BODY))
        self.end_headers()
        self.wfile.write(b"x" * BODY)

    def do_PUT(self) -> None:  # noqa: N802 - stdlib name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


def _transfer(url: str) -> float:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    started = time.monotonic()
    assert len(opener.open(f"{url}/files/a", timeout=60).read()) == BODY
    opener.open(urllib.request.Request(f"{url}/files/b", data=b"y" * BODY, method="PUT"), timeout=60).read()
    return time.monotonic() - started


def test_counts_and_paces_both_directions() -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{upstream.server_address[1]}"
        with CountingProxy(url) as proxy:
            _transfer(proxy.url)
            want = {("GET", "files"): [1, 0, BODY], ("PUT", "files"): [1, BODY, 0]}
            deadline = time.monotonic() + 10  # a request is counted once its response is sent: the client may be faster
            while proxy.totals() != want and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proxy.totals() == want
        rate = 4 * (1 << 20)  # 3 MiB down then 3 MiB up at 4 MiB/s each way: at least 1.5 s minus one chunk's burst
        with CountingProxy(url, rate=rate) as proxy:
            seconds = _transfer(proxy.url)
        assert seconds >= 2 * (BODY - (1 << 20)) / rate, seconds  # a lower bound: a slow machine only adds to it
    finally:
        upstream.shutdown()
        upstream.server_close()
