"""Benchmark: the verification's interpreters started while quantizing (issue 41 item 2) against started at the first
verification, on a tiny model.

    python benchmarks/bench_verify_start.py [--model llama|flux] [--rounds 3] [--workdir DIR]

The real CLI publishes a tiny base from a local folder (``--no-push --compat none --eval-budget 0 --json``), each run
in a fresh process so no zygote is left from an earlier one; ``early`` is the product as it is, ``late`` the same run
with ``publisher.verify.workers.start_early`` replaced by a no-op (the zygote then starts at the first verification,
as before). The two alternate ``--rounds`` times (this shared machine's speed drifts between runs) and the median of
each is printed: the verify stage's seconds (``seconds["verify"]`` of the --json outcome), the quantize stage's (the
zygote's imports share the CPU with it) and their sum.

Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN = """
import sys
if sys.argv[1] == "late":
    import publisher.verify.workers as workers
    workers.start_early = lambda *args, **kwargs: None
from publisher.cli import main
main(sys.argv[2:])
"""


def publish(base: Path, out: Path, how: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", RUN, how, str(base), "--quant", "int8wo", "--no-push", "--output-dir", str(out),
           "--compat", "none", "--eval-budget", "0", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{how}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    seconds = json.loads(proc.stdout)["seconds"]
    return {"verify": seconds["verify"], "quantize": seconds["quantize"],
            "both": seconds["verify"] + seconds["quantize"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llama", "flux"), default="llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    from publisher.testing import tiny

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-verify-start-"))
    base = (tiny.build_tiny_llama if args.model == "llama" else tiny.build_tiny_flux)(work / f"tiny-{args.model}")
    runs: dict[str, list[dict[str, float]]] = {"early": [], "late": []}
    for i in range(args.rounds):
        for how in ("late", "early") if i % 2 else ("early", "late"):
            runs[how].append(publish(base, work / f"out-{how}-{i}", how))
            print(f"round {i + 1} {how}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[how][-1].items()), flush=True)
    median = {how: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for how, rs in runs.items()}
    for how in ("late", "early"):
        print(f"{how:5s} (median of {args.rounds}): " + ", ".join(f"{k} {v:.2f} s" for k, v in median[how].items()))
    print("early/late: " + ", ".join(f"{k} {median['early'][k] / median['late'][k]:.2f}" for k in median["early"]))


if __name__ == "__main__":
    main()
