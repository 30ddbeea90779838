"""Single-use interpreters started ahead, for the scripts that cannot be forked from a zygote (a load on a GPU: CUDA
cannot be used across a fork).

Each is ``python zygote.py --once MODULE...`` (publisher/runtime/zygote.py): it makes the imports a zygote makes,
says it is ready, and waits for one request; handed one, it becomes the script's process itself, in-process, as a
forked child would be (the caller's arguments, folder and environment, stdout and stderr to files, ``__main__``), and
ends with the script's exit status. Started while the caller does something else (the quantization: issue 41), its
imports overlap that work, and the script starts past them when its turn comes. Used once: a second script needs
another.

The pool is keyed by what the caller says the interpreter serves (publisher/runtime/zygotes.py: the interpreter,
its imports and every variable those could read), so an interpreter is handed only a script whose environment its
imports would have read alike. An interpreter never handed a script is killed when the process ends (``close_all``
at exit), or ends on its own once its stdin closes (the process gone without cleanup).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

from publisher.runtime import procs
from publisher.runtime.zygote_pipe import READY_TIMEOUT_S, Gone, Server

log = logging.getLogger(__name__)


class Prestarted(Server):
    """One ``zygote.py --once`` process, ready or still importing."""

    def __init__(self, python: str, env: Mapping[str, str], preload: Sequence[str]) -> None:
        super().__init__(python, env, preload, once=True)

    def hand(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, outputs: tuple[Path, Path]) -> None:
        """Hand it the script (see ``Server.send``), waiting for its imports if they are not done yet, until it has
        taken it. Raises ``Gone`` or ``subprocess.TimeoutExpired`` (it is killed then) if it has not: the script did
        not start, and runs in a fresh interpreter instead."""
        try:
            self.send(argv, env, cwd, outputs)
            self.ready()
            if self.line(time.monotonic() + READY_TIMEOUT_S).get("pid") != self.proc.pid:
                raise Gone("took no request")
        except BaseException:  # Gone, a timeout, SIGINT/SIGTERM (errors.Interrupted): nothing is left running
            self.close()
            raise
        for pipe in (self.proc.stdin, self.proc.stdout):  # the protocol is over: the script owns the process
            if pipe is not None:
                pipe.close()

    def wait(self, timeout: float | None) -> int:
        """The script's exit status (as ``subprocess`` gives it: negative for a signal). On any exception (a timeout:
        ``subprocess.TimeoutExpired``, SIGINT/SIGTERM) its process group is killed first, as ``procs.run`` does."""
        try:
            return self.proc.wait(timeout)
        except BaseException:
            procs.kill_group(self.proc)
            raise

    def close(self, grace: float = 0) -> None:
        """Kill it (and reap it): one not handed a script holds nothing but its imports, so it is not waited for."""
        super().close(grace)


_pool: dict[Hashable, list[Prestarted]] = {}
_without: set[Hashable] = set()  # keys whose interpreter could not start one (not ready): fresh interpreters
_lock = threading.Lock()


def start(key: Hashable, python: str, env: Mapping[str, str], preload: Sequence[str], count: int, limit: int) -> int:
    """Make ``count`` interpreters wait for ``key`` (those already waiting count), with at most ``limit`` waiting in
    all; returns how many were started now. Popen returns once the interpreter runs: the imports go on meanwhile."""
    started = 0
    with _lock:
        if key in _without:
            return 0
        waiting = _pool.setdefault(key, [])
        total = sum(len(p) for p in _pool.values())
        while len(waiting) < count and total < limit:
            try:
                waiting.append(Prestarted(python, env, preload))
            except OSError as exc:  # no such interpreter: its scripts fail (or not) on their own, fresh
                log.debug("no interpreter started ahead for %s (%s)", python, exc)
                _without.add(key)
                break
            started += 1
            total += 1
    return started


def take(key: Hashable) -> Prestarted | None:
    """The first one started for ``key`` (the one most likely ready), out of the pool; None where there is none."""
    with _lock:
        waiting = _pool.get(key)
        return waiting.pop(0) if waiting else None


def keys() -> list[Hashable]:
    """The keys some interpreter waits for."""
    with _lock:
        return [k for k, v in _pool.items() if v]


def refuse(key: Hashable) -> None:
    """An interpreter for ``key`` could not take its script (not ready: an import failed, or initialized CUDA): its
    siblings would not either; they are killed and none is started again for it."""
    with _lock:
        _without.add(key)
        waiting = _pool.pop(key, [])
    for p in waiting:
        p.close()


@atexit.register
def close_all() -> None:
    with _lock:
        waiting = [p for ps in _pool.values() for p in ps]
        _pool.clear()
    for p in waiting:
        p.close()

