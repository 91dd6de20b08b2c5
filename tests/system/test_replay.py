"""tools.replay on real runs of the demo: a logged step replays bit-identically, the
bisect of a planted outlier ranks the planted linear first, refusals come before anything is
written, and trainer.on_anomaly=replay bisects in the loop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train_helpers import FAST, REPO, _fingerprint, run_train
from training.metrics import read_metrics

PLANTED = "layers.2.mixer.in_proj"
OUTLIER_ENV = {"OUTLIER_LINEAR": PLANTED, "OUTLIER_VALUE": "1e4"}
OUTLIER_SCRIPT = REPO / "tests" / "outlier_injection.py"
# Three NVFP4 steps, a checkpoint after each, a validation after step 2. The outlier's effect
# is largest early: the step's update shrinks the weight column the outlier channel multiplies.
PLANTED_RUN = [*FAST, "precision=nvfp4", "trainer.max_steps=3", "trainer.save_every=1",
               "trainer.eval_every=2"]


def replay(*args: str, cache_dir: Path, outlier: bool = True) -> subprocess.CompletedProcess:
    """python -m tools.replay, under the outlier wrapper when the run was trained with it."""
    env = {**os.environ, "NVFP4_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    if outlier:
        env.update(OUTLIER_ENV, OUTLIER_MODULE="tools.replay")
        cmd = [sys.executable, str(OUTLIER_SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "tools.replay", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, data_cache):
    run_dir = tmp_path_factory.mktemp("planted") / "run"
    proc = run_train(run_dir, *PLANTED_RUN, cache_dir=data_cache, env=OUTLIER_ENV,
                     script=OUTLIER_SCRIPT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return run_dir


def logged(run_dir: Path, step: int) -> dict:
    return [r for r in read_metrics(run_dir, "step") if r["step"] == step][-1]


def untouched(run_dir: Path) -> dict:
    """The run's files but the replay's own output."""
    return {k: v for k, v in _fingerprint(run_dir).items() if not k.startswith("replay/")}


def copy_with_checkpoints(run_dir: Path, dst: Path, *steps: int) -> Path:
    """The run's config and metrics with only these checkpoints (a run that kept fewer)."""
    dst.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run_dir / name, dst / name)
    for step in steps:
        name = f"step_{step:07d}"
        shutil.copytree(run_dir / "checkpoints" / name, dst / "checkpoints" / name)
    return dst


def test_logged_step_replays_bit_identically(planted_run, data_cache, tmp_path):
    """Step 3 from step_1: step 2 and the validation after it are replayed as the run ran them."""
    run = copy_with_checkpoints(planted_run, tmp_path / "run", 1)
    before = untouched(run)
    proc = replay(str(run), "--step", "3", cache_dir=data_cache)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    record = json.loads((run / "replay" / "step-3" / "replay.json").read_text())
    assert record["checkpoint"] == "step_0000001"
    assert record["bit_identical"] is True
    # the floats themselves, as metrics.jsonl holds them (JSON keeps every bit of a float)
    for key in ("loss", "grad_norm"):
        assert record["replayed"][key] == logged(run, 3)[key]
    assert [(s["step"], s["bit_identical"]) for s in record["steps_before"]] == [(2, True)]
    assert record["steps_before"][0]["replayed"]["loss"] == logged(run, 2)["loss"]
    assert "step 3: bit-identical to the log" in proc.stdout
    assert untouched(run) == before  # checkpoints, metrics and config as they were


def test_bisect_ranks_the_planted_linear_first(planted_run, data_cache, tmp_path):
    """The outlier on one channel of layers.2.mixer.in_proj's input flushes its 1x16 NVFP4
    block-mates in Fprop: the step's grad norm deviates ~2.4 % from the all-BF16 replay, the
    other 35 quantized GEMMs together ~0.75 % (measured on this demo); a threshold of 1.5 %
    separates them."""
    out = tmp_path / "bisect"
    proc = replay(str(planted_run), "--step", "2", "--bisect", "--grad-norm-threshold", "0.015",
                  "--out", str(out), cache_dir=data_cache)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    record = json.loads((out / "replay.json").read_text())
    found = record["bisect"]
    assert record["bit_identical"] is True  # the bisect's as-logged trial is the logged step
    assert found["anomaly"].startswith("grad_norm deviates")
    assert found["ranking"][0]["module"] == PLANTED
    assert "fprop" in found["ranking"][0]["passes"]
    assert {c["module"] for c in found["culprits"]} == {PLANTED}
    # binary splitting over the 36 quantized GEMMs: far fewer replays than one per GEMM
    assert found["trials_run"] <= 16
    assert PLANTED in proc.stdout and "replays" in proc.stdout


def test_step_without_checkpoint_before_it_is_refused_naming_the_nearest(planted_run, data_cache):
    proc = replay(str(planted_run), "--step", "1", cache_dir=data_cache, outlier=False)
    assert proc.returncode == 6, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --step 1: no intact checkpoint at or before step 0")
    assert "step_0000001 (after)" in line
    assert not (planted_run / "replay" / "step-1").exists()


