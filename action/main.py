"""Entry point of the action's steps: `python3 -I "$GITHUB_ACTION_PATH/action/main.py" STEP`.

    check        validate the inputs before the (long) install; exit 2 with an ::error:: on a bad one
    free-disk    opt-in removal of large preinstalled toolchains on GitHub-hosted Linux runners
    install      a venv in $RUNNER_TEMP with the pinned torch, then the action's copy of the tool; writes the
                 `python` step output. HF_AO_PUBLISH_SKIP_INSTALL=1 reuses an interpreter that has both
    run          run `hf-ao-publish publish ... --json` once; write outputs, the summary and annotations
    torch-index  print the pip --index-url for a torch build (cpu, cu128, ...; empty for pypi)

Every step reads the action's inputs from HFAO_* environment variables. The glue is stdlib-only and keeps
Python 3.8 syntax, because check, free-disk and install run under whatever python3 the runner has, before
anything is installed (and install must be able to say that the interpreter is too old).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script with -I: sys.path has neither this folder nor the working directory (the caller's
    # repo, which must not shadow anything), so put the action's checkout first to import `action.*`.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from action.disk import free_disk
from action.inputs import build_request, parse_bool, secret_values
from action.install import install, torch_index
from action.run import run
from action.workflow import StepFailed, error, redact

USAGE = "usage: main.py {check|free-disk|install|run|torch-index BUILD}"


def check(env: Mapping[str, str]) -> int:
    """Validate every input before the install, so a typo fails in seconds instead of after minutes."""
    try:
        build_request(env)
        torch_index(env.get("HFAO_TORCH_BUILD"))
        parse_bool("free-disk-space", env.get("HFAO_FREE_DISK_SPACE"), False)
    except StepFailed as exc:
        error(redact(str(exc), secret_values(env)))
        return exc.code
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch one step; a StepFailed becomes one ::error:: annotation and the step's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    steps = {"check": check, "free-disk": free_disk, "install": install, "run": run}
    try:
        if len(args) == 1 and args[0] in steps:
            return steps[args[0]](env)
        if len(args) == 2 and args[0] == "torch-index":
            print(torch_index(args[1]))
            return 0
    except StepFailed as exc:
        error(redact(str(exc), secret_values(env)))
        return exc.code
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
