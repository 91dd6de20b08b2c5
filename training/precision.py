"""The run's precision, step by step: what the trainer calls around each optimizer step and
evaluation, so that the trainer knows nothing about formats.

- `before_step`: the late switch to BF16 once its share of the run's tokens is consumed (the
  `RuntimePrecisionState` names the passes that run in BF16 from then on, and every linear
  applies that to its own per-pass formats at each call), the refresh of the quantized-weight
  caches, and the quantization diagnostics and the underflow telemetry switched on when due.
- `after_step`: the step's input amaxes into the recorder's window; the diagnostics switched off
  and collected, as `quant/<layer>/<role>/<stat>` metrics (this rank's); the telemetry collected
  as `underflow/<linear>/<pass>/<operand>/<stat>` (every rank's, MAX-reduced: one all-reduce and
  one host sync per window).
- `decide`: `precision.adaptive`'s fallback on that window (`fallback_decisions`, a pure function
  of the reduced statistics, so every rank decides alike), applied from the next step on through
  `apply_formats`, returned as `precision_fallback` events.
- `before_evaluation`: the caches refreshed, so evaluation sees the last step's weights.

When to switch is a pure function (`switch_due`); when to measure, the cadence its caller gives
(`diagnostics_due`, `telemetry_due`: the trainer's `Every(precision.diagnostics_every)` and
`Every(precision.telemetry.every)`). Checkpointed (trainer.pt): the input-amax window, and the
fallback's map and counted windows (`state_dict`), so a resumed run decides as an uninterrupted
one. The late switch is a function of the consumed tokens, decided again at the first step after
a resume (which records the `switch_to_bf16` event again).

Why here, in `training`, and not in `nvfp4_recipe`: this is the run's per-step policy (its
cadence, its events in metrics.jsonl, its state in checkpoints), over the linears of one built
model (`model.build.BuiltModel.linears`: each with its policy name, format, and the
`nvfp4_recipe.linear_protocol.PrecisionLinear` it is steered through): the per-layer fallback
NVFP4 -> MXFP8 -> BF16 from underflow statistics reduced over the ranks, applied at step
boundaries and recorded in checkpoints, needs the run's process groups, its checkpoint and its
metrics. `nvfp4_recipe` keeps the numerics (the telemetry's counts: nvfp4_recipe/telemetry.py),
the policy (which format each linear gets), the protocol and its two implementations (emulated
and TE), and the input-amax recorder the serving export reads.
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from model.build import BuiltModel
from nvfp4_recipe.megatron.input_amax import InputAmaxRecorder
from nvfp4_recipe.passes import BF16, PASSES, PassFormats
from nvfp4_recipe.policy import (ADAPTIVE_PASSES, SWITCHED_PASSES, TELEMETRY_STATS, AdaptiveConfig,
                                 PrecisionConfig, describe_kernels, describe_precision_map,
                                 low_precision_formats)
from nvfp4_recipe.registry import format_spec, pass_configs_for
from nvfp4_recipe.telemetry import OPERANDS, ratios

from . import checkpoint as ckpt
from .cadence import Every

# The underflow telemetry's metric keys: `underflow/<linear>/<pass>/<operand>/<stat>`, the linear
# by its policy name (`layers.<i>.<module>`), the pass fprop | dgrad | wgrad, the operand x | w |
# dy as that pass's GEMM quantizes it (nvfp4_recipe.telemetry.OPERANDS), the stat flush |
# scale_underflow | scale_overflow. Only the quantized (pass, operand) pairs appear.
UNDERFLOW_PREFIX = "underflow/"
# The event of each adaptive decision in metrics.jsonl (fields: see FallbackDecision.fields).
FALLBACK_EVENT = "precision_fallback"


def underflow_key(linear: str, gemm: str, operand: str, stat: str) -> str:
    return f"{UNDERFLOW_PREFIX}{linear}/{gemm}/{operand}/{stat}"


def parse_underflow_key(key: str) -> Optional[tuple[str, str, str, str]]:
    """(linear, pass, operand, stat) of an underflow telemetry metric key, None for any other."""
    if not key.startswith(UNDERFLOW_PREFIX):
        return None
    parts = key[len(UNDERFLOW_PREFIX):].split("/")
    if len(parts) != 4:
        return None
    linear, gemm, operand, stat = parts
    if (not linear.startswith("layers.") or gemm not in OPERANDS or operand not in OPERANDS[gemm]
            or stat not in TELEMETRY_STATS):
        return None
    return linear, gemm, operand, stat


def switch_due(precision: PrecisionConfig, consumed_tokens: int, total_tokens: int) -> bool:
    """Whether the low-precision GEMMs run in BF16 from now on (`precision.switch_to_bf16`)."""
    at = precision.switch_to_bf16.at_fraction
    if at is None or not low_precision_formats(precision):
        return False
    return consumed_tokens >= at * total_tokens


@dataclass(frozen=True)
class FallbackDecision:
    """One GEMM pass of one linear moved down the ladder (`precision.adaptive`)."""

    module: str  # the policy's linear name
    gemm: str  # fprop | dgrad | wgrad
    source: str  # the format it ran
    target: str  # the format it runs from the next step on
    statistic: str
    value: float  # the statistic in the window that decided (its operands' largest)
    threshold: float
    windows: int  # consecutive telemetry windows above the threshold

    def fields(self) -> dict[str, Any]:
        """The `precision_fallback` event's fields in metrics.jsonl."""
        return {"module": self.module, "pass": self.gemm, "from": self.source,
                "to": self.target, "statistic": self.statistic, "value": self.value,
                "threshold": self.threshold, "windows": self.windows}


