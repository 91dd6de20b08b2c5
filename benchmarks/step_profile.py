"""Where one training step's time goes, BF16 against emulated NVFP4.

    python -m benchmarks.step_profile [--steps 3] [--repeats 3] [--out docs/benchmarks/step-profile.md]

Builds the demo model as the trainer does (BF16 weights, FP32 main grads and master weights,
the CPU twins of megatron's DDP and optimizer, megatron's loss contract) on random tokens of the
demo shape (2 micro-batches of 4 x 256), and runs the trainer's step: refresh the quantized-weight
caches, forward and backward of each micro-batch, gradient sync and clipping, optimizer step.

Two measurements, every case interleaved with the others round by round (medians of `repeats`
rounds of `steps` steps), so load changes hit all cases alike:
- variants: BF16; NVFP4 as configured; and NVFP4 with one component off at a time (stochastic
  rounding, RHT, 16x16 weight tiles): each difference is what that component costs; NVFP4 with
  the underflow telemetry on (`nvfp4-telemetry`, not a default variant);
- parts: wall time inside the functions that do each part (benchmarks/part_timer.py: hooks
  installed for the profile only; the innermost part owns the time): the emulated linears'
  quantizers, their SR draws, the Wgrad transposes with the RHT, the emulated GEMMs (forward and
  backward: they are autograd Functions), the Mamba scan (forward only), gradient sync +
  clipping, the optimizer. "Rest of the step" is everything else: BF16 GEMMs, attention, conv1d,
  norms, the scan's and attention's backward, autograd.
torch.profiler is not used: its ~10 us per op made an NVFP4 step 7.7x slower, which distorts
exactly the many-small-op parts this is meant to measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from errors import ExitCode
from model.build import build_model
from model.config import ModelConfig
from model.recompute import RecomputeConfig
from nvfp4_recipe.compute import GEMM_COMPUTE, FP32Gemms
from nvfp4_recipe.policy import PrecisionConfig
from nvfp4_recipe.telemetry import ratios
from training.config import TrainerConfig
from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model
from training.distributed import init_distributed, shutdown
from training.schedules import run_micro_batches

from .machine import MachineLoad, machine_summary
from .part_timer import PartTimer

VARIANTS = {  # name -> (format, PrecisionConfig field overrides, trainer.recompute)
    "bf16": ("bf16", {}, "none"),
    "nvfp4": ("nvfp4", {}, "none"),
    "nvfp4-no-sr": ("nvfp4", {"stochastic_rounding": False}, "none"),
    "nvfp4-no-rht": ("nvfp4", {"rht": False}, "none"),
    "nvfp4-1x16-weights": ("nvfp4", {"weight_2d": False}, "none"),
    # NVFP4 with the underflow telemetry measured at every step (precision.telemetry.rows at its
    # default), and collected as the precision controller collects it: at the default cadence
    # (precision.telemetry.every) a run pays 1/every of the difference to nvfp4
    "nvfp4-telemetry": ("nvfp4", {}, "none"),
    "bf16-recompute-selective": ("bf16", {}, "selective"),
    "bf16-recompute-full": ("bf16", {}, "full"),
}
DEFAULT_VARIANTS = ("bf16", "nvfp4", "nvfp4-no-sr", "nvfp4-no-rht", "nvfp4-1x16-weights")


def demo_model_config(hidden_size: int | None = None, recipe: str = "demo"):
    """recipes/model/<recipe>.yaml as the trainer reads it, with the demo tokenizer's vocabulary
    (and another hidden size, for a larger CPU config)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[1] / "recipes" / "model"
                                                / f"{recipe}.yaml"))
    raw.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    cfg.vocab_size = cfg.vocab_size or 4096
    cfg.hidden_size = hidden_size or cfg.hidden_size
    cfg.validate()
    return cfg


def _demo_setup(variant: str, ctx, hidden_size: int | None):
    torch.manual_seed(0)
    cfg = demo_model_config(hidden_size)
    fmt, overrides, recompute = VARIANTS[variant]
    precision = dataclasses.replace(PrecisionConfig(name=fmt, format=fmt), **overrides)
    built = build_model(cfg, precision, vocab_size=cfg.vocab_size, backend="emulated",
                        params_dtype=PARAMS_DTYPE, recompute=RecomputeConfig(recompute))
    if variant == "nvfp4-telemetry":  # what the controller sets on a telemetry step
        built.runtime_state.telemetry_rows = precision.telemetry.rows
    model, optimizer = build_data_parallel_model(built.module, TrainerConfig(), ctx)
    return built.linears, model, optimizer, random_micro_batches(cfg.vocab_size), cfg.hidden_size


