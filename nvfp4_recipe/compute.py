"""What a BF16 GEMM computes in: the GEMM compute policy and the mode that applies it.

Where BF16 GEMMs are native (CUDA, x86 with AVX512-BF16 or AMX, Arm with BF16) they run as they
are. Elsewhere torch's CPU BF16 GEMM falls back to a generic kernel that is 7-20x slower than its
FP32 GEMM (a Zen 3 CPU: `F.linear` 1024x256 x 256x1024 in 82 ms vs 12 ms). There `FP32Gemms`
multiplies the same BF16 values in FP32 and rounds the result to BF16 once: what a GPU's BF16 GEMM
does (FP32 accumulation, one rounding of the output). The result differs from a CPU BF16 kernel's
only by the order of the FP32 accumulation; parameters, activations and gradients stay BF16.

`FP32Gemms` is a dispatch-level mode (torch's `TorchDispatchMode`): it sits below autograd, so it
sees the forward's GEMMs and those autograd runs for the backward alike, and every caller
(megatron's linears and output layer, attention, the Mamba mixer's matmuls, einsums and conv1d, the
emulated low-precision GEMMs) is covered without touching a call site. Everything else passes
through unchanged.

The machine is decided here, once per process (`cpu_bf16_gemms_native`, a cached probe that
model/device.py's `Hardware` reads too), so the library's own emulated GEMMs need no caller to
enter a mode: `emulated_gemms_in_fp32(device)` is what nvfp4_recipe/operands.py asks. It follows
the run where the run has decided (`GemmCompute.context()`, either way), and the machine
elsewhere (`nvfp4_linear` called directly): FP32 GEMMs on the exact dequantized values where BF16
is not native. Those values are exact in FP32, and the GEMM's output is rounded to BF16 as a BF16
GEMM's would be, so only the order of the FP32 accumulation differs.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

aten = torch.ops.aten
GEMM_COMPUTE = ("auto", "bf16", "fp32")

# The GEMM-like ops a BF16 model reaches on CPU, and which of their outputs are BF16 (rounded back
# after the FP32 call). SDPA's CPU flash kernel also returns an FP32 logsumexp, kept as it is.
_BF16_OUTPUTS = {
    aten.mm.default: (0,),
    aten.addmm.default: (0,),
    aten.bmm.default: (0,),
    aten.baddbmm.default: (0,),
    aten.mv.default: (0,),
    aten.addmv.default: (0,),
    aten.dot.default: (0,),
    aten.addbmm.default: (0,),
    aten._addmm_activation.default: (0,),
    aten.convolution.default: (0,),
    aten.convolution_backward.default: (0, 1, 2),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2),
}
GEMM_OPS = frozenset(_BF16_OUTPUTS)


def _up(value):
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_up(v) for v in value)
    return value


def _gemm_in_fp32(func, args, kwargs):
    """A BF16 GEMM-like op on the same values in FP32, its BF16 outputs rounded back once."""
    args, kwargs = _up_all(args, kwargs)
    return _down(func, func(*args, **kwargs))


def _up_all(args, kwargs):
    return _up(args), _up(kwargs)


def _down(func, out):
    """The FP32 call's BF16 outputs (_BF16_OUTPUTS) rounded back to BF16."""
    if isinstance(out, torch.Tensor):
        return out.to(torch.bfloat16)
    rounded = _BF16_OUTPUTS[func]
    return type(out)(o.to(torch.bfloat16) if i in rounded and o is not None else o
                     for i, o in enumerate(out))


def _takes_bf16(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 and not a.is_cuda
               for a in args)


class FP32Gemms(TorchDispatchMode):
    """BF16 GEMMs on CPU computed in FP32, their outputs rounded to BF16 once (see the module
    docstring). `counts` tallies the GEMMs seen, by the dtype they computed in, for profiles."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd regions (the emulation's quantizer kernels: elementwise, no GEMM) compile
        # and run without the mode (torch >= 2.9); otherwise dynamo refuses to trace under it.
        return True

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {"fp32": 0, "bf16->fp32": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in GEMM_OPS:
            return func(*args, **kwargs)
        if not _takes_bf16(args):
            self.counts["fp32"] += 1
            return func(*args, **kwargs)
        self.counts["bf16->fp32"] += 1
        return _gemm_in_fp32(func, args, kwargs)


def fp32_gemms_active() -> bool:
    """Whether BF16 GEMMs compute in FP32 here (an `FP32Gemms` mode is active on this thread)."""
    return any(isinstance(mode, FP32Gemms) for mode in _get_current_dispatch_mode_stack())


def bf16_gemms_native(onednn_bf16: bool, x86: bool, bf16_instructions: bool) -> bool:
    """Whether a CPU's BF16 GEMMs are native (pure): oneDNN must take them (`onednn_bf16`:
    `torch.ops.mkldnn._is_mkldnn_bf16_supported()`, which follows ONEDNN_MAX_CPU_ISA), and on x86
    the CPU must have BF16 instructions (AVX512-BF16 or AMX-BF16). oneDNN also takes BF16 on
    AVX-512 without them, emulating the BF16 dot products: measured on an Intel Xeon with
    AVX-512 but no avx512_bf16 (2026-12-03), `F.linear` 1024x256 x 256x1024 took 9.2 ms in BF16
    against 1.6 ms in FP32. On Arm oneDNN's own check already asks for the BF16 extension."""
    return onednn_bf16 and (bf16_instructions or not x86)


