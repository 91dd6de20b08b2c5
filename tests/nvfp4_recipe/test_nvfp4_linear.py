"""Emulated quantized linears against reference compositions of the quantizers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvfp4_recipe import (
    FP8BlockConfig,
    MXFP4Config,
    NVFP4Config,
    PassConfigs,
    nvfp4_linear,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
    quantized_linear,
    random_hadamard_transform,
)

EXACT = NVFP4Config(gemm="exact")
DETERMINISTIC = NVFP4Config(gemm="exact", stochastic_rounding=False)


def _problem(tokens=(3, 40), k=64, n=48, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    dy = torch.randn(*tokens, n, generator=gen).to(dtype)
    return x, w, b, dy


def _run(config, x, w, b, dy, seed=0):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = quantized_linear(x, w, b, config, generator=torch.Generator().manual_seed(seed))
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def _deq(q) -> torch.Tensor:
    return q.dequantize(torch.float64)


def _pad_t(t2d: torch.Tensor, multiple: int) -> torch.Tensor:
    """(T, C) -> (C, T padded with zeros to a multiple)."""
    pad = -t2d.shape[0] % multiple
    return F.pad(t2d.t().float(), (0, pad))


def _assert_gemm_close(actual, a, b, gemm="exact"):
    """actual vs a @ b^T in float64. FP32 accumulation of exact products: error <= K * 2**-24 *
    sum |a_k b_k| (plus output rounding); the fast path also rounds its bf16 output (2**-8)."""
    expected = a @ b.T
    bound = a.shape[1] * 2**-24 * (a.abs() @ b.abs().T) + 2**-23 * expected.abs()
    if gemm == "fast":
        bound = bound + 2**-8 * expected.abs()
    assert ((actual.double() - expected).abs() <= bound + 1e-30).all()


def test_forward_equals_reference_composition():
    x, w, b, _ = _problem()
    y = nvfp4_linear(x, w, None, EXACT)
    _assert_gemm_close(y.reshape(-1, 48), _deq(quantize_nvfp4(x.reshape(-1, 64))), _deq(quantize_nvfp4(w, tile=(16, 16))))
    y_fast = nvfp4_linear(x, w, None, NVFP4Config())
    _assert_gemm_close(y_fast.reshape(-1, 48), _deq(quantize_nvfp4(x.reshape(-1, 64))), _deq(quantize_nvfp4(w, tile=(16, 16))), "fast")
    torch.testing.assert_close(nvfp4_linear(x, w, b, EXACT), y + b)  # bias added in FP32


def test_backward_without_sr_and_rht_equals_reference_compositions():
    x, w, b, dy = _problem()  # 120 tokens: padded to 128 for the Wgrad operands
    _, dx, dw, db = _run(NVFP4Config(gemm="exact", stochastic_rounding=False, rht=False), x, w, b, dy)
    dy2, x2 = dy.reshape(-1, 48), x.reshape(-1, 64)
    w_q = _deq(quantize_nvfp4(w, tile=(16, 16)))
    _assert_gemm_close(dx.reshape(-1, 64), _deq(quantize_nvfp4(dy2)), w_q.T)
    _assert_gemm_close(dw, _deq(quantize_nvfp4(_pad_t(dy2, 16))), _deq(quantize_nvfp4(_pad_t(x2, 16))))
    torch.testing.assert_close(db, dy2.sum(0))


def test_wgrad_with_rht_equals_reference_composition():
    x, w, b, dy = _problem()
    _, _, dw, _ = _run(DETERMINISTIC, x, w, b, dy)
    dy_t = random_hadamard_transform(_pad_t(dy.reshape(-1, 48), 16))
    x_t = random_hadamard_transform(_pad_t(x.reshape(-1, 64), 16))
    _assert_gemm_close(dw, _deq(quantize_nvfp4(dy_t)), _deq(quantize_nvfp4(x_t)))


def test_sr_backward_equals_composition_with_the_same_draws():
    # Dgrad's dY is quantized first, then Wgrad's dY^T, each one random byte per element.
    x, w, b, dy = _problem(tokens=(128,))
    _, dx, dw, _ = _run(NVFP4Config(gemm="exact", rht=False), x, w, b, dy, seed=5)
    gen = torch.Generator().manual_seed(5)
    dy_q = _deq(quantize_nvfp4(dy, rounding="stochastic", generator=gen))
    dy_t_q = _deq(quantize_nvfp4(_pad_t(dy, 16), rounding="stochastic", generator=gen))
    _assert_gemm_close(dx, dy_q, _deq(quantize_nvfp4(w, tile=(16, 16))).T)
    _assert_gemm_close(dw, dy_t_q, _deq(quantize_nvfp4(_pad_t(x, 16))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_everything_off_is_exactly_f_linear(dtype):
    x, w, b, dy = _problem(dtype=dtype)
    off = PassConfigs()  # every GEMM on the BF16 operands
    ours = _run(off, x, w, b, dy)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = F.linear(xr, wr, br)
    y.backward(dy)
    for a, e in zip(ours, (y.detach(), xr.grad, wr.grad, br.grad)):
        assert torch.equal(a, e)


def test_each_switch_changes_exactly_its_ingredient():
    x, w, b, dy = _problem()
    base = _run(DETERMINISTIC, x, w, b, dy)

    def same(a, c):
        return torch.equal(a, c)

    no_rht = _run(NVFP4Config(gemm="exact", stochastic_rounding=False, rht=False), x, w, b, dy)
    assert same(no_rht[0], base[0]) and same(no_rht[1], base[1]) and not same(no_rht[2], base[2])
    no_2d = _run(NVFP4Config(gemm="exact", stochastic_rounding=False, weight_2d=False), x, w, b, dy)
    assert not same(no_2d[0], base[0]) and not same(no_2d[1], base[1]) and same(no_2d[2], base[2])
    with_sr = _run(EXACT, x, w, b, dy)
    assert same(with_sr[0], base[0]) and not same(with_sr[1], base[1]) and not same(with_sr[2], base[2])
    assert all(same(a, c) for a, c in zip(_run(EXACT, x, w, b, dy), with_sr))  # same seed, same draws
    fwd_off = _run(PassConfigs(None, DETERMINISTIC, DETERMINISTIC), x, w, b, dy)
    assert same(fwd_off[0], F.linear(x, w, b)) and same(fwd_off[1], base[1]) and same(fwd_off[2], base[2])
    bwd_off = _run(PassConfigs(EXACT, None, None), x, w, b, dy)
    dy2, x2 = dy.reshape(-1, 48), x.reshape(-1, 64)
    assert same(bwd_off[0], base[0])
    assert same(bwd_off[1], dy2.mm(w).view_as(x)) and same(bwd_off[2], dy2.t().mm(x2))


def test_1d_weight_quantizes_fprop_along_k_and_dgrad_along_n():
    x, w, b, dy = _problem(tokens=(64,))
    cfg = NVFP4Config(gemm="exact", stochastic_rounding=False, weight_2d=False)
    y, dx, _, _ = _run(cfg, x, w, b, dy)
    _assert_gemm_close(y - b, _deq(quantize_nvfp4(x)), _deq(quantize_nvfp4(w)))
    _assert_gemm_close(dx, _deq(quantize_nvfp4(dy)), _deq(quantize_nvfp4(w.t().contiguous())))


def test_fast_gemm_is_within_one_bf16_rounding_of_exact():
    x, w, b, dy = _problem(dtype=torch.bfloat16, tokens=(64,))
    b = torch.zeros_like(b)  # a bias would cancel against the GEMM and hide its relative error
    fast = _run(NVFP4Config(stochastic_rounding=False), x, w, b, dy)
    exact = _run(DETERMINISTIC, x, w, b, dy)
    for f, e in zip(fast[:3], exact[:3]):
        assert f.dtype == torch.bfloat16
        # bf16 GEMM output (<= 1 bf16 rounding) then the bf16 result: <= 2 roundings of 2**-8 each.
        torch.testing.assert_close(f.float(), e.float(), rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize("tokens", [(40,), (2, 17)])
def test_token_counts_not_multiple_of_16_are_padded(tokens):
    x, w, b, dy = _problem(tokens=tokens)
    _, dx, dw, _ = _run(DETERMINISTIC, x, w, b, dy)
    assert dx.shape == x.shape and dw.shape == w.shape and torch.isfinite(dw).all()


def test_mxfp4_and_fp8_forward_equal_reference_compositions():
    x, w, b, _ = _problem(tokens=(32,), k=256, n=128)
    y = quantized_linear(x, w, None, MXFP4Config(gemm="exact"))
    _assert_gemm_close(y, _deq(quantize_mxfp4(x)), _deq(quantize_mxfp4(w)))
    y = quantized_linear(x, w, None, FP8BlockConfig(gemm="exact"))
    _assert_gemm_close(y, _deq(quantize_fp8_block(x)), _deq(quantize_fp8_block(w, (128, 128))))


def test_mxfp4_and_fp8_backward_equal_reference_compositions():
    x, w, b, dy = _problem(tokens=(40,), k=256, n=128)
    _, dx, dw, _ = _run(MXFP4Config(gemm="exact"), x, w, b, dy)
    _assert_gemm_close(dx, _deq(quantize_mxfp4(dy)), _deq(quantize_mxfp4(w.t().contiguous())))
    _assert_gemm_close(dw, _deq(quantize_mxfp4(_pad_t(dy, 32))), _deq(quantize_mxfp4(_pad_t(x, 32))))
    _, dx, dw, _ = _run(FP8BlockConfig(gemm="exact"), x, w, b, dy)
    _assert_gemm_close(dx, _deq(quantize_fp8_block(dy)), _deq(quantize_fp8_block(w, (128, 128))).T)
    _assert_gemm_close(dw, _deq(quantize_fp8_block(_pad_t(dy, 128))), _deq(quantize_fp8_block(_pad_t(x, 128))))


def test_quantized_linear_rejects_bad_dimensions_and_configs():
    with pytest.raises(ValueError, match="K \\(in_features\\) = 40"):
        nvfp4_linear(torch.zeros(4, 40), torch.zeros(16, 40))
    with pytest.raises(ValueError, match="N \\(out_features\\) = 100"):
        quantized_linear(torch.zeros(4, 128), torch.zeros(100, 128), config=MXFP4Config())
    # FP8 zero-pads partial 128-blocks instead (tests/nvfp4_recipe/test_fp8_partial_blocks.py)
    assert quantized_linear(torch.zeros(4, 128), torch.zeros(100, 128),
                            config=FP8BlockConfig()).shape == (4, 100)
    with pytest.raises(ValueError, match="do not match"):
        nvfp4_linear(torch.zeros(4, 32), torch.zeros(16, 48))
    with pytest.raises(ValueError, match="NVFP4Config"):
        nvfp4_linear(torch.zeros(4, 32), torch.zeros(16, 32), config=MXFP4Config())
    with pytest.raises(ValueError, match="gemm"):
        NVFP4Config(gemm="fp64")
    assert torch.equal(quantized_linear(torch.ones(2, 8), torch.ones(3, 8), None, None), torch.full((2, 3), 8.0))


def test_backward_saves_no_activation_copy_when_weight_is_frozen():
    x, w, _, dy = _problem(tokens=(32,))
    x = x.requires_grad_()
    y = nvfp4_linear(x, w, None, DETERMINISTIC)  # w does not require grad
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert all(t.data_ptr() != x.data_ptr() for t in saved)
    y.backward(dy)
    assert x.grad is not None


def _heavy_tailed(rows, cols, dtype, seed=0):
    """Per-column ranges 1e-4..1e3: sums of 16 such values round in FP32, so the order matters."""
    gen = torch.Generator().manual_seed(seed)
    ranges = torch.logspace(-4, 3, cols, dtype=torch.float64)[torch.randperm(cols, generator=gen)]
    return (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * ranges).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 200, 300, 1000])  # one block, partial blocks, padding
def test_blocked_transpose_and_fused_rht_equal_the_unfused_composition(dtype, tokens):
    # The Wgrad source is built block by block (transpose in cache, RHT on each block); it must be
    # bit-identical to pad(t^T) and to random_hadamard_transform(pad(t^T)) computed whole.
    from nvfp4_recipe.hadamard import rht_matrix
    from nvfp4_recipe.operands import transpose_padded

    t = _heavy_tailed(tokens, 48, dtype)
    plain = _pad_t(t, 16)
    assert torch.equal(transpose_padded(t, 16), plain)
    fused = transpose_padded(t, 16, rht_matrix())
    assert torch.equal(fused.view(torch.int32), random_hadamard_transform(plain).view(torch.int32))
    for multiple in (32, 128, 256):  # MXFP4, FP8, and a block larger than the copy block
        assert torch.equal(transpose_padded(t, multiple), _pad_t(t, multiple))


def test_blocked_rht_equals_the_whole_tensor_rht_at_model_widths():
    # The per-block GEMMs have far fewer rows than a whole-tensor one; the per-row sums must not
    # depend on the row count. 1024 channels x 384 tokens, heavy-tailed, bf16 (the Wgrad input).
    from nvfp4_recipe.hadamard import rht_matrix
    from nvfp4_recipe.operands import transpose_padded

    t = _heavy_tailed(384, 1024, torch.bfloat16, seed=3)
    fused = transpose_padded(t, 16, rht_matrix())
    assert torch.equal(fused.view(torch.int32), random_hadamard_transform(_pad_t(t, 16)).view(torch.int32))


def test_fast_output_is_the_bf16_gemm_times_the_fp32_scales_rounded_once_more():
    # emulated_gemm multiplies the bf16 GEMM output in place by the 0-d FP32 scale product: torch
    # must compute that in FP32 (not round the scale to bf16 first), or outputs drift by ~2**-8.
    from nvfp4_recipe.linear import emulated_gemm
    from nvfp4_recipe.operands import GemmOperand
    from nvfp4_recipe.nvfp4 import nvfp4_scaled_values

    x, w, _, _ = _problem(tokens=(64,), dtype=torch.bfloat16)
    a = GemmOperand(*nvfp4_scaled_values(x))
    b = GemmOperand(*nvfp4_scaled_values(w, 16))
    scale = a.decode_scale * b.decode_scale
    assert scale.item() != scale.to(torch.bfloat16).item()  # otherwise the test could not fail
    expected = (torch.mm(a.values, b.values.t()).float() * scale).to(torch.bfloat16)
    assert torch.equal(emulated_gemm(a, b, torch.bfloat16), expected)
    assert torch.equal(emulated_gemm(a, b, torch.float32), torch.mm(a.values, b.values.t()).float() * scale)
