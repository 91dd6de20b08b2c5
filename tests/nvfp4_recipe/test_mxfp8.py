"""quantize_mxfp8 against an independent reference written from Transformer Engine's source
(release_v2.19), compared bit for bit: E4M3 data bytes and E8M0 scale bytes.

The reference (`ref_mxfp8_lines`) walks one 32-value block at a time in plain Python with numpy
float32 scalars (IEEE round-to-nearest, subnormals kept, as TE's non-fast-math kernels):
  amax     fmaxf over |x|, NaN ignored       cast/mxfp8/quantize_mxfp8.cuh:255-259, 408-412
  exponent float_to_e8m0(amax * fp32(1/448)) util/ptx.cuh:390-421, utils.cuh:1044;
           also TE's CPU test reference, tests/cpp/test_common.h:480-500
  inverse  exp2f_rcp(exponent)               util/ptx.cuh:356-365, tests/cpp/test_common.h:502-513
  element  fp32(x * inverse), then cvt.rn.satfinite.e4m3 (util/ptx.cuh:1023-1025): here an
           explicit nearest-even E4M3 encoder with saturation to +-448 and the sign kept.
None of it calls nvfp4_recipe or torch's float8 casts. The comparisons run on both quantizer paths
(`kernels`: eager PyTorch ops, and the torch.compile'd kernel where inductor can build one);
tests/nvfp4_recipe/test_mxfp8_kernels.py checks the two paths against each other on more inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nvfp4_recipe
from nvfp4_recipe import MXFP8Tensor, quantize_mxfp8
from nvfp4_recipe.kernels import use_compiled
from nvfp4_recipe.mxfp8 import mxfp8_dequantized_values, quantize_mxfp8_along

F32 = np.float32
RCP_448 = F32(1.0) / F32(448.0)  # TE: static_cast<float>(1.0 / 448.0); the double quotient rounds the same
E4M3_NAN = 0x7F


def f32_bits(v: np.float32) -> int:
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0])


def f32_from_bits(b: int) -> np.float32:
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def ref_float_to_e8m0(val: np.float32) -> int:
    """TE util/ptx.cuh:390-421 (non-Blackwell branch) line by line."""
    if math.isnan(val):
        return 0xFF
    if math.isinf(val):
        return 0xFE
    if val == 0:
        return 0x00
    bits = f32_bits(val)
    exponent = (bits >> 23) & 0xFF  # e8m0_t is a byte: the (zero) sign bit falls off
    mantissa = bits & 0x7FFFFF
    if (mantissa > 0 and exponent != 0xFE) and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def ref_exp2f_rcp(biased: int) -> np.float32:
    """TE util/ptx.cuh:356-365."""
    if biased == 255:
        return f32_from_bits(0x7FFFFFFF)
    if biased == 254:
        return f32_from_bits(0x00400000)
    return f32_from_bits((254 - biased) << 23)


def ref_e4m3_byte(v: np.float32) -> int:
    """FP8 E4M3 (OCP, 'fn': no Inf, S.1111.111 NaN) of an FP32 value: round to nearest, ties to even,
    satfinite (anything beyond 448, Inf included, becomes +-448), sign of zero kept."""
    sign = 0x80 if math.copysign(1.0, float(v)) < 0 else 0
    a = abs(float(v))
    if math.isnan(a):
        return E4M3_NAN | sign  # the sign of a NaN is not compared (see the NaN test)
    if a >= 448.0:
        return sign | 0x7E
    if a == 0.0:
        return sign
    _, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    unbiased = max(e - 1, -6)  # below 2**-6 the subnormals share 2**-6's step
    step = 2.0 ** (unbiased - 3)
    q = round(a / step)  # exact quotient (power-of-two step); Python's round is ties-to-even
    value = q * step
    if value == 0.0:
        return sign
    if value < 2.0**-6:
        return sign | int(value / 2.0**-9)  # exponent field 0, mantissa in units of 2**-9
    _, e = math.frexp(value)  # recomputed: rounding may have carried into the next binade
    mantissa = int((value / 2.0 ** (e - 1) - 1.0) * 8)
    return sign | ((e - 1 + 7) << 3) | mantissa


def ref_mxfp8_lines(lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference MXFP8 of float32 `lines` (n, k) with 32-value blocks along each line: (data bytes
    (n, k), scale bytes (n, k // 32))."""
    n, k = lines.shape
    data = np.zeros((n, k), dtype=np.uint8)
    scales = np.zeros((n, k // 32), dtype=np.uint8)
    for i in range(n):
        for j in range(k // 32):
            block = [F32(v) for v in lines[i, 32 * j:32 * (j + 1)]]
            amax = F32(0.0)
            for v in block:
                if not math.isnan(v):  # fmaxf(amax, NaN) is amax
                    amax = max(amax, F32(abs(v)))
            biased = ref_float_to_e8m0(F32(amax * RCP_448))
            scales[i, j] = biased
            inverse = ref_exp2f_rcp(biased)
            for t, v in enumerate(block):
                data[i, 32 * j + t] = ref_e4m3_byte(F32(v * inverse))
    return data, scales


def bytes_of(t: MXFP8Tensor) -> tuple[np.ndarray, np.ndarray]:
    return t.data.view(torch.uint8).cpu().numpy(), t.scales.view(torch.uint8).cpu().numpy()


# Both quantizer paths; the compiled one where inductor can build kernels (a C++ compiler on PATH).
KERNELS = ["eager", pytest.param("compiled", marks=pytest.mark.skipif(
    not use_compiled("auto", torch.device("cpu")), reason="no C++ compiler for inductor here"))]


def assert_matches_reference(x: torch.Tensor, kernels: str = "eager") -> MXFP8Tensor:
    q = quantize_mxfp8(x, kernels=kernels)
    data, scales = bytes_of(q)
    ref_data, ref_scales = ref_mxfp8_lines(x.reshape(-1, x.shape[-1]).float().numpy())
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(data, ref_data)
    return q


def _random_inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(38)
    heavy = torch.randn(16, 256, generator=gen) * torch.logspace(-6, 6, 256, dtype=torch.float64).float()
    return {
        "normal": torch.randn(16, 128, generator=gen),
        "heavy_tailed": heavy,
        "large": torch.randn(8, 128, generator=gen) * 1e36,  # scales near the top of E8M0
        "small": torch.randn(8, 128, generator=gen) * 1e-30,
        # amax * (1/448) an FP32 subnormal: the exponent-0 branch of float_to_e8m0
        "subnormal_region": torch.randn(8, 128, generator=gen) * 1e-38,
        "fp32_subnormal_inputs": torch.randn(8, 128, generator=gen) * 1e-42,
        "bf16": (torch.randn(8, 128, generator=gen) * 3).bfloat16(),
        "fp16": (torch.randn(8, 128, generator=gen) * 3).half(),
        "float64": torch.randn(8, 128, generator=gen, dtype=torch.float64) * 7,
        "3d": torch.randn(2, 3, 64, generator=gen),
    }


@pytest.mark.parametrize("name", list(_random_inputs()))
@pytest.mark.parametrize("kernels", KERNELS)
def test_random_tensors_bit_exact(name, kernels):
    x = _random_inputs()[name]
    q = assert_matches_reference(x, kernels)
    rows = x.numel() // x.shape[-1]
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (rows, x.shape[-1])
    assert q.scales.dtype == torch.float8_e8m0fnu and q.scales.shape == (rows, x.shape[-1] // 32)
    assert q.shape == x.shape


def _powers_of_two_times_448() -> torch.Tensor:
    """One block per k: amax exactly 448 * 2**k, one FP32 ulp above it, one below; the rest of the
    block random below the amax."""
    gen = torch.Generator().manual_seed(7)
    ks = list(range(-134, -120)) + list(range(-30, 31)) + list(range(110, 120))
    rows = []
    for k in ks:
        exact = F32(448.0 * 2.0**k)
        for amax in (exact, np.nextafter(exact, F32(np.inf)), np.nextafter(exact, F32(0))):
            row = (torch.rand(32, generator=gen) * 2 - 1) * float(amax) * 0.9
            row[int(torch.randint(0, 32, (1,), generator=gen))] = -float(amax) if k % 2 else float(amax)
            rows.append(row)
    return torch.stack(rows).float(), ks


@pytest.mark.parametrize("kernels", KERNELS)
def test_amax_at_powers_of_two_times_448(kernels):
    x, ks = _powers_of_two_times_448()
    q = assert_matches_reference(x, kernels)
    scales = q.scales.view(torch.uint8).view(-1, 3).long()
    for (exact, above, below), k in zip(scales.tolist(), ks):
        if k >= -127:  # 2**k is an E8M0 scale: exact, no rounding up (448 * fp32(1/448) rounds to 1)
            assert exact == 127 + k, k
            assert below == 127 + k, k
            if k > -127:
                # One FP32 ulp above rounds up a whole power: TE's choice (torchao's RCEIL keeps 2**k)
                assert above == 128 + k, k
            else:
                # The product is the subnormal 2**-127, whose ulp (2**-149) is 2**-22 relative: one
                # ulp more amax still rounds to exactly 2**-127, mantissa 0x400000 -> code 0
                assert above == 0, k
        else:  # below E8M0's range: everything lands on 2**-127
            assert exact == above == below == 0, k
    # The amax element of a block scaled by exactly 2**k encodes as 448 (0x7E, or 0xFE negative)
    data = q.data.view(torch.uint8).view(-1, 3, 32)
    normal = torch.tensor([k >= -127 for k in ks])
    assert bool(((data[normal, 0] & 0x7F) == 0x7E).any(dim=-1).all())


@pytest.mark.parametrize("kernels", KERNELS)
def test_zero_blocks_and_negative_zero(kernels):
    x = torch.zeros(4, 96)
    x[1] = -0.0
    x[2, :32] = -0.0
    x[2, 32:64] = torch.linspace(-1, 1, 32)
    x[2, 40] = -0.0
    x[3, :32] = torch.tensor([-1e-30] * 31 + [448.0])  # negative values that round to -0
    q = assert_matches_reference(x, kernels)
    data, scales = bytes_of(q)
    assert (scales[:2] == 0).all() and scales[2, 0] == 0 and scales[3, 1:].tolist() == [0, 0]
    assert (data[0] == 0).all() and (data[1] == 0x80).all()  # +-0 keep their sign
    assert data[2, 40] == 0x80 and (data[3, :31] == 0x80).all()
    # +-0 dequantize to themselves, sign bit included
    assert torch.equal(q.dequantize()[:2].view(torch.int32), x[:2].view(torch.int32))


@pytest.mark.parametrize("kernels", KERNELS)
def test_round_to_nearest_even_ties(kernels):
    # Scale 2**0 (amax 448): E4M3 steps are 2**-3 in [1, 2) and 2**-9 below 2**-6.
    values = [448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 2.0**-11, 0.99 * 2.0**-10]
    x = torch.tensor(values + [0.0] * (32 - len(values))).view(1, 32)
    data, scales = bytes_of(assert_matches_reference(x, kernels))
    assert scales[0, 0] == 127
    # 1.0625 -> 1.0 (even), 1.1875 -> 1.25, 2**-10 -> 0 (tie, even), 3 * 2**-10 -> 2 * 2**-9,
    # 2**-11 -> 0, just below 2**-10 -> 0
    assert data[0, :8].tolist() == [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x00, 0x00]


@pytest.mark.parametrize("kernels", KERNELS)
def test_infinities_saturate(kernels):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    x[0, 5] = float("inf")
    x[1, 40] = float("-inf")
    data, scales = bytes_of(assert_matches_reference(x, kernels))
    # Inf amax -> 254 (satfinite), inverse 2**-127; Inf * 2**-127 = Inf -> +-448, the rest -> +-0
    assert scales[0, 0] == 254 and scales[1, 1] == 254
    assert data[0, 5] == 0x7E and data[1, 40] == 0xFE
    assert set((data[0, :32] & 0x7F).tolist()) <= {0, 0x7E}
    assert scales[0, 1] == ref_float_to_e8m0(F32(x[0, 32:].abs().max().item()) * RCP_448)


@pytest.mark.parametrize("kernels", KERNELS)
def test_nan_elements_do_not_enter_the_amax(kernels):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=gen)
    x[0, 3] = float("nan")
    x[1, 32:] = float("nan")  # a block of only NaNs: amax 0 -> scale 2**-127
    x[2, 0] = -float("nan")
    q = quantize_mxfp8(x, kernels=kernels)
    data, scales = bytes_of(q)
    ref_data, ref_scales = ref_mxfp8_lines(x.numpy())
    np.testing.assert_array_equal(scales, ref_scales)
    assert scales[1, 1] == 0
    assert scales[0, 0] == ref_float_to_e8m0(F32(np.nanmax(np.abs(x[0, :32].numpy()))) * RCP_448)
    nan = torch.isnan(x).numpy()
    # NaN's sign bit after cvt.rn.satfinite is not stated in TE's source: compare NaN-ness only
    assert ((data[nan] & 0x7F) == E4M3_NAN).all()
    np.testing.assert_array_equal(data[~nan], ref_data[~nan])


@pytest.mark.parametrize("kernels", KERNELS)
def test_subnormal_product_boundary(kernels):
    """amax * fp32(1/448) at the FP32 subnormal 2**-127 (mantissa 0x400000) stays at E8M0 code 0;
    the next subnormal above it rounds up to code 1 (ptx.cuh:417)."""
    found = {}
    amax = F32(448.0 * 2.0**-127)
    for step in range(-40, 40):
        candidate = amax
        for _ in range(abs(step)):
            candidate = np.nextafter(candidate, F32(np.inf) if step > 0 else F32(0))
        found.setdefault(f32_bits(F32(candidate * RCP_448)), candidate)
    assert 0x400000 in found and 0x400001 in found  # the search hit both sides of the boundary
    x = torch.zeros(2, 32)
    x[0, 0] = float(found[0x400000])
    x[1, 0] = float(found[0x400001])
    _, scales = bytes_of(assert_matches_reference(x, kernels))
    assert scales[:, 0].tolist() == [0, 1]


def test_dequantize_error_bound():
    """E4M3 keeps 4 significant bits: round to nearest errs by at most 2**-4 relative in the normal
    range; below 2**-6 (scaled) the step is 2**-9, so at most 2**-10 * scale absolute."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 3, 256).float()
    q = quantize_mxfp8(x)
    scale = q.scales.float().repeat_interleave(32, dim=1)
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    err = (q.dequantize() - x).abs()
    assert bool((err <= bound).all())
    assert float(err.max()) > 0  # the bound is exercised, not trivially met
    assert bool((q.dequantize().abs().amax(dim=-1) <= x.abs().amax(dim=-1) * (1 + 2.0**-4)).all())


def test_dequantized_values_match_dequantize():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(48, 160, generator=gen) * 10
    q = quantize_mxfp8(x)
    assert torch.equal(mxfp8_dequantized_values(x, torch.float32), q.dequantize())
    assert torch.equal(mxfp8_dequantized_values(x, torch.bfloat16), q.dequantize(torch.bfloat16))
    # exact in bfloat16 at these scales: the FP32 and BF16 values coincide
    assert torch.equal(mxfp8_dequantized_values(x, torch.bfloat16).float(), q.dequantize())


@pytest.mark.parametrize("shape", [(4, 48), (3, 33), (8, 16)])
def test_refuses_k_not_multiple_of_32(shape):
    with pytest.raises(ValueError, match=f"last dimension is {shape[-1]}"):
        quantize_mxfp8(torch.randn(shape))


def test_columnwise_blocks_run_down_the_columns():
    """quantize_mxfp8_along(x, 0): 32-value blocks down each column (Dgrad's W, Wgrad's dY and x),
    checked against the reference fed with explicit columns, not with a transposed tensor."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-2, 2, 64).float().unsqueeze(1)
    columns = np.stack([x[:, j].numpy() for j in range(x.shape[1])])
    ref_data, ref_scales = ref_mxfp8_lines(columns)
    col = quantize_mxfp8_along(x, 0)
    assert col.data.shape == (96, 64) and col.scales.shape == (96, 2)
    data, scales = bytes_of(col)
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(data, ref_data)
    # rowwise is quantize_mxfp8 itself; the two copies differ in their blocking
    row = quantize_mxfp8_along(x, 1)
    assert torch.equal(row.data.view(torch.uint8), quantize_mxfp8(x).data.view(torch.uint8))
    assert torch.equal(col.dequantize().t(), quantize_mxfp8(x.t().contiguous()).dequantize().t())
    assert not torch.equal(col.dequantize().t(), row.dequantize())
    with pytest.raises(ValueError, match="last dimension is 40"):
        quantize_mxfp8_along(torch.randn(40, 64), 0)
    with pytest.raises(ValueError, match="2-D"):
        quantize_mxfp8_along(torch.randn(2, 32, 32), 0)


def test_check_finite_refuses_non_finite():
    x = torch.randn(2, 32)
    x[1, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp8(x, check_finite=True)


def test_public_api():
    assert nvfp4_recipe.quantize_mxfp8 is quantize_mxfp8
    assert nvfp4_recipe.MXFP8Tensor is MXFP8Tensor
    assert {"quantize_mxfp8", "MXFP8Tensor"} <= set(nvfp4_recipe.__all__)


def test_reference_against_hand_values():
    """The reference's own pieces against values worked out by hand, so that an error shared by the
    reference and the module cannot pass unseen."""
    assert ref_float_to_e8m0(F32(1.0)) == 127
    assert ref_float_to_e8m0(F32(1.5)) == 128
    assert ref_float_to_e8m0(F32(2.0**127 * 1.5)) == 254  # saturates instead of 255
    assert ref_float_to_e8m0(f32_from_bits(0x400000)) == 0 and ref_float_to_e8m0(f32_from_bits(0x400001)) == 1
    assert ref_exp2f_rcp(127) == 1.0 and ref_exp2f_rcp(0) == F32(2.0**127) and ref_exp2f_rcp(254) == F32(2.0**-127)
    assert [ref_e4m3_byte(F32(v)) for v in (448.0, 449.0, 1e9, -1.0, 2.0**-6, 2.0**-9, 0.875 * 2.0**-6, 1.75)] == [
        0x7E, 0x7E, 0x7E, 0xB8, 0x08, 0x01, 0x07, 0x3E]
    assert f32_bits(F32(F32(448.0) * RCP_448)) == f32_bits(F32(1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")
def test_cuda_matches_cpu_bits():
    inputs = _random_inputs()
    x, _ = _powers_of_two_times_448()
    inputs["powers"] = x
    for name, t in inputs.items():
        # kernels="compiled" on CUDA runs the eager ops (mxfp8.py, "Kernels": no Triton kernel)
        cpu, gpu = quantize_mxfp8(t, kernels="compiled"), quantize_mxfp8(t.cuda(), kernels="compiled")
        assert torch.equal(cpu.scales.view(torch.uint8), gpu.scales.view(torch.uint8).cpu()), name
        assert torch.equal(cpu.data.view(torch.uint8), gpu.data.view(torch.uint8).cpu()), name


def ref_mxfp8_values(lines: np.ndarray) -> np.ndarray:
    """The reference's dequantized values (float64: exact) of `lines`, blocks along each line."""
    data, scales = ref_mxfp8_lines(lines.astype(np.float32))
    values = torch.from_numpy(data).view(torch.float8_e4m3fn).double().numpy()
    scale = np.exp2(scales.astype(np.float64) - 127)
    return values * np.repeat(scale, 32, axis=1)


def test_each_gemm_reads_the_copy_blocked_along_its_reduction_dimension():
    """The emulated MXFP8 linear, per GEMM and per operand, against the reference: x and W blocked
    along K (Fprop), dY and W^T along N (Dgrad), dY^T and x^T along T with T zero-padded to 32
    (Wgrad); each copy from the high-precision tensor, as TE's rowwise and columnwise copies.
    gemm=exact multiplies in FP32: the reference multiplies the same exact values in float64, so
    only FP32's accumulation differs, by at most (terms * 2**-24) * sum |a_i b_i| per element."""
    from nvfp4_recipe import quantized_linear
    from nvfp4_recipe.config import MXFP8Config

    gen = torch.Generator().manual_seed(5)
    tokens, k, n = 40, 96, 64  # 40 tokens: Wgrad pads T to 64
    # W's odd columns 2**-24 times its even ones, beyond E4M3's range (2**-9 .. 448): a block along
    # K flushes them, a block along N keeps them, so Dgrad from the wrong copy is far off (checked
    # at the end). x spans five decades along K.
    x = (torch.randn(tokens, k, generator=gen) * torch.logspace(-3, 2, k)).requires_grad_()
    odd_small = torch.where(torch.arange(k) % 2 == 0, 1.0, 2.0**-24)
    w = (torch.randn(n, k, generator=gen) * odd_small).requires_grad_()
    dy = torch.randn(tokens, n, generator=gen) * 1e-3
    y = quantized_linear(x, w, None, MXFP8Config(gemm="exact"))
    y.backward(dy)

    xs, ws, dys = (t.detach().double().numpy() for t in (x, w, dy))

    def padded_t(a):  # (T, C) -> (C, 64): Wgrad's operands, T zero-padded
        return np.concatenate([a.T, np.zeros((a.shape[1], 64 - tokens))], axis=1)

    operands = {
        "fprop": (ref_mxfp8_values(xs), ref_mxfp8_values(ws)),
        "dgrad": (ref_mxfp8_values(dys), ref_mxfp8_values(ws.T)),
        "wgrad": (ref_mxfp8_values(padded_t(dys)), ref_mxfp8_values(padded_t(xs))),
    }
    got = {"fprop": y.detach(), "dgrad": x.grad, "wgrad": w.grad}
    for gemm, (a, b) in operands.items():
        bound = a.shape[1] * 2.0**-24 * (np.abs(a) @ np.abs(b).T) + 1e-45
        error = np.abs(got[gemm].double().numpy() - a @ b.T)
        assert (error <= bound).all(), (gemm, (error / bound).max())
    # Dgrad from Fprop's copy of W (blocks along K, transposed) is another result: the test can fail.
    wrong = ref_mxfp8_values(dys) @ ref_mxfp8_values(ws)
    a, b = operands["dgrad"]
    bound = a.shape[1] * 2.0**-24 * (np.abs(a) @ np.abs(b).T)
    assert (np.abs(x.grad.double().numpy() - wrong) > 100 * bound).any()