@functools.cache
def cpu_bf16_gemms_native() -> bool:
    """This CPU's `bf16_gemms_native`, probed once per process (model/device.py reads it too)."""
    onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    instructions = x86 and bool(torch.cpu._is_avx512_bf16_supported()
                                or torch.cpu._is_amx_tile_supported())
    return bf16_gemms_native(onednn, x86, instructions)


# The run's decision while a GemmCompute.context() is entered on this thread (None: none is).
_decided = threading.local()


def emulated_gemms_in_fp32(device: torch.device) -> bool:
    """Whether the emulated GEMMs on `device` multiply in FP32 (their operands written in FP32)
    instead of BF16: as the run decided (GemmCompute.context(), or an FP32Gemms mode), else as
    the machine decides: on a CPU without native BF16 GEMMs."""
    if fp32_gemms_active():
        return True
    decided = getattr(_decided, "dtype", None)
    if decided is not None:
        return decided == torch.float32
    return device.type == "cpu" and not cpu_bf16_gemms_native()


@contextlib.contextmanager
def _deciding(dtype: torch.dtype):
    previous = getattr(_decided, "dtype", None)
    _decided.dtype = dtype
    try:
        yield
    finally:
        _decided.dtype = previous


def tf32_matmuls() -> bool:
    """Whether FP32 matmuls on CUDA may run as TF32 (10-bit mantissa) in this process.

    torch's default is IEEE FP32 (`torch.backends.cuda.matmul.fp32_precision` "none"/"ieee",
    legacy `allow_tf32` False) and this project never changes it, so the emulation's FP32 GEMMs
    (the 16-point RHT of the Wgrad operands, `gemm="exact"`, the "fast" output scaling) are
    exact there. A user who turns TF32 on (`torch.set_float32_matmul_precision("high")`, either
    flag) would round their inputs to TF32; the start-up line says so. The flag is read, never
    set: torch >= 2.9 raises at every FP32 cuBLAS call once the legacy and the new TF32 APIs
    disagree, so toggling it around our GEMMs could break a user's settings. (Triton's `tl.dot`,
    e.g. mamba_ssm's SSD scan, uses TF32 regardless: model/ssd_check.py.)"""
    try:
        new = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # torch >= 2.9
        if new in ("tf32",):
            return True
        if new in ("ieee",):
            return False
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # the two APIs disagree: torch itself will refuse FP32 matmuls
        return True


@dataclass(frozen=True)
class GemmCompute:
    """What BF16 GEMMs compute in for a run, and why (the start-up line says both)."""

    dtype: torch.dtype  # torch.bfloat16: as they are; torch.float32: FP32Gemms
    reason: str
    tf32: bool = False  # a CUDA run whose FP32 matmuls may run as TF32 (tf32_matmuls)

    def context(self):
        """The context a forward and backward run in: `FP32Gemms`, or BF16 GEMMs as they are
        (a forced `bf16` on a CPU without BF16 instructions: the emulation's GEMMs too)."""
        if self.dtype == torch.float32:
            return FP32Gemms()
        return _deciding(self.dtype)

    def describe(self) -> str:
        if self.dtype == torch.float32:
            return f"GEMMs: FP32 on BF16 values: {self.reason}"
        line = f"GEMMs: BF16: {self.reason}"
        if self.tf32:
            line += ("; WARNING: TF32 matmuls are on, so the emulation's FP32 GEMMs (RHT, "
                     "gemm=exact) round their inputs to TF32; torch's default is off")
        return line


def gemm_compute(requested: str, device_type: str, bf16_native: bool, isa: str,
                 tf32: bool = False) -> GemmCompute:
    """The GEMM compute policy (pure): `requested` is the config's `auto | bf16 | fp32`;
    `device_type` the run's device; `bf16_native` whether this device multiplies BF16 natively;
    `isa` names its instruction set for the reason (e.g. "AVX2", "compute capability 9.0");
    `tf32`: FP32 matmuls on this CUDA device may run as TF32 (tf32_matmuls())."""
    if requested not in GEMM_COMPUTE:
        raise ValueError(f"precision.gemm_compute={requested!r}: choose auto, bf16 or fp32")
    if device_type != "cpu":
        if requested == "fp32":
            raise ValueError(f"precision.gemm_compute=fp32 applies to CPU runs; this run is on "
                             f"{device_type} ({isa}), whose BF16 GEMMs accumulate in FP32 already")
        return GemmCompute(torch.bfloat16, f"{device_type} ({isa})", tf32=tf32)
    if requested == "bf16":
        native = "native" if bf16_native else "no BF16 instructions, slow generic kernel"
        return GemmCompute(torch.bfloat16, f"precision.gemm_compute=bf16 ({isa}: {native})")
    if requested == "fp32":
        return GemmCompute(torch.float32, f"precision.gemm_compute=fp32 ({isa})")
    if bf16_native:
        return GemmCompute(torch.bfloat16, f"this CPU multiplies BF16 natively ({isa})")
    return GemmCompute(torch.float32, f"this CPU has no BF16 instructions ({isa})")
