"""Fixtures of the study tests: run directories shaped as train.py writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TOKENS_PER_STEP = 8 * 128  # recipes/experiment/ablations.yaml: 8 sequences x 128 tokens


def write_run(run_dir: Path, steps: int, final_loss: float, *, exit_code: int = 0,
              stop_at: int | None = None, downstream: dict[str, float] | None = None,
              eval_every: int = 2) -> None:
    """One finished (or stopped) ablation run: config.yaml, metrics.jsonl, ablation.json.

    The training loss falls linearly to `final_loss` at `steps`; the validation loss is the
    training loss + 0.1 every `eval_every` steps; `downstream` ({"eval/<task>/<metric>": v})
    follows the last step's record, as the trainer's in-loop evaluation logs it.
    """
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"trainer:\n  max_steps: {steps}\nevaluation:\n  tasks: "
        f"{sorted({k.split('/')[1] for k in downstream}) if downstream else []}\n")
    last = stop_at or steps
    lines = []
    for step in range(1, last + 1):
        loss = final_loss + 0.5 * (steps - step) / steps
        rec = {"step": step, "consumed_tokens": step * TOKENS_PER_STEP, "loss": loss,
               "tokens_per_sec": 1000.0 + step}
        if step % eval_every == 0 or step == steps:
            rec["val_loss"] = loss + 0.1
        lines.append(json.dumps(rec))
        if step == steps and downstream:  # the trainer logs the scores as a record of their own
            lines.append(json.dumps({"step": step, **downstream, "eval/seconds": 1.5}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "ablation.json").write_text(json.dumps(
        {"exit_code": exit_code, "wall_s": 10.0, "last_step": last, "steps": steps}))
    (run_dir / "stdout.log").write_text("error: a message\n" if exit_code in (2, 3) else "")


@pytest.fixture
def fake_ablation_runs(tmp_path):
    """A runs dir of the study at 8 steps: bf16, nvfp4 (seeds 1, 2), fp8 (seed 1), mxfp4
    diverged (exit 4) at step 5, nvfp4_naive failed at start-up (exit 2), study.json."""
    runs = tmp_path / "runs"
    finals = {"bf16": (3.00, 3.02), "nvfp4": (3.06, 3.09), "fp8": (3.01,)}
    for config, losses in finals.items():
        for seed, loss in enumerate(losses, start=1):
            write_run(runs / f"{config}-s{seed}", 8, loss)
    write_run(runs / "mxfp4-s1", 8, 3.5, exit_code=4, stop_at=5)
    (runs / "nvfp4_naive-s1").mkdir()
    (runs / "nvfp4_naive-s1" / "ablation.json").write_text(json.dumps({"exit_code": 2}))
    (runs / "nvfp4_naive-s1" / "stdout.log").write_text("error: precision.x=1 is not a key\n")
    (runs / "study.json").write_text(json.dumps({
        "steps": 8, "overrides": ["experiment=ablations"],
        "plan": ["bf16-s1", "nvfp4-s1", "fp8-s1", "mxfp4-s1", "nvfp4_naive-s1", "bf16-s2",
                 "nvfp4-s2"],
        "sessions": [{"started": "2026-12-01T10:00:00+00:00",
                      "command": "python -m studies.ablations --steps 8", "jobs": 2,
                      "threads_per_job": 1, "finished": "2026-12-01T10:10:00+00:00",
                      "wall_s": 600.0}]}))
    return runs
