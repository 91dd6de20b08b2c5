"""The one device decision (model/device.py): a run's device and what it offers, as a value that
every device choice reads; no other module asks "is some GPU present"."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

from model.device import Hardware, probe_hardware
from tests.train_helpers import FAST, REPO, patched_train_script, run_train, step_losses

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


def test_the_slow_cpu_reproduction_switch_reads_as_a_cpu_without_bf16():
    """docs/performance.md: ATEN_CPU_CAPABILITY=avx2 + ONEDNN_MAX_CPU_ISA=AVX2 makes torch take a
    Zen 3's paths; the probe must see that machine, whatever this one is."""
    code = ("from model.device import probe_hardware; h = probe_hardware('cpu'); "
            "print(h.cpu_isa, h.bf16_gemms_native, h.gemm_compute().dtype)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["AVX2", "False", "torch.float32"]


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


@pytest.mark.slow
def test_a_gloo_run_on_a_host_that_has_a_gpu_trains_and_checkpoints_on_the_cpu(tmp_path, data_cache):
    """`parallel.backend=gloo` beside a GPU. The host is stated as a value: the device
    decision's "is a GPU present" says yes (and any CUDA call would fail, as there is none), so
    every choice that asked it instead of reading the run's device (RNG seeding, megatron's CPU
    patches, the backend, the Mamba kernels, the checkpoint's RNG state, the GEMM policy) would
    take its CUDA branch and crash this run. (The AST test above keeps torch.cuda.is_available()
    itself out of the project.)"""
    wrapper = patched_train_script(
        tmp_path / "train_beside_a_gpu.py",
        "import model.device\n"
        "model.device.cuda_present = lambda: True  # the host has a GPU; this run does not use it")
    run_dir = tmp_path / "run"
    res = run_train(run_dir, *FAST, "parallel.backend=gloo", "trainer.max_steps=2",
                    "trainer.save_every=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                    cache_dir=data_cache, script=wrapper)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(step_losses(run_dir)) == [1, 2]
    assert (run_dir / "checkpoints" / "step_0000002").is_dir()
    assert f"device: CPU {torch.backends.cpu.get_cpu_capability()}" in res.stdout + res.stderr
