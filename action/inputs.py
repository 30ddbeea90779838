"""The action's inputs, read from HFAO_* environment variables, turned into the CLI's argv list.

action.yml hands every input to the scripts through `env:` (never `${{ inputs.* }}` inside a script), and
the argv built here is run without a shell, so a value such as `$(touch x)` stays a plain string that the
CLI rejects. Inputs are always strings on the runner: booleans are 'true' / 'false'; quant holds one --quant value
per line, each passed whole (a config call has commas and spaces of its own); the other lists are separated by commas,
spaces or newlines.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from action.workflow import StepFailed

# Options the action sets itself, or that would leak the token or break the JSON result it parses.
FORBIDDEN_EXTRA = ("--token", "--json", "--output-dir", "--help", "-h", "--version", "--on-hf-jobs", "--attach")
RUN_ON = ("runner", "hf-jobs")  # input run-on: this runner, or Hugging Face Jobs (flavor: input hf-jobs-flavor)


class ActionInputError(StepFailed):
    """An action input is malformed: exit code 2, as the CLI uses for a usage error."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=2)


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    """'true' / 'false' in any case; empty means the default. Anything else is refused, not guessed."""
    text = (value or "").strip().lower()
    if not text:
        return default
    if text == "true":
        return True
    if text == "false":
        return False
    raise ActionInputError(f"input {name} must be 'true' or 'false', got {value!r}")


def split_list(value: str | None) -> list[str]:
    """'a,b', 'a b' or one per line -> ['a', 'b'] (YAML block scalars give one item per line)."""
    return [part for part in re.split(r"[\s,]+", value or "") if part]


def parse_quant(value: str | None) -> list[str]:
    """quant: one ``--quant`` value per line, each passed to the CLI whole: the CLI splits a value on its top-level
    commas itself (``int8wo,float8wo`` is two recipes; ``IntxWeightOnlyConfig(weight_dtype=torch.int4,
    granularity=PerGroup(32))`` one config; ``transformer=float8wo,text_encoder_2=int8wo`` one mapping). Spaces inside
    a line are the value's own; a line of bare names separated by spaces (``int8wo int8dq``) is refused with the fix,
    unless it names a file in the workspace (a config_to_dict JSON file)."""
    lines = [line.strip() for line in (value or "").splitlines() if line.strip(" \t,")]  # blank: nothing to pass
    for line in lines:
        words = line.split()
        if len(words) > 1 and all(re.fullmatch(r"[\w.-]+", word) for word in words) and not Path(line).is_file():
            raise ActionInputError(f"input quant: {line!r} is several names on one line; give one --quant value per line "
                                   f"(or join recipes with commas: {','.join(words)})")
    return lines


def parse_matrix(value: str | None) -> list[str]:
    """verify-matrix: environments separated by spaces or newlines; a comma joins packages into one environment
    (``transformers==4.57.6,diffusers==0.39.0``). Each is ``default``, ``none`` or a version spec; the CLI parses
    the specs, this only refuses what cannot be one."""
    items = [item.strip(",") for item in re.split(r"\s+", value or "") if item.strip(",")]
    for item in items:
        if item in ("default", "none", "latest"):
            continue
        if item.startswith("-") or "/" in item or "\\" in item or not re.search(r"(==|>=|<=|~=|!=|<|>)", item):
            raise ActionInputError(f"input verify-matrix: {item!r} is not an environment; give default, latest, none, or version specs "
                             "like diffusers==0.39.0")
    if "none" in items and len(items) > 1:
        raise ActionInputError("input verify-matrix: none cannot be combined with other environments")
    return items


def secret_values(env: Mapping[str, str]) -> list[str]:
    """The token values to mask and to keep out of everything the action writes."""
    return [s for s in (env.get("HFAO_TOKEN", "").strip(), env.get("HF_TOKEN", "").strip()) if s]


@dataclass
class Request:
    """What one run of the CLI needs: its arguments and what the action does around it."""

    model: str  # for a recheck: the repos, separated by ", "
    args: list[str]  # the CLI's arguments after the executable, without --json / --output-dir
    push: bool
    keep_output: bool
    token: str | None = field(default=None, repr=False)  # kept out of repr: it may end up in a log
    remote: bool = False  # run-on: hf-jobs: the job's folders stay in the job (no --output-dir here)
    recheck: bool = False  # `hf-ao-publish recheck REPO...` instead of a publish (no --output-dir, nothing pushed)


def parse_extra_args(value: str | None) -> list[str]:
    """Split extra-args like a POSIX shell would (quotes only: nothing is expanded or executed)."""
    try:
        args = shlex.split(value or "", comments=False, posix=True)
    except ValueError as exc:
        raise ActionInputError(f"input extra-args cannot be parsed ({exc}); quote it like a shell command line") from None
    for arg in args:
        name = arg.split("=", 1)[0]
        if name == "--token":
            raise ActionInputError("input extra-args must not contain --token; pass the token with the hf-token input "
                             "(from a secret)")
        if name in FORBIDDEN_EXTRA:
            raise ActionInputError(f"input extra-args must not contain {name}: the action sets it itself")
    return args


PUBLISH_ONLY = ("HFAO_MODEL", "HFAO_MODELS", "HFAO_QUANT", "HFAO_COMPONENTS", "HFAO_EXCLUDE", "HFAO_REPO_ID", "HFAO_REVISION", "HFAO_HF_JOBS_FLAVOR")


