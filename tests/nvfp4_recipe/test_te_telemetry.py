"""The underflow telemetry measured beside a TE linear (nvfp4_recipe/megatron/te_telemetry.py)
against the emulated linear's own (nvfp4_recipe/linear.py, itself checked against references
from the formats' definitions in test_telemetry.py): on the same operands, with nearest
rounding, the six counts of every pass and operand must be equal, integer for integer. TE is not
installed here; the stand-ins have the interface the hooks read (megatron's TE wrappers: forward
returns (output, bias); TE's LayerNormLinear attributes, v2.18 module/layernorm_linear.py:
1314-1436)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvfp4_recipe.config import MXFP8Config, NVFP4Config, PassConfigs
from nvfp4_recipe.linear import quantized_linear
from nvfp4_recipe.megatron.te_runtime import TEPrecisionLinear
from nvfp4_recipe.megatron.te_telemetry import TELinearTelemetry
from nvfp4_recipe.policy import RuntimePrecisionState
from nvfp4_recipe.telemetry import OperandTelemetry

NEAREST = NVFP4Config(stochastic_rounding=False, kernels="eager")  # RHT and 16x16 weights on
MXFP8 = MXFP8Config(kernels="eager")
ROWS = 16  # of 64: the sample is every 4th row (channel, weight tile row)


class FakeTELinear(torch.nn.Module):
    """A megatron TE linear wrapper as the hooks see it: `weight`, forward(x) -> (y, None)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def gemm_input(self, x):
        return x

    def forward(self, x):
        return F.linear(self.gemm_input(x), self.weight), None


class FakeTELayerNormLinear(FakeTELinear):
    """TE's LayerNormLinear attributes (layernorm_linear.py:1314, 1323, 1419-1436)."""

    def __init__(self, weight, normalization, zero_centered_gamma):
        super().__init__(weight)
        k = weight.shape[1]
        g = torch.Generator().manual_seed(7)
        self.normalization, self.zero_centered_gamma, self.eps = (normalization,
                                                                  zero_centered_gamma, 1e-5)
        self.layer_norm_weight = torch.nn.Parameter(0.1 * torch.randn(k, generator=g))
        self.layer_norm_bias = (torch.nn.Parameter(0.1 * torch.randn(k, generator=g))
                                if normalization == "LayerNorm" else None)

    def gemm_input(self, x):
        """Written from the norms' definitions (not te_gemm_input's code)."""
        gamma = self.layer_norm_weight.float() + (1 if self.zero_centered_gamma else 0)
        xf = x.float()
        if self.normalization == "RMSNorm":
            y = F.rms_norm(xf, xf.shape[-1:], gamma, self.eps)
        else:
            mean = xf.mean(-1, keepdim=True)
            var = (xf - mean).pow(2).mean(-1, keepdim=True)
            y = (xf - mean) / torch.sqrt(var + self.eps) * gamma + self.layer_norm_bias.float()
        return y.to(x.dtype)


