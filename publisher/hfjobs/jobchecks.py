"""The checks a remote publish runs on this machine before anything is submitted or uploaded.

A wrong flavor costs nothing: it is refused here in seconds, with the flavors that fit. Then the same plan as a
local run (base, components, target, write access), except that the hardware is the flavor's, not this
machine's, and the token must also be allowed to start Jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from publisher.errors import TargetError, UsageError
from publisher.flavors import Flavor, find
from publisher.io.tokens import TokenRights
from publisher.recipes import Recipe

log = logging.getLogger(__name__)

TOKENS_URL = "https://huggingface.co/settings/tokens"


def fitting(recipe: Recipe, flavors: Sequence[Flavor], count: int = 2) -> list[Flavor]:
    """The smallest flavors on which one job can quantize, run and benchmark ``recipe``."""
    return [f for f in flavors if all(needs.fits(f) for needs in recipe.job_needs.values())][:count]


def _pick(recipe: Recipe, flavors: Sequence[Flavor]) -> str:
    names = ", ".join(f.describe() for f in fitting(recipe, flavors)) or "none of the listed flavors"
    return f"pick {names} (`hf-ao-publish recipes` lists the flavors per recipe)"


def check_flavor(recipes: Sequence[Recipe], name: str, flavors: Sequence[Flavor]) -> Flavor:
    """The flavor, if it can make and run every recipe; UsageError (exit 2) otherwise."""
    flavor = find(name, flavors)
    if flavor is None:
        raise UsageError(f"unknown Jobs flavor {name!r} for --on-hf-jobs; choose one of: "
                         f"{', '.join(f.name for f in flavors)} (`hf jobs hardware` shows them with prices)")
    has = f"{flavor.name} has no GPU" if flavor.gpu is None else f"{flavor.describe()} is below it"
    if flavor.gpu is not None and flavor.capability is None:
        raise UsageError(f"the compute capability of {flavor.name}'s GPU ({flavor.gpu}) is unknown to hf-ao-publish, so "
                         "no recipe can be checked against it; pick a flavor listed by `hf-ao-publish recipes`")
    for recipe in recipes:
        make, run = recipe.job_needs["quantize"], recipe.run
        if not make.fits(flavor):
            raise UsageError(f"{recipe.name} needs a {make.describe()} to quantize and {has}; {_pick(recipe, flavors)}")
        if flavor.gpu is not None and run.cuda and not run.fits(flavor):
            raise UsageError(f"{recipe.name} runs only on a {run.describe()} and {has}: the job would pay for a GPU it "
                             f"cannot use; {_pick(recipe, flavors)}")
        if flavor.gpu is None and run.cuda:
            log.warning("%s runs only on a %s: on %s it is made on the CPU and verified there, without a GPU forward or "
                        "GPU figures for the card (%s)", recipe.name, run.describe(), flavor.name, _pick(recipe, flavors))
        if flavor.gpu is not None and not run.cuda:
            cpu = next((f.name for f in flavors if f.gpu is None), "a CPU flavor")
            log.warning("%s is quantized, verified and measured on the CPU: the GPU of %s stays idle; %s is enough",
                        recipe.name, flavor.name, cpu)
    if flavor.gpus > 1:
        log.warning("hf-ao-publish uses one GPU; %s has %d", flavor.name, flavor.gpus)
    return flavor


def check_token_can_run_jobs(who: dict[str, Any], namespace: str) -> None:
    """A read token cannot publish; a fine-grained token needs the job.write permission on ``namespace``."""

    rights = TokenRights.of(who)
    if rights.role == "read":
        raise TargetError(f"the Hub token is read-only; a remote publish needs a token that can write and start Jobs "
                          f"(create one at {TOKENS_URL}) and set HF_TOKEN")
    reason = rights.require("job.write", namespace, f"start Jobs in {namespace}")
    if reason is not None:
        raise TargetError(reason)
