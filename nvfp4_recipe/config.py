"""Typed, frozen configs of the emulated quantized linear: one per format, and the config of each
GEMM pass of a linear (`PassConfigs`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from nvfp4_recipe.kernels import check_kernel_mode


class Gemm(StrEnum):
    """How the emulated GEMM multiplies the exact q*s operands (`precision.gemm`)."""

    fast = "fast"  # in bf16, FP32 tensor scales applied to its bf16 output
    exact = "exact"  # in FP32


def _check_gemm(gemm: str, owner: str) -> None:
    if gemm not in tuple(Gemm):
        raise ValueError(f"{owner}.gemm={gemm!r} is not supported; use 'fast' or 'exact'")


@dataclass(frozen=True)
class NVFP4Config:
    """NVFP4 recipe of the paper / TE NVFP4BlockScaling. Each flag switches one ingredient off.

    rht:                16-point RHT on both Wgrad operands (TE disable_rht=False).
    stochastic_rounding: SR on the gradient dY for Dgrad and Wgrad (TE disable_stochastic_rounding).
    weight_2d:          16x16 weight tiles; off = 1x16 blocks along K (Fprop) and along N (Dgrad),
                        each quantized separately (TE disable_2d_quantization).
    gemm:               "fast" (default, training): bf16 GEMM of the exact q*s operands, FP32 tensor
                        scales applied to its bf16 output (one extra rounding, <= 1 bf16 ulp);
                        "exact": FP32 GEMM of q*s, then the scales (what the hardware computes, up
                        to summation order).
    kernels:            "auto" (default), "eager" or "compiled": how the operands' quantizers run
                        (nvfp4_recipe.kernels); all three compute the same bits.
    """

    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    gemm: Gemm = Gemm.fast
    kernels: str = "auto"

    def __post_init__(self) -> None:
        _check_gemm(self.gemm, "NVFP4Config")
        check_kernel_mode(self.kernels, "NVFP4Config")


@dataclass(frozen=True)
class MXFP4Config:
    """MXFP4 comparison: 1x32 E8M0-scaled blocks on all operands, nearest rounding; optional SR on
    the gradient operands (default off)."""

    stochastic_rounding: bool = False
    gemm: Gemm = Gemm.fast

    def __post_init__(self) -> None:
        _check_gemm(self.gemm, "MXFP4Config")


@dataclass(frozen=True)
class FP8BlockConfig:
    """FP8 E4M3 block scaling as TE Float8BlockScaling: weights 128x128, activations and gradients
    1x128, nearest rounding, power-of-two FP32 scales (TE's default)."""

    power_2_scales: bool = True
    gemm: Gemm = Gemm.fast

    def __post_init__(self) -> None:
        _check_gemm(self.gemm, "FP8BlockConfig")


@dataclass(frozen=True)
class MXFP8Config:
    """MXFP8 as TE MXFP8BlockScaling with its default E4M3 format (TE common/recipe/__init__.py,
    v2.0:165 .. release_v2.19:337): E4M3 values and one E8M0 scale per 1x32 block on every
    operand, the blocks along each GEMM's reduction dimension; nearest rounding, no RHT, no SR.
    kernels: "auto" (default), "eager" or "compiled": how the quantizer runs (nvfp4_recipe/mxfp8.py,
    "Kernels"); the same bits."""

    gemm: Gemm = Gemm.fast
    kernels: str = "auto"

    def __post_init__(self) -> None:
        _check_gemm(self.gemm, "MXFP8Config")
        check_kernel_mode(self.kernels, "MXFP8Config")


QuantConfig = NVFP4Config | MXFP4Config | MXFP8Config | FP8BlockConfig


@dataclass(frozen=True)
class PassConfigs:
    """The config of each GEMM of one linear y = x W^T: Fprop (y), Dgrad (dx), Wgrad (dW); None
    runs that GEMM on the unquantized BF16 operands. A GEMM's two operands are quantized with its
    own pass's config (nvfp4_recipe/linear.py), so a linear may run, say, an MXFP8 Fprop with NVFP4
    gradients, and the late switch to BF16 is a PassConfigs with some passes None."""

    fprop: QuantConfig | None = None
    dgrad: QuantConfig | None = None
    wgrad: QuantConfig | None = None

    @classmethod
    def every(cls, config: QuantConfig | None) -> "PassConfigs":
        """One config (or BF16) for all three GEMMs."""
        return cls(config, config, config)

    @property
    def quantized(self) -> bool:
        """Whether any GEMM is quantized (all None: the linear is exactly F.linear)."""
        return any(c is not None for c in (self.fprop, self.dgrad, self.wgrad))
