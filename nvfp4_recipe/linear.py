"""Emulated quantized linear layers (autograd): what TE's NVFP4 / MXFP4 / FP8-block GEMMs compute.

For y = x W^T + b with x (T, K) (any leading dims; T = their product), W (N, K):
  Fprop  y  = Q(x, blocks along K) @ Q(W, blocks along K)^T
  Dgrad  dx = Q(dY, blocks along N) @ Q(W, blocks along N)
  Wgrad  dW = Q(dY^T, blocks along T) @ Q(x^T, blocks along T)^T
NVFP4: x 1x16 nearest; W 16x16 tiles (the same quantized W serves Fprop and Dgrad, as in TE);
dY 1x16 stochastic; both Wgrad operands get the 16-point RHT along T and their own amax.
Each copy is quantized from the high-precision tensor. T is zero-padded to a multiple of the
block for the Wgrad operands (zeros add nothing to dW). K and N must be multiples of the block
(16 NVFP4, 32 MXFP4, 128 FP8) or a ValueError is raised.

GEMMs: operands are the exact q*s values; config.gemm = "fast" runs a bf16 GEMM (FP32 accumulation
inside, output rounded to bf16) and applies the FP32 tensor scales to that output (one extra rounding,
<= 1 bf16 ulp), "exact" runs it in FP32. Bias and all accumulation stay in high precision. Where BF16
GEMMs compute in FP32 (nvfp4_recipe/compute.py), "fast" writes its operands in FP32 and rounds the
GEMM's output to bf16: the same numbers, without a BF16 kernel or a conversion pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nvfp4_recipe.compute import fp32_gemms_active
from nvfp4_recipe.config import FP8BlockConfig, MXFP4Config, NVFP4Config, QuantConfig
from nvfp4_recipe.fp8_block import FP8_BLOCK, fp8_block_dequantized_values, quantize_fp8_block
from nvfp4_recipe.hadamard import rht_matrix
from nvfp4_recipe.mxfp4 import MX_BLOCK, mxfp4_dequantized_values, quantize_mxfp4
from nvfp4_recipe.nvfp4 import BLOCK, nvfp4_scaled_values, quantize_nvfp4
from nvfp4_recipe.parts import part


# Labels of the emulated GEMM's parts (nvfp4_recipe/parts.py: the innermost label owns the time).
QUANTIZE = "emulation/quantize"
GEMM = "emulation/gemm"
WGRAD_TRANSPOSE = "emulation/wgrad_transpose_rht"
SR_DRAWS = "emulation/sr_draws"


class GemmOperand(NamedTuple):
    """values: (rows, reduction) q*s in the GEMM dtype; decode_scale: FP32 0-d tensor scale or None."""

    values: torch.Tensor
    decode_scale: torch.Tensor | None

    def t(self) -> "GemmOperand":
        return GemmOperand(self.values.t(), self.decode_scale)


def emulated_gemm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype,
                  gemm_out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a.values @ b.values^T (both (rows, reduction)) times both FP32 decode scales, in `out_dtype`.

    The GEMM's output (bf16 for "fast", FP32 for "exact"; `gemm_out_dtype` rounds an FP32 GEMM's
    output to bf16 as a BF16 GEMM would, for "fast" under FP32Gemms) times the FP32 scale product is rounded
    once to FP32 and then to out_dtype. On CPU a bf16 output multiplied in place by the 0-d FP32
    scale computes in FP32 and rounds once (tests/nvfp4_recipe/test_nvfp4_linear.py checks it), saving two
    casts; CUDA kernels would round that scale to bf16 first, so there the output is cast up.
    """
    out = torch.mm(a.values, b.values.t())
    if gemm_out_dtype is not None and out.dtype != gemm_out_dtype:
        out = out.to(gemm_out_dtype)
    if out.dtype != torch.float32 and (out.dtype != out_dtype or not out.is_cpu):
        out = out.float()
    if a.decode_scale is not None and b.decode_scale is not None:
        out.mul_(a.decode_scale * b.decode_scale)
    return out.to(out_dtype)


