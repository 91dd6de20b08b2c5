"""Underflow telemetry of the emulated GEMMs: per GEMM pass and operand, how much of a sample of
the operand the quantization loses, counted on the device (no host sync).

Measured on the operand exactly as its GEMM quantized it (nvfp4_recipe/linear.py calls `observe`
with the GEMM's own quantized values: the same blocks along the reduction dimension, the same
RHT and stochastic-rounding draws), on a sample of its rows: every `stride`-th row (for 16x16 or
128x128 weight tiles, every `stride`-th tile row), at most `rows` of them. A Wgrad operand's
rows are channels (its blocks run along the tokens), so the sample is of channels. Three
statistics, from six counts a window accumulates over its GEMM calls:

- `flush`: the fraction of the nonzero source values whose quantized value is zero;
- `scale_underflow`: the fraction of blocks with a nonzero value whose ideal scale (the block
  amax over the element format's largest value, times the tensor scale where the format has one)
  is below the scale format's smallest positive value, so the scale is flushed to zero or held at
  that smallest and the block's small values go to zero (NVFP4: E4M3 scales, smallest 2**-9, with
  the tensor scale from the tensor's amax, nvfp4.block_scales; MXFP8 / MXFP4: E8M0, 2**-127);
- `scale_overflow`: the fraction of blocks whose ideal scale is above the scale format's largest
  (or not finite), so the scale saturates and the block's largest values clip. Current scaling
  puts the block that holds the tensor's amax at the largest NVFP4 scale (448) up to the FP32
  rounding of the scale's computation: that is not counted (`OVERFLOW_MARGIN`); in practice this
  counts the blocks of non-finite values.

No megatron import: the controller (training/precision.py) reads the counts of every linear
once per window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nvfp4_recipe.formats import E2M1_MAX, E4M3_MAX, FP32_MAX, FP32_RECIPROCAL_OF_6
from nvfp4_recipe.nvfp4 import BLOCK as NVFP4_BLOCK, tensor_scales
from nvfp4_recipe.operands import GemmOperand, _FormatOps, _FP8BlockOps, _MXFP4Ops, _MXFP8Ops, _NVFP4Ops

STATS = ("flush", "scale_underflow", "scale_overflow")
# The operands of each GEMM pass, as the metric keys name them (y = x W^T, dy its gradient).
OPERANDS = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}
# Relative slack above the largest scale before a block counts as overflowing (see the module
# docstring): far above the few FP32 ulps (2**-23 each) of the scale's rounding, far below any
# real saturation.
OVERFLOW_MARGIN = 2.0 ** -10
# The six counts of one operand, in this order, an int64 vector on the device.
COUNTS = ("flushed", "nonzero", "underflow_blocks", "nonzero_blocks", "overflow_blocks", "blocks")

_E8M0_SMALLEST, _E8M0_LARGEST = 2.0 ** -127, 2.0 ** 127
_FP32_RECIPROCAL_OF_448 = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()


@dataclass(frozen=True)
class ScaleRule:
    """How a format's block scale follows from the block's amax (`ideal(block_amax, tensor
    amax)`, FP32, before any rounding or clamping) and its scale format's range."""

    ideal: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    smallest: float
    largest: float


def _nvfp4_ideal(block_amax, tensor_amax):
    # nvfp4.block_scales: vec_max * (S_enc * fp32(1/6)), S_enc from the tensor amax
    s_enc, _ = tensor_scales(tensor_amax)
    return block_amax * (s_enc * FP32_RECIPROCAL_OF_6)


_SCALE_RULES: dict[type, ScaleRule] = {
    # E4M3 block scales: smallest subnormal 2**-9, largest 448
    _NVFP4Ops: ScaleRule(_nvfp4_ideal, 2.0 ** -9, E4M3_MAX),
    # E8M0 scales of amax * fp32(1/448) (mxfp8.e8m0_scale_from_amax)
    _MXFP8Ops: ScaleRule(lambda a, _t: a * _FP32_RECIPROCAL_OF_448, _E8M0_SMALLEST, _E8M0_LARGEST),
    # E8M0 scales of vec_max / 6 (mxfp4.mx_scale_exponent)
    _MXFP4Ops: ScaleRule(lambda a, _t: a / E2M1_MAX, _E8M0_SMALLEST, _E8M0_LARGEST),
    # FP32 scales 448 / amax, clamped at FLT_MAX (fp8_block.fp8_block_scale): as an inverse
    # scale, amax / 448 with 1 / FLT_MAX the smallest
    _FP8BlockOps: ScaleRule(lambda a, _t: a / E4M3_MAX, 1.0 / FP32_MAX, float("inf")),
}


def scale_rule(ops: _FormatOps) -> ScaleRule:
    for kind, rule in _SCALE_RULES.items():
        if isinstance(ops, kind):
            return rule
    raise ValueError(f"no scale rule for the {ops.name} operands")


def weight_tile_rows(ops: _FormatOps) -> int:
    """The rows of a weight operand's scaling tile (NVFP4 16x16, FP8 128x128; 1: 1-D blocks)."""
    if isinstance(ops, _NVFP4Ops):
        return NVFP4_BLOCK if ops.config.weight_2d else 1
    if isinstance(ops, _FP8BlockOps):
        return ops.block
    return 1


