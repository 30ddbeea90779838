"""The state file of a published repo (``hf_ao_publish.json``): everything that determines its bytes and its card.

Its fingerprint decides whether a re-run is a no-op (job.RecipeRun.up_to_date) and marks the folders a run made; the
options that change only the card are in it too (request.PublishRequest.card_options), so that changing one of them
publishes a new card. The resume cache is keyed by ``bytes_key``: the same state without the card options, so a card
option changed between an interrupted run and its re-run still reuses the quantized components.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from publisher import __version__
from publisher.handoffs.plan import Plan
from publisher.recipes import Recipe


def state_for(plan: Plan, recipe: Recipe) -> dict[str, Any]:
    """Everything that determines the published bytes; its hash decides whether a re-run is a no-op."""
    import importlib.metadata as md

    state = {
        "tool": "hf-ao-publish",
        "tool_version": __version__,
        # a local base by its folder's name: the same folder moved elsewhere is the same base (its listing,
        # base_sha, is what tells bases apart), and its path is nobody's business on the Hub
        "base_model": plan.source.name,
        "base_sha": plan.source.sha or _local_digest(plan),
        "recipe": recipe.name,
        "config": recipe.python,
        "quant": recipe.quant_json(),  # every config as given and as torchao writes it, per component and per layer
        "components": [c.name or "model" for c in plan.quantized],
        "exclude": sorted(plan.exclude),
        "versions": {n: md.version(n) for n in ("torch", "torchao", "diffusers", "transformers")},
        "card": plan.options.get("card"),  # the options that change only the card (card_options)
    }
    state["fingerprint"] = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
    # The Hub's hash of every base file read, so `verify TARGET` can prove it re-quantized the very same bytes. Not in
    # the fingerprint: base_sha (a git commit id) already fixes every blob id and, through the LFS pointers, sha256.
    if plan.base_hashes:
        state["base_files"] = {f: h.to_json() for f, h in sorted(plan.base_hashes.items())}
    return state


def bytes_key(state: dict[str, Any]) -> str:
    """The hash of what decides the quantized bytes (the state without the card options): the resume cache's key."""
    decides = {k: v for k, v in state.items() if k not in ("card", "fingerprint", "base_files")}
    return hashlib.sha256(json.dumps(decides, sort_keys=True).encode()).hexdigest()


def _local_digest(plan: Plan) -> str:
    listing = json.dumps({f: plan.source.sizes[f] for f in plan.base_files}, sort_keys=True)
    return "local-" + hashlib.sha256(listing.encode()).hexdigest()[:40]
