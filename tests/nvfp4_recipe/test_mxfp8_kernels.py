"""The torch.compile'd MXFP8 quantizer (nvfp4_recipe/mxfp8.py, "Kernels") against the eager one:
the same bytes of E4M3 data and E8M0 scales, and the same dequantized values, bit for bit.

The eager path is checked against the independent reference written from TE's source in
tests/nvfp4_recipe/test_mxfp8.py (which also runs its reference comparisons on the compiled path),
so bit equality here, on more inputs and every dtype pair the emulated linear uses, carries that
over. Each input dtype / output dtype variant compiles once per process (seconds; inductor caches
it on disk).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import nvfp4_recipe.mxfp8 as mxfp8
from nvfp4_recipe import quantized_linear
from nvfp4_recipe.config import MXFP8Config
from nvfp4_recipe.kernels import Fused, use_compiled
from nvfp4_recipe.mxfp8 import mxfp8_dequantized_values, quantize_mxfp8
from nvfp4_recipe.policy import PrecisionConfig, describe_kernels
from nvfp4_recipe.registry import Format, format_spec

needs_compiler = pytest.mark.skipif(not use_compiled("auto", torch.device("cpu")),
                                    reason="no C++ compiler for inductor on this machine")

F32 = np.float32


def _powers_of_two_times_448() -> torch.Tensor:
    """One block per k: amax exactly 448 * 2**k, one FP32 ulp above and below (float32 steps), the
    rest of the block random below it; k spans E8M0's subnormal-product end, the middle and the top."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for k in [*range(-136, -118), *range(-20, 21), *range(110, 120)]:
        exact = F32(448.0 * 2.0**k)
        for amax in (exact, np.nextafter(exact, F32(np.inf)), np.nextafter(exact, F32(0))):
            row = (torch.rand(32, generator=gen) * 2 - 1) * float(amax) * 0.9
            row[int(torch.randint(0, 32, (1,), generator=gen))] = float(amax) * (-1) ** k
            rows.append(row)
    return torch.stack(rows).float()


def _inputs() -> dict[str, torch.Tensor]:
    """FP32 inputs; each test also runs them as BF16 and FP16 (the activations' and gradients'
    dtypes; the Wgrad sources are FP32)."""
    gen = torch.Generator().manual_seed(38)
    zero_blocks = torch.randn(6, 128, generator=gen)
    zero_blocks[0] = 0.0
    zero_blocks[1] = -0.0
    zero_blocks[2, 32:64] = -0.0
    zero_blocks[3, :32] = torch.tensor([-1e-30] * 31 + [448.0])  # rounds to -0 beside a 448
    zero_blocks[4, 64:96] = torch.where(torch.arange(32) % 2 == 0, 0.0, -0.0)
    return {
        "normal": torch.randn(64, 256, generator=gen),
        "heavy_tailed": torch.randn(32, 256, generator=gen) * torch.logspace(-8, 8, 256),
        "zero_blocks": zero_blocks,
        # amax * fp32(1/448) an FP32 subnormal (the exponent-0 branch), and FP32 subnormal inputs
        "subnormal_products": torch.randn(16, 128, generator=gen) * torch.logspace(-39, -35, 16).unsqueeze(1),
        "subnormal_inputs": torch.randn(16, 128, generator=gen) * 1e-42,
        # elements far below their block's amax: E4M3 subnormals and zeros of both signs
        "wide_blocks": torch.randn(16, 128, generator=gen) * torch.logspace(-12, 2, 128)[torch.randperm(128, generator=gen)],
        "large": torch.randn(8, 128, generator=gen) * 1e36,
        "powers_of_two_times_448": _powers_of_two_times_448(),
        "odd_block_count": torch.randn(3, 96, generator=gen),  # 9 blocks: a partial vector
    }


