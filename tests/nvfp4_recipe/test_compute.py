"""The GEMM compute policy (nvfp4_recipe/compute.py): which dtype BF16 GEMMs compute in, and the
FP32Gemms mode that computes them in FP32 where a CPU has no BF16 instructions.

The reference for every op is written independently: the same BF16 values in float64, rounded
once to BF16. A GPU's (or oneDNN's) BF16 GEMM accumulates in FP32 and rounds its output once; so
does FP32Gemms, so it may differ from the float64 reference only by FP32 accumulation error,
which rounds to at most one BF16 ulp at these sizes (K <= 256: the FP32 error is ~K * 2^-24
relative, far below a BF16 ulp's 2^-8, so only an output within that distance of a BF16 rounding
boundary can round the other way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nvfp4_recipe.compute import FP32Gemms, GemmCompute, fp32_gemms_active, gemm_compute

BF16 = torch.bfloat16


def bf16_ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in units of the BF16 ulp of |ref| (2^(exponent - 7))."""
    ref64 = ref.double()
    ulp = torch.exp2(torch.floor(torch.log2(ref64.abs().clamp_min(1e-30))) - 7)
    return ((got.double() - ref64).abs() / ulp).max().item()


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


# -- the policy --------------------------------------------------------------------------------

@pytest.mark.parametrize("requested,device,native,dtype,says", [
    ("auto", "cpu", True, BF16, "this CPU multiplies BF16 natively (AVX512)"),
    ("auto", "cpu", False, torch.float32, "this CPU has no BF16 instructions (AVX2)"),
    ("bf16", "cpu", False, BF16, "precision.gemm_compute=bf16"),
    ("fp32", "cpu", True, torch.float32, "precision.gemm_compute=fp32"),
    ("auto", "cuda", True, BF16, "cuda"),
    ("bf16", "cuda", True, BF16, "cuda"),
])
def test_policy(requested, device, native, dtype, says):
    isa = "AVX2" if not native else ("AVX512" if device == "cpu" else "compute capability 9.0")
    choice = gemm_compute(requested, device, native, isa)
    assert choice.dtype == dtype
    assert says in choice.reason
    assert choice.describe().startswith("GEMMs: FP32 on BF16 values" if dtype == torch.float32
                                        else "GEMMs: BF16")


def test_policy_refuses_fp32_on_a_gpu_and_unknown_values():
    with pytest.raises(ValueError, match="precision.gemm_compute=fp32 applies to CPU runs"):
        gemm_compute("fp32", "cuda", True, "compute capability 10.0")
    with pytest.raises(ValueError, match="precision.gemm_compute='fp16'"):
        gemm_compute("fp16", "cpu", True, "AVX512")


def test_the_bf16_policy_enters_no_mode():
    with GemmCompute(BF16, "native").context():
        assert not fp32_gemms_active()
    with GemmCompute(torch.float32, "AVX2").context():
        assert fp32_gemms_active()
    assert not fp32_gemms_active()


# -- the mode: each GEMM op, forward and backward -----------------------------------------------

def _grads(fn, *inputs):
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    weight = rand(*out.shape, seed=99)
    (out.float() * weight.float()).sum().backward()
    return out, [t.grad for t in inputs]


CASES = {
    "linear (addmm, mm)": (lambda x, w, b: F.linear(x, w, b),
                           lambda x, w, b: x @ w.T + b, [(64, 96), (48, 96), (48,)]),
    "matmul 3-D (bmm)": (torch.matmul, torch.matmul, [(4, 32, 64), (4, 64, 40)]),
    "einsum (bmm)": (lambda a, b: torch.einsum("bhtd,bhsd->bhts", a, b),
                     lambda a, b: torch.einsum("bhtd,bhsd->bhts", a, b),
                     [(2, 3, 16, 32), (2, 3, 24, 32)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b), lambda c, a, b: c + a @ b,
                [(3, 8, 12), (3, 8, 16), (3, 16, 12)]),
    "depthwise conv1d (Mamba)": (
        lambda x, w: F.conv1d(x, w, groups=x.shape[1], padding=3)[..., :x.shape[-1]],
        lambda x, w: F.conv1d(x, w, groups=x.shape[1], padding=3)[..., :x.shape[-1]],
        [(2, 64, 50), (64, 1, 4)]),
    "SDPA, causal, grouped heads": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        lambda q, k, v: F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True),
        [(2, 4, 32, 16), (2, 2, 32, 16), (2, 2, 32, 16)]),
}


