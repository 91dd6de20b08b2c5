"""FP8 block scaling on dimensions that are not multiples of 128 (the demo's Mamba in_proj: 1312)."""

import torch

from nvfp4_recipe import FP8BlockConfig, quantize_fp8_block, quantized_linear


def _reference_padded(t: torch.Tensor, block) -> torch.Tensor:
    """Quantize a zero-padded copy with whole blocks, dequantize, cut back."""
    rows, cols = t.shape
    padded = torch.zeros(-(-rows // block[0]) * block[0], -(-cols // 128) * 128)
    padded[:rows, :cols] = t
    return quantize_fp8_block(padded, block).dequantize(torch.float32)[:rows, :cols]


def test_fp8_linear_forward_on_partial_blocks_equals_padded_reference():
    torch.manual_seed(0)
    x = torch.randn(3, 40, 200)  # K = 200: one whole and one partial 1x128 block
    w = torch.randn(1312, 200) * 0.05  # N = 1312 rows: partial 128x128 weight tiles
    out = quantized_linear(x, w, None, FP8BlockConfig(gemm="exact"))
    ref = _reference_padded(x.reshape(-1, 200), (1, 128)) @ _reference_padded(w, (128, 128)).t()
    torch.testing.assert_close(out.reshape(-1, 1312), ref, rtol=1e-6, atol=1e-6)


def test_zero_padding_keeps_a_partial_blocks_scale():
    """The partial block's amax, hence its scale, ignores the padding zeros."""
    x = torch.zeros(1, 130)
    x[0, 128:] = torch.tensor([3.0, -7.0])  # the partial block holds only these two values
    q = _reference_padded(x, (1, 128))
    assert q[0, 129].item() == -7.0 and q[0, 128].item() == 3.0
