"""The dry-run planner: layer precisions, parameters, memory per rank, FLOPs and time of a run.

`dry_run(cfg, ctx)` builds the model on the meta device (no memory, seconds even at 12B) with the
*portable* spec at tensor = pipeline = 1, reads the precision of every linear from the built
modules (each one was chosen by `nvfp4_recipe`'s precision policy) and derives the per-rank
numbers for the layout in `cfg.parallel` analytically, so a single process can plan a
4-way tensor-parallel run. It prints a table and writes `plan.json` into `run.dir`, with the
precision map (`precision_map`) and the preflight (`preflight`: every low-precision GEMM's local
shapes checked against the rules of each backend the run may use, at parallel.tensor and at
tensor 1/2/4/8; nvfp4_recipe/preflight.py). `run_preflight` is the same check at start-up.

The memory model is the trainer's: megatron's `--bf16` mixed precision
(training/mixed_precision.py), `trainer.distributed_optimizer`, `trainer.recompute*`
(model/recompute.py) and `parallel.sequence`. Formulas (P = parameters, b = micro-batch,
s = sequence length, t = tensor parallel, p = pipeline parallel, d = data parallel, h = hidden;
GiB = 2^30 bytes):

Parameters per rank
    A parameter is *TP-sharded* when it belongs to a megatron tensor-parallel linear or the
    vocab-parallel embedding, or carries `tensor_model_parallel=True` (the Mamba conv1d, A_log,
    D, dt_bias and gated-norm weight); it holds numel / t elements per rank. Everything else
    (the RMSNorm weights before each layer and the final norm) is replicated: numel per rank.
    Stages split the pattern as megatron's `MambaStack._select_layers_for_pipeline_parallel`
    (even split, or `parallel.first_stage_layers` / `last_stage_layers`); the embedding lives on
    the first stage, the final norm and the output layer on the last. P_rank is per stage.
    The vocabulary is padded to a multiple of `model.vocab_multiple` x t, as `build_model` does.

Static memory per rank (Megatron-LM's count: 18 B/param, or 6 + 12/d with the distributed
optimizer, megatron/training/theoretical_memory_usage.py:293-296 at core_v0.19.0)
    weights     2 P_rank    BF16 (megatron's Float16Module casts every parameter).
    main grads  4 P_rank    FP32 gradient buffer (grad_reduce_in_fp32); full size on every rank,
                            also under the distributed optimizer (it reduce-scatters in place).
    optimizer  12 P_rank / d_opt   FP32 master weights + Adam exp_avg + exp_avg_sq; d_opt = d with
                            trainer.distributed_optimizer, else 1 (every replica holds all of it).
    TE weights  (plan backend te only) the quantized copies TE caches of each low-precision GEMM
                weight across micro-batches, row-wise for Fprop and column-wise for Dgrad:
                NVFP4 2 x (0.5 + 1/16) B, FP8 2 x 1 B per weight element (an estimate of TE's
                workspaces; BF16 linears keep none).

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
    + (plan backend emulated) each low-precision linear saves its quantized weight (BF16 values)
      for Dgrad: 2 B x its weight elements per rank, per micro-batch (nvfp4_recipe/linear.py).
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
    in_flight = min(p - stage, micro-batches per step): megatron's 1F1B schedule holds up to
    p - stage micro-batches of activations on a stage (1 when p = 1).

Peak per rank = static + the largest of
    end of forward   in_flight x kept + logits (kept = what one micro-batch keeps, above)
    recompute        (in_flight - 1) x kept + max over checkpointed chunks k of [what the chunks
                     before k keep + chunk k's full activations] (full recompute only)
    optimizer step   4 B x the optimizer's elements with torch's foreach AdamW (a sqrt(exp_avg_sq)
                     buffer: the CPU twin, or megatron without TE / apex; plan backend emulated),
                     0 with TE's FusedAdam (backend te). The activations are gone by then.
    Neglected: the scan's per-head dt / cumulative-decay vectors (H per token), each parameter's
    BF16 .grad before the DDP hook folds it into main_grad (the largest, the output layer's, is
    2 V h / t B), TE's quantized saved inputs (smaller than the BF16 counted), kernel workspaces,
    the CUDA context and allocator fragmentation. The activation model is the GPU kernels'; the
    portable spec on CPU keeps more (FP32 SSD-scan and attention intermediates):
    docs/benchmarks/memory-plan.md measures both.

FLOPs per token: model/flops.py (one count, shared with the bench's MFU).

Time
    time_s = flops_per_token x total_tokens / (gpus x peak_tflops x 1e12 x mfu), with MFU on
    model FLOPs (activation recompute costs up to ~1/3 more hardware FLOPs, which shows up as a
    lower achievable MFU, not in this formula). Low-precision GEMMs run faster than BF16 peak, so
    at a given `mfu` the BF16 peak makes this a conservative (long) estimate.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

GIB = 2**30
BYTES_WEIGHT = 2  # BF16 parameters (Float16Module)
BYTES_MAIN_GRAD = 4  # FP32 main-grad buffer
BYTES_OPTIMIZER = 12  # FP32 master weight + exp_avg + exp_avg_sq
BYTES_ACTIVATION = 2  # BF16 activations
BYTES_LOGITS = 6  # BF16 logits + the FP32 copy the vocab-parallel cross entropy keeps
BYTES_EMULATED_WEIGHT_COPY = 2  # the emulated low-precision linear's saved BF16 weight values
BYTES_ADAM_TEMP = 4  # foreach AdamW's sqrt(exp_avg_sq) buffer
# TE's cached quantized weight per element: row-wise + column-wise data and their block scales.
TE_WEIGHT_CACHE_BYTES = {"nvfp4": 2 * (0.5 + 1 / 16), "fp8": 2.0}
BACKENDS = ("te", "emulated")
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
    # The GEMM backend of the target machine (te | emulated), which changes the low-precision
    # weight copies and the optimizer's step buffer; None = the one this machine would use.
    backend: Optional[str] = None


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
    raise ValueError(f"unknown layer kind {kind!r}")


def recompute_config_of(trainer):
    """The trainer's recompute setting as a validated RecomputeConfig."""
    from .recompute import RecomputeConfig

    rc = RecomputeConfig(getattr(trainer, "recompute", "none"),
                         getattr(trainer, "recompute_method", "uniform"),
                         getattr(trainer, "recompute_layers", 1))
    rc.validate()
    return rc