def operands(seed=0, outlier=2e6):
    """bf16 x (64 x 128) with an outlier channel, w (64 x 128), dy (64 x 64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g)
    x[:, 3] = outlier
    w = torch.randn(64, 128, generator=g) * 0.02
    dy = torch.randn(64, 64, generator=g) * 1e-3
    return x.bfloat16(), w.bfloat16(), dy.bfloat16()


def emulated_counts(x, w, dy, configs) -> dict[str, torch.Tensor]:
    telemetry = OperandTelemetry(ROWS)
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    quantized_linear(x, w, None, configs, telemetry=telemetry).backward(dy)
    return telemetry.take()


def beside_te(module, configs, state=None):
    state = state or RuntimePrecisionState(telemetry_rows=ROWS)
    return TELinearTelemetry(module, configs, state), state


def assert_same_counts(got: dict, want: dict):
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), (key, got[key], want[key])


@pytest.mark.parametrize("configs", [
    PassConfigs.every(NEAREST),
    PassConfigs.every(MXFP8),
    PassConfigs(MXFP8, NEAREST, NEAREST),  # the Nemotron 3 map's kind: MXFP8 Fprop
    PassConfigs(NEAREST, None, NEAREST),  # Dgrad in BF16: nothing counted for it
], ids=["nvfp4", "mxfp8", "mxfp8-fprop", "bf16-dgrad"])
def test_a_te_linears_counts_equal_the_emulated_linears(configs):
    x, w, dy = operands()
    module = FakeTELinear(w)
    telemetry, _ = beside_te(module, configs)
    module(x.clone().requires_grad_(True))[0].backward(dy)
    got = telemetry.take()
    assert_same_counts(got, emulated_counts(x, w, dy, configs))
    assert got["fprop/x"][0] > 0  # the outlier channel flushes its blocks' other values


@pytest.mark.parametrize("normalization, zero_centered", [("RMSNorm", True), ("LayerNorm", False)])
def test_a_layernorm_linear_is_measured_on_its_normalised_input(normalization, zero_centered):
    x, w, dy = operands(outlier=60.0)  # an outlier the norm scales down with its row
    module = FakeTELayerNormLinear(w, normalization, zero_centered)
    configs = PassConfigs.every(NEAREST)
    telemetry, _ = beside_te(module, configs)
    module(x.clone().requires_grad_(True))[0].backward(dy)
    got = telemetry.take()
    want = emulated_counts(module.gemm_input(x).detach(), w, dy, configs)
    assert_same_counts(got, want)
    # normalised, the raw input's counts would be another operand's
    raw = emulated_counts(x, w, dy, configs)
    assert not any(torch.equal(got[key], raw[key]) for key in ("fprop/x", "wgrad/x"))


def test_one_micro_batch_per_window_and_nothing_between_windows():
    x, w, dy = operands()
    module = FakeTELinear(w)
    configs = PassConfigs.every(NEAREST)
    telemetry, state = beside_te(module, configs)
    for _ in range(3):  # a step of three micro-batches: the first is measured
        module(x.clone().requires_grad_(True))[0].backward(dy)
    assert_same_counts(telemetry.take(), emulated_counts(x, w, dy, configs))
    state.telemetry_rows = 0  # a step outside the window
    module(x.clone().requires_grad_(True))[0].backward(dy)
    assert telemetry.take() == {}
    state.telemetry_rows = ROWS  # the next window measures again
    module(x.clone().requires_grad_(True))[0].backward(dy)
    assert set(telemetry.take()) == {"fprop/x", "fprop/w", "dgrad/dy", "dgrad/w", "wgrad/dy",
                                     "wgrad/x"}


def test_a_recomputed_forward_carries_the_backward():
    """megatron's recompute: the forward first runs without autograd, then again inside the
    backward; the output gradient is counted once, on the recomputed graph."""
    from torch.utils.checkpoint import checkpoint

    x, w, dy = operands()
    module = FakeTELinear(w)
    configs = PassConfigs.every(NEAREST)
    telemetry, _ = beside_te(module, configs)
    xr = x.clone().requires_grad_(True)
    checkpoint(lambda t: module(t)[0], xr, use_reentrant=True).backward(dy)
    assert_same_counts(telemetry.take(), emulated_counts(x, w, dy, configs))


def test_the_late_switch_and_a_format_switch_reach_the_counts():
    x, w, dy = operands()
    module = FakeTELinear(w)
    telemetry, state = beside_te(module, PassConfigs.every(NEAREST))
    linear = TEPrecisionLinear(module, switchable=True, telemetry=telemetry)
    state.bf16_passes = ("fprop",)  # switch_to_bf16.passes=forward
    module(x.clone().requires_grad_(True))[0].backward(dy)
    assert set(linear.take_telemetry()) == {"dgrad/dy", "dgrad/w", "wgrad/dy", "wgrad/x"}
    state.bf16_passes = ()
    mixed = PassConfigs(MXFP8, NEAREST, NEAREST)
    linear.set_formats("mxfp8/nvfp4/nvfp4", mixed)  # the adaptive fallback moved Fprop
    module(x.clone().requires_grad_(True))[0].backward(dy)
    assert_same_counts(linear.take_telemetry(), emulated_counts(x, w, dy, mixed))


def test_stochastic_rounding_draws_from_its_own_generator():
    """Measuring must not move torch's global RNG (dropout, the emulated linears draw from it):
    the run computes the same with the telemetry on or off."""
    x, w, dy = operands()
    module = FakeTELinear(w)
    telemetry, _ = beside_te(module, PassConfigs.every(NVFP4Config(kernels="eager")))
    before = torch.get_rng_state()
    module(x.clone().requires_grad_(True))[0].backward(dy)
    assert torch.equal(torch.get_rng_state(), before)
    counts = telemetry.take()
    assert counts["dgrad/dy"][1] > 0 and counts["wgrad/dy"][1] > 0
