"""The run directory: one trainer at a time, clear refusals, and each start-up fault's exit code."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from train_helpers import FAST, REPO, popen_train, run_train, wait_for_step
from training.metrics import read_metrics

LOCK_NAME = ".lock"  # training/run_dir.py (imported in the tests that use it)

ARGS = [*FAST, "trainer.max_steps=6", "trainer.save_every=2", "trainer.eval_every=100"]






def _one_error_line(out: str) -> str:
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    return errors[0]


# -- the lock -------------------------------------------------------------------------------------


def test_the_lock_is_exclusive_names_its_holder_and_goes_with_its_descriptor(tmp_path):
    from training.run_dir import RunDirBusy, lock_run_dir, release_run_dir

    assert lock_run_dir(tmp_path)
    assert lock_run_dir(tmp_path)  # re-entrant in the holding process
    holder = json.loads((tmp_path / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    probe = ("import sys; from pathlib import Path; from training.run_dir import lock_run_dir\n"
             "try:\n    lock_run_dir(Path(sys.argv[1]))\nexcept Exception as e:\n"
             "    print(type(e).__name__, e); sys.exit(1)\n")
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, env={**os.environ, "SLURM_JOB_ID": ""})
    assert other.returncode == 1 and other.stdout.startswith(RunDirBusy.__name__), other
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in other.stdout
    release_run_dir(tmp_path)
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True)
    assert other.returncode == 0, other


def test_a_second_trainer_on_a_locked_run_dir_refuses_at_once_naming_the_holder(tmp_path):
    """The first trainer's lock (here: this process's, with a Slurm job id) turns the second
    away with exit 5 before it writes anything."""
    from training.run_dir import lock_run_dir, release_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.environ["SLURM_JOB_ID"] = "4242"
    try:
        assert lock_run_dir(run_dir)
    finally:
        del os.environ["SLURM_JOB_ID"]
    try:
        before = sorted(run_dir.iterdir())
        start = time.time()
        proc = run_train(run_dir, *FAST, "trainer.max_steps=2", timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 5, out
        line = _one_error_line(out)
        assert "in use by another trainer" in line
        assert f"pid {os.getpid()} on host {socket.gethostname()} (Slurm job 4242)" in line
        assert time.time() - start < 60  # at start-up, not after building the model and data
        assert sorted(run_dir.iterdir()) == before  # no config.yaml, train.log, metrics
    finally:
        release_run_dir(run_dir)


@pytest.mark.slow
def test_two_trainers_on_one_run_dir_never_interleave(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    first = popen_train(run_dir, data_cache, *ARGS)
    wait_for_step(run_dir, 1, first)
    # Frozen (its lock held) while the second starts: on a fast CPU the first would otherwise
    # finish its 6 steps before the second reached the lock, and the second would resume.
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = run_train(run_dir, *ARGS, cache_dir=data_cache, timeout=120)  # a duplicate sbatch
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert second.returncode == 5, second.stdout + second.stderr
    assert f"pid {first.pid} on host" in second.stdout + second.stderr
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6]  # every step once: the second trainer wrote nothing
    # SIGKILL leaves the lock file but no lock: test_faults' SIGKILL test resumes after one.


def test_checkpoint_temporaries_of_a_dead_writer_are_removed_under_the_lock(tmp_path):
    from training.config import LoggerConfig, RunConfig, TrainConfig
    from training.distributed import ParallelContext
    from training.run_dir import release_run_dir
    from training.trainer import prepare_run_dir

    run_dir = tmp_path / "run"
    stale = run_dir / "checkpoints" / ".tmp-step_0000004-deadhost-12345"
    (stale / "dist").mkdir(parents=True)
    (stale / "dist" / "__0_0.distcp").write_bytes(b"half a checkpoint")
    kept = run_dir / "checkpoints" / "step_0000002"
    kept.mkdir()
    cfg = TrainConfig(run=RunConfig(dir=str(run_dir)), logger=LoggerConfig(mode="disabled"))
    ctx = ParallelContext(1, 0, 1, 1, 1, 0, 0, 0, device=None)
    try:
        prepare_run_dir(cfg, ctx)
        assert not stale.exists() and kept.exists()
    finally:
        release_run_dir(run_dir)


# -- exit codes of start-up faults -------------------------------------------------------------


@pytest.mark.parametrize("where", ["under_a_file", "sysfs"])
def test_an_impossible_or_read_only_run_dir_exits_8_with_one_line(tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "a_file").write_text("not a directory")
        run_dir = tmp_path / "a_file" / "run"
    else:
        if not Path("/sys/kernel").is_dir():
            pytest.skip("no sysfs")
        run_dir = Path("/sys/kernel/nvfp4-run")  # sysfs: mkdir is refused, even to root
    proc = run_train(run_dir, *FAST, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 8, out
    assert f"run.dir={run_dir} cannot be written" in _one_error_line(out)


def test_a_missing_tokenizer_is_missing_data_exit_3(tmp_path):
    proc = run_train(tmp_path / "run", *FAST, "data.tokenizer=/no/such/tokenizer.json",
                     timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "data.tokenizer = '/no/such/tokenizer.json': file not found" in _one_error_line(out)
    assert not (tmp_path / "run").exists()


def _no_wandb_credentials(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    home = tmp_path / "home"
    home.mkdir()
    return {**env, "HOME": str(home), "NETRC": str(home / ".netrc"),
            "WANDB_CONFIG_DIR": str(home / "wandb-config"), "PYTHONUNBUFFERED": "1"}


# no_server waits out wandb's own retries (~10 s) by design: slow
@pytest.mark.parametrize("problem", ["no_api_key", pytest.param("no_server", marks=pytest.mark.slow)])
def test_wandb_online_without_a_key_or_a_server_exits_9_at_once(tmp_path, problem):
    env = _no_wandb_credentials(tmp_path)
    if problem == "no_server":  # a key, and nothing listening where the server should be
        env.update(WANDB_API_KEY="0" * 40, WANDB_BASE_URL="http://127.0.0.1:9")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), f"run.dir={run_dir}", *FAST,
                           "logger.mode=online"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9, out
    line = _one_error_line(out)
    assert "logger.mode=online" in line
    assert ("no W&B API key" in line) if problem == "no_api_key" else ("W&B did not" in line)
    # "At once": before the model is built (no wall-clock bound: a loaded CI machine takes a
    # minute to import torch; a hang would hit the subprocess timeout above).
    assert "model paths:" not in out
    assert not run_dir.exists()  # refused before anything was written


def test_only_data_errors_map_to_missing_data(tmp_path, monkeypatch):
    """A FileNotFoundError from anywhere but the data check is not exit 3: in run.dir it is
    exit 8, elsewhere it propagates (a bug, with its traceback)."""
    from hydra import compose, initialize_config_dir
    from training import entry, trainer
    from training.config import register_configs

    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=[*FAST, f"run.dir={tmp_path / 'run'}"])

    def failing_trainer(path):
        class Failing:
            def __init__(self, *args, **kwargs):
                raise FileNotFoundError(2, "No such file or directory", str(path))
        return Failing

    monkeypatch.setattr(trainer, "Trainer", failing_trainer(tmp_path / "elsewhere" / "x"))
    with pytest.raises(FileNotFoundError):
        entry.run(raw)
    monkeypatch.setattr(trainer, "Trainer", failing_trainer(tmp_path / "run" / "checkpoints"))
    assert entry.run(raw) == entry.ExitCode.UNWRITABLE


# -- SIGINT -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_first_ctrl_c_checkpoints_and_exits_75(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = popen_train(run_dir, data_cache, *ARGS, "trainer.save_every=100")
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out
    assert "SIGINT received: finishing this step" in out and "Traceback" not in out
    stopped_at = max(m["step"] for m in read_metrics(run_dir) if "loss" in m)
    assert stopped_at < 6 and (run_dir / "checkpoints" / f"step_{stopped_at:07d}").is_dir()
    resumed = run_train(run_dir, *ARGS, "trainer.save_every=100", cache_dir=data_cache)
    assert resumed.returncode == 0 and f"at step {stopped_at}" in resumed.stdout


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once_with_130(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # Long steps (and no checkpoint before the stop) leave time for the second Ctrl-C.
    proc = popen_train(run_dir, data_cache, *ARGS, "trainer.max_steps=50",
                        "trainer.save_every=100", "trainer.seq_length=256",
                        "trainer.global_batch_size=8")
    lines: list[str] = []
    first_seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "SIGINT received" in line:
                first_seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for_step(run_dir, 1, proc)
    proc.send_signal(signal.SIGINT)
    assert first_seen.wait(60), "".join(lines)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 130, out
    assert "interrupted (a second SIGINT): stopped at once" in _one_error_line(out)
    assert not (run_dir / "checkpoints").exists() or not any(
        (run_dir / "checkpoints").glob("step_*"))
