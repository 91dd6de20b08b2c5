"""Chunked SSD (state-space duality) scan for Mamba-2, in plain PyTorch.

This is the CPU path of :class:`model.mamba_mixer.MambaMixer` and the tested twin of
``mamba_ssm``'s ``mamba_chunk_scan_combined`` Triton kernel (same argument layout).

Recurrence computed (per batch b, head h, channel p, state n)::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t x_t^T
    y_t = C_t h_t + D * x_t

The algorithm is the "minimal discrete" chunked SSD of the Mamba-2 paper:

1. within each chunk, the quadratic (attention-like) form with a segment-sum decay mask;
2. the state each chunk leaves behind (its inputs decayed to the chunk end);
3. state passing between chunks (a segment-sum over the chunk-level decays, so no Python loop);
4. the contribution of the state entering each chunk to that chunk's outputs.

Everything inside runs in float32 (or float64 if the inputs are float64) with autocast off;
the output is cast back to the dtype of ``x``.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ["segsum", "ssd_chunk_scan"]


def segsum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sum: ``out[..., i, j] = sum_{k=j+1}^{i} x[..., k]`` for ``i >= j``, ``-inf`` above.

    ``exp(segsum(log_decay))`` is the lower-triangular matrix of decays from step j to step i.
    Built with a masked cumsum (no subtraction of large cumulative sums), so it is exact for
    long chunks and its gradient is zero (not NaN) in the masked part.
    """
    T = x.size(-1)
    xe = x.unsqueeze(-1).expand(*x.shape, T)  # xe[..., i, j] = x[..., i]
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    xe = xe.masked_fill(~strict, 0.0)
    out = torch.cumsum(xe, dim=-2)  # out[..., i, j] = sum_{j < k <= i} x_k
    incl = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~incl, float("-inf"))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Chunked SSD scan (same layout as ``mamba_ssm``'s ``mamba_chunk_scan_combined``).

    Args:
        x: (batch, seqlen, nheads, headdim)
        dt: (batch, seqlen, nheads) — raw; ``dt_bias`` is added and softplus applied if asked
        A: (nheads,) — negative decay rates (``-exp(A_log)``)
        B, C: (batch, seqlen, ngroups, dstate); nheads % ngroups == 0, head h uses group
            ``h // (nheads // ngroups)`` (mamba_ssm's convention)
        chunk_size: chunk length; seqlen need not be a multiple of it (padded internally)
        D: (nheads,) or (nheads, headdim) skip, optional
        dt_bias: (nheads,), optional
        dt_softplus: apply softplus to ``dt + dt_bias``
        initial_states: (batch, nheads, headdim, dstate), optional
        return_final_states: also return the state after the last step

    Returns:
        y (batch, seqlen, nheads, headdim) in ``x.dtype``; and the final states
        (batch, nheads, headdim, dstate, float32/64) if ``return_final_states``.
    """
    out_dtype = x.dtype
    cdt = _compute_dtype(x)
    device_type = x.device.type
    with torch.autocast(device_type=device_type, enabled=False):
        bsz, seqlen, nheads, headdim = x.shape
        ngroups, dstate = B.shape[-2], B.shape[-1]
        assert dt.shape == (bsz, seqlen, nheads), dt.shape
        assert B.shape == (bsz, seqlen, ngroups, dstate) and C.shape == B.shape, (B.shape, C.shape)
        assert nheads % ngroups == 0, (nheads, ngroups)
        hpg = nheads // ngroups  # heads per group

        xf = x.to(cdt)
        dtf = dt.to(cdt)
        if dt_bias is not None:
            dtf = dtf + dt_bias.to(cdt)
        if dt_softplus:
            dtf = F.softplus(dtf)
        Af = A.to(cdt)
        Bf = B.to(cdt)
        Cf = C.to(cdt)

        # Pad the sequence to a multiple of the chunk: dt = 0 there, i.e. decay 1 and no input,
        # so neither the outputs of real steps nor the final state change.
        pad = (-seqlen) % chunk_size
        X = xf * dtf.unsqueeze(-1)  # discretised input
        dA = dtf * Af  # (b, l, h) log-decay per step
        if pad:
            X = F.pad(X, (0, 0, 0, 0, 0, pad))
            dA = F.pad(dA, (0, 0, 0, pad))
            Bp = F.pad(Bf, (0, 0, 0, 0, 0, pad))
            Cp = F.pad(Cf, (0, 0, 0, 0, 0, pad))
        else:
            Bp, Cp = Bf, Cf
        L = seqlen + pad
        nc = L // chunk_size
        cs = chunk_size

        # Layouts: heads split as (group g, head-in-group r) so B/C are never repeated per head.
        X = X.reshape(bsz, nc, cs, ngroups, hpg, headdim)  # b c l g r p
        Bc = Bp.reshape(bsz, nc, cs, ngroups, dstate)  # b c l g n
        Cc = Cp.reshape(bsz, nc, cs, ngroups, dstate)  # b c l g n
        dA = dA.reshape(bsz, nc, cs, ngroups, hpg).permute(0, 3, 4, 1, 2)  # b g r c l
        dA_cs = torch.cumsum(dA, dim=-1)  # b g r c l

        # 1. Intra-chunk (diagonal blocks): y_i = sum_{j<=i} (C_i . B_j) exp(sum_{j<k<=i} dA_k) X_j
        decay = torch.exp(segsum(dA))  # b g r c l s
        CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # shared by the heads of a group
        scores = decay * CB.unsqueeze(2)  # b g r c l s
        Y = torch.einsum("bgrcls,bcsgrp->bclgrp", scores, X)

        # 2. State each chunk leaves behind, from its own inputs only.
        decay_to_end = torch.exp(dA_cs[..., -1:] - dA_cs)  # b g r c l
        Xd = X * decay_to_end.permute(0, 3, 4, 1, 2).unsqueeze(-1)  # b c l g r p
        states = torch.einsum("bclgn,bclgrp->bcgrpn", Bc, Xd)

        # 3. State passing between chunks: state entering chunk c is
        #    sum_{c' < c} exp(sum of chunk decays c'+1 .. c-1) * states[c'] (+ decayed initial).
        if initial_states is None:
            init = torch.zeros(bsz, 1, ngroups, hpg, headdim, dstate, dtype=cdt, device=x.device)
        else:
            init = initial_states.to(cdt).reshape(bsz, 1, ngroups, hpg, headdim, dstate)
        states = torch.cat([init, states], dim=1)  # b (c+1) g r p n
        chunk_decay = torch.exp(segsum(F.pad(dA_cs[..., -1], (1, 0))))  # b g r (c+1) (c+1)
        new_states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)
        states_in, final_states = new_states[:, :-1], new_states[:, -1]

        # 4. Contribution of the entering state to each step of its chunk.
        decay_from_start = torch.exp(dA_cs).permute(0, 3, 4, 1, 2)  # b c l g r
        Y_off = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, states_in)
        Y = Y + Y_off * decay_from_start.unsqueeze(-1)

        Y = Y.reshape(bsz, L, nheads, headdim)[:, :seqlen]
        if D is not None:
            Df = D.to(cdt)
            Df = Df.view(1, 1, nheads, 1) if Df.dim() == 1 else Df.view(1, 1, nheads, headdim)
            Y = Y + xf * Df
        Y = Y.to(out_dtype)

    if return_final_states:
        return Y, final_states.reshape(bsz, nheads, headdim, dstate)
    return Y

