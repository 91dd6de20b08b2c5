"""The device-dependent decisions of model/build.py (Wgrad fusion, where weights are
initialised), as pure functions, and what a CPU build keeps: CPU initialisation, no Wgrad fusion,
no fused Mamba path."""

from __future__ import annotations

import pytest
import torch

import compat
from model.build import (apex_fused_wgrad_available, gradient_accumulation_fusion,
                         transformer_config, use_cpu_initialization)
from model.config import ModelConfig


@pytest.mark.parametrize("backend,main_grads,apex,expected", [
    ("te", True, True, "config"),        # TE linears + megatron's output layer (apex)
    ("te", True, False, "te_layers"),    # the output layer would refuse the flag without apex
    ("te", False, True, "off"),          # no main_grad to accumulate into (benches, export)
    ("emulated", True, True, "config"),  # the local output layer fuses with apex
    ("emulated", True, False, "off"),    # emulated linears do their own GEMMs
    ("emulated", False, False, "off"),
])
def test_gradient_accumulation_fusion(backend, main_grads, apex, expected):
    mode, why = gradient_accumulation_fusion(backend, main_grads, apex)
    assert mode == expected and why


def test_megatron_still_exposes_the_apex_probe_and_refuses_the_flag_without_it():
    """What the decision reads (tensor_parallel/layers.py:44-48) and why "te_layers" keeps the
    config's flag off without apex (layers.py:924-932 in 0.16.1)."""
    import inspect

    from megatron.core.tensor_parallel import layers

    assert hasattr(layers, "_grad_accum_fusion_available")
    assert apex_fused_wgrad_available() is False  # no apex on a CPU machine
    source = inspect.getsource(layers.ColumnParallelLinear.__init__)
    assert "gradient_accumulation_fusion and not _grad_accum_fusion_available" in source


def test_te_fuse_wgrad_accumulation_sets_te_modules_only():
    te_linear = type("Linear", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.module.linear"})
    other = type("Linear", (torch.nn.Module,), {"__module__": "model.other"})
    model = torch.nn.Sequential(te_linear(), other(), torch.nn.Linear(2, 2))
    model[0].fuse_wgrad_accumulation = False
    model[1].fuse_wgrad_accumulation = False
    assert compat.te_fuse_wgrad_accumulation(model) == 1
    assert model[0].fuse_wgrad_accumulation is True and model[1].fuse_wgrad_accumulation is False


def test_initialisation_on_the_run_device():
    assert use_cpu_initialization(cuda=False) is True  # CPU runs, tests and checkpoints unchanged
    assert use_cpu_initialization(cuda=True) is False  # GPU: megatron's TP-consistent CUDA RNG


def test_a_cpu_build_keeps_what_it_built_before(parallel_context):
    from model.build import build_model
    from nvfp4_recipe.policy import PrecisionConfig

    built = build_model(ModelConfig(vocab_size=256), PrecisionConfig(name="bf16", format="bf16"),
                        vocab_size=256, backend="emulated")
    config = built.module.config
    assert config.use_cpu_initialization and not config.gradient_accumulation_fusion
    assert not config.use_mamba_mem_eff_path
    assert built.paths == ("Mamba: PyTorch SSD scan and gated norm (CPU run); no FP32 main_grad "
                           "buffers (the model is not under megatron's DDP); weights initialised "
                           "on the CPU")
    gpu = transformer_config(ModelConfig(vocab_size=256), cpu_initialization=False,
                             mem_eff_mamba=True, fuse_wgrad=True)
    assert (gpu.use_cpu_initialization, gpu.use_mamba_mem_eff_path,
            gpu.gradient_accumulation_fusion) == (False, True, True)
