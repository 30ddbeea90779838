"""publisher/hfjobs and publisher/flavors without a job: the flavor table and the registry's picks, the local
preflight (a wrong flavor is refused before anything is submitted), the token's scope, the wheel that ships
this code, and the result protocol between bootstrap.py and follow.py. The loopback runs are in
test_hfjobs_e2e.py.
"""

from __future__ import annotations

import email
import json
import logging
import subprocess
import sys
import time
import tomllib
import zipfile
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

from publisher import flavors as flavor_table
from publisher import recipes as recipe_registry
from publisher.errors import TargetError, UsageError
from publisher.flavors import Flavor, capability_of
from publisher.hfjobs import bootstrap, hardware, jobchecks, package
from publisher.hfjobs.follow import RemoteOutcome, decode_result, take_marker

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ flavors and registry

def test_capability_by_gpu_model() -> None:
    assert capability_of("L4") == (8, 9) and capability_of("Nvidia A10G") == (8, 6)
    assert capability_of("T4") == (7, 5) and capability_of("rtx-pro-6000") == (12, 0)
    assert capability_of("A100") == (8, 0) and capability_of(None) is None and capability_of("X9") is None
    assert Flavor("l4x1", "L4", 1).describe() == "l4x1 (L4, CC 8.9)" and Flavor("cpu-basic").describe() == "cpu-basic"
    assert Flavor("a100x4", "A100", 4).describe() == "a100x4 (4x A100, CC 8.0)"


def test_every_builtin_gpu_flavor_has_a_known_capability() -> None:
    names = [f.name for f in flavor_table.BUILTIN]
    assert len(names) == len(set(names))
    assert all(f.capability is not None for f in flavor_table.BUILTIN if f.gpu)
    from huggingface_hub import JobHardware

    assert set(names) == {h.value for h in JobHardware}  # the client's own list of flavor names


def test_smallest_flavors_per_recipe() -> None:
    picks = {r.name: {step: [f.name for f in found] for step, found in r.smallest_flavors().items()}
             for r in recipe_registry.all_recipes()}
    assert picks["int8wo"] == {"quantize": ["cpu-basic", "cpu-upgrade"], "run": ["cpu-basic", "cpu-upgrade"],
                               "benchmark": ["cpu-basic", "cpu-upgrade"]}
    # FP8 dynamic: made on a CPU (fp8cpu.py), but runs and is measured only on CC >= 8.9 (L4, L40S...)
    assert picks["float8dq"] == {"quantize": ["cpu-basic", "cpu-upgrade"], "run": ["l4x1", "l40sx1"],
                                 "benchmark": ["l4x1", "l40sx1"]}
    # int4wo: CC >= 8.0 for everything; the T4 (7.5) never qualifies
    assert picks["int4wo"]["quantize"] == ["l4x1", "a10g-small"] == picks["int4wo"]["run"]
    assert recipe_registry.get("int4wo").to_dict()["hf_jobs"]["run"] == ["l4x1", "a10g-small"]
    assert recipe_registry.get("float8dq").hf_jobs_text() == (
        "quantize: cpu-basic, cpu-upgrade; run, benchmark: l4x1 (L4, CC 8.9), l40sx1 (L40S, CC 8.9)")


def test_the_hubs_list_orders_by_price() -> None:
    class Acc:
        def __init__(self, model: str, quantity: str) -> None:
            self.type, self.model, self.quantity, self.vram = "gpu", model, quantity, "24 GB"

    class Entry:
        def __init__(self, name: str, cost: float, acc: Acc | None = None) -> None:
            self.name, self.unit_cost_usd, self.accelerator, self.unit_label = name, cost, acc, "minute"

    found = flavor_table.from_hub([Entry("a10g-small", 0.0167, Acc("A10G", "1")), Entry("cpu-basic", 0.0002),
                                   Entry("l4x1", 0.0133, Acc("L4", "1"))])
    assert [f.name for f in found] == ["cpu-basic", "l4x1", "a10g-small"]
    assert found[1].capability == (8, 9) and found[1].cost == 0.0133
    # with these prices an int4wo job's smallest flavor is the cheapest that fits
    assert [f.name for f in jobchecks.fitting(recipe_registry.get("int4wo"), found)] == ["l4x1", "a10g-small"]