class _FormatOps:
    """How one format quantizes each GEMM operand (registry.py names each format's subclass)."""

    block: int
    name: str
    # K and N must be whole blocks (FP4 GEMMs); FP8 zero-pads a partial 128-block instead.
    whole_blocks_only = True

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        # The GEMM's output dtype, and its operands' (FP32 where BF16 GEMMs compute in FP32).
        self.gemm_out_dtype = torch.bfloat16 if config.gemm == "fast" else torch.float32
        self.gemm_dtype = torch.float32 if fp32_gemms_active() else self.gemm_out_dtype

    def check_shapes(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"{self.name} linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                f"match; need x (..., K) and weight (N, K)"
            )
        n, k = weight.shape
        for dim_name, size in (("K (in_features)", k), ("N (out_features)", n)):
            if self.whole_blocks_only and size % self.block:
                raise ValueError(
                    f"{self.name} linear: {dim_name} = {size} is not a multiple of the {self.block}-"
                    f"element block; pad the layer to {-(-size // self.block) * self.block} or keep it "
                    f"in high precision"
                )

    def wgrad_source(self, t2d: torch.Tensor) -> torch.Tensor:
        """(T, C) -> FP32 (C, T_pad): what the Wgrad operand is quantized from, blocks along T."""
        return transpose_padded(t2d, self.block)

    def activation(self, x2d: torch.Tensor) -> GemmOperand: ...
    def weight_fprop(self, weight: torch.Tensor) -> GemmOperand: ...
    def weight_dgrad(self, weight: torch.Tensor, fprop: GemmOperand | None) -> GemmOperand: ...
    def grad_dgrad(self, dy2d: torch.Tensor, generator: torch.Generator | None) -> GemmOperand: ...
    # The Wgrad operands take the (T, C) tensors; blocks run along T (see wgrad_source).
    def grad_wgrad(self, dy2d: torch.Tensor, generator: torch.Generator | None) -> GemmOperand: ...
    def activation_wgrad(self, x2d: torch.Tensor) -> GemmOperand: ...
    # Q(x) in float32 as the rowwise (Fprop / Dgrad) operand of `role` sees it (diagnostics.py).
    def quantize_dequantize(self, x: torch.Tensor, role: str,
                            generator: torch.Generator) -> torch.Tensor: ...


class _NVFP4Ops(_FormatOps):
    block = BLOCK
    name = "NVFP4"
    config: NVFP4Config

    def _q(self, t: torch.Tensor, tile_rows: int = 1, stochastic: bool = False,
           generator: torch.Generator | None = None) -> GemmOperand:
        return GemmOperand(*nvfp4_scaled_values(
            t, tile_rows, stochastic, generator, self.gemm_dtype, self.config.kernels))

    def activation(self, x2d):
        return self._q(x2d)

    def weight_fprop(self, weight):
        return self._q(weight, BLOCK if self.config.weight_2d else 1)

    def weight_dgrad(self, weight, fprop):
        if self.config.weight_2d:  # 16x16 tiles are transpose-symmetric: reuse Fprop's copy
            return (fprop if fprop is not None else self.weight_fprop(weight)).t()
        return self._q(weight.t().contiguous())  # 1x16 blocks along N

    def grad_dgrad(self, dy2d, generator):
        return self._q(dy2d, 1, self.config.stochastic_rounding, generator)

    def wgrad_source(self, t2d):
        hadamard = rht_matrix(device=t2d.device) if self.config.rht else None
        return transpose_padded(t2d, self.block, hadamard)

    def grad_wgrad(self, dy2d, generator):
        return self._q(self.wgrad_source(dy2d), 1, self.config.stochastic_rounding, generator)

    def activation_wgrad(self, x2d):
        return self._q(self.wgrad_source(x2d))

    def quantize_dequantize(self, x, role, generator):
        tile = (BLOCK, BLOCK) if role == "weight" and self.config.weight_2d else (1, BLOCK)
        stochastic = role == "gradient" and self.config.stochastic_rounding
        q = quantize_nvfp4(x, tile, "stochastic" if stochastic else "nearest", generator)
        return q.dequantize()


class _MXFP4Ops(_FormatOps):
    block = MX_BLOCK
    name = "MXFP4"
    config: MXFP4Config

    def _q(self, t, stochastic=False, generator=None):
        return GemmOperand(mxfp4_dequantized_values(t, stochastic, generator, self.gemm_dtype), None)

    def activation(self, x2d):
        return self._q(x2d)

    def weight_fprop(self, weight):
        return self._q(weight)

    def weight_dgrad(self, weight, fprop):
        return self._q(weight.t().contiguous())

    def grad_dgrad(self, dy2d, generator):
        return self._q(dy2d, self.config.stochastic_rounding, generator)

    def grad_wgrad(self, dy2d, generator):
        return self._q(self.wgrad_source(dy2d), self.config.stochastic_rounding, generator)

    def activation_wgrad(self, x2d):
        return self._q(self.wgrad_source(x2d))

    def quantize_dequantize(self, x, role, generator):
        stochastic = role == "gradient" and self.config.stochastic_rounding
        return quantize_mxfp4(x, "stochastic" if stochastic else "nearest", generator).dequantize()


