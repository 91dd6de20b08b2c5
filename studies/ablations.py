"""The precision ablation study: train the demo model under every precision recipe, then report.

    python -m studies.ablations --jobs 2                # the study (resumable), then the report
    python -m studies.ablations --seeds 1 2 3 --steps 80 --jobs 2   # other seeds / length
    python -m studies.ablations --jobs 2 evaluation=demo   # + downstream scores per recipe
    python -m studies.ablations --report-only           # rebuild docs/ablations/ from existing runs

Every run is `train.py experiment=ablations precision=<config> trainer.seed=<seed>`, one per
precision recipe in recipes/precision/ (`--steps` sets trainer.max_steps), so all configs of one
seed see the same data order and the same initial weights. Hydra overrides (key=value words among
the flags) go to every run: `evaluation=demo` (or `evaluation.tasks=[...] evaluation.limit=N`)
scores each run on lm-eval tasks at its last step, `model=...` or `trainer.seq_length=...` change
the scale. Keys the study sets per run (precision, trainer.seed, run.dir, the step counts) are
refused. Runs live in `<runs-dir>/<config>-s<seed>/` (default runs/ablations/, gitignored); a run
dir trained with another --steps or other overrides is refused (pass another --runs-dir). A run
whose metrics.jsonl holds the final step with its val_loss (and its downstream scores, when it
evaluates) is skipped; an interrupted one resumes from its newest checkpoint (run.resume=auto);
one that stopped on a NaN/Inf loss (exit 4) is recorded as diverged and not retried.

The report (docs/ablations/ by default): val_loss.png (relative validation-loss gap to BF16 vs
tokens, mean over seeds), train_loss.png (the same for the smoothed training loss), results.json,
and README.md (studies/templates/ablations.md.j2: table, downstream scores when the runs have
them, command, machine, wall time, the paper's orderings checked against the seed noise measured
here, plus the hand-written headline.md and reading.md when present).

Exit codes (errors.ExitCode): 0 every run finished or diverged; 2 a bad flag or override, or a run
dir of another study; 3 --report-only without runs; 130 Ctrl-C (the runs checkpointed first);
else the first failed run's own train.py code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.machine import hardware_info
from errors import ConfigError, ExitCode, MissingError, ProjectError
from studies.render import fmt, render
from training import metrics

REPO = Path(__file__).resolve().parents[1]

RECIPES = REPO / "recipes"
# Every precision recipe is a config of the study; BF16, the reference of every gap, first.
CONFIGS = sorted((p.stem for p in (RECIPES / "precision").glob("*.yaml")),
                 key=lambda name: (name != "bf16", name))
# Display names for the plots; a recipe without one is shown by its name.
LABELS = {
    "bf16": "BF16", "fp8": "FP8 (block-scaled E4M3)", "nvfp4": "NVFP4 (full recipe)",
    "nvfp4_no_rht": "NVFP4 - RHT", "nvfp4_no_sr": "NVFP4 - SR", "nvfp4_no_2d": "NVFP4 - 2D weights",
    "nvfp4_no_bf16_layers": "NVFP4 - BF16 layers", "nvfp4_naive": "NVFP4 naive (nothing)",
    "mxfp4": "MXFP4", "mxfp8": "MXFP8 (E4M3, E8M0 per 32)", "nvfp4_switch": "NVFP4 + BF16 from 80%",
    "nvfp4_mamba_proj_bf16": "NVFP4, Mamba projections BF16",
}
# The baselines the 4-bit recipes are measured against, drawn dashed: BF16 and the 8-bit formats
# (the paper's FP8 block recipe; MXFP8, TE's default Blackwell recipe).
BASELINES = ("bf16", "fp8", "mxfp8")
# The study's config on top of recipes/: recipes/experiment/ablations.yaml (its trainer keys are
# the report's settings); --steps replaces its step count.
STUDY_OVERRIDES = ["experiment=ablations"]
STUDY_TRAINER = OmegaConf.load(RECIPES / "experiment" / "ablations.yaml").trainer
DEFAULT_STEPS = STUDY_TRAINER.max_steps
DEFAULT_RUNS_DIR, DEFAULT_OUT = "runs/ablations", "docs/ablations"
STATUS = "ablation.json"  # per run dir: exit code, wall time, (diverged) step, extra overrides
# train.py's exit codes at start-up that a second try meets again (a bug, a bad value, a missing file)
STARTUP_FAILURES = (ExitCode.BUG, ExitCode.CONFIG, ExitCode.MISSING)


# -- runs -------------------------------------------------------------------------------------
# Keys every run's command line sets itself (run_overrides): an extra override may not change them.
STUDY_KEYS = ("precision", "trainer.seed", "run.dir", "experiment", "trainer.max_steps",
              "trainer.eval_every", "trainer.save_every", "run.resume")
# A Hydra override as the command line takes it: key=value, key a dotted name (+/~ prefixes: add,
# delete). Only the key is looked at; Hydra parses the value in train.py.
OVERRIDE = re.compile(r"[+~]{0,2}[A-Za-z_][\w.-]*(@[\w.]+)?=.*", re.DOTALL)


def check_overrides(overrides: list[str]) -> list[str]:
    """The study's extra Hydra overrides (for every run), refused (ConfigError, exit 2) when one
    is not `key=value` or sets a key the study sets per run."""
    for override in overrides:
        if not OVERRIDE.fullmatch(override):
            raise ConfigError(f"override {override!r} is not key=value (a Hydra override)")
        key = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        owner = next((k for k in STUDY_KEYS if key == k or key.startswith(k + ".")), None)
        if owner is not None:
            raise ConfigError(f"override {override!r}: the study sets {owner} for every run "
                              "(--configs, --seeds, --steps, --runs-dir choose it)")
    return list(overrides)


def run_overrides(config: str, seed: int, steps: int, run_dir: Path,
                  extra: list[str] = ()) -> list[str]:
    return [f"precision={config}", f"trainer.seed={seed}", f"run.dir={run_dir}",
            *STUDY_OVERRIDES, *extra, f"trainer.max_steps={steps}",
            f"trainer.eval_every={max(1, steps // 8)}", f"trainer.save_every={max(1, steps // 4)}",
            "run.resume=auto"]


def step_records(run_dir: Path) -> dict[int, dict]:
    """step -> that step's records merged: the trainer logs a step's downstream scores as a
    record of their own after the step's, and a resumed run logs steps again (the later wins)."""
    out: dict[int, dict] = {}
    if not (run_dir / metrics.METRICS_FILE).exists():
        return out
    for rec in metrics.read_metrics(run_dir, kind="step"):
        out[rec["step"]] = {**out.get(rec["step"], {}), **rec}
    return out