def test_hardware_list_falls_back_to_the_table_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hardware.available() == (list(flavor_table.BUILTIN), "builtin")


def test_hardware_list_from_the_loopback_hub(hub: Any, cli: Any) -> None:
    found, source = hardware.available()
    assert source == "hub" and [f.name for f in found] == [f.name for f in flavor_table.BUILTIN]
    text = cli("recipes").stdout
    assert "flavors for --on-hf-jobs, from the Hub's hardware list." in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "  hf jobs      quantize, run, benchmark: l4x1 (L4, CC 8.9), a10g-small (A10G, CC 8.6)" in text


# ------------------------------------------------------------------------------------------ preflight

def _recipes(*names: str) -> list[recipe_registry.Recipe]:
    return [recipe_registry.get(n) for n in names]


@pytest.mark.parametrize("recipe, flavor, message", [
    ("int4wo", "cpu-basic", "int4wo needs a CUDA GPU with compute capability >= 8.0 to quantize and cpu-basic has no GPU; "
                            "pick l4x1 (L4, CC 8.9), a10g-small (A10G, CC 8.6)"),
    ("int4wo", "t4-small", "int4wo needs a CUDA GPU with compute capability >= 8.0 to quantize and t4-small (T4, CC 7.5) "
                           "is below it"),
    ("float8dq", "a10g-small", "float8dq runs only on a CUDA GPU with compute capability >= 8.9 and a10g-small (A10G, "
                               "CC 8.6) is below it: the job would pay for a GPU it cannot use; pick l4x1"),
    ("int8wo", "h100", "unknown Jobs flavor 'h100' for --on-hf-jobs; choose one of: cpu-basic, cpu-upgrade"),
])
def test_a_wrong_flavor_is_refused(recipe: str, flavor: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        jobchecks.check_flavor(_recipes(recipe), flavor, flavor_table.BUILTIN)
    assert message in str(info.value) and info.value.exit_code == 2


def test_fitting_flavors_pass_and_idle_hardware_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="publisher")
    assert jobchecks.check_flavor(_recipes("int4wo", "float8dq"), "l4x1", flavor_table.BUILTIN).name == "l4x1"
    assert not caplog.records
    jobchecks.check_flavor(_recipes("int8wo"), "a10g-small", flavor_table.BUILTIN)
    assert "the GPU of a10g-small stays idle; cpu-basic is enough" in caplog.text
    jobchecks.check_flavor(_recipes("float8dq"), "cpu-upgrade", flavor_table.BUILTIN)
    assert "on cpu-upgrade it is made on the CPU and verified there, without a GPU forward" in caplog.text
    jobchecks.check_flavor(_recipes("int4wo"), "a100x4", flavor_table.BUILTIN)
    assert "hf-ao-publish uses one GPU; a100x4 has 4" in caplog.text


def test_a_gpu_of_unknown_capability_is_refused() -> None:
    with pytest.raises(UsageError, match=r"compute capability of b300x1's GPU \(B300\) is unknown"):
        jobchecks.check_flavor(_recipes("int8wo"), "b300x1", [Flavor("b300x1", "B300", 1)])


def _who(role: str, **grained: Any) -> dict[str, Any]:
    return {"name": "alice", "auth": {"accessToken": {"role": role, **({"fineGrained": grained} if grained else {})}}}


def test_token_scope() -> None:
    jobchecks.check_token_can_run_jobs(_who("write"), "alice")
    ok = {"scoped": [{"entity": {"name": "alice", "type": "user"}, "permissions": ["repo.write", "job.write"]}]}
    jobchecks.check_token_can_run_jobs(_who("fineGrained", **ok), "alice")
    with pytest.raises(TargetError, match="read-only"):
        jobchecks.check_token_can_run_jobs(_who("read"), "alice")
    other = {"scoped": [{"entity": {"name": "acme", "type": "org"}, "permissions": ["job.write"]}]}
    with pytest.raises(TargetError, match="no job.write permission on alice, so it cannot start Jobs in alice"):
        jobchecks.check_token_can_run_jobs(_who("fineGrained", **other), "alice")


