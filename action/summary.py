"""The job summary: links, the files, components and verification tables, and a preview of the model card.

Everything from the CLI's result is untrusted text (a file name, an error message, the card): table cells
are escaped so nothing renders as HTML or breaks the table, links are made only from http(s) URLs, and the
card sits inside a code fence longer than any run of backticks it contains. GitHub refuses a step summary
over 1 MiB, so the text is cut to a budget, the card first.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from typing import Any

from action.result import entries
from action.workflow import TITLE, redact

SUMMARY_LIMIT = 1024 * 1024  # GitHub's cap for one step's summary
SUMMARY_BUDGET = SUMMARY_LIMIT - 48 * 1024  # what this module writes at most, with a margin
PREVIEW_HEAD = "<details><summary>Model card preview (README.md)</summary>"
MAX_FILE_ROWS = 200  # a sharded checkpoint can have hundreds of files; the rest is counted


def cell(value: object) -> str:
    """Text safe inside a markdown table cell (no HTML, no pipes, one line)."""
    text = "" if value is None else str(value)
    return html.escape(" ".join(text.split())).replace("|", "&#124;")


def human_size(n: Any) -> str:
    """Bytes as B / KiB / MiB / GiB; anything that is not a number is shown as text."""
    try:
        size = float(n)
    except (TypeError, ValueError):
        return cell(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - the loop returns at GiB


def link(text: str, url: str | None) -> str:
    """A markdown link, or the plain text when `url` is not a plain http(s) URL (no javascript:, no spaces)."""
    safe = cell(text)
    if url and re.match(r"^https?://[^\s()<>]+$", url):
        return f"[{safe}]({url})"
    return safe


def status(r: Mapping[str, Any]) -> str:
    """One recipe's outcome in words."""
    if r.get("error"):
        return "❌ failed"
    if r.get("up_to_date"):
        return "✅ up to date (nothing to publish)"
    if r.get("pr_url"):
        return "✅ pull request opened"
    if r.get("pushed"):
        return "✅ published"
    return "✅ verified (not pushed)"


def _num(value: object) -> str:
    return f"{value:.6f}" if isinstance(value, (int, float)) else cell(value)


def _files_table(files: list[dict[str, Any]]) -> list[str]:
    lines = ["#### Files", "", "| file | size |", "|---|---:|"]
    for f in files[:MAX_FILE_ROWS]:
        lines.append(f"| `{cell(f.get('name'))}` | {human_size(f.get('size'))} |")
    if len(files) > MAX_FILE_ROWS:
        lines.append(f"| … {len(files) - MAX_FILE_ROWS} more | |")
    total = sum(f.get("size") or 0 for f in files if isinstance(f.get("size"), (int, float)))
    return lines + [f"| **total** | **{human_size(total)}** |", ""]


