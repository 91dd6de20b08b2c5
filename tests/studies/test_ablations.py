"""The precision ablation study (studies/ablations.py): from run directories to the report.

The runs here are written by hand in train.py's layout (tests/studies/conftest.py), so every
number the report shows is known: the final validation loss of a run is its `final_loss` + 0.1,
its training loss falls linearly to `final_loss`. The real command on two tiny runs with the
shipped downstream tasks: tests/system/test_study_commands.py.
"""

from __future__ import annotations

import json
import statistics

import pytest

from conftest import write_run
from errors import ExitCode
from studies import ablations as A

DOWNSTREAM = {"eval/demo_arith/exact_match": 0.25, "eval/demo_arith/exact_match_stderr": 0.05,
              "eval/demo_arith_choice/acc": 0.5, "eval/demo_arith_choice/acc_stderr": 0.1}


def test_collect_reads_each_runs_state_and_final_values(fake_ablation_runs):
    runs = A.collect(fake_ablation_runs)
    assert runs["bf16"][1]["state"] == "done"
    assert runs["bf16"][1]["final_val_loss"] == pytest.approx(3.10)
    # the mean training loss over the last quarter (steps 7, 8) of the linear fall to 3.00
    assert runs["bf16"][1]["late_train_loss"] == pytest.approx(3.0 + 0.5 * (0.5 / 8))
    assert runs["mxfp4"][1]["state"] == "diverged" and runs["mxfp4"][1]["final_val_loss"] is None
    failed = runs["nvfp4_naive"][1]
    assert failed["state"] == "failed" and failed["error"] == "error: precision.x=1 is not a key"
    # validation curve against consumed tokens, every second step
    assert [t for t, _ in runs["bf16"][1]["val_loss"]] == [2048, 4096, 6144, 8192]


def test_summary_gaps_are_seed_matched(fake_ablation_runs):
    summary = A.summarize(A.collect(fake_ablation_runs))
    nvfp4 = summary["nvfp4"]
    want = [100 * (3.16 - 3.10) / 3.10, 100 * (3.19 - 3.12) / 3.12]
    assert nvfp4["paired_gap_pct"] == pytest.approx(want)
    assert nvfp4["final_val_loss_std"] == pytest.approx(statistics.stdev([3.16, 3.19]))
    assert summary["mxfp4"]["diverged_seeds"] == [1]
    assert summary["nvfp4_naive"]["failed"] == {1: "error: precision.x=1 is not a key"}


def test_orderings_judge_against_twice_the_paired_noise(fake_ablation_runs):
    runs = A.collect(fake_ablation_runs)
    summary = A.summarize(runs)
    noise = A.paired_noise(runs, "final_val_loss")
    gaps = [100 * (3.16 - 3.10) / 3.10, 100 * (3.19 - 3.12) / 3.12]
    assert noise == pytest.approx(statistics.stdev(gaps))
    rows = {r["claim"]: r for r in A.check_orderings(runs, summary, {"val": noise, "train": None})}
    trails = rows["NVFP4 trails BF16"]
    assert trails["pairs"] == 2 and trails["diff_val_pct"] == pytest.approx(statistics.fmean(gaps))
    assert trails["verdict_val"] == "reproduces"  # ~2.1 % against 2 x 0.22 %
    assert trails["verdict_train"] == "right sign (no noise estimate)"
    assert rows["MXFP4 trails NVFP4"]["verdict_val"] == "reproduces (diverged)"
    assert rows["removing RHT hurts"]["verdict_val"] == "no data"
    assert A._verdict(-1.0, 0.2) == "reversed" and A._verdict(0.3, 0.2) == "within noise (right sign)"


def test_the_report_states_the_runs(fake_ablation_runs, tmp_path):
    out = tmp_path / "out"
    A.write_report(fake_ablation_runs, out)
    readme = (out / "README.md").read_text()
    assert "| `bf16` | 3.1100 ± 0.0141 | 3.1000 / 3.1200 | 0 (reference) |" in readme
    assert "**+2.09 %** (+1.94, +2.24)" in readme  # nvfp4's mean gap and per-seed gaps
    assert "| `nvfp4_naive` | not run: train.py stopped at start-up — precision.x=1 is not a key" in readme
    assert "8 steps x 8 sequences x 128 tokens = 8,192 tokens per run" in readme
    assert "(2 steps x 1,024 tokens," in readme  # the last quarter of 8 steps
    assert "### Downstream scores" not in readme  # no run evaluated downstream tasks
    # claims whose configs did not both run are left out, and counted; the rebuild command
    # names the study's own directories
    assert "removing RHT hurts" not in readme and "| NVFP4 trails BF16 |" in readme
    assert "more claims compare configs this study did not run" in readme
    assert (f"--report-only --runs-dir {fake_ablation_runs} --out {out}   # this report, "
            f"from {fake_ablation_runs}/") in readme
    assert "python -m studies.ablations --steps 8\n" in readme
    assert "Wall time: 10.0 min over 1 session(s) (2026-12-01T10:00:00Z, 2 job(s) x 1 thread(s)" in readme
    res = json.loads((out / "results.json").read_text())
    assert res["summary"]["fp8"]["seeds"] == [1]
    for png in ("val_loss.png", "train_loss.png"):
        assert (out / png).stat().st_size > 10_000, png