@dataclass(frozen=True)
class AdaptiveState:
    """What the fallback remembers between windows (saved in checkpoints): the consecutive
    windows each (linear, pass, statistic) stayed above its threshold, and the GEMMs (linear,
    pass) that fell back so far (what the cap counts)."""

    streaks: Mapping[tuple[str, str, str], int] = dataclass_field(default_factory=dict)
    moved: frozenset = frozenset()


def pass_statistics(window: Mapping[str, float]) -> dict[tuple[str, str], dict[str, float]]:
    """{(linear, pass): {stat: the largest over the pass's operands}} of underflow metrics."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in window.items():
        parsed = parse_underflow_key(key)
        if parsed is None:
            continue
        linear, gemm, _operand, stat = parsed
        stats = out.setdefault((linear, gemm), {})
        stats[stat] = max(stats.get(stat, value), value)
    return out


def quantized_gemms(formats: Mapping[str, PassFormats], passes) -> int:
    """How many (linear, pass) GEMMs among `passes` run a low-precision format."""
    return sum(getattr(f, gemm) != BF16 for f in formats.values() for gemm in passes)


def fallback_decisions(statistics: Mapping[tuple[str, str], Mapping[str, float]],
                       formats: Mapping[str, PassFormats], state: AdaptiveState,
                       adaptive: AdaptiveConfig, total_gemms: int,
                       fits: Callable[[str, str], bool] = lambda linear, fmt: True,
                       ) -> tuple[AdaptiveState, list[FallbackDecision]]:
    """One telemetry window's decisions, a pure function of its (rank-reduced) statistics.

    A (linear, pass) whose format is on `adaptive.ladder` below its last rung, among the passes
    `adaptive.passes` lets move, counts the windows each watched statistic is above its threshold
    (a window at or below it starts the count again; a window without the statistic leaves it).
    At `patience` windows it moves to the next rung its shapes can run (`fits(linear, format)`),
    and its counts start again. At most floor(max_fallback_fraction x total_gemms) GEMMs ever
    move (a GEMM moving a second rung is not counted again); when more are due, those furthest
    above their thresholds go first (then by name and pass, so every rank picks the same).
    Returns the new state and the decisions, in that order."""
    watched = {stat: getattr(adaptive.thresholds, stat) for stat in TELEMETRY_STATS
               if getattr(adaptive.thresholds, stat) is not None}
    ladder = list(adaptive.ladder)
    movable = ADAPTIVE_PASSES[adaptive.passes]
    streaks = dict(state.streaks)
    due = []
    for (linear, gemm), stats in sorted(statistics.items()):
        fmt = getattr(formats[linear], gemm) if linear in formats else None
        if gemm not in movable or fmt not in ladder or fmt == ladder[-1]:
            continue
        above = []
        for stat, threshold in watched.items():
            if stat not in stats:
                continue
            key = (linear, gemm, stat)
            streaks[key] = streaks.get(key, 0) + 1 if stats[stat] > threshold else 0
            if streaks[key] >= adaptive.patience:
                ratio = stats[stat] / threshold if threshold > 0 else math.inf
                above.append((ratio, stat))
        if above:
            ratio, stat = max(above, key=lambda a: (a[0], -TELEMETRY_STATS.index(a[1])))
            due.append((-ratio, linear, PASSES.index(gemm), stat))
    cap = math.floor(adaptive.max_fallback_fraction * total_gemms + 1e-9)
    moved = set(state.moved)
    decisions = []
    for _, linear, gemm_index, stat in sorted(due):
        gemm = PASSES[gemm_index]
        if (linear, gemm) not in moved and len(moved) >= cap:
            continue
        fmt = getattr(formats[linear], gemm)
        target = next((f for f in ladder[ladder.index(fmt) + 1:] if fits(linear, f)), None)
        if target is None:
            continue
        moved.add((linear, gemm))
        decisions.append(FallbackDecision(
            linear, gemm, fmt, target, stat, statistics[(linear, gemm)][stat],
            watched[stat], streaks[(linear, gemm, stat)]))
        for s in watched:
            streaks.pop((linear, gemm, s), None)
    return AdaptiveState(streaks, frozenset(moved)), decisions


def block_fits(shapes: Optional[Mapping[str, tuple[int, int]]]) -> Callable[[str, str], bool]:
    """fits(linear, format) for fallback_decisions: the linear's local (K, N), from `shapes`
    ({module name: (in, out)}, model.specs.linear_shapes; None: every format fits), are whole
    blocks of the format where it needs them (MXFP8: 32)."""

    def fits(linear: str, fmt: str) -> bool:
        ops = format_spec(fmt).ops
        shape = (shapes or {}).get(linear.split(".", 2)[-1])
        if ops is None or shape is None or not ops.whole_blocks_only:
            return True
        return all(size % ops.block == 0 for size in shape)

    return fits


class PrecisionController:
    """The precision of one built model as the run goes.

    `step` in the hooks is the number of optimizer steps done before the one they surround (the
    trainer's counter), as the events of metrics.jsonl number them."""

    def __init__(self, precision: PrecisionConfig, built: BuiltModel, tokens_per_step: int,
                 total_tokens: int, diagnostics_due: Callable[[int], bool] = lambda step: False,
                 telemetry_due: Optional[Callable[[int], bool]] = None,
                 gemm_shapes: Optional[Mapping[str, tuple[int, int]]] = None):
        """`diagnostics_due(step)`: whether optimizer step `step` (from 1) measures the
        quantization error, the cadence the caller owns (the trainer's: every
        precision.diagnostics_every steps); never by default (an evaluation). `telemetry_due`:
        the same for the underflow telemetry (default every precision.telemetry.every steps).
        `gemm_shapes`: {module name: (in, out)} of this layout's local linears
        (model.specs.linear_shapes), so a fallback skips a format the shapes cannot run."""
        self.precision = precision
        self.diagnostics_due = diagnostics_due
        self.telemetry_due = telemetry_due or Every(precision.telemetry.every)
        self.policy = built.policy
        self.state = built.runtime_state
        self.tokens_per_step, self.total_tokens = tokens_per_step, total_tokens
        self.linears = built.linears  # this rank's, BF16 ones included (linear_protocol.py)
        self.device = _device_of(built.module)
        # Every rank's linears (the policy's), with the formats the policy gave them; the run's
        # switches to other formats are in state.linear_formats (apply_formats).
        self.policy_formats = {name: PassFormats(fmt)
                               for name, fmt in self.policy.linear_formats().items()}
        # The running input amax of the low-precision linears (saved in checkpoints); its columns
        # are every rank's, the same list everywhere.
        names = [name for name, fmt in self.policy_formats.items() if fmt != "bf16"]
        self.input_amax = InputAmaxRecorder(names, self.linears, precision.input_amax_steps,
                                            self.device)
        self.adaptive = precision.adaptive
        self.adaptive_state = AdaptiveState()
        self.fits = block_fits(gemm_shapes)
        # The cap's base: the GEMMs the policy quantizes among those the fallback may move.
        self.total_gemms = quantized_gemms(self.policy_formats,
                                           ADAPTIVE_PASSES[self.adaptive.passes])
        self.window: dict[str, float] = {}  # the last telemetry window's metrics, for decide()

    @property
    def quantizes(self) -> bool:
        """Whether any linear runs a low-precision format (what the preflight checks)."""
        return bool(low_precision_formats(self.precision))

    def describe(self, backend: str, reason: str, device) -> list[str]:
        """The start-up lines: the backend, the BF16 layers, the quantizers, the precision map."""
        precision, policy = self.precision, self.policy
        kernels = describe_kernels(precision, backend, device)
        lines = [f"precision {precision.name}: {backend} GEMMs ({reason})"
                 + (f"; first {policy.first} / last {policy.last} pattern layers in BF16"
                    if policy.formats.low_precision else "")
                 + (f"; {kernels}" if kernels else "")]
        if self.quantizes:
            lines.append(f"precision map (each linear's Fprop/Dgrad/Wgrad; runs of pattern layers "
                         f"that have the linear): {self.describe_map()}")
        if self.quantizes and self.precision.telemetry.every:
            telemetry = self.precision.telemetry
            adaptive = self.adaptive
            lines.append(
                f"underflow telemetry every {telemetry.every} steps ({telemetry.rows} rows per "
                "operand" + ("" if backend == "emulated" else
                             "; measured beside the TE linears by the emulated quantizers")
                + ")" + (f"; adaptive fallback {' -> '.join(adaptive.ladder)} after "
                         f"{adaptive.patience} windows, {adaptive.passes} passes"
                         if adaptive.enabled else ""))
        return lines

    # -- the precision map as the run goes --------------------------------------------------
    def current_formats(self) -> dict[str, PassFormats]:
        """{linear: formats} of every linear now: the policy's, with the run's switches
        (apply_formats; the late switch to BF16 aside)."""
        switched = self.state.linear_formats
        return {name: switched.get(name, fmt) for name, fmt in self.policy_formats.items()}

    def switched_formats(self) -> dict[str, PassFormats]:
        """The linears whose formats differ from the policy's, and their formats now."""
        return dict(self.state.linear_formats)

    def describe_map(self) -> str:
        """The precision map now (the policy's, with the run's switches), on one line."""
        return describe_precision_map(self.policy.precision_map(self.state.linear_formats))

    def apply_formats(self, changes: Mapping[str, Any]) -> None:
        """Switch linears to other formats from their next forward on ({policy name: PassFormats
        or its string}; the policy's own formats undo a switch). Call it between steps, with the
        same changes on every rank. The emulated linears get the configs of their new formats;
        the TE ones read the runtime state at each forward (te_runtime.te_linear_context).
        ValueError for a name the policy does not have."""
        held = {h.name: h.linear for h in self.linears}
        for name, value in changes.items():
            if name not in self.policy_formats:
                raise ValueError(f"{name!r} is not a linear of this model's precision policy")
            formats = PassFormats(value)
            if formats == self.policy_formats[name]:
                self.state.linear_formats.pop(name, None)
            else:
                self.state.linear_formats[name] = formats
            linear = held.get(name)
            if linear is not None:  # another pipeline stage holds the others
                linear.set_formats(formats, pass_configs_for(*formats.formats, self.precision))

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What trainer.pt holds under "precision": "map", {linear: "fprop/dgrad/wgrad"
        formats} of the linears switched from the policy's (precision_map_of reads it), and the
        fallback's windows and moved GEMMs, so a resumed run decides as an uninterrupted one."""
        return {"map": {name: str(fmt) for name, fmt in self.state.linear_formats.items()},
                "streaks": [[*key, count] for key, count in
                            sorted(self.adaptive_state.streaks.items())],
                "moved": sorted([list(m) for m in self.adaptive_state.moved])}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:  # a checkpoint written before the adaptive precision: the policy's map
            return
        self.apply_formats(state.get("map", {}))
        self.adaptive_state = AdaptiveState(
            {(linear, gemm, stat): int(count)
             for linear, gemm, stat, count in state.get("streaks", [])},
            frozenset((linear, gemm) for linear, gemm in state.get("moved", [])))

    def before_step(self, step: int) -> list[tuple[str, dict[str, Any]]]:
        """Set up the next step; returns the events to record at `step` ((name, fields) pairs)."""
        events = []
        consumed = step * self.tokens_per_step
        if not self.state.bf16_passes and switch_due(self.precision, consumed, self.total_tokens):
            passes = self.precision.switch_to_bf16.passes
            self.state.bf16_passes = SWITCHED_PASSES[passes]
            events.append(("switch_to_bf16", {"passes": passes, "consumed_tokens": consumed}))
        self._refresh_weight_caches()
        # Diagnostics, when due, record each linear's last micro-batch; the telemetry counts
        # every micro-batch's GEMMs.
        self.state.collect_diagnostics = self.diagnostics_due(step + 1)
        due = self.quantizes and self.telemetry_due(step + 1)
        self.state.telemetry_rows = self.precision.telemetry.rows if due else 0
        return events

    def after_step(self, step: int) -> dict[str, float]:
        """The step's precision metrics ({} unless diagnostics or telemetry were due): the
        diagnostics' `quant/...` of this rank, the telemetry's `underflow/...` of every rank
        (reduced)."""
        self.input_amax.end_step()
        metrics = {}
        if self.state.telemetry_rows:
            self.state.telemetry_rows = 0
            metrics.update(self._collect_telemetry())
        self.window = metrics.copy()
        if self.state.collect_diagnostics:
            self.state.collect_diagnostics = False
            metrics.update(self._collect_diagnostics())
        return metrics

    def decide(self, step: int) -> list[tuple[str, dict[str, Any]]]:
        """After optimizer step `step` (from 1): the adaptive fallback's decisions on the
        telemetry window after_step collected (none when it collected none, the fallback is off,
        or the map froze: step > adaptive.freeze_after_step), applied from the next step on;
        returns their events ((name, fields) pairs). The statistics are every rank's reduced,
        so every rank decides the same."""
        window, self.window = self.window, {}
        freeze = self.adaptive.freeze_after_step
        if not window or not self.adaptive.enabled or (freeze is not None and step > freeze):
            return []
        current = self.current_formats()
        self.adaptive_state, decisions = fallback_decisions(
            pass_statistics(window), current, self.adaptive_state, self.adaptive,
            self.total_gemms, self.fits)
        changes: dict[str, PassFormats] = {}
        for d in decisions:
            changes[d.module] = changes.get(d.module, current[d.module]).replace({d.gemm: d.target})
        self.apply_formats(changes)
        return [(FALLBACK_EVENT, d.fields()) for d in decisions]

    def _collect_telemetry(self) -> dict[str, float]:
        """Every quantized (linear, pass, operand)'s statistics, the largest over the ranks that
        measured it (one all-reduce, one host sync); the entries no rank measured (TE linears)
        are left out."""
        entries = []
        for name, formats in self.current_formats().items():
            now = self.state.formats(formats)
            entries += [(name, gemm, operand) for gemm in PASSES if getattr(now, gemm) != BF16
                        for operand in OPERANDS[gemm]]
        if not entries:
            return {}
        index = {entry: i for i, entry in enumerate(entries)}
        values = torch.full((len(entries), 3), -1.0, device=self.device)
        for held in self.linears:
            for key, counts in held.linear.take_telemetry().items():
                gemm, operand = key.split("/")
                i = index.get((held.name, gemm, operand))
                if i is not None:
                    values[i] = ratios(counts).to(self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {underflow_key(*entry, stat): value
                for entry, row in zip(entries, values.tolist())
                for stat, value in zip(TELEMETRY_STATS, row) if value >= 0}

    def _collect_diagnostics(self) -> dict[str, float]:
        keys, values = [], []
        for held in self.linears:
            for role, stats in held.linear.take_diagnostics().items():
                for stat, value in stats.items():
                    keys.append(f"quant/{held.name}/{role}/{stat}")
                    values.append(torch.as_tensor(value, dtype=torch.float32))
        if not values:
            return {}
        # The linears' statistics stay on the device until here: one host sync for all of them.
        return dict(zip(keys, torch.stack([v.to(values[0].device) for v in values]).tolist()))

    def before_evaluation(self) -> None:
        self._refresh_weight_caches()  # the weights the last step produced

    def _refresh_weight_caches(self) -> None:
        for held in self.linears:
            held.linear.refresh_weight_cache()


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def precision_map_of(trainer_state: Optional[Mapping[str, Any]]) -> dict[str, PassFormats]:
    """{linear: formats} of the linears a run switched from its policy's formats, from a
    checkpoint's trainer.pt (loaded with weights_only=True); {} for a checkpoint without them."""
    state = (trainer_state or {}).get("precision") or {}
    return {name: PassFormats(fmt) for name, fmt in (state.get("map") or {}).items()}


def checkpoint_precision_map(checkpoint: Path) -> dict[str, PassFormats]:
    """precision_map_of a checkpoint directory's trainer.pt ({} where it has none or cannot be
    read: the map is informational where this is used, the weights are read separately)."""
    try:
        state = torch.load(Path(checkpoint) / "trainer.pt", map_location="cpu", weights_only=True)
        return precision_map_of(state if isinstance(state, dict) else None)
    except Exception:  # noqa: BLE001  (a missing or unreadable trainer.pt: the policy's map)
        return {}


def resume_precision_map(run_dir: Path) -> dict[str, PassFormats]:
    """The switched formats a run in `run_dir` continues with (run.resume=auto): those of its
    newest checkpoint that has a trainer.pt; {} for a fresh directory."""
    root = Path(run_dir) / "checkpoints"
    for checkpoint in reversed(ckpt.step_dirs(root)) if root.is_dir() else ():
        if (checkpoint / "trainer.pt").is_file():
            return checkpoint_precision_map(checkpoint)
    return {}


def diagnostics_summary(diag: dict[str, float]) -> str:
    """One log line over `after_step`'s metrics (its `quant/...`)."""
    diag = {k: v for k, v in diag.items() if k.startswith("quant/")}
    errors = [v for k, v in diag.items() if k.endswith("/rel_error")]
    zeros = [v for k, v in diag.items() if k.endswith("/zero_frac")]
    layers = {k.split("/")[1] for k in diag}
    return (f"quant: {len(layers)} low-precision linears, relative error mean "
            f"{sum(errors) / max(len(errors), 1):.4f} max {max(errors, default=0):.4f}, "
            f"flushed-to-zero mean {sum(zeros) / max(len(zeros), 1):.4f}")
