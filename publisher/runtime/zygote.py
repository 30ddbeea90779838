"""A zygote: an interpreter that has imported torch (and what else it is told) and nothing of a run, and forks a
child per script to run.

Run as a *script* (``python zygote.py [MODULE...]``) by publisher/runtime/zygotes.py, in any interpreter (it
imports nothing of ``publisher``, only the standard library and the modules named). It imports the modules named
(default: torch and ``torch._dynamo``, torch's own module that torchao's import brings in on every load path),
freezes what they made, says it is ready, and then serves requests from stdin, one JSON line each::

    {"argv": [SCRIPT, ARG...], "env": {...}, "cwd": DIR, "stdout": FILE, "stderr": FILE}

For each it forks a child that takes the caller's environment, working directory and ``sys.argv`` as they are now,
sends stdout and stderr to those files, leads a process group of its own (the caller kills the group), and runs
``SCRIPT`` as ``__main__`` (``runpy.run_path``, as ``python SCRIPT ARG...`` would, ``sys.path[0]`` its folder).
The zygote answers ``{"pid": N}`` at once and ``{"exit": CODE}`` when the child has ended (CODE as ``subprocess``
gives it: negative for a signal). It ends when stdin closes, so it never outlives its caller for long.

What the modules read from the environment when imported is the zygote's: the caller starts one per environment
(publisher/runtime/zygotes.py says which variables count). What they print when imported (torchao's lines about its
optional kernels, torch's deprecation warnings, ...) is kept, and every child writes it to its own stdout and stderr
before it runs the script, as a fresh interpreter that imported them first would have.
"""

import gc
import json
import os
import runpy
import signal
import sys
import tempfile

PRELOAD = ("torch", "torch._dynamo")  # when no module is named


def _become(req, proto, printed):
    """In the forked child: become the process ``python SCRIPT ARG...`` would be, up to running the script."""
    os.close(proto)
    os.setsid()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
        os.write(fd, printed[fd])  # what the imports printed (a regular file takes it whole)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - not the zygote's buffered requests
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = list(req["argv"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))


def _import(preload):
    """Import the modules; what they print on fd 1 and fd 2 (Python's own streams and C code's alike), by fd."""
    kept = {}
    for fd in (1, 2):
        kept[fd] = (os.dup(fd), tempfile.TemporaryFile())  # noqa: SIM115 - closed below
        os.dup2(kept[fd][1].fileno(), fd)
    try:
        for name in preload:
            __import__(name)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        printed = {}
        for fd, (saved, file) in kept.items():
            os.dup2(saved, fd)
            os.close(saved)
            file.seek(0)
            printed[fd] = file.read()
            file.close()
    return printed


def _exit_code(status):
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def serve(preload):
    proto = os.dup(1)  # the answers; fd 1 itself goes nowhere, so an import that prints cannot garble them
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    del sys.path[0]  # this script's folder: nothing in it may stand in for a module torch imports
    gc.disable()
    try:
        printed = _import(preload)
    except BaseException:  # noqa: BLE001 - reported as "not ready": the caller starts fresh interpreters, which
        os.write(proto, b'{"ready": false}\n')  # fail (or not) on their own, from a clean state
        return 1
    gc.collect()
    gc.enable()
    gc.freeze()  # the children's collections skip what the imports made (and forking copies fewer pages)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # CUDA does not survive a fork: no zygote, then
        os.write(proto, b'{"ready": false}\n')
        return 1
    os.write(proto, b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # the child runs the script and ends as an interpreter ends: an exception or SystemExit from the script
            # goes up from here to the top, the interpreter prints it, runs the atexit handlers, sets the exit code
            _become(req, proto, printed)
            runpy.run_path(sys.argv[0], run_name="__main__")
            return 0
        os.write(proto, json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        os.write(proto, json.dumps({"exit": _exit_code(status)}).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:] or PRELOAD))
