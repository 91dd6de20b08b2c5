"""The independent quantizer reference (tests/nvfp4_recipe/quant_reference.py) against hand
values, so that the quantizer tests compare to a reference that is itself right."""

from __future__ import annotations

import torch

from tests.nvfp4_recipe.quant_reference import e2m1_code, e4m3_round, ref_quantize_nvfp4


def test_reference_threshold_table_matches_spec_examples():
    expected = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6, 0.26: 1, 5.01: 7, 6.0: 7}
    for value, code in expected.items():
        assert e2m1_code(value) == code, value
        assert e2m1_code(-value) == code + 8, -value
    assert e2m1_code(-0.0) == 0 and e2m1_code(-0.1) == 8


def test_reference_e4m3_rounding_hand_values():
    assert e4m3_round(448.0) == 448.0
    assert e4m3_round(17.0) == 16.0  # step 2 in [16, 32): 17 is a tie -> even mantissa 16
    assert e4m3_round(19.0) == 20.0  # tie between 18 (mantissa 001) and 20 (mantissa 010, even)
    assert e4m3_round(2.0**-9) == 2.0**-9  # smallest subnormal
    assert e4m3_round(2.0**-11) == 0.0  # a quarter of it rounds to zero
    assert e4m3_round(float(torch.tensor(0.1).to(torch.float8_e4m3fn).float())) == 0.1015625


def test_reference_quantizes_a_hand_built_block():
    # amax 2688 -> S_enc = S_dec = 1; block max 12 -> s = e4m3(12 * fp32(1/6)) = 2, e = 0.5.
    row = [2688.0] + [0.0] * 15 + [12.0, 0.5, 1.5, -2.5, 5.0, -7.0, 0.0, -0.0] + [0.0] * 8
    codes, scales, amax = ref_quantize_nvfp4(torch.tensor([row]))
    assert amax == 2688.0 and scales[0].tolist() == [448.0, 2.0]
    # scaled: 6, 0.25, 0.75, -1.25, 2.5, -3.5, 0, -0 (ties go to the even code)
    assert codes[0, 16:24].tolist() == [7, 0, 2, 10, 4, 14, 0, 0]
