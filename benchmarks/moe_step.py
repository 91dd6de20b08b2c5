"""The hybrid MoE demo's training step against a dense demo with the same active parameters.

    python -m benchmarks.moe_step [--steps 2] [--repeats 6] [--precisions bf16,nvfp4]
                                  [--out docs/benchmarks/moe-step.md]

Three models, each built as the trainer builds it (BF16 weights, FP32 main grads and master
weights, the CPU twins of megatron's DDP and optimizer) on random tokens of the demo shape (2
micro-batches of 4 x 256), stepping as benchmarks/step_profile.py does:
- `demo_moe` (recipes/model/demo_moe.yaml): 'MEM*EMEME', 8 routed experts of 256, top-2, one
  shared expert of 256;
- `dense_same_active`: the same pattern with each `E` an MLP of 768 = 2 x 256 routed + 256
  shared, so a token passes the same expert weights (the routers' 8 x 256 per layer aside);
- `demo`: the dense demo (MLPs of 1024), for scale.

Tokens per second per model and precision, every case interleaved with the others round by round
(medians of `repeats` rounds of `steps` steps). Parts of the MoE step (benchmarks/part_timer.py;
the innermost timed call owns the time): the router (megatron's TopKRouter: FP32 gating, top-k,
the aux loss and the bias bookkeeping), the dispatch (megatron's all-to-all token dispatcher, its
six stages: token counts, permute, all-to-all, sort by expert, and back), the routed experts
(SequentialMLP with their emulated-precision linears, quantizers included) and the shared
expert, in the forward. For
every model, its feed-forward layers (MoE or MLP) as a whole, forward and backward (module hooks,
`time_ffn_layers`: autograd runs the backward, so its parts cannot be told apart without
torch.profiler's ~10 us per op), and the optimizer, so the MoE model's deficit against its twin
is measured where it arises.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from megatron.core.transformer.mlp import MLP

from errors import ExitCode
from model.build import build_model
from model.config import ModelConfig
from nvfp4_recipe.policy import PrecisionConfig
from training.config import TrainerConfig
from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model
from training.distributed import init_distributed, shutdown

from .machine import MachineLoad, machine_summary
from .part_timer import Part, PartTimer
from .step_profile import _step, _TalliedGemms, demo_model_config, random_micro_batches

MODELS = ("demo_moe", "dense_same_active", "demo")
PRECISIONS = ("bf16", "nvfp4")
ROUTER, DISPATCH, EXPERTS, SHARED = ("moe/router", "moe/dispatch", "moe/routed experts",
                                     "moe/shared expert")
MOE_PARTS = (ROUTER, DISPATCH, EXPERTS, SHARED)
# Every model's feed-forward layers (MoE or MLP) as a whole, and the optimizer: what differs
# between demo_moe and its dense twin, measured rather than inferred.
FFN_FORWARD, FFN_BACKWARD = "ffn layers/forward", "ffn layers/backward"
OPTIMIZER = "optimizer (grad clip + step)"
STEP_REGIONS = ("step/grad_clip", "step/optimizer")  # step_profile._step's
PART_LABELS = (*MOE_PARTS, FFN_FORWARD, FFN_BACKWARD, OPTIMIZER)
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher"


def moe_parts() -> list[Part]:
    """The MoE layer's parts, by the functions that do them (mc 0.16.1: router.py:639,
    token_dispatcher.py:592-849, shared_experts.py:125; model/moe.py's experts)."""
    return [Part("megatron.core.transformer.moe.router.TopKRouter", "forward", ROUTER),
            *(Part(_DISPATCHER, stage, DISPATCH)
              for stage in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                            "combine_preprocess", "token_combine", "combine_postprocess")),
            Part("model.moe.PolicySequentialMLP", "forward", EXPERTS),
            Part("megatron.core.transformer.moe.shared_experts.SharedExpertMLP", "forward",
                 SHARED)]