def sample_stride(rows: int, want: int, tile_rows: int = 1) -> int:
    """The step between sampled rows (in tiles of `tile_rows`): at most `want` rows, spread over
    all of them."""
    tiles, want_tiles = -(-rows // tile_rows), max(1, want // tile_rows)
    return max(1, -(-tiles // want_tiles))


def sampled_rows(t: torch.Tensor, want: int, tile_rows: int = 1) -> torch.Tensor:
    """Every stride-th row of 2-D `t` (tile_rows at a time), at most about `want`: a view."""
    rows = t.shape[0]
    stride = sample_stride(rows, want, tile_rows)
    if tile_rows == 1:
        return t[::stride]
    whole = rows - rows % tile_rows
    # unflatten views a transposed weight too; only the sample is copied
    tiles = t[:whole].unflatten(0, (whole // tile_rows, tile_rows))[::stride]
    return tiles.reshape(-1, t.shape[1])


def operand_counts(source: torch.Tensor, values: torch.Tensor, ops: _FormatOps,
                   tensor_amax: torch.Tensor | None, tile_rows: int = 1) -> torch.Tensor:
    """The six COUNTS of rows `source` (as quantized: blocks along the last dim) whose quantized
    values (q * s, any scale factor aside) are `values`, of the same shape. int64 on the device."""
    src = source.detach().float()
    nonzero = src != 0
    flushed = (nonzero & (values == 0)).sum()
    rule = scale_rule(ops)
    block_amax = _block_amax(src, ops.block, tile_rows)
    ideal = rule.ideal(block_amax, tensor_amax)
    has_value = block_amax > 0
    underflow = has_value & (ideal < rule.smallest)
    overflow = ~(ideal <= rule.largest * (1 + OVERFLOW_MARGIN))  # NaN counts as overflowing
    blocks = torch.full((), block_amax.numel(), dtype=torch.int64, device=src.device)
    return torch.stack([flushed, nonzero.sum(), underflow.sum(), has_value.sum(), overflow.sum(),
                        blocks])


def _block_amax(src: torch.Tensor, block: int, tile_rows: int) -> torch.Tensor:
    """max |x| per block of `block` along the last dim (per tile of tile_rows x block), zero
    padding where a dimension is not whole blocks (FP8's partial blocks)."""
    rows, cols = src.shape
    pad_rows, pad_cols = (-rows) % tile_rows, (-cols) % block
    if pad_rows or pad_cols:
        src = torch.nn.functional.pad(src, (0, pad_cols, 0, pad_rows))
        rows, cols = src.shape
    # max_pool1d over each row: several times faster on CPU than amax over a trailing dim of 16
    # or 32 (as nvfp4.py's and mxfp8.py's block amax); the same maxima
    rows_max = torch.nn.functional.max_pool1d(src.abs().view(1, rows, cols), block, block)
    if tile_rows == 1:
        return rows_max.view(rows, cols // block)
    return rows_max.view(rows // tile_rows, tile_rows, cols // block).amax(dim=1)


def ratios(counts: torch.Tensor) -> torch.Tensor:
    """(flush, scale_underflow, scale_overflow) from the COUNTS, FP32 on the device (0 where
    nothing was counted)."""
    c = counts.to(torch.float64)
    return torch.stack([c[0] / c[1].clamp_min(1), c[2] / c[3].clamp_min(1),
                        c[4] / c[5].clamp_min(1)]).float()


class OperandTelemetry:
    """The counts one linear's GEMMs accumulate while the telemetry is on: {"<pass>/<operand>":
    COUNTS}, 0-d work on the device only. `rows`: the sample's size per operand and call."""

    def __init__(self, rows: int):
        self.rows = rows
        self.counts: dict[str, torch.Tensor] = {}

    def observe(self, gemm: str, operand: str, ops: _FormatOps, source: torch.Tensor,
                quantized: GemmOperand, tile_rows: int = 1) -> None:
        """Rows of `source` (as quantized) and the same rows of its GEMM operand."""
        src = sampled_rows(source, self.rows, tile_rows)
        values = sampled_rows(quantized.values, self.rows, tile_rows)
        self._add(f"{gemm}/{operand}", operand_counts(src, values, ops, quantized.amax, tile_rows))

    def observe_wgrad(self, operand: str, ops: _FormatOps, t2d: torch.Tensor,
                      quantized: GemmOperand) -> None:
        """A Wgrad operand: (T, C) `t2d` is quantized as ops.wgrad_source(t2d) (C, T_pad), rows
        = channels; the sampled channels' source is transformed alone (the RHT runs along T,
        channel by channel)."""
        stride = sample_stride(t2d.shape[1], self.rows)
        source = ops.wgrad_source(t2d[:, ::stride])
        values = quantized.values[::stride]
        self._add(f"wgrad/{operand}", operand_counts(source, values, ops, quantized.amax))

    def _add(self, key: str, counts: torch.Tensor) -> None:
        seen = self.counts.get(key)
        self.counts[key] = counts if seen is None else seen + counts

    def take(self) -> dict[str, torch.Tensor]:
        taken, self.counts = self.counts, {}
        return taken
