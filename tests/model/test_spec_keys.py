"""The checkpoint keys of the two layer-spec families and the pure mapping between them
(model/hf.py:spec_key), which a resume on other hardware translates through (a TE-spec
checkpoint resumed on the portable spec, and back).

The TE spec cannot be built here (Transformer Engine needs CUDA), so its keys are recorded from
upstream source for a model with one layer of each kind, pattern "M*-":
- megatron's TE hybrid spec builds in_proj, linear_qkv and linear_fc1 as
  TELayerNormColumnParallelLinear, out_proj/linear_proj/linear_fc2 as TERowParallelLinear, core
  attention as TEDotProductAttention, and gives MambaLayer / TransformerLayer / MLPLayer no norm
  of their own (IdentityOp, the submodules' default): mc 0.16.1
  models/mamba/mamba_layer_specs.py:36-80, core_v0.19.0 models/hybrid/hybrid_layer_specs.py:90-205.
- TE's LayerNormLinear registers `layer_norm_weight` (RMSNorm; `layer_norm_bias` too for
  LayerNorm) and `weight`, no bias parameter when bias=False (TE v2.8
  pytorch/module/layernorm_linear.py:1276-1289, 1372; v2.18 :1423-1436, 1519); every TE module
  saves `_extra_state`.
- megatron's TE wrappers checkpoint every state_dict entry under its own name
  (`make_sharded_tensors_for_checkpoint(self.state_dict(...), prefix, {"weight": 0, "bias": 0})`,
  mc 0.16.1 extensions/transformer_engine.py:909-918, core_v0.19.0 :1347-1356).
- megatron's MambaMixer keeps dt_bias, A_log, D, conv1d and its gated `norm` (mc 0.16.1
  ssm/mamba_mixer.py:1098-1180), the names the portable mixer (model/mamba_mixer.py) uses.
- The embedding, final norm and output layer are the same modules on both specs (model/stack.py
  builds its own final norm).
"""

from __future__ import annotations

import pytest

from model.hf import canonical_key, spec_key

# The TE spec's checkpoint keys of decoder.layers.* for pattern "M*-" (see the module docstring).
TE_LAYER_KEYS = {
    "decoder.layers.0.mixer.dt_bias", "decoder.layers.0.mixer.A_log", "decoder.layers.0.mixer.D",
    "decoder.layers.0.mixer.in_proj.weight", "decoder.layers.0.mixer.in_proj.layer_norm_weight",
    "decoder.layers.0.mixer.in_proj._extra_state",
    "decoder.layers.0.mixer.conv1d.weight", "decoder.layers.0.mixer.conv1d.bias",
    "decoder.layers.0.mixer.norm.weight",
    "decoder.layers.0.mixer.out_proj.weight", "decoder.layers.0.mixer.out_proj._extra_state",
    "decoder.layers.1.self_attention.linear_qkv.weight",
    "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.1.self_attention.linear_qkv._extra_state",
    "decoder.layers.1.self_attention.core_attention._extra_state",
    "decoder.layers.1.self_attention.linear_proj.weight",
    "decoder.layers.1.self_attention.linear_proj._extra_state",
    "decoder.layers.2.mlp.linear_fc1.weight", "decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
    "decoder.layers.2.mlp.linear_fc1._extra_state",
    "decoder.layers.2.mlp.linear_fc2.weight", "decoder.layers.2.mlp.linear_fc2._extra_state",
}
# What only TE modules save (recipe metadata): never translated, never requested across specs.
TE_ONLY = {"decoder.layers.1.self_attention.core_attention._extra_state"}


@pytest.fixture(scope="module")
def portable_keys(parallel_context):
    """Every checkpoint key (tensors and objects) of the portable spec's "M*-" model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig

    module = build_model(ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128,
                                     pattern="M*-"), PrecisionConfig(name="bf16", format="bf16"),
                         vocab_size=256, backend="emulated").module
    return {item.key for item in nested_values(module.sharded_state_dict())}


def test_the_portable_keys_map_onto_the_te_specs_recorded_keys(portable_keys):
    layers = {k for k in portable_keys if k.startswith("decoder.layers.")}
    # the portable model's own names of the pre-norms are what TE fuses into the first linear
    assert {"decoder.layers.0.norm.weight", "decoder.layers.1.input_layernorm.weight",
            "decoder.layers.2.pre_mlp_layernorm.weight"} <= layers
    assert {spec_key(k, "te") for k in layers} == TE_LAYER_KEYS - TE_ONLY
    assert {spec_key(k, "portable") for k in TE_LAYER_KEYS - TE_ONLY} == layers
    outside = portable_keys - layers  # embedding, final norm, output layer: the same on both
    assert all(spec_key(k, "te") == k == spec_key(k, "portable") for k in outside)


def test_the_mapping_is_pure_and_carries_the_optimizer_state_keyed_by_parameter():
    te = "decoder.layers.12.mlp.linear_fc1.layer_norm_weight"
    portable = "decoder.layers.12.pre_mlp_layernorm.weight"
    assert spec_key(te, "portable") == portable and spec_key(portable, "te") == te
    # megatron's per-parameter optimizer state (fully_reshardable, and the plain optimizer):
    # `optimizer.state.<state>.<model key>` (distrib_optimizer.py:1462,1525 in mc 0.16.1;
    # :1748,1814 in core_v0.19.0)
    for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
        assert (spec_key(f"optimizer.state.{state}.{te}", "portable")
                == f"optimizer.state.{state}.{portable}")
    assert spec_key("decoder.layers.3.mixer.in_proj.layer_norm_bias", "portable") == \
        "decoder.layers.3.norm.bias"  # LayerNorm's bias, TE's layer_norm_bias
    for key in (te, portable, "decoder.layers.0.mixer.norm.weight", "decoder.final_norm.weight"):
        for spec in ("te", "portable"):  # idempotent: a key already in a spec's names stays
            assert spec_key(spec_key(key, spec), spec) == spec_key(key, spec)
    assert spec_key("decoder.layers.0.mixer.norm.weight", "te") == \
        "decoder.layers.0.mixer.norm.weight"  # the Mamba gated norm is no pre-norm
    assert canonical_key(te) == portable  # the Hugging Face export's view: the same table
    with pytest.raises(ValueError, match="spec='gpu'"):
        spec_key(te, "gpu")
