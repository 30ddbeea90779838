"""Resuming: finished quantized components are reused after an interrupted run, never a damaged one."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX


def _interrupted_run(cli: Any, args: list[str], monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """Run the CLI with the run stopping right after quantization (an error that is not a failed verification,
    which would drop the cache entry), then restore verification."""
    from publisher import job as publish
    from publisher.errors import PublishError

    monkeypatch.setenv("HF_AO_PUBLISH_CACHE", str(cache))
    real_verify = publish.verify

    def interrupted(*a: Any, **k: Any) -> Any:
        raise PublishError("injected: the run stops after quantization")

    monkeypatch.setattr(publish, "verify", interrupted)
    assert cli(*args).exit_code == 1
    monkeypatch.setattr(publish, "verify", real_verify)


@pytest.mark.transfer
@pytest.mark.slow
def test_interrupted_run_reuses_finished_components(cli: Any, tiny_llama_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="publisher")
    out = tmp_path / "out"
    args = [str(tiny_llama_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(out), "--json", *IN_PROCESS, *SKIP_EVAL_AND_MATRIX]
    _interrupted_run(cli, args, monkeypatch, cache)
    assert not (out / "README.md").exists()  # nothing passes for finished
    entries = [p for p in cache.iterdir() if not p.name.endswith(".tmp")]
    assert len(entries) == 1 and (entries[0] / "hf-ao-publish-cache.json").is_file()

    caplog.clear()
    # a card-only option changed on the re-run: the card differs, the quantized bytes do not (the cache is keyed by them)
    result = cli(*args, "--sample-prompt", "a prompt the interrupted run did not have")
    assert result.exit_code == 0, result.output
    assert any("reusing the quantized model" in r.getMessage() for r in caplog.records)
    data = json.loads(result.stdout)
    assert data["verified"] and data["components"][0]["quantized_layers"] == 14
    assert not any(cache.iterdir())  # dropped once the folder is finished


@pytest.mark.slow
def test_damaged_cache_entry_is_quantized_again(cli: Any, tiny_llama_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="publisher")
    args = [str(tiny_llama_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out"), *IN_PROCESS,
            *SKIP_EVAL_AND_MATRIX]
    _interrupted_run(cli, args, monkeypatch, cache)
    entry = next(cache.iterdir())
    shard = entry / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.unlink()  # a new inode: the damage must not reach anything else linked to the old one
    shard.write_bytes(bytes(data))
    caplog.clear()
    result = cli(*args)
    assert result.exit_code == 0, result.output
    messages = [r.getMessage() for r in caplog.records]
    assert any("is damaged" in m for m in messages) and not any("reusing" in m for m in messages)


@pytest.mark.slow
def test_failed_verification_drops_the_cache_entry(cli: Any, tiny_llama_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What failed verification is never reused by a later run."""
    from publisher import job as publish
    from publisher.errors import VerificationError

    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_AO_PUBLISH_CACHE", str(cache))

    def failing(*a: Any, **k: Any) -> Any:
        raise VerificationError("injected: a load path failed")

    monkeypatch.setattr(publish, "verify", failing)
    result = cli(str(tiny_llama_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out"),
                 *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 1 and "injected: a load path failed" in result.stderr
    assert cache.is_dir() and not any(cache.iterdir())
