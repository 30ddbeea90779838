"""What a Hub token may do, read from ``whoami-v2`` before any download, so a token that cannot finish the job is
refused in the preflight instead of at its first write, after the whole quantization.

huggingface.co reports ``auth.accessToken.role`` as ``read``, ``write`` or ``fineGrained``. A fine-grained token
lists ``fineGrained.global`` permissions and ``fineGrained.scoped`` entries, each an entity (a user, an org, or one
repo by its id) with permissions such as ``repo.content.read``, ``repo.write`` or ``job.write``, and
``canReadGatedRepos`` for the public gated repos its user was granted. Most CI runners hold fine-grained tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKENS_URL = "https://huggingface.co/settings/tokens"
READ = frozenset({"repo.content.read"})
# How the token settings page words each permission, so the fix can be followed as written
WORDING = {
    "repo.write": "Write access to contents/settings of all repos under {ns}",
    "repo.content.read": "Read access to contents of all repos under {ns}",
    "job.write": "Start and manage Jobs on your behalf",
}


def resolve_token(token: str | None) -> str | None:
    """--token, else HF_TOKEN / the stored login (huggingface_hub's own lookup)."""
    if token:
        return token
    from huggingface_hub import get_token

    return get_token()


@dataclass(frozen=True)
class TokenRights:
    role: str | None  # None: whoami did not say (an older Hub): the Hub decides at each call
    granted: tuple[tuple[str, frozenset[str]], ...] = ()  # (entity name, permissions); "" for the global ones
    can_read_gated: bool = True

    @classmethod
    def of(cls, who: dict[str, Any]) -> TokenRights:
        access = (who.get("auth") or {}).get("accessToken") or {}
        role = access.get("role")
        if role != "fineGrained":
            return cls(role if isinstance(role, str) else None)
        grained = access.get("fineGrained") or {}
        granted = [("", frozenset(grained.get("global") or ()))]
        for scope in grained.get("scoped") or ():
            name = (scope.get("entity") or {}).get("name")
            if isinstance(name, str):
                granted.append((name, frozenset(scope.get("permissions") or ())))
        return cls(role, tuple(granted), bool(grained.get("canReadGatedRepos")))

    def allows(self, permission: str, repo_id: str) -> bool:
        """Whether ``permission`` is held on ``repo_id`` (``ns/name``) or, for a bare name, on that namespace."""
        if self.role in (None, "write"):
            return True
        if self.role == "read":
            return permission in READ
        namespace = repo_id.split("/")[0]
        held: set[str] = set()
        for name, permissions in self.granted:
            if name in ("", namespace, repo_id):
                held |= permissions
        return permission in held or (permission == "repo.content.read" and "repo.write" in held)

    def require(self, permission: str, repo_id: str, why: str) -> str | None:
        """None when allowed; else the one-line reason naming the missing permission and where to add it."""
        if self.allows(permission, repo_id):
            return None
        if self.role == "read":
            return f"the Hub token is read-only, so it cannot {why}; create a token with write access at {TOKENS_URL}"
        namespace = repo_id.split("/")[0]
        wording = WORDING.get(permission, permission).format(ns=namespace)
        return (f"this fine-grained token has no {permission} permission on {namespace}, so it cannot {why}; add "
                f"\"{wording}\" to it at {TOKENS_URL}, or use another token")

    def gated_reason(self, repo_id: str) -> str | None:
        if self.role != "fineGrained" or self.can_read_gated:
            return None
        return (f"{repo_id} is gated and this fine-grained token may not read gated repos; enable \"Read access to "
                f"contents of all public gated repos you can access\" for it at {TOKENS_URL}")