def time_ffn_layers(module: torch.nn.Module, seconds: dict) -> list:
    """Hooks adding the wall time of every feed-forward layer (a pattern layer's MoELayer or MLP)
    to seconds[FFN_FORWARD] and seconds[FFN_BACKWARD]. The backward runs from the gradient of its
    output arriving (full backward pre-hook) to its input's gradient (full backward hook); CPU
    autograd runs the graph on the caller's thread, newest node first, so the interval is the
    layer's own backward (for an MoE layer: router, dispatch, experts and shared expert).
    Returns the handles."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def timed(label: str):
        started: list[float] = []

        def begin(*_):
            started.append(time.perf_counter())

        def end(*_):
            seconds[label] += time.perf_counter() - started.pop()

        return begin, end

    handles = []
    for layer in module.decoder.layers:
        ffn = getattr(layer, "mlp", None)
        if not isinstance(ffn, (MoELayer, MLP)):
            continue  # Mamba and attention layers (their mlp is megatron's IdentityOp)
        begin, end = timed(FFN_FORWARD)
        handles += [ffn.register_forward_pre_hook(begin), ffn.register_forward_hook(end)]
        begin, end = timed(FFN_BACKWARD)
        handles += [ffn.register_full_backward_pre_hook(begin),
                    ffn.register_full_backward_hook(end)]
    return handles


def model_config(name: str) -> ModelConfig:
    """The recipe's model with the demo tokenizer's vocabulary; `dense_same_active` is
    demo_moe with an MLP of (top-k x expert width + shared width) in place of each MoE layer."""
    cfg = demo_model_config(recipe="demo" if name == "demo" else "demo_moe")
    if name == "dense_same_active":
        moe = cfg.moe
        cfg = dataclasses.replace(
            cfg, pattern=cfg.pattern.replace("E", "-"), moe=None,
            ffn_hidden_size=moe.topk * moe.ffn_hidden_size + moe.shared_expert_ffn_hidden_size)
        cfg.validate()
    return cfg


def active_parameters(cfg: ModelConfig, module: torch.nn.Module) -> int:
    """Parameters a token passes: all but the routed experts it is not sent to."""
    total = sum(p.numel() for p in module.parameters())
    if cfg.moe is None:
        return total
    routed = sum(p.numel() for n, p in module.named_parameters()
                 if ".mlp.experts.local_experts." in n)
    return total - routed * (cfg.moe.num_experts - cfg.moe.topk) // cfg.moe.num_experts


def _setup(name: str, precision: str, ctx, hooked_s: dict):
    torch.manual_seed(0)
    cfg = model_config(name)
    built = build_model(cfg, PrecisionConfig(name=precision, format=precision),
                        vocab_size=cfg.vocab_size, backend="emulated", params_dtype=PARAMS_DTYPE)
    params = (sum(p.numel() for p in built.module.parameters()),
              active_parameters(cfg, built.module))
    time_ffn_layers(built.module, hooked_s)
    model, optimizer = build_data_parallel_model(built.module, TrainerConfig(), ctx)
    return (built.linears, model, optimizer, random_micro_batches(cfg.vocab_size),
            cfg.hidden_size), params


def measure(models: list[str], precisions: list[str], steps: int, repeats: int) -> dict:
    ctx = init_distributed(1, 1, "gloo")
    cases = [(m, p) for p in precisions for m in models]
    try:
        gemm = _TalliedGemms(ctx.hardware.gemm_compute("auto"))
        hooked_s: dict[str, float] = defaultdict(float)  # time_ffn_layers', per step
        built = {case: _setup(*case, ctx, hooked_s) for case in cases}
        with PartTimer(moe_parts()) as timer:
            for case in cases:  # warm-up: compiled kernels, allocator
                for _ in range(2):
                    _step(*built[case][0], ctx, gemm, timer)
            timer.take()
            hooked_s.clear()
            meter = MachineLoad().start()
            times, parts = defaultdict(list), {case: defaultdict(list) for case in cases}
            order = random.Random(0)
            for _ in range(repeats):
                # interleaved, so a load change hits every case alike, in a new order each round,
                # so no case always follows the same one (a step right after an MoE case's runs
                # measurably slower)
                for case in order.sample(cases, len(cases)):
                    for _ in range(steps):
                        start = time.perf_counter()
                        _step(*built[case][0], ctx, gemm, timer)
                        wall = time.perf_counter() - start
                        seconds, _ = timer.take()
                        seconds.update(hooked_s)
                        hooked_s.clear()
                        seconds[OPTIMIZER] = sum(seconds.get(r, 0.0) for r in STEP_REGIONS)
                        times[case].append(wall)
                        for label in PART_LABELS:
                            parts[case][label].append(seconds.get(label, 0.0))
            load = meter.stop()
    finally:
        shutdown()
    tokens = 2 * 4 * 256
    return {"cases": [{"model": m, "precision": p,
                       "parameters": built[(m, p)][1][0], "active": built[(m, p)][1][1],
                       "step_s": statistics.median(times[(m, p)]),
                       "tokens_per_s": tokens / statistics.median(times[(m, p)]),
                       "parts_s": {k: statistics.median(v) for k, v in parts[(m, p)].items()}}
                      for m, p in cases],
            "gemm_compute": gemm.gemm.describe(), "load_line": load.line(),
            "loaded": load.loaded, "steps": steps, "repeats": repeats}


def report(result: dict) -> str:
    cases = {(c["model"], c["precision"]): c for c in result["cases"]}
    precisions = list(dict.fromkeys(p for _, p in cases))
    lines = ["# The hybrid MoE demo's step against dense demos", "",
             f"Machine: {machine_summary()}. Load: {result['load_line']}.", "",
             "Produced by `python -m benchmarks.moe_step` (method in its docstring): medians of "
             f"{result['repeats']} interleaved rounds of {result['steps']} steps per case, "
             f"2 micro-batches of 4 x 256 tokens. BF16 GEMMs: {result['gemm_compute']}.", "",
             "| model | precision | parameters | active | step | tokens/s | "
             "vs dense_same_active |", "|---|---|---:|---:|---:|---:|---:|"]
    for (m, p), c in cases.items():
        same = cases.get(("dense_same_active", p))
        ratio = f"{c['tokens_per_s'] / same['tokens_per_s']:.2f}x" if same else "-"
        lines.append(f"| {m} | {p} | {c['parameters'] / 1e6:.2f}M | {c['active'] / 1e6:.2f}M | "
                     f"{c['step_s'] * 1e3:.0f} ms | {c['tokens_per_s']:,.0f} | {ratio} |")
    lines += ["", "Where each step goes (the feed-forward layers, MoE or MLP, forward and backward; "
              "the optimizer; the rest: Mamba, attention, embedding, loss):", "",
              "| model | precision | step | ffn forward | ffn backward | optimizer | rest |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for (m, p), c in cases.items():
        ffn = [c["parts_s"].get(k, 0.0) for k in (FFN_FORWARD, FFN_BACKWARD, OPTIMIZER)]
        lines.append(f"| {m} | {p} | {c['step_s'] * 1e3:.0f} ms | "
                     + " | ".join(f"{v * 1e3:.0f} ms" for v in ffn)
                     + f" | {(c['step_s'] - sum(ffn)) * 1e3:.0f} ms |")
    lines += ["", "The MoE layers' forward by part (each its share of the whole step):", "",
              "| part | " + " | ".join(f"demo_moe {p}" for p in precisions) + " |",
              "|---|" + "---:|" * len(precisions)]
    for label in MOE_PARTS:
        cells = []
        for p in precisions:
            c = cases.get(("demo_moe", p))
            value = c["parts_s"].get(label, 0.0) if c else 0.0
            cells.append(f"{value * 1e3:.0f} ms ({100 * value / c['step_s']:.1f} %)" if c else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, from: {', '.join(PRECISIONS)}")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from: {', '.join(MODELS)}")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [p for p in precisions if p not in PRECISIONS] + [m for m in models if m not in MODELS]
    if bad or not precisions or not models or args.steps < 1 or args.repeats < 1:
        parser.error(f"unknown {bad} (precisions: {list(PRECISIONS)}, models: {list(MODELS)}); "
                     "--steps and --repeats must be >= 1")
    text = report(measure(models, precisions, args.steps, args.repeats))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return ExitCode.OK


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    raise SystemExit(main())
