"""What the CPU int4 recipes cost and give on this machine: stored bytes, quantize time, forward latency.

One bf16 Linear (default 2048x2048, the size of a small LM's projections) quantized with each recipe's torchao
config; forward on batch 1 (decode-like) and batch 64 (prefill-like) tokens, eager and (``--compile``)
torch.compile. The models are timed round-robin (one call each per round, ``--iters`` rounds after a warm-up) so
that a busy shared machine slows them alike; the median per model is printed as a Markdown table, with the ratio to
bf16. docs/cpu-int4.md quotes it with the machine it ran on. A CPU figure only: GPU kernels are not measured here.

    .venv/bin/python benchmarks/bench_cpu_int4.py [--size 2048] [--iters 30] [--compile]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from typing import Any


def _rounds(fns: dict[str, Any], iters: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up (and torch.compile's compilation)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    import torch
    from torchao.quantization import quantize_

    from publisher import recipes
    from publisher.configs.probe import stored_bytes

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--recipes", default="int8wo,int8dq,intx4wo,int8dq-int4")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = torch.nn.Linear(args.size, args.size, bias=False).to(torch.bfloat16).eval()
    xs = {b: torch.randn(b, args.size, dtype=torch.bfloat16) for b in (1, 64)}
    models: dict[str, Any] = {"bf16": base}
    facts: dict[str, list[str]] = {"bf16": ["Parameter", f"{base.weight.numel() * 2 / 1e6:.2f}", "16.00", "-"]}
    for name in args.recipes.split(","):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        quantize_(model, recipes.get(name).config_for(""))
        q_ms = (time.perf_counter() - t0) * 1e3
        nbytes = stored_bytes(model.weight)
        models[name] = model
        facts[name] = [type(model.weight).__name__, f"{nbytes / 1e6:.2f}", f"{nbytes * 8 / model.weight.numel():.2f}", f"{q_ms:.0f}"]
    columns: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for b in (1, 64):
            columns[f"batch {b} eager ms"] = _rounds({n: (lambda m=m, x=xs[b]: m(x)) for n, m in models.items()}, args.iters)
        if args.compile:
            compiled = {}
            for n, m in models.items():
                torch._dynamo.reset()  # else dynamo's recompile limit sends later models back to eager
                compiled[n] = torch.compile(m, dynamic=False)
                for b in (1, 64):
                    compiled[n](xs[b])
            for b in (1, 64):
                columns[f"batch {b} compiled ms"] = _rounds({n: (lambda m=m, x=xs[b]: m(x)) for n, m in compiled.items()},
                                                            args.iters)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"Linear {args.size}x{args.size}, median of {args.iters} round-robin rounds (ratio to bf16)")
    head = ["recipe", "weight class", "stored MB", "bits/weight", "quantize ms", *columns]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in models:
        cells = [name, *facts[name]]
        for col in columns.values():
            cells.append(f"{col[name]:.2f} ({col[name] / col['bf16']:.2f}x)")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
