"""Quality against the unquantized base: relative error and cosine similarity of each component's output.

Apart from the reload checks (full.py) that use it, and the checks of a pushed commit (published.py).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

from publisher import loadpath
from publisher.handoffs.report import Expected, Quality
from publisher.streaming.shards import build_index
from publisher.verify import streaming as vs

if TYPE_CHECKING:
    from publisher.streaming.shards import ShardSource

log = logging.getLogger(__name__)


def quality_against_base(expected: list[Expected], base_sources: dict[str, ShardSource],
                         saved: dict[str, ShardSource] | None = None) -> list[Quality]:
    """Relative error and cosine similarity of each component's output against the unquantized base: its output from
    the quantization pass when that ran it (verify/inpass.py), else a forward block by block from its shards (one
    block in memory: never more than the quantized side needs).

    The base runs in the dtypes the quantized component was loaded in (bfloat16, and float32 where the library
    keeps a module in float32), whatever dtype it is stored in: a float32 or float16 base is cast as it is read,
    so the figures measure quantization alone. ``saved``: component -> its quantized files, whose header dtypes
    say which tensors stayed float32."""
    import torch


    out: list[Quality] = []
    for exp in expected:
        source = base_sources.get(exp.component)
        if exp.output is None or exp.inputs is None:
            continue
        if exp.base_output is not None:  # computed during the quantization pass: nothing to read again
            ref = exp.base_output.float()
        elif source is None:
            continue
        else:
            try:
                cast = loaded_dtypes(saved.get(exp.component) if saved else None)
                ref = vs.block_forward(source, exp.library, exp.class_name, vs.load_config(source),
                                       loadpath.load_call(exp.inputs), cast=cast).output.float()
            except (OSError, KeyError, ValueError, RuntimeError, TypeError) as exc:
                log.warning("quality of %s not measured: the base forward failed (%s)", exp.component or "model", exc)
                continue
            gc.collect()
        q = exp.output.float()
        rel = float((q - ref).norm() / ref.norm().clamp_min(1e-12))
        cos = float(torch.nn.functional.cosine_similarity(q.flatten(), ref.flatten(), dim=0))
        out.append(Quality(exp.component or "model", rel, cos))
    return out


def loaded_dtypes(saved: ShardSource | None) -> Any:
    """``cast(name, tensor)`` for the base forward: floating tensors to the dtype the quantized component holds them
    in (read from its saved headers; bfloat16 for quantized weights and anything not found)."""
    import torch


    dtypes: dict[str, Any] = {}
    if saved is not None:
        index = build_index(saved)
        names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        for name, keys in index.parts.items():
            if keys == [name] and index.entries[name][1].dtype in names:
                dtypes[name] = names[index.entries[name][1].dtype]

    def cast(name: str, t: Any) -> Any:
        if type(t) is not torch.Tensor or not t.is_floating_point():
            return t
        return t.to(dtypes.get(name, torch.bfloat16))

    return cast
