"""Run-time fault injection, so reliability tests can make the Hub misbehave on demand.

A fault is a rule with a remaining `count`; each matching request consumes one. Rules are set either
in-process (`HubServer.set_fault(...)`) or over HTTP (`POST /_admin/faults` with the same JSON keys),
which is how tests drive a server running as a subprocess.

Spec keys (one fault kind per rule):
    commit_status: int            answer this status on POST .../commit/... (the commit is NOT applied,
                                  unless "apply": true, which simulates a commit whose response was lost)
    drop_upload_after_bytes: int  on an LFS PUT (a whole object or one part; optional `match` on its path, e.g.
                                  "/_lfs/part/"), read this many body bytes, then close the connection without
                                  answering (nothing is stored)
    status: int + match: str      answer this status on any request whose path contains `match`
                                  (optional "method": "POST"; optional "ratelimit_reset": seconds, which adds the
                                  Hub's `RateLimit: "api";r=0;t=N` and `RateLimit-Policy` headers, as on a 429)
    delay_s: float + match: str   sleep before handling matching requests (to kill a server mid-push)
    count: int = 1                how many requests the rule affects

File bodies (GET .../resolve/..., whose path contains `match`): what a faulty link or proxy does to a download,
applied where the bytes are written to the socket, after the status line and headers were decided:
    flip_byte_at: int             flip one byte (XOR 0xFF) at this file offset (negative: from the end); the size,
                                  ETag and X-Linked-Etag stay the Hub's. Consumed only by a body that covers it
    truncate_body_at: int         send only this many bytes of the body, with a Content-Length that says so (a
                                  complete but short answer: huggingface_hub's "Consistency check failed")
    drop_body_after_bytes: int    announce the full length, send this many bytes, then cut the connection
    ignore_range: true            answer a Range request with 200 and the whole file

Xet downloads (hf_xet reads the CAS itself; the fault acts on the snapshot a read token hands out, xet.py):
    xet_flip: true                the file's first xorb is served with one byte flipped (hf_xet does not check chunk
                                  contents: the download succeeds with one wrong byte)
    xet_truncate: true            the file's first xorb is served cut in half (the download fails)
  `match` is tested against the file's resolve path at the revision the read token was asked for.

Why here and not in a separate proxy process: huggingface_hub reads HF_ENDPOINT once, at import, so the in-process
tests (the `cli` fixture) can only reach a fault through the session's Hub; these rules sit exactly where a proxy
would act (status and headers untouched, the body bytes changed), reuse the count/match/fired bookkeeping, and
reach a spawned server through the same admin endpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from publisher.testing.hubserver.storage import HubError


@dataclass
class Fault:
    kind: str  # "commit_status" | "drop_upload" | "status" | "delay" | "flip" | "truncate" | "drop_body" | "ignore_range"
    #            | "xet_flip" | "xet_truncate"
    count: int = 1
    status: int = 503
    drop_after: int = 0
    delay_s: float = 0.0
    match: str = ""
    method: str = ""
    apply: bool = False
    offset: int = 0  # body faults: the byte to flip, or how many body bytes are sent
    ratelimit_reset: int | None = None  # status faults: seconds until the rate-limit window resets

    def headers(self) -> dict[str, str]:
        if self.ratelimit_reset is None:
            return {}
        return {"RateLimit": f'"api";r=0;t={self.ratelimit_reset}',
                "RateLimit-Policy": '"fixed window";"api";q=500;w=300'}


@dataclass
class FaultInjector:
    """Thread-safe rule list plus counters of faults that actually fired (tests assert on these)."""

    rules: list[Fault] = field(default_factory=list)
    fired: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _last: dict[str, float] = field(default_factory=dict, repr=False)  # kind -> when it last fired (monotonic)
    # requests held by a delay fault right now ("the client is waiting on it", which a count of fired faults cannot
    # say); like `fired`, what a clear() precedes is not counted (a request a test left held, its client killed,
    # sleeps on in its server thread): a clear() starts a new generation, and only its own requests count down
    _delaying: int = field(default=0, repr=False)
    _generation: int = field(default=0, repr=False)

    def add(self, spec: dict[str, Any]) -> Fault:
        count = int(spec.get("count", 1))
        method = str(spec.get("method", "")).upper()
        match = str(spec.get("match", ""))
        if spec.get("commit_status") is not None:
            fault = Fault("commit_status", count, status=int(spec["commit_status"]), apply=bool(spec.get("apply")))
        elif spec.get("drop_upload_after_bytes") is not None:
            fault = Fault("drop_upload", count, drop_after=int(spec["drop_upload_after_bytes"]), match=match)
        elif spec.get("status") is not None and match:
            reset = spec.get("ratelimit_reset")
            fault = Fault("status", count, status=int(spec["status"]), match=match, method=method,
                          ratelimit_reset=None if reset is None else int(reset))
        elif spec.get("delay_s") is not None and match:
            fault = Fault("delay", count, delay_s=float(spec["delay_s"]), match=match, method=method)
        elif spec.get("flip_byte_at") is not None:
            fault = Fault("flip", count, match=match, method="GET", offset=int(spec["flip_byte_at"]))
        elif spec.get("truncate_body_at") is not None:
            fault = Fault("truncate", count, match=match, method="GET", offset=max(0, int(spec["truncate_body_at"])))
        elif spec.get("drop_body_after_bytes") is not None:
            fault = Fault("drop_body", count, match=match, method="GET", offset=max(0, int(spec["drop_body_after_bytes"])))
        elif spec.get("ignore_range"):
            fault = Fault("ignore_range", count, match=match, method="GET")
        elif spec.get("xet_flip") or spec.get("xet_truncate"):
            fault = Fault("xet_flip" if spec.get("xet_flip") else "xet_truncate", count, match=match, method="GET")
        else:
            raise ValueError(f"Unknown fault spec {spec!r}: expected commit_status, drop_upload_after_bytes, "
                             "status/delay_s with match, flip_byte_at, truncate_body_at, drop_body_after_bytes, "
                             "ignore_range, xet_flip or xet_truncate")
        if fault.count < 1:
            raise ValueError("count must be >= 1")
        with self._lock:
            self.rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.fired.clear()
            self._last.clear()
            self._delaying = 0
            self._generation += 1

    def take(self, kind: str, method: str = "", path: str = "",
             applies: Callable[[Fault], bool] | None = None) -> Fault | None:
        """Consume one use of the first matching rule of `kind` (for which `applies(rule)` holds), or return None."""
        with self._lock:
            for rule in self.rules:
                if rule.kind != kind or (rule.method and rule.method != method) or rule.match not in path:
                    continue
                if applies is not None and not applies(rule):
                    continue
                rule.count -= 1
                if rule.count <= 0:
                    self.rules.remove(rule)
                self.fired[kind] = self.fired.get(kind, 0) + 1
                self._last[kind] = time.monotonic()
                return rule
        return None

    def before_request(self, method: str, path: str) -> None:
        """The faults every request may meet before it is served, on the Hub and on its storage bridge alike: a delay,
        then an injected status (with the Hub's rate-limit headers where the fault has them)."""
        if (fault := self.take("delay", method, path)) is not None:
            with self._lock:
                generation = self._generation
                self._delaying += 1
            try:
                time.sleep(fault.delay_s)
            finally:
                with self._lock:
                    if generation == self._generation:
                        self._delaying -= 1
        if (fault := self.take("status", method, path)) is not None:
            raise HubError(fault.status, f"Injected fault: HTTP {fault.status}", headers=fault.headers())

    def pending(self, *kinds: str) -> bool:
        """Whether a rule of one of ``kinds`` is set, or one fired in the last minute."""
        with self._lock:
            recent = any(time.monotonic() - self._last.get(k, -1e9) < 60 for k in kinds)
            return recent or any(r.kind in kinds for r in self.rules)

    def take_body(self, path: str, start: int, end: int, size: int) -> Fault | None:
        """The body fault for a GET of file bytes [start, end] (inclusive) of a `size`-byte file, if any.
        A flip is resolved to an absolute offset and taken only when this body carries that byte."""
        def covers(rule: Fault) -> bool:
            at = rule.offset if rule.offset >= 0 else size + rule.offset
            return start <= at <= end

        fault = self.take("flip", "GET", path, covers)
        if fault is not None:
            at = fault.offset if fault.offset >= 0 else size + fault.offset
            return Fault("flip", offset=at)
        return self.take("truncate", "GET", path) or self.take("drop_body", "GET", path)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"rules": [asdict(r) for r in self.rules], "fired": dict(self.fired),
                    "delaying": self._delaying}
