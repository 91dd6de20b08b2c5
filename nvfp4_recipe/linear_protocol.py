"""What the run's per-step precision may ask of a linear of the precision policy.

The per-step precision controller (training/precision.py) steers linears of two families: the
emulated ones (nvfp4_recipe/megatron/parallel_linear.py, on CPUs and any GPU) and Transformer
Engine's (on Blackwell, through the adapter in nvfp4_recipe/megatron/te_runtime.py). It asks each
of them these things, and nothing else:

- `take_diagnostics`: the quantization statistics it recorded while the diagnostics were on
  (`RuntimePrecisionState.collect_diagnostics`), handed over and cleared;
- `record_input_amax`: from now on, fold the max |x| of every GEMM input into a tensor the
  input-amax recorder owns (nvfp4_recipe/megatron/input_amax.py);
- `refresh_weight_cache`: the weights may have changed (a new step, an evaluation), so the next
  forward quantizes them again and the step's later micro-batches reuse that copy;
- `take_telemetry`: the underflow counts its GEMMs accumulated while the telemetry was on
  (`RuntimePrecisionState.telemetry_rows`, nvfp4_recipe/telemetry.py);
- `set_formats`: run other formats from the next step on (the adaptive fallback, a replay's map).

The model builder hands the controller every policy linear its rank holds as a `HeldLinear` (the
policy's name, the format, the linear), so nobody searches a module tree for attributes. The
BF16 ones are in the list too: a TE linear's cache flag also decides whether its first
micro-batch's fused Wgrad overwrites or accumulates the main grad (te_runtime.py), and a linear
the policy keeps in BF16 is where a per-layer fallback to BF16 would put any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class PrecisionLinear(Protocol):
    def take_diagnostics(self) -> dict[str, dict[str, torch.Tensor]]:
        """{role: {stat: 0-d FP32 device tensor}} recorded since the last take ("activation",
        "weight", "gradient"; nvfp4_recipe/diagnostics.py's statistics), then forgotten; {} when
        nothing was recorded, or the linear cannot record (TE's)."""
        ...

    def record_input_amax(self, into: torch.Tensor) -> bool:
        """Fold max |x| of every later GEMM input into `into` (a 0-d FP32 tensor on the linear's
        device, which the recorder reads and zeroes once a step; no host sync). False where the
        linear cannot record (TE's): then `into` is not used."""
        ...

    def refresh_weight_cache(self) -> None:
        """The start of a step or an evaluation: the next forward quantizes the current weights."""
        ...

    def take_telemetry(self) -> dict[str, torch.Tensor]:
        """{"<pass>/<operand>": int64 counts (nvfp4_recipe.telemetry.COUNTS)} that the GEMMs
        accumulated while `RuntimePrecisionState.telemetry_rows` was set, then forgotten (TE's
        are measured beside them: nvfp4_recipe/megatron/te_telemetry.py); {} when nothing was
        counted."""
        ...

    def set_formats(self, formats: Any, gemm_config: Any) -> None:
        """From the next forward on, run these formats (a PassFormats; `gemm_config`: its
        emulated configs, nvfp4_recipe.registry.pass_configs_for), between steps."""
        ...


@dataclass(frozen=True)
class HeldLinear:
    """One linear of the precision policy that this rank holds (model.build.BuiltModel.linears)."""

    name: str  # the policy's name: `layers.<pattern index>.<module name>`
    format: str  # the format the policy gave it ("bf16" or a low-precision format)
    linear: PrecisionLinear
