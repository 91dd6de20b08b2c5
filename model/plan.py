"""The dry-run planner: layer precisions, parameters, memory per rank, FLOPs and time of a run.

`dry_run(cfg, ctx)` builds the model on the meta device (no memory, seconds even at 12B) with the
*portable* spec at tensor = pipeline = 1, reads the precision of every linear from the built
modules (each one was chosen by `nvfp4_recipe`'s precision policy) and derives the per-rank
numbers for the layout in `cfg.parallel` analytically, so a single process can plan a
4-way tensor-parallel run. It prints a table and writes `plan.json` into `run.dir`, with the
precision map (`precision_map`) and the preflight (`preflight`: every low-precision GEMM's local
shapes checked against the rules of each backend the run may use, at parallel.tensor and at
tensor 1/2/4/8; nvfp4_recipe/preflight.py). `run_preflight` is the same check at start-up.

Formulas (every number in plan.json comes from one of these; P = parameters, b = micro-batch,
s = sequence length, t = tensor parallel, p = pipeline parallel, d = data parallel):

Parameters per rank
    A parameter is *TP-sharded* when it belongs to a megatron tensor-parallel linear or the
    vocab-parallel embedding, or carries `tensor_model_parallel=True` (the Mamba conv1d, A_log,
    D, dt_bias and gated-norm weight); it holds numel / t elements per rank. Everything else
    (the RMSNorm weights before each layer and the final norm) is replicated: numel per rank.
    Stages split the pattern as megatron's `MambaStack._select_layers_for_pipeline_parallel`
    (even split, or `parallel.first_stage_layers` / `last_stage_layers`); the embedding lives on
    the first stage, the final norm and the output layer on the last. P_rank is the largest stage.
    The vocabulary is padded to a multiple of `model.vocab_multiple` x t, as `build_model` does.

Memory per rank (bytes; GiB = 2^30 bytes)
    static      = 4 P_rank (FP32 master weights) + 4 P_rank (FP32 gradients)
                + 8 P_rank (AdamW exp_avg + exp_avg_sq, FP32; torch AdamW, no distributed
                  optimizer, so every data-parallel replica holds all of it)
                + 2 P_gemm_rank (BF16 working copies of the GEMM weights: the linears and the
                  output layer; embedding and norms are not cast). The emulated linears keep the
                  BF16 copy alive for backward; on TE the FP8/FP4 weight caches are smaller, so
                  this is an upper bound there.
    activations = sum over the busiest stage's layers of
                  elements_per_token(kind) x b x s x 2 B (BF16) x in_flight,
                  elements_per_token (h = hidden; all TP-sharded terms / t; the h-wide terms are
                  replicated because sequence parallelism is off):
                    mamba     2h (norm in, in_proj in) + [in_proj out (2 d_inner + 2 g N + H)
                              + conv out (d_inner + 2 g N) + scan out (d_inner)
                              + gate/norm (d_inner) + out_proj in (d_inner)] / t
                    attention 2h (norm in, qkv in) + [qkv out ((n_q + 2 n_kv) d_head)
                              + context = proj in (n_q d_head)] / t; flash-style kernels keep
                              no s^2 score matrix (their per-row log-sum-exp is neglected)
                    mlp       2h (norm in, fc1 in) + [fc1 out (f) + activation out (f)] / t
                  in_flight = min(p - stage, micro-batches per step) under a 1F1B pipeline
                  schedule (1 when p = 1).
                  With plan.activation_recompute: h x b x s x 2 B per layer (the layer inputs)
                  + the largest single layer's full activations (recomputed during backward).
                  Neglected: the scan's per-head dt / cumulative-decay vectors (H per token,
                  < 1%), the kernels' workspaces, the CUDA context and allocator fragmentation.
    logits      = b x s x V_padded / t x 4 B on the last stage (megatron's vocab-parallel cross
                  entropy keeps the FP32 softmax for backward).
    transient   = 4 P_rank (torch foreach AdamW allocates a sqrt(exp_avg_sq) buffer per param
                  group) + 4 P_rank when d > 1 (the trainer flattens all gradients into one FP32
                  buffer for the data-parallel all-reduce). Both happen after backward, when the
                  activations are gone.
    total       = static + max(activations + logits, transient). Gradients are counted during
                  the forward pass too: with gradient accumulation they persist from the first
                  micro-batch on.

FLOPs per token (model FLOPs, fwd + bwd = 3 x forward)
    6 x N_gemm          N_gemm = parameters of every linear + the output layer (the embedding is
                        a lookup, not a GEMM — the main reason the total is below 6 x P).
    + attention         6 x n_q x d_head x s per attention layer: QK^T and scores x V over the
                        causal mean context of s / 2 keys (what flash kernels compute).
    + SSD scan          3 x [2 g Q N + H (2 Q P + 4 N P)] per Mamba layer (chunk Q, heads H of
                        dim P, state N, g groups): the intra-chunk C B^T and its product with x
                        over full Q x Q blocks, the chunk states B^T x and their read-out C h;
                        the inter-chunk state passing (H P N per chunk) is neglected.
    + conv1d            3 x 2 k (d_inner + 2 g N) per Mamba layer.
    Not counted: norms, activations, softmax, gating, the optimizer (not tensor-core work).
    Approximations: the causal halving of attention; backward = 2 x forward for the scan.

Time
    time_s = flops_per_token x total_tokens / (gpus x peak_tflops x 1e12 x mfu), with MFU on
    model FLOPs (activation recompute costs ~1/3 more hardware FLOPs, which shows up as a lower
    achievable MFU, not in this formula). Low-precision GEMMs run faster than BF16 peak, so at a
    given `mfu` the BF16 peak makes this a conservative (long) estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

GIB = 2**30
BYTES_MASTER = 4  # FP32 master weight
BYTES_GRAD = 4  # FP32 gradient
BYTES_ADAM = 8  # FP32 exp_avg + exp_avg_sq
BYTES_WORKING = 2  # BF16 working copy of a GEMM weight
BYTES_ACTIVATION = 2  # BF16 activations (the GPU production assumption)
BYTES_LOGIT = 4  # FP32 softmax kept by the vocab-parallel cross entropy
BYTES_OPT_TEMP = 4  # foreach AdamW sqrt(exp_avg_sq) buffer
BYTES_DP_FLAT = 4  # the trainer's flattened FP32 gradient buffer for the DP all-reduce
# Vocabulary when none is known without building data: model.vocab_size unset and data.tokenizer
# naming a file that does not exist (yet). The demo tokenizer uses data.demo.vocab_size instead.
PLACEHOLDER_VOCAB = 8192


@dataclass
class PlanConfig:
    """Hydra group `plan` (the dry run's assumptions about the target machine)."""

    # GPUs of the run; None = tensor x pipeline (data parallel 1). Must be a multiple of it.
    gpus: Optional[int] = None
    # Dense BF16 peak of one device in TFLOP/s. 2500 = GB200 (Blackwell): NVIDIA's GB200 NVL72
    # datasheet lists 5 PFLOPS FP16/BF16 per GPU *with* 2:4 sparsity, i.e. 2.5 PFLOPS dense.
    # H100/H200 SXM: 989.
    peak_tflops: float = 2500.0
    # Model-FLOPs utilisation assumed for the time estimate (0.4 is typical of well-tuned
    # Megatron pretraining at this scale; an assumption, not a measurement).
    mfu: float = 0.4
    # Tokens of the run; None = trainer.max_steps x global_batch_size x seq_length.
    total_tokens: Optional[int] = None
    # Full-layer activation recompute (changes the activation term; see the module docstring).
    activation_recompute: bool = False


# -- inputs -------------------------------------------------------------------------------------


def resolve_vocab(cfg) -> tuple[int, str]:
    """(unpadded vocabulary size, where it came from). Never builds the demo corpus."""
    if cfg.model.vocab_size is not None:
        return int(cfg.model.vocab_size), "model.vocab_size"
    data = getattr(cfg, "data", None)
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is None:
        demo = getattr(data, "demo", None)
        size = getattr(demo, "vocab_size", None)
        if size is not None:
            # The demo BPE is trained to exactly this size (an upper bound if the corpus ran out
            # of merges; padding to model.vocab_multiple hides the difference).
            return int(size), "data.demo.vocab_size (demo tokenizer target size)"
        return PLACEHOLDER_VOCAB, f"placeholder {PLACEHOLDER_VOCAB} (demo tokenizer size unknown)"
    path = os.path.expanduser(tokenizer)
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path).get_vocab_size(), f"data.tokenizer ({path})"
    return PLACEHOLDER_VOCAB, f"placeholder {PLACEHOLDER_VOCAB} (data.tokenizer not found: {path})"