def stage_activation_bytes(layer_bytes: list[int], input_bytes: int, recompute) -> dict[str, int]:
    """One micro-batch on one stage: {"kept": what stays from its forward to its backward,
    "recompute_peak": the most alive while a checkpointed chunk's backward runs (0 without
    full recompute)}. `layer_bytes[i]`: layer i's full activations; `input_bytes`: one layer
    input (what a checkpointed chunk keeps)."""
    from .recompute import checkpointed_chunks

    kept, peak = 0, 0
    for start, end, checkpointed in checkpointed_chunks(len(layer_bytes), recompute):
        full = sum(layer_bytes[start:end])
        if checkpointed:
            peak = max(peak, kept + full)  # the chunks after this one are freed by then
            kept += input_bytes
        else:
            kept += full
    return {"kept": kept, "recompute_peak": peak}


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


def _plan_backend(cfg, plan: PlanConfig) -> tuple[str, str]:
    from .build import choose_backend

    if plan.backend is not None:
        if plan.backend not in BACKENDS:
            raise ValueError(f"plan.backend={plan.backend!r}: choose te, emulated or null")
        return plan.backend, "plan.backend"
    try:
        return choose_backend(cfg.precision, cfg.model.spec)
    except ValueError as exc:  # backend=te requested on a machine without it: plan anyway
        return "te", f"requested; not available on this machine ({exc})"


