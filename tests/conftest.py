import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One demo-corpus cache for the whole session (built by the first run that needs it)."""
    return tmp_path_factory.mktemp("nvfp4-cache")


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, data_cache):
    """train.py runs that several tests read, each trained once (train_helpers.SharedRuns)."""
    from train_helpers import SharedRuns

    return SharedRuns(tmp_path_factory.mktemp("shared-runs"), data_cache)


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """(cache_dir, DemoCorpus) of the default demo corpus, built once per session."""
    from data.demo import ensure_demo_corpus

    cache = str(tmp_path_factory.mktemp("data-cache"))
    return cache, ensure_demo_corpus(cache)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> str:
    """Path of a small (300-token) byte-level BPE tokenizer.json."""
    from data.tokenizer import train_bpe_tokenizer

    words = ["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"] * 50
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_bpe_tokenizer(words, 300).save(path)
    return path


@pytest.fixture(scope="module")
def parallel_context():
    """The trainer's own one-process set-up (training.distributed): a gloo group of one and
    megatron's parallel state at tensor = pipeline = 1, torn down after the module."""
    from training.distributed import init_distributed, shutdown

    context = init_distributed(1, 1, "gloo")
    yield context
    shutdown()


@pytest.fixture
def make_trainer(tmp_path, data_cache, monkeypatch):
    """make_trainer(*overrides): a one-process Trainer (gloo) on the CPU demo at test size, in
    tmp_path, composed from train.py's recipes as train.py composes them; the process group is
    torn down after the test."""
    from train_helpers import FAST, compose_train
    from training.distributed import init_distributed, shutdown
    from training.trainer import Trainer, prepare_run_dir

    monkeypatch.setenv("NVFP4_CACHE", str(data_cache))

    def make(*overrides: str) -> Trainer:
        cfg = compose_train(*FAST, f"run.dir={tmp_path}", *overrides)
        ctx = init_distributed(1, 1, "gloo")
        prepare_run_dir(cfg, ctx)
        return Trainer(cfg, ctx)

    yield make
    shutdown()


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size (needs root); unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        where = tmp_path / f"tmpfs-{size}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): "
                        f"{proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


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


# -- the tiers' times, printed at the end of every session ------------------------------------
SYSTEM_TIER = "tests/system/"
_SESSION_START = time.monotonic()


def tier_seconds(reports) -> dict[str, float]:
    """Seconds spent in each tier's tests (setup + call + teardown, summed over the tests; under
    pytest-xdist the workers' times add up, so their sum exceeds the session's wall time)."""
    out = {"unit": 0.0, "system": 0.0}
    for report in reports:
        tier = "system" if report.nodeid.startswith(SYSTEM_TIER) else "unit"
        out[tier] += getattr(report, "duration", 0.0) or 0.0
    return out


def pytest_terminal_summary(terminalreporter):
    """One line that docs/performance.md's tier rows are read from: each tier's test time and
    the session's wall time."""
    reports = [r for reports in terminalreporter.stats.values() for r in reports
               if getattr(r, "when", None) in ("setup", "call", "teardown")]
    if not reports:
        return
    seconds = tier_seconds(reports)
    terminalreporter.write_line(
        f"tier times: unit {seconds['unit'] / 60:.1f} min, system {seconds['system'] / 60:.1f} min "
        f"of tests; session {(time.monotonic() - _SESSION_START) / 60:.1f} min wall")
