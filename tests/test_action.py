"""The GitHub Action as a whole: action.yml and the workflows, the glue in action/, and the steps run by the harness.

The harness (tests/action_harness.py) executes action.yml's `run:` steps the way the runner does. The Hub is
conftest's loopback server (HF_ENDPOINT is inherited from the environment). The unit tests of the glue's
modules are in test_action_<module>.py.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from action_harness import EXPR, ROOT, Interrupt, assert_secret_absent, load_action, run_action
from workflow_harness import assert_actionlint_clean

yaml = pytest.importorskip("yaml")

GLUE = ROOT / "action"
GLUE_MODULES = sorted(GLUE.glob("*.py"))
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
SMALL = "--sample-steps 2 --sample-size 64"


# ------------------------------------------------------------------------------------------- structure

def test_action_yml_structure() -> None:
    action = load_action()
    assert {"name", "description", "inputs", "outputs", "runs"} <= set(action)
    assert action["runs"]["using"] == "composite"
    for name, spec in action["inputs"].items():
        assert spec.get("description"), f"input {name} has no description"
        if "default" in spec:
            assert isinstance(spec["default"], str), f"input {name}: defaults are strings (inputs always are)"
    assert {"model", "quant", "components", "exclude", "repo-id", "revision", "private", "create-pr", "hf-token",
            "python-version", "torch-build", "free-disk-space", "extra-args"} <= set(action["inputs"])
    assert {"repo-id", "repo-url", "commit-sha", "pr-url", "verified", "result-json"} <= set(action["outputs"])

    steps = action["runs"]["steps"]
    ids = [s["id"] for s in steps if "id" in s]
    assert len(ids) == len(set(ids))
    used_inputs: set[str] = set()
    earlier: list[str] = []
    for step in steps:
        assert ("run" in step) != ("uses" in step), step
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", step["uses"]), f"pin {step['uses']} to a major version"
        else:
            assert step.get("shell") == "bash", f"{step.get('name')}: every run step needs shell: bash"
            assert "${{" not in step["run"], f"{step.get('name')}: no expression inside run: (pass it through env:)"
            syntax = subprocess.run(["bash", "-n"], input=step["run"], capture_output=True, text=True)
            assert syntax.returncode == 0, f"{step.get('name')}: {syntax.stderr}"
        for key, value in (step.get("env") or {}).items():
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key)
            for expr in EXPR.findall(str(value)):
                assert re.fullmatch(r"(inputs\.[\w-]+|steps\.[\w-]+\.outputs\.[\w-]+)", expr), expr
        text = yaml.safe_dump(step)
        used_inputs |= set(re.findall(r"inputs\.([\w-]+)", text))
        for sid in re.findall(r"steps\.([\w-]+)\.outputs", text):
            assert sid in earlier, f"{step.get('name')} reads steps.{sid} before it ran"
        if "id" in step:
            earlier.append(step["id"])
    assert used_inputs <= set(action["inputs"]), f"undeclared inputs used: {used_inputs - set(action['inputs'])}"
    assert set(action["inputs"]) <= used_inputs, f"declared but unused: {set(action['inputs']) - used_inputs}"
    for name, spec in action["outputs"].items():
        m = re.fullmatch(r"\$\{\{ steps\.([\w-]+)\.outputs\.([\w-]+) \}\}", spec["value"])
        assert m and m.group(1) in ids and m.group(2) == name, spec["value"]
    # The token reaches the scripts only as HFAO_TOKEN, and the first step masks it.
    assert "HFAO_TOKEN" in steps[0]["env"] and "add-mask" in steps[0]["run"]
    for step in steps:
        for key, value in (step.get("env") or {}).items():
            assert ("inputs.hf-token" in str(value)) == (key == "HFAO_TOKEN")
    # check and publish get the same inputs (a check must see what the run will see).
    check, publish = (next(s for s in steps if s.get("name", "").startswith(p)) for p in ("Check", "Quantize"))
    assert {k: v for k, v in check["env"].items() if k not in ("HFAO_TORCH_BUILD", "HFAO_FREE_DISK_SPACE")} == {
        k: v for k, v in publish["env"].items() if k != "HFAO_PYTHON"}


def test_glue_reads_only_declared_variables() -> None:
    """Every HFAO_* variable the glue reads is set by some step, and vice versa."""
    read = {name for path in GLUE_MODULES for name in re.findall(r'"(HFAO_[A-Z_]+)"', path.read_text())}
    set_by_steps = {k for s in load_action()["runs"]["steps"] for k in (s.get("env") or {})}
    assert read == set_by_steps


def test_steps_run_the_glue_from_the_action_path() -> None:
    """Each run step (but the mask) is one call of action/main.py under python3, isolated (-I), exec'd so that a
    cancelled run's signals reach the glue (bash would hold them until its child ended)."""
    steps = [s for s in load_action()["runs"]["steps"] if "run" in s][1:]
    assert [s["run"] for s in steps] == [f'exec python3 -I "$GITHUB_ACTION_PATH/action/main.py" {step}'
                                         for step in ("check", "free-disk", "install", "run")]
    publish = next(s for s in steps if s.get("id") == "publish")
    assert publish["env"]["HFAO_PYTHON"] == "${{ steps.install.outputs.python }}"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement in a file, relative ones resolved in action."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = ("action." if node.level else "") + (node.module or "")
            found.append((module.rstrip("."), [alias.name for alias in node.names]))
    return found


