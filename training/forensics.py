"""Precision forensics: re-run one optimizer step with sets of quantized GEMMs switched to BF16,
find the smallest set whose low precision explains the step's anomaly, and watch the run for
anomalies (`trainer.on_anomaly`).

What `tools.replay --bisect` and the trainer's `on_anomaly=replay` share. Both hold a model in
the state a step starts from: its weights, the step's micro-batches, and the RNG state the step
drew its stochastic rounding from (`capture_rng`). `measure` runs the step's forward, backward and
gradient norm on that state, without the optimizer update, so it can be run again and again: with
the same formats and RNG state it computes the step again bit for bit (the replay checks this),
with other formats it says what the step would have been.

The bisect (`bisect`) works on items, one per quantized GEMM: (linear, pass), the linear named as
the precision policy names it (`layers.<pattern index>.<module>`), the pass fprop|dgrad|wgrad. A
trial keeps a set of items in their low-precision format and runs every other GEMM in BF16. The
all-BF16 trial is the reference; a trial is anomalous when it is non-finite (if the logged step
was) or when its loss or gradient norm deviates from the reference's by more than a threshold
(relative). The search is adaptive group testing by binary splitting (the recursion of delta
debugging's minimisation): a half that alone reproduces the anomaly is searched alone; when
neither half does, each is minimised with the other held on. One culprit among n items costs
about 2 log2(n) trials; k culprits about k times that.

The switch to BF16 is applied per linear through its per-pass configs (`bf16_items`), the same
object the late switch to BF16 masks (nvfp4_recipe/megatron/parallel_linear.py
`_active_gemm_config`), and restored after each trial.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from atomic_files import write_text_atomically
from nvfp4_recipe.passes import BF16

PASSES = ("fprop", "dgrad", "wgrad")
REPO = Path(__file__).resolve().parents[1]

# Config keys that do not change what a step computes: where the run lives and what it logs.
# A replay compares every other key of the checkpoint's config with the run's config.yaml.
NON_NUMERIC_KEYS = ("run.", "logger.", "plan.", "evaluation.", "trainer.log_every",
                    "trainer.save_every", "trainer.keep_last", "trainer.on_anomaly",
                    "trainer.anomaly_", "trainer.on_nan", "trainer.max_consecutive_skips",
                    "parallel.timeout_minutes", "data.cache_dir")


# -- provenance: what trained a checkpoint ---------------------------------------------------
def code_version(repo: Path = REPO) -> dict[str, Any]:
    """{"commit": HEAD or None (not a git checkout, no git), "dirty": tracked files changed}."""
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


def code_changes(recorded: dict, now: dict, repo: Path = REPO) -> list[str]:
    """The differences between the code a checkpoint recorded and this checkout's, as lines
    (empty: the same commit, neither with uncommitted changes)."""
    lines = []
    if not recorded.get("commit") or not now.get("commit"):
        return [f"code version unknown (recorded {recorded.get('commit')}, now "
                f"{now.get('commit')}): not a git checkout"] if recorded != now else []
    if recorded["commit"] != now["commit"]:
        try:
            done = subprocess.run(["git", "-C", str(repo), "diff", "--name-only",
                                   f"{recorded['commit']}..{now['commit']}"],
                                  capture_output=True, text=True, timeout=20)
            files = done.stdout.split() if done.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired):
            files = []
        shown = ", ".join(files[:8]) + (f", ... ({len(files)} files)" if len(files) > 8 else "")
        lines.append(f"commit {recorded['commit'][:10]} -> {now['commit'][:10]}"
                     + (f": {shown}" if files else " (not in this clone's history)"))
    if recorded.get("dirty"):
        lines.append("the run's checkout had uncommitted changes")
    if now.get("dirty"):
        lines.append("this checkout has uncommitted changes")
    return lines


def flat_config(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a config tree (dicts of dicts and lists)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(flat_config(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(before: dict, after: dict) -> list[str]:
    """`key: before -> after` for every key that computes differently (NON_NUMERIC_KEYS skipped)."""
    a, b = flat_config(before), flat_config(after)
    lines = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(NON_NUMERIC_KEYS) or a.get(key, "<absent>") == b.get(key, "<absent>"):
            continue
        lines.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return lines


# -- one step, measured ----------------------------------------------------------------------
def capture_rng(ctx) -> dict[str, Optional[torch.Tensor]]:
    """The RNG state a step's stochastic rounding draws from (as the checkpoint saves it)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(ctx.device) if ctx.hardware.cuda else None}


def restore_rng(state: dict[str, Optional[torch.Tensor]], ctx) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], ctx.device)


