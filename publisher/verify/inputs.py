"""Seeded inputs for one forward pass of a transformers model, from its forward signature and config.

Used for causal LMs and for text encoders that a pipeline run did not record (verify/capture.py records
pipeline calls). No per-family table: token ids within the vocabulary, as many as fit the position table.
"""

from __future__ import annotations

import inspect
from typing import Any

SEQ_LEN = 8


def _vocab_size(config: dict[str, Any]) -> int:
    for source in (config, config.get("text_config") or {}):
        if isinstance(source.get("vocab_size"), int) and source["vocab_size"] > 0:
            return int(source["vocab_size"])
    return 0


def token_inputs(class_name: str, config: dict[str, Any], seed: int = 0) -> tuple[dict[str, Any] | None, str]:
    """(keyword arguments for ``model(**inputs)``, how they were made) or (None, why there are none)."""
    import torch
    import transformers

    cls = getattr(transformers, class_name, None)
    if cls is None:
        return None, f"transformers has no class {class_name}"
    params = inspect.signature(cls.forward).parameters
    if "input_ids" not in params:
        return None, f"{class_name}.forward takes no input_ids"
    required = [n for n, p in params.items() if n not in ("self", "input_ids") and p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if required:
        return None, f"{class_name}.forward requires {', '.join(required)}, which its config does not determine"
    vocab = _vocab_size(config)
    if not vocab:
        return None, f"the config of {class_name} has no vocab_size"
    positions = [v for k, v in config.items() if k in ("max_position_embeddings", "n_positions") and isinstance(v, int)]
    length = max(1, min([SEQ_LEN, *positions]))
    gen = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": torch.randint(0, vocab, (1, length), generator=gen)}
    if config.get("is_encoder_decoder") and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = torch.randint(0, vocab, (1, length), generator=gen)
    return inputs, f"{length} seeded token ids (from {class_name}'s forward signature and config)"
