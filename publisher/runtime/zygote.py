"""A zygote: an interpreter that has imported torch (and what else it is told) and nothing of a run, and forks a
child per script to run; or, with ``--once``, an interpreter started ahead that becomes the one script it is handed.

Run as a *script* (``python zygote.py [--once] [MODULE...]``) by publisher/runtime/zygotes.py, in any interpreter (it
imports nothing of ``publisher``, only the standard library and the modules named). It imports the modules named
(default: torch and ``torch._dynamo``, torch's own module that torchao's import brings in on every load path),
freezes what they made, says it is ready, and then serves requests from stdin, one JSON line each::

    {"argv": [SCRIPT, ARG...], "env": {...}, "cwd": DIR, "stdout": FILE, "stderr": FILE}

For each it forks a child that takes the caller's environment, working directory and ``sys.argv`` as they are now,
sends stdout and stderr to those files, leads a process group of its own (the caller kills the group), and runs
``SCRIPT`` as ``__main__`` (``runpy.run_path``, as ``python SCRIPT ARG...`` would, ``sys.path[0]`` its folder).
The zygote answers ``{"pid": N}`` at once and ``{"exit": CODE}`` when the child has ended (CODE as ``subprocess``
gives it: negative for a signal). It ends when stdin closes, so it never outlives its caller for long.

A request ``{"branch": {"python": PYTHON, "preload": [MODULE...], "env": {...}, "socket": PATH}}`` forks a zygote of
another list instead: PYTHON is this interpreter (its libraries imported on top of its torch), or a layer over it (a venv of the same Python whose only ``.pth``
file appends this interpreter's site-packages after its own: publisher/verify/envs.py builds them), and its torch is
this one's. The child connects to the Unix socket PATH (the caller listens there; that connection is its stdin and
its answers from then on), becomes what PYTHON would be at start-up (its prefix, executable and ``sys.path``), takes
``env``, imports the modules named and serves like any zygote. So the layer's scripts start past torch's import,
made once for every layer. It refuses (``{"ready": false, "not_a_layer": WHY}``, and ends) wherever that would differ
from a fresh PYTHON that imported torch first: another Python, a ``.pth`` file that does more than append our
site-packages, or a top-level package in the layer that is imported here already (a layer holding its own torch or
one of torch's dependencies): the caller then starts a zygote in PYTHON itself. The zygote answers ``{"pid": N}``
and, the branch being a server of its own, no exit line.

``--once`` is for a script that must not run in a forked child (a load on a GPU: CUDA cannot be used across a
fork, publisher/runtime/prestarted.py): the same imports and ready line, then one request, answered ``{"pid": N}``
(its own pid), and the interpreter itself becomes the child described above (it already leads its own process group:
the caller starts it in a new session) and runs the script; its exit status is the script's, as the caller's
``subprocess`` sees it. stdin closed before a request comes: it ends, having run nothing. What the imports may
leave of CUDA differs between the two modes (``_holds_cuda``).

What the modules read from the environment when imported is the zygote's: the caller starts one per environment
(publisher/runtime/zygotes.py says which variables count). What they print when imported (torchao's lines about its
optional kernels, torch's deprecation warnings, ...) is kept, and every child writes it to its own stdout and stderr
before it runs the script, as a fresh interpreter that imported them first would have.
"""

import ast
import gc
import importlib
import json
import os
import runpy
import signal
import site
import socket
import sys
import tempfile

PRELOAD = ("torch", "torch._dynamo")  # when no module is named


def _become(req, proto, printed, forked=True):
    """In the forked child (or the ``--once`` interpreter itself): become the process ``python SCRIPT ARG...`` would
    be, up to running the script."""
    os.close(proto)
    if forked:  # a --once interpreter leads its group already (a session leader cannot call setsid)
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
    """Import the modules, up to the first that fails: what they print on fd 1 and fd 2 (Python's own streams and C
    code's alike), by fd, and the name of the one that failed (None when all were imported)."""
    kept = {}
    for fd in (1, 2):
        kept[fd] = (os.dup(fd), tempfile.TemporaryFile())  # noqa: SIM115 - closed below
        os.dup2(kept[fd][1].fileno(), fd)
    failed = None
    try:
        for name in preload:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - named in the answer: this list will never import here
                failed = name
                break
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
    return printed, failed


