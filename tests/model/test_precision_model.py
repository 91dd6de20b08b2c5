"""The precision policy applied to the demo model: which linear gets what, and what it computes."""

from __future__ import annotations

import pytest
import torch

from nvfp4_recipe import NVFP4Config, PassConfigs, quantize_nvfp4
from nvfp4_recipe.megatron.parallel_linear import PrecisionColumnParallelLinear, PrecisionRowParallelLinear
from nvfp4_recipe.policy import PrecisionConfig
from helpers import model_config

VOCAB = 512


def build(precision: PrecisionConfig):
    from model.build import build_model

    torch.manual_seed(0)
    return build_model(model_config("demo"), precision, vocab_size=VOCAB, backend="emulated")


def precision_linears(module):
    return {name.removeprefix("decoder."): m for name, m in module.named_modules()
            if isinstance(m, (PrecisionColumnParallelLinear, PrecisionRowParallelLinear))}


def test_policy_decides_every_linear_of_the_demo(parallel_context):
    built = build(PrecisionConfig(name="nvfp4", format="nvfp4"))
    linears = precision_linears(built.module)
    assert len(linears) == 18  # 9 pattern layers x 2
    for name, module in linears.items():
        layer = int(name.split(".")[1])
        low = 1 <= layer <= 6  # demo: first 1 and last 2 of 9 layers stay BF16
        assert module.gemm_format == ("nvfp4" if low else "bf16"), name
        # one config object for the three GEMMs (so Dgrad may reuse Fprop's weight copy)
        configs = module.gemm_config
        assert configs == (PassConfigs.every(NVFP4Config()) if low else None), name
        assert not low or configs.fprop is configs.dgrad is configs.wgrad
    # embeddings, output layer and norms are not precision linears: they stay high precision
    assert type(built.module.output_layer).__name__ == "ColumnParallelLinear"


@pytest.mark.parametrize("key", ["rht", "stochastic_rounding", "weight_2d"])
def test_each_ablation_key_reaches_exactly_its_field(parallel_context, key):
    built = build(PrecisionConfig(name="x", format="nvfp4", **{key: False}))
    configs = {c for m in precision_linears(built.module).values() if m.gemm_config
               for c in (m.gemm_config.fprop, m.gemm_config.dgrad, m.gemm_config.wgrad)}
    expected = NVFP4Config(**{key: False})
    assert configs == {expected}


def _capture_linear_io(module):
    records = {}

    def hook(name):
        def fn(mod, inputs, output):
            records[name] = (inputs[0].detach(), output[0].detach())
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in precision_linears(module).items()]
    return records, handles


def test_forward_equals_reference_composition_layer_by_layer(parallel_context):
    """Each NVFP4 linear's output == dequant(Q(x, 1x16)) @ dequant(Q(W, 16x16))^T, computed here
    from the public quantizers (exact GEMM mode: FP32 products and sums of the q*s values)."""
    built = build(PrecisionConfig(name="nvfp4", format="nvfp4", gemm="exact"))
    records, handles = _capture_linear_io(built.module)
    tokens = torch.randint(0, VOCAB, (2, 64))
    with torch.no_grad():
        built.module(tokens, None, None)
    for h in handles:
        h.remove()
    checked = 0
    for name, module in precision_linears(built.module).items():
        x, out = records[name]
        x_bf16 = x.to(torch.bfloat16).reshape(-1, x.shape[-1])
        w_bf16 = module.weight.detach().to(torch.bfloat16)
        if module.gemm_format == "bf16":
            ref = torch.nn.functional.linear(x_bf16, w_bf16).float()
            torch.testing.assert_close(out.reshape(ref.shape).float(), ref, rtol=0, atol=0)
            continue
        xq = quantize_nvfp4(x_bf16, tile=(1, 16)).dequantize()
        wq = quantize_nvfp4(w_bf16, tile=(16, 16)).dequantize()
        ref = xq @ wq.t()
        # The linear casts its BF16 output back to the FP32 residual stream: compare in BF16.
        torch.testing.assert_close(out.reshape(ref.shape), ref.to(torch.bfloat16).float(),
                                   rtol=8e-3, atol=1e-5)
        checked += 1
    assert checked == 12


def test_switch_to_bf16_makes_every_gemm_plain_bf16(parallel_context):
    nvfp4 = build(PrecisionConfig(name="nvfp4", format="nvfp4"))
    bf16 = build(PrecisionConfig())
    tokens = torch.randint(0, VOCAB, (2, 64))
    nvfp4.runtime_state.bf16_passes = ("fprop", "dgrad", "wgrad")  # the switch, passes=all
    with torch.no_grad():
        a = nvfp4.module(tokens, None, None, labels=tokens)
        b = bf16.module(tokens, None, None, labels=tokens)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    nvfp4.runtime_state.bf16_passes = ()
    with torch.no_grad():
        c = nvfp4.module(tokens, None, None, labels=tokens)
    assert not torch.equal(a, c)  # back on: the quantized forward differs


def test_forward_only_switch_keeps_backward_quantized(parallel_context):
    built = build(PrecisionConfig(name="nvfp4", format="nvfp4"))
    built.runtime_state.bf16_passes = ("fprop",)  # the switch, passes=forward
    layer = precision_linears(built.module)["layers.1.mlp.linear_fc1"]
    active = layer._active_gemm_config()
    assert active.fprop is None and active.dgrad is active.wgrad is layer.gemm_config.dgrad
    assert active.dgrad is not None