@pytest.mark.parametrize("path", GLUE_MODULES, ids=lambda p: p.name)
def test_glue_is_stdlib_only_python38(path: Path) -> None:
    """The glue runs under the runner's python3 before anything is installed: stdlib only, Python 3.8 syntax,
    no private name of another module, a few hundred lines at most."""
    ast.parse(path.read_text(), str(path), feature_version=(3, 8))
    for module, names in _imports(path):
        top = module.split(".")[0]
        assert top == "action" or top == "__future__" or top in sys.stdlib_module_names, f"{path.name} imports {module}"
        if top == "action":
            assert not [n for n in names if n.startswith("_")], f"{path.name} imports private names from {module}"
    assert len(path.read_text().splitlines()) <= 300


def test_glue_has_no_import_cycle() -> None:
    """Module-level and deferred imports alike (ast.walk sees both); `from action import x` counts as action.x."""
    graph: dict[str, set[str]] = {f"action.{p.stem}": set() for p in GLUE_MODULES}
    for path in GLUE_MODULES:
        me = f"action.{path.stem}"
        for module, names in _imports(path):
            graph[me] |= {t for t in {module, *(f"{module}.{n}" for n in names)} if t in graph and t != me}
    done: set[str] = set()

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in trail, f"import cycle: {' -> '.join(trail + (node,))}"
        if node not in done:
            for dep in graph[node]:
                visit(dep, trail + (node,))
            done.add(node)

    for node in graph:
        visit(node, ())


def test_the_package_does_not_know_the_glue() -> None:
    """The wheel is the CLI only: nothing in publisher/ imports or names the Action's glue."""
    for path in sorted((ROOT / "publisher").rglob("*.py")):
        for module, _ in _imports(path):
            assert module.split(".")[0] != "action", f"{path} imports {module}"
        text = path.read_text()
        for word in ("HFAO_", "GITHUB_", "::add-mask::", "stop-commands", "action/main.py"):
            assert word not in text, f"{path} mentions {word}: workflow glue belongs in action/"


def test_glue_ships_in_the_sdist_not_the_wheel(tmp_path: Path) -> None:
    import tarfile

    proc = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-t", "wheel", "-d", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheel = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert not [n for n in wheel if not n.startswith(("publisher/", "hf_ao_publish-"))], wheel
    with tarfile.open(next(tmp_path.glob("*.tar.gz"))) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {f"action/{p.name}" for p in GLUE_MODULES} | {"action.yml"} <= names


def _workflows() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, yaml.safe_load(p.read_text())) for p in WORKFLOWS]


def test_workflows_structure() -> None:
    names = {p.name for p in WORKFLOWS}
    assert {"self-test.yml", "release.yml"} <= names
    for path, wf in _workflows():
        on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
        assert on, f"{path.name}: no triggers"
        # least privilege: only the release workflow pushes (a tag), and it runs no third-party action
        if path.name == "release.yml":
            assert wf.get("permissions") == {"contents": "write"}, path.name
            assert {s["uses"] for job in wf["jobs"].values() for s in job["steps"] if "uses" in s} == {"actions/checkout@v4"}
        else:
            assert wf.get("permissions") == {"contents": "read"}, f"{path.name}: least-privilege token"
        for job_name, job in wf["jobs"].items():
            assert job.get("runs-on") and job.get("timeout-minutes"), f"{path.name}:{job_name}"
            for step in job["steps"]:
                assert ("run" in step) != ("uses" in step)
                if "run" in step:
                    assert "${{ inputs." not in step["run"] and "${{ github.event" not in step["run"]
    self_test = yaml.safe_load((ROOT / ".github/workflows/self-test.yml").read_text())
    steps = self_test["jobs"]["action"]["steps"]
    assert [s["uses"] for s in steps if "uses" in s][:2] == ["actions/checkout@v4", "actions/setup-python@v5"]
    assert sum(1 for s in steps if s.get("uses") == "./") >= 2
    runs = "\n".join(s.get("run", "") for s in steps)
    assert "python -m publisher.testing.hubserver" in runs and "--port 8765" in runs and "python -m publisher.testing.tiny flux" in runs
    assert self_test["jobs"]["action"]["env"]["HF_ENDPOINT"] == "http://127.0.0.1:8765"


