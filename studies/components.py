"""The component study: what each part of the NVFP4 recipe fixes, measured on the demo model's own
tensors instead of through loss curves.

    python -m studies.components                        # train, capture, measure, docs/components/
    python -m studies.components --steps 60 --batches 2 --out /tmp/components   # a quicker look

The ablation study (docs/ablations/) trains 81,920 tokens per recipe: too few for the effects RHT,
stochastic rounding and 2D weight scaling address to show in the loss. Here one BF16 run of the
demo model (the ablation's shapes, constant LR after warm-up: a mid-pretraining state) is stopped at
three points; at each, the next `--batches` training steps are captured: every linear's GEMM input
x, weight W and output gradient dY, exactly as megatron's linear hands them to its GEMM. On them,
with this project's quantizers (nvfp4_recipe; the GEMMs composed from the public quantizers as
nvfp4_recipe/linear.py composes them, checked bit for bit against `quantized_linear` by
tests/studies/test_components.py, and the quantizers against the independent per-block reference of
tests/nvfp4_recipe/test_quant_reference.py on captured slices):

  RHT         relative error of the quantized Wgrad dY^T X against FP32, with and without the
              16-point RHT, per linear kind, and the kurtosis of the operands along T.
  SR          bias of the Wgrad accumulated over N micro-batches (one sequence each), nearest vs
              stochastic; the same on one micro-batch drawn N times; and k optimizer steps from one
              state on the same batches, full recipe vs the recipe without SR, against BF16.
  2D weights  mismatch between the weight Fprop uses and the one Dgrad uses (1x16 along K vs along
              N) against 16x16 tiles, each copy's error, and the error of dX.
  BF16 layers per-layer quantization error, and the loss change / gradient error when only that
              layer is quantized (a sensitivity scan over all layers).
  MXFP4       the same operand and GEMM errors for MXFP4 (1x32, E8M0) and NVFP4 (1x16, E4M3 + FP32).
  variants    every ablation recipe applied to the same captured batches: loss change and gradient
              error against BF16.

Intervals: 95 % Student-t intervals over the captured batches (each batch contributes one value,
the mean over the linears it covers); n is given with every interval. The report: README.md,
*.png and results.json in --out (default docs/components/).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.machine import cpu_model
from nvfp4_recipe.hadamard import rht_matrix
from nvfp4_recipe.linear import GemmOperand, emulated_gemm, transpose_padded
from nvfp4_recipe.mxfp4 import MX_BLOCK, mxfp4_dequantized_values
from nvfp4_recipe.nvfp4 import BLOCK, nvfp4_scaled_values

REPO = Path(__file__).resolve().parents[1]

# The ablation study's shapes (studies/ablations.py STUDY_OVERRIDES: 8 sequences x 128 tokens per
# step, one micro-batch, so every GEMM sees T = 1,024 tokens), with a constant LR after warm-up
# (decay_fraction=0): the captured states are mid-pretraining ones, not annealed ones, and the
# optimizer-step experiment runs at the peak LR.
TRAIN_OVERRIDES = [
    "precision=bf16", "trainer.seq_length=128", "trainer.global_batch_size=8",
    "trainer.micro_batch_size=8", "trainer.warmup_steps=10", "trainer.decay_fraction=0",
    "trainer.eval_batches=4", "trainer.grad_health_every=0", "logger.mode=disabled",
]
DEFAULT_STEPS = 400
# The recipes of recipes/precision/ compared end to end on the captured batches.
VARIANTS = ["nvfp4", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_no_2d", "nvfp4_no_bf16_layers",
            "nvfp4_naive", "mxfp4"]
# Linear module names (model/specs.py LINEAR_NAMES) -> the kinds the tables group by.
KIND_OF = {
    "mixer.in_proj": "mamba in_proj", "mixer.out_proj": "mamba out_proj",
    "self_attention.linear_qkv": "attention qkv", "self_attention.linear_proj": "attention proj",
    "mlp.linear_fc1": "mlp fc1", "mlp.linear_fc2": "mlp fc2",
}
KINDS = list(KIND_OF.values())
ACCUMULATE_NS = (1, 2, 4, 8)  # micro-batches (sequences of one captured batch) accumulated
REPEAT_NS = (1, 2, 4, 8, 16, 32)  # draws of one micro-batch's gradient operand
# How the NVFP4 quantizers run (nvfp4_recipe.kernels): "auto" as in training; every mode computes
# the same bits (tests use "eager" to skip compilation).
KERNELS = "auto"


# -- statistics -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (p > 0.5) by bisection on its CDF, integrated with Simpson's rule (no
    scipy in this environment). t_quantile(0.975, 11) = 2.2010."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def pdf(t: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))

    def cdf(x: float, n: int = 4000) -> float:
        h = x / n
        s = pdf(0.0) + pdf(x) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
        return 0.5 + s * h / 3

    hi = 1.0
    while cdf(hi) < p:
        hi *= 2
    lo = hi / 2 if hi > 1 else 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def interval(values) -> dict:
    """Mean and 95 % t-interval of independent values (None bounds for n < 2)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    n = len(v)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    mean = statistics.fmean(v)
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": 1}
    half = t_quantile(0.975, n - 1) * statistics.stdev(v) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def negated(ci: dict) -> dict:
    """The interval of -value."""
    flip = lambda v: None if v is None else -v
    return {**ci, "mean": flip(ci["mean"]), "lo": flip(ci["hi"]), "hi": flip(ci["lo"])}


def jackknife(full: float, leave_one_out: list[float]) -> dict:
    """95 % interval of a statistic from its leave-one-out values (jackknife standard error)."""
    n = len(leave_one_out)
    if n < 2:
        return {"mean": full, "lo": None, "hi": None, "n": max(n, 1)}
    m = statistics.fmean(leave_one_out)
    se = math.sqrt((n - 1) / n * sum((v - m) ** 2 for v in leave_one_out))
    half = t_quantile(0.975, n - 1) * se
    return {"mean": full, "lo": full - half, "hi": full + half, "n": n}


def sig(value):
    """6 significant digits: what results.json keeps of a measurement (the report is computed
    from the same rounded values, so --report-only reproduces it exactly)."""
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def excludes_zero(ci: dict) -> bool:
    return ci["lo"] is not None and (ci["lo"] > 0 or ci["hi"] < 0)


# -- the recipe's GEMMs on captured tensors ----------------------------------------------------
def nvfp4_operand(t2d: torch.Tensor, tile_rows: int = 1, stochastic: bool = False,
                  generator: torch.Generator | None = None) -> GemmOperand:
    """An NVFP4 GEMM operand (blocks along the last dim), FP32 q*s values and the tensor scale."""
    return GemmOperand(*nvfp4_scaled_values(t2d, tile_rows, stochastic, generator, torch.float32,
                                            KERNELS))


def mxfp4_operand(t2d: torch.Tensor, stochastic: bool = False,
                  generator: torch.Generator | None = None) -> GemmOperand:
    return GemmOperand(mxfp4_dequantized_values(t2d, stochastic, generator, torch.float32), None)


def dequantized(op: GemmOperand) -> torch.Tensor:
    return op.values if op.decode_scale is None else op.values * op.decode_scale


@dataclass(frozen=True)
class Gemms:
    """One recipe's Fprop / Dgrad / Wgrad, composed from the public quantizers exactly as
    nvfp4_recipe.linear's _NVFP4Ops / _MXFP4Ops compose them, with FP32 GEMMs (precision.gemm=
    exact: the quantization error alone). For y = x W^T, x (T, K), W (N, K), dY (T, N):
    Fprop Q(x) Q(W)^T, Dgrad Q(dY) Q(W) (blocks along N), Wgrad Q(dY^T) Q(x^T)^T (blocks along T,
    after the RHT when on). SR applies to dY only; Dgrad draws before Wgrad, as the backward does."""

    fmt: str = "nvfp4"
    rht: bool = True
    sr: bool = True
    weight_2d: bool = True

    @property
    def block(self) -> int:
        return BLOCK if self.fmt == "nvfp4" else MX_BLOCK

    def _q(self, t, tile_rows=1, stochastic=False, generator=None) -> GemmOperand:
        if self.fmt == "nvfp4":
            return nvfp4_operand(t, tile_rows, stochastic, generator)
        return mxfp4_operand(t, stochastic, generator)

    def weight_fprop(self, w):
        return self._q(w, BLOCK if self.fmt == "nvfp4" and self.weight_2d else 1)

    def weight_dgrad(self, w, fprop: GemmOperand | None = None):
        if self.fmt == "nvfp4" and self.weight_2d:  # 16x16 tiles: Fprop's copy, transposed
            return (fprop if fprop is not None else self.weight_fprop(w)).t()
        return self._q(w.t().contiguous())

    def fprop(self, x2d, w):
        return emulated_gemm(self._q(x2d), self.weight_fprop(w), torch.float32)

    def dgrad(self, dy2d, w, generator=None):
        return emulated_gemm(self._q(dy2d, 1, self.sr, generator), self.weight_dgrad(w),
                             torch.float32)

    def wgrad_source(self, t2d):
        """(T, C) -> FP32 (C, T_pad): the Wgrad operand before quantization (after the RHT)."""
        hadamard = rht_matrix(device=t2d.device) if self.fmt == "nvfp4" and self.rht else None
        return transpose_padded(t2d, self.block, hadamard)

    def wgrad(self, dy2d, x2d, generator=None, activation: GemmOperand | None = None):
        grad = self._q(self.wgrad_source(dy2d), 1, self.sr, generator)
        act = activation if activation is not None else self._q(self.wgrad_source(x2d))
        return emulated_gemm(grad, act, torch.float32)


