"""Raw HTTP to the loopback Hub for the hubserver tests: no proxy (loopback), and redirects are answers under test,
never followed."""

from __future__ import annotations

import urllib.error
import urllib.request


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a 302 is the answer under test, not something to follow


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def raw(url: str, method: str = "GET", body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request; an HTTP error status is an answer, not an exception."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=20) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
