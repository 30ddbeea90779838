"""The command line's plumbing: the shared options (declared once, so the flag, its help and its env var agree in every
command) and the group that makes `publish` the default command. No command logic lives here."""

from __future__ import annotations

import re
from pathlib import Path

import click

from publisher import compat
from publisher.cli import jsonout

token_option = click.option(
    "--token", envvar="HF_TOKEN", default=None, show_envvar=True, metavar="TOKEN",
    help="Hub token (default: HF_TOKEN, then the stored login). Never printed.")
revision_option = click.option(
    "--revision", default=None, metavar="REV",
    help="Branch, tag or commit sha of the Hub repo given as argument (default: main).")
verify_env_option = click.option(
    "--verify-env", "verify_envs", multiple=True, metavar="PYTHON|SPEC",
    help="Also run the load checks, which must pass, in this environment: a Python interpreter, or a version spec "
         "(diffusers==0.39.0, torchao==0.17.*, transformers==4.57.6,diffusers==0.39.0) that is built as this "
         "environment with those packages replaced and cached. Repeatable.")


MATRIX_COST = compat.cost_text()
compat_option = click.option(
    "--compat", "compat", multiple=True, metavar="ENV", envvar=compat.VARIABLE, show_envvar=True,
    help="Environments measured for the Compatibility table (pass, fail or silently wrong; they never stop a "
         "publish): default (the recipe's matrix, docs/compatibility.md), none (skips it), latest (the newest releases on the package index alone), or a version spec (torch==2.15.0, "
         f"diffusers==0.39.0). Repeatable; default: default ({MATRIX_COST}).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
debug_option = click.option(
    "--debug", is_flag=True, help="Show tracebacks, and the library warnings hidden as harmless.")
quiet_option = click.option("--quiet", is_flag=True,
                            help="Only warnings and errors on stderr: no progress, no summary line (the result is on stdout).")


class DefaultToPublish(jsonout.JsonErrors, click.Group):
    """`hf-ao-publish MODEL ...` means `hf-ao-publish publish MODEL ...`; the group's own options
    (--help, --version) and its subcommands keep their meaning. With --json every error, a usage error included,
    also leaves its JSON object on stdout (publisher.cli.jsonout)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own = {opt for param in self.get_params(ctx) for opt in (*param.opts, *param.secondary_opts)}
        if args and args[0] not in self.commands and args[0] not in own:
            close = mistyped_command(args[0], list(self.commands))
            if close is not None:
                raise click.UsageError(f"No such command {args[0]!r}. Did you mean {close!r}?", ctx)
            args = ["publish", *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_usage(ctx, formatter)  # the commands' form, then publish's own, which needs no command name
        formatter.write(f"       {ctx.command_path} [publish] MODEL_ID --quant RECIPE [OPTIONS]\n")


def mistyped_command(word: str, commands: list[str]) -> str | None:
    """The command ``word`` looks like a typo of (`verfy`, `recipe`), unless it can be a MODEL_ID: an option, a path
    that exists, or a repo id with a namespace (`alice/verfy`) are published as before."""
    import difflib

    if word.startswith("-") or "/" in word or Path(word).expanduser().exists():
        return None
    close = difflib.get_close_matches(word.lower(), commands, n=1, cutoff=0.75)
    return close[0] if close else None


# Options a job's command does not repeat: the job gets its own --quant/--repo-id/--revision/--json, and the
# token only as a secret; local folders and interpreters do not exist there.
NOT_FOR_JOBS = {"model_id", "quant", "layer_config", "repo_id", "revision", "token", "as_json", "output_dir", "on_hf_jobs",
                "hf_jobs_timeout", "attach", "keep_going"}
LOCAL_ONLY = {"output_dir": "--output-dir", "no_push": "--no-push", "verify_envs": "--verify-env"}


def check_remote_options(ctx: click.Context, timeout: str) -> None:
    for name, flag in LOCAL_ONLY.items():
        if ctx.params.get(name):
            raise click.UsageError(f"{flag} needs this machine's disk or interpreters, which a job on Hugging Face Jobs "
                                   f"does not have; drop {flag} or --on-hf-jobs")
    if not re.fullmatch(r"\d+(\.\d+)?[smhd]?", timeout.strip()):
        raise click.BadParameter(f"{timeout!r} is not a duration such as 45m, 2h or 5400", ctx=ctx,
                                 param_hint="'--hf-jobs-timeout'")


def command_args(ctx: click.Context, skip: set[str], *, from_environment: bool = False) -> list[str]:
    """The parsed arguments and options, defaults, ``skip`` and (unless asked) values from variables left out."""
    parts: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        value = ctx.params.get(name)
        if name in skip or value == param.default:
            continue
        if value is False and isinstance(param, click.Option) and param.secondary_opts:  # --no-low-disk, given
            parts.append(param.secondary_opts[0])
            continue
        if value in (None, False, ()):
            continue
        if ctx.get_parameter_source(name) == click.core.ParameterSource.ENVIRONMENT and not from_environment:
            continue
        if isinstance(param, click.Argument):  # MODEL_ID...: every model typed
            parts += [str(item) for item in value] if isinstance(value, tuple) else [str(value)]
        elif isinstance(value, bool):
            parts.append(param.opts[0])
        elif isinstance(value, tuple):
            for item in value:
                parts += [param.opts[0], str(item)]
        else:
            parts += [param.opts[0], str(value)]
    return parts
