"""The memory plan against a real run: `python -m benchmarks.memory --measure [--recompute
none,selective,full,full:block:4] [--repeats 3] [--json PATH]` (results and method:
docs/benchmarks/memory-plan.md).

Trains the demo-shaped model a few optimizer steps on random tokens on CPU, built and stepped as
the trainer does, in a fresh process per setting with glibc's allocator made to return freed
buffers (MALLOC_ENV), and compares the process's RSS with the dry run's plan of the same
configuration (training/plan.py, model/memory_model.py): static memory, peak, activations, and what
autograd saves per layer kind against model/memory_model.py's per-layer count.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from compat import seed_model_parallel_rng
from errors import ExitCode
from model.build import build_model
from model.config import LAYER_SYMBOLS
from model.memory_model import BYTES_ACTIVATION, GIB, activation_elements_per_token, stage_activation_bytes
from model.recompute import RecomputeConfig
from training.config import TrainConfig
from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model
from training.distributed import ParallelContext
from training.plan import PlanConfig, build_plan, recompute_config_of
from training.schedules import run_micro_batches

from .machine import load_average, machine_summary



def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """VmHWM (resettable) where the kernel has it, else the lifetime ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def parse_recompute(text: str) -> tuple[str, str, int]:
    """'none' | 'selective' | 'full[:uniform|block[:N]]' -> (granularity, method, layers)."""
    parts = text.split(":")
    granularity = parts[0]
    method = parts[1] if len(parts) > 1 else "uniform"
    layers = int(parts[2]) if len(parts) > 2 else 1
    RecomputeConfig(granularity, method, layers).validate("--recompute")
    return granularity, method, layers


def measure_config(*, steps: int = 2, micro_batches: int = 2, micro_batch_size: int = 4,
                   seq_length: int = 256, hidden_size: Optional[int] = None,
                   vocab_size: int = 4096, recompute: str = "none"):
    """The TrainConfig `measure` trains (and plans): the demo shape, the BF16 recipe."""
    cfg = TrainConfig()
    cfg.model.vocab_size = vocab_size
    if hidden_size is not None:
        cfg.model.hidden_size = hidden_size
    cfg.model.max_sequence_length = max(cfg.model.max_sequence_length, seq_length)
    tr = cfg.trainer
    tr.micro_batch_size = micro_batch_size
    tr.global_batch_size = micro_batch_size * micro_batches
    tr.seq_length = seq_length
    tr.max_steps = steps
    tr.recompute, tr.recompute_method, tr.recompute_layers = parse_recompute(recompute)
    return cfg


def _build_like_trainer(cfg, vocab: int, ctx):
    """Model, data-parallel wrapper and optimizer as training/trainer.py builds them."""
    built = build_model(cfg.model, cfg.precision, vocab_size=vocab, backend="emulated",
                        params_dtype=PARAMS_DTYPE, recompute=recompute_config_of(cfg.trainer))
    model, optimizer = build_data_parallel_model(built.module, cfg.trainer, ctx)
    return model, optimizer


def _train(cfg, vocab: int, ctx, steps: int, micro_batches: int):
    """`steps` optimizer steps on random tokens, as Trainer.train_step runs them."""
    import torch

    tr = cfg.trainer
    model, optimizer = _build_like_trainer(cfg, vocab, ctx)
    gen = torch.Generator().manual_seed(0)
    shape = (tr.seq_length, tr.micro_batch_size, cfg.model.hidden_size)
    for _ in range(steps):
        batches = []
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (tr.micro_batch_size, tr.seq_length + 1),
                                   generator=gen)
            batches.append({"tokens": tokens[:, :-1].contiguous(),
                            "labels": tokens[:, 1:].contiguous(),
                            "loss_mask": torch.ones(tr.micro_batch_size, tr.seq_length)})
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        run_micro_batches(model, batches, ctx, shape)
        optimizer.prepare_grads()
        optimizer.clip_grad_norm(tr.grad_clip)
        optimizer.step_with_ready_grads()
        del batches
    return model, optimizer


