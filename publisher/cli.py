"""Command line: parse, delegate, map errors. No job logic lives here.

`hf-ao-publish MODEL_ID --quant RECIPE` is the publish command; `recipes` and `verify` are
subcommands. Heavy libraries are imported inside the stages so `--help` is instant.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click

from publisher import __version__
from publisher import recipes as recipe_registry

_SUBCOMMANDS = ("publish", "recipes", "verify")


def _prefer_lfs_for_local_hub() -> None:
    """A loopback HF_ENDPOINT (our test Hub) has no Xet storage; the switch must be set before
    huggingface_hub is imported. huggingface.co keeps the client's default."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "")).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("HF_HUB_DISABLE_XET", "1")


class _DefaultToPublish(click.Group):
    """`hf-ao-publish MODEL ...` means `hf-ao-publish publish MODEL ...`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version", "--list-recipes"):
            args = ["publish", *args]
        return super().parse_args(ctx, args)


def _setup_logging(debug: bool, quiet: bool) -> None:
    level = logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO
    handler = logging.StreamHandler(sys.stderr)  # logs and progress go to stderr; data to stdout
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("publisher")
    root.handlers[:] = [handler]
    root.setLevel(level)


class _Failure(click.ClickException):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _run_mapped(debug: bool, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run library code; known errors become one-line messages (tracebacks only with --debug)."""
    from publisher.messages import describe

    try:
        return fn(*args, **kwargs)
    except (click.ClickException, click.exceptions.Exit, KeyboardInterrupt):
        raise
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


def _print_recipes(as_json: bool) -> None:
    rows = recipe_registry.all_recipes()
    if as_json:
        click.echo(json.dumps([
            {"name": r.name, "summary": r.summary, "config": r.python, "quantize_needs": r.quantize.describe(),
             "run_needs": r.run.describe(), "speedup": r.speedup, "tensor_class": r.tensor_class} for r in rows
        ], indent=2))
        return
    width = max(len(r.name) for r in rows)
    click.echo(f"{'recipe':<{width}}  {'quantize on':<42}  {'run on':<42}  what")
    for r in rows:
        click.echo(f"{r.name:<{width}}  {r.quantize.describe():<42}  {r.run.describe():<42}  {r.summary}")


