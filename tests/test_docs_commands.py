"""Every command README.md and docs/*.md show running the tool, executed as written (issue 37).

The commands are read from the docs' shell blocks (```bash): each line that runs the tool (`hf-ao-publish ...`,
`hf ao-publish ...`, `hf extensions ...`, `make ...`), with the `export` lines before it applied. They run with the
product's defaults, as a user's first run does: the quality evaluation and the compatibility matrix on. Substituted,
and nothing else: the model ids (FLUX.1-dev -> the loopback Hub's tiny FLUX, Llama-3.2-1B -> its tiny Llama, the
repo ids a doc derives from them and from the example user), the token (`hf_...` -> a loopback token of its own user,
so no other test's repos meet these) and `JOB_ID` (the id the command before printed); the endpoint is the loopback
Hub's already (HF_ENDPOINT, conftest). `./my-pipeline` is the tiny FLUX as a folder, `layers.json` the JSON block
usage.md shows under that name. A command that cannot run here says why in the doc, on its line or the line below it:
`# not run by the tests: REASON`; the test reads it. Identical commands in several docs run once.

Publishes run through the real CLI in this process (the `cli` fixture; one that follows Hugging Face Jobs as a child
process, interrupted once its jobs are submitted: "up to the submission"); pushes in both transfer modes (`transfer`;
the verify and recheck commands that read the first push back run on the default path, Xet, only).
The Action's workflows (docs/action.md) run through the runner harness in tests/test_action_docs.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import TRANSFER

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOKEN = "tok_docs"  # a user of its own on the loopback Hub (conftest TOKENS): "docs"
USER = "docs"
SUBSTITUTE = {
    "black-forest-labs/FLUX.1-dev": "bfl/tiny-flux",
    "black-forest-labs/FLUX.1-schnell": "bfl/tiny-flux",
    "meta-llama/Llama-3.2-1B": "meta/tiny-llama",
    "alice/FLUX.1-dev-torchao-int8wo": f"{USER}/tiny-flux-torchao-int8wo",  # the repo the first example published
    "hf_...": TOKEN,
}
SKIP_MARK = re.compile(r"#\s*not run by the tests:\s*(\S.*)$")
RUNS_THE_TOOL = re.compile(r"^(hf-ao-publish|hf ao-publish|hf extensions|make)\b")


@dataclass
class DocCommand:
    text: str  # as written (without its trailing comment)
    where: list[str] = field(default_factory=list)  # doc:line of every place that shows it
    env: dict[str, str] = field(default_factory=dict)  # the export lines above it
    skip: str = ""  # the doc's reason it cannot run here

    @property
    def argv(self) -> list[str]:
        text = self.text
        for old, new in SUBSTITUTE.items():
            text = text.replace(old, new)
        return shlex.split(text)


def doc_commands() -> list[DocCommand]:
    found: dict[str, DocCommand] = {}
    for doc in DOCS:
        source = doc.read_text()
        for block in re.finditer(r"^ *```(bash|sh|shell|console)\n(.*?)^ *```", source, re.S | re.M):
            first = source[:block.start(2)].count("\n") + 1
            env: dict[str, str] = {}
            last: DocCommand | None = None
            for i, raw in enumerate(block.group(2).splitlines()):
                line = raw.strip()
                mark = SKIP_MARK.search(line)
                code = shlex.split(line, comments=True)
                if not code:
                    if mark and last is not None:  # a mark on a line of its own is about the command above it
                        last.skip = mark.group(1)
                    continue
                if code[0] == "export":
                    name, _, value = code[1].partition("=")
                    env[name] = SUBSTITUTE.get(value, value)
                    continue
                if not RUNS_THE_TOOL.match(line):
                    continue  # pip install ...: what sets the tool up, not the tool
                text = shlex.join(code)
                command = found.setdefault(text, DocCommand(text, env=dict(env)))
                command.where.append(f"{doc.relative_to(ROOT)}:{first + i}")
                command.skip = command.skip or (mark.group(1) if mark else "")
                last = command
    return list(found.values())


COMMANDS = doc_commands()


def _by(text: str) -> DocCommand:
    return next(c for c in COMMANDS if c.text == text)


def _layers_json() -> str:
    """The JSON block usage.md shows as `layers.json`."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    return re.search(r"`layers\.json`:\n\n```json\n(.*?)```", usage, re.S).group(1)  # type: ignore[union-attr]


