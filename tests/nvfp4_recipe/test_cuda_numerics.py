"""The nvfp4_recipe emulation on CUDA tensors gives the same bits as on CPU.

Quantizers (NVFP4 1x16 / 16x16 nearest, MXFP4, FP8 block) must agree bit for bit: codes, scales and
amax. Stochastic rounding draws from a device-specific RNG, so CPU and CUDA draws are not
comparable: on CUDA we check SR's own properties (only the two grid neighbours, unbiased on
average, reproducible with a seeded CUDA generator). The emulated linear's quantized GEMM operands
must be identical; its output may differ only by FP32 summation order. mamba_ssm's Triton SSD scan
agrees with the PyTorch scan the mixer falls back to (model/ssd_check.py: tolerances and why).
Skipped without CUDA (the whole module); run on a GPU machine by launch/gpu_check.sh (the SSD
tests there as their own part, `python -m model.ssd_check`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)"),
]

from model import ssd_check  # noqa: E402
from nvfp4_recipe import NVFP4Config, nvfp4_linear, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4  # noqa: E402
from nvfp4_recipe.hadamard import random_hadamard_transform  # noqa: E402
from nvfp4_recipe.nvfp4 import nvfp4_scaled_values  # noqa: E402

CUDA = torch.device("cuda")
SHAPES = [(16, 16), (48, 64), (256, 1024), (1000, 160), (4096 + 16, 512)]  # last: several chunks


def _inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1]).roll(seed)
    x[0, :16] = 0.0  # an all-zero block
    if shape[0] > 2:
        x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # E2M1 ties
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (works for float8 and NaN-free floats)."""
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_nvfp4_nearest_bit_exact(shape, dtype, tile):
    if tile == (16, 16) and shape[0] % 16:
        pytest.skip("16x16 tiles need rows % 16 == 0")
    x = _inputs(shape, dtype)
    cpu, gpu = quantize_nvfp4(x, tile=tile), quantize_nvfp4(x.to(CUDA), tile=tile)
    assert gpu.data.is_cuda and gpu.scales.is_cuda
    assert _same(cpu.data, gpu.data), f"codes differ in {int((cpu.data != gpu.data.cpu()).sum())} bytes"
    assert _same(cpu.scales, gpu.scales)
    assert _same(cpu.amax, gpu.amax)
    assert torch.equal(cpu.dequantize(), gpu.dequantize().cpu())


def test_nvfp4_scaled_values_bit_exact():
    x = _inputs((512, 256), torch.bfloat16, seed=3)
    for tile_rows in (1, 16):
        for dtype in (torch.bfloat16, torch.float32):
            v_cpu, s_cpu = nvfp4_scaled_values(x, tile_rows, dtype=dtype)
            v_gpu, s_gpu = nvfp4_scaled_values(x.to(CUDA), tile_rows, dtype=dtype)
            assert _same(v_cpu, v_gpu) and _same(s_cpu, s_gpu)