@click.group(cls=_DefaultToPublish, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hf-ao-publish")
@click.option("--list-recipes", is_flag=True, help="Print the recipe table and exit.")
@click.pass_context
def main(ctx: click.Context, list_recipes: bool) -> None:
    """Quantize a Hugging Face model with torchao, verify it reloads, write a card and publish it.

    \b
    Example:
      hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo
    """
    if list_recipes:
        _print_recipes(False)
        ctx.exit(0)
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@main.command("recipes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def recipes_cmd(as_json: bool) -> None:
    """List the quantization recipes and the hardware each needs.

    Example: hf-ao-publish recipes
    """
    _print_recipes(as_json)


@main.command("publish")
@click.argument("model_id")
@click.option("--quant", "quant", multiple=True, required=True, metavar="RECIPE",
              help=f"Recipe ({', '.join(recipe_registry.names())}); repeat or comma-separate for several.")
@click.option("--components", default=None, metavar="A,B", help="Pipeline components to quantize (default: the denoiser).")
@click.option("--exclude", multiple=True, metavar="MODULE", help="Module to keep unquantized (repeatable).")
@click.option("--repo-id", default=None, metavar="NAMESPACE/NAME",
              help="Target repo (default: <your user>/<base name>-torchao-<recipe>).")
@click.option("--revision", default=None, help="Base branch, tag or commit sha (resolved to a sha).")
@click.option("--private", is_flag=True, help="Create the target repo as private.")
@click.option("--token", envvar="HF_TOKEN", default=None, show_envvar=True,
              help="Hub token (default: HF_TOKEN or the stored login). Never printed.")
@click.option("--output-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where to write the repo folder (default: a temporary folder).")
@click.option("--no-push", is_flag=True, help="Stop after verify and card, leaving a complete repo folder.")
@click.option("--create-pr", is_flag=True, help="Open (or update) a pull request on the target instead of committing to main.")
@click.option("--trust-remote-code", is_flag=True, help="Allow bases that need remote code (review it first).")
@click.option("--keep-going", is_flag=True, help="With several recipes, publish those that succeed even if one fails.")
@click.option("--verify-env", "verify_envs", multiple=True, metavar="PYTHON",
              help="Also verify with this Python interpreter (another venv). Repeatable.")
@click.option("--sample-prompt", default=None, help="Prompt used in the card's usage snippet.")
@click.option("--sample-steps", type=click.IntRange(1, 200), default=28, show_default=True, help="Denoising steps in the card's snippet.")
@click.option("--sample-size", type=click.IntRange(16, 4096), default=1024, show_default=True, help="Image size in the card's snippet.")
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the result on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def publish_cmd(model_id: str, quant: tuple[str, ...], components: str | None, exclude: tuple[str, ...], repo_id: str | None,
                revision: str | None, private: bool, token: str | None, output_dir: Path | None, no_push: bool,
                create_pr: bool, trust_remote_code: bool, keep_going: bool, verify_envs: tuple[str, ...],
                sample_prompt: str | None, sample_steps: int, sample_size: int, benchmark: bool, engine: str, low_disk: bool | None,
                max_shard_size: str | None, recheck_published: bool, verify_mode: str, as_json: bool, debug: bool,
                quiet: bool) -> None:
    """Quantize MODEL_ID (Hub repo id or local folder), verify, card and push it.

    \b
    Example:
      hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo
      hf-ao-publish ./my-llama --quant int8wo,float8wo --no-push --output-dir out
    """
    if verify_envs and verify_mode == "streaming":
        raise click.UsageError("--verify-env reloads whole components in another interpreter; use --verify-mode full or auto with it")
    if low_disk and (sample_prompt or benchmark):
        raise click.UsageError("--sample-prompt and --benchmark run the whole bf16 base, which --low-disk does not download; drop one of them")
    if low_disk and verify_envs and not no_push:
        raise click.UsageError("with --low-disk a push uploads and deletes each shard as it is made, so --verify-env has "
                               "nothing to reload; drop --verify-env, or add --no-push")
    if low_disk and engine == "library":
        raise click.UsageError("--low-disk reads weights by HTTP range, which only the streaming engine does; drop --engine library")
    if max_shard_size is not None:
        _check_size(max_shard_size)
    _setup_logging(debug, quiet)
    _prefer_lfs_for_local_hub()
    from publisher.job import PublishRequest, run

    req = PublishRequest(
        model=model_id,
        quant=list(quant),
        components=[c.strip() for c in components.split(",") if c.strip()] if components else None,
        exclude=list(exclude),
        repo_id=repo_id,
        revision=revision,
        private=private,
        token=token,
        output_dir=output_dir,
        push=not no_push,
        create_pr=create_pr,
        trust_remote_code=trust_remote_code,
        keep_going=keep_going,
        verify_envs=verify_envs,
        sample_prompt=sample_prompt,
        sample_steps=sample_steps,
        sample_size=sample_size,
        engine=engine,
        low_disk=low_disk,
        verify_mode="full" if verify_envs and verify_mode == "auto" else verify_mode,
        benchmark=benchmark,
        max_shard_size=max_shard_size,
        recheck_published=recheck_published,
        command=_command_line(click.get_current_context()),
    )
    try:
        outcomes = _run_mapped(debug, run, req)
    except _Failure as failure:
        from publisher.errors import RunFailed

        stopped = failure.__context__  # the library error the failure was mapped from
        if as_json and isinstance(stopped, RunFailed) and stopped.results:
            _print_json(stopped.results)  # what each recipe had come to, for machines
        raise
    _report(outcomes, as_json, keep_going)


@main.command("verify")
@click.argument("target")
@click.option("--revision", default=None, help="Revision of a Hub TARGET (default: main).")
@click.option("--token", envvar="HF_TOKEN", default=None, show_envvar=True, help="Hub token for private or gated repos.")
@click.option("--verify-env", "verify_envs", multiple=True, metavar="PYTHON", help="Also run the load paths with this interpreter.")
@click.option("--no-requantize", is_flag=True, help="Do not re-quantize the recorded base; only compare load paths with each other.")
@click.option("--json", "as_json", is_flag=True, help="Print the verification report as JSON on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.option("--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def verify_cmd(target: str, revision: str | None, token: str | None, verify_envs: tuple[str, ...], no_requantize: bool,
               as_json: bool, debug: bool, quiet: bool) -> None:
    """Check that a torchao-quantized repo (Hub id or folder) reloads along every load path.

    \b
    Example:
      hf-ao-publish verify alice/FLUX.1-dev-torchao-int8wo
    """
    _setup_logging(debug, quiet)
    _prefer_lfs_for_local_hub()
    import tempfile

    from publisher.verify.target import verify_target

    with tempfile.TemporaryDirectory(prefix="hf-ao-verify-") as work:
        report = _run_mapped(debug, verify_target, target, Path(work), envs=verify_envs, token=token,
                             revision=revision, requantize=not no_requantize)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(f"{'component':<16} {'path':<8} {'environment':<40} {'result':<6} {'layers':>6}  detail")
        for r in report.results:
            env = f"{r.env} (torch {r.versions.get('torch', '?')}, torchao {r.versions.get('torchao', '?')})"
            click.echo(f"{(r.component or 'model'):<16} {r.path:<8} {env[:40]:<40} {'pass' if r.ok else 'FAIL':<6} "
                       f"{r.quantized_layers:>6}  {r.detail}")
    if not report.passed:
        raise _Failure(f"verification of {target} failed: {report.summary()}", 1)
    click.echo(f"{target}: all {len(report.results)} load checks passed", err=True)


def _check_size(value: str) -> None:
    from publisher.stages.push_pr import size_bytes

    try:
        size_bytes(value)
    except ValueError:
        raise click.UsageError(f"--max-shard-size {value!r} is not a size; give one such as 2GB, 500MB or 1000000000") from None


def _command_line(ctx: click.Context) -> str:
    """The command that made the repo, rebuilt from the parsed options (defaults left out) for the
    card: reproducible, and the token (or any secret) is never part of it."""
    parts = ["hf-ao-publish"]
    skip = {"token", "debug", "quiet", "as_json", "output_dir"}
    for param in ctx.command.params:
        name = param.name or ""
        value = ctx.params.get(name)
        if name in skip or value in (None, False, ()) or value == param.default:
            continue
        if isinstance(param, click.Argument):
            parts.append(str(value))
        elif isinstance(value, bool):
            parts.append(param.opts[0])
        elif isinstance(value, tuple):
            for item in value:
                parts += [param.opts[0], str(item)]
        else:
            parts += [param.opts[0], str(value)]
    return shlex.join(parts)


def _print_json(outcomes: list[Any]) -> None:
    payload = outcomes[0].to_json() if len(outcomes) == 1 else {
        "results": [o.to_json() for o in outcomes], "verified": all(o.verified for o in outcomes),
    }
    click.echo(json.dumps(payload, indent=2))


def _report(outcomes: list[Any], as_json: bool, keep_going: bool) -> None:
    failed = [o for o in outcomes if o.error]
    if as_json:
        _print_json(outcomes)
    for o in outcomes:
        if o.error:
            click.echo(f"{o.recipe}: FAILED: {o.error}", err=True)
        elif o.up_to_date:
            click.echo(f"{o.repo_id} is up to date: {o.url} (commit {o.commit})", err=True)
        elif o.pushed:
            where = o.pr_url or o.url
            click.echo(f"published {o.repo_id}: {where} (commit {o.commit})", err=True)
        else:
            click.echo(f"{o.recipe}: verified repo folder at {o.folder} (card: {o.folder}/README.md); not pushed", err=True)
        if not as_json and not o.error:
            click.echo(o.pr_url or o.url or str(o.folder))
    if failed:
        raise _Failure(f"{len(failed)} of {len(outcomes)} recipes failed" + ("" if keep_going else ""), 1)


if __name__ == "__main__":
    main()
