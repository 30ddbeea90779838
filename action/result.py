"""The CLI's `--json` result, and the action's outputs derived from it.

One recipe prints one object; several print {"results": [...], "verified": ...}; several models (input models,
on Hugging Face Jobs) a list with one object per job. The result is read
defensively: the action must still write its outputs and summary when the CLI printed nothing, or
something unexpected, so every access checks the type it gets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def parse(stdout: str) -> object:
    """The JSON document the CLI printed, or None (nothing, or not JSON: a crash)."""
    if not stdout.strip():
        return None
    try:
        return json.loads(stdout)
    except ValueError:
        return None


def entries(payload: object) -> list[dict[str, Any]]:
    """One dict per recipe, in the order the CLI ran them."""
    if isinstance(payload, dict) and isinstance(payload.get("results"), list):
        return [r for r in payload["results"] if isinstance(r, dict)]
    if isinstance(payload, dict) and "repo_id" in payload:
        return [payload]
    if isinstance(payload, list):  # jobs of several models (input models): one entry per job, naming its model
        return [r for r in payload if isinstance(r, dict)]
    return []


def _lines(values: list[Any]) -> str:
    return "\n".join("" if v is None else str(v) for v in values)


def outputs_for(payload: object, error: str | None, returncode: int, out_dir: Path | None) -> dict[str, str]:
    """The action's outputs. With several recipes each id/url/sha output is one line per recipe."""
    results = entries(payload)
    if isinstance(payload, dict) and "results" in payload:
        verified = bool(payload.get("verified"))
    else:
        verified = bool(results) and all(r.get("verified") for r in results)
    verified = verified and returncode == 0
    # result-json is never empty: a workflow can always json.loads it and look for "error".
    result_json = payload if payload is not None else {"error": error or f"hf-ao-publish exited with code {returncode}",
                                                       "exit_code": returncode}
    return {
        "repo-id": _lines([r.get("repo_id") for r in results]),
        "repo-url": _lines([r.get("url") for r in results]),
        "commit-sha": _lines([r.get("commit") for r in results]),
        "pr-url": _lines([r.get("pr_url") for r in results]),
        "verified": "true" if verified else "false",
        "up-to-date": "true" if results and all(r.get("up_to_date") for r in results) else "false",
        "output-dir": str(out_dir) if out_dir is not None and out_dir.is_dir() else "",
        "result-json": json.dumps(result_json, separators=(",", ":"), sort_keys=True),
    }


def rechecks(payload: object) -> list[dict[str, Any]]:
    """A recheck's entries, one per repo (``{"repos": [...]}``)."""
    if isinstance(payload, dict) and isinstance(payload.get("repos"), list):
        return [r for r in payload["repos"] if isinstance(r, dict)]
    return []


def recheck_outputs(payload: object, repos: list[dict[str, Any]], error: str | None, returncode: int) -> dict[str, str]:
    """A recheck's outputs: the repos and their pull requests one line each (empty where nothing changed); verified is
    'true' when every repo was measured again."""
    result_json = payload if payload is not None else {"error": error or f"hf-ao-publish exited with code {returncode}",
                                                       "exit_code": returncode}
    return {
        "repo-id": _lines([r.get("repo") for r in repos]),
        "repo-url": "", "commit-sha": _lines([r.get("revision") for r in repos]),
        "pr-url": _lines([r.get("pull_request") for r in repos]),
        "verified": "true" if repos and returncode == 0 and not any(r.get("error") for r in repos) else "false",
        "up-to-date": "true" if repos and returncode == 0 and not any(r.get("changes") for r in repos) else "false",
        "output-dir": "",
        "result-json": json.dumps(result_json, separators=(",", ":"), sort_keys=True),
    }
