"""The quality stage of a publish run: what it checks when the plan is made, what it reads before the download, what it
hands the quantization pass, what it computes after verification, and the gate that runs before anything is pushed.

    check_measurable(settings, plan, token)          # plan time: a --min-quality bound on a figure that cannot be had
    text = read_text(settings, plan, token)           # right after the plan (an explicit dataset fails here)
    evaluation = Evaluation(settings, text, plan, base_dir, elsewhere, token, work)   # after the download
    quantize_recipe(..., observer=evaluation.observer)                                # in-pass perplexity
    figures = evaluation.run(artifacts, base_sources, pass_seconds, recipe)            # after verification
    gate(settings, figures, recipe)                                                   # QualityError: exit 1

Every recipe's evaluation has ``--eval-budget`` seconds (``auto``: by the size of the weights it runs,
``options.Settings.budget_for``) and keeps it: the grid checks the time before every denoiser step (``budget.py``), the
continuation after every token, the perplexity between windows.

Figures: ``lm.LmFigures`` for a causal language model, ``grid.GridFigures`` for a pipeline, None otherwise.
"""

from __future__ import annotations

import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import adapters
from publisher.adapters.diffusers import output_kind
from publisher.errors import SourceError, UsageError
from publisher.handoffs.plan import DENOISERS, Component
from publisher.io.jsonfile import read_object
from publisher.quality import grid, lm, memory, options, perceptual
from publisher.quality import images as im
from publisher.quality.budget import Deadline
from publisher.quality.gridrun import GridRun
from publisher.quality.options import Settings
from publisher.quality.reference import References, Step, continuation
from publisher.quality.sources import Weights, component_weights, local_shards
from publisher.quality.text import MIN_WINDOW, EvalText, unreadable, windows
from publisher.quality.text import read_text as read
from publisher.streaming.shards import HubShards, build_index
from publisher.verify.streaming import BLOCK_BUDGET

if TYPE_CHECKING:  # types only
    from collections.abc import Iterator

    from publisher.handoffs.artifacts import Artifacts, QuantizedComponent
    from publisher.handoffs.plan import Plan
    from publisher.recipes import Recipe

log = logging.getLogger(__name__)

Figures = lm.LmFigures | grid.GridFigures  # what an evaluation measured (None: nothing it can measure)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
NO_TOKENIZER = "no tokenizer in the base (the text is tokenized with the base's own tokenizer, and it has none)"


def kind_of(plan: Plan) -> str | None:
    first = plan.quantized[0] if plan.quantized else None
    return options.model_kind(plan.kind, first.class_name if first else "")


def check_measurable(settings: Settings, plan: Plan, token: str | None) -> None:
    """At plan time, before any download: a causal LM without a tokenizer is said in one line (the run goes on without
    perplexity and continuation); a ``--min-quality`` bound on perplexity that cannot be measured here (no tokenizer,
    an evaluation text that cannot be read: one request) is a usage error (exit 2); so is a bound on LPIPS whose
    weights are not on this machine."""
    lpips_bound = [b for b in settings.bounds if b.metric == "lpips"]
    if settings.enabled and lpips_bound and kind_of(plan) == options.PIPELINE:
        try:
            perceptual.locate()
        except perceptual.Unavailable as exc:
            raise UsageError(f"--min-quality {lpips_bound[0].text()} cannot be checked: for LPIPS, {exc}; get them "
                             f"({perceptual.HOW_TO_GET}), or drop the bound") from None
    if not settings.enabled or kind_of(plan) != options.CAUSAL_LM:
        return
    bounded = [b for b in settings.bounds if b.metric == "ppl-recovery"]
    if not plan.source.has_tokenizer:
        if bounded:
            raise UsageError(f"--min-quality {bounded[0].text()} cannot be checked: {plan.source.model_id} has no "
                             "tokenizer, which perplexity needs; add the base's tokenizer files to it, or drop "
                             "--min-quality")
        log.warning("%s has no tokenizer: perplexity and the greedy continuation will not be measured (the card says "
                    "so); add the tokenizer's files to the base for them", plan.source.model_id)
        return
    if bounded and not settings.explicit_dataset:
        reason = unreadable(settings.dataset, token)
        if reason:
            raise UsageError(f"--min-quality {bounded[0].text()} cannot be checked: the evaluation text "
                             f"{settings.dataset.text()} {reason}; name a readable one with --eval-dataset, or drop "
                             "--min-quality")


