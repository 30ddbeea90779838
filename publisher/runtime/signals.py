"""SIGINT and SIGTERM end a run cleanly: they raise ``errors.Interrupted`` in the main thread.

Python's default SIGTERM kills the process on the spot (no ``finally`` runs: temporary folders, worker processes
and a repo the run had created would all stay), and its SIGINT raises a bare KeyboardInterrupt. Inside
``handled()`` both raise ``Interrupted`` (a KeyboardInterrupt, so ``except Exception`` never swallows it) wherever
the main thread is: in a blocking socket read or ``wait()`` too (PEP 475 runs the handler, which raises). The
stages' own cleanup then runs on the way out (``finally``, ``except BaseException``: temporary folders removed,
the verify and measurement workers' process groups killed (publisher.runtime.procs), a repo this run created deleted),
and the CLI prints one line and exits 128 + the signal (130, 143).

A second signal while that cleanup runs ends the process at once (the user insists; a CI runner sends SIGINT,
then SIGTERM 7.5 s later, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from publisher.errors import Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def handled() -> Iterator[None]:
    """Within this block SIGINT / SIGTERM raise Interrupted; the previous handlers come back afterwards.
    Outside the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) > 1:
            name = Interrupted(signum).signal_name
            os.write(2, f"Error: {name} again while cleaning up; stopped at once, some temporary files may remain\n".encode())
            os._exit(128 + signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in HANDLED}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
