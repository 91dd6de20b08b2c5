"""Map our precision keys to Transformer Engine recipes.

`te_recipe_spec` is a pure function (tested on CPU, where TE cannot be imported);
`build_te_recipe` imports TE lazily and is only called on a GPU with TE installed.
"""

from __future__ import annotations

from typing import Any, Optional

from .policy import PrecisionConfig, validate_precision

# Blackwell (B200/GB200 = 10.0, B300/GB300 = 10.3) is where TE runs NVFP4 GEMMs.
NVFP4_COMPUTE_CAPABILITY_MAJOR = 10


def te_recipe_spec(cfg: PrecisionConfig) -> Optional[dict[str, Any]]:
    """The TE recipe class name and constructor kwargs for a precision config (None for bf16)."""
    validate_precision(cfg)
    if cfg.format == "bf16":
        return None
    if cfg.format == "nvfp4":
        return {
            "recipe": "NVFP4BlockScaling",
            "kwargs": {
                "disable_rht": not cfg.rht,
                "disable_stochastic_rounding": not cfg.stochastic_rounding,
                "disable_2d_quantization": not cfg.weight_2d,
            },
        }
    if cfg.format == "fp8":
        # The paper's FP8 baseline: E4M3 everywhere, 128x128 weight / 1x128 activation blocks.
        return {"recipe": "Float8BlockScaling", "kwargs": {"fp8_format": "E4M3"}}
    if cfg.format == "mxfp4":
        # TE has no MXFP4 training recipe: MXFP4 only runs in the emulation.
        return None
    raise AssertionError(cfg.format)


def te_supports(cfg: PrecisionConfig, compute_capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """Whether TE can run this recipe on a device, and why not."""
    if cfg.format == "bf16":
        return compute_capability is not None, "no CUDA device"
    if compute_capability is None:
        return False, "no CUDA device"
    if cfg.format == "nvfp4" and compute_capability[0] != NVFP4_COMPUTE_CAPABILITY_MAJOR:
        major, minor = compute_capability
        return False, f"NVFP4 TE GEMMs need compute capability 10.x, found {major}.{minor}"
    if cfg.format == "fp8" and compute_capability < (9, 0):
        return False, "FP8 block scaling needs compute capability 9.0 or newer"
    if cfg.format == "mxfp4":
        return False, "TE has no MXFP4 training recipe"
    return True, ""


def build_te_recipe(cfg: PrecisionConfig):
    """Instantiate the TE recipe object (GPU machines with transformer_engine only)."""
    spec = te_recipe_spec(cfg)
    if spec is None:
        return None
    from transformer_engine.common import recipe as te_recipe

    kwargs = dict(spec["kwargs"])
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return getattr(te_recipe, spec["recipe"])(**kwargs)
