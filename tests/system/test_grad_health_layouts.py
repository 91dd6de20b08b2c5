"""Gradient health over two processes: two pipeline stages report every layer once and name the
layer a NaN began in, and tensor-parallel and sharded gradients report the norms one process
measures (the per-layer checks in one process: tests/training/test_grad_health.py)."""

from __future__ import annotations

import pytest
import torch
from train_helpers import FAST, HEALTH_KEYS, REPO, run_train, train_in_process
from training.metrics import read_metrics


ARGS = [*FAST, "trainer.max_steps=2", "trainer.eval_every=100", "trainer.save_every=100",
        "trainer.grad_health_every=1", "trainer.grad_clip=0", "trainer.on_nan=skip"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_cache) -> dict:
    """Step 1's per-layer gradient health in one process (the trainer's step, in this process):
    the norms every layout must reproduce."""
    run_dir = tmp_path_factory.mktemp("grad-health") / "single"
    # One thread, as torchrun gives each of its ranks (OMP_NUM_THREADS=1): a BF16 GEMM computed
    # in FP32 (CPUs without BF16 instructions) sums in another order with 2 threads, and its
    # BF16-rounded output moves the norms by ~1e-5, which the DP=2 comparison would read.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (step,) = train_in_process(run_dir, data_cache, *ARGS, "trainer.max_steps=1")
    finally:
        torch.set_num_threads(threads)
    assert set(step.health) == HEALTH_KEYS
    return step.health


def _same_health(got: dict, want: dict, rel: float) -> None:
    assert {k for k in got if k.startswith("grad/")} == HEALTH_KEYS  # each layer once
    for key in HEALTH_KEYS:
        assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-12), key


def test_two_pipeline_stages_report_every_layer_once_and_name_the_nan_layer(
        tmp_path, data_cache, one_process):
    """Layer 7 lives on the second stage (5 + 4 layers); rank 0, which logs, learns of it from
    rank 1. Step 1 is clean (per-layer norms as one process measures them), step 2 injects."""
    proc = run_train(tmp_path, *ARGS, "parallel.pipeline=2", "parallel.first_stage_layers=5",
                     nproc=2, cache_dir=data_cache, script=REPO / "tests" / "nan_injection.py",
                     env={"NAN_LAYER": "7", "NAN_AFTER": "2"})  # 2 micro-batches per step
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log  # step 2 skipped
    assert "event: nonfinite at step 2 first_layer=layer_07.mamba" in log
    records = read_metrics(tmp_path)
    _same_health(records[0], one_process, rel=1e-3)  # fp32 summation order only
    (event,) = [m for m in records if m.get("event") == "nonfinite"]
    assert event["step"] == 2 and event["first_layer"] == "layer_07.mamba"
    assert records[-1]["step"] == 2 and records[-1]["skipped_steps"] == 1
    assert records[-1]["grad/layer_07.mamba/nonfinite_frac"] == 1.0
    assert records[-1]["grad/layer_08.mlp/nonfinite_frac"] == 0.0


@pytest.mark.parametrize("layout,rel", [
    ("parallel.tensor=2", 2e-3),  # TP duplicates (norm weights) counted once; BF16 TP GEMMs
    ("trainer.distributed_optimizer=true", 1e-9),  # DP=2: each rank's own reduced shard
])
def test_tensor_parallel_and_sharded_grads_report_the_one_process_norms(
        tmp_path, data_cache, one_process, layout, rel):
    proc = run_train(tmp_path, *ARGS, "trainer.max_steps=1", layout, nproc=2,
                     cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _same_health(read_metrics(tmp_path)[0], one_process, rel)
