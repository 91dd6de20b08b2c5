"""The precision policy: which GEMM format each linear of each pattern layer uses.

The `precision` config group's schema and its choices, and the policy that turns it into
per-layer decisions and, through `precision.overrides`, per-linear ones. No megatron or TE
import: `nvfp4_recipe.megatron.parallel_linear` turns a decision into a megatron-core linear
(emulated GEMMs), `nvfp4_recipe.megatron.te_mapping` into a Transformer Engine recipe (Blackwell).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from enum import StrEnum
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence

import torch

from .compute import GEMM_COMPUTE
from .config import Gemm
from .kernels import KERNEL_MODES, use_compiled
from .passes import BF16, PASSES, PassFormats, parse_pass_map, pass_formats
from .registry import Format, format_names, format_spec, is_format

# The choices of the schema's choice fields (str-valued, spelled as in the YAML recipes: Hydra
# rejects another value naming these; `validate_precision`, which the schema's __post_init__ runs,
# checks a config built in Python).


class Backend(StrEnum):
    auto = "auto"
    te = "te"
    emulated = "emulated"


class SwitchPasses(StrEnum):
    forward = "forward"
    all = "all"


# Field metadata of a dict whose keys are the user's own names (module-name patterns), not
# fields: the config layer lets the command line add keys to it (training/config.py).
USER_KEYS = "user_keys"

# The GEMM passes each `switch_to_bf16.passes` value turns to BF16 in every linear's formats.
SWITCHED_PASSES = {SwitchPasses.forward: ("fprop",), SwitchPasses.all: PASSES}


# How the emulation's quantizers run: nvfp4_recipe.kernels' modes.
Kernels = StrEnum("Kernels", [(mode, mode) for mode in KERNEL_MODES], module=__name__)
# What BF16 GEMMs compute in: nvfp4_recipe.compute's policy.
GemmComputeChoice = StrEnum("GemmComputeChoice", [(c, c) for c in GEMM_COMPUTE], module=__name__)


@dataclass
class SwitchToBF16Config:
    # Fraction of the run's total tokens after which the low-precision GEMMs run in BF16
    # (paper appendix D: 0.82 of 10T). None = never.
    at_fraction: Optional[float] = None
    # "all": forward and backward GEMMs switch; "forward": only Fprop (cheaper, most of the gain).
    passes: SwitchPasses = SwitchPasses.all


class AdaptivePasses(StrEnum):
    forward = "forward"
    all = "all"


# The GEMM passes each `adaptive.passes` value lets the fallback move.
ADAPTIVE_PASSES = {AdaptivePasses.forward: ("fprop",), AdaptivePasses.all: PASSES}
# The statistics the underflow telemetry measures per GEMM operand (nvfp4_recipe/telemetry.py),
# the names of `adaptive.thresholds`' fields.
TELEMETRY_STATS = ("flush", "scale_underflow", "scale_overflow")


@dataclass
class TelemetryConfig:
    # Underflow telemetry (per linear, GEMM pass and operand: the flushed fraction and the blocks
    # whose scale under- or overflows) every N optimizer steps, on the emulated GEMMs (0 = off).
    # A measured demo step costs up to ~1.3x (docs/performance.md): 20 keeps it under 2 %.
    every: int = 20
    # Rows of each quantized operand sampled per GEMM call (tokens; channels of a Wgrad operand;
    # weight rows, in whole 16x16 tiles): the cost is about this many rows' quantization.
    rows: int = 64


@dataclass
class AdaptiveThresholds:
    # A GEMM pass falls back when the statistic, its operands' largest, stays above this
    # (a fraction in [0, 1]; null: not watched). The demo's healthy NVFP4 linears flush up to
    # ~0.3 of their values (the squared-ReLU MLP inputs); a planted outlier channel makes ~0.9
    # of its linear's blocks underflow (tests/system/test_adaptive_runs.py).
    flush: Optional[float] = 0.4
    scale_underflow: Optional[float] = 0.25
    scale_overflow: Optional[float] = None


@dataclass
class AdaptiveConfig:
    # Move a linear's GEMM pass to the next format of `ladder` when a telemetry statistic stays
    # above its threshold for `patience` consecutive telemetry windows (training/precision.py).
    enabled: bool = False
    # Formats from least to most precise; a pass whose format is not on it never moves.
    ladder: list[str] = field(default_factory=lambda: ["nvfp4", "mxfp8", "bf16"])
    thresholds: AdaptiveThresholds = field(default_factory=AdaptiveThresholds)
    patience: int = 3
    # "forward": only Fprop moves; "all": Fprop, Dgrad and Wgrad, each on its own statistics.
    passes: AdaptivePasses = AdaptivePasses.all
    # At most this fraction of the run's quantized GEMMs (linear x pass) ever falls back.
    max_fallback_fraction: float = 0.25
    # No decision after this optimizer step: the map is frozen (null: never frozen).
    freeze_after_step: Optional[int] = None


@dataclass
class PrecisionConfig:
    """Hydra group `precision/`. Field docs are in the README's "Precision recipes" table."""

    name: str = "bf16"
    # The recipe's format: bf16 | fp8 | mxfp4 | mxfp8 | nvfp4 for every GEMM, or one per GEMM
    # pass, {fprop: .., dgrad: .., wgrad: ..} with `forward` (= fprop) and `backward` (= dgrad +
    # wgrad) as shorthands; a pass the map does not name runs in BF16 (nvfp4_recipe/passes.py).
    # Any: OmegaConf has no union of a string and a map; validate_precision checks it.
    format: Any = "bf16"
    # Random Hadamard transform on both Wgrad operands (NVFP4 only).
    rht: bool = True
    # Stochastic rounding of gradients feeding Dgrad and Wgrad (NVFP4; MXFP4 if set).
    stochastic_rounding: bool = True
    # 16x16 weight tiles (so Fprop and Dgrad see the same quantized W); off = 1x16 along K / N.
    weight_2d: bool = True
    # Leading / trailing pattern layers kept in BF16; None = the model config's default.
    bf16_first_layers: Optional[int] = None
    bf16_last_layers: Optional[int] = None
    # The trailing BF16 layers as a fraction of the depth, rounded up (ceil(fraction x layers));
    # instead of bf16_last_layers, which must then be null.
    bf16_last_fraction: Optional[float] = None
    switch_to_bf16: SwitchToBF16Config = field(default_factory=SwitchToBF16Config)
    # auto: TE's FP4 GEMMs on compute capability 10.x, the nvfp4_recipe emulation elsewhere.
    backend: Backend = Backend.auto
    # Emulated GEMM: "fast" multiplies the (exact) bf16 q*s operands in bf16, "exact" in fp32.
    gemm: Gemm = Gemm.fast
    # Emulation quantizers: "auto" (compiled on CPU when a C++ compiler exists), "eager", "compiled".
    kernels: Kernels = Kernels.auto
    # What BF16 GEMMs compute in: "auto" = BF16 where the device multiplies BF16 natively (GPUs,
    # AVX512/AMX/Arm-BF16 CPUs), else FP32 on the same BF16 values (nvfp4_recipe/compute.py);
    # "bf16" / "fp32" force a side on a CPU, for comparisons.
    gemm_compute: GemmComputeChoice = GemmComputeChoice.auto
    # Quantization diagnostics every N optimizer steps (0 = off).
    diagnostics_every: int = 0
    # Each low-precision linear's input amax, a running max over the last N optimizer steps,
    # saved in checkpoints: the activation scales of an NVFP4 serving export (0 = off;
    # nvfp4_recipe/megatron/input_amax.py).
    input_amax_steps: int = 1000
    # Underflow telemetry of the emulated GEMMs (metrics `underflow/<linear>/<pass>/<operand>/
    # <stat>`), and the per-linear fallback it drives.
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    # Per-linear formats: glob pattern (fnmatch, case-sensitive) on names like
    # `layers.3.mixer.in_proj` (pattern-layer index, megatron module name) -> a format, or a map
    # of passes as `format` takes (the passes it does not name keep the layer's formats). Beats
    # format and (see overrides_in_bf16_layers) the BF16 first/last layers; `resolve_overrides`.
    overrides: dict[str, Any] = field(default_factory=dict, metadata={USER_KEYS: True})
    # Whether the overrides also change the linears of the BF16 first/last layers (true), or only
    # those of the layers the recipe quantizes (false: megatron-core's per-module quantization
    # config leaves a layer outside the quantized autocast alone unless asked,
    # TEQuantizationRecipe.override_nonquantized_autocast=False, extensions/transformer_engine.py:157).
    overrides_in_bf16_layers: bool = True

    def __post_init__(self) -> None:
        validate_precision(self)


