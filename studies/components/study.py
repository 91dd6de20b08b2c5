"""The study run: train BF16, capture at three points, measure, and collect the results."""

from __future__ import annotations

import os
import shlex
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.machine import hardware_info
from errors import ConfigError
from training.config import register_configs, validate
from training.distributed import init_distributed, shutdown

from . import REPO
from .capture import Capture, kind_of, layer_index, precision_linears
from .measure import load_reference, measure_linear, reference_check
from .passes import model_level, recipe_configs, sr_steps
from .stats import sig


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


def capture_steps(steps: int, batches: int) -> list[list[int]]:
    """Three capture points (1/6, 1/2 and the end of training), `batches` consecutive steps each."""
    starts = [max(1, steps // 6), max(1, steps // 2), steps - batches + 1]
    points = [list(range(s, s + batches)) for s in starts]
    flat = [s for p in points for s in p]
    if len(set(flat)) != len(flat) or min(flat) < 1:
        raise ConfigError(f"--steps {steps} is too short for 3 capture points of --batches "
                          f"{batches} steps")
    return points


def build_trainer(steps: int, seed: int, run_dir: Path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    # deferred: megatron (~3 s); __main__ imports this module, and --report-only runs without it
    from training.trainer import Trainer

    register_configs()
    overrides = [*TRAIN_OVERRIDES, f"trainer.max_steps={steps}", f"trainer.seed={seed}",
                 f"run.dir={run_dir}"]
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        cfg = OmegaConf.to_object(compose("train", overrides=overrides))
    ctx = init_distributed(1, 1, "gloo")
    policy = validate(cfg, ctx.world_size)
    return Trainer(cfg, ctx, policy=policy), cfg, overrides


def log(msg: str, t0: float) -> None:
    load = os.getloadavg()[0]
    print(f"[{time.time() - t0:7.1f} s | load {load:5.2f}] {msg}", flush=True)


def run_study(args) -> dict:
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
            results["final_val_loss"] = trainer.validator.loss()
        finally:
            shutdown()
    results["phases"] = {k: round(v, 1) for k, v in phase.items()}
    results["wall_s"] = round(time.time() - t0, 1)
    results["load_start"] = [round(v, 2) for v in load_start]
    results["load_end"] = [round(v, 2) for v in os.getloadavg()]
    results["config"] = {"steps": args.steps, "batches_per_point": args.batches,
                         "model_batches_per_point": args.model_batches, "points": points,
                         "sr_steps": args.sr_steps, "sr_seeds": args.sr_seeds, "seed": args.seed,
                         "overrides": overrides[:-1],
                         "tokens_per_batch": cfg.trainer.seq_length * cfg.trainer.global_batch_size}
    results["command"] = shlex.join(["python", "-m", "studies.components", *args.argv])
    results["machine"] = hardware_info()
    results["generated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    log(f"study done in {results['wall_s'] / 60:.1f} min", t0)
    return results
