#!/usr/bin/env python3
"""Issue 8 device check: every registry recipe on one GPU, plus CPU-made vs GPU-made float8dq.

    python scripts/gpu_check.py [OUT_DIR] [--device cuda|cpu] [--tiny | --size-gb N] [--time-budget S]

OUT_DIR defaults to $OUT, else ./gpu-check-out; results.json and table.md are (re)written there
after every step, so a run stopped at its time limit still leaves what it measured. Steps:
  0. arithmetic: torture tensors (every bf16 value, zero/NaN/inf rows) quantized to float8 by
     torchao on the GPU, by torchao on the CPU (raw and through publisher.fp8cpu) and by an
     independent reference; bytes compared, plus hashes made on the dev machine (torch 2.13 CPU).
  1. a FLUX.1-dev-shaped transformer (fewer blocks, seeded random bf16) built on the CPU.
  2. per recipe: quantize one Linear at a time on the device (never all bf16 + all quantized
     weights there), save with save_pretrained (sharded safetensors), reload via from_pretrained
     and via the manual path, outputs compared bit for bit with the in-memory model, classes,
     memory, eager latency, error vs bf16; float8dq*: the same checkpoint made on the CPU
     (publisher.fp8cpu) compared file by file and run on the device. torch.compile last, while
     the time budget lasts. Every step is wrapped: a failure is recorded, the rest still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FLUX_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# inner dim 192, not 128: torchao 0.18 mistakes a 128x128 PerTensor weight for 128x128 blockwise.
TINY = dict(FLUX_DEV, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=64,
            num_attention_heads=3, joint_attention_dim=128, pooled_projection_dim=64, axes_dims_rope=(8, 28, 28))
# float8 first: they are what issue 8 is about, and the budget may run out.
ORDER = ["float8dq", "float8dq-tensor", "int8dq", "int8wo", "float8wo", "int4wo"]

# sha256(qdata bytes + scale bytes) of publisher.fp8cpu's result for each torture case, made on the
# dev machine (torch 2.13.0 CPU, torchao 0.18.0) with --emit-arith-hashes: a cross-version check.
EXPECTED_CPU_HASHES: dict[str, str] = {
    "every_bf16/row": "c5866102e76f7e7e041a6c9c754164af1d452fc5f2cfc1a7b882a2be668e4840",
    "every_bf16/tensor": "ba5b2899c7b67cb7a38fec1233c4aa929b842ecfcfb302b2eeac938cfd81ad9b",
    "every_finite_bf16/row": "c4726e508a7d5821b7d2c2717d2fb5fce8728fab9a01657ab873be68ef237e58",
    "every_finite_bf16/tensor": "c484cd6037c63e1848f7d77cc9c7c2bad5b54cababe838a0173dc4503bd00979",
    "binades/row": "35244464158a60bd47fa5d1040dba7f195ba5a558e8f4ed49a397efef04b1ac7",
    "binades/tensor": "ca5caca250cb133efcd1bf2a3e82e24ace7c61bd347aba2ed52d45ca16e4d662",
    "special_rows/row": "a2541182b8eab4af2e69d8335d3bccaf97d59764fc3d2e26c8e613e34fff8575",
    "special_rows/tensor": "b28383e9d04e501ff71958487378ac776dce153e66b93f7766475d8dce018678",
}


class Check:
    """Results, the time budget, and the wrapper that turns a failing step into a record."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.t0, self.budget = out, time.monotonic(), budget_s
        self.results: dict[str, Any] = {"meta": {}, "arith": {}, "bf16": {}, "recipes": {}, "fp8_cpu_vs_device": {},
                                        "compile": {}, "failures": [], "optional_failures": [], "summary": {}}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

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


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def mem_mb(device: str, peak: bool = False) -> float | None:
    import torch

    if device != "cuda":
        return None
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**20


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def tensor_bytes(model: Any) -> int:
    """Bytes of all parameters and buffers, counting a torchao tensor by its inner tensors."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        names = getattr(t, "tensor_data_names", None)
        if names:
            names = list(names) + list(getattr(t, "optional_tensor_data_names", []) or [])
            total += sum(getattr(t, n).nbytes for n in names if getattr(t, n, None) is not None)
        else:
            total += t.nbytes
    return total


def flux_config(tiny: bool, size_gb: float) -> tuple[dict[str, Any], int]:
    """FLUX.1-dev's transformer config with n double and 2n single blocks, n the largest that fits size_gb."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    if tiny:
        cfg = dict(TINY)
    else:
        cfg = dict(FLUX_DEV)
        for n in range(1, 20):
            trial = dict(FLUX_DEV, num_layers=n, num_single_layers=min(2 * n, 38))
            with init_empty_weights():
                params = sum(p.numel() for p in FluxTransformer2DModel.from_config(trial).parameters())
            if n > 1 and params * 2 > size_gb * 1e9:
                break
            cfg = trial
    with init_empty_weights():
        params = sum(p.numel() for p in FluxTransformer2DModel.from_config(cfg).parameters())
    return cfg, params


