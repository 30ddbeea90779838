"""The documented library path, as the yardstick the streaming engine is compared with (tests, benchmark).

Kept next to the engine so both sides of every comparison build the same configs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from publisher.recipes import Recipe


def library_quantize(src_dir: Path, dst_dir: Path, *, library: str, recipe: Recipe, exclude: Sequence[str] = (),
                     class_name: str | None = None, device: str | None = None,
                     max_shard_size: int | str | None = None) -> Any:
    """``Cls.from_pretrained(src, quantization_config=TorchAoConfig(...), bf16)`` then ``save_pretrained(dst)``.

    ``device="cuda"`` loads with ``device_map="cuda"`` (quantizing on the GPU), as publisher.stages.quantize does; FP8-dynamic
    recipes on a CPU load inside fp8cpu's bypass, likewise. Returns the quantized model.
    """
    import json
    from contextlib import nullcontext

    import torch

    from publisher.recipes import build_config

    config = build_config(recipe)
    kwargs: dict[str, Any] = {}
    context: Any = nullcontext()
    if device and device != "cpu":
        kwargs["device_map"] = device
    elif recipe.quantize.cuda:
        from publisher.fp8cpu import cpu_quantization_context  # FP8-dynamic on a CPU, as publisher.stages.quantize does

        context = cpu_quantization_context(recipe)
    cfg = json.loads((Path(src_dir) / "config.json").read_text())
    if library == "diffusers":
        import diffusers

        cls = getattr(diffusers, class_name or cfg["_class_name"])
        qconf = diffusers.TorchAoConfig(config, modules_to_not_convert=list(exclude) or None)
        with context:
            model = cls.from_pretrained(src_dir, quantization_config=qconf, torch_dtype=torch.bfloat16, **kwargs)
    else:
        import transformers

        cls = getattr(transformers, class_name or cfg["architectures"][0])
        qconf = transformers.TorchAoConfig(config, modules_to_not_convert=list(exclude) or None)
        with context:
            model = cls.from_pretrained(src_dir, quantization_config=qconf, dtype=torch.bfloat16, **kwargs)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(dst_dir, **save_kwargs)
    return model
