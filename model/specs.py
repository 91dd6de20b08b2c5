"""Layer specs of the hybrid model, one per pattern layer, with precision decided by the policy.

Two families, as megatron-core's own specs:
- portable: megatron-core tensor-parallel linears (their GEMM routed by `nvfp4_recipe`), our
  PyTorch Mamba-2 mixer, SDPA core attention, torch RMSNorm. Runs on CPU and on any GPU.
- te: Transformer Engine layers (fused norm+linear, TE attention) and mamba_ssm's mixer, as
  Megatron's hybrid spec; low-precision layers run under a TE autocast chosen per layer, and a
  linear that `precision.overrides` gives another format runs in its own context
  (`with_linear_contexts`).
Also the local GEMM shapes of each linear at a tensor-parallel size (`linear_shapes`,
`layout_problems`), which the preflight checks.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                        TransformerLayerSubmodules)

from nvfp4_recipe.megatron.parallel_linear import (
    PrecisionColumnParallelLinear,
    PrecisionRowParallelLinear,
)
from nvfp4_recipe.policy import LayerPrecision, PrecisionConfig, RuntimePrecisionState
from nvfp4_recipe.registry import pass_configs_for

from .attention import PortableSelfAttention, SDPACoreAttention
from .config import LINEAR_NAMES, SHARED_EXPERT_LINEARS, ModelConfig, expert_linear_name
from .mamba_mixer import MambaMixer, MambaMixerSubmodules
from .moe import PolicySequentialMLP, PortableTopKRouter

# The linears of each layer kind, by their megatron module names (plan.json uses these).
def _portable_linears(decision: LayerPrecision, cfg: PrecisionConfig, state: RuntimePrecisionState,
                      names: tuple[str, str] | None = None):
    """(column spec, row spec) of a layer's two linears (`names`, default the kind's
    LINEAR_NAMES), each in its own formats (the policy's, one per GEMM pass); a linear all in
    BF16 gets no config."""
    column_name, row_name = names or LINEAR_NAMES[decision.kind]
    specs = []
    for cls, name in ((PrecisionColumnParallelLinear, column_name),
                      (PrecisionRowParallelLinear, row_name)):
        fmt = decision.linear_format(name)
        specs.append(ModuleSpec(module=cls, params={
            "gemm_format": fmt,
            "gemm_config": pass_configs_for(*fmt.formats, cfg) if fmt.low_precision else None,
            "runtime_state": state}))
    return tuple(specs)


class TorchNorm:
    """The portable spec's norm: torch's RMSNorm (or LayerNorm), as megatron's WrappedTorchNorm
    builds it, with two differences.

    - eps = config.layernorm_epsilon unless the caller passes one. MambaLayer builds its pre-norm
      from (config, hidden_size) alone, so it would get 1e-5 whatever the config says: through
      build_module in mc 0.16.1 (ssm/mamba_layer.py:85), by calling `submodules.norm(config,
      hidden_size)` in core_v0.17.1 / core_v0.18.0 (ssm/mamba_layer.py:91 / :98). A ModuleSpec
      param would not survive the latter; a class works with both.
    - Sequence parallelism: WrappedTorchNorm refuses it (mc 0.16.1 torch_norm.py:32). A norm
      only needs its weight's gradient summed over the tensor-parallel group, since each rank
      normalises its own slice of the sequence; as megatron's TE norms do
      (extensions/transformer_engine.py:651), the parameters are marked `sequence_parallel`,
      which finalize_model_grads all-reduces (distributed/finalize_model_grads.py:354).
    """

    def __new__(cls, config, hidden_size: int, eps: float | None = None, **_unused):
        eps = config.layernorm_epsilon if eps is None else eps
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma and memory-efficient norms need the TE spec")
        norm_classes = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in norm_classes:
            raise ValueError(f"normalization={config.normalization!r}: the portable spec has "
                             "RMSNorm and LayerNorm")
        norm = norm_classes[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def portable_layer_spec(
    decision: LayerPrecision, cfg: PrecisionConfig, state: RuntimePrecisionState,
    model: ModelConfig,
) -> ModuleSpec:
    if decision.kind == "moe":
        return _portable_moe_spec(decision, cfg, state, model)
    column, row = _portable_linears(decision, cfg, state)
    if decision.kind == "mamba":
        return ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=TorchNorm,
                mixer=ModuleSpec(
                    module=MambaMixer,
                    params={"chunk_size": model.mamba_chunk_size},
                    submodules=MambaMixerSubmodules(in_proj=column, out_proj=row),
                ),
                mamba_bda=get_bias_dropout_add,
            ),
        )
    if decision.kind == "attention":
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=TorchNorm,
                self_attention=ModuleSpec(
                    module=PortableSelfAttention,
                    params={"attn_mask_type": AttnMaskType.causal},
                    submodules=SelfAttentionSubmodules(
                        linear_qkv=column, core_attention=SDPACoreAttention, linear_proj=row
                    ),
                ),
                self_attn_bda=get_bias_dropout_add,
            ),
        )
    if decision.kind == "mlp":
        return ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=TorchNorm,
                mlp=ModuleSpec(
                    module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)
                ),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    raise ValueError(f"unknown layer kind {decision.kind!r}")


def _portable_moe_spec(decision: LayerPrecision, cfg: PrecisionConfig,
                       state: RuntimePrecisionState, model: ModelConfig) -> ModuleSpec:
    """megatron's MoE layer (as its hybrid spec's moe_layer, models/mamba/mamba_layer_specs.py in
    mc 0.16.1) with a torch pre-norm, the FP32 router and the emulated linears in every expert.
    The experts' spec carries the layer's formats; an expert an override changed is switched
    to its own (model/moe.py: PolicySequentialMLP)."""
    expert_formats: dict[int, dict[str, tuple]] = {}
    for g in range(model.moe.num_experts):
        for linear in ("linear_fc1", "linear_fc2"):
            fmt = decision.linear_format(expert_linear_name(g, linear))
            if fmt != decision.format:
                expert_formats.setdefault(g, {})[linear] = (
                    fmt, pass_configs_for(*fmt.formats, cfg) if fmt.low_precision else None)
    # The layer's formats, as an expert linear with no override has them.
    column, row = _portable_linears(decision, cfg, state,
                                    (expert_linear_name(-1, "linear_fc1"),
                                     expert_linear_name(-1, "linear_fc2")))
    shared = None
    if model.moe.shared_expert_ffn_hidden_size is not None:
        s_column, s_row = _portable_linears(decision, cfg, state, SHARED_EXPERT_LINEARS)
        shared = ModuleSpec(module=SharedExpertMLP,
                            submodules=MLPSubmodules(linear_fc1=s_column, linear_fc2=s_row))
    experts = ModuleSpec(module=PolicySequentialMLP, params={"expert_formats": expert_formats},
                         submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))
    return ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=TorchNorm,
            mlp=ModuleSpec(module=MoELayer, submodules=MoESubmodules(
                experts=experts, shared_experts=shared, router=PortableTopKRouter)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def te_layer_spec(decision: LayerPrecision, model: ModelConfig) -> ModuleSpec:
    """Megatron's TE hybrid layer (GPU with TE and mamba_ssm); precision comes from autocast.

    Mamba layers get our chunk size and a mixer whose gated norm takes config.layernorm_epsilon.
    Their pre-norm is fused into in_proj (TELayerNormColumnParallelLinear), which already reads
    config.layernorm_epsilon (mc 0.16.1 extensions/transformer_engine.py:826).
    """
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    # deferred: megatron's MambaMixer needs triton and a built mamba_ssm at import (the TE spec only)
    from .te_mamba_mixer import MambaMixerWithConfigEps

    stack = mamba_stack_spec.submodules
    if decision.kind == "mamba":
        layer = stack.mamba_layer
        mixer = replace(layer.submodules.mixer, module=MambaMixerWithConfigEps,
                        params={**layer.submodules.mixer.params,
                                "chunk_size": model.mamba_chunk_size})
        return replace(layer, submodules=replace(layer.submodules, mixer=mixer))
    return {"attention": stack.attention_layer, "mlp": stack.mlp_layer}[decision.kind]


# -- per-linear contexts on the TE spec ------------------------------------------------------------

# Where each linear sits in megatron's layer specs: the submodules path of its module name.
_TE_LINEAR_SLOTS = {
    "mixer.in_proj": ("mixer", "in_proj"), "mixer.out_proj": ("mixer", "out_proj"),
    "self_attention.linear_qkv": ("self_attention", "linear_qkv"),
    "self_attention.linear_proj": ("self_attention", "linear_proj"),
    "mlp.linear_fc1": ("mlp", "linear_fc1"), "mlp.linear_fc2": ("mlp", "linear_fc2"),
}


class _GemmContextLinear:
    """Mixin: the linear's forward runs inside `gemm_context()` (a factory, called per forward,
    so the runtime switch to BF16 reaches it). Put before a megatron TE linear wrapper."""

    def __init__(self, *args, gemm_context, **kwargs):
        super().__init__(*args, **kwargs)
        self.gemm_context = gemm_context

    def forward(self, *args, **kwargs):
        with self.gemm_context():
            return super().forward(*args, **kwargs)


_CONTEXT_CLASSES: dict[type, type] = {}


def with_gemm_context(cls: type) -> type:
    """`cls` whose forward enters the `gemm_context` it is built with (one subclass per class, so
    module types stay stable across layers and checkpoints)."""
    if cls not in _CONTEXT_CLASSES:
        name = f"{cls.__name__}WithGemmContext"
        _CONTEXT_CLASSES[cls] = type(name, (_GemmContextLinear, cls),
                                     {"__module__": __name__, "__qualname__": name})
    return _CONTEXT_CLASSES[cls]


def with_linear_contexts(layer: ModuleSpec, contexts: dict) -> ModuleSpec:
    """A TE layer spec whose linears named in `contexts` ({module name: context factory}) are
    built as `with_gemm_context(their class)`: how a linear overridden to another format than its
    layer runs on TE (nvfp4_recipe.megatron.te_runtime.te_linear_context)."""
    for name, context in contexts.items():
        parent_name, slot = _TE_LINEAR_SLOTS[name]
        parent = getattr(layer.submodules, parent_name)
        current = getattr(parent.submodules, slot)
        module = current.module if isinstance(current, ModuleSpec) else current
        params = dict(current.params) if isinstance(current, ModuleSpec) else {}
        wrapped = ModuleSpec(module=with_gemm_context(module),
                             params={**params, "gemm_context": context})
        parent = replace(parent, submodules=replace(parent.submodules, **{slot: wrapped}))
        layer = replace(layer, submodules=replace(layer.submodules, **{parent_name: parent}))
    return layer


# -- local GEMM shapes (the preflight's input) -----------------------------------------------------


def linear_shapes(model: ModelConfig, tensor: int,
                  expert_tensor: int | None = None) -> dict[str, dict]:
    """{module name: {"in": K, "out": N, "parallel": "column" | "row"}} of each linear on one
    tensor-parallel rank, as megatron shards it: column-parallel linears split their outputs (the
    Mamba in_proj each of z, x, B, C, dt: mc 0.16.1 ssm/mamba_mixer.py:247-258), row-parallel ones
    their inputs; an MoE layer's routed experts over `expert_tensor` ranks (None: `tensor`, as
    megatron). Assumes `layout_problems(model, tensor)` is empty."""
    t, h = tensor, model.hidden_size
    d_inner = model.mamba_num_heads * model.mamba_head_dim
    in_proj = (2 * d_inner + 2 * model.mamba_num_groups * model.mamba_state_dim
               + model.mamba_num_heads)
    q, kv, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    shapes = {
        "mixer.in_proj": {"in": h, "out": in_proj // t, "parallel": "column"},
        "mixer.out_proj": {"in": d_inner // t, "out": h, "parallel": "row"},
        "self_attention.linear_qkv": {"in": h, "out": (q + 2 * kv) * d // t, "parallel": "column"},
        "self_attention.linear_proj": {"in": q * d // t, "out": h, "parallel": "row"},
        "mlp.linear_fc1": {"in": h, "out": model.ffn_hidden_size // t, "parallel": "column"},
        "mlp.linear_fc2": {"in": model.ffn_hidden_size // t, "out": h, "parallel": "row"},
    }
    if model.moe is not None:
        # Routed experts are split over the expert tensor-parallel group (SequentialMLP builds
        # each MLP with tp_group=expt_tp, transformer/moe/experts.py:852-859 in mc 0.16.1), whose
        # size megatron defaults to the tensor size (parallel_state.py:786-787); the shared
        # expert over the tensor group, as a dense MLP.
        et = tensor if expert_tensor is None else expert_tensor
        f_e, f_s = model.moe.ffn_hidden_size, model.moe.shared_expert_ffn_hidden_size
        for g in range(model.moe.num_experts):
            shapes[expert_linear_name(g, "linear_fc1")] = {"in": h, "out": f_e // et,
                                                           "parallel": "column"}
            shapes[expert_linear_name(g, "linear_fc2")] = {"in": f_e // et, "out": h,
                                                           "parallel": "row"}
        if f_s is not None:
            fc1, fc2 = SHARED_EXPERT_LINEARS
            shapes[fc1] = {"in": h, "out": f_s // t, "parallel": "column"}
            shapes[fc2] = {"in": f_s // t, "out": h, "parallel": "row"}
    return shapes


def layout_problems(model: ModelConfig, tensor: int) -> list[str]:
    """Why megatron cannot split this model over `tensor` ranks ([] when it can)."""
    kinds = set(model.layer_kinds())
    checks = []
    if "mamba" in kinds:  # mc 0.16.1 ssm/mamba_mixer.py:249-258
        checks += [("model.mamba_num_heads", model.mamba_num_heads),
                   ("model.mamba_num_groups", model.mamba_num_groups)]
    if "attention" in kinds and model.num_query_groups >= tensor:  # attention.py:297-303
        checks += [("model.num_attention_heads", model.num_attention_heads),
                   ("model.num_query_groups", model.num_query_groups)]
    elif "attention" in kinds:  # fewer KV groups than ranks (attention.py:289-296): the QKV
        qkv = (model.num_attention_heads + 2 * model.num_query_groups) * model.kv_channels
        checks += [("the QKV outputs (heads + 2 x query groups) x kv_channels", qkv)]
    if "mlp" in kinds:  # ColumnParallelLinear: divide(output, tp), tensor_parallel/layers.py:842
        checks += [("model.ffn_hidden_size", model.ffn_hidden_size)]
    if "moe" in kinds:  # the experts split over the expert-TP group, megatron's default: TP
        checks += [("model.moe.ffn_hidden_size", model.moe.ffn_hidden_size)]
        if model.moe.shared_expert_ffn_hidden_size is not None:
            checks += [("model.moe.shared_expert_ffn_hidden_size",
                        model.moe.shared_expert_ffn_hidden_size)]
    return [f"{key}={value} is not divisible by tensor parallel {tensor}"
            for key, value in checks if value % tensor]
