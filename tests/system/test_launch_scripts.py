"""The launchers, run for real: launch/torchrun.sh with two ranks on this machine, launch/slurm.sbatch
on a local single-node Slurm (.ci/slurm-up.sh) -- a plain run, and a run that is signalled like a
job near its time limit: it checkpoints, exits 75, requeues itself and resumes -- and
launch/gpu_check.sh in its CPU mode: the offline install beside the environment, the parts past
the run's budget skipped, and every part with the resume giving the same losses.

The Slurm tests skip themselves unless `sinfo` is installed, SLURM_CONF is set and the node
answers. What is proven without running them: tests/launch/test_launchers.py,
tests/launch/test_gpu_check.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

from errors import ExitCode
from train_helpers import FAST, REPO, SLURM_SBATCH, TORCHRUN_SH
from training.metrics import read_metrics


def launcher_env(run_dir: Path, cache: Path, **extra: str) -> dict:
    # OMP_NUM_THREADS=1: torchrun sets it only for several ranks per agent; two one-rank agents
    # would otherwise each spin up a thread per core on the CI machine's two cores.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "NVFP4_CACHE": str(cache), "RUN_DIR": str(run_dir), **extra}


def train_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir) if "loss" in m]


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


def test_torchrun_sh_exits_with_train_py_exit_code(tmp_path, data_cache):
    # parallel.tensor=2 on one rank: train.py's "invalid value" exit code 2, not torchrun's 1
    proc = subprocess.run(
        [str(TORCHRUN_SH), *FAST, "parallel.tensor=2"], cwd=tmp_path,
        env=launcher_env(tmp_path / "run", data_cache, NPROC_PER_NODE="1"),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr


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
           f"--output={tmp_path / 'slurm.out'}", *sbatch_args, str(SLURM_SBATCH), *FAST, *overrides]
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


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure wheel, standing in for the wheelhouse's megatron-core & co."""
    path = folder / "gpu_check_probe-1.0-py3-none-any.whl"
    info = "gpu_check_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("gpu_check_probe/__init__.py", "VALUE = 7\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_deps_installs_the_wheelhouse_offline_beside_the_environment(tmp_path):
    wheels, site, out = tmp_path / "wheels", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    _probe_wheel(wheels)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "WHEELS": str(wheels),
           "GPU_CHECK_SITE": str(site), "GPU_CHECK_PARTS": "deps", "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "| deps | ok |" in summary and "| bench | skipped: not in GPU_CHECK_PARTS=deps |" in summary
    assert "Installed offline with --no-deps" in summary and "gpu-check-probe" in summary
    assert (site / "gpu_check_probe" / "__init__.py").exists()  # beside, not inside, the venv
    assert "- ok megatron-core" in summary and "(present)" in summary
    # a second run finds it installed and installs nothing
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "Installed offline" not in (out / "summary.md").read_text()
    # no wheelhouse where WHEELS points: a failed deps row, exit 10
    env["WHEELS"] = str(tmp_path / "nowhere")
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == ExitCode.CHECK_FAILED
    assert f"| deps | FAILED (WHEELS={tmp_path / 'nowhere'} is not a folder" in summary


def test_parts_past_the_runs_budget_are_skipped_with_the_reason(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_NO_INSTALL": "1",
           "GPU_CHECK_SITE": str(tmp_path / "site"), "GPU_CHECK_BUDGET_S": "20"}
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:]  # skipped is not failed
    for name in ("gpu_path", "cuda_tests", "ssd_triton", "warmup", "gpu_sync", "demo_bf16", "resume",
                 "demo_nvfp4", "demo_moe", "bench"):
        assert re.search(rf"^\| {name} \| skipped: needs ~\d+ s, \d+ s of the run's 20 s budget "
                         r"\(GPU_CHECK_BUDGET_S\) left \|", summary, flags=re.M), name
    assert "Planned from the parts' estimates" in summary


