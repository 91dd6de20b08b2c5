"""The dry-run planner: layer precisions, parameters, memory per rank, FLOPs and time of a run.

`dry_run(cfg, ctx)` builds the model on the meta device (no memory, seconds even at 12B) with the
*portable* spec at tensor = pipeline = 1, reads the precision of every linear from the built
modules (each one was chosen by `nvfp4_recipe`'s precision policy) and derives the per-rank
numbers for the layout in `cfg.parallel` analytically, so a single process can plan a
4-way tensor-parallel run. It prints a table and writes `plan.json` into `run.dir`, with the
precision map (`precision_map`) and the preflight (`preflight`: every low-precision GEMM's local
shapes checked against the rules of each backend the run may use, at parallel.tensor and at
tensor 1/2/4/8; training/preflight.py, the same check the trainer runs at start-up).

The memory model is the trainer's: megatron's `--bf16` mixed precision
(training/ddp_optimizer.py), `trainer.distributed_optimizer`, `trainer.recompute*`
(model/recompute.py) and `parallel.sequence`. Parameters per rank and the activations one
micro-batch keeps per layer are the model's accounting (model/memory_model.py, with its formulas);
this module adds what the training set-up holds. P_rank = parameters per rank of a stage,
d = data parallel, p = pipeline parallel; GiB = 2^30 bytes:

Static memory per rank (Megatron-LM's count: 18 B/param, or 6 + 12/d with the distributed
optimizer, megatron/training/theoretical_memory_usage.py:293-296 at core_v0.19.0)
    weights     2 P_rank    BF16 (megatron's Float16Module casts every parameter).
    main grads  4 P_rank    FP32 gradient buffer (grad_reduce_in_fp32); full size on every rank,
                            also under the distributed optimizer (it reduce-scatters in place).
    optimizer  12 P_rank / d_opt   FP32 master weights + Adam exp_avg + exp_avg_sq; d_opt = d with
                            trainer.distributed_optimizer, else 1 (every replica holds all of it).
    TE weights  (plan backend te only) the quantized copies TE caches of each low-precision GEMM
                weight across micro-batches, row-wise for Fprop and column-wise for Dgrad:
                NVFP4 2 x (0.5 + 1/16) B, FP8 2 x 1 B, MXFP8 2 x (1 + 1/32) B per weight element
                (model/memory_model.py's QUANTIZED_BYTES_PER_ELEMENT; an estimate of TE's
                workspaces; BF16 linears keep none; MXFP4 has no TE recipe).

MoE layers' routed experts (built whole, at expert parallel 1): P_experts / (EP x ETP) per rank,
    their optimizer state sharded over the expert data-parallel group (world / (EP x ETP x PP))
    with trainer.distributed_optimizer, as megatron's distributed optimizer shards expert
    parameters; plan.json's `experts` adds the all-to-all bytes one rank sends per step
    (all_to_all_bytes).

Micro-batches in flight
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
    2 V h / t B), the scale padding of TE's quantized saved inputs (counted at
    QUANTIZED_BYTES_PER_ELEMENT: model/memory_model.py), kernel workspaces,
    the CUDA context and allocator fragmentation. The activation model is the GPU kernels'; the
    portable spec on CPU keeps more (FP32 SSD-scan and attention intermediates):
    docs/benchmarks/memory-plan.md measures both.

FLOPs per token: model/flops.py (the one count, shared with the hardware bench's MFU).

Time
    time_s = flops_per_token x total_tokens / (gpus x peak_tflops x 1e12 x mfu), with MFU on
    model FLOPs (activation recompute costs up to ~1/3 more hardware FLOPs, which shows up as a
    lower achievable MFU, not in this formula). Low-precision GEMMs run faster than BF16 peak, so
    at a given `mfu` the BF16 peak makes this a conservative (long) estimate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from atomic_files import write_text_atomically
from errors import ExitCode
from field_ranges import above, at_least, check_fields, within
from model.flops import flops_per_token_terms, gemm_weights, inactive_parameters
from model.memory_model import (
    BYTES_ACTIVATION,
    BYTES_EMULATED_WEIGHT_COPY,
    BYTES_LOGITS,
    GIB,
    QUANTIZED_BYTES_PER_ELEMENT,
    activation_elements_per_token,
    emulated_keeps_weight_copy,
    linear_weight_counts,
    parameter_counts,
    pipeline_stages,
    sharded_param_ids,
    stage_activation_bytes,
    te_layer_activation_bytes_per_token,
)
from model.recompute import RecomputeConfig
from nvfp4_recipe.policy import describe_precision_map

from .preflight import preflight, preflight_backends, probe_device

BYTES_WEIGHT = 2  # BF16 parameters (Float16Module)
BYTES_MAIN_GRAD = 4  # FP32 main-grad buffer
BYTES_OPTIMIZER = 12  # FP32 master weight + exp_avg + exp_avg_sq
BYTES_ADAM_TEMP = 4  # foreach AdamW's sqrt(exp_avg_sq) buffer
# TE's cached quantized weight per element: row-wise + column-wise data and their block scales.
TE_WEIGHT_CACHE_BYTES = {fmt: 2 * n for fmt, n in QUANTIZED_BYTES_PER_ELEMENT.items()}
BACKENDS = ("te", "emulated")
# Vocabulary when none is known without building data: model.vocab_size unset and data.tokenizer
# naming a file that does not exist (yet). The demo tokenizer uses data.demo.vocab_size instead.
PLACEHOLDER_VOCAB = 8192


@dataclass
class PlanConfig:
    """Hydra group `plan` (the dry run's assumptions about the target machine)."""

    # GPUs of the run; None = tensor x pipeline (data parallel 1). Must be a multiple of it.
    gpus: Optional[int] = field(default=None, metadata=at_least(1))
    # Dense BF16 peak of one device in TFLOP/s. 2500 = GB200 (Blackwell): NVIDIA's GB200 NVL72
    # datasheet lists 5 PFLOPS FP16/BF16 per GPU *with* 2:4 sparsity, i.e. 2.5 PFLOPS dense.
    # H100/H200 SXM: 989.
    peak_tflops: float = field(default=2500.0, metadata=above(0))
    # Model-FLOPs utilisation assumed for the time estimate (0.4 is typical of well-tuned
    # Megatron pretraining at this scale; an assumption, not a measurement).
    mfu: float = field(default=0.4, metadata=within(0, 1, low_open=True))
    # Tokens of the run; None = trainer.max_steps x global_batch_size x seq_length.
    total_tokens: Optional[int] = field(default=None, metadata=at_least(1))
    # The GEMM backend of the target machine (te | emulated), which changes the low-precision
    # weight copies and the optimizer's step buffer; None = the one this machine would use.
    backend: Optional[str] = None

    def __post_init__(self):
        check_fields(self, "plan")


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


def recompute_config_of(trainer):
    """The trainer's recompute setting as a validated RecomputeConfig."""
    rc = RecomputeConfig(getattr(trainer, "recompute", "none"),
                         getattr(trainer, "recompute_method", "uniform"),
                         getattr(trainer, "recompute_layers", 1))
    rc.validate()
    return rc



# -- the plan -----------------------------------------------------------------------------------


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def _build_meta(cfg, vocab_padded: int, policy=None):
    """The full (TP = 1) model on the meta device, with `policy` (the start-up's precision
    policy; None builds it); returns the BuiltModel."""
    import torch
    from megatron.core import parallel_state

    # deferred: model.build imports megatron (~3 s), and training.config imports this module: a
    # refused start exits before megatron loads
    from model.build import build_model

    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1):
        raise ValueError(
            "the dry run builds the unsharded model: initialise megatron's parallel state with "
            "tensor = pipeline = 1 (the plan divides by parallel.tensor itself)")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab_padded, spec="portable")
    with torch.device("meta"):
        return build_model(model_cfg, cfg.precision, vocab_size=vocab_padded, initialize=False,
                           backend="emulated", policy=policy)


