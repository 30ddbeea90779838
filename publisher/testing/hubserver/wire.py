"""The transport-neutral request/response pair shared by the routes and the HTTP plumbing."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher.testing.hubserver.faults import Fault
from publisher.testing.hubserver.storage import HubError


@dataclass
class Request:
    method: str
    path: str  # raw (still percent-encoded) path, without the query string
    query: dict[str, list[str]]
    headers: Any  # a Mapping[str, str] or the stdlib's email.message.Message (case-insensitive get)
    base_url: str  # scheme://host:port as the client addressed us, for URLs we hand back
    read_body: Callable[[], bytes]
    iter_body: Callable[[], Iterator[bytes]]
    user: str | None = None
    token: str | None = None

    def q(self, name: str, default: str | None = None) -> str | None:
        values = self.query.get(name)
        return values[0] if values else default

    def flag(self, name: str) -> bool:
        return (self.q(name) or "").lower() in ("1", "true", "yes")

    def json(self) -> Any:
        raw = self.read_body()
        try:
            return json.loads(raw) if raw else {}
        except ValueError as exc:
            raise HubError(400, f"Malformed JSON body: {exc}") from exc


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    file: Path | None = None  # streamed by the transport; `file_range` is (start, end inclusive)
    file_range: tuple[int, int] | None = None
    virtual: Callable[[int, int], Iterator[bytes]] | None = None  # instead of `file`: bytes start..end, computed
    drop: bool = False  # close the connection without answering (fault injection)
    stream: Iterator[bytes] | None = None  # sent with chunked transfer encoding as it is produced (job logs)
    body_fault: Fault | None = None  # flip / truncate / drop_body applied to `file` as it is sent (fault injection)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})


def error_response(err: HubError) -> Response:
    # The message must fit in one latin-1 header line; the JSON body carries it too (the client shows both).
    msg = err.message.replace("\n", " ").encode("latin-1", "replace").decode("latin-1")
    headers = {"X-Error-Message": msg, **err.headers}
    if err.code:
        headers["X-Error-Code"] = err.code
    return json_response({"error": err.message, **err.extra}, err.status, headers)