@dataclass(frozen=True)
class Outcome:
    loss: float
    grad_norm: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def same_value(a: float, b: float) -> bool:
    """Bit-identical as floats (NaN equals NaN: a non-finite step replays as non-finite)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def measure(trainer, micro_batches: list[dict], rng: dict) -> Outcome:
    """The step's loss and gradient norm from the trainer's current weights, `micro_batches`
    and RNG state `rng`, computed as Trainer.train_step computes them (forward, backward, the
    data-parallel sync, the norm with clipping as configured), without the optimizer update.
    Leaves the step's gradients in the optimizer and the RNG where the step leaves it."""
    # deferred: training.schedules and .distributed import megatron (~3 s); the replay command
    # refuses bad arguments before it pays for that
    from .distributed import step_loss_and_stop
    from .schedules import run_micro_batches

    restore_rng(rng, trainer.ctx)
    trainer.model.train()
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    trainer.precision.before_evaluation()  # the weight caches: formats may have changed
    total = run_micro_batches(trainer.model, micro_batches, trainer.ctx, trainer.activation_shape,
                              gemm=trainer.gemm)
    loss, _ = step_loss_and_stop(total, False, trainer.ctx)
    trainer.optimizer.prepare_grads()
    clip = trainer.cfg.trainer.grad_clip
    norm = trainer.optimizer.clip_grad_norm(clip) if clip > 0 else \
        trainer.optimizer.get_grad_norm()
    return Outcome(float(loss), float(norm))


# -- switching GEMMs to BF16 -------------------------------------------------------------------
Item = tuple[str, str]  # (the policy's linear name, pass)


def quantized_items(controller, step_map: dict) -> list[Item]:
    """Every (linear, pass) of the model that runs a low-precision format under `step_map`
    ({linear: PassFormats}, with the late switch's passes in BF16), in the model's order
    (pattern layer, then module), passes in Fprop, Dgrad, Wgrad order. Every rank's linears,
    so that every rank bisects the same items."""
    items = []
    for name in sorted(step_map, key=_layer_order):
        now = controller.state.formats(step_map[name])
        items.extend((name, p) for p, fmt in zip(PASSES, now.formats) if fmt != BF16)
    return items


def _layer_order(name: str) -> tuple:
    parts = name.split(".", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1, name)


@contextlib.contextmanager
def low_precision_only(controller, step_map: dict, keep: Iterable[Item]):
    """Within: the step's map `step_map`, with every quantized GEMM not in `keep` in BF16,
    applied through the controller's runtime switch (training/precision.py apply_formats: the
    emulated linears get the configs, TE's read it per forward); the map of before restored on
    exit. The underflow telemetry and the quantization diagnostics are off within, so that the
    trials leave no statistics behind (they observe; they change no value)."""
    keep = set(keep)
    state = controller.state
    changes = {}
    for name, formats in step_map.items():
        now = state.formats(formats)
        off = [p for p, fmt in zip(PASSES, now.formats) if fmt != BF16 and (name, p) not in keep]
        changes[name] = formats.with_bf16(off) if off else formats
    before = controller.current_formats()
    observers = (state.collect_diagnostics, state.telemetry_rows)
    state.collect_diagnostics, state.telemetry_rows = False, 0
    controller.apply_formats(changes)
    try:
        yield
    finally:
        controller.apply_formats(before)
        state.collect_diagnostics, state.telemetry_rows = observers


# -- the bisect ---------------------------------------------------------------------------------
@dataclass
class Thresholds:
    loss: float = 0.02  # relative |loss - loss_bf16| / |loss_bf16|
    grad_norm: float = 0.25  # relative |norm - norm_bf16| / norm_bf16


@dataclass
class Trial:
    kept: list[Item]  # the items in low precision (all others BF16)
    outcome: Outcome
    severity: float  # max of the deviations over their thresholds (inf: non-finite)
    anomalous: bool
    seconds: float


@dataclass
class BisectResult:
    step: int
    as_logged: Outcome
    reference: Outcome  # all-BF16
    anomaly: Optional[str]  # "non-finite", "loss", "grad_norm", ... or None
    culprits: list[Item] = field(default_factory=list)
    ranking: list[dict] = field(default_factory=list)  # one per module, strongest effect first
    trials: list[Trial] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        def outcome(o: Outcome) -> dict:
            return {"loss": _json_float(o.loss), "grad_norm": _json_float(o.grad_norm)}

        return {"step": self.step, "as_logged": outcome(self.as_logged),
                "all_bf16": outcome(self.reference), "anomaly": self.anomaly,
                "culprits": [{"module": m, "pass": p} for m, p in self.culprits],
                "ranking": [{k: _json_float(v) if isinstance(v, float) else v
                             for k, v in row.items()} for row in self.ranking],
                "note": self.note, "trials_run": len(self.trials),
                "trials": [{"low_precision": [f"{m}/{p}" for m, p in t.kept],
                            **outcome(t.outcome), "severity": _json_float(t.severity),
                            "anomalous": t.anomalous, "seconds": round(t.seconds, 2)}
                           for t in self.trials]}


