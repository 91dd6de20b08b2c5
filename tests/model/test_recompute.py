"""Activation recompute: megatron's none / selective / full, the same numbers as none.

Recompute must not change what a step computes. The forward is deterministic here, and the only
random draws, stochastic rounding of gradients, happen in the backward from the default
generator; every checkpoint implementation recomputes under the first forward's RNG state and
restores the backward's own before the region's backward runs. So the losses and gradients are
bit-identical, SR draws included: tests/system/test_recompute_steps.py checks exactly that over
whole steps (with a control showing the SR draws do move the gradients), and that the activations
are really dropped and recomputed. This file checks the settings, the layers each method
checkpoints and that the torch twin restores the forward's RNG state.
"""

from __future__ import annotations

import pytest
import torch
from helpers import recompute_settings

from model.recompute import (RecomputeConfig, checkpoint_implementation, checkpointed_chunks,
                             recompute)

SETTINGS = recompute_settings()


def test_chunks_follow_megatrons_uniform_and_block_methods():
    assert checkpointed_chunks(3, RecomputeConfig()) == [(0, 1, False), (1, 2, False),
                                                         (2, 3, False)]
    assert checkpointed_chunks(3, RecomputeConfig("selective")) == checkpointed_chunks(
        3, RecomputeConfig())
    # uniform: chunks of num_layers layers, the last one shorter (core_v0.19.0 recompute.py:160)
    assert checkpointed_chunks(5, RecomputeConfig("full", "uniform", 2)) == [
        (0, 2, True), (2, 4, True), (4, 5, True)]
    # block: the first num_layers layers checkpointed one by one, the rest kept
    assert checkpointed_chunks(4, RecomputeConfig("full", "block", 2)) == [
        (0, 1, True), (1, 2, True), (2, 3, False), (3, 4, False)]


def test_checkpoint_implementation_per_device_and_layer_family():
    assert checkpoint_implementation(cuda=False, te_layers=False) == "torch"
    assert checkpoint_implementation(cuda=True, te_layers=False) == "megatron"
    assert checkpoint_implementation(cuda=True, te_layers=True) == "te"
    with pytest.raises(ValueError, match="need CUDA"):
        checkpoint_implementation(cuda=False, te_layers=True)


@pytest.mark.parametrize("config,message", [
    (RecomputeConfig("partial"), "trainer.recompute='partial': choose none, selective or full"),
    (RecomputeConfig("full", "every"), "trainer.recompute_method='every'"),
    (RecomputeConfig("full", "uniform", 0), "trainer.recompute_layers=0 must be"),
])
def test_bad_settings_are_named(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.validate()


def test_megatron_fields_make_a_valid_transformer_config():
    from model.build import transformer_config
    from model.config import ModelConfig

    for setting in SETTINGS:
        config = transformer_config(ModelConfig(), initialize=False, recompute=setting)
        expected = None if setting.granularity == "none" else setting.granularity
        assert config.recompute_granularity == expected
        if setting.granularity == "full":
            assert (config.recompute_method, config.recompute_num_layers) == (
                setting.method, setting.num_layers)


def test_torch_twin_restores_the_forward_rng_for_the_recompute():
    """A region that draws in its forward draws the same numbers when recomputed (else its
    backward would differentiate another function); the draws after it are unaffected."""
    def noisy(x):
        return x * torch.rand(x.shape)

    x = torch.ones(4, requires_grad=True)
    torch.manual_seed(3)
    y = recompute(noisy, x, implementation="torch")
    after_forward = torch.rand(1)
    y.sum().backward()
    torch.manual_seed(3)
    assert torch.equal(x.grad, torch.rand(4))  # d(x * r)/dx = r: the first forward's draws
    torch.manual_seed(3)
    torch.rand(4)
    assert torch.equal(after_forward, torch.rand(1))