def test_the_docs_commands_are_all_here() -> None:
    """What the doc tier runs is what the docs show: every tool command is one of the cases below or marked."""
    texts = {c.text for c in COMMANDS}
    assert texts == set(CASES) | {c.text for c in COMMANDS if c.skip}, sorted(texts ^ set(CASES))
    skipped = {c.text: c.skip for c in COMMANDS if c.skip}
    assert skipped == {"make test": "it is the test suite itself",
                       "hf extensions install hf-ao-publish/hf-ao-publish":
                           "it installs from GitHub; they install the extension from this checkout instead"}
    assert all(c.where for c in COMMANDS) and len(COMMANDS) >= 15


@pytest.fixture
def workspace(tmp_path: Path, tiny_flux_dir: Path, monkeypatch: pytest.MonkeyPatch, hub: Any) -> Path:
    """The folder a user runs the docs' commands in: ./my-pipeline and layers.json as the docs describe them."""
    shutil.copytree(tiny_flux_dir, tmp_path / "my-pipeline")
    (tmp_path / "layers.json").write_text(_layers_json())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(cli: Any, command: DocCommand) -> Any:
    argv = command.argv
    assert argv[0] == "hf-ao-publish", argv
    token = command.env.get("HF_TOKEN", TOKEN)
    result = cli(*argv[1:], token=token)
    assert result.exit_code == 0, f"{command.where}: {command.text}\n{result.output}"
    assert "Traceback" not in result.stderr and "\r" not in result.stderr and "it/s]" not in result.stderr  # no bars
    return result


def _card(repo_id: str) -> str:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, "README.md", token=TOKEN)).read_text()


def _defaults_ran(card: str, *, pipeline: bool) -> None:
    """The card shows both defaults at work: the quality evaluation's figures (or its plain reason) and the measured
    compatibility matrix."""
    quality = card.split("## Quality", 1)[1].split("\n## ", 1)[0]
    if pipeline:
        assert "### Seeded comparison grid" in quality and ("PSNR dB" in quality or "No comparison grid:" in quality)
    else:
        assert "### Perplexity on real text" in quality and "### Greedy continuation" in quality
    assert "turned off for this repo (`--eval-budget 0`)" not in card
    compat = card.split("## Compatibility", 1)[1].split("\n## ", 1)[0]
    assert "--compat none" not in compat and re.search(r"\| this one with `(torchao|diffusers|transformers)==", compat), compat
    # the newest releases on the index (issue 39): a row of each that differs from this environment, or one line why not
    newest = re.findall(r"\| this one with `(\w+)==[^`]+` \(newest\) \|", compat)
    assert newest or "Compatibility: the newest release" in card, compat


def _publish_flux_int8wo(cli: Any) -> None:
    _run(cli, _by("hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo"))
    _defaults_ran(_card(f"{USER}/tiny-flux-torchao-int8wo"), pipeline=True)


