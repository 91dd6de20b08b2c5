"""Model FLOPs per token of a training step: the one count the planner (training/plan.py, run time)
and the hardware bench (benchmarks/hardware.py, MFU) share; model/memory_model.py counts the memory.

fwd + bwd = 3 x forward for every term (the backward of a GEMM is two GEMMs of the same size).
With m = a ModelConfig, s = sequence length, V = the padded vocabulary:

    gemm        6 x N_gemm, N_gemm = the weights of every linear + the output layer (V x h). The
                embedding is a lookup, not a GEMM. Per layer:
                  mamba      h (2 d_inner + 2 g N + H) (in_proj: z, x, B, C, dt)
                             + d_inner h (out_proj)
                  attention  h (n_q + 2 n_kv) d (linear_qkv) + n_q d h (linear_proj)
                  mlp        2 h f (fc1, fc2; squared ReLU, no gate)
    attention   6 x n_q d s / 2 x 2 per attention layer = 6 n_q d s: Q K^T and scores x V (2 x 2 d
                FLOPs per query-key pair) over the causal mean context of s / 2 keys, which is what
                flash kernels compute.
    ssd_scan    3 x [2 g Q N + H (2 Q P + 4 N P)] per Mamba layer (chunk Q, H heads of dim P,
                state N, g groups): the intra-chunk C B^T (per group) and its product with x (per
                head) over full Q x Q blocks, the chunk states B^T x and their read-out C h (per
                head); the inter-chunk state passing (H P N per chunk, / Q per token) is neglected.
    conv1d      3 x 2 k (d_inner + 2 g N) per Mamba layer (depthwise, kernel k = 4: megatron's
                MambaMixer default d_conv).
Not counted: norms, activations, softmax, gating, the optimizer (not tensor-core work). With
activation recompute the hardware runs more FLOPs than these (a second forward of what is
recomputed); MFU is on model FLOPs, so recompute shows up as a lower MFU, not a larger count.
"""

from __future__ import annotations

MAMBA_CONV_KERNEL = 4  # megatron's MambaMixer d_conv default (the model does not override it)


def layer_gemm_weights(kind: str, m) -> int:
    """Weights of the linears of one layer of `kind` (all TP shards together)."""
    h = m.hidden_size
    if kind == "mamba":
        d_inner = m.mamba_num_heads * m.mamba_head_dim
        in_proj = h * (2 * d_inner + 2 * m.mamba_num_groups * m.mamba_state_dim
                       + m.mamba_num_heads)
        return in_proj + d_inner * h
    if kind == "attention":
        q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
        return h * (q + 2 * kv) + q * h
    if kind == "mlp":
        return 2 * h * m.ffn_hidden_size
    raise ValueError(f"unknown layer kind {kind!r}")


def gemm_weights(m, vocab_padded: int) -> int:
    """N_gemm: the linears of every layer + the output layer."""
    return sum(layer_gemm_weights(k, m) for k in m.layer_kinds()) + m.hidden_size * vocab_padded


def layer_nongemm_flops(kind: str, m, seq: int) -> dict[str, float]:
    """The attention-score / SSD-scan / conv1d FLOPs per token of one layer, fwd + bwd."""
    if kind == "attention":
        return {"attention": 6.0 * m.num_attention_heads * m.kv_channels * seq}
    if kind == "mamba":
        q, n, g = m.mamba_chunk_size, m.mamba_state_dim, m.mamba_num_groups
        heads, p = m.mamba_num_heads, m.mamba_head_dim
        scan = 2 * g * q * n + heads * (2 * q * p + 4 * n * p)
        conv = 2 * MAMBA_CONV_KERNEL * (heads * p + 2 * g * n)
        return {"ssd_scan": 3.0 * scan, "conv1d": 3.0 * conv}
    return {}


def flops_per_token_terms(m, seq: int, vocab_padded: int) -> dict[str, float]:
    """{gemm, attention, ssd_scan, conv1d, total} model FLOPs per token (module docstring)."""
    terms = {"gemm": 6.0 * gemm_weights(m, vocab_padded), "attention": 0.0, "ssd_scan": 0.0,
             "conv1d": 0.0}
    for kind in m.layer_kinds():
        for key, value in layer_nongemm_flops(kind, m, seq).items():
            terms[key] += value
    terms["total"] = terms["gemm"] + terms["attention"] + terms["ssd_scan"] + terms["conv1d"]
    return terms


def flops_per_token(m, seq: int, vocab_padded: int) -> float:
    """Model FLOPs per token of one training step (fwd + bwd)."""
    return flops_per_token_terms(m, seq, vocab_padded)["total"]
