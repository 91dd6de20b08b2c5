"""The hardware bench (`python -m benchmarks.hardware`) and the prepared GPU check (launch/gpu_check.sh)
in their CPU modes: the table has the emulation rows and honest skipped rows, the JSON has the
documented keys, ratios are positive finite numbers."""

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


@pytest.mark.slow  # the module's one quick bench run: ~16 s on 2 cores
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


@pytest.mark.slow
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
@pytest.mark.slow
def test_skipped_rows_say_why(quick_bench):
    _, results, _ = quick_bench
    reasons = {r["case"]: r["reason"] for r in results["skipped"]}
    for case in ("te bf16", "te fp8 block", "te nvfp4"):
        assert reasons[case] == "no CUDA device", (case, reasons)
    assert "no CUDA device" in reasons["MFU"]
    # torch 2.13 CPU: _scaled_mm works for float8_e4m3fn but only as a slow reference loop.
    fp8 = _rows(results, case="fp8 scaled_mm")
    assert fp8, "an FP8 row, timed or skipped, must be there"
    if fp8[0]["status"] == "skipped":
        assert "torch._scaled_mm" in fp8[0]["note"] and "GFLOP/s" in fp8[0]["note"]
    # every skipped row is in the table once, with its shape marked as all shapes
    assert len(_rows(results, case="te nvfp4")) == 1
    assert all(r["note"] for r in results["rows"] if r["status"] == "skipped")


def test_te_nvfp4_skip_reason_names_the_capability(monkeypatch):
    """On a Hopper GPU the TE NVFP4 row says why (the helper, without a GPU)."""
    import benchmarks.hardware as bench

    monkeypatch.setattr(bench, "_capability", lambda: (9, 0))
    assert bench.te_status("nvfp4") == (False, "NVFP4 TE GEMMs need compute capability 10.x, found 9.0")


def test_flops_and_peaks():
    from benchmarks.hardware import HYBRID_1B, flops_per_token
    from benchmarks.machine import bf16_peak_tflops
    from model.config import ModelConfig
    from model.flops import flops_per_token_terms

    cfg = ModelConfig(**HYBRID_1B)  # checks its fields (__post_init__)
    per_token = flops_per_token(cfg, 4096, cfg.vocab_size)
    assert 6 * 1.0e9 < per_token < 6 * 1.6e9  # ~1.3B parameters in GEMMs + output layer
    # MFU counts what the planner counts (model/flops.py), the SSD scan and conv1d included:
    # 12 Mamba layers x 3 x [2*8*128*128 + 64 x (2*128*64 + 4*128*64)] = 19.3 MFLOP of scan.
    terms = flops_per_token_terms(cfg, 4096, 131072)
    assert per_token == terms["total"]
    assert terms["ssd_scan"] == 12 * 3 * (2 * 8 * 128 * 128 + 64 * (2 * 128 * 64 + 4 * 128 * 64))
    # The output layer runs at the padded vocabulary: 1000 tokens pad to 1024 (multiple 128).
    small = ModelConfig(**{**HYBRID_1B, "vocab_size": 1000})
    assert flops_per_token(small, 4096, 1000) == flops_per_token_terms(small, 4096, 1024)["total"]
    assert bf16_peak_tflops("NVIDIA H200")[0] == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    assert bf16_peak_tflops("NVIDIA GB200")[0] == 2500.0
    assert bf16_peak_tflops("NVIDIA B200")[0] == 2250.0
    assert "unsure" in bf16_peak_tflops("NVIDIA B300 SXM6 AC")[1]
    assert bf16_peak_tflops(None)[0] is None


def test_load_report_marks_a_loaded_machine():
    from benchmarks.machine import LOADED_OTHER_CPUS, LoadReport

    idle = LoadReport((0.1, 0.2, 0.3), (0.2, 0.2, 0.3), LOADED_OTHER_CPUS / 2, 10.0)
    busy = LoadReport((0.1, 0.2, 0.3), (1.9, 0.9, 0.4), 1.0, 10.0)
    assert idle.loaded is False and idle.line().startswith("idle")
    assert busy.loaded is True and busy.line().startswith("LOADED")
    assert "1.00 CPUs" in busy.line() and "1.9 0.9 0.4 at end" in busy.line()
    assert LoadReport(None, None, None, 1.0).loaded is None
    assert busy.to_json()["loaded"] is True


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_machine_load_sees_a_background_process():
    # One spinning BF16 matmul process beside an idle wait: the meter attributes its CPU to
    # "other processes" (about one CPU), not to this one.
    from benchmarks.machine import MachineLoad, background_load

    with background_load(1), MachineLoad() as load:
        time.sleep(1.5)
    assert load.report.other_cpus > 0.5 and load.report.loaded
