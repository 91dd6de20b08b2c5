"""Fused element kernels of the emulated GEMM operands: torch.compile'd twins of formats.py's.

The eager kernels (formats.py, nvfp4.py) run ~10 in-place elementwise ops per chunk, each one a
pass over memory. Compiled by inductor, the same formulas become one loop per pass: the block amax
reads x once, and scale / clamp / round / rescale reads x (and the uniforms) once and writes the
bf16 operand once. They are bit-identical to the eager kernels (tests/nvfp4_recipe/test_kernels.py on CPU,
tests/nvfp4_recipe/test_cuda_numerics.py on CUDA): the same FP32 values in the same order, no reassociation
(inductor's default C++ flags exclude -fassociative-math; do not set
TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG), every product whose rounding an FMA could change is
exact, no FP32 division (Triton's `/` is approximate: multiplications by exact reciprocals
instead), and the stochastic-rounding bytes are drawn eagerly, once per tensor, by the same call
as the eager kernels'. Under Triton's flush-to-zero a scaled value below FP32's normal range keeps
its value (zero after rounding) but may lose its sign in the packed codes (-0 vs +0); the GEMM
operands do not carry that sign.

Selection (NVFP4Config.kernels / precision.kernels): "eager", "compiled", or "auto" = compiled
where inductor can build kernels: on CPU when a C++ compiler is on PATH, on CUDA when Triton
imports. The first call per variant compiles for a few seconds; inductor caches the result on disk
for later processes.
"""

from __future__ import annotations

import functools
import shutil
import warnings

import torch

from nvfp4_recipe.formats import (
    _EXPONENT_MASK,
    _MAGIC_OFFSET,
    _ONE_BITS,
    _ONE_ULP_EXPONENT,
    _TWO_TO_127_BITS,
    E2M1_MAX,
    SR_HALF,
    SR_SCALE,
    draw_random_bytes,
    pack_codes,
)

KERNEL_MODES = ("auto", "eager", "compiled")


def check_kernel_mode(mode: str, owner: str) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{owner}.kernels={mode!r} is not supported; use one of {', '.join(KERNEL_MODES)}")


@functools.cache
def _cpu_compiler_available() -> bool:
    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


@functools.cache
def _triton_available() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def compiler_available(device_type: str) -> bool:
    """Whether inductor can build kernels for `device_type`: C++ on CPU, Triton on CUDA."""
    if device_type == "cpu":
        return _cpu_compiler_available()
    if device_type == "cuda":
        return _triton_available()
    return False


def use_compiled(mode: str, device: torch.device) -> bool:
    """Whether `mode` selects the compiled kernels for tensors on `device` (a pure decision)."""
    if mode == "compiled":
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"kernels='compiled' runs on CPU and CUDA tensors, got a {device.type} tensor; "
                f"use kernels='auto' (eager there) or 'eager'")
        return True
    return mode == "auto" and compiler_available(device.type)


def compiled_scales(device: torch.device) -> bool:
    """Whether the block-scale computation runs compiled too: on CPU only. It divides
    (1 / (s * S_dec)), and Triton's FP32 division is approximate unless inductor emulates eager
    rounding, a switch whose name changed between torch releases; the (rows, K / 16) scales are
    a sixteenth of the work and stay eager on CUDA."""
    return device.type == "cpu"


# The kernels see flat (blocks, block) tensors, detached (dynamo guards on requires_grad and on a
# view's base), so a call has one dynamic size (the block count) and a new shape does not recompile
# (except block counts 0 and 1, which dynamo specializes; empty tensors stay eager). Nearest and
# stochastic rounding are separate functions so each stays well under dynamo's recompile limit
# (one variant per input dtype and output dtype).
def block_amax_flat(x: torch.Tensor) -> torch.Tensor:
    """(blocks, block) -> FP32 (blocks,) max |x| (max is exact in any dtype)."""
    return x.abs().amax(dim=-1).float()