def _plan_backend(cfg, plan: PlanConfig) -> tuple[str, str]:
    from model.build import choose_backend  # deferred: megatron, as in _build_meta

    if plan.backend is not None:
        if plan.backend not in BACKENDS:
            raise ValueError(f"plan.backend={plan.backend!r}: choose te, emulated or null")
        return plan.backend, "plan.backend"
    try:
        return choose_backend(cfg.precision, cfg.model.spec)
    except ValueError as exc:  # backend=te requested on a machine without it: plan anyway
        return "te", f"requested; not available on this machine ({exc})"


@dataclass
class _Layout:
    """How the run splits over its GPUs, and what that means for one rank."""

    gpus: int
    tensor: int
    pipeline: int
    data: int
    micro_batches: int  # per optimizer step, per data-parallel rank
    sequence_parallel: bool
    distributed_optimizer: bool
    optimizer_shards: int  # d_opt of the module docstring
    # MoE layers' routed experts (1, tensor, data and d_opt without any): split over
    # expert_parallel ranks, each expert over expert_tensor ranks, replicated over expert_data
    expert_parallel: int = 1
    expert_tensor: int = 1
    expert_data: int = 1
    expert_optimizer_shards: int = 1  # d_opt of the experts: expert_data, distributed


def _layout(cfg, plan: PlanConfig) -> _Layout:
    """The run's layout from plan.gpus and cfg.parallel; refuses one the batch does not split
    into, and an impossible machine (mfu, peak)."""
    par, tr = cfg.parallel, cfg.trainer
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
    if not 0 < plan.mfu <= 1 or plan.peak_tflops <= 0:
        raise ValueError(f"plan.mfu={plan.mfu} must be in (0, 1] and plan.peak_tflops="
                         f"{plan.peak_tflops} positive")
    distributed = bool(getattr(tr, "distributed_optimizer", False))
    ep, etp = 1, t
    if cfg.model.moe is not None:
        ep = getattr(par, "expert_model_parallel_size", 1)
        etp = getattr(par, "expert_tensor_parallel_size", None) or t
        if gpus % (ep * etp * p):
            raise ValueError(f"plan.gpus={gpus} is not a multiple of expert parallel {ep} x "
                             f"expert tensor parallel {etp} x pipeline {p}")
    edp = gpus // (ep * etp * p)
    return _Layout(gpus=gpus, tensor=t, pipeline=p, data=dp,
                   micro_batches=tr.global_batch_size // (tr.micro_batch_size * dp),
                   sequence_parallel=bool(par.sequence) and t > 1,
                   distributed_optimizer=distributed, optimizer_shards=dp if distributed else 1,
                   expert_parallel=ep, expert_tensor=etp, expert_data=edp,
                   expert_optimizer_shards=edp if distributed else 1)


