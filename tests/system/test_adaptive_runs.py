"""precision.adaptive in train.py runs, with an outlier channel planted on one linear
(tests/outlier_injection.py): the fallback moves exactly that linear, a resumed run decides as the
uninterrupted one (losses, grad norms, telemetry and events bit for bit), and the plan and the
serving export show the map the run ended with."""

from __future__ import annotations

import json
import math

import pytest

from train_helpers import FAST, REPO, rewound_copy, run_train
from training.metrics import read_metrics
from training.precision import (FALLBACK_EVENT, checkpoint_precision_map, parse_underflow_key,
                                resume_precision_map)

PLANTED = "layers.2.mixer.in_proj"
# 1e6 on one input channel: every other 16-block of that linear's activation needs an E4M3 scale
# under 2**-9 (448 x ~4 / 1e6), so ~15 of 16 blocks underflow, while the linears downstream
# see no single dominant channel (tests/nvfp4_recipe/test_telemetry.py has the mechanism).
OUTLIER = {"OUTLIER_LINEAR": PLANTED, "OUTLIER_VALUE": "1e6"}
SCRIPT = REPO / "tests" / "outlier_injection.py"
# Telemetry at every step; a forward pass falls back after 3 windows with more than half of its
# operands' blocks underflowing: the decision comes at step 3, after the step-2 checkpoint.
ADAPTIVE = [*FAST, "precision=nvfp4", "trainer.max_steps=4", "trainer.save_every=2",
            "trainer.eval_every=100", "precision.telemetry.every=1",
            "precision.adaptive.enabled=true", "precision.adaptive.patience=3",
            "precision.adaptive.passes=forward", "precision.adaptive.thresholds.flush=null",
            "precision.adaptive.thresholds.scale_underflow=0.5"]


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, data_cache):
    run_dir = tmp_path_factory.mktemp("adaptive") / "planted"
    proc = run_train(run_dir, *ADAPTIVE, cache_dir=data_cache, env=OUTLIER, script=SCRIPT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    return run_dir, log


def fallbacks(run_dir) -> list[dict]:
    return [e for e in read_metrics(run_dir, "event") if e["event"] == FALLBACK_EVENT]


def steps(run_dir) -> dict[int, dict]:
    """step -> its last record (a resumed run logs its steps again)."""
    return {r["step"]: r for r in read_metrics(run_dir, "step")}


def test_a_planted_outlier_moves_exactly_its_linear(planted_run):
    run_dir, log = planted_run
    events = fallbacks(run_dir)
    assert [{k: v for k, v in e.items() if k != "value"} for e in events] == [{
        "step": 3, "event": FALLBACK_EVENT, "module": PLANTED, "pass": "fprop", "from": "nvfp4",
        "to": "mxfp8", "statistic": "scale_underflow", "threshold": 0.5, "windows": 3}]
    assert events[0]["value"] > 0.5
    assert f"event: {FALLBACK_EVENT} at step 3 module={PLANTED} pass=fprop" in log
    records = steps(run_dir)
    for step in (1, 2, 3):  # the windows that decided: only the planted linear above 0.5
        above = {parse_underflow_key(k)[0] for k, v in records[step].items()
                 if k.endswith("/fprop/x/scale_underflow") and v > 0.5}
        assert above == {PLANTED}, (step, above)
    # from step 4 its Fprop runs MXFP8, whose E8M0 block scales reach 2**-127: nothing underflows
    assert records[4][f"underflow/{PLANTED}/fprop/x/scale_underflow"] == 0.0
    # its Dgrad and Wgrad stay NVFP4 and are still measured (passes=forward moves Fprop only)
    assert f"underflow/{PLANTED}/wgrad/x/flush" in records[4]
    assert all(math.isfinite(records[s]["loss"]) for s in records)
    ckpts = run_dir / "checkpoints"
    assert checkpoint_precision_map(ckpts / "step_0000002") == {}
    assert checkpoint_precision_map(ckpts / "step_0000004") == {PLANTED: "mxfp8/nvfp4/nvfp4"}


def test_a_resumed_run_makes_the_same_decisions_at_the_same_steps(planted_run, tmp_path,
                                                                  data_cache):
    """From the step-2 checkpoint (2 of the 3 windows counted): the same decision at step 3, and
    steps 3-4 bit-identical to the uninterrupted run's (JSON keeps a float's exact repr)."""
    run_dir, _ = planted_run
    resumed = rewound_copy(run_dir, tmp_path / "resumed", 2)
    proc = run_train(resumed, *ADAPTIVE, cache_dir=data_cache, env=OUTLIER, script=SCRIPT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert fallbacks(resumed) == fallbacks(run_dir)
    whole, again = steps(run_dir), steps(resumed)
    for step in (3, 4):
        drop = ("tokens_per_sec",)  # wall time
        assert ({k: v for k, v in again[step].items() if k not in drop}
                == {k: v for k, v in whole[step].items() if k not in drop}), step
    ckpt = "checkpoints/step_0000004"
    assert checkpoint_precision_map(resumed / ckpt) == checkpoint_precision_map(run_dir / ckpt)

    # The plan of the run continuing from there shows the map it ended with, as does the
    # serving export (its forward formats)
    assert resume_precision_map(resumed) == {PLANTED: "mxfp8/nvfp4/nvfp4"}
    proc = run_train(resumed, *ADAPTIVE, "run.dry_run=true", cache_dir=data_cache)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    plan = json.loads((resumed / "plan.json").read_text())
    assert plan["precision_map"]["mixer.in_proj"]["mxfp8/nvfp4/nvfp4"] == "2"
    from tools.hf_export import serving_formats
    from training.run_reader import read_run

    formats = serving_formats(read_run(resumed), "nvfp4",
                              checkpoint_precision_map(resumed / ckpt))
    assert formats[PLANTED] == "mxfp8" and formats["layers.5.mixer.in_proj"] == "nvfp4"


def test_ranks_decide_on_statistics_reduced_over_them(tmp_path, data_cache):
    """Two data-parallel ranks, the outlier planted on rank 1 only: rank 0's own telemetry of
    the planted linear is clean, but the logged statistics are every rank's largest, so the
    decision (rank 0 writes the events and the checkpoint) is the one rank 1's data calls for,
    and both ranks train on with it to the end."""
    run_dir = tmp_path / "dp2"
    proc = run_train(run_dir, *FAST, "precision=nvfp4", "trainer.max_steps=3",
                     "trainer.save_every=3", "trainer.eval_every=100",
                     "precision.telemetry.every=1", "precision.adaptive.enabled=true",
                     "precision.adaptive.patience=2", "precision.adaptive.passes=forward",
                     "precision.adaptive.thresholds.flush=null",
                     "precision.adaptive.thresholds.scale_underflow=0.5", nproc=2,
                     cache_dir=data_cache, env={**OUTLIER, "OUTLIER_RANK": "1"}, script=SCRIPT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert [(e["step"], e["module"], e["pass"], e["to"]) for e in fallbacks(run_dir)] == [
        (2, PLANTED, "fprop", "mxfp8")]
    records = steps(run_dir)
    assert records[1][f"underflow/{PLANTED}/fprop/x/scale_underflow"] > 0.5
    assert sorted(records) == [1, 2, 3]
    assert checkpoint_precision_map(run_dir / "checkpoints" / "step_0000003") == {
        PLANTED: "mxfp8/nvfp4/nvfp4"}
