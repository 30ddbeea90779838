"""Float8 checks shared by tests/test_fp8cpu.py, tests/test_scripts_gpu_check.py and scripts/gpu_check.py.

``arith_check``: torture tensors quantized to float8 by torchao on the CPU (raw, and through publisher.fp8cpu),
by fp8cpu's independent reference and, on a CUDA machine, by torchao on the GPU; bytes compared, and hashes
compared with those made on the dev machine. ``expected_act_kwargs``: what a quantized model's Float8Tensors carry.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from typing import Any

from publisher import fp8cpu

# sha256(qdata bytes + scale bytes) of publisher.fp8cpu's result for each torture case, made on the
# dev machine (torch 2.13.0 CPU, torchao 0.18.0) with ``scripts/gpu_check.py --emit-arith-hashes``:
# a cross-version check.
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
    """Per torture case and granularity, each result's differences from the GPU's (else fp8cpu's); ``all_identical``."""
    import torch
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8Tensor, PerRow, PerTensor

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
                e: dict[str, Any] = {"qdata_diff": int(qd.sum()), "scale_diff": int(sd.sum()),
                                     "scale_nan_payload_diff": int(nan_bits.sum())}
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


def expected_act_kwargs(config: Any) -> Any:
    """The activation-quantization settings torchao's handler derives from a Float8DynamicActivationFloat8WeightConfig."""
    from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

    return QuantizeTensorToFloat8Kwargs(config.activation_dtype, config.granularity[0],
                                        hp_value_lb=config.activation_value_lb, hp_value_ub=config.activation_value_ub,
                                        kernel_preference=config.kernel_preference)

