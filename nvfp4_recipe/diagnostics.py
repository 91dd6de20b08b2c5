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
    MXFP8: 1x32 E4M3 with E8M0 scales, nearest, every role alike (TE's MXFP8BlockScaling has no
    2-D weights and no SR). FP8 block: weight 128x128, others 1x128. x must be 2-D (weights) or
    (..., K). Each format's rule is its emulated ops' `quantize_dequantize`
    (nvfp4_recipe/operands.py).
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not supported; use one of {ROLES}")
    ops = ops_for(config)
    return ops.quantize_dequantize(x, role, _private_generator(x.device))


def _private_generator(device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with _DIAGNOSTICS_SEED (seeding is host-side: no sync)."""
    return torch.Generator(device=device).manual_seed(_DIAGNOSTICS_SEED)


def quantization_error_tensors(
    x: torch.Tensor, config: QuantConfig, role: Role = "activation"
) -> dict[str, torch.Tensor]:
    """quantization_error_stats as 0-d FP32 tensors on x's device, computed without a host sync:
    a caller that records many layers reads them all at once (training/precision.py reads a
    step's diagnostics with one `.tolist()`), instead of ~5 syncs per role per linear."""
    with torch.no_grad():
        x_hat = quantize_dequantize(x, config, role)
        x32 = x.detach().float()
        norm = torch.linalg.vector_norm(x32)
        error = torch.linalg.vector_norm(x_hat - x32)
        nonzero = x32 != 0
        n_nonzero = nonzero.sum()
        flushed = (nonzero & (x_hat == 0)).sum()
        zero = torch.zeros((), dtype=torch.float32, device=x32.device)
        return {
            "rel_error": torch.where(norm > 0, error / norm.clamp_min(torch.finfo(torch.float32).tiny), zero),
            "zero_frac": torch.where(n_nonzero > 0, flushed / n_nonzero.clamp_min(1), zero).float(),
            "amax": x32.abs().amax() if x32.numel() else zero,
        }


def quantization_error_stats(
    x: torch.Tensor, config: QuantConfig, role: Role = "activation"
) -> dict[str, float]:
    """{"rel_error": ||Q(x) - x|| / ||x||, "zero_frac": fraction of nonzero inputs that quantize to
    zero, "amax": max |x|} for x quantized as `role` under `config` (see quantize_dequantize).

    An all-zero x gives rel_error 0 and zero_frac 0. Uses a private RNG for stochastic rounding.
    One host sync (quantization_error_tensors reads the same values without any).
    """
    stats = quantization_error_tensors(x, config, role)
    values = torch.stack(list(stats.values())).tolist()
    return dict(zip(stats, values))
