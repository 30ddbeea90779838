"""What a card (or `verify TARGET`) may say about versions: derived only from loads that were run.

The compatibility table lists every measured environment with the outcome of each load path. A minimum
version is stated for a package only where a load at that version passed, and only when nothing measured
between it and this environment's version failed; a package no environment varied is stated at the one
version measured. Nothing here is typed by hand: no result, no claim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from publisher.handoffs.report import OUTCOMES, PATHS, EnvRecord, Outcome, PathResult, VerifyReport

SILENT_PREFIX = "loads without an error, but "  # how compare() starts the detail of a silently wrong load
# the packages a card talks about; the libraries only when a quantized component loads with them
CORE = ("torch", "torchao", "safetensors")
LIBRARIES = ("diffusers", "transformers")


@dataclass
class Row:
    """One environment and one component: the outcome of each load path."""

    env: EnvRecord
    component: str
    versions: dict[str, str]  # as the worker measured them (empty when no load started)
    results: dict[str, PathResult] = field(default_factory=dict)  # path -> result

    def outcome(self, path: str) -> Outcome | None:
        r = self.results.get(path)
        return r.outcome if r else None


@dataclass
class Claim:
    package: str
    path: str  # "library" | "manual"
    current: str
    minimum: str | None  # the oldest version measured to pass, with no failure measured above it
    passed: list[str] = field(default_factory=list)
    not_passed: list[tuple[str, Outcome]] = field(default_factory=list)
    ceiling: str | None = None  # the oldest version above this one measured not to pass (a newer release that breaks it)

    def text(self) -> str:
        """``diffusers >= 0.39.0 (measured: 0.39.0 and 0.42.1 pass; 0.38.0 silently wrong)``"""
        measured = "; ".join(filter(None, [
            f"{' and '.join(self.passed)} pass" if self.passed else "",
            "; ".join(f"{v} {o}" for v, o in self.not_passed),
        ]))
        if self.minimum is None:
            return f"{self.package}: no version measured to pass ({measured})"
        if self.passed == [self.current] and not self.not_passed:
            return f"{self.package} {self.current} (the only version measured)"
        upper = f", < {self.ceiling}" if self.ceiling else ""
        return f"{self.package} >= {self.minimum}{upper} (measured: {measured}; versions in between not measured)"


@dataclass
class Compatibility:
    rows: list[Row]
    claims: dict[str, list[Claim]]  # path -> one claim per package
    packages: list[str]  # the packages the card states, in order
    current: dict[str, str]
    counts: dict[Outcome, int]  # over every load in the table
    silently_wrong: list[Row]  # rows with at least one silently wrong path
    manual_rescues: list[Row]  # rows where the manual path passes and the library path does not
    note: str  # why nothing but this environment was measured, when so


def spec_names(spec: str) -> list[str]:
    """The packages a normalised spec names (``transformers==4.57.6,diffusers>=0.39`` -> both names)."""
    return [m.group(0) for part in spec.split(",") if (m := re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", part.strip()))]


def env_label(env: EnvRecord) -> str:
    if env.kind == "current":
        return "this tool's own (made and verified here)"
    if env.kind == "interpreter":
        return f"`{env.name}` (an interpreter given with --verify-env)"
    if env.kind == "recheck":
        return f"a later recheck's ({env.why})"
    return f"this one with `{env.name}`" + (" (newest)" if env.newest else "")


def table(comp: Compatibility) -> list[dict[str, str]]:
    """The card's table, one dict of markdown cells per row."""
    return [{"env": env_label(row.env), "component": row.component or "model", "versions": versions_text(row, comp.packages),
             "library": cell(row.results.get("library")), "manual": cell(row.results.get("manual"))} for row in comp.rows]


def warnings(comp: Compatibility) -> list[str]:
    """One sentence per silently wrong load: the card puts them above the table."""
    out = []
    for row in comp.silently_wrong:
        for path in PATHS:
            r = row.results.get(path)
            if r is not None and r.outcome == "silently wrong":
                how = "the library loaders" if path == "library" else "the manual path"
                out.append(f"with {versions_text(row, comp.packages, only_changed=True)}, {row.component or 'the model'} "
                           f"loaded through {how} raises no error, but {r.detail.removeprefix(SILENT_PREFIX)}")
    return out


