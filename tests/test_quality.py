"""The quality evaluation's parts on fixture data (publisher/quality/): option parsing and the gate, PSNR/SSIM and the
grid image, the CPU budget's choice of size and steps, perplexity through the block-by-block machinery (against
a whole model's logits, and a model against itself), the greedy continuation, and the card's quality sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from publisher.errors import QualityError, UsageError
from publisher.quality import spec


def test_options_parse_and_name_what_is_wrong() -> None:
    assert spec.DatasetSpec.parse("Salesforce/wikitext:wikitext-2-raw-v1:test") == spec.DatasetSpec(
        "Salesforce/wikitext", "wikitext-2-raw-v1", "test")
    assert spec.DatasetSpec.parse("me/text") == spec.DatasetSpec("me/text", None, "test")
    assert spec.DatasetSpec.parse("me/text:cfg:validation").text() == "me/text:cfg:validation"
    assert spec.Bound.parse("ppl-recovery=95%") == spec.Bound("ppl-recovery", 95.0)
    assert spec.Bound.parse("PSNR=30dB") == spec.Bound("psnr", 30.0)
    s = spec.settings(None, 512, "15m", ("ssim=0.9",), "a cat", 64, 2)
    assert s.budget_s == 900 and not s.explicit_dataset and s.dataset.text() == spec.DEFAULT_DATASET
    assert spec.settings("me/t", 512, "90", (), None, 64, 2).explicit_dataset
    assert spec.seconds("1h") == 3600 and spec.seconds("0") == 0 and spec.seconds("soon") is None
    for args, message in [
        (("me/t:a:b:c", 16, "1m", ()), "--eval-dataset 'me/t:a:b:c' is not REPO[:CONFIG][:SPLIT]"),
        ((None, 16, "1m", ("ppl=3",)), "--min-quality 'ppl=3' is not METRIC=VALUE with METRIC one of ppl-recovery, psnr, ssim"),
        ((None, 16, "1m", ("psnr=high",)), "'high' is not a number"),
        ((None, 16, "later", ()), "--eval-budget 'later' is not a duration"),
        ((None, 16, "0", ("psnr=20",)), "--min-quality needs the quality evaluation, which --eval-budget 0 turns off"),
        (("me/t", 16, "0", ()), "--eval-dataset needs the quality evaluation"),
    ]:
        with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
            spec.settings(*args, None, 64, 2)  # type: ignore[misc]


def test_gate_names_the_figure_and_the_bound() -> None:
    bounds = (spec.Bound("ppl-recovery", 95.0),)
    spec.gate(bounds, {"ppl-recovery": 99.2}, {}, "int8wo")  # above: no error
    with pytest.raises(QualityError, match=r"int8wo: ppl-recovery is 58.43%, below --min-quality ppl-recovery=95; nothing"):
        spec.gate(bounds, {"ppl-recovery": 58.4337}, {}, "int8wo")
    with pytest.raises(QualityError, match=r"cannot be checked: ppl-recovery was not measured \(the dataset x could not"):
        spec.gate(bounds, {"ppl-recovery": None}, {"ppl-recovery": "the dataset x could not be read"}, "int8wo")
    spec.check_applicable(bounds, spec.CAUSAL_LM, "m")
    with pytest.raises(UsageError, match="psnr applies to a pipeline, and m is a causal language model; use ppl-recovery"):
        spec.check_applicable((spec.Bound("psnr", 1),), spec.CAUSAL_LM, "m")
    with pytest.raises(UsageError, match="and m is neither; drop --min-quality"):
        spec.check_applicable(bounds, None, "m")
    assert spec.model_kind("transformers", "LlamaForCausalLM") == spec.CAUSAL_LM
    assert spec.model_kind("transformers", "BertModel") is None and spec.model_kind("pipeline", "") == spec.PIPELINE


def test_psnr_ssim_and_the_grid_image() -> None:
    import numpy as np
    from PIL import Image

    from publisher.quality import images

    rng = np.random.default_rng(0)
    a = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    noisy = np.clip(np.asarray(a, dtype=np.int16) + rng.integers(-8, 9, (64, 64, 3)), 0, 255).astype(np.uint8)
    b = Image.fromarray(noisy)
    assert images.psnr(a, a) == float("inf") and images.ssim(a, a) == pytest.approx(1.0)
    mse = ((np.asarray(a, float) - noisy) ** 2).mean()
    assert images.psnr(a, b) == pytest.approx(10 * np.log10(255**2 / mse))
    assert 0.99 < images.ssim(a, b) < 1  # noise of +-8 on pixels of high variance: structure kept
    # skimage 0.26.0's structural_similarity(x, y, channel_axis=2, gaussian_weights=True, sigma=1.5,
    # use_sample_covariance=False, data_range=255) on these two gave 0.4110124807999728 (PSNR 26.65044466979081)
    ramp = (np.add.outer(np.arange(64), np.arange(64)) * 2 % 256).astype(np.uint8)
    x = np.stack([ramp, ramp.T, 255 - ramp], -1)
    y = np.clip(x.astype(np.int16) + np.random.default_rng(0).integers(-20, 21, x.shape), 0, 255).astype(np.uint8)
    assert images.ssim(x, y) == pytest.approx(0.4110124807999728, abs=1e-12)
    assert images.psnr(x, y) == pytest.approx(26.65044466979081, abs=1e-12)
    flat = Image.new("RGB", (64, 64), (100, 100, 100))
    assert images.ssim(flat, flat) == pytest.approx(1.0)
    assert images.ssim(a, Image.fromarray(255 - np.asarray(a))) < 0  # the negative image anti-correlates
    with pytest.raises(ValueError, match="differ in size"):
        images.ssim(a, Image.new("RGB", (32, 64)))
    g = images.grid([(a, b), (b, a), (a, a)])
    assert g.size == (128, 192)
    assert np.array_equal(np.asarray(g)[64:128, 64:], np.asarray(a))  # row 2, right: the second pair's quantized image


def test_budget_picks_the_largest_size_then_steps_that_fit() -> None:
    from publisher.quality import grid

    flux = grid.Cost(denoiser_params=11_900_000_000, other_params=4_900_000_000 + 84_000_000,
                     read_bytes_per_call=23_800_000_000, flops=2e11, read_rate=2e8)
    assert grid.choose(flux, 900, 6, 1024, 28) is None  # FLUX.1-dev on a 2-core CPU: no grid within 15 min
    small = grid.Cost(denoiser_params=1_000_000, other_params=1_000_000, read_bytes_per_call=0, flops=1e10, read_rate=1e9)
    size, steps, seconds = grid.choose(small, 900, 6, 1024, 28)  # type: ignore[misc]
    assert (size, steps) == (1024, 28) and seconds == pytest.approx(grid.estimate(small, 1024, 28, 6))
    mid = grid.Cost(denoiser_params=100_000_000, other_params=0, read_bytes_per_call=0, flops=1e11, read_rate=1e9)
    size, steps, _ = grid.choose(mid, 60, 6, 1024, 28)  # type: ignore[misc]
    assert grid.estimate(mid, size, steps, 6) <= 60 < grid.estimate(mid, grid.CPU_SIZES[grid.CPU_SIZES.index(size) - 1], 2, 6)
    assert grid.choose(small, 900, 6, 64, 2)[:2] == (64, 2)  # type: ignore[index]  # never above --sample-size/steps


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Any:
    from publisher.quality import sources
    from publisher.streaming.shards import LocalShards
    from publisher.verify.streaming import load_config

    src = LocalShards(tiny_llama_dir, ["model.safetensors"])
    return src, load_config(src), sources.saved(src)


def test_perplexity_block_by_block_is_the_whole_model_s_and_a_model_against_itself_recovers_100(
        llama: Any, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    import torch
    from transformers import LlamaForCausalLM

    from publisher.quality import lm
    from publisher.verify import streaming

    src, config, weights = llama
    ids = torch.randint(3, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(lm, "HEAD_CHUNK", 16)  # several chunks of positions
    monkeypatch.setattr(streaming, "BLOCK_BUDGET", 64 * 1024)  # several blocks (each Linear its own)
    nll = lm.nll_after_pass(weights, "transformers", "LlamaForCausalLM", config, ids)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = model(ids).logits.float()
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert nll.shape == (2, 40) and torch.allclose(nll[:, :-1], ref, atol=1e-5) and not nll[:, -1].any()
    assert lm.perplexity(nll) == pytest.approx(math.exp(float(ref.double().mean())))
    again = lm.nll_after_pass(weights, "transformers", "LlamaForCausalLM", config, ids)
    figures = lm.LmFigures("x", base_ppl=lm.perplexity(nll), quantized_ppl=lm.perplexity(again))
    assert figures.recovery == 100.0  # the same model on both sides: its own figure


def test_greedy_block_by_block_is_generate_s(llama: Any, tiny_llama_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from publisher.quality import lm

    src, config, weights = llama
    prompts = ["the cat sat", "hello"]
    got = lm.greedy(weights, "transformers", "LlamaForCausalLM", config, tiny_llama_dir, prompts, 6)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    for prompt, text in zip(prompts, got):  # one prompt at a time, no padding: the same tokens
        batch = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert text == tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def test_requantized_weights_are_the_engine_s(llama: Any, tiny_llama_dir: Path) -> None:
    """A folder whose shards were uploaded and deleted is evaluated on the base quantized again as it is read: the
    same tensors the streaming engine saved (digest for digest)."""
    from publisher import recipes
    from publisher.loadpath import tensor_digest
    from publisher.quality import sources
    from publisher.streaming.shards import TensorReader, build_index

    src, _, _ = llama
    requant = sources.Requantize("transformers", "LlamaForCausalLM", tiny_llama_dir, recipes.get("int8wo"), [])
    with TensorReader(src, build_index(src)) as reader:
        weight = requant.quantized("model.layers.0.mlp.up_proj.weight", reader.read("model.layers.0.mlp.up_proj.weight"))
        norm = requant.quantized("model.norm.weight", reader.read("model.norm.weight"))
    assert type(weight).__name__ == "Int8Tensor" and type(norm).__name__ in ("Tensor", "Parameter")
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Linear(128, 256, bias=False, dtype=torch.bfloat16)
    with TensorReader(src, build_index(src)) as reader:
        linear.weight.data = reader.read("model.layers.0.mlp.up_proj.weight").to(torch.bfloat16)
    quantize_(linear, Int8WeightOnlyConfig())
    assert tensor_digest(linear.weight) == tensor_digest(weight)


def test_dataset_that_cannot_be_read(hub: Any) -> None:
    from publisher.errors import SourceError
    from publisher.quality.text import read_text

    missing = spec.DatasetSpec("nobody/no-such-text", None, "test")
    got = read_text(missing, 64, None, explicit=False)
    assert got.text is None and "nobody/no-such-text was not found on this Hub" in got.reason
    with pytest.raises(SourceError, match=r"--eval-dataset nobody/no-such-text:test: nobody/no-such-text was not found .*"
                                          r"name a readable text dataset"):
        read_text(missing, 64, None, explicit=True)


def test_dataset_rows_and_windows(wikitext_repo: str, tiny_llama_dir: Path) -> None:
    from publisher.quality.text import read_text, windows

    got = read_text(spec.DatasetSpec.parse(spec.DEFAULT_DATASET), 300, None, explicit=True)
    assert got.text is not None and got.text.startswith("\n\n = Section 0 = \n") and len(got.text) >= 300 * 8
    ids = windows(got.text, tiny_llama_dir, 300, 256)
    assert tuple(ids.shape) == (1, 256)  # the position table (256) bounds a window; 300 tokens make one whole window
    assert tuple(windows(got.text * 4, tiny_llama_dir, 600, 128).shape) == (4, 128)
    assert tuple(windows("the cat sat on the red dog and the photo of a cat" * 2, tiny_llama_dir, 600, 256).shape) == (1, 26)
    with pytest.raises(ValueError, match="holds only 3 tokens, fewer than 16"):
        windows("the cat sat", tiny_llama_dir, 600, 256)
