"""Command line: parse, delegate, map errors. No job logic lives here.

`hf-ao-publish MODEL_ID --quant RECIPE` is the publish command; `recipes`, `verify` and `recheck` are
subcommands. Heavy libraries are imported inside the stages so `--help` is instant.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from publisher import __version__, compat
from publisher import recipes as recipe_registry
from publisher.cli import jsonout, options
from publisher.cli.recipe_table import recipes_text
from publisher.compat import matrix_plan
from publisher.quality import options as quality_options

if TYPE_CHECKING:  # types only: the job and its stages are imported when a command runs
    from publisher.handoffs.report import Mode
    from publisher.request import Engine

# A run's own lines on stderr (not with --quiet); named, not __name__, which is __main__ under `python -m publisher.cli`
_say = logging.getLogger("publisher.cli").info


def _start(debug: bool, quiet: bool) -> None:
    """Before a command imports any library: logging (with the library noise filter), progress bars (read when the
    libraries are imported) and hf_xet's memory bound (read when hf_xet starts its first session). Xet itself is
    huggingface_hub's default, on every Hub that offers it; only the user's own HF_HUB_DISABLE_XET=1 turns it off."""
    from publisher.io import xetupload
    from publisher.runtime import known, logs, progress

    logs.setup(debug=debug, quiet=quiet)
    progress.setup(quiet=quiet)  # bars only on a terminal: a CI log gets our one line per stage instead
    xetupload.bound_memory()
    for line in known.broken():  # pyproject.toml states ranges: a combination inside them known not to work
        logging.getLogger("publisher.cli").warning("%s", line)


class _Failure(click.ClickException):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class; ours varies


def _run_mapped(debug: bool, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run library code; known errors become one-line messages (tracebacks only with --debug)."""
    from publisher.messages import describe
    from publisher.runtime.signals import handled

    try:
        with handled():  # SIGINT / SIGTERM unwind the run (its cleanup runs), then exit 130 / 143 with one line
            return fn(*args, **kwargs)
    except (click.ClickException, click.exceptions.Exit):
        raise
    except KeyboardInterrupt as exc:
        message, code = describe(exc) or ("interrupted", 130)
        raise _Failure(message, code) from None
    except Exception as exc:  # mapped below; unknown errors re-raise with their traceback
        if debug:
            raise
        known = describe(exc)
        if known is None:
            raise
        message, code = known
        if code == 2:
            raise click.UsageError(message) from None
        raise _Failure(message, code) from None


