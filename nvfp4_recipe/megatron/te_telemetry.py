"""The underflow telemetry of a Transformer Engine linear, measured beside it.

TE's GEMMs quantize inside its kernels and report nothing a run can act on (its `underflows%`
needs the nvdlfw_inspect debug tooling and only logs). This measures the same statistics as the
emulated linears (nvfp4_recipe/telemetry.py) on a TE linear's own operands: hooks on the module
see the GEMM input, the weight and the output gradient, and the emulated quantizers of the
linear's current formats (bit-exact to TE's formulas, docs/numerics.md) quantize them as TE's
GEMMs do, without running any GEMM. Only on telemetry steps, and only the step's first micro-batch
(as the emulated linears): each operand is quantized whole once (the tensor amax sets NVFP4's
tensor scale, so a sample cannot be quantized alone), then its sampled rows are counted.

What differs from what TE's kernels quantize, by construction:
- stochastic rounding draws from this module's own generator, not TE's: the flushed fraction of a
  stochastically rounded gradient is the same in distribution, not bit for bit;
- with sequence parallelism TE reduces a column-parallel input's amax, and a row-parallel output
  gradient's, over the tensor-parallel group (TE v2.18 module/layernorm_linear.py:224-228,
  705-712); this counts on the rank's shard with the shard's amax, so its tensor scale can be
  larger than TE's and `scale_underflow` can read low on those operands;
- a fused LayerNorm-linear normalises in FP32 and quantizes from that (with_quantized_norm,
  layernorm_linear.py:230-239); this normalises in FP32 and rounds to the input dtype first, as the
  unfused path does.

No host sync: the counts stay on the device until the controller reads them once per window.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from nvfp4_recipe.config import PassConfigs
from nvfp4_recipe.linear import PassOps, _in_backward, pass_configs
from nvfp4_recipe.policy import RuntimePrecisionState
from nvfp4_recipe.telemetry import OperandTelemetry, weight_tile_rows

# The operands' dtype: TE quantizes from the BF16 activations and weights megatron hands it, as
# the emulated linears do (parallel_linear.COMPUTE_DTYPE).
OPERAND_DTYPE = torch.bfloat16
# The seed of each linear's own stochastic-rounding generator (never torch's global RNG, whose
# draws the run's dropout and the emulated linears own).
GENERATOR_SEED = 0x5EED


def te_gemm_input(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a TE linear's Fprop GEMM multiplies: `x` itself, or for a LayerNormLinear (megatron's
    TELayerNormColumnParallelLinear) the normalised `x`. TE v2.18 module/layernorm_linear.py:
    `normalization` "LayerNorm" | "RMSNorm" (:1314), `zero_centered_gamma` (:1323: the weight is
    gamma - 1), `eps` (:1419), `layer_norm_weight` and, for LayerNorm, `layer_norm_bias`
    (:1420-1436)."""
    gamma = getattr(module, "layer_norm_weight", None)
    if gamma is None:
        return x
    gamma = gamma.float() + (1.0 if module.zero_centered_gamma else 0.0)
    xf = x.float()
    if module.normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps) * gamma
    else:
        y = F.layer_norm(xf, xf.shape[-1:], gamma, module.layer_norm_bias.float(), module.eps)
    return y.to(x.dtype)


