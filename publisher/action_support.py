"""The GitHub Action's logic (action.yml): input checks, install, the CLI run, outputs and the job summary.

action.yml keeps its bash to one line per step; everything else lives here so it can be tested. Each
step passes the action's inputs through `env:` (never `${{ inputs.* }}` inside a script), and this
module turns them into an argv list that is run without a shell.

Subcommands (all read their inputs from HFAO_* environment variables):

    check        validate the inputs before the (long) install; exit 2 with an ::error:: on a bad one
    free-disk    opt-in removal of large preinstalled toolchains on GitHub-hosted Linux runners
    install      a venv in $RUNNER_TEMP with torch==2.13.0 from the chosen index, then the action's own copy
                 of the package; writes the `python` step output. HF_AO_PUBLISH_SKIP_INSTALL=1 skips it and
                 uses the current interpreter (checked for matching versions)
    run          run `hf-ao-publish publish ... --json` once; write outputs, the summary and annotations
    torch-index  print the pip --index-url for a torch build (cpu, cu128, ...; empty for pypi)

This file is stdlib-only and keeps Python 3.8 syntax: `install` runs it as a script
(`python3 -I .../action_support.py install`) with whatever interpreter the runner has, before the
package is installed.
"""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

TORCH_VERSION = "2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/"
SUMMARY_LIMIT = 1024 * 1024  # GitHub's cap for one step's summary
SUMMARY_BUDGET = SUMMARY_LIMIT - 48 * 1024  # what this module writes at most, with a margin
MAX_FILE_ROWS = 200
TITLE = "hf-ao-publish"

# Options the action sets itself or that would leak or break the JSON result: never from extra-args.
_FORBIDDEN_EXTRA = ("--token", "--json", "--output-dir", "--help", "-h", "--version")
# Large preinstalled toolchains on GitHub-hosted Ubuntu images that a model publish does not need.
# /opt/hostedtoolcache/Python is kept on purpose: actions/setup-python lives there.
FREE_DISK_PATHS = (
    "/usr/share/dotnet",
    "/usr/local/lib/android",
    "/opt/ghc",
    "/usr/local/.ghcup",
    "/opt/hostedtoolcache/CodeQL",
    "/usr/local/share/boost",
    "/usr/share/swift",
    "/usr/local/share/powershell",
    "/usr/local/share/chromium",
    "/usr/local/julia",
)


class InputError(Exception):
    """An action input is malformed (exit code 2) or a step cannot go on (code 1): one ::error:: annotation."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------- workflow I/O

def escape_data(text: str) -> str:
    """Escape a workflow command's message (the part after the last '::')."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(name: str, message: str = "", **props: str) -> None:
    """Print a workflow command (::error::, ::group::, ...) on stdout."""
    attrs = ",".join(f"{k}={escape_property(v)}" for k, v in props.items())
    sys.stdout.write(f"::{name}{' ' + attrs if attrs else ''}::{escape_data(message)}\n")
    sys.stdout.flush()


def mask(secret: Optional[str]) -> None:
    """::add-mask:: every line of a secret (a multi-line value must be masked line by line)."""
    for line in (secret or "").splitlines():
        if line.strip():
            command("add-mask", line.strip())


def redact(text: str, secrets: List[str]) -> str:
    for secret in secrets:
        for line in secret.splitlines():
            if line.strip():
                text = text.replace(line.strip(), "***")
    return text


def write_output(path: Optional[str], name: str, value: str) -> None:
    """Append one output to $GITHUB_OUTPUT with the heredoc syntax and a random delimiter."""
    if not path:
        return
    delimiter = f"ghadelimiter_{uuid.uuid4().hex}"
    while delimiter in value:  # pragma: no cover - a random 128-bit delimiter does not occur by chance
        delimiter = f"ghadelimiter_{uuid.uuid4().hex}"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"{name}<<{delimiter}\n{value}\n{delimiter}\n")


