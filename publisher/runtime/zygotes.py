"""Python scripts run in children forked from a zygote of their interpreter, in an interpreter started ahead, or in a
fresh interpreter.

A verify worker is a fresh interpreter by design (publisher/verify/workers.py), and most of its time goes to
imports: torch (some 3 s of a worker's 5 s on a 2-core machine), then the library and torchao (1 to 2 s).
``run()`` forks the script from a zygote that has made those imports once (publisher/runtime/zygote.py): a
process that verifies several load paths, recipes or environments (a test session too) makes them once per
interpreter. The child is what ``python SCRIPT ARG...`` would be after those imports: the caller's environment,
working directory and arguments, its own process group, stdout and stderr in files that are read back.

What a zygote imports is the caller's choice, and only what the script would import first anyway: ``TORCH`` for
any script (a card snippet's first line is ``import torch``), ``LIBRARIES`` for a load path (what every load path
imports before it reads a checkpoint: transformers' and diffusers' model base classes, with whatever those import
in the interpreter's versions; where one of them cannot be imported, the caller's ``fallback``: those of the
libraries the script loads; a failure the caller asks to ``remember`` is kept in a file, and later processes start
the fallback at once). A zygote serves one interpreter, one such list and one environment: it is reused
only while every variable its imports could read is what it was when it started (``NOT_READ_BY_TORCH`` and
``NOT_READ_BY_LIBRARIES`` list those that may differ: the token, our own, ...); what lives at
once (the least recently used is closed past ``zygote_budget()``: 8 zygotes of their own, more branches, less where
memory is short).

A layered environment (a venv over this interpreter that shadows a few packages: publisher/verify/envs.py builds
them for the compatibility matrix and --verify-env) imports the same torch from the same files. Where the caller
says so (``branch_from``), its zygote is forked from this interpreter's torch zygote and becomes that environment
there (its prefix, executable and ``sys.path``) before it imports the rest of its list; this interpreter's own
load-path zygote branches from it the same way (no layer to enter). One import of torch for all of them (about 2.8 s
of CPU each here) instead of one each. The zygote refuses where the child would differ
from a fresh interpreter of the layer (publisher/runtime/zygote.py ``_enter_layer``), and the layer gets a zygote of
its own as before.

A caller whose script must not be forked (a load on a GPU: CUDA cannot be used across a fork, so it is initialized
in the new process only) says so (``forked=False``): the script runs in an interpreter that ``prestart`` started ahead
(the same interpreter, imports and environment, compared as a zygote's), which made the imports and then becomes the
script's process itself (no fork: publisher/runtime/prestarted.py), used once; where none waits, in a fresh one.

Where there is no zygote (or, unforked, no interpreter started ahead) the script runs in a fresh interpreter: not on
Linux (fork after torch's import is what PyTorch's own data loaders do on Linux; macOS's system libraries refuse
it; the interpreters started ahead are kept to the same platform), with ``HF_AO_PUBLISH_ZYGOTE=0``, or when the
interpreter cannot run one (a stand-in script, an interpreter that exits, an import that fails, the imports having
initialized CUDA; for an interpreter started ahead, having made a CUDA context: runtime/zygote.py ``_holds_cuda``). Zygotes and interpreters started ahead end with the process (and on their own when it is
gone: their stdin closes).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

from publisher.io import keptfile
from publisher.runtime import prestarted, procs, zygote
from publisher.runtime.zygote_pipe import READY_TIMEOUT_S, Branch, Channel, Gone, NotReady, Server, Unimportable

log = logging.getLogger(__name__)

SWITCH = "HF_AO_PUBLISH_ZYGOTE"
# one that imported torch and the libraries' base classes (measured: 353 MB unique); an interpreter started ahead
# holds the same
ZYGOTE_BYTES = 360 * 1024 * 1024
BRANCH_BYTES = 150 * 1024 * 1024  # a branch of a torch zygote that imported the libraries (runtime/zygote.py)
TORCH = tuple(zygote.PRELOAD)  # torch and torch._dynamo: the first import of every script we run
# ... and what every load path imports before it reads a checkpoint: the libraries' model base classes (in the versions
# we run, transformers' imports torchao); a script that loads no model never gets these
LIBRARIES = (*TORCH, "transformers.modeling_utils", "diffusers.models.modeling_utils")
# How long an import list that failed in an interpreter stays refused there (``run``'s ``remember``): an interpreter
# whose packages change in place would learn again after this
REMEMBER_TTL_S = 7 * 24 * 3600
# Variables a zygote's imports do not read. Torch reads none of the Hugging Face libraries' (or ours); the libraries
# read theirs at import (huggingface_hub its endpoint and folders, ...) but the token only when a call needs it, and
# none reads ours. PYTEST_CURRENT_TEST changes with every test and is read by none.
NOT_READ_BY_TORCH = ("HF_", "HUGGINGFACE_", "HUGGING_FACE_", "TRANSFORMERS_", "DIFFUSERS_", "PYTEST_CURRENT_TEST")
NOT_READ_BY_LIBRARIES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_AO_PUBLISH_", "PYTEST_CURRENT_TEST")


class Zygote:
    """One zygote, serving one script at a time: a process of its own (``Server``: publisher/runtime/zygote.py run by
    ``python``), or a branch of this interpreter's torch zygote for a layered environment (``Branch``)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        try:
            channel.ready()
        except BaseException:
            channel.close()
            raise

    def run(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, outputs: tuple[Path, Path],
            timeout: float | None) -> int:
        """Fork a child that runs ``argv`` (script and arguments) in ``cwd``, its stdout and stderr to ``outputs``;
        its exit code. Raises ``subprocess.TimeoutExpired`` after killing it, ``Gone`` if the zygote went away."""
        self.channel.send(argv, env, cwd, outputs)
        pid = int(self.channel.line(time.monotonic() + READY_TIMEOUT_S)["pid"])
        deadline = time.monotonic() + timeout if timeout is not None else None
        try:
            return int(self.channel.line(deadline)["exit"])
        except subprocess.TimeoutExpired:
            _kill_group(pid)
            try:
                self.channel.line(time.monotonic() + 60)  # the killed child's exit: the zygote serves on
            except BaseException:
                self.close()
                raise
            raise
        except BaseException:  # SIGINT/SIGTERM (errors.Interrupted), the zygote gone: the child goes too
            _kill_group(pid)
            self.close()
            raise

    def close(self) -> None:
        self.channel.close()


