"""Run-time fault injection, so reliability tests can make the Hub misbehave on demand.

A fault is a rule with a remaining `count`; each matching request consumes one. Rules are set either
in-process (`HubServer.set_fault(...)`) or over HTTP (`POST /_admin/faults` with the same JSON keys),
which is how tests drive a server running as a subprocess.

Spec keys (one fault kind per rule):
    commit_status: int            answer this status on POST .../commit/... (the commit is NOT applied,
                                  unless "apply": true, which simulates a commit whose response was lost)
    drop_upload_after_bytes: int  on an LFS PUT, read this many body bytes, then close the connection
                                  without answering (nothing is stored)
    status: int + match: str      answer this status on any request whose path contains `match`
                                  (optional "method": "POST")
    delay_s: float + match: str   sleep before handling matching requests (to kill a server mid-push)
    count: int = 1                how many requests the rule affects
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Fault:
    kind: str  # "commit_status" | "drop_upload" | "status" | "delay"
    count: int = 1
    status: int = 503
    drop_after: int = 0
    delay_s: float = 0.0
    match: str = ""
    method: str = ""
    apply: bool = False


@dataclass
class FaultInjector:
    """Thread-safe rule list plus counters of faults that actually fired (tests assert on these)."""

    rules: list[Fault] = field(default_factory=list)
    fired: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, spec: dict[str, Any]) -> Fault:
        count = int(spec.get("count", 1))
        method = str(spec.get("method", "")).upper()
        match = str(spec.get("match", ""))
        if spec.get("commit_status") is not None:
            fault = Fault("commit_status", count, status=int(spec["commit_status"]), apply=bool(spec.get("apply")))
        elif spec.get("drop_upload_after_bytes") is not None:
            fault = Fault("drop_upload", count, drop_after=int(spec["drop_upload_after_bytes"]))
        elif spec.get("status") is not None and match:
            fault = Fault("status", count, status=int(spec["status"]), match=match, method=method)
        elif spec.get("delay_s") is not None and match:
            fault = Fault("delay", count, delay_s=float(spec["delay_s"]), match=match, method=method)
        else:
            raise ValueError(f"Unknown fault spec {spec!r}: expected commit_status, drop_upload_after_bytes, "
                             "or status/delay_s with match")
        if fault.count < 1:
            raise ValueError("count must be >= 1")
        with self._lock:
            self.rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.fired.clear()

    def take(self, kind: str, method: str = "", path: str = "") -> Fault | None:
        """Consume one use of the first matching rule of `kind`, or return None."""
        with self._lock:
            for rule in self.rules:
                if rule.kind != kind or (rule.method and rule.method != method) or rule.match not in path:
                    continue
                rule.count -= 1
                if rule.count <= 0:
                    self.rules.remove(rule)
                self.fired[kind] = self.fired.get(kind, 0) + 1
                return rule
        return None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"rules": [asdict(r) for r in self.rules], "fired": dict(self.fired)}
