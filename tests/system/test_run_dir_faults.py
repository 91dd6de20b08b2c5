"""train.py and its run directory, from the command line: one trainer at a time, each start-up
fault's one line and exit code before anything is written, Ctrl-C and SIGTERM, a full disk, and
files that are never turned on other files (the in-process checks: tests/training/test_run_dir.py
and tests/training/test_run_dir_files.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import victim_file
from train_helpers import (FAST, REPO, SIX_STEPS, patched_train_script, popen_train, run_train,
                           wait_for_step)
from training.metrics import read_metrics

from training.checkpoint import verify_checkpoint


LOCK_NAME = ".lock"  # training/run_dir.py (imported in the tests that use it)
TINY = [*FAST, "model.hidden_size=64", "model.ffn_hidden_size=128"]
TINY_SAVES = [*TINY, "trainer.save_every=2", "trainer.eval_every=100"]


def _one_error_line(out: str) -> str:
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    return errors[0]


# -- the lock between trainers ----------------------------------------------------------------


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
        proc = run_train(run_dir, *FAST, "trainer.max_steps=2", timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 5, out
        line = _one_error_line(out)
        assert "in use by another trainer" in line
        assert f"pid {os.getpid()} on host {socket.gethostname()} (Slurm job 4242)" in line
        # at start-up, not after building the model and data (whose start-up lines never came;
        # a wall-clock bound here failed under load)
        assert not [m for m in ("device:", "model paths:", "parallel: world") if m in out], out
        assert sorted(run_dir.iterdir()) == before  # no config.yaml, train.log, metrics
    finally:
        release_run_dir(run_dir)


def test_two_trainers_on_one_run_dir_never_interleave(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    first = popen_train(run_dir, data_cache, *SIX_STEPS)
    wait_for_step(run_dir, 1, first)
    # Frozen (its lock held) while the second starts: on a fast CPU the first would otherwise
    # finish its 6 steps before the second reached the lock, and the second would resume.
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = run_train(run_dir, *SIX_STEPS, cache_dir=data_cache, timeout=120)  # a duplicate sbatch
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    assert second.returncode == 5, second.stdout + second.stderr
    assert f"pid {first.pid} on host" in second.stdout + second.stderr
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == [1, 2, 3, 4, 5, 6]  # every step once: the second trainer wrote nothing
    # SIGKILL leaves the lock file but no lock: test_faults' SIGKILL test resumes after one.


# -- exit codes of start-up faults, before anything is written ---------------------------------


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


# no_server waits out wandb's own retries (~10 s) by design
@pytest.mark.parametrize("problem", ["no_api_key", "no_server"])
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


# -- SIGINT -----------------------------------------------------------------------------------


def test_first_ctrl_c_checkpoints_and_exits_75(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = popen_train(run_dir, data_cache, *SIX_STEPS, "trainer.save_every=100")
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out
    assert "SIGINT received: finishing this step" in out and "Traceback" not in out
    stopped_at = max(m["step"] for m in read_metrics(run_dir) if "loss" in m)
    assert stopped_at < 6 and (run_dir / "checkpoints" / f"step_{stopped_at:07d}").is_dir()
    resumed = run_train(run_dir, *SIX_STEPS, "trainer.save_every=100", cache_dir=data_cache)
    assert resumed.returncode == 0 and f"at step {stopped_at}" in resumed.stdout


def test_second_ctrl_c_stops_at_once_with_130(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # Long steps (and no checkpoint before the stop) leave time for the second Ctrl-C.
    proc = popen_train(run_dir, data_cache, *SIX_STEPS, "trainer.max_steps=50",
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


# -- files the run must not destroy, and the start-up's refusals of bad input -------------------


def test_train_py_refuses_a_symlinked_lock_with_exit_8_and_one_line(tmp_path):
    victim, before = victim_file(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").symlink_to(victim)
    proc = run_train(run_dir, *TINY, "trainer.max_steps=2", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 8, out
    line = _one_error_line(out)
    assert f"{run_dir / '.lock'}" in line and "symbolic link" in line
    assert victim.read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing else written


def test_an_empty_run_dir_is_refused_before_anything_is_written(tmp_path, data_cache):
    """Started from an empty working directory (run.dir='' would be that directory)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "run.dir=", *TINY,
                           "trainer.max_steps=1"], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                            "NVFP4_CACHE": str(data_cache)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "run.dir=''" in _one_error_line(out)
    assert not list(cwd.iterdir())


