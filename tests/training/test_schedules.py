"""Pipeline parallelism on CPU/gloo: the pattern split over 2 stages trains like one process."""

from __future__ import annotations

import math

import pytest

from train_helpers import FAST, run_train, step_losses


@pytest.mark.slow
def test_two_pipeline_stages_match_one_process(tmp_path, data_cache):
    args = [*FAST, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=100"]
    single = tmp_path / "single"
    assert run_train(single, *args, cache_dir=data_cache).returncode == 0
    staged = tmp_path / "pp2"
    # The 9-layer demo pattern splits 5 + 4.
    proc = run_train(staged, *args, "parallel.pipeline=2", "parallel.first_stage_layers=5",
                     nproc=2, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one, two = step_losses(single), step_losses(staged)
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    # Same weights, same data, same FP32 residual stream crossing the stage boundary: only the
    # order of gradient-norm partial sums differs (fp32 ulps, then BF16 weight roundings).
    for step in one:
        assert math.isclose(one[step], two[step], abs_tol=1e-3), (step, one[step], two[step])
