"""MXFP4 (comparison format): E2M1 elements, one power-of-two E8M0 scale per 1x32 block, no tensor
scale. Scale = 2**ceil(log2(vec_max / 6)) (TE's reference rule; the notes), so nothing clips."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvfp4_recipe.formats import (
    encode_e2m1_blocks,
    E2M1_MAX,
    as_rows,
    decode_e2m1,
    e8m0_from_exponent,
    unpack_codes,
)

MX_BLOCK = 32


@dataclass(frozen=True)
class MXFP4Tensor:
    """data: uint8 (rows, K // 2) packed codes (even column low nibble); scales:
    torch.float8_e8m0fnu (rows, K // 32); shape: original shape."""

    data: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = unpack_codes(self.data)
        rows, k = codes.shape
        q = decode_e2m1(codes).view(rows, k // MX_BLOCK, MX_BLOCK)
        return (q * self.scales.float().unsqueeze(-1)).view(self.shape).to(dtype)


def mx_scale_exponent(vec_max: torch.Tensor) -> torch.Tensor:
    """ceil(log2(vec_max / 6)) computed exactly from the FP32 bits, clamped to [-127, 127].

    (torch.log2 can round k + tiny down to k and so pick a scale one power too small.)
    vec_max = 0 gives -127.
    """
    y = (vec_max.float() / E2M1_MAX).view(torch.int32)
    biased = (y >> 23) & 0xFF
    mantissa = y & 0x7FFFFF
    exponent = biased - 127 + (mantissa != 0).int()
    # FP32 subnormals (biased exponent 0) are all below 2**-126: clamp makes them -127.
    exponent = torch.where(biased == 0, torch.full_like(exponent, -127), exponent)
    return exponent.clamp_(-127, 127)


def _quantize_mx_core(
    x2d: torch.Tensor,
    stochastic: bool,
    generator: torch.Generator | None,
    want_codes: bool,
    values_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    rows, k = x2d.shape
    blocks = k // MX_BLOCK
    vec_max = x2d.view(rows, blocks, MX_BLOCK).abs().amax(dim=-1).float()
    exponent = mx_scale_exponent(vec_max)
    scale = torch.exp2(exponent.float())
    inverse = torch.exp2(-exponent.float())  # exact: powers of two in FP32 range
    packed, values = encode_e2m1_blocks(
        x2d, MX_BLOCK, inverse, scale, stochastic=stochastic, generator=generator,
        want_codes=want_codes, values_dtype=values_dtype)
    return packed, e8m0_from_exponent(exponent), values


def quantize_mxfp4(
    x: torch.Tensor,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    check_finite: bool = False,
) -> MXFP4Tensor:
    """Quantize x (..., K), K a multiple of 32, to MXFP4 (1x32 blocks along the last dim)."""
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")
    x2d = as_rows(x, MX_BLOCK, "quantize_mxfp4", check_finite)
    packed, scales, _ = _quantize_mx_core(x2d, rounding == "stochastic", generator, True, None)
    return MXFP4Tensor(packed, scales, x.shape)


def mxfp4_dequantized_values(
    x2d: torch.Tensor,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantized MXFP4 values of 2-D x2d in `dtype` (exact in bfloat16 for normal-range scales)."""
    x2d = as_rows(x2d, MX_BLOCK, "MXFP4 operand", False)
    return _quantize_mx_core(x2d, stochastic, generator, False, dtype)[2]