def test_mxfp8_runs_as_an_8_bit_baseline_and_the_report_shows_it(tmp_path):
    """recipes/precision/mxfp8.yaml is a config of the study (every recipe is), labelled and drawn
    as a baseline beside BF16 and FP8; its runs get their row with the seed-matched gap; its
    config on the study's demo passes the start-up preflight (every linear whole 32-blocks)."""
    from model.config import precision_policy
    from train_helpers import compose_train
    from training.preflight import preflight

    assert "mxfp8" in A.CONFIGS and A.CONFIGS[0] == "bf16"
    assert A.LABELS["mxfp8"].startswith("MXFP8") and "mxfp8" in A.BASELINES
    assert "precision=mxfp8" in A.run_overrides("mxfp8", 1, 8, tmp_path / "mxfp8-s1")

    runs = tmp_path / "runs"
    for config, losses in {"bf16": (3.00, 3.02), "mxfp8": (3.01, 3.03)}.items():
        for seed, loss in enumerate(losses, start=1):
            write_run(runs / f"{config}-s{seed}", 8, loss)
    out = tmp_path / "out"
    res = A.write_report(runs, out)
    assert res["summary"]["mxfp8"]["paired_gap_pct"] == pytest.approx(
        [100 * 0.01 / 3.10, 100 * 0.01 / 3.12])
    readme = (out / "README.md").read_text()
    assert "| `mxfp8` | 3.1200 ± 0.0141 | 3.1100 / 3.1300 | **+0.32 %** (+0.32, +0.32) |" in readme

    cfg = compose_train("experiment=ablations", "precision=mxfp8")
    assert cfg.precision.format == "mxfp8"
    report = preflight(cfg, precision_policy(cfg.model, cfg.precision), ("emulated",))
    assert report.verdict == "ok" and {c.format for c in report.checks} == {"mxfp8"}
    assert len(report.checks) == 3 * 2 * cfg.model.num_layers  # every layer, no BF16 ones


def test_downstream_scores_are_columns_per_recipe(tmp_path):
    runs = tmp_path / "runs"
    for seed, shift in ((1, 0.0), (2, 0.1)):
        for config in ("bf16", "nvfp4"):
            scores = {k: v + (0 if k.endswith("_stderr") else shift) for k, v in DOWNSTREAM.items()}
            write_run(runs / f"{config}-s{seed}", 8, 3.0, downstream=scores)
    out = tmp_path / "out"
    res = A.write_report(runs, out)
    arith = res["summary"]["bf16"]["downstream"]["eval/demo_arith/exact_match"]
    assert arith["mean"] == pytest.approx(0.30) and arith["stderr"] == pytest.approx(0.05)
    assert arith["per_seed"] == {1: 0.25, 2: pytest.approx(0.35)}
    readme = (out / "README.md").read_text()
    assert "| config | demo_arith exact_match | demo_arith_choice acc | seeds |" in readme
    assert "| `nvfp4` | 0.3000 ± 0.0500 (0.2500, 0.3500) | 0.5500 ± 0.1000 (0.5000, 0.6000) | 1, 2 |" in readme
    assert "eval/seconds" not in json.dumps(res["summary"])  # a time, not a score


def test_a_run_is_done_only_with_its_final_downstream_scores(tmp_path):
    """A run killed during its last evaluation has val_loss at the final step but no scores: it
    is resumed (partial), or its row would lack them."""
    write_run(tmp_path / "scored", 8, 3.0, downstream=DOWNSTREAM)
    assert A.run_state(tmp_path / "scored", 8) == "done"
    write_run(tmp_path / "killed", 8, 3.0, downstream=DOWNSTREAM)
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "killed" / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert A.run_state(tmp_path / "killed", 8) == "partial"
    write_run(tmp_path / "diverged", 8, 3.0, exit_code=ExitCode.DIVERGED, stop_at=3)
    assert A.run_state(tmp_path / "diverged", 8) == "diverged"
    assert A.run_state(tmp_path / "absent", 8) == "new"


def test_step_records_merge_a_steps_records_and_a_resume_wins(tmp_path):
    write_run(tmp_path / "r", 4, 3.0, downstream=DOWNSTREAM)
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:  # resumed from step 3: logged again
        f.write(json.dumps({"event": "restart", "step": 3}) + "\n")
        f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n")
    records = A.step_records(tmp_path / "r")
    assert sorted(records) == [1, 2, 3, 4]
    assert records[4]["loss"] == 9.0 and records[4]["eval/demo_arith/exact_match"] == 0.25


