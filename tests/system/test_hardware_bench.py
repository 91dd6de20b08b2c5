"""The hardware bench (`python -m benchmarks.hardware`) in its CPU mode, run as a user runs it: the
table has the emulation rows and honest skipped rows, the JSON has the documented keys, ratios are
positive finite numbers; and the machine-load meter sees a background process (the bench's
arithmetic and load report: tests/benchmarks/test_bench.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.hardware", "--quick", "--repeats", "1", "--json", str(out)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), out


def _rows(results, **match):
    return [r for r in results["rows"] if all(str(v) in str(r[k]) for k, v in match.items())]


# the module's one quick bench run: ~16 s on 2 cores
def test_json_has_the_documented_keys(quick_bench):
    _, results, path = quick_bench
    assert results["schema_version"] == 1
    for key in ("command", "hardware", "settings", "rows", "skipped", "load_average_end", "load", "elapsed_s"):
        assert key in results, key
    assert set(results["load"]) == {"load_average_start", "load_average_end", "other_cpus", "loaded", "seconds"}
    for key in ("cpu", "cpu_count", "torch", "load_average", "cuda_available", "transformer_engine",
                "bf16_peak_tflops", "bf16_peak_source"):
        assert key in results["hardware"], key
    settings = results["settings"]
    assert settings["quick"] and settings["tokens"] == 256 and settings["scale"] == 8
    assert [s["name"] for s in settings["shapes"]] == ["mlp fc1", "mamba in_proj", "attn qkv"]
    assert settings["shapes"][0] == {"name": "mlp fc1", "m": 256, "k": 640, "n": 2560}
    for row in results["rows"]:
        assert set(row) == {"section", "case", "shape", "path", "status", "ms", "value", "unit",
                            "vs_bf16", "vs_peak", "note"}
        assert row["status"] in ("ok", "skipped", "error")
    assert path.with_suffix(".md").exists()
    assert not _rows(results, status="error"), _rows(results, status="error")


def test_emulation_rows_with_positive_finite_ratios(quick_bench):
    stdout, results, _ = quick_bench
    for shape in ("mlp fc1", "mamba in_proj", "attn qkv"):
        for case, path in (("bf16", "torch bf16"), ("nvfp4 fast", "emulated (nvfp4_recipe, fast)"),
                           ("nvfp4 exact", "emulated (nvfp4_recipe, exact)")):
            (row,) = [r for r in results["rows"] if r["case"] == f"{shape}: {case}"]
            assert row["status"] == "ok" and row["path"].startswith(path)
            assert row["unit"] == "TFLOP/s"
            for key in ("ms", "value", "vs_bf16"):
                assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, row
    (share,) = _rows(results, case="mlp fc1: quantize share")
    assert 0 < share["value"] < 100 and share["unit"] == "%"
    train = _rows(results, section="train", status="ok")
    assert {r["case"] for r in train} == {"demo: bf16 step", "demo: nvfp4 step"}
    for r in train:
        assert r["unit"] == "tokens/s" and r["value"] > 0 and math.isfinite(r["vs_bf16"])
        assert r["vs_peak"] is None  # no MFU on CPU
    (step_share,) = _rows(results, case="demo: quantize share of step")
    assert 0 < step_share["value"] < 100
    # the table is printed, naming the paths
    assert "emulated (nvfp4_recipe, fast)" in stdout and "torch bf16" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip reasons")
def test_skipped_rows_say_why(quick_bench):
    _, results, _ = quick_bench
    reasons = {r["case"]: r["reason"] for r in results["skipped"]}
    for case in ("te bf16", "te fp8 block", "te nvfp4"):
        assert reasons[case] == "no CUDA device", (case, reasons)
    assert "no CUDA device" in reasons["MFU"]
    # torch 2.13 CPU: _scaled_mm works for float8_e4m3fn but only as a slow reference loop (its
    # rate is named); where oneDNN has no primitive for it (ONEDNN_MAX_CPU_ISA=AVX2 on an Intel
    # Xeon with AMX, 2026-12-03) the probe's error is named instead.
    fp8 = _rows(results, case="fp8 scaled_mm")
    assert fp8, "an FP8 row, timed or skipped, must be there"
    if fp8[0]["status"] == "skipped":
        note = fp8[0]["note"]
        assert "torch._scaled_mm" in note and ("GFLOP/s" in note or "fails on cpu: " in note)
    # every skipped row is in the table once, with its shape marked as all shapes
    assert len(_rows(results, case="te nvfp4")) == 1
    assert all(r["note"] for r in results["rows"] if r["status"] == "skipped")


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_machine_load_sees_a_background_process():
    # One spinning BF16 matmul process beside an idle wait: the meter attributes its CPU to
    # "other processes" (about one CPU), not to this one.
    from benchmarks.machine import MachineLoad, background_load

    with background_load(1), MachineLoad() as load:
        time.sleep(1.5)
    assert load.report.other_cpus > 0.5 and load.report.loaded
