"""The storage bridge: the second origin to which ``resolve/`` of an LFS file redirects, as a signed URL does.

huggingface.co answers ``resolve/`` of an LFS or Xet-backed file with 302 to a signed URL on another host (its Xet
storage bridge), which honours ``Range`` and takes no Hub credentials: the signature in the query is the credential.
So this origin refuses any request that carries an ``Authorization`` header (a client that forwards the Hub token off
the Hub is a bug worth seeing), checks the signature and expiry, and serves the object's bytes with the same fault
rules as the Hub (they match the resolve path, which the bridge path repeats after ``/_bridge``).
"""

from __future__ import annotations

import collections
import hmac
import time

from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.reads import bridge_sig, serve_range
from publisher.testing.hubserver.storage import HubError, Store
from publisher.testing.hubserver.wire import Request, Response, error_response

PREFIX = "/_bridge"


class BridgeApp:
    def __init__(self, store: Store, faults: FaultInjector,
                 seen: collections.deque[tuple[str, str, str | None]]) -> None:
        self.store, self.faults, self.seen = store, faults, seen  # faults and the request log: the Hub's own

    def handle(self, req: Request) -> Response:
        try:
            return self._serve(req)
        except HubError as err:
            return error_response(err)

    def _serve(self, req: Request) -> Response:
        if req.method not in ("GET", "HEAD") or not req.path.startswith(PREFIX + "/"):
            raise HubError(404, f"Not found: {req.path}")
        if req.headers.get("Authorization"):
            raise HubError(400, "Only one auth mechanism allowed; only the signature query parameter is accepted "
                                "here (the request carried an Authorization header)")
        oid, exp, sig = req.q("oid") or "", req.q("exp") or "", req.q("sig") or ""
        if not exp.isdigit() or not hmac.compare_digest(sig, bridge_sig(self.store, req.path, oid, int(exp))):
            raise HubError(403, "Invalid signature on the storage URL")
        if int(exp) < time.time():
            raise HubError(403, "The storage URL has expired; resolve the file again")
        resolve_path = req.path[len(PREFIX):]
        self.faults.before_request(req.method, resolve_path)
        size = self.store.blob_size(oid)
        if size is None and (virtual := self.store.virtual(oid)) is not None:
            size = virtual.size
        if size is None:
            raise HubError(404, "No such object")
        return serve_range(req, self.store, self.faults, oid, size, {"ETag": f'"{oid}"'}, resolve_path)