@dataclass(frozen=True)
class LayerPrecision:
    """The decision for one pattern layer: the layer's formats and, where `precision.overrides`
    changed a linear's, that linear's (`linears`: (name, formats) pairs; a linear not listed has
    the layer's). Formats are PassFormats, one per GEMM pass (a plain format name is taken as the
    format of all three)."""

    index: int
    kind: str
    format: PassFormats  # "bf16", or the recipe's formats
    linears: tuple[tuple[str, PassFormats], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", PassFormats(self.format))
        object.__setattr__(self, "linears",
                           tuple((name, PassFormats(fmt)) for name, fmt in self.linears))

    @property
    def low_precision(self) -> bool:
        """Whether the layer runs under the recipe (on TE: inside the layer's autocast)."""
        return self.format.low_precision

    def linear_format(self, name: str) -> PassFormats:
        return dict(self.linears).get(name, self.format)


def validate_precision(cfg: PrecisionConfig) -> None:
    """The schema's own checks (its __post_init__, which `OmegaConf.to_object` runs): ValueError
    naming the key. This package ships alone in its wheel, without the project's errors module
    (or its field_ranges): every numeric field is checked here by hand, and the training config
    layer turns the ValueError into a ConfigError. The choices again, for a config built in
    Python (Hydra checks a composed one); the layer counts against the model's depth are
    `resolve_bf16_layers`'. `format` and the overrides' values: a format or a map of passes
    (nvfp4_recipe/passes.py), checked here since the schema can only type them Any."""
    parse_pass_map(cfg.format, "precision.format")
    for key, value, choices in (("backend", cfg.backend, Backend), ("gemm", cfg.gemm, Gemm),
                                ("kernels", cfg.kernels, Kernels),
                                ("gemm_compute", cfg.gemm_compute, GemmComputeChoice),
                                ("switch_to_bf16.passes", cfg.switch_to_bf16.passes, SwitchPasses)):
        if value not in tuple(choices):
            raise ValueError(f"precision.{key}={value!r}: choose one of {', '.join(choices)}")
    at = cfg.switch_to_bf16.at_fraction
    if at is not None and not 0.0 <= at <= 1.0:
        raise ValueError(
            f"precision.switch_to_bf16.at_fraction={at}: a fraction of the run's tokens in "
            "[0, 1], or null for never"
        )
    for key in ("bf16_first_layers", "bf16_last_layers"):
        value = getattr(cfg, key)
        if value is not None and value < 0:
            raise ValueError(f"precision.{key}={value} is negative: use 0 or more (or null: the "
                             "model's default)")
    fraction = cfg.bf16_last_fraction
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"precision.bf16_last_fraction={fraction} is not a fraction of "
                             "the model's layers: use [0, 1], or null")
        if cfg.bf16_last_layers is not None:
            raise ValueError(f"precision.bf16_last_layers={cfg.bf16_last_layers} and "
                             f"precision.bf16_last_fraction={fraction} both set the trailing BF16 "
                             "layers: set one, the other null")
    if cfg.diagnostics_every < 0:
        raise ValueError(f"precision.diagnostics_every={cfg.diagnostics_every} must be >= 0")
    if cfg.input_amax_steps < 0:
        raise ValueError(f"precision.input_amax_steps={cfg.input_amax_steps} must be >= 0 "
                         "(0 = off)")
    validate_adaptive(cfg)
    for pattern, fmt in cfg.overrides.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ValueError(f"precision.overrides: {pattern!r} is not a module-name pattern")
        parse_pass_map(fmt, f"precision.overrides[{pattern!r}]")


