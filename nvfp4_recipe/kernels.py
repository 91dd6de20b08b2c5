"""Fused element kernels of the emulated GEMM operands: torch.compile'd twins of formats.py's.

The eager kernels (formats.py, nvfp4.py) run ~10 in-place elementwise ops per chunk, each one a
pass over memory. Compiled by inductor, the same formulas become one loop per pass: the block amax
reads x once, and scale / clamp / round / rescale reads x (and the uniforms) once and writes the
bf16 operand once. They are bit-identical to the eager kernels (tests/test_kernels.py): the same FP32
operations in the same order, no reassociation (inductor compiles without -fassociative-math), and
the stochastic-rounding uniforms are drawn eagerly from the caller's generator in the same order.

Selection (NVFP4Config.kernels / precision.kernels): "eager", "compiled", or "auto" = compiled on
CPU when inductor can build C++ (a compiler is on PATH), eager on GPUs (the compiled GPU path needs
Triton and is untested here). The first call per variant compiles for a few seconds; inductor
caches the result on disk for later processes.
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
    E2M1_MAX,
    UNIFORM_BITS_MASK,
    UNIFORM_BITS_SCALE,
)

KERNEL_MODES = ("auto", "eager", "compiled")


def check_kernel_mode(mode: str, owner: str) -> None:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{owner}.kernels={mode!r} is not supported; use one of {', '.join(KERNEL_MODES)}")


@functools.cache
def _cpu_compiler_available() -> bool:
    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


def use_compiled(mode: str, device: torch.device) -> bool:
    """Whether `mode` selects the compiled kernels for tensors on `device`."""
    if mode == "compiled":
        return True
    return mode == "auto" and device.type == "cpu" and _cpu_compiler_available()


# The kernels see flat (blocks, block) tensors, detached (dynamo guards on requires_grad and on a
# view's base), so a call has one dynamic size (the block count) and a new shape does not recompile. Nearest and
# stochastic rounding are separate functions so each stays well under dynamo's recompile limit
# (one variant per input dtype and output dtype).
def _block_amax_flat(x: torch.Tensor) -> torch.Tensor:
    """(blocks, block) -> FP32 (blocks,) max |x| (max is exact in any dtype)."""
    return x.abs().amax(dim=-1).float()


def _scaled_clamped(x: torch.Tensor, encode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = (x.float() * encode).clamp(-E2M1_MAX, E2M1_MAX)
    exponent = torch.bitwise_and(v.view(torch.int32), _EXPONENT_MASK).clamp(min=_ONE_BITS)
    return v, exponent


def _e2m1_values_nearest(x, encode, decode, out_dtype: torch.dtype) -> torch.Tensor:
    """formats.round_e2m1_nearest_ of clamp(x * encode, -6, 6), times decode, in out_dtype."""
    v, exponent = _scaled_clamped(x, encode)
    magic = (exponent + _MAGIC_OFFSET).view(torch.float32)
    return (((v + magic) - magic) * decode).to(out_dtype)


def _e2m1_values_stochastic(x, encode, decode, random_bits, out_dtype: torch.dtype) -> torch.Tensor:
    """formats.round_e2m1_stochastic_ (same ops, same order) with the given 24-bit draws."""
    v, exponent = _scaled_clamped(x, encode)
    step = (exponent - _ONE_ULP_EXPONENT).view(torch.float32)
    scaled = v / step
    floor = torch.floor(scaled)
    # formats.draw_uniform_bits_'s mask, fused here; exact: < 2**24, times a power of two
    uniform = torch.bitwise_and(random_bits, UNIFORM_BITS_MASK).float() * UNIFORM_BITS_SCALE
    rounded = (floor + torch.ceil((scaled - floor) - uniform)) * step
    return (rounded * decode).to(out_dtype)


class Fused:
    """A kernel function and its torch.compile'd form. If compiling fails (no working C++
    toolchain, an unsupported platform), "auto" warns once and runs the function eagerly, which
    computes the same bits; "compiled" raises."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        self.failure: Exception | None = None

    def __call__(self, strict: bool, *args):
        if self.failure is None:
            try:
                with torch.no_grad():  # one grad mode for every caller: dynamo guards on it
                    return self.compiled(*args)
            except Exception as error:  # inductor / dynamo build errors have no common base class
                if strict:
                    raise
                self.failure = error
                warnings.warn(
                    f"nvfp4_recipe: compiling the fused quantization kernels failed ({error!r:.200}); "
                    f"running them eagerly. Set precision.kernels=eager to silence this.",
                    RuntimeWarning, stacklevel=3)
        return self.fn(*args)


_BLOCK_AMAX = Fused(_block_amax_flat)
_VALUES_NEAREST = Fused(_e2m1_values_nearest)
_VALUES_STOCHASTIC = Fused(_e2m1_values_stochastic)


def block_amax(x2d: torch.Tensor, block: int, strict: bool = False) -> torch.Tensor:
    """FP32 (rows, K // block) max |x| of each block along the last dim of contiguous x2d."""
    rows, k = x2d.shape
    return _BLOCK_AMAX(strict, x2d.view(-1, block).detach()).view(rows, k // block)


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
    """The values output of formats.encode_e2m1_blocks (no codes), in one fused pass.

    The random bits are drawn for the whole tensor in row-major order, the sequence the eager
    kernel draws chunk by chunk, so both round every element with the same u.
    """
    rows, k = x2d.shape
    x = x2d.view(-1, block).detach()
    encode, decode = encode.reshape(-1, 1).detach(), decode.reshape(-1, 1).detach()
    if stochastic:
        random_bits = torch.empty(x.shape, dtype=torch.int32, device=x.device).random_(generator=generator)
        values = _VALUES_STOCHASTIC(strict, x, encode, decode, random_bits, values_dtype)
    else:
        values = _VALUES_NEAREST(strict, x, encode, decode, values_dtype)
    return values.view(rows, k)

