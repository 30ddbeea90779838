"""Plan-time checks of every base file the run will parse, before any weight is downloaded and before any repo
exists (docs/reliability.md, "Hostile input"):

- every JSON file we parse (``model_index.json``, every ``*config.json``, ``*.safetensors.index.json``) is within
  its size limit (from the file listing: an oversized one is never fetched), UTF-8, valid JSON and an object;
- every safetensors file of the plan passes the library's header rules (``streaming.validate``): read from disk
  for a local base, by one or two small HTTP range reads per file for a Hub base;
- a sharded checkpoint's index agrees with its shards: every shard it names ends in ``.safetensors``, no shard
  of its naming pattern is left out, every tensor it lists is in the shard it names, and no tensor is in two
  shards.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from publisher.errors import InputError
from publisher.handoffs.plan import Source
from publisher.io import jsonfile
from publisher.io.localfiles import open_regular
from publisher.stages.source import base_roots, read_json
from publisher.streaming.safetensors_io import read_header
from publisher.streaming.shards import RangeFile
from publisher.streaming.validate import HeaderEntry

Header = tuple[dict[str, str], dict[str, HeaderEntry]]  # (``__metadata__``, tensors by name) of one safetensors file


def check_base(source: Source, files: Sequence[str], token: str | None) -> dict[str, Header]:
    """Every check above; returns the parsed header of each safetensors file (for stages/prequantized.py)."""
    for f in files:  # sizes first: nothing is fetched while an oversized file could still fail the run
        limit = jsonfile.limit_for(f)
        if jsonfile.parsed_here(f) and source.sizes.get(f, 0) > limit:
            raise jsonfile.too_big(source.where(f), source.sizes[f], limit)
    for f in files:
        if jsonfile.parsed_here(f):
            read_json(source, f, token)
    weights = [f for f in files if f.endswith(".safetensors")]
    if source.local_dir is not None:
        headers = {f: _header(source, f, token) for f in weights}
    else:  # a few small range reads per file; concurrent, for repos of hundreds of shards
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=8) as pool:
            headers = dict(zip(weights, pool.map(lambda f: _header(source, f, token), weights)))
    for f in files:
        if f.endswith(".safetensors.index.json"):
            _check_index(source, f, {k: v[1] for k, v in headers.items()}, token)
    return headers


def _header(source: Source, path: str, token: str | None) -> Header:
    where = source.where(path)
    if source.local_dir is not None:
        with open_regular(source.local_dir / path, base_roots(source)) as local:
            return read_header(local, where)
    from huggingface_hub import hf_hub_url


    url = hf_hub_url(source.repo_id, path, revision=source.sha)  # type: ignore[arg-type]
    with RangeFile(url, token, where) as remote:
        return read_header(remote, where)  # type: ignore[arg-type]


def _check_index(source: Source, index: str, headers: dict[str, dict[str, HeaderEntry]], token: str | None) -> None:
    folder = index.rpartition("/")[0]
    prefix = f"{folder}/" if folder else ""
    where = source.where(index)
    mapping = jsonfile.weight_map(read_json(source, index, token), where)
    named = set(mapping.values())
    odd = sorted(n for n in named if not n.endswith(".safetensors"))
    if odd:
        raise InputError(f"{where} names the shard {odd[0]!r}, which is not a .safetensors file; only safetensors "
                         "checkpoints are read: fix the index", kind="index")
    stem = Path(index).name.removesuffix(".safetensors.index.json")
    pattern = re.compile(re.escape(stem) + r"-\d+-of-\d+\.safetensors")
    stray = sorted(f for f in source.files if f.startswith(prefix) and "/" not in f[len(prefix):]
                   and pattern.fullmatch(f[len(prefix):]) and f[len(prefix):] not in named)
    if stray:
        raise InputError(f"{source.where(stray[0])} is a shard that {where} does not name; a loader that reads the "
                         "folder and one that reads the index would see different checkpoints: add it to the index or "
                         "remove it", kind="index")
    owner: dict[str, str] = {}
    for shard in sorted(named):
        for tensor in headers.get(prefix + shard, {}):
            if tensor in owner:
                raise InputError(f"tensor {tensor!r} is in two shards of {where}: {owner[tensor]} and {shard}; which one "
                                 "a loader reads depends on the loader: fix the checkpoint", kind="index")
            owner[tensor] = shard
    for tensor, shard in sorted(mapping.items()):
        if owner.get(tensor) != shard:
            found = f"it is in {owner[tensor]}" if tensor in owner else "no shard holds it"
            raise InputError(f"{where} puts tensor {tensor!r} in {shard}, but {found}; fix the index", kind="index")
