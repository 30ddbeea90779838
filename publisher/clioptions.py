"""The command line's plumbing: the shared options (declared once, so the flag, its help and its env var agree in every
command) and the group that makes `publish` the default command. No command logic lives here."""

from __future__ import annotations

from pathlib import Path

import click

from publisher import clijson, compat

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


class DefaultToPublish(clijson.JsonErrors, click.Group):
    """`hf-ao-publish MODEL ...` means `hf-ao-publish publish MODEL ...`; the group's own options
    (--help, --version) and its subcommands keep their meaning. With --json every error, a usage error included,
    also leaves its JSON object on stdout (publisher.clijson)."""

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