def validate_adaptive(cfg: PrecisionConfig) -> None:
    """`precision.telemetry` and `precision.adaptive`: ValueError naming the key."""
    telemetry, adaptive = cfg.telemetry, cfg.adaptive
    if _not_int(telemetry.every) or telemetry.every < 0:
        raise ValueError(f"precision.telemetry.every={telemetry.every!r} must be >= 0 (0 = off)")
    if _not_int(telemetry.rows) or telemetry.rows < 1:
        raise ValueError(f"precision.telemetry.rows={telemetry.rows!r} must be >= 1")
    if adaptive.passes not in tuple(AdaptivePasses):
        raise ValueError(f"precision.adaptive.passes={adaptive.passes!r}: choose one of "
                         f"{', '.join(AdaptivePasses)}")
    ladder = list(adaptive.ladder)
    for fmt in ladder:
        if not isinstance(fmt, str) or not is_format(fmt):
            raise ValueError(f"precision.adaptive.ladder names {fmt!r}, not a format: choose "
                             f"from {format_names()}")
    if len(ladder) < 2 or len(set(ladder)) != len(ladder):
        raise ValueError(f"precision.adaptive.ladder={ladder}: two or more distinct formats, "
                         "least precise first (e.g. [nvfp4, mxfp8, bf16])")
    for stat in TELEMETRY_STATS:
        value = getattr(adaptive.thresholds, stat)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0.0 <= value <= 1.0):
            raise ValueError(f"precision.adaptive.thresholds.{stat}={value!r}: a fraction in "
                             "[0, 1], or null for not watched")
    if _not_int(adaptive.patience) or adaptive.patience < 1:
        raise ValueError(f"precision.adaptive.patience={adaptive.patience!r} must be >= 1 "
                         "(consecutive telemetry windows)")
    fraction = adaptive.max_fallback_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"precision.adaptive.max_fallback_fraction={fraction!r}: a fraction of "
                         "the quantized GEMMs in [0, 1]")
    freeze = adaptive.freeze_after_step
    if freeze is not None and (_not_int(freeze) or freeze < 0):
        raise ValueError(f"precision.adaptive.freeze_after_step={freeze!r} must be >= 0 (or "
                         "null: never frozen)")
    if adaptive.enabled:
        if telemetry.every == 0:
            raise ValueError("precision.adaptive.enabled=true needs the telemetry it decides "
                             "from: set precision.telemetry.every >= 1")
        if all(getattr(adaptive.thresholds, stat) is None for stat in TELEMETRY_STATS):
            raise ValueError("precision.adaptive.enabled=true watches no statistic: set one of "
                             "precision.adaptive.thresholds.{flush,scale_underflow,"
                             "scale_overflow}")


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def recipe_formats(cfg: PrecisionConfig) -> PassFormats:
    """The formats of the recipe's low-precision layers (`precision.format`; a pass a map does
    not name runs in BF16)."""
    return pass_formats(cfg.format, "precision.format")


