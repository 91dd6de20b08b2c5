"""Parameters and activation memory of the hybrid model, per layer and per rank: the memory half of
the model's accounting (model/flops.py is the FLOP half). training/plan.py turns these into the
per-rank memory of a run; benchmarks/memory.py checks them against a CPU run.

P = parameters, b = micro-batch, s = sequence length, t = tensor parallel, p = pipeline parallel,
h = hidden; GiB = 2^30 bytes.

Parameters per rank
    A parameter is *TP-sharded* when it belongs to a megatron tensor-parallel linear or the
    vocab-parallel embedding, or carries `tensor_model_parallel=True` (the Mamba conv1d, A_log,
    D, dt_bias and gated-norm weight); it holds numel / t elements per rank. Everything else
    (the RMSNorm weights before each layer and the final norm) is replicated: numel per rank.
    Stages split the pattern as megatron's `MambaStack._select_layers_for_pipeline_parallel`
    (even split, or `parallel.first_stage_layers` / `last_stage_layers`); the embedding lives on
    the first stage, the final norm and the output layer on the last. P_rank is per stage.

Activations of one micro-batch (BF16, 2 B per element; sp = t with parallel.sequence, else 1)
    per layer, elements per token; the h-wide terms outside the TP-sharded regions (the norm's
    input, the first linear's input) are / sp, everything inside / t, as in Korthikanti et al.
    2022 (arXiv 2205.05198, Table 2: with sequence parallelism every term is / t):
        mamba     2h / sp (norm in, in_proj in) + [in_proj out (2 d_inner + 2 g N + H: also
                  the conv's input and the gate z) + conv out (d_inner + 2 g N: the scan's x, B,
                  C) + scan out (d_inner: the gated norm's input) + out_proj in (d_inner)] / t;
                  mamba_ssm's gated RMSNorm saves its x and z, not x * silu(z)
                  (ops/triton/layernorm_gated.py, LayerNormFn.forward)
        attention 2h / sp (norm in, qkv in) + [qkv out ((n_q + 2 n_kv) d_head)
                  + context = proj in (n_q d_head)] / t; flash-style kernels keep no s^2 score
                  matrix (their per-row log-sum-exp is neglected)
        mlp       2h / sp (norm in, fc1 in) + [fc1 out (f) + activation out (f)] / t
    (plan backend te) a low-precision linear keeps its input for Wgrad as TE quantized it, not
      in BF16 (te_layer_activation_bytes_per_token): one copy, the column-wise one, of the Wgrad
      pass's format, QUANTIZED_BYTES_PER_ELEMENT per element. TE quantizes the input row- and
      column-wise for Fprop and drops the row-wise data before saving it (linear.py: v2.8:370-390,
      v2.18:560-577; the norm-fused in_proj / qkv / fc1, layernorm_linear.py v2.8:404-414,
      v2.18:459-469, save the quantized norm output, no BF16 one: the norm is quantizing). So
      in_proj_in, qkv_in, fc1_in, out_proj_in and fc2's input (activation_out) shrink to the
      quantized bytes. Exceptions, from the same lines: under sequence parallelism the norm-fused
      linears keep the row-wise NVFP4 data too (all-gathered for Wgrad; MXFP8 and FP8 block
      gather column-wise data): two copies; and the attention output projection's input is also
      the attention output that TE's fused attention saves in BF16 (q, k, v, out:
      attention/dot_product_attention/backends.py v2.8:1240-1276), so its quantized copy comes on
      top of `context`.
    + (plan backend emulated) each low-precision linear whose Dgrad reads Fprop's weight copy
      (NVFP4 16x16, FP8 block: emulated_keeps_weight_copy) saves it (BF16 values): 2 B x its
      weight elements per rank, per micro-batch (nvfp4_recipe/linear.py).
    last stage: + final-norm input and output-layer input (2h / sp per token); and at the end of
      the forward the logits, b s V/t x 6 B: the output layer's BF16 logits (2 B) and the FP32
      copy the vocab-parallel cross entropy turns into its saved softmax (4 B; Megatron-LM counts
      those 4 B, theoretical_memory_usage.py:368-376 at core_v0.19.0).
    Recompute (trainer.recompute, model/recompute.py):
        none       every layer keeps everything above.
        selective  megatron's core-attention recompute (and on the portable spec the Mamba conv1d
                   + SSD scan): the kernels this model counts (flash attention, mamba_ssm's fused
                   scan) keep only their inputs already, so it saves nothing here.
        full       each stage's layers split as `checkpointed_chunks` (megatron's uniform: chunks
                   of recompute_layers layers; block: the first recompute_layers layers one by
                   one, the rest not recomputed); a checkpointed chunk keeps its input only,
                   s b h / sp x 2 B, and its full activations exist again while its backward runs.
"""

from __future__ import annotations

from typing import Optional

from nvfp4_recipe.passes import PassFormats

from .recompute import checkpointed_chunks

