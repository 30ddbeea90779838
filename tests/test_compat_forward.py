"""Compatibility forward in time (issue 39): torch in the matrix, the newest releases, a torch that cannot import
torchao in one row.

No test downloads a torch: pip is pointed at folders of hand-written wheels (an empty PEP 503 index in a
folder as ``PIP_INDEX_URL`` with ``PIP_FIND_LINKS``, and another standing in for PyTorch's CPU index), whose ``torch`` is a stand-in that
imports but that torchao cannot run on. A real torch from PyPI or PyTorch's index is measured by
``scripts/compat_rows.py`` (docs/compatibility.md), not here.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from publisher import compat
from publisher.errors import EnvBuildError
from publisher.handoffs.report import EnvRecord, Expected, VerifyReport
from publisher.testing.wheels import simple_index, write_wheel
from publisher.verify import claims, envs, matrix, torch_sources

FAKE = "2.99.0"
STAND_IN = f"__version__ = {FAKE!r}\n"  # imports; torchao then fails on the first torch API it touches


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The user's configured sources (a folder of wheels, no index) and a CPU index, both empty to begin with; no CUDA."""
    folders = {"user": tmp_path / "user-wheels", "cpu": tmp_path / "cpu-index-wheels"}
    for folder in folders.values():
        folder.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip config (a cap on torch's version) is not the user's
    monkeypatch.setenv("PIP_INDEX_URL", simple_index(tmp_path / "user-index", []))  # an empty index, and a folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(folders["user"]))
    monkeypatch.setenv("HF_AO_PUBLISH_ENVS", str(tmp_path / "envs"))
    monkeypatch.setenv(torch_sources.CPU_INDEX_VARIABLE, simple_index(tmp_path / "cpu-index", []))
    monkeypatch.setattr(torch_sources, "has_cuda", lambda: False)
    return folders


def test_the_cpu_build_is_asked_for_first_on_a_machine_without_cuda() -> None:
    exact = torch_sources.attempts(["torch==2.15.0"], cuda=False)
    assert [a.requirements for a in exact] == [["torch==2.15.0+cpu"], ["torch==2.15.0+cpu"], ["torch==2.15.0"]]
    assert exact[0].options == [] and exact[1].options[:2] == ["--extra-index-url", torch_sources.CPU_INDEX]
    assert "CUDA build" in exact[2].note  # the multi-GB download is said before it starts
    assert [a.requirements for a in torch_sources.attempts(["torch==2.15.0"], cuda=False, fallback=False)] == [
        ["torch==2.15.0+cpu"], ["torch==2.15.0+cpu"]]  # the newest torch, unasked: the CPU build or nothing
    assert [a.requirements for a in torch_sources.attempts(["torch==2.15.0", "torchao==0.18.0"], cuda=True)] == [
        ["torch==2.15.0", "torchao==0.18.0"]]  # with CUDA: as pip install would
    ranged = torch_sources.attempts(["torch>=2.14,<2.16"], cuda=False)
    assert len(ranged) == 1 and ranged[0].options[:2] == ["--extra-index-url", torch_sources.CPU_INDEX]


@pytest.mark.slow
def test_a_torch_from_the_users_sources_and_one_that_cannot_import_torchao(sources: dict[str, Path],
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    write_wheel(sources["user"], "torch", f"{FAKE}+cpu", STAND_IN)
    write_wheel(sources["user"], "torch", FAKE, STAND_IN)  # the "CUDA build" beside it: not taken
    with caplog.at_level(logging.INFO, logger="publisher.verify.envs"):
        env = envs.build(envs.parse_spec(f"torch=={FAKE}"))
    assert env.packages["torch"] == f"{FAKE}+cpu"
    record = json.loads((env.path / envs.RECORD).read_text())
    assert record["downloads"] == [{"name": "torch", "version": f"{FAKE}+cpu", "source": str(sources["user"])}]
    assert f"asking your package sources for torch {FAKE}+cpu" in caplog.text
    assert f"pip installed torch {FAKE}+cpu from {sources['user']}" in caplog.text  # what was downloaded, from where
    # the stand-in imports, torchao does not run on it: one line, kept with the entry
    assert env.import_error.startswith(f"torch {FAKE}+cpu cannot import torchao ") and "\n" not in env.import_error
    assert envs.build(envs.parse_spec(f"torch=={FAKE}")).import_error == env.import_error  # reused: still known


@pytest.mark.slow
def test_the_cpu_index_then_the_build_the_sources_have(sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    write_wheel(sources["user"], "torch", FAKE, STAND_IN)  # the sources have only the "CUDA build"
    cpu = write_wheel(sources["cpu"], "torch", f"{FAKE}+cpu", STAND_IN)
    monkeypatch.setenv(torch_sources.CPU_INDEX_VARIABLE, simple_index(tmp_path / "cpu-index", [cpu]))
    assert envs.build(envs.parse_spec(f"torch=={FAKE}")).packages["torch"] == f"{FAKE}+cpu"
    monkeypatch.setenv(torch_sources.CPU_INDEX_VARIABLE, simple_index(tmp_path / "empty-index", []))
    with caplog.at_level(logging.INFO, logger="publisher.verify.envs"):
        heavy = envs.build(envs.parse_spec(f"torch=={FAKE}"), root=tmp_path / "other-envs")
    assert heavy.packages["torch"] == FAKE and "the CUDA build, about 0.5 GB" in caplog.text
    with pytest.raises(EnvBuildError, match=f"torch=={FAKE}"):  # unasked (the newest): never that download
        envs.build(envs.parse_spec(f"torch=={FAKE}"), root=tmp_path / "third-envs", unasked=True)


def test_a_torch_that_cannot_import_torchao_is_one_failing_row(tmp_path: Path) -> None:
    why = f"torch {FAKE}+cpu cannot import torchao 0.18.0: AttributeError: module 'torch' has no attribute 'nn'"
    record = EnvRecord(f"torch=={FAKE}", "spec", gating=False, packages={"torch": f"{FAKE}+cpu"}, unusable=why)
    report = VerifyReport("int8wo", "here", passed=True,
                          expected=[Expected("transformer", "diffusers", "FluxTransformer2DModel", None, None, {}, ["x"])])
    matrix.measure(report, "here", None, tmp_path, [matrix.Env(record, "")], [])  # no interpreter is started
    assert [(r.path, r.outcome, r.detail) for r in report.compat] == [("library", "fail", why), ("manual", "fail", why)]
    rows = claims.table(claims.summarise(report, {"diffusers"}))
    assert [(r["env"], r["library"].startswith("fail"), "cannot import torchao" in r["manual"]) for r in rows] == [
        (f"this one with `torch=={FAKE}`", True, True)]


def test_the_newest_releases_join_the_matrix(sources: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """The newest release of each package on the configured sources (here a folder: only accelerate has one, newer than
    this environment's); what cannot be looked up is one line, not a stop; the card says "(newest)"."""
    compat._look_up.cache_clear()
    write_wheel(sources["user"], "accelerate", "99.0.0", "")
    with caplog.at_level(logging.INFO):
        found = matrix.matrix_envs(["latest"], ["Int8Tensor"], {"transformers"})
    assert found is not None
    built = [e for e in found if not e.record.skipped]
    assert [(e.record.name, e.record.newest) for e in built] == [("accelerate==99.0.0", True)]
    assert claims.env_label(built[0].record) == "this one with `accelerate==99.0.0` (newest)"
    (skipped,) = [e for e in found if e.record.skipped]
    assert re.match(r"the newest release of torch, torchao, transformers was not looked up: ", skipped.record.skipped)
    report = VerifyReport("int8wo", "here", passed=True)
    matrix.measure(report, "here", None, Path("."), [skipped], [])
    assert report.notes == [f"Compatibility: {skipped.record.skipped}."] and not report.compat


def test_a_newest_release_found_is_kept_a_while_for_the_next_runs(sources: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A later run (another process) with the same pip and configuration reads what was found in the last
    NEWEST_TTL_S instead of asking the index again; what could not be looked up is asked again; after the TTL, or with
    another configuration, the index is asked."""
    store = Path(os.environ["HF_AO_PUBLISH_ENVS"]) / matrix.NEWEST_FILE
    write_wheel(sources["user"], "accelerate", "99.0.0", "")
    asked: list[str] = []
    ask = compat._ask_index
    monkeypatch.setattr(compat, "_ask_index", lambda packages: (asked.extend(packages), ask(packages))[1])

    def run() -> compat.Newest:
        compat._look_up.cache_clear()  # a new process
        asked.clear()
        return compat.newest({"transformers"}, {}, store)

    assert run().versions == {"accelerate": "99.0.0"} and "accelerate" in asked
    write_wheel(sources["user"], "accelerate", "99.1.0", "")  # released since
    again = run()
    assert again.versions == {"accelerate": "99.0.0"} and asked == ["torch", "torchao", "transformers"]
    assert "the newest release of torch, torchao, transformers was not looked up" in again.skipped
    monkeypatch.setenv("PIP_FIND_LINKS", str(sources["cpu"]))  # another configuration: asked, nothing there
    assert run().versions == {} and "accelerate" in asked
    monkeypatch.setenv("PIP_FIND_LINKS", str(sources["user"]))
    monkeypatch.setattr(compat, "NEWEST_TTL_S", 0.0)  # expired
    assert run().versions == {"accelerate": "99.1.0"} and "accelerate" in asked


def test_offline_the_newest_releases_are_skipped_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    compat._look_up.cache_clear()
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 makes of it when the CLI starts
    found = compat.newest({"diffusers"}, {})
    assert found.versions == {} and found.skipped == "the newest releases were not looked up: offline (HF_HUB_OFFLINE is set)"
    assert compat._look_up.cache_info().misses == 0  # no index asked


def test_a_newest_torch_without_its_cpu_build_is_skipped_and_remembered(sources: dict[str, Path]) -> None:
    compat._look_up.cache_clear()
    write_wheel(sources["user"], "torch", FAKE, STAND_IN)  # newer than this torch, only its "CUDA build"
    first = matrix.matrix_envs(["latest"], None, {"diffusers"})
    assert first is not None
    (torch_row,) = [e.record for e in first if e.record.name == f"torch=={FAKE}"]
    assert torch_row.skipped.startswith(f"torch {FAKE} (newest): not measured: pip install failed") and torch_row.newest
    compat._look_up.cache_clear()
    again = matrix.matrix_envs(["latest"], None, {"diffusers"})
    assert again is not None
    (torch_again,) = [e.record for e in again if e.record.name == f"torch=={FAKE}"]
    assert "(remembered from " in torch_again.skipped  # not tried again for a day


@pytest.mark.slow
def test_a_publish_with_a_torch_spec_gets_its_row(cli: Any, tiny_llama_dir: Path, tmp_path: Path, sources: dict[str, Path]) -> None:
    """`--compat 'torch==X'` end to end: the environment is built (the CPU build, from the user's sources), and the torch
    that torchao cannot run on is one failing row of the card's table with the reason, not a crash of the publish."""
    write_wheel(sources["user"], "torch", f"{FAKE}+cpu", STAND_IN)
    out = tmp_path / "out"
    result = cli(str(tiny_llama_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(out), "--json",
                 "--compat", f"torch=={FAKE}", "--eval-budget", "0")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["verification"]
    (env,) = [e for e in report["environments"] if e["name"] == f"torch=={FAKE}"]
    assert env["packages"] == {"torch": f"{FAKE}+cpu"} and env["unusable"].startswith(f"torch {FAKE}+cpu cannot import torchao")
    rows = [line for line in (out / "README.md").read_text().splitlines() if line.startswith(f"| this one with `torch=={FAKE}`")]
    assert len(rows) == 1 and rows[0].count(f"fail: torch {FAKE}+cpu cannot import torchao") == 2, rows


def test_a_known_broken_combination_is_said_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher.runtime import known

    versions = {"torchao": "0.18.0", "torch": "2.10.0+cpu"}
    monkeypatch.setattr(known, "_version", versions.get)
    assert known.broken() == ["torchao 0.18.0 loads its compiled kernels only with torch >= 2.11; with torch 2.10.0+cpu "
                              "they are skipped (int4 and float8 kernels missing): install torch >= 2.11"]
    versions["torch"] = "2.15.0"
    assert known.broken() == []


@pytest.mark.slow
def test_pip_install_keeps_a_users_torch_in_the_tested_range(sources: dict[str, Path], tmp_path: Path) -> None:
    """`pip install .` beside a torch the ranges admit (a stand-in of 2.15.0, layered on this environment as verify/envs.py
    layers one) installs the tool alone: torch stays (with exact pins it would have to be replaced, and pip, given no
    index here, would fail)."""
    import subprocess

    write_wheel(sources["user"], "torch", "2.15.0+cpu", "__version__ = '2.15.0'\n")
    env = envs.build(envs.parse_spec("torch==2.15.0"))
    report = tmp_path / "report.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([env.python, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--no-index",
                           "--report", str(report), "--quiet", str(root)], capture_output=True, text=True,
                          env={**os.environ, "PIP_FIND_LINKS": str(tmp_path / "nowhere")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert names == ["hf-ao-publish"], names
