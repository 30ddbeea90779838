"""The evaluation text of a language model: rows of a Hub dataset, read with ``datasets`` (streamed: only the rows
needed for ``--eval-tokens``), then the base's own tokenizer cuts them into fixed-length windows.

Read right after the plan, before any weight is downloaded: first one request asks the Hub whether the dataset can
be read (``unreadable``: no retries, ``HF_HUB_OFFLINE`` respected), so an unreachable Hub costs one line and no
waiting; then ``datasets`` streams the rows. A dataset the user named (``--eval-dataset``) that cannot be read stops
the run there (SourceError, exit 1); the default one that cannot be read (offline, gated, missing on this Hub) only
costs the figure, and the card says why in a plain sentence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher.errors import SourceError
from publisher.io import hub
from publisher.quality.options import DatasetSpec

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 8  # rows are read until there are this many characters per wanted token (English BPE: about 4)
WINDOW = 512  # tokens per window; shorter where the model's position table is
MIN_WINDOW = 16


@dataclass
class EvalText:
    spec: DatasetSpec
    text: str | None  # None: the dataset could not be read (``reason``)
    reason: str = ""
    rows: int = 0
    seconds: float = 0.0


def read_text(spec: DatasetSpec, tokens: int, token: str | None, explicit: bool) -> EvalText:
    """The first rows of the split, joined with blank lines as wikitext's perplexity recipes do, until they hold about
    ``tokens`` tokens. ``explicit``: the user named the dataset, so failing to read it is an error."""
    from datasets.exceptions import DatasetsError
    from huggingface_hub.errors import HfHubHTTPError

    started = time.monotonic()
    reason = unreadable(spec, token)
    if reason:
        if explicit:
            raise SourceError(f"--eval-dataset {spec.text()}: {spec.repo} {reason}; name a readable text dataset "
                              "(REPO[:CONFIG][:SPLIT]) or drop --eval-dataset for the default")
        log.warning("perplexity will not be measured: the evaluation text %s %s (--eval-dataset REPO[:CONFIG][:SPLIT] "
                    "names another)", spec.text(), reason)
        return EvalText(spec, None, f"the evaluation text {spec.text()} {reason}", seconds=time.monotonic() - started)
    try:
        text, rows = _rows(spec, tokens * CHARS_PER_TOKEN, token)
    except (OSError, ValueError, KeyError, DatasetsError, HfHubHTTPError) as exc:  # each means: not readable here
        reason = _why(spec, exc)
        if explicit:
            raise SourceError(f"--eval-dataset {spec.text()}: {reason}; name a readable text dataset "
                              "(REPO[:CONFIG][:SPLIT]) or drop --eval-dataset for the default") from None
        log.warning("perplexity not measured: the default evaluation dataset %s could not be read (%s); "
                    "--eval-dataset REPO[:CONFIG][:SPLIT] names another", spec.text(), reason)
        return EvalText(spec, None, reason, seconds=time.monotonic() - started)
    if not text.strip():
        if explicit:
            raise SourceError(f"--eval-dataset {spec.text()}: its split holds no text; name a text dataset")
        return EvalText(spec, None, "its split holds no text", seconds=time.monotonic() - started)
    return EvalText(spec, text, rows=rows, seconds=time.monotonic() - started)


def unreadable(spec: DatasetSpec, token: str | None) -> str:
    """Why the dataset cannot be read here, in words that follow its name ("" when it can): one request for the
    dataset's page on the Hub, never retried, none at all when ``HF_HUB_OFFLINE`` is set (the rows are streamed from
    the Hub, which offline mode forbids)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors


    if constants.HF_HUB_OFFLINE:
        return "cannot be read offline (HF_HUB_OFFLINE is set, and the text is streamed from the Hub)"
    try:
        hub.client(token).dataset_info(spec.repo, timeout=10)
    except hub_errors.GatedRepoError:
        return "is gated and this token has no access"
    except hub_errors.RepositoryNotFoundError:
        return f"was not found on {hub.endpoint()} (or is private)"
    except hub_errors.HfHubHTTPError as exc:
        return f"could not be read from {hub.endpoint()} (HTTP {hub.status_of(exc) or 'error'})"
    except (httpx2.TransportError, OSError) as exc:  # refused, no route, DNS, timed out: not reachable from here
        return f"could not be read: {hub.endpoint()} is not reachable from this machine ({type(exc).__name__})"
    return ""


def _rows(spec: DatasetSpec, chars: int, token: str | None) -> tuple[str, int]:
    import datasets

    if not log.isEnabledFor(logging.DEBUG):
        datasets.disable_progress_bars()
    stream = datasets.load_dataset(spec.repo, spec.config, split=spec.split, streaming=True, token=token)
    column = _text_column(stream)
    parts: list[str] = []
    size = rows = 0
    for row in stream:
        value = row.get(column)
        rows += 1
        if isinstance(value, str):
            parts.append(value)
            size += len(value)
        if size >= chars:
            break
    return "\n\n".join(parts), rows


def _text_column(stream: Any) -> str:
    features = getattr(stream, "features", None) or {}
    names = [n for n, f in features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    if "text" in features or not names:
        return "text"
    return names[0]


def _why(spec: DatasetSpec, exc: BaseException) -> str:
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    name = type(exc).__name__
    if "gated" in line.lower() or name == "GatedRepoError":
        return f"{spec.repo} is gated and this token has no access"
    if name in ("DatasetNotFoundError", "RepositoryNotFoundError"):
        return f"{spec.repo} was not found on this Hub (or is private)"
    return f"{name}: {line}"


def windows(text: str, tokenizer_dir: Path, tokens: int, max_positions: int | None) -> Any:
    """Token ids ``[windows, length]``: consecutive, non-overlapping windows of the tokenized text, ``tokens`` in all
    (fewer when the text is shorter), each as long as ``WINDOW``, the model's position table and the text allow.
    ValueError when the text is too short for a window of ``MIN_WINDOW``."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False, verbose=False)["input_ids"][0]
    length = min(WINDOW, tokens, max_positions or WINDOW, len(ids))
    if length < MIN_WINDOW:
        raise ValueError(f"its text holds only {len(ids)} tokens, fewer than {MIN_WINDOW}")
    count = max(1, min(len(ids), tokens) // length)
    return ids[: count * length].reshape(count, length).to(torch.long)
