"""FP8 dynamic-activation checkpoints produced on a CPU-only machine (issue 8).

torchao 0.18 refuses ``Float8DynamicActivationFloat8WeightConfig`` without a GPU of compute
capability >= 8.9, but the refusal is a hardware assertion (``_check_hardware_support``) in the
config handler, not missing arithmetic: the weight quantization itself is plain torch code.
``allow_cpu_float8_quantization()`` bypasses exactly that assertion, only for CPU tensors and only
while the context is open, and otherwise runs torchao's own handler, so the act-quant settings,
``mm_config``, ``block_size`` and the config JSON are built by torchao itself.

Why the CPU result is byte-identical to a GPU-made one (torchao 0.18, ``kernel_preference=AUTO``,
``Float8PackingFormat.PLAIN``) -- the torch quantize path, ``Float8Tensor.from_hp``:

* ``scale = (|w|.amax(row or tensor) / 448).to(float32)``: the amax is computed in bfloat16 (exact:
  a max), the division by the Python scalar 448 also yields **bfloat16**, so every scale is a
  bf16 value widened to float32 (its low 16 bits are zero). On CUDA, ``tensor / python_scalar``
  is computed as ``a * float32(1/448)`` (multiply by reciprocal), on CPU as a true float32
  division; both then round to bf16. Checked exhaustively over all 65 280 finite bf16 values: the
  two give the same bf16 for every one (see tests/test_fp8cpu.py), because amax/448 = m/7 * 2**k
  is never within one float32 ulp of a bf16 rounding tie.
* ``qdata = (w.float() / scale).clamp(-448, 448).to(float8_e4m3fn)``: an IEEE float32 division of
  two tensors (correctly rounded on both devices; PyTorch's CUDA kernels are not built with
  fast-math), then fp32->e4m3fn: c10's software round-to-nearest-even on the CPU, CUDA's
  ``__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)`` (also RNE) on the GPU. After the clamp
  both should give the same byte for every finite input (subnormals included) and differ on NaN
  only. Not yet run on a GPU here: scripts/gpu_check.py compares every bf16 value, GPU vs CPU.
* A machine with such a GPU already produces CPU-made tensors: diffusers' from_pretrained with a
  TorchAoConfig and no device_map quantizes the weights on the CPU, through this same torch path
  (when mslk is not installed).
* Nothing in the tensor records the device: ``mm_config`` comes from the config
  (``use_fast_accum=True`` unless an XPU is present), ``kernel_preference`` stays ``AUTO``.

Device-dependent exceptions, handled or documented:

* NaN sign: a row (or tensor) whose amax is 0 gives scale 0 and ``0/0``. x86 produces the
  negative default NaN and c10's CPU cast keeps its sign (fp8 byte 0xFF); the CUDA cast maps every
  NaN to 0x7F. The CPU result is canonicalised to 0x7F (``canonicalize_nan_``). Such rows are
  broken on either device (dequantize to NaN); ``check_dequantized`` reports them. NaN *scales*
  (only from NaN/inf weights) may differ in payload bits and are left alone.
* The ``mslk`` kernel package: on a GPU of CC >= 9.0 *with mslk installed*, torchao's AUTO
  per-row path quantizes with a Triton kernel (float32 scale from ``max(amax, eps)``,
  multiply by a reciprocal) whose bits differ from the torch path. A CPU checkpoint therefore
  equals a GPU checkpoint made without mslk (as on the H200 checked by scripts/gpu_check.py),
  not one made with it. Inside the context mslk is reported unavailable so the CPU result never
  depends on what is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from publisher.errors import QuantizeError
from publisher.runtime.patches import Patches


class _Needs(Protocol):
    @property
    def cuda(self) -> bool: ...


class CpuRecipe(Protocol):
    """What this module reads of a recipe (publisher.recipes.Recipe, which builds on this module and so is not
    imported here): whether torchao needs a GPU to quantize it, and whether this module makes it on a CPU."""

    @property
    def quantize(self) -> _Needs: ...

    @property
    def cpu_producible(self) -> bool: ...

if TYPE_CHECKING:  # pragma: no cover
    import torch


# e4m3fn: 3 mantissa bits, so round-to-nearest in the normal range is within 2**-4 relative.
FP8_E4M3_REL_ERROR = 2.0**-4
# Below the smallest normal (2**-6) the step is 2**-9: absolute error 2**-10, in units of the scale.
FP8_E4M3_SUBNORMAL_ABS_ERROR = 2.0**-10
# Slack for the bf16 rounding of the scale and of the dequantized output (2**-9 relative each).
_BOUND_SLACK = 2.0**-8

_PATCHES = Patches()  # torchao's CPU float8 guards, replaced while allow_cpu_float8_quantization() is held


def _patch_targets() -> tuple[Any, Any]:
    """The two torchao modules whose globals the context patches; raises if torchao moved them."""
    try:
        from torchao.quantization import quant_api
        from torchao.quantization.quantize_.workflows.float8 import float8_tensor
    except ImportError as exc:  # pragma: no cover - pinned torchao has them
        raise QuantizeError(f"torchao's float8 modules are missing ({exc}); install torchao==0.18.0") from exc
    needed = {
        quant_api: ("_check_hardware_support", "_float8_dynamic_activation_float8_weight_quantize_tensor",
                    "is_sm_at_least_89"),
        float8_tensor: ("_is_mslk_available", "Float8Tensor"),
    }
    for module, names in needed.items():
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise QuantizeError(
                f"this torchao ({module.__name__}) lacks {', '.join(missing)}: CPU float8 quantization was "
                "written for torchao 0.18.0; quantize on a GPU with compute capability >= 8.9 instead"
            )
    return quant_api, float8_tensor


def cpu_quantize_supported(recipe: CpuRecipe) -> bool:
    """True when ``recipe`` can be quantized on a CPU: natively, or through this module."""
    if not recipe.quantize.cuda:
        return True
    if not recipe.cpu_producible:  # the registry says which recipes this module makes on a CPU
        return False
    try:
        _patch_targets()
    except QuantizeError:
        return False
    return True


def needs_cpu_bypass(recipe: CpuRecipe) -> bool:
    """True when quantizing ``recipe`` on a CPU needs ``allow_cpu_float8_quantization``."""
    return bool(recipe.cpu_producible)


def cpu_quantization_context(recipe: CpuRecipe) -> ContextManager[None]:
    """The context to quantize ``recipe`` on a CPU in (a no-op for recipes torchao allows there)."""
    return allow_cpu_float8_quantization() if needs_cpu_bypass(recipe) else nullcontext()


def _granularity_only_check(granularities: Any) -> None:
    """torchao's ``_check_hardware_support`` without the hardware assertion: still rejects what
    the torch quantize path was not checked for (blockwise 1x128/128x128 needs GPU kernels)."""
    from torchao.quantization.granularity import PerRow, PerTensor

    a, w = granularities
    if (isinstance(a, PerTensor) and isinstance(w, PerTensor)) or (isinstance(a, PerRow) and isinstance(w, PerRow)):
        return
    raise QuantizeError(
        f"CPU float8 quantization supports PerRow or PerTensor granularity only, not {granularities}"
    )


def canonicalize_nan_(qdata: torch.Tensor) -> int:
    """Rewrite negative fp8 NaNs (0xFF) as 0x7F, the only NaN PyTorch's CUDA cast produces; returns
    the number of NaN bytes. x86 yields a negative NaN for 0/0 and inf/inf and the CPU cast keeps
    the sign."""
    import torch

    raw = qdata.view(torch.uint8)
    nan = (raw & 0x7F) == 0x7F
    count = int(nan.sum())
    if count:
        raw[nan] = 0x7F
    return count


@contextmanager
def allow_cpu_float8_quantization() -> Iterator[None]:
    """Let ``quantize_`` (and diffusers/transformers ``TorchAoConfig`` loading, which calls it)
    apply ``Float8DynamicActivationFloat8WeightConfig`` to CPU weights.

    Patches, for the duration only: the hardware assertion (granularity checks kept), the CC >= 8.9
    assertion of the module handler (reachable when an older GPU is present), and mslk
    availability (so the torch path is always taken). Weights on any other device raise. Re-entrant;
    the patches are process-wide while open, so do not quantize for a GPU in another thread then.
    """
    quant_api, float8_tensor = _patch_targets()

    def install() -> dict[tuple[object, str], object]:
        original = quant_api._float8_dynamic_activation_float8_weight_quantize_tensor

        def quantize_tensor_on_cpu(weight: Any, config: Any) -> Any:
            _check_config(config)
            if weight.device.type != "cpu":
                raise QuantizeError(
                    f"allow_cpu_float8_quantization quantizes CPU weights only; this one is on {weight.device} "
                    "(on a GPU with compute capability >= 8.9 quantize without it)"
                )
            result = original(weight, config)
            if isinstance(result, float8_tensor.Float8Tensor):
                canonicalize_nan_(result.qdata)
            return result

        return {
            (quant_api, "_check_hardware_support"): _granularity_only_check,
            (quant_api, "_float8_dynamic_activation_float8_weight_quantize_tensor"): quantize_tensor_on_cpu,
            (quant_api, "is_sm_at_least_89"): lambda: True,  # only guards the handler; weights are CPU-checked above
            (float8_tensor, "_is_mslk_available"): lambda: False,
        }

    with _PATCHES.held(install):
        yield


def _check_config(config: Any) -> None:
    """Reject config options whose CPU result was not shown to equal the GPU one."""
    from torchao.quantization.quantize_.common import KernelPreference
    from torchao.quantization.quantize_.workflows.float8.float8_packing_format import Float8PackingFormat

    if config.packing_format != Float8PackingFormat.PLAIN:
        raise QuantizeError(f"CPU float8 quantization supports the plain packing format only, not {config.packing_format}")
    if config.kernel_preference not in (KernelPreference.AUTO, KernelPreference.TORCH):
        raise QuantizeError(
            f"kernel_preference={config.kernel_preference} quantizes with GPU kernels; CPU supports AUTO/TORCH"
        )


def quantize_module_float8_on_cpu(module: torch.nn.Module, config: Any, **quantize_kwargs: Any) -> int:
    """``quantize_(module, config)`` on CPU inside the bypass; returns how many weights became
    ``Float8Tensor`` (torchao silently skips Linears whose dims are not multiples of 16)."""
    from torchao.quantization import Float8Tensor, quantize_

    with allow_cpu_float8_quantization():
        quantize_(module, config, **quantize_kwargs)
    return sum(isinstance(p, Float8Tensor) for p in module.parameters())


def reference_float8_quantize(weight: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent re-statement of torchao's torch-path arithmetic (for tests and gpu_check):
    bf16 amax / 448 rounded to bf16, widened to float32; float32 division; clamp; RNE to e4m3fn.

    The last step does not use torch's fp32->fp8 cast: it rounds to the nearest of the 256 e4m3fn
    values (ties to even mantissa), found by search over the decoded table.
    """
    import torch

    w = weight.detach()
    amax = w.abs().amax(dim=-1, keepdim=True) if per_row else w.abs().amax().reshape([1] * w.dim())
    scale = (amax.float() / 448.0).to(torch.bfloat16).float()
    scale = torch.where(torch.isnan(scale), torch.full_like(scale, float("nan")), scale)  # 0x7FC00000, as torch's bf16 cast
    x = (w.float() / scale).clamp(-448.0, 448.0)
    q = _round_to_e4m3fn(x)
    canonicalize_nan_(q)
    return q, scale


