"""Layer specs of the hybrid model, one per pattern layer, with precision decided by the policy.

Two families, as megatron-core's own specs:
- portable: megatron-core tensor-parallel linears (their GEMM routed by `nvfp4_recipe`), our
  PyTorch Mamba-2 mixer, SDPA core attention, torch RMSNorm. Runs on CPU and on any GPU.
- te: Transformer Engine layers (fused norm+linear, TE attention) and mamba_ssm's mixer, as
  Megatron's hybrid spec; low-precision layers run under a TE autocast chosen per layer.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from nvfp4_recipe.parallel_linear import (
    PrecisionColumnParallelLinear,
    PrecisionRowParallelLinear,
    gemm_config_for,
)
from nvfp4_recipe.policy import LayerPrecision, PrecisionConfig, RuntimePrecisionState

from .attention import SDPACoreAttention
from .mamba_mixer import MambaMixer, MambaMixerSubmodules

# The linears of each layer kind, by their megatron module names (plan.json uses these).
LINEAR_NAMES = {
    "mamba": ("mixer.in_proj", "mixer.out_proj"),
    "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
    "mlp": ("mlp.linear_fc1", "mlp.linear_fc2"),
}


def _portable_linears(decision: LayerPrecision, cfg: PrecisionConfig, state: RuntimePrecisionState):
    params = {
        "gemm_format": decision.format,
        "gemm_config": gemm_config_for(decision.format, cfg),
        "runtime_state": state,
    }
    return (
        ModuleSpec(module=PrecisionColumnParallelLinear, params=params),
        ModuleSpec(module=PrecisionRowParallelLinear, params=params),
    )


def portable_layer_spec(
    decision: LayerPrecision, cfg: PrecisionConfig, state: RuntimePrecisionState
) -> ModuleSpec:
    column, row = _portable_linears(decision, cfg, state)
    if decision.kind == "mamba":
        return ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=WrappedTorchNorm,
                mixer=ModuleSpec(
                    module=MambaMixer,
                    submodules=MambaMixerSubmodules(in_proj=column, out_proj=row),
                ),
                mamba_bda=get_bias_dropout_add,
            ),
        )
    if decision.kind == "attention":
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=WrappedTorchNorm,
                self_attention=ModuleSpec(
                    module=SelfAttention,
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
                pre_mlp_layernorm=WrappedTorchNorm,
                mlp=ModuleSpec(
                    module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)
                ),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    raise ValueError(f"unknown layer kind {decision.kind!r}")


def te_layer_spec(decision: LayerPrecision) -> ModuleSpec:
    """Megatron's TE hybrid layer (GPU with TE and mamba_ssm); precision comes from autocast."""
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    stack = mamba_stack_spec.submodules
    return {"mamba": stack.mamba_layer, "attention": stack.attention_layer,
            "mlp": stack.mlp_layer}[decision.kind]