def test_nvfp4_stochastic_rounding_on_cuda():
    """SR on CUDA: only the two E2M1 neighbours, unbiased, reproducible with a seeded generator."""
    x = (torch.rand(256, 1024) * 2 - 1).to(CUDA)
    x[:, 0] = 1.0  # fix each row's block scale: the first column holds the block max
    nearest = quantize_nvfp4(x, tile=(1, 16)).dequantize()
    draws = []
    for seed in range(32):
        gen = torch.Generator(device=CUDA).manual_seed(seed)
        draws.append(quantize_nvfp4(x, rounding="stochastic", generator=gen).dequantize())
    stack = torch.stack(draws)
    # Neighbours: every draw is within one grid step of x (grid step <= 2 x the largest error of
    # nearest rounding for that element's block).
    step_bound = 2 * (nearest - x).abs().amax(dim=-1, keepdim=True) + 1e-6
    assert ((stack - x).abs() <= step_bound).all()
    # Unbiased: the mean of 32 draws is far closer to x than nearest rounding's systematic error.
    bias = (stack.mean(0) - x).mean().abs().item()
    assert bias < 1e-3, bias
    assert (stack.mean(0) - x).abs().mean() < (nearest - x).abs().mean()
    # Reproducible on the device with the same seed; different seeds differ.
    again = quantize_nvfp4(x, rounding="stochastic",
                           generator=torch.Generator(device=CUDA).manual_seed(0)).dequantize()
    assert torch.equal(again, draws[0]) and not torch.equal(draws[0], draws[1])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_compiled_quantizers_are_bit_identical_to_eager_on_cuda(rounding):
    """kernels=auto compiles the quantizers with Triton on CUDA: the same bits as the eager
    kernels, the GEMM operands (values) and the packed codes, with the same seeded generator (both
    paths draw the stochastic-rounding bytes once per tensor, by the same call)."""
    from nvfp4_recipe.kernels import use_compiled

    assert use_compiled("auto", CUDA), "Triton is not importable: kernels=auto stays eager on CUDA"
    stochastic = rounding == "stochastic"
    for shape in ((48, 64), (1000, 160), (4096 + 16, 512)):
        for dtype in (torch.bfloat16, torch.float32):
            x = _inputs(shape, dtype, seed=5).to(CUDA)
            for tile_rows in (1, 16):
                if shape[0] % tile_rows:
                    continue
                values = [nvfp4_scaled_values(x, tile_rows, stochastic,
                                              torch.Generator(device=CUDA).manual_seed(1),
                                              torch.bfloat16, kernels)
                          for kernels in ("eager", "compiled")]
                assert torch.equal(values[0][0].view(torch.int16), values[1][0].view(torch.int16)), \
                    (shape, dtype, tile_rows)
                assert torch.equal(values[0][1], values[1][1])
                codes = [quantize_nvfp4(x, (tile_rows, 16), rounding,
                                        torch.Generator(device=CUDA).manual_seed(2), kernels=kernels)
                         for kernels in ("eager", "compiled")]
                assert torch.equal(codes[0].data, codes[1].data)
                assert torch.equal(codes[0].scales.view(torch.uint8), codes[1].scales.view(torch.uint8))


@pytest.mark.parametrize("shape", [(64, 64), (300, 1024), (4096, 256)])
def test_mxfp4_bit_exact(shape):
    x = _inputs(shape, torch.bfloat16, seed=1)
    cpu, gpu = quantize_mxfp4(x), quantize_mxfp4(x.to(CUDA))
    assert _same(cpu.data, gpu.data) and _same(cpu.scales, gpu.scales)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("power_2_scales", [True, False])
def test_fp8_block_bit_exact(block, power_2_scales):
    x = _inputs((256, 512), torch.float32, seed=2)
    cpu = quantize_fp8_block(x, block, power_2_scales)
    gpu = quantize_fp8_block(x.to(CUDA), block, power_2_scales)
    assert _same(cpu.data, gpu.data) and _same(cpu.scale_inv, gpu.scale_inv)


def test_rht_matches_cpu():
    """16-point RHT: a 16-term FP32 dot product, so CUDA may round a sum differently (tiny)."""
    x = _inputs((64, 512), torch.float32, seed=4)
    cpu, gpu = random_hadamard_transform(x), random_hadamard_transform(x.to(CUDA))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=2e-6, atol=1e-6)


def test_fp32_gemms_are_ieee_unless_tf32_is_turned_on():
    """The RHT is an FP32 mm. Under torch's default (TF32 off, which this project never changes:
    nvfp4_recipe/compute.tf32_matmuls) it is exact to CPU; with TF32 turned on it would round x to
    10 mantissa bits, and the start-up line warns. The TF32 half documents
    where it may reach: it is expected to differ from the CPU beyond FP32 rounding."""
    from nvfp4_recipe.compute import tf32_matmuls

    x = _inputs((64, 512), torch.float32, seed=5)
    assert not tf32_matmuls(), "TF32 matmuls are on in this process: the emulated RHT is not exact"
    cpu = random_hadamard_transform(x)
    torch.testing.assert_close(random_hadamard_transform(x.to(CUDA)).cpu(), cpu, rtol=2e-6, atol=1e-6)
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert tf32_matmuls()
        tf32 = random_hadamard_transform(x.to(CUDA)).cpu()
    finally:
        matmul.fp32_precision = previous
    rel = ((tf32 - cpu).norm() / cpu.norm()).item()
    assert rel > 1e-5, f"TF32 did not change the RHT (rel {rel:.1e}): cuBLAS ignored the flag?"


