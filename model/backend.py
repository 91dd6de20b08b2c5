"""Which layer spec and GEMM backend a run uses, and why: one pure decision over a probed machine.

- TE spec + TE GEMMs: Transformer Engine runs the precision's recipe on this GPU (TE's own
  check), and the mamba_ssm package imports (megatron's MambaMixer, which the TE spec uses,
  raises ImportError without it, mc 0.16.1 ssm/mamba_mixer.py:173-176). With a causal_conv1d
  that mamba_ssm's fused kernel can call the mixer takes megatron's memory-efficient fused path
  (`mamba_mem_eff_path`, `fused_conv1d_usable`); otherwise the non-fused one, with causal_conv1d_fn
  or PyTorch's conv1d (ssm/mamba_mixer.py:801-810 in 0.16.1, :913 in 0.19.0).
- Otherwise the portable spec, GEMMs emulated by nvfp4_recipe; on CUDA its Mamba mixer still uses
  each mamba_ssm / causal_conv1d kernel that loads (model/mamba_mixer.py), mamba_ssm's Triton
  kernels even where the package itself does not import (compat.mamba_ssm_triton_kernels).

`model.spec` and `precision.backend` may force either side; forcing TE where it cannot run is a
ValueError that names the key and the reason, and `auto` never raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from nvfp4_recipe.megatron.te_mapping import probe_te_support
from nvfp4_recipe.policy import PrecisionConfig

from .device import Hardware, probe_hardware
from .mamba_mixer import (KERNEL_PACKAGES, fused_conv1d_probe, mamba_kernels,
                          mamba_ssm_package_imports)

SPECS = ("auto", "portable", "te")
SPEC_OF_BACKEND = {"te": "te", "emulated": "portable"}  # TE layers do their own GEMMs


@dataclass(frozen=True)
class Machine:
    """What this machine offers the model (plain values, so tests can state any machine)."""

    capability: Optional[tuple[int, int]]  # None: a CPU run (Hardware.cuda_capability)
    te_recipe: tuple[bool, str]  # transformer_engine imports and runs the recipe here, or why not
    mamba_ssm: bool  # the package imports (megatron's mixer, the TE spec, needs it)
    causal_conv1d: bool  # imports
    # mamba_ssm's Triton SSD scan and gated RMSNorm load (with or without the package's
    # __init__, compat item 8); None: as mamba_ssm
    mamba_triton: Optional[bool] = None
    # mamba_ssm's fused conv1d + scan can call this causal_conv1d (fused_conv1d_usable); None: as
    # causal_conv1d
    fused_conv1d: Optional[bool] = None

    @property
    def mamba_kernels(self) -> bool:
        return self.mamba_ssm if self.mamba_triton is None else self.mamba_triton

    @property
    def mamba_fused_conv1d(self) -> bool:
        return self.causal_conv1d if self.fused_conv1d is None else self.fused_conv1d


@dataclass(frozen=True)
class BackendChoice:
    spec: str  # "te" | "portable"
    gemm_backend: str  # "te" | "emulated"
    reason: str


def _te_spec_problem(machine: Machine) -> str:
    """Why the TE spec cannot run here ("" when it can)."""
    if machine.capability is None:
        return "no CUDA device"
    te_ok, te_why = machine.te_recipe
    if not te_ok:
        return te_why
    if not machine.mamba_ssm:
        return ("mamba_ssm not importable (the TE spec's Mamba mixer needs it"
                + ("; its Triton kernels load without it, for the portable mixer)"
                   if machine.mamba_kernels else ")"))
    return ""


def _portable_mixer_kernels(machine: Machine) -> str:
    """What the portable Mamba mixer runs on this machine, for the start-up line."""
    if machine.capability is None:
        return ""
    scan = "mamba_ssm SSD scan and gated norm" if machine.mamba_kernels else "PyTorch SSD scan and norm"
    conv = "causal_conv1d" if machine.causal_conv1d else "PyTorch conv1d"
    return f"; Mamba mixer: {scan}, {conv}"


def select_backend(precision: PrecisionConfig, model_spec: str, machine: Machine) -> BackendChoice:
    """The spec family and GEMM backend for a run on `machine`, with the reason to log."""
    if model_spec not in SPECS:
        raise ValueError(f"model.spec={model_spec!r}: choose auto, portable or te")
    asked_te = [f"{key}=te" for key, value in (("model.spec", model_spec),
                                               ("precision.backend", precision.backend))
                if value == "te"]
    asked_portable = (["model.spec=portable"] if model_spec == "portable" else []) + (
        ["precision.backend=emulated"] if precision.backend == "emulated" else [])
    if asked_te and asked_portable:
        raise ValueError(f"{asked_te[0]} contradicts {asked_portable[0]}: TE layers run TE GEMMs, "
                         "the portable spec emulated ones; set one of them to auto")
    kernels = _portable_mixer_kernels(machine)
    if asked_portable:
        return BackendChoice("portable", "emulated", f"portable spec: {asked_portable[0]}{kernels}")
    problem = _te_spec_problem(machine)
    if problem and asked_te:
        key = asked_te[0].split("=")[0]
        raise ValueError(f"{asked_te[0]} is not available here: {problem}; use {key}=auto or "
                         f"{'portable' if key == 'model.spec' else 'emulated'}")
    if problem:
        return BackendChoice("portable", "emulated", f"portable spec: {problem}{kernels}")
    major, minor = machine.capability
    why = asked_te[0] if asked_te else f"compute capability {major}.{minor}"
    if mamba_mem_eff_path("te", machine.mamba_fused_conv1d):
        mixer = "megatron's fused conv1d + SSD scan (use_mamba_mem_eff_path, causal_conv1d)"
    elif machine.causal_conv1d:
        mixer = ("megatron's non-fused path: mamba_ssm SSD scan, causal_conv1d (this "
                 "causal_conv1d does not fit mamba_ssm's fused kernel: mamba-ssm >= 2.2.5 needs "
                 "causal-conv1d >= 1.5.1, older mamba-ssm older causal-conv1d; so no "
                 "use_mamba_mem_eff_path)")
    else:
        mixer = ("megatron's non-fused path: mamba_ssm SSD scan, PyTorch conv1d (no causal_conv1d, "
                 "so no use_mamba_mem_eff_path)")
    return BackendChoice("te", "te", f"TE spec: {why}; transformer_engine and mamba_ssm usable, "
                                     f"Mamba mixer: {mixer}")


def mamba_mem_eff_path(spec: str, fused_conv1d: bool) -> bool:
    """megatron's `use_mamba_mem_eff_path` for a model of `spec` ("te" | "portable").

    On: the TE spec where mamba_ssm's fused kernel can call causal_conv1d
    (`fused_conv1d_usable`). Its mixer then trains with `mamba_split_conv1d_scan_combined`
    (mc core_v0.19.0 ssm/mamba_mixer.py:502-511, 733-769; 0.16.1 :436, :630-690): conv1d, scan and
    gate fused, fewer activations kept for the backward; the path megatron trains and tests, while
    it logs the other as "not currently using or functionally testing ... for training"
    (core_v0.19.0 :307-315, 0.16.1 :282-290). The fused kernel calls causal_conv1d's compiled
    functions (mamba v2.3.2.post1 ops/triton/ssd_combined.py:840, 914, 963, through
    causal_conv1d.cpp_functions imported guarded at :21-28), so without them it would fail at the
    first forward: off, the non-fused path. Off on the portable spec: its own mixer
    (model/mamba_mixer.py) has no such path.
    """
    return spec == "te" and fused_conv1d


def fused_conv1d_usable(wrapped: Optional[bool], causal_conv1d_version: Optional[str]) -> bool:
    """Whether mamba_ssm's fused conv1d + scan can call the installed causal_conv1d.

    `wrapped`: mamba-ssm >= 2.2.5 imports causal_conv1d's Python wrappers,
    `causal_conv1d.cpp_functions` (from causal-conv1d 1.5.1), and leaves None behind where that
    fails (v2.3.2.post1 ops/triton/ssd_combined.py:21-28): True or False. None: mamba-ssm <= 2.2.4,
    which calls the compiled `causal_conv1d_cuda` itself with 7 and 10 arguments (v2.2.4
    ssd_combined.py:23, 779, 853, 903), the binding of causal-conv1d before 1.5.1; from 1.5.1 it
    takes 8 and 12 (v1.7.0 csrc/causal_conv1d.cpp:150-157, 261-272): a TypeError at the first
    forward.
    """
    if wrapped is not None:
        return wrapped
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", causal_conv1d_version or "")
    return match is not None and tuple(map(int, match.groups())) < (1, 5, 1)


def fused_conv1d_loads() -> bool:
    """On a CUDA run where mamba_ssm imports: causal_conv1d imports, and mamba_ssm's fused kernel
    can call it (`fused_conv1d_usable`). The backend choice and build_model both ask this."""
    return ("causal_conv1d_fn" in mamba_kernels(cuda=True)
            and fused_conv1d_usable(*fused_conv1d_probe()))


def probe_machine(precision: PrecisionConfig, hardware: Hardware) -> Machine:
    """What the run's device offers `select_backend` (imports TE and the Mamba kernels on a CUDA
    run; never raises)."""
    capability = hardware.cuda_capability
    packages = {KERNEL_PACKAGES[name] for name in mamba_kernels(hardware.cuda)}
    mamba_ssm = hardware.cuda and mamba_ssm_package_imports()
    causal_conv1d = "causal_conv1d" in packages
    return Machine(capability=capability, te_recipe=probe_te_support(precision, capability),
                   mamba_ssm=mamba_ssm, causal_conv1d=causal_conv1d,
                   mamba_triton="mamba_ssm" in packages,
                   fused_conv1d=mamba_ssm and fused_conv1d_loads())


def choose_backend(precision: PrecisionConfig, model_spec: str = "auto",
                   hardware: Optional[Hardware] = None) -> tuple[str, str]:
    """("te" | "emulated", reason) on the run's `hardware` (default: the device a run would
    take here); the spec family follows the backend."""
    hardware = hardware or probe_hardware()
    choice = select_backend(precision, model_spec, probe_machine(precision, hardware))
    return choice.gemm_backend, choice.reason
