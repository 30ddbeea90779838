#!/usr/bin/env python3
"""Device check: the real CLI on a CUDA GPU, per GPU recipe and per engine, with the device's figures on top.

On the device, one command (scripts/gpu_check.sh runs it after installing the wheels the device image lacks):

    python scripts/gpu_check.py --out $OUT          # or run(command="bash scripts/gpu_check.sh", carry=[".whl"])

Here, without a GPU: `--dry-run [--assume-cc 9.0]` prints the command lines it would run and runs nothing;
`--allow-cpu --recipes int8wo` runs the same loop on the CPU (what tests/test_scripts_gpu_check.py does).

Everything goes through the product:
  1. a tiny base folder, built offline (publisher.testing.families: `--base flux`, any family name, or a folder;
     the CLI takes a local folder, so no Hub is involved);
  2. per recipe that needs a CUDA GPU (the registry's device rules: float8dq, float8dq-tensor, int4wo; those this
     GPU cannot take are recorded as skipped) and per engine, `hf-ao-publish publish BASE --quant R --engine
     library|streaming --no-push --json --benchmark --output-dir ...` as a subprocess; its --json outcome gives
     verified, the components (engine, tensor classes), where verification ran, the benchmark block (eager and
     compiled ms, forward peak MB, against bf16) and the stage seconds;
  3. recipes the CPU can make too (FP8 through publisher/fp8cpu.py) once more with CUDA hidden;
  4. each component folder compared with the recipe's library-made one (publisher.testing.checkpoints): the
     streaming engine's output and the CPU-made one must be the same tensors and headers;
  5. on top, only what the CLI does not measure: each run's wall seconds and the device's peak memory while it ran
     (nvidia-smi, sampled), and the float8 arithmetic on every bf16 value (publisher.testing.fp8_checks).
results.json and table.md are rewritten in --out after every run (a run stopped at its limit keeps what it measured);
the CLI's stderr goes to cli.log there. Exit status: 0 when every run published a verified folder with the engine it
was asked for and every comparison matched; 1 otherwise; 2 without CUDA (unless --allow-cpu or --dry-run).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from publisher import recipes  # noqa: E402 - importable once the repository root is on the path

ENGINES = ("library", "streaming")  # library first: the others are compared with its folders
NOT_APPLICABLE = "--engine streaming cannot quantize"  # the CLI's refusal when the engine does not apply
VERSIONS = ("torch", "torchao", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub")


@dataclass
class Run:
    """One CLI publish: what it is called in the results, its command line, and what its folders must equal."""

    label: str
    recipe: str
    engine: str
    cmd: list[str]
    output_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    same_as: str | None = None  # the label of the run whose component folders this one's must equal


# ----------------------------------------------------------------------------- what to run


def gpu_recipe_names() -> list[str]:
    """The registry's recipes that need a CUDA GPU to quantize or to run."""
    return [r.name for r in recipes.all_recipes() if r.quantize.cuda or r.run.cuda]


def skip_reason(name: str, cc: tuple[int, int] | None) -> str | None:
    """Why this machine cannot take the recipe on its GPU (recipes.py's device rules), or None."""
    recipe = recipes.get(name)
    have = f"this GPU has {cc[0]}.{cc[1]}" if cc else "this machine has no CUDA GPU"
    if recipe.run.cuda and recipes.device(recipe, cc) != "cuda":  # one device rule for quantizing and running
        return f"runs on a {recipe.run.describe()} only; {have}"
    if recipe.needs_gpu_to_quantize and recipes.device(recipe, cc) != "cuda":
        return f"quantizes on a {recipe.quantize.describe()} only; {have}"
    return None


def cli_prefix() -> list[str]:
    """The installed console script next to this interpreter, else the same entry point through -m."""
    exe = Path(sys.executable).with_name("hf-ao-publish")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "publisher.cli"]


def publish_command(prefix: list[str], base: Path, recipe: str, engine: str, out_dir: Path, *,
                    benchmark: bool, eval_budget: str) -> list[str]:
    cmd = [*prefix, "publish", str(base), "--quant", recipe, "--engine", engine, "--no-push", "--json",
           "--output-dir", str(out_dir), "--compat", "none", "--eval-budget", eval_budget,
           "--sample-steps", "2", "--sample-size", "64"]  # the device has no package index: no compat matrix
    return cmd + (["--benchmark"] if benchmark else [])


