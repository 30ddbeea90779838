"""Follow running Jobs to their end: stream each log to stderr, read the result back, cancel on Ctrl-C.

One reader thread per job iterates ``HfApi.fetch_job_logs(follow=True)`` and hands lines to the caller's
thread, which prints them (prefixed `[recipe]` when several jobs run, `[model recipe]` for several models), keeps
the marker lines of bootstrap.py out of the display and decodes the job's --json result from them. A dropped connection is
followed again (the Hub replays the log from the start; the lines already shown are skipped). Ctrl-C
cancels every job still running and says so.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from publisher.errors import PublishError
from publisher.hfjobs.bootstrap import EXIT_MARKER, RESULT_MARKER
from publisher.io import hub

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
RECONNECTS = 5  # consecutive failures to read a log before giving up (the job keeps running)
REREADS = 2  # a finished job's log without bootstrap.py's exit line is read again this many times
STATUS_EVERY_S = 20.0  # a quiet job's stage is checked (and a change reported) this often
CANCEL_WAIT_S = 20.0


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI runner cancelling the step, `kill`) is handled like Ctrl-C while jobs run: they are
    cancelled rather than left running, billed, until their timeout."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stage_name(stage: Any) -> str:
    """A JobStage (a str enum) or the plain string the client often leaves there: "RUNNING"."""
    return str(getattr(stage, "value", stage))


class JobFailed(PublishError):
    """A job ended without publishing (its exit code and last log line are in the message)."""


class JobsCancelled(PublishError):
    """Ctrl-C: the jobs were cancelled. Exit code 130, as for an interrupted command."""

    exit_code = 130


class LostConnection(PublishError):
    """The log of a job could not be read any more; the job itself may still be running."""


@dataclass
class RemoteOutcome:
    """One recipe's job and what it produced; the CLI reports it like a local run's Outcome."""

    recipe: str
    repo_id: str
    job_id: str
    job_url: str
    flavor: str
    stage: str = "SCHEDULING"
    exit_code: int | None = None
    result: dict[str, Any] | None = None  # the job's own --json result, read back from its log
    error: str | None = None
    last_line: str = ""
    status_message: str | None = None
    chunks: dict[int, str] = field(default_factory=dict, repr=False)
    chunk_count: int = 0
    seen: int = 0  # log lines received so far (skipped when the log is followed again)
    rereads: int = 0  # times the log of the finished job was read again for its missing end
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20), repr=False)
    model: str = ""  # the base, when the command follows jobs of several models ("" otherwise: named nowhere)

    @property
    def done(self) -> bool:
        return self.stage in TERMINAL

    def _get(self, key: str) -> Any:
        return (self.result or {}).get(key)

    verified = property(lambda self: bool(self._get("verified")))
    url = property(lambda self: self._get("url"))
    commit = property(lambda self: self._get("commit"))
    pr_url = property(lambda self: self._get("pr_url"))
    up_to_date = property(lambda self: bool(self._get("up_to_date")))
    pushed = property(lambda self: bool(self._get("pushed")))
    folder = property(lambda self: None)  # the job's folders stay in the job

    def to_json(self) -> dict[str, Any]:
        """The job's result as its CLI printed it; a stub naming the error when it printed none."""
        if self.result is not None:
            return self.result
        return {"repo_id": self.repo_id, "url": None, "commit": None, "pr_url": None, "recipe": self.recipe,
                "verified": False, "pushed": False, "up_to_date": False, "error": self.error}

    @property
    def name(self) -> str:
        """What the job publishes, as messages and log prefixes name it: the recipe, after the model if several."""
        return f"{self.model} {self.recipe}" if self.model else self.recipe

    def describe(self) -> str:
        return f"job {self.job_id} ({self.name} on {self.flavor})"


def decode_result(outcome: RemoteOutcome) -> dict[str, Any] | None:
    if not outcome.chunk_count or len(outcome.chunks) != outcome.chunk_count:
        return None
    text = base64.b64decode("".join(outcome.chunks[i] for i in range(1, outcome.chunk_count + 1))).decode("utf-8")
    payload = json.loads(text)
    return payload if isinstance(payload, dict) else None


