"""Activation recompute over whole steps: megatron's none / selective / full compute the same
numbers as none. Six builds of the demo-shaped model in NVFP4, each a forward and a backward with
stochastic rounding, give bit-identical losses and gradients (with a control showing the SR draws
do move the gradients) while the activations they keep shrink; and the trainer's three settings
train three identical steps (the settings and the RNG twin: tests/model/test_recompute.py)."""

from __future__ import annotations

import torch
from helpers import recompute_settings

from model.recompute import RecomputeConfig

SETTINGS = recompute_settings()


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


# six model builds and steps: ~40 s on 2 cores
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


def test_trainer_recompute_settings_train_identically(tmp_path, data_cache):
    from train_helpers import FAST, train_in_process

    args = [*FAST, "trainer.max_steps=3", "precision=nvfp4"]
    losses = {setting: [step.loss for step in train_in_process(
        tmp_path / setting, data_cache, *args, f"trainer.recompute={setting}")]
        for setting in ("none", "selective", "full")}
    assert len(losses["none"]) == 3
    assert losses["selective"] == losses["none"] and losses["full"] == losses["none"]
