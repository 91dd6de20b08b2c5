"""model/specs.py: the model config's Mamba chunk size and norm epsilon reach the layers built
from both spec families (the TE one from megatron's real TE hybrid spec, its mixer's CUDA-only
construction recorded and bound to megatron's signature: TE and mamba_ssm are absent on CPU)."""

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


# The one module between megatron's TE hybrid spec and a CPU: its inference-only Triton kernels
# (mc 0.16.1 ssm/mamba_mixer.py:22-26 imports them; training never calls them).
TRITON_INFERENCE_KERNELS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


@pytest.fixture
def megatron_te_stack(monkeypatch):
    """megatron's real TE hybrid stack spec and MambaMixer, imported on CPU with only the Triton
    inference kernels stood in for; every module this import adds is dropped afterwards, so the
    rest of the session sees megatron as it was."""
    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, TRITON_INFERENCE_KERNELS, types.SimpleNamespace(
        tensor_get_slice_after=None, tensor_masked_update=None, tensor_merge=None))
    monkeypatch.delitem(sys.modules, "model.te_mamba_mixer", raising=False)
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.ssm.mamba_mixer import MambaMixer

    yield mamba_stack_spec.submodules, MambaMixer
    for name in set(sys.modules) - before:
        module = sys.modules.pop(name)
        parent, _, child = name.rpartition(".")  # else `from parent import child` finds it
        if getattr(sys.modules.get(parent), child, None) is module:
            delattr(sys.modules[parent], child)


def test_te_mamba_layer_takes_chunk_size_and_gated_norm_eps(megatron_te_stack, monkeypatch,
                                                           parallel_context):
    """megatron's MambaLayer builds our mixer from te_layer_spec; the call reaching megatron's
    MambaMixer binds to its real signature with our chunk size, and the gated norm ends with the
    config's eps. megatron's mixer needs CUDA and mamba_ssm to construct, so its __init__ records
    the call and builds only what megatron's builds with eps: `self.norm` (mamba_mixer.py:357)."""
    import inspect

    from megatron.core.ssm.mamba_layer import MambaLayer

    from model.specs import te_layer_spec
    from model.te_mamba_mixer import MambaMixerWithConfigEps

    stack, megatron_mixer = megatron_te_stack
    signature = inspect.signature(megatron_mixer.__init__)
    calls = []

    def megatron_init(self, *args, **kwargs):
        calls.append(signature.bind(self, *args, **kwargs).arguments)
        torch.nn.Module.__init__(self)
        self.rmsnorm = calls[-1].get("rmsnorm", True)
        self.norm = torch.nn.Module()
        self.norm.eps = 1e-5  # megatron's literal

    monkeypatch.setattr(megatron_mixer, "__init__", megatron_init)
    spec = te_layer_spec(MAMBA, MODEL)
    assert spec.module is MambaLayer
    assert spec.submodules.mamba_bda is stack.mamba_layer.submodules.mamba_bda
    mixer_spec = spec.submodules.mixer
    assert issubclass(mixer_spec.module, megatron_mixer)
    assert mixer_spec.submodules is stack.mamba_layer.submodules.mixer.submodules  # TE linears
    layer = _build(spec, MODEL)
    assert isinstance(layer.mixer, MambaMixerWithConfigEps)
    (call,) = calls
    assert call["chunk_size"] == 32 and call["d_model"] == 64
    assert call["submodules"] is mixer_spec.submodules
    assert layer.mixer.norm.eps == 1e-3
    for kind, layer_spec in (("attention", stack.attention_layer), ("mlp", stack.mlp_layer)):
        assert te_layer_spec(LayerPrecision(index=1, kind=kind, format="bf16"), MODEL) is layer_spec
