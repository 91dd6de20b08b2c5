"""training/metrics.py's reader of metrics.jsonl: what MetricsSink writes, read back."""

from __future__ import annotations

import math

import pytest

from training.metrics import METRICS_FILE, MetricsSink, read_metrics


def test_read_metrics_returns_steps_and_events_as_the_sink_wrote_them(tmp_path):
    sink = MetricsSink(tmp_path, enabled=True)
    sink.log(1, {"loss": 8.5, "lr": 1e-4, "data/tokens/prose": 256})
    sink.event(1, "switch_to_bf16", passes="all")
    sink.log(2, {"loss": math.nan, "val_loss": 7.25})
    sink.log(2, {"loss": 7.5})  # a resumed run logs step 2 again

    steps = [{"step": 1, "loss": 8.5, "lr": 1e-4, "data/tokens/prose": 256},
             {"step": 2, "loss": math.nan, "val_loss": 7.25},
             {"step": 2, "loss": 7.5}]
    event = {"step": 1, "event": "switch_to_bf16", "passes": "all"}
    records = read_metrics(tmp_path)
    assert [r.get("event") for r in records] == [None, "switch_to_bf16", None, None]
    assert records[1] == event
    assert read_metrics(tmp_path, kind="event") == [event]
    got = read_metrics(tmp_path, kind="step")
    assert [r["step"] for r in got] == [1, 2, 2]
    assert got[0] == steps[0] and got[2] == steps[2]
    assert math.isnan(got[1]["loss"]) and got[1]["val_loss"] == 7.25  # NaN survives the round trip


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    MetricsSink(tmp_path, enabled=True).log(1, {"loss": 8.5})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 8.5}]


def test_an_unknown_kind_is_refused(tmp_path):
    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match="kind"):
        read_metrics(tmp_path, kind="steps")


def test_every_is_due_on_its_multiples_and_the_last_step():
    from training.cadence import Every

    assert [s for s in range(1, 11) if Every(4, last=10)(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if Every(0)(s)] == []  # 0: never (e.g. grad_health_every=0)
    assert [s for s in range(1, 4) if Every(1)(s)] == [1, 2, 3]