def _components_table(components: list[dict[str, Any]]) -> list[str]:
    lines = ["#### Components", "",
             "| component | class | quantized layers | skipped | excluded | size before | size after |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for c in components:
        skipped = c.get("skipped_layers")
        n_skipped = len(skipped) if isinstance(skipped, list) else skipped
        lines.append(f"| {cell(c.get('name'))} | {cell(c.get('class'))} | {cell(c.get('quantized_layers'))} | "
                     f"{cell(n_skipped)} | {cell(c.get('excluded_layers'))} | "
                     f"{human_size(c.get('bytes_before'))} | {human_size(c.get('bytes_after'))} |")
    return lines + [""]


def _verification_tables(report: dict[str, Any]) -> list[str]:
    lines = ["#### Verification", "",
             "| component | load path | env | result | max abs diff | quantized layers | versions | detail |",
             "|---|---|---|---|---:|---:|---|---|"]
    for v in report.get("results") or []:
        versions = v.get("versions") if isinstance(v.get("versions"), dict) else {}
        lines.append(
            f"| {cell(v.get('component') or 'model')} | {cell(v.get('path'))} | {cell(v.get('env'))} | "
            f"{'✅ bit-identical' if v.get('ok') else '❌ failed'} | {cell(v.get('max_abs_diff'))} | "
            f"{cell(v.get('quantized_layers'))} | {cell(', '.join(f'{k} {x}' for k, x in versions.items()))} | "
            f"{cell(v.get('detail'))} |")
    lines.append("")
    compat = [v for v in report.get("compat") or [] if isinstance(v, dict)]
    if compat:  # the compatibility matrix: measured for the card, never a reason to stop
        marks = {"pass": "✅ pass", "fail": "❌ fail", "silently wrong": "⚠️ **silently wrong**"}
        lines += ["#### Compatibility (measured; does not decide the publish)", "",
                  "| component | load path | environment | result | quantized layers | detail |", "|---|---|---|---|---:|---|"]
        for v in compat:
            lines.append(f"| {cell(v.get('component') or 'model')} | {cell(v.get('path'))} | {cell(v.get('env'))} | "
                         f"{marks.get(str(v.get('outcome')), cell(v.get('outcome')))} | {cell(v.get('quantized_layers'))} | "
                         f"{cell(v.get('detail'))} |")
        lines.append("")
    quality = report.get("quality") or []
    if quality:
        lines += ["| component | relative error vs bf16 | cosine vs bf16 |", "|---|---:|---:|"]
        for q in quality:
            lines.append(f"| {cell(q.get('component') or 'model')} | {_num(q.get('rel_error'))} | "
                         f"{_num(q.get('cosine'))} |")
        lines.append("")
    return lines


def result_section(r: Mapping[str, Any]) -> list[str]:
    """One recipe: heading with the repo link and status, commit, PR, then its tables."""
    lines = [f"### {cell(r.get('recipe'))}: {link(r.get('repo_id') or '', r.get('url'))} {status(r)}", ""]
    facts = []
    if r.get("commit"):
        facts.append(f"commit `{cell(r['commit'])}`")
    if r.get("pr_url"):
        facts.append(f"pull request: {link(r['pr_url'], r['pr_url'])}")
    facts.append("verified: **yes**" if r.get("verified") else "verified: **no**")
    lines += [" · ".join(facts), ""]
    if r.get("error"):
        lines += [f"> **Error:** {cell(r['error'])}", ""]
    files = [f for f in r.get("files") or [] if isinstance(f, dict)]
    if files:
        lines += _files_table(files)
    components = [c for c in r.get("components") or [] if isinstance(c, dict)]
    if components:
        lines += _components_table(components)
    report = r.get("verification")
    if isinstance(report, dict) and report:
        lines += _verification_tables(report)
    return lines


def truncate_utf8(text: str, limit: int) -> str:
    """At most `limit` UTF-8 bytes, cut at a line end when there is one in the last quarter."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    cut = data[:max(limit, 0)].decode("utf-8", errors="ignore")
    newline = cut.rfind("\n")
    return cut[: newline + 1] if newline >= len(cut) * 3 // 4 else cut


def _fence(text: str) -> str:
    # A fence longer than any backtick run inside, so the card's own ``` blocks cannot close it.
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def card_preview(card: str, budget: int, url: str | None) -> list[str]:
    """The card in a <details> block as raw markdown, truncated to `budget` bytes."""
    head = f"{PREVIEW_HEAD}\n"
    fence = _fence(card)
    overhead = len((head + "\n" + fence + "markdown\n" + "\n" + fence + "\n\n</details>\n").encode("utf-8")) + 300
    body = card
    note = ""
    if len(card.encode("utf-8")) + overhead > budget:
        body = truncate_utf8(card, max(budget - overhead, 0))
        total = len(card.encode("utf-8"))
        note = (f"\n*Card truncated to {len(body.encode('utf-8'))} of {total} bytes "
                "(the job summary is limited to 1 MiB)"
                + (f"; the full card is at {link(url, url)}*" if url else "*") + "\n")
        if not body:
            return [PREVIEW_HEAD, "", note.strip(), "", "</details>", ""]
    if not body.endswith("\n"):
        body += "\n"
    return [head, f"{fence}markdown", body + fence, note, "</details>", ""]


def build_summary(model: str, payload: object, error: str | None, returncode: int,
                  cards: Mapping[int, str], secrets: Sequence[str], budget: int = SUMMARY_BUDGET) -> str:
    """The job summary: links, size and verification tables, the card preview(s); at most `budget` bytes.

    `cards` maps a recipe's index in the result to its card text."""
    results = entries(payload)
    lines = [f"## {'✅' if returncode == 0 else '❌'} {TITLE}: `{cell(model)}`", ""]
    if error:
        lines += [f"> **Error:** {cell(error)}", ""]
    if len(results) > 1:
        lines += ["| recipe | repo | status | commit |", "|---|---|---|---|"]
        for r in results:
            what = " ".join(str(r[k]) for k in ("model", "recipe") if r.get(k))  # several models: which one
            lines.append(f"| {cell(what)} | {link(r.get('repo_id') or '', r.get('url'))} | {status(r)} | "
                         f"{cell((r.get('commit') or '')[:12])} |")
        lines.append("")
    for r in results:
        lines += result_section(r)
    text = redact("\n".join(lines) + "\n", secrets)
    if len(text.encode("utf-8")) > budget:  # tables alone over budget: keep what fits
        return truncate_utf8(text, budget - 200) + "\n\n*Summary truncated (1 MiB limit).*\n"
    # The cards share what is left, each getting an equal part of the remainder in turn.
    remaining = budget - len(text.encode("utf-8"))
    previews = [(i, cards[i]) for i in range(len(results)) if i in cards]
    for n, (i, card) in enumerate(previews):
        share = remaining // (len(previews) - n)
        title = f"#### Card: {cell(results[i].get('recipe'))}\n\n" if len(previews) > 1 else ""
        preview = card_preview(redact(card, secrets), share - len(title.encode("utf-8")), results[i].get("url"))
        block = redact(title + "\n".join(preview), secrets)
        text += block
        remaining -= len(block.encode("utf-8"))
    return text


def build_recheck_summary(repos: list[dict[str, Any]], error: str | None, returncode: int) -> str:
    """The job summary of a recheck: one row per repo."""
    lines = [f"## {TITLE}: recheck", ""]
    if error:
        lines += [f"**Failed** (exit code {returncode}): {cell(error)}", ""]
    lines += ["| repo | changed rows | pull request |", "|---|---|---|"]
    for r in repos:
        if r.get("error"):
            lines.append(f"| {cell(r.get('repo'))} | not rechecked: {cell(r['error'])} | |")
            continue
        changes = r.get("changes") or []
        what = "; ".join(f"{c.get('component')} {c.get('path')} ({c.get('versions')}): "
                         + (f"was {c['before']}, now {c.get('after')}" if c.get("before") else f"new, {c.get('after')}")
                         for c in changes) or "none"
        lines.append(f"| {cell(r.get('repo'))} | {cell(what)} | {link('pull request', r.get('pull_request')) if r.get('pull_request') else ''} |")
    return "\n".join(lines) + "\n"
