"""Hardware bench: `python -m benchmarks.hardware [--quick] [--tokens N] [--json PATH]` (`make bench ARGS=...`).

"What do I get on my machine?" Detects the hardware (CPU, CUDA device and compute capability,
Transformer Engine) and measures, at GEMM shapes of the 12B Nemotron-H model:
  * GEMM throughput (TFLOP/s, forward y = x W^T) per path: torch BF16; FP8 (`torch._scaled_mm`,
    per-tensor E4M3, operands pre-quantized; TE `Float8BlockScaling` on CUDA); NVFP4 through TE
    `NVFP4BlockScaling` (compute capability 10.x only); MXFP8 through TE `MXFP8BlockScaling`
    (CUDA); the nvfp4_recipe emulation of NVFP4 (fast and exact GEMM modes) and of MXFP8 (fast;
    shapes whose K and N are whole 32-blocks; its quantizer compiled where inductor can build it,
    and eager beside it), quantization of x and W included, as in training;
  * a training step (forward, backward, AdamW) of the demo model (and on CUDA of a ~1B hybrid,
    HYBRID_1B below) in BF16 and NVFP4 (TE on 10.x, else emulated): tokens/s and, on a GPU with a
    known peak, MFU against the dense BF16 peak;
  * quantization overhead: the share of the emulated NVFP4 linear (per shape) and of the NVFP4
    training step spent in the quantizers (timing wrappers around the quantizer and RHT entry
    points of nvfp4_recipe.linear).
Prints one rich table (absolute numbers, ratio to the BF16 row of the same case, the path each row
used, skipped rows with the reason) and writes JSON (default runs/bench/<time>-<device>.json) and a
Markdown copy of the table next to it. Timings: warm-up, then interleaved repeats, medians
(benchmarks/timing.py); CUDA synchronized around each timed call; inputs are random normal.

JSON keys (schema_version 1): schema_version, command, hardware (benchmarks.machine.device_info()),
settings {device, quick, tokens, scale, warmup, repeats, train_repeats, shapes, train_models},
rows [{section, case, shape, path, status, ms, value, unit, vs_bf16, vs_peak, note}],
skipped [{section, case, path, reason}], load_average_end, load (benchmarks.machine.LoadReport: load
averages at start and end, CPUs used by other processes, loaded), elapsed_s.
status is "ok", "skipped" (the reason in note) or "error" (the exception in note).
vs_bf16 = BF16 time / this row's time for the same case (>1: faster than BF16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from compat import seed_model_parallel_rng, te_autocast
from model.config import ModelConfig
from model.device import cuda_present, probe_hardware
from model.flops import flops_per_token as model_flops_per_token
from nvfp4_recipe import MXFP8Config, NVFP4Config, nvfp4_linear, quantized_linear
from nvfp4_recipe.mxfp8 import MX_BLOCK
from nvfp4_recipe.linear import emulated_gemm, ops_for
from nvfp4_recipe.megatron.te_mapping import build_te_recipe, probe_te_support
from nvfp4_recipe.policy import PrecisionConfig
from training.distributed import init_distributed

from .machine import MachineLoad, device_info, load_average
from .part_timer import QUANTIZE, SR_DRAWS, WGRAD_TRANSPOSE, PartTimer, step_parts
from .timing import format_table, gemm_tflops, measure_interleaved

SCHEMA_VERSION = 1
CPU_SCALED_MM_MIN_GFLOPS = 5.0  # below this, _scaled_mm on CPU is a reference loop: skip its rows
COLUMNS = ["section", "case", "shape", "path", "ms", "value", "unit", "vs_bf16", "vs_peak", "note"]


# -- shapes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmShape:
    """y (tokens, n) = x (tokens, k) @ W (n, k)^T."""

    name: str
    k: int
    n: int

    def scaled(self, scale: int) -> "GemmShape":
        return GemmShape(self.name, _round16(self.k / scale), _round16(self.n / scale))


def _round16(v: float) -> int:
    """Nearest multiple of 16 (NVFP4 blocks and 16x16 weight tiles need it)."""
    return max(16, int(round(v / 16)) * 16)


# The 12B Nemotron-H linears (/work/shared/notes/nemotron-h-12b.md): hidden 5120, MLP 20480,
# Mamba in_proj 5120 -> 2*10240 + 2*8*128 + 128 = 22656, attention qkv 5120 -> 40*128 + 2*8*128.
SHAPES_12B = (
    GemmShape("mlp fc1", 5120, 20480),
    GemmShape("mamba in_proj", 5120, 22656),
    GemmShape("attn qkv", 5120, 7168),
)

# A ~1B hybrid for GPU training steps (defined here; not a recipe): Nemotron-H proportions
# (Mamba : MLP : attention = 12 : 12 : 2), hidden 2048, MLP 8192, 16 query / 4 KV heads of 128,
# Mamba 64 heads x 64 (= 2 x hidden), state 128, 8 groups, vocab 131072 (untied).
# ~0.78B in the GEMMs + 0.54B embedding/output = ~1.3B parameters.
HYBRID_1B = dict(
    name="hybrid_1b",
    pattern="M-M-M-M*-M-M-M-M-M-M-M*-M-",
    hidden_size=2048, ffn_hidden_size=8192,
    num_attention_heads=16, num_query_groups=4, kv_channels=128,
    mamba_num_heads=64, mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8,
    mamba_chunk_size=128, vocab_size=131072, max_sequence_length=4096,
    init_method_std=0.02, bf16_first_layers=1, bf16_last_layers=2,
)


def _row(section: str, case: str, shape: str, path: str, status: str = "ok", ms: float | None = None,
         value: float | None = None, unit: str = "", vs_bf16: float | None = None,
         vs_peak: float | None = None, note: str = "") -> dict[str, object]:
    return {"section": section, "case": case, "shape": shape, "path": path, "status": status,
            "ms": ms, "value": value, "unit": unit, "vs_bf16": vs_bf16, "vs_peak": vs_peak,
            "note": note}


def _skip(section: str, case: str, shape: str, path: str, reason: str) -> dict[str, object]:
    return _row(section, case, shape, path, status="skipped", note=reason)


def _error(section: str, case: str, shape: str, path: str, exc: BaseException) -> dict[str, object]:
    return _row(section, case, shape, path, status="error", note=f"{type(exc).__name__}: {exc}"[:300])


def _capability() -> tuple[int, int] | None:
    return probe_hardware().cuda_capability


def te_status(fmt: str) -> tuple[bool, str]:
    """Whether the TE row of a format ("bf16", "fp8", "nvfp4", "mxfp8") can run here, and why
    not."""
    return probe_te_support(PrecisionConfig(name=fmt, format=fmt), _capability())


def _te_recipe(fmt: str):
    return build_te_recipe(PrecisionConfig(name=fmt, format=fmt))


# -- GEMMs ----------------------------------------------------------------------------------------
def scaled_mm_status(device: torch.device) -> tuple[bool, str]:
    """Whether torch._scaled_mm runs an E4M3 x E4M3 GEMM on this device (probed, not assumed)."""
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda" and _capability() < (8, 9):
        major, minor = _capability()
        return False, f"FP8 GEMMs need compute capability 8.9 or newer, found {major}.{minor}"
    try:
        a = torch.randn(32, 64, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(32, 64, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        ref = a.float() @ b.float().t()
        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        if not math.isfinite(err) or err > 1e-2:
            return False, f"torch._scaled_mm ran but is wrong here (max rel err {err:.3g})"
        if device.type == "cpu":
            # torch 2.13 CPU runs it (correctly) through a reference loop: measured ~3 MFLOP/s at
            # 64x1280x256. Probe the speed; timing the real shapes would take minutes per call.
            a = torch.randn(64, 256).to(torch.float8_e4m3fn)
            b = torch.randn(128, 256).to(torch.float8_e4m3fn)
            start = time.perf_counter()
            torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            gflops = 2 * 64 * 256 * 128 / (time.perf_counter() - start) / 1e9
            if gflops < CPU_SCALED_MM_MIN_GFLOPS:
                return False, (f"torch._scaled_mm works for float8_e4m3fn on CPU in torch "
                               f"{torch.__version__} (correct results) but runs at {gflops:.3g} "
                               f"GFLOP/s (a reference loop, no FP8 kernel): not timed")
    except Exception as exc:
        return False, f"torch._scaled_mm fails on {device.type}: {type(exc).__name__}: {exc}"[:200]
    return True, ""


def bench_gemms(shapes: list[GemmShape], tokens: int, device: torch.device, warmup: int,
                repeats: int, peak: float | None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    skip_rows: list[dict[str, object]] = []
    seen_skips: set[tuple[object, object]] = set()
    fp8_ok, fp8_why = scaled_mm_status(device)
    gemm = probe_hardware(device).gemm_compute()
    te_ok = {fmt: te_status(fmt) for fmt in ("bf16", "fp8", "nvfp4", "mxfp8")}
    for shape in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, shape.k, device=device, dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(shape.n, shape.k, device=device, dtype=torch.bfloat16, generator=gen)
             / shape.k ** 0.5)
        label = f"{tokens}x{shape.k}x{shape.n}"
        x32, w32 = x.float(), w.float()
        paths: dict[str, tuple[str, Callable[[], object]]] = {
            "bf16": ("torch bf16 (F.linear)", lambda: F.linear(x, w)),
            "fp32": ("torch fp32 (F.linear)", lambda: F.linear(x32, w32)),
            "nvfp4 fast": ("emulated (nvfp4_recipe, fast)",
                           lambda: nvfp4_linear(x, w, None, NVFP4Config(gemm="fast"))),
            "nvfp4 exact": ("emulated (nvfp4_recipe, exact)",
                            lambda: nvfp4_linear(x, w, None, NVFP4Config(gemm="exact"))),
        }
        # The same fast-mode GEMM on operands quantized once, outside the timing: the GEMM share.
        # Quantized as the emulation quantizes them under this GEMM policy (FP32 operands where
        # BF16 GEMMs compute in FP32), so the timed GEMM is the emulation's own.
        with gemm.context():
            fast_ops = ops_for(NVFP4Config(gemm="fast"), x.device)
            xq, wq = fast_ops.activation(x), fast_ops.weight_fprop(w)
        paths["nvfp4 fast, pre-quantized"] = (
            "emulated GEMM only (nvfp4_recipe, fast)",
            lambda: emulated_gemm(xq, wq, torch.bfloat16, fast_ops.gemm_out_dtype))
        notes = {"bf16": gemm.describe(), "fp32": "FP32 tensors",
                 "nvfp4 fast": "quantizes x (1x16) and W (16x16) per call",
                 "nvfp4 exact": "fp32 GEMM of q*s; quantizes per call",
                 "nvfp4 fast, pre-quantized": "operands quantized outside the timing"}
        skipped: list[dict[str, object]] = []
        # MXFP8 (TE's MXFP8BlockScaling emulated): K and N whole 32-blocks, else no row for it.
        if shape.k % MX_BLOCK == 0 and shape.n % MX_BLOCK == 0:
            paths["mxfp8 fast"] = ("emulated (nvfp4_recipe, fast)",
                                   lambda: quantized_linear(x, w, None, MXFP8Config(gemm="fast")))
            notes["mxfp8 fast"] = "quantizes x and W (1x32, E4M3 + E8M0) per call"
            # The same linear with the eager quantizer: what the compiled one (kernels="auto",
            # nvfp4_recipe/mxfp8.py "Kernels") saves, interleaved with it.
            paths["mxfp8 fast, eager"] = (
                "emulated (nvfp4_recipe, fast, kernels=eager)",
                lambda: quantized_linear(x, w, None, MXFP8Config(gemm="fast", kernels="eager")))
            notes["mxfp8 fast, eager"] = "as mxfp8 fast, eager quantizer (PyTorch ops)"
        else:
            rows.append(_skip("gemm", f"{shape.name}: mxfp8 fast", label,
                              "emulated (nvfp4_recipe, fast)",
                              f"K {shape.k} or N {shape.n} not a multiple of the MXFP8 block "
                              f"({MX_BLOCK})"))
        if fp8_ok:
            amax_x, amax_w = x.abs().amax().float(), w.abs().amax().float()
            sx, sw = (448.0 / amax_x), (448.0 / amax_w)
            x8 = (x.float() * sx).to(torch.float8_e4m3fn)
            w8 = (w.float() * sw).to(torch.float8_e4m3fn)
            inv_x, inv_w = (1.0 / sx).reshape(()), (1.0 / sw).reshape(())
            paths["fp8 scaled_mm"] = (
                "torch._scaled_mm (E4M3, per-tensor)",
                lambda: torch._scaled_mm(x8, w8.t(), scale_a=inv_x, scale_b=inv_w,
                                         out_dtype=torch.bfloat16))
            notes["fp8 scaled_mm"] = "operands pre-quantized; GEMM only"
        else:
            skipped.append(_skip("gemm", "fp8 scaled_mm", label, "torch._scaled_mm (E4M3)", fp8_why))
        for fmt, case, path in (("bf16", "te bf16", "TE Linear (bf16)"),
                                ("fp8", "te fp8 block", "TE Linear, Float8BlockScaling"),
                                ("nvfp4", "te nvfp4", "TE Linear, NVFP4BlockScaling"),
                                ("mxfp8", "te mxfp8", "TE Linear, MXFP8BlockScaling")):
            ok, why = te_ok[fmt]
            if not ok:
                skipped.append(_skip("gemm", case, label, path, why))
                continue
            try:
                paths[case] = (path, _te_linear_fn(fmt, x, w))
                notes[case] = "quantizes x and W per call" if fmt != "bf16" else ""
            except Exception as exc:
                skipped.append(_error("gemm", case, label, path, exc))
        with torch.no_grad():
            # BF16 and emulated GEMMs compute as the device's GEMM policy says (FP32 on BF16
            # values on a CPU without BF16 instructions: nvfp4_recipe/compute.py).
            fns = {case: _under(gemm, fn) for case, (_, fn) in paths.items()}
            try:
                seconds = measure_interleaved(fns, warmup=warmup, repeats=repeats)
            except Exception:  # find the failing path, time the others
                seconds = {}
                for case, fn in fns.items():
                    try:
                        seconds[case] = measure_interleaved({case: fn}, warmup, repeats)[case]
                    except Exception as exc:
                        skipped.append(_error("gemm", case, label, paths[case][0], exc))
        base = seconds.get("bf16")
        for case, s in seconds.items():
            tf = gemm_tflops(tokens, shape.k, shape.n, s)
            rows.append(_row("gemm", f"{shape.name}: {case}", label, paths[case][0], ms=s * 1e3,
                             value=tf, unit="TFLOP/s", vs_bf16=(base / s) if base else None,
                             vs_peak=(tf / peak) if peak else None, note=notes.get(case, "")))
        if "nvfp4 fast" in seconds and "nvfp4 fast, pre-quantized" in seconds:
            share = 1.0 - seconds["nvfp4 fast, pre-quantized"] / seconds["nvfp4 fast"]
            rows.append(_row("overhead", f"{shape.name}: quantize share of emulated linear fwd",
                             label, "emulated (nvfp4_recipe, fast)", value=100.0 * share, unit="%",
                             note="1 - t(GEMM on pre-quantized) / t(linear fwd with quantization)"))
        for r in skipped:  # a path skipped for one shape is skipped for all: one row per path
            if r["status"] == "error":
                rows.append(dict(r, case=f"{shape.name}: {r['case']}"))
                continue
            key = (r["case"], r["note"])
            if key not in seen_skips:
                seen_skips.add(key)
                skip_rows.append(dict(r, shape="all shapes"))
        del x, w, xq, wq, x32, w32
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows + skip_rows


def _under(gemm, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with its GEMMs computed as the GEMM compute policy `gemm` says."""
    def run():
        with gemm.context():
            return fn()
    return run


