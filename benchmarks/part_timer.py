"""Wall time per part of a training step, from hooks that only the step profile installs.

The numerics carry no timer (a timer in the hot path would cost every step): while a `PartTimer` is entered, each function that
does one part of the step (STEP_PARTS) is replaced, wherever the project binds it, by a wrapper
that times the call, and put back on exit. Outside a profile the step runs the very functions it
always runs; tests/nvfp4_recipe/test_parts.py checks that none is left wrapped.

Not torch.profiler: it charges ~10 us to every op, and an emulated NVFP4 step runs many small
ops (under it a step took 7.7x longer), so its split would measure the profiler. A wrapper costs
~1 us per call. A part's time excludes the timed parts nested in it (the innermost owns the time).
Parts called inside autograd Functions are timed in the backward too (CPU autograd runs on the
caller's thread). None of these functions runs inside a torch.compile'd region (the quantizers'
compiled kernels are called from them), so the wrappers cause no graph break.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from nvfp4_recipe.registry import FORMAT_SPECS

QUANTIZE = "emulation/quantize"
GEMM = "emulation/gemm"
WGRAD_TRANSPOSE = "emulation/wgrad_transpose_rht"
SR_DRAWS = "emulation/sr_draws"
SSD_SCAN = "mamba/ssd_scan"
CONVERSIONS = "gemm/bf16<->fp32 conversions"
FP32_GEMMS = "gemm/fp32 on bf16 values"
TELEMETRY = "emulation/underflow telemetry"

# The GEMM operands each format's ops class quantizes (nvfp4_recipe/operands.py).
OPERAND_ROLES = ("weight_fprop", "activation", "weight_dgrad", "grad_dgrad", "grad_wgrad",
                 "activation_wgrad")
# Packages whose modules may bind a timed function under its own name.
_PROJECT_PACKAGES = ("nvfp4_recipe", "model", "training", "benchmarks", "studies")


@dataclass(frozen=True)
class Part:
    """`owner.name` (owner: a module or a class, by dotted path) is timed as `label`."""

    owner: str
    name: str
    label: str


def _ops_class_parts() -> list[Part]:
    return [Part(f"{spec.ops.__module__}.{spec.ops.__qualname__}", role, QUANTIZE)
            for spec in FORMAT_SPECS.values() if spec.ops is not None for role in OPERAND_ROLES]


def step_parts() -> list[Part]:
    """What the step profile times: the emulated linears' quantizers (every GEMM operand of every
    format), their stochastic-rounding draws, the Wgrad transposes with the RHT, the emulated
    GEMMs, the underflow telemetry's sampling (its Wgrad sources' transposes are the
    transposes' time); the Mamba scan (forward; its backward is autograd's); where BF16 GEMMs compute in
    FP32, those GEMMs and their conversions."""
    return _ops_class_parts() + [
        Part("nvfp4_recipe.formats", "draw_random_bytes", SR_DRAWS),
        Part("nvfp4_recipe.operands", "transpose_padded", WGRAD_TRANSPOSE),
        Part("nvfp4_recipe.linear", "emulated_gemm", GEMM),
        Part("nvfp4_recipe.telemetry.OperandTelemetry", "observe", TELEMETRY),
        Part("nvfp4_recipe.telemetry.OperandTelemetry", "observe_wgrad", TELEMETRY),
        Part("model.ssd", "ssd_chunk_scan", SSD_SCAN),
        Part("nvfp4_recipe.compute", "_gemm_in_fp32", FP32_GEMMS),
        Part("nvfp4_recipe.compute", "_up_all", CONVERSIONS),
        Part("nvfp4_recipe.compute", "_down", CONVERSIONS),
    ]


def _resolve(path: str):
    """A module or a class by dotted path (modules are imported)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, cls = path.rpartition(".")
        return getattr(importlib.import_module(module), cls)


def _project_modules_binding(name: str, fn: Callable) -> list:
    return [module for module_name, module in list(sys.modules.items())
            if module_name.split(".")[0] in _PROJECT_PACKAGES and vars(module).get(name) is fn]


class PartTimer:
    """Installs the wrappers of `parts` on __enter__ and removes them on __exit__; `seconds` and
    `calls` per label accumulate until `take()`."""

    def __init__(self, parts: Sequence[Part] | None = None) -> None:
        self.parts = list(parts) if parts is not None else step_parts()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._children: list[float] = []  # per open region: time spent in nested regions
        self._installed: list[tuple[object, str, Callable, Callable]] = []  # owner, name, original, timed

    @contextmanager
    def region(self, label: str) -> Iterator[None]:
        self._children.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            nested = self._children.pop()
            self.seconds[label] += elapsed - nested
            self.calls[label] += 1
            if self._children:
                self._children[-1] += elapsed

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """The seconds and calls per label so far; starts a new count."""
        seconds, calls = dict(self.seconds), dict(self.calls)
        self.seconds.clear()
        self.calls.clear()
        return seconds, calls

    def _wrap(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.region(label):
                return fn(*args, **kwargs)

        return timed

    def __enter__(self) -> "PartTimer":
        if self._installed:
            raise RuntimeError("this PartTimer is already installed")
        try:
            for part in self.parts:
                self._install(part)
        except BaseException:
            self._uninstall()
            raise
        return self

    def _install(self, part: Part) -> None:
        owner = _resolve(part.owner)
        if isinstance(owner, type):
            original = vars(owner).get(part.name)  # its own method, not an inherited one
            if not callable(original):
                raise AttributeError(f"{part.owner} defines no method {part.name!r} to time")
            owners = [owner]
        else:
            original = getattr(owner, part.name)
            # Every project module that imported the function under its name calls it through
            # its own global: wrap it there too.
            owners = _project_modules_binding(part.name, original)
        if hasattr(original, "__wrapped__"):
            raise RuntimeError(f"{part.owner}.{part.name} is already wrapped: one PartTimer at a time")
        timed = self._wrap(original, part.label)
        for target in owners:
            setattr(target, part.name, timed)
            self._installed.append((target, part.name, original, timed))

    def _uninstall(self) -> None:
        while self._installed:
            target, name, original, timed = self._installed.pop()
            setattr(target, name, original)
            # A module imported during the profile bound the wrapper: give it the original too.
            for module in _project_modules_binding(name, timed):
                setattr(module, name, original)

    def __exit__(self, *exc) -> None:
        self._uninstall()