GIB = 2**30
BYTES_ACTIVATION = 2  # BF16 activations
BYTES_LOGITS = 6  # BF16 logits + the FP32 copy the vocab-parallel cross entropy keeps
BYTES_EMULATED_WEIGHT_COPY = 2  # the emulated low-precision linear's saved BF16 weight values


def emulated_keeps_weight_copy(fmt: str, weight_2d: bool) -> bool:
    """Whether an emulated linear of format `fmt` (or per-pass map "fprop/dgrad/wgrad") keeps
    Fprop's weight copy for Dgrad: only where both passes share the format and its Dgrad reads
    the copy (NVFP4's 16x16 tiles, FP8's 128x128 blocks; MX formats quantize W^T afresh,
    nvfp4_recipe/operands.py dgrad_reuses_fprop_weight)."""
    passes = PassFormats(fmt)
    if passes.fprop != passes.dgrad:
        return False
    return passes.fprop == "fp8" or (passes.fprop == "nvfp4" and weight_2d)
# Bytes per element of one quantized copy of a tensor (one usage: rowwise or columnwise), its
# block scales included, as TE stores it:
#   nvfp4  0.5 B (two E2M1 codes a byte) + one E4M3 scale per 16 (the FP32 tensor scale: 0);
#   fp8    1 B; its FP32 scale per 128x128 weight block (4 B per 16,384) neglected;
#   mxfp8  1 B (E4M3) + one E8M0 scale byte per 32: TE's MXFP8Tensor holds, per usage, data of
#          the tensor's shape and a scale_inv of (rows, cols / 32) rowwise, (rows / 32, cols)
#          columnwise (v2.18 pytorch/tensor/mxfp8_tensor.py:103-140, get_scale_shape; padded to
#          128 x 4 scale tiles, neglected), as this project's quantize_mxfp8 (data
#          float8_e4m3fn, scales float8_e8m0fnu).
QUANTIZED_BYTES_PER_ELEMENT = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0, "mxfp8": 1 + 1 / 32}


def pipeline_stages(num_layers: int, pipeline: int, first: Optional[int] = None,
                    last: Optional[int] = None) -> list[range]:
    """Layer indices per stage, as megatron-core 0.16's `_select_layers_for_pipeline_parallel`."""
    if pipeline == 1:
        return [range(num_layers)]
    if first is None and last is None:
        if num_layers % pipeline:
            raise ValueError(
                f"the {num_layers}-layer pattern does not split evenly into parallel.pipeline="
                f"{pipeline} stages: set parallel.first_stage_layers / last_stage_layers")
        n = num_layers // pipeline
        return [range(i * n, (i + 1) * n) for i in range(pipeline)]
    f, l = first or 0, last or 0
    middle_stages = pipeline - sum(x is not None for x in (first, last))
    middle = num_layers - f - l
    if middle < 0 or (middle_stages > 0 and middle % middle_stages) or (middle_stages == 0 and middle):
        raise ValueError(
            f"parallel.first_stage_layers={first} / last_stage_layers={last} leave {middle} "
            f"layers for {middle_stages} middle stage(s): they must divide evenly")
    per = middle // middle_stages if middle_stages else 0
    stages, start = [], 0
    for rank in range(pipeline):
        if first is not None and rank == 0:
            n = f
        elif last is not None and rank == pipeline - 1:
            n = l
        else:
            n = per
        stages.append(range(start, start + n))
        start += n
    return stages


# -- parameters ---------------------------------------------------------------------------------


def sharded_param_ids(module) -> set[int]:
    """ids of the TP-sharded parameters of a module (see the module docstring)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    ids = set()
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            ids.update(id(p) for p in m.parameters(recurse=False))
        elif isinstance(m, RowParallelLinear):
            ids.add(id(m.weight))  # a row-parallel bias would be replicated
    for p in module.parameters():
        if getattr(p, "tensor_model_parallel", False):
            ids.add(id(p))
    return ids


def parameter_counts(module, sharded: set[int], tensor: int) -> tuple[int, int]:
    """(full parameters, parameters per rank) of a module."""
    full = rank = 0
    for p in module.parameters():
        n = p.numel()
        full += n
        if id(p) in sharded:
            if n % tensor:
                raise ValueError(f"a parameter of {n} elements does not split into "
                                 f"parallel.tensor={tensor} shards")
            rank += n // tensor
        else:
            rank += n
    return full, rank


def linear_weight_counts(module, sharded: set[int], tensor: int) -> tuple[int, int]:
    """(full, per rank) weights of the tensor-parallel linears in a module (biases excluded)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    full = rank = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None:
            full += m.weight.numel()
            rank += m.weight.numel() // tensor if id(m.weight) in sharded else m.weight.numel()
    return full, rank


# -- activations ----------------------------------------------------------------------------------