def read_text(settings: Settings, plan: Plan, token: str | None) -> EvalText | None:
    """The evaluation text of a causal LM (None for other models, with the evaluation off, or without a tokenizer)."""

    if not settings.enabled or kind_of(plan) != options.CAUSAL_LM or not plan.source.has_tokenizer:
        return None
    return read(settings.dataset, settings.tokens, token, settings.explicit_dataset)


def configs_folder(plan: Plan, base_dir: Path, elsewhere: frozenset[str], token: str | None, work: Path) -> Path:
    """A folder with every non-weight file of the base (configs, tokenizers, scheduler): the download folder, or, when
    some went Hub to Hub without touching the disk (``--low-disk`` push), a copy with those downloaded (small files)."""
    missing = [f for f in plan.base_files if f in elsewhere and not f.endswith(WEIGHT_SUFFIXES)]
    if not missing:
        return base_dir
    from huggingface_hub import hf_hub_download

    dest = work / "configs"
    for rel in plan.base_files:
        if rel.endswith(WEIGHT_SUFFIXES) or rel == "README.md":
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel in elsewhere:  # only a Hub base has files elsewhere
            assert plan.source.repo_id is not None
            shutil.copyfile(hf_hub_download(plan.source.repo_id, rel, revision=plan.source.sha, token=token), target)
        elif (base_dir / rel).is_file():
            shutil.copyfile(base_dir / rel, target)
    return dest


