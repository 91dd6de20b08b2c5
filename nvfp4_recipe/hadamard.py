"""The 16-point random Hadamard transform (RHT) TE applies to both Wgrad operands."""

from __future__ import annotations

import torch

RHT_SIZE = 16
# TE's fixed sign vector (get_wgrad_sign_vector), shared by all layers for the whole run.
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)

_matrix_cache: dict[tuple[tuple[float, ...], torch.device, torch.dtype], torch.Tensor] = {}


def sylvester_hadamard(size: int = RHT_SIZE) -> torch.Tensor:
    """The +-1 Sylvester Hadamard matrix of a power-of-two size, float32."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(
    signs: tuple[float, ...] | torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """H = diag(signs) @ Sylvester16 / 4 (orthogonal; entries +-1/4, exact in any float dtype)."""
    if signs is None:
        signs = TE_RHT_SIGNS
    sign_values = tuple(float(s) for s in (signs.tolist() if isinstance(signs, torch.Tensor) else signs))
    if len(sign_values) != RHT_SIZE or any(s not in (1.0, -1.0) for s in sign_values):
        raise ValueError(f"signs must be 16 values of +1 or -1, got {sign_values}")
    key = (sign_values, torch.device(device), dtype)
    if key not in _matrix_cache:
        h = torch.diag(torch.tensor(sign_values)) @ sylvester_hadamard(RHT_SIZE) / 4.0
        _matrix_cache[key] = h.to(device=device, dtype=dtype)
    return _matrix_cache[key]


def random_hadamard_transform(
    x: torch.Tensor,
    signs: tuple[float, ...] | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Apply H to each run of 16 along the last dim: x.view(-1, 16) @ H, H = diag(signs) Syl16 / 4.

    Computed in float32 (float64 for float64 input); returned in `out_dtype` (default x.dtype).
    The last dim must be a multiple of 16. `signs` defaults to TE's fixed vector.
    """
    if x.dim() == 0 or x.shape[-1] % RHT_SIZE != 0:
        raise ValueError(
            f"random_hadamard_transform: last dimension of shape {tuple(x.shape)} must be a "
            f"multiple of {RHT_SIZE}; pad it with zeros"
        )
    if not x.is_floating_point():
        raise ValueError(f"random_hadamard_transform: need a floating-point tensor, got {x.dtype}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = rht_matrix(signs, x.device, compute)
    y = torch.mm(x.reshape(-1, RHT_SIZE).to(compute), h).view(x.shape)
    return y.to(out_dtype or x.dtype)
