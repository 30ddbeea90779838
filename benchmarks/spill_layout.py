"""What one-pass reading costs where execution order is not file order, computed from a layout (no weights).

    python benchmarks/spill_layout.py [--scale 1]

For each shard of the FLUX.1-dev-shaped transformer that ``bench_publish.py`` serves (FLUX.1-dev's exact shapes
and shard split; safetensors stores tensors by name), it prints two peaks, in bytes of bf16 weights:

- reading in execution order while hashing each file in file order (what ``--low-disk`` does,
  ``integrity.SpillingHashedReader``): the bytes read ahead of the hash, which wait on disk;
- reading in file order instead: the blocks that arrive before the forward pass can use them (x_embedder is
  stored last, ``transformer_blocks.10`` before ``.2``), which would wait in memory.

Execution order here is module order (embedders, double blocks by number, single blocks by number, the output
layers): the order the forward calls them in, up to the three small embedders at the start.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_publish import build_layout  # noqa: E402 - the sibling benchmark's layout


def _block(name: str) -> tuple[int, int]:
    m = re.match(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.", name)
    if m:
        return (1 if m.group(1) == "transformer_blocks" else 2, int(m.group(2)))
    return (0, 0) if name.split(".")[0] in ("time_text_embed", "context_embedder", "x_embedder") else (3, 0)


def peaks(tensors: list[tuple[str, tuple[int, ...]]]) -> tuple[int, int]:
    """(spill peak reading in execution order, forward backlog peak reading in file order), in bytes."""
    sizes = {n: math.prod(s) * 2 for n, s in tensors}
    offsets, pos = {}, 0
    for n in sorted(sizes):
        offsets[n] = (pos, pos + sizes[n])
        pos += sizes[n]
    cursor, pending, spill, spill_peak = 0, {}, 0, 0
    for n in sorted(sizes, key=lambda n: (_block(n), n)):
        start, end = offsets[n]
        if start == cursor:
            cursor = end
            while cursor in pending:
                nxt = pending.pop(cursor)
                spill -= nxt - cursor
                cursor = nxt
        else:
            pending[start] = end
            spill += end - start
            spill_peak = max(spill_peak, spill)
    blocks = sorted({_block(n) for n in sizes})
    members = {b: {n for n in sizes if _block(n) == b} for b in blocks}
    got: set[str] = set()
    held = held_peak = done = 0
    for n in sorted(sizes):
        got.add(n)
        held += sizes[n]
        while done < len(blocks) and members[blocks[done]] <= got:
            held -= sum(sizes[x] for x in members[blocks[done]])
            done += 1
        held_peak = max(held_peak, held)
    return spill_peak, held_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        layout = build_layout(Path(tmp), args.scale)
    for name, tensors in layout["transformer"]:
        size = sum(math.prod(s) * 2 for _, s in tensors)
        spill, held = peaks(tensors)
        print(f"{name}: {size / 1e9:.2f} GB; execution order, hash spill peak {spill / 1e9:.2f} GB; "
              f"file order, forward backlog peak {held / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