def test_cli_refuses_a_wrong_flavor_before_anything_is_submitted(cli: Any, hub: Any, flux_repo: str, tmp_path: Path) -> None:
    before = len(hub.jobs.jobs)
    staging = hub.store.get_repo("dataset", "alice/hf-ao-publish-jobs")  # an earlier test's jobs may have made it
    result = cli(flux_repo, "--quant", "int4wo", "--on-hf-jobs", "t4-small", token="tok_alice")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1].startswith("Error: int4wo needs a CUDA GPU with compute capability >= 8.0 "
                                                     "to quantize and t4-small (T4, CC 7.5) is below it; pick l4x1")
    assert len(hub.jobs.jobs) == before and hub.store.get_repo("dataset", "alice/hf-ao-publish-jobs") == staging
    result = cli(str(tmp_path), "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", token="tok_alice")
    assert result.exit_code == 2 and "is a local folder, which a Job cannot read" in result.stderr
    result = cli(flux_repo, "--quant", "int8wo", "--on-hf-jobs", "cpu-basic")
    assert result.exit_code == 1 and "needs a Hub token that can write and start Jobs" in result.stderr
    assert len(hub.jobs.jobs) == before


# ------------------------------------------------------------------------------------------ the wheel

def test_the_wheel_is_reproducible_and_complete() -> None:
    first, second = package.build_wheel(), package.build_wheel()
    assert first.data == second.data and first.sha256 == second.sha256  # the same code gives the same file
    assert first.filename == f"hf_ao_publish-{first.version}-py3-none-any.whl"
    zf = zipfile.ZipFile(BytesIO(first.data))
    names = set(zf.namelist())
    assert {"publisher/cli/commands.py", "publisher/hfjobs/bootstrap.py", "publisher/templates/modelcard.md.j2"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert zf.read("publisher/cli/commands.py") == (ROOT / "publisher" / "cli" / "commands.py").read_bytes()  # the running code, as is
    dist = f"hf_ao_publish-{first.version}.dist-info"
    meta = email.message_from_bytes(zf.read(f"{dist}/METADATA"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta.get_all("Requires-Dist") == project["dependencies"] and meta["Version"] == first.version
    assert zf.read(f"{dist}/entry_points.txt").decode() == "[console_scripts]\nhf-ao-publish = publisher.cli:main\n"
    assert first.version.startswith(project["version"] + "+")


def test_the_wheel_installs_and_runs(tmp_path: Path) -> None:
    wheel = package.build_wheel()
    path = tmp_path / wheel.filename
    path.write_bytes(wheel.data)
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                          "--disable-pip-version-check", "--target", str(target), str(path)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    code = "import publisher, publisher.stages.card as c; print(publisher.__file__); print(c.template_path())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [str(target / "publisher" / "__init__.py"),
                                       str(target / "publisher" / "templates" / "modelcard.md.j2")]


# ------------------------------------------------------------------------------------------ the result protocol

def test_result_round_trip_through_log_lines(capsys: pytest.CaptureFixture[str]) -> None:
    payload = {"recipe": "int8wo", "verified": True, "big": "x" * 10000, "text": "é ✓"}
    bootstrap.report(json.dumps(payload, indent=2) + "\n", 0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 3 and all(len(line) < 3100 for line in lines)
    outcome = RemoteOutcome("int8wo", "alice/m", "j", "u", "cpu-basic")
    assert all(take_marker(outcome, line) for line in lines)
    assert decode_result(outcome) == payload and outcome.exit_code == 0
    assert not take_marker(outcome, "Error: something else")


def test_bootstrap_imports_nothing_of_ours() -> None:
    source = (ROOT / "publisher" / "hfjobs" / "bootstrap.py").read_text()
    assert "publisher" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))


def test_sigterm_is_handled_like_ctrl_c_while_jobs_run() -> None:
    import os
    import signal

    from publisher.hfjobs.follow import terminate_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), terminate_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_docs_flavor_table_is_the_registrys() -> None:
    assert recipe_registry.hf_jobs_table() in (ROOT / "docs" / "hf-jobs.md").read_text()