@pytest.mark.parametrize("name", CASES)
def test_fp32_gemms_match_a_float64_reference_within_one_bf16_ulp(name):
    fn, reference, shapes = CASES[name]
    inputs = [rand(*s, seed=i) for i, s in enumerate(shapes)]
    mode = FP32Gemms()
    with mode:
        out, grads = _grads(fn, *inputs)
    # what a BF16 model sees: BF16 outputs and BF16 gradients, through autograd
    assert out.dtype == BF16 and all(g.dtype == BF16 for g in grads)
    assert mode.counts["bf16->fp32"] >= 2  # forward and backward went through FP32
    ref_out, ref_grads = _grads(reference, *[t.double() for t in inputs])
    if name.startswith("SDPA"):
        # Attention is two GEMMs around a softmax, and its backward reads the BF16-rounded output
        # (as every BF16 attention kernel's does): normwise, within 2 BF16 ulps of the largest
        # value (2 * 2^-8 relative).
        for got, ref in zip([out, *grads], [ref_out, *ref_grads]):
            assert (got.double() - ref).abs().max() <= 2 * 2**-8 * ref.abs().max(), name
        return
    # One GEMM, one rounding of its output; a gradient through it, one more of its own.
    for got, ref in zip([out, *grads], [ref_out, *ref_grads]):
        assert bf16_ulps(got, ref) <= 1.0, name


def test_fp32_gemms_round_like_a_bf16_gemm_with_fp32_accumulation():
    """The definition, bit for bit: FP32 product of the BF16 values, rounded once to BF16."""
    a, b = rand(128, 256), rand(256, 64, seed=1)
    with FP32Gemms():
        got = a @ b
    assert torch.equal(got, (a.float() @ b.float()).to(BF16))


def test_cpu_bf16_kernels_differ_only_in_accumulation_order():
    """torch's own BF16 kernel (oneDNN where native, a generic one elsewhere) also accumulates in
    FP32 and rounds once: the two agree to one BF16 ulp, and mostly exactly."""
    a, b = rand(256, 256), rand(256, 256, seed=1)
    native = a @ b
    with FP32Gemms():
        emulated = a @ b
    assert bf16_ulps(emulated, native.double()) <= 1.0
    assert (emulated == native).float().mean() > 0.95


def test_fp32_and_integer_gemms_pass_through_unchanged():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    i, j = torch.randint(-5, 5, (4, 4)), torch.randint(-5, 5, (4, 4))
    mode = FP32Gemms()
    with mode:
        assert torch.equal(a @ b, torch.mm(a, b))
        assert torch.equal(i @ j, torch.mm(i, j))
        y = torch.randn(3, 3, dtype=BF16) + 1  # elementwise BF16: untouched
    assert y.dtype == BF16
    assert mode.counts["bf16->fp32"] == 0


def test_the_mode_reaches_autograd_functions_backward():
    """megatron's linears are autograd Functions whose backward calls matmul itself: the mode is
    thread state the autograd engine carries, so their backward GEMMs run in FP32 too."""

    class MatmulFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x.matmul(w.t())

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g.matmul(w), g.t().matmul(x)

    x, w = rand(16, 32).requires_grad_(), rand(8, 32, seed=1).requires_grad_()
    mode = FP32Gemms()
    with mode:
        MatmulFn.apply(x, w).float().sum().backward()
    assert mode.counts["bf16->fp32"] == 3
    assert x.grad.dtype == w.grad.dtype == BF16


# -- the emulated low-precision GEMMs under the policy -----------------------------------------

@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_emulated_fast_gemms_compute_the_same_numbers_in_fp32(fmt):
    """precision.gemm=fast multiplies exact q*s values and rounds the GEMM's output to BF16. Under
    FP32Gemms the emulation writes those values in FP32 itself (no BF16 operand for the mode to
    convert) and rounds the output the same way: forward, Dgrad and Wgrad agree with the BF16
    path to one BF16 ulp (the same FP32 sums in another order; here they are mostly exact)."""
    from nvfp4_recipe.linear import quantized_linear
    from nvfp4_recipe.policy import PrecisionConfig
    from nvfp4_recipe.registry import gemm_config_for

    config = gemm_config_for(fmt, PrecisionConfig(name=fmt, format=fmt))
    x, w = rand(64, 256), rand(128, 256, seed=1)

    def run(mode):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with mode:
            y = quantized_linear(xs, ws, None, config, torch.Generator().manual_seed(3))
            (y.float() * rand(64, 128, seed=2).float()).sum().backward()
        return y.detach(), xs.grad, ws.grad

    bf16 = run(GemmCompute(BF16, "native").context())
    mode = FP32Gemms()
    fp32 = run(mode)
    assert mode.counts["bf16->fp32"] == 0 and mode.counts["fp32"] >= 3
    for got, ref in zip(fp32, bf16):
        assert got.dtype == ref.dtype == BF16
        assert bf16_ulps(got, ref.double()) <= 1.0