def _exit_code(status):
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _prepare(preload, once):
    """Make the imports with fd 1 kept for the answers; (the answers' fd, what the imports printed by fd), or None when
    not ready (said on the answers' fd: the caller runs the script in a fresh interpreter instead)."""
    proto = os.dup(1)  # the answers; fd 1 itself goes nowhere, so an import that prints cannot garble them
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    del sys.path[0]  # this script's folder: nothing in it may stand in for a module torch imports
    printed = _ready_after(preload, proto, once)
    return None if printed is None else (proto, printed)


def _ready_after(preload, proto, once):
    """Make the imports and say on ``proto`` whether this process can serve: what they printed by fd, or None when
    not ready (the caller runs the script in a fresh interpreter instead)."""
    gc.disable()
    try:
        printed, failed = _import(preload)
    except BaseException:  # noqa: BLE001 - reported as "not ready": the caller starts fresh interpreters, which
        os.write(proto, b'{"ready": false}\n')  # fail (or not) on their own, from a clean state
        return None
    if failed is not None:  # the same, and the caller need not try this list in this interpreter again
        os.write(proto, json.dumps({"ready": False, "unimportable": failed}).encode() + b"\n")
        return None
    gc.collect()
    gc.enable()
    gc.freeze()  # the children's collections skip what the imports made (and forking copies fewer pages)
    if _holds_cuda(sys.modules.get("torch"), once):
        os.write(proto, b'{"ready": false}\n')
        return None
    os.write(proto, b'{"ready": true}\n')
    return printed


def _holds_cuda(torch, once):
    """Whether the imports left CUDA in a state this mode cannot serve from.

    A zygote: torch's CUDA state initialized at all (CUDA does not survive a fork). A --once interpreter does not
    fork: the process that initialized CUDA is the one that uses it, as in a fresh interpreter making the same imports
    (torchao 0.18's import does, on a machine with a CUDA GPU: its kernel checks call
    ``torch.cuda.get_device_capability()``, which runs torch's lazy CUDA init). It only must not hold a CUDA context
    while it waits (GPU memory, beside the quantization it was started with): torch's init creates none, an
    allocation or ``set_device`` would. Where torch cannot say (a build without ``_cuda_hasPrimaryContext``): refused."""
    if torch is None or not torch.cuda.is_initialized():
        return False
    if not once:
        return True
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return has_context is None or any(has_context(i) for i in range(torch.cuda.device_count()))


def serve(preload):
    prepared = _prepare(preload, once=False)
    if prepared is None:
        return 1
    proto, printed = prepared
    return _serve(sys.stdin.buffer, proto, printed)


def _serve(requests, proto, printed):
    branches: set[int] = set()
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        branches -= {pid for pid in branches if os.waitpid(pid, os.WNOHANG)[0]}  # reap the branches that ended
        pid = os.fork()
        if pid == 0:
            if "branch" in req:
                return _branch(req["branch"], proto, printed)
            # the child runs the script and ends as an interpreter ends: an exception or SystemExit from the script
            # goes up from here to the top, the interpreter prints it, runs the atexit handlers, sets the exit code
            _become(req, proto, printed)
            runpy.run_path(sys.argv[0], run_name="__main__")
            return 0
        os.write(proto, json.dumps({"pid": pid}).encode() + b"\n")
        if "branch" in req:  # a zygote of its own, which answers its caller directly from now on
            branches.add(pid)
            continue
        _, status = os.waitpid(pid, 0)
        os.write(proto, json.dumps({"exit": _exit_code(status)}).encode() + b"\n")
    return 0


