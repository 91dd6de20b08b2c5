"""The studies' commands run as a user runs them: `python -m studies.ablations` on two tiny runs
with the shipped downstream tasks adds their scores to the report (the report from hand-written
run directories: tests/studies/test_ablations.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from train_helpers import REPO


# two 2-step train.py runs, each with an lm-eval evaluation: ~1-2 min on 2 cores
def test_the_command_adds_downstream_scores(tmp_path, data_cache):
    runs, out = tmp_path / "runs", tmp_path / "out"
    env = {**os.environ, "NVFP4_CACHE": str(data_cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "studies.ablations", "--configs", "bf16", "nvfp4", "--seeds", "1",
           "--noise-seeds", "--steps", "2", "--runs-dir", str(runs), "--out", str(out),
           "evaluation=demo", "evaluation.tasks=[demo_arith_choice,demo_next_word]",
           "evaluation.limit=4", "evaluation.batch_size=4"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    for config in ("bf16", "nvfp4"):
        scores = res["summary"][config]["downstream"]
        assert set(scores) == {"eval/demo_arith_choice/acc", "eval/demo_arith_choice/acc_norm",
                               "eval/demo_next_word/acc", "eval/demo_next_word/acc_norm"}, scores
        for d in scores.values():  # 4 items each: a score is a multiple of 1/4
            assert d["mean"] * 4 == pytest.approx(round(d["mean"] * 4)) and d["stderr"] is not None
    readme = (out / "README.md").read_text()
    assert "| config | demo_arith_choice acc | demo_arith_choice acc_norm |" in readme
    assert "`evaluation.limit=4`" in readme
    assert res["study"]["extra_overrides"] == cmd[cmd.index("evaluation=demo"):]
    # a second call skips the finished runs (their scores make them done) and rebuilds the report
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "2 already finished" in again.stdout, again.stdout[-2000:]