def plan_config_of(cfg) -> PlanConfig:
    plan = getattr(cfg, "plan", None)
    return plan if plan is not None else PlanConfig()


def plan_world_size(cfg) -> int:
    """The world size the plan is for: plan.gpus, or tensor x pipeline. What `validate` needs."""
    plan = plan_config_of(cfg)
    return plan.gpus if plan.gpus is not None else cfg.parallel.tensor * cfg.parallel.pipeline


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


def _sharded_param_ids(module) -> set[int]:
    """ids of the TP-sharded parameters (see the module docstring)."""
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


def _count(module, sharded: set[int], tensor: int) -> tuple[int, int]:
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


def _linear_weight_params(module, sharded: set[int], tensor: int) -> tuple[int, int]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    full = rank = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None:
            full += m.weight.numel()
            rank += m.weight.numel() // tensor if id(m.weight) in sharded else m.weight.numel()
    return full, rank


# -- activations and FLOPs ----------------------------------------------------------------------


def activation_elements_per_token(kind: str, m, tensor: int) -> dict[str, float]:
    """Saved activation elements per token of one layer on one TP rank (module docstring)."""
    h = m.hidden_size
    if kind == "mamba":
        d_inner = m.mamba_num_heads * m.mamba_head_dim
        gn = 2 * m.mamba_num_groups * m.mamba_state_dim
        return {"norm_in": h, "in_proj_in": h,
                "in_proj_out": (2 * d_inner + gn + m.mamba_num_heads) / tensor,
                "conv_out": (d_inner + gn) / tensor, "scan_out": d_inner / tensor,
                "gate_norm": d_inner / tensor, "out_proj_in": d_inner / tensor}
    if kind == "attention":
        d = m.kv_channels
        return {"norm_in": h, "qkv_in": h,
                "qkv_out": (m.num_attention_heads + 2 * m.num_query_groups) * d / tensor,
                "context": m.num_attention_heads * d / tensor}
    if kind == "mlp":
        f = m.ffn_hidden_size
        return {"norm_in": h, "fc1_in": h, "fc1_out": f / tensor, "activation_out": f / tensor}
    raise ValueError(f"unknown layer kind {kind!r}")