def _te_linear_fn(fmt: str, x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    """te.Linear(k, n) with our weights; forward under TE's autocast with the format's recipe."""
    import transformer_engine.pytorch as te

    layer = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=torch.bfloat16,
                      device=x.device)
    with torch.no_grad():
        layer.weight.copy_(w)
    if fmt == "bf16":
        return lambda: layer(x)
    recipe = _te_recipe(fmt)

    def run():
        with te_autocast(recipe):
            return layer(x)

    return run


# -- training steps -------------------------------------------------------------------------------
def flops_per_token(cfg, seq: int, vocab: int) -> float:
    """Model FLOPs per token of a training step, for MFU: model/flops.py's count (the planner's
    too): 6 x (GEMM weights + output layer) + causal attention + the SSD scan + conv1d, with the
    output layer at the padded vocabulary the model is built with."""
    # deferred: model.build imports megatron, which a bare GPU machine may lack: the GEMM rows run
    # without it
    from model.build import padded_vocab_size

    return model_flops_per_token(cfg, seq, padded_vocab_size(vocab, cfg.vocab_multiple, 1))


def _quantization_timer() -> PartTimer:
    """The step profile's hooks (benchmarks/part_timer.py) on the quantization parts only: every
    GEMM operand's quantizer, the SR draws, the Wgrad transposes with the RHT."""
    return PartTimer([p for p in step_parts() if p.label in (QUANTIZE, SR_DRAWS, WGRAD_TRANSPOSE)])


