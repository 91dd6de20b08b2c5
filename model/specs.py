"""Layer specs of the hybrid model, one per pattern layer, with precision decided by the policy.

Two families, as megatron-core's own specs:
- portable: megatron-core tensor-parallel linears (their GEMM routed by `nvfp4_recipe`), our
  PyTorch Mamba-2 mixer, SDPA core attention, torch RMSNorm. Runs on CPU and on any GPU.
- te: Transformer Engine layers (fused norm+linear, TE attention) and mamba_ssm's mixer, as
  Megatron's hybrid spec; low-precision layers run under a TE autocast chosen per layer.
"""

from __future__ import annotations

from dataclasses import replace

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
from .config import ModelConfig
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


class TorchNormWithConfigEps(WrappedTorchNorm):
    """megatron's torch norm with eps = config.layernorm_epsilon unless the caller passes one.

    MambaLayer builds its pre-norm from (config, hidden_size) alone, so it gets 1e-5 whatever the
    config says: through build_module in mc 0.16.1 (ssm/mamba_layer.py:85), by calling
    `submodules.norm(config, hidden_size)` in core_v0.17.1 / core_v0.18.0 (ssm/mamba_layer.py:91 /
    :98). A ModuleSpec param would not survive the latter; a class works with both.
    """

    def __new__(cls, config, hidden_size: int, eps: float | None = None, **kwargs):
        eps = config.layernorm_epsilon if eps is None else eps
        return WrappedTorchNorm.__new__(cls, config, hidden_size, eps=eps, **kwargs)


def portable_layer_spec(
    decision: LayerPrecision, cfg: PrecisionConfig, state: RuntimePrecisionState,
    model: ModelConfig,
) -> ModuleSpec:
    column, row = _portable_linears(decision, cfg, state)
    if decision.kind == "mamba":
        return ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=TorchNormWithConfigEps,
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


def te_layer_spec(decision: LayerPrecision, model: ModelConfig) -> ModuleSpec:
    """Megatron's TE hybrid layer (GPU with TE and mamba_ssm); precision comes from autocast.

    Mamba layers get our chunk size and a mixer whose gated norm takes config.layernorm_epsilon.
    Their pre-norm is fused into in_proj (TELayerNormColumnParallelLinear), which already reads
    config.layernorm_epsilon (mc 0.16.1 extensions/transformer_engine.py:826).
    """
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    from .te_mamba_mixer import MambaMixerWithConfigEps

    stack = mamba_stack_spec.submodules
    if decision.kind == "mamba":
        layer = stack.mamba_layer
        mixer = replace(layer.submodules.mixer, module=MambaMixerWithConfigEps,
                        params={**layer.submodules.mixer.params,
                                "chunk_size": model.mamba_chunk_size})
        return replace(layer, submodules=replace(layer.submodules, mixer=mixer))
    return {"attention": stack.attention_layer, "mlp": stack.mlp_layer}[decision.kind]
