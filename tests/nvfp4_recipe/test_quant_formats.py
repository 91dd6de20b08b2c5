"""MXFP4 and FP8-block quantizers against the spec reference; the RHT; the diagnostics hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvfp4_recipe import (
    FP8BlockConfig,
    MXFP4Config,
    NVFP4Config,
    TE_RHT_SIGNS,
    quantization_error_stats,
    quantize_fp8_block,
    quantize_mxfp4,
    random_hadamard_transform,
    rht_matrix,
)
from nvfp4_recipe.formats import unpack_codes
from nvfp4_recipe.hadamard import sylvester_hadamard

from tests.nvfp4_recipe.quant_reference import E2M1_VALUE, ref_quantize_fp8_block, ref_quantize_mxfp4


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    heavy = torch.randn(128, 256, generator=gen) * torch.logspace(-4, 3, 256, dtype=torch.float64).float()
    powers = torch.randn(128, 256, generator=gen)
    powers[:, :32] = 6.0 * 2.0 ** torch.arange(-4, 4).repeat(4).float()  # vec_max / 6 exact powers of 2
    return {
        "normal": torch.randn(128, 256, generator=gen),
        "normal_bf16": torch.randn(128, 256, generator=gen).bfloat16(),
        "heavy_tailed": heavy,
        "zeros": torch.zeros(128, 256),
        "tiny": torch.randn(128, 256, generator=gen) * 1e-30,
        "huge": torch.randn(128, 256, generator=gen) * 1e30,
        "power_of_two_block_max": powers,
    }


INPUTS = _inputs()


@pytest.mark.parametrize("name", list(INPUTS))
def test_mxfp4_identical_to_spec_reference(name):
    x = INPUTS[name][:16]
    q = quantize_mxfp4(x)
    codes, exponents = ref_quantize_mxfp4(x)
    np.testing.assert_array_equal(unpack_codes(q.data).numpy(), codes)
    assert q.scales.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(q.scales.view(torch.uint8).numpy().astype(np.int64) - 127, exponents)
    values = torch.tensor(E2M1_VALUE)[torch.from_numpy(codes)]
    scale = torch.exp2(torch.from_numpy(exponents).float()).repeat_interleave(32, 1)
    assert torch.equal(q.dequantize(), values * scale)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("name", ["normal", "normal_bf16", "heavy_tailed", "zeros", "tiny", "huge"])
def test_fp8_block_identical_to_spec_reference(name, block):
    x = INPUTS[name] if block[0] == 128 else INPUTS[name][:8]
    q = quantize_fp8_block(x, block)
    expected, scale_inv = ref_quantize_fp8_block(x, block[0])
    assert q.data.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q.scale_inv.double().numpy(), scale_inv)
    np.testing.assert_array_equal(q.dequantize().double().numpy(), expected)


def test_fp8_block_scales_are_powers_of_two_from_448_over_amax():
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 128] = 1.0, 3.0  # 448 / 1 -> 256; 448 / 3 = 149.3 -> 128
    q = quantize_fp8_block(x)
    assert q.scale_inv.tolist() == [[1 / 256, 1 / 128]]


def test_bad_block_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_fp8_block(torch.zeros(64, 128), (128, 128))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_block(torch.zeros(4, 128), (1, 64))


# --- RHT -----------------------------------------------------------------------------------------


def test_rht_matrix_is_orthogonal_with_te_signs():
    h = rht_matrix()
    assert torch.equal(h @ h.T, torch.eye(16))  # entries +-1/4: exact in FP32
    assert torch.equal(h * 4, torch.diag(torch.tensor(TE_RHT_SIGNS, dtype=torch.float32)) @ sylvester_hadamard(16))
    assert TE_RHT_SIGNS == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def test_rht_acts_on_each_run_of_16():
    x = torch.randn(3, 64, dtype=torch.float64)
    y = random_hadamard_transform(x)
    for j in range(4):
        torch.testing.assert_close(y[:, 16 * j : 16 * j + 16], x[:, 16 * j : 16 * j + 16] @ rht_matrix(dtype=torch.float64))


def test_wgrad_with_rht_equals_wgrad_without_when_unquantized():
    # dW = dY^T X over tokens; the RHT along tokens cancels (H H^T = I). float64: rounding ~1e-16.
    gen = torch.Generator().manual_seed(4)
    dy_t = torch.randn(24, 80, generator=gen, dtype=torch.float64)
    x_t = torch.randn(40, 80, generator=gen, dtype=torch.float64)
    with_rht = random_hadamard_transform(dy_t) @ random_hadamard_transform(x_t).T
    torch.testing.assert_close(with_rht, dy_t @ x_t.T, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(random_hadamard_transform(dy_t), dy_t)  # the transform did something


def test_rht_rejects_bad_signs_and_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard_transform(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="signs"):
        random_hadamard_transform(torch.zeros(4, 16), signs=(1,) * 15)


# --- diagnostics ---------------------------------------------------------------------------------


def test_diagnostics_on_a_hand_checkable_block():
    # amax 2688 -> S_enc = S_dec = 1; block scale e4m3(2688 * fp32(1/6)) = 448; x / 448 in the grid:
    # 2688 -> 6, 672 -> 1.5 (exact), 1075.2 -> 2.4 -> 2 (896), 89.6 -> 0.2 -> 0 (flushed).
    x = torch.tensor([[2688.0, 672.0, 1075.2, 89.6] + [0.0] * 12])
    stats = quantization_error_stats(x, NVFP4Config(), role="activation")
    expected_error = (179.2**2 + 89.6**2) ** 0.5 / (2688.0**2 + 672.0**2 + 1075.2**2 + 89.6**2) ** 0.5
    assert stats["amax"] == pytest.approx(2688.0)
    assert stats["zero_frac"] == pytest.approx(1 / 4)
    assert stats["rel_error"] == pytest.approx(expected_error, rel=1e-5)  # FP32 rounding of 1075.2 etc.


def test_diagnostics_roles_and_formats():
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(2))
    state = torch.get_rng_state()
    nv = {role: quantization_error_stats(x, NVFP4Config(), role) for role in ("activation", "weight", "gradient")}
    assert torch.equal(torch.get_rng_state(), state)  # SR diagnostics never move the global RNG
    assert 0.05 < nv["activation"]["rel_error"] < 0.15  # NVFP4 on randn: ~9 %
    assert nv["weight"]["rel_error"] != nv["activation"]["rel_error"]  # 16x16 tiles vs 1x16
    assert nv["gradient"]["rel_error"] > nv["activation"]["rel_error"]  # SR adds variance
    fp8 = quantization_error_stats(x, FP8BlockConfig(), "weight")
    mx = quantization_error_stats(x, MXFP4Config(), "activation")
    assert fp8["rel_error"] < 0.05 < nv["activation"]["rel_error"] < mx["rel_error"]
    assert quantization_error_stats(torch.zeros(16, 16), NVFP4Config()) == {"rel_error": 0.0, "zero_frac": 0.0, "amax": 0.0}
    with pytest.raises(ValueError, match="role"):
        quantization_error_stats(x, NVFP4Config(), role="bias")
