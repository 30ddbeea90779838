"""Tiny but complete models, saved to a folder exactly as a Hub repo would hold them.

Used by the test suite and the offline demo (which uploads the folder to a local Hub server and runs
the tool on it). Nothing here downloads anything: weights are random (seeded), tokenizers are built
from in-memory vocabularies.

Dimensions are chosen so every Linear's in_features is a multiple of 128, so that grouped torchao
configs (PerGroup(32/64/128)) apply to every layer without exclusions. The same seed gives the same
bytes in every file.

torch/diffusers/transformers are imported inside the functions so that `import publisher.testing.tiny` is instant.

Command line: ``python -m publisher.testing.tiny flux|llama|not-a-model|remote-code DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from publisher.testing.configs import TINY_TEXT_DIM, tiny_pipeline_transformer

T5_MAX_LENGTH = 512  # FLUX.1-dev's tokenizer_2 model_max_length
CLIP_MAX_LENGTH = 77  # the pipeline pads CLIP prompts to tokenizer.model_max_length: must fit the position table

# Words that get whole-word tokens; everything else falls back to characters (or unk).
_WORDS = ("a", "an", "the", "cat", "dog", "photo", "of", "on", "in", "hello", "world", "is", "and", "red", "sat")

_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
        "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
        "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
        "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*", "*.jpg",
    )
)

_FLUX_LICENSE = """\
FLUX.1-tiny [dev] Non-Commercial License (test fixture)

