"""Faults a cluster job meets: SIGKILL at any moment, torn/corrupt checkpoints, NaN losses, signals."""

from __future__ import annotations

import os
import random
import shutil
import signal

import pytest
from train_helpers import (FAST, RESUMABLE, SIX_STEPS, popen_train, run_train, step_losses,
                           wait_for_step)
from training.metrics import read_metrics
from training.checkpoint import latest_valid_checkpoint, verify_checkpoint
from training.run_dir import LOCK_NAME

# BF16 keeps these fast; the NVFP4 resume test (test_train_e2e) covers the SR RNG state.
ARGS = [*SIX_STEPS, "trainer.keep_last=10"]


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(tmp_path, data_cache,
                                                                  shared_runs):
    reference, _ = shared_runs.get(*SIX_STEPS)  # keep_last does not change what trains
    expected = step_losses(reference)

    killed = tmp_path / "killed"
    kill_after = random.Random(os.getpid()).randint(2, 5)  # any moment, even mid-checkpoint
    proc = popen_train(killed, data_cache, *ARGS)
    wait_for_step(killed, kill_after, proc)
    # The whole process group, as a node failure would: megatron's checkpoint helpers too. The
    # lock file stays but its lock went with the process (test_run_dir): the next run is not
    # refused, and resumes from the newest intact checkpoint (killed during the first one, it
    # has none and starts over).
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (killed / LOCK_NAME).exists()
    intact = latest_valid_checkpoint(killed / "checkpoints")
    proc = run_train(killed, *ARGS, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if intact is not None:
        assert f"resumed from {intact}" in proc.stdout, proc.stdout
    else:
        assert "resumed from" not in proc.stdout, proc.stdout
    # The resumed steps re-log; their losses equal the uninterrupted run's, bit for bit.
    assert step_losses(killed) == expected, f"killed after step {kill_after}"


def test_sigterm_checkpoints_and_exits_75_then_resumes(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = popen_train(run_dir, data_cache, *ARGS, "trainer.save_every=100")
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out
    stopped_at = max(m["step"] for m in read_metrics(run_dir) if "loss" in m)
    assert latest_valid_checkpoint(run_dir / "checkpoints").name == f"step_{stopped_at:07d}"
    assert run_train(run_dir, *ARGS, "trainer.save_every=100",
                     cache_dir=data_cache).returncode == 0
    assert max(step_losses(run_dir)) == 6


def test_corrupt_or_torn_latest_checkpoint_falls_back_to_the_previous(tmp_path, data_cache,
                                                                      shared_runs):
    run_dir = shutil.copytree(shared_runs.get(*RESUMABLE)[0], tmp_path / "run")  # steps 2 and 4
    args = [*ARGS, "trainer.max_steps=4"]
    root = run_dir / "checkpoints"
    assert verify_checkpoint(root / "step_0000004") is None
    shard = root / "step_0000004" / "dist" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    (root / "step_0000006").mkdir()  # a torn write: no manifest
    assert "checksum" in verify_checkpoint(root / "step_0000004")
    assert latest_valid_checkpoint(root).name == "step_0000002"

    proc = run_train(run_dir, *[a for a in args if "max_steps" not in a], "trainer.max_steps=5",
                     cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = proc.stdout + proc.stderr
    assert "step_0000006 is unusable: no manifest" in log
    assert "step_0000004 is unusable" in log and "resumed from" in log
    assert "step_0000002" in log
    # saving step 4 again moved the corrupt one aside instead of deleting it
    (aside,) = root.glob("abandoned-*")
    assert (aside / "step_0000004" / "dist" / "__0_0.distcp").read_bytes() == bytes(data)
    assert verify_checkpoint(root / "step_0000004") is None


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_loss_stops_or_skips_and_never_checkpoints_nan_weights(tmp_path, data_cache, policy):
    run_dir = tmp_path / policy
    # An absurd learning rate without clipping blows the weights up within a few steps.
    proc = run_train(run_dir, *FAST, "trainer.max_steps=6", "trainer.save_every=1",
                     "trainer.eval_every=100", "trainer.lr=1e12", "trainer.grad_clip=0",
                     "trainer.warmup_steps=0", f"trainer.on_nan={policy}",
                     # every step after the first is skipped: let them all be (the limit is
                     # test_checkpoint_safety's)
                     "trainer.max_consecutive_skips=10", cache_dir=data_cache)
    log = proc.stdout + proc.stderr
    metrics = [m for m in read_metrics(run_dir) if "loss" in m]
    if policy == "stop":
        assert proc.returncode == 4, log
        assert "is not finite" in log
    else:
        assert proc.returncode == 0, log
        assert metrics[-1]["skipped_steps"] > 0
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    if policy == "stop":
        # every checkpoint predates the step whose loss was not finite
        assert all(step < len(metrics) + 1 for step in saved)
    nan_weights = "not writing a checkpoint: the weights contain NaN/Inf" in log
    # a skipped step never updates the weights, so they stay finite and checkpoints continue
    assert not nan_weights or policy == "stop"
