"""The compatibility matrix: the verified folder (or any torchao repo) loaded in other environments.

Two kinds of environment, built from the same values (an interpreter's path, or a version spec such as
``diffusers==0.39.0`` that publisher/verify/envs.py builds):
- ``--verify-env``: gating, like this environment: a publish fails unless every load there passes;
- ``--compat`` (default: the recipe's matrix in publisher/compat.py): measured for the card's
  "Compatibility" table; a failure there is a fact to publish, not a reason to stop.

Each load ends in one of three outcomes (report.Outcome): pass, fail, or silently wrong. Environments are
built before anything is downloaded, so a spec that cannot be built stops the run while it is cheap.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from publisher import compat
from publisher.errors import EnvBuildError, UsageError
from publisher.handoffs.report import PATHS, EnvRecord, PathResult, VerifyReport
from publisher.verify import envs as env_builder
from publisher.verify.full import compare
from publisher.verify.workers import run_workers

log = logging.getLogger(__name__)

DEFAULT = "default"
NONE = "none"
LATEST = "latest"  # the newest releases on the index alone (the default matrix includes them)
NEWEST_FILE = "newest.json"  # beside the environments: the newest releases found lately (compat.NEWEST_TTL_S)


@dataclass
class Env:
    record: EnvRecord
    python: str

    @property
    def pair(self) -> tuple[str, str]:
        return self.record.name, self.python


def current_record() -> EnvRecord:
    return EnvRecord("current", "current", gating=True)


def check_choices(compat_values: Sequence[str]) -> tuple[bool, list[str]]:
    """--compat values -> (run the default matrix, extra specs). No value means ``default``."""
    values = [v.strip() for v in compat_values if v.strip()] or [DEFAULT]
    if NONE in values and len(values) > 1:
        raise UsageError("--compat none cannot be combined with other --compat values; give either none or environments")
    specs = []
    for value in values:
        if value in (DEFAULT, NONE, LATEST):
            continue
        if not env_builder.is_spec(value):
            raise UsageError(f"--compat {value!r} is not an environment; give default, latest, none, or a spec like "
                             "torch==2.15.0 or diffusers==0.39.0")
        specs.append(env_builder.parse_spec(value, "--compat").text)
    return DEFAULT in values, specs


def check_verify_envs(values: Sequence[str]) -> None:
    """Fail on a malformed --verify-env before any work: a spec must parse, an interpreter must exist."""
    for value in values:
        if env_builder.is_spec(value):
            env_builder.parse_spec(value)
        elif not (Path(value).is_file() and os.access(value, os.X_OK)) and shutil.which(value) is None:
            raise UsageError(f"--verify-env {value!r} is neither a Python interpreter (no executable file there) "
                             "nor a version spec like diffusers==0.39.0")


def check(verify_values: Sequence[str], compat_values: Sequence[str]) -> None:
    """Every --verify-env and --compat value well formed (usage errors), before any work."""
    check_verify_envs(verify_values)
    check_choices(compat_values)


def prepare(verify_values: Sequence[str], compat_values: Sequence[str], recipes: Mapping[str, Sequence[str]],
            libraries: set[str], *, measure: bool) -> tuple[list[Env], dict[str, list[Env] | None]]:
    """Build the --verify-env environments and each recipe's matrix (``recipes``: name -> the torchao classes its
    configs make; an environment shared by recipes is built once); ``measure`` False (streaming verification): no
    matrix."""
    gating = verify_envs(verify_values)
    skip = [e.record.name for e in gating]
    matrices = {r: matrix_envs(compat_values, c, libraries, skip=skip) for r, c in recipes.items()} if measure else {}
    return gating, matrices


def verify_envs(values: Sequence[str]) -> list[Env]:
    """The gating environments of --verify-env, built when given as specs."""
    check_verify_envs(values)
    out = []
    for value in values:
        if env_builder.is_spec(value):
            out.append(_built(env_builder.parse_spec(value).text, gating=True, why="--verify-env"))
        else:
            out.append(Env(EnvRecord(value, "interpreter", gating=True, why="--verify-env"), value))
    return out


def matrix_envs(compat_values: Sequence[str], classes: Sequence[str] | None, libraries: set[str],
                skip: Sequence[str] = ()) -> list[Env] | None:
    """The measured environments for a repo whose quantized layers are of the torchao ``classes`` (None: not known)
    and whose quantized components load with ``libraries`` (returns None: --compat none); ``skip``: names already
    run as gating environments."""
    use_default, specs = check_choices(compat_values)
    latest = use_default or LATEST in [v.strip() for v in compat_values]
    if not use_default and not specs and not latest:
        return None
    installed = env_builder.installed_versions()
    wanted: dict[str, str] = {}
    if use_default:
        for entry in compat.default_matrix(classes, libraries, installed):
            wanted[env_builder.parse_spec(entry.spec).text] = entry.why
    for spec in specs:
        wanted.setdefault(spec, "--compat")
    found = compat.newest(libraries, installed, env_builder.envs_root() / NEWEST_FILE) if latest else None
    newest = {env_builder.parse_spec(f"{p}=={v}").text for p, v in found.versions.items()} if found else set()
    out = [_built(spec, gating=False, why=why, newest=spec in newest) for spec, why in wanted.items() if spec not in skip]
    if found is not None:
        out += _newest_envs(found, installed, done={*wanted, *skip})
    return out


def _newest_envs(found: compat.Newest, installed: dict[str, str], done: set[str]) -> list[Env]:
    """One environment per newest release on the index (compat.newest) not already asked for. What cannot be looked up
    or built is one line in the log and the report (an Env marked ``skipped``), never a stop: nobody asked for that
    version by name. A torch is taken only in its CPU build on a machine without CUDA (torch_sources): PyPI's CUDA
    build is several GB, too much to download unasked."""
    out = []
    if found.skipped:
        log.warning("compatibility matrix: %s", found.skipped)
        out.append(_skipped("newest releases", found.skipped))
    for package in found.current:
        log.info("compatibility matrix: %s %s here is the newest release on the index", package, installed.get(package))
    for package, version in found.versions.items():
        spec = env_builder.parse_spec(f"{package}=={version}").text
        why = compat.NEWEST_WHY.format(package=package)
        if spec in done:
            continue
        try:
            out.append(_built(spec, gating=False, why=why, newest=True, asked=False))
            continue
        except EnvBuildError as exc:
            reason = str(exc).removeprefix(f"cannot build the verification environment {spec}: ")
        line = f"{package} {version} (newest): not measured: {reason}"
        log.warning("compatibility matrix: %s", line)
        out.append(_skipped(spec, line))
    return out


def _skipped(name: str, reason: str) -> Env:
    return Env(EnvRecord(name, "spec", gating=False, why=reason, newest=True, skipped=reason), "")


def _built(spec: str, *, gating: bool, why: str, newest: bool = False, asked: bool = True) -> Env:
    """``asked`` False (a newest release nobody named): envs.build's ``unasked`` (the CPU build of a torch or nothing, a
    failure remembered for a day)."""
    built = env_builder.build(env_builder.parse_spec(spec), unasked=not asked)
    record = EnvRecord(spec, "spec", gating=gating, packages=dict(built.packages), why=why,
                       build_seconds=None if built.reused else built.seconds, newest=newest, unusable=built.import_error)
    return Env(record, built.python)


def libraries_of(components: Sequence[tuple[str, str]]) -> set[str]:
    """(name, library) of the quantized components -> their libraries."""
    return {library for _, library in components}


def measure(report: VerifyReport, where: str, revision: str | None, work: Path, matrix: Sequence[Env] | None,
            gating: Sequence[Env], *, token: str | None = None, device: str = "cpu") -> None:
    """Run every load path of every expected component in each matrix environment (None: --compat none); the
    results go to ``report.compat`` (never to ``report.results``: they do not decide the publish)."""
    report.environments = [current_record(), *(e.record for e in gating), *(e.record for e in matrix or [])]
    if report.mode == "streaming":
        report.compat_note = ("verified streaming: a whole reload does not fit in memory, and other environments "
                              "need whole reloads")
        report.environments = [current_record()]
        return
    if not matrix:
        report.compat_note = "--compat none" if matrix is None else "the default matrix has no other environment for this repo"
        return
    import torch

    started = time.monotonic()
    log.info("compatibility matrix: %d environments x %d components x %d load paths", len(matrix), len(report.expected), len(PATHS))
    before = 0  # loads an earlier run measured (verify/memo.py)
    for env in matrix:  # one interpreter per path loads every component in turn (verify/workers.py)
        if env.record.skipped:  # a newest release that could not be looked up or built: one line, no row
            report.notes.append(f"Compatibility: {env.record.skipped}.")
            continue
        if env.record.unusable:  # torch cannot import torchao there: one failing row per component, nothing to load
            for exp in report.expected:
                for path in PATHS:
                    report.compat.append(PathResult(exp.component, path, env.record.name, dict(env.record.packages),
                                                    False, detail=env.record.unusable))
                _log(report.compat[-1])
            continue
        found: dict[tuple[int, int], PathResult] = {}
        for j, path in enumerate(PATHS):
            datas = run_workers(report.expected, path, env.python, where, revision, work, token, torch.get_num_threads(),
                                tag="compat", device=device, kept=True)
            before += sum(1 for d in datas if d.get("measured_before"))
            for k, (exp, data) in enumerate(zip(report.expected, datas)):
                found[k, j] = compare(exp, data, path, env.record.name, env.python, report.tensor_class or None)
        for key in sorted(found):  # component by component, as the verification's own results
            report.compat.append(found[key])
            _log(found[key])
    log.info("compatibility matrix measured in %.0f s%s", time.monotonic() - started,
             f" ({before} of the loads were measured by an earlier run: the same files, inputs and environment)"
             if before else "")


def _log(r: PathResult) -> None:
    what = f"{r.component or 'model'} via the {r.path} path with {r.env}"
    if r.outcome == "silently wrong":
        log.warning("SILENTLY WRONG: %s: %s", what, r.detail)
    elif r.outcome == "fail":
        log.warning("compatibility: %s fails: %s", what, r.detail)
    else:
        log.info("compatibility: %s passes", what)