def test_actionlint_workflows() -> None:
    """actionlint's WebAssembly build from npm (`make setup` installs it into .ci/.node; it works offline)."""
    assert_actionlint_clean(WORKFLOWS)


# ------------------------------------------------------------------------------------------- executed

def test_harness_stops_at_a_bad_input(tmp_path: Path, hub: Any) -> None:
    """A malformed input fails in the check step, before install: seconds, not minutes."""
    run = run_action({"model": "bfl/tiny-flux", "quant": "int8wo", "hf-token": "tok_alice", "free-disk-space": "yes"}, tmp_path)
    assert run.returncode == 2 and run.failed_step == "Check inputs"
    assert run.skipped == ["actions/setup-python@v5"] and run.ran == ["Mask the token", "Check inputs"]
    assert run.errors() == ["input free-disk-space must be 'true' or 'false', got 'yes'"]
    assert_secret_absent(run, "tok_alice")


def test_extra_args_token_is_refused(tmp_path: Path, hub: Any) -> None:
    marker = tmp_path / "pwned"
    run = run_action({"model": "bfl/tiny-flux", "quant": "int8wo", "hf-token": "tok_alice",
                      "extra-args": f"--sample-steps 2 --token tok_bfl; touch {marker}"}, tmp_path)
    assert run.returncode == 2 and run.failed_step == "Check inputs"
    assert any("must not contain --token" in e for e in run.errors())
    assert not marker.exists()


def test_skip_install_checks_the_interpreter(tmp_path: Path, hub: Any) -> None:
    bare = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    run = run_action({"model": "bfl/tiny-flux", "quant": "int8wo", "hf-token": "tok_alice"}, tmp_path,
                     env={"HF_AO_PUBLISH_PYTHON": bare})
    assert run.returncode == 2 and run.failed_step == "Install torch and hf-ao-publish"
    assert any("HF_AO_PUBLISH_SKIP_INSTALL is set but" in e for e in run.errors())


