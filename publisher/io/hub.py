"""The Hub plumbing: one HfApi per run (per token), bounded retries with backoff, URL and delete helpers.

Every Hub call of ours goes through ``client(token)``, which says who is calling
(``library_name="hf-ao-publish"`` and our version in the user agent), and through ``call`` for retries.

Retries: transient Hub errors are tried again with exponential backoff.

Transient: 5xx and 429 answers, dropped or refused connections and timeouts (httpx2.TransportError,
ConnectionError, TimeoutError), a download whose body ended short of its announced size (huggingface_hub's
"Consistency check failed"), and huggingface_hub's "could not locate the file" error when it wraps one of
those. Permanent: every other 4xx (401, 403, 404, 412 stale parent...) and anything else.

    call(api.create_repo, repo_id, what="create the repo alice/x")

Tries and the first delay come from HF_AO_PUBLISH_RETRIES (total tries, default 4) and
HF_AO_PUBLISH_RETRY_DELAY (seconds, default 0.5); the delay doubles on each retry, capped at 8 s
(a longer Retry-After from the Hub, up to 60 s, is honoured). A 429 whose ``RateLimit`` header (the Hub's
``"api";r=0;t=SECONDS``, IETF draft) says the window is used up waits until the window resets, at most
HF_AO_PUBLISH_MAX_RATE_WAIT seconds (default 330: the Hub's windows last up to 5 minutes), with one line saying so.
Each retry is logged at INFO on the "publisher" logger, a rate-limit wait at WARNING.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from publisher import __version__

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TRIES = 4
DEFAULT_DELAY_S = 0.5
MAX_DELAY_S = 8.0
MAX_RATE_WAIT_S = 330.0
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def settings() -> tuple[int, float]:
    """(tries, first delay in seconds) from the environment; malformed values fall back to the defaults."""
    try:
        tries = int(os.environ.get("HF_AO_PUBLISH_RETRIES", DEFAULT_TRIES))
    except ValueError:
        tries = DEFAULT_TRIES
    try:
        delay = float(os.environ.get("HF_AO_PUBLISH_RETRY_DELAY", DEFAULT_DELAY_S))
    except ValueError:
        delay = DEFAULT_DELAY_S
    return max(1, tries), max(0.0, delay)


def status_of(exc: BaseException) -> int | None:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def is_short_body(exc: BaseException) -> bool:
    """huggingface_hub's download ended cleanly but short of the announced size (a proxy or link cut it)."""
    return isinstance(exc, OSError) and str(exc).startswith("Consistency check failed")


def is_xet_failure(exc: BaseException) -> bool:
    """An error of hf_xet's transfer (huggingface_hub lets them through as they are): a bare ``OSError`` or
    ``RuntimeError`` raised from its native code, or one of hf_xet's own classes."""
    if type(exc) in (OSError, RuntimeError):
        return True
    try:
        import hf_xet
    except ImportError:  # pragma: no cover - a hard dependency of huggingface_hub
        return False
    return isinstance(exc, (hf_xet.XetAuthenticationError, hf_xet.XetObjectNotFoundError))


def is_transient(exc: BaseException) -> bool:
    """Worth trying again: the same request may well succeed in a moment."""
    if is_short_body(exc) or (type(exc) in (OSError, RuntimeError) and "I/O error" in str(exc)):
        return True
    try:
        from huggingface_hub import errors as hf
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        hf = None  # type: ignore[assignment]
    if hf is not None:
        if isinstance(exc, hf.OfflineModeIsEnabled):  # a ConnectionError, but a setting, not a glitch
            return False
        if isinstance(exc, hf.HfHubHTTPError):
            return status_of(exc) in TRANSIENT_STATUS
        if isinstance(exc, hf.LocalEntryNotFoundError):
            # hf_hub_download's "cannot locate the file and it is not cached": a wrapped connection error or 5xx
            cause = exc.__cause__
            return cause is not None and is_transient(cause)
    try:
        import httpx2

        if isinstance(exc, (httpx2.UnsupportedProtocol, httpx2.ProxyError, httpx2.LocalProtocolError)):
            return False  # a bad endpoint URL, proxy setting or client bug: the same request fails again
        if isinstance(exc, httpx2.TransportError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, (ConnectionError, TimeoutError))


