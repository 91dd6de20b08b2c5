"""NVFP4 quantizer: bit-exact against the independent spec reference, torchao, properties, SR."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from nvfp4_recipe import NVFP4Tensor, quantize_nvfp4
from nvfp4_recipe.formats import E2M1_MAGNITUDES, E2M1_TIES

from tests.nvfp4_recipe.quant_reference import e2m1_code, ref_dequantize_nvfp4, ref_quantize_nvfp4

TILES = [(1, 16), (16, 16)]


def _heavy_tailed(gen: torch.Generator) -> torch.Tensor:
    column_scale = torch.logspace(-4, 3, 64, dtype=torch.float64).float()
    return torch.randn(32, 64, generator=gen) * column_scale


def _ties() -> torch.Tensor:
    # Row 0 holds the tensor amax 2688 (S_enc = S_dec = 1). Every other 16-block's max is 6 * 2 so
    # its scale is 2 and e = 0.5: the values +-0.5, 1.5, ..., 10 scale to the exact ties.
    x = torch.zeros(16, 32)
    x[0, 0] = 2688.0
    ties = torch.tensor(E2M1_TIES) * 2.0
    for r in range(1, 16):
        x[r, :7] = ties * (-1) ** r
        x[r, 7] = 12.0 * (-1) ** r
        x[r, 16:23] = -ties * (-1) ** r
        x[r, 23] = -12.0 * (-1) ** r
    return x


def _cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    normal = torch.randn(32, 64, generator=gen)
    negative_zero = torch.randn(32, 64, generator=gen)
    negative_zero[::3, ::5] = -0.0
    negative_zero[1, :16] = torch.tensor([-1e-6] * 15 + [-3.0])  # tiny negatives round to -0 (code 8)
    return {
        "normal_fp32": normal,
        "normal_bf16": normal.bfloat16(),
        "heavy_tailed": _heavy_tailed(gen),
        "heavy_tailed_bf16": _heavy_tailed(gen).bfloat16(),
        "all_zero": torch.zeros(32, 64),
        "denormal_range": torch.randn(32, 64, generator=gen) * 1e-30,
        "fp32_subnormals": torch.randn(32, 64, generator=gen) * 1e-40,
        "huge": torch.randn(32, 64, generator=gen) * 1e30,
        "ties": _ties(),
        "negative_zero": negative_zero,
        "mixed_zero_blocks": torch.cat([torch.zeros(16, 64), torch.randn(16, 64, generator=gen)]),
    }


CASES = _cases()


@pytest.mark.parametrize("tile", TILES, ids=["1x16", "16x16"])
@pytest.mark.parametrize("name", list(CASES))
def test_codes_scales_amax_identical_to_spec_reference(name, tile):
    x = CASES[name]
    q = quantize_nvfp4(x, tile=tile)
    codes, scales, amax = ref_quantize_nvfp4(x, tile[0])
    assert float(q.amax) == amax
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (x.shape[0], x.shape[1] // 16)
    np.testing.assert_array_equal(q.scales.float().numpy(), scales)
    np.testing.assert_array_equal(q.codes().numpy(), codes)
    np.testing.assert_array_equal(q.dequantize().numpy(), ref_dequantize_nvfp4(codes, scales, amax))


def test_ties_round_to_even_codes():
    q = quantize_nvfp4(_ties())
    # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 -> 0, 1, 1, 2, 2, 4, 4 (codes 0, 2, 2, 4, 4, 6, 6)
    assert q.codes()[2, :8].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]
    assert q.codes()[1, :8].tolist() == [8, 10, 10, 12, 12, 14, 14, 15]


def test_negative_zero_and_tiny_negatives():
    x = torch.tensor([[-0.0, 0.0, -1e-6, 1e-6] + [6.0] + [0.0] * 11])
    assert quantize_nvfp4(x).codes()[0, :5].tolist() == [0, 0, 8, 0, 7]


def test_packing_puts_even_column_in_low_nibble():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -0.5  # codes 7 and 9 (scale: amax 6 -> e such that 6 -> 6)
    q = quantize_nvfp4(x)
    assert q.data.dtype == torch.uint8 and q.data.shape == (1, 8)
    assert int(q.data[0, 0]) == 7 | (9 << 4)


def test_leading_dims_flattened_and_restored():
    x = torch.randn(2, 3, 16, 32)
    q = quantize_nvfp4(x)
    assert q.shape == x.shape and q.data.shape == (96, 16) and q.scales.shape == (96, 2)
    flat = quantize_nvfp4(x.reshape(-1, 32))
    assert torch.equal(q.data, flat.data) and q.dequantize().shape == x.shape


def test_tile_16x16_scale_is_repeated_over_its_rows():
    x = torch.randn(32, 32)
    x[3, 20] = 50.0  # dominates tile (0, 1) only
    s = quantize_nvfp4(x, tile=(16, 16)).scales.float()
    assert torch.equal(s[:16], s[:1].expand(16, -1)) and torch.equal(s[16:], s[16:17].expand(16, -1))
    assert float(s[0, 1]) == 448.0 and float(s[0, 0]) < 448.0


# --- torchao -------------------------------------------------------------------------------------


def test_matches_torchao_except_at_documented_ties():
    ao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours = quantize_nvfp4(x)
    theirs = ao.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=ao.per_tensor_amax_to_scale(ours.amax))
    assert torch.equal(ours.scales.view(torch.uint8), theirs.scale.view(torch.uint8))
    our_codes = ours.codes()
    their_codes = NVFP4Tensor(theirs.qdata.view(torch.uint8), ours.scales, ours.amax, x.shape).codes()
    differ = our_codes != their_codes
    # TE multiplies by the encode scale 1 / (s * S_dec); torchao scales by (1 / (amax / 2688)) / s.
    # They differ only where torchao's scaled value is exactly a rounding tie and TE's lands an
    # FP32 ulp away from it (e.g. 0.74999988 -> 0.5 instead of 0.75 -> 1).
    s_enc = torch.clamp(2688.0 / ours.amax, max=torch.finfo(torch.float32).max)
    ours_scaled = x.float().view(1024, 64, 16) * (1.0 / (ours.scales.float() * (1.0 / s_enc))).unsqueeze(-1)
    reciprocal = (1.0 / ao.per_tensor_amax_to_scale(ours.amax)) / ours.scales.float()
    theirs_scaled = x.float().view(1024, 64, 16) * reciprocal.unsqueeze(-1)
    ours_scaled, theirs_scaled = ours_scaled.view(1024, 1024), theirs_scaled.view(1024, 1024)
    n_differ = int(differ.sum())
    assert 0 < n_differ < 400  # ~ 0.02 % of a randn tensor; 0 would mean this test checks nothing
    assert torch.isin(theirs_scaled[differ].abs(), torch.tensor(E2M1_TIES)).all()
    assert ((ours_scaled[differ] - theirs_scaled[differ]).abs() <= 2 * 2**-24 * 6).all()
    assert ((our_codes[differ].int() - their_codes[differ].int()).abs() == 1).all()


# --- properties ----------------------------------------------------------------------------------

# Magnitudes within a 2**12 range (or exactly 0) keep every block scale a normal-ish E4M3 number, so
# the error bound below holds; tiny-block flushing is covered by the reference tests above.
_element = st.one_of(
    st.just(0.0),
    st.floats(2.0**-6, 2.0**6, width=32),
    st.floats(-(2.0**6), -(2.0**-6), width=32),
)
_matrices = arrays(np.float32, st.tuples(st.sampled_from([16, 32]), st.sampled_from([16, 48])), elements=_element)

# Largest |v - q| for each magnitude q: half the gap to each neighbour (6 also absorbs clipping
# of values up to 6 * (1 + 2**-4) after E4M3 rounding of the scale).
_MAX_SCALED_ERROR = {0.0: 0.25, 0.5: 0.25, 1.0: 0.25, 1.5: 0.25, 2.0: 0.5, 3.0: 0.5, 4.0: 1.0, 6.0: 1.0}


@settings(max_examples=60, deadline=None)
@given(_matrices, st.sampled_from(TILES))
def test_error_bounded_by_half_grid_step(xs, tile):
    x = torch.from_numpy(xs)
    q = quantize_nvfp4(x, tile=tile)
    codes = q.codes().long()
    magnitude = torch.tensor(E2M1_MAGNITUDES + E2M1_MAGNITUDES)[codes]
    bound = magnitude.apply_(lambda m: _MAX_SCALED_ERROR[m])
    unit = (q.scales.float().repeat_interleave(16, dim=1) * q.decode_scale).view_as(x)
    error = (q.dequantize() - x).abs()
    assert (error <= bound * unit * (1 + 2**-20)).all()


@settings(max_examples=60, deadline=None)
@given(_matrices, st.sampled_from(TILES))
def test_quantizing_dequantized_values_is_exact(xs, tile):
    q = quantize_nvfp4(torch.from_numpy(xs), tile=tile)
    again = quantize_nvfp4(q.dequantize(), tile=tile)
    # Code 8 (-0) dequantizes to -0.0, which quantizes to code 0 (TE's reference convention).
    assert torch.equal(again.codes(), torch.where(q.codes() == 8, 0, q.codes()))
    assert torch.equal(again.scales.view(torch.uint8), q.scales.view(torch.uint8))
    # The tensor scale is recomputed from the new amax (= q_max * s * S_dec), so S_dec may move by an
    # FP32 ulp; the values agree to that.
    torch.testing.assert_close(again.dequantize(), q.dequantize(), rtol=2**-22, atol=0)


@settings(max_examples=60, deadline=None)
@given(_matrices, st.sampled_from(TILES))
def test_sign_symmetry(xs, tile):
    x = torch.from_numpy(xs)
    q, q_neg = quantize_nvfp4(x, tile=tile), quantize_nvfp4(-x, tile=tile)
    nonzero = x != 0
    assert torch.equal(q_neg.codes()[nonzero], q.codes()[nonzero] ^ 8)
    assert (q_neg.codes()[~nonzero] == 0).all() and (q.codes()[~nonzero] == 0).all()
    assert torch.equal(q_neg.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(q_neg.dequantize(), -q.dequantize())


# --- stochastic rounding -------------------------------------------------------------------------


def _sr_setup(n_rows: int = 8192):
    # Every row is the same block; amax 6 -> S_enc = 448, block scale 448, e = 1 to within an FP32
    # ulp: the scaled values are the inputs, spread over every grid interval, and 6 (saturation).
    block = torch.tensor([0.1, 0.3, 0.7, 1.1, 1.4, 1.9, 2.2, 2.7, 3.3, 3.9, 4.5, 5.5, -0.2, -1.3, -4.9, 6.0])
    return block, block.repeat(n_rows, 1)


def _e2m1_values(q: NVFP4Tensor) -> torch.Tensor:
    return torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))[q.codes().long()]


def _grid_neighbours(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(sorted({s * m for m in E2M1_MAGNITUDES for s in (1.0, -1.0)}))
    idx = torch.searchsorted(grid, v, right=True) - 1
    lo = grid[idx.clamp(max=len(grid) - 1)]
    hi = grid[(idx + 1).clamp(max=len(grid) - 1)]
    return lo, torch.where(lo == v, lo, hi)


def test_sr_stays_between_neighbours_and_saturates_at_6():
    block, x = _sr_setup(1024)
    values = _e2m1_values(quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(3)))
    lo, hi = _grid_neighbours(block)
    assert ((values == lo) | (values == hi)).all()
    assert (values[:, -1] == 6.0).all()
    assert ((values == lo).any(0) & (values == hi).any(0))[:-1].all()  # both neighbours occur


def test_sr_is_unbiased():
    block, x = _sr_setup(16384)
    values = _e2m1_values(quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(0)))
    lo, hi = _grid_neighbours(block)
    # Per element the SR output is lo or hi: std <= (hi - lo) / 2, so the mean of n draws has std
    # <= (hi - lo) / (2 sqrt(n)). 5 sigma tolerance, fixed seed: fails only on a real bias.
    tolerance = 5 * (hi - lo) / (2 * 16384**0.5) + 1e-6
    assert ((values.mean(0) - block).abs() <= tolerance).all()
    nearest = _e2m1_values(quantize_nvfp4(x[:1]))[0]
    assert not torch.allclose(nearest, block, atol=0.05)  # nearest rounding is visibly biased here


def test_sr_reproducible_with_generator_and_global_rng():
    _, x = _sr_setup(64)
    runs = [quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert torch.equal(runs[0].data, runs[1].data) and not torch.equal(runs[0].data, runs[2].data)
    torch.manual_seed(11)
    a = quantize_nvfp4(x, rounding="stochastic")
    torch.manual_seed(11)
    b = quantize_nvfp4(x, rounding="stochastic")
    assert torch.equal(a.data, b.data)


def test_sr_draws_one_64_bit_number_per_8_elements():
    # 8 random bytes per 64-bit draw, drawn once per tensor: the generator advances by ceil(n / 8)
    # draws whatever the chunking (the eager kernels chunk, the fused ones do not).
    _, x = _sr_setup(64)
    gen = torch.Generator().manual_seed(5)
    quantize_nvfp4(x, rounding="stochastic", generator=gen)
    expected = torch.Generator().manual_seed(5)
    torch.empty(-(-x.numel() // 8), dtype=torch.int32).random_(generator=expected)  # 2 x 32 bits each
    torch.empty(-(-x.numel() // 8), dtype=torch.int32).random_(generator=expected)
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=expected))


def test_sr_takes_the_upper_neighbour_with_the_fraction_rounded_to_8_bits():
    # Every byte value r once: the round-up count over the 256 bytes is exactly the number of
    # midpoints (r + 1/2) / 256 below the fraction f, i.e. P(up) = round(256 f) / 256 (ties down).
    # The hardware's cvt.rs.satfinite.e2m1x4 has the same 8-bit resolution (PTX ISA, cvt rbits).
    from nvfp4_recipe.formats import E2M1Scratch, round_e2m1_stochastic_

    fractions = torch.tensor([0.0, 1 / 1024, 1 / 512, 3 / 1024, 0.25, 0.3, 0.5, 0.6, 0.999, 1 - 2**-24])
    for lo, step in ((0.0, 0.5), (1.5, 0.5), (2.0, 1.0), (4.0, 2.0)):
        v = (lo + fractions * step).repeat_interleave(256).view(len(fractions), 256)
        r = torch.arange(256, dtype=torch.uint8).repeat(len(fractions), 1)
        n = v.numel()
        scratch = E2M1Scratch(n, v.device, stochastic=True, codes=False)
        rounded = round_e2m1_stochastic_(v.clone(), scratch, n, r.reshape(-1))
        ups = (rounded > lo).sum(1)
        expected = torch.tensor([sum((k + 0.5) / 256 < f for k in range(256)) for f in fractions.tolist()])
        assert torch.equal(ups, expected), (lo, ups.tolist(), expected.tolist())
        assert ((rounded == lo) | (rounded == lo + step)).all()


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, kwargs, message",
    [
        (torch.zeros(4, 20), {}, "multiple of 16"),
        (torch.zeros(4, 16, dtype=torch.int32), {}, "dtype"),
        (torch.zeros(8, 16), {"tile": (16, 16)}, "multiple of 16"),
        (torch.zeros(4, 16), {"tile": (2, 16)}, "tile"),
        (torch.zeros(4, 16), {"rounding": "up"}, "rounding"),
        (torch.tensor([[float("nan")] + [0.0] * 15]), {"check_finite": True}, "NaN or Inf"),
        (torch.tensor(1.0), {}, "0-d"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_nvfp4(x, **kwargs)


def test_sr_random_bytes_are_uniform_and_reproducible():
    # draw_random_bytes views full-range 64-bit draws as bytes: every byte position of a draw is
    # uniform over 0..255 (a 63-bit draw would leave the top byte at most 127).
    from nvfp4_recipe.formats import draw_random_bytes

    for n in (1, 17, 100_003):
        ours, theirs = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        a, b = (draw_random_bytes(n, torch.device("cpu"), g) for g in (ours, theirs))
        assert a.dtype == torch.uint8 and a.shape == (n,) and torch.equal(a, b)
    counts = torch.bincount(draw_random_bytes(8 * 256 * 400, torch.device("cpu"),
                                              torch.Generator().manual_seed(0)).view(-1, 8).long()
                            .add(torch.arange(8) * 256).view(-1), minlength=8 * 256).view(8, 256)
    # each (position, value) count is Binomial(102400, 1/256): mean 400, sd 20; 6 sigma bounds
    assert counts.min() > 400 - 6 * 20 and counts.max() < 400 + 6 * 20, counts
