"""publisher/io/tokens.py: what a token may do, read from whoami-v2, and the preflight that refuses a token that cannot
finish the job before anything is downloaded (read-only, fine-grained without repo.write on the target namespace,
fine-grained without gated read access for a gated base)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import seed

from publisher.io.tokens import TokenRights


def _who(role: str, **grained: Any) -> dict[str, Any]:
    access: dict[str, Any] = {"role": role}
    if grained:
        access["fineGrained"] = grained
    return {"name": "alice", "auth": {"accessToken": access}}


ALICE_WRITE = {"scoped": [{"entity": {"type": "user", "name": "alice"}, "permissions": ["repo.write"]}]}
ACME_READ_ONLY = {"scoped": [{"entity": {"type": "user", "name": "alice"}, "permissions": ["repo.write"]},
                             {"entity": {"type": "org", "name": "acme"}, "permissions": ["repo.content.read"]}]}


def test_roles_and_scopes() -> None:
    assert TokenRights.of(_who("write")).allows("repo.write", "acme/x")
    assert not TokenRights.of(_who("read")).allows("repo.write", "alice/x")
    assert TokenRights.of(_who("read")).allows("repo.content.read", "alice/x")
    fine = TokenRights.of(_who("fineGrained", **ACME_READ_ONLY))
    assert fine.allows("repo.write", "alice/x") and fine.allows("repo.content.read", "alice/x")  # write implies read
    assert not fine.allows("repo.write", "acme/x") and not fine.allows("job.write", "alice")
    one_repo = TokenRights.of(_who("fineGrained", scoped=[{"entity": {"type": "model", "name": "acme/m"},
                                                          "permissions": ["repo.write"]}]))
    assert one_repo.allows("repo.write", "acme/m") and not one_repo.allows("repo.write", "acme")
    reason = fine.require("repo.write", "acme", "create acme/x")
    assert reason is not None and "no repo.write permission on acme" in reason
    assert "Write access to contents/settings of all repos under acme" in reason
    assert TokenRights.of(_who("fineGrained", **ALICE_WRITE)).gated_reason("meta/llama") is not None
    assert TokenRights.of(_who("fineGrained", canReadGatedRepos=True)).gated_reason("meta/llama") is None
    assert TokenRights.of(_who("write")).gated_reason("meta/llama") is None
    assert TokenRights.of({"name": "x"}).allows("repo.write", "x/y")  # an older Hub that says nothing: its call


@pytest.fixture(scope="module")
def tokens(hub: Any) -> None:
    hub.add_token("tok_fine_acme_ro", "alice", ACME_READ_ONLY)
    hub.add_token("tok_fine_no_gated", "alice", {**ALICE_WRITE, "canReadGatedRepos": False})
    hub.add_token("tok_read_alice", "alice", "read")


def _no_weights_read(hub: Any, base: str) -> bool:
    """Nothing but the plan's header reads (small byte ranges): no whole-file GET, no Xet read token."""
    return not [p for m, p, r in hub.app.seen if (m == "GET" and r is None and p.endswith(".safetensors"))
                or "xet-read-token" in p]


@pytest.mark.parametrize("token,target,expect", [
    ("tok_fine_acme_ro", "acme/tok-llama", "no repo.write permission on acme, so it cannot create acme/tok-llama"),
    ("tok_read_alice", "alice/tok-llama", "the Hub token is read-only"),
])
def test_a_token_that_cannot_write_the_target_is_refused_before_any_download(cli: Any, hub: Any, tokens: None,
                                                                              tiny_llama_dir: Path, token: str,
                                                                              target: str, expect: str) -> None:
    base = "meta/tok-llama"
    seed(base, tiny_llama_dir, "tok_meta")
    hub.app.seen.clear()
    result = cli(base, "--quant", "int8wo", "--repo-id", target, token=token)
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: ") and expect in line and "Traceback" not in result.stderr
    assert _no_weights_read(hub, base)


def test_a_gated_base_and_a_token_without_gated_access_is_refused_before_any_download(cli: Any, hub: Any, tokens: None,
                                                                                      tiny_llama_dir: Path) -> None:
    base = "meta/tok-gated"
    seed(base, tiny_llama_dir, "tok_meta")
    hub.set_gated(base, granted_users=["alice"])
    hub.app.seen.clear()
    result = cli(base, "--quant", "int8wo", "--no-push", token="tok_fine_no_gated")
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "meta/tok-gated is gated and this fine-grained token may not read gated repos" in line
    assert _no_weights_read(hub, base)
