"""The hardware bench's pieces that need no bench run (benchmarks/hardware.py, benchmarks/machine.py):
the TE NVFP4 skip reason, FLOPs per token and the GPUs' peaks, the load report. The bench run as a
user runs it, and the load meter beside a background process: tests/system/test_hardware_bench.py."""

from __future__ import annotations


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


def test_the_gemm_bench_has_an_mxfp8_row_where_the_shape_is_whole_32_blocks():
    """The emulated MXFP8 linear is timed beside BF16 and NVFP4 (its vs_bf16 is BF16's time over
    its own); a shape whose N is not whole 32-blocks gets a skipped row with the reason, and the
    TE MXFP8 row says why it cannot run here."""
    import torch

    import benchmarks.hardware as bench
    from model.device import cuda_present

    shapes = [bench.GemmShape("a", 64, 96), bench.GemmShape("b", 64, 80)]
    rows = bench.bench_gemms(shapes, 32, torch.device("cpu"), warmup=0, repeats=1, peak=None)
    by_case = {r["case"]: r for r in rows}
    mx = by_case["a: mxfp8 fast"]
    assert mx["status"] == "ok" and mx["ms"] > 0 and mx["unit"] == "TFLOP/s"
    assert mx["vs_bf16"] == by_case["a: bf16"]["ms"] / mx["ms"]
    assert "1x32" in mx["note"] and by_case["a: nvfp4 fast"]["status"] == "ok"
    eager = by_case["a: mxfp8 fast, eager"]  # the quantizer's eager path, timed beside it
    assert eager["status"] == "ok" and "kernels=eager" in eager["path"]
    assert "b: mxfp8 fast, eager" not in by_case
    skipped = by_case["b: mxfp8 fast"]
    assert skipped["status"] == "skipped"
    assert skipped["note"] == "K 64 or N 80 not a multiple of the MXFP8 block (32)"
    if not cuda_present():
        te = by_case["te mxfp8"]
        assert te["status"] == "skipped" and te["path"] == "TE Linear, MXFP8BlockScaling"
