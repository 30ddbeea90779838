"""Fixture data for the unit tiers (tests/test_unit_*.py): the hand-offs of a publish built by hand, with no
quantization, no reload in a fresh interpreter and no download.

Two publishes, as the pipeline stages would hand them on: a transformers language model (one component, "") and a
diffusers pipeline with two quantized components (transformer, text_encoder_2) and one kept (vae). Their repo
folders hold a config.json and a tiny safetensors file per quantized component, so ``Artifacts.files()`` and the
card's sizes read real files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from publisher.handoffs.artifacts import Artifacts, KeptKind, LayerReport, QuantizedComponent
from publisher.handoffs.plan import Component, Plan, Source
from publisher.handoffs.report import ForwardInputs, PathResult, Quality, VerifyReport

SHA = "0123456789abcdef0123456789abcdef01234567"
VERSIONS = {"torch": "2.13.0+cpu", "torchao": "0.18.0", "diffusers": "0.42.1", "transformers": "5.23.0",
            "safetensors": "0.8.0", "accelerate": "1.15.0", "huggingface_hub": "2.4.0", "python": "3.11.7"}
# config.json's quantization_config as transformers and diffusers store an Int8WeightOnlyConfig (as in tests/golden/)
INT8WO_STORED = {
    "quant_method": "torchao",
    "quant_type": {"default": {"_type": "Int8WeightOnlyConfig", "_version": 2, "_data": {
        "granularity": {"_type": "PerRow", "_version": 1, "_data": {"dim": -1}},
        "group_size": None, "set_inductor_config": True}}},
}
LM_LAYERS = tuple(f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"))
TRANSFORMER_LAYERS = ("x_embedder", "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "proj_out")
T5_LAYERS = ("encoder.block.0.layer.0.SelfAttention.q", "encoder.block.0.layer.1.DenseReluDense.wi")


def write_component(folder: Path, weights: str = "model.safetensors", config: dict[str, Any] | None = None) -> Path:
    """A component folder: config.json (with the stored quantization_config) and a 2x2 safetensors file."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"quantization_config": INT8WO_STORED}, indent=2) + "\n")
    save_file({"weight": torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)}, str(folder / weights))
    return folder


def _quantized(name: str, library: str, class_name: str, layers: tuple[str, ...], before: int, after: int) -> QuantizedComponent:
    return QuantizedComponent(name=name, library=library, class_name=class_name, quantized=list(layers), skipped=[],
                              excluded=[], tensor_classes={"Int8Tensor": len(layers)}, bytes_before=before,
                              bytes_after=after, quantization_config=INT8WO_STORED)


def _layers(quantized: int, linear: int, total: int, kept: list[KeptKind]) -> LayerReport:
    return LayerReport(quantized=quantized, linear=linear, kept=kept, total_bytes=total)


def lm_publish(folder: Path, target: str | None = "alice/unit-llama") -> tuple[Plan, Artifacts]:
    """A Llama language model, int8wo: 6 of 7 Linear layers quantized, lm_head kept by transformers' rules."""
    from publisher import recipes

    recipe = recipes.get("int8wo")
    write_component(folder)
    (folder / "tokenizer.json").write_text("{}\n")
    source = Source("meta/tiny-llama", "meta/tiny-llama", None, None, SHA,
                    sizes={"config.json": 600, "model.safetensors": 787_712, "LICENSE": 11_000, "tokenizer.json": 3},
                    card_data={"license": "apache-2.0", "tags": ["llama", "tiny"]}, endpoint="https://hub.invalid")
    component = Component("", "transformers", "LlamaForCausalLM", True, linear_names=(*LM_LAYERS, "lm_head"),
                          param_bytes=787_712, weight_files=("model.safetensors",), default_skips=("lm_head",))
    plan = Plan(source=source, kind="transformers", pipeline_class=None, components=(component,), recipes=(recipe,),
                exclude=(), targets={"int8wo": target}, base_files=("config.json", "model.safetensors", "LICENSE", "tokenizer.json"),
                library_name="transformers", pipeline_tag="text-generation")
    comp = _quantized("", "transformers", "LlamaForCausalLM", LM_LAYERS, 787_712, 513_740)
    kept = [KeptKind("embedding", "embeddings", 1, 98_304, "lookup tables, not matmuls; the recipes do not apply",
                     ["model.embed_tokens"]),
            KeptKind("library", "Linear kept by the library's rules", 1, 98_304, "kept on purpose: the library's default rules",
                     ["lm_head"])]
    artifacts = Artifacts(recipe=recipe, folder=folder, components=[comp],
                          layers={"": _layers(len(LM_LAYERS), len(LM_LAYERS) + 1, 787_712, kept)})
    return plan, artifacts


