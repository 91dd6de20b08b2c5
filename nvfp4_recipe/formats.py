"""Element and scale formats shared by the quantizers: FP4 E2M1, FP8 E4M3, E8M0, and input checks.

The E2M1 rounding kernels here work in place on float32 tensors that are already scaled and clamped
to [-6, 6]; the quantizers (nvfp4.py, mxfp4.py) call them on chunks of up to CHUNK_ELEMENTS.
"""

from __future__ import annotations

from typing import Iterator

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max
# fp32(1/6): TE multiplies by the FP32 reciprocal of 6 instead of dividing (notes, step 4). A
# Python float holding that FP32 value exactly, never a tensor: a CPU tensor constant would be
# copied to the GPU at every quantization, and a host-to-device copy without non_blocking waits for
# the stream (PyTorch aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda -> memcpy_and_sync). An
# FP32 tensor times it is the FP32 product either way: torch converts the scalar to the tensor's
# FP32 opmath type, and a backend computing in double would get the same rounded product (two
# 24-bit significands multiply exactly in 53 bits). tests/nvfp4_recipe/test_host_syncs.py.
FP32_RECIPROCAL_OF_6 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()

# Magnitudes of codes 0..7; codes 8..15 are their negatives (code 8 is -0.0).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_EXPONENT_MASK = 0x7F800000
_ONE_BITS = 0x3F800000  # float32 1.0
# 1.5 * 2**(E + 22) minus 2**E (both as float32 bit patterns): adding it to the exponent bits of
# max(|v|, 1) gives the "magic" constant whose ulp is the E2M1 grid step at |v|.
_MAGIC_OFFSET = 0x0B400000
_ONE_ULP_EXPONENT = 1 << 23
_TWO_TO_127_BITS = 0x7F000000  # bits(2**k) + bits(2**-k): the step's reciprocal, exactly

# Scratch buffers of the element kernels hold at most this many elements (4 MiB in float32): a
# chunk's ~6 buffers stay in the last-level cache, and each of its ~10 elementwise ops is large
# enough that dispatch and thread start-up are small. Measured on the 2-core dev VM (nvfp4_linear
# fwd+bwd at 2048^3): 2**16 elements 2.98x bf16, 2**18 2.46x, 2**20 2.27x, 2**22 2.50x.
CHUNK_ELEMENTS = 1 << 20

_code_to_value_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_magnitude_code_lut_cache: dict[torch.device, torch.Tensor] = {}


