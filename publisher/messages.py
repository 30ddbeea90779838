"""The one place where exceptions become one-line user messages and exit codes."""

from __future__ import annotations

from typing import Any

from .errors import PublishError


def describe(exc: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for an error we know how to explain; None for a real bug."""
    if isinstance(exc, PublishError):
        return str(exc), exc.exit_code
    try:
        from huggingface_hub import errors as hf
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        return None
    # Most specific first: GatedRepoError is a subclass of RepositoryNotFoundError.
    if isinstance(exc, hf.GatedRepoError):
        repo = _repo_of(exc)
        return (f"{repo or 'the repo'} is gated and this token has no access; accept its terms at "
                f"{_endpoint()}/{repo or ''} and use a token of that account"), 1
    if isinstance(exc, hf.RepositoryNotFoundError):
        repo = _repo_of(exc)
        return (f"repo {repo or ''} not found on {_endpoint()} (or private and not visible to this token); "
                "check the id, or set HF_TOKEN to a token that can read it"), 1
    if isinstance(exc, hf.RevisionNotFoundError):
        return "revision not found in the repo; pass an existing branch, tag or commit sha with --revision", 1
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return f"a file is missing on the Hub: {_first_line(exc)}", 1
    if isinstance(exc, hf.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return "the Hub rejected the token (401 Unauthorized); set HF_TOKEN to a valid token", 1
        if status == 403:
            return f"the Hub refused the request (403 Forbidden): {exc.server_message or _first_line(exc)}; use a token with write access to the target", 1
        if status == 412:
            return "the target repo changed while publishing (another writer); re-run to publish on top of it", 1
        return f"Hub request failed ({status}): {exc.server_message or _first_line(exc)}", 1
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set; unset it to reach the Hub, or pass a local folder as MODEL_ID", 1
    if isinstance(exc, hf.HFValidationError):
        return f"invalid repo id: {_first_line(exc)}", 2
    if _is_connection_error(exc):
        return f"cannot reach the Hub at {_endpoint()} ({type(exc).__name__}); check the network or HF_ENDPOINT", 1
    if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
        return "no space left on the device; free disk space or point --output-dir / HF_HOME at a larger disk", 1
    return None


def _is_connection_error(exc: BaseException) -> bool:
    try:
        import httpx2

        if isinstance(exc, httpx2.TransportError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, ConnectionError)


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _repo_of(exc: Any) -> str | None:
    """The repo id from the failed request's URL (/api/models/org/name/...)."""
    try:
        path = str(exc.response.request.url.path)
    except AttributeError:
        return None
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 4 and parts[0] == "api" and parts[1] in ("models", "datasets", "spaces"):
        return f"{parts[2]}/{parts[3]}"
    if len(parts) >= 2:
        return f"{parts[0]}/{parts[1]}"
    return None
