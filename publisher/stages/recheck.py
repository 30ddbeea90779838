"""`hf-ao-publish recheck REPO [REPO...]`: published repos measured again against today's compatibility matrix.

A repo is checked once, the day it is made; what breaks users' checkpoints comes after (a torchao release that drops a
tensor class, a transformers loader that changes). A recheck runs ``verify`` on the repo's current commit without
re-quantizing any base (the load paths in this environment and the matrix, whose default now includes the newest
releases on the index), and compares each row with the one the repo's ``verification.json`` holds, row by row, keyed
by the exact versions a load ran with (an environment is what it holds, not what it was called). When a row is new or
its outcome changed, it opens one pull request on the repo that updates the card's "Software requirements" and
"Compatibility" sections and ``verification.json`` (the old rows that were not measured again stay: they were true of
the versions they name); when nothing changed, nothing is written.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from publisher import __version__
from publisher.handoffs.report import PATHS, REPORT_NAME, EnvRecord, PathResult, VerifyReport
from publisher.io import hub
from publisher.stages import card
from publisher.stages.push import find_open_pr
from publisher.verify import claims
from publisher.verify.target import verify_target

log = logging.getLogger(__name__)

CARD = "README.md"
TITLE = "hf-ao-publish recheck"
RECHECK_ENV = "recheck"  # the kind and name prefix of the rechecking environment's rows
KEYED = (*claims.CORE, *claims.LIBRARIES, "accelerate")  # the versions that make an environment what it is


@dataclass
class Change:
    component: str
    path: str
    versions: str  # the exact versions of the row, as the card writes them
    before: str | None  # None: a row the repo did not have
    after: str


@dataclass
class RecheckResult:
    repo: str
    revision: str  # the commit measured
    loads: int  # loads run by this recheck
    changes: list[Change] = field(default_factory=list)
    pull_request: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _key(r: PathResult) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    return r.component, r.path, tuple(sorted((k, v) for k, v in r.versions.items() if k in KEYED))


def _path_result(data: dict[str, Any]) -> PathResult:
    names = {f.name for f in fields(PathResult)}
    return PathResult(**{k: v for k, v in data.items() if k in names})


def _env_record(data: dict[str, Any]) -> EnvRecord:
    names = {f.name for f in fields(EnvRecord)}
    return EnvRecord(**{k: v for k, v in data.items() if k in names})


def merge(published: dict[str, Any], now: VerifyReport, when: str) -> tuple[VerifyReport, list[Change]]:
    """The published report's rows updated with this recheck's (``now``), and what changed. The published repo's own
    environment stays the table's first row; this environment's loads are a row of their own (kind "recheck") unless
    they ran with exactly the versions of a row the repo has."""
    old_results = [_path_result(r) for r in published.get("results") or [] if r.get("path") in PATHS]
    old_compat = [_path_result(r) for r in published.get("compat") or []]
    envs = {e.name: e for e in (_env_record(e) for e in published.get("environments") or [])}
    rows = {_key(r): r for r in [*old_results, *old_compat]}
    here = f"{RECHECK_ENV} {when}"
    changes: list[Change] = []
    fresh = [r for r in now.results if r.path in PATHS] + list(now.compat)
    for r in fresh:
        if r.env == "current":
            r.env = here
        key = _key(r)
        before = rows.get(key)
        if before is not None and before.outcome == r.outcome:
            continue
        changes.append(Change(r.component or "model", r.path, ", ".join(f"{k} {v}" for k, v in key[2]),
                              before.outcome if before is not None else None, r.outcome))
        if before is not None:  # the same versions: the row keeps its place and its environment's name
            r.env = before.env
        rows[key] = r
    for e in now.environments:
        if e.kind == "current":
            envs.setdefault(here, EnvRecord(here, "recheck", gating=False, why=f"hf-ao-publish {__version__} on {when}"))
        elif e.name not in envs:
            envs[e.name] = e
    merged = VerifyReport(recipe=str(published.get("recipe") or now.recipe), location=now.location, passed=True)
    merged.results = [r for r in rows.values() if r.env == "current"]
    merged.compat = [r for r in rows.values() if r.env != "current"]
    merged.environments = list(envs.values())
    merged.compat_note = "" if merged.compat else str(published.get("compat_note") or now.compat_note)
    return merged, changes


def section(merged: VerifyReport, published: dict[str, Any], libraries: set[str], components: int) -> str:
    """The card's "Software requirements" and "Compatibility" sections for the merged rows (the template's own part)."""
    current = next((r.versions for r in merged.results if r.versions), {})
    compat = claims.summarise(merged, libraries)
    classes = sorted({c for r in merged.results for c in r.classes_found if c != "missing"}) or (
        [str(published["tensor_class"])] if published.get("tensor_class") else [])
    text = card.environment().get_template(card.COMPAT_TEMPLATE).render(
        versions=current, compat=compat, compat_table=claims.table(compat), compat_warnings=claims.warnings(compat),
        quantized=range(components), classes_text=card.classes_text(classes))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def replace_section(readme: str, new: str) -> str:
    """``readme`` with its "## Software requirements" ... "## Compatibility" sections replaced by ``new`` (appended when
    the card has no Compatibility section: a repo this tool did not make)."""
    start = readme.find("\n## Software requirements\n")
    if start < 0:
        start = readme.find("\n## Compatibility\n")
    if start < 0:
        return readme.rstrip("\n") + "\n\n" + new
    compat = readme.find("\n## Compatibility\n", start)
    after = re.search(r"\n## (?!Compatibility\n)", readme[compat + 1:]) if compat >= 0 else None
    end = compat + 1 + after.start() if after else len(readme)
    return readme[:start + 1] + new + ("\n" + readme[end + 1:] if after else "")


def recheck(repo: str, work: Path, *, compat: tuple[str, ...] = (), token: str | None = None) -> RecheckResult:
    """Measure ``repo``'s current commit again and open a pull request when a row changed (see the module)."""
    from huggingface_hub import CommitOperationAdd, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError  # a file the repo does not have

    api = hub.client(token)
    sha = str(hub.call(api.model_info, repo, what=f"read {repo}").sha)  # every read below sees this one commit
    published: dict[str, Any] = {}
    try:
        published = json.loads(Path(hf_hub_download(repo, REPORT_NAME, revision=sha, token=token,
                                                    cache_dir=work / "cache")).read_text())
    except EntryNotFoundError:
        log.info("%s has no %s (not made by hf-ao-publish): every row it gets is new", repo, REPORT_NAME)
    readme_file = None
    try:
        readme_file = hf_hub_download(repo, CARD, revision=sha, token=token, cache_dir=work / "cache")
    except EntryNotFoundError:
        pass
    now = verify_target(repo, work / "verify", compat=compat, token=token, revision=sha, requantize=False)
    when = time.strftime("%Y-%m-%d", time.gmtime())
    merged, changes = merge(published, now, when)
    result = RecheckResult(repo, sha, len([r for r in now.results if r.path in PATHS]) + len(now.compat), changes)
    if not changes:
        return result
    libraries = {c for c in ("diffusers", "transformers") if any(c in r.versions for r in merged.results)}
    readme = Path(readme_file).read_text() if readme_file else ""
    new_readme = replace_section(readme, section(merged, published, libraries, len({r.component for r in merged.results})))
    rows = merged.to_dict()
    record = {**published, "compat": rows["compat"], "environments": rows["environments"],
              "rechecks": [*published.get("rechecks", []), {"date": when, "tool": f"hf-ao-publish {__version__}",
                                                            "revision": sha, "changes": [asdict(c) for c in changes]}]}
    if not published:
        record.update(recipe=merged.recipe, results=now.to_dict()["results"])
    ops = [CommitOperationAdd(CARD, new_readme.encode()),
           CommitOperationAdd(REPORT_NAME, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())]
    message = f"{TITLE}: {len(changes)} compatibility row(s) changed"
    open_pr = find_open_pr(repo, token, title_prefix=f"{TITLE}:")
    if open_pr is not None:  # an earlier recheck's, not merged yet: updated, not a second one beside it
        num, ref = open_pr
        hub.call(api.create_commit, repo, ops, commit_message=message, commit_description=describe(changes), revision=ref,
                 what=f"update pull request #{num} on {repo}")
        result.pull_request = hub.pr_url(repo, num)
    else:
        info = hub.call(api.create_commit, repo, ops, commit_message=message, commit_description=describe(changes),
                        create_pr=True, parent_commit=sha, what=f"open a pull request on {repo}")
        result.pull_request = info.pr_url
    return result


def describe(changes: list[Change]) -> str:
    lines = [f"- {c.component}, {'library loaders' if c.path == 'library' else 'manual path'}, {c.versions}: "
             f"{c.before or 'not measured before'} -> {c.after}" for c in changes]
    return "Measured again by `hf-ao-publish recheck` against today's compatibility matrix:\n\n" + "\n".join(lines) + "\n"
