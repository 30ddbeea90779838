"""Row by row: an embedding table or an output head larger than a block is never loaded whole.

Llama-3's vocabulary of 128,256 words makes its embedding and its head 1.05 GB each in bf16 (Llama-3-8B), more than
the block loader's budget and, with torch and the libraries in the process, more than the 1.2 GiB the run keeps to.
Both are plain tensors in every recipe that leaves them alone (transformers keeps the head and the embeddings
unquantized), stored row after row, so a row is one range of the file:

- the **embedding** reads only the rows of the ids it is given (``RowEmbedding``: a pre-hook that puts the rows in
  place and renumbers the ids, so the module's own forward runs, scaled embeddings included);
- the **head** reads its weight a chunk of vocabulary rows at a time (``ROW_CHUNK_BYTES``) and makes the logits chunk
  by chunk (``RowLinear``: its forward, for ``generate``), or, for perplexity, the per-token negative log-likelihood
  without the logits ever existing whole (``RowLinear.nll``: a running log-sum-exp and each target's logit).

Used by ``streaming.BlockLoader`` for the model's input or output embeddings (transformers' ``get_input_embeddings``,
``get_output_embeddings``) when over its budget, stored plain and kept plain by the loader's ``cast`` (a quantized
head is loaded whole, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from publisher.streaming.shards import TensorReader

ROW_CHUNK_BYTES = 32 << 20  # the head's rows read at once (Llama-3-8B: 4,096 rows of 8 KB)


def candidate(module: Any, budget: int) -> bool:
    """An Embedding or Linear whose weight alone is over ``budget`` bytes in bf16."""
    import torch

    weight = getattr(module, "weight", None)
    return (isinstance(module, (torch.nn.Embedding, torch.nn.Linear)) and weight is not None
            and weight.dim() == 2 and weight.numel() * 2 > budget)


class RowEmbedding:
    """Pre- and post-hook of an embedding: only the rows of the ids it is called with are read, for that call."""

    def __init__(self, module: Any, reader: TensorReader, name: str, cast: Callable[[str, Any], Any]) -> None:
        self.module, self.reader, self.name, self.cast = module, reader, name, cast
        self.original = module._parameters["weight"]
        self.rows_read = 0

    def before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        import torch

        ids = args[0] if args else kwargs.pop("input")
        unique, inverse = torch.unique(ids, return_inverse=True)
        table = torch.cat([self.cast(self.name, self.reader.read_rows(self.name, start, stop))
                           for start, stop in runs(unique.tolist())])
        self.rows_read += int(table.shape[0])
        module._parameters["weight"] = torch.nn.Parameter(table, requires_grad=False)
        return (inverse.reshape(ids.shape), *args[1:]), kwargs

    def after(self, module: Any, args: Any, output: Any) -> None:
        module._parameters["weight"] = self.original  # back to meta: the rows are freed


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted unique ids as (start, stop) ranges of consecutive ids: one read each."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class RowLinear:
    """The forward of an output head read a chunk of vocabulary rows at a time (installed as the module's ``forward``;
    ``nll`` for perplexity)."""

    def __init__(self, module: Any, reader: TensorReader, name: str, bias: str | None, cast: Callable[[str, Any], Any]) -> None:
        self.module, self.reader, self.name, self.bias, self.cast = module, reader, name, bias, cast
        rows = reader.plain_rows(name)
        if rows is None:  # the caller installs this head only on a plain matrix (verify/streaming.py)
            raise ValueError(f"{name} is not a plain matrix; its rows cannot be read alone")
        self.rows = rows
        row_bytes = module.weight.shape[1] * module.weight.element_size()
        self.chunk = max(1, ROW_CHUNK_BYTES // max(row_bytes, 1))
        self.passes = 0  # how often the whole weight was read

    def chunks(self) -> Any:
        """(start, weight rows, bias rows or None) for each chunk of the vocabulary, read as they are used."""
        self.passes += 1
        bias = self.cast(self.bias, self.reader.read(self.bias)) if self.bias else None
        for start in range(0, self.rows, self.chunk):
            stop = min(start + self.chunk, self.rows)
            weight = self.cast(self.name, self.reader.read_rows(self.name, start, stop))
            yield start, weight, None if bias is None else bias[start:stop]

    def __call__(self, hidden: Any) -> Any:
        """The logits, ``[..., vocabulary]``, as the module's own forward gives them (for ``generate``: a few positions)."""
        import torch
        import torch.nn.functional as F

        return torch.cat([F.linear(hidden, w, b) for _, w, b in self.chunks()], dim=-1)

    def nll(self, hidden: Any, targets: Any) -> Any:
        """float32 ``[B, T]``: the negative log-likelihood of token t+1 at position t (0 at the last position), what
        ``cross_entropy`` of the whole float32 logits gives, with one chunk of logits in memory at a time."""
        import torch
        import torch.nn.functional as F

        batch, length = hidden.shape[0], hidden.shape[1]
        scored, wanted = hidden[:, :length - 1], targets[:, 1:length]
        best = torch.full((batch, length - 1), float("-inf"))
        total = torch.zeros(batch, length - 1)
        picked = torch.zeros(batch, length - 1)
        for start, w, b in self.chunks():
            logits = F.linear(scored, w, b).float()
            top = torch.maximum(best, logits.amax(dim=-1))
            total = total * torch.exp(best - top) + torch.exp(logits - top[..., None]).sum(dim=-1)
            best = top
            inside = (wanted >= start) & (wanted < start + logits.shape[-1])
            local = (wanted - start).clamp(0, logits.shape[-1] - 1)
            picked = torch.where(inside, logits.gather(-1, local[..., None])[..., 0], picked)
        out = torch.zeros(batch, length, dtype=torch.float32)
        out[:, :length - 1] = best + torch.log(total) - picked
        return out