_Key = tuple[str, tuple[str, ...], frozenset[tuple[str, str]]]
_zygotes: OrderedDict[_Key, Zygote] = OrderedDict()
_without: set[_Key] = set()  # interpreters that could not run one
_early: dict[tuple[str, tuple[str, ...]], _Key] = {}  # (python, preload) -> the key a start() made a zygote for
_lock = threading.RLock()  # a branch's zygote makes its parent's under it


def start(python: str, env: Mapping[str, str], preload: tuple[str, ...] = TORCH,
          branch_from: str | None = None) -> None:
    """Start, on a thread of its own, the zygote that a later ``run`` with these arguments forks from, so its imports
    overlap what the caller does meanwhile (the verification's, the quantization: issue 41). Returns at once; a
    ``run`` that comes before it is ready waits for it (sooner than a fresh one), and one whose environment differs by
    then starts its own (said at debug level)."""
    if not _enabled(env):
        return
    key = _key(python, env, preload)
    with _lock:
        if key in _zygotes or key in _without:
            return
        _early[python, preload] = key
    # a daemon thread: a process that ends before the zygote is ready does not wait for it (atexit closes it)
    threading.Thread(target=_zygote, args=(python, dict(env), preload, None, branch_from), name="zygote-start",
                     daemon=True).start()


def prestart(python: str, env: Mapping[str, str], preload: tuple[str, ...] = TORCH, count: int = 1) -> int:
    """Start ``count`` single-use interpreters (publisher/runtime/prestarted.py) that later ``run(..., forked=False)``
    calls with these arguments take, one each, so their imports overlap what the caller does meanwhile (a GPU load's
    verification while the recipes quantize: issue 41). Those already waiting for the same key count; at most
    ``max_prestarted()`` wait in all. Returns at once, with how many it started."""
    if not _enabled(env):
        return 0
    key = _key(python, env, preload)
    # like a zygote, it gets none of the libraries' variables (no token): the script it becomes gets the caller's
    return prestarted.start(key, python, dict(key[2]), preload, count, max_prestarted())