def low_precision_formats(cfg: PrecisionConfig) -> list[str]:
    """Every low-precision format a run may use, in any pass: the recipe's and the overrides'
    (no bf16)."""
    formats = {Format(f) for value in (cfg.format, *cfg.overrides.values())
               for f in parse_pass_map(value, "precision.format").values()}
    return sorted(formats - {Format.bf16}, key=list(Format).index)


def resolve_overrides(overrides: Mapping[str, Any],
                      names: Sequence[str]) -> dict[str, dict[str, str]]:
    """{linear name: {pass: format}} from `precision.overrides` over the model's linear names
    (the passes each value names: all three for a format name).

    A pattern is a glob (fnmatch, case-sensitive: `*` any run of characters dots included, `?` one,
    `[0-9]` a class) matched against the whole name, e.g. `*.mixer.in_proj`,
    `layers.1?.mlp.*`, `layers.5.self_attention.linear_qkv` (the same glob matching as
    megatron-core's per-module quantization config, mc 0.16.1 quantization/quant_config.py).
    A pattern that matches no linear, or two patterns giving one linear different values, is a
    ValueError: nothing is silently ignored and the order of the patterns never matters."""
    resolved: dict[str, tuple[str, dict[str, str]]] = {}
    for pattern, value in overrides.items():
        fmt = parse_pass_map(value, f"precision.overrides[{pattern!r}]")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            examples = ", ".join(dict.fromkeys(_example_names(names)))
            raise ValueError(
                f"precision.overrides: {pattern!r} matches no linear of this model; names look "
                f"like {examples} (glob: '*' any characters, '?' one)")
        for name in matched:
            if name in resolved and resolved[name][1] != fmt:
                other, other_fmt = resolved[name]
                raise ValueError(
                    f"precision.overrides: {name} matches {other!r} ({_describe(other_fmt)}) "
                    f"and {pattern!r} ({_describe(fmt)}); make the patterns disjoint")
            resolved[name] = (pattern, fmt)
    return {name: fmt for name, (_, fmt) in resolved.items()}