def _branch(spec, parent_proto, printed):
    """In a child of this zygote: the zygote of the layer ``spec["python"]`` (see the module's docstring); its exit
    status."""
    os.close(parent_proto)  # the parent's answers are the parent's: its caller must see them end with it
    os.setsid()  # a group of its own, which its caller kills on close
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(spec["socket"])
    fd = conn.detach()
    os.dup2(fd, 0)  # its requests come on fd 0, as a zygote's come on its stdin ...
    os.close(fd)
    proto = os.dup(0)  # ... and its answers go back on the same connection
    why = None if spec["python"] == sys.executable else _enter_layer(spec["python"])  # ours: no layer to enter
    if why is not None:
        os.write(proto, json.dumps({"ready": False, "not_a_layer": why}).encode() + b"\n")
        return 1
    os.environ.clear()
    os.environ.update(spec["env"])  # what the libraries read when imported (torch read ours, alike for it)
    more = _ready_after(spec["preload"], proto, False)
    if more is None:
        return 1
    return _serve(open(0, "rb", closefd=False), proto, {fd: printed[fd] + more[fd] for fd in (1, 2)})  # noqa: SIM115


def _enter_layer(python):
    """Make this interpreter what the venv ``python`` is at start-up when that is a layer over this one (see the
    module's docstring): its prefix, executable and ``sys.path`` (its site-packages before ours, where a fresh
    interpreter has it). None when done, else why it is not such a layer (nothing changed then)."""
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    try:
        with open(os.path.join(prefix, "pyvenv.cfg"), encoding="utf-8") as f:
            cfg = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
    except OSError as exc:
        return f"no pyvenv.cfg ({exc.strerror})"
    cfg = {k.strip(): v.strip() for k, v in cfg.items()}
    if os.path.realpath(python) != os.path.realpath(sys.executable) or cfg.get("version") != "{}.{}.{}".format(*sys.version_info[:3]):
        return "another Python"
    if cfg.get("include-system-site-packages", "false").lower() != "false":
        return "it includes the system's site-packages"
    layer_site = os.path.join(prefix, "lib", "python{}.{}".format(*sys.version_info[:2]), "site-packages")
    try:
        names = sorted(os.listdir(layer_site))
    except OSError as exc:
        return f"no site-packages ({exc.strerror})"
    appended = []
    for name in (n for n in names if n.endswith(".pth")):
        with open(os.path.join(layer_site, name), encoding="utf-8") as f:
            for line in f.read().splitlines():
                dir_ = _appended_dir(line)
                if dir_ is None and line.strip() and not line.startswith("#"):
                    return f"{name} does more than append a site-packages folder"
                if dir_ is not None:
                    appended.append(dir_)
    if not appended or not all(d in sys.path for d in appended):
        return "its .pth files do not append this interpreter's site-packages"
    imported = {m.partition(".")[0] for m in sys.modules}
    for name in names:
        top = name.partition(".")[0]
        if not name.endswith((".dist-info", ".egg-info", ".pth")) and top != "__pycache__" and top in imported:
            return f"it holds {top}, imported here already"
    sys.path.insert(sys.path.index(appended[0]), layer_site)
    importlib.invalidate_caches()
    sys.prefix = sys.exec_prefix = prefix
    site.PREFIXES = [prefix]
    sys.executable = python
    return None


def _appended_dir(line):
    """The folder of a ``.pth`` line ``import site; site.addsitedir('DIR')`` (what publisher/verify/envs.py writes),
    else None."""
    head, sep, rest = line.strip().partition("site.addsitedir(")
    if head.strip() != "import site;" or not sep or not rest.endswith(")"):
        return None
    try:
        value = ast.literal_eval(rest[:-1])
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, str) else None


def once(preload):
    """Ready, one request, then this interpreter is the script's process (as a forked child is), ending as it ends."""
    prepared = _prepare(preload, once=True)
    if prepared is None:
        return 1
    proto, printed = prepared
    line = sys.stdin.buffer.readline()
    if not line:  # the caller ended, or closed an interpreter it did not need
        return 0
    req = json.loads(line)
    os.write(proto, json.dumps({"pid": os.getpid()}).encode() + b"\n")
    sys.stdout.flush()
    sys.stderr.flush()
    _become(req, proto, printed, forked=False)
    runpy.run_path(sys.argv[0], run_name="__main__")  # an exception or SystemExit goes up to the top, as in serve
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--once"]:
        sys.exit(once(sys.argv[2:] or PRELOAD))
    sys.exit(serve(sys.argv[1:] or PRELOAD))