def plan_runs(names: list[str], base: Path, work: Path, cc: tuple[int, int] | None, *, prefix: list[str],
              engines: tuple[str, ...] = ENGINES, eval_budget: str = "0", benchmark: bool = True) -> list[Run]:
    """Every recipe's run with the first engine (the reference) first, so that a device slot that ends early has
    measured every recipe once; then each recipe's other engines and, with a GPU present, the CPU-made run of the
    recipes the CPU can make (CUDA hidden; no --benchmark, which would only measure the CPU)."""
    first_runs: list[Run] = []
    others: list[Run] = []
    for name in names:
        first = f"{name}/{engines[0]}"
        for engine in engines:
            out = work / name / engine
            run = Run(f"{name}/{engine}", name, engine, publish_command(prefix, base, name, engine, out,
                                                                        benchmark=benchmark, eval_budget=eval_budget),
                      out, same_as=None if engine == engines[0] else first)
            (first_runs if engine == engines[0] else others).append(run)
        if cc is not None and recipes.get(name).cpu_producible:
            out = work / name / "cpu-made"
            others.append(Run(f"{name}/cpu-made", name, engines[0], publish_command(
                prefix, base, name, engines[0], out, benchmark=False, eval_budget=eval_budget), out,
                env={"CUDA_VISIBLE_DEVICES": ""}, same_as=first))
    return first_runs + others


# ----------------------------------------------------------------------------- running one, on top of the CLI


def nvidia_smi_used_mb() -> float | None:
    """Memory in use on every GPU (MiB, as nvidia-smi counts it: every process's), or None without nvidia-smi."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True)
        return sum(float(line) for line in proc.stdout.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class PeakMemory:
    """Samples the device's used memory on a thread while a run goes; ``used_mb``: the peak above the baseline."""

    def __init__(self, read: Any = nvidia_smi_used_mb, interval_s: float = 0.2) -> None:
        self.read, self.interval = read, interval_s
        self.baseline: float | None = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            value = self.read()
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self.baseline = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def used_mb(self) -> float | None:
        if self.baseline is None or self.peak is None:
            return None
        return round(self.peak - self.baseline, 1)


def child_env(run: Run, work: Path) -> dict[str, str]:
    """The CLI's environment: this code first on the path, offline, a cache of its own, no token."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HOME=str(work / "hf_home"),
               PYTHONUNBUFFERED="1")
    env.update(run.env)
    return env


def execute(run: Run, work: Path, log: Path, timeout_s: float, read_memory: Any = nvidia_smi_used_mb) -> dict[str, Any]:
    """Run the CLI; its stdout (the --json document) is returned, its stderr appended to ``log``."""
    with log.open("a") as err:
        err.write(f"\n===== {run.label}: {shlex.join(run.cmd)}\n")
        err.flush()
        t0 = time.monotonic()
        with PeakMemory(read_memory) as memory:
            # its own session: a timeout kills the CLI's worker processes with it
            proc = subprocess.Popen(run.cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
                                    env=child_env(run, work), start_new_session=True)
            try:
                stdout, _ = proc.communicate(timeout=timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, _ = proc.communicate()
                rc = None
    return {"rc": rc, "stdout": stdout, "wall_s": round(time.monotonic() - t0, 1), "gpu_peak_mb": memory.used_mb,
            "gpu_baseline_mb": memory.baseline, "timeout_s": timeout_s}


def read_outcome(run: Run, stdout: str, rc: int | None) -> dict[str, Any]:
    """What the CLI's --json document says about the run, and ``problems``: why it does not count as passed."""
    if rc is None:
        return {"status": "failed", "problems": ["timed out"]}
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        return {"status": "failed", "exit_code": rc, "problems": [f"no JSON document on stdout (exit {rc}): {stdout[-300:]!r}"]}
    error = doc.get("error")
    if error and NOT_APPLICABLE in str(error):
        return {"status": "not applicable", "exit_code": rc, "reason": str(error)}
    verification = doc.get("verification") or {}
    out: dict[str, Any] = {
        "exit_code": rc, "verified": doc.get("verified"), "error": error,
        "components": [{k: c.get(k) for k in ("name", "engine", "tensor_classes", "quantized_layers", "bytes_before",
                                              "bytes_after")} for c in doc.get("components") or []],
        "verify_device": verification.get("device"), "verify_mode": verification.get("mode"),
        "loads": {f"{r.get('component')}/{r.get('path')}": r.get("outcome") for r in verification.get("results") or []},
        "quality": {q.get("component"): {"rel_error": q.get("rel_error"), "cosine": q.get("cosine")}
                    for q in doc.get("quality") or []},
        "seconds": doc.get("seconds"), "benchmark": doc.get("benchmark")}
    problems = []
    if rc != 0 or error:
        problems.append(f"exit {rc}: {str(error)[:300]}")
    if doc.get("verified") is not True:
        problems.append("not verified")
    if not out["components"]:
        problems.append("no component quantized")
    problems += [f"{c['name']}: ran the {c['engine']} engine, not {run.engine}" for c in out["components"]
                 if c["engine"] != run.engine]
    out.update(status="failed" if problems else "ok", problems=problems)
    return out