_DIST_READY = False


def _ensure_parallel_state():
    global _DIST_READY
    if not _DIST_READY:
        init_distributed(1, 1, "auto")
        _DIST_READY = True


def bench_training(model_name: str, model_cfg, micro_batch: int, seq: int, device: torch.device,
                   warmup: int, repeats: int, peak: float | None) -> list[dict[str, object]]:
    from model.build import build_model, choose_backend  # deferred: megatron, as in flops_per_token

    _ensure_parallel_state()
    vocab = model_cfg.vocab_size or 4096
    tokens = micro_batch * seq
    label = f"{model_name} {micro_batch}x{seq}"
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen).to(device)
    inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    fpt = flops_per_token(model_cfg, seq, vocab)
    rows, seconds, paths, notes = [], {}, {}, {}
    gemm = probe_hardware(device).gemm_compute()
    for fmt in ("bf16", "nvfp4"):
        precision = PrecisionConfig(name=fmt, format=fmt)
        backend, reason = choose_backend(precision, model_cfg.spec, probe_hardware(device))
        path = {"te": f"TE ({'NVFP4BlockScaling' if fmt == 'nvfp4' else 'bf16'})",
                "emulated": "emulated (nvfp4_recipe, fast)" if fmt == "nvfp4" else "torch bf16"}[backend]
        try:
            seed_model_parallel_rng(1234, cuda=device.type == "cuda")
            try:
                built = build_model(model_cfg, precision, vocab_size=vocab, backend=backend,
                                    params_dtype=torch.bfloat16)
            except Exception as exc:  # e.g. the TE spec without mamba_ssm: fall back, say so
                if backend != "te":
                    raise
                backend, reason = "emulated", f"TE build failed ({type(exc).__name__}: {exc})"[:160]
                path = "emulated (nvfp4_recipe, fast)" if fmt == "nvfp4" else "torch bf16"
                built = build_model(model_cfg, precision, vocab_size=vocab, backend=backend,
                                    params_dtype=torch.bfloat16)
            # BF16 weights and activations as in training (TE's NVFP4 quantizer with RHT takes
            # BF16 only); AdamW directly on them stands in for the FP32-master optimizer step.
            model = built.module.to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

            def step(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = model(inputs, None, None, labels=labels).float().mean()
                loss.backward()
                opt.step()
                return loss

            step = _under(gemm, step)
            for _ in range(warmup):
                step()
            step_s = measure_interleaved({fmt: step}, warmup=0, repeats=repeats)[fmt]
            seconds[fmt], paths[fmt] = step_s, path
            notes[fmt] = f"backend {backend} ({reason})" if backend == "te" or fmt != "bf16" else ""
            if fmt == "nvfp4" and backend == "emulated":
                with _quantization_timer() as timer:
                    t0 = time.perf_counter()
                    n = 1 if device.type == "cuda" else max(1, min(2, repeats))
                    for _ in range(n):
                        step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    total = time.perf_counter() - t0
                part_seconds, _ = timer.take()
                parts = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(part_seconds.items()))
                rows.append(_row("overhead", f"{model_name}: quantize share of step", label,
                                 path, value=100.0 * sum(part_seconds.values()) / total, unit="%",
                                 note=f"{n} instrumented steps: {parts}"))
            elif fmt == "nvfp4":
                rows.append(_skip("overhead", f"{model_name}: quantize share of step", label,
                                  path, "TE fuses quantization into its kernels; use nsys for a split"))
            del model, opt, built
        except Exception as exc:
            traceback.print_exc()
            rows.append(_error("train", f"{model_name}: {fmt} step", label, path, exc))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = seconds.get("bf16")
    train_rows = []
    for fmt, s in seconds.items():
        tps = tokens / s
        mfu = tps * fpt / 1e12 / peak if peak else None
        train_rows.append(_row("train", f"{model_name}: {fmt} step", label, paths[fmt], ms=s * 1e3,
                               value=tps, unit="tokens/s", vs_bf16=(base / s) if base else None,
                               vs_peak=mfu, note=(notes[fmt] + f"; {fpt / 1e6:.1f} MFLOP/token")
                               .lstrip("; ")))
    return train_rows + rows


