"""launch/prepare.sbatch, the Slurm array of data.prepare shards, parses and is executable. The
array itself on the local Slurm of .ci/slurm-up.sh (a task killed mid-way is redone alone, the
shards hold one process's tokens): tests/system/test_data_prepare_runs.py."""

from __future__ import annotations

import os
import subprocess

from tests.prepare_helpers import SBATCH


def test_prepare_sbatch_parses():
    assert os.access(SBATCH, os.X_OK), f"{SBATCH} is not executable"
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