def nongemm_flops_per_token(kind: str, m, seq: int) -> float:
    """Attention-score / SSD-scan / conv FLOPs per token of one layer, fwd + bwd."""
    if kind == "attention":
        return 6.0 * m.num_attention_heads * m.kv_channels * seq
    if kind == "mamba":
        q, n, g = m.mamba_chunk_size, m.mamba_state_dim, m.mamba_num_groups
        heads, p = m.mamba_num_heads, m.mamba_head_dim
        scan = 2 * g * q * n + heads * (2 * q * p + 4 * n * p)
        conv = 2 * 4 * (heads * p + 2 * g * n)  # d_conv = 4 (megatron's default)
        return 3.0 * (scan + conv)
    return 0.0


# -- the plan -----------------------------------------------------------------------------------


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def _build_meta(cfg, vocab_padded: int):
    """The full (TP = 1) model on the meta device; returns the BuiltModel."""
    import torch
    from megatron.core import parallel_state

    from .build import build_model

    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1):
        raise ValueError(
            "the dry run builds the unsharded model: initialise megatron's parallel state with "
            "tensor = pipeline = 1 (the plan divides by parallel.tensor itself)")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab_padded, spec="portable")
    with torch.device("meta"):
        return build_model(model_cfg, cfg.precision, vocab_size=vocab_padded, initialize=False,
                           backend="emulated")


