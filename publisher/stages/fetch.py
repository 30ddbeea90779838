"""Stage 2: bring exactly the planned base files onto local disk (nothing for a local folder).

Every downloaded file is hashed and compared with the sha256 / git blob id the Hub reported at plan time before
anything reads it (publisher.io.downloads); under --low-disk the quantized components' shards are read by HTTP
range through one running hash per shard, compared when the shard was read to its end (``RemoteWeights``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from publisher.handoffs.plan import Component, Plan
from publisher.io.downloads import download
from publisher.io.integrity import HashedReader, SpillingHashedReader
from publisher.streaming.shards import HubShards, LocalShards

if TYPE_CHECKING:
    from publisher.streaming.shards import HubShards, ShardSource

log = logging.getLogger(__name__)


def fetch(plan: Plan, token: str | None, skip: frozenset[str] = frozenset()) -> Path:
    """Download the planned files at the pinned sha into the huggingface_hub cache, each checked against the Hub's
    hash before use; return the folder.

    Exact file names only, so a root single-file checkpoint (FLUX.1-dev's 23.8 GB flux1-dev.safetensors) or a second
    weight format is never downloaded. ``skip``: files left on the Hub (--low-disk: the quantized components'
    weights, read by HTTP range instead).
    """
    return _download(plan, [f for f in plan.base_files if f not in skip], token)


def _download(plan: Plan, files: list[str], token: str | None) -> Path:
    source = plan.source
    if source.local_dir is not None:
        return source.local_dir

    total = sum(source.sizes.get(f, 0) for f in files)
    log.info("downloading %d files (%.1f MB) of %s, each checked against the Hub's sha256", len(files), total / 1e6,
             source.display)
    return download(source.repo_id, source.sha, files, plan.base_hashes, token)  # type: ignore[arg-type]


def weight_files(plan: Plan, comp: Component) -> list[str]:
    """The base's safetensors files of one quantized component (the index and configs excluded)."""
    prefix = f"{comp.name}/" if comp.name else ""
    return [f for f in plan.base_files
            if f.startswith(prefix) and "/" not in f[len(prefix):] and f.endswith(".safetensors")]


class RemoteWeights:
    """--low-disk: the quantized components' weight files stay on the Hub and are read by HTTP range,
    one tensor at a time (nothing of them is written to disk)."""

    def __init__(self, plan: Plan, token: str | None) -> None:
        self.plan, self.token = plan, token
        self.files = frozenset(f for c in plan.quantized for f in weight_files(plan, c))

    def listing(self, comp: Component) -> list[str]:
        prefix = f"{comp.name}/" if comp.name else ""
        return [f[len(prefix):] for f in weight_files(self.plan, comp)]

    def source(self, comp: Component) -> HubShards:
        src = self.plan.source
        return HubShards(src.repo_id, src.sha, comp.name, self.token, listing=self.listing(comp))  # type: ignore[arg-type]

    def inputs(self, comp: Component, spill_dir: Path) -> HashedShards:
        """The engine's input shards of ``comp`` (streaming.job.ShardInputs)."""
        return HashedShards(self.source(comp), self.plan, comp, spill_dir)

    def download(self, comp: Component) -> Path:
        """For the library path (its loaders read local files): fetch this component's weights after all."""
        log.info("downloading the weights of %s for the library path (--low-disk cannot stream it)", comp.label)
        return _download(self.plan, weight_files(self.plan, comp), self.token)


def base_sources(plan: Plan, base_dir: Path, remote: RemoteWeights | None) -> dict[str, ShardSource]:
    """Where each quantized component's bf16 base is read for the quality figures (one block at a time):
    the downloaded folder, or HTTP range reads under --low-disk."""

    sources: dict[str, ShardSource] = {}
    for comp in plan.quantized:
        local = base_dir / comp.name if comp.name else base_dir
        downloaded = remote is None or any(local.glob("*.safetensors"))
        prefix = f"{comp.name}/" if comp.name else ""
        planned = [f[len(prefix):] for f in weight_files(plan, comp)]  # never a stray file of the folder
        sources[comp.name] = LocalShards(local, planned) if downloaded or remote is None else remote.source(comp)
    return sources


class HashedShards:
    """Each shard of one component read by HTTP range, each byte once, through one running hash in file order; the
    engine may read in another order (the forward pass during quantization), what it reads ahead of the hash waits
    in ``spill_dir`` (integrity.SpillingHashedReader)."""

    def __init__(self, shards: HubShards, plan: Plan, comp: Component, spill_dir: Path) -> None:
        self.shards, self.plan, self.spill_dir = shards, plan, spill_dir
        self.prefix = f"{comp.name}/" if comp.name else ""

    def open(self, name: str) -> BinaryIO:
        src = self.plan.source
        label = f"{self.prefix}{name} of {src.repo_id}@{(src.sha or '')[:12]}"
        return SpillingHashedReader(self.shards.open(name), self.plan.base_hashes[self.prefix + name], label,  # type: ignore[arg-type,return-value]
                                    self.spill_dir)

    def release(self, shard: object) -> None:
        """The engine read the whole shard: compare its running hash with the Hub's before anything is committed
        (a mismatch stops the run; output shards already pre-uploaded belong to no commit)."""

        if isinstance(shard, HashedReader):
            shard.finish(after="nothing was committed")
        if isinstance(shard, SpillingHashedReader) and shard.peak_spilled:
            log.info("%s: read in execution order; at most %.1f MB waited on disk for its hash check", shard.name,
                     shard.peak_spilled / 1e6)
