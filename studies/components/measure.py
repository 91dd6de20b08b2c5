"""Per-linear measurements on one captured batch (x, W, dY), and the check of the study's
quantizers against the independent per-element reference of the tests."""

from __future__ import annotations

import importlib.util

import torch

from nvfp4_recipe.linear import emulated_gemm
from nvfp4_recipe.mxfp4 import MX_BLOCK

from . import REPO
from .gemms import (MXFP4, MXFP8, NVFP4, Gemms, dequantized, flushed, generator, kurtosis_rows,
                    mxfp4_operand, mxfp8_operand, nvfp4_operand, rel, rel_norm)


ACCUMULATE_NS = (1, 2, 4, 8)  # micro-batches (sequences of one captured batch) accumulated
REPEAT_NS = (1, 2, 4, 8, 16, 32)  # draws of one micro-batch's gradient operand


def measure_linear(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, key: str,
                   point_state: dict | None = None) -> dict:
    """Every tensor-level metric of one linear on one captured batch.

    x (S, B, K), w (N, K), dy (S, B, N) as the GEMM saw them (BF16); `key` seeds the SR draws.
    """
    x2d, dy2d = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    xf, wf, dyf = x2d.float(), w.float(), dy2d.float()
    y_ref, dx_ref, dw_ref = xf @ wf.t(), dyf @ wf, dyf.t() @ xf
    out: dict = {}

    # RHT: Wgrad error with / without the 16-point RHT, nearest and stochastic dY; the share of
    # the operands' nonzero values that quantize to zero; the kurtosis along T (the direction the
    # Wgrad blocks and the RHT run), before / after the RHT.
    for rht in (False, True):
        tag = "rht" if rht else "plain"
        g = Gemms(rht=rht)
        x_src, dy_src = g.wgrad_source(x2d), g.wgrad_source(dy2d)
        act = NVFP4._q(x_src)  # x^T is always rounded to nearest
        out[f"flush/x/{tag}"] = flushed(x_src, act)
        for sr in (False, True):
            grad = nvfp4_operand(dy_src, 1, sr, generator(key, "wgrad", sr))
            if not sr:
                out[f"flush/dy/{tag}"] = flushed(dy_src, grad)
            dw = emulated_gemm(grad, act, torch.float32)
            out[f"wgrad_err/{tag}/{'sr' if sr else 'nearest'}"] = rel(dw, dw_ref)
        out[f"kurtosis/x{'_rht' if rht else ''}"] = kurtosis_rows(x_src)
        out[f"kurtosis/dy{'_rht' if rht else ''}"] = kurtosis_rows(dy_src)

    # 2D weight scaling: the two 1x16 copies against the one 16x16 copy.
    one_d, two_d = Gemms(weight_2d=False), NVFP4
    w_fprop_1d = dequantized(one_d.weight_fprop(w))
    w_dgrad_1d = dequantized(one_d.weight_dgrad(w)).t()
    fprop_2d = two_d.weight_fprop(w)
    w_2d, w_dgrad_2d = dequantized(fprop_2d), dequantized(two_d.weight_dgrad(w, fprop_2d)).t()
    out["w_mismatch/1d"] = rel_norm(w_fprop_1d - w_dgrad_1d, wf)
    out["w_mismatch/2d"] = rel_norm(w_2d - w_dgrad_2d, wf)
    out["w_err/fprop_1d"] = rel(w_fprop_1d, wf)
    out["w_err/dgrad_1d"] = rel(w_dgrad_1d, wf)
    out["w_err/2d"] = rel(w_2d, wf)
    dx_1d = one_d.dgrad(dy2d, w, generator(key, "dgrad"))  # the same SR draws of dY for both
    dx_2d = two_d.dgrad(dy2d, w, generator(key, "dgrad"))
    out["dx_err/1d"], out["dx_err/2d"] = rel(dx_1d, dx_ref), rel(dx_2d, dx_ref)
    # Against the gradient of the function Fprop computed (dY times the weight Fprop used).
    out["dx_consistency/1d"] = rel(dx_1d, dyf @ w_fprop_1d)
    out["dx_consistency/2d"] = rel(dx_2d, dyf @ w_2d)

    # NVFP4 vs MXFP4, and the 8-bit MXFP8 beside them: operand errors (nearest rounding: the
    # formats alone) and the recipes' GEMMs (MXFP8's: 1x32 on every operand, nearest).
    for role, t, tile in (("x", x2d, 1), ("w", w, 1), ("dy", dy2d, 1)):
        out[f"operand_err/{role}/nvfp4"] = rel(dequantized(nvfp4_operand(t, tile)), t.float())
        out[f"operand_err/{role}/mxfp4"] = rel(dequantized(mxfp4_operand(t)), t.float())
        out[f"operand_err/{role}/mxfp8"] = rel(dequantized(mxfp8_operand(t)), t.float())
    out["y_err/nvfp4"] = rel(NVFP4.fprop(x2d, w), y_ref)
    out["y_err/mxfp4"] = rel(MXFP4.fprop(x2d, w), y_ref)
    out["y_err/mxfp8"] = rel(MXFP8.fprop(x2d, w), y_ref)
    out["dx_err/nvfp4"] = out["dx_err/2d"]
    out["dx_err/mxfp4"] = rel(MXFP4.dgrad(dy2d, w), dx_ref)
    out["dx_err/mxfp8"] = rel(MXFP8.dgrad(dy2d, w), dx_ref)
    out["wgrad_err/nvfp4"] = out["wgrad_err/rht/sr"]
    out["wgrad_err/mxfp4"] = rel(MXFP4.wgrad(dy2d, x2d), dw_ref)
    out["wgrad_err/mxfp8"] = rel(MXFP8.wgrad(dy2d, x2d), dw_ref)

    out.update(sr_accumulation(x, dy, key, point_state))
    return out