def build_plan(cfg, plan: Optional[PlanConfig] = None) -> dict[str, Any]:
    """The plan of a TrainConfig as the plan.json dictionary (needs megatron's parallel state
    initialised with tensor = pipeline = 1)."""
    from .build import padded_vocab_size
    from .flops import flops_per_token_terms, gemm_weights
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
    recompute = recompute_config_of(tr)
    sp = bool(par.sequence) and t > 1
    distributed = bool(getattr(tr, "distributed_optimizer", False))
    opt_shards = dp if distributed else 1
    backend, reason = _plan_backend(cfg, plan)

    vocab, vocab_source = resolve_vocab(cfg)
    vocab_padded = padded_vocab_size(vocab, m.vocab_multiple, t)
    built = _build_meta(cfg, vocab_padded)
    module = built.module
    sharded = _sharded_param_ids(module)
    decisions = built.policy.layers()
    kinds = m.layer_kinds()

    layers, counts = [], {}
    layer_rank_params, layer_lowp = [], []  # per layer: params / rank; {format: weights / rank}
    for i, layer in enumerate(module.decoder.layers):
        linears, lowp = {}, {}
        for name in LINEAR_NAMES[kinds[i]]:
            sub = layer.get_submodule(name)
            fmt = getattr(sub, "gemm_format", None)
            if fmt != decisions[i].linear_format(name):
                raise AssertionError(f"layer {i} {name}: built {fmt!r}, policy "
                                     f"{decisions[i].linear_format(name)!r}")
            linears[name] = fmt
            counts[fmt] = counts.get(fmt, 0) + 1
            if fmt != "bf16":
                n = sub.weight.numel()
                lowp[fmt] = lowp.get(fmt, 0) + (n // t if id(sub.weight) in sharded else n)
        full, rank = _count(layer, sharded, t)
        layer_rank_params.append(rank)
        layer_lowp.append(lowp)
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
    if gemm_full != gemm_weights(m, vocab_padded):  # the FLOP count must see the built GEMMs
        raise AssertionError(f"built GEMM weights {gemm_full:,} != model/flops.py's "
                             f"{gemm_weights(m, vocab_padded):,}")

    # Activations of one micro-batch, per layer (bytes): BF16 tensors + emulated weight copies.
    b, s = tr.micro_batch_size, tr.seq_length
    per_token = {k: sum(activation_elements_per_token(k, m, t, sp).values())
                 for k in dict.fromkeys(kinds)}
    act_layer = [round(per_token[k] * b * s * BYTES_ACTIVATION) for k in kinds]
    if backend == "emulated":
        act_layer = [a + BYTES_EMULATED_WEIGHT_COPY * sum(lp.values())
                     for a, lp in zip(act_layer, layer_lowp)]
    h_sp = m.hidden_size // (t if sp else 1)
    input_bytes = b * s * h_sp * BYTES_ACTIVATION  # one layer's input (a checkpointed chunk's)

    stages = pipeline_stages(m.num_layers, p, par.first_stage_layers, par.last_stage_layers)
    stage_rows = []
    for r, st in enumerate(stages):
        params = sum(layer_rank_params[i] for i in st)
        if r == 0:
            params += emb_rank
        last = r == p - 1
        if last:
            params += out_rank + fnorm_rank
        te_cache = 0
        if backend == "te":
            for i in st:
                for fmt, n in layer_lowp[i].items():
                    if fmt not in TE_WEIGHT_CACHE_BYTES:
                        raise ValueError(f"{fmt} linears do not run on TE (layer {i}): plan with "
                                         "plan.backend=emulated")
                    te_cache += TE_WEIGHT_CACHE_BYTES[fmt] * n
        opt_elems = -(-params // opt_shards)
        static = {"weights": BYTES_WEIGHT * params, "main_grads": BYTES_MAIN_GRAD * params,
                  "optimizer": BYTES_OPTIMIZER * opt_elems, "te_weight_cache": round(te_cache)}
        acts = stage_activation_bytes([act_layer[i] for i in st], input_bytes, recompute)
        head = 2 * b * s * h_sp * BYTES_ACTIVATION if last else 0  # final norm in, output in
        kept = acts["kept"] + head
        logits = b * s * vocab_padded // t * BYTES_LOGITS if last else 0
        in_flight = min(p - r, micro_batches)
        end_of_forward = in_flight * kept + logits
        recompute_peak = ((in_flight - 1) * kept + acts["recompute_peak"]
                          if acts["recompute_peak"] else 0)
        transient = BYTES_ADAM_TEMP * opt_elems if backend == "emulated" else 0
        static_total = sum(static.values())
        stage_rows.append({
            "stage": r, "layers": [st.start, st.stop - 1] if len(st) else [],
            "parameters_per_rank": params, "optimizer_elements_per_rank": opt_elems,
            "in_flight_micro_batches": in_flight,
            "static_bytes": static_total, **{f"{k}_bytes": v for k, v in static.items()},
            "kept_per_micro_batch_bytes": kept, "activation_bytes": in_flight * kept,
            "logit_bytes": logits, "recompute_peak_bytes": recompute_peak,
            "transient_bytes": transient,
            "total_bytes": static_total + max(end_of_forward, recompute_peak, transient)})
    busiest = max(stage_rows, key=lambda row: row["total_bytes"])
    params_rank = max(row["parameters_per_rank"] for row in stage_rows)
    peak_phase = max((("end of forward", busiest["activation_bytes"] + busiest["logit_bytes"]),
                      ("recompute", busiest["recompute_peak_bytes"]),
                      ("optimizer step", busiest["transient_bytes"])), key=lambda x: x[1])[0]
    memory = {
        "stage": busiest["stage"],
        "parameters_per_rank": busiest["parameters_per_rank"],
        "backend": backend,
        "weights_bf16_gib": _gib(busiest["weights_bytes"]),
        "main_grads_fp32_gib": _gib(busiest["main_grads_bytes"]),
        "optimizer_fp32_gib": _gib(busiest["optimizer_bytes"]),
        "te_weight_cache_gib": _gib(busiest["te_weight_cache_bytes"]),
        "static_gib": _gib(busiest["static_bytes"]),
        "activations_gib": _gib(busiest["activation_bytes"]),
        "logits_gib": _gib(busiest["logit_bytes"]),
        "recompute_peak_gib": _gib(busiest["recompute_peak_bytes"]),
        "transient_gib": _gib(busiest["transient_bytes"]),
        "peak_phase": peak_phase,
        "activations_per_layer_gib": {
            k: _gib(per_token[k] * b * s * BYTES_ACTIVATION) for k in per_token},
        "layer_input_gib": _gib(input_bytes),
        "micro_batch_size": b, "seq_length": s, "micro_batches_per_step": micro_batches,
        "distributed_optimizer": distributed, "optimizer_sharded_over": opt_shards,
        "sequence_parallel": sp,
        "recompute": dataclasses.asdict(recompute),
        "stages": stage_rows,
    }

    flops = flops_per_token_terms(m, s, vocab_padded)
    flops_per_token = flops["total"]
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
        "flops": {"gemm_per_token": flops["gemm"], "attention_per_token": flops["attention"],
                  "ssd_scan_per_token": flops["ssd_scan"], "conv1d_per_token": flops["conv1d"],
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
    stage_row = mem["stages"][mem["stage"]]
    rc = mem["recompute"]
    recompute = (f"recompute {rc['granularity']}" if rc["granularity"] != "full" else
                 f"recompute full ({rc['method']}, {rc['num_layers']} layer(s))")
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
        ("memory / rank", f"{plan['memory_per_rank_gib']:.2f} GiB at the {mem['peak_phase']} "
                          f"(stage {mem['stage']}) = static {mem['static_gib']} + "
                          f"{plan['memory_per_rank_gib'] - mem['static_gib']:.3f} GiB"),
        ("static", f"BF16 weights {mem['weights_bf16_gib']} + FP32 main grads "
                   f"{mem['main_grads_fp32_gib']} + FP32 master + Adam {mem['optimizer_fp32_gib']}"
                   + (f" (distributed optimizer: / {mem['optimizer_sharded_over']})"
                      if mem["distributed_optimizer"] else "")
                   + f" + TE weight cache {mem['te_weight_cache_gib']} GiB "
                     f"({mem['backend']} GEMMs)"),
        ("activations", f"kept {mem['activations_gib']} ({stage_row['in_flight_micro_batches']} "
                        f"micro-batch(es) in flight) + logits {mem['logits_gib']} GiB at the end "
                        f"of the forward; recompute peak {mem['recompute_peak_gib']}; optimizer "
                        f"step {mem['transient_gib']} GiB; {recompute}; sequence parallel "
                        f"{'on' if mem['sequence_parallel'] else 'off'}; per layer "
                        + ", ".join(f"{k} {v}" for k, v in mem["activations_per_layer_gib"].items())
                        + f" GiB, layer input {mem['layer_input_gib']} GiB"),
        ("FLOPs / token", f"{plan['flops_per_token'] / 1e9:.2f} G "
                          f"({plan['flops']['ratio_to_6P']:.3f} x 6P; GEMMs "
                          f"{plan['flops']['gemm_per_token'] / 1e9:.2f} G, attention "
                          f"{plan['flops']['attention_per_token'] / 1e9:.2f} G, SSD scan "
                          f"{plan['flops']['ssd_scan_per_token'] / 1e9:.2f} G, conv1d "
                          f"{plan['flops']['conv1d_per_token'] / 1e9:.3f} G)"),
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


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """VmHWM (resettable) where the kernel has it, else the lifetime ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def parse_recompute(text: str) -> tuple[str, str, int]:
    """'none' | 'selective' | 'full[:uniform|block[:N]]' -> (granularity, method, layers)."""
    parts = text.split(":")
    granularity = parts[0]
    method = parts[1] if len(parts) > 1 else "uniform"
    layers = int(parts[2]) if len(parts) > 2 else 1
    from .recompute import RecomputeConfig

    RecomputeConfig(granularity, method, layers).validate("--recompute")
    return granularity, method, layers


def measure_config(*, steps: int = 2, micro_batches: int = 2, micro_batch_size: int = 4,
                   seq_length: int = 256, hidden_size: Optional[int] = None,
                   vocab_size: int = 4096, recompute: str = "none"):
    """The TrainConfig `measure` trains (and plans): the demo shape, the BF16 recipe."""
    from training.config import TrainConfig

    cfg = TrainConfig()
    cfg.model.vocab_size = vocab_size
    if hidden_size is not None:
        cfg.model.hidden_size = hidden_size
    cfg.model.max_sequence_length = max(cfg.model.max_sequence_length, seq_length)
    tr = cfg.trainer
    tr.micro_batch_size = micro_batch_size
    tr.global_batch_size = micro_batch_size * micro_batches
    tr.seq_length = seq_length
    tr.max_steps = steps
    tr.recompute, tr.recompute_method, tr.recompute_layers = parse_recompute(recompute)
    return cfg


def _build_like_trainer(cfg, vocab: int, ctx):
    """Model, data-parallel wrapper and optimizer as training/trainer.py builds them."""
    from training.mixed_precision import PARAMS_DTYPE, build_data_parallel_model

    from .build import build_model

    built = build_model(cfg.model, cfg.precision, vocab_size=vocab, backend="emulated",
                        params_dtype=PARAMS_DTYPE, recompute=recompute_config_of(cfg.trainer))
    model, optimizer = build_data_parallel_model(built.module, cfg.trainer, ctx)
    return model, optimizer


def _train(cfg, vocab: int, ctx, steps: int, micro_batches: int):
    """`steps` optimizer steps on random tokens, as Trainer.train_step runs them."""
    import torch

    from training.pipeline import run_micro_batches

    tr = cfg.trainer
    model, optimizer = _build_like_trainer(cfg, vocab, ctx)
    gen = torch.Generator().manual_seed(0)
    shape = (tr.seq_length, tr.micro_batch_size, cfg.model.hidden_size)
    for _ in range(steps):
        batches = []
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (tr.micro_batch_size, tr.seq_length + 1),
                                   generator=gen)
            batches.append({"tokens": tokens[:, :-1].contiguous(),
                            "labels": tokens[:, 1:].contiguous(),
                            "loss_mask": torch.ones(tr.micro_batch_size, tr.seq_length)})
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        run_micro_batches(model, batches, ctx, shape)
        optimizer.prepare_grads()
        optimizer.clip_grad_norm(tr.grad_clip)
        optimizer.step_with_ready_grads()
        del batches
    return model, optimizer


def saved_activation_bytes(model, kinds: list[str], batch: dict) -> dict[str, Any]:
    """Bytes autograd saves for backward in one forward of `batch`, by what saved them: each
    decoder layer (averaged per kind) and the rest ("head": embedding, final norm, output layer,
    loss). Each storage is counted once, at its full size (a view keeps all of it alive);
    parameters are not activations and are left out."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    stack = next(m for m in model.modules()
                 if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen = ["head"], {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr not in seen:
                seen[ptr] = (where[0], storage.nbytes())
        return t

    handles = []
    for i, layer in enumerate(stack.layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: where.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda *_: where.__setitem__(0, "head")))
    try:
        with saved_tensors_hooks(pack, lambda t: t):
            out = model(batch["tokens"], None, None, labels=batch["labels"])
        del out
    finally:
        for h in handles:
            h.remove()
    per_layer = [0] * len(stack.layers)
    head = 0
    for owner, nbytes in seen.values():
        if owner == "head":
            head += nbytes
        else:
            per_layer[owner] += nbytes
    by_kind = {}
    for kind in dict.fromkeys(kinds):
        sizes = [n for n, k in zip(per_layer, kinds) if k == kind]
        by_kind[kind] = sum(sizes) / len(sizes)
    return {"per_layer_by_kind": by_kind, "head": head, "total": head + sum(per_layer)}


def measure(steps: int = 2, micro_batches: int = 2, micro_batch_size: int = 4,
            seq_length: int = 256, hidden_size: Optional[int] = None,
            vocab_size: int = 4096, recompute: str = "none") -> dict[str, Any]:
    """Train the demo-shaped model `steps` optimizer steps on random tokens on CPU, built and
    stepped as the trainer does (BF16 weights, FP32 main grads, FP32 master + Adam, the
    trainer's recompute), and compare its memory with the plan of the same configuration.

    Measured = RSS high-water mark minus the RSS before the model is built (reset after a
    warm-up), so every allocation torch makes counts, short-lived ones included. Static = RSS
    after the last step (weights, grads, optimizer; activations freed) minus the same baseline.
    RSS is page-granular and includes allocator caching: run it in a fresh process with
    glibc's mmap threshold fixed (main() does)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from training.distributed import ParallelContext

    from .compat import seed_model_parallel_rng

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
    ctx = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                          pipeline_rank=0, data_rank=0, device=torch.device("cpu"))
    cfg = measure_config(steps=steps, micro_batches=micro_batches,
                         micro_batch_size=micro_batch_size, seq_length=seq_length,
                         hidden_size=hidden_size, vocab_size=vocab_size, recompute=recompute)
    started = _time.perf_counter()
    try:
        planned = build_plan(cfg, PlanConfig(gpus=1, backend="emulated"))
        seed_model_parallel_rng(cfg.trainer.seed)
        # Warm-up on a 16x narrower model with the same recompute: faults in the library code
        # and kernels the real run uses (they count in RSS but are not part of the plan).
        tiny = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, hidden_size=max(cfg.model.hidden_size // 16, 16),
            ffn_hidden_size=max(cfg.model.ffn_hidden_size // 16, 16)))
        torch.manual_seed(0)
        warm = _train(tiny, vocab_size, ctx, 1, micro_batches)
        del warm
        gc.collect()
        baseline = _rss()
        reset = _reset_peak_rss()
        baseline_peak = _peak_rss()
        torch.manual_seed(0)
        model, optimizer = _train(cfg, vocab_size, ctx, steps, micro_batches)
        static = _rss() - baseline
        peak = _peak_rss() - baseline
        # After the measurement (it allocates): what autograd saves, by layer kind.
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        model.train()
        saved = saved_activation_bytes(model, cfg.model.layer_kinds(),
                                       {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        del model, optimizer
    finally:
        if created:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    mem = planned["memory"]
    planned_static = (mem["weights_bf16_gib"] + mem["main_grads_fp32_gib"]
                      + mem["optimizer_fp32_gib"])
    return {
        "machine": _machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(_time.perf_counter() - started, 1),
        "config": {"pattern": cfg.model.pattern, "hidden_size": cfg.model.hidden_size,
                   "vocab_size": vocab_size, "micro_batch_size": micro_batch_size,
                   "micro_batches": micro_batches, "seq_length": seq_length, "steps": steps,
                   "parameters": planned["parameters"], "recompute": recompute,
                   "precision": "bf16 (portable spec, BF16 weights, CPU twin of megatron's "
                                "DDP + optimizer)"},
        "baseline_rss_gib": round(baseline / GIB, 3),
        "peak_reset": reset,
        "baseline_was_peak": (not reset) and baseline_peak > baseline + peak,
        "measured_peak_gib": round(peak / GIB, 4),
        "measured_static_gib": round(static / GIB, 4),
        "measured_activations_gib": round((peak - static) / GIB, 4),
        "planned_gib": planned["memory_per_rank_gib"],
        "planned_static_gib": round(planned_static, 4),
        "planned_activations_gib": round(planned["memory_per_rank_gib"] - mem["static_gib"], 4),
        "planned_terms_gib": {k: mem[k] for k in (
            "weights_bf16_gib", "main_grads_fp32_gib", "optimizer_fp32_gib", "activations_gib",
            "logits_gib", "recompute_peak_gib", "transient_gib")},
        "planned_peak_phase": mem["peak_phase"],
        "saved_per_layer_mib": {k: round(v / 2**20, 3)
                                for k, v in saved["per_layer_by_kind"].items()},
        "planned_per_layer_mib": {
            k: round(sum(activation_elements_per_token(k, cfg.model, 1).values())
                     * micro_batch_size * seq_length * BYTES_ACTIVATION / 2**20, 3)
            for k in dict.fromkeys(cfg.model.layer_kinds())},
        "saved_head_mib": round(saved["head"] / 2**20, 3),
        "saved_total_mib": round(saved["total"] / 2**20, 3),
        "ratio_static": round(static / GIB / planned_static, 3) if planned_static else None,
        "ratio_peak": round(peak / GIB / planned["memory_per_rank_gib"], 3),
        "ratio_activations": round((peak - static) / (planned["memory_per_rank_gib"]
                                                      - mem["static_gib"]) / GIB, 3),
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


# glibc keeps freed heap memory in its arenas, so RSS would not fall when tensors are freed; with
# a fixed 64 KiB mmap threshold every tensor buffer above it is its own mapping, returned to the
# kernel on free, and RSS follows the live tensor bytes.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def measure_settings(settings: list[str], repeats: int, args: list[str]) -> list[dict]:
    """Each recompute setting in its own fresh process (RSS is per process), interleaved over
    the repeats so that a change of the machine's load hits every setting alike."""
    results = []
    for rep in range(repeats):
        for setting in settings:
            cmd = [sys.executable, "-m", "model.plan", "--measure", "--recompute", setting, *args]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, **MALLOC_ENV})
            if proc.returncode:
                results.append({"setting": setting, "repeat": rep,
                                "error": (proc.stderr or proc.stdout)[-600:]})
            else:
                results.append({"setting": setting, "repeat": rep, **json.loads(proc.stdout)})
            print(json.dumps({k: results[-1].get(k) for k in (
                "setting", "repeat", "ratio_static", "ratio_peak", "ratio_activations",
                "load_average", "seconds", "error")}), file=sys.stderr, flush=True)
    return results


def calibrated_activations_gib(result: dict, full_layers: dict,
                               kept_layers: Optional[dict] = None) -> float:
    """The plan's recompute and peak formulas (stage_activation_bytes) applied to what the CPU
    layers measurably save, which separates the recompute accounting from the per-layer model.
    `full_layers`: a recompute=none run (each layer's full activations); `kept_layers`: for
    selective, a selective run (what each layer keeps; while a layer's backward runs its
    recomputed mixer holds the full activations again). End of forward: kept + the head's saved
    tensors + the BF16 logits alive next to their FP32 copy."""
    from .config import LAYER_SYMBOLS
    from .recompute import RecomputeConfig

    c = result["config"]
    kinds = [LAYER_SYMBOLS[ch] for ch in c["pattern"]]
    full = [full_layers["saved_per_layer_mib"][k] * 2**20 for k in kinds]
    tokens = c["micro_batch_size"] * c["seq_length"]
    head = full_layers["saved_head_mib"] * 2**20 + tokens * c["vocab_size"] * BYTES_ACTIVATION
    if kept_layers is not None:  # selective: every layer a one-layer "chunk" keeping this much
        kept = [kept_layers["saved_per_layer_mib"][k] * 2**20 for k in kinds]
        peak = max(sum(kept[:i]) + full[i] for i in range(len(kinds)))
        return max(sum(kept) + head, peak) / GIB
    granularity, method, layers = parse_recompute(c["recompute"])
    acts = stage_activation_bytes(full, tokens * c["hidden_size"] * BYTES_ACTIVATION,
                                  RecomputeConfig(granularity, method, layers))
    return max(acts["kept"] + head, acts["recompute_peak"]) / GIB


def summary_table(results: list[dict]) -> str:
    """Markdown: per setting, planned and measured (median over repeats) and their ratios."""
    rows = ["| recompute | static: planned / measured | ratio | peak: planned / measured "
            "(min-max) | ratio | activations: planned / measured | ratio | plan formulas on "
            "the measured layers | ratio | runs |", "|---|" + "---:|" * 9]
    ok_runs = [r for r in results if "error" not in r]
    for setting in dict.fromkeys(r["setting"] for r in results):
        ok = [r for r in ok_runs if r["setting"] == setting]
        if not ok:
            err = next(r["error"] for r in results if r["setting"] == setting)
            rows.append(f"| {setting} | failed: {err.splitlines()[-1][:120]} |" + " |" * 8)
            continue

        def med(key, runs=ok):
            return statistics.median(r[key] for r in runs)

        nones = [r for r in ok_runs if r["setting"] == "none"]
        calibrated = "-", "-"
        if nones:
            kept = None
            if setting == "selective":
                kept = min(ok, key=lambda r: r["repeat"])
            cal = calibrated_activations_gib(ok[0], min(nones, key=lambda r: r["repeat"]), kept)
            calibrated = f"{cal:.3f}", f"**{med('measured_activations_gib') / cal:.2f}**"
        peaks = [r["measured_peak_gib"] for r in ok]
        rows.append(
            f"| {setting} | {ok[0]['planned_static_gib']:.3f} / {med('measured_static_gib'):.3f} "
            f"| **{med('ratio_static'):.2f}** | {ok[0]['planned_gib']:.3f} / "
            f"{med('measured_peak_gib'):.3f} ({min(peaks):.3f}-{max(peaks):.3f}) | "
            f"**{med('ratio_peak'):.2f}** | {ok[0]['planned_activations_gib']:.3f} / "
            f"{med('measured_activations_gib'):.3f} | **{med('ratio_activations'):.2f}** | "
            f"{calibrated[0]} | {calibrated[1]} | {len(ok)} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model.plan",
        description="Validate the memory plan against a short CPU training run "
                    "(plans of real runs: python train.py run.dry_run=true ...).")
    parser.add_argument("--measure", action="store_true", help="run the CPU measurement")
    parser.add_argument("--recompute", default="none",
                        help="none | selective | full[:uniform|block[:N]]; a comma-separated "
                             "list measures each in its own process, interleaved over --repeats")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write every run's result here")
    args = parser.parse_args(argv)
    if not args.measure:
        parser.print_help()
        return 2
    settings = args.recompute.split(",")
    for setting in settings:
        parse_recompute(setting)  # a bad setting fails here, not in a subprocess
    if len(settings) > 1 or args.repeats > 1:
        passed = ["--steps", str(args.steps), "--micro-batches", str(args.micro_batches),
                  "--micro-batch-size", str(args.micro_batch_size), "--seq-length",
                  str(args.seq_length)]
        if args.hidden_size is not None:
            passed += ["--hidden-size", str(args.hidden_size)]
        results = measure_settings(settings, args.repeats, passed)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(summary_table(results))
        return 1 if any("error" in r for r in results) else 0
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "model.plan", *argv],
                  {**os.environ, **MALLOC_ENV})
    result = measure(steps=args.steps, micro_batches=args.micro_batches,
                     micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                     hidden_size=args.hidden_size, recompute=args.recompute)
    json.dump(result, sys.stdout, indent=1)
    print()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