def random_micro_batches(vocab_size: int) -> list[dict]:
    """The profiled step's data: 2 micro-batches of 4 x 256 random tokens, the same every run."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab_size, (8, 257), generator=gen)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(4, 256)}
            for t in tokens.split(4)]


class _TalliedGemms:
    """The GEMM compute policy of the profile, keeping one FP32Gemms across steps so that its
    tally (GEMMs by the dtype they computed in) can be reported."""

    def __init__(self, gemm):
        self.gemm = gemm
        self.mode = FP32Gemms() if gemm.dtype == torch.float32 else None

    def context(self):
        return self.mode if self.mode is not None else self.gemm.context()


def _step(linears, model, optimizer, batches, hidden, ctx, gemm, timer: PartTimer) -> None:
    model.zero_grad_buffer()
    optimizer.zero_grad()
    for held in linears:  # what the precision controller does before each step
        held.linear.refresh_weight_cache()
    run_micro_batches(model, batches, ctx, (256, 4, hidden), gemm=gemm)
    with timer.region("step/telemetry collection"):  # the controller's after_step: one sync
        measured = [ratios(counts) for held in linears
                    for counts in held.linear.take_telemetry().values()]
        if measured:
            torch.stack(measured).tolist()
    with timer.region("step/grad_clip"):
        optimizer.prepare_grads()
        optimizer.clip_grad_norm(1.0)
    with timer.region("step/optimizer"):
        optimizer.step_with_ready_grads()


def profile(variants: list[str], steps: int, repeats: int, hidden_size: int | None = None,
            gemm_compute: str = "auto") -> dict:
    ctx = init_distributed(1, 1, "gloo")
    try:
        gemm = _TalliedGemms(ctx.hardware.gemm_compute(gemm_compute))
        setups = {v: _demo_setup(v, ctx, hidden_size) for v in variants}
        with PartTimer() as timer:
            for v in variants:  # warm-up: compiled kernels, allocator
                for _ in range(2):
                    _step(*setups[v], ctx, gemm, timer)
            timer.take()
            tally_before = dict(gemm.mode.counts) if gemm.mode else {}
            meter = MachineLoad().start()
            times = defaultdict(list)
            parts = {v: defaultdict(list) for v in variants}
            for _ in range(repeats):
                for v in variants:  # interleaved: a load change hits every variant alike
                    for _ in range(steps):
                        start = time.perf_counter()
                        _step(*setups[v], ctx, gemm, timer)
                        wall = time.perf_counter() - start
                        seconds, _ = timer.take()
                        times[v].append(wall)
                        for name, value in seconds.items():
                            parts[v][name].append(value)
                        parts[v]["rest of the step"].append(wall - sum(seconds.values()))
            load = meter.stop()
    finally:
        shutdown()
    timed_steps = steps * repeats * len(variants)
    tally = ({k: (n - tally_before[k]) / timed_steps for k, n in gemm.mode.counts.items()}
             if gemm.mode else {})
    return {"median_step_s": {v: statistics.median(t) for v, t in times.items()},
            "gemm_compute": f"{ctx.hardware.describe()}; {gemm.gemm.describe()}",
            "gemms_per_step": tally,
            "parts_s": {v: {name: statistics.median(x) for name, x in p.items()}
                        for v, p in parts.items()},
            "load": load.to_json(), "load_line": load.line(), "steps": steps, "repeats": repeats,
            "hidden_size": setups[variants[0]][4]}


def report(result: dict) -> str:
    variants = list(result["median_step_s"])
    steps = result["median_step_s"]
    base = steps[variants[0]]
    lines = [
        "# One demo training step, part by part",
        "",
        f"Machine: {machine_summary()}. Load: {result['load_line']}.",
        "",
        "Produced by `python -m benchmarks.step_profile` (method in its docstring): demo model at "
        f"hidden size {result['hidden_size']}, medians of {result['repeats']} interleaved rounds "
        f"of {result['steps']} steps per variant.",
        "",
        f"Device: {result['gemm_compute']}."
        + (" GEMMs per step (mean over the variants), by what they computed in: "
           + ", ".join(f"{n:.0f} {k}" for k, n in result["gemms_per_step"].items())
           + " (\"bf16->fp32\": BF16 values multiplied in FP32, nvfp4_recipe/compute.py; \"fp32\": "
             "FP32 operands: the emulated low-precision GEMMs and the Wgrad RHT)."
           if result["gemms_per_step"] else ""),
        "",
        f"| variant | step (median) | vs {variants[0]}{' (LOADED)' if result['load']['loaded'] else ''} |",
        "|---|---:|---:|",
    ]
    for v in variants:
        lines.append(f"| {v} | {steps[v] * 1e3:.0f} ms | {steps[v] / base:.2f}x |")
    shown = [v for v in variants if v in ("bf16", "nvfp4")] or variants[:2]
    names = sorted({n for v in shown for n in result["parts_s"][v]},
                   key=lambda n: -max(result["parts_s"][v].get(n, 0.0) for v in shown))
    lines += ["", "| part | " + " | ".join(f"{v}: ms (% of step)" for v in shown) + " |",
              "|---|" + "---:|" * len(shown)]
    for n in names:
        cells = []
        for v in shown:
            value = result["parts_s"][v].get(n, 0.0)
            cells.append(f"{value * 1e3:.0f} ({100 * value / steps[v]:.0f} %)")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from: {', '.join(VARIANTS)}")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="the demo model at another hidden size (a larger CPU config)")
    parser.add_argument("--gemm-compute", choices=GEMM_COMPUTE, default="auto",
                        help="what BF16 GEMMs compute in (default: this CPU's policy)")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or args.steps < 1 or args.repeats < 1:
        parser.error(f"unknown --variants {bad} (choose from {list(VARIANTS)}); --steps and "
                     "--repeats must be >= 1")
    text = report(profile(variants, args.steps, args.repeats, args.hidden_size,
                          args.gemm_compute))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return ExitCode.OK


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    raise SystemExit(main())