def _round_to_e4m3fn(x: torch.Tensor) -> torch.Tensor:
    import torch

    codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8)  # non-negative finite codes, 0x00..0x7E
    values = codes.view(torch.float8_e4m3fn).float()  # increasing
    mag = x.abs().flatten()
    hi = torch.searchsorted(values, mag).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # even code = even mantissa
    idx = torch.where(pick_hi, hi, lo)
    out = codes[idx].clone()
    out = torch.where(torch.signbit(x.flatten()), out | 0x80, out)  # -0.0 keeps its sign, like the cast
    out = torch.where(torch.isnan(x.flatten()), torch.full_like(out, 0x7F), out)
    return out.view(torch.float8_e4m3fn).reshape(x.shape)


def dequantize_error_bound(reference: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantize(q) - reference| for e4m3 with the given (broadcastable) scale:
    2**-4 relative (normal range) plus 2**-10 * scale (subnormal step), with slack for bf16 roundings."""
    ref = reference.float().abs()
    return ref * (FP8_E4M3_REL_ERROR + _BOUND_SLACK) + scale.float() * FP8_E4M3_SUBNORMAL_ABS_ERROR * (1 + _BOUND_SLACK)


@dataclass
class DequantReport:
    ok: bool
    worst_ratio: float  # max |error| / bound (<= 1 within the FP8 bound)
    max_abs_error: float
    nonfinite: int  # NaN/inf elements after dequantizing (zero rows give NaN in torchao 0.18)


def check_dequantized(qweight: Any, reference: torch.Tensor) -> DequantReport:
    """Compare a Float8Tensor's dequantized weight with the bf16 weight it was made from."""
    import torch

    deq = qweight.dequantize().float()
    ref = reference.detach().float().to(deq.device)
    err = (deq - ref).abs()
    finite = torch.isfinite(deq)
    nonfinite = int((~finite).sum())
    bound = dequantize_error_bound(ref, qweight.scale.to(deq.device))
    ratio = torch.where(finite, err / bound.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(err))
    worst = float(ratio.max()) if ratio.numel() else 0.0
    max_abs = float(torch.where(finite, err, torch.zeros_like(err)).max()) if err.numel() else 0.0
    return DequantReport(ok=nonfinite == 0 and worst <= 1.0, worst_ratio=worst, max_abs_error=max_abs,
                         nonfinite=nonfinite)
