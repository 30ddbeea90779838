"""Every FLUX-shaped transformer config of the tests, the benchmark and the scripts, and the builder that uses them.

FLUX.1-dev's transformer (``black-forest-labs/FLUX.1-dev``, ``transformer/config.json``) is the shape that
matters: inner dim 3072 (24 heads x 128), 19 double-stream + 38 single-stream blocks, T5-XXL d_model 4096,
CLIP-L pooled 768, 16 latent channels packed 2x2 (x_embedder in_features 64). The small configs keep its
structure (every kind of FLUX Linear) and say what their dimensions are for. FLUX requires
``sum(axes_dims_rope) == attention_head_dim``.

The dicts are shared: copy one (``dict(FLUX_TINY_FP8, ...)``) before changing it.
torch/diffusers are imported inside the functions so that importing this module is instant.
"""

from __future__ import annotations

from typing import Any

FLUX_DEV: dict[str, Any] = dict(
    patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_DEV_BF16_BYTES = 23.8e9  # its transformer's weights in bf16 (11.9 B parameters)

# The tiny FluxPipeline's transformer (publisher.testing.tiny.build_tiny_flux): inner dim 128 (2 heads x 64),
# so every Linear's in_features is a multiple of 128 and grouped configs (PerGroup(32/64/128)) apply everywhere.
TINY_TEXT_DIM = 128  # CLIP hidden size (= pooled_projection_dim) and T5 d_model (= joint_attention_dim)


def tiny_pipeline_transformer(latent_channels: int = 32) -> dict[str, Any]:
    """``latent_channels=32`` makes x_embedder's in_features 128; 16 reproduces FLUX.1-dev's 64."""
    return dict(
        patch_size=1,
        in_channels=4 * latent_channels,  # the pipeline packs 2x2 latent patches
        num_layers=1,  # 1 double-stream + 1 single-stream block: every FLUX Linear kind, ~1 M params
        num_single_layers=1,
        attention_head_dim=64,
        num_attention_heads=2,
        joint_attention_dim=TINY_TEXT_DIM,
        pooled_projection_dim=TINY_TEXT_DIM,
        guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
        axes_dims_rope=(8, 28, 28),
    )


# FP8 checks (scripts/gpu_check.py --tiny, tests/test_fp8cpu.py): every Linear dim a multiple of 16 (float8
# skips the others) and inner dim 192 (3 heads x 64), not 128: torchao 0.18 mistakes a 128x128 PerTensor
# weight for 128x128 blockwise.
FLUX_TINY_FP8: dict[str, Any] = dict(
    FLUX_DEV, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=3,
    joint_attention_dim=128, pooled_projection_dim=64, axes_dims_rope=(8, 28, 28),
)

# Streaming engine tests (tests/test_streaming.py): 2 + 2 blocks, so exclusion patterns match several blocks,
# and dims small enough that a 100-200 KB max_shard_size gives several shards.
FLUX_TINY_SHARDED: dict[str, Any] = dict(
    FLUX_DEV, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
    joint_attention_dim=48, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
)


def flux_dev_shaped(num_layers: int, num_single_layers: int) -> dict[str, Any]:
    """FLUX.1-dev's transformer with fewer blocks (real dimensions, so real tensor sizes)."""
    return dict(FLUX_DEV, num_layers=num_layers, num_single_layers=num_single_layers)


def bf16_bytes(config: dict[str, Any]) -> int:
    """The bf16 size of a FluxTransformer2DModel's weights, counted on the meta device."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(config)
    return sum(t.numel() for t in model.state_dict().values()) * torch.bfloat16.itemsize


def flux_dev_blocks(size_gb: float) -> tuple[int, int]:
    """Double/single block counts whose FLUX.1-dev-shaped transformer is nearest ``size_gb`` GB in bf16,
    keeping FLUX.1-dev's 1:2 ratio where possible (2.5 or 2.6 -> 2 + 4 blocks, 2.62 GB)."""
    base = bf16_bytes(flux_dev_shaped(0, 0))
    double, single = bf16_bytes(flux_dev_shaped(1, 0)) - base, bf16_bytes(flux_dev_shaped(0, 1)) - base
    target = size_gb * 1e9
    d = max(1, round((target - base) / (double + 2 * single)))
    s = max(1, round((target - base - d * double) / single))
    return d, s


def flux_transformer(config: dict[str, Any], *, seed: int = 0, device: str = "cpu") -> Any:
    """A FluxTransformer2DModel with seeded random bf16 weights, initialised on ``device`` (fast on a GPU)."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        return FluxTransformer2DModel.from_config(config).to(torch.bfloat16).eval()