def run(python: str, script: Path, args: Sequence[str], *, env: Mapping[str, str], timeout: float | None,
        outputs: Path, forked: bool = True, cwd: Path | None = None, preload: tuple[str, ...] = TORCH,
        fallback: tuple[str, ...] | None = None, remember: Path | None = None,
        branch_from: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python script args...`` with ``env`` in ``cwd`` (default: ours), like ``procs.run`` (stdout and stderr in
    the result; a timeout raises ``subprocess.TimeoutExpired`` after the kill), forked from a zygote that imported
    ``preload`` where there is one and ``forked``; not ``forked``, in an interpreter ``prestart`` started with these
    arguments where one waits. Such a child writes its stdout and stderr to ``outputs`` + ``.stdout`` / ``.stderr``,
    which are read back. ``fallback``: the imports of a zygote to fork from where one of ``preload`` cannot start in
    that interpreter (an import that fails there), before a fresh interpreter. ``remember``: a file where such a
    failure is kept for later processes (of an interpreter whose packages never change: a spec-built environment's),
    so they start the ``fallback`` zygote at once instead of making ``preload``'s imports up to the one that fails.
    ``branch_from``: an interpreter whose torch zygote the zygote of ``python`` may branch from, past torch's import:
    ``python`` itself, or one it may be a layer over (a built environment: publisher/verify/envs.py;
    publisher/runtime/zygote.py says when a layer is refused)."""
    argv = [str(script), *args]
    files = (outputs.with_name(outputs.name + ".stdout"), outputs.with_name(outputs.name + ".stderr"))
    workdir = str(cwd or os.getcwd())
    z = _zygote(python, env, preload, remember, branch_from) if forked else None
    if z is None and forked and fallback is not None and fallback != preload:
        z = _zygote(python, env, fallback, remember, branch_from)
    if z is not None:
        with z.lock:
            try:
                code = z.run(argv, env, workdir, files, timeout)
            except Gone as exc:
                log.debug("the zygote of %s went away (%s); a fresh interpreter instead", python, exc)
                _forget(z)
            else:
                return subprocess.CompletedProcess([python, *argv], code, _read(files[0]), _read(files[1]))
            finally:
                if z.channel.ended():
                    _forget(z)
    p = None if forked else _prestarted(python, env, preload)
    if p is not None:
        try:
            p.hand(argv, env, workdir, files)
        except (Gone, subprocess.TimeoutExpired) as exc:  # it ran nothing (and is gone): a fresh interpreter runs it
            log.debug("an interpreter of %s started ahead could not take the script (%s); fresh interpreters "
                      "instead", python, exc)
            prestarted.refuse(_key(python, env, preload))
        else:
            code = p.wait(timeout)
            return subprocess.CompletedProcess([python, *argv], code, _read(files[0]), _read(files[1]))
    return procs.run([python, *argv], env=env, timeout=timeout, cwd=cwd)


def _prestarted(python: str, env: Mapping[str, str], preload: tuple[str, ...]) -> prestarted.Prestarted | None:
    if not _enabled(env):
        return None
    key = _key(python, env, preload)
    p = prestarted.take(key)
    if p is not None:
        log.debug("an interpreter of %s started ahead is used", python)
        return p
    for other in prestarted.keys():  # started ahead for another environment: say what changed since
        if isinstance(other, tuple) and other[:2] == (python, preload):
            changed = sorted({k for k, _ in other[2] ^ key[2]})
            log.debug("the interpreters of %s started ahead are not used: the environment changed since (%s)",
                      python, ", ".join(changed))
    return None


def _enabled(env: Mapping[str, str]) -> bool:
    return sys.platform == "linux" and env.get(SWITCH) != "0"


def _zygote(python: str, env: Mapping[str, str], preload: tuple[str, ...], remember: Path | None = None,
            branch_from: str | None = None) -> Zygote | None:
    if not _enabled(env):
        return None
    key = _key(python, env, preload)
    with _lock:
        if key in _without:
            return None
        early = _early.get((python, preload))
        if key in _zygotes:
            if early == key:
                log.debug("the zygote of %s started early is used", python)
            _zygotes.move_to_end(key)
            return _zygotes[key]
        if early is not None and early != key:
            changed = sorted({k for k, _ in early[2] ^ key[2]})
            log.debug("the zygote of %s started early is not used: the environment changed since (%s)", python,
                      ", ".join(changed))
        kept = keptfile.read(remember, REMEMBER_TTL_S).get(" ".join(preload)) if remember is not None else None
        if kept is not None:
            log.debug("no zygote of %s for %s: %s cannot be imported there (found by an earlier run)", python,
                      ", ".join(preload), kept.get("module"))
            _without.add(key)
            return None
        try:  # the zygote gets none of the libraries' variables (no token): its children get the caller's
            z = _branch(key, branch_from) if branch_from is not None else None
            z = z or Zygote(Server(python, dict(key[2]), preload))
        except (OSError, Gone, subprocess.TimeoutExpired) as exc:
            log.debug("no zygote for %s (%s): fresh interpreters", python, exc)
            _without.add(key)
            if isinstance(exc, Unimportable) and remember is not None:
                keptfile.keep(remember, {" ".join(preload): {"module": exc.module}}, REMEMBER_TTL_S)
            return None
        _zygotes[key] = z
        budget = zygote_budget()
        while len(_zygotes) > 1 and sum(_bytes(v) for v in _zygotes.values()) > budget:
            _zygotes.popitem(last=False)[1].close()
        return z


def _branch(key: _Key, base: str) -> Zygote | None:
    """The zygote for ``key`` forked from ``base``'s torch zygote, past torch's import; None where that zygote cannot
    be had or ``key``'s interpreter is no layer over ``base`` (the caller then starts one in that interpreter).
    ``Unimportable``: an import of the rest of the list failed there, as it would in a zygote of its own."""
    python, preload, env = key
    rest = preload[len(TORCH):]
    if preload[:len(TORCH)] != TORCH or not rest:
        return None
    parent = _zygote(base, dict(env), TORCH)  # what the torch zygote is keyed by: the variables torch could read
    if parent is None:
        return None
    with parent.lock:
        try:
            z = Zygote(Branch(parent.channel, python, dict(env), rest))
        except (Unimportable, NotReady):  # a zygote of its own would say the same
            raise
        except (OSError, Gone, subprocess.TimeoutExpired) as exc:  # NotALayer included: no layer over ``base``
            log.debug("no branch of the zygote of %s for %s (%s): a zygote of its own", base, python, exc)
            if parent.channel.ended():
                _forget(parent)
            return None
    log.debug("the zygote of %s branched from the zygote of %s", python, base)
    return z


def _key(python: str, env: Mapping[str, str], preload: tuple[str, ...]) -> _Key:
    """What a zygote serves: the interpreter, its imports, and every variable those imports could read."""
    unread = NOT_READ_BY_TORCH if all(m.split(".")[0] == "torch" for m in preload) else NOT_READ_BY_LIBRARIES
    return python, preload, frozenset((k, v) for k, v in env.items() if not k.startswith(unread))


def zygote_budget() -> int:
    """The memory the zygotes that live at once may hold (the least recently used are closed past it): enough for
    this interpreter's and every environment of the default compatibility matrix (up to 6) and the card snippets' (8
    zygotes of their own, or many more branches: ``_bytes``), ``_spare_bytes`` where that is less, never under 3
    zygotes."""
    return int(max(3 * ZYGOTE_BYTES, min(8 * ZYGOTE_BYTES, _spare_bytes())))


def _bytes(z: Zygote) -> int:
    """What a zygote holds of its own: a branch shares its torch zygote's pages (measured: 105 MB unique against 267 MB
    for a zygote of its own of the same imports, and 62 MB for the torch zygote beside its branches)."""
    return BRANCH_BYTES if isinstance(z.channel, Branch) else ZYGOTE_BYTES


def max_prestarted() -> int:
    """How many single-use interpreters may wait at once: at most as many as zygotes, and none past the memory
    bound (each is a head start only: a script with none runs fresh)."""
    return min(8, int(_spare_bytes() // ZYGOTE_BYTES))


def _spare_bytes() -> float:
    """What the processes kept for later (zygotes, interpreters started ahead) may hold: a sixth of the memory
    available."""
    import psutil

    return psutil.virtual_memory().available / 6


def _forget(z: Zygote) -> None:
    with _lock:
        for key, value in list(_zygotes.items()):
            if value is z:
                del _zygotes[key]
    z.close()


@atexit.register
def close_all() -> None:
    with _lock:
        while _zygotes:
            _zygotes.popitem()[1].close()


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (it makes one, its pid the group's, a moment after the fork; before that,
    the child alone)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
