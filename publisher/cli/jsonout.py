"""--json on stdout: exactly one JSON document per command, an error included.

A command's result is printed with ``emit``; a failed run's result carries its ``error`` and ``exit_code`` itself.
Any other error, a usage error that click raises while parsing included, leaves ``{"error": ..., "exit_code": ...}``
(``JsonErrors``, mixed into the CLI's group). Whether --json was asked is read from the words typed, since parsing
them may be what fails. The message also goes to stderr as usual.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import click


@dataclass
class _State:
    wanted: bool = False
    printed: bool = False


_state: ContextVar[_State | None] = ContextVar("json_state", default=None)  # set per command line (make_context)


def _current() -> _State:
    state = _state.get()
    if state is None:  # a command invoked without the group (a test calling one directly)
        state = _State()
        _state.set(state)
    return state


def emit(payload: Any) -> None:
    """Print the command's JSON document on stdout."""
    click.echo(json.dumps(payload, indent=2))
    _current().printed = True


def outcomes(results: list[Any], error: str | None = None, exit_code: int | None = None) -> None:
    """A publish's document: one recipe's result, or every recipe's; a failed run's also carries the error line and
    the exit code (the one recipe's own error, when it has one). Jobs of several models: a list, one entry per job
    naming its model and job, each with its own error (the exit code is the command's)."""
    from publisher.hfjobs import many

    if many.several_models(results):
        emit([many.entry(o) for o in results])
        return
    payload = results[0].to_json() if len(results) == 1 else {
        "results": [o.to_json() for o in results], "verified": all(o.verified for o in results),
    }
    if error is not None:
        payload["error"] = payload.get("error") or error
        payload["exit_code"] = exit_code
    emit(payload)


def error(message: str, exit_code: int) -> None:
    """The error object on stdout with --json, unless the command already printed its document."""
    state = _current()
    if state.wanted and not state.printed:
        emit({"error": message, "exit_code": exit_code})


class JsonErrors(click.Group):
    """A group whose commands' errors also reach stdout as JSON when --json was given."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        given = args[:args.index("--")] if "--" in args else args
        _state.set(_State(wanted="--json" in given))
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            error(exc.format_message(), exc.exit_code)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.Exit:  # --help, --version
            raise
        except click.Abort:  # click's own "Aborted!" (an interrupted prompt)
            error("aborted", 1)
            raise
        except click.ClickException as exc:
            error(exc.format_message(), exc.exit_code)
            raise
        except Exception as exc:  # re-raised: with --debug (a known error) or a bug, the traceback follows
            from publisher.messages import describe

            message, code = describe(exc) or (f"internal error: {type(exc).__name__}: {exc}", 1)
            error(message, code)
            raise
