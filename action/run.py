"""The publish step: run `hf-ao-publish publish ... --json` once; write the outputs, the summary, annotations.

The CLI runs in the interpreter the install step prepared ($HFAO_PYTHON), without a shell, with its
--output-dir in $RUNNER_TEMP so the action can keep or remove the repo folder as the inputs say. This module
runs under any python3: it only starts the CLI and reads its JSON, so it never imports the package.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from action import result
from action.inputs import ActionInputError, build_request, parse_quant, secret_values, split_list
from action.summary import build_recheck_summary, build_summary
from action.workflow import (
    TITLE,
    StepFailed,
    append_summary,
    commands_stopped,
    error,
    group,
    mask,
    redact,
    write_output,
)

STDERR_TAIL = 400  # lines of the CLI's stderr kept to find its one-line error message


def cli_command(python: str, path: str | None = None) -> list[str]:
    """How to start the CLI: the console script next to `python`, else on the step's PATH (``path``; default this
    process's), else through `python -c`."""
    script = Path(python).parent / "hf-ao-publish"
    if script.exists():
        return [str(script)]
    found = shutil.which("hf-ao-publish", path=path)
    if found:
        return [found]
    return [python, "-c", "import sys; sys.argv[0] = 'hf-ao-publish'; from publisher.cli import main; main()"]


def child_env(env: Mapping[str, str], token: str | None) -> dict[str, str]:
    """The CLI's environment: the step's, without the raw inputs, with the token as HF_TOKEN only."""
    child = {key: value for key, value in env.items() if not key.startswith("HFAO_")}
    if token:
        child["HF_TOKEN"] = token
    child.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # progress bars are noise in a CI log
    child.setdefault("PYTHONUNBUFFERED", "1")  # the log streams as the CLI works, not at its end
    return child


@dataclass
class CliRun:
    """What the CLI left: its exit code, its stdout (the JSON result) and the end of its stderr."""

    returncode: int
    stdout: str
    stderr_tail: list[str]

    @property
    def error_line(self) -> str | None:
        """The CLI's one-line message (`Error: ...`), the last one on stderr."""
        for line in reversed(self.stderr_tail):
            if line.startswith("Error: "):
                return line[len("Error: "):].strip()
        return None


