"""How each format quantizes each operand of an emulated GEMM: the formats' ops classes, which
the registry (registry.py) names per format, and the Wgrad operands' transpose with the RHT.

The operands are the exact q*s values of each format in the GEMM dtype, with NVFP4's FP32 tensor
decode scale beside them; nvfp4_recipe/linear.py multiplies them (see its docstring for which
operand is quantized how).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nvfp4_recipe.compute import emulated_gemms_in_fp32
from nvfp4_recipe.config import FP8BlockConfig, MXFP4Config, MXFP8Config, NVFP4Config, QuantConfig
from nvfp4_recipe.fp8_block import FP8_BLOCK, fp8_block_dequantized_values, quantize_fp8_block
from nvfp4_recipe.hadamard import rht_matrix
from nvfp4_recipe.mxfp4 import MX_BLOCK, mxfp4_dequantized_values, quantize_mxfp4
from nvfp4_recipe.mxfp8 import mxfp8_dequantized_values, quantize_mxfp8
from nvfp4_recipe.nvfp4 import BLOCK, nvfp4_scaled_values, quantize_nvfp4


class GemmOperand(NamedTuple):
    """values: (rows, reduction) q*s in the GEMM dtype; decode_scale: FP32 0-d tensor scale or None;
    amax: FP32 0-d max |source| where the quantizer computed it (NVFP4's tensor amax), else None."""

    values: torch.Tensor
    decode_scale: torch.Tensor | None
    amax: torch.Tensor | None = None

    def t(self) -> "GemmOperand":
        return GemmOperand(self.values.t(), self.decode_scale, self.amax)



class _FormatOps:
    """How one format quantizes each GEMM operand (registry.py names each format's subclass)."""

    block: int
    name: str
    # K and N must be whole blocks (FP4 GEMMs); FP8 zero-pads a partial 128-block instead.
    whole_blocks_only = True

    def __init__(self, config: QuantConfig, device: torch.device | None = None) -> None:
        self.config = config
        # The GEMM's output dtype, and its operands' (FP32 where BF16 GEMMs compute in FP32 on
        # `device`: nvfp4_recipe/compute.py; None: only as a run decided, for the diagnostics).
        self.gemm_out_dtype = torch.bfloat16 if config.gemm == "fast" else torch.float32
        self.bf16_in_fp32 = emulated_gemms_in_fp32(
            device if device is not None else torch.device("meta"))
        self.gemm_dtype = torch.float32 if self.bf16_in_fp32 else self.gemm_out_dtype

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

    @property
    def dgrad_reuses_fprop_weight(self) -> bool:
        """Whether weight_dgrad reads Fprop's weight copy (so the forward keeps it for Dgrad)."""
        return False

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
            t, tile_rows, stochastic, generator, self.gemm_dtype, self.config.kernels,
            with_amax=True))

    def activation(self, x2d):
        return self._q(x2d)

    def weight_fprop(self, weight):
        return self._q(weight, BLOCK if self.config.weight_2d else 1)

    @property
    def dgrad_reuses_fprop_weight(self):
        return self.config.weight_2d

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


class _MXFP8Ops(_FormatOps):
    """TE's MXFP8BlockScaling operands (mxfp8.py's docstring): each copy quantized from the
    high-precision tensor with its 1x32 blocks along the GEMM's reduction dimension (TE's rowwise
    and columnwise copies), so Dgrad's weight is its own quantization of W^T, not Fprop's
    transposed. Nearest rounding everywhere; the values (4 significant bits times a power of two)
    are exact in the BF16 GEMM dtype."""

    block = MX_BLOCK
    name = "MXFP8"
    config: MXFP8Config

    def _q(self, t):
        return GemmOperand(mxfp8_dequantized_values(t, self.gemm_dtype, self.config.kernels), None)

    def activation(self, x2d):
        return self._q(x2d)

    def weight_fprop(self, weight):
        return self._q(weight)

    def weight_dgrad(self, weight, fprop):
        return self._q(weight.t().contiguous())  # columnwise: blocks along N

    def grad_dgrad(self, dy2d, generator):
        return self._q(dy2d)

    def grad_wgrad(self, dy2d, generator):
        return self._q(self.wgrad_source(dy2d))

    def activation_wgrad(self, x2d):
        return self._q(self.wgrad_source(x2d))

    def quantize_dequantize(self, x, role, generator):
        return quantize_mxfp8(x, kernels=self.config.kernels).dequantize()


class _FP8BlockOps(_FormatOps):
    block = FP8_BLOCK
    name = "FP8 block"
    whole_blocks_only = False
    config: FP8BlockConfig

    def __init__(self, config: FP8BlockConfig, device: torch.device | None = None) -> None:
        super().__init__(config, device)
        if not config.power_2_scales:  # q * (1/scale) is exact in bf16 only for power-of-two scales
            self.gemm_dtype = self.gemm_out_dtype = torch.float32

    def _q(self, t, block=(1, FP8_BLOCK)):
        values = fp8_block_dequantized_values(t, block, self.config.power_2_scales, self.gemm_dtype)
        return GemmOperand(values, None)

    def activation(self, x2d):
        return self._q(x2d)

    def weight_fprop(self, weight):
        return self._q(weight, (FP8_BLOCK, FP8_BLOCK))

    dgrad_reuses_fprop_weight = True  # 128x128 blocks are transpose-symmetric

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


# Elements of the source per block in transpose_padded (1 MiB in FP32): 2-5x faster than one
# strided copy on CPU (each block's transposed writes stay in cache; measured 2048^2 bf16: 3 ms vs
# 15 ms). A block is this many elements' worth of rows, not a fixed row count: 128 rows of a
# 256-column tensor took 500 us, 1024 rows 290 us (the per-block ops dominated).
TRANSPOSE_BLOCK_ELEMENTS = 1 << 18


def transpose_padded(t2d: torch.Tensor, multiple: int, hadamard: torch.Tensor | None = None) -> torch.Tensor:
    """(T, C) -> FP32 (C, T_pad), T zero-padded to a multiple of `multiple`: a Wgrad operand.

    With `hadamard` (the 16x16 RHT matrix H) each run of 16 along T is multiplied by H while its
    block is in cache: the result equals random_hadamard_transform(transpose_padded(t2d, multiple))
    bit for bit (the same FP32 GEMM per 16-run; tests/nvfp4_recipe/test_nvfp4_linear.py checks it).
    """
    tokens, cols = t2d.shape
    padded = -(-tokens // multiple) * multiple
    out = torch.empty(cols, padded, dtype=torch.float32, device=t2d.device)
    # One strided copy is fast on GPUs; there blocks would only add kernel launches. Blocks are a
    # multiple of `multiple` (so only the last one holds padding) and of 16 (the RHT's runs).
    block = (max(padded, 1) if t2d.is_cuda
             else max(1, TRANSPOSE_BLOCK_ELEMENTS // max(cols, 1) // multiple) * multiple)
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
