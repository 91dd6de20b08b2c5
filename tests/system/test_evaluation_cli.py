"""Downstream evaluation from the command line (training/downstream.py, tools/evaluate.py):
`python -m tools.evaluate` refuses a task it cannot prepare, both commands refuse a task whose
documents cannot be read before writing, and the in-loop evaluation (killed and resumed, and at
TP=2) logs the scores the command line gives (the in-process checks:
tests/training/test_downstream.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import NETWORK_TASK, task_with_a_malformed_line
from train_helpers import FAST, REPO, patched_train_script, run_train
from training.metrics import read_metrics

pytest.importorskip("lm_eval")

TINY = ["model.hidden_size=64", "model.ffn_hidden_size=128"]


def evaluate_cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "tools.evaluate", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_network_task_is_refused_with_one_line_and_nothing_written(tmp_path):
    yaml = tmp_path / "needs_the_hub.yaml"
    yaml.write_text(NETWORK_TASK)
    out = tmp_path / "results.json"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "ds")}
    proc = evaluate_cli(tmp_path / "no-run", "--tasks", yaml, "--output", out, env=env)
    assert proc.returncode == 3, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert "'needs_the_hub'" in lines[0] and "nvfp4-tests/not-a-cached-dataset" in lines[0]
    assert not out.exists() and not (tmp_path / "no-run").exists()


# the CLI indexes every lm-eval task to know a name is unknown: ~10 s
def test_an_unknown_task_is_exit_2_naming_it(tmp_path):
    proc = evaluate_cli(tmp_path, "--tasks", "demo_no_such_task")
    assert proc.returncode == 2
    assert "'demo_no_such_task'" in proc.stderr.splitlines()[-1]


# two start-ups: ~20 s
def test_both_commands_refuse_a_task_whose_documents_cannot_be_read_before_writing(
        tmp_path, data_cache):
    from errors import ExitCode

    yaml = task_with_a_malformed_line(tmp_path)
    proc = evaluate_cli(tmp_path / "no-run", "--tasks", yaml)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr
    assert "cut_arith.yaml" in [l for l in proc.stderr.splitlines() if l.startswith("error:")][0]
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, *TINY, f"evaluation.tasks=[{yaml}]", cache_dir=data_cache)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not run_dir.exists()


# train.py, killed (SIGKILL to its whole process group: its session, started by the test) as the
# evaluation after step KILL_AT begins.
KILL_DURING_EVAL = """
import os, signal
import training.downstream as downstream

real_run = downstream.DownstreamEvaluator.run

def run(self, step, sink):
    if step == int(os.environ.get("KILL_AT", "0")):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return real_run(self, step, sink)

downstream.DownstreamEvaluator.run = run
"""


def test_in_loop_evaluation_killed_resumes_once_and_matches_the_cli(tmp_path, data_cache):
    script = patched_train_script(tmp_path / "kill_during_eval.py", KILL_DURING_EVAL)
    run_dir = tmp_path / "run"
    args = [*FAST, *TINY, "trainer.max_steps=4", "trainer.save_every=100",
            "trainer.eval_every=100", "evaluation.tasks=[demo_arith_choice]",
            "evaluation.every=2", "evaluation.limit=4", "evaluation.batch_size=4"]
    env = {**os.environ, "NVFP4_CACHE": str(data_cache), "PYTHONUNBUFFERED": "1",
           "KILL_AT": "2"}
    killed = subprocess.Popen([sys.executable, str(script), f"run.dir={run_dir}", *args],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    assert killed.wait(timeout=600) == -9
    # The evaluation's step was checkpointed first, with the evaluation pending in it.
    assert (run_dir / "checkpoints" / "step_0000002").is_dir()
    resumed = run_train(run_dir, *args, cache_dir=data_cache, script=script)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = read_metrics(run_dir, kind="step")
    trained = [r["step"] for r in records if "loss" in r]
    evaluated = [r["step"] for r in records if "eval/demo_arith_choice/acc" in r]
    assert trained == [1, 2, 3, 4]  # no step trained twice, none lost
    assert evaluated == [2, 4]
    last = next(r for r in records if r["step"] == 4 and "eval/demo_arith_choice/acc" in r)
    assert "eval/demo_arith_choice/acc_stderr" in last and last["eval/seconds"] > 0

    # The shipped task on the finished run's checkpoint, from the command line: the same
    # model and requests as the in-loop evaluation after step 4, so the same scores.
    out = tmp_path / "results.json"
    proc = evaluate_cli(run_dir, "--tasks", "demo_arith_choice", "--limit", 4, "--output", out,
                        env={"NVFP4_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stderr
    assert "demo_arith_choice" in proc.stdout and "|acc" in proc.stdout.replace(" ", "")
    result = json.loads(out.read_text())
    assert result["step"] == 4
    assert result["metrics"]["eval/demo_arith_choice/acc"] == last["eval/demo_arith_choice/acc"]
    assert result["metrics"]["eval/demo_arith_choice/acc_norm"] == pytest.approx(
        last["eval/demo_arith_choice/acc_norm"])


def test_in_loop_evaluation_at_tp2_logs_the_scores_the_cli_gives(tmp_path, data_cache):
    # Every process runs lm-eval; only the first gets its results (the others None), and rank 0
    # logs them. The command line at the same layout and batch size gives the same scores.
    run_dir = tmp_path / "run"
    args = [*FAST, *TINY, "parallel.tensor=2", "trainer.max_steps=2", "trainer.save_every=2",
            "trainer.eval_every=100", "evaluation.tasks=[demo_arith_choice]",
            "evaluation.every=2", "evaluation.limit=8", "evaluation.batch_size=8"]
    proc = run_train(run_dir, *args, nproc=2, cache_dir=data_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logged = [r for r in read_metrics(run_dir, kind="step") if "eval/demo_arith_choice/acc" in r]
    assert [r["step"] for r in logged] == [2]
    out = tmp_path / "results.json"
    cli = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "tools.evaluate", str(run_dir),
                          "--tasks", "demo_arith_choice", "--limit", "8", "--batch-size", "8",
                          "--tensor", "2", "--output", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "NVFP4_CACHE": str(data_cache)})
    assert cli.returncode == 0, cli.stdout + cli.stderr
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["eval/demo_arith_choice/acc"] == logged[0]["eval/demo_arith_choice/acc"]
    assert metrics["eval/demo_arith_choice/acc_norm"] == pytest.approx(
        logged[0]["eval/demo_arith_choice/acc_norm"])
