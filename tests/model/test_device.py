"""The one device decision (model/device.py): a run's device and what it offers, as a value that
every device choice reads; no other module asks "is some GPU present". A run beside a GPU, and the
slow-CPU switch in a fresh interpreter: tests/system/test_device_runs.py."""

from __future__ import annotations

import ast

import pytest
import torch

from model.device import Hardware, probe_hardware
from tests.train_helpers import REPO

ZEN3 = Hardware(device_type="cpu", cuda_capability=None, cpu_isa="AVX2", bf16_gemms_native=False)
ZEN4 = Hardware(device_type="cpu", cuda_capability=None, cpu_isa="AVX512", bf16_gemms_native=True)
H200 = Hardware(device_type="cuda", cuda_capability=(9, 0), cpu_isa="AVX512",
                bf16_gemms_native=True)


def test_each_machine_says_what_its_gemms_compute_in():
    assert ZEN3.describe() == "CPU AVX2, no BF16 instructions"
    assert ZEN3.gemm_compute().describe() == (
        "GEMMs: FP32 on BF16 values: this CPU has no BF16 instructions (AVX2)")
    assert ZEN4.gemm_compute().dtype == torch.bfloat16
    assert ZEN4.gemm_compute("fp32").dtype == torch.float32  # forced, for comparisons
    assert H200.describe() == "CUDA, compute capability 9.0"
    assert H200.gemm_compute().describe() == "GEMMs: BF16: cuda (compute capability 9.0)"
    with pytest.raises(ValueError, match="applies to CPU runs"):
        H200.gemm_compute("fp32")


def test_a_cpu_run_on_a_host_with_a_gpu_is_a_cpu_run():
    """The backend follows the run's device: a gloo run beside a GPU builds the portable spec."""
    from model.backend import choose_backend
    from nvfp4_recipe.policy import PrecisionConfig

    backend, reason = choose_backend(PrecisionConfig(name="nvfp4", format="nvfp4"), "auto", ZEN4)
    assert (backend, reason) == ("emulated", "portable spec: no CUDA device")


def test_this_machine_probes_to_a_cpu_hardware():
    hw = probe_hardware("cpu")
    assert hw.device_type == "cpu" and hw.cuda_capability is None
    assert hw.cpu_isa == torch.backends.cpu.get_cpu_capability()
    assert hw is probe_hardware(torch.device("cpu"))  # probed once


# Modules that may ask torch itself whether a GPU is present: the device decision only.
DEVICE_DECISION = {"model/device.py"}
PACKAGES = ("compat.py", "train.py", "model", "training", "data", "nvfp4_recipe", "benchmarks",
            "launch", "studies")


def test_no_module_outside_the_device_decision_asks_whether_a_gpu_is_present():
    offenders = []
    for entry in PACKAGES:
        path = REPO / entry
        for file in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            rel = str(file.relative_to(REPO))
            for node in ast.walk(ast.parse(file.read_text(), rel)):
                if (isinstance(node, ast.Attribute) and node.attr == "is_available"
                        and ast.unparse(node.value) == "torch.cuda"
                        and rel not in DEVICE_DECISION):
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, ("ask model.device (the run's Hardware, or cuda_present() for a "
                           f"default device) instead: {offenders}")
