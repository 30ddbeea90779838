"""The set-up path installs PyTorch's CPU build unless asked for another: the Makefile's commands (as make would run
them, read with `make -n`) and the README's `pip install` lines. PyPI's torch==2.13.0 is the multi-GB CUDA build."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _setup_commands(*variables: str) -> list[str]:
    return _commands("setup", *variables)


def _commands(target: str, *variables: str) -> list[str]:
    """The commands `make TARGET` runs, not run (-n), as if nothing were installed yet (-B)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), target, *variables], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.replace("\\\n", " ").splitlines()


def _torch_installs(lines: list[str]) -> list[str]:
    return [line for line in lines if re.search(r"pip install .*'?torch==", line)]


def test_setup_installs_the_cpu_build_of_torch_by_default() -> None:
    (line,) = _torch_installs(_setup_commands())
    # the pin names the build: no index can hand out a CUDA wheel for torch==2.13.0+cpu
    assert "'torch==2.13.0+cpu'" in line
    assert f"--extra-index-url {CPU_INDEX}" in line
    lines = _setup_commands()
    package = next(i for i, x in enumerate(lines) if "-e '.[test]'" in x)
    assert lines.index(line) < package  # torch first


def test_setup_compiles_the_bytecode_on_every_core_after_pip() -> None:
    lines = _setup_commands()
    installs = [i for i, x in enumerate(lines) if re.search(r"pip install .*(torch==|-e '\.\[test\]')", x)]
    assert installs and all("--no-compile" in lines[i] for i in installs)  # pip compiles one file at a time
    compiles = [i for i, x in enumerate(lines) if "-m compileall" in x]
    # each with the one exclusion pattern, whose effect the next test checks path by path
    assert compiles and all("-j 0" in lines[i] and "-x '" in lines[i] for i in compiles)
    # torch's files in the background while pip installs the package (pip keeps one core busy), then the whole venv
    first, last = lines[compiles[0]], lines[compiles[-1]]
    assert re.search(r"compileall .*site-packages/torch .*& .*pip install .*-e '\.\[test\]'.*wait", first)
    assert compiles[-1] > max(installs) and re.search(r"compileall -qq -j 0 -x '\S+' \.venv/lib ", last)


def test_setup_leaves_out_what_a_run_never_imports_and_compiles_the_rest() -> None:
    """The exclusion, applied as compileall applies it (re.search on each path): the packages' test suites and the
    per-model / per-pipeline folders stay out; torch, transformers' auto classes and diffusers' pipeline base do not."""
    lines = [x for x in _setup_commands() if "-m compileall" in x]
    (pattern,) = {re.search(r"-x '([^']+)'", x).group(1) for x in lines}  # type: ignore[union-attr]
    site = "/w/.venv/lib/python3.11/site-packages/"
    out = ["sympy/polys/tests/test_rings.py", "numpy/tests/test_ctypeslib.py", "transformers/models/llama/modeling_llama.py",
           "transformers/models/t5/configuration_t5.py", "diffusers/pipelines/flux/pipeline_flux.py"]
    kept = ["torch/nn/modules/linear.py", "transformers/models/auto/modeling_auto.py", "transformers/models/__init__.py",
            "transformers/modeling_utils.py", "diffusers/pipelines/pipeline_utils.py", "diffusers/models/modeling_utils.py",
            "diffusers/models/transformers/transformer_flux.py", "torchao/quantization/quant_api.py"]
    assert [p for p in out if not re.search(pattern, site + p)] == []
    assert [p for p in kept if re.search(pattern, site + p)] == []


def test_one_variable_asks_for_a_cuda_build() -> None:
    (line,) = _torch_installs(_setup_commands("TORCH_BUILD=cu128"))
    assert "'torch==2.13.0+cu128'" in line and "--extra-index-url https://download.pytorch.org/whl/cu128" in line
    (pypi,) = _torch_installs(_setup_commands("TORCH_BUILD=pypi"))
    assert "'torch==2.13.0'" in pypi and "download.pytorch.org" not in pypi