def test_cpu_quick_mode_runs_every_part_and_the_resume_gives_the_same_losses(tmp_path, data_cache,
                                                                             monkeypatch):
    """`OUT=... GPU_CHECK_QUICK=1 bash launch/gpu_check.sh` without CUDA: the CUDA parts skip with
    the reason, the warm-up, the demos, the resume (same losses, bitwise on CPU) and the bench pass.
    Then the resume part's own command, resumed with another learning rate, fails at step 4."""
    out = tmp_path / "gpu_check"
    proc = subprocess.run(["bash", "launch/gpu_check.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), "GPU_CHECK_QUICK": "1", "COLUMNS": "200",
                               "PYTHON": sys.executable, "GPU_CHECK_NO_INSTALL": "1",
                               "GPU_CHECK_SITE": str(tmp_path / "site"), "NVFP4_CACHE": str(data_cache)},
                          timeout=600)
    summary = (out / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = re.findall(r"^\| (\w+) \| (.+) \| \d+ s \|$", summary, flags=re.M)
    assert [name for name, _ in rows] == ["deps", "gpu_path", "cuda_tests", "ssd_triton", "warmup", "gpu_sync",
                                          "demo_bf16", "resume", "demo_nvfp4", "demo_moe", "bench"]
    status = dict(rows)
    if torch.cuda.is_available():
        pytest.skip("the CPU-mode rows below are for a machine without CUDA")
    for name in ("gpu_path", "gpu_sync"):
        assert status[name] == "skipped: needs a CUDA device; none visible to torch", name
    assert status["cuda_tests"] == "skipped: needs a CUDA device (none visible to torch)"
    assert status["ssd_triton"].startswith("skipped: needs a CUDA device")
    for name in ("deps", "warmup", "demo_bf16", "resume", "demo_nvfp4", "demo_moe", "bench"):
        assert status[name] == "ok", (name, status[name])
    assert "- ok megatron-core" in summary
    # demo_bf16 ran 2 + 2 steps with a checkpoint at 2; the resume trained steps 3-4 from it, bitwise
    assert re.search(r"- demo_bf16: 4 steps, loss [0-9.]+ -> [0-9.]+", summary)
    assert re.search(r"- resume: ok: steps 3-4 from the step-2 checkpoint: losses 3: [0-9.]+, 4: [0-9.]+, "
                     r"equal to the uninterrupted run's \(largest relative difference 0\.0e\+00; first 1 bitwise\); "
                     r"optimizer state dp_reshardable", summary)
    assert (out / "resume" / "checkpoints" / "step_0000004").is_dir()
    assert "resumed from" in (out / "resume.log").read_text()
    assert "Planned from the parts' estimates" in summary and "- bench: runs (limit" in summary
    assert "MAMBA_DETERMINISTIC=1" in summary
    # what tests/benchmarks/test_bench.py checked of the CPU mode before these parts existed
    for name in ("gpu_check.log", "hardware.json", "bench.json", "bench.md", "cuda_tests.xml", "cuda_tests.log",
                 "ssd_triton.json", "demo_bf16/metrics.jsonl", "demo_nvfp4/metrics.jsonl", "plan.txt"):
        assert (out / name).exists(), name
    assert "NO CUDA DEVICE" in proc.stdout and "No CUDA device was visible" in summary
    assert re.search(r"- demo_nvfp4: 2 steps, loss [0-9.]+ -> [0-9.]+, median tokens/s", summary)
    # the hybrid MoE demo: its steps, its experts' load, its expert-parallel layout
    assert re.search(r"- demo_moe: 2 steps, loss [0-9.]+ -> [0-9.]+, median tokens/s", summary)
    assert re.search(r"  - expert load, last step: busiest expert [0-9.]+x the mean \(worst of 4 MoE "
                     r"layers\)", summary)
    assert "experts: expert 1 x expert tensor 1 x expert data 1" in summary
    assert (out / "demo_moe" / "metrics.jsonl").exists()
    assert summary.count("config: trainer.distributed_optimizer=true, trainer.recompute=full") == 3
    assert summary.count("trainer.checkpoint_layout=dp_reshardable") == 3
    assert summary.count("mixed precision: BF16 weights, FP32 main grads") == 3
    assert "precision nvfp4: emulated GEMMs" in summary and "## bench" in summary
    # the same resume with another learning rate: step 3 (the restored weights' forward) still
    # equal, step 4 not; the command is the one the script ran (its log line), run.dir moved
    from launch.gpu_check_plan import resume_demo

    line = next(l for l in (out / "gpu_check.log").read_text().splitlines() if "== resume (limit" in l)
    train = line.split(" -- ", 1)[1].split()
    bad = tmp_path / "resumed_other_lr"
    train = [f"run.dir={bad}" if a.startswith("run.dir=") else a for a in train] + ["trainer.lr=1.0e-2"]
    monkeypatch.setenv("NVFP4_CACHE", str(data_cache))
    ok, why = resume_demo(out / "demo_bf16", bad, 2, 0.0, 1, train)
    assert not ok and why.startswith("step 4: loss "), why
