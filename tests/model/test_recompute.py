"""Activation recompute: megatron's none / selective / full, the same numbers as none.

Recompute must not change what a step computes. The forward is deterministic here, and the only
random draws, stochastic rounding of gradients, happen in the backward from the default
generator; every checkpoint implementation recomputes under the first forward's RNG state and
restores the backward's own before the region's backward runs. So the losses and gradients are
bit-identical, SR draws included, and this file checks exactly that (with a control showing the
SR draws do move the gradients), plus that the activations are really dropped and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from model.recompute import (RecomputeConfig, checkpoint_implementation, checkpointed_chunks,
                             recompute)

SETTINGS = [RecomputeConfig(), RecomputeConfig("selective"), RecomputeConfig("full"),
            RecomputeConfig("full", "uniform", 2), RecomputeConfig("full", "block", 3)]


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


def _step(setting: RecomputeConfig, sr_seed: int = 5):
    """One forward + backward of the demo-shaped model in NVFP4 (SR on gradients); returns
    (loss, flat gradients, forward calls per module kind, bytes saved for backward)."""
    from model.attention import SDPACoreAttention
    from model.build import build_model
    from model.config import ModelConfig
    from model.mamba_mixer import MambaMixer
    from nvfp4_recipe.policy import PrecisionConfig

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=256), PrecisionConfig(name="nvfp4", format="nvfp4"),
                        vocab_size=256, backend="emulated", recompute=setting).module
    calls = {"layer": 0, "core_attention": 0, "ssm": 0}

    def count(kind):
        def hook(*_):
            calls[kind] += 1
        return hook

    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(count("layer"))

    def counted(kind, function):
        def run(*args):
            calls[kind] += 1
            return function(*args)
        return run

    # The regions selective recompute re-runs: the attention itself and the Mamba scan.
    for module in model.modules():
        if isinstance(module, SDPACoreAttention):
            module._attention = counted("core_attention", module._attention)
        if isinstance(module, MambaMixer):
            module.ssm = counted("ssm", module.ssm)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(sr_seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, None, None, labels=tokens).mean()
    forward_bytes = sum(saved)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return loss.detach(), grads, calls, forward_bytes


@pytest.mark.slow  # six model builds and steps: ~40 s on 2 cores
def test_recompute_gives_bit_identical_losses_and_gradients_with_stochastic_rounding(parallel_context):
    loss0, grads0, calls0, bytes0 = _step(RecomputeConfig())
    layers = calls0["layer"]
    assert calls0 == {"layer": 9, "core_attention": 1, "ssm": 4}  # M-M*-M-M-: one forward each
    # The control: other SR draws give other gradients, so equality below covers the draws.
    _, other_draws, _, _ = _step(RecomputeConfig(), sr_seed=6)
    assert not torch.equal(other_draws, grads0)
    recomputed = {}
    for setting in SETTINGS[1:]:
        loss, grads, calls, forward_bytes = _step(setting)
        assert torch.equal(loss, loss0), setting
        assert torch.equal(grads, grads0), setting
        recomputed[setting] = (calls, forward_bytes)
    selective, full = recomputed[SETTINGS[1]], recomputed[SETTINGS[2]]
    # selective: core attention and each Mamba scan run again in the backward, layers once
    assert selective[0] == {"layer": layers, "core_attention": 2, "ssm": 8}
    # full: every layer runs twice (forward, then its recompute in the backward)
    assert full[0]["layer"] == 2 * layers
    assert recomputed[SETTINGS[4]][0]["layer"] == layers + 3  # block: the first 3 layers
    # And the activations they keep for the backward shrink in that order.
    assert full[1] < selective[1] < bytes0, (full[1], selective[1], bytes0)


@pytest.mark.slow
def test_trainer_recompute_settings_train_identically(tmp_path, data_cache):
    from train_helpers import FAST, train_in_process

    args = [*FAST, "trainer.max_steps=3", "precision=nvfp4"]
    losses = {setting: [step.loss for step in train_in_process(
        tmp_path / setting, data_cache, *args, f"trainer.recompute={setting}")]
        for setting in ("none", "selective", "full")}
    assert len(losses["none"]) == 3
    assert losses["selective"] == losses["none"] and losses["full"] == losses["none"]
