"""The torch.compile'd quantization kernels against the eager ones: the same bits, always.

The eager kernels are checked against the independent per-block reference elsewhere
(tests/nvfp4_recipe/quant_reference.py), so bit equality here carries that over to the compiled path.
Shapes are small; each dtype / rounding variant compiles once per process (a few seconds).
"""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from nvfp4_recipe import NVFP4Config, nvfp4_linear, quantize_nvfp4
from nvfp4_recipe.kernels import Fused, use_compiled
from nvfp4_recipe.nvfp4 import nvfp4_scaled_values
from nvfp4_recipe.policy import PrecisionConfig, validate_precision

needs_compiler = pytest.mark.skipif(not use_compiled("auto", torch.device("cpu")),
                                    reason="no C++ compiler for inductor on this machine")


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ranges = torch.logspace(-4, 3, 64, dtype=torch.float64)[torch.randperm(64, generator=gen)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 6.0, -6.0, 0.0, 1e-30, 3.0, -5.0, 0.5, 4.0])
    return {
        "normal": torch.randn(48, 64, generator=gen).to(dtype),
        "heavy-tailed": (torch.randn(48, 64, generator=gen, dtype=torch.float64) * ranges).to(dtype),
        "zeros": torch.zeros(32, 64, dtype=dtype),
        "ties": (ties.repeat(32, 4) * torch.tensor(2.0) ** torch.arange(32).view(32, 1).sub(16)).to(dtype),
    }


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # Fprop/Dgrad input, Wgrad input
@pytest.mark.parametrize("stochastic", [False, True])
def test_compiled_quantizer_is_bit_identical_to_eager(dtype, stochastic):
    # Output dtypes: bf16 operands (BF16 GEMMs), FP32 ones (BF16 GEMMs computed in FP32).
    for (name, x), out_dtype in itertools.product(_inputs(dtype).items(), (torch.bfloat16, torch.float32)):
        for tile_rows in (1, 16):
            results = []
            for kernels in ("eager", "compiled"):
                gen = torch.Generator().manual_seed(7)
                results.append(nvfp4_scaled_values(x, tile_rows, stochastic, gen, out_dtype, kernels))
            (eager, eager_scale), (compiled, compiled_scale) = results
            int_view = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
            assert torch.equal(eager.view(int_view), compiled.view(int_view)), (name, tile_rows)
            assert torch.equal(eager_scale, compiled_scale)


