"""The emulated linear with a format per GEMM pass: each GEMM's two operands are quantized in its
own pass's format, so a mixed linear computes, GEMM by GEMM, what the single-format linears
compute (bit for bit, FP32 GEMMs)."""

from __future__ import annotations

import itertools

import pytest
import torch

from nvfp4_recipe import (FP8BlockConfig, MXFP4Config, MXFP8Config, NVFP4Config, PassConfigs,
                          quantized_linear)
from nvfp4_recipe.linear import WeightOperandCache
from nvfp4_recipe.operands import _NVFP4Ops

# One deterministic config per format (no stochastic rounding: no generator state is shared
# between the GEMMs), FP32 GEMMs; None is BF16 (the unquantized operands).
FORMATS = {
    "nvfp4": NVFP4Config(gemm="exact", stochastic_rounding=False),
    "mxfp8": MXFP8Config(gemm="exact"),
    "fp8": FP8BlockConfig(gemm="exact"),
    "mxfp4": MXFP4Config(gemm="exact"),
    "bf16": None,
}


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 40, 64, generator=gen)  # T = 80: Wgrad's operands pad it
    w = torch.randn(96, 64, generator=gen) / 8  # K = 64, N = 96: whole 16- and 32-blocks
    dy = torch.randn(2, 40, 96, generator=gen)
    return x, w, dy


def _run(config, x, w, dy, seed=0, grads=(True, True)):
    x = x.detach().clone().requires_grad_(grads[0])
    w = w.detach().clone().requires_grad_(grads[1])
    y = quantized_linear(x, w, None, config, generator=torch.Generator().manual_seed(seed))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("fprop,dgrad,wgrad", list(itertools.permutations(FORMATS, 3)))
def test_each_gemm_computes_what_the_linear_of_its_passs_format_computes(fprop, dgrad, wgrad):
    """Fprop's x and W in the Fprop format, Dgrad's dY and W in the Dgrad format, Wgrad's dY^T and
    x^T in the Wgrad format: y from the Fprop format's linear, dx from the Dgrad format's, dW
    from the Wgrad format's, every bit."""
    x, w, dy = _problem()
    y, dx, dw = _run(PassConfigs(FORMATS[fprop], FORMATS[dgrad], FORMATS[wgrad]), x, w, dy)
    assert torch.equal(y, _run(FORMATS[fprop], x, w, dy)[0])
    assert torch.equal(dx, _run(FORMATS[dgrad], x, w, dy)[1])
    assert torch.equal(dw, _run(FORMATS[wgrad], x, w, dy)[2])


def test_stochastic_rounding_draws_in_the_same_order_as_one_format():
    """MXFP8 forward, NVFP4 backward (stochastic rounding on dY, RHT on Wgrad): Dgrad's draws come
    first, then Wgrad's, so the gradients equal those of the NVFP4 linear with the same seed."""
    x, w, dy = _problem(1)
    nvfp4 = NVFP4Config(gemm="exact")
    mixed = _run(PassConfigs(MXFP8Config(gemm="exact"), nvfp4, nvfp4), x, w, dy, seed=7)
    alone = _run(nvfp4, x, w, dy, seed=7)
    assert torch.equal(mixed[1], alone[1]) and torch.equal(mixed[2], alone[2])
    assert not torch.equal(mixed[0], alone[0])
    # Another seed draws other bits: the gradients do come from the generator.
    assert not torch.equal(_run(nvfp4, x, w, dy, seed=8)[2], alone[2])


def test_a_bf16_backward_is_the_plain_gemms():
    x, w, dy = _problem()
    y, dx, dw = _run(PassConfigs(MXFP8Config(gemm="exact")), x, w, dy)
    dy2, x2 = dy.reshape(-1, 96), x.reshape(-1, 64)
    assert torch.equal(dx, dy2.mm(w).view_as(x)) and torch.equal(dw, dy2.t().mm(x2))
    assert torch.equal(y, _run(MXFP8Config(gemm="exact"), x, w, dy)[0])


