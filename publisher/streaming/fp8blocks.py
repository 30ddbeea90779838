"""Float8 weights quantized and dequantized a block of rows at a time: torchao's bytes, bit for bit, in a fraction
of its memory.

torchao 0.18 works on a whole weight in float32 on the CPU. Quantizing (``Float8Tensor.from_hp``:
``_choose_scale_float8`` then ``_quantize_affine_float8``) holds, for a bf16 weight of N bytes, its float32 copy,
the quotient and the clamped quotient at once (3 x 2N) plus the fp8 result: 0.46 GiB for one of FLUX.1-dev's
3072x12288 weights (75 MB; measured in isolation). Dequantizing (``Float8Tensor.dequantize``, what float8wo's
linear computes with, in the in-pass forward checks) holds the float32 copy and the product (2 x 2N) before the bf16
result: about 0.3 GiB. Those calls took every streaming pass with float8wo over the 1.2 GiB budget
(docs/benchmarks.md). Inside ``float8_in_row_blocks()`` a large 2-D CPU weight is done one block of rows
(``ROW_BLOCK_BYTES`` of float32) after the other: each block's scale by torchao's own ``_choose_scale_float8``,
then the element-wise steps of ``_quantize_affine_float8`` (widen, divide, clamp, cast) or
``_dequantize_affine_float8`` (widen, multiply, cast), each in place in one float32 buffer, into a preallocated
result. The quantized ``Float8Tensor`` is built with torchao's constructor and the arguments ``from_hp`` passes it.

Why the bytes are torchao's:

* PerRow and PerGroup (block_size ``[1, k]``; float8wo and float8dq use PerRow) reduce within a row: a block of
  rows gets exactly its rows' scales. The amax is a max (exact in any order).
* PerTensor: the scale is torchao's own call on the whole tensor (its only temporary is the bf16 ``|w|``, 1x the
  weight), then the rows are quantized in blocks with that one scale.
* Every other step is element-wise and correctly rounded, and runs the kernel torchao's runs: ``.to(dtype)`` is a
  ``copy_`` into a new tensor (fp32 -> e4m3 and -> bf16 round to nearest even, the widenings are exact); ``a / b``
  and ``a.div_(b)``, ``a * b`` and ``a.mul_(b)``, ``clamp`` and ``clamp_`` are one operation each; so an element
  gets the same bits whichever block it is in.
* A dequantized transposed weight (``linear`` dequantizes ``weight.t()``) is made in the untransposed layout and
  handed back transposed: the strides torchao's result has, so the matmul that follows takes the same path.
* No autograd: torchao's quantized tensor, made from the loaders' ``Parameter`` (``requires_grad``), keeps a graph
  back to its float32 copy in ``qdata.grad_fn``; ours has none. Nothing saved, hashed or computed depends on it.

Everything else goes to torchao unchanged: small weights (one block or less), other devices, other ranks or
layouts, other granularities (PerBlock's 128x128), tensor subclasses inside, and the mslk kernel choice (read
through the module, so fp8cpu's patch that reports mslk unavailable holds here too). tests/test_fp8blocks.py and
tests/test_streaming_convert.py compare both paths' tensors, outputs and published bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from publisher.runtime.patches import Patches

if TYPE_CHECKING:  # pragma: no cover
    import torch

# float32 bytes of one block, the one buffer the steps run in (4 MiB: 85 rows of 12288; measured faster than
# torchao's whole-tensor call, which allocates each step's result; a freshly mapped block per step was slower)
ROW_BLOCK_BYTES = 4 << 20

# Float8Tensor.from_hp's and .dequantize's parameters in torchao 0.18; others may mean other arithmetic behind them
_FROM_HP_PARAMS = ("cls", "hp_tensor", "float8_dtype", "granularity", "mm_config", "hp_value_lb", "hp_value_ub",
                   "kernel_preference", "act_quant_kwargs")
_DEQUANTIZE_PARAMS = ("self", "output_dtype")

_PATCHES = Patches()  # Float8Tensor's two methods, replaced while float8_in_row_blocks() is held


def rows_per_block(cols: int) -> int:
    """Rows of ``cols`` elements whose float32 copy fills one block (at least one row)."""
    return max(1, ROW_BLOCK_BYTES // (4 * max(cols, 1)))


def _float8_tensor_module() -> Any | None:
    """torchao's float8_tensor module when it is the 0.18 code this module restates, else None (torchao's path)."""
    try:
        import torchao
        from torchao.quantization import quant_primitives
        from torchao.quantization.quantize_.workflows.float8 import float8_tensor
    except ImportError:  # pragma: no cover - pinned torchao has them
        return None
    if not torchao.__version__.startswith("0.18."):
        return None  # pragma: no cover - the steps restated here are 0.18's
    needed = (quant_primitives, ("_choose_scale_float8", "_maybe_expand_scale_to_tensor_shape")), \
        (float8_tensor, ("Float8Tensor", "_is_mslk_available", "get_block_size"))
    if not all(hasattr(module, n) for module, names in needed for n in names):
        return None  # pragma: no cover
    cls = float8_tensor.Float8Tensor
    from_hp, dequantize = cls.__dict__.get("from_hp"), cls.__dict__.get("dequantize")
    if not isinstance(from_hp, classmethod) or not callable(dequantize):
        return None  # pragma: no cover
    if (tuple(inspect.signature(from_hp.__func__).parameters) != _FROM_HP_PARAMS
            or tuple(inspect.signature(dequantize).parameters) != _DEQUANTIZE_PARAMS):
        return None  # pragma: no cover
    return float8_tensor


def _widened(t: torch.Tensor, step: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each block of ``step`` rows of the 2-D ``t``: its first row, the block, and the block widened to float32 in one
    buffer reused for every block (no allocation per block; the buffer is the caller's to work in until the next)."""
    import torch

    work = torch.empty(step * t.shape[1], dtype=torch.float32)
    for start in range(0, t.shape[0], step):
        block = t[start:start + step]
        x = work[:block.numel()].view(block.shape)
        x.copy_(block)
        yield start, block, x