def test_tf32_is_read_from_torch_and_named_on_the_start_up_line():
    """The emulation's FP32 GEMMs (RHT, gemm=exact) are IEEE FP32 under torch's
    default; a user who turns TF32 on is told. The flag is only read (compute.tf32_matmuls)."""
    from nvfp4_recipe.compute import tf32_matmuls

    matmul = torch.backends.cuda.matmul
    assert tf32_matmuls() is False  # torch's default, which nothing in the project changes
    try:
        matmul.fp32_precision = "tf32"
        assert tf32_matmuls() is True
    finally:
        matmul.fp32_precision = "none"
    assert tf32_matmuls() is False
    on = gemm_compute("auto", "cuda", True, "compute capability 9.0", tf32=True)
    assert "TF32 matmuls are on" in on.describe() and on.dtype == BF16
    assert "TF32" not in gemm_compute("auto", "cuda", True, "compute capability 9.0").describe()


# -- the machine decision, and the emulation deciding without a caller's mode ----------------------

@pytest.mark.parametrize("onednn,x86,instructions,native", [
    (True, True, True, True),     # AMD Zen 4, Intel Sapphire Rapids: AVX512-BF16 / AMX
    (True, True, False, False),   # AVX-512 without BF16 instructions: oneDNN emulates BF16
    (False, True, False, False),  # AVX2 (Zen 2/3), or ONEDNN_MAX_CPU_ISA=AVX2
    (True, False, False, True),   # Arm with BF16: oneDNN's check asks for the extension itself
    (False, False, False, False),  # Arm without it (Apple M1)
])
def test_which_cpus_multiply_bf16_natively(onednn, x86, instructions, native):
    from nvfp4_recipe.compute import bf16_gemms_native

    assert bf16_gemms_native(onednn, x86, instructions) is native


def test_the_machine_is_probed_once_and_the_run_reads_the_same_value():
    from model.device import probe_hardware
    from nvfp4_recipe.compute import cpu_bf16_gemms_native

    assert cpu_bf16_gemms_native() is cpu_bf16_gemms_native()
    assert cpu_bf16_gemms_native.cache_info().currsize == 1
    assert probe_hardware("cpu").bf16_gemms_native == cpu_bf16_gemms_native()


@pytest.mark.parametrize("native", [True, False])
def test_the_emulation_decides_its_gemm_dtype_without_a_mode(monkeypatch, native):
    """A library user calls nvfp4_linear with no mode: its operands are FP32 where this CPU has
    no native BF16 GEMMs, BF16 where it has; a run's decision (GemmCompute.context()) wins either
    way, and a CUDA device never follows the CPU's answer."""
    import nvfp4_recipe.compute as compute
    from nvfp4_recipe.config import NVFP4Config
    from nvfp4_recipe.linear import ops_for

    monkeypatch.setattr(compute, "cpu_bf16_gemms_native", lambda: native)
    cpu = torch.device("cpu")
    expected = BF16 if native else torch.float32
    assert ops_for(NVFP4Config(), cpu).gemm_dtype == expected
    assert ops_for(NVFP4Config(gemm="exact"), cpu).gemm_dtype == torch.float32
    assert ops_for(NVFP4Config(), torch.device("cuda")).gemm_dtype == BF16
    with GemmCompute(BF16, "forced").context():
        assert ops_for(NVFP4Config(), cpu).gemm_dtype == BF16
    with GemmCompute(torch.float32, "forced").context():
        assert ops_for(NVFP4Config(), cpu).gemm_dtype == torch.float32
    assert ops_for(NVFP4Config(), cpu).gemm_dtype == expected  # the decision does not leak


@pytest.mark.parametrize("quantize", [(True, True), (False, True), (True, False)])
def test_a_direct_call_without_native_bf16_computes_what_fp32gemms_computes(monkeypatch, quantize):
    """Outside any mode on a CPU without native BF16 GEMMs, quantized_linear (its quantized and
    unquantized GEMMs alike) returns what it returns under FP32Gemms, bit for bit, and runs no
    BF16 GEMM (a mode that only watches the GEMMs' operand dtypes sees none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import nvfp4_recipe.compute as compute
    from nvfp4_recipe.compute import GEMM_OPS
    from nvfp4_recipe.config import NVFP4Config, PassConfigs
    from nvfp4_recipe.linear import quantized_linear

    class GemmDtypes(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:  # the compiled quantizers: no GEMM there
            return True

        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in GEMM_OPS:
                self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
            return func(*args, **(kwargs or {}))

    nvfp4 = NVFP4Config()
    config = PassConfigs(*(nvfp4 if q else None for q in (quantize[0], quantize[1], quantize[1])))
    x, w, b = rand(64, 256), rand(128, 256, seed=1), rand(128, seed=4)
    dy = rand(64, 128, seed=2)

    def run(mode):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        with mode:
            y = quantized_linear(xs, ws, bs, config, torch.Generator().manual_seed(3))
            y.backward(dy)
        return y.detach(), xs.grad, ws.grad, bs.grad

    monkeypatch.setattr(compute, "cpu_bf16_gemms_native", lambda: False)
    watch = GemmDtypes()
    direct = run(watch)
    assert watch.seen == {torch.float32}
    reference = run(FP32Gemms())
    for got, ref in zip(direct, reference):
        assert got.dtype == ref.dtype == BF16
        assert torch.equal(got, ref)
