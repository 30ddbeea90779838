"""A runner harness for the GitHub Action: run_action() executes action.yml's steps the way the runner would.

Not a test module (pytest does not collect it): test_action.py and the test_action_*.py unit tests import it.
run_action() reads action.yml and runs its `run:` steps in order with
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

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from action.summary import SUMMARY_LIMIT

ROOT = Path(__file__).resolve().parent.parent
ACTION = ROOT / "action.yml"
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}", re.S)


def load_action() -> dict[str, Any]:
    import yaml  # imported here: the unit tests that use the parsers below do not need PyYAML

    return yaml.safe_load(ACTION.read_text())


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


@dataclass
class Interrupt:
    """Cancel the run as the runner does: once `ready()` holds during step `step`, send `signum` to that step's
    process (the bash that runs its script) and nothing else."""

    step: str
    ready: Callable[[], bool]
    signum: int
    timeout: float = 300


def _run_step(argv: list[str], cwd: Path, env: dict[str, str], interrupt: Interrupt | None) -> Any:
    if interrupt is None:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + interrupt.timeout
    while not interrupt.ready():
        assert proc.poll() is None, f"step {interrupt.step} ended before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, f"step {interrupt.step} never became ready to interrupt"
        time.sleep(0.05)
    proc.send_signal(interrupt.signum)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_action(inputs: dict[str, str], tmp: Path, env: dict[str, str | None] | None = None,
               interrupt: Interrupt | None = None, workspace: Path | None = None) -> ActionRun:
    """Run action.yml's steps with these inputs; ``env`` adds to (None: removes from) this process's environment, as a
    job's `env:` does; ``workspace`` is the job's workspace (default: a new folder in ``tmp``)."""
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
    workspace = workspace or tmp / "workspace"
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
    for key, value in (env or {}).items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value

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
        proc = _run_step(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], workspace, step_env,
                         interrupt if interrupt and step.get("id") == interrupt.step else None)
        ran.append(label)
        out.append(proc.stdout)
        err.append(proc.stderr)
        if summary_file.exists():
            text = summary_file.read_text(encoding="utf-8")
            assert len(text.encode("utf-8")) <= SUMMARY_LIMIT, f"{label}: summary over GitHub's 1 MiB cap"
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


def sample_result(card_path: str | None = None, **kw: Any) -> dict[str, Any]:
    """One recipe's --json result, as the CLI prints it, for the unit tests of the summary and the outputs."""
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