def recheck_request(env: Mapping[str, str], repos: list[str]) -> Request:
    """recheck: `hf-ao-publish recheck REPO... [--compat ...] [extra-args]`; the publish inputs must be empty."""
    given = [var.removeprefix("HFAO_").lower().replace("_", "-") for var in PUBLISH_ONLY if env.get(var, "").strip()]
    if given:
        raise ActionInputError(f"input recheck measures published repos again and publishes nothing; drop {', '.join(given)} "
                               "(or drop recheck to publish)")
    if (env.get("HFAO_RUN_ON") or "runner").strip().lower() != "runner":
        raise ActionInputError("input recheck runs on the runner; drop run-on")
    for repo in repos:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or repo.startswith("-"):
            raise ActionInputError(f"input recheck: {repo!r} is not a Hub repo id (org/name)")
    token = env.get("HFAO_TOKEN", "").strip() or env.get("HF_TOKEN", "").strip() or None
    if not token:
        raise ActionInputError("input hf-token is required with recheck (a token that can open pull requests on the repos)")
    args = ["recheck", *repos, *[f"--compat={item}" for item in parse_matrix(env.get("HFAO_VERIFY_MATRIX"))],
            *parse_extra_args(env.get("HFAO_EXTRA_ARGS"))]
    return Request(model=", ".join(repos), args=args, push=False, keep_output=False, token=token, recheck=True)


def build_request(env: Mapping[str, str]) -> Request:
    """The CLI arguments for the action's inputs. Raises ActionInputError on the first malformed one."""
    repos = split_list(env.get("HFAO_RECHECK"))
    if repos:
        return recheck_request(env, repos)
    models = model_inputs(env)
    model = ", ".join(models)
    quants = parse_quant(env.get("HFAO_QUANT"))
    if not quants:
        raise ActionInputError("input quant is required (one or several recipes, e.g. 'int8wo' or 'int8wo,float8wo')")
    # --name=value everywhere: a value that starts with '-' cannot be taken for an option.
    args = ["publish", *models]
    args += [f"--quant={quant}" for quant in quants]
    components = split_list(env.get("HFAO_COMPONENTS"))
    if components:
        args.append(f"--components={','.join(components)}")
    args += [f"--exclude={module}" for module in split_list(env.get("HFAO_EXCLUDE"))]
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
    args += [f"--compat={item}" for item in parse_matrix(env.get("HFAO_VERIFY_MATRIX"))]
    extra = parse_extra_args(env.get("HFAO_EXTRA_ARGS"))
    if "--no-push" in extra:
        push = False
    args += extra
    token = env.get("HFAO_TOKEN", "").strip() or env.get("HF_TOKEN", "").strip() or None
    remote = _run_on(env, push, keep_output, models)
    if len(models) > 1 and not remote:
        raise ActionInputError("input models publishes several models on Hugging Face Jobs, one job per model and recipe: "
                               "add run-on: hf-jobs and hf-jobs-flavor, or run one model per job with a matrix over model "
                               "(docs/action.md)")
    if remote:
        args.append(f"--on-hf-jobs={remote}")
    if (push or remote) and not token:
        raise ActionInputError("input hf-token is required to push (pass a write token from a secret), or set push: 'false'"
                         if not remote else "input hf-token is required with run-on: hf-jobs (the job is started "
                         "and billed with it, and receives it as a job secret)")
    return Request(model=model, args=args, push=push, keep_output=keep_output, token=token, remote=bool(remote))


def model_inputs(env: Mapping[str, str]) -> list[str]:
    """model (one repo id or folder), or models (repo ids separated by commas, spaces or newlines): not both."""
    model, models = env.get("HFAO_MODEL", "").strip(), split_list(env.get("HFAO_MODELS"))
    if model and models:
        raise ActionInputError("give input model or input models, not both")
    names = models or ([model] if model else [])
    if not names:
        raise ActionInputError("input model is required (a Hub repo id such as black-forest-labs/FLUX.1-dev)")
    for name in names:
        if name.startswith("-"):  # click would read it as an option
            raise ActionInputError(f"input model must be a repo id or a folder, not an option: {name!r}")
    return names


def _run_on(env: Mapping[str, str], push: bool, keep_output: bool, models: list[str]) -> str:
    """The Jobs flavor when run-on is hf-jobs (checked against what a job can do), else ''."""
    run_on = (env.get("HFAO_RUN_ON") or "runner").strip().lower()
    flavor = (env.get("HFAO_HF_JOBS_FLAVOR") or "").strip()
    if run_on not in RUN_ON:
        raise ActionInputError(f"input run-on must be one of {', '.join(RUN_ON)}, got {run_on!r}")
    if run_on == "runner":
        if flavor:
            raise ActionInputError("input hf-jobs-flavor is only used with run-on: hf-jobs; set run-on or drop the flavor")
        return ""
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{1,40}", flavor):
        raise ActionInputError(f"input hf-jobs-flavor must name a Jobs flavor such as l4x1 or a10g-small, got {flavor!r} "
                         "(`hf-ao-publish recipes` lists them per recipe)")
    if not push:
        raise ActionInputError("run-on: hf-jobs publishes from the job; push: 'false' would leave the repo folder in the job, "
                         "where nobody can read it")
    if keep_output:
        raise ActionInputError("run-on: hf-jobs leaves no repo folder on the runner; drop keep-output")
    for model in models:
        if model.startswith((".", "/", "~")) or Path(model).exists():  # the step runs in the workspace
            raise ActionInputError(f"run-on: hf-jobs needs a Hub repo id as model (a job cannot read {model!r} from the "
                                   "workspace); upload the folder to the Hub first")
    return flavor
