#!/usr/bin/env python3
"""Issue 8 device check: every registry recipe on one GPU, plus CPU-made vs GPU-made float8dq.

    python scripts/gpu_check.py [OUT_DIR] [--device cuda|cpu] [--tiny | --size-gb N] [--time-budget S]

OUT_DIR defaults to $OUT, else ./gpu-check-out; results.json and table.md are (re)written there
after every step, so a run stopped at its time limit still leaves what it measured. Every step goes
through the package's own code, and is wrapped: a failure is recorded, the rest still runs.
  0. arithmetic (publisher.testing.fp8_checks): torture tensors (every bf16 value, zero/NaN/inf rows)
     quantized to float8 on the GPU, on the CPU (raw and through publisher.fp8cpu) and by an
     independent reference; bytes compared, plus hashes made on the dev machine.
  1. a FLUX.1-dev-shaped transformer (fewer blocks, seeded random bf16: publisher.testing.configs),
     saved as the bf16 base and loaded back on the device as the reference.
  2. per recipe: quantized on the device by the library loader, tensor by tensor as it loads
     (publisher.testing.reference: from_pretrained with quantization_config), saved as sharded
     safetensors, reloaded by both load paths of publisher.loadpath and compared bit for bit with the
     in-memory model; classes, memory and eager latency (publisher.stages.measure), error vs bf16;
     float8dq*: the same checkpoint made on the CPU (publisher.fp8cpu) compared file by file
     (publisher.testing.checkpoints) and run on the device. torch.compile last, while the time budget lasts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from publisher import fp8cpu, loadpath, recipes  # noqa: E402 - importable once the repository root is on the path
from publisher.stages.measure import free, gpu_memory, latency_ms, sync  # noqa: E402
from publisher.testing.checkpoints import compare_checkpoints  # noqa: E402
from publisher.testing.configs import FLUX_TINY_FP8, flux_dev_blocks, flux_dev_shaped, flux_transformer  # noqa: E402
from publisher.testing.fp8_checks import arith_check, float8_attrs_ok  # noqa: E402
from publisher.testing.reference import library_quantize  # noqa: E402

LIB, CLS = "diffusers", "FluxTransformer2DModel"
# float8 first: they are what issue 8 is about, and the budget may run out.
ORDER = ["float8dq", "float8dq-tensor", "int8dq", "int8wo", "float8wo", "int4wo"]


class Check:
    """Results, the time budget, and the wrapper that turns a failing step into a record."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.t0, self.budget = out, time.monotonic(), budget_s
        self.results: dict[str, Any] = {"meta": {}, "arith": {}, "bf16": {}, "recipes": {}, "fp8_cpu_vs_device": {},
                                        "compile": {}, "failures": [], "optional_failures": [], "summary": {}}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def out_of_time(self, where: dict[str, Any], needed_s: float) -> bool:
        if self.left() >= needed_s:
            return False
        where.update(status="skipped", reason=f"time budget ({self.left():.0f}s left)")
        return True

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    @contextlib.contextmanager
    def step(self, where: dict[str, Any], name: str, core: bool = True) -> Any:
        self.log(f"-> {name}")
        t = time.monotonic()
        try:
            yield
            where.setdefault("status", "ok")
        except Exception as exc:  # noqa: BLE001 - one failure must not stop the rest
            where["status"] = "failed"
            where["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            where["traceback"] = traceback.format_exc()[-4000:]
            self.results["failures" if core else "optional_failures"].append(f"{name}: {where['error'][:300]}")
            self.log(f"!! {name} failed: {where['error'][:300]}")
        finally:
            where["seconds"] = round(time.monotonic() - t, 2)
            self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out / "results.json")
        (self.out / "table.md").write_text(render_table(self.results))


# ----------------------------------------------------------------------------- helpers


def forward(model: Any, inputs: dict[str, Any]) -> Any:
    return loadpath.forward(model, LIB, inputs)


