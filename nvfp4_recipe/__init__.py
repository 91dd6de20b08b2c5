"""NVFP4 pretraining numerics: quantizers (NVFP4, MXFP4, MXFP8, FP8 block), the 16-point RHT, stochastic
rounding, and emulated quantized linear layers bit-exact to Transformer Engine's formulas; the
format registry (registry.py: each format's config, emulated ops, TE recipe, device rules) and
the precision policy (policy.py: the `precision` config and each linear's formats, one per GEMM
pass, passes.py); how each format quantizes each GEMM operand (operands.py). Also the rules of the GEMM preflight
(gemm_support.py: which shapes each backend takes; training/preflight.py applies them), the fused
kernels (kernels.py), quantization diagnostics (diagnostics.py), the GEMM compute policy
(compute.py: BF16 GEMMs in FP32 where a CPU has no BF16 instructions), and what the run's
per-step precision may ask of a linear (linear_protocol.py: its diagnostics, its input amax, the
refresh of its quantized weights).

Imports inside the package go one way: formats <- the quantizers <- operands <- registry <- linear
<- diagnostics, and registry <- passes <- policy (tests/test_layering.py).

Depends on torch only. The subpackage `nvfp4_recipe.megatron` applies all this to megatron-core
models and Transformer Engine layers; importing `nvfp4_recipe` does not import it.
"""

from nvfp4_recipe.config import (FP8BlockConfig, MXFP4Config, MXFP8Config, NVFP4Config,
                                 PassConfigs, QuantConfig)
from nvfp4_recipe.diagnostics import quantization_error_stats, quantize_dequantize
from nvfp4_recipe.fp8_block import FP8BlockTensor, quantize_fp8_block
from nvfp4_recipe.hadamard import TE_RHT_SIGNS, random_hadamard_transform, rht_matrix
from nvfp4_recipe.linear import nvfp4_linear, quantized_linear
from nvfp4_recipe.mxfp4 import MXFP4Tensor, quantize_mxfp4
from nvfp4_recipe.mxfp8 import MXFP8Tensor, quantize_mxfp8
from nvfp4_recipe.nvfp4 import NVFP4Tensor, quantize_nvfp4

__all__ = [
    "FP8BlockConfig",
    "FP8BlockTensor",
    "MXFP4Config",
    "MXFP4Tensor",
    "MXFP8Config",
    "MXFP8Tensor",
    "NVFP4Config",
    "NVFP4Tensor",
    "PassConfigs",
    "QuantConfig",
    "TE_RHT_SIGNS",
    "nvfp4_linear",
    "quantization_error_stats",
    "quantize_dequantize",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantized_linear",
    "random_hadamard_transform",
    "rht_matrix",
]
