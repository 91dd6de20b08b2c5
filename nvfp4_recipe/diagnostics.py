"""Per-layer quantization statistics for the trainer (cheap enough to run every N steps)."""

from __future__ import annotations

from typing import Literal

import torch

from nvfp4_recipe.config import QuantConfig
from nvfp4_recipe.linear import ops_for

Role = Literal["activation", "weight", "gradient"]
ROLES = ("activation", "weight", "gradient")
# Stochastic rounding in diagnostics draws from this private stream so that calling the hook never
# moves the global RNG (which would change the training run).
_DIAGNOSTICS_SEED = 0


def quantize_dequantize(x: torch.Tensor, config: QuantConfig, role: Role = "activation") -> torch.Tensor:
    """Q(x) as the rowwise (Fprop / Dgrad) GEMM operand of `role` sees it, in float32.

    NVFP4: activation 1x16 nearest; weight 16x16 (1x16 if config.weight_2d is off) nearest;
    gradient 1x16, stochastic if config.stochastic_rounding. MXFP4: 1x32 (SR on gradients if set).
    FP8 block: weight 128x128, others 1x128. x must be 2-D (weights) or (..., K). Each format's
    rule is its emulated ops' `quantize_dequantize` (nvfp4_recipe/linear.py).
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not supported; use one of {ROLES}")
    ops = ops_for(config)
    generator = torch.Generator(device=x.device).manual_seed(_DIAGNOSTICS_SEED)
    return ops.quantize_dequantize(x, role, generator)


def quantization_error_stats(
    x: torch.Tensor, config: QuantConfig, role: Role = "activation"
) -> dict[str, float]:
    """{"rel_error": ||Q(x) - x|| / ||x||, "zero_frac": fraction of nonzero inputs that quantize to
    zero, "amax": max |x|} for x quantized as `role` under `config` (see quantize_dequantize).

    An all-zero x gives rel_error 0 and zero_frac 0. Uses a private RNG for stochastic rounding.
    """
    with torch.no_grad():
        x_hat = quantize_dequantize(x, config, role)
        x32 = x.detach().float()
        norm = torch.linalg.vector_norm(x32)
        error = torch.linalg.vector_norm(x_hat - x32)
        nonzero = x32 != 0
        n_nonzero = int(nonzero.sum())
        flushed = int((nonzero & (x_hat == 0)).sum())
        return {
            "rel_error": float(error / norm) if float(norm) > 0 else 0.0,
            "zero_frac": flushed / n_nonzero if n_nonzero else 0.0,
            "amax": float(x32.abs().max()) if x32.numel() else 0.0,
        }