def build_plan(cfg, plan: Optional[PlanConfig] = None, *, activation_bytes: int = BYTES_ACTIVATION
               ) -> dict[str, Any]:
    """The plan of a TrainConfig as the plan.json dictionary (needs megatron's parallel state
    initialised with tensor = pipeline = 1)."""
    from .build import choose_backend, padded_vocab_size
    from .specs import LINEAR_NAMES

    plan = plan or plan_config_of(cfg)
    m, par, tr = cfg.model, cfg.parallel, cfg.trainer
    t, p = par.tensor, par.pipeline
    gpus = plan.gpus if plan.gpus is not None else t * p
    if gpus < 1 or gpus % (t * p):
        raise ValueError(f"plan.gpus={plan.gpus} must be a multiple of parallel.tensor={t} x "
                         f"parallel.pipeline={p}")
    dp = gpus // (t * p)
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise ValueError(
            f"trainer.global_batch_size={tr.global_batch_size} is not a multiple of "
            f"trainer.micro_batch_size={tr.micro_batch_size} x data parallel {dp} "
            f"(plan.gpus={gpus} / (tensor {t} x pipeline {p}))")
    micro_batches = tr.global_batch_size // (tr.micro_batch_size * dp)
    if not 0 < plan.mfu <= 1 or plan.peak_tflops <= 0:
        raise ValueError(f"plan.mfu={plan.mfu} must be in (0, 1] and plan.peak_tflops="
                         f"{plan.peak_tflops} positive")

    vocab, vocab_source = resolve_vocab(cfg)
    vocab_padded = padded_vocab_size(vocab, m.vocab_multiple, t)
    built = _build_meta(cfg, vocab_padded)
    module = built.module
    sharded = _sharded_param_ids(module)
    decisions = built.policy.layers()
    kinds = m.layer_kinds()

    layers, counts = [], {}
    layer_rank_params = []
    for i, layer in enumerate(module.decoder.layers):
        linears = {}
        for name in LINEAR_NAMES[kinds[i]]:
            fmt = getattr(layer.get_submodule(name), "gemm_format", None)
            if fmt != decisions[i].linear_format(name):
                raise AssertionError(f"layer {i} {name}: built {fmt!r}, policy "
                                     f"{decisions[i].linear_format(name)!r}")
            linears[name] = fmt
            counts[fmt] = counts.get(fmt, 0) + 1
        full, rank = _count(layer, sharded, t)
        layer_rank_params.append(rank)
        formats = set(linears.values())
        layers.append({"index": i, "kind": kinds[i],
                       "precision": formats.pop() if len(formats) == 1 else "mixed",
                       "linears": linears, "parameters": full, "parameters_per_rank": rank})

    total = sum(q.numel() for q in module.parameters())
    emb_full, emb_rank = _count(module.embedding, sharded, t)
    out_full, out_rank = _count(module.output_layer, sharded, t)
    fnorm_full, fnorm_rank = _count(module.decoder.final_norm, sharded, t)
    gemm_full, _ = _linear_weight_params(module.decoder, sharded, t)
    gemm_full += out_full

    # Pipeline stages: parameters and activations per rank.
    stages = pipeline_stages(m.num_layers, p, par.first_stage_layers, par.last_stage_layers)
    b, s = tr.micro_batch_size, tr.seq_length
    act_layer = [round(sum(activation_elements_per_token(k, m, t).values()) * b * s
                       * activation_bytes) for k in kinds]
    stage_rows = []
    for r, st in enumerate(stages):
        params = sum(layer_rank_params[i] for i in st)
        gemm = sum(_linear_weight_params(module.decoder.layers[i], sharded, t)[1] for i in st)
        if r == 0:
            params += emb_rank
        if r == p - 1:
            params += out_rank + fnorm_rank
            gemm += out_rank
        in_flight = min(p - r, micro_batches)
        if plan.activation_recompute:
            per_mb = (len(st) * m.hidden_size * b * s * activation_bytes
                      + max((act_layer[i] for i in st), default=0))
        else:
            per_mb = sum(act_layer[i] for i in st)
        logits = b * s * vocab_padded // t * BYTES_LOGIT if r == p - 1 else 0
        static = (BYTES_MASTER + BYTES_GRAD + BYTES_ADAM) * params + BYTES_WORKING * gemm
        transient = BYTES_OPT_TEMP * params + (BYTES_DP_FLAT * params if dp > 1 else 0)
        acts = per_mb * in_flight
        stage_rows.append({
            "stage": r, "layers": [st.start, st.stop - 1] if len(st) else [],
            "parameters_per_rank": params, "gemm_parameters_per_rank": gemm,
            "in_flight_micro_batches": in_flight, "static_bytes": static,
            "activation_bytes": acts, "logit_bytes": logits, "transient_bytes": transient,
            "total_bytes": static + max(acts + logits, transient)})
    busiest = max(stage_rows, key=lambda r: r["total_bytes"])
    params_rank = max(r["parameters_per_rank"] for r in stage_rows)
    pr, gr = busiest["parameters_per_rank"], busiest["gemm_parameters_per_rank"]
    memory = {
        "stage": busiest["stage"],
        "parameters_per_rank": pr,
        "weights_fp32_gib": _gib(BYTES_MASTER * pr),
        "grads_fp32_gib": _gib(BYTES_GRAD * pr),
        "adam_fp32_gib": _gib(BYTES_ADAM * pr),
        "weights_bf16_working_gib": _gib(BYTES_WORKING * gr),
        "activations_gib": _gib(busiest["activation_bytes"]),
        "logits_gib": _gib(busiest["logit_bytes"]),
        "transient_gib": _gib(busiest["transient_bytes"]),
        "activation_bytes_per_element": activation_bytes,
        "activations_per_layer_gib": {
            k: _gib(sum(activation_elements_per_token(k, m, t).values()) * b * s
                    * activation_bytes) for k in dict.fromkeys(kinds)},
        "micro_batch_size": b, "seq_length": s, "micro_batches_per_step": micro_batches,
        "activation_recompute": plan.activation_recompute,
        "stages": stage_rows,
    }

    gemm_flops = 6.0 * gemm_full
    other_flops = sum(nongemm_flops_per_token(k, m, s) for k in kinds)
    flops_per_token = gemm_flops + other_flops
    tokens = plan.total_tokens if plan.total_tokens is not None else (
        tr.max_steps * tr.global_batch_size * s)
    cluster_flops = gpus * plan.peak_tflops * 1e12 * plan.mfu
    seconds = flops_per_token * tokens / cluster_flops
    tokens_per_step = tr.global_batch_size * s
    time = {
        "total_tokens": tokens, "gpus": gpus, "tensor": t, "pipeline": p, "data": dp,
        "peak_tflops": plan.peak_tflops, "mfu": plan.mfu,
        "steps": math.ceil(tokens / tokens_per_step),
        "tokens_per_step": tokens_per_step,
        "step_seconds": round(flops_per_token * tokens_per_step / cluster_flops, 4),
        "tokens_per_second": round(cluster_flops / flops_per_token, 1),
        "total_flops": flops_per_token * tokens,
        "seconds": round(seconds, 1), "days": round(seconds / 86400, 2),
        "gpu_hours": round(seconds * gpus / 3600, 1),
    }

    try:
        backend, reason = choose_backend(cfg.precision, cfg.model.spec)
    except ValueError as exc:  # backend=te requested on a machine without it: plan anyway
        backend, reason = "te", f"requested; not available on this machine ({exc})"
    checks = preflight(cfg, preflight_backends(cfg.precision, cfg.model.spec), probe_device(cfg))

    return {
        "parameters": total,
        "parameters_per_rank": params_rank,
        "vocab_size": vocab, "vocab_size_padded": vocab_padded, "vocab_source": vocab_source,
        "pattern": m.pattern,
        "layers": layers,
        "linear_counts": counts,
        "embedding_parameters": emb_full, "output_layer_parameters": out_full,
        "final_norm_parameters": fnorm_full, "gemm_parameters": gemm_full,
        "recipe": built.policy.recipe(),
        "precision_map": built.policy.precision_map(),
        "backend": backend, "backend_reason": reason,
        "preflight": checks.as_dict(),
        "memory_per_rank_gib": _gib(busiest["total_bytes"]),
        "memory": memory,
        "flops_per_token": flops_per_token,
        "flops": {"gemm_per_token": gemm_flops, "attention_scan_conv_per_token": other_flops,
                  "ratio_to_6P": round(flops_per_token / (6.0 * total), 4)},
        "time": time,
    }


