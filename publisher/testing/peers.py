"""The peer corpus: torchao checkpoints made with other people's code, and broken copies of them (issue 22).

Each checkpoint is written offline, from the tiny bases of ``publisher.testing.tiny``, by the libraries' own
documented calls, as a user or a model-release script would make it:

- transformers: ``AutoModelForCausalLM.from_pretrained(base, quantization_config=TorchAoConfig(cfg))`` then
  ``save_pretrained(dir)`` (int8wo, float8wo, int8dq), and the model-release recipe of pytorch/ao's former
  ``quantize_and_upload.py`` ("8da4w": ``ModuleFqnToConfig`` with int8 dynamic activations + int4 ``Intx`` weights
  by default and ``IntxWeightOnlyConfig(int8)`` for the embeddings, ``include_input_output_embeddings`` (the
  script's ``include_embedding`` before transformers 5), ``untie_embedding_weights``, float32 as the script loads),
  applied as the script applies it: to the "untied-weights" copy its first step writes (``lm_head`` a copy of the
  input embeddings, ``tie_word_embeddings`` false). Applied to a model whose ``lm_head`` is its own, transformers'
  ``untie_embedding_weights`` overwrites ``lm_head`` with the input embeddings (only the base shows it);
- diffusers: a whole ``FluxPipeline`` quantized with ``PipelineQuantizationConfig(quant_mapping=...)`` (diffusers'
  ``TorchAoConfig`` for the transformer, transformers' for ``text_encoder_2``) and ``pipe.save_pretrained(dir)``;
  a standalone model folder, ``transformer.save_pretrained(dir)`` (safetensors, and ``safe_serialization=False``:
  a pickle ``.bin``), and the same pickle inside the pipeline;
- broken copies: float8 weights under an int8wo ``quantization_config``, one layer's scale NaN, one layer's scale
  zeroed, one layer's int8 weights sign-flipped, torchao tensors under a config.json without quantization_config.

``CORPUS`` names every entry with the verdict `hf-ao-publish verify` must reach (and what its message says), with and
without the base. Command line: ``python -m publisher.testing.peers DIR [NAME ...]`` (``--list`` for the names).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher.testing.tiny import build_tiny_flux, build_tiny_llama

LLAMA_LAYER = "model.layers.0.self_attn.q_proj"  # the layer the broken copies break
FLUX_LAYER = "transformer_blocks.0.ff.net.2"


@dataclass(frozen=True)
class Peer:
    name: str
    base: str  # "llama", "llama-untied" (lm_head a copy of the input embeddings) or "flux": its tiny base
    what: str
    verdict: str  # "pass" or "fail": `verify DIR` without a base (values checked for self-consistency only)
    with_base: str  # the verdict of `verify DIR --base BASE`
    says: str = ""  # a fragment of the one-line message of a failing verdict (either verdict)
    layout: str = "transformers"  # "transformers" | "pipeline" | "diffusers-model"


def _transformers_config(name: str) -> Any:
    import torch
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        ModuleFqnToConfig,
        PerAxis,
        PerGroup,
    )
    from transformers import TorchAoConfig

    if name == "release":
        embedding = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
        linear = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                       weight_scale_dtype=torch.bfloat16)
        fqn = ModuleFqnToConfig({"_default": linear, "model.embed_tokens": embedding})
        return TorchAoConfig(quant_type=fqn, include_input_output_embeddings=True, untie_embedding_weights=True,
                             modules_to_not_convert=[])
    configs = {"int8wo": Int8WeightOnlyConfig(), "float8wo": Float8WeightOnlyConfig(),
               "int8dq": Int8DynamicActivationInt8WeightConfig()}
    return TorchAoConfig(configs[name])


def transformers_peer(base: Path, out: Path, recipe: str) -> Path:
    """``from_pretrained(base, quantization_config=TorchAoConfig(...))`` + ``save_pretrained(out)``, tokenizer too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if recipe == "release" else torch.bfloat16  # the release script loads in float32
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=_transformers_config(recipe), dtype=dtype)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def untied_weights(base: Path, out: Path) -> Path:
    """The release script's first step: a copy whose lm_head is its own copy of the input embeddings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def flux_pipeline_peer(base: Path, out: Path, *, safe_serialization: bool = True) -> Path:
    """A whole FluxPipeline quantized with ``PipelineQuantizationConfig(quant_mapping=...)`` and saved."""
    import diffusers
    import torch
    import transformers
    from torchao.quantization import Int8WeightOnlyConfig

    mapping = {"transformer": diffusers.TorchAoConfig(Int8WeightOnlyConfig()),
               "text_encoder_2": transformers.TorchAoConfig(Int8WeightOnlyConfig())}
    quant = diffusers.PipelineQuantizationConfig(quant_mapping=mapping)
    pipe = diffusers.FluxPipeline.from_pretrained(base, quantization_config=quant, torch_dtype=torch.bfloat16)
    pipe.save_pretrained(out, safe_serialization=safe_serialization)
    return out


def flux_model_peer(base: Path, out: Path, *, safe_serialization: bool = True) -> Path:
    """The seeds' serialization example: the transformer alone, ``transformer.save_pretrained(dir)``."""
    import diffusers
    import torch
    from torchao.quantization import Int8WeightOnlyConfig

    model = diffusers.FluxTransformer2DModel.from_pretrained(
        base, subfolder="transformer", quantization_config=diffusers.TorchAoConfig(Int8WeightOnlyConfig()),
        torch_dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=safe_serialization)
    return out


