"""Scripts forked from a zygote (publisher/runtime/zygote.py, zygotes.py): the child is what ``python SCRIPT ARG...``
would be, with torch imported and nothing else; it takes the caller's environment, folder and arguments at the time
of the call; it is killed (with its process group) on a timeout; without a zygote a fresh interpreter runs it.

Each zygote costs one import of torch (about 3 s here), so the tests share few of them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ended, wait_ended, write_probe

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="zygotes fork: Linux only")


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    return write_probe(tmp_path, ("torch", "torch._dynamo", "huggingface_hub", "transformers", "diffusers", "torchao", "publisher"))


def _run(probe: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
         name: str = "facts", preload: tuple[str, ...] | None = None
         ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    from publisher.runtime import zygotes

    out = tmp_path / f"{name}.json"
    done = zygotes.run(sys.executable, probe, [str(out), *args], env=env if env is not None else dict(os.environ),
                       timeout=timeout, outputs=tmp_path / name, preload=preload or zygotes.TORCH)
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_the_child_is_a_fresh_script_process_with_torch_imported(probe: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "HF_ENDPOINT": "http://one.invalid", "HF_TOKEN": "tok_one"}
    env.pop("PROBE_VAR", None)
    done, facts = _run(probe, tmp_path, "7", env=env)
    assert done.returncode == 7 and done.stderr == "to stderr\n" and done.stdout == "to stdout\n"
    assert facts["argv"] == [str(probe), str(tmp_path / "facts.json"), "7"] and facts["name"] == "__main__"
    assert facts["cwd"] == str(tmp_path) and facts["path0"] == str(probe.parent) and facts["stdin"] == os.devnull
    assert facts["env"] == {"HF_ENDPOINT": "http://one.invalid", "HF_TOKEN": "tok_one", "PROBE_VAR": None}
    # torch only: huggingface_hub reads HF_ENDPOINT at its import, the libraries register what they register at theirs
    assert facts["imported"] == ["torch", "torch._dynamo"]
    assert facts["pgid"] == facts["pid"] != os.getpgid(0)  # its own process group, which a kill takes whole
    zygote = facts["ppid"]
    assert zygote != os.getpid()
    # the token went to the child through the pipe, never to the zygote
    assert "tok_one" not in Path(f"/proc/{zygote}/environ").read_bytes().decode(errors="replace")

    # another endpoint and token, the rest alike: the same zygote, and the child sees the new values
    env2 = {**env, "HF_ENDPOINT": "http://two.invalid", "HF_TOKEN": "tok_two"}
    done, facts = _run(probe, tmp_path, env=env2, name="second")
    assert done.returncode == 0 and facts["ppid"] == zygote
    assert facts["env"] == {"HF_ENDPOINT": "http://two.invalid", "HF_TOKEN": "tok_two", "PROBE_VAR": None}
    # a variable torch could read at its import: another zygote
    done, facts = _run(probe, tmp_path, env={**env, "PROBE_VAR": "b"}, name="third")
    assert done.returncode == 0 and facts["ppid"] != zygote and facts["env"]["PROBE_VAR"] == "b"


def test_a_load_path_zygote_serves_the_environment_the_libraries_were_imported_in(probe: Path, tmp_path: Path) -> None:
    from publisher.runtime import zygotes

    def run(env: dict[str, str], name: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        done, facts = _run(probe, tmp_path, env=env, name=name, preload=zygotes.LIBRARIES)
        assert done.returncode == 0, done.stderr
        return done, facts

    env = {**os.environ, "HF_ENDPOINT": "http://one.invalid", "HF_TOKEN": "tok_one"}
    done, first = run(env, "one")
    assert {"torch", "transformers", "diffusers", "huggingface_hub"} <= set(first["imported"])
    # the child's stderr starts with what those imports print, as a new interpreter's that makes them (torch's
    # warnings carry a time and a process id)
    fresh = subprocess.run([sys.executable, "-c", f"import {', '.join(zygotes.LIBRARIES)}"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0 and fresh.stderr.strip()

    def unstamped(text: str) -> str:
        return re.sub(r"(?m)^([IWEF])\d{4} [\d:.]+ +\d+ ", r"\1 ", text)

    assert unstamped(done.stderr) == unstamped(fresh.stderr) + "to stderr\n"
    assert "publisher" not in first["imported"] and first["hub_endpoint"] == "http://one.invalid"
    # the token is read when a call needs it: the same zygote, the child sees its own
    _, second = run({**env, "HF_TOKEN": "tok_two"}, "two")
    assert second["ppid"] == first["ppid"] and second["env"]["HF_TOKEN"] == "tok_two"
    # the endpoint is read when huggingface_hub is imported: another zygote, imported with it
    _, third = run({**env, "HF_ENDPOINT": "http://two.invalid"}, "three")
    assert third["ppid"] != first["ppid"] and third["hub_endpoint"] == "http://two.invalid"


def test_where_a_library_cannot_be_imported_a_load_forks_from_a_zygote_of_its_own_library(probe: Path,
                                                                                         tmp_path: Path) -> None:
    """In an environment where diffusers cannot be imported (as transformers 4.57's, whose huggingface_hub is too old
    for it), a zygote of both libraries cannot start: a transformers load forks from one of torch and transformers
    (workers.preload_for, the ``fallback``), instead of paying every import in a fresh interpreter; a diffusers load
    there has no zygote and runs fresh, where its import fails as a user's would. Where the caller names a file (a
    built environment's: workers.py), the list that failed is kept there, and the next process starts the fallback's
    zygote at once, without making torch's and transformers' imports only to fail at diffusers' again."""
    from publisher.runtime import zygotes
    from publisher.verify import workers

    broken = tmp_path / "site" / "diffusers"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this diffusers cannot be imported here')\n")
    env = {**os.environ, "PYTHONPATH": str(broken.parent)}
    assert workers.preload_for({"transformers"}) == (*zygotes.TORCH, "transformers.modeling_utils")
    assert workers.preload_for({"diffusers", "transformers"}) == (
        *zygotes.TORCH, "diffusers.models.modeling_utils", "transformers.modeling_utils")
    notes = tmp_path / "env" / "notes.json"

    def run(name: str, libraries: set[str]) -> dict[str, Any]:
        out = tmp_path / f"{name}.json"
        done = zygotes.run(sys.executable, probe, [str(out)], env=env, timeout=120, outputs=tmp_path / name,
                           preload=zygotes.LIBRARIES, fallback=workers.preload_for(libraries), remember=notes)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(out.read_text()))

    facts = run("transformers", {"transformers"})
    assert facts["ppid"] != os.getpid() and "transformers" in facts["imported"] and "diffusers" not in facts["imported"]
    assert run("again", {"transformers"})["ppid"] == facts["ppid"]  # that zygote serves the next load too
    facts = run("diffusers", {"diffusers"})
    assert facts["ppid"] == os.getpid() and facts["imported"] == []  # no zygote: a fresh interpreter
    # kept: each list that failed (both libraries', and the diffusers load's fallback) and the module it failed at;
    # not the one that imported (transformers')
    kept = json.loads(notes.read_text())
    assert kept.keys() == {" ".join(zygotes.LIBRARIES), " ".join(workers.preload_for({"diffusers"}))}
    assert {entry["module"] for entry in kept.values()} == {"diffusers.models.modeling_utils"}

    # the next process: the fallback's zygote at once, the load forked from it as before
    script = tmp_path / "next_process.py"
    script.write_text(
        "import json, logging, os, sys\n"
        "from pathlib import Path\n"
        "from publisher.runtime import zygotes\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(message)s')\n"
        "out, probe, notes = (Path(a) for a in sys.argv[1:4])\n"
        "done = zygotes.run(sys.executable, probe, [str(out)], env=dict(os.environ), timeout=120,\n"
        "                   outputs=out.with_suffix(''), preload=zygotes.LIBRARIES,\n"
        "                   fallback=tuple(json.loads(sys.argv[4])), remember=notes)\n"
        "assert done.returncode == 0, done.stderr\n")
    out = tmp_path / "next.json"
    done = subprocess.run([sys.executable, str(script), str(out), str(probe), str(notes),
                           json.dumps(workers.preload_for({"transformers"}))],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(out.read_text())
    assert "transformers" in facts["imported"] and "diffusers" not in facts["imported"]  # forked from the fallback
    assert "diffusers.models.modeling_utils cannot be imported there (found by an earlier run)" in done.stderr
    assert "cannot import diffusers" not in done.stderr  # not tried again


def test_what_the_imports_print_every_child_prints_first(probe: Path, tmp_path: Path) -> None:
    """A module the zygote imports prints when imported (torchao about its optional kernels, torch a deprecation
    warning): every child's stdout and stderr start with it, as those of a fresh interpreter that imported it first
    would (a test that checks a script's stderr, the card snippets' for instance, sees everything)."""
    from publisher.runtime import zygotes

    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "noisy_import.py").write_text(
        "import os, sys\nprint('imported')\nprint('warned', file=sys.stderr)\nos.write(2, b'from C code\\n')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "modules")}
    parents = set()
    for name in ("one", "two"):
        done, facts = _run(probe, tmp_path, env=env, name=name, preload=(*zygotes.TORCH, "noisy_import"))
        assert done.returncode == 0
        assert done.stdout == "imported\nto stdout\n" and done.stderr == "warned\nfrom C code\nto stderr\n"
        parents.add(facts["ppid"])
    assert len(parents) == 1  # one zygote: the second child got the same lines


def test_a_crash_and_a_timeout(probe: Path, tmp_path: Path) -> None:

    done, _ = _run(probe, tmp_path, "crash")
    # as subprocess reports a signal; what was written before the crash is there
    assert done.returncode == -signal.SIGSEGV and done.stderr == "to stderr\n" and done.stdout == "to stdout\n"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run(probe, tmp_path, "sleep", timeout=2, name="slow")
    assert time.monotonic() - start < 60
    facts = json.loads((tmp_path / "slow.json").read_text())
    assert ended(facts["pid"])
    with pytest.raises(ProcessLookupError):
        os.killpg(facts["pgid"], 0)
    done, after = _run(probe, tmp_path, name="after")  # the zygote serves on
    assert done.returncode == 0 and after["ppid"] == facts["ppid"]


def test_switched_off_or_no_zygote_runs_a_fresh_interpreter(probe: Path, tmp_path: Path) -> None:
    done, facts = _run(probe, tmp_path, env={**os.environ, "HF_AO_PUBLISH_ZYGOTE": "0"})
    assert done.returncode == 0 and facts["ppid"] == os.getpid() and facts["imported"] == []
    assert done.stderr == "to stderr\n" and done.stdout == "to stdout\n" and not (tmp_path / "facts.stderr").exists()
    from publisher.runtime import zygotes

    out = tmp_path / "unforked.json"  # a caller that asks for a new interpreter (a load on a GPU)
    done = zygotes.run(sys.executable, probe, [str(out)], env=dict(os.environ), timeout=60, outputs=tmp_path / "u",
                       forked=False)
    assert done.returncode == 0 and json.loads(out.read_text())["ppid"] == os.getpid()
    # an interpreter that is not one (a stand-in script ignoring its arguments): the script runs in it directly
    stand_in = tmp_path / "stand-in"
    stand_in.write_text(f"#!{sys.executable}\nimport sys\nprint('stand-in', sys.argv[1:], file=sys.stderr)\n")
    stand_in.chmod(0o755)
    done = zygotes.run(str(stand_in), probe, ["x"], env=dict(os.environ), timeout=60, outputs=tmp_path / "s")
    assert done.returncode == 0 and done.stderr == f"stand-in ['{probe}', 'x']\n"


def test_the_zygote_ends_with_its_caller(tmp_path: Path, probe: Path) -> None:
    """A caller killed with SIGKILL runs no cleanup: the zygote ends when its stdin closes."""
    import psutil

    caller = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from pathlib import Path; from publisher.runtime import zygotes; "
        f"zygotes.run(sys.executable, Path({str(probe)!r}), [{str(tmp_path / 'f.json')!r}], env=dict(os.environ), "
        f"timeout=60, outputs=Path({str(tmp_path / 'f')!r})); print('ran', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "ran\n"
        zygote = json.loads((tmp_path / "f.json").read_text())["ppid"]
        assert psutil.Process(zygote).parent().pid == caller.pid
    finally:
        caller.kill()
        caller.wait()
    assert wait_ended(zygote, 30), "the zygote outlived its caller"