def _publish_llama_two(cli: Any) -> None:
    from huggingface_hub import HfApi

    _run(cli, _by("hf-ao-publish meta-llama/Llama-3.2-1B --quant int8wo,float8wo --private"))
    for recipe in ("int8wo", "float8wo"):
        repo = f"{USER}/tiny-llama-torchao-{recipe}"
        assert HfApi(token=TOKEN).model_info(repo).private
        _defaults_ran(_card(repo), pipeline=False)
    # quality.md's gate, on the same target (after it: one push at a time): a card option changed, so published again
    before = HfApi(token=TOKEN).list_repo_commits(f"{USER}/tiny-llama-torchao-int8wo")[0].commit_id
    result = _run(cli, _by("hf-ao-publish meta-llama/Llama-3.2-1B --quant int8wo --min-quality ppl-recovery=95"))
    assert f"published {USER}/tiny-llama-torchao-int8wo" in result.stderr
    card = _card(f"{USER}/tiny-llama-torchao-int8wo")
    assert HfApi(token=TOKEN).list_repo_commits(f"{USER}/tiny-llama-torchao-int8wo")[0].commit_id != before
    recovery = float(re.search(r"\*\*([\d.]+)% recovery\*\*", card).group(1))  # type: ignore[union-attr]
    assert recovery >= 95 and "--min-quality ppl-recovery=95" in card


def _my_pipeline(cli: Any) -> None:
    _run(cli, _by("hf-ao-publish ./my-pipeline --quant int8dq --components transformer,text_encoder_2 --no-push "
                  "--output-dir out"))
    card = Path("out/README.md").read_text()
    _defaults_ran(card, pipeline=True)
    assert str(Path.cwd()) not in card  # the local base by its name (issue 37)
    result = _run(cli, _by("hf-ao-publish verify ./out --base ./my-pipeline --compat none"))
    assert "all" in result.stderr and "load checks passed; values match the base" in result.stderr


def _verify_published(cli: Any) -> None:
    _publish_flux_int8wo(cli)
    if TRANSFER == "lfs":  # the push is what the LFS pass runs again (pushes in both transfer modes, issue 37); what
        return  # follows reads a published repo, on the default path here and on both in the transfer tests' downloads
    result = _run(cli, _by("hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo"))
    assert "load checks passed" in result.stderr and "other environments:" in result.stderr  # the default matrix
    # compatibility.md's check of one more environment, which must pass
    result = _run(cli, _by("hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo --verify-env diffusers==0.39.0 "
                           "--compat none"))
    assert "all 4 load checks passed" in result.stderr and "diffusers==0.39.0" in result.stdout  # 2 paths x 2 envs
    # measured again with the matrix of today, which is the one it was published with: nothing to propose
    for command in ("hf-ao-publish recheck alice/FLUX.1-dev-torchao-int8wo",
                    "hf-ao-publish recheck alice/FLUX.1-dev-torchao-int8wo --compat latest"):
        result = _run(cli, _by(command))
        assert f"{USER}/tiny-flux-torchao-int8wo: nothing changed (" in result.stderr and "nothing written" in result.stderr


def _config_call(cli: Any) -> None:
    _run(cli, _by("hf-ao-publish meta-llama/Llama-3.2-1B --quant 'Int8WeightOnlyConfig(granularity=PerGroup(128))'"))
    from huggingface_hub import HfApi

    names = [m.id for m in HfApi(token=TOKEN).list_models(author=USER)]
    repo = next(n for n in names if n.startswith(f"{USER}/tiny-llama-torchao-int8-weight-only-"))
    _defaults_ran(_card(repo), pipeline=False)


def _per_component(cli: Any) -> None:
    _run(cli, _by("hf-ao-publish black-forest-labs/FLUX.1-dev --quant transformer=float8wo,text_encoder_2=int8wo"))
    from huggingface_hub import HfApi

    names = [m.id for m in HfApi(token=TOKEN).list_models(author=USER)]
    repo = next(n for n in names if "transformer-float8wo-text_encoder_2-int8wo" in n)
    _defaults_ran(_card(repo), pipeline=True)


def _per_layer(cli: Any) -> None:
    _run(cli, _by("hf-ao-publish black-forest-labs/FLUX.1-dev --quant intx4wo --layer-config layers.json"))
    from huggingface_hub import HfApi

    names = [m.id for m in HfApi(token=TOKEN).list_models(author=USER)]
    repo = next(n for n in names if "intx4wo-per-layer" in n)
    card = _card(repo)
    _defaults_ran(card, pipeline=True)
    assert "--layer-config maps it to null" in card  # layers.json keeps proj_out: whose choice the card says