# -- preflight ----------------------------------------------------------------------------------


def preflight_backends(precision, model_spec: str) -> tuple[str, ...]:
    """The GEMM backends a run of this config may use (the dry run checks each): TE where the
    config lets it (`auto`: TE on Blackwell, the emulation elsewhere), never for MXFP4 (TE has no
    MXFP4 recipe, so such a run is emulated)."""
    from nvfp4_recipe.policy import low_precision_formats

    if precision.backend == "emulated" or model_spec == "portable":
        return ("emulated",)
    if precision.backend == "te" or model_spec == "te":
        return ("te",)
    return ("emulated",) if "mxfp4" in low_precision_formats(precision) else ("te", "emulated")


def probe_device(cfg, activation_dtype: str = "bf16"):
    """This machine's GPU and Transformer Engine release for the known-bad table (None without
    a GPU). Reads TE's version from its package metadata: nothing is imported."""
    import importlib.metadata

    import torch

    from nvfp4_recipe.policy import low_precision_formats
    from nvfp4_recipe.preflight import DeviceSetting

    if not torch.cuda.is_available():
        return None
    te_version = None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            te_version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    p = cfg.precision
    return DeviceSetting(capability=tuple(torch.cuda.get_device_capability()),
                         te_version=te_version, formats=tuple(low_precision_formats(p)),
                         rht=p.rht, stochastic_rounding=p.stochastic_rounding,
                         activation_dtype=activation_dtype)


