"""The Mixture-of-Experts layer (`E` in model.pattern): megatron-core's MoELayer with the
precision policy's linears in its experts.

- Router: megatron's TopKRouter, in FP32 (moe_router_dtype="fp32"; its weight is an FP32
  parameter, mc 0.16.1 transformer/moe/router.py:53-55), never quantized: it is not a linear of
  the policy. `PortableTopKRouter` only allocates the expert-bias buffers where the router's
  weight lives (megatron puts them on torch.cuda.current_device(), router.py:163-179, which a
  CPU run does not have).
- Experts: megatron's SequentialMLP, one MLP per expert built from the layer's linear spec (the
  emulated PrecisionColumn/RowParallelLinear), so each expert's GEMMs run in the recipe's formats
  and every expert linear is a linear the precision controller steers. An expert whose linear
  `precision.overrides` gives another format is switched to it after the build
  (`PolicySequentialMLP`), by the same call the controller uses at run time (set_formats).
- Shared expert: megatron's SharedExpertMLP with the same linears.
- Dispatch: dropless (moe_expert_capacity_factor=None), by megatron's all-to-all token
  dispatcher on every device, so a CPU run over gloo runs the dispatch code a GPU runs over
  NCCL. `PortableAlltoAllTokenDispatcher` only replaces its device-to-host copies, which use a
  CUDA stream (mc 0.16.1 transformer/moe/token_dispatcher.py:862-901, core_v0.19.0 :913-952),
  by what they leave on a CPU run (`use_portable_dispatchers`, after the build); compat item 11
  keeps its constructor from making that stream on a torch without CUDA.

On the TE spec the experts would be megatron's TEGroupedMLP (one grouped GEMM per layer,
TEGroupedLinear; transformer/moe/experts.py:512 in mc 0.16.1), which runs NVFP4 only with TE's
grouped NVFP4 GEMM (TransformerEngine PR #2971) and needs per-expert token counts padded for
quantization (moe_router_padding_for_quantization, transformer_config.py:614-626). That path is
not wired here: `te_moe_refusal` says so before a model is built; docs/moe-te.md records the TE
releases and shape rules it needs.
"""

from __future__ import annotations

from copy import copy

import torch
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.utils import get_pg_rank

from compat import reset_moe_metrics_tracker
from nvfp4_recipe.passes import PassFormats

from .config import ModelConfig


def moe_transformer_fields(cfg: ModelConfig) -> dict:
    """megatron's TransformerConfig fields of the model's MoE layers ({} without any)."""
    moe = cfg.moe
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": moe.shared_expert_ffn_hidden_size,
        "moe_router_score_function": str(moe.score_function),
        "moe_router_topk_scaling_factor": moe.topk_scaling_factor,
        "moe_router_enable_expert_bias": moe.expert_bias,
        "moe_router_bias_update_rate": moe.bias_update_rate,
        "moe_router_load_balancing_type": str(moe.load_balancing),
        "moe_aux_loss_coeff": moe.aux_loss_coeff,
        # megatron refuses a softmax over one chosen score (its gradient is zero,
        # transformer_config.py:1632-1641): with top-1 the softmax runs over all experts first.
        "moe_router_pre_softmax": moe.topk == 1 and moe.score_function == "softmax",
        "moe_router_dtype": "fp32",  # the router stays in high precision
        "moe_expert_capacity_factor": None,  # dropless
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,  # SequentialMLP: one emulated linear pair per expert
    }


class PortableAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all token dispatcher, whose device-to-host copies also run on a CPU run.

    On a GPU, megatron's: at `cuda_dtoh_point` the split sizes and token counts are copied to the
    host on a side stream, and the step waits for them at `cuda_sync_point`. On CPU tensors there
    is nothing to copy or wait for; what the copies leave is kept: the all-to-all split sizes as
    numpy arrays (maybe_move_tensor_to_cpu(as_numpy=True) returns those from a GPU tensor, and a
    CPU tensor unchanged: moe_utils.py:1078-1100 in mc 0.16.1). It adds no state: megatron's
    MoELayer builds its dispatcher itself (moe_layer.py:203-209 in mc 0.16.1, :306-312 in
    core_v0.19.0, with the layer's process groups), and `use_portable_dispatchers` makes that
    object one of these."""

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        if self.routing_map.is_cuda:
            if self.cuda_dtoh_stream is None:  # its stream was never made (compat item 11)
                raise RuntimeError("this MoE model was built for a CPU run (build_model(cuda="
                                   "False)) and then run on a GPU: build it with cuda=True")
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert


def use_portable_dispatchers(module: torch.nn.Module) -> int:
    """Give every MoE layer of a built model the portable device-to-host step of its all-to-all
    dispatcher (the subclass adds a method, no state); returns how many."""
    # a dispatcher is no nn.Module: found through the layers that hold one
    dispatchers = [m.token_dispatcher for m in module.modules()
                   if type(getattr(m, "token_dispatcher", None)) is MoEAlltoAllTokenDispatcher]
    for dispatcher in dispatchers:
        dispatcher.__class__ = PortableAlltoAllTokenDispatcher
    return len(dispatchers)


class PortableTopKRouter(TopKRouter):
    """megatron's TopKRouter with its expert-bias buffers on the device of its weight, counting
    the tokens it routes to each expert in training forwards (`load_seen`, for the expert-load
    metrics: `take_expert_load`)."""

    def __init__(self, config, pg_collection=None) -> None:
        self._init_router(config, pg_collection)
        # Counted where megatron counts for the bias update (router.py:532-543): forwards with
        # gradients, so an evaluation or the no-grad first pass of a recomputed chunk adds none.
        # integer counts: megatron's Float16Module casts floating buffers to BF16, which counts
        # exactly only up to 256
        self.register_buffer("load_seen", torch.zeros(self.config.num_moe_experts,
                                                      dtype=torch.long, device=self.weight.device),
                             persistent=False)

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        # megatron keeps expert_bias in FP32 after Float16Module's cast to BF16
        # (_maintain_float32_expert_bias, router.py:209-218); the load it updates from needs the
        # same, or counts above 256 per expert round (BF16 has 8 significant bits).
        counts = self.local_tokens_per_expert
        if counts is not None and counts.dtype != torch.float32:
            self.local_tokens_per_expert = counts.float()
        probs, routing_map = super().routing(logits, *args, **kwargs)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.load_seen += routing_map.sum(dim=0)
        return probs, routing_map

    def _init_router(self, config, pg_collection) -> None:
        with_bias = config.moe_router_enable_expert_bias
        if with_bias:  # built without, then the same two buffers as router.py:163-179
            config = _replaced(config, moe_router_enable_expert_bias=False)
        super().__init__(config=config, pg_collection=pg_collection)
        if with_bias:
            self.config = _replaced(config, moe_router_enable_expert_bias=True)
            self.enable_expert_bias = True
            n, device = self.config.num_moe_experts, self.weight.device
            del self.local_tokens_per_expert, self.expert_bias  # megatron's None attributes
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(n, dtype=torch.float32, device=device),
                                 persistent=False)
            self.register_buffer("expert_bias", torch.zeros(n, dtype=torch.float32,
                                                            device=device))

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """megatron's gating (router.py:79-101 in mc 0.16.1, :87-109 in core_v0.19.0) without its
        move of a CPU weight to the GPU, for a CPU run: the logits in FP32 (moe_router_dtype)."""
        if input.is_cuda:
            return super().gating(input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype,
                                                                    input.dtype)
        # router_gating_linear's own GEMM needs TE (moe_utils.py:1192): the same product by torch,
        # operands cast to the router dtype, gradients cast back by autograd.
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


def _replaced(config, **fields):
    config = copy(config)  # shallow, as SharedExpertMLP copies it (shared_experts.py:46)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


def moe_routers(module: torch.nn.Module) -> list[tuple[int, PortableTopKRouter]]:
    """(pattern-layer index, router) of this rank's MoE layers, in pattern order."""
    return [(router.layer_number - 1, router) for router in module.modules()
            if isinstance(router, PortableTopKRouter)]


def take_expert_load(routers: list[tuple[int, PortableTopKRouter]], micro_batches: int = 1,
                     group=None) -> dict[str, float]:
    """The expert-load metrics since the last call, per MoE layer i (pattern index), and resets
    the counts: moe/<i>/max_over_mean and min_over_mean (tokens of the busiest / idlest expert
    over the mean; 1 is perfect balance), moe/<i>/expert_bias_min|max (the aux-loss-free bias
    after its updates), moe/<i>/aux_loss (the layer's unscaled load-balancing loss, mean over the
    step's `micro_batches`, from megatron's tracker), and with at most PER_EXPERT_MAX experts
    moe/<i>/tokens/<e> per expert. `routers`: `moe_routers(model)`, found once per model. The
    token counts are summed over `group`, the ranks that route different tokens (`routing_group`:
    every rank of it must call this), and the auxiliary losses reduced as megatron's logging
    does (`_reduce_aux_losses`). Empty without MoE layers."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    if not routers:
        return {}
    loads = torch.stack([r.load_seen for _, r in routers]).float()
    for _, r in routers:
        r.load_seen.zero_()
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(loads, group=group)
    tracker = get_moe_layer_wise_logging_tracker()
    _reduce_aux_losses(tracker)
    metrics: dict[str, float] = {}
    loads = loads.cpu()
    for (i, router), load in zip(routers, loads):
        mean = load.mean().item()
        if mean > 0:
            metrics[f"moe/{i}/max_over_mean"] = load.max().item() / mean
            metrics[f"moe/{i}/min_over_mean"] = load.min().item() / mean
        if router.expert_bias is not None:
            metrics[f"moe/{i}/expert_bias_min"] = router.expert_bias.min().item()
            metrics[f"moe/{i}/expert_bias_max"] = router.expert_bias.max().item()
        for name, entry in tracker.items():
            if name.endswith("load_balancing_loss") and entry["values"].numel() > i:
                metrics[f"moe/{i}/aux_loss"] = entry["values"][i].item() / micro_batches
        if load.numel() <= PER_EXPERT_MAX:
            metrics.update({f"moe/{i}/tokens/{e}": int(n) for e, n in enumerate(load.tolist())})
    # emptied, not zeroed: the next model to log sizes its own rows (compat item 12)
    reset_moe_metrics_tracker()
    return metrics


def routing_group(sequence_parallel: bool):
    """The ranks of one pipeline stage that route different tokens: the data-parallel ranks and,
    under sequence parallelism, the tensor-parallel ranks too (each routes its part of the
    sequence; megatron sums the expert-bias load over the same ranks, finalize_model_grads.py
    `_update_router_expert_bias`). None before the parallel state is set up."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return (ps.get_tensor_and_data_parallel_group() if sequence_parallel
            else ps.get_data_parallel_group())