def _describe(passes: Mapping[str, str]) -> str:
    """"nvfp4" for a value that names all three passes one format, else "fprop=mxfp8, ..."."""
    if tuple(passes) == PASSES and len(set(passes.values())) == 1:
        return next(iter(passes.values()))
    return ", ".join(f"{p}={f}" for p, f in passes.items())


def _example_names(names: Sequence[str]) -> list[str]:
    """One name per distinct linear (the first layer that has it), for error messages."""
    seen, out = set(), []
    for name in names:
        suffix = name.split(".", 2)[-1]
        if suffix not in seen:
            seen.add(suffix)
            out.append(name)
    return out


def resolve_bf16_layers(
    cfg: PrecisionConfig, num_layers: int, model_first: int, model_last: int
) -> tuple[int, int]:
    """The (first, last) BF16 layer counts, range-checked against the model depth. The last:
    `bf16_last_layers`, else ceil(`bf16_last_fraction` x depth), else the model's."""
    first = model_first if cfg.bf16_first_layers is None else cfg.bf16_first_layers
    if cfg.bf16_last_layers is not None:
        last = cfg.bf16_last_layers
    elif cfg.bf16_last_fraction is not None:
        # The fraction as written (0.15 is 3/20, not the binary float just below it), so that a
        # product that is a whole number is not rounded up past it.
        last = math.ceil(Fraction(str(cfg.bf16_last_fraction)) * num_layers)
    else:
        last = model_last
    for key, value in (("bf16_first_layers", first), ("bf16_last_layers", last)):
        if value < 0:
            raise ValueError(f"precision.{key}={value} is negative: use 0 or more")
        if value > num_layers:
            raise ValueError(
                f"precision.{key}={value} is larger than the model depth ({num_layers} layers)"
            )
    if first + last > num_layers:
        raise ValueError(
            f"precision.bf16_first_layers={first} and precision.bf16_last_layers={last} overlap: "
            f"together they exceed the model's {num_layers} layers"
        )
    return first, last


