"""Replay one optimizer step of a run, and with --bisect find the GEMMs whose low precision
explains its anomaly (what the precision-forensics design calls `training.replay`; the commands over finished
runs live in tools/).

    python -m tools.replay RUN_DIR --step N [--bisect [--loss-threshold R]
        [--grad-norm-threshold R]] [--out DIR] [--verbose]

Step N is the N-th optimizer step, as metrics.jsonl numbers it. It starts from the state after
step N-1, so the replay loads the newest intact checkpoint at or before step N-1 (step_K holds
the state after K steps), builds the model and trainer from the config that checkpoint was
written with (trainer.pt records it), trains steps K+1 .. N-1 as the run did (the same data
stream, RNG and stochastic-rounding draws, precision map and validations), and computes step N.
It reports whether the replayed loss and grad norm equal the logged ones: bit-identical on the
same layout and machine, otherwise the difference. Launched as one process it replays a run of
any tensor/pipeline layout at tensor = pipeline = 1 (a difference is then expected, not bit
identity); under torchrun at the run's layout.

--bisect re-runs step N with sets of quantized GEMMs (a linear's Fprop, Dgrad or Wgrad) switched
to BF16, finds the smallest set whose low precision explains the step's anomaly (non-finite values,
or a loss or grad-norm deviation from the all-BF16 replay beyond the thresholds) by binary
splitting, and ranks the modules by effect (training/forensics.py).

Writes RUN_DIR/replay/step-N/replay.json (or DIR/replay.json), whole or not at all, and prints a
table. Nothing else of the run is written: its checkpoints, metrics and config stay as they are.

Refusals, one line each, before anything is written (errors.ExitCode): 2 a bad argument, a step
outside the run, or a run whose config changed since the checkpoint was written (the keys that
differ are listed: a replay under another config would not reproduce the step); 6 no intact
checkpoint at or before step N-1 (the nearest ones are named), or one refused; 8 the output
cannot be written. A run whose code changed since (another git commit, uncommitted changes) is
replayed with a warning listing the changed files: the bit-identity verdict then says whether
the change mattered.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from compat import quiet_cpu_fallback_warnings
from errors import ConfigError, ExitCode, ProjectError
from training.forensics import (Outcome, Thresholds, bisect, bisect_table, capture_rng,
                                code_changes, code_version, config_differences, same_value,
                                write_replay_json)
from training.run_reader import RunDirError

log = logging.getLogger("nvfp4_pretrain")

# Where a replay writes, under the run directory (never into checkpoints/ or metrics.jsonl).
REPLAY_DIR = "replay"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tools.replay",
                                description="Replay one optimizer step of a run; --bisect finds "
                                            "the GEMMs whose low precision explains it.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--step", type=int, required=True, help="the optimizer step to replay (>= 1)")
    p.add_argument("--bisect", action="store_true",
                   help="re-run the step with sets of quantized GEMMs in BF16 and find the "
                        "smallest set that explains its anomaly")
    defaults = Thresholds()
    p.add_argument("--loss-threshold", type=float, default=defaults.loss,
                   help="relative loss deviation from the all-BF16 replay that counts as an "
                        f"anomaly (default {defaults.loss})")
    p.add_argument("--grad-norm-threshold", type=float, default=defaults.grad_norm,
                   help="relative grad-norm deviation from the all-BF16 replay that counts as "
                        f"an anomaly (default {defaults.grad_norm})")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for replay.json (default RUN_DIR/{REPLAY_DIR}/step-N)")
    p.add_argument("--verbose", action="store_true", help="the trainer's start-up lines too")
    return p.parse_args(argv)


@dataclass
class Plan:
    """What the checks before any model is built found."""
    run_dir: Path
    step: int
    checkpoint: Path
    checkpoint_step: int
    config_text: str  # the config the checkpoint was written with
    logged: Optional[dict]  # metrics.jsonl's record of step N (None: not logged)
    logged_between: dict[int, dict]  # records of steps K+1 .. N-1
    out_dir: Path
    warnings: list[str] = field(default_factory=list)


def check_args(args) -> Plan:
    # deferred: training.checkpoint imports megatron (~3 s); the argument checks come first
    from training import checkpoint as ckpt
    from training.metrics import read_metrics
    from training.run_reader import read_run
    from training.safe_load import CheckpointRefused, load_weights_only

    run_dir = args.run_dir.expanduser()
    for name in ("loss_threshold", "grad_norm_threshold"):
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"--{name.replace('_', '-')}={value}: must be a positive number")
    read_run(run_dir)  # a run directory with a readable config.yaml (RunDirError, exit 2)
    config_path = newest_config(run_dir)
    current = _load_yaml(config_path)
    max_steps = current.get("trainer", {}).get("max_steps")
    if args.step < 1 or (max_steps is not None and args.step > max_steps):
        raise ConfigError(f"--step {args.step}: the run's steps are 1 .. {max_steps}")
    if not (run_dir / "metrics.jsonl").is_file():
        raise RunDirError(f"RUN_DIR={run_dir}: no metrics.jsonl (not a run that trained)")
    records = {r["step"]: r for r in read_metrics(run_dir, "step") if "loss" in r}

    root = run_dir / "checkpoints"
    dirs = ckpt.step_dirs(root) if root.is_dir() else []
    before = [d for d in dirs if ckpt.named_step(d) is not None
              and ckpt.named_step(d) <= args.step - 1]
    warnings = []
    checkpoint = None
    for candidate in reversed(before):
        problem = ckpt.verify_checkpoint(candidate)
        if problem is None:
            checkpoint = candidate
            break
        warnings.append(f"checkpoint {candidate.name} is unusable: {problem}; trying an older one")
    if checkpoint is None:
        after = [d.name for d in dirs if (ckpt.named_step(d) or 0) > args.step - 1]
        nearest = ", ".join(filter(None, [before[-1].name + " (unusable)" if before else None,
                                          after[0] + " (after)" if after else None]))
        raise RunDirError(
            f"--step {args.step}: no intact checkpoint at or before step {args.step - 1} (the "
            f"state step {args.step} starts from) in {root}; nearest: {nearest or 'none'}",
            ExitCode.NO_USABLE_CHECKPOINT)
    k = ckpt.named_step(checkpoint)
    try:
        trainer_state = load_weights_only(checkpoint / "trainer.pt", str(checkpoint / "trainer.pt"),
                                          map_location="cpu")
    except CheckpointRefused as exc:
        raise RunDirError(str(exc), ExitCode.NO_USABLE_CHECKPOINT) from None
    provenance = trainer_state.get("provenance") or {}
    if provenance.get("config"):
        config_text = provenance["config"]
        changed = config_differences(_parse_yaml(config_text), current)
        if changed:
            raise ConfigError(
                f"--step {args.step}: the run's config changed since {checkpoint.name} was "
                f"written ({config_path.name} now): {'; '.join(changed)}; a replay under "
                "another config would not reproduce the step")
    else:
        config_text = config_path.read_text()
        warnings.append(f"{checkpoint.name} records no config (written before replays "
                        f"existed): replaying with {config_path.name}")
    if "code" in provenance:
        changes = code_changes(provenance["code"], code_version())
        if changes:
            warnings.append("the code changed since the checkpoint was written: "
                            + "; ".join(changes))
    else:
        warnings.append(f"{checkpoint.name} records no code version")
    out_dir = (args.out.expanduser() if args.out is not None
               else run_dir / REPLAY_DIR / f"step-{args.step}")
    _check_out_dir(out_dir, run_dir)
    return Plan(run_dir, args.step, checkpoint, k, config_text, records.get(args.step),
                {s: r for s, r in records.items() if k < s < args.step}, out_dir, warnings)


def newest_config(run_dir: Path) -> Path:
    """The config the run was last started with: config.yaml, or its newest
    config.resume-<n>.yaml (a resume with another config writes one; training/run_dir.py)."""
    resumes = [(int(p.stem.rsplit("-", 1)[1]), p) for p in run_dir.glob("config.resume-*.yaml")
               if p.stem.rsplit("-", 1)[1].isdigit()]
    return max(resumes)[1] if resumes else run_dir / "config.yaml"


def _parse_yaml(text: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(text), resolve=False)


def _load_yaml(path: Path) -> dict:
    return _parse_yaml(path.read_text())


def _check_out_dir(out_dir: Path, run_dir: Path) -> None:
    real, run = Path(os.path.realpath(out_dir)), Path(os.path.realpath(run_dir))
    for protected in (run, run / "checkpoints"):
        if real == protected or (protected != run and protected in real.parents):
            raise ConfigError(f"--out={out_dir}: would write into the run's "
                              f"{'checkpoints' if protected != run else 'directory itself'}")
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    if os.path.islink(out_dir) or not os.access(probe, os.W_OK):
        raise ProjectError(f"--out={out_dir}: cannot be written here (a link, or no permission)",
                           ExitCode.UNWRITABLE)


class EventRecorder:
    """What train_step hands its events to (a MetricsSink's `event`), kept for replay.json."""

    def __init__(self):
        self.events: list[dict] = []

    def event(self, step: int, name: str, **fields) -> None:
        self.events.append({"step": step, "event": name, **fields})


def replay_config(plan: Plan, world: int):
    """The TrainConfig to replay with: the checkpoint's, with nothing written, no downstream
    evaluation, no anomaly watch, a non-finite step computed rather than stopped at, and the
    run's layout where the launched processes fit it."""
    from omegaconf import OmegaConf

    # deferred: as in check_args (the config schemas reach the model builder's modules)
    from training.config import TrainConfig

    raw = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.create(plan.config_text))
    cfg: TrainConfig = OmegaConf.to_object(raw)
    cfg.run.dir = str(plan.run_dir)
    cfg.logger.mode = "disabled"
    cfg.evaluation.tasks = []
    tr = cfg.trainer
    # a step the run stopped at (on_nan=stop) is computed and reported, not raised
    tr.on_nan, tr.max_consecutive_skips = "skip", 2**31
    if hasattr(tr, "on_anomaly"):
        tr.on_anomaly = "off"
    layout = cfg.parallel.tensor * cfg.parallel.pipeline
    notes = []
    if world == 1 and layout > 1:
        notes.append(f"the run's layout is tensor {cfg.parallel.tensor} x pipeline "
                     f"{cfg.parallel.pipeline}; replaying at tensor 1 x pipeline 1 in one "
                     "process: a difference is expected, not bit identity")
        cfg.parallel.tensor = cfg.parallel.pipeline = 1
        cfg.parallel.sequence = False
        cfg.parallel.first_stage_layers = cfg.parallel.last_stage_layers = None
    elif world % layout:
        raise ConfigError(f"the run's tensor {cfg.parallel.tensor} x pipeline "
                          f"{cfg.parallel.pipeline} does not divide the {world} launched processes")
    return cfg, notes


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_cpu_fallback_warnings()
    args = parse_args(argv)
    if not args.verbose:
        log.setLevel(logging.WARNING)
    ctx = None
    try:
        plan = check_args(args)
        # deferred: megatron (~3 s), after the refusals
        from training.distributed import init_distributed, launched_world_size

        cfg, notes = replay_config(plan, launched_world_size())
        plan.warnings.extend(notes)
        ctx = init_distributed(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.backend)
        return run(plan, cfg, ctx, args)
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    finally:
        if ctx is not None:
            from training.distributed import shutdown  # deferred: imported in the try above

            shutdown()


