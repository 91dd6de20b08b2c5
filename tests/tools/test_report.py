"""tools/report.py over a synthesized run directory: the heatmap's matrix is built from the
telemetry keys exactly as logged, and the page shows the figures and each decision."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tools import report

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run:\n  name: synth\nprecision:\n  name: nvfp4\n")
    records = []
    for step in range(1, 7):
        record = {"step": step, "loss": 8.0 - 0.1 * step, "grad_norm": 2.0 + (step == 4)}
        if step % 2 == 0:  # telemetry every 2 steps
            record.update({
                "underflow/layers.2.mixer.in_proj/fprop/x/flush": 0.1 * step,
                "underflow/layers.2.mixer.in_proj/fprop/w/flush": 0.01,
                "underflow/layers.2.mixer.in_proj/wgrad/dy/flush": 0.02,
                "underflow/layers.10.mlp.linear_fc1/fprop/x/flush": 0.001 * step,
                "underflow/layers.2.mixer.in_proj/fprop/x/scale_underflow": 0.0,
                "underflow/layers.2.mixer.in_proj/fprop/x/scale_overflow": 0.0,
                # not telemetry: ignored by the heatmap
                "quant/layers.2.mixer.in_proj/activation/zero_frac": 0.5,
            })
        records.append(record)
        if step == 4:
            records.append({"step": 4, "event": "precision_fallback",
                            "module": "layers.2.mixer.in_proj", "pass": "fprop", "from": "nvfp4",
                            "to": "mxfp8", "statistic": "flush", "value": 0.4,
                            "threshold": 0.2, "windows": 2})
    # a resumed run logs step 6 again: the later record counts
    records.append({"step": 6, "loss": 7.0, "grad_norm": 2.0,
                    "underflow/layers.2.mixer.in_proj/fprop/x/flush": 0.55})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_heatmap_matrix_is_the_logged_fractions_in_model_order(tmp_path):
    _write_run(tmp_path / "run")
    from training.metrics import read_metrics

    steps = report._last_per_step(read_metrics(tmp_path / "run", "step"))
    heat = report.underflow_heatmap(steps, "flush")
    # layer 2 before layer 10 (numeric, not string order); passes fprop, wgrad; operands x, w
    assert heat.rows == ["layers.2.mixer.in_proj/fprop/x", "layers.2.mixer.in_proj/fprop/w",
                         "layers.2.mixer.in_proj/wgrad/dy", "layers.10.mlp.linear_fc1/fprop/x"]
    assert heat.steps == [2, 4, 6]
    assert heat.values[0] == [0.2, 0.4, 0.55]  # step 6: the resumed run's record
    assert heat.values[1][:2] == [0.01, 0.01] and math.isnan(heat.values[1][2])
    assert heat.values[3][:2] == [0.002, 0.004]
    assert report.underflow_heatmap(steps, "scale_underflow").values == [[0.0, 0.0]]


def test_report_writes_html_and_figures_atomically(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run)
    before = {p: p.read_bytes() for p in run.iterdir()}
    assert report.main([str(run)]) == 0
    out = run / "report"
    for name in ("underflow.png", "loss.png", "grad_norm.png"):
        assert (out / name).read_bytes().startswith(PNG), name
    # scale_underflow / scale_overflow are all zero: no heatmap of their own
    assert not (out / "underflow_scale_underflow.png").exists()
    page = (out / "index.html").read_text()
    assert '<img src="underflow.png"' in page
    assert "highest: 0.55 at layers.2.mixer.in_proj/fprop/x, step 6" in page
    assert "<td>precision_fallback</td>" in page and "to=mxfp8" in page
    assert {p: p.read_bytes() for p in run.iterdir() if p.name != "report"} == before
    assert "Replays" not in page
    # a second report replaces the first whole; no temporaries are left beside it
    (out / "stale.txt").write_text("old")
    assert report.main([str(run), "--out", str(out)]) == 0
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl", "report"]


def test_report_lists_the_replays_and_their_bisects(tmp_path):
    """replay.json files under RUN/replay/ (tools.replay's and on_anomaly's) are summarised."""
    run = tmp_path / "run"
    _write_run(run)
    for step, record in (
            (4, {"step": 4, "checkpoint": "step_0000003", "bit_identical": True,
                 "logged": {"loss": 7.6}, "bisect": {
                     "anomaly": "grad_norm deviates 0.0235 (threshold 0.015)", "trials_run": 9,
                     "note": "", "ranking": [{"rank": 1, "module": "layers.2.mixer.in_proj",
                                              "passes": ["fprop"], "severity_alone": 1.63,
                                              "severity_without": 0.0}]}}),
            (5, {"step": 5, "in_process": True, "trigger": "non-finite (loss nan, grad norm nan)",
                 "bisect": {"anomaly": "non-finite", "trials_run": 2, "ranking": [],
                            "note": "the all-BF16 replay is non-finite too"}})):
        (run / "replay" / f"step-{step}").mkdir(parents=True)
        (run / "replay" / f"step-{step}" / "replay.json").write_text(json.dumps(record))
    assert report.main([str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert "replay of step 4 (replay/step-4/replay.json)" in page
    assert "from step_0000003: bit-identical to the log" in page
    assert "<td>1</td><td>layers.2.mixer.in_proj</td><td>fprop</td><td>1.63</td>" in page
    assert "bisected in the loop (trainer.on_anomaly): non-finite" in page
    assert "the all-BF16 replay is non-finite too" in page


def test_report_refusals(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    run = tmp_path / "run"
    _write_run(run)
    (run / "checkpoints").mkdir()
    assert report.main([str(run), "--out", str(run / "checkpoints")]) == 2
    assert "checkpoints" in capsys.readouterr().err
