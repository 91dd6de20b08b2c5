"""Map our precision keys to Transformer Engine recipes, and say where TE can run them.

Each format's recipe and device rules are registered in nvfp4_recipe/registry.py; here they are
applied to a precision config, and to the formats of one linear's three GEMMs (a PassFormats,
nvfp4_recipe/passes.py), which TE runs in one of three ways, each from a release on:

- one format for Fprop, Dgrad and Wgrad: that format's recipe (registry.py), from the release
  the format needs;
- a quantized Fprop with Dgrad and Wgrad in BF16: the Fprop format's recipe with
  `backward_override="high_precision"`, TE 2.15 on (common/recipe/__init__.py v2.15:14, and the
  field of MXFP8BlockScaling :328, Float8BlockScaling :391, NVFP4BlockScaling :501; v2.14 has
  none): the backward GEMMs take the original BF16 input (module/linear.py v2.15:141-142,
  save_original_input) and weight (:804-812), and dY unquantized (ctx.fp8 = False, :554-564),
  what the emulation's BF16 passes compute;
- any other map: a CustomRecipe whose quantizer factory gives each tensor a HybridQuantizer, its
  rowwise copy in the format of the GEMM that reads it rowwise and its columnwise copy in the
  other's (x: Fprop / Wgrad, W: Fprop / Dgrad, dY: Dgrad / Wgrad), each quantized from the
  original tensor as the emulation does; TE 2.19 on (pytorch/tensor/hybrid_tensor.py:19-125 on
  TE's release_v2.19 branch, the factory called with a QuantizerRole, quantization.py:57-96,
  from module/linear.py:1831-1837 and layernorm_linear.py:1622-1628; TE's own example of the
  pattern is custom_recipes/quantizer_factory_zoo.py:120-158, mxfp8_fwd_nvfp4_bwd_factory).

`te_formats_recipe_spec`, `te_pass_rule` and `te_supports` are pure functions (tested on CPU,
where TE cannot be imported); `probe_te_support` asks the installed TE; `build_te_recipe` imports
TE lazily and is only called on a GPU with TE installed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

from nvfp4_recipe.passes import ALL_BF16, BF16, PassFormats, parse_pass_map
from nvfp4_recipe.policy import (SWITCHED_PASSES, PrecisionConfig, low_precision_formats,
                                 recipe_formats, validate_precision)
from nvfp4_recipe.registry import format_spec, major_minor

# The first TE release of each way of running a linear whose passes differ (module docstring).
HIGH_PRECISION_BACKWARD_SINCE = (2, 15)
HYBRID_QUANTIZER_SINCE = (2, 19)
# A HybridQuantizer's tensors: (rowwise GEMM, columnwise GEMM) of each, as TE's GEMMs read them.
HYBRID_DIRECTIONS = {"input": ("fprop", "wgrad"), "weight": ("fprop", "dgrad"),
                     "grad_output": ("dgrad", "wgrad")}


def te_pass_mode(formats: PassFormats) -> str:
    """How TE runs a linear of these formats: "bf16" (outside any recipe), "recipe" (one format's
    recipe), "high_precision_backward" or "hybrid" (see the module docstring)."""
    if not formats.low_precision:
        return "bf16"
    if formats.uniform is not None:
        return "recipe"
    if formats.dgrad == formats.wgrad == BF16:
        return "high_precision_backward"
    return "hybrid"


def te_formats_recipe_spec(formats: PassFormats, cfg: PrecisionConfig) -> Optional[dict[str, Any]]:
    """The TE recipe of a linear whose GEMMs run `formats`: {"recipe": class name, "kwargs"},
    and for a CustomRecipe {"quantizers": {tensor role: {"rowwise": quantizer, "columnwise":
    quantizer}}} (each as registry.FormatSpec.te_quantizer describes it). None for BF16, and
    where a format has no TE recipe or quantizer (MXFP4)."""
    mode = te_pass_mode(formats)
    if mode == "bf16":
        return None
    if mode == "recipe":
        return format_spec(formats.uniform).te_recipe(cfg)
    if mode == "high_precision_backward":
        spec = format_spec(formats.fprop).te_recipe(cfg)
        if spec is None:
            return None
        return {"recipe": spec["recipe"],
                "kwargs": {**spec["kwargs"], "backward_override": "high_precision"}}
    quantizers = {}
    for role, directions in HYBRID_DIRECTIONS.items():
        pair = {}
        for direction, gemm in zip(("rowwise", "columnwise"), directions):
            quantizer = format_spec(getattr(formats, gemm)).te_quantizer(cfg, role)
            if quantizer is None:
                return None
            pair[direction] = quantizer
        quantizers[role] = pair
    return {"recipe": "CustomRecipe", "kwargs": {}, "quantizers": quantizers}


def te_pass_rule(formats: PassFormats, te_version: Optional[str]) -> tuple[bool, str]:
    """Whether a TE release can run a linear whose passes run `formats` (beyond each format's
    own rules), and which release it needs where it cannot."""
    mode = te_pass_mode(formats)
    te = major_minor(te_version)
    passes = f"{formats} (Fprop/Dgrad/Wgrad)"
    if mode == "high_precision_backward" and (te is None or te < HIGH_PRECISION_BACKWARD_SINCE):
        return False, (f"a linear runs {passes}: a BF16 backward under a quantized forward needs "
                       f"the recipes' backward_override, transformer_engine >= 2.15, found "
                       f"{te_version}; or precision.backend=emulated")
    if mode == "hybrid" and (te is None or te < HYBRID_QUANTIZER_SINCE):
        return False, (f"a linear runs {passes}: a format per GEMM pass needs TE's "
                       f"HybridQuantizer, transformer_engine >= 2.19, found {te_version}; or "
                       "precision.backend=emulated")
    return True, ""


def during_run(formats: Iterable[PassFormats], cfg: PrecisionConfig) -> list[PassFormats]:
    """The low-precision formats among `formats` and those the late switch to BF16 leaves of
    them (when the config switches): every PassFormats a linear runs at some step, once."""
    out = []
    switch = cfg.switch_to_bf16
    for fmt in formats:
        out.append(fmt)
        if switch.at_fraction is not None:
            out.append(fmt.with_bf16(SWITCHED_PASSES[switch.passes]))
    return [f for f in dict.fromkeys(out) if f.low_precision]


def te_pass_formats(cfg: PrecisionConfig) -> list[PassFormats]:
    """The formats a linear of this config may run on TE, from the config alone (the model's
    layers decide which of them occur): the recipe's and BF16 (the first/last layers), each with
    every override's passes over it (BF16 only where overrides reach the BF16 layers), before
    and after the switch."""
    recipe = recipe_formats(cfg)
    bases = [recipe, ALL_BF16] if cfg.overrides_in_bf16_layers else [recipe]
    overrides = [parse_pass_map(v, "precision.overrides") for v in cfg.overrides.values()]
    return during_run([recipe, *(base.replace(o) for base in bases for o in overrides)], cfg)


def te_recipe_spec(cfg: PrecisionConfig) -> Optional[dict[str, Any]]:
    """The TE recipe class name and constructor kwargs of a precision config's recipe (None for
    bf16, and for a format TE has no recipe for)."""
    validate_precision(cfg)
    return te_formats_recipe_spec(recipe_formats(cfg), cfg)


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
    """The formats TE must run for this config, in any GEMM pass: the recipe's, then each other
    low-precision format that `precision.overrides` gives a linear (TE runs every linear of the
    TE spec); ["bf16"] where nothing is quantized."""
    recipe = recipe_formats(cfg).quantized_formats()
    return ([*recipe, *(f for f in low_precision_formats(cfg) if f not in recipe)]
            or [BF16])


def te_supports(cfg: PrecisionConfig, capability: Optional[tuple[int, int]],
                cuda_version: Optional[str], te_version: Optional[str]) -> tuple[bool, str]:
    """Whether TE can run this recipe on a device, and why not (pure; see `probe_te_support`):
    each format's rules, then each way of running a linear's passes (`te_pass_rule`)."""
    for fmt in te_formats(cfg):
        ok, why = _project_rule(fmt, capability)
        if ok:
            ok, why = te_recipe_rule(fmt, capability, cuda_version, te_version)
        if not ok:
            return ok, why
    return _pass_rules(cfg, te_version)


def _pass_rules(cfg: PrecisionConfig, te_version: Optional[str]) -> tuple[bool, str]:
    for formats in te_pass_formats(cfg):
        ok, why = te_pass_rule(formats, te_version)
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

        te_version = getattr(transformer_engine, "__version__", None)
        for fmt in formats:
            verdict = _ask_te(fmt)
            if verdict is None:
                verdict = te_recipe_rule(fmt, capability, torch.version.cuda, te_version)
            if not verdict[0]:
                return verdict
    except Exception as exc:  # ImportError, or a TE built for another CUDA / torch
        return False, f"transformer_engine not usable ({type(exc).__name__}: {exc})"[:200]
    return _pass_rules(cfg, te_version)


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
        ("nvfp4", "fp8", "mxfp8"), lambda v: True,  # any value: a mode, or an assertion in __post_init__
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


def build_te_recipe(formats: PassFormats, cfg: PrecisionConfig):
    """Instantiate the TE recipe object of a linear whose GEMMs run `formats` (GPU machines with
    transformer_engine only); `build_model` calls it once per PassFormats its linears run."""
    spec = te_formats_recipe_spec(formats, cfg)
    if spec is None:
        return None
    from transformer_engine.common import recipe as te_recipe

    if "quantizers" in spec:
        return te_recipe.CustomRecipe(qfactory=_hybrid_factory(spec["quantizers"]))
    kwargs = dict(spec["kwargs"])
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return getattr(te_recipe, spec["recipe"])(**kwargs)


# Where TE 2.19 defines the quantizers a CustomRecipe's factory returns (pytorch/tensor/).
_TE_QUANTIZER_MODULES = {
    "NVFP4Quantizer": "transformer_engine.pytorch.tensor.nvfp4_tensor",
    "MXFP8Quantizer": "transformer_engine.pytorch.tensor.mxfp8_tensor",
    "Float8BlockQuantizer": "transformer_engine.pytorch.tensor.float8_blockwise_tensor",
    "IdentityQuantizer": "transformer_engine.pytorch.tensor.identity_tensor",
}


def _te_quantizer(spec: dict[str, Any]):
    """A new TE quantizer from its registry description (a fresh one per call: HybridQuantizer
    takes ownership of its children, hybrid_tensor.py:50-56)."""
    import importlib

    from transformer_engine.pytorch.constants import DType

    cls = getattr(importlib.import_module(_TE_QUANTIZER_MODULES[spec["quantizer"]]),
                  spec["quantizer"])
    kwargs = {k: getattr(DType, v) if k.endswith("_dtype") else v
              for k, v in spec["kwargs"].items()}
    return cls(**kwargs)


def _hybrid_factory(quantizers: dict[str, dict[str, dict[str, Any]]]):
    """CustomRecipe's qfactory: for a linear's input, weight and gradient a HybridQuantizer of
    the two formats that read it (one quantizer where they are the same), each copy quantized
    from the original tensor (columnwise_source="original"); TE's other roles (the output, the
    input gradient, which this project never asks to quantize) in high precision."""

    def qfactory(role):
        from transformer_engine.pytorch.tensor.hybrid_tensor import HybridQuantizer
        from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer

        pair = quantizers.get(role.tensor_type) if role is not None else None
        if pair is None or role.module_type not in ("linear", "grouped_linear"):
            return IdentityQuantizer()
        if pair["rowwise"] == pair["columnwise"]:
            return _te_quantizer(pair["rowwise"])
        return HybridQuantizer(rowwise_quantizer=_te_quantizer(pair["rowwise"]),
                               columnwise_quantizer=_te_quantizer(pair["columnwise"]),
                               columnwise_source="original")

    return qfactory
