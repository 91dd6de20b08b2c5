"""The underflow telemetry (nvfp4_recipe/telemetry.py) against references written from the
formats' definitions: the flushed fraction from the reference quantizers' own dequantized values,
the scale under- and overflow from the block amax in float64 (NVFP4: scale = 448 * block amax /
tensor amax, E4M3's smallest positive scale 2**-9; MXFP8: amax / 448 against E8M0's 2**-127).
With `rows` at least the operand's rows the sample is the whole operand, so the counts must be
exact; the test data keep every block's scale away from the limits by a factor of 2 or more, so
FP32 rounding of the scale cannot move a block across them."""

from __future__ import annotations

import pytest
import torch

from nvfp4_recipe.config import MXFP8Config, NVFP4Config, PassConfigs
from nvfp4_recipe.hadamard import random_hadamard_transform
from nvfp4_recipe.linear import quantized_linear
from nvfp4_recipe.mxfp8 import quantize_mxfp8
from nvfp4_recipe.nvfp4 import quantize_nvfp4
from nvfp4_recipe.telemetry import COUNTS, OperandTelemetry, ratios, sampled_rows

# Eager quantizers: the same bits as the compiled ones (tests/nvfp4_recipe/test_kernels.py),
# without a compile in a short test.
NEAREST = NVFP4Config(stochastic_rounding=False, kernels="eager")
MXFP8 = MXFP8Config(kernels="eager")


