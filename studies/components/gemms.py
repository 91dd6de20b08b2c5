"""The recipe's GEMMs on captured tensors, composed from nvfp4_recipe's public quantizers, and
the error measures the study applies to them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nvfp4_recipe.hadamard import rht_matrix
from nvfp4_recipe.linear import emulated_gemm
from nvfp4_recipe.operands import GemmOperand, transpose_padded
from nvfp4_recipe.mxfp4 import MX_BLOCK, mxfp4_dequantized_values
from nvfp4_recipe.mxfp8 import mxfp8_dequantized_values
from nvfp4_recipe.nvfp4 import BLOCK, nvfp4_scaled_values


# How the NVFP4 quantizers run (nvfp4_recipe.kernels): "auto" as in training; every mode computes
# the same bits (tests use "eager" to skip compilation).
KERNELS = "auto"


def nvfp4_operand(t2d: torch.Tensor, tile_rows: int = 1, stochastic: bool = False,
                  generator: torch.Generator | None = None) -> GemmOperand:
    """An NVFP4 GEMM operand (blocks along the last dim), FP32 q*s values and the tensor scale."""
    return GemmOperand(*nvfp4_scaled_values(t2d, tile_rows, stochastic, generator, torch.float32,
                                            KERNELS))


def mxfp4_operand(t2d: torch.Tensor, stochastic: bool = False,
                  generator: torch.Generator | None = None) -> GemmOperand:
    return GemmOperand(mxfp4_dequantized_values(t2d, stochastic, generator, torch.float32), None)


def mxfp8_operand(t2d: torch.Tensor) -> GemmOperand:
    """An MXFP8 GEMM operand (E4M3, an E8M0 scale per 32 along the last dim), FP32 values."""
    return GemmOperand(mxfp8_dequantized_values(t2d, torch.float32), None)


def dequantized(op: GemmOperand) -> torch.Tensor:
    return op.values if op.decode_scale is None else op.values * op.decode_scale


@dataclass(frozen=True)
class Gemms:
    """One recipe's Fprop / Dgrad / Wgrad, composed from the public quantizers exactly as
    nvfp4_recipe.operands' _NVFP4Ops / _MXFP4Ops / _MXFP8Ops compose them, with FP32 GEMMs
    (precision.gemm=exact: the quantization error alone). For y = x W^T, x (T, K), W (N, K),
    dY (T, N): Fprop Q(x) Q(W)^T, Dgrad Q(dY) Q(W) (blocks along N), Wgrad Q(dY^T) Q(x^T)^T
    (blocks along T, after the RHT when on). SR applies to dY only; Dgrad draws before Wgrad, as
    the backward does. MXFP8 has neither RHT nor SR (TE's MXFP8BlockScaling)."""

    fmt: str = "nvfp4"
    rht: bool = True
    sr: bool = True
    weight_2d: bool = True

    @property
    def block(self) -> int:
        return BLOCK if self.fmt == "nvfp4" else MX_BLOCK

    def _q(self, t, tile_rows=1, stochastic=False, generator=None) -> GemmOperand:
        if self.fmt == "nvfp4":
            return nvfp4_operand(t, tile_rows, stochastic, generator)
        if self.fmt == "mxfp8":
            return mxfp8_operand(t)
        return mxfp4_operand(t, stochastic, generator)

    def weight_fprop(self, w):
        return self._q(w, BLOCK if self.fmt == "nvfp4" and self.weight_2d else 1)

    def weight_dgrad(self, w, fprop: GemmOperand | None = None):
        if self.fmt == "nvfp4" and self.weight_2d:  # 16x16 tiles: Fprop's copy, transposed
            return (fprop if fprop is not None else self.weight_fprop(w)).t()
        return self._q(w.t().contiguous())

    def fprop(self, x2d, w):
        return emulated_gemm(self._q(x2d), self.weight_fprop(w), torch.float32)

    def dgrad(self, dy2d, w, generator=None):
        return emulated_gemm(self._q(dy2d, 1, self.sr, generator), self.weight_dgrad(w),
                             torch.float32)

    def wgrad_source(self, t2d):
        """(T, C) -> FP32 (C, T_pad): the Wgrad operand before quantization (after the RHT)."""
        hadamard = rht_matrix(device=t2d.device) if self.fmt == "nvfp4" and self.rht else None
        return transpose_padded(t2d, self.block, hadamard)

    def wgrad(self, dy2d, x2d, generator=None, activation: GemmOperand | None = None):
        grad = self._q(self.wgrad_source(dy2d), 1, self.sr, generator)
        act = activation if activation is not None else self._q(self.wgrad_source(x2d))
        return emulated_gemm(grad, act, torch.float32)


NVFP4 = Gemms()
MXFP4 = Gemms("mxfp4", rht=False, sr=False, weight_2d=False)  # MXFP4Config's defaults
MXFP8 = Gemms("mxfp8", rht=False, sr=False, weight_2d=False)  # MXFP8Config: 1x32, nearest


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 for b = 0 = a)."""
    nb = float(torch.linalg.vector_norm(b.float()))
    d = float(torch.linalg.vector_norm(a.float() - b.float()))
    return d / nb if nb > 0 else (0.0 if d == 0 else math.inf)


def rel_norm(err: torch.Tensor, ref: torch.Tensor) -> float:
    nr = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(err)) / nr if nr > 0 else math.inf


def flushed(source: torch.Tensor, op: GemmOperand) -> float:
    """Share of the nonzero values of `source` that the quantized operand holds as zero."""
    nonzero = source != 0
    n = int(nonzero.sum())
    return int((nonzero & (op.values == 0)).sum()) / n if n else 0.0


def kurtosis_rows(t: torch.Tensor) -> float:
    """Mean over rows of the Pearson kurtosis E[(v - m)^4] / var^2 (3 for a Gaussian) of each
    row; rows with zero variance are skipped. In float64: gradients of ~1e-10 would underflow the
    fourth powers in FP32."""
    t = t.double()
    c = t - t.mean(dim=-1, keepdim=True)
    var = c.square().mean(dim=-1)
    ok = var > 0
    if not bool(ok.any()):
        return float("nan")
    return float((c[ok].pow(4).mean(dim=-1) / var[ok].square()).mean())


def seed_for(*parts) -> int:
    """A reproducible generator seed per (batch, linear, purpose)."""
    h = 0
    for p in parts:
        for ch in str(p):
            h = (h * 131 + ord(ch)) % (2**61 - 1)
    return h % (2**31)


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(*parts))
