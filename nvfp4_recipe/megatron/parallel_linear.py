"""megatron-core tensor-parallel linears whose GEMMs follow a precision decision.

Column- and row-parallel semantics (sharding, TP all-reduces, the sequence-parallel
reduce-scatter after a row-parallel GEMM) are megatron's own: we only replace `_forward_impl`,
the local GEMM, and with it the sequence-parallel all-gather megatron folds into it. Every GEMM
runs on BF16 operands (as on the GPU, where activations are BF16 and TE quantizes from them); the
low-precision formats quantize those operands with the `nvfp4_recipe` emulation, each GEMM
(Fprop, Dgrad, Wgrad) in its own pass's format (`nvfp4_recipe.registry.pass_configs_for` gives
the configs of a linear's formats). Master weights and their gradients stay FP32.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from nvfp4_recipe.diagnostics import quantization_error_tensors
from nvfp4_recipe.config import PassConfigs
from nvfp4_recipe.linear import (WeightOperandCache, _in_backward, fold_input_amax, pass_configs,
                                 quantized_linear)
from nvfp4_recipe.passes import PassFormats
from nvfp4_recipe.policy import RuntimePrecisionState
from nvfp4_recipe.telemetry import OperandTelemetry

COMPUTE_DTYPE = torch.bfloat16


class _PrecisionLinearMixin:
    """The GEMM of a megatron parallel linear, routed by the layer's precision decision; a
    `nvfp4_recipe.linear_protocol.PrecisionLinear` for the run's per-step precision."""

    # A 0-d FP32 device tensor while the input-amax recorder records this linear's running input
    # amax (record_input_amax; input_amax.py, the activation scales of an NVFP4 serving export);
    # None: off.
    input_amax: Optional[torch.Tensor] = None

    def _init_precision(self, gemm_format: str, gemm_config, runtime_state):
        # The policy's format of each GEMM (nvfp4_recipe.passes.PassFormats) and the emulated
        # configs that run them: a PassConfigs, or one config for all three GEMMs (None: BF16).
        self.gemm_format = gemm_format
        self.gemm_config = gemm_config
        self.runtime_state = runtime_state or RuntimePrecisionState()
        # Filled when runtime_state.collect_diagnostics is on: {"activation": {...}, ...}, 0-d
        # device tensors that the controller takes (take_diagnostics) and reads with one host
        # sync per step.
        self.diagnostics: dict[str, dict[str, torch.Tensor]] = {}
        # TE's flag for its quantized-weight cache (refresh_weight_cache sets True at the start
        # of every step and evaluation): True -> quantize the weight and keep it, False -> reuse
        # it, None (the default, outside the trainer) -> quantize at every call.
        self.is_first_microbatch: Optional[bool] = None
        self.weight_cache = WeightOperandCache()
        # The underflow counts of this linear's GEMMs while runtime_state.telemetry_rows is set
        # (nvfp4_recipe/telemetry.py), taken by the controller once per window: those of the
        # step's first forward and its backward (a sample of the step, at a micro-batch's cost).
        self.telemetry = OperandTelemetry(0)
        self.telemetry_measured = False

    # -- the PrecisionLinear protocol (nvfp4_recipe/linear_protocol.py) --------------------
    def take_diagnostics(self) -> dict[str, dict[str, torch.Tensor]]:
        taken, self.diagnostics = self.diagnostics, {}
        return taken

    def record_input_amax(self, into: torch.Tensor) -> bool:
        self.input_amax = into
        return True

    def refresh_weight_cache(self) -> None:
        self.is_first_microbatch = True

    def take_telemetry(self) -> dict[str, torch.Tensor]:
        self.telemetry_measured = False
        return self.telemetry.take()

    def set_formats(self, formats: PassFormats, gemm_config: PassConfigs) -> None:
        # The weight cache keeps each copy with its config, so a pass that changes format never
        # reuses the old format's copy (nvfp4_recipe/linear.py: WeightOperandCache).
        self.gemm_format, self.gemm_config = formats, gemm_config

    def _active_gemm_config(self) -> Optional[PassConfigs]:
        """The configs of this call's GEMMs: the linear's, with the passes the late switch turned
        to BF16 (`runtime_state.bf16_passes`) set to None; None when no GEMM is quantized."""
        configs = pass_configs(self.gemm_config)
        bf16 = self.runtime_state.bf16_passes
        if bf16:
            configs = dataclasses.replace(configs, **dict.fromkeys(bf16))
        return configs if configs.quantized else None

    def _precision_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        out_dtype = x.dtype
        x_c, w_c = x.to(COMPUTE_DTYPE), weight.to(COMPUTE_DTYPE)
        config = self._active_gemm_config()
        # The running input amax takes the GEMM input as TE would quantize it (no host sync):
        # quantized_linear folds in the amax its quantizer computes anyway.
        if config is None:
            if self.input_amax is not None:
                fold_input_amax(self.input_amax, x_c)
            out = F.linear(x_c, w_c)
        else:
            if self.runtime_state.collect_diagnostics:
                self._record_diagnostics(x_c, w_c, config.fprop)
            rows = self.runtime_state.telemetry_rows
            # A recompute's forward (inside the backward) carries the telemetry to the backward
            # of the graph it rebuilds; its own Fprop was measured already (linear.py).
            measure = bool(rows) and (not self.telemetry_measured or _in_backward())
            if measure:
                self.telemetry.rows, self.telemetry_measured = rows, True
            out = quantized_linear(x_c, w_c, None, config, weight_cache=self._weight_cache(),
                                   input_amax=self.input_amax,
                                   telemetry=self.telemetry if measure else None)
            if (self.runtime_state.collect_diagnostics and out.requires_grad
                    and config.dgrad is not None):
                out.register_hook(lambda g: self._record_gradient(g, config.dgrad))
        out = out.to(out_dtype)
        return out + bias if bias is not None else out

    def _weight_cache(self) -> Optional[WeightOperandCache]:
        if self.is_first_microbatch is None:
            return None
        if self.is_first_microbatch:  # the weights may have changed since the cache was filled
            self.weight_cache.clear()
            self.is_first_microbatch = False
        return self.weight_cache

    # The diagnostics quantize each tensor as the rowwise operand of its first GEMM sees it: the
    # activation and weight as Fprop's (nothing to measure where Fprop runs in BF16), the
    # gradient as Dgrad's.
    @torch.no_grad()
    def _record_diagnostics(self, x, w, config):
        if config is None:
            return
        self.diagnostics["activation"] = quantization_error_tensors(x, config, role="activation")
        self.diagnostics["weight"] = quantization_error_tensors(w, config, role="weight")

    @torch.no_grad()
    def _record_gradient(self, grad, config):
        self.diagnostics["gradient"] = quantization_error_tensors(grad, config, role="gradient")
        return None


