"""Which spec and GEMM backend a run gets (model/backend.py): the pure choice over stated
machines, and the probe with TE and the Mamba kernels faked (none is installed on CPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from model.backend import Machine, select_backend
from model.device import Hardware
from model.build import choose_backend  # where the trainer, plan and bench import it from
from nvfp4_recipe.policy import PrecisionConfig

NVFP4 = PrecisionConfig(name="nvfp4", format="nvfp4")
B200 = Machine(capability=(10, 0), te_recipe=(True, ""), mamba_ssm=True, causal_conv1d=True)
CPU = Machine(capability=None, te_recipe=(False, "no CUDA device"), mamba_ssm=False,
              causal_conv1d=False)


def precision(backend: str = "auto", fmt: str = "nvfp4") -> PrecisionConfig:
    return PrecisionConfig(name=fmt, format=fmt, backend=backend)


def test_te_spec_where_everything_runs():
    choice = select_backend(NVFP4, "auto", B200)
    assert (choice.spec, choice.gemm_backend) == ("te", "te")
    assert choice.reason == ("TE spec: compute capability 10.0; transformer_engine and mamba_ssm "
                             "usable, Mamba mixer: megatron's fused conv1d + SSD scan "
                             "(use_mamba_mem_eff_path, causal_conv1d)")


def test_te_spec_without_causal_conv1d_uses_pytorch_conv():
    """megatron's non-fused mixer (use_mamba_mem_eff_path=False) needs only mamba_ssm."""
    choice = select_backend(NVFP4, "auto", Machine((10, 0), (True, ""), mamba_ssm=True,
                                                   causal_conv1d=False))
    assert (choice.spec, choice.gemm_backend) == ("te", "te")
    assert choice.reason.endswith("Mamba mixer: megatron's non-fused path: mamba_ssm SSD scan, "
                                  "PyTorch conv1d (no causal_conv1d, so no use_mamba_mem_eff_path)")


@pytest.mark.parametrize(
    "machine,reason",
    [(CPU, "portable spec: no CUDA device"),
     # TE without mamba_ssm used to pick the TE spec, whose MambaMixer raises ImportError
     (Machine((10, 0), (True, ""), mamba_ssm=False, causal_conv1d=False),
      "portable spec: mamba_ssm not importable (the TE spec's Mamba mixer needs it); Mamba "
      "mixer: PyTorch SSD scan and norm, PyTorch conv1d"),
     # TE's own verdict on the recipe, given as the reason
     (Machine((9, 0), (False, "FP8 block scaling needs CUDA 12.9 or newer, found 12.4"),
              mamba_ssm=True, causal_conv1d=True),
      "portable spec: FP8 block scaling needs CUDA 12.9 or newer, found 12.4; Mamba mixer: "
      "mamba_ssm SSD scan and gated norm, causal_conv1d")],
)
def test_auto_falls_back_to_the_portable_spec_with_the_reason(machine, reason):
    choice = select_backend(precision("auto", "fp8"), "auto", machine)
    assert (choice.spec, choice.gemm_backend, choice.reason) == ("portable", "emulated", reason)


def test_model_spec_portable_wins_on_blackwell():
    choice = select_backend(NVFP4, "portable", B200)
    assert (choice.spec, choice.gemm_backend) == ("portable", "emulated")
    assert choice.reason == ("portable spec: model.spec=portable; Mamba mixer: mamba_ssm SSD scan "
                             "and gated norm, causal_conv1d")


def test_model_spec_te_where_it_cannot_run_names_the_key_and_why():
    no_mamba = Machine((10, 0), (True, ""), mamba_ssm=False, causal_conv1d=True)
    with pytest.raises(ValueError, match=r"model.spec=te is not available here: mamba_ssm not "
                                         r"importable .*; use model.spec=auto or portable"):
        select_backend(NVFP4, "te", no_mamba)
    assert select_backend(NVFP4, "te", B200).spec == "te"


def test_precision_backend_te_where_it_cannot_run():
    with pytest.raises(ValueError, match="precision.backend=te is not available here: no CUDA "
                                         "device; use precision.backend=auto or emulated"):
        select_backend(precision("te"), "auto", CPU)