def parse_bool(name: str, value: Optional[str], default: bool) -> bool:
    """Action inputs are strings: 'true'/'false' (any case); empty means the default."""
    text = (value or "").strip().lower()
    if not text:
        return default
    if text == "true":
        return True
    if text == "false":
        return False
    raise InputError(f"input {name} must be 'true' or 'false', got {value!r}")


def _split_list(value: Optional[str]) -> List[str]:
    """'a,b', 'a b' or one per line -> ['a', 'b']."""
    return [part for part in re.split(r"[\s,]+", value or "") if part]


# ---------------------------------------------------------------------------------------- the request

@dataclass
class Request:
    model: str
    args: List[str]  # CLI arguments after the executable, without --json / --output-dir
    push: bool
    keep_output: bool
    token: Optional[str] = field(default=None, repr=False)

    @property
    def secrets(self) -> List[str]:
        return [self.token] if self.token else []


def parse_extra_args(value: Optional[str]) -> List[str]:
    """Split extra-args like a POSIX shell would (quotes only: nothing is expanded or executed)."""
    try:
        args = shlex.split(value or "", comments=False, posix=True)
    except ValueError as exc:
        raise InputError(f"input extra-args cannot be parsed ({exc}); quote it like a shell command line") from None
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in _FORBIDDEN_EXTRA:
            if name == "--token":
                raise InputError("input extra-args must not contain --token; pass the token with the hf-token input "
                                 "(from a secret)")
            raise InputError(f"input extra-args must not contain {name}: the action sets it itself")
    return args


def build_request(env: Dict[str, str]) -> Request:
    """The CLI arguments for the action's inputs (HFAO_* variables). Raises InputError."""
    model = env.get("HFAO_MODEL", "").strip()
    if not model:
        raise InputError("input model is required (a Hub repo id such as black-forest-labs/FLUX.1-dev)")
    if model.startswith("-"):
        raise InputError(f"input model must be a repo id or a folder, not an option: {model!r}")
    recipes = _split_list(env.get("HFAO_QUANT"))
    if not recipes:
        raise InputError("input quant is required (one or several recipes, e.g. 'int8wo' or 'int8wo,float8wo')")
    args = ["publish", model]
    args += [f"--quant={r}" for r in recipes]
    components = _split_list(env.get("HFAO_COMPONENTS"))
    if components:
        args.append(f"--components={','.join(components)}")
    args += [f"--exclude={m}" for m in _split_list(env.get("HFAO_EXCLUDE"))]
    for option, var in (("--repo-id", "HFAO_REPO_ID"), ("--revision", "HFAO_REVISION")):
        value = env.get(var, "").strip()
        if value:
            args.append(f"{option}={value}")
    if parse_bool("private", env.get("HFAO_PRIVATE"), False):
        args.append("--private")
    if parse_bool("create-pr", env.get("HFAO_CREATE_PR"), False):
        args.append("--create-pr")
    push = parse_bool("push", env.get("HFAO_PUSH"), True)
    if not push:
        args.append("--no-push")
    keep_output = parse_bool("keep-output", env.get("HFAO_KEEP_OUTPUT"), False)
    extra = parse_extra_args(env.get("HFAO_EXTRA_ARGS"))
    if "--no-push" in extra:
        push = False
    args += extra
    token = env.get("HFAO_TOKEN", "").strip() or env.get("HF_TOKEN", "").strip() or None
    if push and not token:
        raise InputError("input hf-token is required to push (pass a write token from a secret), or set push: 'false'")
    return Request(model=model, args=args, push=push, keep_output=keep_output, token=token)


# ---------------------------------------------------------------------------------------- install

def torch_index(build: Optional[str]) -> str:
    """pip --index-url for a torch build: cpu, cuXYZ (e.g. cu128), rocmX.Y; 'pypi' -> '' (PyPI's default)."""
    name = (build or "cpu").strip().lower()
    if name == "pypi":
        return ""
    if name == "cpu" or re.fullmatch(r"cu\d{3}", name) or re.fullmatch(r"rocm\d+(\.\d+)+", name):
        return TORCH_INDEX + name
    raise InputError(f"input torch-build must be cpu, cuXYZ (e.g. cu126, cu128), rocmX.Y or pypi, got {build!r}")


