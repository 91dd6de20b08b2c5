"""Pipeline parallelism on CPU/gloo: the pattern split over 2 stages trains like one process, and
step 1's loss and gradient norm agree across micro-batch counts and pipeline stages (the loss
contract through megatron's own code: tests/training/test_loss_contract.py)."""

from __future__ import annotations

import math

from train_helpers import FAST, RESUMABLE, TWO_STAGES, run_train, step_losses, train_in_process
from training.metrics import read_metrics


def test_two_pipeline_stages_match_one_process(shared_runs):
    single, _ = shared_runs.get(*RESUMABLE)
    staged, _ = shared_runs.get(*RESUMABLE, *TWO_STAGES, nproc=2)
    one, two = step_losses(single), step_losses(staged)
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    # Same weights, same data, same FP32 residual stream crossing the stage boundary: only the
    # order of gradient-norm partial sums differs (fp32 ulps, then BF16 weight roundings).
    for step in one:
        assert math.isclose(one[step], two[step], abs_tol=1e-3), (step, one[step], two[step])


def test_gradients_agree_across_micro_batches_and_pipeline_stages(tmp_path, data_cache,
                                                                    shared_runs):
    """Step 1's loss and grad norm (same weights, same 4 samples) for n = 1, 2, 4 micro-batches
    in one process and through the 2-stage GPipe schedule (train.py on two processes). A gradient
    scaled by 1/n or 1/n^2 would move the norm by 2x or more; BF16 GEMMs over other micro-batch
    shapes differ by ~1e-3 relative. Step 1 is before any update: how many steps a run has and
    when it saves do not change it, so n = 2 at two stages is the shared RESUMABLE run's."""
    base = [*FAST, "trainer.max_steps=1", "trainer.eval_every=100", "trainer.save_every=100",
            "trainer.global_batch_size=4", "precision=bf16"]
    runs = {}
    for micro in (4, 2, 1):
        (step,) = train_in_process(tmp_path / f"mb{micro}-pp1", data_cache, *base,
                                   f"trainer.micro_batch_size={micro}")
        runs[(4 // micro, 1)] = (step.loss, step.grad_norm)
        if micro == 2:  # the fast trainer's own: global batch 4 of micro-batches of 2, BF16
            run_dir, _ = shared_runs.get(*RESUMABLE, *TWO_STAGES, nproc=2)
        else:
            run_dir = tmp_path / f"mb{micro}-pp2"
            proc = run_train(run_dir, *base, f"trainer.micro_batch_size={micro}", *TWO_STAGES,
                             nproc=2, cache_dir=data_cache)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        first = next(m for m in read_metrics(run_dir) if "loss" in m)
        assert first["step"] == 1
        runs[(4 // micro, 2)] = (first["loss"], first["grad_norm"])
    ref_loss, ref_norm = runs[(1, 1)]
    for key, (loss, norm) in runs.items():
        assert math.isclose(loss, ref_loss, rel_tol=2e-3), (key, runs)
        assert math.isclose(norm, ref_norm, rel_tol=2e-2), (key, runs)
