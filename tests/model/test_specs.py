"""model/specs.py: the model config's Mamba chunk size and norm epsilon reach the layers built
from both spec families (the TE one with megatron's TE modules faked: TE is absent on CPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from model.config import ModelConfig
from nvfp4_recipe.policy import LayerPrecision, PrecisionConfig, RuntimePrecisionState

MAMBA = LayerPrecision(index=0, kind="mamba", format="bf16")
# Not the defaults (chunk 64, eps 1e-5), so a value that does not arrive shows.
MODEL = ModelConfig(hidden_size=64, mamba_num_heads=8, mamba_head_dim=16, mamba_state_dim=16,
                    mamba_num_groups=2, mamba_chunk_size=32, layernorm_epsilon=1e-3)


def _build(spec, model: ModelConfig):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from model.build import transformer_config

    config = transformer_config(model)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    return build_module(spec, config=config, layer_number=1, pg_collection=pgs)


def test_portable_mamba_layer_takes_chunk_size_and_eps(parallel_context):
    from model.specs import portable_layer_spec

    spec = portable_layer_spec(MAMBA, PrecisionConfig(), RuntimePrecisionState(), MODEL)
    layer = _build(spec, MODEL)
    assert layer.mixer.chunk_size == 32
    assert layer.norm.eps == 1e-3  # MambaLayer passes no eps (mc 0.16.1 ssm/mamba_layer.py:85)
    assert layer.mixer.norm.eps == 1e-3
    out, _ = layer.mixer(torch.randn(40, 2, 64))  # 40 tokens: two chunks of 32
    assert out.shape == (40, 2, 64)


def test_mamba_pre_norm_called_as_newer_megatron_calls_it():
    """core_v0.17.1+ calls `submodules.norm(config, hidden_size)` directly (mamba_layer.py:91)."""
    from model.build import transformer_config
    from model.specs import TorchNorm

    config = transformer_config(MODEL, initialize=False)
    norm = TorchNorm(config, 64)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-3
    assert TorchNorm(config, 64, eps=1e-6).eps == 1e-6  # an explicit eps wins


@pytest.fixture
def fake_megatron_te_modules(monkeypatch):
    """megatron's TE hybrid stack spec and its (triton-importing) MambaMixer, faked."""
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    class MegatronMambaMixer:  # what the subclass needs of megatron's: config in, self.norm
        def __init__(self, config, submodules=None, d_model=None, chunk_size=128, **kwargs):
            self.chunk_size, self.submodules, self.rmsnorm = chunk_size, submodules, True
            self.norm = types.SimpleNamespace(eps=1e-5)  # mc 0.16.1 ssm/mamba_mixer.py:357

    mixer_submodules = types.SimpleNamespace(in_proj="TELayerNormColumnParallelLinear",
                                             out_proj="TERowParallelLinear")
    stack = types.SimpleNamespace(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            mixer=ModuleSpec(module=MegatronMambaMixer, submodules=mixer_submodules),
            mamba_bda="bda")),
        attention_layer="TE attention layer", mlp_layer="TE MLP layer")
    monkeypatch.setitem(sys.modules, "megatron.core.ssm.mamba_mixer", types.SimpleNamespace(
        MambaMixer=MegatronMambaMixer))
    monkeypatch.setitem(sys.modules, "megatron.core.models.mamba.mamba_layer_specs",
                        types.SimpleNamespace(mamba_stack_spec=types.SimpleNamespace(
                            submodules=stack)))
    monkeypatch.delitem(sys.modules, "model.te_mamba_mixer", raising=False)
    yield mixer_submodules
    sys.modules.pop("model.te_mamba_mixer", None)  # it subclassed the fake


def test_te_mamba_layer_takes_chunk_size_and_gated_norm_eps(fake_megatron_te_modules):
    from model.specs import te_layer_spec

    spec = te_layer_spec(MAMBA, MODEL)
    mixer_spec = spec.submodules.mixer
    assert mixer_spec.params == {"chunk_size": 32}
    assert mixer_spec.submodules is fake_megatron_te_modules  # TE linears kept
    assert spec.submodules.mamba_bda == "bda"
    config = types.SimpleNamespace(layernorm_epsilon=1e-3)
    mixer = mixer_spec.module(config, submodules=mixer_spec.submodules, d_model=64,
                              **mixer_spec.params)
    assert (mixer.chunk_size, mixer.norm.eps) == (32, 1e-3)
    for kind, layer in (("attention", "TE attention layer"), ("mlp", "TE MLP layer")):
        assert te_layer_spec(LayerPrecision(index=1, kind=kind, format="bf16"), MODEL) == layer