@pytest.mark.parametrize("backend,spec", [("te", "portable"), ("emulated", "te")])
def test_contradicting_keys_are_refused(backend, spec):
    with pytest.raises(ValueError, match="contradicts"):
        select_backend(precision(backend), spec, B200)


def test_precision_backend_emulated_is_portable():
    choice = select_backend(precision("emulated"), "auto", B200)
    assert choice.spec == "portable"
    assert choice.reason.startswith("portable spec: precision.backend=emulated;")


# -- the probe, on a faked machine ---------------------------------------------------------------

def _fake_gpu(monkeypatch, capability, *, te_checks, kernels, triton_only=False):
    """A CUDA device of `capability` with a fake TE >= 2.9 answering `te_checks` and the given
    Mamba kernels importable (`triton_only`: mamba_ssm's Triton kernels load, the package does
    not import)."""
    import model.mamba_mixer as mm

    manager = type("FP8GlobalStateManager", (), {
        name: classmethod(lambda cls, _a=answer: _a) for name, answer in te_checks.items()})
    te = types.ModuleType("transformer_engine")
    te.__version__ = "2.9.0"
    quantization = types.ModuleType("transformer_engine.pytorch.quantization")
    quantization.FP8GlobalStateManager = manager
    for name, module in (("transformer_engine", te),
                         ("transformer_engine.pytorch", types.ModuleType("te.pytorch")),
                         ("transformer_engine.pytorch.quantization", quantization)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(mm, "_KERNELS", {name: object() for name in kernels})
    whole = "mamba_chunk_scan_combined" in kernels and not triton_only
    monkeypatch.setattr(mm, "_MAMBA_SSM", (whole, "faked"))
    return Hardware(device_type="cuda", cuda_capability=capability, cpu_isa="AVX512",
                    bf16_gemms_native=True)


def test_choose_backend_on_blackwell_with_te_but_no_mamba_ssm(monkeypatch):
    """TE present, mamba_ssm not: auto once picked TE here and megatron's MambaMixer raised
    ImportError; it takes the portable spec until the Mamba kernels import."""
    gpu = _fake_gpu(monkeypatch, (10, 0), te_checks={"is_nvfp4_available": (True, "")},
                    kernels=())
    backend, reason = choose_backend(NVFP4, "auto", gpu)
    assert backend == "emulated"
    assert reason.startswith("portable spec: mamba_ssm not importable")
    gpu = _fake_gpu(monkeypatch, (10, 0), te_checks={"is_nvfp4_available": (True, "")},
                    kernels=("causal_conv1d_fn", "mamba_chunk_scan_combined", "rmsnorm_fn"))
    assert choose_backend(NVFP4, "auto", gpu)[0] == "te"
    assert choose_backend(NVFP4, "portable", gpu)[0] == "emulated"
    # The same host, a CPU run (parallel.backend=gloo): no TE, no Mamba kernels.
    cpu_run = Hardware(device_type="cpu", cuda_capability=None, cpu_isa="AVX512",
                       bf16_gemms_native=True)
    assert choose_backend(NVFP4, "auto", cpu_run) == ("emulated", "portable spec: no CUDA device")


def test_choose_backend_asks_te_about_fp8_block_scaling(monkeypatch):
    """Hopper with CUDA < 12.9: TE says no, auto falls back with TE's reason."""
    reason = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
    gpu = _fake_gpu(monkeypatch, (9, 0),
                    te_checks={"is_fp8_block_scaling_available": (False, reason)},
                    kernels=("causal_conv1d_fn", "mamba_chunk_scan_combined", "rmsnorm_fn"))
    backend, why = choose_backend(precision("auto", "fp8"), "auto", gpu)
    assert backend == "emulated" and why.startswith(f"portable spec: transformer_engine: {reason}")
    with pytest.raises(ValueError, match="precision.backend=te is not available here"):
        choose_backend(precision("te", "fp8"), "auto", gpu)


def test_build_model_refuses_a_backend_against_model_spec():
    """A caller's backend that model.spec rules out fails before anything is built."""
    from model.build import build_model
    from model.config import ModelConfig

    with pytest.raises(ValueError, match=r"model.spec=portable but backend=te \(the te spec\)"):
        build_model(ModelConfig(spec="portable"), NVFP4, vocab_size=512, backend="te")


def test_mamba_ssm_without_its_cuda_extension_gives_the_portable_mixer_its_triton_kernels(monkeypatch):
    """The MAMBA_SKIP_CUDA_BUILD wheel (no CUDA extension). The TE spec still cannot run (megatron's
    mixer imports the package), but the portable mixer's line says the Triton scan runs."""
    gpu = _fake_gpu(monkeypatch, (10, 0), te_checks={"is_nvfp4_available": (True, "")},
                    kernels=("mamba_chunk_scan_combined", "rmsnorm_fn"), triton_only=True)
    backend, reason = choose_backend(NVFP4, "auto", gpu)
    assert backend == "emulated"
    assert reason == ("portable spec: mamba_ssm not importable (the TE spec's Mamba mixer needs it; "
                      "its Triton kernels load without it, for the portable mixer); Mamba mixer: "
                      "mamba_ssm SSD scan and gated norm, PyTorch conv1d")


@pytest.mark.parametrize("spec,fused_conv1d,expected", [
    ("te", True, True), ("te", False, False), ("portable", True, False), ("portable", False, False)])
def test_mamba_mem_eff_path(spec, fused_conv1d, expected):
    """megatron's fused Mamba path on the TE spec where it can run (needs causal_conv1d)."""
    from model.backend import mamba_mem_eff_path

    assert mamba_mem_eff_path(spec, fused_conv1d) is expected


@pytest.mark.parametrize("wrapped,version,usable", [
    (True, "1.7.0", True),  # mamba-ssm >= 2.2.5 took causal_conv1d.cpp_functions
    (False, "1.4.0", False),  # ... which causal-conv1d < 1.5.1 lacks: mamba left None behind
    (None, "1.4.0", True),  # mamba-ssm <= 2.2.4 calls the 7/10-argument binding itself
    (None, "1.5.0.post8", True),
    (None, "1.5.1", False),  # 8/12 arguments from 1.5.1: a TypeError at the first forward
    (None, "1.7.0", False),
    (None, None, False),  # version unknown: not risked
])
def test_the_fused_conv1d_needs_a_matching_mamba_ssm_and_causal_conv1d(wrapped, version, usable):
    """mamba v2.3.2.post1 ops/triton/ssd_combined.py:21-28 vs v2.2.4 :23, 779, 853, 903; the
    binding: causal-conv1d 1.7.0 csrc/causal_conv1d.cpp:150-157, 261-272."""
    from model.backend import fused_conv1d_usable

    assert fused_conv1d_usable(wrapped, version) is usable


def test_a_mismatched_causal_conv1d_takes_the_non_fused_path_with_it():
    """Both packages import, the fused kernel cannot call this causal_conv1d: the TE spec still
    runs, megatron's non-fused mixer (which calls causal_conv1d_fn, whose API is unchanged)."""
    machine = Machine((10, 0), (True, ""), mamba_ssm=True, causal_conv1d=True, fused_conv1d=False)
    choice = select_backend(NVFP4, "auto", machine)
    assert (choice.spec, choice.gemm_backend) == ("te", "te")
    assert "megatron's non-fused path: mamba_ssm SSD scan, causal_conv1d (this causal_conv1d " \
           "does not fit mamba_ssm's fused kernel" in choice.reason


def test_the_probe_reads_which_causal_conv1d_mamba_ssm_took(monkeypatch):
    """fused_conv1d_probe reads mamba_ssm's own module: the wrappers, None, or the raw binding."""
    import model.mamba_mixer as mm

    ssd = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", ssd)
    monkeypatch.setattr(sys.modules["mamba_ssm.ops.triton"], "ssd_combined", ssd, raising=False)
    ssd.causal_conv1d_fwd_function = None  # >= 2.2.5, without causal_conv1d.cpp_functions
    assert mm.fused_conv1d_probe()[0] is False
    ssd.causal_conv1d_fwd_function = object()
    assert mm.fused_conv1d_probe()[0] is True
    del ssd.causal_conv1d_fwd_function
    ssd.causal_conv1d_cuda = object()  # <= 2.2.4
    assert mm.fused_conv1d_probe()[0] is None
    ssd.causal_conv1d_cuda = None
    assert mm.fused_conv1d_probe()[0] is False
