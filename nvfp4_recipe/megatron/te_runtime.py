"""What Transformer Engine layers run under, step by step: pure decisions, tested on CPU.

- Which recipe each layer runs under at a given moment of the run (`te_layer_recipe`): the
  recipe of the layer's formats (one per GEMM pass, te_mapping.build_te_recipe: one format's
  recipe, its high-precision-backward variant, or a CustomRecipe of HybridQuantizers) with the
  passes the late switch turned to BF16 applied (`RuntimePrecisionState.formats`, the same rule
  as the emulated linears); BF16 layers run outside any recipe. The autocast is entered per layer
  at every forward (`te_layer_context`), so the switch reaches layers built long before.
- Which recipe one linear runs under when `precision.overrides` gave it other formats than its
  layer (`te_linear_context`): TE's autocast is a global state that a nested autocast replaces
  for its extent and restores on exit (TE v2.9 quantization.py:846-860); a module records at
  forward whether it quantized and with which recipe, and its backward follows that
  (module/linear.py:433-434), so wrapping one linear's forward is enough. A BF16 linear inside a
  low-precision layer runs under `autocast(enabled=False)`, as megatron-core forces BF16 for one
  module (mc 0.16.1 extensions/transformer_engine.py:205-215, 669-678).
- When TE's cached quantized weights are refreshed (`TEPrecisionLinear.refresh_weight_cache`).
  TE quantizes a weight when `is_first_microbatch` is True and reuses that copy while it is False
  (TE `module/linear.py:253-260`, `module/base.py:1378-1446`, v2.8). megatron's TE wrappers set
  the flag to False after each call (`extensions/transformer_engine.py:672-678, 893-900`, core
  0.16.1), and only `MegatronModule.set_is_first_microbatch` sets it back, and only when
  `config.fp8`/`fp4` is set (`transformer/module.py:105-121`), which this project does not use:
  without a reset every step after the first would reuse step 1's quantized weights. The
  precision controller sets it on every linear of the policy before every training step and
  every evaluation: quantized once per step, reused by that step's micro-batches, never across
  steps. On the BF16 linears too: with `fuse_wgrad_accumulation` the flag also decides whether a
  micro-batch's Wgrad overwrites the main grad (True) or accumulates into it (module/linear.py:
  822-824, v2.8).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch

from nvfp4_recipe.megatron.te_telemetry import TELinearTelemetry
from nvfp4_recipe.passes import PassFormats
from nvfp4_recipe.policy import LayerPrecision, RuntimePrecisionState


def te_formats_recipe(formats: PassFormats, state: RuntimePrecisionState,
                      recipes: dict[str, Any], name: Optional[str] = None) -> Optional[Any]:
    """The recipe a linear of these formats runs under now (None: plain BF16); `name`: the
    policy name of a linear the controller may switch at run time (state.linear_formats).
    `recipes`: one per PassFormats the run's linears run at some step (te_mapping.during_run),
    built once; a `RecipeTable` builds the others (a run-time switch's) on first use."""
    now = state.formats(formats, name)
    if not now.low_precision:
        return None
    try:
        return recipes[now]
    except KeyError:
        raise KeyError(f"no TE recipe was built for {now} (Fprop/Dgrad/Wgrad); build_model "
                       "builds one for every format its linears run, before and after the "
                       "switch") from None


class RecipeTable(dict):
    """{PassFormats: TE recipe} that builds a missing recipe once, on first use (`build`): the
    formats a linear is switched to at run time (precision.adaptive's ladder, a replay's map) are
    not known when the model is built. One object per formats, as for the others."""

    def __init__(self, built: dict, build: Callable[[PassFormats], Any]):
        super().__init__(built)
        self.build = build

    def __missing__(self, formats: PassFormats):
        recipe = self[formats] = self.build(formats)
        return recipe


def te_layer_recipe(decision: LayerPrecision, state: RuntimePrecisionState,
                    recipes: dict[str, Any]) -> Optional[Any]:
    """The TE recipe a layer's forward runs under now, or None for plain BF16."""
    return te_formats_recipe(decision.format, state, recipes)


def te_layer_context(decision: LayerPrecision, state: RuntimePrecisionState,
                     recipes: dict[str, Any], autocast: Callable[[Any], Any]) -> Callable[[], Any]:
    """A factory of the context one layer's forward runs in, decided anew at every call."""

    def context():
        chosen = te_layer_recipe(decision, state, recipes)
        return nullcontext() if chosen is None else autocast(chosen)

    return context


def te_linear_context(layer_formats: PassFormats, linear_formats: PassFormats,
                      state: RuntimePrecisionState, recipes: dict[str, Any],
                      autocast: Callable[[Any], Any],
                      no_autocast: Callable[[], Any],
                      name: Optional[str] = None) -> Callable[[], Any]:
    """A factory of the context one linear's forward runs in, inside its layer's context: nothing
    when the linear runs what its layer runs, else its own recipe or TE's autocast turned off.
    With `name` (the linear's policy name) the linear's formats are read from the runtime state
    at every forward, so the controller can switch them (PrecisionController.apply_formats)."""

    def context():
        layer = te_formats_recipe(layer_formats, state, recipes)
        linear = te_formats_recipe(linear_formats, state, recipes, name)
        if linear is layer:
            return nullcontext()
        return no_autocast() if linear is None else autocast(linear)

    return context


class TEPrecisionLinear:
    """A megatron TE linear wrapper (TELinear, TELayerNormColumnParallelLinear, ...) as a
    `nvfp4_recipe.linear_protocol.PrecisionLinear`. TE's linears record no diagnostics and no
    input amax (input_amax.py); their underflow telemetry is measured beside them
    (`telemetry`, te_telemetry.TELinearTelemetry: every low-precision linear has one); their
    quantized-weight cache is refreshed through TE's own flag (see the module docstring). Their
    formats switch through the runtime state their gemm context reads per forward (`switchable`:
    built with one)."""

    def __init__(self, module: torch.nn.Module, switchable: bool = False,
                 telemetry: Optional[TELinearTelemetry] = None):
        self.module = module
        self.switchable = switchable
        self.telemetry = telemetry

    def take_diagnostics(self) -> dict[str, dict[str, torch.Tensor]]:
        return {}

    def take_telemetry(self) -> dict[str, torch.Tensor]:
        return self.telemetry.take() if self.telemetry is not None else {}

    def set_formats(self, formats: PassFormats, gemm_config: Any = None) -> None:
        # Nothing to hold here: the linear's context reads RuntimePrecisionState.linear_formats,
        # which the controller sets, at its next forward. TE re-reads the autocast's recipe at
        # every forward and re-creates its quantizers when it changed (init_fp8_metadata, TE
        # v2.9 module/base.py:1007-1061; a recipe of another class also drops the cached
        # quantized weights, :1051-1061), and the backward follows the recipe its forward ran
        # (module/linear.py:433-434), so a switch between steps reaches both. The telemetry
        # measures the new formats from then on.
        if not self.switchable:
            raise RuntimeError("this TE linear was built without a run-time format switch "
                               "(model.build.build_model gives every low-precision linear one)")
        if self.telemetry is not None and gemm_config is not None:
            self.telemetry.set_configs(gemm_config)

    def record_input_amax(self, into: torch.Tensor) -> bool:
        return False

    def refresh_weight_cache(self) -> None:
        self.module.is_first_microbatch = True
