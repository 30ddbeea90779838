"""The compatibility rows of docs/compatibility.md for other torch releases: the tiny FLUX and Llama repos of the tests,
published with each recipe by the real CLI (``--no-push``), measured in environments that differ from this one only in
torch (and in the newest transformers and accelerate: ``--compat latest``). Prints one markdown table per model.

    python scripts/compat_rows.py                       # torch 2.11.0 2.12.0 2.14.1 2.15.0, int8wo float8wo intx4wo
    python scripts/compat_rows.py --torch 2.15.0 --recipes int8wo --models llama

Each torch environment is built once (publisher/verify/envs.py: PyTorch's CPU build when it can be had, else the build
the package sources have, which on Linux is PyPI's CUDA build run on the CPU; the log says which) and cached in
``$HF_AO_PUBLISH_ENVS``. Not run by the tests: several GB of downloads the first time. On a machine whose pip is capped
below a torch release (a constraints file in pip's config), lift the cap for this command, for example with
``PIP_CONSTRAINT=/dev/null``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = ("2.11.0", "2.12.0", "2.14.1", "2.15.0")
RECIPES = ("int8wo", "float8wo", "intx4wo")


def build(models: list[str], work: Path) -> dict[str, Path]:
    from publisher.testing import tiny

    out = {}
    if "flux" in models:
        out["flux"] = tiny.build_tiny_flux(work / "tiny-flux")
    if "llama" in models:
        out["llama"] = tiny.build_tiny_llama(work / "tiny-llama")
    return out


def publish(folder: Path, recipe: str, torches: list[str], out: Path, latest: bool) -> dict:
    compat = [a for t in torches for a in ("--compat", f"torch=={t}")] + (["--compat", "latest"] if latest else [])
    cmd = [sys.executable, "-m", "publisher.cli", "publish", str(folder), "--quant", recipe, "--no-push", "--json",
           "--output-dir", str(out), "--eval-budget", "0", *compat]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"{folder.name} {recipe}: the publish failed ({proc.returncode})")
    data = json.loads(proc.stdout)
    data["_wall"] = time.monotonic() - started
    data["_log"] = [line for line in proc.stderr.splitlines() if "verification environment" in line or "newest" in line]
    return data


def rows(data: dict) -> list[str]:
    ver = data["verification"]
    envs = {e["name"]: e for e in ver.get("environments", [])}
    found: dict[tuple[str, str], dict[str, str]] = {}
    for r in [*ver.get("results", []), *ver.get("compat", [])]:
        if r["path"] not in ("library", "manual"):
            continue
        cell = r["outcome"] if r["outcome"] == "pass" else f"{r['outcome']}: {r['detail'][:120]}"
        found.setdefault((r["env"], r["component"]), {})[r["path"]] = cell
    out = []
    for (env, comp), cells in found.items():
        e = envs.get(env, {})
        v = next((r["versions"] for r in [*ver.get("results", []), *ver.get("compat", [])] if r["env"] == env and r["versions"]), {})
        name = "this one" if env == "current" else env + (" (newest)" if e.get("newest") else "")
        versions = ", ".join(f"{k} {v[k]}" for k in ("torch", "torchao", "diffusers", "transformers", "accelerate") if k in v)
        out.append(f"| {name} | {comp or 'model'} | {versions} | {cells.get('library', '-')} | {cells.get('manual', '-')} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch", nargs="+", default=list(TORCH))
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--models", nargs="+", default=["flux", "llama"], choices=["flux", "llama"])
    ap.add_argument("--no-latest", action="store_true", help="leave out the newest transformers/diffusers and accelerate")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="compat-rows-") as tmp:
        work = Path(tmp)
        for model, folder in build(args.models, work).items():
            for recipe in args.recipes:
                data = publish(folder, recipe, args.torch, work / f"out-{model}-{recipe}", not args.no_latest)
                print(f"\n### tiny {model}, {recipe} ({data['_wall']:.0f} s)\n")
                print("| environment | component | exact versions | library loaders | manual path |\n|---|---|---|---|---|")
                print("\n".join(rows(data)))
                for line in data["_log"]:
                    print(f"    {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
