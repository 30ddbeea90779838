"""Fixed, seeded inputs for one forward pass of a component (used by verification and quality checks).

Small on purpose: verification compares bits, not images; a handful of tokens exercises every layer.
"""

from __future__ import annotations

from typing import Any


def build_inputs(library: str, class_name: str, config: dict[str, Any], seed: int = 0) -> dict[str, Any] | None:
    """Keyword arguments for ``model(**inputs)``, or None when we have no builder for the class
    (verification then compares weights only, and says so)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    if library == "transformers":
        vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0)
        if not vocab:
            return None
        ids = torch.randint(0, vocab, (1, 8), generator=gen)
        return {"input_ids": ids}
    if class_name == "FluxTransformer2DModel":
        img, txt = 16, 8
        inputs = {
            "hidden_states": torch.randn(1, img, config["in_channels"], generator=gen).to(bf16),
            "encoder_hidden_states": torch.randn(1, txt, config["joint_attention_dim"], generator=gen).to(bf16),
            "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=gen).to(bf16),
            "timestep": torch.tensor([0.5], dtype=bf16),
            "img_ids": torch.zeros(img, 3),
            "txt_ids": torch.zeros(txt, 3),
        }
        inputs["img_ids"][:, 1] = torch.arange(img) // 4
        inputs["img_ids"][:, 2] = torch.arange(img) % 4
        if config.get("guidance_embeds"):
            inputs["guidance"] = torch.tensor([3.5], dtype=torch.float32)
        return inputs
    if class_name in ("UNet2DConditionModel",):
        size = 8
        return {
            "sample": torch.randn(1, config["in_channels"], size, size, generator=gen).to(bf16),
            "timestep": torch.tensor([10]),
            "encoder_hidden_states": torch.randn(1, 8, config["cross_attention_dim"], generator=gen).to(bf16),
        }
    return None


def save_inputs(inputs: dict[str, Any] | None, path: Any) -> Any:
    """Write the inputs as safetensors (workers load them without any pickle); the path, or None."""
    if inputs is None:
        return None
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in inputs.items()}, str(path))
    return path
