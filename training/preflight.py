"""The preflight of a run: every low-precision GEMM of a TrainConfig at its local shape on one
tensor-parallel rank, checked against the rules of each backend the run may use
(nvfp4_recipe/gemm_support.py holds the rules, each citing its source) and, where TE runs, this
machine's GPU and TE release against the known-bad table. The trainer runs it at start-up
(`run_preflight`: a "would fail" stops the run before anything is written, exit 2); the dry run
(training/plan.py) writes every GEMM's result and the verdict at tensor 1/2/4/8 to plan.json.
"""

from __future__ import annotations

from model.config import policy_for
from model.device import probe_hardware
from nvfp4_recipe.gemm_support import (CANDIDATE_TENSOR_SIZES, DeviceSetting, Linear, Report,
                                       Setting, check_linears, known_bad_hits, layout_verdicts)
from nvfp4_recipe.policy import low_precision_formats
from nvfp4_recipe.registry import format_spec


def preflight_backends(precision, model_spec: str) -> tuple[str, ...]:
    """The GEMM backends a run of this config may use (the dry run checks each): TE where the
    config lets it (`auto`: TE on Blackwell, the emulation elsewhere), never where a format has
    no TE recipe in the registry (MXFP4: such a run is emulated; NVFP4, FP8 and MXFP8 have one)."""
    if precision.backend == "emulated" or model_spec == "portable":
        return ("emulated",)
    if precision.backend == "te" or model_spec == "te":
        return ("te",)
    te_runs_all = all(format_spec(f).te_recipe(precision) is not None
                      for f in low_precision_formats(precision))
    return ("te", "emulated") if te_runs_all else ("emulated",)


def probe_device(cfg, activation_dtype: str = "bf16", hardware=None):
    """The run's GPU (`hardware`, model/device.py; default: the device a run would take here)
    and Transformer Engine release for the known-bad table (None on a CPU run). Reads TE's
    version from its package metadata: nothing is imported."""
    import importlib.metadata

    hardware = hardware or probe_hardware()
    if not hardware.cuda:
        return None
    te_version = None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            te_version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    p = cfg.precision
    return DeviceSetting(capability=hardware.cuda_capability,
                         te_version=te_version, formats=tuple(low_precision_formats(p)),
                         rht=p.rht, stochastic_rounding=p.stochastic_rounding,
                         activation_dtype=activation_dtype)


def preflight(cfg, policy, backends, device=None):
    """The preflight Report of a TrainConfig (nvfp4_recipe/gemm_support.py): every low-precision
    GEMM at parallel.tensor, micro-batch x sequence rows, for each backend in `backends`; the
    same at each candidate tensor size (which layouts are clean); `device` against the known-bad
    table where TE is among the backends. `policy`: the precision policy of cfg.model and
    cfg.precision (training.config.validate's, or model.config.precision_policy's; ValueError
    for one built from other objects; None builds it)."""
    # deferred: model.specs imports megatron (~3 s), and training.config imports this module
    # (through training.plan): a refused start exits before megatron loads
    from model.specs import layout_problems, linear_shapes

    m, par, tr, p = cfg.model, cfg.parallel, cfg.trainer, cfg.precision
    if m.moe is not None:  # the TE spec does not build MoE layers (model/moe.py te_moe_refusal)
        backends = tuple(b for b in backends if b != "te") or ("emulated",)
    formats = {n: f for n, f in policy_for(m, p, policy).linear_formats().items() if f != "bf16"}
    tokens = tr.micro_batch_size * tr.seq_length

    def checks_at(tensor: int, backend: str):
        shapes = linear_shapes(m, tensor)
        linears = [Linear(name, fmt, shapes[suffix]["in"], shapes[suffix]["out"],
                          shapes[suffix]["parallel"])
                   for name, fmt in formats.items() for suffix in [name.split(".", 2)[2]]]
        setting = Setting(backend=backend, tokens=tokens, tensor=tensor,
                          sequence_parallel=par.sequence, rht=p.rht,
                          capability=device.capability if device else None,
                          te_version=device.te_version if device else None)
        return check_linears(linears, setting)

    report = Report(tensor=par.tensor, tokens=tokens, sequence_parallel=par.sequence,
                    layout_problems=layout_problems(m, par.tensor))
    if not report.layout_problems:
        report.checks = [c for b in backends for c in checks_at(par.tensor, b)]
    for t in sorted({*CANDIDATE_TENSOR_SIZES, par.tensor}):
        problems = layout_problems(m, t)
        if problems:
            report.layouts[t] = {b: {"verdict": "fail", "linears": {}, "layout": problems}
                                 for b in backends}
        else:
            per_backend = layout_verdicts([c for b in backends for c in checks_at(t, b)])
            report.layouts[t] = {b: per_backend.get(b, {"verdict": "ok", "linears": {}})
                                 for b in backends}
    if device is not None and "te" in backends:
        cap = device.capability
        report.device = {"capability": list(cap) if cap else None,
                         "te_version": device.te_version,
                         "describe": (f"compute capability {cap[0]}.{cap[1]}" if cap else
                                      "no GPU") + f", transformer_engine {device.te_version}"}
        report.device_hits = known_bad_hits(device)
    return report


def run_preflight(cfg, policy, backend: str, hardware, activation_dtype: str = "bf16"):
    """The start-up preflight of a run with `policy` (its precision policy, as `preflight`) on
    `backend` ("te" | "emulated") and `hardware` (the run's, model/device.py); the device is
    checked only for TE. Its `refusal()` stops the run before anything is written (exit 2)."""
    device = probe_device(cfg, activation_dtype, hardware) if backend == "te" else None
    return preflight(cfg, policy, (backend,), device)