NVFP4 = Gemms()
MXFP4 = Gemms("mxfp4", rht=False, sr=False, weight_2d=False)  # MXFP4Config's defaults


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 for b = 0 = a)."""
    nb = float(torch.linalg.vector_norm(b.float()))
    d = float(torch.linalg.vector_norm(a.float() - b.float()))
    return d / nb if nb > 0 else (0.0 if d == 0 else math.inf)


def flushed(source: torch.Tensor, op: GemmOperand) -> float:
    """Share of the nonzero values of `source` that the quantized operand holds as zero."""
    nonzero = source != 0
    n = int(nonzero.sum())
    return int((nonzero & (op.values == 0)).sum()) / n if n else 0.0


def kurtosis_rows(t: torch.Tensor) -> float:
    """Mean over rows of the Pearson kurtosis E[(v - m)^4] / var^2 (3 for a Gaussian) of each
    row; rows with zero variance are skipped. In float64: gradients of ~1e-10 would underflow the
    fourth powers in FP32."""
    t = t.double()
    c = t - t.mean(dim=-1, keepdim=True)
    var = c.square().mean(dim=-1)
    ok = var > 0
    if not bool(ok.any()):
        return float("nan")
    return float((c[ok].pow(4).mean(dim=-1) / var[ok].square()).mean())


def seed_for(*parts) -> int:
    """A reproducible generator seed per (batch, linear, purpose)."""
    h = 0
    for p in parts:
        for ch in str(p):
            h = (h * 131 + ord(ch)) % (2**61 - 1)
    return h % (2**31)


def generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(*parts))


# -- per-linear measurements --------------------------------------------------------------------
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

    # NVFP4 vs MXFP4: operand errors (nearest rounding: the formats alone) and the recipes' GEMMs.
    for role, t, tile in (("x", x2d, 1), ("w", w, 1), ("dy", dy2d, 1)):
        out[f"operand_err/{role}/nvfp4"] = rel(dequantized(nvfp4_operand(t, tile)), t.float())
        out[f"operand_err/{role}/mxfp4"] = rel(dequantized(mxfp4_operand(t)), t.float())
    out["y_err/nvfp4"] = rel(NVFP4.fprop(x2d, w), y_ref)
    out["y_err/mxfp4"] = rel(MXFP4.fprop(x2d, w), y_ref)
    out["dx_err/nvfp4"] = out["dx_err/2d"]
    out["dx_err/mxfp4"] = rel(MXFP4.dgrad(dy2d, w), dx_ref)
    out["wgrad_err/nvfp4"] = out["wgrad_err/rht/sr"]
    out["wgrad_err/mxfp4"] = rel(MXFP4.wgrad(dy2d, x2d), dw_ref)

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


def rel_norm(err: torch.Tensor, ref: torch.Tensor) -> float:
    nr = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(err)) / nr if nr > 0 else math.inf


# -- the independent reference on captured slices -----------------------------------------------
def load_reference():
    """tests/nvfp4_recipe/test_quant_reference.py (per-element Python loops written from the spec), or None."""
    path = REPO / "tests" / "nvfp4_recipe" / "test_quant_reference.py"
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


# -- capture ------------------------------------------------------------------------------------
def precision_linears(core: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{`layers.<i>.<linear>`: module} of every linear whose GEMM follows a precision decision
    (the names precision.overrides and the policy use)."""
    from nvfp4_recipe.megatron.parallel_linear import _PrecisionLinearMixin

    out = {}
    for name, module in core.named_modules():
        if isinstance(module, _PrecisionLinearMixin):
            out[name[name.index("layers."):]] = module
    return out


def layer_index(name: str) -> int:
    return int(name.split(".")[1])


def kind_of(name: str) -> str:
    return KIND_OF[name.split(".", 2)[2]]


class Capture:
    """Records, while `active`, the GEMM input x, the weight and the output gradient dY of every
    precision linear: wraps each module's `_precision_gemm` (the local GEMM megatron's parallel
    linear calls), so the tensors are exactly the GEMM's operands, in its [s, b, h] layout."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.modules = modules
        self.active = False
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in modules.items():
            module._precision_gemm = self._wrap(name, module._precision_gemm)

    def _wrap(self, name, gemm):
        from nvfp4_recipe.megatron.parallel_linear import COMPUTE_DTYPE

        def wrapped(x, weight, bias):
            out = gemm(x, weight, bias)
            if self.active and torch.is_grad_enabled():
                rec = self.tensors[name] = {"x": x.detach().to(COMPUTE_DTYPE).clone(),
                                            "w": weight.detach().to(COMPUTE_DTYPE).clone()}
                if out.requires_grad:
                    out.register_hook(lambda g: rec.__setitem__(
                        "dy", g.detach().to(COMPUTE_DTYPE).clone()))
            return out

        return wrapped

    def take(self) -> dict[str, dict[str, torch.Tensor]]:
        got, self.tensors = self.tensors, {}
        missing = [n for n, r in got.items() if "dy" not in r]
        if missing or len(got) != len(self.modules):
            raise RuntimeError(f"capture incomplete: {len(got)} of {len(self.modules)} linears, "
                               f"no dY for {missing}")
        return got

    def remove(self) -> None:
        for module in self.modules.values():
            del module._precision_gemm  # back to the class's method


# -- precision maps on one model ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def precision_config(name: str):
    """recipes/precision/<name>.yaml as train.py composes it (its `defaults` chain included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import register_configs

    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        cfg = compose("train", overrides=[f"precision={name}"])
    return OmegaConf.to_object(cfg.precision)


def recipe_configs(name: str, model_cfg) -> dict[str, object]:
    """{linear name: its emulated-GEMM config (None = BF16)} under recipe `name`, from the
    project's precision policy (the first/last BF16 layers, overrides)."""
    from model.build import precision_policy
    from nvfp4_recipe.registry import gemm_config_for

    pcfg = precision_config(name)
    policy = precision_policy(model_cfg, pcfg)
    return {n: gemm_config_for(f, pcfg) for n, f in policy.linear_formats().items()}


@contextlib.contextmanager
def gemm_configs(modules: dict[str, torch.nn.Module], configs: dict[str, object]):
    """Run the linears under `configs` (missing names: BF16), quantizing at every call."""
    saved = {n: (m.gemm_config, m.is_first_microbatch) for n, m in modules.items()}
    try:
        for n, m in modules.items():
            m.gemm_config = configs.get(n)
            m.is_first_microbatch = None
            m.weight_cache.clear()
        yield
    finally:
        for n, m in modules.items():
            m.gemm_config, m.is_first_microbatch = saved[n]
            m.weight_cache.clear()


def loss_and_grad(trainer, batch: dict, seed: int) -> tuple[float, torch.Tensor]:
    """One micro-batch's loss and every parameter's gradient (FP32 main grads), SR drawn from
    `seed` (the trainer's global stream is restored afterwards)."""
    from training.schedules import run_micro_batches

    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        trainer.model.train()
        trainer.model.zero_grad_buffer()
        loss = run_micro_batches(trainer.model, [batch], trainer.ctx, trainer.activation_shape)
        grad = torch.cat([p.main_grad.reshape(-1) for p in trainer.model.params]).clone()
        trainer.model.zero_grad_buffer()
    finally:
        torch.set_rng_state(state)
    return float(loss), grad


def model_level(trainer, modules, batch: dict, model_cfg, key: str) -> dict:
    """Loss change and gradient error against BF16 on one batch, for each recipe variant and for
    each layer quantized alone (NVFP4 full recipe): the sensitivity scan."""
    base_loss, base_grad = loss_and_grad(trainer, batch, seed_for(key, "bf16"))
    norm = float(torch.linalg.vector_norm(base_grad))
    out = {}

    def measure(tag, configs):
        with gemm_configs(modules, configs):
            loss, grad = loss_and_grad(trainer, batch, seed_for(key, tag))
        out[f"dloss/{tag}"] = loss - base_loss
        out[f"grad_err/{tag}"] = float(torch.linalg.vector_norm(grad - base_grad)) / norm

    for variant in VARIANTS:
        measure(variant, recipe_configs(variant, model_cfg))
    full = recipe_configs("nvfp4_no_bf16_layers", model_cfg)  # the recipe on every layer
    for i in sorted({layer_index(n) for n in modules}):
        measure(f"layer/{i}", {n: c for n, c in full.items() if layer_index(n) == i})
    out["loss/bf16"] = base_loss
    return out


# -- SR through optimizer steps -------------------------------------------------------------------
def snapshot(trainer) -> dict:
    """The weights, FP32 master weights, Adam state and schedule (the CPU optimizer's)."""
    opt = trainer.optimizer
    return {"params": trainer.model.param_data.clone(),
            "masters": [m.detach().clone() for *_, m in opt.pieces],
            "adam": copy.deepcopy(opt.adam.state_dict()),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict())}


def restore(trainer, snap: dict) -> None:
    opt = trainer.optimizer
    with torch.no_grad():
        trainer.model.param_data.copy_(snap["params"])
        for (*_, m), saved in zip(opt.pieces, snap["masters"]):
            m.copy_(saved)
    opt.adam.load_state_dict(copy.deepcopy(snap["adam"]))
    trainer.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))


def masters(trainer) -> torch.Tensor:
    return torch.cat([m.detach().reshape(-1) for *_, m in trainer.optimizer.pieces]).clone()


def set_masters(trainer, flat: torch.Tensor) -> None:
    """Load FP32 master weights (masters()' layout) and the BF16 weights made from them, as the
    optimizer's step does."""
    opt, offset = trainer.optimizer, 0
    with torch.no_grad():
        for i, a, b, master in opt.pieces:
            master.copy_(flat[offset:offset + master.numel()].view_as(master))
            offset += master.numel()
            start = opt.layout.offsets[i]
            trainer.model.param_data[start + a:start + b].copy_(master)