def _json_float(x: float):
    return x if math.isfinite(x) else str(x)


def deviation(outcome: Outcome, reference: Outcome, thresholds: Thresholds) -> dict[str, float]:
    """Relative deviation of loss and grad norm from the all-BF16 reference."""
    def rel(a: float, b: float) -> float:
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        return abs(a - b) / max(abs(b), 1e-12)

    return {"loss": rel(outcome.loss, reference.loss),
            "grad_norm": rel(outcome.grad_norm, reference.grad_norm)}


def severity(outcome: Outcome, reference: Outcome, thresholds: Thresholds) -> float:
    d = deviation(outcome, reference, thresholds)
    return max(d["loss"] / thresholds.loss, d["grad_norm"] / thresholds.grad_norm)


def bisect(trainer, micro_batches: list[dict], rng: dict, step: int, step_map: dict,
           thresholds: Thresholds = Thresholds(),
           log: Callable[[str], None] = lambda line: None) -> BisectResult:
    """Find the smallest set of quantized GEMMs whose low precision explains step `step`'s
    anomaly, from the state the step starts from (`trainer`'s weights, `micro_batches`, `rng`,
    and `step_map`, the precision map the step ran with: the controller's current_formats()
    before an adaptive decision after it switched some linears).

    Ends with the step as logged computed once more, so that the trainer's gradients and RNG are
    the step's own afterwards (the trainer's on_anomaly continues from there); the map of before
    the call is restored."""
    controller = trainer.precision
    items = quantized_items(controller, step_map)
    cache: dict[frozenset, Trial] = {}
    trials: list[Trial] = []

    def run(kept: Iterable[Item]) -> Trial:
        key = frozenset(kept)
        if key in cache:
            return cache[key]
        started = time.perf_counter()
        with low_precision_only(controller, step_map, key):
            outcome = measure(trainer, micro_batches, rng)
        trial = Trial([i for i in items if i in key], outcome, math.nan, False,
                      time.perf_counter() - started)
        cache[key] = trial
        trials.append(trial)
        return trial

    as_logged = run(items)
    reference = run([])

    def judge(trial: Trial) -> Trial:
        if not math.isnan(trial.severity):  # judged already (a cached trial)
            return trial
        trial.severity = (math.inf if not trial.outcome.finite
                          else severity(trial.outcome, reference.outcome, thresholds))
        trial.anomalous = (not trial.outcome.finite if not as_logged.outcome.finite
                           else trial.severity > 1)
        log(f"  replay {trials.index(trial) + 1:>2}: {len(trial.kept):>2} GEMMs low precision -> loss "
            f"{trial.outcome.loss:.6g} grad-norm {trial.outcome.grad_norm:.6g} "
            f"({'anomalous' if trial.anomalous else 'ok'})")
        return trial

    judge(as_logged)
    judge(reference)
    result = BisectResult(step, as_logged.outcome, reference.outcome, None, trials=trials)
    if not reference.outcome.finite:
        result.note = ("the all-BF16 replay is non-finite too: the low-precision GEMMs do not "
                       "explain it")
    elif not as_logged.anomalous:
        result.note = (f"no anomaly to explain: the step as logged is within the thresholds of "
                       f"the all-BF16 replay (loss {thresholds.loss:g}, grad norm "
                       f"{thresholds.grad_norm:g} relative)")
    else:
        if not as_logged.outcome.finite:
            result.anomaly = "non-finite"
        else:
            d = deviation(as_logged.outcome, reference.outcome, thresholds)
            result.anomaly = ", ".join(f"{k} deviates {v:.3g} (threshold {getattr(thresholds, k):g})"
                                       for k, v in d.items() if v > getattr(thresholds, k))

        def anomalous(kept: list[Item]) -> bool:
            trial = cache.get(frozenset(kept))
            return (trial or judge(run(kept))).anomalous

        result.culprits = minimal_set(items, anomalous)
        result.ranking = _rank(result.culprits, run, judge, reference.outcome, thresholds)
    # the step as logged, last: the trainer's gradients and RNG are the step's own again
    with low_precision_only(controller, step_map, items):
        final = measure(trainer, micro_batches, rng)
    if not (same_value(final.loss, as_logged.outcome.loss)
            and same_value(final.grad_norm, as_logged.outcome.grad_norm)):
        result.note += (" (the step as logged did not recompute bit-identically: "
                        f"{as_logged.outcome} then {final})")
    return result


