"""Tiny transformers causal LMs of every family the tool is tested on, built offline in a second each.

Two layers, a few heads, the same byte-level tokenizer (``tiny.llama_tokenizer``) for all; each family keeps
what makes it different for the tool: tied embeddings (Qwen2, Gemma, GPT-2), fused and per-expert MoE
weights (Mixtral, Qwen2-MoE), GPT-2's Conv1D layers instead of nn.Linear, float32 storage (GPT-2), sliding
windows and soft-capping (Gemma2/3), fused qkv and gate_up projections (Phi3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from publisher.testing.tiny import llama_tokenizer, seeded

VOCAB = 384
SMALL: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2)  # tiny.llama_tokenizer's <s> and </s>


def _config(family: str) -> tuple[str, Any]:
    """(model class name, config) of one family."""
    import transformers as t

    if family == "llama":
        return "LlamaForCausalLM", t.LlamaConfig(**SMALL, head_dim=16)
    if family == "qwen2":
        return "Qwen2ForCausalLM", t.Qwen2Config(**SMALL, tie_word_embeddings=True)  # as Qwen2-0.5B/1.5B
    if family == "qwen3":
        return "Qwen3ForCausalLM", t.Qwen3Config(**SMALL, head_dim=16)
    if family == "gemma2":
        return "Gemma2ForCausalLM", t.Gemma2Config(**SMALL, head_dim=16, sliding_window=8)
    if family == "gemma3":
        return "Gemma3ForCausalLM", t.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=8)
    if family == "mistral":
        return "MistralForCausalLM", t.MistralConfig(**SMALL, head_dim=16, sliding_window=None)
    if family == "phi3":
        return "Phi3ForCausalLM", t.Phi3Config(**SMALL, pad_token_id=0)
    if family == "mixtral":
        return "MixtralForCausalLM", t.MixtralConfig(**SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return "Qwen2MoeForCausalLM", t.Qwen2MoeConfig(
            **SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1)
    if family == "gpt2":
        return "GPT2LMHeadModel", t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                                 bos_token_id=1, eos_token_id=2)
    raise ValueError(f"no tiny LM family {family!r}")


LM_FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "mistral", "phi3", "mixtral", "qwen2_moe", "gpt2")
# GPT-2 and most older checkpoints are stored in float32; the rest as their releases are, in bfloat16
_DTYPES = {"gpt2": "float32"}


def build_lm(family: str, path: Path, seed: int = 0) -> Path:
    """Write a tiny ``family`` causal LM repo (safetensors, tokenizer, generation config, card) into ``path``."""
    import torch
    import transformers

    class_name, config = _config(family)
    tok = llama_tokenizer(VOCAB)
    with seeded(seed):
        model = getattr(transformers, class_name)(config)
    model.to(getattr(torch, _DTYPES.get(family, "bfloat16"))).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    card = ["---", "license: apache-2.0", "pipeline_tag: text-generation", "library_name: transformers", "tags:",
            f"- {family}", "---", "", f"# tiny {class_name} (random weights, for tests)", ""]
    (path / "README.md").write_text("\n".join(card), encoding="utf-8", newline="\n")
    return path