def pipeline_publish(folder: Path, target: str | None = "alice/unit-flux") -> tuple[Plan, Artifacts]:
    """A FLUX pipeline, int8wo: transformer and text_encoder_2 quantized, vae kept as it was."""
    from publisher import recipes

    recipe = recipes.get("int8wo")
    write_component(folder / "transformer", "diffusion_pytorch_model.safetensors")
    write_component(folder / "text_encoder_2")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}) + "\n")
    source = Source("bfl/tiny-flux", "bfl/tiny-flux", None, None, SHA, sizes={"model_index.json": 500, "LICENSE.md": 9_000},
                    card_data={"license": "other", "license_name": "flux-1-dev-non-commercial-license",
                               "license_link": "LICENSE.md", "tags": ["flux"]}, endpoint="https://hub.invalid")
    components = (
        Component("transformer", "diffusers", "FluxTransformer2DModel", True, linear_names=TRANSFORMER_LAYERS),
        Component("text_encoder_2", "transformers", "T5EncoderModel", True, linear_names=T5_LAYERS),
        Component("vae", "diffusers", "AutoencoderKL", False),
    )
    plan = Plan(source=source, kind="pipeline", pipeline_class="FluxPipeline", components=components, recipes=(recipe,),
                exclude=(), targets={"int8wo": target}, base_files=("model_index.json", "LICENSE.md"),
                library_name="diffusers", pipeline_tag="text-to-image")
    quantized = [_quantized("transformer", "diffusers", "FluxTransformer2DModel", TRANSFORMER_LAYERS, 2_110_000, 1_120_000),
                 _quantized("text_encoder_2", "transformers", "T5EncoderModel", T5_LAYERS, 433_980, 229_400)]
    layers = {"transformer": _layers(len(TRANSFORMER_LAYERS), len(TRANSFORMER_LAYERS), 2_110_000, []),
              "text_encoder_2": _layers(len(T5_LAYERS), len(T5_LAYERS), 433_980, [])}
    return plan, Artifacts(recipe=recipe, folder=folder, components=quantized, layers=layers)


def result(component: str, path: str, outcome: str = "pass", *, env: str = "current", layers: int = 6,
           detail: str = "") -> PathResult:
    """One load's result as compare() hands it on: "pass", "silently wrong", "fail" or "not applicable"."""
    ok = outcome == "pass"
    return PathResult(component, path, env, dict(VERSIONS), ok, detail, max_abs_diff=0.0 if ok else None,
                      quantized_layers=layers, tensors_checked=10, forward_checked=ok,
                      applicable=outcome != "not applicable", silent=outcome == "silently wrong",
                      class_found="Int8Tensor", classes_found={"Int8Tensor": layers})


def report_for(artifacts: Artifacts, results: list[PathResult], **extra: Any) -> VerifyReport:
    """The verification report of ``artifacts``: passed exactly when no applicable result failed (as verify() sets it)."""
    report = VerifyReport(
        recipe=artifacts.recipe.name, location=str(artifacts.folder), passed=False, results=results,
        quality=[Quality(c.label, 0.0123, 0.999876) for c in artifacts.components],
        expected_layers={c.label: len(c.quantized) for c in artifacts.components},
        tensor_class=artifacts.recipe.tensor_class, compat_note="--compat none",
        forward={c.label: ForwardInputs(artifacts.folder / f"inputs-{c.label}.safetensors", "token ids (seeded)")
                 for c in artifacts.components}, **extra)
    report.passed = bool(report.results) and not report.failures()
    return report


def passing_results(artifacts: Artifacts) -> list[PathResult]:
    return [result(c.name, path, layers=len(c.quantized)) for c in artifacts.components for path in ("library", "manual")]
