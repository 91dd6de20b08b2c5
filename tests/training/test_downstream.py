"""Downstream evaluation in-process (training/downstream.py): the task refusals' exit codes, a task
whose documents cannot be read refused when prepared, and the flat metric names. From the command
line (tools.evaluate's refusals, the in-loop evaluation killed and resumed, at TP=2):
tests/system/test_evaluation_cli.py."""

from __future__ import annotations

import pytest

from helpers import NETWORK_TASK, task_with_a_malformed_line

pytest.importorskip("lm_eval")


def test_task_refusals_carry_their_exit_codes(tmp_path, monkeypatch):
    from errors import ExitCode
    from training.downstream import TaskUnavailable, UnknownTask, prepare_tasks

    with pytest.raises(UnknownTask) as unknown:
        prepare_tasks(["demo_no_such_task"])
    assert unknown.value.code == ExitCode.CONFIG
    yaml = tmp_path / "needs_the_hub.yaml"
    yaml.write_text(NETWORK_TASK)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(TaskUnavailable) as offline:
        prepare_tasks([str(yaml)])
    assert offline.value.code == ExitCode.MISSING


def test_a_task_whose_documents_cannot_be_read_is_refused_when_prepared(tmp_path):
    """A malformed JSON line was a traceback at the first in-loop evaluation, and again at every
    resume (a Slurm requeue looped on it): prepare_tasks, which both commands call at start-up,
    reads every document and refuses the task (exit 7)."""
    from errors import ExitCode
    from training.downstream import UnreadableTaskData, prepare_tasks

    with pytest.raises(UnreadableTaskData, match="'.*cut_arith.yaml'.*JSON parse error") as err:
        prepare_tasks([str(task_with_a_malformed_line(tmp_path))])
    assert err.value.code == ExitCode.BAD_INPUT


def test_flat_metrics_name_task_metric_and_stderr():
    from training.downstream import flat_metrics

    results = {"results": {"demo_arith_choice": {"alias": "demo_arith_choice", "acc,none": 0.5,
                                                 "acc_stderr,none": 0.25,
                                                 "bits_per_byte_stderr,none": "N/A"},
                           "gsm8k": {"exact_match,strict-match": 0.1}}}
    assert flat_metrics(results) == {"eval/demo_arith_choice/acc": 0.5,
                                     "eval/demo_arith_choice/acc_stderr": 0.25,
                                     "eval/gsm8k/exact_match/strict-match": 0.1}
