"""publisher.fp8cpu: float8 dynamic-activation checkpoints made on a CPU (issue 8).

What is checked here (CPU only): torchao's own handler runs on CPU weights inside the context and
builds the tensors its config dictates; an independent reference reproduces them bit for bit; the
bf16 scale division is device-independent for every bf16 value; the checkpoint saves, reloads and
carries the same quantization_config as a normal TorchAoConfig. The CPU-vs-GPU byte comparison
itself needs a GPU: scripts/gpu_check.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torchao.quantization import (
    Float8DynamicActivationFloat8WeightConfig,
    Float8Tensor,
    PerRow,
    PerTensor,
    quantize_,
)

from publisher import fp8cpu, recipes
from publisher.errors import QuantizeError
from publisher.testing.configs import FLUX_TINY_FP8, flux_transformer
from publisher.testing.fp8_checks import expected_act_kwargs

# With a GPU of CC >= 8.9 present torchao itself accepts CPU weights, so "refuses" cannot be shown.
needs_no_fp8_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="torchao's refusal shows only without a GPU")


def _config(per_row: bool = True) -> Float8DynamicActivationFloat8WeightConfig:
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if per_row else PerTensor())


def _sequential(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 48), torch.nn.Linear(48, 16, bias=False),
    ).to(torch.bfloat16)


@needs_no_fp8_gpu
def test_torchao_still_refuses_outside_the_context():
    with pytest.raises(AssertionError, match="compute capability"):
        quantize_(_sequential(), _config())


@pytest.mark.parametrize("per_row", [True, False], ids=["PerRow", "PerTensor"])
def test_sequential_quantizes_like_the_config_says(per_row: bool):
    model = _sequential()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    config = _config(per_row)
    assert fp8cpu.quantize_module_float8_on_cpu(model, config) == 3
    for name, ref in originals.items():
        w = model.get_submodule(name).weight
        assert isinstance(w, Float8Tensor)
        assert w.qdata.dtype == torch.float8_e4m3fn and w.dtype == torch.bfloat16
        assert w.scale.dtype == torch.float32
        assert tuple(w.scale.shape) == ((ref.shape[0], 1) if per_row else (1, 1))
        assert w.block_size == ([1, ref.shape[1]] if per_row else list(ref.shape))
        assert w.act_quant_kwargs == expected_act_kwargs(config)
        assert w.mm_config == config.mm_config and w.mm_config.use_fast_accum
        assert w.kernel_preference == config.kernel_preference
        report = fp8cpu.check_dequantized(w, ref)
        assert report.ok, report
        # the scale is a bf16 value widened to float32 (torchao divides in bf16)
        assert bool(((w.scale.view(torch.int32) & 0xFFFF) == 0).all())
    out = model(torch.randn(4, 64, dtype=torch.bfloat16))  # torchao even runs it on CPU
    assert out.shape == (4, 16) and torch.isfinite(out).all()


@needs_no_fp8_gpu
def test_context_restores_torchao_and_nests():
    from torchao.quantization import quant_api

    before = quant_api._check_hardware_support
    with fp8cpu.allow_cpu_float8_quantization():
        with fp8cpu.allow_cpu_float8_quantization():
            assert quant_api._check_hardware_support is not before
        assert quant_api._check_hardware_support is not before
    assert quant_api._check_hardware_support is before
    with pytest.raises(AssertionError):
        quantize_(_sequential(), _config())


def test_non_cpu_weights_and_gpu_only_options_are_refused():
    from torchao.quantization.quantize_.common import KernelPreference

    meta = torch.nn.Linear(32, 32, device="meta", dtype=torch.bfloat16)
    with pytest.raises(QuantizeError, match="CPU weights only"):
        fp8cpu.quantize_module_float8_on_cpu(meta, _config())
    with pytest.raises(QuantizeError, match="kernel_preference"):
        fp8cpu.quantize_module_float8_on_cpu(
            _sequential(), Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                                      kernel_preference=KernelPreference.MSLK))


def test_dims_not_multiple_of_16_are_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.Linear(24, 32)).to(torch.bfloat16)
    assert fp8cpu.quantize_module_float8_on_cpu(model, _config()) == 0


def test_zero_row_gives_the_gpu_nan_byte():
    model = _sequential()
    with torch.no_grad():
        model[0].weight[3].zero_()
    fp8cpu.quantize_module_float8_on_cpu(model, _config())
    w = model[0].weight
    assert bool((w.qdata[3].view(torch.uint8) == 0x7F).all())  # x86 gives 0xFF; CUDA's 0/0 is the positive NaN
    assert fp8cpu.check_dequantized(w, torch.zeros(32, 64)).nonfinite == 64


@pytest.mark.parametrize("per_row", [True, False], ids=["PerRow", "PerTensor"])
def test_reference_arithmetic_equals_torchao_bit_for_bit(per_row: bool):
    torch.manual_seed(1)
    weights = [torch.randn(48, 256, dtype=torch.bfloat16) * 0.02,
               torch.randn(32, 64, dtype=torch.bfloat16) * torch.logspace(-6, 3, 64).to(torch.bfloat16),
               torch.zeros(16, 32, dtype=torch.bfloat16)]
    weights[1][5] = 0  # a zero row inside a finite tensor
    for w in weights:
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
        lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        fp8cpu.quantize_module_float8_on_cpu(lin, _config(per_row))
        q, scale = fp8cpu.reference_float8_quantize(w, per_row=per_row)
        assert torch.equal(lin.weight.qdata.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(lin.weight.scale.view(torch.int32), scale.view(torch.int32))


def test_reference_rounding_matches_torch_cast_on_every_bf16_value():
    bits = torch.arange(65536, dtype=torch.int32)
    x = (bits - 65536 * (bits >= 32768)).to(torch.int16).view(torch.bfloat16).float()
    x = x[torch.isfinite(x)].clamp(-448, 448)
    mine = fp8cpu._round_to_e4m3fn(x).view(torch.uint8)
    assert torch.equal(mine, x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_scale_division_is_the_same_as_the_gpu_reciprocal_multiply():
    """CUDA computes bf16 / python scalar as a * float32(1/448); the CPU divides. Both round to the
    same bf16 for every finite bf16 amax, so the scales cannot differ by device."""
    bits = torch.arange(65536, dtype=torch.int32)
    x = (bits - 65536 * (bits >= 32768)).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)].abs()
    cpu = x / 448.0  # the op torchao runs (bf16 tensor / Python float)
    # the reciprocal as float32 division (older torch) and as double then float (newer torch)
    for inv in (torch.tensor(1.0) / torch.tensor(448.0), torch.tensor(1.0 / 448.0, dtype=torch.float64).float()):
        gpu_like = (x.float() * inv).to(torch.bfloat16)  # opmath float32 multiply, RNE to bf16
        assert torch.equal(cpu.view(torch.int16), gpu_like.view(torch.int16))


def test_dequantize_bound_catches_a_wrong_weight():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    ref = model[0].weight.detach().clone()
    fp8cpu.quantize_module_float8_on_cpu(model, _config())
    assert fp8cpu.check_dequantized(model[0].weight, ref).ok
    wrong = ref.clone()
    wrong[0, 0] = wrong[0, 0] * 1.2 + 0.01
    report = fp8cpu.check_dequantized(model[0].weight, wrong)
    assert not report.ok and report.worst_ratio > 1


def test_recipe_support_flags():
    get = recipes.get
    assert fp8cpu.cpu_quantize_supported(get("float8dq")) and fp8cpu.cpu_quantize_supported(get("float8dq-tensor"))
    assert fp8cpu.cpu_quantize_supported(get("int8wo"))
    assert not fp8cpu.cpu_quantize_supported(get("int4wo"))
    assert fp8cpu.needs_cpu_bypass(get("float8dq")) and not fp8cpu.needs_cpu_bypass(get("float8wo"))
    assert recipes.cpu_producible_names() == ("float8dq", "float8dq-tensor")
    for name in recipes.cpu_producible_names():
        config = recipes.build_config(recipes.get(name))
        assert isinstance(config, Float8DynamicActivationFloat8WeightConfig)


@pytest.mark.slow
def test_tiny_flux_saves_reloads_and_carries_the_normal_config(tmp_path):
    from diffusers import FluxTransformer2DModel, TorchAoConfig

    base = flux_transformer(FLUX_TINY_FP8)  # every Linear dim a multiple of 16, none 128x128
    base.save_pretrained(tmp_path / "bf16")
    originals = {n: m.weight.detach().clone() for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    config = recipes.build_config(recipes.get("float8dq"))
    with fp8cpu.cpu_quantization_context(recipes.get("float8dq")):  # diffusers' own quantize-on-load path
        model = FluxTransformer2DModel.from_pretrained(tmp_path / "bf16", quantization_config=TorchAoConfig(config),
                                                       torch_dtype=torch.bfloat16)
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert weights and all(isinstance(w, Float8Tensor) for w in weights.values())
    for name, w in weights.items():
        assert tuple(w.scale.shape) == (w.shape[0], 1) and w.scale.dtype == torch.float32
        assert w.act_quant_kwargs == expected_act_kwargs(config)
        assert fp8cpu.check_dequantized(w, originals[name]).ok, name
    model.save_pretrained(tmp_path / "q")
    assert list((tmp_path / "q").glob("*.safetensors")) and not list((tmp_path / "q").glob("*.bin"))

    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    normal = TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())).to_dict()
    assert saved == json.loads(json.dumps(normal))

    reloaded = FluxTransformer2DModel.from_pretrained(tmp_path / "q", torch_dtype=torch.bfloat16)
    for name, m in reloaded.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert isinstance(m.weight, Float8Tensor)
            assert torch.equal(m.weight.qdata.view(torch.uint8), weights[name].qdata.view(torch.uint8))
            assert torch.equal(m.weight.scale, weights[name].scale)
            assert m.weight.act_quant_kwargs == weights[name].act_quant_kwargs