def max_rate_wait() -> float:
    try:
        return max(0.0, float(os.environ.get("HF_AO_PUBLISH_MAX_RATE_WAIT", MAX_RATE_WAIT_S)))
    except ValueError:
        return MAX_RATE_WAIT_S


def rate_limit_wait(exc: BaseException) -> tuple[float, str] | None:
    """(seconds until the rate-limit window resets, capped by max_rate_wait(); the limit's name) for a 429 whose
    ``RateLimit`` header says no request is left; None otherwise."""
    from huggingface_hub.utils import parse_ratelimit_headers

    headers = getattr(getattr(exc, "response", None), "headers", None)
    if status_of(exc) != 429 or headers is None:
        return None
    info = parse_ratelimit_headers(headers)
    if info is None or info.remaining != 0:
        return None
    return min(float(info.reset_in_seconds) + 1.0, max_rate_wait()), str(info.resource_type)


def retry_after(exc: BaseException) -> float:
    """Seconds a 429/503 answer asks to wait (Retry-After in seconds), capped at 60; 0 when absent."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    try:
        value = float(headers.get("Retry-After", "")) if headers is not None else 0.0
    except (TypeError, ValueError):  # an HTTP date, or garbage: use our own backoff
        return 0.0
    return min(max(value, 0.0), 60.0)


def short(exc: BaseException) -> str:
    status = status_of(exc)
    first = (getattr(exc, "server_message", None) or str(exc)).strip()
    first = (first.splitlines() or [""])[0][:160]
    kind = f"HTTP {status}" if status else type(exc).__name__
    return f"{kind}: {first}" if first else kind


def call(fn: Callable[..., T], *args: Any, what: str, check: Callable[[], T | None] | None = None, **kwargs: Any) -> T:
    """fn(*args, **kwargs), retried on transient errors.

    `check`, when given, runs before every retry (not before the first try): a non-None result ends the
    loop as a success with that value. It is how a non-idempotent call (a commit whose response was lost
    but which the server applied) is recognised as done instead of being sent again. An error in `check`
    counts as a failed try.
    """
    tries, delay = settings()
    attempt = 0
    while True:
        attempt += 1
        try:
            if attempt > 1 and check is not None:
                done = check()
                if done is not None:
                    log.info("%s: the previous try had succeeded on the Hub; not sending it again", what)
                    return done
            return fn(*args, **kwargs)
        except Exception as exc:
            if attempt >= tries or not is_transient(exc):
                raise
            wait = max(min(MAX_DELAY_S, delay * (2 ** (attempt - 1))), retry_after(exc))
            limited = rate_limit_wait(exc)
            if limited is not None:
                wait = max(wait, limited[0])
                log.warning("%s: the Hub's %r rate limit is used up; waiting %.0f s for its window to reset "
                            "(try %d of %d)", what, limited[1], wait, attempt + 1, tries)
            else:
                log.info("%s failed (%s); retrying in %.1f s (try %d of %d)", what, short(exc), wait, attempt + 1, tries)
            time.sleep(wait)


def client(token: str | None) -> HfApi:
    """The run's HfApi for this token (built once per token and endpoint), saying who is calling."""
    from huggingface_hub import constants

    return _client(token or None, constants.ENDPOINT)


@functools.lru_cache(maxsize=8)
def _client(token: str | None, endpoint: str) -> HfApi:
    from huggingface_hub import HfApi


    return HfApi(endpoint=endpoint, token=token, library_name="hf-ao-publish", library_version=__version__)


def endpoint() -> str:
    """The Hub's base URL (HF_ENDPOINT, or huggingface.co), without a trailing slash."""
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def repo_url(repo_id: str) -> str:
    return f"{endpoint()}/{repo_id}"


def pr_url(repo_id: str, pr_num: int | None) -> str | None:
    return f"{repo_url(repo_id)}/discussions/{pr_num}" if pr_num is not None else None


def delete_repo_quietly(repo_id: str, token: str | None) -> None:
    """Best effort: remove a repo this run created, so a failed push leaves nothing behind. The original
    error matters more, so a failure here is logged, not raised."""
    try:
        call(client(token).delete_repo, repo_id, what=f"deleting the repo {repo_id}")
        log.info("deleted the repo %s that this run had created", repo_id)
    except Exception as exc:  # reported only: the caller is already handling the error that matters
        log.warning("could not delete the repo %s that this run had created: %s", repo_id, short(exc))
