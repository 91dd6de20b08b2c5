"""NVFP4 quantization: E2M1 elements, E4M3 scales per 1x16 block (or 16x16 tile), FP32 tensor scale.

Bit-exact to Transformer Engine's default (non-"4over6") path: the formulas and their operation
order follow TE's reference quantizer (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py
in TE 2.19; earlier quantization_ref_nvfp4.py in 2.16-2.18, quantization_nvfp4.py in 2.10-2.15,
experimental/ in 2.8-2.9) and "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149, its format
section); each step is written out where it is computed (tensor_scales, block_scales, formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

import nvfp4_recipe.kernels as fused
from nvfp4_recipe.formats import (
    encode_e2m1_blocks,
    E2M1_MAX,
    E4M3_MAX,
    FP32_MAX,
    FP32_RECIPROCAL_OF_6,
    as_rows,
    chunk_numel,
    row_chunks,
    unpack_codes,
    decode_e2m1,
)

BLOCK = 16
Tile = tuple[int, int]
Rounding = Literal["nearest", "stochastic"]


@dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized tensor in TE's storage layout.

    data:   uint8 (rows, K // 2), two E2M1 codes per byte, even column in the low nibble.
    scales: torch.float8_e4m3fn (rows, K // 16); for 16x16 tiles each tile's scale is repeated over
            its 16 rows.
    amax:   float32 0-d, max |x| of the quantized tensor.
    shape:  the original shape (leading dims were flattened into rows).
    """

    data: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor
    shape: torch.Size
    tile: Tile = (1, BLOCK)

    @property
    def decode_scale(self) -> torch.Tensor:
        """The FP32 tensor decode scale S_dec = 1 / S_enc."""
        return tensor_scales(self.amax)[1]

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, (rows, K) uint8."""
        return unpack_codes(self.data)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x_hat = q * fp32(s) * S_dec, in `dtype`, with the original shape."""
        rows, k = self.data.shape[0], self.data.shape[1] * 2
        q = decode_e2m1(self.codes()).view(rows, k // BLOCK, BLOCK)
        x_hat = (q * self.scales.float().unsqueeze(-1)) * self.decode_scale
        return x_hat.view(self.shape).to(dtype)


def tensor_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) from the tensor amax, in FP32: S_enc = min(448 * 6 / amax, FLT_MAX), 0 -> 1."""
    s_enc = torch.clamp(torch.div(E4M3_MAX * E2M1_MAX, amax), max=FP32_MAX)
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    return s_enc, torch.div(1.0, s_enc)


def _block_amax(x2d: torch.Tensor, tile_rows: int, compiled: bool = False, strict: bool = False) -> torch.Tensor:
    """max |x| per 1x16 block, or per 16x16 tile repeated over its rows: float32 (rows, K // 16)."""
    rows, k = x2d.shape
    if compiled:
        vec_max = fused.block_amax(x2d, BLOCK, strict)
    else:
        vec_max = torch.empty(rows, k // BLOCK, dtype=torch.float32, device=x2d.device)
        scratch = torch.empty(min(rows * k, chunk_numel(k)), dtype=torch.float32, device=x2d.device)
        for start, stop in row_chunks(rows, k):
            _block_amax_chunk(x2d, scratch, vec_max, start, stop)
    if tile_rows > 1:
        tile_max = vec_max.view(rows // tile_rows, tile_rows, k // BLOCK).amax(dim=1)
        vec_max = tile_max.repeat_interleave(tile_rows, dim=0)
    return vec_max


def _block_amax_chunk(
    x2d: torch.Tensor, scratch: torch.Tensor, vec_max: torch.Tensor, start: int, stop: int
) -> None:
    rows, k = stop - start, x2d.shape[1]
    chunk = scratch[: rows * k].view(1, rows, k)
    if x2d.dtype == torch.float32:
        torch.abs(x2d[start:stop], out=chunk[0])
    else:
        chunk.copy_(x2d[start:stop]).abs_()
    # max_pool1d is several times faster on CPU than amax over a trailing dim of 16.
    pooled = torch.nn.functional.max_pool1d(chunk, BLOCK, BLOCK)
    vec_max[start:stop].copy_(pooled.view(rows, k // BLOCK))


def block_scales(
    vec_max: torch.Tensor, amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 block scales s, FP32 encode scales e, S_dec) from block and tensor amax (notes 2-5)."""
    s_enc, s_dec = tensor_scales(amax)
    multiplier = s_enc * FP32_RECIPROCAL_OF_6  # formed first, in FP32
    scale = torch.clamp(vec_max * multiplier, max=FP32_MAX).clamp_(-E4M3_MAX, E4M3_MAX)
    scale_e4m3 = scale.to(torch.float8_e4m3fn)  # round to nearest even
    encode = torch.clamp(torch.div(1.0, scale_e4m3.float() * s_dec), max=FP32_MAX)
    return scale_e4m3, encode, s_dec


def scales_of_blocks(
    vec_max: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(amax, E4M3 block scales, FP32 encode scales, S_dec) from the (non-empty) block amaxes."""
    amax = vec_max.amax()
    return (amax, *block_scales(vec_max, amax))


# The same function compiled: ~8 small ops on (rows, K // 16) tensors become two loops.
_COMPILED_SCALES_OF_BLOCKS = fused.Fused(scales_of_blocks)


def _operand_scales(x_blocks: torch.Tensor):
    vec_max = fused.block_amax_flat(x_blocks)
    amax, scale_e4m3, encode, s_dec = scales_of_blocks(vec_max)
    return amax, scale_e4m3, encode.unsqueeze(-1), scale_e4m3.float().unsqueeze(-1), s_dec


def _operand_nearest(x_blocks: torch.Tensor, out_dtype: torch.dtype):
    """A 1x16-block GEMM operand of flat (blocks, 16) x in one function: the block amax, the
    scales (scales_of_blocks) and the values q * s, the kernels composed as quantize_nvfp4_core
    composes them: (E4M3 scales, amax, S_dec, values)."""
    amax, scale_e4m3, encode, decode, s_dec = _operand_scales(x_blocks)
    return scale_e4m3, amax, s_dec, fused.e2m1_values_nearest(x_blocks, encode, decode, out_dtype)


def _operand_stochastic(x_blocks: torch.Tensor, random_bytes: torch.Tensor, out_dtype: torch.dtype):
    """As _operand_nearest, stochastically rounded with the given random bytes."""
    amax, scale_e4m3, encode, decode, s_dec = _operand_scales(x_blocks)
    values = fused.e2m1_values_stochastic(x_blocks, encode, decode, random_bytes, out_dtype)
    return scale_e4m3, amax, s_dec, values


# Each compiled as one call: dynamo's guards and wrappers cost tens of us per compiled call, which
# the three separate calls (amax, scales, values) paid on every activation and gradient operand, a
# large share of a small operand's quantization. Only where the scales run compiled (CPU). Two
# functions, as in kernels.py, so that each stays under dynamo's recompile limit.
_COMPILED_OPERAND_NEAREST = fused.Fused(_operand_nearest)
_COMPILED_OPERAND_STOCHASTIC = fused.Fused(_operand_stochastic)


def _check_tile(tile: Tile) -> int:
    if tuple(tile) not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise ValueError(f"tile={tile!r} is not supported; use (1, 16) or (16, 16)")
    return tile[0]


def _check_rounding(rounding: str) -> bool:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding={rounding!r} is not supported; use 'nearest' or 'stochastic'")
    return rounding == "stochastic"


def _as_nvfp4_rows(x: torch.Tensor, tile_rows: int, check_finite: bool) -> torch.Tensor:
    x2d = as_rows(x, BLOCK, "quantize_nvfp4", check_finite)
    if x2d.shape[0] % tile_rows != 0:
        raise ValueError(
            f"quantize_nvfp4: 16x16 tiles need a row count that is a multiple of 16, got "
            f"{x2d.shape[0]} rows from shape {tuple(x.shape)}; pad the rows with zeros or use tile=(1, 16)"
        )
    return x2d


def quantize_nvfp4_core(
    x2d: torch.Tensor,
    tile_rows: int,
    stochastic: bool,
    generator: torch.Generator | None,
    want_codes: bool,
    values_dtype: torch.dtype | None,
    kernels: str = "eager",
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize contiguous 2-D x2d (rows, K). Returns (packed codes | None, E4M3 scales, amax,
    S_dec, scaled values q * s | None).

    The scaled values q * s are exact in bfloat16 (<= 6 significant bits, in [2**-10, 2688]), so a
    GEMM on them with FP32 accumulation times the two S_dec computes what FP4 tensor cores compute.
    Two passes over x: block amax, then scale / round / encode. kernels="compiled" (or "auto" where
    available) runs both as fused kernels (nvfp4_recipe.kernels) when one output is wanted,
    bit-identical to the eager ones.
    """
    rows, k = x2d.shape
    device = x2d.device
    # The fused kernels produce one output: codes (quantize_nvfp4) or values (the GEMM operands).
    compiled = (fused.use_compiled(kernels, device) and want_codes != (values_dtype is not None)
                and x2d.numel() > 0)
    strict = kernels == "compiled"
    if compiled and values_dtype is not None and tile_rows == 1 and fused.compiled_scales(device):
        x_blocks = x2d.view(-1, BLOCK).detach()
        if stochastic:  # the bytes the other paths draw, by the same call
            scale_e4m3, amax, s_dec, values = _COMPILED_OPERAND_STOCHASTIC(
                strict, x_blocks, fused.draw_bytes_like(x_blocks, generator), values_dtype)
        else:
            scale_e4m3, amax, s_dec, values = _COMPILED_OPERAND_NEAREST(strict, x_blocks, values_dtype)
        return None, scale_e4m3.view(rows, k // BLOCK), amax, s_dec, values.view(rows, k)
    vec_max = _block_amax(x2d, tile_rows, compiled, strict)
    if not vec_max.numel():
        amax = torch.zeros((), device=device)
        scale_e4m3, encode, s_dec = block_scales(vec_max, amax)
    elif compiled and fused.compiled_scales(device):
        amax, scale_e4m3, encode, s_dec = _COMPILED_SCALES_OF_BLOCKS(strict, vec_max)
    else:
        amax, scale_e4m3, encode, s_dec = scales_of_blocks(vec_max)
    decode = scale_e4m3.float() if values_dtype is not None else None
    if compiled and want_codes:
        packed = fused.encode_codes(x2d, BLOCK, encode, stochastic, generator, strict)
        return packed, scale_e4m3, amax, s_dec, None
    if compiled:
        values = fused.encode_values(x2d, BLOCK, encode, decode, stochastic, generator, values_dtype, strict)
        return None, scale_e4m3, amax, s_dec, values
    packed, values = encode_e2m1_blocks(
        x2d, BLOCK, encode, decode, stochastic=stochastic, generator=generator,
        want_codes=want_codes, values_dtype=values_dtype)
    return packed, scale_e4m3, amax, s_dec, values


def quantize_nvfp4(
    x: torch.Tensor,
    tile: Tile = (1, BLOCK),
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
    check_finite: bool = False,
    kernels: str = "auto",
) -> NVFP4Tensor:
    """Quantize x (..., K), K a multiple of 16, to NVFP4 exactly as Transformer Engine does.

    Leading dims are flattened into rows. tile=(1, 16): one scale per 16 values along K;
    tile=(16, 16): one per 16x16 tile (rows must be a multiple of 16), TE's 2-D weight scaling.
    rounding="stochastic" takes one random byte per element from `generator` (eight per 64-bit
    draw; None: torch's global RNG, which the trainer checkpoints). check_finite=True rejects
    NaN/Inf with a ValueError. kernels: "auto" (compiled where inductor can build kernels),
    "eager" or "compiled"; the same bits.
    """
    fused.check_kernel_mode(kernels, "quantize_nvfp4")
    tile_rows = _check_tile(tile)
    stochastic = _check_rounding(rounding)
    x2d = _as_nvfp4_rows(x, tile_rows, check_finite)
    packed, scales, amax, _, _ = quantize_nvfp4_core(
        x2d, tile_rows, stochastic, generator, want_codes=True, values_dtype=None, kernels=kernels
    )
    return NVFP4Tensor(packed, scales, amax, x.shape, (tile_rows, BLOCK))


def nvfp4_scaled_values(
    x2d: torch.Tensor,
    tile_rows: int = 1,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.bfloat16,
    kernels: str = "auto",
    with_amax: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(q * s in `dtype`, S_dec): the GEMM operand of an emulated NVFP4 GEMM, no code packing;
    with_amax=True adds the tensor amax it computed (max |x|, FP32 0-d: the input amax recorder's).

    x2d must be 2-D with K % 16 == 0 (and rows % 16 == 0 for tile_rows=16). q * s is exact in
    bfloat16 and float32; the dequantized tensor is (q * s) * S_dec. `kernels` ("eager",
    "compiled", "auto") picks how the quantizer runs (nvfp4_recipe.kernels); the bits are the same.
    """
    fused.check_kernel_mode(kernels, "nvfp4_scaled_values")
    x2d = _as_nvfp4_rows(x2d, tile_rows, check_finite=False)
    _, _, amax, s_dec, values = quantize_nvfp4_core(
        x2d, tile_rows, stochastic, generator, want_codes=False, values_dtype=dtype, kernels=kernels
    )
    return (values, s_dec, amax) if with_amax else (values, s_dec)