class Evaluation:
    """One run's evaluation (shared by its recipes: the same text, windows, folders and budget)."""

    def __init__(self, settings: Settings, text: EvalText | None, plan: Plan, base_dir: Path, elsewhere: frozenset[str],
                 token: str | None, work: Path) -> None:
        self.settings, self.text, self.plan, self.base_dir, self.token = settings, text, plan, base_dir, token
        self.kind = kind_of(plan) if settings.enabled else None
        self.elsewhere = elsewhere
        self.configs = configs_folder(plan, base_dir, elsewhere, token, work) if self.kind else base_dir
        # the weights each evaluation runs: a pipeline's every model, a language model itself (bf16 bytes)
        runs = plan.components if self.kind == options.PIPELINE else plan.quantized
        self.budget_s = settings.budget_for(sum(c.param_bytes for c in runs))
        self.ids: Any = None
        self.models: dict[str, Any] = {}
        self.limited = ""  # why fewer tokens than --eval-tokens are scored
        self.flops = grid.measured_flops() if self.kind else 0.0  # this CPU's bf16 matmul rate: what the budget buys
        self.text_reason = ""
        self.refs = References()  # the base's figures, computed by the first recipe that needs them
        if self.kind == options.CAUSAL_LM:
            self._windows()

    def _windows(self) -> None:
        if not self.plan.source.has_tokenizer:
            self.text_reason = NO_TOKENIZER
            return
        if self.text is None or self.text.text is None:
            self.text_reason = self.text.reason if self.text is not None else "no evaluation text"
            return
        config = read_object(self.configs / "config.json")
        tokens = self.settings.tokens
        # Both forward passes, 2 FLOPs per parameter and token, may take half the budget; on a CPU without fast bf16
        # matmuls (this project's: about 1.5 GFLOP/s) that is far fewer tokens than a GPU's
        per_token = 2 * 2 * (self.plan.quantized[0].param_bytes // 2) / max(self.flops, 1.0)
        affordable = int(0.5 * self.budget_s / per_token) if per_token > 0 else tokens
        if affordable < tokens:
            if affordable < MIN_WINDOW:
                self.text_reason = (f"scoring even {MIN_WINDOW} tokens would take about {MIN_WINDOW * per_token / 60:.0f} min "
                                    f"on this CPU (bf16 matmuls at {self.flops / 1e9:.1f} GFLOP/s), more than half of "
                                    f"--eval-budget ({self.budget_s:.0f} s); publish on a GPU (--on-hf-jobs FLAVOR) or "
                                    "raise --eval-budget")
                return
            self.limited = (f"{affordable} of the {tokens} asked (--eval-tokens): what half of --eval-budget "
                            f"({self.budget_s:.0f} s) allows on this CPU, whose bf16 matmuls run at "
                            f"{self.flops / 1e9:.1f} GFLOP/s")
            tokens = affordable
        try:
            self.ids = windows(self.text.text, self.configs, tokens, config.get("max_position_embeddings"))
        except ValueError as exc:
            if self.settings.explicit_dataset:
                raise SourceError(f"--eval-dataset {self.text.spec.text()}: {exc}; name a dataset with more text") from None
            self.text_reason = f"the evaluation text {self.text.spec.text()} is too short: {exc}"

    def observer(self, comp: Component, config: dict[str, Any]) -> Any:
        """The in-pass perplexity observer for a streamed causal LM (None otherwise)."""
        if self.ids is None or not adapters.of(comp.library).token_inputs:
            return None

        text = config.get("text_config") or config
        table = int(text.get("vocab_size") or 0) * int(text.get("hidden_size") or 0) * 2
        if table > BLOCK_BUDGET:
            # The head comes first in the file and is used last: the observer would hold it (and the embedding)
            # through the whole pass, 1.7 GiB at Llama-3-8B's shapes. After the pass both are read row by row.
            log.info("perplexity after the pass: the embedding and head (%d MB each in bf16) are read row by row then, "
                     "rather than held through the pass", table // 1_000_000)
            return None
        return lm.observer(comp.library, comp.class_name, config, self.ids, comp.label)

    def run(self, artifacts: Artifacts, base_sources: dict[str, Any], pass_seconds: float, recipe: Recipe) -> Figures | None:
        deadline = Deadline(self.budget_s)
        if self.kind == options.CAUSAL_LM:
            return self._lm(artifacts, base_sources, pass_seconds, recipe, deadline)
        if self.kind == options.PIPELINE:
            return self._grid(artifacts, base_sources, pass_seconds, recipe, deadline)
        return None

    # ------------------------------------------------------------------ language models
    def _weights(self, comp: QuantizedComponent, artifacts: Artifacts, base_sources: dict[str, Any], recipe: Recipe) -> tuple[Weights, Weights]:
        folder = artifacts.folder / comp.name if comp.name else artifacts.folder
        config_dir = self.configs / comp.name if comp.name else self.configs
        return component_weights(comp.library, comp.class_name, base_sources[comp.name], config_dir, recipe,
                                 list(self.plan.exclude), local_shards(folder), comp.name)

    def _lm(self, artifacts: Artifacts, base_sources: dict[str, Any], pass_seconds: float, recipe: Recipe,
            deadline: Deadline) -> lm.LmFigures:

        comp = artifacts.components[0]
        config = read_object(self.configs / "config.json")
        figures = lm.LmFigures(dataset=self.settings.dataset.text(), budget_s=self.budget_s)
        if self.text_reason == NO_TOKENIZER:
            figures.reason = figures.continuation_reason = NO_TOKENIZER
            return figures
        base_w, quant_w = self._weights(comp, artifacts, base_sources, recipe)
        if self.ids is None:
            figures.reason = self.text_reason or "no evaluation text"
        else:
            self._perplexity(figures, comp, config, base_w, quant_w, deadline, recipe.name)
        prompts = ([self.settings.prompt] if self.settings.prompt else []) + list(lm.PROMPTS)
        figures.prompts = prompts[:3]
        # a step reads each model's weights once: about what the pass took to read the base and write the quantized
        # weights (a conservative rate: the pass also quantized); 2 FLOPs per parameter and prompt on top
        read_s = max(pass_seconds, 0.0) / max(comp.bytes_before, 1)
        step = Step(read_s * comp.bytes_before, read_s * comp.bytes_after,
                    2 * (comp.bytes_before // 2) * len(figures.prompts) / max(self.flops, 1.0))
        continuation(figures, self.refs, base_w.key, recipe.name, (base_w, quant_w),
                     (comp.library, comp.class_name, config), self.configs, step, deadline, self.budget_s)
        return figures

    def _perplexity(self, figures: lm.LmFigures, comp: QuantizedComponent, config: dict[str, Any], base_w: Weights, quant_w: Weights,
                    deadline: Deadline, recipe: str) -> None:
        started = time.monotonic()
        ids = self.ids
        figures.limited = self.limited
        passed = getattr(comp, "eval_forward", None)
        if passed is not None and passed.output is not None and passed.base_output is not None:
            quant_nll, base_nll = passed.output, passed.base_output
            figures.where = "during the quantization pass (block by block, the tensors the pass held)"
            figures.seconds["perplexity_in_pass_cpu"] = round(passed.cpu_seconds, 3)
        else:
            if passed is not None:
                log.info("perplexity after the pass: %s", passed.detail)
            import torch

            # window by window, both models, one stderr line each: the first always, then each that half of the time
            # left still allows at the slowest window's pace
            total = int(ids.shape[0])
            base_parts, quant_parts, slowest, reused = [], [], 0.0, []
            for i in range(total):
                if i and slowest > 0.5 * deadline.left():
                    figures.limited = (f"{i} of {total} windows: a window of both models took {slowest:.1f} s here, and "
                                       f"half of what was left of --eval-budget ({self.budget_s:.0f} s) allowed no more")
                    log.warning("perplexity: %s", figures.limited)
                    break
                began = time.monotonic()
                kept = self.refs.nll(base_w.key, i)  # a window's time is then the quantized model's alone
                if kept is None:
                    base_parts.append(lm.nll_after_pass(base_w, comp.library, comp.class_name, config, ids[i:i + 1]))
                    self.refs.keep_nll(base_w.key, i, base_parts[-1], recipe)
                else:
                    base_parts.append(kept[0])
                    reused.append(kept[1])
                quant_parts.append(lm.nll_after_pass(quant_w, comp.library, comp.class_name, config, ids[i:i + 1]))
                slowest = max(slowest, time.monotonic() - began)
                log.info("perplexity: window %d of %d (%d tokens, %s): %.1f s; %.0f s of --eval-budget left", i + 1, total,
                         int(ids.shape[1]), "base and quantized" if kept is None else "quantized; the base's reused",
                         time.monotonic() - began, max(deadline.left(), 0.0))
            if reused:
                log.info("perplexity: the bf16 base's NLL of %d of %d windows reused (computed once per run, for %s)",
                         len(reused), len(base_parts), ", ".join(sorted(set(reused))))
            base_nll, quant_nll = torch.cat(base_parts), torch.cat(quant_parts)
            ids = ids[:len(base_parts)]
            figures.where = "after the quantization pass, block by block"
            figures.seconds["perplexity_after_pass"] = round(time.monotonic() - started, 3)
        figures.windows, figures.window = int(ids.shape[0]), int(ids.shape[1])
        figures.tokens = figures.windows * (figures.window - 1)
        figures.base_ppl, figures.quantized_ppl = lm.perplexity(base_nll), lm.perplexity(quant_nll)
        if self.text is not None:
            figures.seconds["read_dataset"] = round(self.text.seconds, 3)

    # ------------------------------------------------------------------ pipelines
    def _grid(self, artifacts: Artifacts, base_sources: dict[str, Any], pass_seconds: float, recipe: Recipe,
              deadline: Deadline) -> grid.GridFigures:
        import torch


        prompts = (([self.settings.prompt] if self.settings.prompt else []) + list(grid.PROMPTS))[:3]
        figures = grid.GridFigures(prompts=prompts, seeds=list(range(len(prompts))), budget_s=round(self.budget_s, 1),
                                   asked=(self.settings.size, self.settings.steps))
        if output_kind(self.plan.pipeline_class) != "image":
            figures.reason = f"{self.plan.pipeline_class} makes {output_kind(self.plan.pipeline_class)}, not images"
            return figures
        import psutil

        models, sizes, quantized_from = self._offloaded_models(artifacts, base_sources, recipe)
        local = self._on_disk(artifacts)
        # A GPU runs the pipelines from their folders (whole, or with model CPU offload); without the files on disk
        # (--low-disk) the grid runs offloaded on the CPU, block by block, like a CPU-only machine.
        device = "cuda" if torch.cuda.is_available() and local else "cpu"
        figures.device = device
        # A run whose components all went through the streaming engine keeps its process tree within the 1.2 GiB
        # bound, and so does its grid on a CPU: a pipeline is held whole only when it fits in it, else offloaded, and
        # sizes whose activations would not fit are left out (memory.py, gridrun.py). The library engine loaded whole
        # models already; a GPU's memory is its own.
        bounded = device == "cpu" and all(c.engine == "streaming" for c in artifacts.components)
        limit = memory.limit(bounded)
        whole = local and (device == "cuda" or (sum(sizes.values()) <= 0.8 * psutil.virtual_memory().available
                                                and (limit is None or memory.tree_rss() + sum(sizes.values()) <= limit)))
        figures.quantized_from = "the saved files" if whole else quantized_from
        figures.mode = ("whole pipeline in memory" if whole and device == "cpu" else "GPU" if device == "cuda"
                        else "offloaded: each component built on the meta device, loaded block by block as it runs")
        denoiser = next((n for n in DENOISERS if n in sizes), max(sizes, key=lambda n: sizes[n]))
        if device == "cpu":  # hopeless on this CPU: said without running anything
            rate = sum(c.bytes_before for c in artifacts.components) / max(pass_seconds, 1e-3)
            offloaded = 0 if whole or sizes[denoiser] <= BLOCK_BUDGET else sizes[denoiser]
            least = grid.lower_bound(sizes[denoiser] // 2, offloaded, rate, self.flops)
            if least > 0.25 * self.budget_s:
                figures.estimate_s = round(least, 1)
                figures.reason = (f"on this CPU one denoising step of a {grid.MIN_SIZE}x{grid.MIN_SIZE} px image takes at "
                                  f"least {least:.0f} s, and --eval-budget is {self.budget_s:.0f} s; the grid needs a GPU: "
                                  "publish with --on-hf-jobs FLAVOR (a GPU flavor, `hf-ao-publish recipes` lists them) "
                                  "or on a machine with one, or raise --eval-budget")
                log.warning("no comparison grid: %s", figures.reason)
                return figures
        # the base's images depend on how its pipeline runs and what it reads, not on the recipe: made once per run
        key = (device, whole, limit, tuple(figures.prompts), tuple(figures.seeds), figures.asked,
               () if whole else tuple((n, pair[0].key) for n, (_, _, pair) in sorted(models.items())))
        reference = self.refs.grid(key)
        if reference is not None:  # the whole budget goes to the quantized pipeline
            run = GridRun(figures, deadline, denoiser, device, load_s=reference.load_s, memory_limit=limit)
            run.reuse(reference)
        else:
            started = time.monotonic()
            with self._pipeline("base", whole, device, artifacts, models) as pipe:
                run = GridRun(figures, deadline, denoiser, device, load_s=time.monotonic() - started, memory_limit=limit)
                run.base(pipe)
            self.refs.keep_grid(key, run.reference(recipe.name))
        if run.prompts:
            with self._pipeline("quantized", whole, device, artifacts, models) as pipe:
                run.quantized(pipe)
        pairs = run.pairs()
        if not pairs:
            figures.seconds = round(deadline.elapsed(), 3)
            figures.reason = figures.reason or f"--eval-budget ({self.budget_s:.0f} s) ran out before the first pair of images"
            figures.prompts, figures.seeds = [], []
            return figures

        figures.prompts, figures.seeds = figures.prompts[:len(pairs)], figures.seeds[:len(pairs)]
        im.perceptual_figures(figures, pairs, deadline)
        figures.metrics = im.metrics_note(figures)
        im.save_grid(im.grid(pairs, figures, recipe.name), artifacts.folder / grid.IMAGE_NAME)
        if self.settings.full_images:
            figures.full_images = im.save_full(pairs, artifacts.folder)
        figures.seconds = round(deadline.elapsed(), 3)
        figures.image = grid.IMAGE_NAME
        return figures

    @contextmanager
    def _pipeline(self, role: str, whole: bool, device: str, artifacts: Artifacts, models: dict[str, Any]) -> Iterator[Any]:
        if whole:
            pipe = grid.whole(self.base_dir if role == "base" else artifacts.folder, device)
            try:
                yield pipe
            finally:
                del pipe
            return
        with grid.Offloaded(self.configs, {n: (lib, cls, pair[role == "quantized"])
                                           for n, (lib, cls, pair) in models.items()}) as pipe:
            yield pipe

    def _on_disk(self, artifacts: Artifacts) -> bool:
        """Every weight file of both pipelines is on disk (base and quantized)."""
        if self.elsewhere or any(local_shards(artifacts.folder / c.name) is None for c in artifacts.components):
            return False
        return all(local_shards(self.base_dir / c.name) is not None for c in self.plan.components if c.name in self.models)

    def _offloaded_models(self, artifacts: Artifacts, base_sources: dict[str, Any],
                          recipe: Recipe) -> tuple[dict[str, Any], dict[str, int], str]:
        """component -> (library, class, (base weights, quantized weights)) for every model component with weights; their
        bytes (read from the safetensors headers); where the quantized weights come from."""

        models: dict[str, Any] = {}
        sizes: dict[str, int] = {}
        how = ""
        quantized = {c.name: c for c in artifacts.components}
        for comp in self.plan.components:
            weights = [f for f in self.plan.base_files if f.startswith(f"{comp.name}/") and f.endswith(".safetensors")]
            if not comp.class_name or not comp.name or not weights:
                continue  # tokenizers, schedulers: no weights
            if comp.name in quantized:
                pair = self._weights(quantized[comp.name], artifacts, base_sources, recipe)
                how = how or pair[1].how
            else:
                source: Any = local_shards(self.base_dir / comp.name)
                if source is None:  # not on disk: a Hub base's unchanged component, copied Hub to Hub (--low-disk)
                    repo_id, sha = self.plan.source.repo_id, self.plan.source.sha
                    assert repo_id is not None and sha is not None
                    source = HubShards(repo_id, sha, comp.name, self.token)
                same = Weights(source, grid.loader_cast(comp.library, comp.class_name), "the base")
                pair = (same, same)
            index = build_index(pair[0].source)
            sizes[comp.name] = sum(index.nbytes(n) for n in index.parts)
            models[comp.name] = (comp.library, comp.class_name, pair)
        self.models = models
        return models, sizes, how


def gate(settings: Settings, figures: Figures | None, recipe: str) -> None:
    if not settings.bounds:
        return
    values: dict[str, float | None] = {}
    missing: dict[str, str] = {}
    if isinstance(figures, lm.LmFigures):
        values["ppl-recovery"] = figures.recovery
        missing["ppl-recovery"] = figures.reason
    elif isinstance(figures, grid.GridFigures):
        values["psnr"] = min(figures.psnr) if figures.psnr else None
        values["ssim"] = min(figures.ssim) if figures.ssim else None
        values["lpips"] = max(figures.lpips) if figures.lpips else None
        missing["psnr"] = missing["ssim"] = figures.reason
        missing["lpips"] = figures.reason or f"LPIPS was not computed: {figures.lpips_reason}"
    options.gate(settings.bounds, values, missing, recipe)


def to_json(figures: Figures | None) -> dict[str, Any] | None:
    if figures is None:
        return None
    data = asdict(figures)
    if isinstance(figures, lm.LmFigures):
        data["recovery_percent"] = figures.recovery
        data["kind"] = options.CAUSAL_LM
    else:
        data["kind"] = options.PIPELINE
        data["psnr"] = [None if p == float("inf") else p for p in figures.psnr]  # JSON has no infinity
    return data
