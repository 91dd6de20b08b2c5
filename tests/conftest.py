import os
import shutil
import subprocess

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One demo-corpus cache for the whole session (built by the first run that needs it)."""
    return tmp_path_factory.mktemp("nvfp4-cache")


@pytest.fixture(scope="module")
def slurm():
    """The local Slurm of .ci/slurm-up.sh (or any Slurm the environment points at)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        pytest.skip("no Slurm client installed (start one with: eval \"$(.ci/slurm-up.sh)\")")
    if not os.environ.get("SLURM_CONF"):
        pytest.skip("SLURM_CONF is not set (start a local Slurm with: eval \"$(.ci/slurm-up.sh)\")")
    state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
    if state.returncode != 0 or not state.stdout.split():
        pytest.skip(f"Slurm does not answer: {state.stderr.strip() or 'no nodes'}")