class _FP8BlockOps(_FormatOps):
    block = FP8_BLOCK
    name = "FP8 block"
    whole_blocks_only = False
    config: FP8BlockConfig

    def __init__(self, config: FP8BlockConfig) -> None:
        super().__init__(config)
        if not config.power_2_scales:  # q * (1/scale) is exact in bf16 only for power-of-two scales
            self.gemm_dtype = self.gemm_out_dtype = torch.float32

    def _q(self, t, block=(1, FP8_BLOCK)):
        values = fp8_block_dequantized_values(t, block, self.config.power_2_scales, self.gemm_dtype)
        return GemmOperand(values, None)

    def activation(self, x2d):
        return self._q(x2d)

    def weight_fprop(self, weight):
        return self._q(weight, (FP8_BLOCK, FP8_BLOCK))

    def weight_dgrad(self, weight, fprop):
        return (fprop if fprop is not None else self.weight_fprop(weight)).t()

    def grad_dgrad(self, dy2d, generator):
        return self._q(dy2d)

    def grad_wgrad(self, dy2d, generator):
        return self._q(self.wgrad_source(dy2d))

    def activation_wgrad(self, x2d):
        return self._q(self.wgrad_source(x2d))

    def quantize_dequantize(self, x, role, generator):
        block = (FP8_BLOCK, FP8_BLOCK) if role == "weight" else (1, FP8_BLOCK)
        return quantize_fp8_block(x, block, self.config.power_2_scales).dequantize()


def ops_for(config: QuantConfig) -> _FormatOps:
    """The ops of a config's format (ValueError for a type no format registers)."""
    # Imported here: the registry imports this module's ops classes.
    from nvfp4_recipe.registry import spec_of_config

    return spec_of_config(config).ops(config)


# Rows of the source per block in transpose_padded: 2-5x faster than one strided copy on CPU (each
# block's transposed writes stay in cache; measured 2048^2 bf16: 3 ms vs 15 ms). A multiple of 16.
TRANSPOSE_BLOCK_ROWS = 128


def transpose_padded(t2d: torch.Tensor, multiple: int, hadamard: torch.Tensor | None = None) -> torch.Tensor:
    """(T, C) -> FP32 (C, T_pad), T zero-padded to a multiple of `multiple`: a Wgrad operand.

    With `hadamard` (the 16x16 RHT matrix H) each run of 16 along T is multiplied by H while its
    block is in cache: the result equals random_hadamard_transform(transpose_padded(t2d, multiple))
    bit for bit (the same FP32 GEMM per 16-run; tests/nvfp4_recipe/test_nvfp4_linear.py checks it).
    """
    with part(WGRAD_TRANSPOSE):
        return _transpose_padded(t2d, multiple, hadamard)