def _reduce_aux_losses(tracker: dict) -> None:
    """megatron's reduction of its aux-loss tracker (reduce_aux_losses_tracker_across_ranks,
    moe_utils.py:935-955 in mc 0.16.1) within this pipeline stage: summed over each loss's
    reduce_group (under sequence parallelism the tensor-parallel ranks each hold part of a
    sequence's loss), then averaged over the data-parallel ranks and its avg_group. Its sum over
    the pipeline is left out (every stage reports its own layers, and a stage without MoE layers
    has no tracker to match), and the averages are sums over the group size: gloo has no AVG."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from megatron.core import parallel_state as ps

    def mean_over(values, group):
        if dist.get_world_size(group) > 1:
            dist.all_reduce(values, group=group)
            values /= dist.get_world_size(group)

    for name in sorted(tracker):
        entry, values = tracker[name], tracker[name]["values"]
        # 0.16-0.17 say whether the reduce group spans the data-parallel ranks already;
        # 0.18+ say the opposite, whether to average over them (core_v0.19.0 moe_utils.py:1090)
        has_dp = entry.get("reduce_group_has_dp", not entry.get("needs_dp_avg", True))
        if entry.get("reduce_group") is not None:
            dist.all_reduce(values, group=entry["reduce_group"])
            if not has_dp:
                mean_over(values, ps.get_data_parallel_group())
        if entry.get("avg_group") is not None:
            mean_over(values, entry["avg_group"])


# Experts per layer up to which every expert's token count is a metric of its own (the demo's 8;
# Nemotron 3 Nano's 128 x 23 layers would be ~3,000 numbers a step: its summaries only).
PER_EXPERT_MAX = 16


def expert_load_line(metrics: dict[str, float]) -> str:
    """The console's expert-load line: the most imbalanced MoE layer, and the spread over
    layers ("" without MoE metrics)."""
    ratios = {int(k.split("/")[1]): v for k, v in metrics.items()
              if k.startswith("moe/") and k.endswith("/max_over_mean")}
    if not ratios:
        return ""
    worst = max(ratios, key=ratios.get)
    parts = [f"expert load: max/mean {ratios[worst]:.2f} at layer {worst} "
             f"(min/mean {metrics.get(f'moe/{worst}/min_over_mean', 0.0):.2f})",
             f"layers {len(ratios)}, max/mean {min(ratios.values()):.2f}-"
             f"{max(ratios.values()):.2f}"]
    aux = [v for k, v in metrics.items() if k.startswith("moe/") and k.endswith("/aux_loss")]
    if aux:
        parts.append(f"aux loss mean {sum(aux) / len(aux):.4g}")
    bias = [v for k, v in metrics.items() if k.startswith("moe/") and "/expert_bias_" in k]
    if bias:
        parts.append(f"expert bias {min(bias):+.2e}..{max(bias):+.2e}")
    return " | ".join(parts)


class PolicySequentialMLP(SequentialMLP):
    """megatron's SequentialMLP whose experts' linears take the policy's formats: the layer's
    from the spec, and `expert_formats` ({global expert: {"linear_fc1": (formats, configs)}}) for
    the experts an override gives other formats."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, *,
                 expert_formats: dict[int, dict[str, tuple[PassFormats, object]]], **kwargs):
        if not config.use_cpu_initialization:  # GPU: megatron's expert RNG tracker draws
            super().__init__(num_local_experts, config, submodules,
                             pg_collection=pg_collection, **kwargs)
        else:
            self._build_layout_free(num_local_experts, config, submodules, pg_collection, kwargs)
        offset = get_pg_rank(self.ep_group) * num_local_experts
        for local, expert in enumerate(self.local_experts):
            for linear, (formats, configs) in expert_formats.get(offset + local, {}).items():
                getattr(expert, linear).set_formats(formats, configs)


    def _build_layout_free(self, num_local_experts, config, submodules, pg_collection,
                           kwargs) -> None:
        """megatron's construction (experts.py:852-860 in mc 0.16.1; the same call in
        core_v0.19.0), each expert drawn from its own seed (one draw of the layer's stream plus
        its global index), and the layer's stream left as that one draw moved it: expert e's
        initial weights, and the shared expert's after them, are the same at every expert-
        parallel size, so a run at EP=2 starts from the weights of the run at EP=1."""
        base = int(torch.randint(2**31, (1,), device="cpu").item())  # also under a meta build
        super().__init__(0, config, submodules, pg_collection=pg_collection, **kwargs)
        self.num_local_experts = num_local_experts
        offset = get_pg_rank(self.ep_group) * num_local_experts
        with torch.random.fork_rng(devices=[]):
            for local in range(num_local_experts):
                torch.manual_seed(base + offset + local)
                self.local_experts.append(MLP(self.config, submodules,
                                              ffn_hidden_size=self.config.moe_ffn_hidden_size,
                                              is_expert=True, tp_group=pg_collection.expt_tp))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """megatron's forward (experts.py:876-928 in mc 0.16.1, the same signature in
        core_v0.19.0), except that an expert the router sent no token to is not called: the
        emulated low-precision GEMMs refuse a zero-row operand (NVFP4's Wgrad quantizes along the
        tokens), and such an expert adds nothing to the output nor to its weights' gradients (as
        a zero-size group of a grouped GEMM)."""
        counts = [int(n) for n in tokens_per_expert.tolist()]
        if all(counts) or self.config.moe_apply_probs_on_input:
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        outputs = []
        for expert, tokens, probs in zip(self.local_experts,
                                         torch.split(permuted_local_hidden_states, counts),
                                         torch.split(permuted_probs, counts)):
            outputs.append(expert(tokens, probs)[0] if tokens.shape[0] else tokens)
        return torch.cat(outputs), None


def local_expert_module(name: str, num_local_experts: int, ep_rank: int) -> str | None:
    """The module path inside an MoE layer of policy linear `name` on expert-parallel rank
    `ep_rank` (global expert index -> local index), or None if another rank holds that expert."""
    prefix = "mlp.experts.local_experts."
    if not name.startswith(prefix):
        return name  # the shared expert: every rank holds it
    expert, rest = name[len(prefix):].split(".", 1)
    local = int(expert) - ep_rank * num_local_experts
    if not 0 <= local < num_local_experts:
        return None
    return f"{prefix}{local}.{rest}"


def te_moe_refusal(cfg: ModelConfig) -> str | None:
    """Why the TE spec cannot build this model's MoE layers (None without any)."""
    if cfg.moe is None:
        return None
    return ("model.pattern has MoE layers ('E'), which the TE spec does not build yet: its "
            "experts need TEGroupedMLP with TE's grouped NVFP4 GEMM (TransformerEngine #2971) "
            "and per-expert token padding for quantization, not wired or verified here "
            "(docs/moe-te.md); use model.spec=portable (emulated GEMMs, SequentialMLP experts)")
