"""The GEMM formats, each registered once: what the rest of the project looks a format up in.

A format's entry names its emulated-GEMM config and how a precision recipe fills it, the emulated
ops (nvfp4_recipe/operands.py: how each GEMM operand is quantized, and how the diagnostics quantize
a tensor of each role), its Transformer Engine recipe, and the checks of where TE can run it
(this project's own rule, then TE's for a release). No megatron or TE import: the TE recipe is a
class name and its keyword arguments (nvfp4_recipe/megatron/te_mapping.py builds it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, Optional, Protocol

from nvfp4_recipe.config import (FP8BlockConfig, MXFP4Config, MXFP8Config, NVFP4Config,
                                 PassConfigs, QuantConfig)
from nvfp4_recipe.operands import _FormatOps, _FP8BlockOps, _MXFP4Ops, _MXFP8Ops, _NVFP4Ops


class PrecisionFields(Protocol):
    """The fields of the `precision` config (nvfp4_recipe.policy.PrecisionConfig) that a format's
    entry reads. Named here, not imported: the policy imports the registry, imports go one way."""

    rht: bool
    stochastic_rounding: bool
    weight_2d: bool
    gemm: str
    kernels: str


Capability = tuple[int, int]
Verdict = tuple[bool, str]  # (runs, why not)


class Format(StrEnum):
    """A GEMM format (`precision.format`, the values of `precision.overrides`). Members are
    spelled as in the YAML recipes, so a config file and an override read the same."""

    bf16 = "bf16"
    nvfp4 = "nvfp4"
    fp8 = "fp8"
    mxfp4 = "mxfp4"
    mxfp8 = "mxfp8"


@dataclass(frozen=True)
class FormatSpec:
    """Everything the project knows of one format."""

    format: Format
    # The emulated GEMM's config class, and that config under a precision recipe (None: BF16).
    config_type: Optional[type]
    emulated_config: Callable[[PrecisionFields], Optional[QuantConfig]]
    # How the emulation quantizes each GEMM operand and, for the diagnostics, a tensor of each
    # role (operands.py).
    ops: Optional[type[_FormatOps]]
    # {"recipe": TE recipe class name, "kwargs": its arguments}; None: no TE recipe (BF16 runs
    # outside TE's autocast; a format TE cannot run says so in `device_rule`).
    te_recipe: Callable[[PrecisionFields], Optional[dict[str, Any]]]
    # What this project asks of a CUDA device before TE is consulted.
    device_rule: Callable[[Capability], Verdict]
    # TE's own check of the recipe, restated per release (where TE itself cannot be asked).
    te_release_rule: Callable[[Capability, Optional[str], Optional[str]], Verdict]
    # The FP8GlobalStateManager class method that answers (available, reason) for the recipe:
    # TE v2.8 fp8.py:216-231, v2.9 quantization.py:300-308, v2.18 quantization.py:441-449.
    te_availability_check: Optional[str] = None
    # Whether `precision.kernels` picks how its emulated quantizers run (nvfp4_recipe.kernels).
    compiled_kernels: bool = False
    # The TE quantizer of one tensor role ("input", "weight", "grad_output") as a CustomRecipe
    # quantizer factory builds it, for a linear whose GEMM passes run different formats
    # (nvfp4_recipe/megatron/te_mapping.py): {"quantizer": class name, "kwargs": its arguments}
    # (a DType member named by a string); None: TE has no quantizer for the format.
    te_quantizer: Callable[[PrecisionFields, str], Optional[dict[str, Any]]] = lambda cfg, role: None


# Blackwell (B200/GB200 = 10.0, B300/GB300 = 10.3) is where TE runs NVFP4 GEMMs. Stricter than
# TE's own check (>= 10.0, TE v2.8 fp8.py:57-61): this project has not run NVFP4 on 12.x.
NVFP4_COMPUTE_CAPABILITY_MAJOR = 10


def major_minor(version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of "12.9", "2.9.0+abc", "2.10.0.dev0"; None when absent or unparsable."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def _no_requirement(*_device) -> Verdict:
    return True, ""


def _none(_cfg) -> None:
    return None


# -- NVFP4 ---------------------------------------------------------------------------------------


def _nvfp4_config(cfg: PrecisionFields) -> NVFP4Config:
    return NVFP4Config(rht=cfg.rht, stochastic_rounding=cfg.stochastic_rounding,
                       weight_2d=cfg.weight_2d, gemm=cfg.gemm, kernels=cfg.kernels)


def _nvfp4_te_recipe(cfg: PrecisionFields) -> dict[str, Any]:
    return {
        "recipe": "NVFP4BlockScaling",
        "kwargs": {
            "disable_rht": not cfg.rht,
            "disable_stochastic_rounding": not cfg.stochastic_rounding,
            "disable_2d_quantization": not cfg.weight_2d,
        },
    }


def _nvfp4_te_quantizer(cfg: PrecisionFields, role: str) -> dict[str, Any]:
    # TE's nvfp4_factory, the NVFP4BlockScaling defaults per role (release_v2.19 pytorch/
    # custom_recipes/quantizer_factories.py:140-191), with this project's three switches: RHT
    # on the input's and the gradient's columnwise (Wgrad) copies, 16x16 weight tiles, SR on the
    # gradient.
    weight, grad = role == "weight", role == "grad_output"
    rht = cfg.rht and not weight
    return {"quantizer": "NVFP4Quantizer", "kwargs": {
        "fp4_dtype": "kFloat4E2M1", "with_rht": rht, "with_post_rht_amax": rht,
        "with_2d_quantization": weight and cfg.weight_2d,
        "stochastic_rounding": grad and cfg.stochastic_rounding, "with_random_sign_mask": True}}


def _datacenter_blackwell_only(name: str) -> Callable[[Capability], Verdict]:
    """This project's device rule for a format TE runs on Blackwell: compute capability 10.x."""

    def rule(capability: Capability) -> Verdict:
        if capability[0] != NVFP4_COMPUTE_CAPABILITY_MAJOR:
            major, minor = capability
            return False, f"{name} TE GEMMs need compute capability 10.x, found {major}.{minor}"
        return True, ""
    return rule


