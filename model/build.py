"""Build the hybrid model from its config and the precision policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.activations import squared_relu
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

import compat
from nvfp4_recipe.linear_protocol import HeldLinear, PrecisionLinear
from nvfp4_recipe.megatron.te_telemetry import TELinearTelemetry
from nvfp4_recipe.passes import PassFormats
from nvfp4_recipe.policy import (LayerPrecision, PrecisionConfig, PrecisionPolicy,
                                 RuntimePrecisionState)
from nvfp4_recipe.registry import pass_configs_for
from nvfp4_recipe.megatron.te_mapping import build_te_recipe, during_run
from nvfp4_recipe.megatron.te_runtime import (RecipeTable, TEPrecisionLinear, te_layer_context,
                                              te_linear_context)

from .backend import SPEC_OF_BACKEND, choose_backend, mamba_mem_eff_path  # noqa: F401  (re-exported)
from .backend import fused_conv1d_loads
from .config import ModelConfig, policy_for, precision_policy  # noqa: F401  (re-exported)
from .mamba_mixer import mamba_kernels_how
from .moe import (local_expert_module, moe_transformer_fields, te_moe_refusal,
                  use_portable_dispatchers)
from .recompute import RecomputeConfig
from .specs import portable_layer_spec, te_layer_spec, with_linear_contexts
from .stack import HybridStack


@dataclass
class BuiltModel:
    module: torch.nn.Module
    policy: PrecisionPolicy
    runtime_state: RuntimePrecisionState
    backend: str  # "emulated" or "te"
    spec: str  # "portable" or "te"
    # the build's device-dependent decisions, for the start-up line: Mamba scan, Wgrad fusion,
    # where the weights were initialised
    paths: str = ""
    # every linear of the policy this rank holds, in pattern order, each with its format: what
    # the run's per-step precision steers (nvfp4_recipe/linear_protocol.py)
    linears: list[HeldLinear] = dataclasses.field(default_factory=list)


def gradient_accumulation_fusion(backend: str, main_grads: bool, apex_fused_wgrad: bool) -> tuple[str, str]:
    """Where Wgrad accumulates straight into the FP32 `main_grad` (no BF16 `.grad` per
    micro-batch, no rounding of each micro-batch's contribution): ("config" | "te_layers" |
    "off", why). Pure; `main_grads`: the model trains under megatron's DDP, which gives every
    parameter a `main_grad` and handles `grad_added_to_main_grad` (mc 0.16.1
    distributed/distributed_data_parallel.py:116-119, 438, 552; core_v0.19.0 :119-122, 491);
    `apex_fused_wgrad`: apex's `fused_weight_gradient_mlp_cuda` imports (what megatron's own
    linears fuse with: tensor_parallel/layers.py:44-48, 561-573 in 0.16.1).

    - "config": `gradient_accumulation_fusion=True` for the whole model. TE linears get it as
      `fuse_wgrad_accumulation` (extensions/transformer_engine.py:626, 828 in 0.16.1; :1037, 1267
      in core_v0.19.0); megatron's local linears (the output layer on both specs) use apex's kernel.
    - "te_layers": the TE spec without apex. megatron's output layer is a local ColumnParallelLinear
      (models/mamba/mamba_model.py:139 in 0.16.1, models/hybrid/hybrid_model.py:310 in 0.19.0)
      that refuses the flag without apex (layers.py:924-932; :1070-1078 in 0.19.0), so the config
      keeps it off and only the TE linears fuse (compat.te_fuse_wgrad_accumulation).
    - "off": no main_grad to accumulate into; or the portable spec without apex: its emulated
      linears compute their own GEMMs (parallel_linear.py replaces `_forward_impl`, so megatron's
      fused Wgrad is never reached) and the local ColumnParallelLinear refuses the flag.
    """
    if not main_grads:
        return "off", "no FP32 main_grad buffers (the model is not under megatron's DDP)"
    if apex_fused_wgrad:
        return "config", ("gradient_accumulation_fusion: Wgrad into the FP32 main grads "
                          + ("(TE linears, output layer)" if backend == "te" else
                             "(megatron's local linears: the output layer; the emulated linears "
                             "run their own GEMMs)"))
    if backend == "te":
        return "te_layers", ("Wgrad into the FP32 main grads in the TE linears (TE "
                             "fuse_wgrad_accumulation); not in the output layer, which needs apex")
    return "off", ("no gradient_accumulation_fusion: the emulated linears run their own GEMMs and "
                   "megatron's fused Wgrad needs apex's fused_weight_gradient_mlp_cuda")


def apex_fused_wgrad_available() -> bool:
    """Whether megatron's linears found apex's fused Wgrad kernel (the flag megatron itself
    sets when it imports `fused_weight_gradient_mlp_cuda`, tensor_parallel/layers.py:44-48)."""
    from megatron.core.tensor_parallel import layers

    return bool(getattr(layers, "_grad_accum_fusion_available", False))


def use_cpu_initialization(cuda: bool) -> bool:
    """Where the initial weights are drawn. A CPU run: on the CPU, each full weight from the
    common RNG stream (every TP rank identical; the CPU tests and golden losses rest on it). A
    CUDA run: on the GPU (`use_cpu_initialization=False`), each rank drawing its own shard under
    megatron's model-parallel RNG tracker, which `compat.seed_model_parallel_rng` seeds before the
    model is built (`model_parallel_cuda_manual_seed`: one stream per TP rank, the same across
    data-parallel ranks; tensor_parallel/random.py, `_initialize_affine_weight_gpu` in
    tensor_parallel/layers.py forks it). On the CPU a 12B model's initialisation is minutes of
    single-threaded draws and a copy of every weight to the GPU."""
    return not cuda


def padded_vocab_size(vocab_size: int, multiple: int, tensor_parallel: int) -> int:
    step = multiple * tensor_parallel
    return -(-vocab_size // step) * step


def transformer_config(cfg: ModelConfig, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       initialize: bool = True, num_layers_in_first_stage=None,
                       num_layers_in_last_stage=None,
                       params_dtype: torch.dtype = torch.float32,
                       recompute: RecomputeConfig = RecomputeConfig(),
                       sequence_parallel: bool = False, cpu_initialization: bool = True,
                       mem_eff_mamba: bool = False,
                       fuse_wgrad: bool = False, expert_parallel: int = 1,
                       expert_tensor_parallel: int = 1) -> TransformerConfig:
    """megatron's config for the model. Training passes params_dtype=bf16 (BF16 weights and
    activations; FP32 master weights live in the optimizer); float32 serves exact comparisons.
    `cpu_initialization`: use_cpu_initialization; `mem_eff_mamba`: use_mamba_mem_eff_path
    (backend.mamba_mem_eff_path); `fuse_wgrad`: gradient_accumulation_fusion ("config" of
    gradient_accumulation_fusion()); `expert_parallel`, `expert_tensor_parallel`: the MoE
    layers' expert_model_parallel_size and expert_tensor_parallel_size (model/moe.py has the
    other MoE fields)."""
    recompute.validate()
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        mamba_num_heads=cfg.mamba_num_heads,
        mamba_head_dim=cfg.mamba_head_dim,
        mamba_state_dim=cfg.mamba_state_dim,
        mamba_num_groups=cfg.mamba_num_groups,
        use_mamba_mem_eff_path=mem_eff_mamba,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.layernorm_epsilon,
        activation_func=squared_relu,
        gated_linear_unit=False,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,  # what megatron's Float16Module requires
        use_cpu_initialization=cpu_initialization,
        perform_initialization=initialize,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        num_layers_in_first_pipeline_stage=num_layers_in_first_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_stage,
        sequence_parallel=sequence_parallel,
        **recompute.megatron_fields(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=fuse_wgrad,
        persist_layer_norm=False,
        pipeline_dtype=params_dtype,  # what flows between pipeline stages
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        **moe_transformer_fields(cfg),
    )


def build_model(cfg: ModelConfig, precision: PrecisionConfig, *, vocab_size: int,
                tensor_parallel: int = 1, pipeline_parallel: int = 1, pre_process: bool = True,
                post_process: bool = True, pg_collection=None, initialize: bool = True,
                backend: str | None = None, params_dtype: torch.dtype = torch.float32,
                recompute: RecomputeConfig = RecomputeConfig(), sequence_parallel: bool = False,
                cuda: bool = False, main_grads: bool = False,
                policy: PrecisionPolicy | None = None, **stage_kwargs) -> BuiltModel:
    """The megatron-core hybrid model with one layer spec per pattern layer.

    `cuda`: the run's device is a GPU (`Hardware.cuda`): the weights are initialised there
    (use_cpu_initialization); the TE spec's Mamba mixer takes megatron's fused path where
    mamba_ssm's fused kernel can call causal_conv1d (backend.mamba_mem_eff_path). `main_grads`:
    the model will train under megatron's DDP (FP32 main grads), so Wgrad may accumulate into
    them (gradient_accumulation_fusion). `policy`: the start-up's precision policy of `cfg` and
    `precision` (refused if built from other objects); None builds it. The defaults build what
    CPU runs and tests always built.
    `cfg` checked its own fields when it was made (ModelConfig.__post_init__)."""
    policy = policy_for(cfg, precision, policy)
    if backend is None:
        backend, _ = choose_backend(precision, cfg.spec)
    if cfg.spec != "auto" and SPEC_OF_BACKEND[backend] != cfg.spec:
        raise ValueError(f"model.spec={cfg.spec} but backend={backend} (the "
                         f"{SPEC_OF_BACKEND[backend]} spec): pass the backend of "
                         "choose_backend(precision, model.spec)")
    state = RuntimePrecisionState()
    decisions = policy.layers()
    if backend == "te" and te_moe_refusal(cfg):
        raise ValueError(te_moe_refusal(cfg))
    if backend == "te":
        # One recipe object per formats a linear runs (its layer's, an override's), before and
        # after the switch to BF16.
        used = [d.format for d in decisions] + [f for d in decisions for _, f in d.linears]
        # The formats a linear is switched to at run time (PrecisionController.apply_formats)
        # get their recipe on first use.
        recipes = RecipeTable({fmt: build_te_recipe(fmt, precision)
                               for fmt in during_run(used, precision)},
                              lambda fmt: build_te_recipe(fmt, precision))
        layer_specs = []
        for d in decisions:
            spec = te_layer_spec(d, cfg)
            # The linears overridden to other formats than their layer's, and every quantized
            # one: its formats are read from the runtime state per forward, so the controller
            # can switch them (the adaptive fallback, a replay's map).
            switchable = {name: d.linear_format(name)
                          for name in policy.linear_names.get(d.kind, ())
                          if d.linear_format(name).low_precision or name in dict(d.linears)}
            if switchable:
                spec = with_linear_contexts(spec, {
                    name: te_linear_context(d.format, fmt, state, recipes, compat.te_autocast,
                                            compat.te_no_autocast, name=f"layers.{d.index}.{name}")
                    for name, fmt in switchable.items()})
            layer_specs.append(spec)
        # Entered at every forward, so the runtime switch to BF16 reaches every layer.
        contexts = [te_layer_context(d, state, recipes, compat.te_autocast) for d in decisions]
        spec_family = "te"
    else:
        layer_specs = [portable_layer_spec(d, precision, state, cfg) for d in decisions]
        contexts = None
        spec_family = "portable"
    stack_spec = ModuleSpec(
        module=HybridStack,
        params={"layer_specs": layer_specs, "layer_kinds": cfg.layer_kinds(),
                "layer_contexts": contexts, "recompute_config": recompute,
                "te_layers": backend == "te"},
    )
    if cfg.moe is not None:  # the expert groups megatron's parallel state was split into
        stage_kwargs = {**_expert_parallel_sizes(), **stage_kwargs}
    fusion, fusion_why = gradient_accumulation_fusion(backend, main_grads,
                                                      main_grads and apex_fused_wgrad_available())
    mem_eff = mamba_mem_eff_path(spec_family, _fused_conv1d(backend))
    config = transformer_config(cfg, tensor_parallel=tensor_parallel,
                                pipeline_parallel=pipeline_parallel, initialize=initialize,
                                params_dtype=params_dtype, recompute=recompute,
                                sequence_parallel=sequence_parallel,
                                cpu_initialization=use_cpu_initialization(cuda),
                                mem_eff_mamba=mem_eff,
                                fuse_wgrad=fusion == "config", **stage_kwargs)
    model_cls = compat.hybrid_model_class()
    extra = {"pg_collection": pg_collection} if pg_collection is not None else {}
    with compat.cpu_alltoall_dispatcher_construction(cuda):
        module = model_cls(
            config=config,
            vocab_size=padded_vocab_size(cfg.vocab_size or vocab_size, cfg.vocab_multiple,
                                         tensor_parallel),
            max_sequence_length=cfg.max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="none",
            **compat.hybrid_model_kwargs(stack_spec, cfg.pattern),
            **extra,
        )
    if cfg.moe is not None:
        use_portable_dispatchers(module)
        compat.reset_moe_metrics_tracker()  # its rows are sized by the model that logs first
    if fusion == "te_layers":
        compat.te_fuse_wgrad_accumulation(module)
    if spec_family == "te":
        scan = ("megatron's fused conv1d + SSD scan (use_mamba_mem_eff_path)" if mem_eff else
                "megatron's non-fused path (no causal_conv1d that mamba_ssm's fused kernel can "
                "call)")
    else:
        scan = mamba_kernels_how(cuda)
    paths = (f"Mamba: {scan}; {fusion_why}; weights initialised on the "
             f"{'CPU' if use_cpu_initialization(cuda) else 'GPU'}")
    return BuiltModel(module=module, policy=policy, runtime_state=state, backend=backend,
                      spec=spec_family, paths=paths,
                      linears=held_linears(module.decoder, decisions, policy.linear_names,
                                           te=spec_family == "te", precision=precision,
                                           state=state))


def held_linears(stack: HybridStack, decisions: list[LayerPrecision],
                 linear_names: dict[str, tuple[str, ...]], te: bool,
                 precision: PrecisionConfig, state: RuntimePrecisionState) -> list[HeldLinear]:
    """The policy's linears among this pipeline stage's layers, named as the policy names them
    (`layers.<pattern index>.<module name>`): the emulated linears are their own PrecisionLinear,
    TE's are adapted (te_runtime.TEPrecisionLinear). An MoE layer's routed experts are named
    by their global index; this rank holds those of its expert-parallel rank."""
    held = []
    for local, layer in enumerate(stack.layers):
        decision = decisions[stack.layer_offset + local]
        for name in linear_names.get(decision.kind, ()):
            path = name
            if decision.kind == "moe":
                experts = layer.mlp
                path = local_expert_module(name, experts.num_local_experts,
                                           get_pg_rank(experts.ep_group))
                if path is None:  # another expert-parallel rank's expert
                    continue
            module = layer.get_submodule(path)
            linear = _te_linear(module, decision.linear_format(name), precision,
                                state) if te else module
            if not isinstance(linear, PrecisionLinear):
                raise TypeError(f"layers.{decision.index}.{name} is a {type(module).__name__}, "
                                "not a linear the precision controller can steer")
            held.append(HeldLinear(f"layers.{decision.index}.{name}",
                                   decision.linear_format(name), linear))
    return held


def _te_linear(module: torch.nn.Module, fmt: str, precision: PrecisionConfig,
               state: RuntimePrecisionState) -> TEPrecisionLinear:
    """A TE linear as the controller steers it. build_model gives every quantized TE linear a
    gemm context that reads its formats per forward (te_runtime.te_linear_context with its
    name); those get the underflow telemetry measured beside them (te_telemetry.py), in the
    emulated configs of their formats."""
    if not hasattr(module, "gemm_context"):
        return TEPrecisionLinear(module)
    configs = pass_configs_for(*PassFormats(fmt).formats, precision)
    return TEPrecisionLinear(module, switchable=True,
                             telemetry=TELinearTelemetry(module, configs, state))


def _expert_parallel_sizes() -> dict:
    """{"expert_parallel", "expert_tensor_parallel"} of megatron's parallel state (1 and 1 where
    it is not initialised), for TransformerConfig's expert_model_parallel_size and
    expert_tensor_parallel_size, which must agree with the groups the MoE layers use."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"expert_parallel": 1, "expert_tensor_parallel": 1}
    return {"expert_parallel": ps.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel": ps.get_expert_tensor_parallel_world_size()}


def _fused_conv1d(backend: str) -> bool:
    """Whether mamba_ssm's fused conv1d + scan can call causal_conv1d, asked only for the TE spec
    (a CUDA run, where mamba_ssm imports)."""
    return backend == "te" and fused_conv1d_loads()
