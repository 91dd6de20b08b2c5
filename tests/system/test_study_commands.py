"""The studies' commands run as a user runs them: `python -m studies.ablations` on two tiny runs
with the shipped downstream tasks adds their scores to the report, and `python -m
studies.components` trains 4 steps, runs every measurement and writes the report, which
rebuilds from its results alone (the reports from hand-written runs and the measurements on
small tensors: tests/studies/test_ablations.py, tests/studies/test_components.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from train_helpers import REPO

from studies.components import passes


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


# trains 4 steps (captures at 1, 2, 4) and runs every measurement: ~1 min
def test_the_command_writes_the_report(tmp_path, data_cache):
    out = tmp_path / "components"
    env = {**os.environ, "NVFP4_CACHE": str(data_cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "studies.components", "--steps", "4", "--batches", "1",
           "--model-batches", "1", "--sr-steps", "1", "--sr-seeds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    readme = (out / "README.md").read_text()
    for section in ("## Headline", "## 1. Random Hadamard", "## 2. Stochastic rounding",
                    "## 3. 2D", "## 4. BF16 first / last", "## 5. NVFP4 vs MXFP4",
                    "## 6. The recipe variants", "## How it was run"):
        assert section in readme, section
    for png in ("rht.png", "sr.png", "weight2d.png", "layers.png", "formats.png"):
        assert (out / png).stat().st_size > 10_000, png
    res = json.loads((out / "results.json").read_text())
    assert len(res["batches"]) == 3 and len(res["model"]) == 3
    assert res["reference_check"] and all(r["max_abs_diff"] == 0 for r in res["reference_check"])
    # The format table has MXFP8 beside NVFP4 and MXFP4, and MXFP8 runs as a recipe variant.
    assert "| reduction by MXFP8 vs NVFP4 |" in readme and "| `mxfp8` |" in readme
    assert set(res["summary"]["variants"]) == set(passes.VARIANTS)
    formats = res["summary"]["formats"]
    assert all(row["mxfp8"]["mean"] < row["nvfp4"]["mean"] for row in formats.values())
    variants = {v: res["summary"]["variants"][v] for v in passes.VARIANTS}
    assert all(v["grad_err"]["mean"] > 0 for v in variants.values())
    # forward-only ingredients: RHT and SR act on the backward, so the loss is the recipe's
    assert variants["nvfp4_no_rht"]["dloss"]["mean"] == variants["nvfp4"]["dloss"]["mean"]
    # the report rebuilds from results.json alone
    subprocess.run([sys.executable, "-m", "studies.components", "--report-only", "--out", str(out)],
                   cwd=REPO, env=env, check=True, capture_output=True)
    assert (out / "README.md").read_text() == readme
