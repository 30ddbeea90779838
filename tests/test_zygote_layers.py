"""A layered environment's zygote forked from this interpreter's torch zygote (publisher/runtime/zygote.py's
``branch``, zygotes.py's ``branch_from``): its scripts see what a fresh interpreter of the layer sees (prefix,
executable, ``sys.path``, the layer's own packages first, torch from the files it shares), and where a branch would
see something else (the layer shadows a module torch imported, a ``.pth`` that does more), the layer gets a zygote of
its own, as before.

The layers are made by publisher/verify/envs.py's own ``make_layer``, with a small package written into them instead
of a pip install.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_ended

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="zygotes fork: Linux only")

PROBE = """
import json, os, site, sys
import torch, typing_extensions
import layered
facts = {"path": sys.path, "prefix": sys.prefix, "exec_prefix": sys.exec_prefix, "executable": sys.executable,
         "site": site.getsitepackages(), "layered": [layered.__file__, layered.WHERE], "torch": torch.__file__,
         "typing_extensions": typing_extensions.__file__, "pid": os.getpid(), "ppid": os.getppid()}
open(sys.argv[1], "w").write(json.dumps(facts))
print("to stderr", file=sys.stderr)
"""


def _layer(tmp_path: Path, name: str, files: dict[str, str]) -> tuple[str, Path]:
    from publisher.verify import envs

    python, own_site = envs.make_layer(tmp_path / name, envs.parse_spec("layered==1.0"))
    for rel, text in {"layered/__init__.py": f"WHERE = {name!r}\n", **files}.items():
        (Path(own_site) / rel).parent.mkdir(parents=True, exist_ok=True)
        (Path(own_site) / rel).write_text(text)
    return str(python), Path(own_site)


def _facts(python: str, tmp_path: Path, name: str, **kw: Any) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    from publisher.runtime import zygotes

    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(PROBE)
    out = tmp_path / f"{name}.json"
    if kw.pop("fresh", False):
        done = subprocess.run([python, str(script), str(out)], capture_output=True, text=True, timeout=120)
    else:
        done = zygotes.run(python, script, [str(out)], env=dict(os.environ), timeout=120, outputs=tmp_path / name,
                           preload=(*zygotes.TORCH, "layered"), branch_from=sys.executable, **kw)
    assert done.returncode == 0, done.stderr
    return done, json.loads(out.read_text())


def _zygote_of(facts: dict[str, Any]) -> Any:
    import psutil

    return psutil.Process(facts["ppid"])


def _unstamped(text: str) -> str:  # torch's warnings carry a time and a process id
    return re.sub(r"(?m)^([IWEF])\d{4} [\d:.]+ +\d+ ", r"\1 ", text)


def test_a_layer_zygote_branches_from_the_torch_zygote_and_its_scripts_see_the_layer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from publisher.runtime import zygotes

    python, own_site = _layer(tmp_path, "one", {})
    with caplog.at_level(logging.DEBUG, logger="publisher.runtime.zygotes"):
        done, forked = _facts(python, tmp_path, "forked")
    assert f"the zygote of {python} branched from the zygote of {sys.executable}" in caplog.text
    fresh_done, fresh = _facts(python, tmp_path, "fresh", fresh=True)
    for key in ("path", "prefix", "exec_prefix", "executable", "site", "layered", "torch", "typing_extensions"):
        assert forked[key][1:] == fresh[key][1:] if key == "path" else forked[key] == fresh[key], key
    assert forked["layered"] == [str(own_site / "layered" / "__init__.py"), "one"] and forked["prefix"] == str(tmp_path / "one")
    assert _unstamped(done.stderr) == _unstamped(fresh_done.stderr)  # what torch's import printed, then the script's
    # the branch is the torch zygote's child (a zygote of sys.executable that imported torch alone), not ours
    branch = _zygote_of(forked)
    parent = branch.parent()
    assert parent.ppid() == os.getpid() and parent.cmdline()[0] == sys.executable
    assert parent.cmdline()[2:] == list(zygotes.TORCH)
    # it serves the next script too; a second layer branches from the same torch zygote
    assert _facts(python, tmp_path, "again")[1]["ppid"] == branch.pid
    other, _ = _layer(tmp_path, "two", {})
    two = _facts(other, tmp_path, "two")[1]
    assert two["layered"][1] == "two" and _zygote_of(two).parent().pid == parent.pid
    zygotes.close_all()  # closed like any zygote: its connection, then its group
    # its connection closes as it exits, a moment before the kernel makes it a zombie: on a loaded machine, waited for
    assert wait_ended(branch.pid, 5)


@pytest.mark.parametrize("case", ["shadows", "pth"])
def test_where_a_branch_would_differ_the_layer_gets_a_zygote_of_its_own(case: str, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A layer holding a module that torch's import loaded already (here typing_extensions) would see ours in a
    branch; a .pth file that runs code would have run before torch's import. Either way: a zygote of the layer."""
    import typing_extensions

    files = ({"typing_extensions.py": Path(typing_extensions.__file__).read_text()} if case == "shadows"  # a copy
             else {"extra.pth": "import os\n"})
    python, own_site = _layer(tmp_path, case, files)
    with caplog.at_level(logging.DEBUG, logger="publisher.runtime.zygotes"):
        _, forked = _facts(python, tmp_path, "forked")
    why = "it holds typing_extensions, imported here already" if case == "shadows" else "extra.pth does more than"
    assert f"no branch of the zygote of {sys.executable} for {python} ({why}" in caplog.text
    fresh = _facts(python, tmp_path, "fresh", fresh=True)[1]
    assert forked["typing_extensions"] == fresh["typing_extensions"] and forked["path"][1:] == fresh["path"][1:]
    if case == "shadows":
        assert forked["typing_extensions"] == str(own_site / "typing_extensions.py")
    zygote = _zygote_of(forked)  # the layer's own interpreter, our child
    assert zygote.ppid() == os.getpid() and zygote.cmdline()[0] == python


def test_a_branch_ends_with_its_caller(tmp_path: Path) -> None:
    """A caller killed with SIGKILL runs no cleanup: the branch (not its child) ends when its connection closes."""
    import psutil

    python, _ = _layer(tmp_path, "one", {})
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    caller = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from pathlib import Path; from publisher.runtime import zygotes; "
        f"zygotes.run({python!r}, Path({str(script)!r}), [{str(tmp_path / 'f.json')!r}], env=dict(os.environ), "
        f"timeout=60, outputs=Path({str(tmp_path / 'f')!r}), preload=(*zygotes.TORCH, 'layered'), "
        "branch_from=sys.executable); print('ran', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdout.readline() == "ran\n"
        branch = psutil.Process(json.loads((tmp_path / "f.json").read_text())["ppid"])
        assert branch.parent().parent().pid == caller.pid  # the caller's torch zygote forked it
    finally:
        caller.kill()
        caller.wait()
    assert wait_ended(branch.pid, 30), "the branch outlived its caller"
