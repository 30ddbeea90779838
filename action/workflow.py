"""GitHub workflow commands and files: annotations, log groups, masks, step outputs and the job summary.

The runner reads commands from stdout (`::error title=...::message`) and values from the files named by
GITHUB_OUTPUT and GITHUB_STEP_SUMMARY. Everything the action writes goes through here so that escaping and
the output delimiter are done once. See "Workflow commands for GitHub Actions" in GitHub's documentation.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

TITLE = "hf-ao-publish"  # the title of every annotation the action makes


class StepFailed(Exception):
    """A step cannot go on: main() reports `message` as one ::error:: annotation and exits with `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def escape_data(text: str) -> str:
    """Escape a command's message (the part after the last '::'): a newline would end the command."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a property value (title=...): ':' and ',' separate properties there."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(name: str, message: str = "", **props: str) -> None:
    """Print one workflow command (::error::, ::group::, ...) on stdout and flush, so it lands in order."""
    attrs = ",".join(f"{key}={escape_property(value)}" for key, value in props.items())
    sys.stdout.write(f"::{name}{' ' + attrs if attrs else ''}::{escape_data(message)}\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """One ::error:: annotation with the action's title (shown on the run's summary page)."""
    command("error", message, title=TITLE)


def warning(message: str) -> None:
    command("warning", message, title=TITLE)


@contextmanager
def group(title: str) -> Iterator[None]:
    """A collapsible log group; closed even when the body raises, or the rest of the log would be folded."""
    command("group", title)
    try:
        yield
    finally:
        command("endgroup")


@contextmanager
def commands_stopped() -> Iterator[None]:
    """Switch workflow commands off while untrusted text is printed (a model id, the CLI's log).

    Between ::stop-commands::TOKEN and ::TOKEN:: the runner ignores `::add-path::`, `::set-env::` and the
    like; the token is random so the printed text cannot resume them itself."""
    token = uuid.uuid4().hex
    command("stop-commands", token)
    try:
        yield
    finally:
        sys.stdout.write(f"::{token}::\n")
        sys.stdout.flush()


def _secret_lines(secrets: Sequence[str]) -> Iterator[str]:
    # A multi-line secret is masked line by line by the runner; do the same here.
    for secret in secrets:
        for line in secret.splitlines():
            if line.strip():
                yield line.strip()


def mask(secret: str | None) -> None:
    """::add-mask:: every line of a secret, so the runner replaces it with *** in the log."""
    for line in _secret_lines([secret or ""]):
        command("add-mask", line)


def redact(text: str, secrets: Sequence[str]) -> str:
    """`text` with every line of every secret replaced by ***: for what the runner does not mask (files)."""
    for line in _secret_lines(secrets):
        text = text.replace(line, "***")
    return text


def write_output(path: str | None, name: str, value: str) -> None:
    """Append one step output to $GITHUB_OUTPUT with the heredoc syntax and a random delimiter.

    A fixed delimiter (or name=value) would let a value that contains it inject further outputs."""
    if not path:
        return
    delimiter = f"ghadelimiter_{uuid.uuid4().hex}"
    while delimiter in value:  # pragma: no cover - a random 128-bit delimiter does not occur by chance
        delimiter = f"ghadelimiter_{uuid.uuid4().hex}"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"{name}<<{delimiter}\n{value}\n{delimiter}\n")


def append_summary(path: str | None, text: str) -> None:
    """Append markdown to $GITHUB_STEP_SUMMARY (absent outside a runner: then nothing is written)."""
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text)