This file stands in for the FLUX.1 [dev] Non-Commercial License shipped with
black-forest-labs/FLUX.1-dev. The tiny model it accompanies has random weights and exists only
to test tooling. Derivatives must carry this license and its notice.
"""


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (model constructors use it) without disturbing the caller's RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _front_matter(meta: dict[str, Any]) -> str:
    lines = ["---"]
    for key, value in meta.items():
        if isinstance(value, list):
            lines.append(f"{key}:")
            lines.extend(f"- {item}" for item in value)
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines + ["---", ""])


def _write_text(path: Path, text: str) -> None:
    # newline="\n": identical bytes on every OS (the determinism test hashes files).
    path.write_text(text, encoding="utf-8", newline="\n")


def _add_word_merges(vocab: dict[str, int], merges: list[tuple[str, str]], word: str, end: str = "") -> None:
    """Append the BPE merges that build `word` left to right (c+a -> ca, ca+t -> cat); `end` marks the last piece."""
    left = word[0]
    for i, ch in enumerate(word[1:], start=1):
        right = ch + (end if i == len(word) - 1 else "")
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)
        left += right


def _prepare(path: Path | str) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------------------------- FLUX


def clip_tokenizer() -> Any:
    """A CLIP BPE tokenizer over all 256 byte-level symbols (no prompt hits unk) plus a few whole words.

    transformers 5 builds it from in-memory `vocab` (dict) and `merges` (list of *tuples*: strings fail
    with "failed to extract enum PyMerges"); `vocab_file=`/`merges_file=` are silently ignored, and
    `from_pretrained(dir)` would write `"is_local": true` into tokenizer_config.json.
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())  # sorted: alphabet() is an unordered set
    vocab: dict[str, int] = {}
    for token in chars + [c + "</w>" for c in chars]:
        vocab[token] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        _add_word_merges(vocab, merges, word, end="</w>")  # CLIP marks word ends with </w>
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer() -> Any:
    """A T5 (Unigram) tokenizer: pad=0, eos=1, unk=2 as in T5; no <extra_id_*> sentinels."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in _WORDS]
    pieces += [(chr(c), -5.0) for c in range(33, 127)]
    pieces += [("▁" + chr(c), -4.0) for c in range(33, 127) if "▁" + chr(c) not in dict(pieces)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def build_tiny_flux(
    path: Path | str, *, seed: int = 0, license: str | None = "other", latent_channels: int = 32
) -> Path:
    """Write a complete tiny FLUX.1-dev-like repo (diffusers FluxPipeline layout) into `path`.

    `license="other"` mimics FLUX.1-dev (license_name/license_link + LICENSE.md); another string writes
    just `license: <value>`; None writes no licence fields and no LICENSE.md.
    `latent_channels=32` makes x_embedder's in_features 128; 16 reproduces FLUX.1-dev's in_features 64
    (a layer that PerGroup(128) configs must exclude).
    """
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    path = _prepare(path)
    clip_tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    with seeded(seed):
        transformer = FluxTransformer2DModel(**tiny_pipeline_transformer(latent_channels))
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(clip_tok),
                hidden_size=TINY_TEXT_DIM,
                intermediate_size=2 * TINY_TEXT_DIM,
                num_hidden_layers=1,
                num_attention_heads=4,
                max_position_embeddings=CLIP_MAX_LENGTH,
                hidden_act="quick_gelu",
                projection_dim=TINY_TEXT_DIM,
                # The pooled output is taken at the first eos token (eos_token_id == 2 means legacy argmax).
                bos_token_id=clip_tok.bos_token_id,
                eos_token_id=clip_tok.eos_token_id,
                pad_token_id=clip_tok.pad_token_id,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tok),
                d_model=TINY_TEXT_DIM,
                d_kv=32,
                d_ff=2 * TINY_TEXT_DIM,
                num_layers=1,
                num_heads=4,
                feed_forward_proj="gated-gelu",  # T5 v1.1 / T5-XXL as used by FLUX
                relative_attention_num_buckets=8,
                is_encoder_decoder=False,
                use_cache=False,
                pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            )
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,  # 4 blocks: 8x downsampling as in FLUX
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=8,
            sample_size=64,
            scaling_factor=0.3611, shift_factor=0.1159,  # FLUX.1-dev's VAE values
            use_quant_conv=False, use_post_quant_conv=False,
        )
    # FLUX.1-dev ships every component in bf16; bf16 convs/matmuls run on CPU.
    # nn.Module.to, not diffusers' ModelMixin.to, which warns about casting with to() (nothing here needs fp32).
    for module in (transformer, text_encoder, text_encoder_2, vae):
        torch.nn.Module.to(module, torch.bfloat16).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler_config.json
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, transformer=transformer,
        text_encoder=text_encoder, tokenizer=clip_tok, text_encoder_2=text_encoder_2, tokenizer_2=t5_tok,
    )
    pipe.save_pretrained(path, safe_serialization=True)

    # FLUX.1-dev's root also holds the original single-file checkpoint; tools must not mistake it for the model.
    state = {k: v.contiguous() for k, v in transformer.state_dict().items()}
    save_file(state, str(path / "flux1-tiny.safetensors"), metadata={"format": "pt"})
    _write_text(path / ".gitattributes", _GITATTRIBUTES)
    _write_flux_card(path, license)
    return path


def _write_flux_card(path: Path, license: str | None) -> None:
    meta: dict[str, Any] = {"language": ["en"]}
    if license == "other":
        meta |= {
            "license": "other",
            "license_name": "flux-1-dev-non-commercial-license",
            "license_link": "LICENSE.md",  # relative, as on FLUX.1-dev
        }
        _write_text(path / "LICENSE.md", _FLUX_LICENSE)
    elif license is not None:
        meta["license"] = license
    else:
        (path / "LICENSE.md").unlink(missing_ok=True)
    meta |= {"pipeline_tag": "text-to-image", "library_name": "diffusers",
             "tags": ["text-to-image", "image-generation", "flux"]}
    body = """
# FLUX.1-tiny [dev]

A tiny, randomly initialised stand-in for `black-forest-labs/FLUX.1-dev`, with the same repo layout
(diffusers `FluxPipeline` folders plus a single-file checkpoint at the root). It produces noise; it
exists to test tooling offline.
"""
    if license == "other":
        body += "\nThis model falls under the [FLUX.1-tiny [dev] Non-Commercial License](LICENSE.md).\n"
    body += """
## Usage