def _scaled_clamped(x: torch.Tensor, encode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = (x.float() * encode).clamp(-E2M1_MAX, E2M1_MAX)
    exponent = torch.bitwise_and(v.view(torch.int32), _EXPONENT_MASK).clamp(min=_ONE_BITS)
    return v, exponent


def _round_nearest(v: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """formats.round_e2m1_nearest_, functionally."""
    magic = (exponent + _MAGIC_OFFSET).view(torch.float32)
    return (v + magic) - magic


def _round_stochastic(v: torch.Tensor, exponent: torch.Tensor, random_bytes: torch.Tensor) -> torch.Tensor:
    """formats.round_e2m1_stochastic_ (same values, same order) with the given random bytes."""
    step_bits = exponent - _ONE_ULP_EXPONENT
    step = step_bits.view(torch.float32)
    # v / step as v times the exact reciprocal 2**-e (mirrored exponent bits): the same number,
    # and Triton lowers an FP32 `/` to the approximate div.full (torch/_inductor/config.py,
    # eager_numerics), which need not be exact even for a power of two.
    scaled = v * (_TWO_TO_127_BITS - step_bits).view(torch.float32)
    floor = torch.floor(scaled)
    uniform = (random_bytes.float() + SR_HALF) * SR_SCALE  # exact: 9 significant bits
    # abs: a -0 from ceil(0 - u) must not make -0 + -0 (formats.round_e2m1_stochastic_)
    return (floor + torch.ceil((scaled - floor) - uniform).abs()) * step


def _e2m1_codes(rounded: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """formats.e2m1_codes_: grid values -> uint8 codes 0..15 (packed afterwards by one eager pass:
    inductor's stride-2 loads made packing inside the kernel slower).

    The eager path looks the code up in a table indexed by |bits| >> 22; on the 8 grid magnitudes
    that index is 0 (0.0), 252 (0.5) and 254..259 (1, 1.5, 2, 3, 4, 6), i.e. codes 0, 1 and
    index - 252, computed here without a gather (which inductor does not vectorize)."""
    index = torch.bitwise_and(rounded.view(torch.int32), 0x7FFFFFFF) >> 22
    magnitude = torch.where(index >= 254, index - 252, (index > 0).to(torch.int32))
    return (magnitude + negative.to(torch.int32) * 8).to(torch.uint8)


def e2m1_values_nearest(x, encode, decode, out_dtype: torch.dtype) -> torch.Tensor:
    """Nearest-even E2M1 of clamp(x * encode, -6, 6), times decode, in out_dtype."""
    v, exponent = _scaled_clamped(x, encode)
    return (_round_nearest(v, exponent) * decode).to(out_dtype)


def e2m1_values_stochastic(x, encode, decode, random_bytes, out_dtype: torch.dtype) -> torch.Tensor:
    """As e2m1_values_nearest with stochastic rounding."""
    v, exponent = _scaled_clamped(x, encode)
    return (_round_stochastic(v, exponent, random_bytes) * decode).to(out_dtype)


def _e2m1_codes_nearest(x, encode) -> torch.Tensor:
    """Codes of nearest-even E2M1 of clamp(x * encode, -6, 6); the sign from before rounding."""
    v, exponent = _scaled_clamped(x, encode)
    return _e2m1_codes(_round_nearest(v, exponent), v < 0)


def _e2m1_codes_stochastic(x, encode, random_bytes) -> torch.Tensor:
    v, exponent = _scaled_clamped(x, encode)
    return _e2m1_codes(_round_stochastic(v, exponent, random_bytes), v < 0)


# Packed codes in the kernel itself, on AVX2 CPUs (_packs_in_kernel): the kernel reads two adjacent elements as one integer
# (BF16 pairs as int32, FP32 pairs as int64; contiguous loads, where x[:, 0::2] / x[:, 1::2] made
# inductor emit slower strided ones) and writes each byte once, instead of writing one code per
# byte and packing them in another pass. The halves are the elements' exact FP32 values (a BF16's
# bits shifted up 16 are its FP32 bits), so the codes are the same bits.
_PAIR_DTYPES = {torch.bfloat16: torch.int32, torch.float32: torch.int64}


def _pair_halves(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(even, odd) elements of each pair, as FP32 (little-endian: the even one is the low half)."""
    if pairs.dtype == torch.int32:
        even = torch.bitwise_left_shift(pairs, 16).view(torch.float32)
        odd = torch.bitwise_and(pairs, -65536).view(torch.float32)
    else:
        even = torch.bitwise_and(pairs, 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        odd = torch.bitwise_right_shift(pairs, 32).to(torch.int32).view(torch.float32)
    return even, odd


def _pack(even_codes: torch.Tensor, odd_codes: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_or(even_codes, torch.bitwise_left_shift(odd_codes, 4))


@functools.cache
def _packs_in_kernel() -> bool:
    """Whether the codes are packed in the kernel here: where inductor's CPU vectors hold 8 FP32
    lanes (AVX2). It vectorizes the innermost dim in whole vectors only: a block's 8 pairs fill
    AVX2's 8 lanes, while the one-code-per-byte kernel's 16 values per block fill AVX-512's 16.
    Measured 4096^2 BF16 (the whole quantize_nvfp4, medians of 11 interleaved, 2026-12-03, an
    Intel Xeon, load ~3): AVX2 (ATEN_CPU_CAPABILITY=avx2) 38 ms packed vs 69 ms per byte + pack;
    AVX-512 the per-byte kernel + pack 28 ms, packed (flat, to fill 16 lanes) 31 ms, packed as
    (blocks, 8) ran scalar."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return bool(isa) and isa.nelements(torch.float32) <= 8


def _packed_codes_nearest(pairs, encode) -> torch.Tensor:
    """_e2m1_codes_nearest of both elements of each pair, packed (even in the low nibble)."""
    even, odd = _pair_halves(pairs)
    return _pack(_e2m1_codes_nearest(even, encode), _e2m1_codes_nearest(odd, encode))


def _packed_codes_stochastic(pairs, encode, byte_pairs) -> torch.Tensor:
    """As _packed_codes_nearest, stochastically rounded: `byte_pairs` holds each pair's two
    random bytes as one int16 (the even element's in the low byte), the bytes the eager kernel
    gives those elements."""
    even, odd = _pair_halves(pairs)
    even_bytes = torch.bitwise_and(byte_pairs.to(torch.int32), 0xFF)
    odd_bytes = torch.bitwise_and(torch.bitwise_right_shift(byte_pairs.to(torch.int32), 8), 0xFF)
    return _pack(_e2m1_codes_stochastic(even, encode, even_bytes),
                 _e2m1_codes_stochastic(odd, encode, odd_bytes))


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compilation raises (dynamo/inductor errors, incl. a C++ toolchain failure,
    and the recompile limit under fullgraph); anything else (an OOM, a bad argument) is the
    caller's error. Looked up on the first compiled call: importing dynamo costs ~1.5 s, which a
    process that never runs these kernels (a refused start, a BF16 tool) should not pay."""
    return (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit,
            torch._inductor.exc.CppCompileError)


class Fused:
    """A kernel function and its torch.compile'd form. If compiling fails (no working C++
    toolchain, an unsupported platform, the recompile limit), "auto" warns once and from then on
    runs the function eagerly, which computes the same bits; "compiled" (strict) always compiles
    and raises."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.failure: Exception | None = None

    @functools.cached_property
    def compiled(self):  # made on first use (see _compile_errors)
        return torch.compile(self.fn, dynamic=True, fullgraph=True)

    def __call__(self, strict: bool, *args):
        if strict or self.failure is None:
            try:
                with torch.no_grad():  # one grad mode for every caller: dynamo guards on it
                    return self.compiled(*args)
            except _compile_errors() as error:
                if strict:
                    raise
                self.failure = error
                warnings.warn(
                    f"nvfp4_recipe: compiling the fused quantization kernels failed ({error!r:.200}); "
                    f"running them eagerly. Set precision.kernels=eager to silence this.",
                    RuntimeWarning, stacklevel=3)
        return self.fn(*args)


_BLOCK_AMAX = Fused(block_amax_flat)
_VALUES_NEAREST = Fused(e2m1_values_nearest)
_VALUES_STOCHASTIC = Fused(e2m1_values_stochastic)
_CODES_NEAREST = Fused(_e2m1_codes_nearest)
_CODES_STOCHASTIC = Fused(_e2m1_codes_stochastic)
_PACKED_NEAREST = Fused(_packed_codes_nearest)
_PACKED_STOCHASTIC = Fused(_packed_codes_stochastic)


def block_amax(x2d: torch.Tensor, block: int, strict: bool = False) -> torch.Tensor:
    """FP32 (rows, K // block) max |x| of each block along the last dim of contiguous x2d."""
    rows, k = x2d.shape
    return _BLOCK_AMAX(strict, x2d.view(-1, block).detach()).view(rows, k // block)


def _flat_blocks(x2d: torch.Tensor, block: int, *per_block: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x2d as detached (blocks, block), and each per-block tensor as detached (blocks, 1)."""
    return (x2d.view(-1, block).detach(), *(t.reshape(-1, 1).detach() for t in per_block))


def draw_bytes_like(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One random byte per element of `like`, the bytes the eager kernel draws (same call)."""
    return draw_random_bytes(like.numel(), like.device, generator).view(like.shape)


def encode_values(
    x2d: torch.Tensor,
    block: int,
    encode: torch.Tensor,
    decode: torch.Tensor,
    stochastic: bool,
    generator: torch.Generator | None,
    values_dtype: torch.dtype,
    strict: bool = False,
) -> torch.Tensor:
    """The values output of formats.encode_e2m1_blocks ((rows, K) in values_dtype), fused."""
    x, encode, decode = _flat_blocks(x2d, block, encode, decode)
    if stochastic:
        values = _VALUES_STOCHASTIC(strict, x, encode, decode, draw_bytes_like(x, generator), values_dtype)
    else:
        values = _VALUES_NEAREST(strict, x, encode, decode, values_dtype)
    return values.view(x2d.shape)


def encode_codes(
    x2d: torch.Tensor,
    block: int,
    encode: torch.Tensor,
    stochastic: bool,
    generator: torch.Generator | None,
    strict: bool = False,
) -> torch.Tensor:
    """The packed-codes output of formats.encode_e2m1_blocks ((rows, K // 2) uint8), fused."""
    x, encode = _flat_blocks(x2d, block, encode)
    rows, k = x2d.shape
    pair_dtype = _PAIR_DTYPES.get(x.dtype)
    if pair_dtype is not None and x.is_cpu and _packs_in_kernel():  # see _PAIR_DTYPES
        pairs = x.view(pair_dtype)
        if stochastic:
            byte_pairs = draw_bytes_like(x, generator).view(torch.int16)
            packed = _PACKED_STOCHASTIC(strict, pairs, encode, byte_pairs)
        else:
            packed = _PACKED_NEAREST(strict, pairs, encode)
        return packed.view(rows, k // 2)
    if stochastic:
        codes = _CODES_STOCHASTIC(strict, x, encode, draw_bytes_like(x, generator))
    else:
        codes = _CODES_NEAREST(strict, x, encode)
    return pack_codes(codes.view(rows, k), torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device))
