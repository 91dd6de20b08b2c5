"""The run-time precision of a built model: what the trainer calls around each optimizer step and
evaluation, so that the trainer knows nothing about formats.

- `before_step`: the late switch to BF16 once its share of the run's tokens is consumed (flips
  the `RuntimePrecisionState` every low-precision linear reads per call), the refresh of the
  quantized-weight caches (te_runtime.refresh_quantized_weights), and the quantization
  diagnostics switched on when due.
- `after_step`: the diagnostics switched off and collected, as `quant/<layer>/<role>/<stat>`
  metrics.
- `before_evaluation`: the caches refreshed, so evaluation sees the last step's weights.

When to switch is a pure function (`switch_due`); when to measure, the cadence its caller gives
(`diagnostics_due`: the trainer's `Every(precision.diagnostics_every)`). Nothing
needs checkpointing: the switch is a function of the consumed tokens, decided again at the first
step after a resume (which records the `switch_to_bf16` event again).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nvfp4_recipe.policy import PrecisionConfig, describe_kernels, low_precision_formats

from .input_amax import InputAmaxRecorder
from .te_runtime import modules_with_weight_cache, refresh_quantized_weights


def switch_due(precision: PrecisionConfig, consumed_tokens: int, total_tokens: int) -> bool:
    """Whether the low-precision GEMMs run in BF16 from now on (`precision.switch_to_bf16`)."""
    at = precision.switch_to_bf16.at_fraction
    if at is None or precision.format == "bf16":
        return False
    return consumed_tokens >= at * total_tokens


class PrecisionController:
    """The precision of one built model (model.build.BuiltModel) as the run goes.

    `step` in the hooks is the number of optimizer steps done before the one they surround (the
    trainer's counter), as the events of metrics.jsonl number them."""

    def __init__(self, precision: PrecisionConfig, built, tokens_per_step: int,
                 total_tokens: int, diagnostics_due: Callable[[int], bool] = lambda step: False):
        """`diagnostics_due(step)`: whether optimizer step `step` (from 1) measures the
        quantization error, the cadence the caller owns (the trainer's: every
        precision.diagnostics_every steps); never by default (an evaluation)."""
        self.precision = precision
        self.diagnostics_due = diagnostics_due
        self.model: torch.nn.Module = built.module
        self.policy = built.policy
        self.state = built.runtime_state
        self.tokens_per_step, self.total_tokens = tokens_per_step, total_tokens
        self.weight_caches = modules_with_weight_cache(self.model)  # TE's quantized weights
        # The running input amax of the low-precision linears (saved in checkpoints).
        self.input_amax = InputAmaxRecorder(*low_precision_linears(self.model, self.policy),
                                            precision.input_amax_steps, _device_of(self.model))

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
                    if precision.format != "bf16" else "")
                 + (f"; {kernels}" if kernels else "")]
        if self.quantizes:
            lines.append(f"precision map (each linear's Fprop/Dgrad/Wgrad; runs of pattern layers "
                         f"that have the linear): {policy.describe_map()}")
        return lines

    def before_step(self, step: int) -> list[tuple[str, dict[str, Any]]]:
        """Set up the next step; returns the events to record at `step` ((name, fields) pairs)."""
        events = []
        consumed = step * self.tokens_per_step
        if self.state.switched_passes is None and switch_due(self.precision, consumed,
                                                             self.total_tokens):
            passes = self.precision.switch_to_bf16.passes
            self.state.switched_passes = passes
            events.append(("switch_to_bf16", {"passes": passes, "consumed_tokens": consumed}))
        refresh_quantized_weights(self.weight_caches)
        # Diagnostics, when due, record each linear's last micro-batch.
        self.state.collect_diagnostics = self.diagnostics_due(step + 1)
        return events

    def after_step(self, step: int) -> dict[str, float]:
        """The step's precision metrics ({} unless diagnostics were due)."""
        self.input_amax.end_step()
        if not self.state.collect_diagnostics:
            return {}
        self.state.collect_diagnostics = False
        keys, values = [], []
        for name, module in self.model.named_modules():
            for role, stats in getattr(module, "diagnostics", {}).items():
                for stat, value in stats.items():
                    keys.append(f"quant/{name.removeprefix('decoder.')}/{role}/{stat}")
                    values.append(torch.as_tensor(value, dtype=torch.float32))
            if hasattr(module, "diagnostics"):
                module.diagnostics = {}
        if not values:
            return {}
        # The linears' statistics stay on the device until here: one host sync for all of them.
        return dict(zip(keys, torch.stack([v.to(values[0].device) for v in values]).tolist()))

    def before_evaluation(self) -> None:
        refresh_quantized_weights(self.weight_caches)  # the weights the last step produced


def low_precision_linears(model: torch.nn.Module, policy) -> tuple[list[str], dict]:
    """(every low-precision linear's name in the whole model, {name: module} of those this rank
    holds and records), names as the policy gives them: `layers.<pattern index>.<module name>`."""
    formats = policy.linear_formats() if hasattr(policy, "linear_formats") else {}
    names = [name for name, fmt in formats.items() if fmt != "bf16"]
    decoder = getattr(model, "decoder", None)
    offset = getattr(decoder, "layer_offset", 0)  # the first layer of this pipeline stage
    held = {}
    for local, layer in enumerate(getattr(decoder, "layers", None) or []):
        index = offset + local
        for name in policy.linear_names.get(policy.layer_kinds[index], ()):
            key = f"layers.{index}.{name}"
            module = layer.get_submodule(name)
            # Emulated linears record (parallel_linear.py); TE's do not (input_amax.py).
            if formats.get(key, "bf16") != "bf16" and hasattr(type(module), "input_amax"):
                held[key] = module
    return names, held


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def diagnostics_summary(diag: dict[str, float]) -> str:
    """One log line over `after_step`'s metrics."""
    errors = [v for k, v in diag.items() if k.endswith("/rel_error")]
    zeros = [v for k, v in diag.items() if k.endswith("/zero_frac")]
    layers = {k.split("/")[1] for k in diag}
    return (f"quant: {len(layers)} low-precision linears, relative error mean "
            f"{sum(errors) / max(len(errors), 1):.4f} max {max(errors, default=0):.4f}, "
            f"flushed-to-zero mean {sum(zeros) / max(len(zeros), 1):.4f}")