def sr_steps(trainer, modules, model_cfg, batches: list[list[dict]], seeds: list[int]) -> dict:
    """k optimizer steps from one state on the same k batches: BF16, the full recipe (SR, one run
    per seed) and the recipe without SR. Per run: the error of the k-step update of the FP32
    master weights against BF16's, and the validation loss (BF16 forward) after the k steps."""
    snap = snapshot(trainer)
    start = masters(trainer)

    def run(configs, seed):
        restore(trainer, snap)
        torch.manual_seed(seed)
        with gemm_configs(modules, configs):
            for mb in batches:
                for m in modules.values():
                    m.is_first_microbatch = True  # the trainer's protocol: quantize once a step
                trainer.train_step(mb)
        update = masters(trainer) - start
        val = trainer.evaluate()  # BF16 forward: the weights' quality, not the format's
        return update, val

    bf16_update, bf16_val = run({}, 0)
    ref = float(torch.linalg.vector_norm(bf16_update))
    nearest_update, nearest_val = run(recipe_configs("nvfp4_no_sr", model_cfg), 0)
    sr_updates, sr_vals = [], []
    for s in seeds:
        u, v = run(recipe_configs("nvfp4", model_cfg), s)
        sr_updates.append(u)
        sr_vals.append(v)
    restore(trainer, snap)
    err = lambda u: float(torch.linalg.vector_norm(u - bf16_update)) / ref
    # The mean update of k SR runs (disjoint groups of seeds): what averaging SR's rounding over
    # k repetitions leaves; its error falls with k only as far as SR is unbiased.
    mean_of_k, k = {}, 1
    while k <= len(seeds):
        mean_of_k[str(k)] = [err(torch.stack(sr_updates[i:i + k]).mean(0))
                             for i in range(0, len(seeds) - k + 1, k)]
        k *= 2
    everything = torch.stack(sr_updates)
    total = everything.sum(0)

    def val_after(update):  # the validation loss of start + update (BF16 forward)
        restore(trainer, snap)
        set_masters(trainer, start + update)
        return trainer.evaluate()

    mean_val = val_after(total / len(seeds))
    loo_vals = ([val_after((total - u) / (len(seeds) - 1)) for u in everything]
                if len(seeds) > 1 else [])
    restore(trainer, snap)
    return {
        "val_gap/sr_mean_update": mean_val - bf16_val,
        "val_gap/sr_mean_update_loo": [v - bf16_val for v in loo_vals],
        "steps": len(batches), "seeds": seeds, "bf16_val": bf16_val,
        "update_err/nearest": err(nearest_update),
        "update_err/sr_mean_all": err(total / len(seeds)),
        # leave-one-out means: a jackknife interval for the error of the mean of all runs
        "update_err/sr_mean_loo": [err((total - u) / (len(seeds) - 1)) for u in everything]
        if len(seeds) > 1 else [],
        "update_err/sr": [err(u) for u in sr_updates],
        "update_err/sr_mean_of_k": mean_of_k,
        "val_gap/nearest": nearest_val - bf16_val,
        "val_gap/sr": [v - bf16_val for v in sr_vals],
    }


# -- the study ----------------------------------------------------------------------------------
def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads()}


