"""The step profile's part timer (benchmarks/part_timer.py):
hooks installed for a profile only, none left in the numerics outside it."""

from __future__ import annotations

import pytest
import torch

import model.mamba_mixer
import nvfp4_recipe.compute
import nvfp4_recipe.formats
import nvfp4_recipe.kernels
import nvfp4_recipe.linear
import nvfp4_recipe.operands
from benchmarks import part_timer
from benchmarks.part_timer import Part, PartTimer, step_parts
from nvfp4_recipe import NVFP4Config, quantized_linear
from nvfp4_recipe.compute import FP32Gemms

# Where the step calls each timed function from: the binding the wrapper must replace.
CALL_SITES = [
    (nvfp4_recipe.operands, "transpose_padded"),
    (nvfp4_recipe.formats, "draw_random_bytes"),
    (nvfp4_recipe.kernels, "draw_random_bytes"),  # imported by name: the fused kernels' draws
    (nvfp4_recipe.linear, "emulated_gemm"),
    (model.mamba_mixer, "ssd_chunk_scan"),
    (nvfp4_recipe.compute, "_gemm_in_fp32"),
    (nvfp4_recipe.operands._NVFP4Ops, "activation"),
    (nvfp4_recipe.operands._FP8BlockOps, "grad_wgrad"),
]


def test_innermost_part_owns_the_time_and_nothing_is_counted_twice(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(part_timer.time, "perf_counter", lambda: clock[0])

    def spend(seconds):
        clock[0] += seconds

    timer = PartTimer(parts=[])
    with timer.region("outer"):
        spend(2.0)
        with timer.region("inner"):
            spend(3.0)
        with timer.region("inner"):
            spend(1.0)
        spend(0.5)
    seconds, calls = timer.take()
    assert calls == {"outer": 1, "inner": 2}
    assert seconds == {"outer": 2.5, "inner": 4.0}  # the outer's own time only
    assert timer.take() == ({}, {})


def test_the_hooks_exist_only_inside_the_profile():
    """Outside a PartTimer the step calls the numerics' own functions: nothing to pay."""
    originals = [vars(owner)[name] for owner, name in CALL_SITES]
    with PartTimer() as timer:
        for (owner, name), original in zip(CALL_SITES, originals):
            wrapped = vars(owner)[name]
            assert wrapped is not original and wrapped.__wrapped__ is original, (owner, name)
        with pytest.raises(RuntimeError, match="already wrapped"):
            PartTimer().__enter__()
        assert timer.take() == ({}, {})
    for (owner, name), original in zip(CALL_SITES, originals):
        assert vars(owner)[name] is original, (owner, name)
    assert not hasattr(nvfp4_recipe.operands._NVFP4Ops.activation, "__wrapped__")


def test_a_missing_function_is_refused_and_nothing_stays_wrapped():
    original = nvfp4_recipe.linear.emulated_gemm
    parts = [Part("nvfp4_recipe.linear", "emulated_gemm", "gemm"),
             Part("nvfp4_recipe.operands._NVFP4Ops", "no_such_role", "quantize")]
    with pytest.raises(AttributeError, match="no_such_role"):
        PartTimer(parts).__enter__()
    assert nvfp4_recipe.linear.emulated_gemm is original


def test_the_emulated_linear_parts_forward_and_backward():
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    with PartTimer() as timer:
        quantized_linear(x, w, None, NVFP4Config()).float().sum().backward()
    seconds, calls = timer.take()
    # Three GEMMs (Fprop, Dgrad, Wgrad); six operands (W and x; dY and W for Dgrad, where W's
    # 16x16 tiles reuse Fprop's copy; dY^T and x^T for Wgrad); SR draws for dY twice (Dgrad,
    # Wgrad); two Wgrad transposes with the RHT.
    assert calls == {"emulation/quantize": 6, "emulation/gemm": 3,
                     "emulation/sr_draws": 2, "emulation/wgrad_transpose_rht": 2}
    assert all(s > 0 for s in seconds.values())


def test_bf16_gemms_in_fp32_split_into_the_gemm_and_its_conversions():
    a = torch.randn(64, 32, dtype=torch.bfloat16)
    b = torch.randn(32, 16, dtype=torch.bfloat16)
    with PartTimer() as timer, FP32Gemms():
        out = a @ b
    _, calls = timer.take()
    assert out.dtype == torch.bfloat16
    # One GEMM; its operands raised to FP32 once and its output rounded back once.
    assert calls == {"gemm/fp32 on bf16 values": 1, "gemm/bf16<->fp32 conversions": 2}


def test_every_part_of_the_step_profile_names_a_function_it_can_wrap():
    labels = {part.label for part in step_parts()}
    assert labels == {"emulation/quantize", "emulation/gemm", "emulation/wgrad_transpose_rht",
                      "emulation/sr_draws", "emulation/underflow telemetry", "mamba/ssd_scan",
                      "gemm/fp32 on bf16 values", "gemm/bf16<->fp32 conversions"}
    with PartTimer():
        pass  # __enter__ resolves and wraps every part, or raises
