"""The one place where exceptions become one-line user messages and exit codes."""

from __future__ import annotations

import signal

from publisher.errors import Interrupted, PublishError, RunFailed
from publisher.io import hub
from publisher.io.hub import settings


def describe(exc: BaseException) -> tuple[str, int] | None:
    """(message, exit code) for an error we know how to explain; None for a real bug."""
    if isinstance(exc, RunFailed):  # a run that stopped: what stopped it is what the user needs to read
        return describe(exc.cause)
    if isinstance(exc, KeyboardInterrupt):  # SIGINT / SIGTERM: the cleanup ran on the way out (publisher.runtime.signals)
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        then = (f"left: {'; '.join(stop.left)}; {stop.resume} to resume" if stop.left else
                f"nothing was left to resume from; {stop.resume} to start again")
        return (f"interrupted by {stop.signal_name}: stopped the worker processes, removed this run's temporary and "
                f"unfinished files and any repo it had created; {then}"), stop.exit_code
    # A full disk (or a file-size limit) is named as such even when a stage wrapped it (QuantizeError) or a
    # library re-raised it as its own type (safetensors' SafetensorError carries "os error 28" in its text).
    if isinstance(exc, PublishError) and "no space left" in str(exc):
        return str(exc), exc.exit_code  # the stage already said it, naming its folder
    disk = _disk_full(exc)
    if disk is not None:
        return disk, 1
    if isinstance(exc, PublishError):
        return str(exc), exc.exit_code
    try:
        from huggingface_hub import errors as hf
    except ImportError:  # pragma: no cover - huggingface_hub is a hard dependency
        return None
    # Most specific first: GatedRepoError is a subclass of RepositoryNotFoundError.
    if isinstance(exc, hf.GatedRepoError):
        repo = exc.repo_id
        return (f"{repo or 'the repo'} is gated and this token has no access; accept its terms at "
                f"{hub.endpoint()}/{repo or ''} and use a token of that account"), 1
    if isinstance(exc, hf.RepositoryNotFoundError):
        repo = exc.repo_id
        return (f"repo {repo or ''} not found on {hub.endpoint()} (or private and not visible to this token); "
                "check the id, or set HF_TOKEN to a token that can read it"), 1
    if isinstance(exc, hf.RevisionNotFoundError):
        return "revision not found in the repo; pass an existing branch, tag or commit sha with --revision", 1
    if isinstance(exc, hf.RemoteEntryNotFoundError):
        return f"a file is missing on the Hub: {_first_line(exc)}", 1
    if isinstance(exc, hf.LocalEntryNotFoundError):
        # hf_hub_download's "cannot locate the file and it is not cached": explain the wrapped cause
        cause = describe(exc.__cause__) if exc.__cause__ is not None else None
        if cause is not None:
            return cause
        return (f"a file could not be downloaded from {hub.endpoint()} and is not in the local cache; "
                "check the network or HF_ENDPOINT"), 1
    if isinstance(exc, hf.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            return "the Hub rejected the token (401 Unauthorized); set HF_TOKEN to a valid token", 1
        if status == 403:
            return f"the Hub refused the request (403 Forbidden): {exc.server_message or _first_line(exc)}; use a token with write access to the target", 1
        if status == 412:
            return "the target repo changed while publishing (another writer); re-run to publish on top of it", 1
        if isinstance(status, int) and (status >= 500 or status == 429):
            return (f"the Hub kept failing ({status}: {exc.server_message or _first_line(exc)}) after "
                    f"{settings()[0]} tries; nothing was changed by the failed request, try again later"), 1
        return f"Hub request failed ({status}): {exc.server_message or _first_line(exc)}", 1
    if isinstance(exc, OSError) and str(exc).startswith("Consistency check failed"):  # a short body, every try
        return (f"a download from {hub.endpoint()} was cut short on each of {settings()[0]} tries ({_first_line(exc)}); "
                "check the network or proxy, then re-run the same command"), 1
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set; unset it to reach the Hub, or pass a local folder as MODEL_ID", 1
    if isinstance(exc, hf.HFValidationError):
        return f"invalid repo id: {_first_line(exc)}", 2
    if _is_connection_error(exc):
        return f"cannot reach the Hub at {hub.endpoint()} ({type(exc).__name__}); check the network or HF_ENDPOINT", 1
    return None


_DISK_ERRNOS = {27: "file too large for the file-size limit", 28: "no space left on the device", 122: "disk quota exceeded"}
_DISK_TEXTS = {27: ("[errno 27]", "os error 27", "code: 27,"), 28: ("[errno 28]", "os error 28", "code: 28,", "no space left on device"),
               122: ("[errno 122]", "os error 122", "code: 122,")}


def _disk_full(exc: BaseException) -> str | None:
    """The one-line message for ENOSPC / EFBIG anywhere in the exception chain, else None."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not c for c in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    chain = [e for e in chain if getattr(e, "response", None) is None]  # a Hub answer ("no space" on the server) is not ours
    found: tuple[int, str | None] | None = None
    for e in chain:  # a real OSError first: it names the file
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            found = (e.errno, e.filename)
            break
    if found is None:
        for e in chain:
            text = str(e).lower()
            code = next((c for c, markers in _DISK_TEXTS.items() if any(m in text for m in markers)), None)
            if code is not None:
                found = (code, None)
                break
    if found is None:
        return None
    code, where = found
    return (f"no space left to write the files ({_DISK_ERRNOS[code]}{f': {where}' if where else ''}); "
            "free disk space or point --output-dir at a larger disk (and HF_HOME, for the download cache)")


def _is_connection_error(exc: BaseException) -> bool:
    try:
        import httpx2

        if isinstance(exc, httpx2.TransportError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, ConnectionError)



def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