def test_changed_config_is_refused_listing_the_keys(planted_run, data_cache, tmp_path):
    copy = copy_with_checkpoints(planted_run, tmp_path / "run", 2)
    text = (copy / "config.yaml").read_text()
    assert "  lr: 0.003\n" in text
    (copy / "config.yaml").write_text(text.replace("  lr: 0.003\n", "  lr: 0.001\n"))
    proc = replay(str(copy), "--step", "3", cache_dir=data_cache, outlier=False)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "config changed since step_0000002 was written" in line
    assert "trainer.lr: 0.003 -> 0.001" in line
    assert not (copy / "replay").exists()


def test_on_anomaly_bisects_in_the_loop_checkpoints_and_stops(tmp_path, data_cache):
    """A NaN injected into layer 2's backward from its 3rd forward (step 2): on_anomaly=replay
    bisects the step in process before the (skipped) update, finds the all-BF16 step non-finite
    too (not a precision problem), records it, saves step_2 and stops (exit 4)."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, "precision=nvfp4", "trainer.max_steps=4",
                     "trainer.save_every=100", "trainer.eval_every=100", "trainer.on_nan=skip",
                     "trainer.on_anomaly=replay", "trainer.anomaly_action=stop",
                     cache_dir=data_cache, env={"NAN_LAYER": "2", "NAN_AFTER": "2"},
                     script=REPO / "tests" / "nan_injection.py")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 4, log[-3000:]
    assert "anomaly at step 2: non-finite" in log
    assert "stopped after the anomaly at step 2" in log
    record = json.loads((run_dir / "replay" / "step-2" / "replay.json").read_text())
    assert record["in_process"] is True and record["step"] == 2
    assert record["bisect"]["all_bf16"]["grad_norm"] == "nan"
    assert "all-BF16 replay is non-finite too" in record["bisect"]["note"]
    events = [e for e in read_metrics(run_dir, "event") if e["event"] == "anomaly"]
    assert [(e["step"], e["action"]) for e in events] == [(2, "stop")]
    assert (run_dir / "checkpoints" / "step_0000002").is_dir()
    assert max(r["step"] for r in read_metrics(run_dir, "step")) == 2


def train_planted_in_process(run_dir: Path, cache_dir: Path, *overrides: str,
                             steps: int = 3) -> list[tuple[float, float]]:
    """(loss, grad norm) of `steps` NVFP4 demo steps of a one-process Trainer whose
    layers.2.mixer.in_proj sees the 1e4 outlier, events into run_dir/metrics.jsonl."""
    from outlier_injection import plant_outlier
    from train_helpers import compose_train
    from training.distributed import init_distributed, shutdown
    from training.metrics import MetricsSink
    from training.run_dir import release_run_dir
    from training.trainer import Trainer, prepare_run_dir

    cfg = compose_train(*FAST, "precision=nvfp4", f"trainer.max_steps={steps}", *overrides,
                        f"run.dir={run_dir}", f"data.cache_dir={cache_dir}/data")
    ctx = init_distributed(1, 1, "gloo")
    try:
        prepare_run_dir(cfg, ctx)
        trainer = Trainer(cfg, ctx)
        handle = plant_outlier(trainer.core, PLANTED, channel=0, value=1e4)
        sink = MetricsSink(run_dir, True)
        out = []
        for _ in range(steps):
            result = trainer.train_step(trainer.data.train.next_global_batch(), sink)
            trainer.step += 1
            out.append((result.loss, result.grad_norm))
        handle.remove()
        return out
    finally:
        release_run_dir(run_dir)
        shutdown()


def test_on_anomaly_bisects_in_the_loop_and_continues_as_if_nothing_happened(
        tmp_path, data_cache, monkeypatch):
    """The in-loop bisect of step 2 (its trigger forced) finds the planted linear, and the run
    continues bit for bit as the same run without on_anomaly: the bisect ends with the step as
    it ran, so the update and the RNG after it are the step's own."""
    from training import forensics

    plain = train_planted_in_process(tmp_path / "plain", data_cache)
    seen = []

    def forced(self, loss, grad_norm):  # the z-score trigger, fired at the second step
        seen.append(grad_norm)
        return "forced at step 2" if len(seen) == 2 else None

    monkeypatch.setattr(forensics.AnomalyWatch, "check", forced)
    watched = train_planted_in_process(tmp_path / "watched", data_cache,
                                       "trainer.on_anomaly=replay",
                                       "trainer.anomaly_grad_norm_threshold=0.015")
    assert watched == plain  # every step's loss and grad norm, bit for bit
    record = json.loads((tmp_path / "watched" / "replay" / "step-2" / "replay.json").read_text())
    assert record["trigger"] == "forced at step 2"
    assert record["bisect"]["ranking"][0]["module"] == PLANTED
    assert record["bisect"]["as_logged"]["grad_norm"] == plain[1][1]
    events = [e for e in read_metrics(tmp_path / "watched", "event") if e["event"] == "anomaly"]
    assert [(e["step"], e["culprits"]) for e in events] == [(2, [f"{PLANTED}/fprop"])]
