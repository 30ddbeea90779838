"""The free-disk step: opt-in removal of large preinstalled toolchains on GitHub-hosted Linux runners.

A FLUX-sized model needs its download, the quantized copy and the verification reloads on one disk; the
standard runner has about 14 GB free, and these folders add about 20 GB. Nothing is removed anywhere else:
on a self-hosted machine these paths may be somebody's real toolchains.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from action.inputs import parse_bool
from action.workflow import group, warning

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


def _remove(path: str) -> None:
    # The hosted runner's user is not root but has password-less sudo; these folders belong to root.
    if os.geteuid() != 0 and shutil.which("sudo"):
        subprocess.run(["sudo", "-n", "rm", "-rf", "--", path], check=False)
    else:
        shutil.rmtree(path, ignore_errors=True)


def free_disk(env: Mapping[str, str], paths: Sequence[str] = FREE_DISK_PATHS) -> int:
    """Remove `paths` when the free-disk-space input is 'true' on a GitHub-hosted Linux runner; exit code."""
    if not parse_bool("free-disk-space", env.get("HFAO_FREE_DISK_SPACE"), False):
        return 0
    if env.get("RUNNER_ENVIRONMENT") != "github-hosted" or env.get("RUNNER_OS") != "Linux":
        warning("free-disk-space only acts on GitHub-hosted Linux runners; nothing was removed here")
        return 0
    with group("Free disk space"):
        before = shutil.disk_usage("/").free
        for path in paths:
            if os.path.lexists(path):
                print(f"removing {path}", flush=True)
                _remove(path)
        after = shutil.disk_usage("/").free
        print(f"free on /: {before / 1e9:.1f} GB -> {after / 1e9:.1f} GB", flush=True)
    return 0