_nvfp4_device_rule = _datacenter_blackwell_only("NVFP4")


def _nvfp4_te_release_rule(capability: Capability, cuda_version: Optional[str],
                           te_version: Optional[str]) -> Verdict:
    te = major_minor(te_version)
    if te < (2, 8):  # NVFP4BlockScaling first appears in v2.8 (common/recipe/__init__.py:381)
        return False, f"NVFP4BlockScaling needs transformer_engine >= 2.8, found {te_version}"
    # cc >= 10.0: v2.8 fp8.py:57-61, v2.9 quantization.py:71-76, v2.18 quantization.py:171-176
    if capability < (10, 0):
        return False, (f"TE NVFP4 needs compute capability 10.0 or newer, found "
                       f"{capability[0]}.{capability[1]}")
    return True, ""


# -- FP8 block scaling ---------------------------------------------------------------------------


def _fp8_te_recipe(_cfg: PrecisionFields) -> dict[str, Any]:
    # The paper's FP8 baseline: E4M3 everywhere, 128x128 weight / 1x128 activation blocks.
    return {"recipe": "Float8BlockScaling", "kwargs": {"fp8_format": "E4M3"}}


def _fp8_te_quantizer(_cfg: PrecisionFields, role: str) -> dict[str, Any]:
    # TE's float8_block_scaling_factory (quantizer_factories.py:95-122): 128x128 weights, 1x128
    # otherwise, power-of-two scales.
    return {"quantizer": "Float8BlockQuantizer", "kwargs": {
        "fp8_dtype": "kFloat8E4M3", "rowwise": True, "columnwise": True, "amax_epsilon": 0.0,
        "force_pow_2_scales": True, "block_scaling_dim": 2 if role == "weight" else 1}}