def _action_path(env: Dict[str, str]) -> Path:
    return Path(env.get("GITHUB_ACTION_PATH") or Path(__file__).resolve().parent.parent)


def _package_version(action_path: Path) -> str:
    text = (action_path / "publisher" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)', text, re.M)
    if not match:  # pragma: no cover
        raise InputError(f"cannot read the package version from {action_path}")
    return match.group(1)


def installed_versions(python: str) -> Optional[Dict[str, str]]:
    """torch and hf-ao-publish versions in an interpreter, or None when either is missing."""
    code = ("import importlib.metadata as m, json\n"
            "print(json.dumps({'torch': m.version('torch'), 'hf-ao-publish': m.version('hf-ao-publish')}))")
    try:
        proc = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    except OSError:
        return None
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _matches(versions: Optional[Dict[str, str]], package_version: str) -> bool:
    return bool(versions) and versions["torch"].split("+")[0] == TORCH_VERSION and versions["hf-ao-publish"] == package_version


def install(env: Dict[str, str]) -> int:
    action_path = _action_path(env)
    version = _package_version(action_path)
    output = env.get("GITHUB_OUTPUT")
    if env.get("HF_AO_PUBLISH_SKIP_INSTALL", "").strip().lower() in ("1", "true", "yes"):
        python = env.get("HF_AO_PUBLISH_PYTHON") or sys.executable
        found = installed_versions(python)
        if not _matches(found, version):
            raise InputError(f"HF_AO_PUBLISH_SKIP_INSTALL is set but {python} does not have torch {TORCH_VERSION} and "
                             f"hf-ao-publish {version} (found {found}); unset it to let the action install them")
        print(f"HF_AO_PUBLISH_SKIP_INSTALL: using {python} (torch {found['torch']}, hf-ao-publish {version})")  # type: ignore[index]
        write_output(output, "python", python)
        return 0
    index = torch_index(env.get("HFAO_TORCH_BUILD"))
    if sys.version_info < (3, 11):
        raise InputError(f"hf-ao-publish needs Python >= 3.11, this is {sys.version.split()[0]}; "
                         "set the python-version input (e.g. '3.11')")
    venv = Path(env.get("RUNNER_TEMP") or tempfile.gettempdir()) / "hf-ao-publish-venv"
    python = str(venv / "bin" / "python")
    if (venv / "bin" / "python").exists() and _matches(installed_versions(python), version):
        print(f"reusing {venv} (torch {TORCH_VERSION}, hf-ao-publish {version})")
        write_output(output, "python", python)
        return 0
    build = (env.get("HFAO_TORCH_BUILD") or "cpu").strip().lower()
    command("group", f"Install torch {TORCH_VERSION} ({build}) and hf-ao-publish {version}")
    try:
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
        torch_cmd = pip + [f"torch=={TORCH_VERSION}"] + (["--index-url", index] if index else [])
        for cmd in ([sys.executable, "-m", "venv", str(venv)], torch_cmd, pip + [str(action_path)]):
            print("+ " + shlex.join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                raise InputError(f"installation failed: {shlex.join(cmd)} (see the log above)", code=1)
    finally:
        command("endgroup")
    write_output(output, "python", python)
    return 0


# ---------------------------------------------------------------------------------------- free disk

def free_disk(env: Dict[str, str], paths: Any = FREE_DISK_PATHS) -> int:
    if not parse_bool("free-disk-space", env.get("HFAO_FREE_DISK_SPACE"), False):
        return 0
    if env.get("RUNNER_ENVIRONMENT") != "github-hosted" or env.get("RUNNER_OS") != "Linux":
        command("warning", "free-disk-space only acts on GitHub-hosted Linux runners; nothing was removed here",
                title=TITLE)
        return 0
    command("group", "Free disk space")
    try:
        before = shutil.disk_usage("/").free
        for path in paths:
            if not os.path.lexists(path):
                continue
            print(f"removing {path}", flush=True)
            if os.geteuid() != 0 and shutil.which("sudo"):
                subprocess.run(["sudo", "-n", "rm", "-rf", "--", path], check=False)
            else:
                shutil.rmtree(path, ignore_errors=True)
        after = shutil.disk_usage("/").free
        print(f"free on /: {before / 1e9:.1f} GB -> {after / 1e9:.1f} GB", flush=True)
    finally:
        command("endgroup")
    return 0


# ---------------------------------------------------------------------------------------- run

def _cli_command(python: str) -> List[str]:
    script = Path(python).parent / "hf-ao-publish"
    if script.exists():
        return [str(script)]
    found = shutil.which("hf-ao-publish")
    if found:
        return [found]
    return [python, "-c", "import sys; sys.argv[0] = 'hf-ao-publish'; from publisher.cli import main; main()"]


def _child_env(env: Dict[str, str], req: Request) -> Dict[str, str]:
    child = {k: v for k, v in env.items() if not k.startswith("HFAO_")}
    if req.token:
        child["HF_TOKEN"] = req.token
    child.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    child.setdefault("PYTHONUNBUFFERED", "1")
    return child


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr_tail: List[str]

    @property
    def error_line(self) -> Optional[str]:
        """The CLI's one-line message (`Error: ...`), the last one on stderr."""
        for line in reversed(self.stderr_tail):
            if line.startswith("Error: "):
                return line[len("Error: "):].strip()
        return None


def run_cli(argv: List[str], env: Dict[str, str], secrets: List[str], show: str = "") -> CliRun:
    """Run the CLI without a shell; stream its stderr (redacted) with workflow commands switched off.

    Between ::stop-commands:: and the resume token nothing printed (the command line with the model id,
    the CLI's logs) can issue a workflow command such as ::add-path:: or ::set-env::."""
    stop = uuid.uuid4().hex
    command("stop-commands", stop)
    if show:
        sys.stdout.write(redact(show, secrets) + "\n")
        sys.stdout.flush()
    tail: deque = deque(maxlen=400)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                                encoding="utf-8", errors="replace")
    except OSError as exc:
        sys.stdout.write(f"::{stop}::\n")
        sys.stdout.flush()
        raise InputError(f"cannot start {argv[0]}: {exc}", code=1) from None

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = redact(line, secrets)
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    assert proc.stdout is not None
    out = proc.stdout.read()
    code = proc.wait()
    reader.join()
    sys.stdout.write(f"::{stop}::\n")
    sys.stdout.flush()
    return CliRun(code, out, list(tail))