def capture_steps(steps: int, batches: int) -> list[list[int]]:
    """Three capture points (1/6, 1/2 and the end of training), `batches` consecutive steps each."""
    starts = [max(1, steps // 6), max(1, steps // 2), steps - batches + 1]
    points = [list(range(s, s + batches)) for s in starts]
    flat = [s for p in points for s in p]
    if len(set(flat)) != len(flat) or min(flat) < 1:
        raise SystemExit(f"--steps {steps} is too short for 3 capture points of {batches} steps")
    return points


def build_trainer(steps: int, seed: int, run_dir: Path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import register_configs, validate
    from training.distributed import init_distributed
    from training.trainer import Trainer

    register_configs()
    overrides = [*TRAIN_OVERRIDES, f"trainer.max_steps={steps}", f"trainer.seed={seed}",
                 f"run.dir={run_dir}"]
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        cfg = OmegaConf.to_object(compose("train", overrides=overrides))
    ctx = init_distributed(1, 1, "gloo")
    validate(cfg, ctx.world_size)
    return Trainer(cfg, ctx), cfg, overrides


def log(msg: str, t0: float) -> None:
    load = os.getloadavg()[0]
    print(f"[{time.time() - t0:7.1f} s | load {load:5.2f}] {msg}", flush=True)


def run_study(args) -> dict:
    from training.distributed import shutdown

    t0 = time.time()
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    points = capture_steps(args.steps, args.batches)
    capture_at = {s: (p, j) for p, steps in enumerate(points) for j, s in enumerate(steps)}
    model_batches = {s for steps in points for s in steps[:args.model_batches]}
    ref = load_reference()
    results = {"linears": {}, "batches": [], "model": [], "reference_check": [], "phases": {},
               "point_accum": [], "train_loss": []}
    point_states = None
    with tempfile.TemporaryDirectory(prefix="components-") as run_dir:
        trainer, cfg, overrides = build_trainer(args.steps, args.seed, Path(run_dir))
        try:
            modules = precision_linears(trainer.core)
            results["linears"] = {n: {"kind": kind_of(n), "layer": layer_index(n),
                                      "shape": list(m.weight.shape)} for n, m in modules.items()}
            recipe = recipe_configs("nvfp4", cfg.model)
            results["recipe_bf16_layers"] = sorted({layer_index(n) for n, c in recipe.items()
                                                    if c is None})
            capture = Capture(modules)
            log(f"BF16 training, {args.steps} steps; captures at steps {points}", t0)
            phase = {"train": 0.0, "model": 0.0, "tensors": 0.0, "sr_steps": 0.0}
            step = 0
            while step < args.steps:
                mb = trainer.data.train.next_global_batch()
                step += 1
                where = capture_at.get(step)
                if step in model_batches:  # the weights and batch the capture sees
                    t1 = time.time()
                    for j, batch in enumerate(mb):
                        rec = model_level(trainer, modules, batch, cfg.model, f"{step}/{j}")
                        results["model"].append({"step": step, "point": where[0],
                                                 **{k: sig(v) for k, v in rec.items()}})
                    phase["model"] += time.time() - t1
                    log(f"step {step}: recipe variants and layer scan done", t0)
                t1 = time.time()
                capture.active = where is not None
                result = trainer.train_step(mb)
                capture.active = False
                phase["train"] += time.time() - t1
                results["train_loss"].append(round(result.loss, 5))
                if step % 20 == 0 or where is not None:
                    log(f"step {step}: loss {result.loss:.4f}", t0)
                if where is not None:
                    t1 = time.time()
                    tensors = capture.take()
                    if where[1] == 0:
                        point_states = {n: {} for n in tensors}
                    per_linear = {n: {k: sig(v) for k, v in measure_linear(
                                      r["x"], r["w"], r["dy"], f"{step}/{n}", point_states[n]).items()}
                                  for n, r in tensors.items()}
                    results["batches"].append({"step": step, "point": where[0],
                                               "loss": result.loss, "linears": per_linear})
                    if where[1] == len(points[where[0]]) - 1:  # the point's last batch
                        results["point_accum"].append(
                            {"point": where[0], "linears": {
                                n: {str(k): {m: sig(v) for m, v in rec.items()}
                                    for k, rec in st.get("records", {}).items()}
                                for n, st in point_states.items()}})
                        point_states = None
                    if ref is not None and where[1] == 0:  # a few slices per capture point
                        for n in (min(tensors), max(tensors)):
                            for role in ("x", "w", "dy"):
                                t = tensors[n][role].reshape(-1, tensors[n][role].shape[-1])
                                results["reference_check"] += reference_check(
                                    ref, t[:32, :64], f"step {step} {n} {role}[:32, :64]")
                    del tensors
                    phase["tensors"] += time.time() - t1
                    log(f"step {step}: tensor-level measurements done", t0)
                if step == points[1][-1] and args.sr_steps > 0:
                    # SR through optimizer steps, from the mid-training state, on the next
                    # batches (taken off the stream: the main run then trains on later ones).
                    t1 = time.time()
                    nxt = [trainer.data.train.next_global_batch() for _ in range(args.sr_steps)]
                    results["sr_steps"] = sr_steps(trainer, modules, cfg.model, nxt,
                                                   list(range(1, args.sr_seeds + 1)))
                    results["sr_steps"]["at_step"] = step
                    phase["sr_steps"] += time.time() - t1
                    log(f"step {step}: {args.sr_steps} optimizer steps x "
                        f"{args.sr_seeds + 2} runs done", t0)
            capture.remove()
            results["final_val_loss"] = trainer.evaluate()
        finally:
            shutdown()
    results["phases"] = {k: round(v, 1) for k, v in phase.items()}
    results["wall_s"] = round(time.time() - t0, 1)
    results["load_start"] = [round(v, 2) for v in load_start]
    results["load_end"] = [round(v, 2) for v in os.getloadavg()]
    results["config"] = {"steps": args.steps, "batches_per_point": args.batches,
                         "model_batches_per_point": args.model_batches, "points": points,
                         "sr_steps": args.sr_steps, "sr_seeds": args.sr_seeds, "seed": args.seed,
                         "overrides": overrides[:-1]}
    results["command"] = shlex.join(["python", "-m", "studies.components", *args.argv])
    results["machine"] = machine()
    results["generated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    log(f"study done in {results['wall_s'] / 60:.1f} min", t0)
    return results


# -- summaries ----------------------------------------------------------------------------------
def per_batch(results: dict, metric: str, kinds=None, layers=None) -> list[float]:
    """One value per captured batch: the mean of `metric` over its linears (of `kinds`/`layers`)."""
    out = []
    for b in results["batches"]:
        vals = [m[metric] for n, m in b["linears"].items()
                if (kinds is None or kind_of(n) in kinds)
                and (layers is None or layer_index(n) in layers)
                and metric in m and math.isfinite(m[metric])]
        if vals:
            out.append(statistics.fmean(vals))
    return out


def reduction(results, without: str, with_: str, kinds=None) -> dict:
    """Per batch 1 - mean(with) / mean(without) over its linears: the relative error reduction."""
    a, b = per_batch(results, without, kinds), per_batch(results, with_, kinds)
    return interval([1 - w / wo for wo, w in zip(a, b) if wo > 0])


def model_values(results, key: str) -> list[float]:
    return [r[key] for r in results["model"] if key in r]


def summarize(results: dict) -> dict:
    s: dict = {}
    n = len(results["batches"])
    groups = {"all": None, **{k: [k] for k in KINDS}}
    # RHT
    s["rht"] = {}
    for g, kinds in groups.items():
        row = {"linears": sum(1 for x in results["linears"] if kinds is None or kind_of(x) in kinds)}
        for sr in ("nearest", "sr"):
            for arm in ("plain", "rht"):
                row[f"{arm}_{sr}"] = interval(per_batch(results, f"wgrad_err/{arm}/{sr}", kinds))
            row[f"reduction_{sr}"] = reduction(results, f"wgrad_err/plain/{sr}",
                                               f"wgrad_err/rht/{sr}", kinds)
        for t in ("x", "dy", "x_rht", "dy_rht"):
            row[f"kurtosis_{t}"] = interval(per_batch(results, f"kurtosis/{t}", kinds))
        for t in ("x", "dy"):
            for arm in ("plain", "rht"):
                row[f"flush_{t}_{arm}"] = interval(per_batch(results, f"flush/{t}/{arm}", kinds))
            row[f"flush_{t}_drop"] = interval(  # percentage points fewer values lost to zero
                [a - b for a, b in zip(per_batch(results, f"flush/{t}/plain", kinds),
                                       per_batch(results, f"flush/{t}/rht", kinds))])
        s["rht"][g] = row
    # heavy tails: the linear-batch pairs in the top quarter of dY (or x) kurtosis
    pairs = [(max(m["kurtosis/dy"], m["kurtosis/x"]),
              1 - m["wgrad_err/rht/nearest"] / m["wgrad_err/plain/nearest"])
             for b in results["batches"] for m in b["linears"].values()
             if math.isfinite(m["kurtosis/dy"]) and math.isfinite(m["kurtosis/x"])]
    pairs.sort()
    q = max(1, len(pairs) // 4)
    s["rht_tails"] = {"heavy": interval([r for _, r in pairs[-q:]]),
                      "light": interval([r for _, r in pairs[:q]]),
                      "kurtosis_heavy_min": pairs[-q][0] if pairs else None,
                      "kurtosis_light_max": pairs[q - 1][0] if pairs else None,
                      "pairs": len(pairs), "unit": "linear x batch"}
    # SR
    s["sr"] = {}
    for what in ("total", "operand"):
        for mode in ("nearest", "sr"):
            s["sr"][f"{what}_{mode}"] = {
                N: interval(per_batch(results, f"accum/{what}/{mode}/{N}")) for N in ACCUMULATE_NS}
        s["sr"][f"{what}_advantage"] = {  # nearest's bias - SR's, per batch
            N: interval([a - b for a, b in zip(per_batch(results, f"accum/{what}/nearest/{N}"),
                                               per_batch(results, f"accum/{what}/sr/{N}"))])
            for N in ACCUMULATE_NS}
        # shrink factor from N=1 to N=max, per batch
        last = ACCUMULATE_NS[-1]
        for mode in ("nearest", "sr"):
            s["sr"][f"{what}_{mode}_shrink"] = interval(
                [b / a for a, b in zip(per_batch(results, f"accum/{what}/{mode}/1"),
                                       per_batch(results, f"accum/{what}/{mode}/{last}"))
                 if a > 0])
    # over the batches of a capture point: N = 8, 16, 32, ... sequences (n = capture points)
    s["sr"]["point"] = {}
    for rec in results["point_accum"]:
        for name, by_n in rec["linears"].items():
            for N, metrics in by_n.items():
                for metric, value in metrics.items():
                    s["sr"]["point"].setdefault(metric, {}).setdefault(int(N), {}).setdefault(
                        rec["point"], []).append(value)
    means = {metric: {N: [statistics.fmean(pts[p]) for p in sorted(pts)]
                      for N, pts in sorted(by_n.items())}
             for metric, by_n in s["sr"]["point"].items()}
    s["sr"]["point"] = {metric: {N: interval(v) for N, v in by_n.items()}
                        for metric, by_n in means.items()}
    for what in ("total", "operand"):
        if f"{what}/nearest" in means:
            s["sr"]["point"][f"{what}/advantage"] = {
                N: interval([a - b for a, b in zip(v, means[f"{what}/sr"][N])])
                for N, v in means[f"{what}/nearest"].items()}
    for mode in ("nearest", "sr"):
        s["sr"][f"repeat_{mode}"] = {N: interval(per_batch(results, f"repeat/{mode}/{N}"))
                                     for N in REPEAT_NS}
    s["sr"]["repeat_advantage"] = {
        N: interval([a - b for a, b in zip(per_batch(results, f"repeat/nearest/{N}"),
                                           per_batch(results, f"repeat/sr/{N}"))])
        for N in REPEAT_NS}
    s["sr"]["coherence"] = {N: interval(per_batch(results, f"accum/coherence/{N}"))
                            for N in ACCUMULATE_NS}
    if "sr_steps" in results:
        r = results["sr_steps"]
        s["sr_steps"] = {"sr": interval(r["update_err/sr"]), "nearest": r["update_err/nearest"],
                         "sr_mean_of_k": {k: interval(v) for k, v in
                                          r["update_err/sr_mean_of_k"].items()},
                         "sr_mean_all": jackknife(r["update_err/sr_mean_all"],
                                                  r["update_err/sr_mean_loo"]),
                         "val_gap_sr_mean_update": jackknife(
                             r["val_gap/sr_mean_update"], r["val_gap/sr_mean_update_loo"]),
                         "val_gap_mean_update_minus_nearest": jackknife(
                             r["val_gap/sr_mean_update"] - r["val_gap/nearest"],
                             [v - r["val_gap/nearest"] for v in r["val_gap/sr_mean_update_loo"]]),
                         "mean_all_minus_nearest": jackknife(
                             r["update_err/sr_mean_all"] - r["update_err/nearest"],
                             [v - r["update_err/nearest"] for v in r["update_err/sr_mean_loo"]]),
                         "mean_of_k_minus_nearest": {
                             k: interval([e - r["update_err/nearest"] for e in v])
                             for k, v in r["update_err/sr_mean_of_k"].items()},
                         "sr_minus_nearest": interval([e - r["update_err/nearest"]
                                                       for e in r["update_err/sr"]]),
                         "val_gap_sr": interval(r["val_gap/sr"]),
                         "val_gap_nearest": r["val_gap/nearest"],
                         "val_gap_sr_minus_nearest": interval([v - r["val_gap/nearest"]
                                                               for v in r["val_gap/sr"]])}
    # 2D
    s["w2d"] = {}
    for g, kinds in groups.items():
        row = {m: interval(per_batch(results, m, kinds)) for m in
               ("w_mismatch/1d", "w_mismatch/2d", "w_err/fprop_1d", "w_err/dgrad_1d", "w_err/2d",
                "dx_err/1d", "dx_err/2d", "dx_consistency/1d", "dx_consistency/2d")}
        row["consistency_reduction"] = reduction(results, "dx_consistency/1d",
                                                 "dx_consistency/2d", kinds)
        row["dx_reduction"] = reduction(results, "dx_err/1d", "dx_err/2d", kinds)
        row["w_err_increase"] = interval(
            [b / a - 1 for a, b in zip(per_batch(results, "w_err/fprop_1d", kinds),
                                       per_batch(results, "w_err/2d", kinds)) if a > 0])
        s["w2d"][g] = row
    # formats
    s["formats"] = {}
    for metric in ("operand_err/x", "operand_err/w", "operand_err/dy", "y_err", "dx_err",
                   "wgrad_err"):
        s["formats"][metric] = {
            "nvfp4": interval(per_batch(results, f"{metric}/nvfp4")),
            "mxfp4": interval(per_batch(results, f"{metric}/mxfp4")),
            "reduction": reduction(results, f"{metric}/mxfp4", f"{metric}/nvfp4")}
    # layers
    layers = sorted({v["layer"] for v in results["linears"].values()})
    s["layers"] = {}
    for i in layers:
        kinds = sorted({v["kind"] for v in results["linears"].values() if v["layer"] == i})
        s["layers"][i] = {
            "kinds": kinds, "bf16_in_recipe": i in results["recipe_bf16_layers"],
            "y_err": interval(per_batch(results, "y_err/nvfp4", layers=[i])),
            "dx_err": interval(per_batch(results, "dx_err/nvfp4", layers=[i])),
            "wgrad_err": interval(per_batch(results, "wgrad_err/nvfp4", layers=[i])),
            "dloss": interval(model_values(results, f"dloss/layer/{i}")),
            "grad_err": interval(model_values(results, f"grad_err/layer/{i}")),
        }
    # variants
    s["variants"] = {v: {"dloss": interval(model_values(results, f"dloss/{v}")),
                         "grad_err": interval(model_values(results, f"grad_err/{v}"))}
                     for v in VARIANTS}
    paired = lambda a, b, m: interval([x - y for x, y in zip(model_values(results, f"{m}/{a}"),
                                                           model_values(results, f"{m}/{b}"))])
    s["variant_minus_recipe"] = {v: {"dloss": paired(v, "nvfp4", "dloss"),
                                     "grad_err": paired(v, "nvfp4", "grad_err")}
                                 for v in VARIANTS if v != "nvfp4"}
    s["bf16_layers_effect"] = {"dloss": paired("nvfp4_no_bf16_layers", "nvfp4", "dloss"),
                               "grad_err": paired("nvfp4_no_bf16_layers", "nvfp4", "grad_err")}
    s["mxfp4_effect"] = {"dloss": paired("mxfp4", "nvfp4", "dloss"),
                         "grad_err": paired("mxfp4", "nvfp4", "grad_err")}
    s["n_batches"], s["n_model_batches"] = n, len(results["model"])
    return s


# -- report ---------------------------------------------------------------------------------------
def pct(ci: dict, scale: float = 100, spec: str = "+.1f", unit: str = " %") -> str:
    """'+12.3 % [+10.1, +14.5]' (95 % t-interval), or the mean alone for n < 2."""
    if ci is None or ci.get("mean") is None:
        return "—"
    if ci["lo"] is None:
        return f"{format(ci['mean'] * scale, spec)}{unit} (n = 1)"
    return (f"{format(ci['mean'] * scale, spec)}{unit} "
            f"[{format(ci['lo'] * scale, spec)}, {format(ci['hi'] * scale, spec)}]")


def num(ci: dict, spec: str = ".4f") -> str:
    return pct(ci, 1, spec, "")


def mark(ci: dict) -> str:
    return "yes" if excludes_zero(ci) else "**no**"


def plots(results: dict, s: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def err(ci, scale=100):
        m = ci["mean"] * scale
        return m, ([[m - ci["lo"] * scale], [ci["hi"] * scale - m]] if ci["lo"] is not None
                   else None)

    files = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    # RHT: error per kind, and the reduction against the kurtosis of dY along T
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = range(len(KINDS))
    for k, (arm, sr, color) in enumerate((("plain", "nearest", "tab:orange"),
                                          ("rht", "nearest", "tab:blue"),
                                          ("plain", "sr", "tab:red"), ("rht", "sr", "tab:green"))):
        for i, kind in enumerate(KINDS):
            m, e = err(s["rht"][kind][f"{arm}_{sr}"])
            a1.bar(i + (k - 1.5) * 0.2, m, 0.2, yerr=e, color=color, capsize=2,
                   label=f"{'RHT' if arm == 'rht' else 'no RHT'}, dY {sr}" if i == 0 else None)
    a1.set_xticks(list(xs), KINDS, rotation=20, fontsize=8)
    a1.set_ylabel("Wgrad relative error vs FP32 (%)")
    a1.set_title("Wgrad error with / without the 16-point RHT")
    a1.legend(fontsize=8)
    cmap = plt.get_cmap("tab10")
    for i, kind in enumerate(KINDS):
        pts = [(m["kurtosis/dy"], 100 * (1 - m["wgrad_err/rht/nearest"] / m["wgrad_err/plain/nearest"]))
               for b in results["batches"] for n, m in b["linears"].items() if kind_of(n) == kind]
        a2.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, color=cmap(i), label=kind)
    a2.axhline(0, color="0.5", lw=0.8)
    a2.set_xscale("log")
    a2.set_xlabel("kurtosis of dY along T (mean over channels; Gaussian = 3)")
    a2.set_ylabel("Wgrad error reduction by RHT (%, nearest)")
    a2.set_title("RHT gain vs heavy tails (one point per linear and batch)")
    a2.legend(fontsize=7)
    save(fig, "rht.png")

    # SR: accumulated bias vs N, repeated draws, optimizer steps
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.8))
    for what, style in (("total", "-"), ("operand", "--")):
        for mode, color in (("nearest", "tab:orange"), ("sr", "tab:green")):
            cis = s["sr"][f"{what}_{mode}"]
            ns = list(cis)
            a1.errorbar(ns, [100 * cis[n]["mean"] for n in ns],
                        yerr=[[100 * (cis[n]["mean"] - cis[n]["lo"]) for n in ns],
                              [100 * (cis[n]["hi"] - cis[n]["mean"]) for n in ns]]
                        if cis[ns[0]]["lo"] is not None else None,
                        fmt=style + "o", color=color, capsize=3, ms=4,
                        label=f"{'stochastic' if mode == 'sr' else 'nearest'}, "
                              f"{'vs exact' if what == 'total' else 'dY rounding only'}")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("micro-batches accumulated (one sequence each)")
    a1.set_ylabel("relative bias of the accumulated Wgrad (%)")
    a1.set_title("Wgrad accumulated over N micro-batches")
    a1.legend(fontsize=8)
    for mode, color in (("nearest", "tab:orange"), ("sr", "tab:green")):
        cis = s["sr"][f"repeat_{mode}"]
        ns = list(cis)
        a2.plot(ns, [100 * cis[n]["mean"] for n in ns], "o-", color=color,
                label="stochastic" if mode == "sr" else "nearest")
    ns = list(s["sr"]["repeat_sr"])
    first = s["sr"]["repeat_sr"][ns[0]]["mean"]
    a2.plot(ns, [100 * first / math.sqrt(n) for n in ns], ":", color="0.4", label="1/sqrt(N)")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("draws N of the same micro-batch")
    a2.set_ylabel("||mean of N quantized dY - dY|| / ||dY|| (%)")
    a2.set_title("Rounding bias of the Wgrad dY operand")
    a2.legend(fontsize=8)
    if "sr_steps" in s:
        st = s["sr_steps"]
        ks = sorted(st["sr_mean_of_k"], key=int)
        cis = [st["sr_mean_of_k"][k] for k in ks]
        a3.errorbar([int(k) for k in ks], [100 * c["mean"] for c in cis],
                    yerr=[[100 * (c["mean"] - c["lo"]) if c["lo"] is not None else 0 for c in cis],
                          [100 * (c["hi"] - c["mean"]) if c["lo"] is not None else 0 for c in cis]],
                    fmt="o-", color="tab:green", capsize=3, label="SR: mean update of k runs")
        a3.axhline(100 * st["nearest"], color="tab:orange", label="nearest (deterministic)")
        a3.set_xscale("log", base=2)
        a3.set_xlabel("SR runs averaged (k)")
        a3.set_ylabel("update error vs BF16 (%)")
        a3.set_title(f"{results['sr_steps']['steps']} optimizer steps from one state")
        a3.legend(fontsize=8)
    save(fig, "sr.png")

    # 2D weights
    def weight2d_bars(ax, bars):  # four bars per layer kind, one per (metric, label, color)
        for k, (metric, label, color) in enumerate(bars):
            for i, kind in enumerate(KINDS):
                m, e = err(s["w2d"][kind][metric])
                ax.bar(i + (k - 1.5) * 0.2, m, 0.2, yerr=e, color=color, capsize=2,
                       label=label if i == 0 else None)
        ax.set_xticks(list(xs), KINDS, rotation=20, fontsize=8)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    bars = [("w_mismatch/1d", "Fprop vs Dgrad copy, 1x16", "tab:red"),
            ("w_err/fprop_1d", "Fprop copy 1x16 (along K)", "tab:orange"),
            ("w_err/dgrad_1d", "Dgrad copy 1x16 (along N)", "tab:olive"),
            ("w_err/2d", "16x16 copy (both)", "tab:blue")]
    weight2d_bars(a1, bars)
    a1.set_ylabel("relative to ||W|| (%)")
    a1.set_title("Weight copies: error and Fprop/Dgrad mismatch (16x16: 0)")
    a1.legend(fontsize=8)
    bars = [("dx_consistency/1d", "dX vs dY·W_fprop, 1x16", "tab:red"),
            ("dx_consistency/2d", "dX vs dY·W_fprop, 16x16", "tab:blue"),
            ("dx_err/1d", "dX vs dY·W (exact), 1x16", "tab:orange"),
            ("dx_err/2d", "dX vs dY·W (exact), 16x16", "tab:cyan")]
    weight2d_bars(a2, bars)
    a2.set_ylabel("relative error of dX (%)")
    a2.set_title("Dgrad output: 1x16 vs 16x16 weights (same dY draws)")
    a2.legend(fontsize=8)
    save(fig, "weight2d.png")

    # layers
    fig, (a1, a3, a2) = plt.subplots(1, 3, figsize=(18, 4.8))
    layers = sorted(s["layers"], key=int)
    for i in layers:
        row = s["layers"][i]
        color = "tab:gray" if row["bf16_in_recipe"] else "tab:purple"
        m, e = err(row["dloss"], 1)
        a1.bar(int(i), m, 0.6, yerr=e, color=color, capsize=3)
        m, e = err(row["grad_err"])
        a3.bar(int(i), m, 0.6, yerr=e, color=color, capsize=3)
        for k, (metric, c) in enumerate((("y_err", "tab:blue"), ("dx_err", "tab:orange"),
                                         ("wgrad_err", "tab:green"))):
            m, e = err(row[metric])
            a2.bar(int(i) + (k - 1) * 0.25, m, 0.25, yerr=e, color=c, capsize=2,
                   label=metric.replace("_err", "").replace("wgrad", "dW").replace("dx", "dX")
                   if i == layers[0] else None)
    a1.axhline(0, color="0.5", lw=0.8)
    a1.set_xticks([int(i) for i in layers],
                  [f"{i}\n{'/'.join(sorted({k.split()[0] for k in s['layers'][i]['kinds']}))}"
                   for i in layers], fontsize=8)
    a1.set_ylabel("loss change when only this layer is NVFP4")
    a1.set_title("Sensitivity scan: loss (grey: BF16 in the recipe)")
    a3.set_xticks(a1.get_xticks(), [t.get_text() for t in a1.get_xticklabels()], fontsize=8)
    a3.set_ylabel("model gradient error vs BF16 (%)")
    a3.set_title("Sensitivity scan: gradient (only this layer NVFP4)")
    a2.set_xticks([int(i) for i in layers], [str(i) for i in layers])
    a2.set_xlabel("pattern layer")
    a2.set_ylabel("relative error of the layer's GEMM outputs (%)")
    a2.set_title("Per-layer quantization error (NVFP4 recipe)")
    a2.legend(fontsize=8)
    save(fig, "layers.png")

    # formats
    fig, ax = plt.subplots(figsize=(8, 4.5))
    metrics = list(s["formats"])
    for k, (fmt, color) in enumerate((("nvfp4", "tab:blue"), ("mxfp4", "tab:red"))):
        for i, metric in enumerate(metrics):
            m, e = err(s["formats"][metric][fmt])
            ax.bar(i + (k - 0.5) * 0.35, m, 0.35, yerr=e, color=color, capsize=2,
                   label=fmt.upper() if i == 0 else None)
    ax.set_xticks(range(len(metrics)),
                  ["x", "W", "dY", "Fprop y", "Dgrad dX", "Wgrad dW"])
    ax.set_ylabel("relative error (%)")
    ax.set_title("NVFP4 vs MXFP4: operands (nearest) and the recipes' GEMM outputs")
    ax.legend()
    save(fig, "formats.png")
    return files


def render_readme(res: dict, s: dict) -> str:
    c, mach = res["config"], res["machine"]
    nb, nm = s["n_batches"], s["n_model_batches"]
    tokens = 8 * 128
    L = ["# Component study: what each part of the NVFP4 recipe fixes\n"]
    r_all = s["rht"]["all"]
    sr = s["sr"]
    w = s["w2d"]["all"]
    f = s["formats"]
    last = ACCUMULATE_NS[-1]
    L.append(
        f"Measured on the demo model's own tensors: one BF16 run of {c['steps']} steps, every "
        f"linear's x, W and dY captured on {nb} training batches ({len(c['points'])} points of "
        f"training x {c['batches_per_point']} consecutive steps, {tokens:,} tokens each), and "
        f"each recipe component switched on and off on exactly those tensors with this project's "
        f"quantizers. Intervals: 95 % t-intervals over the captured batches (n given; one value "
        f"per batch, the mean over its linears). Effects are signed so that **positive = the "
        f"component helps**.\n")
    L.append("## Headline\n")
    L.append("| component | what is measured | effect (95 % CI) | n | CI excludes 0 |")
    L.append("|---|---|---|---|---|")
    big = max(sr["point"].get("total/nearest", {ACCUMULATE_NS[-1]: None}))
    at_big = lambda m: sr["point"][m][big] if big > last else sr[m.replace("/", "_")][last]
    rows = [
        ("RHT", "dY values flushed to zero in the Wgrad operand: drop (points)",
         r_all["flush_dy_drop"]),
        ("RHT", "Wgrad error reduction, dY nearest (all linears)", r_all["reduction_nearest"]),
        ("RHT", "Wgrad error reduction, dY stochastic (the recipe)", r_all["reduction_sr"]),
        ("SR", "bias of one micro-batch's dY operand averaged over 32 draws: nearest − SR "
               "(points)", sr["repeat_advantage"][REPEAT_NS[-1]]),
        ("SR", "Wgrad error of one micro-batch: nearest − SR (points)", sr["total_advantage"][1]),
        ("SR", f"Wgrad bias accumulated over {big} micro-batches: nearest − SR (points)",
         at_big("total/advantage") if big > last else sr["total_advantage"][last]),
    ]
    if "sr_steps" in s:
        st = s["sr_steps"]
        rows += [
            ("SR", f"{res['sr_steps']['steps']}-step update error vs BF16: nearest − one SR run "
                   f"(points)", negated(st["sr_minus_nearest"])),
            ("SR", f"{res['sr_steps']['steps']}-step update error vs BF16: nearest − the mean "
                   f"of the {len(res['sr_steps']['seeds'])} SR runs (points; jackknife over "
                   f"seeds)", negated(st["mean_all_minus_nearest"])),
        ]
    rows += [
        ("2D weights", "dX error vs the gradient of what Fprop computed: reduction",
         w["consistency_reduction"]),
        ("2D weights", "dX error vs exact dY·W: reduction", w["dx_reduction"]),
        ("2D weights", "weight error, 16x16 vs 1x16: reduction (negative: a cost)",
         negated(w["w_err_increase"])),
        ("BF16 layers", "loss: (all layers NVFP4) − (recipe)", s["bf16_layers_effect"]["dloss"]),
        ("BF16 layers", "gradient error: (all layers NVFP4) − (recipe) (points)",
         s["bf16_layers_effect"]["grad_err"]),
        ("NVFP4 vs MXFP4", "Fprop output error reduction", f["y_err"]["reduction"]),
        ("NVFP4 vs MXFP4", "Wgrad error reduction", f["wgrad_err"]["reduction"]),
        ("NVFP4 vs MXFP4", "gradient error: MXFP4 − NVFP4 recipe (points)",
         s["mxfp4_effect"]["grad_err"]),
        ("NVFP4 vs MXFP4", "loss: MXFP4 − NVFP4 recipe", s["mxfp4_effect"]["dloss"]),
    ]
    fmt_of = lambda label, ci: (num(ci, "+.5f") if label.startswith("loss") else
                                pct(ci, 100, "+.2f", " points") if "points" in label else
                                pct(ci, 100, "+.1f"))
    for comp, label, ci in rows:
        L.append(f"| {comp} | {label} | {fmt_of(label, ci)} | {ci['n']} | {mark(ci)} |")
    L.append("")
    L.append(verdicts(res, s))
    L.append("## 1. Random Hadamard transform (Wgrad)\n")
    L.append("Relative Frobenius error of the quantized Wgrad `dY^T X` (NVFP4, 1x16 blocks along T, "
             "both operands RHT'd or not, FP32 GEMM) against the FP32 product of the captured BF16 "
             "tensors, mean over the linears of each kind; *reduction* = 1 − with / without, per "
             "batch. Kurtosis: Pearson (Gaussian = 3) of each channel along T (the direction the "
             "blocks and the RHT run), mean over channels, before → after the RHT. *Flushed to 0*: "
             "the share of the operand's nonzero values (after the RHT where on) that its NVFP4 "
             "copy holds as zero, without → with the RHT (nearest rounding).\n")
    L.append("| linears | n | kurtosis x | kurtosis dY | x flushed to 0 | dY flushed to 0 | "
             "no RHT (nearest) | RHT (nearest) | "
             "reduction (nearest) | no RHT (SR) | RHT (SR) | reduction (SR) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for g, row in s["rht"].items():
        L.append(f"| {g} ({row['linears']}) | {row['plain_nearest']['n']} | "
                 f"{row['kurtosis_x']['mean']:.1f} → {row['kurtosis_x_rht']['mean']:.1f} | "
                 f"{row['kurtosis_dy']['mean']:.1f} → {row['kurtosis_dy_rht']['mean']:.1f} | "
                 f"{100 * row['flush_x_plain']['mean']:.2f} → {100 * row['flush_x_rht']['mean']:.2f} % | "
                 f"{100 * row['flush_dy_plain']['mean']:.2f} → {100 * row['flush_dy_rht']['mean']:.2f} % | "
                 f"{pct(row['plain_nearest'], 100, '.2f')} | {pct(row['rht_nearest'], 100, '.2f')} | "
                 f"**{pct(row['reduction_nearest'])}** | {pct(row['plain_sr'], 100, '.2f')} | "
                 f"{pct(row['rht_sr'], 100, '.2f')} | **{pct(row['reduction_sr'])}** |")
    t = s["rht_tails"]
    L.append(f"\nHeavy tails: over the {t['pairs']} (linear, batch) pairs, the quarter with the "
             f"largest max(kurtosis x, kurtosis dY) (≥ {t['kurtosis_heavy_min']:.1f}) has an RHT "
             f"reduction (nearest) of {pct(t['heavy'])}; the lightest quarter (≤ "
             f"{t['kurtosis_light_max']:.1f}) {pct(t['light'])} (intervals over pairs, which "
             f"share batches: indicative).\n")
    L.append("![RHT](rht.png)\n")
    L.append("## 2. Stochastic rounding\n")
    L.append(f"**Accumulated bias.** Each captured batch is split into its {last} sequences, "
             f"one micro-batch each (what gradient accumulation with one sequence per micro-batch "
             f"computes); the quantized Wgrads (full recipe, RHT on, dY nearest or stochastic) "
             f"are summed in FP32 over N micro-batches. *vs exact*: ‖Σ(Q-Wgrad − Wgrad)‖ / "
             f"‖Σ Wgrad‖; *dY rounding only*: the reference keeps the quantized x^T operand, so "
             f"only the rounding of dY is measured. Mean over all linears per batch.\n")
    L.append("| N | coherence ‖ΣWgrad‖ / Σ‖Wgrad‖ | nearest, vs exact | SR, vs exact | "
             "nearest − SR | nearest, dY rounding only | SR, dY rounding only | nearest − SR |")
    L.append("|---|---|---|---|---|---|---|---|")
    for N in ACCUMULATE_NS:
        L.append(f"| {N} | {num(sr['coherence'][N], '.3f')} | {pct(sr['total_nearest'][N], 100, '.2f')} | "
                 f"{pct(sr['total_sr'][N], 100, '.2f')} | **{pct(sr['total_advantage'][N], 100, '+.2f')}** | "
                 f"{pct(sr['operand_nearest'][N], 100, '.2f')} | {pct(sr['operand_sr'][N], 100, '.2f')} | "
                 f"**{pct(sr['operand_advantage'][N], 100, '+.2f')}** |")
    pt = sr.get("point", {})
    for N in sorted(pt.get("total/nearest", {})):
        if N <= last:
            continue
        g = lambda m: pt[m][N]
        L.append(f"| {N} (the point's {N // last} batches; n = {g('total/nearest')['n']} points) | "
                 f"{num(g('coherence'), '.3f')} | {pct(g('total/nearest'), 100, '.2f')} | {pct(g('total/sr'), 100, '.2f')} | "
                 f"**{pct(g('total/advantage'), 100, '+.2f')}** | "
                 f"{pct(g('operand/nearest'), 100, '.2f')} | {pct(g('operand/sr'), 100, '.2f')} | "
                 f"**{pct(g('operand/advantage'), 100, '+.2f')}** |")
    L.append(f"\nFrom N = 1 to N = {last} the bias shrinks by a factor (per batch, bias at {last} / "
             f"bias at 1): vs exact nearest {num(sr['total_nearest_shrink'], '.3f')}, SR "
             f"{num(sr['total_sr_shrink'], '.3f')}; dY rounding only nearest "
             f"{num(sr['operand_nearest_shrink'], '.3f')}, SR {num(sr['operand_sr_shrink'], '.3f')}. "
             f"The coherence column says how much of the accumulated gradient is common to the "
             f"micro-batches: 1 if they all had the same Wgrad, 1/sqrt(N) (here "
             f"{1 / math.sqrt(last):.3f} at N = {last}) if their Wgrads were independent.\n")
    L.append("**One micro-batch drawn N times** (the first sequence of each batch; the Wgrad dY "
             "operand after the RHT): ‖mean of N quantized − exact‖ / ‖exact‖. Nearest rounding "
             "gives the same tensor every time; SR's mean converges to the exact operand.\n")
    L.append("| N | " + " | ".join(str(n) for n in REPEAT_NS) + " |")
    L.append("|---|" + "---|" * len(REPEAT_NS))
    for mode in ("nearest", "sr"):
        L.append(f"| {'stochastic' if mode == 'sr' else 'nearest'} | " + " | ".join(
            f"{100 * s['sr'][f'repeat_{mode}'][n]['mean']:.2f} %" for n in REPEAT_NS) + " |")
    L.append("")
    if "sr_steps" in s:
        st, r = s["sr_steps"], res["sr_steps"]
        L.append(f"**Through optimizer steps.** From the state at step {r['at_step']} (weights, "
                 f"FP32 master weights, Adam moments, LR), {r['steps']} optimizer steps on the "
                 f"same {r['steps']} batches (the next ones of the stream) with the trainer's own "
                 f"`train_step`: BF16, the recipe without SR (deterministic), and the full recipe "
                 f"with {len(r['seeds'])} SR seeds. Update error = ‖ΔW − ΔW_BF16‖ / ‖ΔW_BF16‖ over "
                 f"all FP32 master weights; validation loss with a BF16 forward (BF16 run: "
                 f"{r['bf16_val']:.4f}).\n")
        L.append("| run | update error vs BF16 | validation loss − BF16's |")
        L.append("|---|---|---|")
        L.append(f"| nearest (no SR) | {100 * st['nearest']:.2f} % | {st['val_gap_nearest']:+.5f} |")
        L.append(f"| SR, one run (mean [95 % CI] over {st['sr']['n']} seeds) | "
                 f"{pct(st['sr'], 100, '.2f')} | {num(st['val_gap_sr'], '+.5f')} |")
        L.append(f"| SR, mean update of all {st['sr']['n']} runs (95 % jackknife interval over "
                 f"seeds) | {pct(st['sr_mean_all'], 100, '.2f')} | "
                 f"{num(st['val_gap_sr_mean_update'], '+.5f')} |")
        for k, ci in st["sr_mean_of_k"].items():
            if k in ("1", str(st["sr"]["n"])):
                continue
            L.append(f"| SR, mean update of {k} runs ({ci['n']} disjoint group"
                     f"{'s' if ci['n'] > 1 else ''} of seeds) | {pct(ci, 100, '.2f')} | |")
        L.append("")
    L.append("![SR](sr.png)\n")
    L.append("## 3. 2D (16x16) weight scaling\n")
    L.append("With 1x16 blocks the weight is quantized twice, along K for Fprop and along N for "
             "Dgrad; with 16x16 tiles once, for both. *Mismatch* = ‖W_fprop − W_dgrad‖ / ‖W‖; "
             "*weight error* = ‖W_copy − W‖ / ‖W‖; dX (Dgrad, dY stochastically rounded with the "
             "same draws for both) against the exact dY·W, and against dY·W_fprop, the gradient of "
             "the function the forward pass computed (what the chain rule wants).\n")
    L.append("| linears | mismatch 1x16 | mismatch 16x16 | W err Fprop 1x16 | W err Dgrad 1x16 | "
             "W err 16x16 | dX vs dY·W_fprop 1x16 | 16x16 | reduction | dX vs dY·W 1x16 | 16x16 | "
             "reduction |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for g, row in s["w2d"].items():
        L.append(f"| {g} | {pct(row['w_mismatch/1d'], 100, '.2f')} | "
                 f"{100 * row['w_mismatch/2d']['mean']:.2f} % | "
                 f"{pct(row['w_err/fprop_1d'], 100, '.2f')} | {pct(row['w_err/dgrad_1d'], 100, '.2f')} | "
                 f"{pct(row['w_err/2d'], 100, '.2f')} | {pct(row['dx_consistency/1d'], 100, '.2f')} | "
                 f"{pct(row['dx_consistency/2d'], 100, '.2f')} | **{pct(row['consistency_reduction'])}** | "
                 f"{pct(row['dx_err/1d'], 100, '.2f')} | {pct(row['dx_err/2d'], 100, '.2f')} | "
                 f"**{pct(row['dx_reduction'])}** |")
    L.append("\n![2D weights](weight2d.png)\n")
    L.append("## 4. BF16 first / last layers: per-layer error and sensitivity scan\n")
    L.append(f"Per pattern layer: the relative error of its linears' GEMM outputs under the NVFP4 "
             f"recipe (captured tensors, n = {nb}), and, on the model itself, the loss change and "
             f"the relative error of the whole model's gradient when **only that layer** runs the "
             f"NVFP4 recipe (every other layer BF16; n = {nm} batches, the first "
             f"{c['model_batches_per_point']} of each capture point, same weights as the capture). "
             f"The recipe keeps layers {', '.join(map(str, res['recipe_bf16_layers']))} in BF16.\n")
    L.append("| layer | kinds | in the recipe | Fprop y err | dX err | dW err | loss change "
             "(only this layer NVFP4) | gradient error |")
    L.append("|---|---|---|---|---|---|---|---|")
    for i in sorted(s["layers"], key=int):
        row = s["layers"][i]
        L.append(f"| {i} | {', '.join(row['kinds'])} | {'BF16' if row['bf16_in_recipe'] else 'NVFP4'} | "
                 f"{pct(row['y_err'], 100, '.2f')} | {pct(row['dx_err'], 100, '.2f')} | "
                 f"{pct(row['wgrad_err'], 100, '.2f')} | {num(row['dloss'], '+.5f')} | "
                 f"{pct(row['grad_err'], 100, '.2f')} |")
    order = sorted(s["layers"], key=lambda i: -(s["layers"][i]["dloss"]["mean"] or 0))
    L.append(f"\nLayers by loss sensitivity (most first): {', '.join(str(i) for i in order)}.\n")
    L.append("![layers](layers.png)\n")
    L.append("## 5. NVFP4 vs MXFP4\n")
    L.append("Operand errors with nearest rounding (the formats alone: NVFP4 1x16 blocks with E4M3 "
             "scales and an FP32 tensor scale, MXFP4 1x32 blocks with power-of-two E8M0 scales; the "
             "weight 1x16 here); GEMM outputs under each format's recipe (NVFP4: 16x16 weights, "
             "RHT, SR; MXFP4: 1x32 everywhere, nearest).\n")
    L.append("| quantity | NVFP4 | MXFP4 | reduction by NVFP4 |")
    L.append("|---|---|---|---|")
    names = {"operand_err/x": "x (activation)", "operand_err/w": "W (weight)",
             "operand_err/dy": "dY (gradient)", "y_err": "Fprop output y",
             "dx_err": "Dgrad output dX", "wgrad_err": "Wgrad output dW"}
    for m, row in f.items():
        L.append(f"| {names[m]} | {pct(row['nvfp4'], 100, '.2f')} | {pct(row['mxfp4'], 100, '.2f')} | "
                 f"**{pct(row['reduction'])}** |")
    L.append("\n![formats](formats.png)\n")
    L.append("## 6. The recipe variants on the same batches\n")
    L.append(f"Each ablation recipe (recipes/precision/) applied to the model at the capture points, "
             f"on the same batches and weights as BF16 (n = {nm}): the loss change and the "
             f"relative error of the whole model's gradient against BF16. SR draws are seeded per "
             f"batch and variant.\n")
    L.append("| recipe | loss − BF16 | gradient error vs BF16 | loss − recipe's (paired) | "
             "gradient error − recipe's (paired) |")
    L.append("|---|---|---|---|---|")
    for v, row in s["variants"].items():
        d = s["variant_minus_recipe"].get(v)
        extra = (f"{num(d['dloss'], '+.5f')} | {pct(d['grad_err'], 100, '+.2f', ' points')}"
                 if d else "(reference) | (reference)")
        L.append(f"| `{v}` | {num(row['dloss'], '+.5f')} | {pct(row['grad_err'], 100, '.2f')} | "
                 f"{extra} |")
    L.append("")
    L.append("## How it was run\n")
    L.append(f"```bash\n{res['command']}\n```\n")
    L.append(f"One process, {mach['torch_threads']} torch threads: `train.py`'s trainer built "
             f"in-process with `{' '.join(c['overrides'])}`, trained {c['steps']} steps; capture "
             f"steps {c['points']}; SR optimizer-step experiment: {c['sr_steps']} steps x "
             f"({c['sr_seeds']} SR seeds + nearest + BF16). Final validation loss of the BF16 run "
             f"{res['final_val_loss']:.4f}.\n")
    checks = res["reference_check"]
    if checks:
        worst = max(r["max_abs_diff"] for r in checks)
        L.append(f"Quantizer check: {len(checks)} cases (captured 32x64 slices of x, W and dY of "
                 f"two linears per capture point, NVFP4 1x16 and 16x16, MXFP4 1x32) against the "
                 f"independent per-element reference of tests/nvfp4_recipe/test_quant_reference.py: max "
                 f"|difference| {worst:g}" + (" (bit-identical)." if worst == 0 else ".") + "\n")
    else:
        L.append("Quantizer check: tests/nvfp4_recipe/test_quant_reference.py not found; not checked.\n")
    ph = res["phases"]
    L.append(f"Machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}, Python "
             f"{mach['python']}. Wall time {res['wall_s'] / 60:.1f} min (training "
             f"{ph['train'] / 60:.1f}, model-level passes {ph['model'] / 60:.1f}, tensor-level "
             f"measurements {ph['tensors'] / 60:.1f}, optimizer-step runs "
             f"{ph['sr_steps'] / 60:.1f}); load average (1/5/15 min) {res['load_start']} at the "
             f"start, {res['load_end']} at the end (the study keeps {mach['torch_threads']} threads "
             f"busy; a load above {mach['cores']} means other jobs shared the cores and the wall "
             f"time grew with it). Generated {res['generated']}.\n")
    return "\n".join(L)


def verdicts(res: dict, s: dict) -> str:
    """What each interval says; where an effect is absent or reversed, the measured reason."""
    def sign(ci, good, bad, none="does not measurably change"):  # the verb of a sentence
        if not excludes_zero(ci):
            return none
        return good if ci["mean"] > 0 else bad

    L = ["### Reading\n"]
    r, t = s["rht"]["all"], s["rht_tails"]
    red = r["reduction_nearest"]
    L.append(
        f"- **RHT** does what it is built for: it mixes each 16-run of tokens, so the kurtosis "
        f"along T falls from {r['kurtosis_dy']['mean']:.0f} to {r['kurtosis_dy_rht']['mean']:.0f} "
        f"(dY) and from {r['kurtosis_x']['mean']:.0f} to {r['kurtosis_x_rht']['mean']:.0f} (x), and "
        f"the share of dY values lost to zero falls from {100 * r['flush_dy_plain']['mean']:.1f} % to "
        f"{100 * r['flush_dy_rht']['mean']:.1f} % ({pct(r['flush_dy_drop'], 100, '+.1f', ' points')}). "
        f"Its effect on the Wgrad error (reduction, positive = better) is {pct(red)} with "
        f"nearest rounding and {pct(r['reduction_sr'])} with the recipe's SR: "
        f"{sign(red, 'a gain', 'a cost', 'not resolved at this scale')}.")
    if excludes_zero(red) and red["mean"] < 0:
        L.append(
            f"  Why, at this scale: the operands' energy sits in a few large values per 16-run "
            f"(outlier tokens), which 1x16 scaling already represents almost exactly, since the "
            f"block's scale is fitted to them; the RHT spreads each one over its 16 values, all of "
            f"which then carry the 4-bit relative error, and that costs more than the recovered "
            f"small values gain. On the quarter of (linear, batch) pairs with the highest kurtosis "
            f"(≥ {t['kurtosis_heavy_min']:.0f}) the RHT raises the error by "
            f"{pct(negated(t['heavy']))}, on the lightest quarter (≤ "
            f"{t['kurtosis_light_max']:.0f}) by {pct(negated(t['light']))}. The paper keeps the "
            f"RHT for its 12B model over 10T tokens, whose tensors this study does not have; on "
            f"a small model's tensors its effect on the Wgrad error is a cost that grows with "
            f"the tails.")
    sr = s["sr"]
    last = ACCUMULATE_NS[-1]
    rep = sr["repeat_advantage"][REPEAT_NS[-1]]
    one = sr["total_advantage"][1]
    coh = sr["coherence"][last]
    big = max(sr["point"].get("total/nearest", {last: None}))
    adv_big = sr["point"]["total/advantage"][big] if big > last else sr["total_advantage"][last]
    L.append(
        f"- **Stochastic rounding** is unbiased, and the measurement shows it: one micro-batch's dY "
        f"operand averaged over {REPEAT_NS[-1]} draws is off by "
        f"{pct(sr['repeat_sr'][REPEAT_NS[-1]], 100, '.2f')} with SR and "
        f"{pct(sr['repeat_nearest'][REPEAT_NS[-1]], 100, '.2f')} with nearest, which repeats its "
        f"error every time (nearest − SR {pct(rep, 100, '+.2f', ' points')}). A single draw costs accuracy (one micro-batch's Wgrad: nearest − SR "
        f"{pct(one, 100, '+.2f', ' points')}).")
    if excludes_zero(adv_big) and adv_big["mean"] > 0:
        L.append(f"  Accumulated over {big} micro-batches SR's bias is below nearest's "
                 f"({pct(adv_big, 100, '+.2f', ' points')}).")
    else:
        L.append(
            f"  Accumulated over different micro-batches SR does not catch up within N ≤ {big} "
            f"(nearest − SR {pct(adv_big, 100, '+.2f', ' points')}). Why: the micro-batches' "
            f"gradients are nearly independent (coherence ‖ΣWgrad‖ / Σ‖Wgrad‖ = "
            f"{num(coh, '.2f')} at N = {last}; independent would be {1 / math.sqrt(last):.2f}), so "
            f"nearest's rounding errors are as independent as SR's draws and average out the same "
            f"way; nearest's bias only builds up where the same values are rounded the same way "
            f"many times — the common part of the gradient over many steps, which needs far more "
            f"micro-batches than a CPU run provides.")
    if "sr_steps" in s:
        st = s["sr_steps"]
        d1, dall = st["sr_minus_nearest"], st["mean_all_minus_nearest"]
        steps, runs = res["sr_steps"]["steps"], len(res["sr_steps"]["seeds"])
        text = (f"  Through {steps} optimizer steps from one state (same batches), a single SR run's "
                f"update is {'further from' if d1['mean'] > 0 else 'closer to'} BF16's than "
                f"nearest's (SR − nearest {pct(d1, 100, '+.2f', ' points')}); the mean update of "
                f"{runs} SR runs is off by {pct(st['sr_mean_all'], 100, '.2f')} against nearest's "
                f"{100 * st['nearest']:.2f} % ")
        if excludes_zero(dall) and dall["mean"] < 0:
            text += ("— averaging removes SR's noise and leaves its bias, which is smaller than "
                     "nearest's: the effect that accumulates over a long run.")
        else:
            text += ("— averaging SR runs does not bring it below nearest here "
                     f"({pct(dall, 100, '+.2f', ' points')}).")
        v1, vm = st["val_gap_sr_minus_nearest"], st["val_gap_mean_update_minus_nearest"]
        describe = lambda ci: ("does not separate them" if not excludes_zero(ci) else
                               "is higher with SR" if ci["mean"] > 0 else "is lower with SR")
        text += (f" The validation loss after the steps {describe(v1)} for a single run (SR − "
                 f"nearest {num(v1, '+.5f')}; interval over SR seeds, nearest being one "
                 f"deterministic run) and {describe(vm)} for the mean update "
                 f"({num(vm, '+.5f')}, jackknife).")
        L.append(text)
    w = s["w2d"]["all"]
    L.append(
        f"- **2D weight scaling** makes the Fprop and Dgrad weights identical (two 1x16 copies "
        f"differ by {pct(w['w_mismatch/1d'], 100, '.2f')} of ‖W‖; 16x16 tiles: 0), which "
        f"{sign(w['consistency_reduction'], 'lowers', 'raises')} the error of dX against the "
        f"gradient of what the forward pass computed by {pct(w['consistency_reduction'])}. The "
        f"price is a coarser weight ({pct(w['w_err/2d'], 100, '.2f')} error vs "
        f"{pct(w['w_err/fprop_1d'], 100, '.2f')} for 1x16), so against the exact dY·W the dX "
        f"error changes by {pct(w['dx_reduction'])}"
        + (": 2D scaling trades accuracy for a backward pass that is the derivative of the "
           "forward one." if excludes_zero(w["dx_reduction"]) and w["dx_reduction"]["mean"] < 0
           else "."))
    e = s["bf16_layers_effect"]
    layers = s["layers"]
    by_loss = sorted(layers, key=lambda i: -(layers[i]["dloss"]["mean"] or 0))
    by_grad = sorted(layers, key=lambda i: -(layers[i]["grad_err"]["mean"] or 0))
    bf16 = [int(i) for i in res["recipe_bf16_layers"]]
    resolved = [int(i) for i in layers if excludes_zero(layers[i]["dloss"])]
    L.append(
        f"- **BF16 first/last layers**: quantizing every layer instead of the recipe's changes "
        f"the loss by {num(e['dloss'], '+.5f')} ("
        + ("the interval includes zero" if not excludes_zero(e["dloss"]) else
           "a cost" if e["dloss"]["mean"] > 0 else "a gain") + ") and "
        f"the gradient error by {pct(e['grad_err'], 100, '+.2f', ' points')}. The scan (one "
        f"layer quantized at a time) ranks by gradient error {', '.join(map(str, by_grad))} and "
        f"by loss change {', '.join(map(str, by_loss))}; the recipe's BF16 layers are "
        f"{', '.join(map(str, bf16))}. One layer's loss change is small (median |change| "
        f"{statistics.median(abs(layers[i]['dloss']['mean'] or 0) for i in layers):.1e}) and "
        f"{len(resolved)} of {len(layers)} intervals exclude zero"
        + (f" (layers {', '.join(map(str, resolved))}, of which "
           f"{sum(i in bf16 for i in resolved)} are BF16 in the recipe)" if resolved else "")
        + f"; the gradient error's intervals exclude zero for "
        f"{sum(excludes_zero(layers[i]['grad_err']) for i in layers)} of {len(layers)}.")
    f = s["formats"]
    L.append(
        f"- **NVFP4 vs MXFP4**: NVFP4's 16-element blocks with E4M3 scales cut the operand errors "
        f"by {pct(f['operand_err/x']['reduction'])} (x), {pct(f['operand_err/w']['reduction'])} "
        f"(W) and {pct(f['operand_err/dy']['reduction'])} (dY), and the model's gradient error by "
        f"{pct(s['mxfp4_effect']['grad_err'], 100, '+.2f', ' points')} (MXFP4 − NVFP4); the "
        f"loss difference is {num(s['mxfp4_effect']['dloss'], '+.5f')}"
        + ("" if excludes_zero(s["mxfp4_effect"]["dloss"]) else
           ", which one batch's loss does not resolve (the ablation's 80-step runs did: "
           "docs/ablations/)") + ".")
    v = s["variants"]
    L.append(
        "- **The variants** (section 6): RHT and SR act on the backward pass only, so their "
        "loss is the recipe's; by gradient error against BF16 the recipes order "
        + ", ".join(f"`{k}` {100 * v[k]['grad_err']['mean']:.1f} %"
                    for k in sorted(v, key=lambda k: v[k]["grad_err"]["mean"]))
        + ". Removing RHT changes it by "
        f"{pct(s['variant_minus_recipe']['nvfp4_no_rht']['grad_err'], 100, '+.2f', ' points')}, "
        f"SR by {pct(s['variant_minus_recipe']['nvfp4_no_sr']['grad_err'], 100, '+.2f', ' points')}"
        f", 2D weights by "
        f"{pct(s['variant_minus_recipe']['nvfp4_no_2d']['grad_err'], 100, '+.2f', ' points')} "
        f"(one batch's gradient: SR's variance counts, its unbiasedness does not).")
    L.append("")
    return "\n".join(L)


def write_report(results: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(results)
    plots(results, s, out)
    # Per linear and batch a list of values in the order of "metric_names": ~20k numbers.
    names = sorted({k for b in results["batches"] for m in b["linears"].values() for k in m})
    stored = {**results, "metric_names": names, "batches": [
        {**{k: v for k, v in b.items() if k != "linears"},
         "linears": {n: [m.get(k) for k in names] for n, m in b["linears"].items()}}
        for b in results["batches"]]}
    (out / "results.json").write_text(json.dumps({"summary": s, **stored}, separators=(",", ":"),
                                                 default=str) + "\n")
    (out / "README.md").write_text(render_readme(results, s))
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.components",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="BF16 training steps")
    ap.add_argument("--batches", type=int, default=6,
                    help="captured steps (batches) per capture point (3 points)")
    ap.add_argument("--model-batches", type=int, default=6,
                    help="of those, how many also get the variant and layer-scan passes")
    ap.add_argument("--sr-steps", type=int, default=8, help="optimizer steps per SR run (0: skip)")
    ap.add_argument("--sr-seeds", type=int, default=8, help="SR seeds in the optimizer-step runs")
    ap.add_argument("--seed", type=int, default=1234, help="the BF16 run's trainer.seed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="docs/components")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild README.md and the plots from <out>/results.json")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.chdir(REPO)
    out = Path(args.out)
    if args.report_only:
        results = json.loads((out / "results.json").read_text())
        results.pop("summary", None)
        results = _json_keys(results)
    else:
        results = run_study(args)
    write_report(results, out)
    print(f"report: {out}/README.md, rht.png, sr.png, weight2d.png, layers.png, formats.png, "
          f"results.json")
    return 0


def _json_keys(results: dict) -> dict:
    """results.json as run_study returned it: per-linear value lists back to dicts."""
    results["recipe_bf16_layers"] = [int(i) for i in results["recipe_bf16_layers"]]
    names = results.pop("metric_names")
    for b in results["batches"]:
        b["linears"] = {n: {k: v for k, v in zip(names, values) if v is not None}
                        for n, values in b["linears"].items()}
    return results


if __name__ == "__main__":
    sys.exit(main())