class PrecisionColumnParallelLinear(_PrecisionLinearMixin, ColumnParallelLinear):
    def __init__(self, *args, gemm_format: str = "bf16", gemm_config=None, runtime_state=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._init_precision(gemm_format, gemm_config, runtime_state)

    def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False,
                      sequence_parallel=False, **_unused):
        if sequence_parallel:
            # megatron's fused linear all-gathers the sequence shards before the GEMM and
            # reduce-scatters the input gradient (mc 0.16.1 tensor_parallel/layers.py:478-483,
            # 548-560); this mapping is that pair. It keeps the gathered input for the wgrad
            # where megatron re-gathers it in the backward: the same numbers, more memory.
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                         group=self.tp_group)
        if allreduce_dgrad:
            # megatron folds this all-reduce into its own autograd function; we keep its effect.
            input = copy_to_tensor_model_parallel_region(input, group=self.tp_group)
        return self._precision_gemm(input, weight, bias)


class PrecisionRowParallelLinear(_PrecisionLinearMixin, RowParallelLinear):
    def __init__(self, *args, gemm_format: str = "bf16", gemm_config=None, runtime_state=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._init_precision(gemm_format, gemm_config, runtime_state)

    def _forward_impl(self, input, weight, bias=None, sequence_parallel=False, **_unused):
        # RowParallelLinear.forward passes sequence_parallel=False and reduce-scatters the
        # output itself (mc 0.16.1 tensor_parallel/layers.py:1274-1291).
        assert not sequence_parallel, "megatron's row-parallel linear does its own reduce-scatter"
        return self._precision_gemm(input, weight, bias)
