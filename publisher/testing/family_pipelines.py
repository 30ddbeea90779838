"""Tiny diffusers pipelines of every family the tool is tested on, built offline in seconds.

The component configs follow the spirit of diffusers' own fast tests (``get_dummy_components()``: one or
two blocks, a few heads, a handful of channels), written out here so nothing is downloaded; tokenizers
come from ``tiny.py``'s in-memory vocabularies. Each builder saves the pipeline with
``save_pretrained`` in the dtype the real repos of that family are stored in (SD 1.5 and SDXL in
float32, SD3 in float16, the others in bfloat16), because the dtype of the base is part of what the
tool must handle.

torch/diffusers/transformers are imported inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from publisher.testing.tiny import build_tiny_flux, clip_tokenizer, llama_tokenizer, seeded, t5_tokenizer

TEXT = 32  # hidden size of every tiny text encoder


def _clip(with_projection: bool = False, hidden: int = TEXT) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tok = clip_tokenizer()
    config = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="gelu", projection_dim=hidden, layer_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config), tok


def _t5(umt5: bool = False) -> Any:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    tok = t5_tokenizer()
    common = dict(vocab_size=len(tok), d_model=TEXT, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, is_encoder_decoder=False, use_cache=False,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = UMT5EncoderModel(UMT5Config(**common)) if umt5 else T5EncoderModel(T5Config(**common))
    return model, tok


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2Model

    tok = llama_tokenizer(384)
    tok.pad_token = tok.unk_token  # the pipelines pad prompts to a fixed length
    config = Gemma2Config(vocab_size=384, hidden_size=TEXT, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=16, sliding_window=4,
                          max_position_embeddings=512, pad_token_id=0, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    return Gemma2Model(config), tok


def _vae_kl(latent_channels: int = 4, **factors: float) -> Any:
    """4 blocks: 8x downsampling, as in every AutoencoderKL of these families."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8,) * 4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=4, sample_size=32, **factors,
    )


def _save(pipe: Any, path: Path, dtype: str, tags: list[str], pipeline_tag: str = "text-to-image") -> Path:
    """Cast every model to the family's storage dtype and save the pipeline with a small card."""
    import torch

    target = getattr(torch, dtype)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            torch.nn.Module.to(module, target).eval()  # nn.Module.to: diffusers' own .to() warns about dtype casts
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    front = ["---", "license: apache-2.0", f"pipeline_tag: {pipeline_tag}", "library_name: diffusers", "tags:"]
    front += [f"- {t}" for t in tags] + ["---", "", f"# tiny {type(pipe).__name__} (random weights, for tests)", ""]
    (path / "README.md").write_text("\n".join(front), encoding="utf-8", newline="\n")
    return path


def build_flux_kontext(path: Path, seed: int = 0) -> Path:
    """FLUX.1 Kontext: FLUX's components under FluxKontextPipeline (it also runs without an input image)."""
    build_tiny_flux(path, seed=seed, license="apache-2.0")
    (path / "flux1-tiny.safetensors").unlink()
    index = json.loads((path / "model_index.json").read_text())
    index["_class_name"] = "FluxKontextPipeline"
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


def build_sd3(path: Path, seed: int = 0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    with seeded(seed):
        (te, tok), (te2, tok2), (te3, tok3) = _clip(True), _clip(True), _t5()
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
            caption_projection_dim=32, joint_attention_dim=TEXT, pooled_projection_dim=2 * TEXT, out_channels=4,
        )
        vae = _vae_kl(shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=te, tokenizer=tok,
        text_encoder_2=te2, tokenizer_2=tok2, text_encoder_3=te3, tokenizer_3=tok3,
    )
    return _save(pipe, path, "float16", ["sd3"])


def _unet(sdxl: bool) -> Any:
    from diffusers import UNet2DConditionModel

    extra: dict[str, Any] = {}
    if sdxl:  # the text_time conditioning: pooled text embeds + 6 size/crop ids
        extra = dict(addition_embed_type="text_time", addition_time_embed_dim=8, use_linear_projection=True,
                     projection_class_embeddings_input_dim=6 * 8 + TEXT, transformer_layers_per_block=(1, 2))
    return UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=2 * TEXT if sdxl else TEXT, attention_head_dim=(2, 4), norm_num_groups=8, **extra,
    )


def build_sd15(path: Path, seed: int = 0) -> Path:
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    with seeded(seed):
        te, tok = _clip()
        unet, vae = _unet(sdxl=False), _vae_kl()
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return _save(pipe, path, "float32", ["stable-diffusion"])


def build_sdxl(path: Path, seed: int = 0) -> Path:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    with seeded(seed):
        (te, tok), (te2, tok2) = _clip(), _clip(True)
        unet, vae = _unet(sdxl=True), _vae_kl()
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="scaled_linear",
                                       timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=te, tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok2,
                                     unet=unet, scheduler=scheduler)
    return _save(pipe, path, "float32", ["stable-diffusion-xl"])


