"""precision.overrides through training steps: three SGD steps of the demo model with emulated
GEMMs and stochastic rounding, for four precision maps, show that overriding every linear of two
layers to BF16 trains exactly as making those layers BF16 does, and that one linear changes the
losses (the policy, the map and the plan: tests/training/test_overrides.py)."""

from __future__ import annotations

import torch
from helpers import model_config, nvfp4

from nvfp4_recipe.policy import PrecisionConfig


def _losses(precision: PrecisionConfig, steps: int = 3) -> list[float]:
    """A few SGD steps of the demo model (emulated GEMMs, stochastic rounding from the global
    RNG): forward, backward (Dgrad and Wgrad quantized), update."""
    from model.build import build_model

    torch.manual_seed(0)
    built = build_model(model_config("demo"), precision, vocab_size=512, backend="emulated")
    model = built.module
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 64), generator=gen)
    torch.manual_seed(2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, None, None, labels=tokens).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_overrides_change_the_emulated_losses_as_bf16_layers_would(parallel_context):
    """Demo (9 layers, first 1 / last 2 BF16): overriding every linear of layers 1 and 2 to BF16
    trains exactly like bf16_first_layers=3, and differently from the plain recipe."""
    plain = _losses(nvfp4())
    overridden = _losses(nvfp4(overrides={"layers.1.*": "bf16", "layers.2.*": "bf16"}))
    as_layers = _losses(nvfp4(bf16_first_layers=3))
    assert overridden == as_layers
    assert overridden != plain
    # One linear only: differs from both.
    one = _losses(nvfp4(overrides={"layers.1.mlp.linear_fc1": "bf16"}))
    assert one != plain and one != as_layers
