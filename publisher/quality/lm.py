"""Language models: perplexity on real text and a greedy continuation, base and quantized, in bounded memory.

Perplexity runs through the verification's own block-by-block machinery. For a streamed component it runs **during
the quantization pass** (``verify/inpass.py``: a second observer of the same pass, fed the same tensors, so the
base is read once, by HTTP range under ``--low-disk``); otherwise, or when that observer had to give up, after the
pass, one block at a time from the weights' sources (``sources.py``). The language-model head's forward is replaced
by one that turns the hidden states into per-token negative log-likelihoods a chunk of positions at a time, so the
logits of the whole text (tokens x vocabulary) never exist at once.

The greedy continuation needs one forward pass per new token: transformers' own ``generate`` runs on the
meta-device model with the block loader attached (``verify/streaming.BlockLoader``), so every step reads the
weights again, one block at a time; with a KV cache each step is one token per prompt.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher.loadpath import forward
from publisher.quality.sources import Weights
from publisher.streaming.shards import TensorReader, build_index
from publisher.verify import streaming as blockwise  # BLOCK_BUDGET read when a model is built (tests lower it)
from publisher.verify.inpass import InPassForward
from publisher.verify.streaming import BlockLoader, meta_model

log = logging.getLogger(__name__)

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
NEW_TOKENS = 16
HEAD_CHUNK = 128  # positions whose logits exist at once (Llama-3's vocabulary: 128 x 128256 x 4 bytes = 66 MB)


class NllHead:
    """Installed as the head's ``forward``: hidden states ``[B, T, H]`` -> float32 ``[B, T]``, the negative
    log-likelihood of token t+1 at position t (0 at the last position, which has no next token)."""

    def __init__(self, head: Any, targets: Any) -> None:
        self.forward = type(head).forward.__get__(head)  # the module's own forward (its hooks run around this one)
        self.rows = head.__dict__.get("row_linear")  # a head the block loader reads row by row (verify/rowwise.py)
        self.targets = targets

    def __call__(self, hidden: Any) -> Any:
        import torch

        batch, length = hidden.shape[0], hidden.shape[1]
        if hidden.is_meta:
            return torch.empty(batch, length, device="meta")
        if self.rows is not None:  # the vocabulary a chunk at a time: the head's weight is read once
            return self.rows.nll(hidden, self.targets[:, :length])
        out = torch.zeros(batch, length, dtype=torch.float32)
        for start in range(0, length - 1, HEAD_CHUNK):
            end = min(start + HEAD_CHUNK, length - 1)
            logits = self.forward(hidden[:, start:end]).float()
            out[:, start:end] = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), self.targets[:, start + 1:end + 1], reduction="none")
        return out


def nll_head(targets: Any) -> Any:
    """``prepare(model)`` for a perplexity pass over ``targets`` (the input ids)."""

    def prepare(model: Any) -> None:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (language-model head)")
        head.forward = NllHead(head, targets)

    return prepare


def perplexity(nll: Any) -> float:
    """exp(mean NLL) over every scored position (all but each window's last)."""
    return float(math.exp(float(nll[:, :-1].double().mean())))


def observer(library: str, class_name: str, config: dict[str, Any], ids: Any, label: str) -> Any:
    """The in-pass perplexity observer (an ``InPassForward`` whose inputs are the evaluation windows)."""

    return InPassForward(library, class_name, config, {"input_ids": ids}, f"{label} perplexity", prepare=nll_head(ids))


def nll_after_pass(weights: Weights, library: str, class_name: str, config: dict[str, Any], ids: Any) -> Any:
    """Per-token NLL with one block of ``weights`` in memory at a time (after the pass)."""

    with _loaded(weights, library, class_name, config) as model:
        nll_head(ids)(model)
        return forward(model, library, {"input_ids": ids}).detach().clone()


class _TokenLines:
    """A ``generate`` streamer that calls ``each(n)`` after the n-th new token (its first ``put`` is the prompt)."""

    def __init__(self, each: Callable[[int], None]) -> None:
        self.each, self.calls = each, 0

    def put(self, value: Any) -> None:
        if self.calls:
            self.each(self.calls)
        self.calls += 1

    def end(self) -> None:
        pass


def greedy(weights: Weights, library: str, class_name: str, config: dict[str, Any], tokenizer_dir: Path,
           prompts: list[str], new_tokens: int, max_time: float | None = None,
           each_token: Callable[[int], None] | None = None) -> list[list[int]]:
    """The new token ids of greedy continuations of ``prompts`` (one batch, left-padded); fewer than ``new_tokens``
    when ``max_time`` seconds run out first (transformers' own ``max_time`` criterion, checked after every token).
    ``each_token(n)``: called after the n-th new token (progress lines)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with _loaded(weights, library, class_name, config) as model:
        try:
            model.generation_config = GenerationConfig.from_pretrained(tokenizer_dir)
        except OSError:
            pass  # no generation_config.json: the model config's defaults
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, max_time=max_time,
                                 streamer=_TokenLines(each_token) if each_token else None)
    width = batch["input_ids"].shape[1]
    return [row[width:].tolist() for row in out]


def decode(tokenizer_dir: Path, rows: list[list[int]], tokens: int) -> list[str]:
    """The first ``tokens`` new tokens of each row as text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer.decode(row[:tokens], skip_special_tokens=True) for row in rows]


class _loaded:
    """The meta-device model with ``weights``' block loader attached (and detached again on exit)."""

    def __init__(self, weights: Weights, library: str, class_name: str, config: dict[str, Any]) -> None:
        self.args = (weights, library, class_name, config)

    def __enter__(self) -> Any:
        weights, library, class_name, config = self.args
        model = meta_model(library, class_name, config)
        self.reader = TensorReader(weights.source, build_index(weights.source))
        self.loader = BlockLoader(model, self.reader, blockwise.BLOCK_BUDGET, weights.cast)
        self.loader.attach()
        return model

    def __exit__(self, *exc: object) -> None:
        self.loader.detach()
        self.reader.close()


@dataclass
class LmFigures:
    """What the card and --json say about a language model's quality."""

    dataset: str
    tokens: int = 0  # scored positions
    windows: int = 0
    window: int = 0
    base_ppl: float | None = None
    quantized_ppl: float | None = None
    where: str = ""  # "during the quantization pass" / "after the pass, block by block"
    reason: str = ""  # why no perplexity
    limited: str = ""  # why fewer tokens than --eval-tokens were scored
    seconds: dict[str, float] = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)
    base_text: list[str] = field(default_factory=list)
    quantized_text: list[str] = field(default_factory=list)
    new_tokens: int = 0
    continuation_reason: str = ""  # why no continuation
    continuation_limited: str = ""  # why fewer than the asked new tokens
    budget_s: float = 0.0  # --eval-budget in seconds (auto resolved)

    @property
    def recovery(self) -> float | None:
        if self.base_ppl is None or self.quantized_ppl is None:
            return None
        # The ratio first: x / x is exactly 1.0, so a model against itself recovers exactly 100 (100 * x / x rounds
        # 100 * x first and need not give 100 back).
        return 100.0 * (self.base_ppl / self.quantized_ppl)