def test_dgrad_reuses_fprops_weight_copy_only_under_the_same_config(monkeypatch):
    """NVFP4's 16x16 tiles are transpose-symmetric: under one config Dgrad transposes Fprop's
    copy (one quantization of W); under another config it quantizes W itself, and the result
    is the same either way."""
    calls = []
    real = _NVFP4Ops.weight_fprop
    monkeypatch.setattr(_NVFP4Ops, "weight_fprop",
                        lambda self, weight: calls.append(self.config) or real(self, weight))
    x, w, dy = _problem()
    shared = NVFP4Config(gemm="exact", stochastic_rounding=False)
    same = _run(PassConfigs(shared, shared, shared), x, w, dy)
    assert len(calls) == 1
    calls.clear()
    other = NVFP4Config(gemm="exact", stochastic_rounding=False, rht=False)
    apart = _run(PassConfigs(shared, other, shared), x, w, dy)
    assert calls == [shared, other]
    assert torch.equal(same[1], apart[1])  # the RHT is a Wgrad ingredient: Dgrad is the same


def test_the_weight_cache_keeps_each_copy_for_its_own_config():
    cache = WeightOperandCache()
    x, w, _ = _problem()
    w = w.bfloat16()
    nvfp4, mxfp8 = NVFP4Config(), MXFP8Config()
    xs = x.bfloat16().requires_grad_()
    quantized_linear(xs, w.requires_grad_(), None, PassConfigs(mxfp8, nvfp4, nvfp4),
                     weight_cache=cache).float().sum().backward()
    assert cache.fprop[0] is mxfp8 and cache.dgrad[0] is nvfp4
    fprop, dgrad = cache.fprop[1], cache.dgrad[1]
    quantized_linear(xs, w, None, PassConfigs(None, nvfp4, nvfp4),
                     weight_cache=cache).float().sum().backward()
    assert cache.dgrad[1] is dgrad and cache.fprop[1] is fprop  # Dgrad kept its copy
    assert cache.get("fprop", nvfp4) is None  # never another format's copy


def test_shapes_are_checked_for_every_pass_format():
    x, w = torch.randn(4, 48), torch.randn(64, 48)  # K = 48: NVFP4's 16 divides it, MXFP8's 32 not
    quantized_linear(x, w, None, PassConfigs(NVFP4Config()))
    with pytest.raises(ValueError, match="MXFP8 linear: K .in_features. = 48"):
        quantized_linear(x, w, None, PassConfigs(NVFP4Config(), None, MXFP8Config()))


def test_the_forward_keeps_fprops_weight_copy_only_where_dgrad_reads_it():
    """NVFP4 16x16 tiles and FP8 128x128 blocks are transpose-symmetric: Dgrad reads Fprop's copy,
    so the forward keeps it. MX formats quantize W^T afresh for Dgrad: keeping Fprop's copy
    would hold ~2 bytes per weight element per micro-batch for nothing. Same gradients."""
    from nvfp4_recipe import FP8BlockConfig, MXFP4Config, MXFP8Config, NVFP4Config, quantized_linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 128, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 128, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    for config, keeps in ((NVFP4Config(stochastic_rounding=False), True),
                          (NVFP4Config(stochastic_rounding=False, weight_2d=False), False),
                          (FP8BlockConfig(), True), (MXFP8Config(), False), (MXFP4Config(), False)):
        y = quantized_linear(x, w, None, config)
        node = y.grad_fn
        while not hasattr(node, "saved_tensors"):
            node = node.next_functions[0][0]
        saved = [t for t in node.saved_tensors if t is not None]
        # x and W, plus Fprop's copy of W (and NVFP4's tensor scale) where Dgrad reads it
        assert (len(saved) > 2) == keeps, (config, len(saved))
