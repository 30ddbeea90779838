"""The compatibility matrix end to end: two environments built from specs (PyPI, cached), a tiny FLUX publish
whose card table holds what they measure, and `verify TARGET --verify-env SPEC`.

Measured facts this pins (docs/compatibility.md): diffusers 0.38.0's from_pretrained returns the int8wo transformer
without an error but with none of its 30 layers loaded (its weights left on the meta device), and moving it raises:
a failure the user sees, whose detail says which layers came back wrong (issue 22: anything that raised is "fail");
its manual path loads it bit-identically; torchao 0.17.0 fails on both paths with `Int8Tensor.__new__() got an
unexpected keyword argument 'reduce_range'`. The "silently wrong" outcome is pinned by tests/test_verify_peers.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

SMALL = ["--sample-steps", "2", "--sample-size", "64"]
DROPPED, FAILING = "diffusers==0.38.0", "torchao==0.17.0"  # drops the torchao weights; cannot build the tensors
LABELS = {"this tool's own (made and verified here)": "current", f"this one with `{DROPPED}`": DROPPED,
          f"this one with `{FAILING}`": FAILING}


@pytest.fixture(scope="module")
def published(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    from click.testing import CliRunner

    from publisher.cli import main

    out = tmp_path_factory.mktemp("matrix") / "out"
    result = CliRunner().invoke(main, [str(tiny_flux_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(out), "--json",
                                       "--compat", DROPPED, "--compat", FAILING, "--eval-budget", "0", *SMALL],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output  # what the matrix finds is published, it does not stop the publish
    return json.loads(result.stdout), (out / "README.md").read_text(), out


def _outcomes(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(r["env"], r["path"]): r["outcome"] for r in report["results"] + report["compat"]}


@pytest.mark.slow
def test_outcomes(published: tuple[dict[str, Any], str, Path]) -> None:
    report = published[0]["verification"]
    assert report["passed"]
    assert _outcomes(report) == {
        ("current", "library"): "pass", ("current", "manual"): "pass",
        (DROPPED, "library"): "fail", (DROPPED, "manual"): "pass",
        (FAILING, "library"): "fail", (FAILING, "manual"): "fail",
    }
    by = {(r["env"], r["path"]): r for r in report["compat"]}
    dropped = by[(DROPPED, "library")]
    assert dropped["detail"].startswith("it loaded, but 0 of 30 planned layers are of the class their config implies (layer ")
    assert "is Parameter, Int8Tensor expected); then it raised NotImplementedError: Cannot copy out of meta tensor" in dropped["detail"]
    assert dropped["versions"]["diffusers"] == "0.38.0" and dropped["quantized_layers"] == 0 and not dropped["silent"]
    assert dropped["class_found"] == "Parameter"
    assert by[(DROPPED, "manual")]["max_abs_diff"] == 0.0 and by[(DROPPED, "manual")]["quantized_layers"] == 30
    for path in ("library", "manual"):
        failed = by[(FAILING, path)]
        assert "Int8Tensor.__new__() got an unexpected keyword argument 'reduce_range'" in failed["detail"]
        assert failed["versions"]["torchao"] == "0.17.0"
    envs = {e["name"]: e for e in report["environments"]}
    assert list(envs) == ["current", DROPPED, FAILING]
    assert envs[DROPPED]["packages"]["diffusers"] == "0.38.0" and not envs[DROPPED]["gating"]
    assert envs[FAILING]["packages"] == {"torchao": "0.17.0"}  # only the named package: torchao needs nothing else
    assert published[0]["seconds"]["compat"] > 0


def _table(card: str) -> list[list[str]]:
    section = card.split("## Compatibility\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| environment")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def _outcome_of(cell: str) -> str:
    return "pass" if cell.startswith("pass") else "silently wrong" if cell.startswith("**SILENTLY WRONG**") else "fail"


@pytest.mark.slow
def test_card_table_is_the_results(published: tuple[dict[str, Any], str, Path]) -> None:
    data, card, _ = published
    report = data["verification"]
    rows = _table(card)
    assert len(rows) == 3
    table = {}
    for env, component, versions, library, manual in rows:
        assert component == "transformer"
        table[(LABELS[env], "library")], table[(LABELS[env], "manual")] = _outcome_of(library), _outcome_of(manual)
        name = LABELS[env]
        measured = next(r["versions"] for r in report["results"] + report["compat"] if r["env"] == name)
        for package in ("torch", "torchao", "diffusers"):
            assert f"{package} {measured[package]}" in versions  # the exact versions each load ran with
    assert table == _outcomes(report)
    assert "0 of 30 planned layers are of the class their config implies" in card and "reduce_range" in card
    assert "**Silently wrong:**" not in card  # every load that went wrong raised


@pytest.mark.slow
def test_card_claims_only_what_was_measured(published: tuple[dict[str, Any], str, Path]) -> None:
    data, card, _ = published
    current = next(r["versions"] for r in data["verification"]["results"] if r["env"] == "current")
    software = card.split("## Software requirements\n", 1)[1].split("\n## ", 1)[0]
    library = next(line for line in software.splitlines() if line.startswith("- with the library loaders"))
    manual = next(line for line in software.splitlines() if line.startswith("- without the library loaders"))
    assert f"torch {current['torch']} (the only version measured)" in library  # no old torch was run: no torch claim
    assert f"torchao >= {current['torchao']} (measured: {current['torchao']} pass; 0.17.0 fail;" in library
    assert f"diffusers >= {current['diffusers']} (measured: {current['diffusers']} pass; 0.38.0 fail;" in library
    assert f"diffusers >= 0.38.0 (measured: 0.38.0 and {current['diffusers']} pass;" in manual
    for hand_typed in ("torch >= 2.6", "safetensors >= 0.4", "<= 2.6", "Older torch", "Minimum versions known"):
        assert hand_typed not in card
    usage = card.split("### Without the library loaders (older diffusers or transformers)\n", 1)[1]
    assert "Measured to load this repo correctly with:" in usage.split("```", 1)[0]
    assert "whose library loaders do not load it correctly: diffusers 0.38.0" in usage.split("```", 1)[0]
    assert "It does not work with: torchao 0.17.0 (fail)" in usage.split("```", 1)[0]


@pytest.mark.slow
def test_verify_target_with_a_spec_environment(cli: Any, published: tuple[dict[str, Any], str, Path]) -> None:
    from publisher.verify import envs

    assert envs.build(envs.parse_spec(DROPPED)).reused  # built by the publish above, reused from the cache
    folder = published[2]
    result = cli("verify", str(folder), "--no-requantize", "--verify-env", DROPPED, "--compat", "none")  # gating, not measured
    assert result.exit_code == 1  # --verify-env must pass, and diffusers 0.38 does not
    dropped = next(line for line in result.stdout.splitlines() if line.split()[:2] == ["transformer", "library"]
                   and DROPPED in line)
    assert " FAIL " in dropped and "0 of 30 planned layers" in dropped
    assert any(line.split()[:4] == ["transformer", "manual", DROPPED, "pass"] for line in result.stdout.splitlines())
    assert result.stderr.splitlines()[-1].startswith(
        f"Error: verification of {folder} failed: transformer via the library path ({DROPPED}): it loaded, but 0 of 30 "
        "planned layers are of the class their config implies")


@pytest.mark.slow
def test_a_load_measured_before_is_read_not_measured_again(published: tuple[dict[str, Any], str, Path], cli: Any,
                                                           tmp_path: Path) -> None:
    """The same files, inputs and environment: the matrix reads what an earlier run measured (verify/memo.py) and
    gives the same results; one byte of the component's files changed, it measures again, and keeps that; only the
    base's name in a config is not part of the question."""
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(published[2], folder)

    def verify() -> tuple[str, list[dict[str, Any]]]:
        result = cli("verify", str(folder), "--compat", FAILING, "--no-requantize", "--json")
        assert result.exit_code == 0, result.output
        return result.stderr, json.loads(result.stdout)["compat"]

    read = "(2 of the loads were measured by an earlier run: the same files, inputs and environment)"
    measured = {(r["path"], r["outcome"], r["detail"]) for r in published[0]["verification"]["compat"] if r["env"] == FAILING}
    said, got = verify()  # the publish measured these files with FAILING, on the same inputs
    assert read in said and {(r["path"], r["outcome"], r["detail"]) for r in got} == measured
    config = folder / "transformer" / "config.json"
    config.write_text(config.read_text() + "\n")  # the same config, other bytes: another question
    said, again = verify()
    assert "measured by an earlier run" not in said and again == got
    said, kept = verify()
    assert read in said and kept == got
    # the base's name diffusers records (published from a Hub id or from a folder of another name): no load reads it
    text = config.read_text()
    named = json.loads(text)["_name_or_path"]
    config.write_text(text.replace(f'"_name_or_path": {json.dumps(named)}', '"_name_or_path": "./my-pipeline"', 1))
    assert json.loads(config.read_text())["_name_or_path"] == "./my-pipeline"
    said, renamed = verify()
    assert read in said and renamed == got