def _cases():
    for name, x in _inputs().items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = x.to(dtype)
            if dtype != torch.float32 and not bool(y.isfinite().all()):
                continue  # 1e36 overflows FP16: that input's FP16 twin is not an inf/nan-free one
            yield pytest.param(y, id=f"{name}-{str(dtype).removeprefix('torch.')}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@needs_compiler
@pytest.mark.parametrize("x", _cases())
def test_compiled_quantize_is_bit_identical_to_eager(x):
    eager, compiled = (quantize_mxfp8(x, kernels=k) for k in ("eager", "compiled"))
    assert torch.equal(_bits(eager.data), _bits(compiled.data))
    assert torch.equal(_bits(eager.scales), _bits(compiled.scales))
    assert eager.shape == compiled.shape == x.shape
    assert torch.equal(_bits(eager.dequantize()), _bits(compiled.dequantize()))
    # The GEMM operands: the dequantized values straight from the fused kernel, in FP32 (BF16
    # GEMMs computed in FP32) and BF16, equal to the eager quantize-dequantize, sign of zero too.
    for dtype in (torch.float32, torch.bfloat16):
        fused = mxfp8_dequantized_values(x, dtype, kernels="compiled")
        assert torch.equal(_bits(fused), _bits(mxfp8_dequantized_values(x, dtype, kernels="eager")))
        assert torch.equal(_bits(fused), _bits(eager.dequantize(dtype)))


@needs_compiler
def test_the_edge_inputs_exercise_what_they_are_named_for():
    """The inputs hit the branches the equality above must cover (else it could pass vacuously):
    E8M0 codes 0 and 1 from subnormal products, scales exactly 2**k for amax 448 * 2**k, +-0
    data bytes, E4M3 subnormal data bytes."""
    inputs = _inputs()
    q = quantize_mxfp8(inputs["subnormal_products"], kernels="compiled")
    assert {0, 1} <= set(q.scales.view(torch.uint8).unique().tolist())
    powers = quantize_mxfp8(inputs["powers_of_two_times_448"], kernels="compiled")
    exact_scales = powers.scales.view(torch.uint8).view(-1, 3)[:, 0].long()
    ks = torch.tensor([*range(-136, -118), *range(-20, 21), *range(110, 120)])
    assert torch.equal(exact_scales, torch.where(ks >= -127, ks + 127, 0))
    data = quantize_mxfp8(inputs["zero_blocks"], kernels="compiled").data.view(torch.uint8)
    assert (data[1] == 0x80).all() and (data[0] == 0).all() and (data[3, :31] == 0x80).all()
    wide = quantize_mxfp8(inputs["wide_blocks"], kernels="compiled").data.view(torch.uint8)
    exponent_field = (wide & 0x78) >> 3
    assert bool(((exponent_field == 0) & ((wide & 0x07) != 0)).any())  # E4M3 subnormals


@needs_compiler
def test_non_finite_inputs_quantize_as_eager():
    """Inf saturates to +-448 under scale 2**127 (code 254) on both paths; NaN elements stay NaN
    and do not enter the amax (the NaN's sign is not TE's to state: compared as NaN-ness)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    x[0, 5], x[1, 40], x[2, 3], x[3, 32:] = float("inf"), float("-inf"), float("nan"), float("nan")
    eager, compiled = (quantize_mxfp8(x, kernels=k) for k in ("eager", "compiled"))
    assert torch.equal(_bits(eager.scales), _bits(compiled.scales))
    nan = torch.isnan(x)
    assert torch.equal(_bits(eager.data)[~nan], _bits(compiled.data)[~nan])
    assert bool(((_bits(compiled.data)[nan] & 0x7F) == 0x7F).all())


@needs_compiler
@pytest.mark.parametrize("gemm", ["fast", "exact"])
def test_compiled_linear_forward_and_backward_are_bit_identical_to_eager(gemm):
    """The emulated MXFP8 linear (Fprop, Dgrad and Wgrad operands: BF16 activations and
    gradients, FP32 Wgrad sources padded to 32 tokens) on each path."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(72, 96, generator=gen) * torch.logspace(-3, 2, 96)).bfloat16()  # Wgrad pads to 96
    w = torch.randn(64, 96, generator=gen, dtype=torch.bfloat16) / 8
    dy = torch.randn(72, 64, generator=gen, dtype=torch.bfloat16)
    outs = []
    for kernels in ("eager", "compiled"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_linear(xr, wr, None, MXFP8Config(gemm=gemm, kernels=kernels))
        y.backward(dy)
        outs.append((y, xr.grad, wr.grad))
    for eager, compiled in zip(*outs):
        assert torch.equal(_bits(eager), _bits(compiled))


def test_a_failed_compile_falls_back_with_one_warning_under_auto_and_raises_when_compiled(monkeypatch):
    """The same fallback rule as NVFP4's kernels (nvfp4_recipe/kernels.py, Fused): "auto" warns once
    and runs eagerly (the same bits), "compiled" raises."""

    def no_compiler(*_args):
        raise torch._inductor.exc.CppCompileError(["g++"], "no toolchain (test)")

    broken = Fused(mxfp8._flat_mxfp8_data)
    broken.__dict__["compiled"] = no_compiler  # the cached torch.compile'd form, replaced
    monkeypatch.setattr(mxfp8, "_COMPILED_DATA", broken)
    monkeypatch.setattr(mxfp8.fused, "use_compiled", lambda mode, device: mode != "eager")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    eager = quantize_mxfp8(x, kernels="eager")
    with pytest.warns(RuntimeWarning, match="precision.kernels=eager"):
        auto = quantize_mxfp8(x, kernels="auto")
    assert torch.equal(_bits(auto.data), _bits(eager.data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        quantize_mxfp8(x, kernels="auto")
    with pytest.raises(torch._inductor.exc.CppCompileError):
        quantize_mxfp8(x, kernels="compiled")


def test_kernel_modes_are_validated():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="kernels='fused'"):
        quantize_mxfp8(x, kernels="fused")
    with pytest.raises(ValueError, match="kernels='jit'"):
        mxfp8_dequantized_values(x, kernels="jit")
    with pytest.raises(ValueError, match="MXFP8Config.kernels='fast'"):
        MXFP8Config(kernels="fast")


def test_precision_kernels_reaches_the_mxfp8_linears_and_the_start_up_line():
    assert format_spec(Format.mxfp8).compiled_kernels
    config = format_spec(Format.mxfp8).emulated_config(PrecisionConfig(format="mxfp8", kernels="eager"))
    assert config == MXFP8Config(kernels="eager")
    assert describe_kernels(PrecisionConfig(format="mxfp8", kernels="eager"), "emulated", "cpu") == (
        "eager quantizers (precision.kernels=eager)")
    assert describe_kernels(PrecisionConfig(format="mxfp8"), "te", "cuda") == ""  # TE quantizes
    auto = describe_kernels(PrecisionConfig(format="mxfp8", kernels="auto"), "emulated", "cpu")
    assert auto.startswith("compiled" if use_compiled("auto", torch.device("cpu")) else "eager")