def run(plan: Plan, cfg, ctx, args) -> int:
    from rich.console import Console

    # deferred: megatron (~3 s), after main's refusals
    from training import checkpoint as ckpt
    from training.trainer import Trainer

    console = Console(highlight=False, width=max(Console().width, 150))
    for line in plan.warnings:
        console.print(f"warning: {line}")
    started = time.perf_counter()
    trainer = Trainer(cfg, ctx)
    state = ckpt.load_checkpoint(plan.checkpoint, ctx, trainer.core, trainer.optimizer,
                                 trainer.optimizer_format, spec=trainer.built.spec)
    trainer.load_state_dict(state["trainer"])
    same_layout = not state["resharded"]
    console.print(f"replaying step {plan.step} of {plan.run_dir} from {plan.checkpoint.name}"
                  + (f" ({plan.step - 1 - plan.checkpoint_step} steps before it)"
                     if plan.step - 1 > plan.checkpoint_step else ""))
    events = EventRecorder()
    between = []
    while trainer.step < plan.step - 1:  # the steps from the checkpoint to step N-1, as the run
        result = trainer.train_step(trainer.data.train.next_global_batch(), events)
        trainer.step += 1
        if trainer.validator.due(trainer.step):  # as Trainer.fit: validations between steps
            trainer.validator.loss()
        between.append(_compare(trainer.step, Outcome(result.loss, result.grad_norm),
                                plan.logged_between.get(trainer.step)))
    batch = trainer.data.train.next_global_batch()
    found = None
    if args.bisect:
        for name, fields in trainer.precision.before_step(trainer.step):
            events.event(trainer.step, name, **fields)
        trainer.grad_health.begin_step()
        rng = capture_rng(ctx)
        thresholds = Thresholds(args.loss_threshold, args.grad_norm_threshold)
        found = bisect(trainer, batch, rng, plan.step, trainer.precision.current_formats(),
                       thresholds,
                       log=console.print if ctx.is_main else (lambda line: None))
        replayed = found.as_logged
    else:
        result = trainer.train_step(batch, events)
        replayed = Outcome(result.loss, result.grad_norm)
    verdict = _compare(plan.step, replayed, plan.logged)
    seconds = time.perf_counter() - started
    record = {"run_dir": str(plan.run_dir), "step": plan.step,
              "checkpoint": plan.checkpoint.name, "same_layout": same_layout,
              "layout": {"tensor": ctx.tensor, "pipeline": ctx.pipeline, "data": ctx.data},
              "warnings": plan.warnings, **verdict, "steps_before": between,
              "events": events.events, "bisect": found.to_json() if found else None,
              "seconds": round(seconds, 1), "command": ["python", "-m", "tools.replay",
                                                        *sys.argv[1:]]}
    if ctx.is_main:
        path = plan.out_dir / "replay.json"
        try:
            write_replay_json(path, record)
        except OSError as exc:
            raise ProjectError(f"{path}: {exc.strerror or exc}", ExitCode.UNWRITABLE) from None
        console.print(_verdict_line(verdict, same_layout))
        if found is not None:
            console.print(bisect_table(found))
        console.print(f"wrote {path} ({seconds:.0f} s)")
    return ExitCode.OK