def test_extra_overrides_go_to_every_run_before_the_studys_own():
    cmd = A.run_overrides("nvfp4", 2, 40, A.REPO / "r", ["evaluation=demo", "evaluation.limit=5"])
    assert cmd[:3] == ["precision=nvfp4", "trainer.seed=2", f"run.dir={A.REPO / 'r'}"]
    assert cmd.index("evaluation=demo") > cmd.index("experiment=ablations")
    assert cmd[-4:] == ["trainer.max_steps=40", "trainer.eval_every=5", "trainer.save_every=10",
                        "run.resume=auto"]


@pytest.mark.parametrize("override,message", [
    ("trainer.seed=3", "the study sets trainer.seed"),
    ("precision.rht=false", "the study sets precision"),
    ("+run.dir=/tmp/x", "the study sets run.dir"),
    ("=3", "is not key=value"),
    ("evaluation demo=x", "is not key=value"),
])
def test_a_bad_override_is_refused_before_anything_is_written(tmp_path, capsys, override, message):
    runs = tmp_path / "runs"
    code = A.main(["--runs-dir", str(runs), "--out", str(tmp_path / "out"), override])
    assert code == ExitCode.CONFIG
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: override ") and message in err and "\n" not in err
    assert not runs.exists() and not (tmp_path / "out").exists()


def test_a_run_dir_of_another_study_is_refused(tmp_path):
    write_run(tmp_path / "bf16-s1", 8, 3.0)
    plan = [("bf16", 1)]
    with pytest.raises(A.ConfigError, match="max_steps=8, not --steps 10"):
        A.check_plan(tmp_path, plan, 10, [])
    with pytest.raises(A.ConfigError, match=r"extra overrides \[\], not \['evaluation=demo'\]"):
        A.check_plan(tmp_path, plan, 8, ["evaluation=demo"])
    A.check_plan(tmp_path, plan, 8, [])  # the same study resumes


def test_the_study_exits_with_the_first_failed_runs_code():
    assert A.failed_exit_code([]) == ExitCode.OK
    assert A.failed_exit_code([3, 2]) == ExitCode.MISSING
    assert A.failed_exit_code([-9]) == ExitCode.BUG  # killed by a signal
    assert A.failed_exit_code([0]) == ExitCode.BUG  # exit 0 without its final step: a bug


def test_a_report_without_runs_is_exit_3(tmp_path, capsys):
    code = A.main(["--report-only", "--runs-dir", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert code == ExitCode.MISSING
    assert "no ablation runs there" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_report_names_the_model_an_override_chose(tmp_path):
    """`model=demo_moe` among the extra overrides: the report states the runs' model from their
    config.yaml (its MoE layers included), not the demo's description."""
    moe = {"num_experts": 8, "topk": 2, "ffn_hidden_size": 256, "score_function": "sigmoid",
           "expert_bias": True, "load_balancing": "seq_aux_loss", "aux_loss_coeff": 1e-4,
           "shared_expert_ffn_hidden_size": 256}
    model = {"name": "demo_moe", "pattern": "MEM*EMEME", "bf16_first_layers": 1,
             "bf16_last_layers": 2, "moe": moe}
    assert A.model_line(model, ["model=demo_moe"]) == (
        "Model `demo_moe` (`MEM*EMEME`; each `E` 8 routed experts of width 256, top-2, sigmoid "
        "scores, expert bias, seq_aux_loss x 0.0001, a shared expert of 256; by default first 1 / "
        "last 2 pattern layers in BF16, as each precision config keeps or replaces them)")
    assert A.model_line(model, ["evaluation=demo"]).startswith("Demo hybrid (`M-M*-M-M-`")
    assert A.model_line(None, ["model=demo_moe"]).startswith("Model as the runs' config.yaml")
    runs = tmp_path / "runs"
    for config in ("bf16", "nvfp4"):
        write_run(runs / f"{config}-s1", 8, 3.0)
        cfg = runs / f"{config}-s1" / "config.yaml"
        cfg.write_text(cfg.read_text() + "model:\n  name: demo_moe\n  pattern: MEM*EMEME\n"
                       "  bf16_first_layers: 1\n  bf16_last_layers: 2\n  moe:\n"
                       + "".join(f"    {k}: {v}\n" for k, v in moe.items()))
    (runs / "study.json").write_text(json.dumps({
        "steps": 8, "overrides": ["experiment=ablations"], "extra_overrides": ["model=demo_moe"],
        "plan": ["bf16-s1", "nvfp4-s1"], "sessions": []}))
    A.write_report(runs, tmp_path / "out")
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "Model `demo_moe` (`MEM*EMEME`; each `E` 8 routed experts" in readme
    assert json.loads((tmp_path / "out" / "results.json").read_text())["model"]["moe"]["topk"] == 2
