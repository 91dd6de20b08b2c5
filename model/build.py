"""Build the hybrid model from its config and the precision policy."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from megatron.core.activations import squared_relu
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

import compat
from nvfp4_recipe.policy import PrecisionConfig, PrecisionPolicy, RuntimePrecisionState
from nvfp4_recipe.megatron.te_runtime import te_layer_context, te_linear_context

from .backend import SPEC_OF_BACKEND, choose_backend  # noqa: F401  (choose_backend: re-exported)
from .config import ModelConfig
from .recompute import RecomputeConfig
from .specs import LINEAR_NAMES, portable_layer_spec, te_layer_spec, with_linear_contexts
from .stack import HybridStack


@dataclass
class BuiltModel:
    module: torch.nn.Module
    policy: PrecisionPolicy
    runtime_state: RuntimePrecisionState
    backend: str  # "emulated" or "te"
    spec: str  # "portable" or "te"


def precision_policy(cfg: ModelConfig, precision: PrecisionConfig) -> PrecisionPolicy:
    """The one precision policy of a model: every linear's format (raises ValueError for a bad
    `precision` key, e.g. an override pattern that matches no linear)."""
    return PrecisionPolicy(precision, cfg.layer_kinds(), cfg.bf16_first_layers,
                           cfg.bf16_last_layers, linear_names=LINEAR_NAMES)


def padded_vocab_size(vocab_size: int, multiple: int, tensor_parallel: int) -> int:
    step = multiple * tensor_parallel
    return -(-vocab_size // step) * step


def transformer_config(cfg: ModelConfig, *, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                       initialize: bool = True, num_layers_in_first_stage=None,
                       num_layers_in_last_stage=None,
                       params_dtype: torch.dtype = torch.float32,
                       recompute: RecomputeConfig = RecomputeConfig(),
                       sequence_parallel: bool = False) -> TransformerConfig:
    """megatron's config for the model. Training passes params_dtype=bf16 (BF16 weights and
    activations; FP32 master weights live in the optimizer); float32 serves exact comparisons."""
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
        use_mamba_mem_eff_path=False,
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
        use_cpu_initialization=True,
        perform_initialization=initialize,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        num_layers_in_first_pipeline_stage=num_layers_in_first_stage,
        num_layers_in_last_pipeline_stage=num_layers_in_last_stage,
        sequence_parallel=sequence_parallel,
        **recompute.megatron_fields(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        pipeline_dtype=params_dtype,  # what flows between pipeline stages
    )


def build_model(cfg: ModelConfig, precision: PrecisionConfig, *, vocab_size: int,
                tensor_parallel: int = 1, pipeline_parallel: int = 1, pre_process: bool = True,
                post_process: bool = True, pg_collection=None, initialize: bool = True,
                backend: str | None = None, params_dtype: torch.dtype = torch.float32,
                recompute: RecomputeConfig = RecomputeConfig(), sequence_parallel: bool = False,
                **stage_kwargs) -> BuiltModel:
    """The megatron-core hybrid model with one layer spec per pattern layer."""
    cfg.validate()
    policy = precision_policy(cfg, precision)
    if backend is None:
        backend, _ = choose_backend(precision, cfg.spec)
    if cfg.spec != "auto" and SPEC_OF_BACKEND[backend] != cfg.spec:
        raise ValueError(f"model.spec={cfg.spec} but backend={backend} (the "
                         f"{SPEC_OF_BACKEND[backend]} spec): pass the backend of "
                         "choose_backend(precision, model.spec)")
    state = RuntimePrecisionState()
    decisions = policy.layers()
    if backend == "te":
        from nvfp4_recipe.megatron.te_mapping import build_te_recipe, te_formats

        # One recipe object per format (the recipe's own, and any other an override uses).
        recipes = {fmt: build_te_recipe(dataclasses.replace(precision, format=fmt))
                   for fmt in te_formats(precision) if fmt != "bf16"}
        layer_specs = []
        for d in decisions:
            spec = te_layer_spec(d, cfg)
            if d.linears:  # linears overridden to another format than their layer's
                spec = with_linear_contexts(spec, {
                    name: te_linear_context(d.format, fmt, state, recipes, compat.te_autocast,
                                            compat.te_no_autocast) for name, fmt in d.linears})
            layer_specs.append(spec)
        # Entered at every forward, so the runtime switch to BF16 reaches every layer.
        contexts = [te_layer_context(d, state, recipes.get(d.format), compat.te_autocast)
                    for d in decisions]
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
    config = transformer_config(cfg, tensor_parallel=tensor_parallel,
                                pipeline_parallel=pipeline_parallel, initialize=initialize,
                                params_dtype=params_dtype, recompute=recompute,
                                sequence_parallel=sequence_parallel, **stage_kwargs)
    model_cls = compat.hybrid_model_class()
    extra = {"pg_collection": pg_collection} if pg_collection is not None else {}
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
    return BuiltModel(module=module, policy=policy, runtime_state=state, backend=backend,
                      spec=spec_family)