def _plain_cpu_2d(t: Any) -> bool:
    import torch

    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dim() == 2


def in_row_blocks(hp_tensor: torch.Tensor, float8_dtype: torch.dtype, granularity: Any, mm_config: Any,
                  hp_value_lb: float | None, hp_value_ub: float | None, kernel_preference: Any,
                  act_quant_kwargs: Any) -> Any | None:
    """``Float8Tensor.from_hp`` with the same arguments, a block of rows at a time; None when this weight is left to
    torchao (small, or a case the module docstring lists)."""
    import torch
    from torchao.quantization.quant_primitives import _choose_scale_float8, _maybe_expand_scale_to_tensor_shape
    from torchao.quantization.quantize_.common import KernelPreference
    from torchao.quantization.quantize_.workflows.float8 import float8_tensor

    if not _plain_cpu_2d(hp_tensor) or not hp_tensor.is_contiguous():
        return None
    # from_hp's kernel choice: the torch path unless mslk may take it (AUTO with mslk present, or MSLK named)
    if not (kernel_preference == KernelPreference.TORCH
            or (kernel_preference == KernelPreference.AUTO and not float8_tensor._is_mslk_available())):
        return None
    rows, cols = hp_tensor.shape
    step = rows_per_block(cols)
    if rows <= step:
        return None  # one block: torchao's own call costs no more
    block_size = list(float8_tensor.get_block_size(hp_tensor.shape, granularity))
    per_tensor = block_size == [rows, cols]
    if block_size[0] != 1 and not per_tensor:
        return None
    w = hp_tensor.detach()
    max_value = torch.finfo(float8_dtype).max
    with torch.no_grad():
        scale = (_choose_scale_float8(w, float8_dtype=float8_dtype, block_size=block_size, hp_value_lb=hp_value_lb,
                                      hp_value_ub=hp_value_ub)
                 if per_tensor else torch.empty((rows, cols // block_size[1]), dtype=torch.float32))
        qdata = torch.empty((rows, cols), dtype=float8_dtype)
        for start, block, x in _widened(w, step):
            if per_tensor:
                block_scale = scale
            else:
                block_scale = _choose_scale_float8(block, float8_dtype=float8_dtype, block_size=block_size,
                                                   hp_value_lb=hp_value_lb, hp_value_ub=hp_value_ub)
                scale[start:start + step] = block_scale
            # _quantize_affine_float8's steps after the widening, in the buffer: divide, clamp, then the cast (.to is
            # copy_)
            x.div_(_maybe_expand_scale_to_tensor_shape(block_scale, block.shape))
            x.clamp_(min=-max_value, max=max_value)
            qdata[start:start + step].copy_(x)
    return float8_tensor.Float8Tensor(qdata, scale, block_size=block_size, mm_config=mm_config,
                                      act_quant_kwargs=act_quant_kwargs, kernel_preference=kernel_preference,
                                      dtype=hp_tensor.dtype)


def dequantized_in_row_blocks(weight: Any, output_dtype: torch.dtype) -> torch.Tensor | None:
    """``Float8Tensor.dequantize(output_dtype)`` a block of rows at a time, with the strides torchao's result has;
    None when this tensor is left to torchao."""
    import torch
    from torchao.quantization.quant_primitives import _maybe_expand_scale_to_tensor_shape

    qdata, scale = weight.qdata, weight.scale
    if not _plain_cpu_2d(qdata) or not _plain_cpu_2d(scale):
        return None
    # torchao's result keeps qdata's layout (the casts preserve strides, the product follows its larger input)
    transposed = not qdata.is_contiguous() and qdata.t().is_contiguous()
    if transposed:
        qdata, scale = qdata.t(), scale.t()
    elif not qdata.is_contiguous():
        return None
    rows, cols = qdata.shape
    step = rows_per_block(cols)
    if rows <= step or scale.shape[0] not in (1, rows) or cols % scale.shape[1]:
        return None  # one block, or scales that are not per row, per group of a row, or per tensor
    with torch.no_grad():
        out = torch.empty((rows, cols), dtype=output_dtype)
        for start, block, x in _widened(qdata, step):
            block_scale = scale if scale.shape[0] == 1 else scale[start:start + step]
            # _dequantize_affine_float8's steps after the widening, in the buffer: multiply, then the cast (.to is copy_)
            x.mul_(_maybe_expand_scale_to_tensor_shape(block_scale, block.shape))
            out[start:start + step].copy_(x)
    return out.t() if transposed else out


@contextmanager
def float8_in_row_blocks() -> Iterator[None]:
    """While open, ``Float8Tensor.from_hp`` (float8wo's and float8dq's weight quantization, and float8dq's activations)
    and ``Float8Tensor.dequantize`` (float8wo's linear) work on large CPU weights a block of rows at a time;
    everything else goes to torchao's own. Re-entrant; the patches are process-wide while open, as fp8cpu's (they
    change memory, not bytes). A no-op on a torchao whose methods this module does not restate."""
    module = _float8_tensor_module()
    if module is None:  # pragma: no cover - pinned torchao is 0.18
        yield
        return
    cls = module.Float8Tensor

    def install() -> dict[tuple[object, str], object]:
        from_hp_original, dequantize_original = cls.__dict__["from_hp"].__func__, cls.__dict__["dequantize"]
        signature = inspect.signature(from_hp_original)

        def from_hp(klass: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(klass, *args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            del given["cls"]
            made = in_row_blocks(**given) if klass is cls else None
            return made if made is not None else from_hp_original(klass, *args, **kwargs)

        def dequantize(self: Any, output_dtype: torch.dtype | None = None) -> Any:
            made = dequantized_in_row_blocks(self, output_dtype or self.dtype) if type(self) is cls else None
            return made if made is not None else dequantize_original(self, output_dtype)

        return {(cls, "from_hp"): classmethod(from_hp), (cls, "dequantize"): dequantize}

    with _PATCHES.held(install):
        yield