class PrecisionPolicy:
    """Decides the formats of every linear, one per GEMM pass: from the pattern-layer index (the
    recipe's formats, BF16 for the first/last layers), then `precision.overrides` per linear name
    (in the BF16 layers too unless `overrides_in_bf16_layers` is false).

    `linear_names` maps a layer kind to its linears' module names (model.specs.LINEAR_NAMES);
    needed when the config has overrides."""

    def __init__(self, cfg: PrecisionConfig, layer_kinds: list[str], model_first: int = 0,
                 model_last: int = 0, linear_names: Optional[Mapping[str, Sequence[str]]] = None):
        validate_precision(cfg)
        self.cfg = cfg
        self.layer_kinds = list(layer_kinds)
        self.linear_names = {k: tuple(v) for k, v in (linear_names or {}).items()}
        self.formats = recipe_formats(cfg)
        if not self.formats.low_precision:
            self.first, self.last = 0, 0
        else:
            self.first, self.last = resolve_bf16_layers(
                cfg, len(layer_kinds), model_first, model_last
            )
        if cfg.overrides and not self.linear_names:
            raise ValueError("precision.overrides needs the model's linear names (linear_names)")
        self.overrides = resolve_overrides(cfg.overrides, self.names())

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def names(self) -> list[str]:
        """Every linear's name, `layers.<pattern index>.<module name>`, in layer order."""
        return [f"layers.{i}.{n}" for i, kind in enumerate(self.layer_kinds)
                for n in self.linear_names.get(kind, ())]

    def layer(self, index: int) -> LayerPrecision:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} outside a {self.num_layers}-layer pattern")
        in_bf16 = index < self.first or index >= self.num_layers - self.last
        fmt = PassFormats(BF16) if in_bf16 else self.formats
        kind = self.layer_kinds[index]
        changed = []
        if self.cfg.overrides_in_bf16_layers or not in_bf16:
            for n in self.linear_names.get(kind, ()):
                override = self.overrides.get(f"layers.{index}.{n}")
                linear = fmt if override is None else fmt.replace(override)
                if linear != fmt:
                    changed.append((n, linear))
        return LayerPrecision(index=index, kind=kind, format=fmt, linears=tuple(changed))

    def layers(self) -> list[LayerPrecision]:
        return [self.layer(i) for i in range(self.num_layers)]

    def linear_formats(self) -> dict[str, PassFormats]:
        """{`layers.<i>.<name>`: formats} of every linear (PassFormats: what each of its GEMMs,
        Fprop, Dgrad and Wgrad, runs in; a plain name where the three agree)."""
        return {f"layers.{d.index}.{n}": d.linear_format(n) for d in self.layers()
                for n in self.linear_names.get(d.kind, ())}

    def precision_map(self, switched: Optional[Mapping[str, str]] = None
                      ) -> dict[str, dict[str, str]]:
        """{linear name: {formats: runs of pattern-layer indices}}, e.g. {"mixer.in_proj":
        {"bf16": "0-2,56-60", "nvfp4": "4-54"}}: a run a-b covers every layer from a to b that
        has this linear (layers of other kinds in between do not break it). The formats are one
        name where Fprop, Dgrad and Wgrad agree, else "fprop/dgrad/wgrad" ("mxfp8/nvfp4/nvfp4").
        `switched`: {`layers.<i>.<name>`: formats} a run switched linears to (the adaptive
        fallback's map, training/precision.py), shown instead of the policy's."""
        switched = switched or {}
        by_name: dict[str, list[tuple[int, str]]] = {}
        for d in self.layers():
            for n in self.linear_names.get(d.kind, ()):
                fmt = switched.get(f"layers.{d.index}.{n}", d.linear_format(n))
                by_name.setdefault(n, []).append((d.index, str(PassFormats(fmt))))
        return {n: _runs(entries) for n, entries in by_name.items()}

    def describe_map(self) -> str:
        """The precision map on one line, for the start-up log."""
        return describe_precision_map(self.precision_map())

    def recipe(self) -> dict:
        """The resolved precision keys, as recorded in plan.json and W&B."""
        cfg = self.cfg
        return {
            "name": cfg.name,
            "format": str(self.formats),  # "fprop/dgrad/wgrad" where a map gave them apart
            "rht": cfg.rht,
            "stochastic_rounding": cfg.stochastic_rounding,
            "weight_2d": cfg.weight_2d,
            "bf16_first_layers": self.first,
            "bf16_last_layers": self.last,
            "switch_to_bf16": {
                "at_fraction": cfg.switch_to_bf16.at_fraction,
                "passes": cfg.switch_to_bf16.passes,
            },
            "backend": cfg.backend,
            "gemm": cfg.gemm,
            "kernels": cfg.kernels,
            "overrides": dict(cfg.overrides),
            "overrides_in_bf16_layers": cfg.overrides_in_bf16_layers,
        }


