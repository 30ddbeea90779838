"""What the test files share: the command-line pieces that set a test's tier, the session's transfer mode, and the
helpers that seed the loopback Hub, damage its downloads, copy a model folder and run a card snippet. No fixtures
(tests/conftest.py holds them, and the hooks); test files import from here: ``from helpers import seed``.

tests/conftest.py imports this module while it sets the environment up, before huggingface_hub and torch are
imported anywhere (both read their variables when imported): nothing here imports either, or any module that does,
at module level; the helpers import what they need when called.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from publisher import compat  # no torch, no huggingface_hub: the variables' names, as the CLI reads them
from publisher.quality import options as quality_options

# The session's transfer mode: "xet" (huggingface_hub's default, as users' transfers run) or "lfs" (Xet off: plain LFS
# and HTTP); conftest sets HF_HUB_DISABLE_XET from it, `make test` runs the tests marked `transfer` in both.
TRANSFER = os.environ.get("HF_AO_TEST_TRANSFER", "xet")
if TRANSFER not in ("xet", "lfs"):
    raise RuntimeError(f"HF_AO_TEST_TRANSFER must be xet or lfs, not {TRANSFER!r}")

DEFAULTS_VARIABLES = (compat.VARIABLE, quality_options.BUDGET_VARIABLE)  # --compat and --eval-budget from the environment

FAST_TRIES = 3  # HF_AO_PUBLISH_RETRIES under the fast_retries fixture
# For publishes whose subject is not the load paths (pushes, re-runs, Hub faults, integrity, resume, signals, quality
# figures, configs, repo ids): verification in process (every saved tensor against the in-memory one, a block-by-block
# forward) instead of the default's reloads in fresh interpreters, at about half the cost. The default stays where the
# load paths are the subject (docs/development.md, "The tiers").
IN_PROCESS = ["--verify-mode", "streaming"]
# The product's defaults (the compatibility matrix: a few environments from PyPI, two reloads each; the quality
# evaluation: perplexity, continuation, image grid) run in every test that does not pass these. A test that is not
# about the evaluation or the matrix passes them on its own command line, for speed (docs/development.md, "The
# tiers"); `verify` has no evaluation: it takes "--compat", "none" alone.
SKIP_EVAL_AND_MATRIX = ["--eval-budget", "0", "--compat", "none"]
# The fresh-interpreter reloads of a default verification read the saved folder on this disk, never the Hub: the
# transfer mode changes nothing in them. Tests marked `transfer` that run them for other reasons (the token never
# written, the CLI's output) keep them in the Xet session, the users' default, and verify in process in the LFS one,
# where only the transfers differ. (test_job.py's pipeline publish keeps the default verification in both.)
XET_DEFAULT_VERIFY = [] if TRANSFER == "xet" else IN_PROCESS

# The CLI run in-process (the cli fixture, CliRunner: stderr is no terminal) turns progress bars off for itself and
# the processes it starts by setting these (publisher/runtime/progress.py); they end with the test that ran it
# (conftest's _progress_vars_restored).
PROGRESS_VARS = ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")

# What progress bars leave in a log that is no terminal: carriage returns, escape codes, rates, tqdm's bar edge, and
# the bars' own texts (huggingface_hub and hf_xet, transformers, diffusers, our streaming engine's).
BAR_MARKS = ("\r", "\x1b", "it/s", "B/s", "%|", "Processing Files", "New Data Upload", "Validating", "LFS files",
             "Loading weights", "Writing model shards", "Loading pipeline components", "Fetching", "quantize Flux")


def progress_bars(stderr: str) -> list[str]:
    """The lines of ``stderr`` (split on newlines only, so a bar's redraws stay in its line) a progress bar drew."""
    return [line for line in stderr.split("\n") if any(mark in line for mark in BAR_MARKS)]


def seed(repo_id: str, folder: Path, token: str, **kwargs: Any) -> str:
    """Upload a local model folder as a Hub repo; returns its commit sha."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, exist_ok=True, **kwargs)
    return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="seed").oid


def ranged_bytes(hub: Any, prefix: str) -> int:
    """Bytes the loopback Hub was asked for by Range GETs of files under ``prefix`` (a /<repo>/resolve/<sha>/ path)."""
    total = 0
    for method, path, rng in hub.app.seen:
        if method == "GET" and rng and path.startswith(prefix):
            start, _, end = rng.removeprefix("bytes=").partition("-")
            total += int(end) - int(start) + 1
    return total


def download_fault(hub: Any, how: str, match: str, *, at: int = 0, count: int = 1) -> str:
    """Damage downloads where this session's downloads flow: hf_xet's CAS with Xet (the file's first xorb; ``at`` is
    ignored), the HTTP body with Xet off (``at``: the byte flipped, or where the body is cut). ``how``: "flip" or
    "truncate". Returns the fault kind that ``hub.faults_fired`` will count."""
    if TRANSFER == "xet":
        hub.set_fault(**{f"xet_{how}": True}, match=match, count=count)
        return f"xet_{how}"
    hub.set_fault(**{"flip_byte_at" if how == "flip" else "truncate_body_at": at}, match=match, count=count)
    return how


def distinct_copy(src: Path, dst: Path, salt: int) -> Path:
    """A copy of a model folder whose safetensors weights differ from ``src``'s (one value changed per file), so that
    no cache holds them yet: with Xet, huggingface_hub's cache-wide shared blob store deduplicates files by content
    across repos, and a test of what a download does needs a download to happen."""
    import safetensors.torch

    shutil.copytree(src, dst)
    for path in sorted(dst.rglob("*.safetensors")):
        with safetensors.safe_open(str(path), "pt") as f:
            metadata = f.metadata()
        tensors = safetensors.torch.load_file(str(path))
        name = next(k for k, t in sorted(tensors.items()) if t.is_floating_point() and t.numel() > 1)
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += salt * 2.0**-6
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return dst


def run_snippet(code: str, cwd: Path, env: dict[str, str], timeout: float) -> Any:
    """What ``python -c CODE`` in ``cwd`` gives (a ``subprocess.CompletedProcess``), as a user pastes a card snippet
    into a new interpreter, forked from a zygote of this interpreter (publisher/runtime/zygotes.py, as the verify
    workers are): it has imported torch and the libraries' model base classes (what every snippet imports first,
    directly or through diffusers or transformers), and nothing else, so a snippet costs its own work and not those
    imports again; what they print when imported is at the head of its stdout and stderr, as in a new interpreter.
    The code is a file in ``cwd``, so ``sys.path[0]`` is ``cwd`` as with ``-c``."""
    from publisher.runtime import zygotes

    script = cwd / f"snippet_{hashlib.sha256(code.encode()).hexdigest()[:12]}.py"
    script.write_text(code)
    return zygotes.run(sys.executable, script, [], env=env, timeout=timeout, outputs=script.with_suffix(""), cwd=cwd,
                       preload=zygotes.LIBRARIES)


# A script that writes what a user's script could notice about its process (argv, folder, ids, stdin, a few variables,
# the modules in ``modules`` it found imported, huggingface_hub's endpoint as its import read it), prints a line to
# each stream, and then crashes, sleeps or exits as its second argument says: zygotes and interpreters started ahead
# are checked with it against a fresh ``python SCRIPT ARG...`` (tests/test_zygotes.py, tests/test_prestarted.py).
_PROBE = """
import json, os, sys
facts = {
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(), "ppid": os.getppid(),
    "pgid": os.getpgid(0), "name": __name__, "stdin": os.readlink("/proc/self/fd/0"),
    "env": {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_TOKEN", "PROBE_VAR")},
    "imported": sorted(m for m in MODULES if m in sys.modules),
}
hub = sys.modules.get("huggingface_hub.constants")  # what the libraries' imports read from the environment
facts["hub_endpoint"] = hub.ENDPOINT if hub else None
open(sys.argv[1], "w").write(json.dumps(facts))
print("to stderr", file=sys.stderr)
print("to stdout")
if len(sys.argv) > 2 and sys.argv[2] == "crash":
    os.kill(os.getpid(), 11)
if len(sys.argv) > 2 and sys.argv[2] == "sleep":
    import time
    time.sleep(600)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 0)
"""


def write_probe(folder: Path, modules: tuple[str, ...]) -> Path:
    """The probe script above, as ``folder/scripts/probe.py``, reporting which of ``modules`` were imported."""
    script = folder / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(_PROBE.replace("MODULES", repr(modules), 1))
    return script


def ended(pid: int) -> bool:
    """Gone, or a zombie (ended, not yet reaped by whoever is its parent now); a process reaped between two looks
    counts as gone."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_ended(pid: int, seconds: float) -> bool:
    """Whether ``pid`` has ended within ``seconds``: a process killed, closed or left without its caller ends a moment
    later, longer on a loaded machine."""
    deadline = time.monotonic() + seconds
    while not ended(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