def _fp8_te_release_rule(capability: Capability, cuda_version: Optional[str],
                         te_version: Optional[str]) -> Verdict:
    te = major_minor(te_version)
    cc = f"{capability[0]}.{capability[1]}"
    if te < (2, 3):  # Float8BlockScaling first appears in v2.3 (common/recipe/__init__.py:298)
        return False, f"Float8BlockScaling needs transformer_engine >= 2.3, found {te_version}"
    # cc >= 9.0 and CUDA >= 12.9 (v2.9 quantization.py:79-86, v2.18 quantization.py:178-185);
    # up to v2.8 also cc < 10.0 (v2.8 fp8.py:64-72). TE compares float(torch.version.cuda).
    cuda = major_minor(cuda_version)
    if cuda is None or cuda < (12, 9):
        return False, f"FP8 block scaling needs CUDA 12.9 or newer, found {cuda_version}"
    if capability < (9, 0):
        return False, f"FP8 block scaling needs compute capability 9.0 or newer, found {cc}"
    if te < (2, 9) and capability >= (10, 0):
        return False, (f"transformer_engine {te_version} runs FP8 block scaling on compute "
                       f"capability 9.x only (10.x from TE 2.9), found {cc}")
    return True, ""


# -- MXFP4 ---------------------------------------------------------------------------------------


def _mxfp4_device_rule(_capability: Capability) -> Verdict:
    # TE has no MXFP4 training recipe: MXFP4 only runs in the emulation.
    return False, "TE has no MXFP4 training recipe"


# -- MXFP8 --------------------------------------------------------------------------------------


def _mxfp8_te_recipe(_cfg: PrecisionFields) -> dict[str, Any]:
    # TE's default Blackwell recipe, E4M3 on every operand (its default fp8_format).
    return {"recipe": "MXFP8BlockScaling", "kwargs": {"fp8_format": "E4M3"}}


def _mxfp8_te_quantizer(_cfg: PrecisionFields, _role: str) -> dict[str, Any]:
    # TE's mxfp8_factory (quantizer_factories.py:125-137): E4M3, 1x32 blocks, every role.
    return {"quantizer": "MXFP8Quantizer", "kwargs": {"fp8_dtype": "kFloat8E4M3"}}


# B200/GB200 (10.0) and B300/GB300 (10.3), as for NVFP4; TE itself refuses 12.x (below).
_mxfp8_device_rule = _datacenter_blackwell_only("MXFP8")


def _mxfp8_te_release_rule(capability: Capability, cuda_version: Optional[str],
                           te_version: Optional[str]) -> Verdict:
    te = major_minor(te_version)
    cc = f"{capability[0]}.{capability[1]}"
    if te < (2, 0):  # MXFP8BlockScaling first appears in v2.0 (common/recipe/__init__.py:165)
        return False, f"MXFP8BlockScaling needs transformer_engine >= 2.0, found {te_version}"
    # cc >= 10.0: v2.0 fp8.py:41; from v2.6 also cc < 12.0 (v2.6 fp8.py:49-52, v2.8 fp8.py:48-54,
    # v2.18 quantization.py:162-168)
    if capability < (10, 0):
        return False, f"TE MXFP8 needs compute capability 10.0 or newer, found {cc}"
    if te >= (2, 6) and capability >= (12, 0):
        return False, f"transformer_engine {te_version} does not run MXFP8 on compute capability {cc}"
    return True, ""


# -- the registry --------------------------------------------------------------------------------