# -- output ---------------------------------------------------------------------------------------
def _fmt(value: object, key: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if key == "vs_peak":
            return f"{100 * value:.1f}%"
        if key == "vs_bf16":
            return f"{value:.2f}x"
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(rows: list[dict[str, object]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows, COLUMNS))
        return
    table = Table(title=title, show_lines=False)
    for col in COLUMNS:
        table.add_column(col, overflow="fold", no_wrap=col not in ("note", "case", "path"))
    for r in rows:
        style = {"skipped": "dim", "error": "red"}.get(r["status"])
        cells = [_fmt(r.get(c), c) for c in COLUMNS]
        if r["status"] != "ok":
            cells[COLUMNS.index("ms")] = r["status"]
        table.add_row(*cells, style=style)
    Console(width=max(160, int(os.environ.get("COLUMNS", "0") or 0))).print(table)


def markdown_table(rows: list[dict[str, object]]) -> str:
    md_rows = []
    for r in rows:
        cells = {c: _fmt(r.get(c), c) for c in COLUMNS}
        if r["status"] != "ok":
            cells["ms"] = r["status"]
        md_rows.append(cells)
    return format_table(md_rows, COLUMNS)


def default_json_path(info: dict[str, object]) -> Path:
    name = str(info.get("gpu") or "cpu").replace(" ", "_").replace("/", "_")
    return Path("runs/bench") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hardware", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="scaled-down shapes (12B dims / 8, 256 tokens), demo step at 2x64: < 1 min on 2 CPU cores")
    p.add_argument("--tokens", type=int, default=None,
                   help="GEMM rows (M); default 8192 on CUDA, 1024 on CPU, 256 with --quick")
    p.add_argument("--scale", type=int, default=None,
                   help="divide the 12B GEMM dims by this (default 1; 8 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3 CUDA, 1 CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median (default 10 CUDA, 3 CPU)")
    p.add_argument("--no-gemm", action="store_true", help="skip the GEMM rows")
    p.add_argument("--no-train", action="store_true", help="skip the training-step rows")
    p.add_argument("--train-models", default=None,
                   help="comma list of demo,1b (default: demo on CPU, demo,1b on CUDA)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write results here (default runs/bench/<time>-<device>.json; .md beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.device == "auto":
        device = torch.device("cuda" if cuda_present() else "cpu")
    else:
        device = torch.device(args.device)
    cuda = device.type == "cuda"
    tokens = args.tokens or (256 if args.quick else 8192 if cuda else 1024)
    scale = args.scale or (8 if args.quick else 1)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    repeats = args.repeats or (10 if cuda else 3)
    train_models = (args.train_models or ("demo,1b" if cuda and not args.quick else "demo")).split(",")
    shapes = [s.scaled(scale) for s in SHAPES_12B]
    info = device_info()
    peak = info["bf16_peak_tflops"] if cuda else None
    settings = {
        "device": str(device), "quick": args.quick, "tokens": tokens, "scale": scale,
        "warmup": warmup, "repeats": repeats,
        "train_repeats": args.repeats or (2 if args.quick else 3),
        "shapes": [{"name": s.name, "m": tokens, "k": s.k, "n": s.n} for s in shapes],
        "train_models": train_models,
    }
    hw = (f"{info['cpu']} ({info['cpu_count']} cores, {info['torch_threads']} torch threads), "
          f"load {info['load_average']}, torch {info['torch']}")
    if info.get("gpu"):
        hw += f"; {info['gpu']} (cc {info['gpu_capability']}), CUDA {info['cuda_runtime']}"
    te = info["transformer_engine"]
    hw += f"; TE {te['version']}" if te["importable"] else "; TE not importable"
    print(f"hardware: {hw}")
    print(f"shapes (tokens x K x N): " + ", ".join(f"{s.name} {tokens}x{s.k}x{s.n}" for s in shapes)
          + (f" (12B dims / {scale})" if scale != 1 else ""))
    if cuda:
        print(f"BF16 peak: {peak} TFLOP/s ({info['bf16_peak_source']})")
    rows: list[dict[str, object]] = []
    meter = MachineLoad().start()
    if not args.no_gemm:
        rows += bench_gemms(shapes, tokens, device, warmup, repeats, peak)
    if not args.no_train:
        for name in train_models:
            if name == "demo":
                mb, seq = (2, 64) if args.quick else (4, 256)
                cfg = ModelConfig(vocab_size=4096)
            elif name == "1b":
                if not cuda:
                    rows.append(_skip("train", "hybrid_1b: bf16/nvfp4 steps", "-", "-",
                                      "the ~1B hybrid runs on CUDA only (minutes per step on CPU)"))
                    continue
                mb, seq = 2, 4096
                cfg = ModelConfig(**HYBRID_1B)
            else:
                raise SystemExit(f"--train-models: unknown model {name!r}; use demo or 1b")
            rows += bench_training(cfg.name, cfg, mb, seq, device, warmup=1,
                                   repeats=settings["train_repeats"], peak=peak)
    load = meter.stop()
    if not cuda:
        rows.append(_skip("train", "MFU", "-", "-", info["bf16_peak_source"]))
    skipped = [{k: r[k] for k in ("section", "case", "path")} | {"reason": r["note"]}
               for r in rows if r["status"] != "ok"]
    results = {
        "schema_version": SCHEMA_VERSION,
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.hardware", *(argv or sys.argv[1:])]),
        "hardware": info, "settings": settings, "rows": rows, "skipped": skipped,
        "load_average_end": load_average(), "load": load.to_json(),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    title = f"nvfp4-pretrain bench on {info.get('gpu') or info['cpu']} ({device.type})"
    if load.loaded:
        title += " (LOADED machine: ratios not comparable to idle runs)"
    print_table(rows, title)
    print(f"machine: {load.line()}; {results['elapsed_s']} s")
    path = Path(args.json) if args.json else default_json_path(info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))
    path.with_suffix(".md").write_text(f"{title}\n\n{hw}\n\n{markdown_table(rows)}\n")
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return results


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    try:
        main()
    finally:
        if _DIST_READY:
            from training.distributed import shutdown

            shutdown()