def last_step(run_dir: Path) -> int:
    m = step_records(run_dir)
    return max(m) if m else 0


def read_status(run_dir: Path) -> dict:
    p = run_dir / STATUS
    return json.loads(p.read_text()) if p.exists() else {}


def run_state(run_dir: Path, steps: int) -> str:
    """'done', 'diverged', 'partial' or 'new'. Done: the final step's val_loss and, when the run
    evaluates downstream tasks, its final scores are logged (a run killed during that evaluation
    resumes it)."""
    status = read_status(run_dir)
    if status.get("exit_code") == ExitCode.DIVERGED:
        return "diverged"
    m = step_records(run_dir)
    final = m.get(steps, {})
    if "val_loss" in final and (not evaluation_tasks(run_dir)
                                or any(k.startswith("eval/") for k in final)):
        return "done"
    return "partial" if m or (run_dir / "checkpoints").exists() else "new"


def run_config(run_dir: Path):
    """The config train.py composed for the run (its config.yaml), or None before it started."""
    path = run_dir / "config.yaml"
    return OmegaConf.load(path) if path.exists() else None


def configured_steps(run_dir: Path) -> int | None:
    cfg = run_config(run_dir)
    return None if cfg is None else int(cfg.trainer.max_steps)


def evaluation_tasks(run_dir: Path) -> list[str]:
    cfg = run_config(run_dir)
    return list(OmegaConf.select(cfg, "evaluation.tasks", default=None) or []) if cfg else []


def start_run(config: str, seed: int, steps: int, run_dir: Path, threads: int,
              extra: list[str] = ()) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    # the extra overrides the run was started with: a later session must pass the same ones
    (run_dir / STATUS).write_text(json.dumps({**read_status(run_dir), "overrides": list(extra)},
                                             indent=1))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, str(REPO / "train.py"),
           *run_overrides(config, seed, steps, run_dir, extra)]
    log = open(run_dir / "stdout.log", "a")
    log.write(f"\n# {datetime.now(timezone.utc).isoformat()} {shlex.join(cmd)}\n")
    log.flush()
    # own session: a Ctrl-C reaches the runner only, which asks the run to checkpoint (SIGTERM)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc._log = log  # closed when the run ends
    proc._t0 = time.time()
    return proc


def finish_run(proc: subprocess.Popen, run_dir: Path, steps: int) -> dict:
    proc._log.close()
    status = read_status(run_dir)
    wall = status.get("wall_s", 0.0) + (time.time() - proc._t0)
    status.update(exit_code=proc.returncode, wall_s=round(wall, 1), last_step=last_step(run_dir),
                  steps=steps, finished_at=datetime.now(timezone.utc).isoformat(),
                  threads=getattr(proc, "_threads", None))
    (run_dir / STATUS).write_text(json.dumps(status, indent=1))
    return status