def build_lumina2(path: Path, seed: int = 0) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    with seeded(seed):
        te, tok = _gemma2()
        transformer = Lumina2Transformer2DModel(
            sample_size=4, patch_size=2, in_channels=4, hidden_size=16, num_layers=2, num_refiner_layers=1,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 2, 2), axes_lens=(300, 32, 32),
            cap_feat_dim=TEXT,
        )
        vae = _vae_kl(shift_factor=0.0609, scaling_factor=1.5035)
    pipe = Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=te,
                           tokenizer=tok)
    return _save(pipe, path, "bfloat16", ["lumina2"])


def build_pixart_sigma(path: Path, seed: int = 0) -> Path:
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    with seeded(seed):
        te, tok = _t5()
        transformer = PixArtTransformer2DModel(
            sample_size=32, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3, caption_channels=TEXT,
            in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True, activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
        )
        vae = _vae_kl()
    pipe = PixArtSigmaPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer, scheduler=DDIMScheduler())
    return _save(pipe, path, "bfloat16", ["pixart-sigma"])


def build_sana(path: Path, seed: int = 0) -> Path:
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    with seeded(seed):
        te, tok = _gemma2()
        transformer = SanaTransformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=8,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=TEXT,
            sample_size=16,  # 512 px at the DC-AE's 32x: the pipeline bins sizes by it
        )
        blocks = ("ResBlock",) * 5 + ("EfficientViTBlock",)  # 6 stages: 32x downsampling, as in Sana's DC-AE
        vae = AutoencoderDC(
            in_channels=3, latent_channels=4, attention_head_dim=2, encoder_block_types=blocks, decoder_block_types=blocks,
            encoder_block_out_channels=(8,) * 6, decoder_block_out_channels=(8,) * 6,
            encoder_qkv_multiscales=((),) * 5 + ((5,),), decoder_qkv_multiscales=((),) * 5 + ((5,),),
            encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6, downsample_block_type="conv",
            upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
        )
    pipe = SanaPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    return _save(pipe, path, "bfloat16", ["sana"])


def build_auraflow(path: Path, seed: int = 0) -> Path:
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler

    with seeded(seed):
        te, tok = _t5(umt5=True)
        transformer = AuraFlowTransformer2DModel(
            sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=TEXT, out_channels=4, pos_embed_max_size=256,
        )
        vae = _vae_kl()
    pipe = AuraFlowPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer,
                            scheduler=FlowMatchEulerDiscreteScheduler())
    return _save(pipe, path, "bfloat16", ["auraflow"])


def build_qwenimage(path: Path, seed: int = 0) -> Path:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = llama_tokenizer(512)
    tok.pad_token = tok.unk_token
    with seeded(seed):
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
        )
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
                                     latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        config = Qwen2_5_VLConfig(
            text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                         "num_key_value_heads": 2, "vocab_size": 512,
                         "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                         "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                         "rope_theta": 1000000.0},
            vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
            hidden_size=16, vocab_size=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, image_token_id=500, video_token_id=501, vision_start_token_id=502,
            vision_end_token_id=503, vision_token_id=504,
        )
        te = Qwen2_5_VLForConditionalGeneration(config)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=te, tokenizer=tok,
                             transformer=transformer)
    return _save(pipe, path, "bfloat16", ["qwen-image"])


def build_cogvideox(path: Path, seed: int = 0) -> Path:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel, DDIMScheduler

    with seeded(seed):
        te, tok = _t5()
        transformer = CogVideoXTransformer3DModel(
            num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=16, text_embed_dim=TEXT,
            num_layers=1, sample_width=2, sample_height=2, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
            max_text_seq_length=226,  # the pipeline's default prompt length, as in CogVideoX-2b
        )
        vae = AutoencoderKLCogVideoX(
            in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
            layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
        )
    pipe = CogVideoXPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer, scheduler=DDIMScheduler())
    return _save(pipe, path, "bfloat16", ["cogvideox"], pipeline_tag="text-to-video")


def build_wan(path: Path, seed: int = 0) -> Path:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    with seeded(seed):
        te, tok = _t5(umt5=True)
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=TEXT, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
    pipe = WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    return _save(pipe, path, "bfloat16", ["wan"], pipeline_tag="text-to-video")


def build_ltx(path: Path, seed: int = 0) -> Path:
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

    with seeded(seed):
        te, tok = _t5()
        transformer = LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4, attention_head_dim=8,
            cross_attention_dim=32, num_layers=1, caption_channels=TEXT,
        )
        vae = AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
            timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        )
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=te, tokenizer=tok, transformer=transformer)
    return _save(pipe, path, "bfloat16", ["ltx-video"], pipeline_tag="text-to-video")
