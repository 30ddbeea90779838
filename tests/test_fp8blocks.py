"""publisher/streaming/fp8blocks.py: float8 weights quantized a block of rows at a time are torchao's own, bit for bit.

Both paths run here on the same weights: torchao's ``Float8Tensor.from_hp`` / ``quantize_`` as it is, and the same
call inside ``float8_in_row_blocks()``. The block size is made small so that blocks of a few rows (and a last,
shorter block) are exercised without large tensors; the engine-level test (every published byte against the
library path) is in tests/test_streaming_convert.py.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from publisher.streaming import fp8blocks


def _weight(rows: int, cols: int, seed: int = 0, per_row: bool = True) -> Any:
    """A bf16 weight with what the arithmetic has edge cases for: an all-zero row (0/0), values far below the rest of
    their row (fp8 subnormals), negative zeros, and with per-row scales an inf and a large value (a per-tensor scale
    would be inf, or so large that every other value rounds to zero)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w[1] = 0.0
    if per_row:
        w[2, 3] = float("inf")
        w[4, 0] = 3e4
    w[3, :cols // 2] *= 1e-6
    w[5, 1::2] = -0.0
    return w


def _bits(t: Any) -> Any:
    """A tensor's bytes as integers, so NaNs and signed zeros compare by their bits."""
    import torch

    return t.contiguous().view(torch.uint8)


def _assert_same_tensor(ours: Any, theirs: Any) -> None:
    import torch

    assert type(ours) is type(theirs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.device == theirs.device
    for name in ("qdata", "scale"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
        assert torch.equal(_bits(a), _bits(b)), f"{name} differs"
    for name in ("block_size", "mm_config", "act_quant_kwargs", "kernel_preference"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours.block_size) is type(theirs.block_size)  # a list in torchao's metadata JSON either way


def _saved(module: Any) -> tuple[dict[str, Any], bytes]:
    """A module's quantized state dict saved as safetensors (torchao's flattening, as save_pretrained does): the
    parsed header and the tensor bytes (safetensors writes the metadata keys in hash order, so the header's own
    bytes differ between two runs of the same path)."""
    from safetensors.torch import save
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    flat, meta = flatten_tensor_state_dict({f"layer.{k}": v for k, v in module.state_dict().items()})
    raw = save(flat, metadata=meta)
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Blocks of 4 float32 rows of 64 (1 KiB), and a record of the tensors (re)quantized or dequantized in blocks:
    ("q", shape) and ("dq", shape of the untransposed weight)."""
    monkeypatch.setattr(fp8blocks, "ROW_BLOCK_BYTES", 4 * 64 * 4)
    taken: list[Any] = []
    quantize, dequantize = fp8blocks.in_row_blocks, fp8blocks.dequantized_in_row_blocks

    def spy_q(hp_tensor: Any, **kwargs: Any) -> Any:
        made = quantize(hp_tensor, **kwargs)
        if made is not None:
            taken.append(("q", tuple(hp_tensor.shape)))
        return made

    def spy_dq(weight: Any, output_dtype: Any) -> Any:
        made = dequantize(weight, output_dtype)
        if made is not None:
            taken.append(("dq", tuple(weight.qdata.shape if weight.qdata.is_contiguous() else weight.qdata.t().shape)))
        return made

    monkeypatch.setattr(fp8blocks, "in_row_blocks", spy_q)
    monkeypatch.setattr(fp8blocks, "dequantized_in_row_blocks", spy_dq)
    return taken


@pytest.mark.parametrize("shape", [(30, 64), (64, 64), (37, 96), (7, 256)])  # rows a multiple of the block or not
@pytest.mark.parametrize("granularity", ["PerRow", "PerTensor", "PerGroup"])
def test_from_hp_and_dequantize_bit_identical(small_blocks: list[Any], shape: tuple[int, int],
                                              granularity: str) -> None:
    import torch
    from torchao.quantization import PerGroup, PerRow, PerTensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    gran = {"PerRow": PerRow(), "PerTensor": PerTensor(), "PerGroup": PerGroup(32)}[granularity]
    w = _weight(*shape, per_row=granularity != "PerTensor")
    theirs = Float8Tensor.from_hp(w, granularity=gran)
    with fp8blocks.float8_in_row_blocks():
        ours = Float8Tensor.from_hp(w, granularity=gran)
    _assert_same_tensor(ours, theirs)
    assert small_blocks == [("q", shape)]  # every one of these shapes is more than one block
    for t in (ours, ours.t()):  # linear dequantizes the transposed weight
        plain = t.dequantize()
        with fp8blocks.float8_in_row_blocks():
            blocked = t.dequantize()
        assert (blocked.dtype, blocked.shape, blocked.stride()) == (plain.dtype, plain.shape, plain.stride())
        assert torch.equal(_bits(blocked), _bits(plain))
    assert small_blocks == [("q", shape), ("dq", shape), ("dq", shape)]


def test_quantize_bit_identical_and_saved_bytes(small_blocks: list[Any]) -> None:
    """float8wo through quantize_ on a Linear (a Parameter that requires grad, as the loaders make): the same
    Float8Tensor, the same saved safetensors bytes, the same output (its linear dequantizes the weight)."""
    import torch
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    def linear() -> torch.nn.Linear:
        lin = torch.nn.Linear(64, 150, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(_weight(150, 64, seed=1))
        return lin

    a, b = linear(), linear()
    quantize_(a, Float8WeightOnlyConfig())
    with fp8blocks.float8_in_row_blocks():
        quantize_(b, Float8WeightOnlyConfig())
    _assert_same_tensor(b.weight, a.weight)
    assert _saved(b) == _saved(a)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode(), fp8blocks.float8_in_row_blocks():  # as the in-pass forward checks run
        ours = b(x)
    with torch.inference_mode():
        theirs = a(x)
    assert torch.equal(_bits(ours), _bits(theirs))  # the zero row and the inf give NaNs: compared by their bits
    assert small_blocks == [("q", (150, 64)), ("dq", (150, 64))]


@pytest.mark.parametrize("granularity", ["PerRow", "PerTensor"])
def test_float8dq_on_cpu_bit_identical(small_blocks: list[Any], granularity: str) -> None:
    """float8dq made on a CPU (fp8cpu's bypass, its NaN canonicalisation after from_hp) takes the blocks too."""
    import torch
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    from publisher.fp8cpu import quantize_module_float8_on_cpu

    config = Float8DynamicActivationFloat8WeightConfig(granularity={"PerRow": PerRow(), "PerTensor": PerTensor()}[granularity])
    mods = []
    for blocks in (False, True):
        lin = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(_weight(48, 64, seed=2, per_row=granularity != "PerTensor"))
        if blocks:
            with fp8blocks.float8_in_row_blocks():
                assert quantize_module_float8_on_cpu(lin, config) == 1
        else:
            assert quantize_module_float8_on_cpu(lin, config) == 1
        mods.append(lin)
    _assert_same_tensor(mods[1].weight, mods[0].weight)
    assert small_blocks == [("q", (48, 64))]
    assert _saved(mods[1]) == _saved(mods[0])


def test_large_weight_takes_the_blocks_small_one_does_not() -> None:
    """At the real block size: a FLUX.1-dev-sized weight (3072x12288) is quantized and dequantized (as it is and
    transposed, as linear does) in blocks, a 64x64 one by torchao."""
    import torch
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.common import KernelPreference
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    args = (torch.float8_e4m3fn, PerRow(), None, None, None, KernelPreference.AUTO, None)
    large = torch.zeros(3072, 12288, dtype=torch.bfloat16)  # the values do not matter here: the path does
    assert fp8blocks.rows_per_block(12288) < 3072
    quantized = fp8blocks.in_row_blocks(large, *args)
    assert quantized is not None
    assert fp8blocks.dequantized_in_row_blocks(quantized, torch.bfloat16) is not None
    assert fp8blocks.dequantized_in_row_blocks(quantized.t(), torch.bfloat16) is not None
    del quantized
    small = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert fp8blocks.in_row_blocks(small, *args) is None
    assert fp8blocks.dequantized_in_row_blocks(Float8Tensor.from_hp(small), torch.bfloat16) is None
    assert fp8blocks.in_row_blocks(large.t(), *args) is None  # not contiguous: torchao's own
    assert fp8blocks.in_row_blocks(torch.zeros(2, 2048, 2048, dtype=torch.bfloat16), *args) is None  # 3-D


def test_context_restores_torchao_and_is_reentrant() -> None:
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    def methods() -> tuple[Any, Any]:
        return Float8Tensor.__dict__["from_hp"], Float8Tensor.__dict__["dequantize"]

    original = methods()
    with fp8blocks.float8_in_row_blocks():
        patched = methods()
        assert patched[0] is not original[0] and patched[1] is not original[1]
        with fp8blocks.float8_in_row_blocks():
            assert methods() == patched
        assert methods() == patched
    assert methods() == original