def test_the_torch_pin_is_the_constraints_pin_within_the_package_range() -> None:
    from packaging.requirements import Requirement

    constraints = (ROOT / "constraints.txt").read_text()
    makefile = (ROOT / "Makefile").read_text()
    (pin,) = re.findall(r"^torch==([\d.]+)$", constraints, re.M)
    assert f"TORCH_VERSION := {pin}\n" in makefile
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(line.split("==") for line in constraints.splitlines() if line and not line.startswith("#"))
    for dep in map(Requirement, deps):  # the exact set is one the ranges admit, and the ranges are ranges
        if dep.name in pins:
            assert pins[dep.name] in dep.specifier and "==" not in str(dep.specifier), (dep, pins[dep.name])
    install = [line for line in _commands("setup") if "-e '.[test]'" in line]
    assert install and all("-c constraints.txt" in line for line in install)


def test_readme_installs_the_cpu_build() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [line.split("#")[0] for line in readme.splitlines() if line.startswith("pip install")]
    torch = [c for c in commands if "torch" in c]
    assert torch, commands
    for command in torch:
        assert "torch==2.13.0+cpu" in command and CPU_INDEX in command, command
    assert "TORCH_BUILD=cu128" in readme  # how to ask for the CUDA build


def test_the_lfs_pass_collects_every_file_that_marks_a_test_transfer() -> None:
    """The LFS pass names its files (grep for the mark's text): no mark may come from elsewhere, a hook say."""
    (line,) = [x for x in _commands("test") if "HF_AO_TEST_TRANSFER=lfs" in x]
    named = {Path(word).name for word in line.split() if word.startswith("tests/test_")}
    marking = {p.name for p in (ROOT / "tests").glob("test_*.py") if "mark.transfer" in p.read_text()}
    assert named == marking and len(named) >= 10
    helpers = [p for p in (ROOT / "tests").glob("*.py") if not p.name.startswith("test_")]
    assert helpers and not [p.name for p in helpers if "add_marker" in p.read_text()]  # conftest marks nothing


def test_the_scheduler_names_only_test_files_of_the_suite() -> None:
    """`make test`'s scheduler (tests/scheduling.py, called by conftest's hooks) names files by hand: a renamed or
    removed file would silently drop out of the spread or of the cost order (it would run last, by name)."""
    import scheduling

    files = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    assert not scheduling.SPREAD - files and not set(scheduling.COST_ORDER) - files
    assert len(set(scheduling.COST_ORDER)) == len(scheduling.COST_ORDER)
    assert scheduling.scope("tests/test_families.py::test_x[a]") == "tests/test_families.py::test_x[a]"  # spread
    assert scheduling.scope("tests/test_zygotes.py::test_x") == "tests/test_zygotes.py"  # one worker per file


def test_the_workers_openmp_threads_sleep_when_idle() -> None:
    """tests/conftest.py sets OMP_WAIT_POLICY=PASSIVE before torch is first imported in a worker (libgomp reads it when
    torch loads it), so the worker's own idle threads sleep instead of spinning, and every process a test starts (load
    paths, snippets, the CLI) inherits it; the thread count stays torch's default."""
    import os
    import sys

    import conftest
    import torch

    assert not conftest.TORCH_BEFORE_CONFTEST  # a plugin that imported torch first would leave this worker spinning
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    child = subprocess.run([sys.executable, "-c", "import os, torch; print(os.environ['OMP_WAIT_POLICY'], torch.get_num_threads())"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert child == ["PASSIVE", str(torch.get_num_threads())]


def test_no_fixture_switches_a_product_default_off_for_the_session() -> None:
    """The compatibility matrix and the quality evaluation run in every test that does not turn them off on its own
    command line (helpers.SKIP_EVAL_AND_MATRIX): no conftest, fixture or test module sets their variables, which
    would turn them off for every test at once (tests/conftest.py did, for the whole session)."""
    import os

    from helpers import DEFAULTS_VARIABLES as variables

    assert variables == ("HF_AO_PUBLISH_COMPAT", "HF_AO_PUBLISH_EVAL_BUDGET")  # what the CLI reads (publish --help)
    assert [v for v in variables if v in os.environ] == []  # in a test, with the autouse fixtures active
    names = "|".join(variables)
    setting = re.compile(rf"""(environ\[|setdefault\(|setenv\(|putenv\()\s*["']({names})["']""")
    found = [f"{p.name}: {m.group(0)}" for p in sorted((ROOT / "tests").glob("*.py")) for m in setting.finditer(p.read_text())]
    assert found == []