FORMAT_SPECS: dict[Format, FormatSpec] = {spec.format: spec for spec in (
    # BF16 inside a CustomRecipe: TE's IdentityQuantizer (release_v2.19 pytorch/tensor/
    # identity_tensor.py:26; high_precision_factory, quantizer_factories.py:35-50).
    FormatSpec(Format.bf16, config_type=None, emulated_config=_none, ops=None, te_recipe=_none,
               device_rule=_no_requirement, te_release_rule=_no_requirement,
               te_quantizer=lambda cfg, role: {"quantizer": "IdentityQuantizer", "kwargs": {}}),
    FormatSpec(Format.nvfp4, config_type=NVFP4Config, emulated_config=_nvfp4_config,
               ops=_NVFP4Ops, te_recipe=_nvfp4_te_recipe, device_rule=_nvfp4_device_rule,
               te_release_rule=_nvfp4_te_release_rule, te_availability_check="is_nvfp4_available",
               compiled_kernels=True, te_quantizer=_nvfp4_te_quantizer),
    FormatSpec(Format.fp8, config_type=FP8BlockConfig,
               emulated_config=lambda cfg: FP8BlockConfig(gemm=cfg.gemm), ops=_FP8BlockOps,
               te_recipe=_fp8_te_recipe, device_rule=_no_requirement,
               te_release_rule=_fp8_te_release_rule,
               te_availability_check="is_fp8_block_scaling_available",
               te_quantizer=_fp8_te_quantizer),
    FormatSpec(Format.mxfp4, config_type=MXFP4Config,
               emulated_config=lambda cfg: MXFP4Config(gemm=cfg.gemm), ops=_MXFP4Ops,
               te_recipe=_none, device_rule=_mxfp4_device_rule,
               te_release_rule=_no_requirement),
    FormatSpec(Format.mxfp8, config_type=MXFP8Config,
               emulated_config=lambda cfg: MXFP8Config(gemm=cfg.gemm, kernels=cfg.kernels),
               ops=_MXFP8Ops, te_recipe=_mxfp8_te_recipe, device_rule=_mxfp8_device_rule,
               te_release_rule=_mxfp8_te_release_rule, te_availability_check="is_mxfp8_available",
               compiled_kernels=True, te_quantizer=_mxfp8_te_quantizer),
)}
_SPEC_OF_CONFIG = {spec.config_type: spec for spec in FORMAT_SPECS.values() if spec.config_type}


def format_names() -> str:
    """"bf16, nvfp4, fp8, mxfp4, mxfp8": the choices, for error messages."""
    return ", ".join(Format)


def is_format(value) -> bool:
    return value in FORMAT_SPECS


def format_spec(fmt: str) -> FormatSpec:
    if not is_format(fmt):
        raise ValueError(f"unknown GEMM format {fmt!r}: choose one of {format_names()}")
    return FORMAT_SPECS[Format(fmt)]


def spec_of_config(config: QuantConfig) -> FormatSpec:
    """The format an emulated-GEMM config belongs to (by its type)."""
    spec = _SPEC_OF_CONFIG.get(type(config))
    if spec is None:
        names = ", ".join(t.__name__ for t in _SPEC_OF_CONFIG)
        raise ValueError(f"config of type {type(config).__name__} is not supported; pass {names}, "
                         "or None for plain high precision")
    return spec


def gemm_config_for(fmt: str, cfg: PrecisionFields) -> Optional[QuantConfig]:
    """The emulated-GEMM config of one format under a precision recipe (None for BF16)."""
    return format_spec(fmt).emulated_config(cfg)


def pass_configs_for(fprop: str, dgrad: str, wgrad: str, cfg: PrecisionFields) -> PassConfigs:
    """The emulated-GEMM configs of a linear whose Fprop, Dgrad and Wgrad run these formats: one
    config object per format, so passes of one format share it (and Dgrad may reuse Fprop's
    weight copy, nvfp4_recipe/linear.py)."""
    configs = {fmt: gemm_config_for(fmt, cfg) for fmt in dict.fromkeys((fprop, dgrad, wgrad))}
    return PassConfigs(configs[fprop], configs[dgrad], configs[wgrad])