def manual_text(comp: Compatibility) -> str:
    """Where the manual path was measured, for the sentence above its snippet."""
    passed = [row for row in comp.rows if row.outcome("manual") == "pass"]
    failed = [row for row in comp.rows if row.outcome("manual") not in (None, "pass")]
    if not passed and not failed:
        return "It was not measured."
    text = "Measured to load this repo correctly with: " + "; ".join(versions_text(r, comp.packages, only_changed=True) for r in passed)
    if comp.manual_rescues:
        text += (". That includes environments whose library loaders do not load it correctly: "
                 + "; ".join(versions_text(r, comp.packages, only_changed=True) for r in comp.manual_rescues))
    if failed:
        text += ". It does not work with: " + "; ".join(
            f"{versions_text(r, comp.packages, only_changed=True)} ({r.outcome('manual')})" for r in failed)
    return text + "."


def _key(version: str) -> tuple[int, ...] | tuple[float, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return tuple(Version(version).release)
    except InvalidVersion:
        return (float("inf"),)


def summarise(report: VerifyReport, libraries: set[str]) -> Compatibility:
    """The table and the claims for one verification report (its gating results and its matrix)."""
    results = [r for r in report.results if r.path in PATHS] + list(report.compat)
    envs = {e.name: e for e in report.environments}
    rows: dict[tuple[str, str], Row] = {}
    for r in results:
        env = envs.get(r.env) or EnvRecord(r.env, "current" if r.env == "current" else "interpreter", gating=True)
        row = rows.setdefault((r.env, r.component), Row(env, r.component, {}))
        row.results[r.path] = r
        if r.versions and not row.versions:
            row.versions = dict(r.versions)
    ordered = sorted(rows.values(), key=lambda row: (list(envs).index(row.env.name) if row.env.name in envs else len(envs),
                                                        row.component))
    current = next((row.versions for row in ordered if row.env.name == "current" and row.versions), {})
    packages = [*CORE[:2], *(lib for lib in LIBRARIES if lib in libraries), CORE[2]]
    claims = {path: [_claim(ordered, package, path, current) for package in packages if package in current] for path in PATHS}
    counts = {o: sum(1 for r in results if r.outcome == o) for o in OUTCOMES}
    silent = [row for row in ordered if any(row.outcome(p) == "silently wrong" for p in PATHS)]
    rescues = [row for row in ordered if row.outcome("manual") == "pass" and row.outcome("library") not in (None, "pass")]
    note = report.compat_note if not report.compat else ""
    return Compatibility(ordered, claims, packages, current, counts, silent, rescues, note)


def _claim(rows: list[Row], package: str, path: str, current: dict[str, str]) -> Claim:
    """Points: this environment, and every environment built from a spec that names ``package`` alone."""
    here = current[package]
    by_version: dict[str, list[Outcome | None]] = {}
    for row in rows:
        if row.env.kind == "current":
            version = here
        elif row.env.kind == "spec" and spec_names(row.env.name) == [package]:
            version = row.versions.get(package) or row.env.packages.get(package) or ""
        else:
            continue
        if not version:
            continue
        by_version.setdefault(version, []).append(row.outcome(path))
    status: dict[str, Outcome] = {}
    for version, outcomes in by_version.items():
        worst = "fail" if None in outcomes else next((o for o in ("silently wrong", "fail") if o in outcomes), "pass")
        status[version] = worst  # type: ignore[assignment]  # one of OUTCOMES
    ordered = sorted(status, key=_key, reverse=True)
    minimum = None
    if status.get(here) == "pass":
        minimum = here
        for version in [v for v in ordered if _key(v) < _key(here)]:
            if status[version] != "pass":
                break
            minimum = version
    passed = sorted((v for v in status if status[v] == "pass"), key=_key)
    not_passed = sorted(((v, status[v]) for v in status if status[v] != "pass"), key=lambda item: _key(item[0]))
    # forward in time: the first newer release measured not to pass bounds the claim from above
    ceiling = next((v for v, _ in not_passed if _key(v) > _key(here)), None) if minimum is not None else None
    return Claim(package, path, here, minimum, passed, not_passed, ceiling)


# A sentence of a library's error that points at output the card does not show ("For details look at the
# `CONVERSION` entries of the above report!", transformers' load report): nothing a reader of the card can follow.
_POINTER = re.compile(r"\bfor (?:more )?details\b|\b(?:above|previous) (?:report|logs?|traceback|output|messages?)\b"
                      r"|\bsee the (?:logs?|traceback)\b", re.I)
_RAISED = re.compile(r"^(?P<head>.*?\b[A-Z]\w*(?:Error|Exception)): (?P<message>.*)$", re.S)  # "...RuntimeError: msg"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\[])")


def reason(detail: str) -> str:
    """A failed load's detail as one plain line for the card: what raised (the exception type) and its first sentence
    that says something, without the library's pointers to logs the reader does not have."""
    text = " ".join(detail.split())
    raised = _RAISED.match(text)
    head, message = (raised.group("head") + ": ", raised.group("message")) if raised else ("", text)
    sentences = _SENTENCE_END.split(message)
    meaningful = [s for s in sentences if not _POINTER.search(s)]
    if raised:  # a library's exception: its first meaningful sentence says what went wrong
        meaningful = meaningful[:1]
    kept = " ".join(meaningful) or sentences[0]
    return head + kept.rstrip(" .!") if raised else kept


def cell(result: PathResult | None, width: int = 220) -> str:
    """A markdown table cell for one load: the outcome in words, loud when silently wrong."""
    if result is None:
        return "not run"
    if result.outcome == "pass":
        return "pass" + (" (bit-identical)" if result.forward_checked else " (tensors identical)")
    detail = reason(result.detail).replace("|", "\\|")
    if len(detail) > width:
        detail = detail[: width - 3] + "..."
    return ("**SILENTLY WRONG**: " if result.outcome == "silently wrong" else "fail: ") + detail


def versions_text(row: Row, packages: list[str], only_changed: bool = False) -> str:
    """The exact versions that matter in a row: the card's packages, then whatever else a spec's layer replaced.
    ``only_changed``: for a spec's environment, just the packages it names (this tool's versions otherwise)."""
    if only_changed and row.env.kind == "spec":
        named = spec_names(row.env.name)
        packages = [p for p in named if row.versions.get(p) or row.env.packages.get(p)]
        return ", ".join(f"{p} {row.versions.get(p) or row.env.packages.get(p)}" for p in packages)
    if only_changed and row.env.kind == "current":
        own = ", ".join(f"{p} {row.versions[p]}" for p in packages if p != "safetensors" and row.versions.get(p))
        return f"this tool's own environment ({own})"
    shown = [f"{p} {row.versions[p]}" for p in packages if row.versions.get(p) not in (None, "absent")]
    extra = [] if only_changed else [f"{name} {v}" for name, v in sorted(row.env.packages.items())
                                     if name not in packages and name.replace("-", "_") not in packages]
    text = ", ".join(shown) or "versions unknown (no load started)"
    return text + (f" (with {', '.join(extra)})" if extra else "")


def text_table(report: VerifyReport) -> str:
    """The three-outcome table of `hf-ao-publish verify`, one line per load, for a terminal."""
    comp = summarise(report, {e.library for e in report.expected} or set(LIBRARIES))
    words = {"pass": "pass", "fail": "FAIL", "silently wrong": "SILENTLY WRONG"}
    lines = [f"{'component':<14} {'path':<8} {'environment':<32} {'result':<14} {'layers':>6}  detail"]
    for row in comp.rows:
        for path in PATHS:
            r = row.results.get(path)
            if r is None:
                continue
            env = row.env.name if row.env.gating else f"{row.env.name} (measured)"
            detail = versions_text(row, comp.packages) if r.ok else r.detail
            lines.append(f"{(row.component or 'model'):<14} {path:<8} {env[:32]:<32} {words[r.outcome]:<14} "
                         f"{r.quantized_layers:>6}  {detail}")
    if report.compat:
        lines.append("(measured): an environment of the compatibility matrix; its outcome does not decide the exit code")
    elif comp.note:
        lines.append(f"Other environments: not measured ({comp.note}).")
    if report.content:
        lines += ["", f"{'component':<14} {'check':<17} {'result':<6} detail"]
        for c in report.content:
            lines.append(f"{(c.component or 'model'):<14} {c.what:<17} {'pass' if c.ok else 'FAIL':<6} {c.detail}")
            lines += [f"{'':<14} {'':<17} {'note':<6} {note}" for note in c.notes]
    if report.values:
        lines.append(f"Values: {report.values}.")
    return "\n".join(lines)