def _sigterm_to_interrupt(signum, _frame):
    raise KeyboardInterrupt


def check_plan(runs_dir: Path, plan: list[tuple[str, int]], steps: int, extra: list[str]) -> None:
    """Refuse (ConfigError, exit 2) a run dir trained with another step count or other extra
    overrides: resuming it would mix two studies in one curve."""
    for c, s in plan:
        run_dir = runs_dir / f"{c}-s{s}"
        have = configured_steps(run_dir)
        if have is not None and have != steps:
            raise ConfigError(f"{run_dir} was trained with max_steps={have}, not --steps {steps}: "
                              "pass another --runs-dir or remove it")
        had = read_status(run_dir).get("overrides", [] if have is not None else None)
        if had is not None and had != list(extra):
            raise ConfigError(f"{run_dir} was trained with the extra overrides {had}, not "
                              f"{list(extra)}: pass another --runs-dir or remove it")


def run_study(args) -> int:
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    runs_dir = Path(args.runs_dir)
    plan = [(c, s) for s in args.seeds for c in args.configs]
    plan += [(c, s) for s in args.noise_seeds for c in args.noise_configs
             if (c, s) not in plan]
    check_plan(runs_dir, plan, args.steps, args.overrides)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    study_file = runs_dir / "study.json"
    runs_dir.mkdir(parents=True, exist_ok=True)
    study = json.loads(study_file.read_text()) if study_file.exists() else {}
    study.setdefault("sessions", []).append(
        {"started": datetime.now(timezone.utc).isoformat(),
         "command": shlex.join(["python", "-m", "studies.ablations", *sys.argv[1:]]),
         "jobs": args.jobs, "threads_per_job": threads})
    study.update(steps=args.steps, overrides=[*STUDY_OVERRIDES, *args.overrides],
                 extra_overrides=args.overrides, plan=[f"{c}-s{s}" for c, s in plan])
    study_file.write_text(json.dumps(study, indent=1))

    todo = [(c, s) for c, s in plan if run_state(runs_dir / f"{c}-s{s}", args.steps)
            not in ("done", "diverged")]
    if not args.retry_failed:  # a config error (exit 1-3) fails again the same way: report it once
        stuck = [(c, s) for c, s in todo if last_step(runs_dir / f"{c}-s{s}") == 0
                 and read_status(runs_dir / f"{c}-s{s}").get("exit_code") in STARTUP_FAILURES]
        for c, s in stuck:
            console.print(f"[yellow]skipping {c}-s{s}: it failed at start-up before "
                          f"({run_error(runs_dir / f'{c}-s{s}')}); --retry-failed runs it again")
        todo = [x for x in todo if x not in stuck]
    console.print(f"ablation study: {len(plan)} runs ({len(plan) - len(todo)} already finished), "
                  f"{args.steps} steps each, {args.jobs} at a time x {threads} threads; "
                  f"runs in {runs_dir}/")
    failed: dict[str, int] = {}  # run -> its exit code
    t_study = time.time()
    columns = [TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]
    active: dict[str, tuple[subprocess.Popen, Path, int]] = {}
    with Progress(*columns, console=console, refresh_per_second=2) as progress:
        overall = progress.add_task("runs", total=len(plan), completed=len(plan) - len(todo))
        queue = list(todo)
        try:
            while queue or active:
                while queue and len(active) < args.jobs:
                    c, s = queue.pop(0)
                    run_dir = runs_dir / f"{c}-s{s}"
                    proc = start_run(c, s, args.steps, run_dir, threads, args.overrides)
                    proc._threads = threads
                    task = progress.add_task(f"{c}-s{s}", total=args.steps,
                                             completed=last_step(run_dir))
                    active[f"{c}-s{s}"] = (proc, run_dir, task)
                    progress.console.log(f"start {c}-s{s} (from step {last_step(run_dir)})")
                time.sleep(2)
                for name, (proc, run_dir, task) in list(active.items()):
                    progress.update(task, completed=last_step(run_dir))
                    if proc.poll() is None:
                        continue
                    status = finish_run(proc, run_dir, args.steps)
                    state = run_state(run_dir, args.steps)
                    progress.remove_task(task)
                    progress.advance(overall)
                    del active[name]
                    msg = f"{name}: {state} (exit {proc.returncode}, {status['wall_s']:.0f} s this far)"
                    if state not in ("done", "diverged"):
                        failed[name] = proc.returncode
                        msg = f"[red]{msg}: see {run_dir}/stdout.log"
                    progress.console.log(msg)
        except KeyboardInterrupt:
            # train.py checkpoints after the current step on SIGTERM (exit 75): the next call resumes
            progress.console.log("interrupted: asking the active runs to checkpoint and stop")
            for name, (proc, run_dir, _) in active.items():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for name, (proc, run_dir, _) in active.items():
                try:
                    proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                finish_run(proc, run_dir, args.steps)
                progress.console.log(f"{name}: stopped at step {last_step(run_dir)} (exit {proc.returncode})")
            return ExitCode.INTERRUPTED
    study = json.loads(study_file.read_text())
    study["sessions"][-1].update(finished=datetime.now(timezone.utc).isoformat(),
                                 wall_s=round(time.time() - t_study, 1))
    study_file.write_text(json.dumps(study, indent=1))
    console.print(f"study session: {time.time() - t_study:.0f} s; "
                  + (f"[red]failed: {', '.join(failed)}" if failed else "all runs finished"))
    return failed_exit_code(list(failed.values()))


