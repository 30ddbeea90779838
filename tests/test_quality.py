"""The quality evaluation's parts on fixture data (publisher/quality/): option parsing and the gate, PSNR/SSIM and the
grid image, the CPU budget's choice of size and steps, perplexity through the block-by-block machinery (against
a whole model's logits, and a model against itself), the greedy continuation, and the card's quality sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from publisher.errors import QualityError, UsageError
from publisher.quality import options


def test_options_parse_and_name_what_is_wrong() -> None:
    assert options.DatasetSpec.parse("Salesforce/wikitext:wikitext-2-raw-v1:test") == options.DatasetSpec(
        "Salesforce/wikitext", "wikitext-2-raw-v1", "test")
    assert options.DatasetSpec.parse("me/text") == options.DatasetSpec("me/text", None, "test")
    assert options.DatasetSpec.parse("me/text:cfg:validation").text() == "me/text:cfg:validation"
    assert options.Bound.parse("ppl-recovery=95%") == options.Bound("ppl-recovery", 95.0)
    assert options.Bound.parse("PSNR=30dB") == options.Bound("psnr", 30.0)
    s = options.settings(None, 512, "15m", ("ssim=0.9",), "a cat", 64, 2)
    assert s.budget_s == 900 and not s.explicit_dataset and s.dataset.text() == options.DEFAULT_DATASET
    assert s.budget_for(40_000_000_000) == 900  # a duration given is the bound, whatever the model
    auto = options.settings(None, 512, options.DEFAULT_BUDGET, (), None, 64, 2)
    assert options.DEFAULT_BUDGET == "auto" and auto.budget_s is None and auto.enabled and auto.to_dict()["budget_s"] == "auto"
    assert auto.budget_for(5_000_000) == pytest.approx(5.25)  # a tiny model: seconds
    assert auto.budget_for(2_500_000_000) == pytest.approx(130)  # Llama-3.2-1B's bf16 weights: about two minutes
    assert auto.budget_for(34_000_000_000) == 600  # FLUX.1-dev: at most ten minutes
    assert options.settings(None, 512, "AUTO", (), None, 64, 2).budget_s is None
    assert not options.settings(None, 512, "0", (), None, 64, 2).enabled
    assert options.settings("me/t", 512, "90", (), None, 64, 2).explicit_dataset
    assert options.seconds("1h") == 3600 and options.seconds("0") == 0 and options.seconds("soon") is None
    for args, message in [
        (("me/t:a:b:c", 16, "1m", ()), "--eval-dataset 'me/t:a:b:c' is not REPO[:CONFIG][:SPLIT]"),
        ((None, 16, "1m", ("ppl=3",)), "--min-quality 'ppl=3' is not METRIC=VALUE with METRIC one of ppl-recovery, psnr, ssim"),
        ((None, 16, "1m", ("psnr=high",)), "'high' is not a number"),
        ((None, 16, "later", ()), "--eval-budget 'later' is not a duration"),
        ((None, 16, "0", ("psnr=20",)), "--min-quality needs the quality evaluation, which --eval-budget 0 turns off"),
        (("me/t", 16, "0", ()), "--eval-dataset needs the quality evaluation"),
    ]:
        with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
            options.settings(*args, None, 64, 2)  # type: ignore[misc]


def test_gate_names_the_figure_and_the_bound() -> None:
    bounds = (options.Bound("ppl-recovery", 95.0),)
    options.gate(bounds, {"ppl-recovery": 99.2}, {}, "int8wo")  # above: no error
    with pytest.raises(QualityError, match=r"int8wo: ppl-recovery is 58.43%, below --min-quality ppl-recovery=95; nothing"):
        options.gate(bounds, {"ppl-recovery": 58.4337}, {}, "int8wo")
    with pytest.raises(QualityError, match=r"cannot be checked: ppl-recovery was not measured \(the dataset x could not"):
        options.gate(bounds, {"ppl-recovery": None}, {"ppl-recovery": "the dataset x could not be read"}, "int8wo")
    options.check_applicable(bounds, options.CAUSAL_LM, "m")
    with pytest.raises(UsageError, match="psnr applies to a pipeline, and m is a causal language model; use ppl-recovery"):
        options.check_applicable((options.Bound("psnr", 1),), options.CAUSAL_LM, "m")
    with pytest.raises(UsageError, match="and m is neither; drop --min-quality"):
        options.check_applicable(bounds, None, "m")
    assert options.model_kind("transformers", "LlamaForCausalLM") == options.CAUSAL_LM
    assert options.model_kind("transformers", "BertModel") is None and options.model_kind("pipeline", "") == options.PIPELINE


def test_psnr_ssim_and_the_grid_image(tmp_path: Path) -> None:
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
    from publisher.quality.grid import GridFigures

    figures = GridFigures(prompts=["a cat", "a bicycle " * 20, "fruit"], seeds=[0, 1, 2], psnr=[30.0, float("inf"), 25.5],
                          ssim=[0.91, 1.0, 0.8], lpips=[0.05, 0.0, 0.12])
    g = images.grid([(a, b), (b, a), (a, a)], figures, "int8wo")
    cell = images.CELL_MIN  # a 64 px image is shown enlarged (nearest neighbour: its pixels stay visible)
    assert g.width == 2 * cell + 3 * 8 and cell * 3 < g.height < cell * 3 + 300  # two columns, three labelled rows
    pixels = np.asarray(g)
    ys, xs = np.nonzero((pixels < 128).all(axis=2)[:30])  # the column heads: dark text in the first rows
    assert xs.min() < cell and xs.max() > cell  # over both columns
    enlarged = np.asarray(a.resize((cell, cell), Image.Resampling.NEAREST))
    top = next(y for y in range(g.height) if np.array_equal(pixels[y, 8:8 + cell], enlarged[0]))
    assert np.array_equal(pixels[top:top + cell, 8:8 + cell], enlarged)  # row 1, left: the base image, unchanged
    path = tmp_path / "grid.jpg"
    big = [(Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8)),) * 2] * 3  # noise: JPEG's worst
    size = images.save_grid(images.grid(big, GridFigures(prompts=["a"] * 3, seeds=[0, 1, 2], psnr=[20.0] * 3, ssim=[0.5] * 3), "int8wo"), path)
    assert size == path.stat().st_size <= images.MAX_BYTES and Image.open(path).format == "JPEG"
    assert Image.open(path).size == (2 * images.CELL_MAX + 24, Image.open(path).height)  # reduced to card size


def test_the_timing_model_counts_attention_and_chooses_the_largest_that_fits() -> None:
    from publisher.quality import budget

    # a denoiser whose step costs 1e-4 s per token and 1e-7 s per token pair (attention), 512 text tokens, and
    # 16 image tokens per 64x64 px (a VAE of 8 and a 2x2 patch); a decode of 1e-5 s per latent pixel
    def call(size: int) -> budget.Call:
        t = 512 + 16 * (size // 64) ** 2
        p = (size // 8) ** 2
        return budget.Call(steps=[(t, 1e-4 * t + 1e-7 * t * t)], decodes=[(p, 1e-5 * p)],
                           seconds=0.5 + 1e-4 * t + 1e-7 * t * t + 1e-5 * p)
    model = budget.Model.fit([(64, call(64)), (128, call(128))])
    for size in (64, 256, 1024):  # extrapolated from 64 and 128 px, attention's square included
        assert model.per_image(size, 1) == pytest.approx(call(size).seconds, rel=1e-6)
    assert model.per_image(1024, 28) > 20 * model.per_image(128, 28)  # not the linear rule's 4x per doubling
    sizes, steps = [1024, 768, 512, 384, 256, 128, 64], [28, 8, 4, 2]
    def need(size: int, n_steps: int) -> float:  # three pairs, the quantized pipeline 1.5x slower, 1 s to load it
        return 3 * 2.5 * model.per_image(size, n_steps) + 1.0

    choice = budget.choose(model, 20, sizes, steps, 3, 1.5, 1.0)
    assert choice is not None and choice.prompts == 3 and choice.estimate_s == pytest.approx(need(choice.size, choice.steps))
    assert choice.estimate_s <= budget.SAFETY * 20 and choice.size < 1024
    assert need(sizes[sizes.index(choice.size) - 1], 2) > budget.SAFETY * 20  # the next size up does not fit at all
    if choice.steps < 28:  # nor more steps at this size
        assert need(choice.size, steps[steps.index(choice.steps) - 1]) > budget.SAFETY * 20
    assert budget.choose(model, 10_000, sizes, steps, 3, 1.5, 1.0) == budget.Choice(1024, 28, 3, pytest.approx(need(1024, 28)))
    assert budget.choose(model, 3.5, sizes, steps, 3, 1.5, 1.0) == budget.Choice(64, 2, 1, pytest.approx(
        2.5 * model.per_image(64, 2) + 1.0))  # fewer prompts at the smallest rather than none
    assert budget.choose(model, 1, sizes, steps, 3, 1.5, 1.0) is None
    # timings that contradict the model (noise on a busy machine) give a conservative fit, never a negative cost
    noisy = budget.Model.fit([(64, budget.Call(steps=[(768, 0.5)])), (128, budget.Call(steps=[(1536, 0.4)]))])
    assert noisy.step[0] >= 0 and noisy.step[1] >= 0 and noisy.per_image(1024, 1) >= 0.4


def test_the_deadline_stops_a_pipeline_within_one_step() -> None:
    """Every denoiser step and decode checks the deadline: a pipeline far slower than planned still stops in time."""
    import time

    import torch

    from publisher.quality import budget

    class Denoiser(torch.nn.Module):
        def forward(self, hidden_states: Any, encoder_hidden_states: Any = None) -> Any:
            time.sleep(0.05)
            return hidden_states

    class Pipe:
        def __init__(self) -> None:
            self.transformer, self.vae = Denoiser(), type("Vae", (), {"decode": lambda self, latents: latents})()

        def __call__(self, steps: int) -> None:
            for _ in range(steps):
                self.transformer(hidden_states=torch.zeros(1, 16, 4), encoder_hidden_states=torch.zeros(1, 8, 4))
            self.vae.decode(torch.zeros(1, 4, 8, 8))

    pipe = Pipe()
    deadline = budget.Deadline(0.3)
    with budget.Timer(pipe, pipe.transformer, deadline) as timer:
        with timer.call() as first:
            pipe(2)
        assert [t for t, _ in first.steps] == [24, 24] and first.decodes[0][0] == 64  # tokens and latent pixels seen
        started = time.monotonic()
        with pytest.raises(budget.OutOfTime, match=r"--eval-budget \(0 s\) ran out before the next denoising step"):
            with timer.call():
                pipe(1000)  # 50 s of steps
        assert time.monotonic() - started < 0.3 + 0.1  # stopped at the deadline, within one step
    assert "decode" not in pipe.vae.__dict__ and not pipe.transformer._forward_pre_hooks  # the hooks are gone


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> Any:
    from publisher.quality import sources
    from publisher.streaming.shards import LocalShards
    from publisher.verify.streaming import load_config

    src = LocalShards(tiny_llama_dir, ["model.safetensors"])
    return src, load_config(src), sources.saved(src)


# The tiny Llama's embedding and head are 98 KB each in bf16. 128 KB: several blocks (the MLP's Linears each its own),
# the embedding and head whole; 64 KB: they are over the budget, read row by row (verify/rowwise.py), the head's
# vocabulary in chunks of 100 rows
WHOLE = 128 * 1024
BUDGETS = pytest.mark.parametrize("budget", [WHOLE, 64 * 1024], ids=["whole-head", "row-by-row"])


def _row_by_row(monkeypatch: pytest.MonkeyPatch, budget: int) -> list[str]:
    """Small blocks (and head chunks); the names of the blocks the loaders read row by row, as they are made."""
    from publisher.verify import rowwise, streaming

    monkeypatch.setattr(streaming, "BLOCK_BUDGET", budget)
    monkeypatch.setattr(rowwise, "ROW_CHUNK_BYTES", 100 * 2 * 128)
    seen: list[str] = []
    attach = streaming.BlockLoader.attach

    def recording(self: Any) -> None:
        attach(self)
        seen.extend(self.row_by_row)

    monkeypatch.setattr(streaming.BlockLoader, "attach", recording)
    return seen


@BUDGETS
def test_perplexity_block_by_block_is_the_whole_model_s_and_a_model_against_itself_recovers_100(
        llama: Any, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    import math

    import torch
    from transformers import LlamaForCausalLM

    from publisher.quality import lm

    src, config, weights = llama
    ids = torch.randint(3, 384, (2, 40), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(lm, "HEAD_CHUNK", 16)  # several chunks of positions
    rows = _row_by_row(monkeypatch, budget)
    nll = lm.nll_after_pass(weights, "transformers", "LlamaForCausalLM", config, ids)
    assert rows == ([] if budget == WHOLE else ["model.embed_tokens", "lm_head"])
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = model(ids).logits.float()
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert nll.shape == (2, 40) and torch.allclose(nll[:, :-1], ref, atol=1e-5) and not nll[:, -1].any()
    assert lm.perplexity(nll) == pytest.approx(math.exp(float(ref.double().mean())))
    again = lm.nll_after_pass(weights, "transformers", "LlamaForCausalLM", config, ids)
    figures = lm.LmFigures("x", base_ppl=lm.perplexity(nll), quantized_ppl=lm.perplexity(again))
    assert figures.recovery == 100.0  # the same model on both sides: its own figure


@BUDGETS
def test_greedy_block_by_block_is_generate_s(llama: Any, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                            budget: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from publisher.quality import lm

    src, config, weights = llama
    prompts = ["the cat sat", "hello"]
    read_by_rows = _row_by_row(monkeypatch, budget)
    rows = lm.greedy(weights, "transformers", "LlamaForCausalLM", config, tiny_llama_dir, prompts, 6)
    assert read_by_rows == ([] if budget == WHOLE else ["model.embed_tokens", "lm_head"])
    assert [len(r) for r in rows] == [6, 6]
    got = lm.decode(tiny_llama_dir, rows, 6)
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
    requant = sources.Requantize("transformers", "LlamaForCausalLM", tiny_llama_dir, recipes.get("int8wo"), [], "")
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

    missing = options.DatasetSpec("nobody/no-such-text", None, "test")
    got = read_text(missing, 64, None, explicit=False)
    endpoint = os.environ["HF_ENDPOINT"]
    assert got.text is None and got.reason == f"the evaluation text nobody/no-such-text:test was not found on {endpoint} (or is private)"
    with pytest.raises(SourceError, match=r"--eval-dataset nobody/no-such-text:test: nobody/no-such-text was not found on .* \(or is private\); "
                                          r"name a readable text dataset"):
        read_text(missing, 64, None, explicit=True)


def test_dataset_rows_and_windows(wikitext_repo: str, tiny_llama_dir: Path) -> None:
    from publisher.quality.text import read_text, windows

    got = read_text(options.DatasetSpec.parse(options.DEFAULT_DATASET), 300, None, explicit=True)
    assert got.text is not None and got.text.startswith("\n\n = Section 0 = \n") and len(got.text) >= 300 * 8
    ids = windows(got.text, tiny_llama_dir, 300, 256)
    assert tuple(ids.shape) == (1, 256)  # the position table (256) bounds a window; 300 tokens make one whole window
    assert tuple(windows(got.text * 4, tiny_llama_dir, 600, 128).shape) == (4, 128)
    assert tuple(windows("the cat sat on the red dog and the photo of a cat" * 2, tiny_llama_dir, 600, 256).shape) == (1, 26)
    with pytest.raises(ValueError, match="holds only 3 tokens, fewer than 16"):
        windows("the cat sat", tiny_llama_dir, 600, 256)


def test_the_grid_leaves_out_sizes_whose_memory_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline whose calls take memory with the square of the size: the sizes predicted over the run's limit are
    never run, the largest that fits is chosen, and the figures say which were left out and why."""
    import time

    import torch
    from PIL import Image

    from publisher.quality import budget, memory
    from publisher.quality.grid import GridFigures
    from publisher.quality.gridrun import GridRun

    per_px2 = 200  # bytes per pixel of the image: 29 MB at 384 px, 13 MB at 256

    class Denoiser(torch.nn.Module):
        def forward(self, hidden_states: Any) -> Any:
            held = torch.ones(int(per_px2 * self.size**2), dtype=torch.uint8)  # pages touched: resident
            time.sleep(3 * memory.SAMPLE_S)
            return hidden_states + float(held[0]) * 0

    class Pipe:
        def __init__(self) -> None:
            self.transformer = Denoiser()
            self.vae = type("Vae", (), {"decode": lambda self, latents: latents})()

        def __call__(self, prompt: str, num_inference_steps: int, height: int, width: int, generator: Any) -> Any:
            self.transformer.size = height
            for _ in range(num_inference_steps):
                self.transformer(hidden_states=torch.zeros(1, (height // 16) ** 2, 4))
            self.vae.decode(torch.zeros(1, 4, height // 8, width // 8))
            return type("Out", (), {"images": [Image.new("RGB", (height, width))]})()

    # this process alone: a test worker's children (load-path interpreters of earlier tests) come and go meanwhile
    monkeypatch.setattr(memory, "children_rss", lambda: 0)
    figures = GridFigures(prompts=["a", "b", "c"], seeds=[0, 1, 2], asked=(1024, 2))
    limit = memory.tree_rss() + 22_000_000  # 256 px (13 MB) fits with room to spare, 384 px (29 MB) is well over
    run = GridRun(figures, budget.Deadline(60), "transformer", "cpu", load_s=0.0, memory_limit=limit)
    run.base(Pipe())
    assert figures.size == 256 and len(run.base_images) == 3  # 384 px: about 29 MB more, over the 22 MB of room
    assert figures.memory_limited.startswith("384 px and larger left out: one step at 384 px would take the process tree")
    assert f"over the {limit / 2**30:.2f} GiB the run keeps to" in figures.memory_limited
    assert all(p["size"] <= 256 for p in figures.probes)  # never run at a size over the limit
    assert run.measured and all(m.peak <= limit for m in run.measured)  # the timing calls stayed within it
    assert figures.peak_rss_bytes >= max(m.peak for m in run.measured)  # the images' peak is reported too
