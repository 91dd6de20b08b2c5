"""Model FLOPs per token of a training step: the one count the planner (training/plan.py, run time)
and the hardware bench (benchmarks/hardware.py, MFU) share; model/memory_model.py counts the memory.

fwd + bwd = 3 x forward for every term (the backward of a GEMM is two GEMMs of the same size).
With m = a ModelConfig, s = sequence length, V = the padded vocabulary:

    gemm        6 x N_gemm, N_gemm = the weights of every linear a token passes through + the output
                layer (V x h). The
                embedding is a lookup, not a GEMM. Per layer:
                  mamba      h (2 d_inner + 2 g N + H) (in_proj: z, x, B, C, dt)
                             + d_inner h (out_proj)
                  attention  h (n_q + 2 n_kv) d (linear_qkv) + n_q d h (linear_proj)
                  mlp        2 h f (fc1, fc2; squared ReLU, no gate)
                  moe        k 2 h f_e + 2 h f_s + h E: the top-k routed experts a token passes
                             (of E, each of width f_e), the shared expert (f_s) and the FP32 router;
                             N_gemm counts the active weights, and the built model holds
                             E 2 h f_e + 2 h f_s in its linears (`layer_gemm_weights`).
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
    if kind == "moe":
        return m.moe.num_experts * _expert_weights(m) + _shared_expert_weights(m)
    raise ValueError(f"unknown layer kind {kind!r}")


def _expert_weights(m) -> int:
    return 2 * m.hidden_size * m.moe.ffn_hidden_size


def _shared_expert_weights(m) -> int:
    f = m.moe.shared_expert_ffn_hidden_size
    return 0 if f is None else 2 * m.hidden_size * f


def layer_active_gemm_weights(kind: str, m) -> int:
    """The GEMM weights one token passes through in a layer of `kind`: an MoE layer's top-k
    experts, its shared expert and its router; every weight of the other kinds."""
    if kind != "moe":
        return layer_gemm_weights(kind, m)
    return (m.moe.topk * _expert_weights(m) + _shared_expert_weights(m)
            + m.hidden_size * m.moe.num_experts)


def inactive_parameters(m) -> int:
    """The parameters a token does not use: in every MoE layer, the routed experts it is not
    sent to. Active parameters = all parameters - this."""
    if m.moe is None:
        return 0
    return m.layer_kinds().count("moe") * (m.moe.num_experts - m.moe.topk) * _expert_weights(m)


def gemm_weights(m, vocab_padded: int) -> int:
    """The weights of the linears of every layer + the output layer (what the model holds)."""
    return sum(layer_gemm_weights(k, m) for k in m.layer_kinds()) + m.hidden_size * vocab_padded


def active_gemm_weights(m, vocab_padded: int) -> int:
    """N_gemm: the GEMM weights one token passes through (= gemm_weights without MoE layers)."""
    return (sum(layer_active_gemm_weights(k, m) for k in m.layer_kinds())
            + m.hidden_size * vocab_padded)


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
    terms = {"gemm": 6.0 * active_gemm_weights(m, vocab_padded), "attention": 0.0, "ssd_scan": 0.0,
             "conv1d": 0.0}
    for kind in m.layer_kinds():
        for key, value in layer_nongemm_flops(kind, m, seq).items():
            terms[key] += value
    terms["total"] = terms["gemm"] + terms["attention"] + terms["ssd_scan"] + terms["conv1d"]
    return terms


def flops_per_token(m, seq: int, vocab_padded: int) -> float:
    """Model FLOPs per token of one training step (fwd + bwd)."""
    return flops_per_token_terms(m, seq, vocab_padded)["total"]
