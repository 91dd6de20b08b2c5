"""Map our precision keys to Transformer Engine recipes, and say where TE can run them.

Each format's recipe and device rules are registered in nvfp4_recipe/registry.py; here they are
applied to a precision config. `te_recipe_spec` and `te_supports` are pure functions (tested on
CPU, where TE cannot be imported); `probe_te_support` asks the installed TE; `build_te_recipe`
imports TE lazily and is only called on a GPU with TE installed.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

from nvfp4_recipe.policy import PrecisionConfig, low_precision_formats, validate_precision
from nvfp4_recipe.registry import format_spec, major_minor


def te_recipe_spec(cfg: PrecisionConfig) -> Optional[dict[str, Any]]:
    """The TE recipe class name and constructor kwargs for a precision config (None for bf16,
    and for a format TE has no recipe for)."""
    validate_precision(cfg)
    return format_spec(cfg.format).te_recipe(cfg)


def _project_rule(fmt: str, capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """What this project asks of a device before TE is consulted."""
    if capability is None:
        return False, "no CUDA device"
    return format_spec(fmt).device_rule(capability)


def te_recipe_rule(fmt: str, capability: tuple[int, int], cuda_version: Optional[str],
                   te_version: Optional[str]) -> tuple[bool, str]:
    """TE's own check of a recipe, restated for a TE release: the fallback where TE cannot be
    asked (`probe_te_support`). `cuda_version` is `torch.version.cuda`."""
    if major_minor(te_version) is None:
        return False, f"unknown transformer_engine version {te_version!r}"
    return format_spec(fmt).te_release_rule(capability, cuda_version, te_version)


def te_formats(cfg: PrecisionConfig) -> list[str]:
    """The formats TE must run for this config: the recipe's, then each other low-precision format
    that `precision.overrides` gives a linear (TE runs every linear of the TE spec)."""
    return [cfg.format] + [f for f in low_precision_formats(cfg) if f != cfg.format]


def te_supports(cfg: PrecisionConfig, capability: Optional[tuple[int, int]],
                cuda_version: Optional[str], te_version: Optional[str]) -> tuple[bool, str]:
    """Whether TE can run this recipe on a device, and why not (pure; see `probe_te_support`)."""
    for fmt in te_formats(cfg):
        ok, why = _project_rule(fmt, capability)
        if ok:
            ok, why = te_recipe_rule(fmt, capability, cuda_version, te_version)
        if not ok:
            return ok, why
    return True, ""


def _ask_te(fmt: str) -> Optional[tuple[bool, str]]:
    """TE's own verdict on this device, or None where this TE release has no check for it."""
    method = format_spec(fmt).te_availability_check
    if method is None:
        return None
    try:  # TE >= 2.9; transformer_engine.pytorch.fp8 is a deprecated alias there (v2.18 fp8.py:13)
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE 2.8 and older
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    check = getattr(FP8GlobalStateManager, method, None)
    if check is None:
        return None
    available, reason = check()
    return bool(available), f"transformer_engine: {reason}" if reason else ""


def probe_te_support(cfg: PrecisionConfig,
                     capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """Whether the installed TE runs this recipe on this device, and why not. Asks TE itself
    where it can, else applies `te_recipe_rule`; a missing or broken TE is a reason, never an
    exception, so `backend=auto` always has an answer."""
    formats = te_formats(cfg)
    for fmt in formats:
        ok, why = _project_rule(fmt, capability)
        if not ok:
            return ok, why
    try:
        import torch
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (the layers need it, not just the package)

        for fmt in formats:
            verdict = _ask_te(fmt)
            if verdict is None:
                verdict = te_recipe_rule(fmt, capability, torch.version.cuda,
                                         getattr(transformer_engine, "__version__", None))
            if not verdict[0]:
                return verdict
    except Exception as exc:  # ImportError, or a TE built for another CUDA / torch
        return False, f"transformer_engine not usable ({type(exc).__name__}: {exc})"[:200]
    return True, ""


class TEVariable(NamedTuple):
    """An environment variable Transformer Engine reads that changes what a recipe computes."""

    formats: tuple[str, ...]  # the formats whose numerics it changes
    changes: Callable[[str], bool]  # whether this value departs from TE's default
    effect: str
    since: str  # the first TE release that reads it


# What TE reads from the environment beyond the fields this project passes (rht, stochastic
# rounding, 2D weights; registry.py): the recipe dataclasses at import (TE release_v2.19
# common/recipe/__init__.py:429-443 for Float8BlockScaling, 558-574 for NVFP4BlockScaling) and
# the NVFP4 quantizer at each call (pytorch/csrc/quantizer.cpp:2679-2690 from 2.16; grouped casts
# from 2.12, extensions/cast.cpp:849). common/util/system.h:25-37 parses that one as a bool:
# unset or empty is false, "0" false, "1" true, anything else an error.
TE_NUMERICS_ENVIRONMENT = {
    "NVTE_BACKWARD_OVERRIDE": TEVariable(
        ("nvfp4", "fp8"), lambda v: True,  # any value: a mode, or an assertion in __post_init__
        "sets the recipe's backward_override (backward GEMMs on high-precision or dequantized "
        "operands)", "2.15"),
    "NVTE_NVFP4_ROW_SCALED_ACTIVATION": TEVariable(
        ("nvfp4",), lambda v: v == "1", "scales activations per row", "2.16"),
    "NVTE_NVFP4_4OVER6": TEVariable(
        ("nvfp4",), lambda v: v != "none", "sets the recipe's 4over6 block-scale selection",
        "2.17"),
    # A class-level QParams(power_2_scale=not use_f32_scales): no keyword can undo it (:429-434).
    "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": TEVariable(
        ("fp8",), lambda v: v == "1", "makes the FP8 block scales FP32 instead of powers of two",
        "2.3"),
    "NVTE_USE_FAST_MATH": TEVariable(
        ("nvfp4",), lambda v: v not in ("", "0"),
        "makes NVFP4 quantization use an approximate reciprocal and skip the RHT output's BF16 "
        "rounding", "2.12"),
}


def te_environment_refusal(env: Mapping[str, str], formats) -> Optional[str]:
    """Why a model on TE cannot be built with this environment (None: it can): a variable of
    TE_NUMERICS_ENVIRONMENT set so that it changes a format the model runs."""
    for name, var in TE_NUMERICS_ENVIRONMENT.items():
        value = env.get(name)
        if value is not None and var.changes(value) and set(var.formats) & set(formats):
            return (f"{name}={value!r}: transformer_engine {var.since} and newer read it, and it "
                    f"{var.effect}: not the recipe this run states (precision.*) and the "
                    "emulation reproduces; unset it")
    return None


def build_te_recipe(cfg: PrecisionConfig):
    """Instantiate the TE recipe object of cfg.format (GPU machines with transformer_engine only);
    `build_model` calls it once per format in `te_formats` (with that format)."""
    spec = te_recipe_spec(cfg)
    if spec is None:
        return None
    from transformer_engine.common import recipe as te_recipe

    kwargs = dict(spec["kwargs"])
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return getattr(te_recipe, spec["recipe"])(**kwargs)