def sr_accumulation(x: torch.Tensor, dy: torch.Tensor, key: str,
                    point_state: dict | None = None) -> dict:
    """Bias of the Wgrad accumulated over N micro-batches of one sequence each (the B sequences of
    a captured batch, in order), nearest vs stochastic dY, full recipe otherwise (RHT on).

    total:   ||sum_i (Q-Wgrad_i - Wgrad_i)|| / ||sum_i Wgrad_i||, Wgrad_i exact in FP32;
    operand: the same with the x^T operand quantized in the reference too (its nearest rounding
             is common to both modes), i.e. the error of the rounding of dY alone;
    repeat:  one micro-batch's dY^T operand drawn N times: ||mean_N Q(g) - g|| / ||g||: what
             SR's unbiasedness guarantees to shrink (as 1/sqrt(N)) and nearest keeps constant.
    `point_state` (a dict kept by the caller across the batches of a capture point) continues the
    sums over the point's batches: its "records" get the values at N = 8, 16, 32, ...
    """
    s, b, _ = x.shape
    out: dict = {}
    batch_state: dict = {}
    for i in range(b):
        xi, dyi = x[:, i].contiguous(), dy[:, i].contiguous()
        act = NVFP4._q(NVFP4.wgrad_source(xi))
        g_src = NVFP4.wgrad_source(dyi)
        exact = dyi.float().t() @ xi.float()
        exact_q = g_src @ dequantized(act).t()
        gen = generator(key, "accumulate", i)
        errors = {}
        for mode in ("nearest", "sr"):
            q = emulated_gemm(nvfp4_operand(g_src, 1, mode == "sr", gen), act, torch.float32)
            errors[f"total/{mode}"], errors[f"operand/{mode}"] = q - exact, q - exact_q
        for state, prefix, at in ((batch_state, "accum", ACCUMULATE_NS),
                                  (point_state, None, None)):
            if state is None:
                continue
            n = state["count"] = state.get("count", 0) + 1
            state["norm_sum"] = state.get("norm_sum", 0.0) + float(torch.linalg.vector_norm(exact))
            for name, value in (("exact", exact), ("exact_q", exact_q), *errors.items()):
                state[name] = state[name] + value if name in state else value.clone()
            if prefix is None:
                if n % b == 0 and (n // b) & (n // b - 1) == 0:  # 1, 2, 4, ... batches
                    state.setdefault("records", {})[n] = accumulated_bias(state)
            elif n in at:
                for metric, value in accumulated_bias(state).items():
                    out[f"{prefix}/{metric}/{n}"] = value
        if i == 0:  # repeated draws of the first sequence's operand
            near = dequantized(nvfp4_operand(g_src))
            mean = torch.zeros_like(g_src)
            gen_r = generator(key, "repeat")
            for n in range(1, max(REPEAT_NS) + 1):
                mean += (dequantized(nvfp4_operand(g_src, 1, True, gen_r)) - mean) / n
                if n in REPEAT_NS:
                    out[f"repeat/sr/{n}"] = rel(mean, g_src)
                    out[f"repeat/nearest/{n}"] = rel(near, g_src)  # every draw is the same
    return out


def accumulated_bias(state: dict) -> dict:
    """The relative biases so far, and the coherence ||sum Wgrad_i|| / sum ||Wgrad_i|| of the exact
    gradients (1 if every micro-batch had the same gradient, 1/sqrt(N) if they were independent)."""
    out = {f"{what}/{mode}": rel_norm(state[f"{what}/{mode}"],
                                      state["exact" if what == "total" else "exact_q"])
           for what in ("total", "operand") for mode in ("nearest", "sr")}
    out["coherence"] = float(torch.linalg.vector_norm(state["exact"])) / state["norm_sum"]
    return out


def load_reference():
    """tests/nvfp4_recipe/quant_reference.py (per-element Python loops written from the spec), or None."""
    path = REPO / "tests" / "nvfp4_recipe" / "quant_reference.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("_quant_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_check(ref, t: torch.Tensor, what: str) -> dict:
    """The study's NVFP4 (1x16, 16x16) and MXFP4 dequantized values of a 2-D slice against the
    reference: {"case", "elements", "max_abs_diff"} per format (0.0 = bit-identical)."""
    import numpy as np

    rows = []
    t = t.float().contiguous()
    for tile in (1, 16):
        codes, scales, amax = ref.ref_quantize_nvfp4(t, tile)
        want = torch.from_numpy(ref.ref_dequantize_nvfp4(codes, scales, amax))
        got = dequantized(nvfp4_operand(t, tile))
        rows.append({"case": f"{what} nvfp4 {'16x16' if tile == 16 else '1x16'}",
                     "elements": t.numel(), "max_abs_diff": float((got - want).abs().max())})
    codes, exps = ref.ref_quantize_mxfp4(t)
    values = np.array(ref.E2M1_VALUE)[codes] * np.repeat(2.0 ** exps.astype(np.float64), MX_BLOCK, 1)
    got = dequantized(mxfp4_operand(t)).double()
    rows.append({"case": f"{what} mxfp4 1x32", "elements": t.numel(),
                 "max_abs_diff": float((got - torch.from_numpy(values)).abs().max())})
    return rows
