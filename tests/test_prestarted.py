"""Scripts run unforked (a load on a GPU) in an interpreter started ahead (publisher/runtime/prestarted.py,
``zygote.py --once``): it is the script's process itself, what ``python SCRIPT ARG...`` would be with the imports
made; it is used once, only for an environment its imports would have read alike, killed with its group on a
timeout or a signal, and one never used ends with its caller. Without one, a fresh interpreter runs the script.

There is no GPU here: the tests force the unforked path on the CPU (``forked=False``), as a GPU load takes it.
Each interpreter started ahead costs one import of torch (about 3 s here), those of the libraries more.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ended, wait_ended, write_probe

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="interpreters started ahead: Linux only, as zygotes")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    return write_probe(tmp_path, ("torch", "torch._dynamo", "transformers", "noisy_import"))


@pytest.fixture(autouse=True)
def _none_waiting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts its own: none left by another test stands in for them (the pool is the process's). As many as
    a test asks for: the memory bound (``max_prestarted``) moves with what others run on a shared machine."""
    from publisher.runtime import prestarted, zygotes

    monkeypatch.setattr(zygotes, "max_prestarted", lambda: 8)
    prestarted.close_all()
    yield
    prestarted.close_all()


def _waiting(pid: int | None = None) -> set[int]:
    """The interpreters started ahead that are still running, children of ``pid`` (default: this process). A child
    just started may not have its own command line yet: before its exec it is still its parent's, and in the exec,
    after Popen has returned (the exec closed Popen's pipe) but before the kernel has set up the new one, it reads
    empty. Waited for, up to 10 s."""
    import psutil

    parent = psutil.Process(pid)
    deadline = time.monotonic() + 10
    while True:
        found, unborn = set(), False
        for p in parent.children():
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmdline = p.cmdline()
                if "--once" in cmdline:
                    found.add(p.pid)
                unborn = unborn or not cmdline or cmdline == parent.cmdline()
            except psutil.NoSuchProcess:
                continue
        if not unborn or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _run(probe: Path, tmp_path: Path, *args: str, env: dict[str, str], timeout: float = 120, name: str = "facts",
         preload: tuple[str, ...] | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    from publisher.runtime import zygotes

    out = tmp_path / f"{name}.json"
    done = zygotes.run(sys.executable, probe, [str(out), *args], env=env, timeout=timeout, outputs=tmp_path / name,
                       forked=False, preload=preload or zygotes.TORCH)
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_the_interpreter_started_ahead_becomes_the_script_once(probe: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher.runtime import zygotes

    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "HF_ENDPOINT": "http://one.invalid", "HF_TOKEN": "tok_zero"}
    env.pop("PROBE_VAR", None)
    assert zygotes.prestart(sys.executable, env, count=1) == 1
    assert zygotes.prestart(sys.executable, env, count=1) == 0  # one waits already: topped up, not added to
    (ahead,) = _waiting()
    # it gets none of the variables its imports do not read (the token): the script gets the caller's
    assert "tok_zero" not in Path(f"/proc/{ahead}/environ").read_bytes().decode(errors="replace")
    mine = {**env, "HF_TOKEN": "tok_one"}
    done, facts = _run(probe, tmp_path, "7", env=mine)
    # that very process ran the script, torch imported before it started; the process ended with it
    assert facts["pid"] == ahead and facts["imported"] == ["torch", "torch._dynamo"] and ended(ahead)
    assert facts["pgid"] == facts["pid"] != os.getpgid(0)  # its own process group, which a kill takes whole

    # what a new interpreter running the script gives (procs.run's: stdin from /dev/null, the same folder)
    fresh_out = tmp_path / "fresh.json"
    fresh = subprocess.run([sys.executable, str(probe), str(fresh_out), "7"], env=mine, cwd=tmp_path, text=True,
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    expected = json.loads(fresh_out.read_text())
    assert done.returncode == fresh.returncode == 7
    assert done.stdout == fresh.stdout == "to stdout\n" and done.stderr == fresh.stderr == "to stderr\n"
    assert done.args == [sys.executable, str(probe), str(tmp_path / "facts.json"), "7"]
    assert facts["argv"] == [str(probe), str(tmp_path / "facts.json"), "7"]
    assert expected["argv"] == [str(probe), str(fresh_out), "7"]
    for fact in ("name", "cwd", "path0", "stdin", "env"):
        assert facts[fact] == expected[fact], fact
    assert facts["env"] == {"HF_ENDPOINT": "http://one.invalid", "HF_TOKEN": "tok_one", "PROBE_VAR": None}
    assert expected["imported"] == []

    # used once: the next script runs in a new interpreter
    done, second = _run(probe, tmp_path, env=mine, name="second")
    assert done.returncode == 0 and second["pid"] != ahead and second["imported"] == [] and not _waiting()


def test_only_an_environment_its_imports_would_have_read_alike(probe: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from publisher.runtime import zygotes

    env = dict(os.environ)
    env.pop("PROBE_VAR", None)
    zygotes.prestart(sys.executable, env, count=1)
    (ahead,) = _waiting()
    # a variable torch could read at its import: a new interpreter, and the one started ahead keeps waiting
    with caplog.at_level(logging.DEBUG, logger="publisher.runtime.zygotes"):
        done, facts = _run(probe, tmp_path, env={**env, "PROBE_VAR": "b"}, name="changed")
    assert done.returncode == 0 and facts["pid"] != ahead and facts["imported"] == [] and facts["env"]["PROBE_VAR"] == "b"
    assert "started ahead are not used: the environment changed since (PROBE_VAR)" in caplog.text
    # switched off: a new interpreter too (HF_AO_PUBLISH_ZYGOTE is not read by torch, so the key alone would match)
    done, facts = _run(probe, tmp_path, env={**env, "HF_AO_PUBLISH_ZYGOTE": "0"}, name="off")
    assert done.returncode == 0 and facts["pid"] != ahead and facts["imported"] == []
    assert _waiting() == {ahead}
    # only a variable its imports do not read differs: it runs the script
    done, facts = _run(probe, tmp_path, env={**env, "HF_TOKEN": "tok"}, name="token")
    assert done.returncode == 0 and facts["pid"] == ahead and facts["env"]["HF_TOKEN"] == "tok"


def test_a_timeout_kills_its_group_and_a_crash_is_its_exit_status(probe: Path, tmp_path: Path) -> None:
    from publisher.runtime import zygotes

    env = dict(os.environ)
    zygotes.prestart(sys.executable, env, count=2)
    ahead = _waiting()
    assert len(ahead) == 2
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run(probe, tmp_path, "sleep", env=env, timeout=2, name="slow")
    assert time.monotonic() - start < 60
    slow = json.loads((tmp_path / "slow.json").read_text())
    assert slow["pid"] in ahead and ended(slow["pid"])
    with pytest.raises(ProcessLookupError):
        os.killpg(slow["pgid"], 0)
    done, crashed = _run(probe, tmp_path, "crash", env=env, name="crash")
    # as subprocess reports a signal; what was written before the crash is there
    assert done.returncode == -signal.SIGSEGV and done.stderr == "to stderr\n" and done.stdout == "to stdout\n"
    assert crashed["pid"] in ahead - {slow["pid"]} and not _waiting()


def test_what_the_imports_print_and_an_import_that_fails(probe: Path, tmp_path: Path) -> None:
    """Modules other than torch (cheap to import): what they print is at the head of the script's stdout and stderr,
    as in a new interpreter that imported them first; one that fails to import makes its interpreters unusable, and
    the script runs in a new interpreter."""
    from publisher.runtime import zygotes

    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "noisy_import.py").write_text(
        "import os, sys\nprint('imported')\nprint('warned', file=sys.stderr)\nos.write(2, b'from C code\\n')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "modules"), os.environ.get("PYTHONPATH", "")])}
    zygotes.prestart(sys.executable, env, ("noisy_import",), count=1)
    (ahead,) = _waiting()
    done, facts = _run(probe, tmp_path, env=env, preload=("noisy_import",))
    assert done.returncode == 0 and facts["pid"] == ahead and facts["imported"] == ["noisy_import"]
    assert done.stdout == "imported\nto stdout\n" and done.stderr == "warned\nfrom C code\nto stderr\n"

    assert zygotes.prestart(sys.executable, env, ("no_such_module",), count=2) == 2
    failing = _waiting()
    done, facts = _run(probe, tmp_path, env=env, preload=("no_such_module",), name="fresh")
    assert done.returncode == 0 and facts["pid"] not in failing and facts["imported"] == []
    assert done.stdout == "to stdout\n" and done.stderr == "to stderr\n"
    assert all(ended(pid) for pid in failing)  # its sibling would not be ready either: killed
    assert zygotes.prestart(sys.executable, env, ("no_such_module",), count=2) == 0  # and none started again


@pytest.mark.parametrize("cuda", ["initialized", "context"])
def test_what_the_imports_leave_of_cuda(probe: Path, tmp_path: Path, cuda: str) -> None:
    """A stand-in torch (no GPU here): torch's CUDA state initialized by the imports (torchao's import does it on a
    machine with a CUDA GPU) rules out a zygote (CUDA does not survive a fork), not an interpreter started ahead (it
    does not fork); a CUDA context (GPU memory held while it waits) rules out both."""
    from publisher.runtime import zygotes

    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text(
        "import os\n"
        "class cuda:\n"
        "    is_initialized = staticmethod(lambda: True)\n"
        "    device_count = staticmethod(lambda: 1)\n"
        "class _C:\n"
        "    _cuda_hasPrimaryContext = staticmethod(lambda i: os.environ['FAKE_CUDA'] == 'context')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "FAKE_CUDA": cuda}
    out = tmp_path / "forked.json"
    done = zygotes.run(sys.executable, probe, [str(out)], env=env, timeout=60, outputs=tmp_path / "forked",
                       preload=("torch",))
    forked = json.loads(out.read_text())
    assert done.returncode == 0 and forked["ppid"] == os.getpid() and forked["imported"] == []  # no zygote
    assert zygotes.prestart(sys.executable, env, ("torch",), count=1) == 1
    # one that found a context says so and ends right after its imports: it may be gone before it is looked for
    ahead = _waiting()
    done, facts = _run(probe, tmp_path, env=env, preload=("torch",))
    assert done.returncode == 0
    if cuda == "initialized":
        assert len(ahead) == 1 and facts["pid"] in ahead and facts["imported"] == ["torch"]
    else:
        assert facts["pid"] not in ahead and facts["imported"] == [] and all(ended(p) for p in ahead)


def test_start_early_for_a_gpu_load_runs_the_load_path_workers_in_interpreters_started_ahead(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``workers.start_early`` for a GPU recipe starts one interpreter per load path (no GPU needed to import torch and
    the libraries); a whole load-path worker run in one gives what a forked one gives."""
    from publisher.handoffs.report import PATHS, Expected
    from publisher.runtime import prestarted, zygotes
    from publisher.verify import workers

    workers.start_early(None, "cuda", "auto", 0)
    ahead = _waiting()
    assert len(ahead) == len(PATHS) == 2
    workers.start_early(None, "cuda", "auto", 0, recipes=3)  # one pass for three recipes: three verifications
    assert len(_waiting()) == 6 and ahead <= _waiting()
    prestarted.close_all()
    workers.start_early(None, "cuda", "auto", 0)
    ahead = _waiting()
    workers.start_early(None, "cuda", "auto", 0)  # the next recipe's call: those waiting count
    workers.start_early(None, "cuda", "streaming", 0)  # verified in this process: none
    assert _waiting() == ahead
    exp = Expected("", "transformers", "LlamaForCausalLM", None, None, {}, [])

    def load(path: str, forked: bool) -> dict[str, Any]:
        run = zygotes.run
        # the GPU load's route (not forked), on this CPU
        monkeypatch.setattr(zygotes, "run", lambda *a, **k: run(*a, **{**k, "forked": forked}))
        try:
            (result,) = workers.run_workers([exp], path, sys.executable, str(tiny_llama_dir), None,
                                            tmp_path / f"work-{forked}", None, 1)
        finally:
            monkeypatch.setattr(zygotes, "run", run)
        assert result["ok"], result
        result.pop("peak_rss_bytes")
        return dict(result)

    for path in PATHS:
        unforked = load(path, False)
        assert unforked == load(path, True)
        assert unforked["linear_classes"] and unforked["digests"]
    assert all(ended(pid) for pid in ahead) and not _waiting()  # each ran one load path


def test_sigterm_kills_the_script_and_the_interpreters_never_used(probe: Path, tmp_path: Path) -> None:
    """As the CLI's verification under publisher.runtime.signals: the running script's group is killed, and the
    interpreter started ahead that was never handed a script ends with the process."""
    facts = tmp_path / "facts.json"
    caller = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from pathlib import Path\n"
        "from publisher.runtime import signals, zygotes\n"
        "zygotes.max_prestarted = lambda: 8  # whatever the memory others use leaves\n"
        "env = dict(os.environ)\n"
        "zygotes.prestart(sys.executable, env, count=2)\n"
        "try:\n"
        "    with signals.handled():\n"
        f"        zygotes.run(sys.executable, Path({str(probe)!r}), [{str(facts)!r}, 'sleep'], env=env, timeout=600,\n"
        f"                    outputs=Path({str(tmp_path / 'f')!r}), forked=False)\n"
        "except KeyboardInterrupt as exc:\n"
        "    sys.exit(128 + exc.signum)\n")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not facts.exists() or not facts.read_text():
            assert caller.poll() is None and time.monotonic() < deadline, caller.stderr.read() if caller.stderr else ""
            time.sleep(0.05)
        ahead = _waiting(caller.pid)
        script = json.loads(facts.read_text())
        assert len(ahead) == 2 and script["pid"] in ahead
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=60) == 143
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    assert all(ended(pid) for pid in ahead)
    with pytest.raises(ProcessLookupError):
        os.killpg(script["pgid"], 0)


def test_one_never_used_ends_with_its_caller(tmp_path: Path) -> None:
    """A caller killed with SIGKILL runs no cleanup: the interpreter started ahead ends when its stdin closes."""
    caller = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from publisher.runtime import zygotes; zygotes.max_prestarted = lambda: 8; "
        "zygotes.prestart(sys.executable, dict(os.environ), count=1); print('started', flush=True); sys.stdin.read()")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "started\n"
        (ahead,) = _waiting(caller.pid)
    finally:
        caller.kill()
        caller.wait()
    assert wait_ended(ahead, 60), "the interpreter started ahead outlived its caller"
