"""FP8 E4M3 with block scaling (comparison format), as TE's Float8BlockScaling recipe:
1x128 blocks for activations and gradients, 128x128 tiles for weights, nearest rounding.

Scale rule (TE compute_scale_from_amax, amax_epsilon = 0, power_2_scale = True by default):
scale = 448 / amax in FP32; amax = 0 (or Inf/NaN) -> 1; an Inf quotient -> FLT_MAX; with power-of-two
scales the mantissa bits are dropped (round down to a power of two). q = e4m3(x * scale);
x_hat = q * (1 / scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvfp4_recipe.formats import E4M3_MAX, FP32_MAX, as_rows

FP8_BLOCK = 128
Block = tuple[int, int]


@dataclass(frozen=True)
class FP8BlockTensor:
    """data: torch.float8_e4m3fn (rows, K); scale_inv: float32 (rows, K // 128) for 1x128 blocks or
    (rows // 128, K // 128) for 128x128 tiles (TE's layouts); shape: original shape."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    shape: torch.Size
    block: Block

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, k = self.data.shape
        scale_inv = self.scale_inv
        if self.block[0] > 1:
            scale_inv = scale_inv.repeat_interleave(self.block[0], dim=0)
        x_hat = self.data.float().view(rows, k // FP8_BLOCK, FP8_BLOCK) * scale_inv.unsqueeze(-1)
        return x_hat.view(self.shape).to(dtype)


def fp8_block_scale(amax: torch.Tensor, power_2_scales: bool = True) -> torch.Tensor:
    """TE's FP32 quantization scale from a block amax (see module docstring)."""
    amax = amax.float()
    scale = torch.div(E4M3_MAX, amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if power_2_scales:
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)  # keep sign+exponent
    return scale


def _check_block(block: Block) -> None:
    if tuple(block) not in ((1, FP8_BLOCK), (FP8_BLOCK, FP8_BLOCK)):
        raise ValueError(f"block={block!r} is not supported; use (1, 128) or (128, 128)")


def quantize_fp8_block(
    x: torch.Tensor,
    block: Block = (1, FP8_BLOCK),
    power_2_scales: bool = True,
    check_finite: bool = False,
) -> FP8BlockTensor:
    """Quantize x (..., K), K a multiple of 128, to E4M3 with 1x128 blocks or 128x128 tiles."""
    _check_block(block)
    x2d = as_rows(x, FP8_BLOCK, "quantize_fp8_block", check_finite)
    rows, k = x2d.shape
    tile_rows = block[0]
    if rows % tile_rows:
        raise ValueError(
            f"quantize_fp8_block: 128x128 tiles need a row count that is a multiple of 128, got "
            f"{rows} rows from shape {tuple(x.shape)}; pad the rows or use block=(1, 128)"
        )
    abs_blocks = x2d.view(rows // tile_rows, tile_rows, k // FP8_BLOCK, FP8_BLOCK).abs()
    amax = abs_blocks.amax(dim=(1, 3)).float()  # (rows / tile_rows, K / 128)
    scale = fp8_block_scale(amax, power_2_scales)
    scale_rows = scale.repeat_interleave(tile_rows, dim=0) if tile_rows > 1 else scale
    scaled = x2d.float().view(rows, k // FP8_BLOCK, FP8_BLOCK) * scale_rows.unsqueeze(-1)
    data = scaled.clamp_(-E4M3_MAX, E4M3_MAX).view(rows, k).to(torch.float8_e4m3fn)
    return FP8BlockTensor(data, torch.div(1.0, scale), x.shape, (tile_rows, FP8_BLOCK))


def fp8_block_dequantized_values(
    x2d: torch.Tensor,
    block: Block = (1, FP8_BLOCK),
    power_2_scales: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantized values in `dtype` (exact in bfloat16 with power-of-two scales).

    A dimension that is not a multiple of the block ends in a partial block: it is zero-padded,
    which leaves that block's amax (and so its scale and values) as TE's blockwise FP8 computes
    it for a partial block, then cut back to the input shape.
    """
    rows, cols = x2d.shape
    pad_rows, pad_cols = (-rows) % block[0], (-cols) % FP8_BLOCK
    if pad_rows or pad_cols:
        x2d = torch.nn.functional.pad(x2d, (0, pad_cols, 0, pad_rows))
    return quantize_fp8_block(x2d, block, power_2_scales).dequantize(dtype)[:rows, :cols]
