"""Emulated quantized linear layers (autograd): what TE's NVFP4 / MXFP4 / MXFP8 / FP8-block GEMMs
compute.

For y = x W^T + b with x (T, K) (any leading dims; T = their product), W (N, K):
  Fprop  y  = Q(x, blocks along K) @ Q(W, blocks along K)^T
  Dgrad  dx = Q(dY, blocks along N) @ Q(W, blocks along N)
  Wgrad  dW = Q(dY^T, blocks along T) @ Q(x^T, blocks along T)^T
NVFP4: x 1x16 nearest; W 16x16 tiles (the same quantized W serves Fprop and Dgrad, as in TE);
dY 1x16 stochastic; both Wgrad operands get the 16-point RHT along T and their own amax.
Each copy is quantized from the high-precision tensor. T is zero-padded to a multiple of the
block for the Wgrad operands (zeros add nothing to dW). K and N must be multiples of the block
(16 NVFP4, 32 MXFP4 and MXFP8; FP8 pads its 128-blocks) or a ValueError is raised.

Each GEMM takes the format of its own pass (config.PassConfigs): both operands of Fprop in the
Fprop format, of Dgrad in the Dgrad format, of Wgrad in the Wgrad format, as TE's HybridQuantizer
gives each tensor a rowwise copy for one GEMM and a columnwise copy for the other; a pass
without a format multiplies the BF16 operands. One config for all three is the common case.

GEMMs: operands are the exact q*s values; config.gemm = "fast" runs a bf16 GEMM (FP32 accumulation
inside, output rounded to bf16) and applies the FP32 tensor scales to that output (one extra rounding,
<= 1 bf16 ulp), "exact" runs it in FP32. Bias and all accumulation stay in high precision. Where BF16
GEMMs compute in FP32 (nvfp4_recipe/compute.py: the run's decision, else the machine's, so a
caller needs no mode), "fast" writes its operands in FP32 and rounds the GEMM's output to bf16:
the same numbers up to the FP32 accumulation order, without a BF16 kernel or a conversion pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nvfp4_recipe.compute import emulated_gemms_in_fp32
from nvfp4_recipe.config import NVFP4Config, PassConfigs, QuantConfig
from nvfp4_recipe.operands import GemmOperand, _FormatOps
from nvfp4_recipe.registry import spec_of_config
from nvfp4_recipe.telemetry import OperandTelemetry, weight_tile_rows


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


def _plain_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, in_fp32: bool) -> torch.Tensor:
    """a @ b in `dtype` where a GEMM is not quantized; a BF16 one multiplied in FP32 and rounded
    once where BF16 GEMMs compute in FP32 (ops.bf16_in_fp32), as FP32Gemms would."""
    a, b = a.to(dtype), b.to(dtype)
    if in_fp32 and dtype == torch.bfloat16:
        return torch.mm(a.float(), b.float()).to(dtype)
    return torch.mm(a, b)


def _in_backward() -> bool:
    """Whether this thread is running a backward pass (autograd's graph task): a forward run there
    is a recompute (megatron's CheckpointFunction reruns the forward inside the backward)."""
    return torch._C._current_graph_task_id() != -1


@torch.no_grad()
def fold_input_amax(into: torch.Tensor, x: torch.Tensor, amax: torch.Tensor | None = None) -> None:
    """into <- max(into, max |x|), in place on the device, no host sync; a non-finite max |x|
    counts as 0. `amax`: max |x| as a quantizer already computed it (NVFP4's tensor amax, the
    same value); otherwise one aminmax pass over x (no full-size |x| temporary). A recompute's
    forward (inside a backward) records nothing: the first forward recorded the same input."""
    if _in_backward():
        return
    if amax is None:
        if x.numel() == 0:
            return
        low, high = torch.aminmax(x.detach())
        amax = torch.maximum(high.float(), low.float().neg())  # NaN in either propagates
    seen = torch.nan_to_num(amax.float(), nan=0.0, posinf=0.0, neginf=0.0)
    torch.maximum(into, seen, out=into)


def ops_for(config: QuantConfig, device: torch.device | None = None) -> _FormatOps:
    """The ops of a config's format (ValueError for a type no format registers); `device`: where
    its GEMMs run, which decides their compute dtype (nvfp4_recipe/compute.py)."""
    return spec_of_config(config).ops(config, device)


class WeightOperandCache:
    """A weight's quantized GEMM operands, kept across the micro-batches of one step.

    TE quantizes a weight on a step's first micro-batch and reuses it for the others
    (`is_first_microbatch`); this is the emulation's equivalent. The owner clears it whenever the
    weight may have changed (`clear()`: the start of every step and evaluation). Each copy is kept
    with the config it was quantized under and handed only to a GEMM of that config, so a switch
    of format (a pass turned to BF16, another format) never reuses another format's copy, and a
    pass that keeps its config keeps its copy.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        # (config, operand) of the Fprop weight and of the Dgrad weight, or None
        self.fprop: tuple[QuantConfig, GemmOperand] | None = None
        self.dgrad: tuple[QuantConfig, GemmOperand] | None = None

    def get(self, gemm: str, config: QuantConfig) -> GemmOperand | None:
        entry = getattr(self, gemm)
        return entry[1] if entry is not None and entry[0] == config else None

    def put(self, gemm: str, config: QuantConfig, operand: GemmOperand) -> None:
        setattr(self, gemm, (config, operand))


class PassOps(NamedTuple):
    """The ops of each GEMM of a linear (None: that GEMM on the BF16 operands), one object per
    distinct config: passes that share a config share its ops (Dgrad may then reuse Fprop's weight
    copy). `bf16_in_fp32`: where a BF16 GEMM computes in FP32 (nvfp4_recipe/compute.py)."""

    fprop: _FormatOps | None
    dgrad: _FormatOps | None
    wgrad: _FormatOps | None
    bf16_in_fp32: bool

    @classmethod
    def of(cls, configs: PassConfigs, device: torch.device) -> "PassOps":
        made: dict[QuantConfig, _FormatOps] = {}
        ops = []
        for config in (configs.fprop, configs.dgrad, configs.wgrad):
            if config is not None and config not in made:
                made[config] = ops_for(config, device)
            ops.append(None if config is None else made[config])
        return cls(*ops, emulated_gemms_in_fp32(device))


def _weight_operand(cache: WeightOperandCache | None, gemm: str, ops: _FormatOps, make):
    """The weight's operand for `gemm` from the cache, or made (and cached)."""
    operand = cache.get(gemm, ops.config) if cache is not None else None
    if operand is None:
        operand = make()
        if cache is not None:
            cache.put(gemm, ops.config, operand)
    return operand


class _QuantizedLinear(torch.autograd.Function):
    """y = x W^T + b with each GEMM quantized by its own pass's ops (PassOps); a pass without
    ops multiplies the BF16 operands."""

    @staticmethod
    def forward(ctx, x, weight, bias, ops: PassOps, generator,
                cache: WeightOperandCache | None = None, input_amax: torch.Tensor | None = None,
                telemetry: OperandTelemetry | None = None):
        k = x.shape[-1]
        x2d = x.reshape(-1, k)
        fprop = ops.fprop
        weight_operand = None
        if fprop is not None:
            weight_operand = _weight_operand(cache, "fprop", fprop,
                                             lambda: fprop.weight_fprop(weight))
            activation = fprop.activation(x2d)
            if input_amax is not None:  # the quantizer's tensor amax where it has one
                fold_input_amax(input_amax, x2d, activation.amax)
            if telemetry is not None and not _in_backward():  # a recompute measured it already
                telemetry.observe("fprop", "x", fprop, x2d, activation)
                telemetry.observe("fprop", "w", fprop, weight, weight_operand,
                                  weight_tile_rows(fprop))
            if bias is None:
                y = emulated_gemm(activation, weight_operand, x.dtype, fprop.gemm_out_dtype)
            else:  # bias added in FP32, then one rounding
                y = emulated_gemm(activation, weight_operand, torch.float32, fprop.gemm_out_dtype)
                y = y.add_(bias.float()).to(x.dtype)
        else:
            if input_amax is not None:
                fold_input_amax(input_amax, x2d)
            if ops.bf16_in_fp32 and x.dtype == torch.bfloat16:
                y = F.linear(x2d.float(), weight.float(), None if bias is None else bias.float())
                y = y.to(x.dtype)
            else:
                y = F.linear(x2d, weight, bias)
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Dgrad may start from Fprop's weight copy only under the same config, and only where the
        # format's weight_dgrad reads it (NVFP4's 16x16 tiles and FP8's 128x128 blocks are
        # transpose-symmetric; MX formats quantize W^T afresh): otherwise the copy is not kept.
        reuse_weight = (need_dx and ops.dgrad is fprop and weight_operand is not None
                        and fprop.dgrad_reuses_fprop_weight)
        ctx.ops, ctx.generator, ctx.cache, ctx.telemetry = ops, generator, cache, telemetry
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        saved_values = weight_operand.values if reuse_weight else None
        saved_scale = weight_operand.decode_scale if reuse_weight else None
        saved_amax = weight_operand.amax if reuse_weight else None  # the telemetry's tensor scale
        ctx.save_for_backward(x2d if need_dw else None, weight, saved_values, saved_scale,
                              saved_amax)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, saved_values, saved_scale, saved_amax = ctx.saved_tensors
        ops: PassOps = ctx.ops
        dy2d = dy.reshape(-1, weight.shape[0])
        dx = dw = db = None
        # Dgrad first, then Wgrad: a fixed order of stochastic-rounding draws.
        if ctx.needs_input_grad[0]:
            dgrad = ops.dgrad
            if dgrad is None:
                dx = _plain_mm(dy2d, weight, dy2d.dtype, ops.bf16_in_fp32)
            else:
                fprop = (GemmOperand(saved_values, saved_scale, saved_amax)
                         if saved_values is not None else None)
                grad_operand = dgrad.grad_dgrad(dy2d, ctx.generator)
                weight_operand = _weight_operand(ctx.cache, "dgrad", dgrad,
                                                 lambda: dgrad.weight_dgrad(weight, fprop))
                dx = emulated_gemm(grad_operand, weight_operand, ctx.x_dtype, dgrad.gemm_out_dtype)
                if ctx.telemetry is not None:
                    ctx.telemetry.observe("dgrad", "dy", dgrad, dy2d, grad_operand)
                    ctx.telemetry.observe("dgrad", "w", dgrad, weight.t(), weight_operand,
                                          weight_tile_rows(dgrad))
        if ctx.needs_input_grad[1]:
            wgrad = ops.wgrad
            if wgrad is None:
                dw = _plain_mm(dy2d.t(), x2d, dy2d.dtype, ops.bf16_in_fp32)
            else:
                dw_operands = wgrad.grad_wgrad(dy2d, ctx.generator), wgrad.activation_wgrad(x2d)
                dw = emulated_gemm(*dw_operands, weight.dtype, wgrad.gemm_out_dtype)
                if ctx.telemetry is not None:
                    ctx.telemetry.observe_wgrad("dy", wgrad, dy2d, dw_operands[0])
                    ctx.telemetry.observe_wgrad("x", wgrad, x2d, dw_operands[1])
        if dx is not None:
            dx = dx.to(ctx.x_dtype).view(ctx.x_shape)
        if dw is not None:
            dw = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        return dx, dw, db, None, None, None, None, None


def pass_configs(config: QuantConfig | PassConfigs | None) -> PassConfigs:
    """A PassConfigs from what `quantized_linear` takes: one config (or None) for every GEMM, or
    a PassConfigs as it is; a config of a type no format registers is a ValueError."""
    configs = config if isinstance(config, PassConfigs) else PassConfigs.every(config)
    for c in (configs.fprop, configs.dgrad, configs.wgrad):
        if c is not None:
            spec_of_config(c)
    return configs


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: QuantConfig | PassConfigs | None = None,
    generator: torch.Generator | None = None,
    weight_cache: WeightOperandCache | None = None,
    input_amax: torch.Tensor | None = None,
    telemetry: OperandTelemetry | None = None,
) -> torch.Tensor:
    """One entry point for all formats. `config`: the format of every GEMM (NVFP4Config,
    MXFP4Config, MXFP8Config, FP8BlockConfig), or a PassConfigs with one per GEMM (Fprop, Dgrad,
    Wgrad; None = that GEMM on the BF16 operands); None, or a PassConfigs of three None, is
    exactly F.linear. `generator` drives stochastic rounding (None: torch's global RNG).
    `weight_cache` reuses the weight's quantized operands (the caller clears it when the weight
    changes). `input_amax`, a 0-d FP32 tensor, takes max |x| in place (fold_input_amax; the
    Fprop quantizer's amax where it has one, so no extra pass over x). `telemetry` counts, on a
    sample of each quantized operand, what its quantization flushed (nvfp4_recipe/telemetry.py);
    it draws no random numbers, so the GEMMs compute the same with it on or off."""
    configs = pass_configs(config)
    if not configs.quantized:
        if input_amax is not None:
            fold_input_amax(input_amax, x)
        return F.linear(x, weight, bias)
    ops = PassOps.of(configs, x.device)
    for pass_ops in dict.fromkeys(o for o in ops[:3] if o is not None):
        pass_ops.check_shapes(x, weight)
    return _QuantizedLinear.apply(x, weight, bias, ops, generator, weight_cache, input_amax,
                                  telemetry)


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