def _recipes(cli: Any) -> None:
    result = _run(cli, _by("hf-ao-publish recipes"))
    assert "int8wo" in result.stdout and "int4wo" in result.stdout


def _jobs(hub: Any, command: str, workspace: Path, *, via_hf: bool = False) -> str:
    """A jobs command up to the submission: run as a user runs it (a process of its own, through `hf` for the
    extension's form), until it has started every job and streams their logs; then Ctrl-C, which cancels them."""
    doc = _by(command)
    env = {**os.environ, "HF_TOKEN": TOKEN, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if via_hf:  # what `hf extensions install` leaves (tests/test_hf_extension.py): our console script as the extension
        env["HOME"] = str(workspace)
        env["HF_HUB_DISABLE_UPDATE_CHECK"] = "1"
        folder = workspace / ".local" / "share" / "hf" / "extensions" / "hf-ao-publish"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "manifest.json").write_text(json.dumps({
            "owner": "hf-ao-publish", "repo": "hf-ao-publish", "repo_id": "hf-ao-publish/hf-ao-publish",
            "short_name": "ao-publish", "executable_path": str(Path(sys.executable).parent / "hf-ao-publish"),
            "type": "python", "installed_at": "2026-12-04T00:00:00+00:00", "description": "hf-ao-publish",
            "commit_sha": None}))
    hub.jobs.scheduling_s = 600  # the jobs wait to be scheduled: their submission is what is run here
    before = set(hub.jobs.jobs)
    proc = subprocess.Popen(doc.argv, env=env, cwd=workspace, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        models = doc.argv[2 if via_hf else 1:doc.argv.index("--quant")]  # one job per model and recipe
        jobs = len(models) * len(doc.argv[doc.argv.index("--quant") + 1].split(","))
        deadline = time.monotonic() + 300
        while len(set(hub.jobs.jobs) - before) < jobs and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        started = sorted(set(hub.jobs.jobs) - before)
        assert len(started) == jobs, proc.communicate(timeout=60)
        time.sleep(1.0)  # following
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        hub.jobs.scheduling_s = 0.0
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # our CLI stops with 130; through `hf`, which gets the Ctrl-C too, the command may end first in hf's own
    # handler ("Aborted!", 1): the jobs are cancelled either way
    assert proc.returncode == 130 or (via_hf and proc.returncode == 1 and err.rstrip().endswith("Aborted!")), err
    assert "Error: interrupted (Ctrl-C): cancelled the running jobs on the Hub" in err
    for job_id in started:
        job = hub.jobs.get(job_id)
        assert job.spec["flavor"] == doc.argv[doc.argv.index("--on-hf-jobs") + 1] and job.cancel_requested
        args = job.spec["arguments"]
        assert "--eval-budget" not in " ".join(args) and "--compat" not in " ".join(args)  # the defaults reach the job
        assert f"cancelled job {job_id}" in err or f"Ctrl-C: cancelled job {job_id}" in err, err
    return started[0]


def _attach(cli: Any, hub: Any, workspace: Path) -> None:
    job_id = _jobs(hub, "hf-ao-publish black-forest-labs/FLUX.1-dev --quant int4wo --on-hf-jobs l4x1", workspace)
    doc = _by("hf-ao-publish --attach JOB_ID")
    argv = [job_id if a == "JOB_ID" else a for a in doc.argv]
    result = cli(*argv[1:], token=TOKEN)
    assert result.exit_code == 1 and f"job {job_id}" in result.stderr and "cancel" in result.stderr.lower()


def _make_demo() -> None:
    proc = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "demo"], capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