class TELinearTelemetry:
    """Hooks on one TE linear that count, while `state.telemetry_rows` is set, what its GEMMs'
    quantization loses (the `take_telemetry` of te_runtime.TEPrecisionLinear). `configs`: the
    emulated configs of the linear's formats (registry.pass_configs_for), replaced by
    `set_configs` when the controller switches its formats; the late switch's BF16 passes are
    read from `state` at each forward."""

    def __init__(self, module: torch.nn.Module, configs: PassConfigs,
                 state: RuntimePrecisionState):
        self.module, self.state = module, state
        self.configs = pass_configs(configs)
        self.telemetry = OperandTelemetry(0)
        # The window's first forward measured; its backward still to count (`pending`), with a
        # hook on an output waiting for it (`hooked`)
        self.measured = self.pending = self.hooked = False
        self.generator: Optional[torch.Generator] = None
        self.handle = module.register_forward_hook(self._forward)

    def set_configs(self, configs: PassConfigs) -> None:
        self.configs = pass_configs(configs)

    def take(self) -> dict[str, torch.Tensor]:
        self.measured = self.pending = self.hooked = False
        return self.telemetry.take()

    def remove(self) -> None:
        self.handle.remove()

    def _ops(self, device: torch.device) -> Optional[PassOps]:
        configs = self.configs
        if self.state.bf16_passes:
            configs = dataclasses.replace(configs, **dict.fromkeys(self.state.bf16_passes))
        return PassOps.of(configs, device) if configs.quantized else None

    def _forward(self, module, args, output) -> None:
        rows = self.state.telemetry_rows
        # megatron's recompute runs a forward without autograd, then again inside the backward:
        # that second forward carries the measured step's backward (its output gradient)
        if not rows or (self.measured and not (self.pending and _in_backward())):
            return
        out = output[0] if isinstance(output, tuple) else output
        ops = self._ops(out.device)
        if ops is None or not args:
            return
        weight = module.weight.detach().to(OPERAND_DTYPE)
        if not self.measured:
            with torch.no_grad():
                x2d = te_gemm_input(module, args[0].detach()).to(OPERAND_DTYPE)
                self.telemetry.rows, self.measured = rows, True
                self._observe_forward(ops, x2d.reshape(-1, weight.shape[1]), weight)
            self.pending = ops.dgrad is not None or ops.wgrad is not None
        # The backward's operands need the output gradient; the activation's Wgrad operand was
        # counted above, so only the weight is held (a parameter, no copy).
        if self.pending and out.requires_grad and not self.hooked:
            self.hooked = True
            out.register_hook(lambda dy: self._backward(ops, weight, dy))

    def _observe_forward(self, ops: PassOps, x2d: torch.Tensor, weight: torch.Tensor) -> None:
        """Fprop's two operands and Wgrad's activation, as nvfp4_recipe/linear.py quantizes them."""
        if ops.fprop is not None:
            self.telemetry.observe("fprop", "x", ops.fprop, x2d, ops.fprop.activation(x2d))
            self.telemetry.observe("fprop", "w", ops.fprop, weight, ops.fprop.weight_fprop(weight),
                                   weight_tile_rows(ops.fprop))
        if ops.wgrad is not None and self.module.weight.requires_grad:
            self.telemetry.observe_wgrad("x", ops.wgrad, x2d, ops.wgrad.activation_wgrad(x2d))

    @torch.no_grad()
    def _backward(self, ops: PassOps, weight: torch.Tensor, dy: torch.Tensor) -> None:
        self.pending = self.hooked = False
        dy2d = dy.detach().to(OPERAND_DTYPE).reshape(-1, weight.shape[0])
        if self.generator is None or self.generator.device != dy2d.device:
            self.generator = torch.Generator(device=dy2d.device).manual_seed(GENERATOR_SEED)
        # Dgrad first, then Wgrad: linear.py's order of stochastic-rounding draws.
        if ops.dgrad is not None:
            self.telemetry.observe("dgrad", "dy", ops.dgrad, dy2d,
                                   ops.dgrad.grad_dgrad(dy2d, self.generator))
            self.telemetry.observe("dgrad", "w", ops.dgrad, weight.t(),
                                   ops.dgrad.weight_dgrad(weight, None),
                                   weight_tile_rows(ops.dgrad))
        if ops.wgrad is not None and self.module.weight.requires_grad:
            self.telemetry.observe_wgrad("dy", ops.wgrad, dy2d,
                                         ops.wgrad.grad_wgrad(dy2d, self.generator))