def build_base(cfg: dict[str, Any], seed: int, device: str) -> Any:
    """Seeded random weights, initialised on ``device`` (fast on a GPU), kept in bf16 on the CPU:
    every recipe and the CPU float8 path start from these same bytes."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = FluxTransformer2DModel.from_config(cfg).to(torch.bfloat16)
    return model.cpu().eval()


def make_inputs(cfg: dict[str, Any], tiny: bool, device: str, seed: int) -> dict[str, Any]:
    import torch

    side, txt = (4, 8) if tiny else (32, 256)  # 32x32 packed latents = a 512x512 image
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    bf = torch.bfloat16
    x = dict(hidden_states=torch.randn(1, side * side, cfg["in_channels"], generator=g).to(bf),
             encoder_hidden_states=torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(bf),
             pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(bf),
             timestep=torch.tensor([0.5], dtype=bf), guidance=torch.tensor([3.5], dtype=bf),
             img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(txt, 3))
    return {k: v.to(device) for k, v in x.items()}


def forward(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def latency_ms(model: Any, inputs: dict[str, Any], device: str, iters: int, warmup: int = 1) -> float:
    import torch

    for _ in range(warmup):
        forward(model, inputs)
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            forward(model, inputs)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            forward(model, inputs)
            times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def quantize_layerwise(base: Any, cfg: dict[str, Any], config: Any, device: str,
                       ctx: Callable[[], Any] = contextlib.nullcontext) -> Any:
    """A copy of ``base`` (CPU, bf16) on ``device`` with every Linear quantized by ``config`` one
    at a time, so at most one bf16 Linear and the quantized weights so far sit on the device."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from torchao.quantization import quantize_

    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(cfg)
    with ctx():
        for name, src in base.named_modules():
            dst = model.get_submodule(name) if name else model
            for pname, p in src.named_parameters(recurse=False):
                dst._parameters[pname] = torch.nn.Parameter(p.detach().to(device), requires_grad=False)
            for bname, b in src.named_buffers(recurse=False):
                dst._buffers[bname] = b.to(device)
            if config is not None and isinstance(src, torch.nn.Linear):
                quantize_(dst, config)
    return model.eval()


def attach_quantizer(model: Any, config: Any) -> None:
    """What diffusers' from_pretrained(quantization_config=...) sets, so save_pretrained flattens
    torchao tensors into safetensors and writes quantization_config into config.json."""
    from diffusers import TorchAoConfig
    from diffusers.quantizers.auto import DiffusersAutoQuantizer

    tq = TorchAoConfig(config)
    quantizer = DiffusersAutoQuantizer.from_config(tq, pre_quantized=False)
    quantizer.validate_environment(device_map=None)
    quantizer.preprocess_model(model, device_map=None, keep_in_fp32_modules=[])
    model.register_to_config(quantization_config=tq)
    model.hf_quantizer = quantizer