```python
import torch
from diffusers import FluxPipeline

pipe = FluxPipeline.from_pretrained("<this repo>", torch_dtype=torch.bfloat16)
image = pipe("a cat", num_inference_steps=2, height=64, width=64, guidance_scale=3.5).images[0]
```
"""
    _write_text(path / "README.md", _front_matter(meta) + body)


# ---------------------------------------------------------------------------------------------- Llama


def llama_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (any text encodes and round-trips), Llama-2 style specials, bos prepended.

    Padded with `<|reserved_special_token_N|>` (as Llama 3 does) to exactly `vocab_size`, so every id the
    random model can generate decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<unk>", "<s>", "</s>"]
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # sorted: alphabet() is an unordered set
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        _add_word_merges(vocab, merges, word)
    # "Ġ" is the byte-level space; it must join the *finished* word (a lower-ranked "Ġ t" would never fire,
    # because "t h" ranks first and consumes the "t").
    for word in _WORDS:
        merges.append(("Ġ", word))
        vocab["Ġ" + word] = len(vocab)
    n_reserved = vocab_size - len(vocab)
    if n_reserved < 0:
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab)} base tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=256
    )
    fast.add_tokens([f"<|reserved_special_token_{i}|>" for i in range(n_reserved)], special_tokens=True)
    return fast


def build_tiny_llama(path: Path | str, *, seed: int = 0) -> Path:
    """Write a tiny Llama repo (bf16 safetensors, tokenizer, generation config, card) into `path`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = _prepare(path)
    vocab_size = 384  # a multiple of 128, like Llama's padded vocabularies
    tok = llama_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention as in Llama 3: k/v_proj out_features 64
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,  # lm_head is its own Linear (Llama 3 8B layout)
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with seeded(seed):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    # transformers 5 records its internal "TokenizersBackend"; Hub Llama repos say "PreTrainedTokenizerFast",
    # which transformers 5 maps to the same class and transformers 4 can also load.
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_text(tok_config_path, json.dumps(tok_config, indent=2) + "\n")
    _write_text(path / ".gitattributes", _GITATTRIBUTES)
    meta = {"license": "apache-2.0", "language": ["en"], "pipeline_tag": "text-generation",
            "library_name": "transformers", "tags": ["llama", "tiny"]}
    body = """
# tiny-llama

A tiny, randomly initialised `LlamaForCausalLM` (2 layers, hidden size 128) with a byte-level BPE
tokenizer. It generates nonsense; it exists to test tooling offline.
"""
    _write_text(path / "README.md", _front_matter(meta) + body)
    return path


# --------------------------------------------------------------------------------- not-loadable repos


def build_not_a_model(path: Path | str) -> Path:
    """A repo that is neither diffusers nor transformers: a dataset-like README and a CSV."""
    path = _prepare(path)
    _write_text(path / "README.md", _front_matter({"license": "mit", "tags": ["tabular"]}) + "\n# Some data\n")
    _write_text(path / "data.csv", "id,text,label\n1,hello world,0\n2,a cat,1\n")
    return path


def build_remote_code_model(path: Path | str) -> Path:
    """A transformers repo whose model class lives in the repo (needs trust_remote_code); it need not load."""
    path = _prepare(path)
    config = {
        "architectures": ["XForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"},
        "model_type": "x",  # unknown to transformers: only the repo's own code can load it
        "hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 384,
        "dtype": "bfloat16", "transformers_version": "5.23.0",
    }
    _write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    _write_text(
        path / "configuration_x.py",
        "from transformers import PretrainedConfig\n\n\n"
        "class XConfig(PretrainedConfig):\n    model_type = \"x\"\n",
    )
    _write_text(
        path / "modeling_x.py",
        "# Remote code: executing this is exactly what the tool must refuse to do.\n"
        "raise RuntimeError(\"remote code was executed\")\n",
    )
    meta = {"license": "apache-2.0", "library_name": "transformers", "pipeline_tag": "text-generation"}
    _write_text(path / "README.md", _front_matter(meta) + "\n# x-model (custom code)\n")
    return path


# ------------------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m publisher.testing.tiny", description="Build a tiny test repo folder.")
    parser.add_argument("kind", choices=["flux", "llama", "not-a-model", "remote-code"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="flux and llama only")
    parser.add_argument("--no-license", action="store_true", help="flux only: card without licence fields")
    args = parser.parse_args(argv)
    if args.kind == "flux":
        out = build_tiny_flux(args.dir, seed=args.seed, license=None if args.no_license else "other")
    elif args.kind == "llama":
        out = build_tiny_llama(args.dir, seed=args.seed)
    elif args.kind == "not-a-model":
        out = build_not_a_model(args.dir)
    else:
        out = build_remote_code_model(args.dir)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