def e2m1_code_to_value(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 E2M1 values indexed by code (code 8 decodes to -0.0)."""
    key = (device, dtype)
    if key not in _code_to_value_cache:
        values = list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES]
        _code_to_value_cache[key] = torch.tensor(values, dtype=dtype, device=device)
    return _code_to_value_cache[key]


def _magnitude_code_lut(device: torch.device) -> torch.Tensor:
    """Code of an E2M1 magnitude, indexed by (float32 bits >> 22): exponent and top mantissa bit."""
    if device not in _magnitude_code_lut_cache:
        lut = torch.zeros(512, dtype=torch.uint8)
        for code, magnitude in enumerate(E2M1_MAGNITUDES):
            bits = torch.tensor(magnitude, dtype=torch.float32).view(torch.int32).item()
            lut[bits >> 22] = code
        _magnitude_code_lut_cache[device] = lut.to(device)
    return _magnitude_code_lut_cache[device]


class E2M1Scratch:
    """Reusable chunk-sized buffers for the in-place E2M1 kernels (one set per quantize call)."""

    def __init__(self, numel: int, device: torch.device, stochastic: bool, codes: bool) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.scaled = torch.empty(numel, **f32)
        self.bits = torch.empty(numel, dtype=torch.int32, device=device)
        self.negative = torch.empty(numel, dtype=torch.bool, device=device) if codes else None
        self.codes = torch.empty(numel, dtype=torch.uint8, device=device) if codes else None
        if stochastic:
            self.floor = torch.empty(numel, **f32)
            self.uniform = torch.empty(numel, **f32)


def round_e2m1_nearest_(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round float32 v (already in [-6, 6]) to the E2M1 grid in place, ties to even.

    Adding M = 1.5 * 2**(22 + E), E = max(exponent(|v|), 0), puts v's grid step (0.5 below 2, 1
    in [2, 4), 2 in [4, 6]) at M's ulp, so the FP32 adder does the round-to-nearest-even; the
    parity of M / step is even, so ties go to the even E2M1 mantissa. `bits` is int32 scratch.
    Values that round to zero come out as +0.0.
    """
    torch.bitwise_and(v.view(torch.int32), _EXPONENT_MASK, out=bits)
    bits.clamp_(min=_ONE_BITS).add_(_MAGIC_OFFSET)
    magic = bits.view(torch.float32)
    return v.add_(magic).sub_(magic)


# Stochastic rounding takes 8 random bits per element: the resolution of Blackwell's FP4 convert,
# cvt.rs.satfinite.e2m1x4.f32, which rounds four values with one 32-bit rbits word, 8 bits each
# (PTX ISA 9.7.9.21 "cvt": "When converting to .e2m1x4, ... lower 8-bits ... for operands e, f and
# upper 8-bits ... for operands a, b"). A byte r gives u = (r + 1/2) / 256, the midpoint of its
# 1/256 interval, so the round-up probability is the fraction rounded to a multiple of 1/256.
# TE 2.19's software rounding for GPUs without cvt.rs takes u = r / 256 (util/ptx.cuh:607-628):
# the fraction floored; which one the instruction follows is not in TE's source (README).
SR_BITS = 8
SR_HALF = 0.5
SR_SCALE = 2.0**-SR_BITS
# The bytes are those of int64 draws over the full 64-bit range (random_(-2**63, None), torch's
# "full 64 bits range" sampler on CPU and CUDA): eight uniform bytes per draw, viewed in place. Against
# one draw per element this cuts the serial mt19937 loop on CPU ~6x.
_BYTES_PER_DRAW = 8


def draw_random_bytes(numel: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """`numel` uniform random bytes (uint8), for one tensor's stochastic rounding, row-major.

    Drawn once per tensor, before any chunking, so the eager and the fused kernels, on CPU and on
    CUDA, consume the same bytes in the same places. The generator advances by ceil(numel / 8)
    64-bit draws.
    """
    draws = torch.empty(-(-numel // _BYTES_PER_DRAW), dtype=torch.int64, device=device)
    draws.random_(-2**63, None, generator=generator)
    return draws.view(torch.uint8)[:numel]


def round_e2m1_stochastic_(v: torch.Tensor, scratch: E2M1Scratch, n: int, random_bytes: torch.Tensor) -> torch.Tensor:
    """Stochastically round float32 v (in [-6, 6]) to the E2M1 grid; returns the rounded tensor.

    With step the grid spacing at |v| (a power of two) and f = v / step (exact), the result is
    step * (floor(f) + [u < f - floor(f)]), u = (r + 1/2) / 256 from the element's random byte r
    (draw_random_bytes): the upper neighbour is taken with probability (v - lo) / (hi - lo) rounded
    to a multiple of 1/256, as the hardware's 8 random bits allow. Never leaves the two
    neighbours; values on the grid (|v| = 6 included) stay where they are.
    The indicator [u < frac] is ceil(frac - u): frac - u is in (0, 1) when u < frac and in (-1, 0]
    otherwise (an FP32 difference of unequal numbers is never rounded to zero; u has 9 significant
    bits, so u * 256 and the scaling are exact), and float-only ops avoid the slow bool paths of
    lt/add on CPU.
    """
    bits = scratch.bits[:n].view(v.shape)
    floor = scratch.floor[:n].view(v.shape)
    uniform = scratch.uniform[:n].view(v.shape)
    # step = 2**(max(E, 0) - 1)
    torch.bitwise_and(v.view(torch.int32), _EXPONENT_MASK, out=bits)
    bits.clamp_(min=_ONE_BITS).sub_(_ONE_ULP_EXPONENT)
    step = bits.view(torch.float32)
    v.div_(step)  # exact: division by a power of two
    torch.floor(v, out=floor)
    v.sub_(floor)  # fractional part (exact, except that -tiny gives 1.0: it rounds up either way)
    uniform.copy_(random_bytes.view(v.shape)).add_(SR_HALF)  # r + 1/2, exact
    # frac - u, rounded once; ceil: 1 where u < frac, else 0 or -0, and abs_ turns -0 into +0, so
    # that v = -0 (floor -0) rounds to +0, not -0 + -0 = -0.
    round_up = v.sub_(uniform, alpha=SR_SCALE).ceil_().abs_()
    floor.add_(round_up)
    return floor.mul_(step)


def e2m1_codes_(
    rounded: torch.Tensor, negative: torch.Tensor, bits: torch.Tensor, codes: torch.Tensor
) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of grid values `rounded`; the sign comes from `negative`.

    The sign is taken from the value before rounding (v < 0), as TE's reference does: -0.2 -> code 8
    (-0), while an input -0.0 -> code 0.
    """
    torch.bitwise_and(rounded.view(torch.int32), 0x7FFFFFFF, out=bits)
    bits.bitwise_right_shift_(22)
    lut = _magnitude_code_lut(rounded.device)
    torch.index_select(lut, 0, bits.view(-1), out=codes.view(-1))
    return codes.add_(negative, alpha=8)


def pack_codes(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, even column in the low nibble: (rows, K) uint8 -> out (rows, K // 2)."""
    torch.bitwise_left_shift(codes[:, 1::2], 4, out=out)
    return out.bitwise_or_(codes[:, 0::2])


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """(rows, K // 2) uint8 -> (rows, K) uint8 codes."""
    codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes -> values."""
    return e2m1_code_to_value(codes.device, dtype)[codes.long()]


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """int exponents in [-127, 127] -> torch.float8_e8m0fnu (biased by 127)."""
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def chunk_numel(cols: int) -> int:
    """Elements of a scratch buffer that holds row_chunks' chunks of rows of length `cols`."""
    return max(cols, CHUNK_ELEMENTS // cols * cols)


def row_chunks(rows: int, cols: int, multiple: int = 1) -> Iterator[tuple[int, int]]:
    """Row ranges of about CHUNK_ELEMENTS elements, each a multiple of `multiple` rows.

    Depends on the shape only, so stochastic rounding draws the same numbers for the same shape.
    """
    step = max(multiple, (CHUNK_ELEMENTS // max(cols, 1)) // multiple * multiple)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def as_rows(x: torch.Tensor, block: int, what: str, check_finite: bool) -> torch.Tensor:
    """Validate a tensor to quantize in blocks of `block` along its last dim; return it as 2-D rows.

    Raises ValueError naming the problem and the fix.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{what}: dtype {x.dtype} cannot be quantized; pass a floating-point tensor "
            f"(float32, bfloat16, float16 or float64), e.g. x.float()"
        )
    if x.dim() == 0:
        raise ValueError(f"{what}: got a 0-d tensor; need shape (..., K) with K a multiple of {block}")
    k = x.shape[-1]
    if k == 0 or k % block != 0:
        raise ValueError(
            f"{what}: last dimension is {k} in shape {tuple(x.shape)}; it must be a positive "
            f"multiple of {block} (pad it with zeros to {max(block, -(-k // block) * block)})"
        )
    if check_finite and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{what}: {bad} element(s) are NaN or Inf; quantization needs finite inputs")
    x2d = x.reshape(-1, k)
    if x2d.dtype == torch.float64:
        x2d = x2d.float()  # all quantizer arithmetic is FP32; float64 is rounded once here
    return x2d.contiguous()


def encode_e2m1_blocks(
    x2d: torch.Tensor,
    block: int,
    encode: torch.Tensor,
    decode: torch.Tensor | None,
    *,
    stochastic: bool,
    generator: torch.Generator | None,
    want_codes: bool,
    values_dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """E2M1-encode x2d (rows, k) block by block along k, the step NVFP4 and MXFP4 share.

    Each value becomes clamp(x * encode[row, block], -6, 6) rounded to E2M1 (nearest-even or
    stochastic). Returns the packed codes (rows, k // 2) if `want_codes` and the values
    `rounded * decode[row, block]` in `values_dtype` if given. Chunked by shape only, so
    stochastic rounding draws the same numbers for the same shape.
    """
    rows, k = x2d.shape
    blocks = k // block
    device = x2d.device
    packed = torch.empty(rows, k // 2, dtype=torch.uint8, device=device) if want_codes else None
    values = torch.empty(rows, k, dtype=values_dtype, device=device) if values_dtype else None
    scratch = E2M1Scratch(min(rows * k, chunk_numel(k)), device, stochastic, want_codes)
    random_bytes = draw_random_bytes(rows * k, device, generator) if stochastic else None
    for start, stop in row_chunks(rows, k):
        r = stop - start
        n = r * k
        v = scratch.scaled[:n].view(r, blocks, block)
        x_chunk, encode_chunk = x2d[start:stop].view(r, blocks, block), encode[start:stop].unsqueeze(-1)
        if x2d.dtype == torch.float32:
            torch.mul(x_chunk, encode_chunk, out=v)
        else:  # mixed-dtype `out=` calls take slow paths on CPU: convert, then multiply in place
            v.copy_(x_chunk).mul_(encode_chunk)
        v.clamp_(-E2M1_MAX, E2M1_MAX)
        if want_codes:
            negative = torch.lt(v, 0, out=scratch.negative[:n].view(v.shape))
        bits = scratch.bits[:n].view(v.shape)
        if stochastic:
            rounded = round_e2m1_stochastic_(v, scratch, n, random_bytes[start * k:stop * k])
        else:
            rounded = round_e2m1_nearest_(v, bits)
        if want_codes:
            codes = e2m1_codes_(rounded, negative, bits, scratch.codes[:n].view(v.shape))
            pack_codes(codes.view(r, k), packed[start:stop])
        if values is not None:
            values[start:stop].view(v.shape).copy_(rounded.mul_(decode[start:stop].unsqueeze(-1)))
    return packed, values