@needs_compiler
@pytest.mark.parametrize("rht", [True, False])
def test_compiled_linear_forward_and_backward_are_bit_identical_to_eager(rht):
    gen = torch.Generator().manual_seed(1)
    x = _inputs(torch.bfloat16)["heavy-tailed"].repeat(2, 1)[:72]  # 72 tokens: Wgrad pads to 80
    w = torch.randn(48, 64, generator=gen, dtype=torch.bfloat16) / 8
    dy = torch.randn(72, 48, generator=gen, dtype=torch.bfloat16)
    outs = []
    for kernels in ("eager", "compiled"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = nvfp4_linear(xr, wr, None, NVFP4Config(rht=rht, kernels=kernels), torch.Generator().manual_seed(3))
        y.backward(dy)
        outs.append((y, xr.grad, wr.grad))
    for eager, compiled in zip(*outs):
        assert torch.equal(eager.view(torch.int16), compiled.view(torch.int16))  # sign of zero too


def _graph_break(x: torch.Tensor) -> torch.Tensor:
    if x.sum().item() > 0:  # data-dependent Python control flow: fullgraph compilation fails
        return x + 1
    return x - 1


def test_auto_falls_back_to_eager_with_one_warning_and_compiled_raises():
    fused = Fused(_graph_break)
    x = torch.ones(4)
    with pytest.warns(RuntimeWarning, match="precision.kernels=eager"):
        assert torch.equal(fused(False, x), x + 1)
    assert fused.failure is not None
    assert torch.equal(fused(False, -x), -x - 1)  # no second attempt, no second warning
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        fused(True, x)  # strict: compiles (and fails) even after an "auto" fallback
    # A caller's error inside traced code also stops dynamo; it still surfaces, raised by eager.
    with pytest.raises(AttributeError), pytest.warns(RuntimeWarning):
        Fused(_graph_break)(False, "not a tensor")


@pytest.mark.parametrize("kernels", [
    "eager", pytest.param("compiled", marks=needs_compiler)])
def test_rounding_never_makes_negative_zero_values(kernels):
    # -0.0 inputs (common in gradients) and values that round to zero come out as +0 in the GEMM
    # operand with either rounding: stochastic rounding once produced -0 from floor(-0) + ceil(-u).
    x = torch.tensor([[-0.0, 0.0, -1e-30, 1e-30, -0.01, 3.0] + [-0.0] * 10] * 16, dtype=torch.bfloat16)
    for stochastic in (False, True):
        values, _ = nvfp4_scaled_values(x, 1, stochastic, torch.Generator().manual_seed(1),
                                        torch.bfloat16, kernels)
        bits = values.view(torch.int16)
        assert not ((bits == -32768).any()), "a -0.0 (bits 0x8000) in the operand"
        assert (bits[:, [0, 1, 6]] == 0).all()


def test_kernel_modes_are_validated_and_selected(monkeypatch):
    from nvfp4_recipe import kernels

    assert use_compiled("compiled", torch.device("cpu")) and not use_compiled("eager", torch.device("cpu"))
    assert use_compiled("compiled", torch.device("cuda")) and not use_compiled("eager", torch.device("cuda"))
    with pytest.raises(ValueError, match="CPU and CUDA tensors"):
        use_compiled("compiled", torch.device("mps"))
    assert not use_compiled("auto", torch.device("mps"))
    assert use_compiled("auto", torch.device("cpu")) == bool(shutil.which("g++") or shutil.which("c++")
                                                             or shutil.which("clang++"))
    # auto on CUDA follows Triton; the scales stay eager there (Triton's FP32 `/` is approximate)
    for has_triton in (True, False):
        monkeypatch.setattr(kernels, "_triton_available", lambda: has_triton)
        assert use_compiled("auto", torch.device("cuda")) is has_triton
    assert kernels.compiled_scales(torch.device("cpu")) and not kernels.compiled_scales(torch.device("cuda"))
    with pytest.raises(ValueError, match="kernels='fused'"):
        NVFP4Config(kernels="fused")
    with pytest.raises(ValueError, match="precision.kernels='jit'"):
        validate_precision(PrecisionConfig(format="nvfp4", kernels="jit"))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("packed_in_kernel", [False, True])
def test_compiled_codes_of_quantize_nvfp4_are_bit_identical_to_eager(dtype, rounding,
                                                                     packed_in_kernel, monkeypatch):
    """Both compiled code kernels, whichever this CPU's vector width selects (AVX2: codes packed
    in the kernel from element pairs; wider: one code per byte, then packed)."""
    import nvfp4_recipe.kernels as kernels

    monkeypatch.setattr(kernels, "_packs_in_kernel", lambda: packed_in_kernel)
    for name, x in _inputs(dtype).items():
        for tile in ((1, 16), (16, 16)):
            eager, compiled = (quantize_nvfp4(x, tile, rounding, torch.Generator().manual_seed(9), kernels=k)
                               for k in ("eager", "compiled"))
            assert torch.equal(eager.data, compiled.data), (name, tile)
            assert torch.equal(eager.scales.view(torch.uint8), compiled.scales.view(torch.uint8))
            assert torch.equal(eager.amax, compiled.amax)
    # An odd block count (9 blocks, 72 pairs): a partial vector at the end of a flat loop.
    x = (torch.randn(3, 48, generator=torch.Generator().manual_seed(2)) * 7).to(dtype)
    eager, compiled = (quantize_nvfp4(x, (1, 16), rounding, torch.Generator().manual_seed(9), kernels=k)
                       for k in ("eager", "compiled"))
    assert torch.equal(eager.data, compiled.data)


def test_start_up_line_says_which_quantizers_run():
    from nvfp4_recipe.policy import describe_kernels

    nvfp4 = PrecisionConfig(format="nvfp4", kernels="eager")
    assert describe_kernels(nvfp4, "emulated", "cpu") == "eager quantizers (precision.kernels=eager)"
    assert describe_kernels(nvfp4, "te", "cuda") == ""  # TE quantizes on Blackwell
    assert describe_kernels(PrecisionConfig(format="bf16"), "emulated", "cpu") == ""
    auto = describe_kernels(PrecisionConfig(format="nvfp4", kernels="auto"), "emulated", "cpu")
    assert auto.startswith("compiled" if use_compiled("auto", torch.device("cpu")) else "eager")
