"""An independent reference of the quantizers, written from the spec (notes/nvfp4-recipe.md) with a
different structure than nvfp4_recipe: per-element Python loops over small tensors, numpy float32
scalars for every FP32 step (IEEE round-to-nearest), an explicit E2M1 threshold table and an explicit
E4M3 rounding. The quantizer tests compare against it (test_nvfp4_formats.py, test_quant_formats.py);
test_quant_reference.py checks it against hand values.
"""

from __future__ import annotations

import math

import numpy as np
import torch

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


def e2m1_code(v: float) -> int:
    """E2M1 code of a scaled value already clamped to [-6, 6] (spec step 6 threshold table)."""
    negative = v < 0  # -0.0 is not < 0: it maps to code 0
    a = -v if negative else v
    if a <= 0.25:
        code = 0
    elif a < 0.75:
        code = 1
    elif a <= 1.25:
        code = 2
    elif a < 1.75:
        code = 3
    elif a <= 2.5:
        code = 4
    elif a < 3.5:
        code = 5
    elif a <= 5.0:
        code = 6
    else:
        code = 7
    return code + 8 if negative else code


E2M1_VALUE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def round_half_even(q: float) -> float:
    return float(round(q))  # Python's round is ties-to-even


def e4m3_round(v: float) -> float:
    """Round a value in [0, 448] to FP8 E4M3 (3 mantissa bits, min normal 2**-6), ties to even."""
    if v == 0:
        return 0.0
    mantissa, exponent = math.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    unbiased = max(exponent - 1, -6)  # subnormals share the step of 2**-6's binade
    step = 2.0 ** (unbiased - 3)
    return min(round_half_even(v / step) * step, 448.0)


def ceil_log2(y: float) -> int:
    mantissa, exponent = math.frexp(y)
    return exponent - 1 if mantissa == 0.5 else exponent


def ref_quantize_nvfp4(x: torch.Tensor, tile_rows: int = 1):
    """-> (codes int64 (M, K), scales float64 (M, K/16), amax float) for 2-D x."""
    xs = x.detach().float().numpy().astype(np.float32)
    m, k = xs.shape
    with np.errstate(all="ignore"):
        amax = F32(np.max(np.abs(xs))) if xs.size else F32(0)
        s_enc = F32(F32(2688.0) / amax)
        s_enc = min(s_enc, FLT_MAX)
        if s_enc == 0:
            s_enc = F32(1.0)
        s_dec = F32(F32(1.0) / s_enc)
        multiplier = F32(s_enc * F32(1.0 / 6.0))
        codes = np.zeros((m, k), dtype=np.int64)
        scales = np.zeros((m, k // 16))
        for i in range(m):
            tile_top = i - i % tile_rows
            for j in range(k // 16):
                block = xs[tile_top : tile_top + tile_rows, 16 * j : 16 * j + 16]
                vec_max = F32(np.max(np.abs(block)))
                s_raw = min(F32(vec_max * multiplier), FLT_MAX)
                s_raw = min(max(s_raw, F32(-448.0)), F32(448.0))
                s = e4m3_round(float(s_raw))
                scales[i, j] = s
                encode = min(F32(F32(1.0) / F32(F32(s) * s_dec)), FLT_MAX)
                for c in range(16):
                    v = F32(xs[i, 16 * j + c] * encode)
                    v = min(max(v, F32(-6.0)), F32(6.0))
                    codes[i, 16 * j + c] = e2m1_code(float(v))
    return codes, scales, float(amax)


def ref_dequantize_nvfp4(codes, scales, amax: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        s_enc = min(F32(F32(2688.0) / F32(amax)), FLT_MAX)
    s_dec = F32(F32(1.0) / (s_enc if s_enc != 0 else F32(1.0)))
    m, k = codes.shape
    out = np.zeros((m, k), dtype=np.float32)
    for i in range(m):
        for c in range(k):
            out[i, c] = F32(F32(E2M1_VALUE[codes[i, c]] * F32(scales[i, c // 16])) * s_dec)
    return out


def ref_quantize_mxfp4(x: torch.Tensor):
    """-> (codes (M, K), scale exponents (M, K/32)) for 2-D x: 2**ceil(log2(vec_max / 6))."""
    xs = x.detach().float().numpy().astype(np.float32)
    m, k = xs.shape
    codes = np.zeros((m, k), dtype=np.int64)
    exponents = np.zeros((m, k // 32), dtype=np.int64)
    for i in range(m):
        for j in range(k // 32):
            block = xs[i, 32 * j : 32 * j + 32]
            y = float(F32(F32(np.max(np.abs(block))) / F32(6.0)))
            e = -127 if y == 0 else min(max(ceil_log2(y), -127), 127)
            exponents[i, j] = e
            for c in range(32):
                v = min(max(float(block[c]) * 2.0 ** (-e), -6.0), 6.0)
                codes[i, 32 * j + c] = e2m1_code(v)
    return codes, exponents


def ref_quantize_fp8_block(x: torch.Tensor, tile_rows: int):
    """-> (dequantized float64 (M, K), scale_inv per block row) for 2-D x, power-of-two scales."""
    xs = x.detach().float().numpy().astype(np.float32)
    m, k = xs.shape
    out = np.zeros((m, k))
    scale_inv = np.zeros((m // tile_rows, k // 128))
    with np.errstate(all="ignore"):
        for bi in range(m // tile_rows):
            for bj in range(k // 128):
                block = xs[bi * tile_rows : (bi + 1) * tile_rows, bj * 128 : (bj + 1) * 128]
                amax = F32(np.max(np.abs(block)))
                if amax == 0:
                    scale = 1.0
                else:
                    scale = F32(F32(448.0) / amax)
                    scale = float(FLT_MAX) if math.isinf(scale) else float(scale)
                    scale = 2.0 ** (math.frexp(scale)[1] - 1)  # round down to a power of two
                scale_inv[bi, bj] = 1.0 / scale
                for r in range(block.shape[0]):
                    for c in range(128):
                        v = float(F32(block[r, c] * F32(scale)))
                        q = math.copysign(e4m3_round(min(abs(v), 448.0)), v)
                        out[bi * tile_rows + r, bj * 128 + c] = q / scale
    return out, scale_inv