# ------------------------------------------------------------------------------------------- broken copies


def _edit_tensors(file: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite one safetensors file with ``edit`` applied to its tensors, header metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata=metadata)


def _copy(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    return out


def _declared(folder: Path, other: Path) -> None:
    """Put the quantization_config of ``other`` into ``folder``'s config.json (the tensors stay as they are)."""
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = json.loads((other / "config.json").read_text())["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def break_scale(folder: Path, layer: str, value: float) -> None:
    """Set every scale of ``layer``'s weight to ``value`` (NaN, 0.0)."""
    def edit(t: dict[str, Any]) -> None:
        t[f"{layer}._weight_scale"].fill_(value)

    _edit_tensors(_weights(folder), edit)


def flip_signs(folder: Path, layer: str) -> None:
    """Negate ``layer``'s int8 weight values (-128 saturates to 127)."""
    import torch

    def edit(t: dict[str, Any]) -> None:
        q = t[f"{layer}._weight_qdata"]
        t[f"{layer}._weight_qdata"] = (-q.to(torch.int16)).clamp(-128, 127).to(torch.int8)

    _edit_tensors(_weights(folder), edit)


def drop_declared(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _weights(folder: Path) -> Path:
    found = sorted(folder.glob("*.safetensors"))
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------------------------------------ corpus

CORPUS: tuple[Peer, ...] = (
    Peer("tf-int8wo", "llama", "transformers TorchAoConfig(Int8WeightOnlyConfig()) + save_pretrained", "pass", "pass"),
    Peer("tf-float8wo", "llama", "transformers TorchAoConfig(Float8WeightOnlyConfig()) + save_pretrained", "pass", "pass"),
    Peer("tf-int8dq", "llama", "transformers TorchAoConfig(Int8DynamicActivationInt8WeightConfig()) + save_pretrained",
         "pass", "pass"),
    Peer("tf-release", "llama-untied", "pytorch/ao release recipe: ModuleFqnToConfig, int8 dynamic + int4 Intx weights, "
         "IntxWeightOnlyConfig(int8) embeddings, float32, on the script's untied-weights copy", "pass", "pass"),
    Peer("tf-release-own-head", "llama", "the release recipe on a model whose lm_head is its own: "
         "untie_embedding_weights overwrites lm_head with the input embeddings", "pass", "fail",
         says="tensor lm_head.weight is not the base's own"),
    Peer("flux-pipeline", "flux", "FluxPipeline + PipelineQuantizationConfig(quant_mapping=...), save_pretrained", "pass",
         "pass", layout="pipeline"),
    Peer("flux-model", "flux", "transformer.save_pretrained(dir): a standalone diffusers model folder", "pass", "pass",
         layout="diffusers-model"),
    Peer("flux-model-bin", "flux", "transformer.save_pretrained(dir, safe_serialization=False): pickle .bin", "pass",
         "pass", layout="diffusers-model"),
    Peer("flux-pipeline-bin", "flux", "the pipeline saved with safe_serialization=False (the transformer as .bin)",
         "pass", "pass", layout="pipeline"),
    Peer("tf-float8-as-int8wo", "llama", "float8 weights under an int8wo quantization_config", "fail", "fail",
         says="the config says Int8WeightOnlyConfig"),
    Peer("tf-nan-scale", "llama", f"int8wo with {LLAMA_LAYER}'s scale set to NaN", "fail", "fail", says="NaN"),
    Peer("tf-zero-scale", "llama", f"int8wo with {LLAMA_LAYER}'s scale zeroed", "pass", "fail",
         says=f"{LLAMA_LAYER}.weight"),
    Peer("tf-sign-flip", "llama", f"int8wo with {LLAMA_LAYER}'s int8 weights sign-flipped", "pass", "fail",
         says=f"{LLAMA_LAYER}.weight"),
    Peer("tf-undeclared", "llama", "int8wo tensors under a config.json without quantization_config", "fail", "fail",
         says="declares no quantization_config"),
)
PEERS = {p.name: p for p in CORPUS}


def build_peer(name: str, out: Path, bases: dict[str, Path], made: dict[str, Path] | None = None) -> Path:
    """Write the corpus entry ``name`` into ``out``; ``bases``: {"llama": dir, "flux": dir} (built when absent);
    ``made``: entries already written (broken copies start from them), updated with this one."""
    made = made if made is not None else {}
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)

    def base(kind: str) -> Path:
        if kind not in bases:
            builders = {"llama": build_tiny_llama, "flux": build_tiny_flux,
                        "llama-untied": lambda p: untied_weights(base("llama"), p)}
            bases[kind] = builders[kind](out.parent / f"base-{kind}")
        return bases[kind]

    def source(peer: str) -> Path:
        if peer not in made:
            build_peer(peer, out.parent / peer, bases, made)
        return made[peer]

    if name in ("tf-int8wo", "tf-float8wo", "tf-int8dq", "tf-release", "tf-release-own-head"):
        transformers_peer(base(PEERS[name].base), out, name.removeprefix("tf-").removesuffix("-own-head"))
    elif name in ("flux-pipeline", "flux-pipeline-bin"):
        flux_pipeline_peer(base("flux"), out, safe_serialization=name == "flux-pipeline")
    elif name in ("flux-model", "flux-model-bin"):
        flux_model_peer(base("flux"), out, safe_serialization=name == "flux-model")
    elif name == "tf-float8-as-int8wo":
        _declared(_copy(source("tf-float8wo"), out), source("tf-int8wo"))
    elif name in ("tf-nan-scale", "tf-zero-scale"):
        break_scale(_copy(source("tf-int8wo"), out), LLAMA_LAYER, float("nan") if name == "tf-nan-scale" else 0.0)
    elif name == "tf-sign-flip":
        flip_signs(_copy(source("tf-int8wo"), out), LLAMA_LAYER)
    elif name == "tf-undeclared":
        drop_declared(_copy(source("tf-int8wo"), out))
    else:
        raise ValueError(f"no peer checkpoint {name!r}; one of: {', '.join(PEERS)}")
    made[name] = out
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m publisher.testing.peers", description="Build the peer corpus.")
    parser.add_argument("dir", nargs="?", type=Path)
    parser.add_argument("names", nargs="*", help="entries to build (default: all)")
    parser.add_argument("--list", action="store_true", help="list the entries with their expected verdicts")
    args = parser.parse_args(argv)
    if args.list or args.dir is None:
        for p in CORPUS:
            print(f"{p.name:<20} {p.verdict:<5} with base: {p.with_base:<5} {p.what}")
        return 0
    bases: dict[str, Path] = {}
    made: dict[str, Path] = {}
    for name in args.names or list(PEERS):
        print(build_peer(name, args.dir / name, bases, made))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