def describe_precision_map(pmap: Mapping[str, Mapping[str, str]]) -> str:
    """"mixer.in_proj: bf16 at 0-7 | mlp.linear_fc1: nvfp4 at 1,6; fp8 at 4; bf16 at 8"."""
    return " | ".join(f"{name}: " + "; ".join(f"{fmt} at {runs}" for fmt, runs in formats.items())
                      for name, formats in pmap.items())


def _runs(entries: list[tuple[int, str]]) -> dict[str, str]:
    """[(layer, format)] in layer order -> {format: "a-b,c"}: maximal runs of consecutive entries
    with one format (consecutive in this list, i.e. among the layers that have the linear)."""
    runs: dict[str, list[list[int]]] = {}
    previous = None
    for index, fmt in entries:
        if fmt == previous:
            runs[fmt][-1][1] = index
        else:
            runs.setdefault(fmt, []).append([index, index])
        previous = fmt
    return {fmt: ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
            for fmt, spans in runs.items()}


@dataclass
class RuntimePrecisionState:
    """Mutable state shared by every linear of a model: the in-run switch to BF16.

    `bf16_passes`: the GEMM passes (nvfp4_recipe/passes.py) that run in BF16 from now on, in
    every linear: each applies it to its own formats per call (`PassFormats.with_bf16`, the same
    per-pass mechanism as a format map in the config). The precision controller sets it once
    (and again on resume: it is derived from the consumed tokens).
    """

    bf16_passes: tuple[str, ...] = ()
    collect_diagnostics: bool = False
    # Rows of each quantized operand the emulated GEMMs sample for the underflow telemetry
    # during this step (nvfp4_recipe/telemetry.py); 0: not measuring.
    telemetry_rows: int = 0
    # {policy linear name: formats} of the linears switched at run time (the precision
    # controller's apply_formats: the adaptive fallback, a replay's map) where they differ from
    # the policy's. The TE linears read it at every forward (te_runtime.te_switchable_context);
    # the emulated ones are handed their new configs.
    linear_formats: dict[str, PassFormats] = field(default_factory=dict)

    def formats(self, formats: PassFormats, name: Optional[str] = None) -> PassFormats:
        """A linear's formats now: its policy's (or those it was switched to, for the linear
        `name`), with the late switch's passes in BF16."""
        if name is not None:
            formats = self.linear_formats.get(name, formats)
        return formats.with_bf16(self.bf16_passes) if self.bf16_passes else formats


def describe_kernels(cfg: PrecisionConfig, backend: str, device) -> str:
    """How the emulation quantizes, for the start-up line ("" where the emulated format has no
    compiled quantizers, or nothing is emulated)."""
    if backend != "emulated" or not any(format_spec(f).compiled_kernels
                                        for f in low_precision_formats(cfg)):
        return ""
    mode = "compiled" if use_compiled(cfg.kernels, torch.device(device)) else "eager"
    return f"{mode} quantizers (precision.kernels={cfg.kernels})"
