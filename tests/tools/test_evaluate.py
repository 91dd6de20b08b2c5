"""`python -m tools.evaluate`'s own refusals, before any model is built or anything written: its
arguments, and an --output inside the run or through a link. TE's recipe changed by the
environment, on a trained run (as train.py's start-up refuses it): tests/system/test_start_up.py.
Its scores: tests/system/test_evaluation_cli.py (against the in-loop evaluation) and
tests/system/test_eval_independent.py (against lm-eval's HFLM on the export)."""

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