def outlier_activation(rows=64, k=128, value=2e6, seed=0):
    """Values ~N(0, 1) with `value` on channel 0 of every row: every other block's NVFP4 scale
    underflows (448 x a block amax under 4.5 / 2e6 < 1e-3, half of E4M3's smallest 2**-9)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[:, 0] = value
    return x.to(torch.bfloat16)


def reference_nvfp4(x: torch.Tensor, tile=(1, 16)) -> dict[str, float]:
    x32 = x.float()
    x_hat = quantize_nvfp4(x32, tile, kernels="eager").dequantize()
    nonzero = x32 != 0
    rows, k = x32.shape
    t = tile[0]
    block_amax = x32.abs().double().view(rows // t, t, k // 16, 16).amax(dim=(1, 3))
    scale = 448 * block_amax / x32.abs().double().max()
    has = block_amax > 0
    return {"flush": float((nonzero & (x_hat == 0)).sum() / nonzero.sum()),
            "scale_underflow": float((has & (scale < 2.0 ** -9)).sum() / has.sum()),
            "scale_overflow": float((scale > 448 * (1 + 2 ** -10)).sum() / scale.numel())}


def measured(telemetry: OperandTelemetry, key: str) -> dict[str, float]:
    return dict(zip(("flush", "scale_underflow", "scale_overflow"),
                    ratios(telemetry.counts[key]).tolist()))


def test_fprop_operands_of_an_outlier_activation_match_the_reference():
    x = outlier_activation()
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    telemetry = OperandTelemetry(rows=10_000)
    quantized_linear(x, w, config=NEAREST, telemetry=telemetry)
    got, want = measured(telemetry, "fprop/x"), reference_nvfp4(x)
    assert want["scale_underflow"] == pytest.approx(7 / 8)  # every block but the outlier's
    assert want["flush"] > 0.5
    assert got == pytest.approx(want, abs=0)
    # the weight is quantized in 16x16 tiles (precision.weight_2d): no outlier, nothing flushes
    assert measured(telemetry, "fprop/w") == pytest.approx(reference_nvfp4(w, (16, 16)), abs=0)
    assert set(telemetry.counts) == {"fprop/x", "fprop/w"}  # no backward ran


def test_backward_operands_match_the_reference_with_the_wgrad_rht():
    """dgrad/dy: the gradient rows as they are (nearest rounding here, so the reference can
    draw nothing); wgrad/x: x^T with the 16-point RHT along the tokens."""
    x = outlier_activation().requires_grad_(True)
    w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.02).to(
        torch.bfloat16).requires_grad_(True)
    dy = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    telemetry = OperandTelemetry(rows=10_000)
    quantized_linear(x, w, config=NEAREST, telemetry=telemetry).backward(dy)
    assert measured(telemetry, "dgrad/dy") == pytest.approx(reference_nvfp4(dy), abs=0)
    x_t = random_hadamard_transform(x.detach().float().t().contiguous())
    assert measured(telemetry, "wgrad/x") == pytest.approx(reference_nvfp4(x_t), abs=0)
    dy_t = random_hadamard_transform(dy.float().t().contiguous())
    assert measured(telemetry, "wgrad/dy") == pytest.approx(reference_nvfp4(dy_t), abs=0)
    assert set(telemetry.counts) == {f"{p}/{o}" for p, o in (
        ("fprop", "x"), ("fprop", "w"), ("dgrad", "dy"), ("dgrad", "w"), ("wgrad", "dy"),
        ("wgrad", "x"))}


def test_mxfp8_scale_underflow_is_a_block_below_e8m0s_smallest_scale():
    """A block of amax 1e-37 needs the scale 1e-37 / 448 < 2**-127 (E8M0's smallest): it is held
    there and its values lose bits; the other blocks are in range."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    x[:4, :32] *= 1e-37
    telemetry = OperandTelemetry(rows=10_000)
    quantized_linear(x, torch.ones(32, 64), config=MXFP8, telemetry=telemetry)
    got = measured(telemetry, "fprop/x")
    assert got["scale_underflow"] == pytest.approx(4 / 64)
    assert got["scale_overflow"] == 0
    x_hat = quantize_mxfp8(x, kernels="eager").dequantize()
    assert got["flush"] == pytest.approx(float(((x != 0) & (x_hat == 0)).sum() / (x != 0).sum()))


def test_a_non_finite_block_counts_as_overflowing():
    x = torch.randn(16, 64)
    x[3, 5] = float("inf")
    telemetry = OperandTelemetry(rows=10_000)
    quantized_linear(x, torch.ones(32, 64), config=MXFP8, telemetry=telemetry)
    assert measured(telemetry, "fprop/x")["scale_overflow"] == pytest.approx(1 / 32)


def test_the_sample_is_every_stride_th_row_and_whole_tiles():
    t = torch.arange(100 * 32).view(100, 32)
    assert sampled_rows(t, 10)[:, 0].tolist() == [i * 32 for i in range(0, 100, 10)]
    tiles = sampled_rows(t.t(), 32, tile_rows=16)  # a transposed view: 2 whole tiles of 16 rows
    assert tiles.shape == (32, 100) and torch.equal(tiles, t.t()[:32])


def test_counts_accumulate_over_calls_and_are_taken_once():
    x = outlier_activation()
    telemetry = OperandTelemetry(rows=10_000)
    for _ in range(2):
        quantized_linear(x, torch.ones(64, 128, dtype=torch.bfloat16), config=NEAREST,
                         telemetry=telemetry)
    once = OperandTelemetry(rows=10_000)
    quantized_linear(x, torch.ones(64, 128, dtype=torch.bfloat16), config=NEAREST,
                     telemetry=once)
    assert torch.equal(telemetry.counts["fprop/x"], 2 * once.counts["fprop/x"])
    assert len(COUNTS) == telemetry.take()["fprop/x"].numel() and telemetry.counts == {}


@pytest.mark.parametrize("config", [NVFP4Config(kernels="eager"), MXFP8,
                                    PassConfigs(MXFP8, NEAREST, NVFP4Config(kernels="eager"))])
def test_measuring_changes_no_output_gradient_or_random_draw(config):
    """The telemetry reads the GEMMs' operands and draws nothing: the stochastic rounding of the
    gradients (global RNG) and every result are bit-identical with it on."""
    def run(telemetry):
        torch.manual_seed(5)
        x = outlier_activation(value=50.0).requires_grad_(True)
        w = torch.randn(64, 128).to(torch.bfloat16).requires_grad_(True)
        y = quantized_linear(x, w, config=config, telemetry=telemetry)
        y.backward(torch.randn_like(y))
        return y, x.grad, w.grad, torch.get_rng_state()

    for a, b in zip(run(None), run(OperandTelemetry(rows=8))):
        assert torch.equal(a, b)
