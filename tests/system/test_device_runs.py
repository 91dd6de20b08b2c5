"""The device decision (model/device.py) seen from processes of their own: a gloo run on a host
that has a GPU trains and checkpoints on the CPU, and the slow-CPU reproduction switch reads as a
CPU without BF16 instructions in a fresh interpreter (the decision as values:
tests/model/test_device.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.train_helpers import FAST, REPO, patched_train_script, run_train, step_losses


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


def test_a_gloo_run_on_a_host_that_has_a_gpu_trains_and_checkpoints_on_the_cpu(tmp_path, data_cache):
    """`parallel.backend=gloo` beside a GPU. The host is stated as a value: the device
    decision's "is a GPU present" says yes (and any CUDA call would fail, as there is none), so
    every choice that asked it instead of reading the run's device (RNG seeding, megatron's CPU
    patches, the backend, the Mamba kernels, the checkpoint's RNG state, the GEMM policy) would
    take its CUDA branch and crash this run. (An AST test in tests/model/test_device.py keeps
    torch.cuda.is_available() itself out of the project.)"""
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