def _compare(step: int, replayed, logged: Optional[dict]) -> dict:
    out = {"replayed": {"loss": _f(replayed.loss), "grad_norm": _f(replayed.grad_norm)}}
    if logged is None:
        return {"step": step, **out, "logged": None, "bit_identical": None}
    logged_values = {"loss": float(logged["loss"]), "grad_norm": float(logged["grad_norm"])}
    same = all(same_value(getattr(replayed, k), v) for k, v in logged_values.items())
    diff = {k: _f(getattr(replayed, k) - v) for k, v in logged_values.items()}
    return {"step": step, **out, "logged": {k: _f(v) for k, v in logged_values.items()},
            "bit_identical": same, "difference": diff}


def _f(x: float):
    return x if math.isfinite(x) else str(x)


def _verdict_line(verdict: dict, same_layout: bool) -> str:
    r = verdict["replayed"]
    if verdict["logged"] is None:
        return (f"step {verdict['step']}: loss {r['loss']} grad-norm {r['grad_norm']} (the run "
                "logged no record of this step)")
    if verdict["bit_identical"]:
        return (f"step {verdict['step']}: bit-identical to the log (loss {r['loss']!r}, "
                f"grad-norm {r['grad_norm']!r})")
    d, lg = verdict["difference"], verdict["logged"]
    return (f"step {verdict['step']}: differs from the log"
            + ("" if same_layout else " (another layout)")
            + f": loss {r['loss']!r} vs {lg['loss']!r} (diff {d['loss']}), grad-norm "
            f"{r['grad_norm']!r} vs {lg['grad_norm']!r} (diff {d['grad_norm']})")


if __name__ == "__main__":
    sys.exit(main())