def activation_elements_per_token(kind: str, m, tensor: int,
                                  sequence_parallel: bool = False) -> dict[str, float]:
    """Saved activation elements per token of one layer on one TP rank (module docstring)."""
    h = m.hidden_size / (tensor if sequence_parallel else 1)  # outside the TP-sharded regions
    if kind == "mamba":
        d_inner = m.mamba_num_heads * m.mamba_head_dim
        gn = 2 * m.mamba_num_groups * m.mamba_state_dim
        return {"norm_in": h, "in_proj_in": h,
                "in_proj_out": (2 * d_inner + gn + m.mamba_num_heads) / tensor,
                "conv_out": (d_inner + gn) / tensor, "scan_out": d_inner / tensor,
                "out_proj_in": d_inner / tensor}
    if kind == "attention":
        d = m.kv_channels
        return {"norm_in": h, "qkv_in": h,
                "qkv_out": (m.num_attention_heads + 2 * m.num_query_groups) * d / tensor,
                "context": m.num_attention_heads * d / tensor}
    if kind == "mlp":
        f = m.ffn_hidden_size
        return {"norm_in": h, "fc1_in": h, "fc1_out": f / tensor, "activation_out": f / tensor}
    if kind == "moe":
        # The router's input (the norm's output), the top-k dispatched copies of each token and
        # what each routed expert keeps (whole: expert tensor parallel 1), the shared expert
        # split over the tensor group as a dense MLP.
        k, f_e = m.moe.topk, m.moe.ffn_hidden_size
        f_s = m.moe.shared_expert_ffn_hidden_size or 0
        return {"norm_in": h, "router_in": h, "dispatched": k * m.hidden_size,
                "expert_fc1_out": k * f_e, "expert_activation_out": k * f_e,
                "shared_fc1_out": f_s / tensor, "shared_activation_out": f_s / tensor}
    raise ValueError(f"unknown layer kind {kind!r}")


# Per layer kind, each linear's saved GEMM input under TE: (linear, its entry in
# activation_elements_per_token, norm fused into the linear, another op saves the BF16 tensor
# too). Module names as the precision policy's (the plan reads each built linear's format).
TE_LINEAR_INPUTS = {
    "mamba": (("mixer.in_proj", "in_proj_in", True, False),
              ("mixer.out_proj", "out_proj_in", False, False)),
    "attention": (("self_attention.linear_qkv", "qkv_in", True, False),
                  ("self_attention.linear_proj", "context", False, True)),
    "mlp": (("mlp.linear_fc1", "fc1_in", True, False),
            ("mlp.linear_fc2", "activation_out", False, False)),
}


def te_saved_input_bytes(fmt: str, norm_fused: bool, sequence_parallel: bool) -> float:
    """Bytes per element of the input a TE linear of format `fmt` (or a per-pass map) keeps for
    its backward (module docstring): the Wgrad pass's format's column-wise copy, twice for a
    norm-fused NVFP4 linear under sequence parallelism; BF16's 2 B where Wgrad runs in BF16."""
    wgrad = PassFormats(fmt).wgrad
    if wgrad not in QUANTIZED_BYTES_PER_ELEMENT:
        return BYTES_ACTIVATION
    copies = 2 if norm_fused and sequence_parallel and wgrad == "nvfp4" else 1
    return copies * QUANTIZED_BYTES_PER_ELEMENT[wgrad]


def te_layer_activation_bytes_per_token(kind: str, m, tensor: int, sequence_parallel: bool,
                                        linear_formats: dict[str, str]) -> float:
    """Bytes per token one layer keeps on one TP rank under TE: the BF16 elements of
    activation_elements_per_token, with each low-precision linear's saved input in TE's quantized
    form (module docstring). `linear_formats`: {linear module name: format}, the plan's."""
    elements = activation_elements_per_token(kind, m, tensor, sequence_parallel)
    total = BYTES_ACTIVATION * sum(elements.values())
    for linear, entry, norm_fused, shared in TE_LINEAR_INPUTS.get(kind, ()):
        per_element = te_saved_input_bytes(linear_formats.get(linear, "bf16"), norm_fused,
                                           sequence_parallel)
        if shared:  # the BF16 tensor stays (another op's); a quantized copy is extra
            total += 0 if per_element == BYTES_ACTIVATION else per_element * elements[entry]
        else:
            total += (per_element - BYTES_ACTIVATION) * elements[entry]
    return total


def stage_activation_bytes(layer_bytes: list[int], input_bytes: int, recompute) -> dict[str, int]:
    """One micro-batch on one stage: {"kept": what stays from its forward to its backward,
    "recompute_peak": the most alive while a checkpointed chunk's backward runs (0 without
    full recompute)}. `layer_bytes[i]`: layer i's full activations; `input_bytes`: one layer
    input (what a checkpointed chunk keeps)."""
    kept, peak = 0, 0
    for start, end, checkpointed in checkpointed_chunks(len(layer_bytes), recompute):
        full = sum(layer_bytes[start:end])
        if checkpointed:
            peak = max(peak, kept + full)  # the chunks after this one are freed by then
            kept += input_bytes
        else:
            kept += full
    return {"kept": kept, "recompute_peak": peak}