FORWARDED = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def forwarding(proc: subprocess.Popen[str]) -> Iterator[None]:
    """While the CLI runs, SIGINT / SIGTERM sent to this step are passed on to it.

    A cancelled workflow run signals the step's process only (SIGINT, SIGTERM 7.5 s later, then SIGKILL):
    action.yml execs this glue, so that is us, and the CLI in its own session sees the signal only through
    here, once. It then does its own cleanup (workers stopped, a repo it created deleted) and exits 130/143
    with its one-line message, which this step turns into the annotation, the summary and the outputs as
    for any failure. Outside the main thread Python cannot set handlers: nothing is forwarded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_cli(argv: list[str], env: Mapping[str, str], secrets: Sequence[str], show: str = "") -> CliRun:
    """Run the CLI without a shell; stream its stderr (redacted) with workflow commands switched off.

    Nothing printed meanwhile (the command line with the model id, the CLI's logs) can issue a workflow
    command such as ::add-path:: or ::set-env::. Raises StepFailed when the CLI cannot be started."""
    tail: deque[str] = deque(maxlen=STDERR_TAIL)
    with commands_stopped():
        if show:
            sys.stdout.write(redact(show, secrets) + "\n")
            sys.stdout.flush()
        try:
            # its own session: a signal meant for the step's process group reaches the CLI once, from us
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(env), text=True,
                                    encoding="utf-8", errors="replace", start_new_session=True)
        except OSError as exc:
            raise StepFailed(f"cannot start {argv[0]}: {exc}") from None
        stderr, stdout = proc.stderr, proc.stdout
        if stderr is None or stdout is None:  # pragma: no cover - both are pipes above
            raise StepFailed(f"{argv[0]} started without its pipes")

        def pump() -> None:
            # stderr is read on a thread while stdout is read here: either pipe filling up would block the CLI.
            for line in stderr:
                line = redact(line, secrets)
                tail.append(line.rstrip("\n"))
                sys.stderr.write(line)
                sys.stderr.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        with forwarding(proc):
            out = stdout.read()
            code = proc.wait()
        reader.join()
    return CliRun(code, out, list(tail))


def failure_message(run: CliRun) -> str | None:
    """The run's error: the CLI's own message, else its exit code and last stderr line; None on success."""
    message = run.error_line
    if run.returncode != 0 and not message:
        message = f"hf-ao-publish exited with code {run.returncode}"
        if run.stderr_tail:
            message += f": {run.stderr_tail[-1][:500]}"
    return message


def read_cards(results: list[dict[str, Any]]) -> dict[int, str]:
    """Each recipe's card text by its index in the result, for the summary's preview."""
    cards: dict[int, str] = {}
    for i, r in enumerate(results):
        card_path = r.get("card_path")
        if card_path and Path(card_path).is_file():
            cards[i] = Path(card_path).read_text(encoding="utf-8", errors="replace")
    return cards


def fail_early(env: Mapping[str, str], model: str, message: str, secrets: Sequence[str], code: int = 2) -> int:
    """The CLI did not run: still one annotation, a summary and every output (result-json holds the error)."""
    message = redact(message, secrets)
    error(message)
    append_summary(env.get("GITHUB_STEP_SUMMARY"), build_summary(model, None, message, code, {}, secrets))
    for name, value in result.outputs_for(None, message, code, None).items():
        write_output(env.get("GITHUB_OUTPUT"), name, value)
    return code


def run(env: Mapping[str, str]) -> int:
    """The step: mask, build the argv, run the CLI, then annotations, summary, the repo folder and outputs."""
    model = env.get("HFAO_MODEL", "") or ", ".join(split_list(env.get("HFAO_MODELS")))
    secrets = secret_values(env)
    for secret in secrets:
        mask(secret)
    try:
        req = build_request(env)
    except ActionInputError as exc:
        return fail_early(env, model, str(exc), secrets, exc.code)
    temp_root = Path(env.get("RUNNER_TEMP") or tempfile.gettempdir())
    temp_root.mkdir(parents=True, exist_ok=True)
    # the CLI's repo folder (a recheck makes none)
    out_dir = None if req.recheck else Path(tempfile.mkdtemp(prefix="hf-ao-publish-out-", dir=str(temp_root)))
    cli = cli_command(env.get("HFAO_PYTHON") or sys.executable, env.get("PATH"))
    # run-on: hf-jobs: the repo folder is made (and removed) in the job; nothing is written on the runner
    argv = cli + req.args + ["--json", *([] if req.remote or out_dir is None else [f"--output-dir={out_dir}"])]
    show = "+ " + shlex.join(["hf-ao-publish", *argv[len(cli):]])
    what = f"recheck {req.model}" if req.recheck else "; ".join(parse_quant(env.get("HFAO_QUANT")))
    try:
        with group(f"{TITLE} {what}"):
            cli_run = run_cli(argv, child_env(env, req.token), secrets, show=show)
    except StepFailed as exc:
        return fail_early(env, model, str(exc), secrets, exc.code)

    payload = result.parse(cli_run.stdout)
    message = failure_message(cli_run)
    if message:
        message = redact(message, secrets)
        error(message)
    if out_dir is None:  # a recheck
        return _rechecked(env, payload, message, cli_run.returncode, secrets)
    results = result.entries(payload)
    for r in results:
        if r.get("error") and r["error"] != message:  # a one-recipe run's result carries the run's own error line
            error(redact(f"{r.get('recipe')}: {r['error']}", secrets))
    summary = build_summary(req.model, payload, message, cli_run.returncode, read_cards(results), secrets)
    append_summary(env.get("GITHUB_STEP_SUMMARY"), summary)

    if cli_run.returncode == 0 and req.push and not req.keep_output:
        shutil.rmtree(out_dir, ignore_errors=True)  # the CLI would delete its own temp folder after a push
    elif out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    for name, value in result.outputs_for(payload, message, cli_run.returncode, out_dir).items():
        write_output(env.get("GITHUB_OUTPUT"), name, redact(value, secrets))
    return cli_run.returncode if cli_run.returncode >= 0 else 1  # killed by a signal: a plain failure


def _rechecked(env: Mapping[str, str], payload: object, message: str | None, code: int, secrets: Sequence[str]) -> int:
    """A recheck's summary (one row per repo: what changed, the pull request) and outputs."""
    repos = result.rechecks(payload)
    for r in repos:
        if r.get("error"):
            error(redact(f"{r.get('repo')}: {r['error']}", secrets))
    append_summary(env.get("GITHUB_STEP_SUMMARY"), redact(build_recheck_summary(repos, message, code), secrets))
    for name, value in result.recheck_outputs(payload, repos, message, code).items():
        write_output(env.get("GITHUB_OUTPUT"), name, redact(value, secrets))
    return code if code >= 0 else 1
