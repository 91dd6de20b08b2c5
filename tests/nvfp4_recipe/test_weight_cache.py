"""Each weight quantized once per step, not per micro-batch, as TE does (`is_first_microbatch`).

The emulated linears follow TE's flag, which the precision controller drives through each
linear's `refresh_weight_cache` (`is_first_microbatch = True`) at the start of a step and of an
evaluation.
The first micro-batch then quantizes the weight (its Fprop operand, and its Dgrad operand in the
backward) and the others reuse the copies; a step never sees the previous step's weights (over
two whole steps through the trainer's pieces: tests/system/test_weight_cache_steps.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import count_weight_quantizations

from nvfp4_recipe import NVFP4Config, quantized_linear
from nvfp4_recipe.linear import WeightOperandCache


@pytest.mark.parametrize("weight_2d", [True, False])
def test_cached_operands_give_bit_identical_outputs_and_gradients(monkeypatch, weight_2d):
    calls = count_weight_quantizations(monkeypatch)
    config = NVFP4Config(weight_2d=weight_2d)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=gen).bfloat16().requires_grad_()
    xs = [torch.randn(32, 128, generator=gen).bfloat16().requires_grad_() for _ in range(3)]

    def run(cache):
        outs, grads = [], []
        torch.manual_seed(11)  # the stochastic-rounding draws of the gradients
        for t in (weight, *xs):
            t.grad = None
        for x in xs:
            y = quantized_linear(x, weight, None, config, weight_cache=cache)
            y.float().square().sum().backward()
            outs.append(y.detach())
            grads.append(x.grad.clone())
        return outs, grads, weight.grad.clone()

    uncached = run(None)
    assert calls == {"fprop": 3, "dgrad": 3}
    calls.update(fprop=0, dgrad=0)
    cached = run(WeightOperandCache())
    # One quantization per weight for the three micro-batches. With 16x16 tiles, weight_dgrad
    # transposes Fprop's copy (no new quantization) and is skipped too once cached.
    assert calls == {"fprop": 1, "dgrad": 1}
    for a, b in zip(uncached[0] + uncached[1], cached[0] + cached[1]):
        assert torch.equal(a, b)
    assert torch.equal(uncached[2], cached[2])


def test_cache_is_per_config():
    cache = WeightOperandCache()
    weight = torch.randn(32, 64).bfloat16()
    x = torch.randn(16, 64).bfloat16()
    nvfp4, other = NVFP4Config(), NVFP4Config(weight_2d=False)
    quantized_linear(x, weight, None, nvfp4, weight_cache=cache)
    first = cache.fprop
    quantized_linear(x, weight, None, other, weight_cache=cache)
    # never another format's copy
    assert cache.fprop[0] is other and cache.fprop[1] is not first[1]


def test_partial_switch_to_bf16_keeps_the_cached_weight(parallel_context, monkeypatch):
    """After `switch_to_bf16` with passes=forward only the backward stays quantized: Dgrad keeps
    its config, so the weight's Dgrad operand is still quantized once per step, not at every
    micro-batch (the cache keeps each copy with its config, linear.py)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nvfp4_recipe.megatron.parallel_linear import PrecisionColumnParallelLinear
    from nvfp4_recipe.policy import RuntimePrecisionState

    calls = count_weight_quantizations(monkeypatch)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1,
                               use_cpu_initialization=True, params_dtype=torch.bfloat16)
    state = RuntimePrecisionState()
    linear = PrecisionColumnParallelLinear(
        64, 32, config=config, init_method=torch.nn.init.normal_, bias=False,
        gather_output=False, gemm_format="nvfp4", gemm_config=NVFP4Config(), runtime_state=state)
    xs = [torch.randn(8, 2, 64).bfloat16().requires_grad_() for _ in range(3)]

    def step():
        calls.update(fprop=0, dgrad=0)
        linear.refresh_weight_cache()
        for x in xs:
            linear(x)[0].float().square().sum().backward()
        return dict(calls)

    assert step() == {"fprop": 1, "dgrad": 1}
    state.bf16_passes = ("fprop",)  # passes=forward: Fprop in BF16, Dgrad and Wgrad still NVFP4
    # The Dgrad copy comes from the 16x16 tiles (weight_fprop) once per step, not once per
    # micro-batch: Dgrad's config did not change, so its cached copy still serves it.
    assert step() == {"fprop": 1, "dgrad": 1}
    assert step() == {"fprop": 1, "dgrad": 1}
    state.bf16_passes = ("fprop", "dgrad", "wgrad")  # passes=all
    assert step() == {"fprop": 0, "dgrad": 0}
