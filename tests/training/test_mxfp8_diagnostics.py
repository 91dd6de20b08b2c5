"""MXFP8 linears report their quantization statistics and gradient health like the other formats:
one step of the demo at test size in this process (precision=mxfp8, every pattern layer MXFP8),
diagnostics and gradient health measured on it."""

from __future__ import annotations

import math

import torch

from nvfp4_recipe import MXFP8Config, NVFP4Config, quantization_error_stats
from nvfp4_recipe.diagnostics import quantize_dequantize
from training.metrics import grad_health_line

ROLES = ("activation", "weight", "gradient")
STATS = ("rel_error", "zero_frac", "amax")


def test_mxfp8_linears_report_quantization_statistics_and_gradient_health(make_trainer):
    trainer = make_trainer("precision=mxfp8", "precision.diagnostics_every=1",
                           "trainer.grad_health_every=1", "trainer.grad_clip=0")
    mxfp8 = [h for h in trainer.precision.linears if h.format == "mxfp8"]
    names = [h.name for h in mxfp8]
    assert len(names) == 2 * 9  # no BF16 layers in the recipe: two linears in each of 9 layers
    weights = {h.name: h.linear.weight.detach().to(torch.bfloat16).clone() for h in mxfp8}

    result = trainer.train_step(trainer.data.train.next_global_batch())

    quant = result.precision
    assert set(quant) == {f"quant/{n}/{role}/{stat}" for n in names for role in ROLES
                          for stat in STATS}
    for name, weight in weights.items():
        # The weight's statistics are those of the weight the step's forward quantized...
        direct = quantization_error_stats(weight, MXFP8Config(), "weight")
        for stat in STATS:
            assert quant[f"quant/{name}/weight/{stat}"] == direct[stat], (name, stat)
        # ...E4M3 with a power-of-two scale per 32 values: far closer than NVFP4's E2M1.
        nvfp4 = quantization_error_stats(weight, NVFP4Config(), "weight")["rel_error"]
        assert direct["rel_error"] < nvfp4 / 3, name
    # ||Q(x) - x|| / ||x|| for E4M3 (3 mantissa bits) with each block's max scaled into
    # (224, 448]: measured 0.0262-0.0270 on every role and linear here. A quantizer that skips
    # rounding (0), zeroes the tensor (1), rounds to 2 mantissa bits (~0.05) or a scale one
    # binade too small (clipping at 448) leaves the band. Values flushed to zero: at most 0.3 %
    # (the MLP's squared-ReLU outputs into linear_fc2, many of them tiny).
    for key, value in quant.items():
        assert math.isfinite(value), key
        if key.endswith("/rel_error"):
            assert 0.02 < value < 0.035, (key, value)
        if key.endswith("/zero_frac"):
            assert value < 0.01, (key, value)
    # The rule the diagnostics apply is MXFP8's 1x32 blocks on every role (no 2-D weight tiles,
    # no stochastic rounding on gradients): one quantization, whatever the role says.
    x = torch.randn(64, 96)
    assert all(torch.equal(quantize_dequantize(x, MXFP8Config(), role),
                           quantize_dequantize(x, MXFP8Config(), "activation"))
               for role in ROLES)

    # Gradient health of the same step: every group measured, all finite.
    groups = {key.split("/")[1] for key in result.health}
    assert {"embedding", "final_norm", "output_layer"} <= groups and len(groups) == 9 + 3
    for key, value in result.health.items():
        if key.endswith("/norm"):
            assert math.isfinite(value) and value > 0, key
        else:
            assert value == 0.0, key
    assert grad_health_line(result.health).endswith("all finite")