def _results(payload: Any) -> List[Dict[str, Any]]:
    if isinstance(payload, dict) and isinstance(payload.get("results"), list):
        return [r for r in payload["results"] if isinstance(r, dict)]
    if isinstance(payload, dict) and "repo_id" in payload:
        return [payload]
    return []


def _lines(values: List[Any]) -> str:
    return "\n".join("" if v is None else str(v) for v in values)


def outputs_for(payload: Any, error: Optional[str], returncode: int, out_dir: Optional[Path]) -> Dict[str, str]:
    """The action's outputs. With several recipes each id/url/sha output is one line per recipe."""
    results = _results(payload)
    if isinstance(payload, dict) and "results" in payload:
        verified = bool(payload.get("verified"))
    else:
        verified = bool(results) and all(r.get("verified") for r in results)
    verified = verified and returncode == 0
    result_json = payload if payload is not None else {"error": error or f"hf-ao-publish exited with code {returncode}",
                                                       "exit_code": returncode}
    return {
        "repo-id": _lines([r.get("repo_id") for r in results]),
        "repo-url": _lines([r.get("url") for r in results]),
        "commit-sha": _lines([r.get("commit") for r in results]),
        "pr-url": _lines([r.get("pr_url") for r in results]),
        "verified": "true" if verified else "false",
        "up-to-date": "true" if results and all(r.get("up_to_date") for r in results) else "false",
        "output-dir": str(out_dir) if out_dir is not None and out_dir.is_dir() else "",
        "result-json": json.dumps(result_json, separators=(",", ":"), sort_keys=True),
    }