def test_emulated_linear_never_synchronizes():
    """A sync per call stalls the stream and breaks CUDA-graph capture: Fprop, Dgrad and Wgrad
    of the emulated NVFP4 linear (compiled and eager quantizers, RHT, stochastic rounding, the
    weight cache) under set_sync_debug_mode("error"),
    which raises at any synchronizing call (a blocking host-to-device copy, .item(), ...)."""
    from nvfp4_recipe.linear import WeightOperandCache, quantized_linear

    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(4, 256, 512, device=CUDA, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(384, 512, device=CUDA, generator=gen).bfloat16().requires_grad_()
    for kernels in ("eager", "auto"):
        config, cache = NVFP4Config(kernels=kernels), WeightOperandCache()
        for _ in range(2):  # the first call builds the per-device constants and compiles
            quantized_linear(x, w, None, config, weight_cache=cache).float().sum().backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for weight_cache in (None, cache):
                quantized_linear(x, w, None, config, weight_cache=weight_cache).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("gemm", ["exact", "fast"])
def test_nvfp4_linear_forward_matches_cpu(gemm):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, 512, generator=gen).to(torch.bfloat16)
    w = (torch.randn(384, 512, generator=gen) / 512 ** 0.5).to(torch.bfloat16)
    b = torch.randn(384, generator=gen).to(torch.bfloat16)
    cfg = NVFP4Config(gemm=gemm)
    with torch.no_grad():
        cpu = nvfp4_linear(x, w, b, cfg).float()
        gpu = nvfp4_linear(x.to(CUDA), w.to(CUDA), b.to(CUDA), cfg).float().cpu()
    if gemm == "exact":
        # Same exact operands, FP32 accumulation on both: only the summation order differs; the
        # output is then rounded to bf16, so allow one bf16 ulp.
        torch.testing.assert_close(gpu, cpu, rtol=2 ** -7, atol=1e-5)
        assert (gpu != cpu).float().mean() < 0.02
    else:
        torch.testing.assert_close(gpu, cpu, rtol=2 ** -6, atol=1e-4)


def test_nvfp4_linear_backward_close_without_sr():
    """Backward with RHT on and SR off (SR draws are device-specific): gradients agree up to
    summation order and the rare RHT-ulp flip of a rounding tie."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(256, 256, generator=gen).to(torch.bfloat16)
    w = (torch.randn(128, 256, generator=gen) / 16).to(torch.bfloat16)
    dy = torch.randn(256, 128, generator=gen).to(torch.bfloat16)
    cfg = NVFP4Config(gemm="exact", stochastic_rounding=False)
    grads = []
    for dev in ("cpu", CUDA):
        xd, wd = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        nvfp4_linear(xd, wd, None, cfg).backward(dy.to(dev))
        grads.append((xd.grad.float().cpu(), wd.grad.float().cpu()))
    for cpu_g, gpu_g in zip(*grads):
        rel = (cpu_g - gpu_g).norm() / cpu_g.norm()
        assert rel < 1e-2, rel


def test_sr_with_cpu_generator_on_cuda_tensor_is_rejected_clearly():
    """A CPU generator cannot drive CUDA draws; torch raises (documents the requirement)."""
    x = torch.randn(32, 64, device=CUDA)
    with pytest.raises(RuntimeError):
        quantize_nvfp4(x, rounding="stochastic", generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case,dtype", [(c, d) for c in ssd_check.CASES for d in c.dtypes],
                         ids=lambda v: getattr(v, "name", str(v).replace("torch.", "")))
def test_triton_ssd_matches_pytorch_scan(case, dtype, record_property):
    """mamba_chunk_scan_combined, called as the mixer calls it, gives the PyTorch scan's y and
    gradients (each within the dtype's relative-L2 tolerance of a float64 run)."""
    fn, how = ssd_check.load_triton_ssd()
    if fn is None:
        pytest.skip(how)
    r = ssd_check.compare(fn, case, dtype)
    record_property("how", how)
    for name, err in r["errors"].items():
        record_property(f"rel_l2_{name}", f"triton {err['triton']:.2e}, pytorch {err['pytorch']:.2e}")
    tol = r["tolerance"]
    beyond = {k: f"{e['triton']:.2e}" for k, e in r["errors"].items() if not e["triton"] <= tol}
    assert not beyond, f"Triton SSD beyond {tol:.0e} (relative L2 vs float64): {beyond}"
    # the fallback itself stays within the same bound (it is what the mixer runs without mamba_ssm)
    assert all(e["pytorch"] <= tol for e in r["errors"].values()), r["errors"]