def test_an_empty_pattern_is_refused_saying_empty(tmp_path):
    proc = run_train(tmp_path / "run", *TINY, "model.pattern=", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    line = _one_error_line(out)
    assert "model.pattern=''" in line and "empty" in line
    assert not (tmp_path / "run").exists()


def test_a_vocab_smaller_than_the_tokenizers_is_refused_before_run_dir_is_written(
        tmp_path, data_cache):
    proc = run_train(tmp_path / "run", *TINY, "model.vocab_size=1000", cache_dir=data_cache,
                     timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    line = _one_error_line(out)
    assert "model.vocab_size=1000" in line and "4096" in line
    assert not (tmp_path / "run").exists()


# -- train.py to the end: a renamed checkpoint, a full disk, SIGTERM during a save --------------


def test_a_renamed_checkpoint_is_refused_and_nothing_real_is_moved_or_deleted(
        tmp_path, data_cache):
    """A user renames a checkpoint: a finished 4-step run, step_0000004 renamed to step_0000009,
    then the same resume twice. The renamed one is refused, never deleted, and no intact
    checkpoint is moved aside."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *TINY_SAVES, "trainer.max_steps=4", cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = run_dir / "checkpoints"
    (root / "step_0000004").rename(root / "step_0000009")
    renamed = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()
               and "step_0000009" in p.parts}

    proc = run_train(run_dir, *TINY_SAVES, "trainer.max_steps=8", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "step_0000009 is unusable" in log and "step 4" in log
    assert f"resumed from {root / 'step_0000002'} at step 2" in log
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()
            and "step_0000009" in p.parts} == renamed  # refused, not deleted
    valid = sorted(p.name for p in root.glob("step_*") if verify_checkpoint(p) is None)
    assert valid == ["step_0000004", "step_0000006", "step_0000008"]
    # the re-logged steps 3-4 follow a `resume` event that says where the run went back to
    records = read_metrics(run_dir)
    resume = [i for i, r in enumerate(records) if r.get("event") == "resume"]
    assert len(resume) == 1 and records[resume[0]]["step"] == 2
    assert [r["step"] for r in records[resume[0] + 1:] if "loss" in r] == [3, 4, 5, 6, 7, 8]

    again = run_train(run_dir, *TINY_SAVES, "trainer.max_steps=8", cache_dir=data_cache)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log
    assert "run already complete (8/8 steps)" in log
    assert not list(root.glob("abandoned-*"))  # no intact checkpoint moved aside as "unusable"
    assert [r["step"] for r in read_metrics(run_dir, kind="step")] == [1, 2, 3, 4, 3, 4, 5, 6,
                                                                       7, 8]


def test_a_full_disk_during_a_checkpoint_exits_8_with_one_line(tmp_path, data_cache,
                                                                small_tmpfs):
    """run.dir on a tmpfs with room for one checkpoint: the second one fails, the first stays."""
    run_dir = small_tmpfs("24m") / "run"
    proc = run_train(run_dir, *TINY_SAVES, "trainer.max_steps=6", cache_dir=data_cache)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 8, out
    line = _one_error_line(out)
    assert "No space left on device" in line and "step_0000004" in line
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]  # no temporary left
    assert verify_checkpoint(root / "step_0000002") is None
    assert [r["step"] for r in read_metrics(run_dir, kind="step")] == [1, 2, 3, 4]


SIGTERM_IN_SAVE = """
import os, signal
import training.checkpoint as ckpt

save = ckpt.save_checkpoint


def save_with_a_signal(root, step, *args, **kwargs):
    if step == 2:  # SIGTERM arrives while this save is in flight
        os.kill(os.getpid(), signal.SIGTERM)
    return save(root, step, *args, **kwargs)


ckpt.save_checkpoint = save_with_a_signal
"""


def test_sigterm_during_a_checkpoint_save_exits_75_right_after_it(tmp_path, data_cache):
    script = patched_train_script(tmp_path / "sigterm_in_save.py", SIGTERM_IN_SAVE)
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *TINY_SAVES, "trainer.max_steps=6", cache_dir=data_cache, script=script)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, out
    assert "Traceback" not in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_0000002"]
    assert [r["step"] for r in read_metrics(run_dir, kind="step")] == [1, 2]  # not one more
    (event,) = read_metrics(run_dir, kind="event")
    assert event["event"] == "preempted" and event["step"] == 2