def failed_exit_code(codes: list[int]) -> ExitCode:
    """The study's exit code: OK when every run finished (or diverged, a result), else the first
    failed run's own code (a train.py ExitCode; BUG for anything else, e.g. a kill by signal)."""
    if not codes:
        return ExitCode.OK
    return ExitCode(codes[0]) if codes[0] in set(ExitCode) - {ExitCode.OK} else ExitCode.BUG


# -- report -----------------------------------------------------------------------------------
def ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (alpha * v + (1 - alpha) * acc if math.isfinite(v) else acc)
        out.append(acc)
    return out


def collect(runs_dir: Path) -> dict:
    """Every run under runs_dir -> {config: {seed: summary}}."""
    runs: dict[str, dict[int, dict]] = {}
    for run_dir in sorted(runs_dir.glob("*-s*")):
        config, _, seed = run_dir.name.rpartition("-s")
        if config not in CONFIGS or not seed.isdigit():
            continue
        if not (run_dir / "metrics.jsonl").exists():
            status = read_status(run_dir)
            if status.get("exit_code") not in (None, 0):
                runs.setdefault(config, {})[int(seed)] = {
                    "state": "failed", "exit_code": status["exit_code"], "error": run_error(run_dir),
                    "final_val_loss": None, "val_loss": [], "train_loss": [],
                    "tokens_per_sec_median": None, "late_train_loss": None,
                    "wall_s": status.get("wall_s"), "downstream": {}}
            continue
        m = step_records(run_dir)
        steps = configured_steps(run_dir) or max(m)
        status = read_status(run_dir)
        val = {s: r["val_loss"] for s, r in sorted(m.items()) if "val_loss" in r}
        tokens = {s: r["consumed_tokens"] for s, r in m.items()}
        train_steps = sorted(s for s in m if "loss" in m[s])
        tps = [m[s]["tokens_per_sec"] for s in train_steps if "tokens_per_sec" in m[s]]
        state = run_state(run_dir, steps)
        runs.setdefault(config, {})[int(seed)] = {
            "state": state, "steps": steps, "last_step": max(m) if m else 0,
            "final_val_loss": val.get(steps) if state == "done" else None,
            "val_loss": [[tokens[s], v] for s, v in val.items()],
            "train_loss": [[tokens[s], m[s]["loss"]] for s in train_steps],
            "tokens_per_sec_median": statistics.median(tps) if tps else None,
            "late_train_loss": (statistics.fmean(m[s]["loss"] for s in train_steps
                                                 if s > steps - max(1, steps // 4))
                                if state == "done" else None),
            "wall_s": status.get("wall_s"), "skipped_steps": m[max(m)].get("skipped_steps", 0) if m else 0,
            # lm-eval's scores at the final step (with their stderr), when the run evaluated
            "downstream": ({k: v for k, v in m[steps].items()
                            if k.startswith("eval/") and k != "eval/seconds"}
                           if state == "done" else {}),
        }
    return runs


def run_error(run_dir: Path) -> str:
    """The last `error:` line train.py printed."""
    log = run_dir / "stdout.log"
    lines = [l.strip() for l in log.read_text().splitlines() if "error" in l.lower()] if log.exists() else []
    return lines[-1] if lines else "unknown (see stdout.log)"


def mean_curve(curves: list[list[list[float]]]) -> tuple[list[float], list[float]]:
    """Mean over seeds at the token counts all curves share."""
    common = set.intersection(*[{t for t, _ in c} for c in curves]) if curves else set()
    xs = sorted(common)
    by = [dict((t, v) for t, v in c) for c in curves]
    return xs, [statistics.fmean(b[x] for b in by) for x in xs]


def summarize(runs: dict) -> dict:
    summary = {}
    for config in CONFIGS:
        seeds = runs.get(config, {})
        done = {s: r for s, r in seeds.items() if r["final_val_loss"] is not None}
        finals = [r["final_val_loss"] for r in done.values()]
        tps = [r["tokens_per_sec_median"] for r in seeds.values() if r["tokens_per_sec_median"]]
        summary[config] = {
            "seeds": sorted(done), "diverged_seeds": sorted(s for s, r in seeds.items()
                                                            if r["state"] == "diverged"),
            "failed": {s: r["error"] for s, r in seeds.items() if r["state"] == "failed"},
            "final_val_loss_mean": statistics.fmean(finals) if finals else None,
            "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else None,
            "final_val_loss_min": min(finals) if finals else None,
            "final_val_loss_max": max(finals) if finals else None,
            "tokens_per_sec_median": statistics.median(tps) if tps else None,
            "downstream": downstream_summary(done),
        }
    base = summary["bf16"]["final_val_loss_mean"]
    for config, s in summary.items():
        s["gap_to_bf16_pct"] = (100 * (s["final_val_loss_mean"] - base) / base
                                if base and s["final_val_loss_mean"] is not None else None)
        # seed-matched gaps: this config's seed k against bf16's seed k (same data, same init)
        s["paired_gap_pct"] = paired(runs, config, "bf16", "final_val_loss")
        late = paired(runs, config, "bf16", "late_train_loss")
        s["late_train_gap_pct"] = late
        s["late_train_gap_pct_mean"] = statistics.fmean(late) if late else None
    return summary


def downstream_summary(done: dict[int, dict]) -> dict[str, dict]:
    """Per `eval/<task>/<metric>` over the finished seeds: the mean score, the mean of lm-eval's
    stderr of it (the items' sampling error of one run) and the per-seed scores."""
    out = {}
    for key in sorted({k for r in done.values() for k in r["downstream"]}):
        if key.endswith("_stderr"):
            continue
        seeds = sorted(s for s, r in done.items() if key in r["downstream"])
        errs = [done[s]["downstream"].get(f"{key}_stderr") for s in seeds]
        errs = [e for e in errs if e is not None and math.isfinite(e)]
        out[key] = {"mean": statistics.fmean(done[s]["downstream"][key] for s in seeds),
                    "stderr": statistics.fmean(errs) if errs else None,
                    "per_seed": {s: done[s]["downstream"][key] for s in seeds}}
    return out


def downstream_table(summary: dict, limit) -> dict:
    """The report's downstream table: a column per `<task> <metric>`, a row per config with
    scores; no columns when no run evaluated downstream tasks."""
    keys = sorted({k for r in summary.values() for k in r.get("downstream", {})})
    rows = []
    for c in (c for c in CONFIGS if c in summary):
        scores = summary[c].get("downstream", {})
        if not scores:
            continue
        cells = []
        for key in keys:
            d = scores.get(key)
            if d is None:
                cells.append("—")
                continue
            cell = f"{d['mean']:.4f}" + (f" ± {d['stderr']:.4f}" if d["stderr"] is not None else "")
            if len(d["per_seed"]) > 1:
                cell += f" ({', '.join(f'{v:.4f}' for v in d['per_seed'].values())})"
            cells.append(cell)
        seeds = sorted({s for d in scores.values() for s in d["per_seed"]})
        rows.append({"config": c, "cells": cells, "seeds": ", ".join(map(str, seeds))})
    columns = [" ".join(k.split("/", 2)[1:]) for k in keys]
    return {"columns": columns, "rows": rows, "limit": limit}


def paired(runs: dict, a: str, b: str, key: str) -> list[float]:
    """100 * (a - b) / b for every seed both configs finished (same data order, same init)."""
    ra, rb = runs.get(a, {}), runs.get(b, {})
    return [100 * (ra[k][key] - rb[k][key]) / rb[k][key] for k in sorted(set(ra) & set(rb))
            if ra[k].get(key) is not None and rb[k].get(key) is not None]


def paired_noise(runs: dict, key: str) -> float | None:
    """Std over seeds of NVFP4's seed-matched gap to BF16: the noise of a same-seed comparison."""
    gaps = paired(runs, "nvfp4", "bf16", key)
    return statistics.stdev(gaps) if len(gaps) > 1 else None


def seed_noise(summary: dict) -> dict:
    """Seed-to-seed spread of the final validation loss, as % of the mean, for configs with >1 seed."""
    out = {}
    for config, s in summary.items():
        if s["final_val_loss_std"] is not None:
            out[config] = {"n": len(s["seeds"]), "std": s["final_val_loss_std"],
                           "std_pct": 100 * s["final_val_loss_std"] / s["final_val_loss_mean"],
                           "range_pct": 100 * (s["final_val_loss_max"] - s["final_val_loss_min"])
                           / s["final_val_loss_mean"]}
    return out


# (claim, worse config, better config): the paper says `worse` ends with a higher loss than `better`.
ORDERINGS = [
    ("naive all-NVFP4 is worse than the full recipe", "nvfp4_naive", "nvfp4"),
    ("removing RHT hurts", "nvfp4_no_rht", "nvfp4"),
    ("removing stochastic rounding hurts", "nvfp4_no_sr", "nvfp4"),
    ("removing 2D weight scaling hurts", "nvfp4_no_2d", "nvfp4"),
    ("removing the BF16 first/last layers hurts", "nvfp4_no_bf16_layers", "nvfp4"),
    ("MXFP4 trails NVFP4", "mxfp4", "nvfp4"),
    ("NVFP4 trails FP8", "nvfp4", "fp8"),
    ("NVFP4 trails BF16", "nvfp4", "bf16"),
    ("the late switch to BF16 closes (part of) the gap", "nvfp4", "nvfp4_switch"),
    # Not the paper's: TE's default Blackwell recipe and the map NVIDIA's Nemotron 3 models were
    # pretrained with (recipes/precision/nvfp4_nemotron3.yaml cites its sources).
    ("MXFP8 trails BF16", "mxfp8", "bf16"),
    ("NVFP4 trails MXFP8", "nvfp4", "mxfp8"),
    ("the Nemotron 3 map closes (part of) NVFP4's gap", "nvfp4", "nvfp4_nemotron3"),
]


def _verdict(diff: float | None, noise: float | None) -> str:
    if diff is None:
        return "no data"
    if noise is None:
        return "right sign (no noise estimate)" if diff > 0 else "wrong sign (no noise estimate)"
    if diff > 2 * noise:
        return "reproduces"
    if diff < -2 * noise:
        return "reversed"
    return "within noise" + (" (right sign)" if diff > 0 else " (wrong sign)")


def check_orderings(runs: dict, summary: dict, noise: dict) -> list[dict]:
    """Seed-matched differences between the two configs of each of the paper's claims."""
    rows = []
    for claim, worse, better in ORDERINGS:
        a, b = summary[worse], summary[better]
        val = paired(runs, worse, better, "final_val_loss")
        train = paired(runs, worse, better, "late_train_loss")
        row = {"claim": claim, "worse": worse, "better": better, "pairs": len(val),
               "diff_val_pct": statistics.fmean(val) if val else None,
               "diff_late_train_pct": statistics.fmean(train) if train else None}
        if not val and a["diverged_seeds"] and not b["diverged_seeds"]:
            row["verdict_val"] = row["verdict_train"] = "reproduces (diverged)"
        else:
            row["verdict_val"] = _verdict(row["diff_val_pct"], noise.get("val"))
            row["verdict_train"] = _verdict(row["diff_late_train_pct"], noise.get("train"))
        rows.append(row)
    return rows


def plot(runs: dict, out: Path, key: str, filename: str, title: str, noise_pct: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "bf16" not in runs:
        return
    smooth = (lambda c: c) if key == "val_loss" else (
        lambda c: [[t, v] for (t, _), v in zip(c, ema([v for _, v in c]))])
    def done(config):
        return {k: r for k, r in runs.get(config, {}).items() if r[key] and r["state"] == "done"}

    base_runs = done("bf16")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab10")
    if noise_pct is not None:
        ax.axhspan(-2 * noise_pct, 2 * noise_pct, color="0.85", zorder=0,
                   label=f"±2x noise of a same-seed gap at the end (std {noise_pct:.2f}%)")
    for i, config in enumerate(CONFIGS):
        # seed-matched: each seed's curve against BF16's curve of the same seed, then the mean
        seeds = sorted(set(done(config)) & set(base_runs))
        gaps = []
        for k in seeds:
            mine, base = dict(map(tuple, smooth(done(config)[k][key]))), dict(map(tuple, smooth(base_runs[k][key])))
            gaps.append([[t, 100 * (mine[t] - base[t]) / base[t]] for t in sorted(mine)
                         if t in base and math.isfinite(mine[t])])
        if not gaps:
            continue
        xs, ys = mean_curve(gaps)
        pts = list(zip(xs, ys))
        if key == "val_loss":
            pts = pts[1:]  # the first evaluation is early in warm-up: all configs ~ equal, noisy
        if not pts:
            continue
        style = "--" if config in BASELINES else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=cmap(i % 10),
                marker="o" if key == "val_loss" else None, ms=3,
                label=f"{LABELS.get(config, config)} (seeds {','.join(map(str, seeds))})", lw=1.6)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"relative {'validation' if key == 'val_loss' else 'training'} loss gap to BF16 (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out / filename, dpi=120)
    plt.close(fig)


def write_report(runs_dir: Path, out: Path) -> dict:
    runs = collect(runs_dir)
    if not runs:
        raise MissingError(f"--runs-dir {runs_dir}: no ablation runs there")
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    noise = seed_noise(summary)
    pn = {"val": paired_noise(runs, "final_val_loss"), "train": paired_noise(runs, "late_train_loss")}
    # a same-seed comparison's noise: NVFP4's seed-matched gap spread; else BF16's seed spread
    threshold_noise = {"val": pn["val"] if pn["val"] is not None else noise.get("bf16", {}).get("std_pct"),
                       "train": pn["train"]}
    orderings = check_orderings(runs, summary, threshold_noise)
    study_file = runs_dir / "study.json"
    study = json.loads(study_file.read_text()) if study_file.exists() else {}
    run_walls = [r["wall_s"] for c in runs.values() for r in c.values() if r["wall_s"]]
    sessions = study.get("sessions", [])
    session_wall = sum(s.get("wall_s", 0) for s in sessions)
    mach = hardware_info()
    plot(runs, out, "val_loss", "val_loss.png",
         "Validation loss vs BF16 of the same seed (mean over seeds)", threshold_noise["val"])
    plot(runs, out, "train_loss", "train_loss.png",
         "Training loss (EMA 0.1) vs BF16 of the same seed (mean over seeds)", threshold_noise["train"])
    results = {
        "generated": datetime.now(timezone.utc).isoformat(), "machine": mach,
        "study": {k: study.get(k) for k in ("steps", "overrides", "extra_overrides", "plan")},
        **run_settings(runs_dir), "runs_dir": _shown(runs_dir),
        "sessions": sessions, "wall_s_sum_of_runs": round(sum(run_walls), 1),
        "wall_s_sessions": round(session_wall, 1),
        "seed_noise": noise, "paired_noise_pct": pn, "threshold_noise_pct": threshold_noise,
        "summary": summary, "orderings": orderings,
        "runs": {c: {str(s): {k: v for k, v in r.items() if k not in ("train_loss",)}
                     for s, r in seeds.items()} for c, seeds in runs.items()},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(render_readme(results, out))
    return results


def run_settings(runs_dir: Path) -> dict:
    """The settings the report states, from a run's config.yaml (extra overrides may change
    them), else from recipes/experiment/ablations.yaml: the trainer's shapes, evaluation.limit."""
    cfg = next((c for c in map(run_config, sorted(runs_dir.glob("*-s*/"))) if c is not None), None)
    trainer = {k: OmegaConf.select(cfg, f"trainer.{k}", default=None) if cfg else None
               for k in ("seq_length", "global_batch_size", "eval_batches", "max_steps")}
    trainer = {k: STUDY_TRAINER[k] if v is None else v for k, v in trainer.items()}
    model = OmegaConf.to_container(cfg.model) if cfg is not None and "model" in cfg else None
    return {"trainer": trainer, "model": model,
            "downstream_limit": OmegaConf.select(cfg, "evaluation.limit", default=None) if cfg else None}


def model_line(model: dict | None, extra: list[str]) -> str:
    """What the report says the runs trained: the demo's description, or the model of the runs'
    config.yaml (name, pattern, MoE layers, BF16 layers) when an extra override changed it."""
    if not any(o.split("=", 1)[0].lstrip("+~").startswith("model") for o in extra):
        return "Demo hybrid (`M-M*-M-M-`, ~6M parameters, first 1 / last 2 pattern layers in BF16)"
    if not model:
        return "Model as the runs' config.yaml composes it (extra overrides below)"
    line = f"Model `{model.get('name')}` (`{model.get('pattern')}`"
    moe = model.get("moe")
    if moe:
        shared = moe.get("shared_expert_ffn_hidden_size")
        line += (f"; each `E` {moe['num_experts']} routed experts of width {moe['ffn_hidden_size']}, "
                 f"top-{moe['topk']}, {moe['score_function']} scores"
                 + (", expert bias" if moe.get("expert_bias") else "")
                 + (f", {moe['load_balancing']} x {moe['aux_loss_coeff']:g}"
                    if moe.get("load_balancing") not in (None, "none") else "")
                 + (f", a shared expert of {shared}" if shared else ""))
    # the model's own BF16 layers: a precision config may replace them (nvfp4_nemotron3's
    # bf16_last_fraction), and the table's rows are per config
    return (line + f"; by default first {model.get('bf16_first_layers')} / last "
            f"{model.get('bf16_last_layers')} pattern layers in BF16, as each precision config "
            "keeps or replaces them)")


def table_rows(summary: dict) -> list[dict]:
    """The results table's cells, one row per config that ran (or failed at start-up)."""
    rows = []
    for c in (c for c in CONFIGS if c in summary):  # a report of older runs lacks newer recipes
        r = summary[c]
        if not r["seeds"] and not r["diverged_seeds"]:
            if r["failed"]:
                rows.append({"config": c, "error": next(iter(r["failed"].values())).removeprefix(
                    "error: "), "failed_seeds": ", ".join(map(str, r["failed"]))})
            continue
        mean = fmt(r["final_val_loss_mean"])
        if r["final_val_loss_std"] is not None:
            mean += f" ± {r['final_val_loss_std']:.4f}"
        pg = r["paired_gap_pct"]
        per_seed = f" ({', '.join(f'{g:+.2f}' for g in pg)})" if len(pg) > 1 else ""
        seeds = ", ".join(map(str, r["seeds"]))
        if r["diverged_seeds"]:
            seeds += f" (diverged: {', '.join(map(str, r['diverged_seeds']))})"
        late = r["late_train_gap_pct_mean"]
        rows.append({
            "config": c, "error": None, "mean": mean, "seeds": seeds,
            "min_max": (f"{fmt(r['final_val_loss_min'])} / {fmt(r['final_val_loss_max'])}"
                        if len(r["seeds"]) > 1 else ""),
            "gap": "0 (reference)" if c == "bf16" else (
                f"**{statistics.fmean(pg):+.2f} %**{per_seed}" if pg else "—"),
            "late": f"{late:+.2f} %" if c != "bf16" and late is not None else "",
            "tokens_per_sec": r["tokens_per_sec_median"]})
    return rows


def _shown(path: Path) -> str:
    """A path as the report prints it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if REPO in path.parents else str(path)


def render_readme(res: dict, out: Path) -> str:
    st = res["study"]
    trainer = res.get("trainer") or STUDY_TRAINER
    steps = st.get("steps") or trainer["max_steps"]  # runs made without the study command
    seq, gbs = trainer["seq_length"], trainer["global_batch_size"]
    extra = st.get("extra_overrides") or []
    commands = [s.get("command", "") for s in res["sessions"]]
    commands = ["python -m studies.ablations" + c.split("studies/ablations.py", 1)[1]
                if "studies/ablations.py" in c else c for c in commands]
    headline, reading = out / "headline.md", out / "reading.md"
    # A claim whose two configs this study did not both run says nothing: left out of the table.
    orderings = [o for o in res["orderings"] if o["pairs"] or o["verdict_val"] != "no data"]
    runs_dir, report_args = _shown(Path(res.get("runs_dir") or DEFAULT_RUNS_DIR)), ""
    if runs_dir != DEFAULT_RUNS_DIR or _shown(out) != DEFAULT_OUT:
        report_args = f" --runs-dir {runs_dir} --out {_shown(out)}"
    return render(
        "ablations.md.j2", **{**res, "orderings": orderings, "runs_dir": runs_dir},
        steps=steps, seq=seq, gbs=gbs,
        tokens=steps * seq * gbs if steps else None, tokens_per_step=seq * gbs,
        eval_batches=trainer["eval_batches"], late_steps=max(1, (steps or 4) // 4),
        model_line=model_line(res.get("model"), extra),
        headline=headline.read_text().strip() if headline.exists() else None,
        reading=reading.read_text().strip() if reading.exists() else None,
        rows=table_rows(res["summary"]), noise=res["seed_noise"], commands=commands,
        left_out=len(res["orderings"]) - len(orderings), report_args=report_args,
        downstream=downstream_table(res["summary"], res.get("downstream_limit")),
        paired_noise=res["paired_noise_pct"], threshold_noise=res["threshold_noise_pct"],
        overrides=st.get("overrides") or STUDY_OVERRIDES,
        eval_every=max(1, (steps or 8) // 8), save_every=max(1, (steps or 4) // 4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.ablations", description=__doc__.split("\n")[0],
                                 epilog="Hydra overrides (key=value) among the flags go to every "
                                        "run, e.g. evaluation=demo for downstream scores.")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds for every config")
    ap.add_argument("--noise-seeds", type=int, nargs="*", default=[3],
                    help="extra seeds for --noise-configs only (measures seed noise)")
    ap.add_argument("--noise-configs", nargs="*", default=["bf16", "nvfp4"], choices=CONFIGS)
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per run (default: cores / jobs)")
    ap.add_argument("--runs-dir", default=DEFAULT_RUNS_DIR)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--retry-failed", action="store_true",
                    help="run again runs that failed at start-up (config errors)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from existing runs")
    argv = list(sys.argv[1:] if argv is None else argv)
    # key=value words are Hydra overrides wherever they stand: a flag taking several values
    # (--seeds 1 2) would otherwise swallow the first of them
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in overrides])
    os.chdir(REPO)
    try:
        args.overrides = check_overrides(overrides)
        for flag in ("steps", "jobs"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag} {getattr(args, flag)} must be >= 1")
        code = ExitCode.OK if args.report_only else run_study(args)
        write_report(Path(args.runs_dir), Path(args.out))
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    print(f"report: {args.out}/README.md, val_loss.png, train_loss.png, results.json")
    return code


if __name__ == "__main__":
    sys.exit(main())