@dataclass
class _Parameters:
    """The built model's parameters: per layer (plan.json rows, per rank, low-precision GEMM
    weights per rank by format) and per part (full, per rank)."""

    layers: list[dict[str, Any]]
    linear_counts: dict[str, int]  # linears per format
    layer_per_rank: list[int]  # routed experts included
    layer_expert_per_rank: list[int]  # the routed experts' share of layer_per_rank
    layer_lowp_weights: list[dict[str, int]]  # {format: weight elements per rank}
    total: int
    embedding: tuple[int, int]
    output_layer: tuple[int, int]
    final_norm: tuple[int, int]
    gemm: int  # the weights model/flops.py counts


def _count_parameters(built, m, layout: _Layout, vocab_padded: int) -> _Parameters:
    """Counts the built model's parameters, and checks that every built linear has the format
    the precision policy chose and that the FLOP model sees the GEMMs that were built. The
    routed experts of an MoE layer (built whole, at expert parallel 1) count per rank over
    expert parallel x expert tensor parallel."""
    module = built.module
    tensor = layout.tensor
    expert_split = layout.expert_parallel * layout.expert_tensor
    sharded = sharded_param_ids(module)
    decisions = built.policy.layers()
    kinds = m.layer_kinds()
    layers, counts = [], {}
    layer_rank_params, layer_expert_params, layer_lowp = [], [], []
    for i, layer in enumerate(module.decoder.layers):
        linears, lowp = {}, {}
        for name in built.policy.linear_names.get(kinds[i], ()):  # an MoE layer's are the model's
            sub = layer.get_submodule(name)  # built at EP = 1: an expert's global index is local
            fmt = getattr(sub, "gemm_format", None)
            if fmt != decisions[i].linear_format(name):
                raise AssertionError(f"layer {i} {name}: built {fmt!r}, policy "
                                     f"{decisions[i].linear_format(name)!r}")
            linears[name] = fmt
            counts[fmt] = counts.get(fmt, 0) + 1
            if fmt != "bf16":
                n = sub.weight.numel()
                if ".experts." in name:  # a routed expert's
                    n //= expert_split
                elif id(sub.weight) in sharded:
                    n //= tensor
                lowp[fmt] = lowp.get(fmt, 0) + n
        full, rank = parameter_counts(layer, sharded, tensor)
        experts = 0
        if kinds[i] == "moe":
            routed, routed_by_tensor = parameter_counts(layer.mlp.experts, sharded, tensor)
            if routed % expert_split:
                raise ValueError(f"layer {i}'s routed experts ({routed:,} parameters) do not "
                                 f"split over expert parallel x expert tensor parallel "
                                 f"{expert_split}")
            experts = routed // expert_split
            rank += experts - routed_by_tensor
        layer_rank_params.append(rank)
        layer_expert_params.append(experts)
        layer_lowp.append(lowp)
        formats = set(linears.values())
        layers.append({"index": i, "kind": kinds[i],
                       "precision": formats.pop() if len(formats) == 1 else "mixed",
                       "linears": linears, "parameters": full, "parameters_per_rank": rank})

    embedding = parameter_counts(module.embedding, sharded, tensor)
    output_layer = parameter_counts(module.output_layer, sharded, tensor)
    final_norm = parameter_counts(module.decoder.final_norm, sharded, tensor)
    gemm_full, _ = linear_weight_counts(module.decoder, sharded, tensor)
    gemm_full += output_layer[0]
    if gemm_full != gemm_weights(m, vocab_padded):  # the FLOP count must see the built GEMMs
        raise AssertionError(f"built GEMM weights {gemm_full:,} != model/flops.py's "
                             f"{gemm_weights(m, vocab_padded):,}")
    return _Parameters(layers=layers, linear_counts=counts, layer_per_rank=layer_rank_params,
                       layer_expert_per_rank=layer_expert_params, layer_lowp_weights=layer_lowp,
                       total=sum(q.numel() for q in module.parameters()), embedding=embedding,
                       output_layer=output_layer, final_norm=final_norm, gemm=gemm_full)


