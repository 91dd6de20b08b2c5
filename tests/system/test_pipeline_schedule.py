"""Pipeline parallelism on CPU/gloo: the pattern split over 2 stages trains like one process."""

from __future__ import annotations

import math

from train_helpers import RESUMABLE, TWO_STAGES, step_losses


def test_two_pipeline_stages_match_one_process(shared_runs):
    single, _ = shared_runs.get(*RESUMABLE)
    staged, _ = shared_runs.get(*RESUMABLE, *TWO_STAGES, nproc=2)
    one, two = step_losses(single), step_losses(staged)
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    # Same weights, same data, same FP32 residual stream crossing the stage boundary: only the
    # order of gradient-norm partial sums differs (fp32 ulps, then BF16 weight roundings).
    for step in one:
        assert math.isclose(one[step], two[step], abs_tol=1e-3), (step, one[step], two[step])