def take_marker(outcome: RemoteOutcome, line: str) -> bool:
    """Record a marker line of bootstrap.py; True when ``line`` was one (it is not shown)."""
    if line.startswith(RESULT_MARKER):
        m = re.fullmatch(r"\s*(\d+)/(\d+)\s+(\S+)\s*", line[len(RESULT_MARKER):])
        if m:
            outcome.chunks[int(m.group(1))] = m.group(3)
            outcome.chunk_count = int(m.group(2))
        return True
    if line.startswith(EXIT_MARKER):
        try:
            outcome.exit_code = int(line[len(EXIT_MARKER):].strip())
        except ValueError:
            pass
        return True
    return False


class Follower:
    """Streams and settles a set of jobs (all in one namespace) for one command."""

    def __init__(self, outcomes: list[RemoteOutcome], namespace: str, token: str, *, keep_going: bool = True) -> None:
        self.outcomes = outcomes
        self.namespace, self.token, self.keep_going = namespace, token, keep_going
        self.api: HfApi = hub.client(token)
        self.events: queue.Queue[tuple[str, RemoteOutcome, Any]] = queue.Queue()
        self.failures: dict[str, int] = {}

    # ---- reading --------------------------------------------------------------------------------
    def _reader(self, outcome: RemoteOutcome, skip: int) -> None:
        try:
            count = 0
            for line in self.api.fetch_job_logs(job_id=outcome.job_id, namespace=self.namespace, follow=True,
                                                token=self.token):
                count += 1
                if count > skip:
                    self.events.put(("line", outcome, line))
            self.events.put(("end", outcome, None))
        except Exception as exc:  # handed to the caller's thread, which decides to follow again or give up
            self.events.put(("error", outcome, exc))

    def _start(self, outcome: RemoteOutcome) -> None:
        threading.Thread(target=self._reader, args=(outcome, outcome.seen), daemon=True,
                         name=f"job-log-{outcome.job_id}").start()

    def _show(self, outcome: RemoteOutcome, line: str) -> None:
        outcome.seen += 1
        self.failures[outcome.job_id] = 0
        if take_marker(outcome, line):
            return
        line = line.replace(self.token, "***") if self.token else line
        if line.strip():
            outcome.last_line = line.strip()
            outcome.tail.append(outcome.last_line)
        log.info("%s%s", f"[{outcome.name}] " if len(self.outcomes) > 1 else "", line)

    # ---- settling --------------------------------------------------------------------------------
    def _inspect(self, outcome: RemoteOutcome) -> None:
        info = hub.call(self.api.inspect_job, job_id=outcome.job_id, namespace=self.namespace, token=self.token,
                        what=f"reading the status of {outcome.describe()}")
        outcome.stage = stage_name(info.status.stage)
        outcome.status_message = info.status.message

    def _settle(self, outcome: RemoteOutcome) -> None:
        """The job has ended: its result, or the one-line reason it failed."""
        try:
            outcome.result = decode_result(outcome)
        except ValueError as exc:
            log.warning("%s: its result could not be decoded (%s)", outcome.describe(), exc)
        if outcome.result and outcome.result.get("repo_id"):
            outcome.repo_id = str(outcome.result["repo_id"])  # what the job published, whatever it was asked
        code = outcome.exit_code
        if code is None and outcome.status_message:
            found = re.search(r"exit code:?\s*(-?\d+)", outcome.status_message, re.IGNORECASE)
            code = outcome.exit_code = int(found.group(1)) if found else None
        if outcome.stage == "COMPLETED" and code in (None, 0):
            if outcome.result is None:
                outcome.error = f"{outcome.describe()} finished but printed no result; see its log at {outcome.job_url}"
            return
        if outcome.stage in ("CANCELED", "DELETED"):
            outcome.error = f"{outcome.describe()} was {outcome.stage.lower()} on the Hub ({outcome.job_url})"
            return
        how = f"with exit code {code}" if code is not None else f"({outcome.status_message or outcome.stage})"
        last = outcome.last_line.removeprefix("Error: ") or "no log line"  # the job's CLI said "Error: ..."
        outcome.error = f"{outcome.describe()} failed {how}: {last} (full log: {outcome.job_url})"

    def cancel(self, outcomes: list[RemoteOutcome], why: str) -> list[RemoteOutcome]:
        """Cancel the jobs still running; wait a little for the Hub to confirm. Returns the cancelled ones."""
        running = [o for o in outcomes if not o.done]
        for outcome in running:
            try:
                hub.call(self.api.cancel_job, job_id=outcome.job_id, namespace=self.namespace, token=self.token,
                         what=f"cancelling {outcome.describe()}")
            except Exception as exc:  # reported: the user must know a job may still be running (and billed)
                log.error("could not cancel %s (%s); cancel it at %s", outcome.describe(), hub.short(exc), outcome.job_url)
        deadline = time.monotonic() + CANCEL_WAIT_S
        for outcome in running:
            while not outcome.done and time.monotonic() < deadline:
                try:
                    self._inspect(outcome)
                except Exception:  # the confirmation is best effort; the cancel request was sent
                    break
                if not outcome.done:
                    time.sleep(0.5)
            state = "cancelled" if outcome.stage in ("CANCELED", "DELETED") else f"cancel requested ({outcome.stage})"
            log.warning("%s: %s %s", why, state, outcome.describe())
        return running

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> list[RemoteOutcome]:
        """Follow every job to its end. Raises JobsCancelled on Ctrl-C (after cancelling the jobs)."""
        pending = {o.job_id: o for o in self.outcomes}
        last_status = {o.job_id: time.monotonic() for o in self.outcomes}
        try:
            for outcome in self.outcomes:
                self._start(outcome)
            while pending:
                try:
                    kind, outcome, value = self.events.get(timeout=0.5)
                except queue.Empty:
                    self._poll_quiet(pending, last_status)
                    continue
                last_status[outcome.job_id] = time.monotonic()
                if kind == "line":
                    self._show(outcome, value)
                    continue
                if kind == "error":
                    self._reconnect(outcome, value)
                    continue
                self._inspect(outcome)  # "end": the stream stops when the job does, or when it was cut
                if not outcome.done or (outcome.exit_code is None and outcome.rereads < REREADS):
                    # huggingface_hub ends the iteration quietly when a stream breaks off ("response ended
                    # prematurely"): a finished job whose log lacks bootstrap.py's last line is read again
                    if outcome.done:
                        outcome.rereads += 1
                    self._start(outcome)
                    continue
                self._settle(outcome)
                del pending[outcome.job_id]
                if outcome.error and not self.keep_going and pending:
                    self.cancel(list(pending.values()), f"{outcome.name} failed, stopping the other jobs "
                                                        "(--keep-going lets them finish)")
        except KeyboardInterrupt:
            raise self.interrupted() from None
        return self.outcomes

    def interrupted(self) -> JobsCancelled:
        """Ctrl-C: cancel every job still running; the error to raise says which were."""
        cancelled = self.cancel(self.outcomes, "Ctrl-C")
        names = ", ".join(o.job_id for o in cancelled) or "none was still running"
        return JobsCancelled(f"interrupted (Ctrl-C): cancelled the running jobs on the Hub ({names})")

    def _reconnect(self, outcome: RemoteOutcome, exc: BaseException) -> None:
        count = self.failures[outcome.job_id] = self.failures.get(outcome.job_id, 0) + 1
        if count > RECONNECTS or not hub.is_transient(exc):
            raise LostConnection(f"lost the log of {outcome.describe()} ({hub.short(exc)}); it may still be running: "
                                 f"follow it again with `hf-ao-publish --attach {outcome.job_id}`")
        wait = min(8.0, 0.5 * 2 ** (count - 1))
        log.info("%s: reading its log failed (%s); following it again in %.1f s", outcome.describe(), hub.short(exc), wait)
        time.sleep(wait)
        self._start(outcome)

    def _poll_quiet(self, pending: dict[str, RemoteOutcome], last: dict[str, float]) -> None:
        """A job that prints nothing (waiting for its hardware) has its stage checked, and a change reported."""
        now = time.monotonic()
        for outcome in list(pending.values()):
            if now - last[outcome.job_id] < STATUS_EVERY_S:
                continue
            last[outcome.job_id] = now
            before = outcome.stage
            try:
                self._inspect(outcome)
            except Exception as exc:  # a status check is informative only; the log reader decides
                log.debug("status of %s: %s", outcome.describe(), exc)
                continue
            if outcome.stage != before:
                log.info("%s is %s", outcome.describe(), outcome.stage)