def preflight(cfg, backends, device=None):
    """The preflight Report of a TrainConfig (nvfp4_recipe/preflight.py): every low-precision
    GEMM at parallel.tensor, micro-batch x sequence rows, for each backend in `backends`; the
    same at each candidate tensor size (which layouts are clean); `device` against the known-bad
    table where TE is among the backends. Raises ValueError for a bad precision key (an override
    pattern that matches nothing)."""
    from nvfp4_recipe.preflight import (CANDIDATE_TENSOR_SIZES, Linear, Report, Setting,
                                        check_linears, known_bad_hits, layout_verdicts)

    from .build import precision_policy
    from .specs import layout_problems, linear_shapes

    m, par, tr, p = cfg.model, cfg.parallel, cfg.trainer, cfg.precision
    formats = {n: f for n, f in precision_policy(m, p).linear_formats().items() if f != "bf16"}
    tokens = tr.micro_batch_size * tr.seq_length

    def checks_at(tensor: int, backend: str):
        shapes = linear_shapes(m, tensor)
        linears = [Linear(name, fmt, shapes[suffix]["in"], shapes[suffix]["out"],
                          shapes[suffix]["parallel"])
                   for name, fmt in formats.items() for suffix in [name.split(".", 2)[2]]]
        setting = Setting(backend=backend, tokens=tokens, tensor=tensor,
                          sequence_parallel=par.sequence, rht=p.rht,
                          capability=device.capability if device else None,
                          te_version=device.te_version if device else None)
        return check_linears(linears, setting)

    report = Report(tensor=par.tensor, tokens=tokens, sequence_parallel=par.sequence,
                    layout_problems=layout_problems(m, par.tensor))
    if not report.layout_problems:
        report.checks = [c for b in backends for c in checks_at(par.tensor, b)]
    for t in sorted({*CANDIDATE_TENSOR_SIZES, par.tensor}):
        problems = layout_problems(m, t)
        if problems:
            report.layouts[t] = {b: {"verdict": "fail", "linears": {}, "layout": problems}
                                 for b in backends}
        else:
            per_backend = layout_verdicts([c for b in backends for c in checks_at(t, b)])
            report.layouts[t] = {b: per_backend.get(b, {"verdict": "ok", "linears": {}})
                                 for b in backends}
    if device is not None and "te" in backends:
        cap = device.capability
        report.device = {"capability": list(cap) if cap else None,
                         "te_version": device.te_version,
                         "describe": (f"compute capability {cap[0]}.{cap[1]}" if cap else
                                      "no GPU") + f", transformer_engine {device.te_version}"}
        report.device_hits = known_bad_hits(device)
    return report


def run_preflight(cfg, backend: str, activation_dtype: str = "bf16"):
    """The start-up preflight of a run on `backend` ("te" | "emulated"); the device is probed
    only for TE. Its `refusal()` stops the run before anything is written (exit 2)."""
    device = probe_device(cfg, activation_dtype) if backend == "te" else None
    return preflight(cfg, (backend,), device)


# -- output -------------------------------------------------------------------------------------