def load_hf(path: Path, device: str, record: dict[str, Any]) -> Any:
    """from_pretrained onto ``device`` (device_map on CUDA); if that fails, load on CPU and move."""
    import torch
    from diffusers import FluxTransformer2DModel

    if device == "cuda":
        try:
            return FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16, device_map=device).eval()
        except Exception as exc:  # noqa: BLE001 - recorded; the CPU path below still checks the files
            record["device_map_load_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return FluxTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16).to(device).eval()


def load_manual(path: Path, device: str) -> Any:
    """The documented path for old torch: empty model + load_file + unflatten + load_state_dict."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(config)
    flat, metadata = {}, {}
    for shard in sorted(path.glob("*.safetensors")):
        flat.update(load_file(shard, device=device))
        with safe_open(shard, framework="pt") as f:
            metadata.update(f.metadata() or {})
    state, leftover = unflatten_tensor_state_dict(flat, metadata)
    state.update(leftover)
    model.load_state_dict(state, strict=True, assign=True)
    for mod in model.modules():  # non-persistent buffers stay where the constructor put them
        for bname, b in list(mod._buffers.items()):
            if b is not None and b.device.type != torch.device(device).type:
                mod._buffers[bname] = b.to(device)
    return model.eval()


def class_counts(model: Any) -> dict[str, int]:
    import torch

    counts: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            name = type(mod.weight).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


def compare_outputs(out: Any, ref: Any) -> dict[str, float]:
    import torch

    a, b = out.float().flatten(), ref.float().flatten()
    return {"rel_err": float((a - b).norm() / b.norm().clamp(min=1e-30)),
            "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "finite": bool(torch.isfinite(a).all())}


def float8_attrs_ok(model: Any, config: Any) -> dict[str, Any]:
    """Every Float8Tensor carries exactly the act-quant settings, mm_config and kernel preference
    torchao's handler derives from ``config``."""
    import torch
    from torchao.quantization import Float8Tensor
    from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

    expected = QuantizeTensorToFloat8Kwargs(config.activation_dtype, config.granularity[0],
                                            hp_value_lb=config.activation_value_lb,
                                            hp_value_ub=config.activation_value_ub,
                                            kernel_preference=config.kernel_preference)
    bad = [n for n, p in model.named_parameters() if isinstance(p, Float8Tensor) and (
        p.act_quant_kwargs != expected or p.mm_config != config.mm_config
        or p.kernel_preference != config.kernel_preference or p.scale.dtype != torch.float32)]
    return {"ok": not bad, "bad": bad[:5]}


def _split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def compare_checkpoints(a: Path, b: Path) -> dict[str, Any]:
    """File by file. safetensors 0.8 writes ``__metadata__`` in hash-map order, random per save, so
    two saves of one torchao model are never byte-identical files: a shard counts as identical when
    its parsed header (metadata, dtypes, shapes, offsets) and its data bytes are equal."""
    import torch
    from safetensors import safe_open

    files = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    report: dict[str, Any] = {"files": {}, "identical": True, "raw_bytes_identical": True, "differing_tensors": []}
    for name in files:
        fa, fb = a / name, b / name
        if not (fa.exists() and fb.exists()):
            report["files"][name] = "missing in " + (str(b) if fa.exists() else str(a))
            report["identical"] = report["raw_bytes_identical"] = False
            continue
        if fa.read_bytes() == fb.read_bytes():
            report["files"][name] = "identical bytes"
            continue
        report["raw_bytes_identical"] = False
        if name.endswith(".json"):
            same = json.loads(fa.read_text()) == json.loads(fb.read_text())
            report["files"][name] = "same JSON, different bytes" if same else "differs"
            report["identical"] &= same
            continue
        if not name.endswith(".safetensors"):
            report["files"][name] = "differs"
            report["identical"] = False
            continue
        (ha, da), (hb, db) = _split_safetensors(fa), _split_safetensors(fb)
        if ha == hb and da == db:
            report["files"][name] = "identical header and data (header key order differs)"
            continue
        report["files"][name] = "differs"
        report["identical"] = False
        if ha.get("__metadata__") != hb.get("__metadata__"):
            ma, mb = ha.get("__metadata__") or {}, hb.get("__metadata__") or {}
            keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
            report["differing_tensors"].append({"file": name, "tensor": "<metadata>", "keys": keys[:10]})
        with safe_open(fa, framework="pt") as x, safe_open(fb, framework="pt") as y:
            for key in sorted(set(x.keys()) | set(y.keys())):
                if key not in x.keys() or key not in y.keys():
                    report["differing_tensors"].append({"file": name, "tensor": key, "missing": True})
                    continue
                ta, tb = x.get_tensor(key), y.get_tensor(key)
                same_layout = ta.dtype == tb.dtype and ta.shape == tb.shape
                if same_layout:
                    ba = ta.contiguous().reshape(-1).view(torch.uint8).reshape(-1, ta.element_size())
                    bb = tb.contiguous().reshape(-1).view(torch.uint8).reshape(-1, tb.element_size())
                    diff = (ba != bb).any(dim=1)
                    if not diff.any():
                        continue
                entry: dict[str, Any] = {"file": name, "tensor": key, "dtype": [str(ta.dtype), str(tb.dtype)],
                                         "shape": [list(ta.shape), list(tb.shape)]}
                if same_layout:
                    entry["n_diff"] = int(diff.sum())
                    d = (ta.float() - tb.float()).abs().reshape(-1)[diff]
                    entry["max_abs_diff"] = float(d.nan_to_num(0, posinf=0, neginf=0).max())
                    entry["max_rel_diff"] = float((d / ta.float().abs().reshape(-1)[diff].clamp(min=1e-30))
                                                  .nan_to_num(0, posinf=0, neginf=0).max())
                report["differing_tensors"].append(entry)
    report["differing_tensors"] = report["differing_tensors"][:50]
    return report


# ----------------------------------------------------------------------------- arithmetic


def torture_tensors() -> dict[str, Any]:
    """Deterministic (no RNG) bf16 matrices covering every bf16 value and the special rows."""
    import torch

    bits = ((torch.arange(65536, dtype=torch.int64) * 40503 + 12345) % 65536).to(torch.int32)
    every = (bits - 65536 * (bits >= 32768)).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    finite = torch.where(torch.isfinite(every), every, torch.zeros_like(every))
    rows = []
    for top in range(93, 141):  # rows spanning 11 binades: every mantissa, both signs, at 48 scales
        e = torch.arange(top - 10, top + 1, dtype=torch.int32)[:, None] * 128 + torch.arange(128, dtype=torch.int32)
        v = e.flatten()
        rows.append(torch.cat([v, v | 0x8000]).to(torch.int16).view(torch.bfloat16))
    special = torch.zeros(16, 64, dtype=torch.bfloat16)  # float8 skips dims that are not multiples of 16
    special[1, 5] = 1.0
    special[2] = torch.arange(1, 65, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # subnormals
    special[3, :8] = torch.tensor([float("inf"), 1.0, -2.0, 3.0, 0.5, -0.25, 7.0, -448.0])
    special[4, :4] = torch.tensor([float("nan"), 1.0, -1.0, 2.0])
    special[5] = torch.tensor([0.0, -0.0] * 32)
    special[6] = torch.finfo(torch.bfloat16).max * torch.linspace(-1, 1, 64)
    special[7] = torch.finfo(torch.bfloat16).tiny * torch.arange(1, 65).float()
    return {"every_bf16": every, "every_finite_bf16": finite, "binades": torch.stack(rows), "special_rows": special}


def _quantize_linear(w: Any, config: Any, device: str, ctx: Callable[[], Any]) -> tuple[Any, Any]:
    import torch
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(w.to(device), requires_grad=False)
    with ctx():
        quantize_(lin, config)
    return lin.weight.qdata.cpu(), lin.weight.scale.cpu()


def _digest(q: Any, s: Any) -> str:
    import torch

    s = torch.where(torch.isnan(s), torch.full_like(s, float("nan")), s)  # NaN payloads vary by build
    return hashlib.sha256(q.view(torch.uint8).numpy().tobytes() + s.numpy().tobytes()).hexdigest()


def arith_check(device: str) -> dict[str, Any]:
    import torch
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8Tensor, PerRow, PerTensor

    from publisher import fp8cpu

    out: dict[str, Any] = {}
    for tname, w in torture_tensors().items():
        for gname, gran in (("row", PerRow()), ("tensor", PerTensor())):
            config = Float8DynamicActivationFloat8WeightConfig(granularity=gran)
            case = f"{tname}/{gname}"
            raw = Float8Tensor.from_hp(w, granularity=gran)  # torchao's arithmetic, no handler, no NaN fix
            results = {"cpu_raw": (raw.qdata, raw.scale),
                       "cpu_fp8cpu": _quantize_linear(w, config, "cpu", fp8cpu.allow_cpu_float8_quantization),
                       "reference": fp8cpu.reference_float8_quantize(w, per_row=gname == "row")}
            if device == "cuda":
                results["gpu"] = _quantize_linear(w, config, "cuda", contextlib.nullcontext)
            target = results.get("gpu", results["cpu_fp8cpu"])
            entry: dict[str, Any] = {"hash_cpu_fp8cpu": _digest(*results["cpu_fp8cpu"])}
            for k, (q, s) in results.items():
                qd = q.view(torch.uint8) != target[0].view(torch.uint8)
                both_nan = torch.isnan(s) & torch.isnan(target[1])
                sd = (s != target[1]) & ~both_nan
                # NaN scales (rows holding NaN/inf) differ in payload bits between CPU builds and GPUs;
                # informational only: such rows dequantize to NaN whatever the payload.
                nan_bits = both_nan & (s.view(torch.int32) != target[1].view(torch.int32))
                e = {"qdata_diff": int(qd.sum()), "scale_diff": int(sd.sum()), "scale_nan_payload_diff": int(nan_bits.sum())}
                if (sd | nan_bits).any():
                    i = int((sd | nan_bits).flatten().nonzero()[0])
                    e["scale_example_bits"] = [hex(int(s.view(torch.int32).flatten()[i]) & 0xFFFFFFFF),
                                               hex(int(target[1].view(torch.int32).flatten()[i]) & 0xFFFFFFFF)]
                if qd.any():
                    idx = qd.flatten().nonzero()[:4].flatten()
                    e["examples"] = [[int(q.view(torch.uint8).flatten()[i]), int(target[0].view(torch.uint8).flatten()[i]),
                                      float(w.flatten()[i])] for i in idx]
                entry[k] = e
            expected = EXPECTED_CPU_HASHES.get(case)
            entry["dev_machine_hash_match"] = None if expected is None else expected == entry["hash_cpu_fp8cpu"]
            if "gpu" in results:
                entry["hash_gpu"] = _digest(*results["gpu"])
                entry["dev_machine_hash_match_gpu"] = None if expected is None else expected == entry["hash_gpu"]
            out[case] = entry
    # The scale division in isolation: every finite bf16 / 448 on this device vs the CPU.
    every = torch.arange(65536, dtype=torch.int32)
    x = (every - 65536 * (every >= 32768)).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    if device == "cuda":
        d = (x.cuda() / 448.0).cpu().view(torch.int16) != (x / 448.0).view(torch.int16)
        out["bf16_div_448_all_values_diff"] = int(d.sum())
    # cpu_raw (torchao on the CPU without publisher.fp8cpu's NaN fix) is informational: it shows
    # whether that fix is needed; fp8cpu and the reference must equal the GPU (or each other).
    out["all_identical"] = all(v[k]["qdata_diff"] == 0 and v[k]["scale_diff"] == 0
                               for v in out.values() if isinstance(v, dict) and "cpu_fp8cpu" in v
                               for k in ("cpu_fp8cpu", "reference"))
    out["compared_against"] = "gpu" if device == "cuda" else "cpu_fp8cpu"
    return out


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


def render_table(r: dict[str, Any]) -> str:
    """One markdown table; '(N.NNx)' is the speed-up over bf16 (eager over eager, compiled over compiled)."""
    cols = ["recipe", "status", "quantized", "class ok", "weights MB", "file MB", "quant peak MB", "fwd peak MB",
            "eager ms", "compile ms", "rel err", "cosine", "reload identical (hf/manual)", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    b = r.get("bf16", {})
    comp = r.get("compile", {})
    lines.append("| " + " | ".join(["bf16", b.get("status", "-"), "-", "-", _fmt(b.get("weights_mb")), "-", "-",
                                    _fmt(b.get("fwd_peak_mb")), _fmt(b.get("eager_ms"), 2),
                                    _fmt(comp.get("bf16", {}).get("ms"), 2), "0", "1", "-", b.get("error", "")[:80]]) + " |")
    for name, x in r.get("recipes", {}).items():
        note = x.get("reason") or x.get("error") or x.get("note") or ""
        c = comp.get(name, {})
        reload = "-" if "reload_hf_identical" not in x and "reload_manual_identical" not in x else \
            f"{_fmt(x.get('reload_hf_identical'))}/{_fmt(x.get('reload_manual_identical'))}"
        cm = _fmt(c.get("ms"), 2) if c.get("status") == "ok" else (c.get("status") or "-")
        lines.append("| " + " | ".join([
            name, x.get("status", "-"), f"{x['quantized']}/{x['linears']}" if "linears" in x else "-",
            _fmt(x.get("class_ok")), _fmt(x.get("weights_mb")), _fmt(x.get("file_mb")), _fmt(x.get("quant_peak_mb")),
            _fmt(x.get("fwd_peak_mb")), _ms(x.get("eager_ms"), x.get("eager_speedup_vs_bf16")),
            _ms(c.get("ms"), c.get("speedup_vs_bf16_compiled")) if c.get("status") == "ok" else cm, _fmt(x.get("rel_err"), 4),
            _fmt(x.get("cosine"), 5), reload, str(note).replace("|", "/").replace("\n", " ")[:120]]) + " |")
    for name, x in r.get("fp8_cpu_vs_device", {}).items():
        note = x.get("error") or x.get("reason") or (
            f"tensors+headers byte-identical to device-made: {_fmt(x.get('bytes_identical'))} "
            f"(raw files: {_fmt(x.get('raw_file_bytes_identical'))}); "
            f"output on device identical: {_fmt(x.get('device_output_identical'))}")
        lines.append("| " + " | ".join([f"{name} (CPU-made)", x.get("status", "-"), "-", "-", "-", _fmt(x.get("file_mb")),
                                        "-", "-", "-", "-", _fmt(x.get("rel_err"), 4), _fmt(x.get("cosine"), 5), "-",
                                        str(note).replace("|", "/")[:160]]) + " |")
    s = r.get("summary", {})
    tail = [f"\narith (torture tensors, float8 CPU vs reference{' vs GPU' if r.get('meta', {}).get('device') == 'cuda' else ''}): "
            f"{_fmt(s.get('arith_identical'))}", f"failures: {len(r.get('failures', []))}"]
    tail += [f"- {f}" for f in r.get("failures", [])[:20]]
    if r.get("optional_failures"):
        tail += [f"optional (compile) failures: {len(r['optional_failures'])}"]
        tail += [f"- {f}" for f in r["optional_failures"][:10]]
    if s:
        tail.append("summary: " + json.dumps({k: v for k, v in s.items()}, default=str))
    return "\n".join(lines + tail) + "\n"


# ----------------------------------------------------------------------------- main steps


def run_recipe(chk: Check, name: str, base: Any, cfg: dict[str, Any], inputs: dict[str, Any], ref_out: Any,
               args: argparse.Namespace, keep: dict[str, Any]) -> None:
    import torch

    from publisher import fp8cpu, recipes

    x: dict[str, Any] = chk.results["recipes"].setdefault(name, {})
    recipe = recipes.get(name)
    dev = args.device
    ctx: Callable[[], Any] = contextlib.nullcontext
    if dev == "cuda":
        try:
            recipes.check_can_quantize(recipe, tuple(torch.cuda.get_device_capability()))
        except Exception as exc:  # noqa: BLE001
            x.update(status="skipped", reason=str(exc))
            return
    elif recipe.quantize.cuda:
        if not fp8cpu.cpu_quantize_supported(recipe):
            x.update(status="skipped", reason=f"needs {recipe.quantize.describe()} (device=cpu)")
            return
        ctx, x["note"] = fp8cpu.allow_cpu_float8_quantization, "quantized via publisher.fp8cpu (device=cpu)"
    if chk.left() < args.min_recipe_s:
        x.update(status="skipped", reason=f"time budget ({chk.left():.0f}s left)")
        return
    with chk.step(x, f"{name}: quantize"):
        config = recipes.build_config(recipe)
        free(dev)
        reset_peak(dev)
        before = mem_mb(dev)
        t = time.monotonic()
        model = quantize_layerwise(base, cfg, config, dev, ctx)
        sync(dev)
        x["quantize_s"] = round(time.monotonic() - t, 2)
        if dev == "cuda":
            x["quant_peak_mb"] = round(mem_mb(dev, peak=True) - before, 1)
            x["weights_mb"] = round(mem_mb(dev) - before, 1)
            # bounded: never the whole bf16 model and the whole quantized one on the GPU at once
            x["quant_memory_bounded"] = x["quant_peak_mb"] < x["weights_mb"] + chk.results["bf16"]["weights_mb"]
        else:
            x["weights_mb"] = round(tensor_bytes(model) / 2**20, 1)
        counts = class_counts(model)
        x["linears"], x["quantized"], x["classes"] = sum(counts.values()), counts.get(recipe.tensor_class, 0), counts
        x["class_ok"] = x["quantized"] > 0 and set(counts) <= {recipe.tensor_class, "Parameter"}
        if hasattr(config, "activation_dtype"):
            x["float8_attrs"] = float8_attrs_ok(model, config)
        reset_peak(dev)
        before = mem_mb(dev)
        out = forward(model, inputs)
        sync(dev)
        if dev == "cuda":
            x["fwd_peak_mb"] = round(mem_mb(dev, peak=True) - before, 1)
        x.update(compare_outputs(out, ref_out))
        x["eager_ms"] = latency_ms(model, inputs, dev, args.iters)
        x["eager_speedup_vs_bf16"] = round(chk.results["bf16"]["eager_ms"] / x["eager_ms"], 3)
        attach_quantizer(model, config)
    if x.get("status") == "failed":
        return
    save_dir = args.work / name
    with chk.step(x, f"{name}: save + reload"):
        shutil.rmtree(save_dir, ignore_errors=True)
        t = time.monotonic()
        model.save_pretrained(save_dir, max_shard_size=args.shard)
        x["save_s"] = round(time.monotonic() - t, 2)
        x["files"] = sorted(p.name for p in save_dir.iterdir())
        x["file_mb"] = round(sum(p.stat().st_size for p in save_dir.glob("*.safetensors")) / 2**20, 1)
        x["quantization_config"] = json.loads((save_dir / "config.json").read_text()).get("quantization_config")
        t = time.monotonic()
        hf = load_hf(save_dir, dev, x)
        x["reload_hf_s"] = round(time.monotonic() - t, 2)
        x["reload_hf_identical"] = bool(torch.equal(forward(hf, inputs), out))
        x["reload_hf_classes_ok"] = class_counts(hf) == counts
        del hf
        free(dev)
        manual = load_manual(save_dir, dev)
        x["reload_manual_identical"] = bool(torch.equal(forward(manual, inputs), out))
        x["reload_manual_classes_ok"] = class_counts(manual) == counts
        del manual
        free(dev)
    if name in fp8cpu.FLOAT8_DYNAMIC_RECIPES and x.get("status") == "failed":
        chk.results["fp8_cpu_vs_device"][name] = {"status": "skipped", "reason": "device-made checkpoint failed"}
    elif name in fp8cpu.FLOAT8_DYNAMIC_RECIPES:
        fp8_cpu_vs_device(chk, name, base, cfg, inputs, ref_out, out, save_dir, args)
    if name not in fp8cpu.FLOAT8_DYNAMIC_RECIPES or chk.results["fp8_cpu_vs_device"].get(name, {}).get("status") != "failed":
        shutil.rmtree(save_dir, ignore_errors=True)  # disk: keep only what a failure needs looking at
    keep[name] = model


def fp8_cpu_vs_device(chk: Check, name: str, base: Any, cfg: dict[str, Any], inputs: dict[str, Any], ref_out: Any,
                      device_out: Any, device_dir: Path, args: argparse.Namespace) -> None:
    """Task A on this machine's CPU: the same checkpoint made without the GPU, compared byte for byte."""
    import torch

    from publisher import fp8cpu, recipes

    x: dict[str, Any] = chk.results["fp8_cpu_vs_device"].setdefault(name, {})
    if chk.left() < args.min_recipe_s:
        x.update(status="skipped", reason=f"time budget ({chk.left():.0f}s left)")
        return
    with chk.step(x, f"{name}: CPU-made checkpoint vs {args.device}-made"):
        config = recipes.build_config(recipes.get(name))
        t = time.monotonic()
        model = quantize_layerwise(base, cfg, config, "cpu", fp8cpu.allow_cpu_float8_quantization)
        x["cpu_quantize_s"] = round(time.monotonic() - t, 2)
        attach_quantizer(model, config)
        cpu_dir = args.work / f"{name}-cpu"
        shutil.rmtree(cpu_dir, ignore_errors=True)
        model.save_pretrained(cpu_dir, max_shard_size=args.shard)
        del model
        x["file_mb"] = round(sum(p.stat().st_size for p in cpu_dir.glob("*.safetensors")) / 2**20, 1)
        cmp = compare_checkpoints(cpu_dir, device_dir)
        x["bytes_identical"], x["raw_file_bytes_identical"] = cmp["identical"], cmp["raw_bytes_identical"]
        x["files"], x["differing_tensors"] = cmp["files"], cmp["differing_tensors"]
        loaded = load_hf(cpu_dir, args.device, x)
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
    for name, model in models.items():
        x: dict[str, Any] = chk.results["compile"].setdefault(name, {})
        if chk.left() < args.min_compile_s:
            x.update(status="skipped", reason=f"time budget ({chk.left():.0f}s left)")
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
            x["ms"] = latency_ms(model, inputs, args.device, args.iters, warmup=1)
            # a graph compiled during timing means the latency includes compilation
            x["graphs"], x["recompiled_while_timing"] = graphs, counters["stats"]["unique_graphs"] != graphs
            x["max_abs_diff_vs_eager"] = float((out.float() - eager.float()).abs().max())
            eager_ms = chk.results["bf16"].get("eager_ms") if name == "bf16" else \
                chk.results["recipes"].get(name, {}).get("eager_ms")
            if eager_ms:
                x["speedup_vs_own_eager"] = round(eager_ms / x["ms"], 3)
            x["speedup_vs_bf16_eager"] = round(chk.results["bf16"]["eager_ms"] / x["ms"], 3)
            bf16_compiled = chk.results["compile"].get("bf16", {}).get("ms")
            if bf16_compiled and name != "bf16":
                x["speedup_vs_bf16_compiled"] = round(bf16_compiled / x["ms"], 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=os.environ.get("OUT") or "./gpu-check-out")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--tiny", action="store_true", help="a tiny Flux config (seconds on a CPU)")
    p.add_argument("--size-gb", type=float, default=3.0, help="bf16 size of the FLUX-shaped model (3: 2.6 GB)")
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
    chk = Check(Path(args.out), args.time_budget)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        return _run(chk, args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


def _run(chk: Check, args: argparse.Namespace) -> int:
    import importlib.metadata as md
    import platform

    import torch

    meta = chk.results["meta"]
    meta["transformers_import"] = preflight()
    meta.update(device=args.device, python=platform.python_version(), cpu_count=os.cpu_count(),
                args={k: str(v) for k, v in vars(args).items()},
                versions={n: _version(md, n) for n in ("torch", "torchao", "diffusers", "accelerate", "safetensors",
                                                         "huggingface_hub", "transformers", "mslk", "triton")})
    if args.device == "cuda":
        meta.update(gpu=torch.cuda.get_device_name(), cc=list(torch.cuda.get_device_capability()),
                    gpu_mem_gb=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    chk.log(f"device={args.device} {meta.get('gpu', '')} versions={meta['versions']}")
    with chk.step(chk.results["arith"], "arith: torture tensors"):
        chk.results["arith"].update(arith_check(args.device))
    base = inputs = ref_out = None
    b = chk.results["bf16"]
    with chk.step(b, "build FLUX-shaped bf16 model + reference forward"):
        cfg, params = flux_config(args.tiny, args.size_gb)
        meta["model"] = {"config": cfg, "params": params, "bf16_gb": round(params * 2 / 1e9, 2)}
        t = time.monotonic()
        base = build_base(cfg, args.seed, args.device)
        free(args.device)
        b["build_s"] = round(time.monotonic() - t, 2)
        inputs = make_inputs(cfg, args.tiny, args.device, args.seed)
        free(args.device)
        reset_peak(args.device)
        before = mem_mb(args.device)
        bf16 = quantize_layerwise(base, cfg, None, args.device)
        b["weights_mb"] = round(mem_mb(args.device) - before, 1) if args.device == "cuda" else round(tensor_bytes(bf16) / 2**20, 1)
        reset_peak(args.device)
        before = mem_mb(args.device)
        ref_out = forward(bf16, inputs)
        sync(args.device)
        if args.device == "cuda":
            b["fwd_peak_mb"] = round(mem_mb(args.device, peak=True) - before, 1)
        b["eager_ms"] = latency_ms(bf16, inputs, args.device, args.iters)
    if base is None or ref_out is None:
        chk.results["summary"] = {"ok": False, "reason": "could not build the model"}
        chk.save()
        print(render_table(chk.results))
        return 1
    keep: dict[str, Any] = {"bf16": bf16}
    for name in [n.strip() for n in args.recipes.split(",") if n.strip()]:
        run_recipe(chk, name, base, cfg, inputs, ref_out, args, keep)
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


def _version(md: Any, name: str) -> str | None:
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
