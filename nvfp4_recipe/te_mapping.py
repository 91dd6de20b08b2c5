"""Map our precision keys to Transformer Engine recipes, and say where TE can run them.

`te_recipe_spec` and `te_supports` are pure functions (tested on CPU, where TE cannot be
imported); `probe_te_support` asks the installed TE; `build_te_recipe` imports TE lazily and is
only called on a GPU with TE installed.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from .policy import PrecisionConfig, low_precision_formats, validate_precision

# Blackwell (B200/GB200 = 10.0, B300/GB300 = 10.3) is where TE runs NVFP4 GEMMs. Stricter than
# TE's own check (>= 10.0, TE v2.8 fp8.py:57-61): this project has not run NVFP4 on 12.x.
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


def _major_minor(version: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of "12.9", "2.9.0+abc", "2.10.0.dev0"; None when absent or unparsable."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def _project_rule(fmt: str, capability: Optional[tuple[int, int]]) -> tuple[bool, str]:
    """What this project asks of a device before TE is consulted."""
    if capability is None:
        return False, "no CUDA device"
    if fmt == "mxfp4":
        return False, "TE has no MXFP4 training recipe"
    if fmt == "nvfp4" and capability[0] != NVFP4_COMPUTE_CAPABILITY_MAJOR:
        major, minor = capability
        return False, f"NVFP4 TE GEMMs need compute capability 10.x, found {major}.{minor}"
    return True, ""


def te_recipe_rule(fmt: str, capability: tuple[int, int], cuda_version: Optional[str],
                   te_version: Optional[str]) -> tuple[bool, str]:
    """TE's own check of a recipe, restated for a TE release: the fallback where TE cannot be
    asked (`probe_te_support`). `cuda_version` is `torch.version.cuda`."""
    te = _major_minor(te_version)
    if te is None:
        return False, f"unknown transformer_engine version {te_version!r}"
    cc = f"{capability[0]}.{capability[1]}"
    if fmt == "nvfp4":
        if te < (2, 8):  # NVFP4BlockScaling first appears in v2.8 (common/recipe/__init__.py:381)
            return False, f"NVFP4BlockScaling needs transformer_engine >= 2.8, found {te_version}"
        # cc >= 10.0: v2.8 fp8.py:57-61, v2.9 quantization.py:71-76, v2.18 quantization.py:171-176
        if capability < (10, 0):
            return False, f"TE NVFP4 needs compute capability 10.0 or newer, found {cc}"
    if fmt == "fp8":
        if te < (2, 3):  # Float8BlockScaling first appears in v2.3 (common/recipe/__init__.py:298)
            return False, f"Float8BlockScaling needs transformer_engine >= 2.3, found {te_version}"
        # cc >= 9.0 and CUDA >= 12.9 (v2.9 quantization.py:79-86, v2.18 quantization.py:178-185);
        # up to v2.8 also cc < 10.0 (v2.8 fp8.py:64-72). TE compares float(torch.version.cuda).
        cuda = _major_minor(cuda_version)
        if cuda is None or cuda < (12, 9):
            return False, f"FP8 block scaling needs CUDA 12.9 or newer, found {cuda_version}"
        if capability < (9, 0):
            return False, f"FP8 block scaling needs compute capability 9.0 or newer, found {cc}"
        if te < (2, 9) and capability >= (10, 0):
            return False, (f"transformer_engine {te_version} runs FP8 block scaling on compute "
                           f"capability 9.x only (10.x from TE 2.9), found {cc}")
    return True, ""


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


# The FP8GlobalStateManager class methods that answer (available, reason) for a recipe:
# TE v2.8 fp8.py:216-231, v2.9 quantization.py:300-308, v2.18 quantization.py:441-449.
_TE_AVAILABILITY_CHECK = {"fp8": "is_fp8_block_scaling_available", "nvfp4": "is_nvfp4_available"}


def _ask_te(fmt: str) -> Optional[tuple[bool, str]]:
    """TE's own verdict on this device, or None where this TE release has no check for it."""
    method = _TE_AVAILABILITY_CHECK.get(fmt)
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
