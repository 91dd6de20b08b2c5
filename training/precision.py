"""The run's precision, step by step: what the trainer calls around each optimizer step and
evaluation, so that the trainer knows nothing about formats.

- `before_step`: the late switch to BF16 once its share of the run's tokens is consumed (the
  `RuntimePrecisionState` names the passes that run in BF16 from then on, and every linear
  applies that to its own per-pass formats at each call), the refresh of the quantized-weight
  caches, and the quantization diagnostics switched on when due.
- `after_step`: the step's input amaxes into the recorder's window; the diagnostics switched off
  and collected, as `quant/<layer>/<role>/<stat>` metrics.
- `before_evaluation`: the caches refreshed, so evaluation sees the last step's weights.

When to switch is a pure function (`switch_due`); when to measure, the cadence its caller gives
(`diagnostics_due`: the trainer's `Every(precision.diagnostics_every)`). Nothing else needs
checkpointing than the input-amax window (trainer.pt): the switch is a function of the consumed
tokens, decided again at the first step after a resume (which records the `switch_to_bf16`
event again).

Why here, in `training`, and not in `nvfp4_recipe`: this is the run's per-step policy (its
cadence, its events in metrics.jsonl, its state in checkpoints), over the linears of one built
model (`model.build.BuiltModel.linears`: each with its policy name, format, and the
`nvfp4_recipe.linear_protocol.PrecisionLinear` it is steered through). What extends it lives at
this layer too: a per-layer fallback NVFP4 -> MXFP8 -> BF16 from underflow statistics reduced
over the ranks, applied at step boundaries and recorded in checkpoints, needs the run's process
groups, its checkpoint and its metrics; MoE adds linears to the builder's list. `nvfp4_recipe`
keeps the numerics, the policy (which format each linear gets), the protocol and its two
implementations (emulated and TE), and the input-amax recorder the serving export reads.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from model.build import BuiltModel
from nvfp4_recipe.megatron.input_amax import InputAmaxRecorder
from nvfp4_recipe.policy import (SWITCHED_PASSES, PrecisionConfig, describe_kernels,
                                 low_precision_formats)


def switch_due(precision: PrecisionConfig, consumed_tokens: int, total_tokens: int) -> bool:
    """Whether the low-precision GEMMs run in BF16 from now on (`precision.switch_to_bf16`)."""
    at = precision.switch_to_bf16.at_fraction
    if at is None or not low_precision_formats(precision):
        return False
    return consumed_tokens >= at * total_tokens


class PrecisionController:
    """The precision of one built model as the run goes.

    `step` in the hooks is the number of optimizer steps done before the one they surround (the
    trainer's counter), as the events of metrics.jsonl number them."""

    def __init__(self, precision: PrecisionConfig, built: BuiltModel, tokens_per_step: int,
                 total_tokens: int, diagnostics_due: Callable[[int], bool] = lambda step: False):
        """`diagnostics_due(step)`: whether optimizer step `step` (from 1) measures the
        quantization error, the cadence the caller owns (the trainer's: every
        precision.diagnostics_every steps); never by default (an evaluation)."""
        self.precision = precision
        self.diagnostics_due = diagnostics_due
        self.policy = built.policy
        self.state = built.runtime_state
        self.tokens_per_step, self.total_tokens = tokens_per_step, total_tokens
        self.linears = built.linears  # this rank's, BF16 ones included (linear_protocol.py)
        # The running input amax of the low-precision linears (saved in checkpoints); its columns
        # are every rank's, the same list everywhere.
        names = [name for name, fmt in self.policy.linear_formats().items() if fmt != "bf16"]
        self.input_amax = InputAmaxRecorder(names, self.linears, precision.input_amax_steps,
                                            _device_of(built.module))

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
                         f"that have the linear): {policy.describe_map()}")
        return lines

    def before_step(self, step: int) -> list[tuple[str, dict[str, Any]]]:
        """Set up the next step; returns the events to record at `step` ((name, fields) pairs)."""
        events = []
        consumed = step * self.tokens_per_step
        if not self.state.bf16_passes and switch_due(self.precision, consumed, self.total_tokens):
            passes = self.precision.switch_to_bf16.passes
            self.state.bf16_passes = SWITCHED_PASSES[passes]
            events.append(("switch_to_bf16", {"passes": passes, "consumed_tokens": consumed}))
        self._refresh_weight_caches()
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


def diagnostics_summary(diag: dict[str, float]) -> str:
    """One log line over `after_step`'s metrics."""
    errors = [v for k, v in diag.items() if k.endswith("/rel_error")]
    zeros = [v for k, v in diag.items() if k.endswith("/zero_frac")]
    layers = {k.split("/")[1] for k in diag}
    return (f"quant: {len(layers)} low-precision linears, relative error mean "
            f"{sum(errors) / max(len(errors), 1):.4f} max {max(errors, default=0):.4f}, "
            f"flushed-to-zero mean {sum(zeros) / max(len(zeros), 1):.4f}")
