"""Data parallelism with the distributed optimizer on gloo: same training, half the optimizer
memory per rank, and checkpoints that move between data-parallel sizes."""

from __future__ import annotations

import math
import re

import pytest

from train_helpers import RESUMABLE as ARGS
from train_helpers import rewound_copy, run_train, step_losses
SHARDED = "trainer.distributed_optimizer=true"


def _optimizer_mib(log: str) -> float:
    return float(re.search(r"FP32 master weights \+ Adam ([0-9.]+) MiB", log).group(1))


def test_sharded_optimizer_trains_alike_and_reshards_over_data_parallel(tmp_path, data_cache,
                                                                        shared_runs):
    (dp2, plain_log), (dp2_sharded, sharded_log) = (shared_runs.get(*ARGS, nproc=2),
                                                    shared_runs.get(*ARGS, SHARDED, nproc=2))
    runs = {"dp2": plain_log, "dp2-sharded": sharded_log}
    plain, sharded = step_losses(dp2), step_losses(dp2_sharded)
    # The same sums in another order (reduce-scatter vs all-reduce, the norm's partial sums):
    # FP32 rounding, then BF16 weight roundings of nearly equal masters.
    for step in plain:
        assert math.isclose(plain[step], sharded[step], abs_tol=2e-3), (plain, sharded)
    assert "sharded over 2 data-parallel ranks" in runs["dp2-sharded"]
    ratio = _optimizer_mib(runs["dp2"]) / _optimizer_mib(runs["dp2-sharded"])
    assert ratio == pytest.approx(2.0, rel=1e-3)

    # DP=2 (sharded) -> DP=1: the step-2 checkpoint continues in one process.
    one = tmp_path / "dp1-from-dp2"
    rewound_copy(dp2_sharded, one, 2)
    proc = run_train(one, *ARGS, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step_0000002" in proc.stdout + proc.stderr
    got = step_losses(one)
    for step in (3, 4):  # master weights and moments restored; one process sums in another order
        assert math.isclose(got[step], sharded[step], abs_tol=5e-3), (got, sharded)

    # DP=1 -> DP=2 (sharded): a one-process checkpoint continues on two ranks.
    single, _ = shared_runs.get(*ARGS)
    expected = step_losses(single)
    two = tmp_path / "dp2-from-dp1"
    rewound_copy(single, two, 2)
    proc = run_train(two, *ARGS, SHARDED, nproc=2, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = step_losses(two)
    for step in (3, 4):
        assert math.isclose(got[step], expected[step], abs_tol=5e-3), (got, expected)
