"""The cluster launchers, run for real: launch/torchrun.sh with two ranks on this machine, and
launch/slurm.sbatch on a local single-node Slurm (.ci/slurm-up.sh) -- a plain run, and a run that is
signalled like a job near its time limit: it checkpoints, exits 75, requeues itself and resumes.

The Slurm tests skip themselves unless `sinfo` is installed, SLURM_CONF is set and the node answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from train_helpers import FAST, REPO
from training.metrics import read_metrics

TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SBATCH = REPO / "launch" / "slurm.sbatch"


def launcher_env(run_dir: Path, cache: Path, **extra: str) -> dict:
    # OMP_NUM_THREADS=1: torchrun sets it only for several ranks per agent; two one-rank agents
    # would otherwise each spin up a thread per core on the CI machine's two cores.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "NVFP4_CACHE": str(cache), "RUN_DIR": str(run_dir), **extra}


def train_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir) if "loss" in m]


def test_launcher_scripts_parse():
    for script in (TORCHRUN_SH, SBATCH, REPO / ".ci" / "slurm-up.sh", REPO / ".ci" / "slurm-down.sh"):
        assert os.access(script, os.X_OK), f"{script} is not executable"
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_torchrun_sh_trains_data_parallel_into_one_run_dir(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(TORCHRUN_SH), *FAST, "trainer.max_steps=3", "trainer.eval_every=3"],
        cwd=tmp_path, env=launcher_env(run_dir, data_cache, NPROC_PER_NODE="2"),
        capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "data 2" in out  # world 2 = tensor 1 x pipeline 1 x data 2
    assert train_steps(run_dir) == [1, 2, 3]  # one metrics.jsonl, each step once (rank 0)
    assert [p.parent for p in tmp_path.rglob("metrics.jsonl")] == [run_dir]
    assert (run_dir / "checkpoints" / "step_0000003").is_dir()
    # both ranks ran, their own output in run_dir/logs; only rank 0 on the console
    assert sorted(p.name for p in run_dir.glob("logs/*/attempt_0/*")) == ["0", "1"]
    assert "[default1]" not in out


@pytest.mark.slow
def test_torchrun_sh_exits_with_train_py_exit_code(tmp_path, data_cache):
    # parallel.tensor=2 on one rank: train.py's "invalid value" exit code 2, not torchrun's 1
    proc = subprocess.run(
        [str(TORCHRUN_SH), *FAST, "parallel.tensor=2"], cwd=tmp_path,
        env=launcher_env(tmp_path / "run", data_cache, NPROC_PER_NODE="1"),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr


@pytest.mark.slow
def test_torchrun_sh_ctrl_c_checkpoints_and_exits_75(tmp_path, data_cache):
    """A Ctrl-C at the launcher reaches every trainer once: finish the step, checkpoint, exit 75."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(TORCHRUN_SH), *FAST, "trainer.max_steps=50", "trainer.save_every=100",
         "trainer.eval_every=100"], cwd=tmp_path,
        env=launcher_env(run_dir, data_cache, NPROC_PER_NODE="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").exists() and train_steps(run_dir)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out
    stopped_at = train_steps(run_dir)[-1]
    assert stopped_at < 50 and (run_dir / "checkpoints" / f"step_{stopped_at:07d}").is_dir(), out


def submit(tmp_path: Path, data_cache: Path, run_dir: Path, sbatch_args: list[str],
           overrides: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`sbatch --wait launch/slurm.sbatch` from the repository root, as a user submits it."""
    name = f"nvfp4-test-{uuid.uuid4().hex[:8]}"
    cmd = ["sbatch", "--wait", f"--job-name={name}", "--time=10", "--signal=B:USR1@30",
           f"--output={tmp_path / 'slurm.out'}", *sbatch_args, str(SBATCH), *FAST, *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launcher_env(run_dir, data_cache, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, name


def finish(proc: subprocess.Popen, name: str, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--name", name])
        proc.kill()
        pytest.fail(f"sbatch --wait did not return within {timeout} s: {proc.communicate()[0]}")


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_two_tasks_train_data_parallel(slurm, tmp_path, data_cache):
    # two tasks = two torchrun agents meeting at the c10d rendezvous, one rank each: the
    # multi-node path, on one node
    run_dir = tmp_path / "run"
    proc, name = submit(tmp_path, data_cache, run_dir, ["--nodes=1", "--ntasks-per-node=2"],
                        ["trainer.max_steps=3", "trainer.eval_every=3"], {"NPROC_PER_NODE": "1"})
    finish(proc, name, timeout=300)
    log = (tmp_path / "slurm.out").read_text()
    assert proc.returncode == 0, log
    assert "data 2" in log and "rendezvous" in log
    assert train_steps(run_dir) == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_0000003").is_dir()


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_preempted_job_checkpoints_requeues_and_resumes(slurm, tmp_path, data_cache):
    run_dir, max_steps = tmp_path / "run", 12
    # two one-rank agents, as on two nodes: every task must exit 75 for the job to requeue
    proc, name = submit(tmp_path, data_cache, run_dir, ["--nodes=1", "--ntasks-per-node=2"],
                        [f"trainer.max_steps={max_steps}", "trainer.eval_every=100",
                         "trainer.save_every=100"], {"NPROC_PER_NODE": "1"})
    try:
        # Wait for a few steps, then signal the batch script as Slurm does near the time limit
        # (--signal=B:USR1@<grace>).
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and len(train_steps(run_dir)) >= 2:
                break
            time.sleep(0.5)
        job = subprocess.run(["squeue", "-h", "-o", "%i", "--name", name],
                             capture_output=True, text=True).stdout.strip()
        assert job, f"the job is not running: {finish(proc, name, 10)}"
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(r.get("event") == "preempted" for r in read_metrics(run_dir)):
                break
            time.sleep(0.5)
        else:
            if proc.poll() is None:
                pytest.fail("no checkpoint within 120 s of SIGUSR1 (ranks that stop at different "
                            "steps deadlock):\n" + (tmp_path / "slurm.out").read_text()[-3000:])
        finish(proc, name, timeout=240)
    finally:
        if proc.poll() is None:
            subprocess.run(["scancel", "--name", name])
            proc.kill()
    log = (tmp_path / "slurm.out").read_text()
    assert proc.returncode == 0, log
    # the batch script requeued the job and Slurm ran it again ($SLURM_RESTART_COUNT=1)
    assert "requeueing job" in log and "restart 1" in log

    records = read_metrics(run_dir)
    [preempted] = [r for r in records if r.get("event") == "preempted"]
    stop = preempted["step"]
    assert 2 <= stop < max_steps and preempted["signal"] == "SIGUSR1"
    # each step exactly once: the requeued job resumed at the checkpoint, it did not start over
    assert train_steps(run_dir) == list(range(1, max_steps + 1))
    assert records.index(preempted) == stop  # the event follows step `stop`'s record
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stop:07d}'} at step {stop}" in log
    assert (run_dir / "checkpoints" / f"step_{max_steps:07d}").is_dir()


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