def _transpose_padded(t2d, multiple, hadamard):
    tokens, cols = t2d.shape
    padded = -(-tokens // multiple) * multiple
    out = torch.empty(cols, padded, dtype=torch.float32, device=t2d.device)
    # One strided copy is fast on GPUs; there blocks would only add kernel launches. Blocks are a
    # multiple of `multiple` (so only the last one holds padding) and of 16 (the RHT's runs).
    block = max(padded, 1) if t2d.is_cuda else -(-TRANSPOSE_BLOCK_ROWS // multiple) * multiple
    scratch = None
    for start in range(0, padded, block):
        stop = min(start + block, tokens)
        width = min(block, padded - start)
        piece = out[:, start:start + width]
        if hadamard is not None:
            if scratch is None:
                scratch = torch.empty(cols * min(block, padded), dtype=torch.float32, device=t2d.device)
            target = scratch[: cols * width].view(cols, width)
        else:
            target = piece
        target[:, : stop - start].copy_(t2d[start:stop].t())
        target[:, stop - start:].zero_()
        if hadamard is not None:
            rows16 = target.view(-1, hadamard.shape[0])
            piece.copy_(torch.mm(rows16, hadamard).view(cols, width))
    return out


class WeightOperandCache:
    """A weight's quantized GEMM operands, kept across the micro-batches of one step.

    TE quantizes a weight on a step's first micro-batch and reuses it for the others
    (`is_first_microbatch`); this is the emulation's equivalent. The owner clears it whenever the
    weight may have changed (`clear()`: the start of every step and evaluation); operands are
    kept per config, so a switch of format never reuses another format's copy.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.config = None
        self.fprop: GemmOperand | None = None
        self.dgrad: GemmOperand | None = None

    def for_config(self, config) -> "WeightOperandCache":
        if config is not self.config:
            self.clear()
            self.config = config
        return self


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ops: _FormatOps, generator,
                cache: WeightOperandCache | None = None):
        config = ops.config
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        weight_operand = None
        if config.quantize_forward:
            weight_operand = cache.fprop if cache is not None else None
            # The labels time each part in benchmarks/step_profile.py (nvfp4_recipe/parts.py).
            with part(QUANTIZE):
                if weight_operand is None:
                    weight_operand = ops.weight_fprop(weight)
                    if cache is not None:
                        cache.fprop = weight_operand
                activation = ops.activation(x2d)
            with part(GEMM):
                if bias is None:
                    y = emulated_gemm(activation, weight_operand, x.dtype, ops.gemm_out_dtype)
                else:  # bias added in FP32, then one rounding
                    y = emulated_gemm(activation, weight_operand, torch.float32, ops.gemm_out_dtype)
                    y = y.add_(bias.float()).to(x.dtype)
        else:
            y = F.linear(x2d, weight, bias)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        reuse_weight = need_dx and config.quantize_backward and weight_operand is not None
        ctx.ops, ctx.generator, ctx.cache = ops, generator, cache
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        saved_values = weight_operand.values if reuse_weight else None
        saved_scale = weight_operand.decode_scale if reuse_weight else None
        ctx.save_for_backward(x2d if need_dw else None, weight, saved_values, saved_scale)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, saved_values, saved_scale = ctx.saved_tensors
        ops: _FormatOps = ctx.ops
        dy2d = dy.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if not ops.config.quantize_backward:
            if ctx.needs_input_grad[0]:
                dx = dy2d.mm(weight.to(dy2d.dtype))
            if ctx.needs_input_grad[1]:
                dw = dy2d.t().mm(x2d.to(dy2d.dtype))
        else:
            if ctx.needs_input_grad[0]:  # Dgrad first, then Wgrad: a fixed order of SR draws
                fprop = GemmOperand(saved_values, saved_scale) if saved_values is not None else None
                cache = ctx.cache
                weight_operand = cache.dgrad if cache is not None else None
                with part(QUANTIZE):
                    dgrad_operand = ops.grad_dgrad(dy2d, ctx.generator)
                    if weight_operand is None:
                        weight_operand = ops.weight_dgrad(weight, fprop)
                        if cache is not None:
                            cache.dgrad = weight_operand
                with part(GEMM):
                    dx = emulated_gemm(dgrad_operand, weight_operand, ctx.x_dtype, ops.gemm_out_dtype)
            if ctx.needs_input_grad[1]:
                with part(QUANTIZE):
                    dw_operands = ops.grad_wgrad(dy2d, ctx.generator), ops.activation_wgrad(x2d)
                with part(GEMM):
                    dw = emulated_gemm(*dw_operands, weight.dtype, ops.gemm_out_dtype)
        if dx is not None:
            dx = dx.to(ctx.x_dtype).view(ctx.x_shape)
        if dw is not None:
            dw = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        return dx, dw, db, None, None, None


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: QuantConfig | None = None,
    generator: torch.Generator | None = None,
    weight_cache: WeightOperandCache | None = None,
) -> torch.Tensor:
    """One entry point for all formats: dispatches on the config type (NVFP4Config, MXFP4Config,
    FP8BlockConfig); None, or both quantize_forward and quantize_backward off, is exactly F.linear.
    `generator` drives stochastic rounding (None: torch's global RNG). `weight_cache` reuses the
    weight's quantized operands (the caller clears it when the weight changes)."""
    if config is None or not (config.quantize_forward or config.quantize_backward):
        if config is not None:
            ops_for(config)  # still reject unknown config types
        return F.linear(x, weight, bias)
    ops = ops_for(config)
    ops.check_shapes(x, weight)
    cache = weight_cache.for_config(config) if weight_cache is not None else None
    return _QuantizedLinear.apply(x, weight, bias, ops, generator, cache)


def nvfp4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: NVFP4Config = NVFP4Config(),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Emulated NVFP4 linear (TE's NVFP4BlockScaling GEMMs); see the module docstring."""
    if not isinstance(config, NVFP4Config):
        raise ValueError(
            f"nvfp4_linear needs an NVFP4Config, got {type(config).__name__}; use quantized_linear "
            f"for other formats"
        )
    return quantized_linear(x, weight, bias, config, generator)