def _stage_rows(cfg, layout: _Layout, params: _Parameters, backend: str, recompute,
                vocab_padded: int) -> tuple[list[dict[str, Any]], dict[str, float], int]:
    """Memory per rank of each pipeline stage (module docstring), with the activation elements
    per token of each layer kind and the bytes of one layer input it used."""
    m, tr = cfg.model, cfg.trainer
    t, p, sp = layout.tensor, layout.pipeline, layout.sequence_parallel
    kinds = m.layer_kinds()
    # Activations of one micro-batch, per layer (bytes): BF16 tensors (TE: quantized linear
    # inputs) + emulated weight copies.
    b, s = tr.micro_batch_size, tr.seq_length
    per_token = {k: sum(activation_elements_per_token(k, m, t, sp).values())
                 for k in dict.fromkeys(kinds)}
    if backend == "te":  # each low-precision linear keeps its input as TE quantized it
        act_layer = [round(te_layer_activation_bytes_per_token(k, m, t, sp, layer["linears"]) * b * s)
                     for k, layer in zip(kinds, params.layers)]
    else:  # the emulated linear keeps its BF16 input (nvfp4_recipe/linear.py)
        act_layer = [round(per_token[k] * b * s * BYTES_ACTIVATION) for k in kinds]
    if backend == "emulated":
        weight_2d = cfg.precision.weight_2d
        act_layer = [a + BYTES_EMULATED_WEIGHT_COPY * sum(
                         n for fmt, n in lp.items() if emulated_keeps_weight_copy(fmt, weight_2d))
                     for a, lp in zip(act_layer, params.layer_lowp_weights)]
    h_sp = m.hidden_size // (t if sp else 1)
    input_bytes = b * s * h_sp * BYTES_ACTIVATION  # one layer's input (a checkpointed chunk's)

    stages = pipeline_stages(m.num_layers, p, cfg.parallel.first_stage_layers,
                             cfg.parallel.last_stage_layers)
    rows = []
    for r, st in enumerate(stages):
        n_params = sum(params.layer_per_rank[i] for i in st)
        n_experts = sum(params.layer_expert_per_rank[i] for i in st)
        if r == 0:
            n_params += params.embedding[1]
        last = r == p - 1
        if last:
            n_params += params.output_layer[1] + params.final_norm[1]
        te_cache = 0
        if backend == "te":
            for i in st:
                for fmt, n in params.layer_lowp_weights[i].items():
                    if fmt not in TE_WEIGHT_CACHE_BYTES:
                        raise ValueError(f"{fmt} linears do not run on TE (layer {i}): plan with "
                                         "plan.backend=emulated")
                    te_cache += TE_WEIGHT_CACHE_BYTES[fmt] * n
        # the distributed optimizer shards the experts over their own data-parallel group
        opt_elems = (-(-(n_params - n_experts) // layout.optimizer_shards)
                     + -(-n_experts // layout.expert_optimizer_shards))
        static = {"weights": BYTES_WEIGHT * n_params, "main_grads": BYTES_MAIN_GRAD * n_params,
                  "optimizer": BYTES_OPTIMIZER * opt_elems, "te_weight_cache": round(te_cache)}
        acts = stage_activation_bytes([act_layer[i] for i in st], input_bytes, recompute)
        head = 2 * b * s * h_sp * BYTES_ACTIVATION if last else 0  # final norm in, output in
        kept = acts["kept"] + head
        logits = b * s * vocab_padded // t * BYTES_LOGITS if last else 0
        in_flight = min(p - r, layout.micro_batches)
        end_of_forward = in_flight * kept + logits
        recompute_peak = ((in_flight - 1) * kept + acts["recompute_peak"]
                          if acts["recompute_peak"] else 0)
        transient = BYTES_ADAM_TEMP * opt_elems if backend == "emulated" else 0
        static_total = sum(static.values())
        rows.append({
            "stage": r, "layers": [st.start, st.stop - 1] if len(st) else [],
            "parameters_per_rank": n_params, "expert_parameters_per_rank": n_experts,
            "optimizer_elements_per_rank": opt_elems,
            "all_to_all_bytes_per_step": all_to_all_bytes(
                cfg, layout, sum(kinds[i] == "moe" for i in st)),
            "in_flight_micro_batches": in_flight,
            "static_bytes": static_total, **{f"{k}_bytes": v for k, v in static.items()},
            "kept_per_micro_batch_bytes": kept, "activation_bytes": in_flight * kept,
            "logit_bytes": logits, "recompute_peak_bytes": recompute_peak,
            "transient_bytes": transient,
            "total_bytes": static_total + max(end_of_forward, recompute_peak, transient)})
    return rows, per_token, input_bytes


def all_to_all_bytes(cfg, layout: _Layout, moe_layers: int) -> int:
    """Bytes one rank sends in the MoE token all-to-alls of an optimizer step, at expert
    parallel > 1 (0 otherwise). megatron's all-to-all dispatcher sends each of the rank's
    tokens' hidden states (BF16) to the ranks holding its top-k experts, and the combine sends
    the expert outputs back (mc 0.16.1 transformer/moe/token_dispatcher.py:647-672, 787-815);
    the backward runs both again on the gradients. With the load balanced, (EP - 1) / EP of the
    top-k copies leave the rank. Tokens per rank: the micro-batch's, over the tensor-parallel
    ranks under sequence parallelism. The routing probabilities (FP32, top-k per token) and the
    token-count exchange are left out (below 1 / h of it)."""
    ep = layout.expert_parallel
    if ep == 1 or not moe_layers:
        return 0
    tr, m = cfg.trainer, cfg.model
    tokens = tr.micro_batch_size * tr.seq_length // (layout.tensor if layout.sequence_parallel
                                                     else 1)
    per_pass = tokens * m.moe.topk * m.hidden_size * BYTES_ACTIVATION * (ep - 1) // ep
    return 4 * per_pass * moe_layers * layout.micro_batches  # dispatch + combine, fwd + bwd


def _memory(cfg, layout: _Layout, stage_rows: list[dict[str, Any]], per_token: dict[str, float],
            input_bytes: int, backend: str, recompute) -> dict[str, Any]:
    """plan.json's `memory`: the terms of the busiest stage, and every stage's row."""
    b, s = cfg.trainer.micro_batch_size, cfg.trainer.seq_length
    busiest = max(stage_rows, key=lambda row: row["total_bytes"])
    peak_phase = max((("end of forward", busiest["activation_bytes"] + busiest["logit_bytes"]),
                      ("recompute", busiest["recompute_peak_bytes"]),
                      ("optimizer step", busiest["transient_bytes"])), key=lambda x: x[1])[0]
    return {
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
        "micro_batch_size": b, "seq_length": s, "micro_batches_per_step": layout.micro_batches,
        "distributed_optimizer": layout.distributed_optimizer,
        "optimizer_sharded_over": layout.optimizer_shards,
        "sequence_parallel": layout.sequence_parallel,
        "recompute": dataclasses.asdict(recompute),
        "stages": stage_rows,
    }


def _experts(layout: _Layout, stage_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """plan.json's `experts` (MoE models): how the routed experts split, and the busiest
    stage's expert parameters and all-to-all bytes per rank and step."""
    busiest = max(stage_rows, key=lambda row: row["total_bytes"])
    return {"expert_parallel": layout.expert_parallel,
            "expert_tensor_parallel": layout.expert_tensor,
            "expert_data_parallel": layout.expert_data,
            "expert_parameters_per_rank": busiest["expert_parameters_per_rank"],
            "all_to_all_gib_per_step": _gib(busiest["all_to_all_bytes_per_step"])}


def _time(cfg, plan: PlanConfig, layout: _Layout, flops_per_token: float) -> dict[str, Any]:
    """plan.json's `time`: the run's length at plan.mfu of plan.peak_tflops (module docstring)."""
    tr = cfg.trainer
    s = tr.seq_length
    tokens = plan.total_tokens if plan.total_tokens is not None else (
        tr.max_steps * tr.global_batch_size * s)
    cluster_flops = layout.gpus * plan.peak_tflops * 1e12 * plan.mfu
    seconds = flops_per_token * tokens / cluster_flops
    tokens_per_step = tr.global_batch_size * s
    return {
        "total_tokens": tokens, "gpus": layout.gpus, "tensor": layout.tensor,
        "pipeline": layout.pipeline, "data": layout.data,
        "peak_tflops": plan.peak_tflops, "mfu": plan.mfu,
        "steps": math.ceil(tokens / tokens_per_step),
        "tokens_per_step": tokens_per_step,
        "step_seconds": round(flops_per_token * tokens_per_step / cluster_flops, 4),
        "tokens_per_second": round(cluster_flops / flops_per_token, 1),
        "total_flops": flops_per_token * tokens,
        "seconds": round(seconds, 1), "days": round(seconds / 86400, 2),
        "gpu_hours": round(seconds * layout.gpus / 3600, 1),
    }


def _resumed_map(cfg) -> dict:
    """The formats a run.resume=auto run continues with where precision.adaptive switched
    linears before its newest checkpoint ({}: the policy's)."""
    # deferred: training.precision imports megatron, as _build_meta does
    from training.precision import resume_precision_map

    return resume_precision_map(cfg.run.dir) if cfg.run.resume == "auto" else {}


def build_plan(cfg, plan: Optional[PlanConfig] = None, policy=None) -> dict[str, Any]:
    """The plan of a TrainConfig as the plan.json dictionary (needs megatron's parallel state
    initialised with tensor = pipeline = 1). `policy`: the start-up's precision policy of `cfg`
    (training.config.validate's); None builds it, once, for the model and the preflight."""
    from model.build import padded_vocab_size  # deferred: megatron, as in _build_meta

    plan = plan or plan_config_of(cfg)
    m = cfg.model
    layout = _layout(cfg, plan)
    recompute = recompute_config_of(cfg.trainer)
    backend, reason = _plan_backend(cfg, plan)

    vocab, vocab_source = resolve_vocab(cfg)
    vocab_padded = padded_vocab_size(vocab, m.vocab_multiple, layout.tensor)
    built = _build_meta(cfg, vocab_padded, policy)
    params = _count_parameters(built, m, layout, vocab_padded)
    stage_rows, per_token, input_bytes = _stage_rows(cfg, layout, params, backend, recompute,
                                                     vocab_padded)
    memory = _memory(cfg, layout, stage_rows, per_token, input_bytes, backend, recompute)
    flops = flops_per_token_terms(m, cfg.trainer.seq_length, vocab_padded)
    checks = preflight(cfg, built.policy, preflight_backends(cfg.precision, m.spec),
                       probe_device(cfg))

    return {
        "parameters": params.total,
        # what one token passes through: all but the routed experts it is not sent to
        "active_parameters": params.total - inactive_parameters(m),
        **({"experts": _experts(layout, stage_rows)} if m.moe is not None else {}),
        "parameters_per_rank": max(row["parameters_per_rank"] for row in stage_rows),
        "vocab_size": vocab, "vocab_size_padded": vocab_padded, "vocab_source": vocab_source,
        "pattern": m.pattern,
        "layers": params.layers,
        "linear_counts": params.linear_counts,
        "embedding_parameters": params.embedding[0],
        "output_layer_parameters": params.output_layer[0],
        "final_norm_parameters": params.final_norm[0], "gemm_parameters": params.gemm,
        "recipe": built.policy.recipe(),
        # a run that continues from a checkpoint runs the formats its adaptive fallback chose
        "precision_map": built.policy.precision_map(_resumed_map(cfg)),
        "backend": backend, "backend_reason": reason,
        "preflight": checks.as_dict(),
        "memory_per_rank_gib": _gib(max(row["total_bytes"] for row in stage_rows)),
        "memory": memory,
        "flops_per_token": flops["total"],
        "flops": {"gemm_per_token": flops["gemm"], "attention_per_token": flops["attention"],
                  "ssd_scan_per_token": flops["ssd_scan"], "conv1d_per_token": flops["conv1d"],
                  "ratio_to_6P": round(flops["total"] / (6.0 * params.total), 4)},
        "time": _time(cfg, plan, layout, flops["total"]),
    }


# -- output -------------------------------------------------------------------------------------


def write_plan(plan: dict, run_dir) -> Path:
    """Write run_dir/plan.json atomically. plan.json is derived data and is rewritten by every dry
    run; no other file in run_dir is created, read or modified."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / "plan.json", json.dumps(plan, indent=1) + "\n")
    return run_dir / "plan.json"


_VERDICT_TEXT = {"ok": "clean", "slower": "slower path", "fail": "would fail"}


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _describe_experts(plan: dict) -> str:
    ex = plan["experts"]
    return (f"{plan['active_parameters']:,} of {plan['parameters']:,} parameters active per token; "
            f"routed experts over expert parallel {ex['expert_parallel']} x expert tensor "
            f"{ex['expert_tensor_parallel']} (expert data parallel {ex['expert_data_parallel']}): "
            f"{ex['expert_parameters_per_rank']:,} expert parameters / rank; all-to-all "
            f"{ex['all_to_all_gib_per_step']} GiB sent / rank / step")


def print_plan(plan: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"layers ({plan['pattern']})", show_lines=False)
    for col, just in (("#", "right"), ("kind", "left"), ("linears", "left"),
                      ("params", "right"), ("params/rank", "right")):
        table.add_column(col, justify=just)
    for row in plan["layers"]:
        style = None if row["precision"] == "bf16" else "cyan"
        fmts = set(row["linears"].values())
        # dict.fromkeys: an MoE layer's experts share their short names (linear_fc1, linear_fc2)
        linears = (", ".join(dict.fromkeys(map(_short, row["linears"]))) + f": {fmts.pop()}"
                   if len(fmts) == 1 else ", ".join(dict.fromkeys(
                       f"{_short(n)} {f}" for n, f in row["linears"].items())))
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
        *([("experts", _describe_experts(plan))] if "experts" in plan else []),
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


def dry_run(cfg, ctx, policy=None) -> int:
    """Plan the run of `cfg` (a TrainConfig) with `policy` (as build_plan), print it, write
    run.dir/plan.json on rank 0. Returns 2 when the preflight says the run would be refused
    (the plan, which says why, is written first), else 0.

    `ctx` is the current process group's ParallelContext; megatron's parallel state must be
    initialised with tensor = pipeline = 1 (the plan needs no GPUs and no real world size)."""
    plan = build_plan(cfg, policy=policy)
    refusal = plan["preflight"]["verdict"] == "fail"
    if ctx is None or ctx.is_main:
        print_plan(plan)
        path = write_plan(plan, cfg.run.dir)
        print(f"wrote {path}")
        if refusal:  # the plan is written (it says why); the exit code says the run would refuse
            print("error: the preflight would refuse this run (lines 'preflight: would fail' "
                  f"above); exit code {int(ExitCode.CONFIG)}")
    return ExitCode.CONFIG if refusal else ExitCode.OK