CASES: dict[str, Any] = {
    "hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo": "verify-published",
    "hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo": "verify-published",
    "hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo --verify-env diffusers==0.39.0 --compat none":
        "verify-published",
    "hf-ao-publish recheck alice/FLUX.1-dev-torchao-int8wo": "verify-published",
    "hf-ao-publish recheck alice/FLUX.1-dev-torchao-int8wo --compat latest": "verify-published",
    "hf-ao-publish meta-llama/Llama-3.2-1B --quant int8wo --min-quality ppl-recovery=95": "llama-two",
    "hf-ao-publish meta-llama/Llama-3.2-1B --quant int8wo,float8wo --private": "llama-two",
    "hf-ao-publish ./my-pipeline --quant int8dq --components transformer,text_encoder_2 --no-push --output-dir out": "my-pipeline",
    "hf-ao-publish verify ./out --base ./my-pipeline --compat none": "my-pipeline",
    "hf-ao-publish meta-llama/Llama-3.2-1B --quant 'Int8WeightOnlyConfig(granularity=PerGroup(128))'": "config-call",
    "hf-ao-publish black-forest-labs/FLUX.1-dev --quant transformer=float8wo,text_encoder_2=int8wo": "per-component",
    "hf-ao-publish black-forest-labs/FLUX.1-dev --quant intx4wo --layer-config layers.json": "per-layer",
    "hf-ao-publish recipes": "recipes",
    "hf-ao-publish black-forest-labs/FLUX.1-dev --quant int4wo --on-hf-jobs l4x1": "jobs-attach",
    "hf-ao-publish --attach JOB_ID": "jobs-attach",
    "hf-ao-publish black-forest-labs/FLUX.1-dev --quant int4wo,float8dq --on-hf-jobs l40sx1": "jobs-two",
    "hf ao-publish black-forest-labs/FLUX.1-dev --quant int4wo --on-hf-jobs l4x1": "jobs-hf",
    "hf-ao-publish black-forest-labs/FLUX.1-dev meta-llama/Llama-3.2-1B --quant int8wo,float8wo --on-hf-jobs cpu-upgrade":
        "jobs-many",
    "make demo": "demo",
}


@pytest.mark.slow
@pytest.mark.transfer
@pytest.mark.parametrize("case", ["verify-published", "llama-two", "config-call", "per-component", "per-layer"])
def test_a_docs_push(case: str, cli: Any, hub: Any, flux_repo: str, llama_repo: str, wikitext_repo: str,
                     workspace: Path) -> None:
    {"verify-published": _verify_published, "llama-two": _publish_llama_two, "config-call": _config_call,
     "per-component": _per_component, "per-layer": _per_layer}[case](cli)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["my-pipeline", "recipes", "jobs-attach", "jobs-two", "jobs-hf", "jobs-many", "demo"])
def test_a_docs_command(case: str, cli: Any, hub: Any, flux_repo: str, workspace: Path,
                        request: pytest.FixtureRequest) -> None:
    if case == "my-pipeline":
        _my_pipeline(cli)
    elif case == "recipes":
        _recipes(cli)
    elif case == "jobs-attach":
        _attach(cli, hub, workspace)
    elif case == "jobs-two":
        _jobs(hub, "hf-ao-publish black-forest-labs/FLUX.1-dev --quant int4wo,float8dq --on-hf-jobs l40sx1", workspace)
    elif case == "jobs-hf":
        _jobs(hub, "hf ao-publish black-forest-labs/FLUX.1-dev --quant int4wo --on-hf-jobs l4x1", workspace, via_hf=True)
    elif case == "jobs-many":
        request.getfixturevalue("llama_repo")  # the second model
        _jobs(hub, "hf-ao-publish black-forest-labs/FLUX.1-dev meta-llama/Llama-3.2-1B --quant int8wo,float8wo "
                   "--on-hf-jobs cpu-upgrade", workspace)
    else:
        _make_demo()
