"""The precision policy: which GEMM format each linear of each pattern layer uses.

This module is pure Python (no torch, megatron or TE import): it turns the `precision` config
into per-layer decisions. `nvfp4_recipe.parallel_linear` turns a decision into a megatron-core
linear class (emulated), `nvfp4_recipe.te_mapping` into a Transformer Engine recipe (Blackwell).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .kernels import KERNEL_MODES, use_compiled

FORMATS = ("bf16", "nvfp4", "fp8", "mxfp4")
BACKENDS = ("auto", "te", "emulated")
SWITCH_PASSES = ("forward", "all")
GEMM_MODES = ("fast", "exact")


@dataclass
class SwitchToBF16Config:
    # Fraction of the run's total tokens after which the low-precision GEMMs run in BF16
    # (paper appendix D: 0.82 of 10T). None = never.
    at_fraction: Optional[float] = None
    # "all": forward and backward GEMMs switch; "forward": only Fprop (cheaper, most of the gain).
    passes: str = "all"


@dataclass
class PrecisionConfig:
    """Hydra group `precision/`. Field docs are in the README's "Precision recipes" table."""

    name: str = "bf16"
    format: str = "bf16"
    # Random Hadamard transform on both Wgrad operands (NVFP4 only).
    rht: bool = True
    # Stochastic rounding of gradients feeding Dgrad and Wgrad (NVFP4; MXFP4 if set).
    stochastic_rounding: bool = True
    # 16x16 weight tiles (so Fprop and Dgrad see the same quantized W); off = 1x16 along K / N.
    weight_2d: bool = True
    # Leading / trailing pattern layers kept in BF16; None = the model config's default.
    bf16_first_layers: Optional[int] = None
    bf16_last_layers: Optional[int] = None
    switch_to_bf16: SwitchToBF16Config = field(default_factory=SwitchToBF16Config)
    # auto: TE's FP4 GEMMs on compute capability 10.x, the nvfp4_recipe emulation elsewhere.
    backend: str = "auto"
    # Emulated GEMM: "fast" multiplies the (exact) bf16 q*s operands in bf16, "exact" in fp32.
    gemm: str = "fast"
    # Emulation quantizers: "auto" (compiled on CPU when a C++ compiler exists), "eager", "compiled".
    kernels: str = "auto"
    # Quantization diagnostics every N optimizer steps (0 = off).
    diagnostics_every: int = 0


@dataclass(frozen=True)
class LayerPrecision:
    """The decision for one pattern layer."""

    index: int
    kind: str
    format: str  # "bf16" or the recipe's low-precision format

    @property
    def low_precision(self) -> bool:
        return self.format != "bf16"


def validate_precision(cfg: PrecisionConfig) -> None:
    if cfg.format not in FORMATS:
        raise ValueError(f"precision.format={cfg.format!r}: choose one of {', '.join(FORMATS)}")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"precision.backend={cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    if cfg.gemm not in GEMM_MODES:
        raise ValueError(f"precision.gemm={cfg.gemm!r}: choose one of {', '.join(GEMM_MODES)}")
    if cfg.kernels not in KERNEL_MODES:
        raise ValueError(f"precision.kernels={cfg.kernels!r}: choose one of {', '.join(KERNEL_MODES)}")
    if cfg.switch_to_bf16.passes not in SWITCH_PASSES:
        raise ValueError(
            f"precision.switch_to_bf16.passes={cfg.switch_to_bf16.passes!r}: "
            f"choose one of {', '.join(SWITCH_PASSES)}"
        )
    at = cfg.switch_to_bf16.at_fraction
    if at is not None and not 0.0 <= at <= 1.0:
        raise ValueError(
            f"precision.switch_to_bf16.at_fraction={at}: a fraction of the run's tokens in "
            "[0, 1], or null for never"
        )
    if cfg.diagnostics_every < 0:
        raise ValueError(f"precision.diagnostics_every={cfg.diagnostics_every} must be >= 0")


def resolve_bf16_layers(
    cfg: PrecisionConfig, num_layers: int, model_first: int, model_last: int
) -> tuple[int, int]:
    """The (first, last) BF16 layer counts, range-checked against the model depth."""
    first = model_first if cfg.bf16_first_layers is None else cfg.bf16_first_layers
    last = model_last if cfg.bf16_last_layers is None else cfg.bf16_last_layers
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
    """Decides, from the pattern layer index, the format of that layer's linears."""

    def __init__(self, cfg: PrecisionConfig, layer_kinds: list[str], model_first: int = 0,
                 model_last: int = 0):
        validate_precision(cfg)
        self.cfg = cfg
        self.layer_kinds = list(layer_kinds)
        if cfg.format == "bf16":
            self.first, self.last = 0, 0
        else:
            self.first, self.last = resolve_bf16_layers(
                cfg, len(layer_kinds), model_first, model_last
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def layer(self, index: int) -> LayerPrecision:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} outside a {self.num_layers}-layer pattern")
        in_bf16 = index < self.first or index >= self.num_layers - self.last
        fmt = "bf16" if (self.cfg.format == "bf16" or in_bf16) else self.cfg.format
        return LayerPrecision(index=index, kind=self.layer_kinds[index], format=fmt)

    def layers(self) -> list[LayerPrecision]:
        return [self.layer(i) for i in range(self.num_layers)]

    def recipe(self) -> dict:
        """The resolved precision keys, as recorded in plan.json and W&B."""
        cfg = self.cfg
        return {
            "name": cfg.name,
            "format": cfg.format,
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
        }


@dataclass
class RuntimePrecisionState:
    """Mutable state shared by every low-precision linear of a model: the in-run switch.

    The trainer flips it once (and restores it on resume); each linear reads it per call.
    """

    switched_passes: Optional[str] = None  # None, "forward" or "all"
    collect_diagnostics: bool = False

    @property
    def forward_quantized(self) -> bool:
        return self.switched_passes is None

    @property
    def backward_quantized(self) -> bool:
        return self.switched_passes != "all"


def describe_kernels(cfg: PrecisionConfig, backend: str, device) -> str:
    """How the emulation quantizes, for the start-up line ("" where nothing is emulated in NVFP4)."""
    if backend != "emulated" or cfg.format != "nvfp4":
        return ""
    mode = "compiled" if use_compiled(cfg.kernels, torch.device(device)) else "eager"
    return f"{mode} quantizers (precision.kernels={cfg.kernels})"