@click.group("hf-ao-publish", cls=options.DefaultToPublish, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hf-ao-publish")
def main() -> None:
    """Quantize a Hugging Face model with torchao, verify it reloads, write a card and publish it.

    `publish` is the default command: a first argument that is no command is a MODEL_ID, so the two lines below
    do the same.

    \b
    Example:
      hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo
      hf-ao-publish publish black-forest-labs/FLUX.1-dev --quant int8wo
    """


@main.command("recipes")
@options.json_option
def recipes_cmd(as_json: bool) -> None:
    """List the quantization recipes and the hardware each needs.

    Example: hf-ao-publish recipes
    """
    _start(debug=False, quiet=False)  # torchao and torch warn while the registry's facts import them
    from publisher.hfjobs import hardware

    flavors, source = hardware.available()
    if as_json:
        jsonout.emit([r.to_dict(flavors) for r in recipe_registry.all_recipes()])
    else:
        click.echo(recipes_text(flavors=flavors, source=source))


@main.command("publish")
@click.argument("model_id", nargs=-1, metavar="MODEL_ID...")  # required unless --attach; several: --on-hf-jobs
@click.option("--quant", "quant", multiple=True, metavar="RECIPE|CONFIG",
              help=f"A recipe ({', '.join(recipe_registry.names())}), a torchao config written as its Python call "
                   "(read, never run), a config_to_dict JSON file, or COMPONENT=CONFIG pairs (one repo, a config per "
                   "component); see the examples above. Split on top-level commas only; repeat or comma-separate for "
                   "several repos.  [required]")
@click.option("--components", default=None, metavar="A,B", help="Pipeline components to quantize (default: the denoiser).")
@click.option("--exclude", multiple=True, metavar="MODULE", help="Module to keep unquantized (repeatable).")
@click.option("--layer-config", "layer_config", multiple=True, metavar="[COMPONENT=]FILE",
              help="Per-layer configs: a JSON object (a file, or inline) mapping a Linear's fqn or re:PATTERN to a config "
                   "(recipe, call or config_to_dict) or null (left unquantized); --quant gives every other layer's. Stored "
                   "as torchao's FqnToConfig. COMPONENT= is needed when several components are quantized.")
@click.option("--repo-id", default=None, metavar="NAMESPACE/NAME",
              help="Target repo (default: <your user>/<base name>-torchao-<recipe>).")
@options.revision_option
@click.option("--private", is_flag=True, help="Create the target repo as private.")
@options.token_option
@click.option("--output-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where to write the repo folder (default: a temporary folder).")
@click.option("--no-push", is_flag=True, help="Stop after verify and card, leaving a complete repo folder.")
@click.option("--create-pr", is_flag=True, help="Open (or update) a pull request on the target instead of committing to main.")
@click.option("--trust-remote-code", is_flag=True, help="Allow bases that need remote code (review it first).")
@click.option("--keep-going", is_flag=True, help="With several recipes, publish those that succeed even if one fails.")
@click.option("--force", is_flag=True,
              help="Publish even when the target is up to date (same base sha, recipe, options, card options and "
                   "versions): quantize, verify, write the card and commit whatever differs from the target.")
@options.verify_env_option
@options.compat_option
@click.option("--sample-prompt", default=None,
              help="Prompt of the card's usage snippet, and the first of the quality grid (pipelines) or continuations (LMs).")
@click.option("--sample-steps", type=click.IntRange(1, 200), default=28, show_default=True,
              help="Denoising steps in the card's snippet, and the most the quality grid runs (within --eval-budget).")
@click.option("--sample-size", type=click.IntRange(16, 4096), default=1024, show_default=True,
              help="Image size in the card's snippet, and the largest the quality grid runs (within --eval-budget).")
@click.option("--eval-dataset", default=None, metavar="REPO[:CONFIG][:SPLIT]",
              help=f"Text dataset on the Hub for the perplexity of a language model (default: {quality_options.DEFAULT_DATASET}; "
                   "the default that cannot be read only costs the figure, a named one that cannot be read is an error).")
@click.option("--eval-tokens", type=click.IntRange(16, 1_000_000), default=quality_options.DEFAULT_TOKENS, show_default=True,
              metavar="N", help="Tokens of the evaluation text scored for perplexity (base and quantized).")
@click.option("--eval-budget", default=quality_options.DEFAULT_BUDGET, show_default=True, metavar="DURATION",
              envvar=quality_options.BUDGET_VARIABLE, show_envvar=True, help=quality_options.BUDGET_HELP)
@click.option("--eval-full-images", "full_images", is_flag=True, help=quality_options.FULL_IMAGES_HELP)
@click.option("--min-quality", "min_quality", multiple=True, metavar="METRIC=VALUE",
              help=f"Fail (exit 1, nothing pushed) when a quality figure is below VALUE (lpips: above): {', '.join(quality_options.METRICS)} "
                   "(e.g. ppl-recovery=95 for a language model, psnr=25 or lpips=0.1 for a pipeline). Repeatable.")
@click.option("--allow-unquantized", is_flag=True,
              help="Publish a component in which no layer could be quantized (default: an error naming its layer types).")
@click.option("--benchmark", is_flag=True, help="Measure latency (and GPU memory) against bf16 for the card; always on with a GPU.")
@click.option("--engine", type=click.Choice(["auto", "streaming", "library"]), default="auto", show_default=True,
              help="auto: the streaming engine (one tensor in memory) where it applies, else the library path.")
@click.option("--low-disk/--no-low-disk", "low_disk", default=None,
              help="Read the quantized components' base weights by HTTP range instead of downloading them "
                   "(default: only when the download would not fit on disk).")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Largest output safetensors shard, e.g. 2GB or 500MB (default: the library's; 2GB with --low-disk and "
                   "a push, where the disk holds about one shard).")
@click.option("--recheck-published", is_flag=True,
              help="After the push, also read the published commit back and reload it (its file hashes are always checked).")
@click.option("--verify-mode", type=click.Choice(["auto", "full", "streaming"]), default="auto", show_default=True,
              help="full: reload each component whole in fresh processes; streaming: tensor by tensor and block by "
                   "block (bounded memory); auto: full when it fits in memory.")
@click.option("--on-hf-jobs", "on_hf_jobs", default=None, metavar="FLAVOR",
              help="Run the publish on Hugging Face Jobs on this hardware (e.g. l4x1), one job per recipe, billed to "
                   "the token's account; the checks run here first. See `hf-ao-publish recipes` for flavors.")
@click.option("--hf-jobs-timeout", default="2h", show_default=True, metavar="DURATION",
              help="With --on-hf-jobs: stop a job after this long (e.g. 90m, 3h).")
@click.option("--attach", "attach", multiple=True, metavar="JOB_ID",
              help="Follow jobs started by --on-hf-jobs again (after a lost connection) instead of publishing. Repeatable.")
@options.json_option
@options.debug_option
@options.quiet_option
def publish_cmd(model_id: tuple[str, ...], quant: tuple[str, ...], components: str | None, exclude: tuple[str, ...],
                layer_config: tuple[str, ...], repo_id: str | None,
                revision: str | None, private: bool, token: str | None, output_dir: Path | None, no_push: bool,
                create_pr: bool, trust_remote_code: bool, keep_going: bool, force: bool, verify_envs: tuple[str, ...],
                compat: tuple[str, ...], sample_prompt: str | None, sample_steps: int, sample_size: int,
                eval_dataset: str | None, eval_tokens: int, eval_budget: str, full_images: bool, min_quality: tuple[str, ...],
                allow_unquantized: bool, benchmark: bool, engine: Engine, low_disk: bool | None,
                max_shard_size: str | None, recheck_published: bool, verify_mode: Mode, on_hf_jobs: str | None,
                hf_jobs_timeout: str, attach: tuple[str, ...], as_json: bool, debug: bool, quiet: bool) -> None:
    """Quantize MODEL_ID (Hub repo id or local folder), verify, card and push it; several with --on-hf-jobs.

    \b
    Example:
      hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo
      hf-ao-publish ./my-llama --quant int8wo,float8wo --no-push --output-dir out
      hf-ao-publish ./my-llama --quant 'Int8WeightOnlyConfig(granularity=PerGroup(128))'
      hf-ao-publish black-forest-labs/FLUX.1-dev --quant transformer=float8wo,text_encoder_2=int8wo
      hf-ao-publish black-forest-labs/FLUX.1-dev --quant int4wo --on-hf-jobs l4x1
      hf-ao-publish meta-llama/Llama-3.2-1B Qwen/Qwen3-0.6B --quant int8wo,float8wo --on-hf-jobs cpu-upgrade
    """
    ctx = click.get_current_context()
    if attach:
        if model_id or quant or on_hf_jobs:
            raise click.UsageError("--attach follows jobs that are already running; give it without MODEL_ID, --quant "
                                   "and --on-hf-jobs")
        _start(debug, quiet)
        from publisher.hfjobs import remote

        _report(_run_failed_json(as_json, debug, remote.attach, list(attach), token, keep_going), as_json, keep_going)
        return
    _require(ctx, "model_id", model_id)
    _require(ctx, "quant", quant)
    if len(model_id) > 1 and on_hf_jobs is None:
        raise click.UsageError("several MODEL_IDs are published on Hugging Face Jobs, one job per model and recipe; add "
                               "--on-hf-jobs FLAVOR, or publish one model per command")
    if on_hf_jobs is not None:
        options.check_remote_options(ctx, hf_jobs_timeout)
    elif ctx.get_parameter_source("hf_jobs_timeout") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--hf-jobs-timeout applies to --on-hf-jobs; add --on-hf-jobs FLAVOR or drop it")
    evaluation = _run_mapped(debug, quality_options.settings, eval_dataset, eval_tokens, eval_budget, min_quality,
                             sample_prompt, sample_size, sample_steps, full_images)
    from publisher.request import BaseSpec, CheckSpec, MakeSpec, PublishRequest, TargetSpec

    req = _run_mapped(debug, lambda: PublishRequest(  # every usage rule is the request's own (exit 2)
        base=BaseSpec(model_id[0], revision, [c.strip() for c in components.split(",") if c.strip()] if components else None,
                      list(exclude), trust_remote_code),
        make=MakeSpec(list(quant), list(layer_config), engine, max_shard_size, allow_unquantized),
        target=TargetSpec(repo_id, not no_push, private, create_pr, force, output_dir, low_disk, recheck_published),
        checks=CheckSpec(verify_envs, compat, verify_mode, benchmark, sample_prompt, sample_steps, sample_size, evaluation),
        token=token, keep_going=keep_going, command=_command_line(ctx)))
    _start(debug, quiet)
    from publisher.job import run

    if on_hf_jobs is not None:
        from publisher.hfjobs import remote

        job_options = tuple(options.command_args(ctx, options.NOT_FOR_JOBS, from_environment=True))  # a job has none of our variables
        jobs = remote.JobsRequest(req, on_hf_jobs, hf_jobs_timeout, job_options)
        if len(model_id) > 1:
            from publisher.hfjobs import many

            _report(_run_failed_json(as_json, debug, many.publish, jobs, list(model_id)), as_json, keep_going, force)
            return
        _report(_run_failed_json(as_json, debug, remote.publish, jobs), as_json, keep_going, force)
        return
    _report(_run_failed_json(as_json, debug, run, req), as_json, keep_going, force)


def _run_failed_json(as_json: bool, debug: bool, fn: Any, *args: Any) -> Any:
    """_run_mapped, and with --json the results of a run that stopped (what each recipe had come to)."""
    try:
        return _run_mapped(debug, fn, *args)
    except _Failure as failure:
        from publisher.errors import RunFailed

        stopped = failure.__context__  # the library error the failure was mapped from
        if as_json and isinstance(stopped, RunFailed) and stopped.results:
            jsonout.outcomes(stopped.results, failure.message, failure.exit_code)  # what each recipe had come to
        raise


def _require(ctx: click.Context, name: str, value: Any) -> None:
    """MODEL_ID and --quant are required unless --attach: click's own message when one is missing."""
    if not value:
        param = next(p for p in ctx.command.params if p.name == name)
        raise click.MissingParameter(ctx=ctx, param=param)


VERIFY_HELP = f"""Check a torchao-quantized checkpoint (Hub id or folder; a pipeline, a diffusers model or a transformers
model, safetensors or pickle .bin): its files against their declared quantization_config, its values against its
base re-quantized (--base, or the base_model it names), and every load path.

Then, unless --compat none, it measures the compatibility matrix, which costs more than the check itself:
the default matrix has up to {compat.most_environments()} environments, each this one with one torchao, diffusers or
transformers release replaced, built once from the package index (seconds to a minute each) and cached, then two
fresh-process reloads of every quantized component in each. That is minutes even for a tiny model (7 min for a 3 MB
FLUX on a busy 2-core machine, docs/compatibility.md) and several times the check's own reloads for a large one.
Its outcomes never fail the check; --verify-env environments must pass.

\b
Example:
  hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo --compat none   # the load paths only
  hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo
  hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo --verify-env diffusers==0.39.0 --compat none
  hf-ao-publish verify ./my-int8-llama --base meta-llama/Llama-3.1-8B --compat none
"""


@main.command("verify", help=VERIFY_HELP)
@click.argument("target")
@options.revision_option
@options.token_option
@options.verify_env_option
@options.compat_option
@click.option("--base", "base", default=None, metavar="BASE",
              help="The unquantized model (Hub id or folder) to re-quantize with the target's declared config and "
                   "compare tensor for tensor (default: the base_model of its card or hf_ao_publish.json, when reachable).")
@click.option("--no-requantize", is_flag=True,
              help="Do not re-quantize any base; only check the files against their declared config and the load "
                   "paths against each other.")
@options.json_option
@options.debug_option
@options.quiet_option
def verify_cmd(target: str, revision: str | None, token: str | None, verify_envs: tuple[str, ...], compat: tuple[str, ...],
               base: str | None, no_requantize: bool, as_json: bool, debug: bool, quiet: bool) -> None:
    """`hf-ao-publish verify TARGET`; the help text is VERIFY_HELP, which states what the matrix costs."""
    _start(debug, quiet)
    _say(matrix_plan(target, compat, verify_envs))
    import tempfile

    from publisher.verify.claims import text_table
    from publisher.verify.target import verify_target

    with tempfile.TemporaryDirectory(prefix="hf-ao-verify-") as work:
        report = _run_mapped(debug, verify_target, target, Path(work), envs=verify_envs, compat=compat, token=token,
                             revision=revision, requantize=not no_requantize, base=base)
    failure = None if report.passed else _Failure(f"verification of {target} failed: {report.summary()}", 1)
    if as_json:
        jsonout.emit({**report.to_dict(), **({"error": failure.message, "exit_code": 1} if failure else {})})
    else:
        click.echo(text_table(report))
    if failure:
        raise failure
    measured = f"; other environments: {report.compat_counts()}" if report.compat else ""
    values = ("; values only checked for self-consistency (no base compared)" if report.self_consistency_only
              else f"; values match the base {report.base}" if report.base else "")
    _say(f"{target}: all {len(report.results)} load checks passed{values}{measured}")


RECHECK_HELP = """Measure published repos again against today's compatibility matrix (by default the recipe's matrix
with the newest releases on the package index), without re-quantizing any base. For each repo where a row is new or
its outcome changed, open one pull request that updates its card's Software requirements and Compatibility sections
and its verification.json; where nothing changed, nothing is written. A repo that cannot be rechecked is reported
and the others go on (exit 1 at the end). Needs a token that can open pull requests on the repos.

\b
Examples:
  hf-ao-publish recheck alice/FLUX.1-dev-torchao-int8wo alice/Llama-3.2-1B-torchao-int8wo
  hf-ao-publish recheck alice/FLUX.1-dev-torchao-int8wo --compat latest --json
"""


@main.command("recheck", help=RECHECK_HELP)
@click.argument("repos", nargs=-1, required=True, metavar="REPO...")
@options.token_option
@options.compat_option
@options.json_option
@options.debug_option
@options.quiet_option
def recheck_cmd(repos: tuple[str, ...], token: str | None, compat: tuple[str, ...], as_json: bool, debug: bool,
                quiet: bool) -> None:
    _start(debug, quiet)
    import tempfile

    from publisher.stages.recheck import recheck

    results: list[dict[str, Any]] = []
    for repo in repos:
        _say(f"rechecking {repo}")
        with tempfile.TemporaryDirectory(prefix="hf-ao-recheck-") as work:
            try:
                result = _run_mapped(debug, recheck, repo, Path(work), compat=compat, token=token)
            except _Failure as exc:  # one repo that cannot be rechecked does not stop the others
                results.append({"repo": repo, "error": exc.message})
                click.echo(f"{repo}: FAILED: {exc.message}", err=True)
                continue
        results.append(result.to_dict())
        changed = f"{len(result.changes)} row(s) changed" if result.changes else "nothing changed"
        if not as_json:
            click.echo(f"{repo}\t{changed}\t{result.pull_request or '-'}")
        _say(f"{repo}: {changed} ({result.loads} loads measured)"
             + (f"; pull request: {result.pull_request}" if result.pull_request else "; nothing written"))
    failed = [r for r in results if r.get("error")]
    if as_json:
        jsonout.emit({"repos": results, **({"error": f"{len(failed)} of {len(repos)} repos could not be rechecked",
                                             "exit_code": 1} if failed else {})})
    if failed:
        raise _Failure(f"{len(failed)} of {len(repos)} repos could not be rechecked", 1)


def _command_line(ctx: click.Context) -> str:
    """The card's command that made the repo, from the parsed options: reproducible, never a secret; defaults and
    values read from a variable (HF_AO_PUBLISH_COMPAT), which were not typed, left out."""
    from publisher.stages.source import shown

    skip = {"token", "debug", "quiet", "as_json", "output_dir", "hf_jobs_timeout", "attach", "force"}
    args = options.command_args(ctx, skip)
    model_id: tuple[str, ...] = ctx.params.get("model_id") or ()
    if len(model_id) == 1 and args and args[0] == model_id[0]:
        args[0] = shown(model_id[0])  # a local folder by its name unless typed as a path below the working directory
    return shlex.join(["hf-ao-publish", *args])


def _report(outcomes: list[Any], as_json: bool, keep_going: bool, force: bool = False) -> None:
    from publisher.hfjobs import many

    failed, table = [o for o in outcomes if o.error], many.several_models(outcomes)  # several models: one table
    failure = _Failure(f"{len(failed)} of {len(outcomes)} {'jobs' if table else 'recipes'} failed", 1) if failed else None
    if as_json:
        jsonout.outcomes(outcomes, *((failure.message, failure.exit_code) if failure else ()))
    for o in outcomes:
        if o.error:
            click.echo(f"{o.recipe}: FAILED: {o.error}", err=True)
        elif o.up_to_date:
            why = ("--force: every file is the same as published" if force else
                   "same base sha, recipe, options, card options and versions; --force publishes it again")
            _say(f"{o.repo_id} is up to date: {o.url} (commit {o.commit}); nothing was published ({why})")
        elif o.pushed:
            _say(f"published {o.repo_id}: {o.pr_url or o.url} (commit {o.commit})")
        else:
            _say(f"{o.recipe}: verified repo folder at {o.folder} (card: {o.folder}/README.md); not pushed")
        if not as_json and not o.error and not table:
            click.echo(o.pr_url or o.url or str(o.folder))
    if table and not as_json:
        click.echo(many.table(outcomes))
    if failure is not None:
        raise failure