def minimal_set(items: list, anomalous: Callable[[list], bool]) -> list:
    """A minimal subset M of `items` with anomalous(M), given anomalous(items) and not
    anomalous([]): binary splitting, the minimisation of delta debugging. A half that is
    anomalous alone is searched alone; when neither half is, each is minimised with the other
    (then its minimum) held in. Order is kept."""
    def minimize(candidates: list, base: list) -> list:
        # invariant: anomalous(base + candidates), not anomalous(base)
        if len(candidates) == 1:
            return candidates
        half = len(candidates) // 2
        first, second = candidates[:half], candidates[half:]
        if anomalous(base + first):
            return minimize(first, base)
        if anomalous(base + second):
            return minimize(second, base)
        kept_first = minimize(first, base + second)
        return kept_first + minimize(second, base + kept_first)

    return minimize(list(items), [])


def _rank(culprits: list[Item], run, judge, reference: Outcome,
          thresholds: Thresholds) -> list[dict]:
    """The culprit modules, strongest effect first: each module's culprit passes alone in low
    precision (`alone`), and all culprits but that module's (`without`)."""
    modules: dict[str, list[Item]] = {}
    for item in culprits:
        modules.setdefault(item[0], []).append(item)
    rows = []
    for name, mine in modules.items():
        alone = judge(run(mine)) if len(modules) > 1 else None
        others = [i for i in culprits if i[0] != name]
        without = judge(run(others)) if others else None
        whole = run(culprits)
        top = alone or whole
        rows.append({"module": name, "passes": [p for _, p in mine],
                     "severity_alone": top.severity, "loss_alone": top.outcome.loss,
                     "grad_norm_alone": top.outcome.grad_norm,
                     "severity_without": without.severity if without else 0.0})
    rows.sort(key=lambda r: -r["severity_alone"])
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return rows


# -- watching the run: trainer.on_anomaly ----------------------------------------------------
class AnomalyWatch:
    """The trigger of trainer.on_anomaly: a non-finite loss or grad norm, or a grad norm whose
    z-score over the previous `window` finite norms exceeds `zscore` (once the window is full).
    Its window is saved in trainer.pt, so a resumed run triggers where an uninterrupted one
    would."""

    def __init__(self, window: int, zscore: float):
        self.window, self.zscore = window, zscore
        self.norms: list[float] = []

    def check(self, loss: float, grad_norm: float) -> Optional[str]:
        """Why this step is an anomaly, or None; the norm joins the window when finite."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"non-finite (loss {loss}, grad norm {grad_norm})"
        why = None
        if len(self.norms) >= self.window:
            mean = sum(self.norms) / len(self.norms)
            std = math.sqrt(sum((n - mean) ** 2 for n in self.norms) / (len(self.norms) - 1))
            z = (grad_norm - mean) / std if std > 0 else (0.0 if grad_norm == mean else math.inf)
            if z > self.zscore:
                why = (f"grad norm {grad_norm:.4g}: z-score {z:.1f} over the last "
                       f"{len(self.norms)} steps (mean {mean:.4g}, std {std:.3g}; threshold "
                       f"{self.zscore:g})")
        self.norms = (self.norms + [grad_norm])[-self.window:]
        return why

    def state_dict(self) -> dict:
        return {"norms": list(self.norms)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.norms = list((state or {}).get("norms", []))[-self.window:]


# -- output ----------------------------------------------------------------------------------
def write_replay_json(path: Path, record: dict) -> None:
    """replay.json, whole or not at all (atomic_files), its directory made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(record, indent=2, default=str) + "\n")


def bisect_table(result: BisectResult):
    """The bisect's findings, for rich: a table of the culprit modules, strongest effect first,
    or the line saying why there is none."""
    from rich.table import Table
    from rich.text import Text

    ref, low = result.reference, result.as_logged
    title = (f"step {result.step}: as logged loss {low.loss:.6g} grad-norm {low.grad_norm:.6g}; "
             f"all-BF16 loss {ref.loss:.6g} grad-norm {ref.grad_norm:.6g}; "
             f"{len(result.trials)} replays")
    if not result.ranking:
        return Text(f"{title}\n{result.note}")
    table = Table(title=title, title_justify="left")
    for column in ("rank", "module", "low-precision passes", "severity alone",
                   "loss alone", "grad-norm alone", "severity without it"):
        table.add_column(column, justify="left" if column in ("module", "low-precision passes")
                         else "right")
    for row in result.ranking:
        table.add_row(str(row["rank"]), row["module"], ",".join(row["passes"]),
                      f"{row['severity_alone']:.3g}", f"{row['loss_alone']:.6g}",
                      f"{row['grad_norm_alone']:.6g}", f"{row['severity_without']:.3g}")
    table.caption = (f"anomaly: {result.anomaly}; severity = max(loss, grad-norm deviation from "
                     "all-BF16 / its threshold); > 1 is anomalous" if result.anomaly
                     else result.note)
    return table