def saved_activation_bytes(model, kinds: list[str], batch: dict) -> dict[str, Any]:
    """Bytes autograd saves for backward in one forward of `batch`, by what saved them: each
    decoder layer (averaged per kind) and the rest ("head": embedding, final norm, output layer,
    loss). Each storage is counted once, at its full size (a view keeps all of it alive);
    parameters are not activations and are left out."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    stack = next(m for m in model.modules()
                 if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen = ["head"], {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params and ptr not in seen:
                seen[ptr] = (where[0], storage.nbytes())
        return t

    handles = []
    for i, layer in enumerate(stack.layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: where.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda *_: where.__setitem__(0, "head")))
    try:
        with saved_tensors_hooks(pack, lambda t: t):
            out = model(batch["tokens"], None, None, labels=batch["labels"])
        del out
    finally:
        for h in handles:
            h.remove()
    per_layer = [0] * len(stack.layers)
    head = 0
    for owner, nbytes in seen.values():
        if owner == "head":
            head += nbytes
        else:
            per_layer[owner] += nbytes
    by_kind = {}
    for kind in dict.fromkeys(kinds):
        sizes = [n for n, k in zip(per_layer, kinds) if k == kind]
        by_kind[kind] = sum(sizes) / len(sizes)
    return {"per_layer_by_kind": by_kind, "head": head, "total": head + sum(per_layer)}


def measure(steps: int = 2, micro_batches: int = 2, micro_batch_size: int = 4,
            seq_length: int = 256, hidden_size: Optional[int] = None,
            vocab_size: int = 4096, recompute: str = "none") -> dict[str, Any]:
    """Train the demo-shaped model `steps` optimizer steps on random tokens on CPU, built and
    stepped as the trainer does (BF16 weights, FP32 main grads, FP32 master + Adam, the
    trainer's recompute), and compare its memory with the plan of the same configuration.

    Measured = RSS high-water mark minus the RSS before the model is built (reset after a
    warm-up), so every allocation torch makes counts, short-lived ones included. Static = RSS
    after the last step (weights, grads, optimizer; activations freed) minus the same baseline.
    RSS is page-granular and includes allocator caching: run it in a fresh process with
    glibc's mmap threshold fixed (main() does)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = False
    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                                rank=0)
        created = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    ctx = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                          pipeline_rank=0, data_rank=0, device=torch.device("cpu"))
    cfg = measure_config(steps=steps, micro_batches=micro_batches,
                         micro_batch_size=micro_batch_size, seq_length=seq_length,
                         hidden_size=hidden_size, vocab_size=vocab_size, recompute=recompute)
    started = time.perf_counter()
    try:
        planned = build_plan(cfg, PlanConfig(gpus=1, backend="emulated"))
        seed_model_parallel_rng(cfg.trainer.seed, cuda=False)
        # Warm-up on a 16x narrower model with the same recompute: faults in the library code
        # and kernels the real run uses (they count in RSS but are not part of the plan).
        tiny = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, hidden_size=max(cfg.model.hidden_size // 16, 16),
            ffn_hidden_size=max(cfg.model.ffn_hidden_size // 16, 16)))
        torch.manual_seed(0)
        warm = _train(tiny, vocab_size, ctx, 1, micro_batches)
        del warm
        gc.collect()
        baseline = _rss()
        reset = _reset_peak_rss()
        baseline_peak = _peak_rss()
        torch.manual_seed(0)
        model, optimizer = _train(cfg, vocab_size, ctx, steps, micro_batches)
        static = _rss() - baseline
        peak = _peak_rss() - baseline
        # After the measurement (it allocates): what autograd saves, by layer kind.
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        model.train()
        saved = saved_activation_bytes(model, cfg.model.layer_kinds(),
                                       {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
        del model, optimizer
    finally:
        if created:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    mem = planned["memory"]
    planned_static = (mem["weights_bf16_gib"] + mem["main_grads_fp32_gib"]
                      + mem["optimizer_fp32_gib"])
    return {
        "machine": machine_summary(),
        "load_average": load_average(),
        "seconds": round(time.perf_counter() - started, 1),
        "config": {"pattern": cfg.model.pattern, "hidden_size": cfg.model.hidden_size,
                   "vocab_size": vocab_size, "micro_batch_size": micro_batch_size,
                   "micro_batches": micro_batches, "seq_length": seq_length, "steps": steps,
                   "parameters": planned["parameters"], "recompute": recompute,
                   "precision": "bf16 (portable spec, BF16 weights, CPU twin of megatron's "
                                "DDP + optimizer)"},
        "baseline_rss_gib": round(baseline / GIB, 3),
        "peak_reset": reset,
        "baseline_was_peak": (not reset) and baseline_peak > baseline + peak,
        "measured_peak_gib": round(peak / GIB, 4),
        "measured_static_gib": round(static / GIB, 4),
        "measured_activations_gib": round((peak - static) / GIB, 4),
        "planned_gib": planned["memory_per_rank_gib"],
        "planned_static_gib": round(planned_static, 4),
        "planned_activations_gib": round(planned["memory_per_rank_gib"] - mem["static_gib"], 4),
        "planned_terms_gib": {k: mem[k] for k in (
            "weights_bf16_gib", "main_grads_fp32_gib", "optimizer_fp32_gib", "activations_gib",
            "logits_gib", "recompute_peak_gib", "transient_gib")},
        "planned_peak_phase": mem["peak_phase"],
        "saved_per_layer_mib": {k: round(v / 2**20, 3)
                                for k, v in saved["per_layer_by_kind"].items()},
        "planned_per_layer_mib": {
            k: round(sum(activation_elements_per_token(k, cfg.model, 1).values())
                     * micro_batch_size * seq_length * BYTES_ACTIVATION / 2**20, 3)
            for k in dict.fromkeys(cfg.model.layer_kinds())},
        "saved_head_mib": round(saved["head"] / 2**20, 3),
        "saved_total_mib": round(saved["total"] / 2**20, 3),
        "ratio_static": round(static / GIB / planned_static, 3) if planned_static else None,
        "ratio_peak": round(peak / GIB / planned["memory_per_rank_gib"], 3),
        "ratio_activations": round((peak - static) / (planned["memory_per_rank_gib"]
                                                      - mem["static_gib"]) / GIB, 3),
    }


# glibc keeps freed heap memory in its arenas, so RSS would not fall when tensors are freed; with
# a fixed 64 KiB mmap threshold every tensor buffer above it is its own mapping, returned to the
# kernel on free, and RSS follows the live tensor bytes.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def measure_settings(settings: list[str], repeats: int, args: list[str]) -> list[dict]:
    """Each recompute setting in its own fresh process (RSS is per process), interleaved over
    the repeats so that a change of the machine's load hits every setting alike."""
    results = []
    for rep in range(repeats):
        for setting in settings:
            cmd = [sys.executable, "-m", "benchmarks.memory", "--measure", "--recompute", setting, *args]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, **MALLOC_ENV})
            if proc.returncode:
                results.append({"setting": setting, "repeat": rep,
                                "error": (proc.stderr or proc.stdout)[-600:]})
            else:
                results.append({"setting": setting, "repeat": rep, **json.loads(proc.stdout)})
            print(json.dumps({k: results[-1].get(k) for k in (
                "setting", "repeat", "ratio_static", "ratio_peak", "ratio_activations",
                "load_average", "seconds", "error")}), file=sys.stderr, flush=True)
    return results


def calibrated_activations_gib(result: dict, full_layers: dict,
                               kept_layers: Optional[dict] = None) -> float:
    """The plan's recompute and peak formulas (stage_activation_bytes) applied to what the CPU
    layers measurably save, which separates the recompute accounting from the per-layer model.
    `full_layers`: a recompute=none run (each layer's full activations); `kept_layers`: for
    selective, a selective run (what each layer keeps; while a layer's backward runs its
    recomputed mixer holds the full activations again). End of forward: kept + the head's saved
    tensors + the BF16 logits alive next to their FP32 copy."""
    c = result["config"]
    kinds = [LAYER_SYMBOLS[ch] for ch in c["pattern"]]
    full = [full_layers["saved_per_layer_mib"][k] * 2**20 for k in kinds]
    tokens = c["micro_batch_size"] * c["seq_length"]
    head = full_layers["saved_head_mib"] * 2**20 + tokens * c["vocab_size"] * BYTES_ACTIVATION
    if kept_layers is not None:  # selective: every layer a one-layer "chunk" keeping this much
        kept = [kept_layers["saved_per_layer_mib"][k] * 2**20 for k in kinds]
        peak = max(sum(kept[:i]) + full[i] for i in range(len(kinds)))
        return max(sum(kept) + head, peak) / GIB
    granularity, method, layers = parse_recompute(c["recompute"])
    acts = stage_activation_bytes(full, tokens * c["hidden_size"] * BYTES_ACTIVATION,
                                  RecomputeConfig(granularity, method, layers))
    return max(acts["kept"] + head, acts["recompute_peak"]) / GIB


def summary_table(results: list[dict]) -> str:
    """Markdown: per setting, planned and measured (median over repeats) and their ratios."""
    rows = ["| recompute | static: planned / measured | ratio | peak: planned / measured "
            "(min-max) | ratio | activations: planned / measured | ratio | plan formulas on "
            "the measured layers | ratio | runs |", "|---|" + "---:|" * 9]
    ok_runs = [r for r in results if "error" not in r]
    for setting in dict.fromkeys(r["setting"] for r in results):
        ok = [r for r in ok_runs if r["setting"] == setting]
        if not ok:
            err = next(r["error"] for r in results if r["setting"] == setting)
            rows.append(f"| {setting} | failed: {err.splitlines()[-1][:120]} |" + " |" * 8)
            continue

        def med(key, runs=ok):
            return statistics.median(r[key] for r in runs)

        nones = [r for r in ok_runs if r["setting"] == "none"]
        calibrated = "-", "-"
        if nones:
            kept = None
            if setting == "selective":
                kept = min(ok, key=lambda r: r["repeat"])
            cal = calibrated_activations_gib(ok[0], min(nones, key=lambda r: r["repeat"]), kept)
            calibrated = f"{cal:.3f}", f"**{med('measured_activations_gib') / cal:.2f}**"
        peaks = [r["measured_peak_gib"] for r in ok]
        rows.append(
            f"| {setting} | {ok[0]['planned_static_gib']:.3f} / {med('measured_static_gib'):.3f} "
            f"| **{med('ratio_static'):.2f}** | {ok[0]['planned_gib']:.3f} / "
            f"{med('measured_peak_gib'):.3f} ({min(peaks):.3f}-{max(peaks):.3f}) | "
            f"**{med('ratio_peak'):.2f}** | {ok[0]['planned_activations_gib']:.3f} / "
            f"{med('measured_activations_gib'):.3f} | **{med('ratio_activations'):.2f}** | "
            f"{calibrated[0]} | {calibrated[1]} | {len(ok)} |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory",
        description="Validate the memory plan against a short CPU training run "
                    "(plans of real runs: python train.py run.dry_run=true ...).")
    parser.add_argument("--measure", action="store_true", help="run the CPU measurement")
    parser.add_argument("--recompute", default="none",
                        help="none | selective | full[:uniform|block[:N]]; a comma-separated "
                             "list measures each in its own process, interleaved over --repeats")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write every run's result here")
    args = parser.parse_args(argv)
    if not args.measure:
        parser.print_help()
        return ExitCode.CONFIG
    settings = args.recompute.split(",")
    for setting in settings:
        parse_recompute(setting)  # a bad setting fails here, not in a subprocess
    if len(settings) > 1 or args.repeats > 1:
        passed = ["--steps", str(args.steps), "--micro-batches", str(args.micro_batches),
                  "--micro-batch-size", str(args.micro_batch_size), "--seq-length",
                  str(args.seq_length)]
        if args.hidden_size is not None:
            passed += ["--hidden-size", str(args.hidden_size)]
        results = measure_settings(settings, args.repeats, passed)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(summary_table(results))
        return ExitCode.CHECK_FAILED if any("error" in r for r in results) else ExitCode.OK
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.memory", *argv],
                  {**os.environ, **MALLOC_ENV})
    result = measure(steps=args.steps, micro_batches=args.micro_batches,
                     micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                     hidden_size=args.hidden_size, recompute=args.recompute)
    json.dump(result, sys.stdout, indent=1)
    print()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return ExitCode.OK


if __name__ == "__main__":
    from compat import quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    sys.exit(main())
