"""The portable core attention in the input dtype, grouped heads handled by SDPA.

Reference: the same causal GQA attention in float64 with K/V heads copied per query head
(repeat_interleave, the grouping megatron uses). Tolerance, normwise against the largest value:
2 BF16 ulps (2 * 2^-8 relative): BF16 inputs, one FP32-accumulated GEMM, an FP32 softmax, the
second GEMM, and one rounding of the BF16 output (the backward reads that rounded output, as every
BF16 attention kernel's does); the same bound tests/nvfp4_recipe/test_compute.py holds SDPA to.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention import SDPACoreAttention
from nvfp4_recipe.compute import GEMM_OPS, FP32Gemms

SEQ, BATCH, HEADS, GROUPS, DIM = 48, 2, 8, 2, 32


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def attention(parallel_context):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, use_cpu_initialization=True,
                               attention_dropout=0.0)
    return SDPACoreAttention(config, 1, AttnMaskType.causal, "self")


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=g)
    k = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=g)
    v = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=g)
    dy = torch.randn(SEQ, BATCH, HEADS * DIM, generator=g)
    return [t.to(dtype) for t in (q, k, v)], dy


def _reference(q, k, v):
    """float64 causal attention, K/V heads repeated per query head; [s, b, n, d] -> [s, b, n*d]."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.permute(2, 0, 1, 3).reshape(SEQ, BATCH, HEADS * DIM)


def _run(fn, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out.double() * dy.double()).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("gemms", ["as they are", "FP32Gemms"])
def test_bf16_attention_matches_an_fp32_reference(attention, gemms):
    inputs, dy = _inputs(torch.bfloat16)
    mode = _Ops()
    policy = FP32Gemms() if gemms == "FP32Gemms" else None
    with policy or contextlib.nullcontext(), mode:
        got = _run(attention, inputs, dy)
    ref = _run(_reference, [t.double() for t in inputs], dy)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.dtype == torch.bfloat16, name  # no FP32 upcast: the input dtype throughout
        assert (a.double() - b).abs().max() <= 2 * 2**-8 * b.abs().max(), name
    # SDPA took the grouped heads itself (no per-head copies of K and V), through the CPU flash
    # kernel, which the GEMM compute policy intercepts (compute.GEMM_OPS)
    aten = torch.ops.aten
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in mode.ops
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in GEMM_OPS
    assert not {aten.repeat_interleave.self_int, aten.index_select.default} & set(mode.ops)
    if policy is not None:
        assert policy.counts["bf16->fp32"] == 2  # the attention forward and its backward


def test_fp32_inputs_stay_fp32(attention):
    """float32 comparisons (params_dtype=float32 builds) keep their dtype and agree tightly."""
    inputs, dy = _inputs(torch.float32)
    got = _run(attention, inputs, dy)
    ref = _run(_reference, [t.double() for t in inputs], dy)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
