"""No host sync and no host-to-device copy per call in the emulated numerics.

On a GPU, `.item()`, `bool(t)`, `.tolist()` of a device tensor wait for the stream, and so does a
host-to-device copy without non_blocking (PyTorch aten/src/ATen/native/cuda/Copy.cu,
`copy_kernel_cuda`: `memcpy_and_sync` unless non_blocking). One per quantization is ~4 per linear
per micro-batch, hundreds per step, and it breaks CUDA-graph capture.

These tests run the quantizers, the emulated linears (forward and backward) and the diagnostics on
tensors of the "meta" device (shapes and dtypes, no data: a device other than the host, no GPU
needed; torch's FakeTensorMode with a fake "cuda" device cannot slice a tensor on a CPU-only build)
under a mode that records every op that would move data between host and device: a copy from a CPU tensor
onto the device or back (`aten._to_copy` / `aten.copy_`; `.tolist()` and `.cpu()` are the latter), a tensor made from host data per call
(`aten.lift_fresh*`, what `torch.tensor(...)` runs), and a read of a device value on the host
(`aten._local_scalar_dense`, what `.item()` / `bool()` / `.tolist()` run; fake tensors refuse it
too, as meta tensors do). The first call per device may build cached constants (E2M1 tables, the RHT matrix); the
second call is the one that must be silent. On the GPU, launch/gpu_check.sh runs the same under
`torch.cuda.set_sync_debug_mode("error")` (tests/nvfp4_recipe/test_cuda_numerics.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nvfp4_recipe import diagnostics, formats, hadamard
from nvfp4_recipe.config import FP8BlockConfig, MXFP4Config, NVFP4Config
from nvfp4_recipe.linear import WeightOperandCache, quantized_linear
from nvfp4_recipe.mxfp4 import quantize_mxfp4
from nvfp4_recipe.nvfp4 import nvfp4_scaled_values, quantize_nvfp4

aten = torch.ops.aten
_COPIES = {aten._to_copy.default, aten.copy_.default}
_FROM_HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


class HostTraffic(TorchDispatchMode):
    """Records the ops that move data between host and device (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self.events.append("host read of a device value (.item / bool / tolist)")
        elif func in _FROM_HOST_DATA:
            self.events.append(f"tensor from host data: {func}")
        elif func in _COPIES:
            src = args[0] if func is aten._to_copy.default else args[1]
            dst = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            if dst is not None and (src.device.type == "cpu") != (torch.device(dst).type == "cpu"):
                way = "host-to-device" if src.device.type == "cpu" else "device-to-host"
                self.events.append(f"{way} copy of a {tuple(src.shape)} {src.dtype} tensor")
        return func(*args, **kwargs)


@pytest.fixture
def device(monkeypatch):
    """The meta device; the per-device constant caches start empty and are restored after."""
    monkeypatch.setattr(formats, "_code_to_value_cache", {})
    monkeypatch.setattr(formats, "_magnitude_code_lut_cache", {})
    monkeypatch.setattr(hadamard, "_matrix_cache", {})
    # The meta device has no generator: the diagnostics' private stream is the default one here
    # (on a GPU it is a CUDA generator, seeded on the host: no sync).
    monkeypatch.setattr(diagnostics, "_private_generator", lambda device: None)
    return torch.device("meta")


def _silent_after_warm_up(fn) -> list[str]:
    fn()  # may fill the per-device caches
    mode = HostTraffic()
    with mode:
        fn()
    return mode.events


def test_the_recorder_sees_what_it_must(device):
    """The check can fail: the pre-fix quantizer scale (a CPU constant moved per call), a
    torch.tensor per call and an .item() are all reported."""
    x = torch.randn(32, 64, device=device)
    constant = torch.tensor(1.0 / 6.0)
    mode = HostTraffic()
    with mode:
        x * constant.to(x.device)
        x * torch.tensor(2.0)
        with pytest.raises(Exception):
            x.sum().item()
    assert mode.events[0] == "host-to-device copy of a () torch.float32 tensor"
    assert any(e.startswith("tensor from host data") for e in mode.events)
    assert mode.events[-1].startswith("host read")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_nvfp4_quantizer_moves_nothing_per_call(device, tile, rounding):
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    assert _silent_after_warm_up(lambda: quantize_nvfp4(x, tile, rounding, kernels="eager")) == []
    assert _silent_after_warm_up(
        lambda: nvfp4_scaled_values(x, tile[0], rounding == "stochastic", kernels="eager")) == []


def test_mxfp4_quantizer_moves_nothing_per_call(device):
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    assert _silent_after_warm_up(lambda: quantize_mxfp4(x, "stochastic")) == []


@pytest.mark.parametrize("config", [NVFP4Config(kernels="eager"), NVFP4Config(kernels="eager", gemm="exact"),
                                    MXFP4Config(), FP8BlockConfig()],
                         ids=["nvfp4", "nvfp4-exact", "mxfp4", "fp8-block"])
def test_emulated_linear_forward_and_backward_move_nothing_per_call(device, config):
    """Fprop, Dgrad and Wgrad (RHT and stochastic rounding included), with and without the
    weight cache."""
    x = torch.randn(4, 32, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    cache = WeightOperandCache()

    def step():
        for weight_cache in (None, cache):
            quantized_linear(x, w, None, config, weight_cache=weight_cache).float().sum().backward()

    assert _silent_after_warm_up(step) == []


def test_diagnostics_read_nothing_on_the_host(device):
    """quantization_error_tensors keeps its statistics on the device (the controller reads a
    step's worth at once); quantization_error_stats reads them with exactly one sync."""
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    for role in ("activation", "weight", "gradient"):
        assert _silent_after_warm_up(
            lambda: diagnostics.quantization_error_tensors(x, NVFP4Config(kernels="eager"), role)) == []
    mode = HostTraffic()
    with mode, pytest.raises(Exception):  # the meta tensor refuses the one read
        diagnostics.quantization_error_stats(x, NVFP4Config(kernels="eager"))
    assert mode.events == ["device-to-host copy of a (3,) torch.float32 tensor"]


def test_the_scale_constant_is_the_fp32_reciprocal_of_6():
    """A Python float holding fp32(1/6) exactly: the products TE forms in FP32 are unchanged."""
    assert isinstance(formats.FP32_RECIPROCAL_OF_6, float)
    as_fp32 = torch.tensor(1.0 / 6.0, dtype=torch.float32)
    assert formats.FP32_RECIPROCAL_OF_6 == as_fp32.item() != 1.0 / 6.0
    s_enc = torch.rand(100_000, dtype=torch.float32) * 1e6
    assert torch.equal(s_enc * formats.FP32_RECIPROCAL_OF_6, s_enc * as_fp32)
