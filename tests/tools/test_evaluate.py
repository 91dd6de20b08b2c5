"""`python -m tools.evaluate`'s own refusals, before any model is built or anything written: its
arguments, an --output inside the run or through a link, and TE's recipe changed by the
environment (as train.py's start-up refuses it). Its scores: tests/training/test_downstream.py
(against the in-loop evaluation) and tests/tools/test_eval_independent.py (against lm-eval's
HFLM on the export)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("argv, code, named", [
    (["--tasks", "demo_arith", "--log-samples"], 2, "--log-samples"),
    (["--tasks", "demo_arith", "--tensor", "2"], 2, "--tensor=2"),
    (["--tasks", "demo_arith", "--first-stage-layers", "0"], 2, "--first-stage-layers=0"),
    (["--tasks", " , "], 2, "--tasks"),
])
def test_evaluate_refuses_bad_arguments_with_their_code(tmp_path, argv, code, named):
    from errors import ProjectError
    from tools.evaluate import check_args, parse_args

    with pytest.raises(ProjectError) as refused:  # one process: --tensor 2 cannot fit
        check_args(parse_args([str(tmp_path), *argv]))
    assert refused.value.code == code and named in str(refused.value)


def test_evaluate_never_writes_its_output_into_the_run_or_through_a_link(tmp_path):
    """A typo'd --output must not replace the run's checkpoint manifest or metrics, follow a
    link to a file elsewhere, or replace an existing file unless --overwrite asks."""
    from tools.evaluate import check_args, parse_args
    from training.run_dir import OutputRefused, write_output_file

    run = tmp_path / "run"
    manifest = run / "checkpoints" / "step_0000004" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("manifest")
    (run / "metrics.jsonl").write_text("metrics")
    elsewhere = tmp_path / "precious.json"
    elsewhere.write_text("precious")
    (tmp_path / "link.json").symlink_to(elsewhere)
    (tmp_path / "old.json").write_text("old")
    refused = {"inside the run": (manifest, "run directory"),
               "the run's metrics": (run / "metrics.jsonl", "run directory"),
               "a link": (tmp_path / "link.json", "symbolic link"),
               "an existing file": (tmp_path / "old.json", "--overwrite")}
    for what, (out, named) in refused.items():
        with pytest.raises(OutputRefused, match=named) as caught:
            check_args(parse_args([str(run), "--tasks", "demo_arith", "--output", str(out)]))
        assert caught.value.code == 2, what
    assert manifest.read_text() == "manifest" and elsewhere.read_text() == "precious"
    args = parse_args([str(run), "--tasks", "demo_arith", "--output", str(tmp_path / "old.json"),
                       "--overwrite"])
    check_args(args)  # asked for: accepted
    write_output_file(args.output, "new", overwrite=True)
    assert (tmp_path / "old.json").read_text() == "new"
    with pytest.raises(OutputRefused, match="appeared"):  # created after the check: kept
        write_output_file(tmp_path / "old.json", "newer", overwrite=False)
    assert (tmp_path / "old.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "old.json",
                                                          "precious.json", "run"]


@pytest.mark.slow  # reads the shared four-step run
def test_evaluate_on_te_refuses_a_recipe_changed_by_the_environment(shared_runs, parallel_context,
                                                                    monkeypatch):
    """tools.evaluate builds the same TE model: the same refusal, before any weight loads.
    The backend and the run's formats are stated (the shared run is BF16, on CPU)."""
    from errors import ConfigError
    from train_helpers import RESUMABLE
    from tools import evaluate

    run_dir, _ = shared_runs.get(*RESUMABLE)
    monkeypatch.setenv("NVTE_NVFP4_4OVER6", "all")
    monkeypatch.setattr("model.build.choose_backend", lambda *a, **k: ("te", "stated"))
    monkeypatch.setattr(evaluate, "te_formats", lambda precision: ["nvfp4"])  # load_model's name
    monkeypatch.setattr("model.build.build_model", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ConfigError, match="NVTE_NVFP4_4OVER6='all'"):
        evaluate.load_model(run_dir, None, parallel_context)