def weights_mb(model: Any) -> float:
    """MiB of all parameters and buffers, counting a torchao tensor by its inner tensors (the CPU's figure)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        names = list(getattr(t, "tensor_data_names", None) or []) + list(getattr(t, "optional_tensor_data_names", None) or [])
        total += sum(getattr(t, n).nbytes for n in names if getattr(t, n, None) is not None) if names else t.nbytes
    return round(total / 2**20, 1)


def make_inputs(cfg: dict[str, Any], tiny: bool, device: str, seed: int) -> dict[str, Any]:
    import torch

    side, txt = (4, 8) if tiny else (32, 256)  # 32x32 packed latents = a 512x512 image
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    bf = torch.bfloat16
    x = {"hidden_states": torch.randn(1, side * side, cfg["in_channels"], generator=g).to(bf),
         "encoder_hidden_states": torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(bf),
         "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(bf),
         "timestep": torch.tensor([0.5], dtype=bf), "guidance": torch.tensor([3.5], dtype=bf),
         "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(txt, 3)}
    return {k: v.to(device) for k, v in x.items()}


def load_library(path: Path, device: str, record: dict[str, Any]) -> Any:
    """loadpath's from_pretrained onto ``device`` (device_map on CUDA); if that fails, on the CPU and moved."""
    try:
        return loadpath.load_component(LIB, CLS, path, device=device)
    except Exception as exc:  # noqa: BLE001 - recorded; the CPU route below still checks the files
        if device == "cpu":
            raise
        record["device_map_load_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return loadpath.load_component(LIB, CLS, path).to(device)


def class_counts(model: Any) -> dict[str, int]:
    import torch

    counts: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            counts[type(mod.weight).__name__] = counts.get(type(mod.weight).__name__, 0) + 1
    return counts


def compare_outputs(out: Any, ref: Any) -> dict[str, float]:
    import torch

    a, b = out.float().flatten(), ref.float().flatten()
    return {"rel_err": float((a - b).norm() / b.norm().clamp(min=1e-30)),
            "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "finite": bool(torch.isfinite(a).all())}


# ----------------------------------------------------------------------------- table


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if abs(v) >= 10 ** -nd or v == 0 else f"{v:.2e}"
    return str(v)


def _ms(ms: Any, speedup: Any) -> str:
    return "-" if ms is None else f"{ms:.2f}" + (f" ({speedup:.2f}x)" if speedup else "")


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |"


def render_table(r: dict[str, Any]) -> str:
    """One markdown table; '(N.NNx)' is the speed-up over bf16 (eager over eager, compiled over compiled)."""
    cols = ["recipe", "status", "quantized", "class ok", "weights MB", "file MB", "quant peak MB", "fwd peak MB",
            "eager ms", "compile ms", "rel err", "cosine", "reload identical (hf/manual)", "notes"]
    b, comp = r.get("bf16", {}), r.get("compile", {})
    lines = [_row(cols), "|" + "---|" * len(cols),
             _row(["bf16", b.get("status", "-"), "-", "-", _fmt(b.get("weights_mb")), "-", "-", _fmt(b.get("fwd_peak_mb")),
                   _fmt(b.get("eager_ms"), 2), _fmt(comp.get("bf16", {}).get("ms"), 2), "0", "1", "-",
                   b.get("error", "")[:80]])]
    for name, x in r.get("recipes", {}).items():
        c = comp.get(name, {})
        reload = "-" if "reload_hf_identical" not in x and "reload_manual_identical" not in x else \
            f"{_fmt(x.get('reload_hf_identical'))}/{_fmt(x.get('reload_manual_identical'))}"
        compiled = _ms(c.get("ms"), c.get("speedup_vs_bf16_compiled")) if c.get("status") == "ok" else c.get("status") or "-"
        lines.append(_row([
            name, x.get("status", "-"), f"{x['quantized']}/{x['linears']}" if "linears" in x else "-",
            _fmt(x.get("class_ok")), _fmt(x.get("weights_mb")), _fmt(x.get("file_mb")), _fmt(x.get("quant_peak_mb")),
            _fmt(x.get("fwd_peak_mb")), _ms(x.get("eager_ms"), x.get("eager_speedup_vs_bf16")), compiled,
            _fmt(x.get("rel_err"), 4), _fmt(x.get("cosine"), 5), reload,
            str(x.get("reason") or x.get("error") or x.get("note") or "")[:120]]))
    for name, x in r.get("fp8_cpu_vs_device", {}).items():
        note = x.get("error") or x.get("reason") or (
            f"tensors+headers byte-identical to device-made: {_fmt(x.get('bytes_identical'))} "
            f"(raw files: {_fmt(x.get('raw_file_bytes_identical'))}); "
            f"output on device identical: {_fmt(x.get('device_output_identical'))}")
        lines.append(_row([f"{name} (CPU-made)", x.get("status", "-"), "-", "-", "-", _fmt(x.get("file_mb")), "-", "-",
                           "-", "-", _fmt(x.get("rel_err"), 4), _fmt(x.get("cosine"), 5), "-", str(note)[:160]]))
    s = r.get("summary", {})
    vs_gpu = " vs GPU" if r.get("meta", {}).get("device") == "cuda" else ""
    tail = [f"\narith (torture tensors, float8 CPU vs reference{vs_gpu}): {_fmt(s.get('arith_identical'))}",
            f"failures: {len(r.get('failures', []))}", *[f"- {f}" for f in r.get("failures", [])[:20]]]
    if r.get("optional_failures"):
        tail += [f"optional (compile) failures: {len(r['optional_failures'])}"]
        tail += [f"- {f}" for f in r["optional_failures"][:10]]
    if s:
        tail.append("summary: " + json.dumps(s, default=str))
    return "\n".join(lines + tail) + "\n"


# ----------------------------------------------------------------------------- main steps


def build_reference(chk: Check, cfg: dict[str, Any], inputs: dict[str, Any], args: argparse.Namespace) -> tuple[Any, Any]:
    """The bf16 base saved to ``args.base`` (every recipe starts from these bytes), loaded back on the device."""
    dev, b = args.device, chk.results["bf16"]
    t = time.monotonic()
    base = flux_transformer(cfg, seed=args.seed, device=dev)
    params = sum(p.numel() for p in base.parameters())
    chk.results["meta"]["model"] = {"config": cfg, "params": params, "bf16_gb": round(params * 2 / 1e9, 2)}
    base.save_pretrained(args.base, max_shard_size=args.shard)
    del base
    free(dev)
    b["build_s"] = round(time.monotonic() - t, 2)
    with gpu_memory(dev) as mem:
        bf16 = load_library(args.base, dev, b)
    b["weights_mb"] = mem["added"] if dev == "cuda" else weights_mb(bf16)
    with gpu_memory(dev) as mem:
        ref_out = forward(bf16, inputs)
    b["fwd_peak_mb"] = mem["peak"]
    b["eager_ms"] = latency_ms(bf16, LIB, inputs, dev, args.iters)
    return bf16, ref_out


def run_recipe(chk: Check, name: str, inputs: dict[str, Any], ref_out: Any, args: argparse.Namespace) -> Any:
    """Quantize, measure, save, reload; the in-memory model (for the compile phase), or None."""
    import torch

    x: dict[str, Any] = chk.results["recipes"].setdefault(name, {})
    recipe, dev = recipes.get(name), args.device
    if dev == "cuda":
        try:
            recipes.check_can_quantize(recipe, tuple(torch.cuda.get_device_capability()))
        except Exception as exc:  # noqa: BLE001 - the recipe is skipped, with the registry's reason
            x.update(status="skipped", reason=str(exc))
            return None
    elif recipe.quantize.cuda:
        if not fp8cpu.cpu_quantize_supported(recipe):
            x.update(status="skipped", reason=f"needs {recipe.quantize.describe()} (device=cpu)")
            return None
        x["note"] = "quantized via publisher.fp8cpu (device=cpu)"
    if chk.out_of_time(x, args.min_recipe_s):
        return None
    save_dir = args.work / name
    model = out = None
    with chk.step(x, f"{name}: quantize + save"):
        free(dev)
        shutil.rmtree(save_dir, ignore_errors=True)
        t = time.monotonic()
        with gpu_memory(dev) as mem:
            model = library_quantize(args.base, save_dir, library=LIB, recipe=recipe, device=dev, max_shard_size=args.shard)
        x["quantize_save_s"] = round(time.monotonic() - t, 2)
        x["weights_mb"] = mem["added"] if dev == "cuda" else weights_mb(model)
        if dev == "cuda":
            x["quant_peak_mb"] = mem["peak"]
            # bounded: never the whole bf16 model and the whole quantized one on the GPU at once
            x["quant_memory_bounded"] = x["quant_peak_mb"] < x["weights_mb"] + chk.results["bf16"]["weights_mb"]
        counts = class_counts(model)
        x["linears"], x["quantized"], x["classes"] = sum(counts.values()), counts.get(recipe.tensor_class, 0), counts
        x["class_ok"] = x["quantized"] > 0 and set(counts) <= {recipe.tensor_class, "Parameter"}
        config = recipes.build_config(recipe)
        if hasattr(config, "activation_dtype"):
            x["float8_attrs"] = float8_attrs_ok(model, config)
        with gpu_memory(dev) as mem:
            out = forward(model, inputs)
        x["fwd_peak_mb"] = mem["peak"]
        x.update(compare_outputs(out, ref_out))
        x["eager_ms"] = latency_ms(model, LIB, inputs, dev, args.iters)
        x["eager_speedup_vs_bf16"] = round(chk.results["bf16"]["eager_ms"] / x["eager_ms"], 3)
        x["files"] = sorted(p.name for p in save_dir.iterdir())
        x["file_mb"] = round(sum(p.stat().st_size for p in save_dir.glob("*.safetensors")) / 2**20, 1)
        x["quantization_config"] = json.loads((save_dir / "config.json").read_text()).get("quantization_config")
    if x.get("status") == "failed":
        return None
    with chk.step(x, f"{name}: reload (library and manual paths)"):
        t = time.monotonic()
        for path, load in (("hf", lambda: load_library(save_dir, dev, x)),
                           ("manual", lambda: loadpath.load_manual(LIB, CLS, save_dir).to(dev))):
            reloaded = load()
            x[f"reload_{path}_identical"] = bool(torch.equal(forward(reloaded, inputs), out))
            x[f"reload_{path}_classes_ok"] = class_counts(reloaded) == counts
            x[f"reload_{path}_s"] = round(time.monotonic() - t, 2)
            del reloaded
            free(dev)
            t = time.monotonic()
    fp8 = chk.results["fp8_cpu_vs_device"]
    if name in recipes.cpu_producible_names() and x.get("status") == "failed":
        fp8[name] = {"status": "skipped", "reason": "device-made checkpoint failed"}
    elif name in recipes.cpu_producible_names():
        fp8_cpu_vs_device(chk, name, inputs, ref_out, out, save_dir, args)
    if fp8.get(name, {}).get("status") != "failed":
        shutil.rmtree(save_dir, ignore_errors=True)  # disk: keep only what a failure needs looking at
    return model


def fp8_cpu_vs_device(chk: Check, name: str, inputs: dict[str, Any], ref_out: Any, device_out: Any,
                      device_dir: Path, args: argparse.Namespace) -> None:
    """Task A on this machine's CPU: the same checkpoint made without the GPU, compared byte for byte."""
    import torch

    x: dict[str, Any] = chk.results["fp8_cpu_vs_device"].setdefault(name, {})
    if chk.out_of_time(x, args.min_recipe_s):
        return
    with chk.step(x, f"{name}: CPU-made checkpoint vs {args.device}-made"):
        cpu_dir = args.work / f"{name}-cpu"
        shutil.rmtree(cpu_dir, ignore_errors=True)
        t = time.monotonic()
        library_quantize(args.base, cpu_dir, library=LIB, recipe=recipes.get(name), device="cpu", max_shard_size=args.shard)
        x["cpu_quantize_save_s"] = round(time.monotonic() - t, 2)
        free("cpu")
        x["file_mb"] = round(sum(p.stat().st_size for p in cpu_dir.glob("*.safetensors")) / 2**20, 1)
        cmp = compare_checkpoints(cpu_dir, device_dir)
        x["bytes_identical"], x["raw_file_bytes_identical"] = cmp.identical, cmp.raw_bytes_identical
        x["files"], x["differing_tensors"] = cmp.files, cmp.differing_tensors
        loaded = load_library(cpu_dir, args.device, x)
        out = forward(loaded, inputs)
        x["device_output_identical"] = bool(torch.equal(out, device_out))
        x.update(compare_outputs(out, ref_out))
        del loaded
        free(args.device)
        shutil.rmtree(cpu_dir, ignore_errors=True)


def compile_phase(chk: Check, models: dict[str, Any], inputs: dict[str, Any], args: argparse.Namespace) -> None:
    import torch

    if not args.compile:
        chk.results["compile"]["note"] = "skipped (--no-compile, the default on cpu)"
        return
    if not args.compile_tuning:
        # torchao's handlers switch on coordinate-descent tuning, which multiplies compile time.
        torch._inductor.config.coordinate_descent_tuning = False
    chk.results["compile"]["note"] = (f"compile_repeated_blocks, mode default, {args.iters} iters; "
                                      f"coordinate_descent_tuning={torch._inductor.config.coordinate_descent_tuning}")
    bf16_eager = chk.results["bf16"]["eager_ms"]
    for name, model in models.items():
        x: dict[str, Any] = chk.results["compile"].setdefault(name, {})
        if chk.out_of_time(x, args.min_compile_s):
            chk.save()
            continue
        with chk.step(x, f"{name}: torch.compile", core=False):
            from torch._dynamo.utils import counters

            torch._dynamo.reset()  # otherwise each recipe's tensor class recompiles the same blocks
            eager = forward(model, inputs)
            model.compile_repeated_blocks()
            t = time.monotonic()
            out = forward(model, inputs)
            sync(args.device)
            x["first_call_s"] = round(time.monotonic() - t, 2)
            graphs = counters["stats"]["unique_graphs"]
            x["ms"] = latency_ms(model, LIB, inputs, args.device, args.iters)
            # a graph compiled during timing means the latency includes compilation
            x["graphs"], x["recompiled_while_timing"] = graphs, counters["stats"]["unique_graphs"] != graphs
            x["max_abs_diff_vs_eager"] = float((out.float() - eager.float()).abs().max())
            own_eager = bf16_eager if name == "bf16" else chk.results["recipes"].get(name, {}).get("eager_ms")
            if own_eager:
                x["speedup_vs_own_eager"] = round(own_eager / x["ms"], 3)
            x["speedup_vs_bf16_eager"] = round(bf16_eager / x["ms"], 3)
            bf16_compiled = chk.results["compile"].get("bf16", {}).get("ms")
            if bf16_compiled and name != "bf16":
                x["speedup_vs_bf16_compiled"] = round(bf16_compiled / x["ms"], 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=os.environ.get("OUT") or "./gpu-check-out")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--tiny", action="store_true", help="a tiny Flux config (seconds on a CPU)")
    p.add_argument("--size-gb", type=float, default=2.6, help="bf16 size of the FLUX-shaped model (2.6: 2+4 blocks, 2.62 GB)")
    p.add_argument("--recipes", default=",".join(ORDER))
    p.add_argument("--time-budget", type=float, default=330.0, help="seconds; later optional steps are skipped")
    p.add_argument("--min-recipe-s", type=float, default=20.0)
    p.add_argument("--min-compile-s", type=float, default=45.0)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--compile-tuning", action="store_true", help="keep torchao's coordinate-descent tuning on")
    p.add_argument("--shard", default=None, help="max_shard_size for save_pretrained")
    p.add_argument("--work", type=Path, default=None, help="scratch folder for checkpoints (default: a tmp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--emit-arith-hashes", action="store_true", help="print EXPECTED_CPU_HASHES for this machine")
    args = p.parse_args(argv)

    import torch

    if args.emit_arith_hashes:
        res = arith_check("cpu")
        print(json.dumps({k: v["hash_cpu_fp8cpu"] for k, v in res.items() if isinstance(v, dict)}, indent=1))
        return 0
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available", file=sys.stderr)
        return 2
    gpu = args.device == "cuda"
    args.iters = args.iters or (10 if gpu else 1)
    args.compile = gpu if args.compile is None else args.compile
    args.shard = args.shard or ("1GB" if not args.tiny else "100KB")  # several shards: exercises cross-shard reload
    args.work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-check-work-{os.getpid()}"
    args.work.mkdir(parents=True, exist_ok=True)
    args.base = args.work / "bf16"
    chk = Check(Path(args.out), args.time_budget)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        return _run(chk, args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


def _run(chk: Check, args: argparse.Namespace) -> int:
    import platform

    import torch

    meta = chk.results["meta"]
    meta["transformers_import"] = preflight()
    meta.update(device=args.device, python=platform.python_version(), cpu_count=os.cpu_count(),
                args={k: str(v) for k, v in vars(args).items()},
                versions={n: _version(n) for n in ("torch", "torchao", "diffusers", "accelerate", "safetensors",
                                                   "huggingface_hub", "transformers", "mslk", "triton")})
    if args.device == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(), cc=list(torch.cuda.get_device_capability()),
                    gpu_mem_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    chk.log(f"device={args.device} {meta.get('gpu', '')} versions={meta['versions']}")
    with chk.step(chk.results["arith"], "arith: torture tensors"):
        chk.results["arith"].update(arith_check(args.device))
    bf16 = ref_out = None
    with chk.step(chk.results["bf16"], "build FLUX-shaped bf16 model + reference forward"):
        cfg = dict(FLUX_TINY_FP8) if args.tiny else flux_dev_shaped(*flux_dev_blocks(args.size_gb))
        inputs = make_inputs(cfg, args.tiny, args.device, args.seed)
        bf16, ref_out = build_reference(chk, cfg, inputs, args)
    if bf16 is None or ref_out is None:
        chk.results["summary"] = {"ok": False, "reason": "could not build the model"}
        chk.save()
        print(render_table(chk.results))
        return 1
    keep: dict[str, Any] = {"bf16": bf16}
    for name in [n.strip() for n in args.recipes.split(",") if n.strip()]:
        model = run_recipe(chk, name, inputs, ref_out, args)
        if model is not None:
            keep[name] = model
        chk.save()
    compile_phase(chk, keep, inputs, args)
    summarize(chk)
    chk.save()
    print("\n" + render_table(chk.results), flush=True)
    return 0 if chk.results["summary"].get("ok") else 1


def preflight() -> str:
    """diffusers imports transformers (and its torchao quantizer) when it is installed; the device
    image's transformers may not import against torchao 0.18, and nothing here needs it, so a
    failing one is hidden from diffusers instead of failing the whole check."""
    try:
        import transformers.quantizers.auto  # noqa: F401 - what `import diffusers` pulls in
        return "ok"
    except Exception as exc:  # noqa: BLE001
        for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
            del sys.modules[name]
        sys.modules["transformers"] = None  # type: ignore[assignment] - find_spec() now says "absent"
        return f"hidden from diffusers: {type(exc).__name__}: {exc}"[:500]


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def summarize(chk: Check) -> None:
    r = chk.results
    arith = r["arith"]
    s: dict[str, Any] = {
        "arith_identical": arith.get("all_identical"),
        "arith_dev_machine_hashes": sorted({str(v.get("dev_machine_hash_match")) for v in arith.values() if isinstance(v, dict)}),
        "arith_gpu_vs_dev_machine_hashes": {k: v["dev_machine_hash_match_gpu"] for k, v in arith.items()
                                            if isinstance(v, dict) and "dev_machine_hash_match_gpu" in v},
        "recipes_ok": [n for n, x in r["recipes"].items() if x.get("status") == "ok"],
        "recipes_skipped": {n: x.get("reason") for n, x in r["recipes"].items() if x.get("status") == "skipped"},
        "recipes_failed": [n for n, x in r["recipes"].items() if x.get("status") == "failed"],
        "reload_all_identical": all(x.get("reload_hf_identical") and x.get("reload_manual_identical")
                                    for x in r["recipes"].values() if x.get("status") == "ok"),
        "fp8_cpu_bytes_identical": {n: x.get("bytes_identical") for n, x in r["fp8_cpu_vs_device"].items()},
        "elapsed_s": round(time.monotonic() - chk.t0, 1),
    }
    s["compile_failed"] = [f.split(":")[0] for f in r["optional_failures"]]
    s["ok"] = (not r["failures"] and bool(s["arith_identical"]) and s["reload_all_identical"]
               and all(v for v in s["fp8_cpu_bytes_identical"].values()))
    r["summary"] = s


if __name__ == "__main__":
    sys.exit(main())