def write_plan(plan: dict, run_dir) -> Path:
    """Write run_dir/plan.json atomically. plan.json is derived data and is rewritten by every dry
    run; no other file in run_dir is created, read or modified."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".json.tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(plan, f, indent=1)
            f.write("\n")
        os.replace(tmp, run_dir / "plan.json")
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return run_dir / "plan.json"


_VERDICT_TEXT = {"ok": "clean", "slower": "slower path", "fail": "would fail"}


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def print_plan(plan: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from nvfp4_recipe.policy import describe_precision_map

    console = console or Console()
    table = Table(title=f"layers ({plan['pattern']})", show_lines=False)
    for col, just in (("#", "right"), ("kind", "left"), ("linears", "left"),
                      ("params", "right"), ("params/rank", "right")):
        table.add_column(col, justify=just)
    for row in plan["layers"]:
        style = None if row["precision"] == "bf16" else "cyan"
        fmts = set(row["linears"].values())
        linears = (", ".join(map(_short, row["linears"])) + f": {fmts.pop()}" if len(fmts) == 1
                   else ", ".join(f"{_short(n)} {f}" for n, f in row["linears"].items()))
        table.add_row(str(row["index"]), row["kind"], linears, f"{row['parameters']:,}",
                      f"{row['parameters_per_rank']:,}", style=style)
    console.print(table)

    mem, tm = plan["memory"], plan["time"]
    summary = Table(title="plan", show_header=False)
    summary.add_column("item")
    summary.add_column("value")
    counts = ", ".join(f"{v} {k}" for k, v in sorted(plan["linear_counts"].items()))
    rows = [
        ("parameters", f"{plan['parameters']:,} (embedding {plan['embedding_parameters']:,}, "
                       f"output {plan['output_layer_parameters']:,})"),
        ("vocabulary", f"{plan['vocab_size']:,} -> {plan['vocab_size_padded']:,} "
                       f"({plan['vocab_source']})"),
        ("linears", f"{counts}; recipe {plan['recipe']['name']} ({plan['recipe']['format']}, "
                    f"BF16 first {plan['recipe']['bf16_first_layers']} / last "
                    f"{plan['recipe']['bf16_last_layers']})"),
        ("backend", f"{plan['backend']} ({plan['backend_reason']})"),
        ("layout", f"{tm['gpus']} GPUs = tensor {tm['tensor']} x pipeline {tm['pipeline']} x "
                   f"data {tm['data']}; {mem['micro_batches_per_step']} micro-batches of "
                   f"{mem['micro_batch_size']} x {mem['seq_length']} per step"),
        ("params / rank", f"{mem['parameters_per_rank']:,} (stage {mem['stage']})"),
        ("memory / rank", f"{plan['memory_per_rank_gib']:.2f} GiB = weights {mem['weights_fp32_gib']}"
                          f" + grads {mem['grads_fp32_gib']} + Adam {mem['adam_fp32_gib']} + BF16 "
                          f"copies {mem['weights_bf16_working_gib']} + max(activations "
                          f"{mem['activations_gib']} + logits {mem['logits_gib']}, optimizer "
                          f"transients {mem['transient_gib']}) GiB"
                          + (" [recompute]" if mem["activation_recompute"] else "")),
        ("FLOPs / token", f"{plan['flops_per_token'] / 1e9:.2f} G "
                          f"({plan['flops']['ratio_to_6P']:.3f} x 6P; GEMMs "
                          f"{plan['flops']['gemm_per_token'] / 1e9:.2f} G, attention+scan+conv "
                          f"{plan['flops']['attention_scan_conv_per_token'] / 1e9:.2f} G)"),
        ("time", f"{tm['total_tokens']:.4g} tokens, {tm['steps']:,} steps of "
                 f"{tm['step_seconds']:.2f} s: {tm['days']:.2f} days = {tm['gpu_hours']:,.0f} "
                 f"GPU-hours at MFU {tm['mfu']} of {tm['peak_tflops']:g} TFLOP/s"),
    ]
    pre = plan["preflight"]
    counts = "; ".join(f"{b}: {n['ok']} ok, {n['slower']} slower path, {n['fail']} would fail"
                       for b, n in pre["counts"].items()) or "no low-precision GEMM"
    total = sum(sum(n.values()) for n in pre["counts"].values())
    rows.append(("preflight", f"{counts} (tensor {pre['tensor']}, {pre['rows_per_gemm']} rows "
                              f"per GEMM; all {total} in plan.json)"))
    rows.append(("layouts", "; ".join(
        f"tensor {t}: " + ", ".join(f"{b} {_VERDICT_TEXT[e['verdict']]}" for b, e in per.items())
        for t, per in pre["layouts"].items())))
    rows.append(("precision map", describe_precision_map(plan["precision_map"])))
    for k, v in rows:
        summary.add_row(k, v)
    console.print(summary)
    for line in pre["problems"]:
        style = "red" if line.startswith("would fail") else "yellow"
        console.print(f"preflight: {line}", style=style, soft_wrap=True)


def dry_run(cfg, ctx) -> int:
    """Plan the run of `cfg` (a TrainConfig), print it, write run.dir/plan.json on rank 0.
    Returns 2 when the preflight says the run would be refused (the plan, which says why, is
    written first), else 0.

    `ctx` is the current process group's ParallelContext; megatron's parallel state must be
    initialised with tensor = pipeline = 1 (the plan needs no GPUs and no real world size)."""
    plan = build_plan(cfg)
    refusal = plan["preflight"]["verdict"] == "fail"
    if ctx is None or ctx.is_main:
        print_plan(plan)
        path = write_plan(plan, cfg.run.dir)
        print(f"wrote {path}")
        if refusal:  # the plan is written (it says why); the exit code says the run would refuse
            print("error: the preflight would refuse this run (lines 'preflight: would fail' "
                  "above); exit code 2")
    return 2 if refusal else 0


# -- validation against a real (CPU) run --------------------------------------------------------


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def measure(steps: int = 2, micro_batches: int = 2, micro_batch_size: int = 4,
            seq_length: int = 256, hidden_size: Optional[int] = None,
            vocab_size: int = 4096) -> dict[str, Any]:
    """Train the demo-shaped model `steps` optimizer steps on random tokens (CPU, BF16 recipe) and
    compare its memory with the plan of the same configuration.

    Measured = kernel RSS high-water mark (`ru_maxrss`) minus the RSS after imports and process
    group set-up, so every allocation torch makes (which tracemalloc cannot see) counts, including
    short-lived ones. Static = RSS after the last step (weights, grads, Adam; activations freed)
    minus the same baseline. RSS is page-granular and includes allocator caching; the baseline
    must be the process's own high-water mark too, so run this in a fresh process."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    from training.config import TrainConfig

    from .build import build_model

    created = False
    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                                rank=0)
        created = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    try:
        cfg = TrainConfig()
        cfg.model.vocab_size = vocab_size
        if hidden_size is not None:
            cfg.model.hidden_size = hidden_size
        cfg.model.max_sequence_length = max(cfg.model.max_sequence_length, seq_length)
        cfg.trainer.micro_batch_size = micro_batch_size
        cfg.trainer.global_batch_size = micro_batch_size * micro_batches
        cfg.trainer.seq_length = seq_length
        cfg.trainer.max_steps = steps
        planned = build_plan(cfg, PlanConfig(gpus=1))
        planned_fp32 = build_plan(cfg, PlanConfig(gpus=1), activation_bytes=4)

        def train(model_cfg, n_steps):
            built = build_model(model_cfg, cfg.precision, vocab_size=vocab_size,
                                backend="emulated")
            model = built.module
            optimizer, _ = build_optimizer(model, cfg.trainer)
            gen = torch.Generator().manual_seed(0)
            for _ in range(n_steps):
                optimizer.zero_grad(set_to_none=True)
                for _ in range(micro_batches):
                    tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length),
                                           generator=gen)
                    loss = model(tokens, None, None, labels=tokens).float().mean()
                    (loss / micro_batches).backward()
                    del loss
                optimizer.step()
            return model, optimizer

        from training.optim import build_optimizer

        # Warm-up on a 16x narrower model: faults in the library code and kernels the real run
        # uses (they count in RSS but are not part of the plan), then frees it.
        tiny = dataclasses.replace(cfg.model, hidden_size=max(cfg.model.hidden_size // 16, 16),
                                   ffn_hidden_size=max(cfg.model.ffn_hidden_size // 16, 16))
        torch.manual_seed(0)
        warm = train(tiny, 1)
        del warm
        gc.collect()
        baseline = _rss()
        baseline_peak = _peak_rss()
        model, optimizer = train(cfg.model, steps)
        static = _rss() - baseline
        peak = _peak_rss() - baseline
    finally:
        if created:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    mem, mem32 = planned["memory"], planned_fp32["memory"]
    planned_static = (mem["weights_fp32_gib"] + mem["grads_fp32_gib"] + mem["adam_fp32_gib"])
    return {
        "machine": _machine(),
        "config": {"pattern": cfg.model.pattern, "hidden_size": cfg.model.hidden_size,
                   "vocab_size": vocab_size, "micro_batch_size": micro_batch_size,
                   "micro_batches": micro_batches, "seq_length": seq_length, "steps": steps,
                   "parameters": planned["parameters"], "precision": "bf16 (emulated linears)"},
        "baseline_rss_gib": round(baseline / GIB, 3),
        "baseline_was_peak": baseline_peak > baseline + peak,
        "measured_peak_gib": round(peak / GIB, 4),
        "measured_static_gib": round(static / GIB, 4),
        "planned_gib": planned["memory_per_rank_gib"],
        "planned_fp32_activations_gib": planned_fp32["memory_per_rank_gib"],
        "planned_static_gib": round(planned_static, 4),
        "planned_activations_gib": mem["activations_gib"] + mem["logits_gib"],
        "planned_fp32_activations_only_gib": mem32["activations_gib"] + mem32["logits_gib"],
        "ratio_peak": round(peak / GIB / planned["memory_per_rank_gib"], 3),
        "ratio_peak_fp32_activations": round(
            peak / GIB / planned_fp32["memory_per_rank_gib"], 3),
        "ratio_static": round(static / GIB / planned_static, 3) if planned_static else None,
    }


def _machine() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model.plan",
        description="Validate the memory plan against a short CPU training run "
                    "(plans of real runs: python train.py run.dry_run=true ...).")
    parser.add_argument("--measure", action="store_true", help="run the CPU measurement")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.measure:
        parser.print_help()
        return 2
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        # glibc keeps freed heap memory in its arenas, so RSS would not fall when tensors are
        # freed; with a fixed 64 KiB mmap threshold every tensor buffer above it is its own
        # mapping, returned to the kernel on free, and RSS follows the live tensor bytes.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "model.plan", *argv], env)
    result = measure(steps=args.steps, micro_batches=args.micro_batches,
                     micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                     hidden_size=args.hidden_size)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