def compare_with(run: Run, reference: Run, components: list[dict[str, Any]]) -> dict[str, Any]:
    """Each quantized component's folder against the reference run's (the one checkpoint comparison)."""
    from publisher.testing.checkpoints import compare_checkpoints

    found = {}
    for comp in components:
        c = compare_checkpoints(reference.output_dir / comp["name"], run.output_dir / comp["name"])
        found[comp["name"]] = {"identical": c.identical, "summary": c.summary(), "differences": c.differences()[:10]}
    return found


# ----------------------------------------------------------------------------- results


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _pair(rows: list[dict[str, Any]], key: str, nd: int = 1) -> str:
    """The quantized figure with bf16's in brackets, per component."""
    return "; ".join(f"{_f(r['quantized'].get(key), nd)} ({_f(r['bf16'].get(key), nd)})" for r in rows) or "-"


def render_table(results: dict[str, Any]) -> str:
    cols = ["run", "status", "engine", "verified on", "classes", "eager ms (bf16)", "compiled ms (bf16)",
            "fwd peak MB (bf16)", "quantize s", "verify s", "wall s", "GPU peak MB", "same as", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, r in results["runs"].items():
        o = r.get("outcome", {})
        rows = (o.get("benchmark") or {}).get("rows") or []
        seconds = o.get("seconds") or {}
        same = "; ".join(f"{r['same_as']}: {'yes' if v['identical'] else 'NO'}" for v in r.get("compared", {}).values())
        classes = "; ".join(f"{c['name']}: {c['tensor_classes']}" for c in o.get("components", []))
        cells = [label, r.get("status", "-"), ",".join(sorted({str(c["engine"]) for c in o.get("components", [])})) or "-",
                 _f(o.get("verify_device")), classes or "-", _pair(rows, "eager_ms", 2), _pair(rows, "compiled_ms", 2),
                 _pair(rows, "forward_peak_mb"), _f(seconds.get("quantize")), _f(seconds.get("verify")), _f(r.get("wall_s")),
                 _f(r.get("gpu_peak_mb")), same or "-", "; ".join(o.get("problems", [])) or r.get("reason") or ""]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ")[:200] for c in cells) + " |")
    for name, why in results["skipped"].items():
        lines.append(f"| {name} | skipped |" + " |" * (len(cols) - 3) + f" {why} |")
    arith = results.get("arith") or {}
    if arith:
        lines.append(f"\nfloat8 arithmetic, every bf16 value, GPU vs CPU: identical={arith.get('all_identical')}")
    s = results["summary"]
    lines.append(f"\n{'OK' if s.get('ok') else 'FAILED'}: {len(s.get('passed', []))} runs passed"
                 + "".join(f"\n- {f}" for f in s.get("failures", [])))
    return "\n".join(lines) + "\n"


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    failures = [f"{label}: {p}" for label, r in results["runs"].items() for p in r.get("outcome", {}).get("problems", [])]
    failures += [f"{label}: {comp} differs from {r['same_as']} ({v['summary']})" for label, r in results["runs"].items()
                 for comp, v in r.get("compared", {}).items() if not v["identical"]]
    if results.get("arith") and not results["arith"].get("all_identical"):
        failures.append("float8 arithmetic: GPU and CPU bytes differ")
    passed = [label for label, r in results["runs"].items() if r.get("status") == "ok"]
    if not passed and not failures:
        failures.append("no run passed")
    return {"ok": not failures, "passed": passed, "failures": failures}


def save(results: dict[str, Any], out: Path) -> None:
    results["summary"] = summarize(results)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out / "results.json")
    (out / "table.md").write_text(render_table(results))


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    p.add_argument("--base", default="flux", help="a family of publisher.testing.families, or a base folder")
    p.add_argument("--recipes", default="gpu", help="comma-separated names; gpu: the registry's GPU recipes")
    p.add_argument("--engines", default=",".join(ENGINES), help="the first one's folders are the reference")
    p.add_argument("--eval-budget", default="0", help="the CLI's --eval-budget (0: no quality evaluation)")
    # A device call runs for at most 600 s: 540 s of runs leaves the set-up and the results' way back room. One run of
    # the tiny FLUX took about 100 s on an H200 (63.6 s of it the always-on benchmark), the first on a fresh device
    # about 120 s: the three GPU recipes' reference runs (ordered first) fit, the rest as time allows.
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; no run starts that would not fit")
    p.add_argument("--run-timeout", type=float, default=240.0, help="seconds for one CLI run")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--no-benchmark", action="store_true", help="leave out the CLI's --benchmark (the CPU mode's test)")
    p.add_argument("--no-arith", action="store_true", help="skip the float8 arithmetic check")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (this script's own test)")
    p.add_argument("--dry-run", action="store_true", help="print the command lines, run nothing")
    p.add_argument("--assume-cc", default=None, help="with --dry-run: plan for a GPU of this compute capability, e.g. 9.0")
    p.add_argument("--emit-arith-hashes", action="store_true", help="print EXPECTED_CPU_HASHES for this machine")
    args = p.parse_args(argv)
    args.engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if not args.engines or not set(args.engines) <= set(ENGINES):
        p.error(f"--engines takes {', '.join(ENGINES)}")
    if args.assume_cc is not None:
        if not args.dry_run:
            p.error("--assume-cc goes with --dry-run")
        major, _, minor = args.assume_cc.partition(".")
        args.assume_cc = (int(major), int(minor or 0))
    return args


def build_base(spec: str, work: Path) -> Path:
    if Path(spec).is_dir():
        return Path(spec).resolve()
    from publisher.testing.families import build_family

    return build_family(spec, work / "base")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emit_arith_hashes:
        from publisher.testing.fp8_checks import arith_check

        res = arith_check("cpu")
        print(json.dumps({k: v["hash_cpu_fp8cpu"] for k, v in res.items() if isinstance(v, dict)}, indent=1))
        return 0
    cc = args.assume_cc if args.dry_run else recipes.cuda_capability()
    if cc is None and not (args.allow_cpu or args.dry_run):
        print("no CUDA GPU here: run this on the device, or pass --allow-cpu (or --dry-run)", file=sys.stderr)
        return 2
    wanted = gpu_recipe_names() if args.recipes == "gpu" else [n.strip() for n in args.recipes.split(",") if n.strip()]
    skipped = {n: why for n in wanted if (why := skip_reason(n, cc))}
    names = [n for n in wanted if n not in skipped]
    own_work = args.work is None
    work = Path(tempfile.mkdtemp(prefix="gpu-check-")) if own_work else args.work.resolve()
    base = Path(args.base).resolve() if Path(args.base).is_dir() else work / "base"
    runs = plan_runs(names, base, work / "published", cc, prefix=cli_prefix(), engines=args.engines,
                     eval_budget=args.eval_budget, benchmark=not args.no_benchmark)
    if args.dry_run:
        print(f"# base: {base} ({args.base})")
        print("\n".join(shlex.join(r.cmd) if not r.env else
                        f"{' '.join(f'{k}={v}' for k, v in r.env.items())} {shlex.join(r.cmd)}" for r in runs))
        for n, why in skipped.items():
            print(f"# skipped {n}: {why}")
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    try:
        return check(args, cc, build_base(args.base, work), runs, skipped, work)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def check(args: argparse.Namespace, cc: tuple[int, int] | None, base: Path, runs: list[Run], skipped: dict[str, str],
          work: Path) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.log").write_text("")
    t0 = time.monotonic()
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout.strip() if shutil.which("nvidia-smi") else None
    results: dict[str, Any] = {
        "meta": {"gpu": gpu, "cc": list(cc) if cc else None, "python": sys.version.split()[0], "base": str(base),
                 "versions": {n: _version(n) for n in VERSIONS}, "args": {k: str(v) for k, v in vars(args).items()}},
        "runs": {}, "skipped": dict(skipped), "arith": {}}
    by_label = {r.label: r for r in runs}
    timed: list[float] = []
    for run in runs:
        estimate = max(timed, default=90.0)  # the longest run so far (90 s until one has been timed)
        record: dict[str, Any] = {"cmd": shlex.join(run.cmd), "env": run.env, "same_as": run.same_as}
        results["runs"][run.label] = record
        left = args.time_budget - (time.monotonic() - t0)
        if left < estimate:
            record.update(status="skipped", reason=f"time budget ({left:.0f}s left, a run takes about {estimate:.0f}s)")
            continue
        print(f"[{time.monotonic() - t0:6.0f}s] {run.label}: {record['cmd']}", flush=True)
        done = execute(run, work, out / "cli.log", min(args.run_timeout, left))
        timed.append(done["wall_s"])
        outcome = read_outcome(run, done.pop("stdout"), done["rc"])
        record.update(done, outcome=outcome, status=outcome["status"], reason=outcome.get("reason"))
        reference = by_label.get(run.same_as or "")
        ref_record = results["runs"].get(run.same_as or "", {})
        if reference is not None and outcome["status"] == "ok" and ref_record.get("status") == "ok":
            record["compared"] = compare_with(run, reference, outcome["components"])
        save(results, out)
        print(f"    {outcome['status']} in {done['wall_s']}s, GPU peak {done['gpu_peak_mb']} MB "
              f"{outcome.get('problems') or ''}", flush=True)
    if cc is not None and not args.no_arith:
        from publisher.testing.fp8_checks import arith_check

        res = arith_check("cuda")
        results["arith"] = {"all_identical": res.get("all_identical"), "compared_against": res.get("compared_against")}
    save(results, out)
    print("\n" + render_table(results), flush=True)
    return 0 if results["summary"]["ok"] else 1


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
