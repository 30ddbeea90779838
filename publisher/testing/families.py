"""The family corpus: one tiny base per model family the tool is tested on, by name.

``build_family(name, dir)`` writes a complete repo folder (as a Hub repo of that family holds it), offline and
in seconds. Command line: ``python -m publisher.testing.families NAME DIR`` (``--list`` for the names).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from publisher.testing import family_pipelines as fp
from publisher.testing.family_lms import LM_FAMILIES, build_lm
from publisher.testing.tiny import build_tiny_flux


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "image" | "video" pipeline, or "lm"
    build: Callable[[Path], Path]
    what: str  # the class that makes the family, for docs and test ids


def _lm(name: str) -> Callable[[Path], Path]:
    return lambda path: build_lm(name, path)


PIPELINES = (
    Family("flux", "image", lambda p: build_tiny_flux(p), "FluxPipeline"),
    Family("flux_kontext", "image", fp.build_flux_kontext, "FluxKontextPipeline"),
    Family("sd3", "image", fp.build_sd3, "StableDiffusion3Pipeline (stored in float16)"),
    Family("sd15", "image", fp.build_sd15, "StableDiffusionPipeline (UNet, stored in float32)"),
    Family("sdxl", "image", fp.build_sdxl, "StableDiffusionXLPipeline (UNet with text_time conditioning, float32)"),
    Family("lumina2", "image", fp.build_lumina2, "Lumina2Pipeline (Gemma2 text encoder)"),
    Family("pixart_sigma", "image", fp.build_pixart_sigma, "PixArtSigmaPipeline (top-level scale_shift_table)"),
    Family("sana", "image", fp.build_sana, "SanaPipeline (DC-AE, top-level scale_shift_table)"),
    Family("auraflow", "image", fp.build_auraflow, "AuraFlowPipeline (top-level register_tokens)"),
    Family("qwenimage", "image", fp.build_qwenimage, "QwenImagePipeline (Qwen2.5-VL text encoder)"),
    Family("cogvideox", "video", fp.build_cogvideox, "CogVideoXPipeline"),
    Family("wan", "video", fp.build_wan, "WanPipeline (top-level scale_shift_table)"),
    Family("ltx", "video", fp.build_ltx, "LTXPipeline (top-level scale_shift_table)"),
)
_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM (tied embeddings)", "qwen3": "Qwen3ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM (Gemma 3 text)", "mistral": "MistralForCausalLM",
               "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM (MoE)", "qwen2_moe": "Qwen2MoeForCausalLM (MoE)",
               "gpt2": "GPT2LMHeadModel (Conv1D layers, float32)"}
LMS = tuple(Family(n, "lm", _lm(n), _LM_CLASSES[n]) for n in LM_FAMILIES)
FAMILIES = {f.name: f for f in PIPELINES + LMS}


def build_family(name: str, path: Path | str) -> Path:
    if name not in FAMILIES:
        raise ValueError(f"no family {name!r}; one of: {', '.join(FAMILIES)}")
    return FAMILIES[name].build(Path(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m publisher.testing.families", description="Build one tiny family base.")
    parser.add_argument("name", nargs="?", choices=sorted(FAMILIES))
    parser.add_argument("dir", nargs="?", type=Path)
    parser.add_argument("--list", action="store_true", help="list the families and exit")
    args = parser.parse_args(argv)
    if args.list or args.name is None or args.dir is None:
        for f in FAMILIES.values():
            print(f"{f.name:<14} {f.kind:<6} {f.what}")
        return 0
    print(build_family(args.name, args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
