"""The quality evaluation through the real CLI on the loopback Hub (issue 24): a tiny Llama trained on the fixture
dataset (perplexity, continuation, the gate, a damaged quantization) and the tiny FLUX pipeline (the grid), each
published as usual and with --low-disk; the figures must agree between the two."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS

EVAL = ["--eval-budget", "10m"]
SMALL = ["--sample-steps", "2", "--sample-size", "64"]


def _card(repo_id: str) -> str:
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, "README.md")).read_text()


def _exists(repo_id: str) -> bool:
    from huggingface_hub import HfApi

    return HfApi().repo_exists(repo_id)


@pytest.mark.slow
def test_llama_perplexity_continuation_and_gate(cli: Any, trained_llama_repo: str, wikitext_repo: str) -> None:
    figures = {}
    for mode, extra in (("plain", []), ("low-disk", ["--low-disk"])):
        target = f"alice/q-llama-{mode}"
        result = cli(trained_llama_repo, "--quant", "int8wo", "--repo-id", target, *EVAL, "--eval-tokens", "512",
                     "--min-quality", "ppl-recovery=95", "--json", *extra, *IN_PROCESS, token="tok_alice")
        assert result.exit_code == 0, result.output
        ev = json.loads(result.stdout)["evaluation"]
        assert ev["kind"] == "causal language model" and ev["dataset"] == "Salesforce/wikitext:wikitext-2-raw-v1:test"
        assert ev["windows"] == 2 and ev["window"] == 256 and ev["tokens"] == 510  # the position table is 256
        assert ev["base_ppl"] < 20 and 95 <= ev["recovery_percent"] <= 105  # a trained model, a good quantization
        assert ev["where"].startswith("during the quantization pass") and ev["new_tokens"] == 16
        assert len(ev["base_text"]) == len(ev["quantized_text"]) == 3 and any(ev["base_text"])
        for role in ("base", "quantized"):  # a stderr line per new token of each model
            assert f"continuation: {role} model, token 1 of 16 (3 prompts): " in result.stderr
            assert f"continuation: {role} model, token 16 of 16 (3 prompts): " in result.stderr
        card = _card(target)
        assert card.index("## Summary") < card.index("## What was quantized") < card.index("## Quality")
        assert f"**{ev['recovery_percent']:.2f}% recovery**" in card.split("## What was quantized")[0]
        assert f"| bf16 base | {ev['base_ppl']:.4f} |" in card and "### Greedy continuation" in card
        assert "| The capital of France is |" in card and "the first 512 tokens of `Salesforce/wikitext" in card
        figures[mode] = ev
    # the same computation either way: --low-disk reads the base by HTTP range, and the quantized weights of its
    # continuation are the base's quantized again as they are read (the shards were uploaded and deleted)
    for key in ("base_ppl", "quantized_ppl", "base_text", "quantized_text"):
        assert figures["plain"][key] == figures["low-disk"][key], key

    from publisher.testing.evaldata import zeroed_scales

    # verifies bit for bit (the damage is in the saved bytes); only the gate can refuse it. The library path has no
    # in-pass observer: its perplexity runs after the pass, block by block from the saved files
    with zeroed_scales():
        bad = cli(trained_llama_repo, "--quant", "int8wo", "--repo-id", "alice/q-llama-bad", *EVAL, "--eval-tokens", "512",
                  "--min-quality", "ppl-recovery=95", "--engine", "library", "--json", *IN_PROCESS, token="tok_alice")
    assert bad.exit_code == 1, bad.output
    assert "int8wo: ppl-recovery is " in bad.stderr and "%, below --min-quality ppl-recovery=95; nothing was pushed" in bad.stderr
    assert not _exists("alice/q-llama-bad")
    damaged = json.loads(bad.stdout)["evaluation"]
    assert damaged["where"] == "after the quantization pass, block by block" and damaged["base_ppl"] == figures["plain"]["base_ppl"]
    assert damaged["recovery_percent"] < 95
    assert "perplexity: window 1 of 2 (256 tokens, base and quantized): " in bad.stderr  # a line per window
    assert "perplexity: window 2 of 2 (256 tokens, base and quantized): " in bad.stderr


@pytest.mark.slow
def test_flux_grid_whole_and_offloaded(cli: Any, flux_repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import hf_hub_download
    from PIL import Image

    from publisher.testing.evaldata import place_lpips_trunk

    # LPIPS' AlexNet where torchvision's download would have put it (a seeded stand-in: nothing is downloaded); the
    # session's own TORCH_HOME stays empty, so the other publishes (the golden cards) say LPIPS was not computed
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    place_lpips_trunk(tmp_path / "torch_home")
    grids = {}
    for mode, extra in (("plain", []), ("low-disk", ["--low-disk", "--eval-full-images"])):
        target = f"alice/q-flux-{mode}"
        result = cli(flux_repo, "--quant", "int8wo", "--repo-id", target, *EVAL, *SMALL, "--min-quality", "psnr=20",
                     "--min-quality", "ssim=0.5", "--min-quality", "lpips=0.5", "--json", *extra, *IN_PROCESS,
                     token="tok_alice")
        assert result.exit_code == 0, result.output
        assert "Loading pipeline components" not in result.stderr and "it/s]" not in result.stderr  # no library bars
        ev = json.loads(result.stdout)["evaluation"]
        assert ev["kind"] == "pipeline" and (ev["size"], ev["steps"], ev["device"]) == (64, 2, "cpu")
        assert len(ev["psnr"]) == len(ev["ssim"]) == 3 and ev["image"] == "quality_grid.jpg" and not ev["cut"]
        assert ev["mode"].startswith("whole" if mode == "plain" else "offloaded")
        assert ("quantized again" in ev["quantized_from"]) == (mode == "low-disk")
        path = Path(hf_hub_download(target, "quality_grid.jpg"))
        image = Image.open(path)  # labelled, card-sized: 64 px images shown at 256 px, two columns, three rows
        assert image.format == "JPEG" and image.width == 2 * 256 + 24 and 3 * 256 < image.height < 3 * 256 + 300
        assert path.stat().st_size <= 2_000_000
        card = _card(target)
        assert card.index("](quality_grid.jpg)") < card.index("## Summary")  # the grid leads the card
        assert "The size and steps asked (`--sample-size`, `--sample-steps`), within `--eval-budget` (600 s)" in card
        assert len(ev["lpips"]) == 3 and all(0 <= v < 0.5 for v in ev["lpips"]) and not ev["lpips_reason"]
        assert "Metrics: PSNR, SSIM and LPIPS (v0.1, AlexNet) against the base's image." in card
        assert "| prompt | seed | PSNR dB | SSIM | LPIPS |" in card and "| a photo of a cat | 0 |" in card
        assert f"LPIPS {max(ev['lpips']):.4f} (the worst of 3 images" in card
        full = [f"quality/prompt-{i}-{role}.png" for i in (1, 2, 3) for role in ("base", "quantized")]
        assert ev["full_images"] == (full if mode == "low-disk" else [])
        if mode == "low-disk":  # --eval-full-images: each image at its own size, lossless, linked from the card
            assert f"[{full[0]}]({full[0]})" in card
            assert Image.open(hf_hub_download(target, full[1])).size == (64, 64)
        grids[mode] = (ev["psnr"], ev["ssim"], ev["lpips"], image.tobytes())
    assert grids["plain"] == grids["low-disk"]  # offloaded block by block gives the whole pipeline's images

    out = tmp_path / "out"
    result = cli(flux_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(out), *EVAL, *SMALL,
                 "--min-quality", "psnr=1000", *IN_PROCESS)
    assert result.exit_code == 1 and "int8wo: psnr is " in result.stderr and "below --min-quality psnr=1000" in result.stderr
    assert not any(out.iterdir()) if out.exists() else True  # nothing half-written


@pytest.mark.slow
def test_quality_options_fail_before_any_download(cli: Any, llama_repo: str, flux_repo: str) -> None:
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", *EVAL, "--min-quality", "psnr=30")
    assert result.exit_code == 2 and "psnr applies to a pipeline, and meta/tiny-llama (LlamaForCausalLM) is a causal " \
                                      "language model; use ppl-recovery" in result.stderr
    result = cli(flux_repo, "--quant", "int8wo", "--no-push", *EVAL, "--min-quality", "ppl-recovery=90")
    assert result.exit_code == 2 and "ppl-recovery applies to a causal language model" in result.stderr
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", *EVAL, "--eval-dataset", "nobody/no-text")
    assert result.exit_code == 1 and "--eval-dataset nobody/no-text:test: nobody/no-text was not found on" in result.stderr
    assert "downloading" not in result.stderr  # refused before any base file was fetched
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", "--eval-budget", "0", "--min-quality", "ppl-recovery=90")
    assert result.exit_code == 2 and "--eval-budget 0 turns off" in result.stderr
    # a bound on LPIPS whose weights are not here (the session's TORCH_HOME is empty): said before any download
    result = cli(flux_repo, "--quant", "int8wo", "--no-push", *EVAL, "--min-quality", "lpips=0.1")
    assert result.exit_code == 2 and "--min-quality lpips=0.1 cannot be checked: for LPIPS, its weights were not found: " \
                                      "torchvision's AlexNet weights" in result.stderr
    assert "downloading" not in result.stderr
