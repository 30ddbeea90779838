"""HTTP plumbing for the loopback Hub: a ThreadingHTTPServer bound to 127.0.0.1, plus the Python API.

`HubServer` runs it in a background thread of the current process (fast, and tests can poke at the
store and faults directly); `spawn_server` runs it as a subprocess (`python -m publisher.testing.hubserver`)
so a test can kill it in the middle of a push and restart it on the same data folder.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from publisher.testing.hubserver.access import parse_type_prefixed
from publisher.testing.hubserver.app import HubApp
from publisher.testing.hubserver.bridge import BridgeApp
from publisher.testing.hubserver.jobs import JobRunner
from publisher.testing.hubserver.storage import HubError, Store
from publisher.testing.hubserver.wire import Request, Response, error_response

HOST = "127.0.0.1"  # never bind anything else: this server has no TLS and an unauthenticated admin API
_CHUNK = 1 << 20


class _BodyReader:
    """Reads a request body framed by Content-Length or Transfer-Encoding: chunked (httpx uses both)."""

    def __init__(self, rfile: Any, headers: Any) -> None:  # an email.message.Message: a mapping in behaviour
        self.rfile = rfile
        self.chunked = "chunked" in (headers.get("Transfer-Encoding") or "").lower()
        length = headers.get("Content-Length") or "0"
        self.malformed = not self.chunked and not length.strip().isdigit()
        self.remaining = 0 if self.chunked or self.malformed else int(length)
        self.finished = not self.chunked and self.remaining == 0
        self._cache: bytes | None = None

    def iter_chunks(self) -> Iterator[bytes]:
        if self.chunked:
            while not self.finished:
                line = self.rfile.readline(65537)
                if not line:
                    raise ConnectionError("client closed the connection mid-body")
                try:
                    n = int(line.split(b";")[0].strip(), 16)
                except ValueError:  # unrecoverable framing: ConnectionError makes the handler hang up
                    raise ConnectionError(f"malformed chunk size line {line[:40]!r}") from None
                if n == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # skip trailers
                    self.finished = True
                    return
                data = self.rfile.read(n)
                if len(data) < n:
                    raise ConnectionError("client closed the connection mid-chunk")
                self.rfile.read(2)
                yield data
        while self.remaining > 0:
            data = self.rfile.read(min(_CHUNK, self.remaining))
            if not data:
                raise ConnectionError("client closed the connection mid-body")
            self.remaining -= len(data)
            yield data
        self.finished = True

    def read_all(self) -> bytes:
        if self._cache is None:
            self._cache = b"".join(self.iter_chunks())
        return self._cache


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server_version = "hf-ao-hubserver/0.1"
    # TCP_NODELAY on each connection, as the Hub's front servers have it: the handler writes the headers and the body
    # in separate sends, and with Nagle's algorithm on, the body waited for the client's delayed ACK (about 40 ms on
    # Linux) on every keep-alive request: a repo_exists() took 44 ms here instead of 2 to 4 ms
    disable_nagle_algorithm = True
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        self.server.track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        if self.server.verbose:
            super().log_message(format, *args)

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        reader = _BodyReader(self.rfile, self.headers)
        req = Request(self.command, split.path, parse_qs(split.query, keep_blank_values=True), self.headers,
                      f"http://{self.headers.get('Host') or self.server.url[7:]}", reader.read_all,
                      reader.iter_chunks)
        self.server.app.seen.append((self.command, split.path, self.headers.get("Range")))
        if reader.malformed:
            self.close_connection = True
            self._write(req, error_response(HubError(400, "Invalid Content-Length header")))
            return
        try:
            resp = self.server.app.handle(req)
        except (ConnectionError, TimeoutError):  # the client went away mid-body: nobody to answer
            self.close_connection = True
            return
        except Exception as exc:  # a bug must answer 500 (with a message), not kill the connection silently
            traceback.print_exc()
            resp = error_response(HubError(500, f"Internal server error: {exc!r}"))
        if resp.drop:
            self._abort()
            return
        if not reader.finished:  # keep-alive needs the unread body consumed before the next request
            try:
                for _ in reader.iter_chunks():
                    pass
            except (ConnectionError, OSError):
                self.close_connection = True
                return
        try:
            self._write(req, resp)
        except (ConnectionError, OSError):
            self.close_connection = True

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

    def _abort(self) -> None:
        """Drop the connection without an answer (fault injection), like a network cut mid-upload."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _write(self, req: Request, resp: Response) -> None:
        if resp.stream is not None:
            self._write_stream(resp)
            return
        start, length = 0, len(resp.body)
        if resp.file is not None:
            start, end = resp.file_range or (0, resp.file.stat().st_size - 1)
            length = end - start + 1
        elif resp.virtual is not None and resp.file_range is not None:
            start, end = resp.file_range
            length = end - start + 1
        fault = resp.body_fault
        send = length  # body bytes actually sent (a fault may send fewer)
        if fault is not None and fault.kind in ("truncate", "drop_body"):
            send = min(length, fault.offset)
        self.send_response(resp.status)
        for key, value in resp.headers.items():
            self.send_header(key, value)
        # a truncated body says so in its Content-Length (a short but complete answer); a dropped one announces all
        self.send_header("Content-Length", str(send if fault is not None and fault.kind == "truncate" else length))
        self.end_headers()
        if req.method == "HEAD":
            return
        if resp.virtual is None and resp.file is None:
            self.wfile.write(resp.body)
            return
        pos = start
        for data in self._body(resp, start, send):
            if fault is not None and fault.kind == "flip" and pos <= fault.offset < pos + len(data):
                changed = bytearray(data)
                changed[fault.offset - pos] ^= 0xFF
                data = bytes(changed)
            self.wfile.write(data)
            pos += len(data)
        if fault is not None and fault.kind == "drop_body":
            self.wfile.flush()
            self._abort()  # the announced length never arrives

    @staticmethod
    def _body(resp: Response, start: int, send: int) -> Iterator[bytes]:
        """``send`` bytes of the file (or of the virtual file, computed as they go) from ``start``."""
        if resp.virtual is not None:
            left = send
            for data in resp.virtual(start, start + send - 1) if send else ():
                yield data[:left]
                left -= len(data)
                if left <= 0:
                    return
            return
        assert resp.file is not None
        left = send
        with open(resp.file, "rb") as fh:
            fh.seek(start)
            while left > 0:
                data = fh.read(min(_CHUNK, left))
                if not data:
                    return
                yield data
                left -= len(data)

    def _write_stream(self, resp: Response) -> None:
        """A body of unknown length (server-sent events): chunked, each piece sent as soon as it is made."""
        assert resp.stream is not None
        self.send_response(resp.status)
        for key, value in resp.headers.items():
            self.send_header(key, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in resp.stream:
            if piece:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # the client opens several upload connections at once
    allow_reuse_address = True  # a restarted server can take the same --port right away

    def __init__(self, port: int, app: HubApp | BridgeApp, verbose: bool) -> None:
        self.app, self.verbose = app, verbose
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((HOST, port), _Handler)
        self.url = f"http://{HOST}:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up (a download it stopped reading, an interrupted run) is not a server bug: no traceback.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    def track(self, conn: socket.socket, alive: bool) -> None:
        with self._conns_lock:
            (self._conns.add if alive else self._conns.discard)(conn)

    def close_all(self) -> None:
        # Keep-alive handler threads outlive shutdown(); cut them so a stopped server really stops answering.
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HubServer:
    """In-process loopback Hub. `with HubServer(tmp, tokens={"tok_alice": "alice"}) as hub: hub.url`.

    ``scopes``: token -> "read", or a fine-grained token's ``fineGrained`` object (access.py); other tokens write.
    ``multipart_threshold``: LFS objects above this many bytes are uploaded in parts of ``multipart_chunk`` bytes
    (None: never). LFS files are served through a second origin, the storage bridge (``bridge_url``)."""

    def __init__(self, data_dir: str | os.PathLike[str], tokens: Mapping[str, str] | None = None,
                 orgs: Mapping[str, Any] | None = None, *, port: int = 0,
                 gated: Mapping[str, Any] | None = None, verbose: bool = False, job_python: str | None = None,
                 discard_lfs: bool = False, scopes: Mapping[str, Any] | None = None,
                 multipart_threshold: int | None = None, multipart_chunk: int | None = None, bridge_port: int = 0,
                 bridge_public_url: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        # the bridge's port, and its URL in the redirects the Hub hands out (a proxy in front of it: benchmarks)
        self.bridge_port, self.bridge_public_url = bridge_port, bridge_public_url
        self.store = Store(self.data_dir, discard_lfs)
        self.app = HubApp(self.store, tokens, orgs, gated, scopes)
        self.app.runner = JobRunner(self.data_dir / "_jobs", job_python)
        self.app.multipart_threshold = multipart_threshold
        if multipart_chunk is not None:
            self.app.multipart_chunk = multipart_chunk
        self.bridge_app = BridgeApp(self.store, self.app.faults, self.app.seen)
        self.port, self.verbose = port, verbose
        self._httpd: _HTTPServer | None = None
        self._bridge: _HTTPServer | None = None
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("HubServer is not started")
        return self._httpd.url

    @property
    def bridge_url(self) -> str:
        if self._bridge is None:
            raise RuntimeError("HubServer is not started")
        return self._bridge.url

    def bind(self) -> str:
        if self._httpd is None:
            self._bridge = _HTTPServer(self.bridge_port, self.bridge_app, self.verbose)
            self._httpd = _HTTPServer(self.port, self.app, self.verbose)
            self.app.bridge_url = self.bridge_public_url or self._bridge.url
        return self._httpd.url

    def _serve_in_thread(self, httpd: _HTTPServer, name: str) -> None:
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self) -> str:
        """Serve in daemon threads; returns the base URL (use it as HF_ENDPOINT)."""
        self.bind()
        assert self._httpd is not None and self._bridge is not None
        self._serve_in_thread(self._bridge, "hubserver-bridge")
        self._serve_in_thread(self._httpd, "hubserver")
        return self.url

    def serve_forever(self) -> None:
        """Serve in the calling thread (the CLI); returns after stop() or KeyboardInterrupt."""
        self.bind()
        assert self._httpd is not None and self._bridge is not None
        self._serve_in_thread(self._bridge, "hubserver-bridge")
        try:
            self._httpd.serve_forever(poll_interval=0.2)
        finally:
            for httpd in (self._bridge, self._httpd):
                if httpd is self._bridge:
                    httpd.shutdown()
                httpd.close_all()
                httpd.server_close()

    def stop(self) -> None:
        self.app.runner.stop_all()
        for httpd in (self._httpd, self._bridge):
            if httpd is None:
                continue
            if self._threads:
                httpd.shutdown()
            httpd.close_all()
            httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
        self._httpd = self._bridge = None
        self._threads = []

    def __enter__(self) -> HubServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- test controls -----------------------------------------------------------------------
    def set_fault(self, **spec: Any) -> None:
        """Same keys as POST /_admin/faults, e.g. set_fault(commit_status=503, count=1)."""
        self.app.faults.add(spec)

    def clear_faults(self) -> None:
        self.app.faults.clear()

    @property
    def faults_fired(self) -> dict[str, int]:
        return self.app.faults.snapshot()["fired"]

    @property
    def requests_delayed_now(self) -> int:
        """How many requests a delay fault holds at this moment (a test's "the client is waiting on that request")."""
        return int(self.app.faults.snapshot()["delaying"])

    def set_gated(self, repo_id: str, granted_users: tuple[str, ...] | list[str] = (), *,
                  repo_type: str = "model", mode: str | bool = "auto") -> None:
        """Gate an existing repo; only its namespace members and `granted_users` may download files."""
        self.app.set_gated(repo_type, repo_id, mode, list(granted_users))

    def add_token(self, token: str, user: str, scope: Any = None) -> None:
        """Accept ``token`` as ``user``; ``scope``: "read" or a fine-grained object (None: a write token)."""
        self.app.tokens[token] = user
        if scope is not None:
            self.app.scopes[token] = scope

    @property
    def jobs(self) -> JobRunner:
        """The Jobs of this Hub: `hub.jobs.get(job_id).process_env`, `hub.jobs.scheduling_s = 5` ..."""
        return self.app.runner


def wait_for_server(url: str, timeout: float = 30.0) -> None:
    """Poll GET /_admin/health until it answers 200 (raises the last error after `timeout` seconds)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    deadline = time.monotonic() + timeout
    while True:
        try:
            with opener.open(f"{url}/_admin/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def spawn_server(data_dir: str | os.PathLike[str], tokens: Mapping[str, str] | None = None,
                 orgs: Mapping[str, Any] | None = None, *, port: int = 0,
                 gated: Mapping[str, Any] | None = None, timeout: float = 30.0,
                 env: Mapping[str, str] | None = None, verbose: bool = False,
                 discard_lfs: bool = False, scopes: Mapping[str, Any] | None = None,
                 multipart_threshold: int | None = None, bridge_port: int = 0,
                 bridge_url: str | None = None) -> tuple[str, subprocess.Popen]:
    """Start `python -m publisher.testing.hubserver` and wait until it answers. Returns (url, process).

    Stop it with proc.terminate()/proc.kill(), then proc.wait(). `tokens` maps token -> user, as in HubServer.
    """
    cmd = [sys.executable, "-m", "publisher.testing.hubserver", "--data", str(data_dir), "--port", str(port)]
    for token, user in (tokens or {}).items():
        cmd += ["--token", f"{user}={token}"]
    for org, users in (orgs or {}).items():
        cmd += ["--org", f"{org}={','.join(users)}"]
    for repo, users in (gated or {}).items():
        parse_type_prefixed(repo)
        cmd += ["--gated", f"{repo}={','.join(users)}" if users else repo]
    if verbose:
        cmd.append("--verbose")
    if discard_lfs:
        cmd.append("--discard-lfs")
    for token, scope in (scopes or {}).items():
        cmd += ["--scope", f"{token}={json.dumps(scope)}"]
    if multipart_threshold is not None:
        cmd += ["--multipart-threshold", str(multipart_threshold)]
    if bridge_port:
        cmd += ["--bridge-port", str(bridge_port)]
    if bridge_url:
        cmd += ["--bridge-url", bridge_url]
    project_root = str(Path(__file__).resolve().parents[2])  # so `-m publisher...` imports from any cwd
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, full_env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=full_env)
    try:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"hubserver did not print its URL within {timeout}s")
        url = proc.stdout.readline().strip()
        proc.stdout.close()  # the server prints nothing after its URL
        if not url.startswith("http://"):
            raise RuntimeError(f"hubserver failed to start (exit code {proc.poll()}, printed {url!r})")
        wait_for_server(url, timeout)
        return url, proc
    except BaseException:
        proc.kill()
        proc.wait()
        raise