def test_usage_and_check_from_the_command_line(tmp_path: Path) -> None:
    """main.py as the steps call it: isolated, from another folder, inputs in the environment only."""
    main = [sys.executable, "-I", str(GLUE / "main.py")]
    usage = subprocess.run([*main, "nope"], capture_output=True, text=True, cwd=tmp_path)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: main.py {check|")
    env = {"PATH": os.environ.get("PATH", ""), "HFAO_MODEL": "bfl/tiny-flux", "HFAO_QUANT": "int8wo",
           "HFAO_TOKEN": "tok_x", "HFAO_EXTRA_ARGS": "--token=tok_x"}
    bad = subprocess.run([*main, "check"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert bad.returncode == 2 and bad.stdout.startswith("::error title=hf-ao-publish::input extra-args must not")
    good = subprocess.run([*main, "check"], capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "HFAO_EXTRA_ARGS": SMALL})
    assert good.returncode == 0 and good.stdout == "", good.stdout + good.stderr


HOSTILE = {  # input -> (value template, the CLI's clean message); none may run anything
    "model-quote": ("model", 'x/y"; touch {marker} #', "is neither an existing local folder nor a Hub repo id"),
    "model-subst": ("model", "$(touch {marker})", "is neither an existing local folder nor a Hub repo id"),
    "model-newline": ("model", "a/b\ntouch {marker}", "is neither an existing local folder nor a Hub repo id"),
    "model-backtick": ("model", "`touch {marker}`/x'; touch {marker}; '", "is neither an existing local folder nor a Hub repo id"),
    "repo-id": ("repo-id", 'alice/x"$(touch {marker})\nacme/y', "is not a valid Hub repo id"),
    "revision": ("revision", "main`touch {marker}`; touch {marker}", "not found in bfl/tiny-flux"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_inputs_run_nothing(tmp_path: Path, flux_repo: str, case: str) -> None:
    name, template, message = HOSTILE[case]
    marker = tmp_path / "pwned"
    inputs = {"model": flux_repo, "quant": "int8wo", "hf-token": "tok_alice", "repo-id": "alice/hostile"}
    inputs[name] = template.format(marker=marker)
    run = run_action(inputs, tmp_path)
    assert not marker.exists()
    assert run.returncode in (1, 2) and run.failed_step == "Quantize, verify and publish"
    errors = run.errors()
    assert len(errors) == 1 and message in errors[0], errors
    assert "Traceback" not in run.log
    assert run.outputs["verified"] == "false" and run.outputs["repo-id"] == ""
    assert json.loads(run.outputs["result-json"])["exit_code"] == run.returncode
    assert message in run.summary
    # the CLI echoed the value (newline included) while workflow commands were switched off
    assert {c.name for c in run.commands} <= {"add-mask", "group", "endgroup", "error"}
    assert_secret_absent(run, "tok_alice")


@pytest.mark.slow
def test_run_step_with_the_tool_in_another_interpreter(tmp_path: Path, hub: Any) -> None:
    """The glue runs under a bare python3 first on PATH; the CLI comes from HF_AO_PUBLISH_PYTHON's venv."""
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or Path(bare).resolve() == Path(sys.executable).resolve():
        pytest.skip("no python3 in /usr/bin or /bin other than the test interpreter")
    path = os.pathsep.join(["/usr/bin", "/bin", os.environ.get("PATH", "")])
    run = run_action({"model": "nobody/absent-model", "quant": "int8wo", "hf-token": "tok_alice"}, tmp_path,
                     env={"PATH": path, "HF_AO_PUBLISH_PYTHON": sys.executable})
    assert run.steps["install"]["python"] == sys.executable
    assert run.ran[-1] == "Quantize, verify and publish" and run.failed_step == "Quantize, verify and publish"
    assert run.returncode in (1, 2)
    errors = run.errors()
    assert len(errors) == 1 and "nobody/absent-model" in errors[0], errors  # the CLI's own message
    assert "Traceback" not in run.log
    assert json.loads(run.outputs["result-json"])["exit_code"] == run.returncode
    assert_secret_absent(run, "tok_alice")


@pytest.mark.slow
def test_action_publishes_tiny_flux_and_reruns_as_noop(tmp_path: Path, flux_repo: str) -> None:
    from huggingface_hub import HfApi

    inputs = {"model": flux_repo, "quant": "int8wo", "repo-id": "alice/action-flux-int8wo", "hf-token": "tok_alice",
              "verify-matrix": "none",
              "extra-args": f"{SMALL} --eval-budget 0 --sample-prompt \"a cat's \\\"portrait\\\"\""}
    t0 = time.monotonic()
    run = run_action(inputs, tmp_path / "first")
    assert run.returncode == 0, run.log[-4000:]
    assert run.skipped == ["actions/setup-python@v5"]
    assert run.ran == ["Mask the token", "Check inputs", "Free disk space", "Install torch and hf-ao-publish",
                       "Quantize, verify and publish"]
    out = run.outputs
    endpoint = os.environ["HF_ENDPOINT"].rstrip("/")
    assert out["repo-id"] == "alice/action-flux-int8wo"
    assert out["repo-url"] == f"{endpoint}/alice/action-flux-int8wo"
    assert re.fullmatch(r"[0-9a-f]{40}", out["commit-sha"])
    assert out["pr-url"] == "" and out["verified"] == "true" and out["up-to-date"] == "false"
    data = json.loads(out["result-json"])
    assert data["repo_id"] == "alice/action-flux-int8wo" and data["commit"] == out["commit-sha"] and data["pushed"]
    assert out["output-dir"] == ""  # pushed: the repo folder was removed, as the CLI does with its own temp folder
    assert not list((tmp_path / "first" / "runner_temp").glob("hf-ao-publish-out-*"))

    api = HfApi()
    assert api.list_repo_commits("alice/action-flux-int8wo")[0].commit_id == out["commit-sha"]
    files = set(api.list_repo_files("alice/action-flux-int8wo"))
    assert {"README.md", "verification.json", "model_index.json", "transformer/diffusion_pytorch_model.safetensors"} <= files
    card = Path(api.hf_hub_download("alice/action-flux-int8wo", "README.md")).read_text()
    assert "tok_alice" not in card and 'a cat\\u0027s \\"portrait\\"' in card  # the prompt, through tojson
    assert "--compat none" in card and "--eval-budget 0" in card  # verify-matrix and extra-args reached the CLI

    summary = run.summary
    assert f"[alice/action-flux-int8wo]({endpoint}/alice/action-flux-int8wo)" in summary
    assert "#### Files" in summary and "`transformer/diffusion_pytorch_model.safetensors`" in summary
    assert "#### Verification" in summary and "✅ bit-identical" in summary and "| library |" in summary and "| manual |" in summary
    assert "Model card preview" in summary and "base_model: bfl/tiny-flux" in summary
    assert [c.name for c in run.commands if c.name in ("group", "endgroup")] == ["group", "endgroup"]
    assert not run.errors()
    assert_secret_absent(run, "tok_alice")
    first = time.monotonic() - t0

    again = run_action(inputs, tmp_path / "again")
    assert again.returncode == 0, again.log[-4000:]
    assert again.outputs["up-to-date"] == "true" and again.outputs["commit-sha"] == out["commit-sha"]
    assert again.outputs["verified"] == "true"
    assert "is up to date" in again.stderr and "up to date (nothing to publish)" in again.summary
    assert api.list_repo_commits("alice/action-flux-int8wo")[0].commit_id == out["commit-sha"]
    assert_secret_absent(again, "tok_alice")
    print(f"publish {first:.1f}s, re-run {time.monotonic() - t0 - first:.1f}s")


QUANT_VALUES = {  # a quant line -> the tensor class each quantized component gets
    "call": ("IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))",
             {"transformer": "IntxUnpackedToInt8Tensor"}),
    "mapping": ("transformer=float8wo,text_encoder_2=int8wo", {"transformer": "Float8Tensor", "text_encoder_2": "Int8Tensor"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(QUANT_VALUES))
def test_a_quant_line_reaches_the_cli_whole(tmp_path: Path, flux_repo: str, case: str) -> None:
    """A config call and a component mapping in `quant` are each one --quant, as on the command line (before, the input
    was split on commas and spaces: "'(' was never closed", "every --quant of one run must quantize the same
    components")."""
    given, classes = QUANT_VALUES[case]
    run = run_action({"model": flux_repo, "quant": f"\n  {given}  \n", "push": "false", "verify-matrix": "none",
                      "extra-args": "--eval-budget 0 --verify-mode streaming"}, tmp_path)
    assert run.returncode == 0, run.log[-4000:]
    data = json.loads(run.outputs["result-json"])
    assert data["verified"] and not data["pushed"]
    assert {c["name"]: list(c["tensor_classes"]) for c in data["components"]} == {n: [k] for n, k in classes.items()}
    record = json.loads((Path(run.outputs["output-dir"]) / "hf_ao_publish.json").read_text())
    assert record["quant"]["given"] == given
    assert "+ " + shlex.join(["hf-ao-publish", "publish", flux_repo, f"--quant={given}", "--no-push"]) in run.stdout


@pytest.mark.slow
def test_a_cancelled_run_reaches_the_cli_which_deletes_the_repo_it_created(tmp_path: Path, hub: Any,
                                                                           flux_repo: str) -> None:
    """A workflow cancel sends SIGINT to the step's process only: the exec'd glue forwards it, the CLI cleans up."""
    from huggingface_hub import HfApi

    target = "alice/action-cancelled"
    hub.clear_faults()
    hub.set_fault(delay_s=1.0, match=f"/api/models/{target}/preupload/", count=10_000)  # the run sits in its push
    try:
        # in-process verification: the subject is the cancel during the push (the publish test above keeps the default)
        run = run_action({"model": flux_repo, "quant": "int8wo", "repo-id": target, "hf-token": "tok_alice",
                          "verify-matrix": "none", "extra-args": f"{SMALL} --verify-mode streaming --eval-budget 0"},
                         tmp_path,
                         interrupt=Interrupt("publish", lambda: hub.requests_delayed_now > 0, signal.SIGINT))
    finally:
        hub.clear_faults()
    assert run.returncode == 130 and run.failed_step == "Quantize, verify and publish", run.log[-4000:]
    errors = run.errors()
    assert len(errors) == 1 and errors[0].startswith("interrupted by SIGINT: "), errors
    assert "any repo it had created" in errors[0]
    assert not HfApi(token="tok_alice").repo_exists(target)  # the CLI's own cleanup ran
    assert json.loads(run.outputs["result-json"])["exit_code"] == 130
    assert "interrupted by SIGINT" in run.summary
    assert "Traceback" not in run.log
    assert_secret_absent(run, "tok_alice")
