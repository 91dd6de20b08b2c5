"""Independent references of the Mamba-2 mixer for the tests of model/mamba_mixer.py and
model/ssd.py in both tiers: the step-by-step SSM recurrence, and the mixer's forward from its
parameters (sharing no code with the chunked scan, the conv or the norm); and the tiny mixer the
tests build, as megatron's MambaLayer builds one."""

from __future__ import annotations

import torch


def naive_ssm(x, dt, A, B, C, D, h0=None):
    """Step-by-step recurrence, one head at a time.

    x (b, l, H, P); dt (b, l, H) (already positive); A (H,) negative; B, C (b, l, G, N); D (H,).
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T ;  y_t = h_t C_t + D x_t.  Head hh uses group
    hh // (H // G).
    """
    b, l, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    per_group = H // G
    h = torch.zeros(b, H, P, N, dtype=x.dtype) if h0 is None else h0.clone()
    y = torch.empty_like(x)
    for t in range(l):
        for hh in range(H):
            g = hh // per_group
            decay = torch.exp(dt[:, t, hh] * A[hh])  # (b,)
            inp = dt[:, t, hh, None, None] * x[:, t, hh, :, None] * B[:, t, g, None, :]  # (b,P,N)
            h[:, hh] = decay[:, None, None] * h[:, hh] + inp
            y[:, t, hh] = (h[:, hh] * C[:, t, g, None, :]).sum(-1) + D[hh] * x[:, t, hh]
    return y, h


TINY = dict(hidden=64, heads=8, head_dim=16, state=16, groups=2)


def mixer_config(hidden, heads, head_dim, state, groups, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        mamba_state_dim=state,
        mamba_head_dim=head_dim,
        mamba_num_groups=groups,
        mamba_num_heads=heads,
        **kw,
    )


def build_mixer(config, **kw):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from model.mamba_mixer import MambaMixer, MambaMixerSubmodules

    spec = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        params=kw,
    )
    # Called the way megatron's MambaLayer builds its mixer, less pg_collection: the mixer then
    # takes megatron's global (mpu) process groups.
    return build_module(spec, config, d_model=config.hidden_size, layer_number=1)


def naive_mixer_forward(m, h):
    """Independent forward from the mixer's parameters: in_proj -> split -> causal conv (tap
    loop) -> SiLU -> softplus dt -> naive recurrence -> y*silu(z) -> grouped RMSNorm -> out_proj."""
    s, b, _ = h.shape
    H, P, N, G = m.nheads, m.headdim, m.d_state, m.ngroups
    d_in = H * P
    zxbcdt = h @ m.in_proj.weight.t()  # [s, b, 2*d_in + 2*G*N + H]
    z = zxbcdt[..., :d_in]
    xbc = zxbcdt[..., d_in: 2 * d_in + 2 * G * N]
    dt = zxbcdt[..., 2 * d_in + 2 * G * N:]
    assert dt.shape[-1] == H
    w = m.conv1d.weight[:, 0, :]  # [c, k]
    k = w.shape[1]
    conv = torch.zeros_like(xbc) + m.conv1d.bias
    for j in range(k):  # out[t] = sum_j w[:, j] * in[t - (k-1) + j]
        shift = k - 1 - j
        if shift < s:
            conv[shift:] += w[:, j] * xbc[: s - shift]
    xbc = conv * torch.sigmoid(conv)
    x = xbc[..., :d_in].permute(1, 0, 2).reshape(b, s, H, P)
    Bm = xbc[..., d_in: d_in + G * N].permute(1, 0, 2).reshape(b, s, G, N)
    Cm = xbc[..., d_in + G * N:].permute(1, 0, 2).reshape(b, s, G, N)
    dt = torch.log1p(torch.exp(dt + m.dt_bias)).permute(1, 0, 2)  # softplus
    A = -torch.exp(m.A_log)
    y, _ = naive_ssm(x, dt, A, Bm, Cm, m.D)
    y = y.reshape(b, s, d_in).permute(1, 0, 2)
    g = y * (z * torch.sigmoid(z))
    gs = d_in // G
    gg = g.reshape(s, b, G, gs)
    gg = gg / torch.sqrt((gg * gg).mean(-1, keepdim=True) + 1e-5)
    g = gg.reshape(s, b, d_in) * m.norm.weight
    return g @ m.out_proj.weight.t()
