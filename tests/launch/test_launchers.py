"""The cluster launchers as far as they run without training: every launch script parses and is
executable, and launch/torchrun.sh exports what megatron's tensor-parallel overlap relies on. The
launchers run for real (torchrun with two ranks, Slurm jobs plain and preempted):
tests/system/test_launch_scripts.py.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from train_helpers import REPO, SLURM_SBATCH, TORCHRUN_SH


def test_launcher_scripts_parse():
    for script in (TORCHRUN_SH, SLURM_SBATCH, REPO / ".ci" / "slurm-up.sh", REPO / ".ci" / "slurm-down.sh"):
        assert os.access(script, os.X_OK), f"{script} is not executable"
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("given,expected", [(None, "1"), ("8", "8")])
def test_torchrun_sh_exports_cuda_device_max_connections(tmp_path, given, expected):
    """What megatron's tensor-parallel overlap relies on (launch/torchrun.sh cites it): 1 unless
    the user set it. PYTHON is a stand-in that prints what the trainers would see."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "CDMC=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    env.update(PYTHON=str(fake), NPROC_PER_NODE="1")
    if given is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = given
    out = subprocess.run(["bash", str(REPO / "launch/torchrun.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"CDMC={expected}", out.stderr
