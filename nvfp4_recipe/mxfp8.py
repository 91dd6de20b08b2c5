"""MXFP8: FP8 E4M3 elements, one power-of-two E8M0 scale per 1x32 block, no tensor scale; bit-exact
to Transformer Engine's MXFP8 cast (TE release_v2.19, paths under transformer_engine/common/).

Per 32-value block (TE cast/mxfp8/quantize_mxfp8.cuh, the generic kernel):

1. amax = max |x| over the block, accumulated with fmaxf (:255-259 colwise, :408-412 rowwise) or,
   for BF16/FP16 inputs, PTX max.xorsign.abs / __hmax (util/ptx.cuh:1161, quantize_mxfp8.cuh:386):
   all of them return the other operand when one is NaN, so NaN elements do not enter the amax (a
   block of only NaNs has amax 0); an Inf element makes it Inf.
2. The biased exponent is float_to_e8m0(amax * max_norm_rcp) (quantize_mxfp8.cuh:446):
   max_norm_rcp = float(1.0 / 448), TE's FP32 reciprocal of 448 (utils.cuh:1044), and the product
   is one FP32 multiply, round-to-nearest, without flush-to-zero (mxfp8 is not among the
   --use_fast_math sources, common/CMakeLists.txt:615-653; the specialized kernel writes it as
   __fmaf_ieee_rn(amax, rcp, 0), specialized/quantize_mxfp8.cuh:87-91, the BF16-constant FMA
   path above it is compiled only with _ENABLE_MXFMA, which nothing defines).
   float_to_e8m0 (util/ptx.cuh:390-421; on Blackwell `cvt.rp.satfinite.ue8m0x2.f32`, the same
   results): NaN -> 255, Inf -> 254, 0 -> 0; else the FP32 exponent field, plus one when the
   mantissa is non-zero (round up), except at 254 (saturate: 2**127 is the largest finite scale)
   and except for FP32 subnormals <= 2**-127 (mantissa <= 0x400000), which round up to 2**-127,
   E8M0's smallest value, code 0. So amax = 448 * 2**k gives exactly 2**k (448 * fp32(1/448)
   rounds to 1.0), and one FP32 ulp above it gives 2**(k+1): torchao's to_mx RCEIL rounds that
   one down (notes/nvfp4-2026.md); this follows TE. (An FP32 division by 448 would give the same
   exponents: fp32(1/448) exceeds 1/448 by 4.3e-8 relative, less than the 6.8e-8 step from
   448 * 2**k to the next FP32 value, and for products near and below 2**-126 all FP32 amax
   were compared.)
3. The elements are multiplied by exp2f_rcp(biased) (util/ptx.cuh:356-365): 2**(127 - biased)
   built from the bits, 2**-127 (a subnormal, 0x00400000) for 254, NaN for 255, in FP32 (PTX
   mul.f32x2, round-to-nearest, util/ptx.cuh:1023; quantize_mxfp8.cuh:295 colwise), and
   converted to E4M3 with round-to-nearest-even and satfinite (`cvt.rn.satfinite.e4m3x2.f32`,
   util/ptx.cuh:1025; the colwise static_cast<fp8e4m3> is cuda_fp8.h's satfinite conversion):
   out-of-range values become +-448, the sign of zero is kept (-0 -> 0x80), NaN stays NaN.
   In practice only Inf needs the saturation: for finite amax the scaled block max is <= 448.

No RHT and no stochastic rounding (TE's MXFP8BlockScaling has neither).

GEMM operands (TE's MXFP8BlockScaling quantizes each operand rowwise and columnwise; a GEMM reads
the copy whose blocks run along its reduction dimension). With x (T, K), W (N, K), dY (T, N):
  Fprop  Y  = x W^T : x rowwise (blocks along K), W rowwise (along K)
  Dgrad  dX = dY W  : dY rowwise (along N), W columnwise = W^T rowwise (along N)
  Wgrad  dW = dY^T x: dY columnwise = dY^T rowwise (along T), x columnwise = x^T rowwise (along T)
quantize_mxfp8_along(x2d, dim) gives either copy; the columnwise one is returned as the rowwise
quantization of x2d^T (data (cols, rows)), the same values and scales TE stores in its
(rows, cols) columnwise layout with (rows // 32, cols) scales.

Non-finite elements are quantized as TE does (above); pass check_finite=True to refuse them.

Kernels (`kernels`, MXFP8Config.kernels, `precision.kernels`, as NVFP4's: nvfp4_recipe/kernels.py):
"eager" runs the steps above as PyTorch ops in row chunks (~ten passes over each tensor);
"compiled" runs them as one torch.compile'd function of the flat (blocks, 32) tensor (inductor's
C++ backend: block amax, exponent, scaling, E4M3 cast and, for the GEMM operands, the dequantized
values, fused), bit-identical (tests/nvfp4_recipe/test_mxfp8_kernels.py); "auto" = compiled where
a C++ compiler is on PATH, falling back to eager with one warning if compiling fails. CPU only:
the exponent rule reads FP32 subnormal products (amax * fp32(1/448) near 2**-127) and the smallest
scale 2**-127 is an FP32 subnormal, which Triton's flush-to-zero would change (kernels.py), so on
CUDA every mode runs eager (the same bits, eager's are tested against TE's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import nvfp4_recipe.kernels as fused
from nvfp4_recipe.formats import E4M3_MAX, as_rows, chunk_numel, row_chunks

MX_BLOCK = 32
# TE's max_norm_rcp for E4M3, float(1.0 / 448) (utils.cuh:1044). A Python float holding the FP32
# value exactly (not a tensor: see formats.FP32_RECIPROCAL_OF_6); an FP32 tensor times it is the
# correctly rounded FP32 product.
FP32_RECIPROCAL_OF_448 = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32).item()

_E8M0_NAN = 255
_E8M0_MAX_FINITE = 254
_FP32_MANTISSA_BITS = 23
_FP32_MANTISSA_MASK = 0x7FFFFF
_FP32_HALF_OF_SMALLEST_NORMAL = 0x400000  # mantissa of the subnormal 2**-127
_TWO_TO_MINUS_127_BITS = 0x00400000


@dataclass(frozen=True)
class MXFP8Tensor:
    """data: torch.float8_e4m3fn (rows, K); scales: torch.float8_e8m0fnu (rows, K // 32), scale of
    data[:, 32 j : 32 (j + 1)] is scales[:, j]; shape: the original shape (..., K)."""

    data: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale in FP32 (exact: 4 significant bits times a power of two >= 2**-127 stays
        above FP32's 2**-149), then converted to `dtype`."""
        rows, k = self.data.shape
        q = self.data.float().view(rows, k // MX_BLOCK, MX_BLOCK)
        return (q * self.scales.float().unsqueeze(-1)).view(self.shape).to(dtype)


def e8m0_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """TE's float_to_e8m0(amax * fp32(1/448)) as int32 biased exponents in [0, 255] (step 2)."""
    product = amax.float() * FP32_RECIPROCAL_OF_448
    bits = product.view(torch.int32)
    exponent = (bits >> _FP32_MANTISSA_BITS) & 0xFF  # amax >= 0: no sign bit to mask
    mantissa = bits & _FP32_MANTISSA_MASK
    # TE's saturation at 254 cannot trigger for an FP32 amax (amax / 448 < 2**120); kept as TE has it
    round_up = (mantissa > 0) & (exponent != _E8M0_MAX_FINITE)
    round_up &= ~((exponent == 0) & (mantissa <= _FP32_HALF_OF_SMALLEST_NORMAL))
    biased = exponent + round_up.int()
    # Exponent field 255 is Inf or NaN; product == 0 already gives 0 above.
    biased = torch.where(torch.isinf(product), _E8M0_MAX_FINITE, biased)
    return torch.where(torch.isnan(product), _E8M0_NAN, biased)


def e8m0_reciprocal(biased: torch.Tensor) -> torch.Tensor:
    """TE's exp2f_rcp: FP32 2**(127 - biased) from int32 biased exponents (step 3)."""
    bits = (254 - biased).clamp(min=0) << _FP32_MANTISSA_BITS
    bits = torch.where(biased == _E8M0_MAX_FINITE, _TWO_TO_MINUS_127_BITS, bits)
    reciprocal = bits.view(torch.float32)
    return torch.where(biased == _E8M0_NAN, float("nan"), reciprocal)


def e8m0_value(biased: torch.Tensor) -> torch.Tensor:
    """FP32 2**(biased - 127) from int32 biased exponents, built from the bits (what torch's
    float8_e8m0fnu -> float32 cast gives, without a cast inductor would have to lower): code 0 is
    the FP32 subnormal 2**-127 (0x00400000), 255 is NaN."""
    bits = torch.where(biased == 0, _TWO_TO_MINUS_127_BITS, biased << _FP32_MANTISSA_BITS)
    return torch.where(biased == _E8M0_NAN, float("nan"), bits.view(torch.float32))


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """max |x| per block (last dim) in FP32, NaN elements ignored as fmaxf ignores them (step 1)."""
    r, n_blocks, block = blocks.shape
    magnitude = blocks.float().abs()
    magnitude.masked_fill_(torch.isnan(magnitude), 0.0)
    # max_pool1d over the row is several times faster on CPU than amax over a trailing dim of 32
    # (as nvfp4.py's block amax); the same maxima.
    pooled = torch.nn.functional.max_pool1d(magnitude.view(1, r, n_blocks * block), block, block)
    return pooled.view(r, n_blocks)


# The compiled path (module docstring, "Kernels"): functions of the detached flat (blocks, 32)
# tensor, so a call has one dynamic size (the block count) and a new shape does not recompile; one
# for the E4M3 data, one for the dequantized values, so each stays under dynamo's recompile limit
# (one variant per input dtype, and output dtype). The same formulas as the eager path, in the same
# order: every FP32 step is one correctly rounded multiply (no sum for a fused multiply-add to
# change), and inductor's C++ flags keep subnormals and NaN checks (no -ffast-math; kernels.py).
def _flat_block_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """(blocks, 32) -> int32 (blocks,) biased E8M0 exponents (steps 1-2), NaN elements ignored."""
    magnitude = blocks.float().abs()
    magnitude = torch.where(torch.isnan(magnitude), 0.0, magnitude)
    return e8m0_scale_from_amax(magnitude.amax(dim=-1))


def _flat_e4m3(blocks: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
    """Step 3: fp32(x * 2**(127 - e)), clamped to +-448 (satfinite; NaN passes), cast to E4M3."""
    scaled = blocks.float() * e8m0_reciprocal(biased).unsqueeze(-1)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _flat_mxfp8_data(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    biased = _flat_block_exponents(blocks)
    return _flat_e4m3(blocks, biased), biased


def _flat_mxfp8_values(blocks: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    biased = _flat_block_exponents(blocks)
    values = _flat_e4m3(blocks, biased).float() * e8m0_value(biased).unsqueeze(-1)  # exact
    return values.to(out_dtype), biased


_COMPILED_DATA = fused.Fused(_flat_mxfp8_data)
_COMPILED_VALUES = fused.Fused(_flat_mxfp8_values)


def _runs_compiled(x2d: torch.Tensor, kernels: str) -> bool:
    """Whether `kernels` selects the compiled path for x2d: CPU tensors only (module docstring),
    non-empty (dynamo specializes the block counts 0 and 1; an empty tensor has nothing to fuse)."""
    fused.check_kernel_mode(kernels, "MXFP8 quantizer")
    return fused.use_compiled(kernels, x2d.device) and x2d.is_cpu and x2d.numel() > 0


def _quantize_mxfp8_core(
    x2d: torch.Tensor, values_dtype: torch.dtype | None, kernels: str = "eager"
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """E4M3 data (or, with values_dtype, the dequantized values instead) and int32 biased scales of
    2-D contiguous x2d (rows, k): compiled (one fused call) or eager, in row chunks of about
    formats.CHUNK_ELEMENTS (bounded FP32 scratch); the same bits."""
    rows, k = x2d.shape
    if _runs_compiled(x2d, kernels):
        strict = kernels == "compiled"
        blocks = x2d.view(-1, MX_BLOCK).detach()
        if values_dtype is None:
            data, biased = _COMPILED_DATA(strict, blocks)
            return data.view(rows, k), biased.view(rows, k // MX_BLOCK), None
        values, biased = _COMPILED_VALUES(strict, blocks, values_dtype)
        return None, biased.view(rows, k // MX_BLOCK), values.view(rows, k)
    blocks = k // MX_BLOCK
    device = x2d.device
    biased = torch.empty(rows, blocks, dtype=torch.int32, device=device)
    data = None if values_dtype else torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device)
    values = torch.empty(rows, k, dtype=values_dtype, device=device) if values_dtype else None
    scratch = torch.empty(min(rows * k, chunk_numel(k)), dtype=torch.float32, device=device)
    for start, stop in row_chunks(rows, k):
        r = stop - start
        chunk = x2d[start:stop].view(r, blocks, MX_BLOCK)
        chunk_biased = e8m0_scale_from_amax(_block_amax(chunk))
        biased[start:stop] = chunk_biased
        scaled = scratch[: r * k].view(r, blocks, MX_BLOCK)
        # The FP32 product x * 2**(127 - e), correctly rounded (it is exact unless subnormal).
        torch.mul(chunk.float(), e8m0_reciprocal(chunk_biased).unsqueeze(-1), out=scaled)
        # satfinite: torch's E4M3 cast is round-to-nearest-even, and clamping first makes the
        # saturation explicit (Inf -> 448) whatever the cast does out of range; NaN passes clamp.
        scaled.clamp_(-E4M3_MAX, E4M3_MAX)
        if data is not None:
            data[start:stop] = scaled.view(r, k)  # copy_ casts FP32 -> E4M3, nearest-even
        else:
            q = scaled.to(torch.float8_e4m3fn).float()
            scale = _as_e8m0(chunk_biased).float()  # exact 2**(e - 127); 255 is NaN
            values[start:stop] = (q * scale.unsqueeze(-1)).view(r, k)
    return data, biased, values


def _as_e8m0(biased: torch.Tensor) -> torch.Tensor:
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_mxfp8(x: torch.Tensor, check_finite: bool = False, kernels: str = "auto") -> MXFP8Tensor:
    """Quantize x (..., K), K a multiple of 32, to MXFP8 (1x32 blocks along the last dim), bit-exact
    to TE's MXFP8 quantizer (module docstring). float64 inputs are rounded to FP32 first.
    kernels: "auto", "eager" or "compiled" (module docstring, "Kernels"); the same bits."""
    fused.check_kernel_mode(kernels, "quantize_mxfp8")
    x2d = as_rows(x, MX_BLOCK, "quantize_mxfp8", check_finite)
    data, biased, _ = _quantize_mxfp8_core(x2d, None, kernels)
    return MXFP8Tensor(data, _as_e8m0(biased), x.shape)


def quantize_mxfp8_along(x2d: torch.Tensor, dim: int, check_finite: bool = False,
                         kernels: str = "auto") -> MXFP8Tensor:
    """MXFP8 of a 2-D tensor with its 32-value blocks along `dim`: dim -1 or 1 is TE's rowwise
    quantization (quantize_mxfp8(x2d)); dim 0 is TE's columnwise one, returned as the rowwise
    quantization of x2d.T (shape (cols, rows)). x2d.shape[dim] must be a multiple of 32."""
    if not isinstance(x2d, torch.Tensor) or x2d.dim() != 2:
        got = tuple(x2d.shape) if isinstance(x2d, torch.Tensor) else type(x2d).__name__
        raise ValueError(f"quantize_mxfp8_along: expected a 2-D tensor, got {got}")
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"quantize_mxfp8_along: dim={dim} is not a dimension of a 2-D tensor")
    lines = x2d.t() if dim in (0, -2) else x2d
    return quantize_mxfp8(lines, check_finite=check_finite, kernels=kernels)


def mxfp8_dequantized_values(x2d: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                             kernels: str = "auto") -> torch.Tensor:
    """Dequantized MXFP8 values of 2-D x2d (blocks along the last dim) in `dtype`, without the E4M3
    tensor: the same values as quantize_mxfp8(x2d).dequantize(dtype). Exact in bfloat16 unless a
    value falls below bfloat16's smallest subnormal 2**-133 (E4M3 subnormals at scale 2**-127).
    kernels: as quantize_mxfp8's."""
    fused.check_kernel_mode(kernels, "mxfp8_dequantized_values")
    x2d = as_rows(x2d, MX_BLOCK, "MXFP8 operand", False)
    return _quantize_mxfp8_core(x2d, dtype, kernels)[2]