# ---------------------------------------------------------------------------------------- summary

def cell(value: Any) -> str:
    """Text safe inside a markdown table cell (no HTML, no pipes, one line)."""
    text = "" if value is None else str(value)
    return html.escape(" ".join(text.split())).replace("|", "&#124;")


def human_size(n: Any) -> str:
    try:
        size = float(n)
    except (TypeError, ValueError):
        return cell(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def _link(text: str, url: Optional[str]) -> str:
    safe = cell(text)
    if url and re.match(r"^https?://[^\s()<>]+$", url):
        return f"[{safe}]({url})"
    return safe


def _status(r: Dict[str, Any]) -> str:
    if r.get("error"):
        return "❌ failed"
    if r.get("up_to_date"):
        return "✅ up to date (nothing to publish)"
    if r.get("pr_url"):
        return "✅ pull request opened"
    if r.get("pushed"):
        return "✅ published"
    return "✅ verified (not pushed)"


def _result_section(r: Dict[str, Any]) -> List[str]:
    lines = [f"### {cell(r.get('recipe'))}: {_link(r.get('repo_id') or '', r.get('url'))} {_status(r)}", ""]
    facts = []
    if r.get("commit"):
        facts.append(f"commit `{cell(r['commit'])}`")
    if r.get("pr_url"):
        facts.append(f"pull request: {_link(r['pr_url'], r['pr_url'])}")
    facts.append("verified: **yes**" if r.get("verified") else "verified: **no**")
    lines += [" · ".join(facts), ""]
    if r.get("error"):
        lines += [f"> **Error:** {cell(r['error'])}", ""]
    files = [f for f in r.get("files") or [] if isinstance(f, dict)]
    if files:
        lines += ["#### Files", "", "| file | size |", "|---|---:|"]
        for f in files[:MAX_FILE_ROWS]:
            lines.append(f"| `{cell(f.get('name'))}` | {human_size(f.get('size'))} |")
        if len(files) > MAX_FILE_ROWS:
            lines.append(f"| … {len(files) - MAX_FILE_ROWS} more | |")
        total = sum(f.get("size") or 0 for f in files if isinstance(f.get("size"), (int, float)))
        lines += [f"| **total** | **{human_size(total)}** |", ""]
    components = [c for c in r.get("components") or [] if isinstance(c, dict)]
    if components:
        lines += ["#### Components", "", "| component | class | quantized layers | skipped | excluded | size before | size after |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for c in components:
            skipped = c.get("skipped_layers")
            lines.append(f"| {cell(c.get('name'))} | {cell(c.get('class'))} | {cell(c.get('quantized_layers'))} | "
                         f"{cell(len(skipped) if isinstance(skipped, list) else skipped)} | {cell(c.get('excluded_layers'))} | "
                         f"{human_size(c.get('bytes_before'))} | {human_size(c.get('bytes_after'))} |")
        lines.append("")
    report = r.get("verification") if isinstance(r.get("verification"), dict) else None
    if report:
        lines += ["#### Verification", "", "| component | load path | env | result | max abs diff | quantized layers | versions | detail |",
                  "|---|---|---|---|---:|---:|---|---|"]
        for v in report.get("results") or []:
            versions = v.get("versions") if isinstance(v.get("versions"), dict) else {}
            lines.append(
                f"| {cell(v.get('component') or 'model')} | {cell(v.get('path'))} | {cell(v.get('env'))} | "
                f"{'✅ bit-identical' if v.get('ok') else '❌ failed'} | {cell(v.get('max_abs_diff'))} | "
                f"{cell(v.get('quantized_layers'))} | {cell(', '.join(f'{k} {x}' for k, x in versions.items()))} | "
                f"{cell(v.get('detail'))} |")
        lines.append("")
        quality = report.get("quality") or []
        if quality:
            lines += ["| component | relative error vs bf16 | cosine vs bf16 |", "|---|---:|---:|"]
            for q in quality:
                lines.append(f"| {cell(q.get('component') or 'model')} | {_num(q.get('rel_error'))} | {_num(q.get('cosine'))} |")
            lines.append("")
    return lines


def _num(value: Any) -> str:
    return f"{value:.6f}" if isinstance(value, (int, float)) else cell(value)


def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def truncate_utf8(text: str, limit: int) -> str:
    """At most `limit` UTF-8 bytes, cut at a line end when there is one in the last quarter."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    cut = data[:max(limit, 0)].decode("utf-8", errors="ignore")
    newline = cut.rfind("\n")
    return cut[: newline + 1] if newline >= len(cut) * 3 // 4 else cut


def card_preview(card: str, budget: int, url: Optional[str]) -> List[str]:
    """The card in a <details> block as raw markdown, truncated to `budget` bytes."""
    head = "<details><summary>Model card preview (README.md)</summary>\n"
    fence = _fence(card)
    overhead = len((head + "\n" + fence + "markdown\n" + "\n" + fence + "\n\n</details>\n").encode("utf-8")) + 300
    body = card
    note = ""
    if len(card.encode("utf-8")) + overhead > budget:
        body = truncate_utf8(card, max(budget - overhead, 0))
        total = len(card.encode("utf-8"))
        note = (f"\n*Card truncated to {len(body.encode('utf-8'))} of {total} bytes (the job summary is limited to 1 MiB)"
                + (f"; the full card is at {_link(url, url)}*" if url else "*") + "\n")
        if not body:
            return ["<details><summary>Model card preview (README.md)</summary>", "", note.strip(), "", "</details>", ""]
    if not body.endswith("\n"):
        body += "\n"
    return [head, f"{fence}markdown", body + fence, note, "</details>", ""]


def build_summary(model: str, payload: Any, error: Optional[str], returncode: int,
                  cards: Dict[int, str], secrets: List[str], budget: int = SUMMARY_BUDGET) -> str:
    """The job summary: links, size and verification tables, the card preview(s); at most `budget` bytes."""
    results = _results(payload)
    ok = returncode == 0
    lines = [f"## {'✅' if ok else '❌'} {TITLE}: `{cell(model)}`", ""]
    if error:
        lines += [f"> **Error:** {cell(error)}", ""]
    if len(results) > 1:
        lines += ["| recipe | repo | status | commit |", "|---|---|---|---|"]
        for r in results:
            lines.append(f"| {cell(r.get('recipe'))} | {_link(r.get('repo_id') or '', r.get('url'))} | {_status(r)} | "
                         f"{cell((r.get('commit') or '')[:12])} |")
        lines.append("")
    for r in results:
        lines += _result_section(r)
    text = redact("\n".join(lines) + "\n", secrets)
    if len(text.encode("utf-8")) > budget:  # tables alone over budget: keep what fits
        return truncate_utf8(text, budget - 200) + "\n\n*Summary truncated (1 MiB limit).*\n"
    remaining = budget - len(text.encode("utf-8"))
    previews = [(i, cards[i]) for i in range(len(results)) if i in cards]
    for n, (i, card) in enumerate(previews):
        share = remaining // (len(previews) - n)
        title = f"#### Card: {cell(results[i].get('recipe'))}\n\n" if len(previews) > 1 else ""
        block = title + "\n".join(card_preview(redact(card, secrets), share - len(title.encode("utf-8")), results[i].get("url")))
        block = redact(block, secrets)
        text += block
        remaining -= len(block.encode("utf-8"))
    return text


def write_summary(env: Dict[str, str], text: str) -> None:
    path = env.get("GITHUB_STEP_SUMMARY")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(text)


# ---------------------------------------------------------------------------------------- the run step

def run(env: Dict[str, str]) -> int:
    outputs_file = env.get("GITHUB_OUTPUT")
    model = env.get("HFAO_MODEL", "")
    secrets = [s for s in (env.get("HFAO_TOKEN", "").strip(), env.get("HF_TOKEN", "").strip()) if s]
    for secret in secrets:
        mask(secret)
    try:
        req = build_request(env)
    except InputError as exc:
        return _fail_early(env, model, str(exc), secrets)
    temp_root = Path(env.get("RUNNER_TEMP") or tempfile.gettempdir())
    temp_root.mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix="hf-ao-publish-out-", dir=str(temp_root)))
    python = env.get("HFAO_PYTHON") or sys.executable
    argv = _cli_command(python) + req.args + ["--json", f"--output-dir={out_dir}"]
    command("group", f"{TITLE} {' '.join(_split_list(env.get('HFAO_QUANT')))}")
    try:
        show = "+ " + shlex.join(["hf-ao-publish", *argv[len(_cli_command(python)):]])
        result = run_cli(argv, _child_env(env, req), secrets, show=show)
    except InputError as exc:
        command("endgroup")
        return _fail_early(env, model, str(exc), secrets, exc.code)
    command("endgroup")

    payload: Any = None
    if result.stdout.strip():
        try:
            payload = json.loads(result.stdout)
        except ValueError:
            payload = None
    error = result.error_line
    if result.returncode != 0 and not error:
        error = f"hf-ao-publish exited with code {result.returncode}"
        if result.stderr_tail:
            error += f": {result.stderr_tail[-1][:500]}"
    if error:
        error = redact(error, secrets)
        command("error", error, title=TITLE)
    for r in _results(payload):
        if r.get("error"):
            command("error", redact(f"{r.get('recipe')}: {r['error']}", secrets), title=TITLE)

    cards: Dict[int, str] = {}
    for i, r in enumerate(_results(payload)):
        card_path = r.get("card_path")
        if card_path and Path(card_path).is_file():
            cards[i] = Path(card_path).read_text(encoding="utf-8", errors="replace")
    write_summary(env, build_summary(req.model, payload, error, result.returncode, cards, secrets))

    if result.returncode == 0 and req.push and not req.keep_output:
        shutil.rmtree(out_dir, ignore_errors=True)  # the CLI would delete its own temp folder after a push
    elif out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    for name, value in outputs_for(payload, error, result.returncode, out_dir).items():
        write_output(outputs_file, name, redact(value, secrets))
    return result.returncode if result.returncode >= 0 else 1  # killed by a signal: a plain failure


def _fail_early(env: Dict[str, str], model: str, message: str, secrets: List[str], code: int = 2) -> int:
    message = redact(message, secrets)
    command("error", message, title=TITLE)
    write_summary(env, build_summary(model, None, message, code, {}, secrets))
    for name, value in outputs_for(None, message, code, None).items():
        write_output(env.get("GITHUB_OUTPUT"), name, value)
    return code


def check(env: Dict[str, str]) -> int:
    """Validate the inputs before the install, so a typo fails in seconds."""
    try:
        build_request(env)
        torch_index(env.get("HFAO_TORCH_BUILD"))
        parse_bool("free-disk-space", env.get("HFAO_FREE_DISK_SPACE"), False)
    except InputError as exc:
        secrets = [s for s in (env.get("HFAO_TOKEN", "").strip(), env.get("HF_TOKEN", "").strip()) if s]
        command("error", redact(str(exc), secrets), title=TITLE)
        return 2
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    usage = "usage: action_support.py {check|free-disk|install|run|torch-index BUILD}"
    if not args:
        print(usage, file=sys.stderr)
        return 2
    try:
        if args[0] == "check":
            return check(env)
        if args[0] == "free-disk":
            return free_disk(env)
        if args[0] == "install":
            return install(env)
        if args[0] == "run":
            return run(env)
        if args[0] == "torch-index" and len(args) == 2:
            print(torch_index(args[1]))
            return 0
    except InputError as exc:
        command("error", str(exc), title=TITLE)
        return exc.code
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
