"""The preflight (nvfp4_recipe/gemm_support.py, training/preflight.py): one test per shape rule and per
known-bad entry, each against the source the rule cites; the 12B at tensor 1/2/4/8; the dry run's
report and exit code; a run that would fail refuses to start before anything is written."""

from __future__ import annotations

import json

import pytest

from model.config import precision_policy
from nvfp4_recipe.gemm_support import (KNOWN_BAD, RULES, DeviceSetting, Linear, Setting,
                                    check_linear, known_bad_hits)
from nvfp4_recipe.policy import PrecisionConfig
from helpers import train_config

T_12B = 8192  # micro-batch 1 x sequence 8192


def verdicts(linear: Linear, **setting) -> dict[str, str]:
    setting = {"backend": "te", "tokens": T_12B, **setting}
    return {c.gemm: c.verdict for c in check_linear(linear, Setting(**setting))}


def reasons(linear: Linear, **setting) -> dict[str, list[str]]:
    setting = {"backend": "te", "tokens": T_12B, **setting}
    return {c.gemm: [r.split(":")[0] for r in c.reasons]
            for c in check_linear(linear, Setting(**setting))}


def in_proj(n: int, fmt: str = "nvfp4", k: int = 5120) -> Linear:
    return Linear("layers.2.mixer.in_proj", fmt, in_features=k, out_features=n)


def test_every_rule_cites_its_source_and_has_a_test():
    tested = {"te.nvfp4.quantize_16", "te.nvfp4.cast_32", "te.nvfp4.rht_fusion",
              "te.mxfp8.quantize_32",
              "te.fp8_block.sequence_parallel_gather", "te.fp8.exec_dims", "te.fp8_block.gemm_dims",
              "emulated.nvfp4.block_16", "emulated.mxfp4.block_32", "emulated.mxfp8.block_32"}
    assert {r.id for r in RULES} == tested
    for rule in (*RULES, *KNOWN_BAD):
        assert rule.source and rule.severity in ("slower", "fail"), rule.id
    for rule in RULES:
        assert ("TE v2." in rule.source) == (rule.backend == "te"), rule.id


# -- TE NVFP4 --------------------------------------------------------------------------------------


def test_te_nvfp4_quantize_needs_multiples_of_16():
    """TE v2.9 quantizer.cpp:1185-1189: NVFP4Quantizer::create_tensor checks flat first and last
    dims % 16; nvfp4_tensor.py:180-188 is_quantizable the same."""
    assert verdicts(in_proj(2824)) == {"fprop": "fail", "dgrad": "fail", "wgrad": "fail"}
    assert "te.nvfp4.quantize_16" in reasons(in_proj(2824))["dgrad"]
    assert "te.nvfp4.quantize_16" not in sum(reasons(in_proj(2832)).values(), [])
    # T (rows) too: 8200 tokens is not a multiple of 16.
    assert verdicts(in_proj(4096), tokens=8200)["fprop"] == "fail"


def test_te_nvfp4_cast_kernel_wants_multiples_of_32():
    """TE v2.9 cast_kernels.cuh:2104-2125 / v2.18 cast/dispatch/quantize.cuh:121-124: BF16, rows
    and cols % 32 for the optimised kernel, else quantize_transpose_vector_blockwise_fp4."""
    got = reasons(in_proj(2832), rht=False)  # 12B in_proj at tensor 8: 22,656 / 8
    assert got["fprop"] == ["te.nvfp4.cast_32"]  # W (2832 x 5120)
    assert got["dgrad"] == ["te.nvfp4.cast_32", "te.nvfp4.cast_32"]  # dY and W
    assert verdicts(in_proj(2832), rht=False) == {g: "slower" for g in ("fprop", "dgrad", "wgrad")}
    assert verdicts(in_proj(2848), rht=False) == {g: "ok" for g in ("fprop", "dgrad", "wgrad")}


def test_te_nvfp4_fused_rht_cast_wants_rows_64_cols_128():
    """TE v2.9 quantizer.cpp:1477-1478 (rows % 64, cols % 128, BF16), fallback 1599-1616; from
    v2.16 (:2310-2312) also SM 10.0-11.0. RHT only on the Wgrad operands (recipe :452-467)."""
    assert verdicts(in_proj(5664)) == {"fprop": "ok", "dgrad": "ok", "wgrad": "slower"}  # TP 4
    assert reasons(in_proj(5664))["wgrad"] == ["te.nvfp4.rht_fusion"]  # dY 8192 x 5664
    assert verdicts(in_proj(5664), rht=False)["wgrad"] == "ok"
    assert verdicts(in_proj(22656))["wgrad"] == "ok"  # TP 1: 22,656 = 177 x 128
    assert verdicts(in_proj(4096), tokens=8160)["wgrad"] == "slower"  # rows % 64
    # The architecture condition of TE >= 2.16: aligned shapes, but sm_120.
    assert verdicts(in_proj(4096), capability=(12, 0), te_version="2.16.0")["wgrad"] == "slower"
    assert verdicts(in_proj(4096), capability=(12, 0), te_version="2.9.0")["wgrad"] == "ok"
    assert verdicts(in_proj(4096), capability=(10, 0), te_version="2.18.0")["wgrad"] == "ok"


def test_te_sequence_parallel_quantizes_the_local_shard_of_a_column_parallel_input():
    """With sequence parallel TE quantizes a column-parallel input on its T/tensor rows, row-wise
    and column-wise, before the all-gather (v2.19 module/linear.py:378-398): NVFP4 raises 'First
    dim for NVFP4 must be divisible by 16' there (quantizer.cpp:1982-1983), and the cast and RHT
    kernels are chosen by the local rows; so for a row-parallel dY whose shard is quantizable.
    FP8 block: TE <= 2.13 asserts (v2.9 utils.py:449-457), later releases gather a dequantized
    copy (v2.19 distributed.py:1133-1140); refused either way."""
    column = in_proj(2848)
    sp = {"tensor": 8, "sequence_parallel": True}
    assert verdicts(column, tokens=8 * 24, **sp)["fprop"] == "fail"  # 24 local rows
    assert reasons(column, tokens=8 * 24, **sp)["fprop"] == ["te.nvfp4.quantize_16",
                                                            "te.nvfp4.cast_32"]
    assert verdicts(column, tokens=8 * 24, tensor=8)["fprop"] != "fail"  # no SP: 192 rows
    # 8 x 32 rows: quantizable and the fast cast, but 32 local rows miss the fused RHT (% 64)
    aligned = in_proj(4096)  # N % 128: the gathered dY takes the fused RHT
    assert verdicts(aligned, tokens=8 * 32, **sp) == {"fprop": "ok", "dgrad": "ok",
                                                       "wgrad": "slower"}
    assert reasons(aligned, tokens=8 * 32, **sp)["wgrad"] == ["te.nvfp4.rht_fusion"]
    assert verdicts(aligned, tokens=8 * 32, tensor=8)["wgrad"] == "ok"  # no SP: 256 rows
    assert verdicts(aligned, tokens=8 * 64, **sp)["wgrad"] == "ok"
    # A row-parallel linear's input is not gathered. Its dY is: quantized on the local shard
    # where that is quantizable (base.py:1745-1750 -> distributed.py:1404-1406), else gathered in
    # BF16 and quantized whole (:1386-1402).
    row = Linear("layers.2.mixer.out_proj", "nvfp4", 1280, 5120, parallel="row")
    assert verdicts(row, tokens=8 * 24, **sp) == {g: "ok" for g in ("fprop", "dgrad", "wgrad")}
    assert verdicts(row, tokens=8 * 32, **sp)["wgrad"] == "slower"  # 32 local rows: RHT % 64
    assert reasons(row, tokens=8 * 32, **sp)["wgrad"] == ["te.nvfp4.rht_fusion"]
    assert verdicts(row, tokens=8 * 32, tensor=8)["wgrad"] == "ok"  # no SP: 256 rows
    assert reasons(row, tokens=8 * 48, **sp)["dgrad"] == ["te.nvfp4.cast_32"]  # 48 local rows
    fp8 = in_proj(2848, "fp8")
    assert reasons(fp8, tokens=8 * 64, **sp)["fprop"] == ["te.fp8_block.sequence_parallel_gather"]
    assert verdicts(fp8, tokens=8 * 64, **sp)["fprop"] == "fail"
    assert verdicts(fp8, tokens=8 * 128, **sp)["fprop"] == "ok"
    # K = 5184 (not whole 128-blocks) with whole row blocks: the round trip keeps the values
    assert verdicts(in_proj(2848, "fp8", k=5184), tokens=8 * 128, **sp)["fprop"] == "ok"


# -- TE MXFP8 --------------------------------------------------------------------------------------


def test_te_mxfp8_quantize_needs_multiples_of_32_in_every_gemm():
    """TE v2.18 quantizer.cpp:1492-1494 (v2.9 :918-920, v2.0 extensions/quantizer.cpp:177):
    MXFP8Quantizer::create_tensor checks the flattened rows and columns % 32, for the rowwise and
    the columnwise copy alike (mxfp8_tensor.py:89-97 is_quantizable the same). Each GEMM reduces
    over one of those dimensions: N = 2832 (the 12B in_proj at tensor 8, 88.5 x 32) is Dgrad's
    reduction dimension, and W and dY hold it in every GEMM, so all three fail; the MXFP8 GEMM
    itself checks nothing more (cublaslt_gemm.cu:179-193, 268-278)."""
    assert verdicts(in_proj(2832, "mxfp8")) == {g: "fail" for g in ("fprop", "dgrad", "wgrad")}
    got = reasons(in_proj(2832, "mxfp8"))
    assert got["fprop"] == ["te.mxfp8.quantize_32"]  # W 2832 x 5120
    dgrad = next(c for c in check_linear(in_proj(2832, "mxfp8"), Setting("te", T_12B))
                 if c.gemm == "dgrad")
    assert dgrad.reasons == ("te.mxfp8.quantize_32: dY 8192 x 2832: columns (N) 2832 not a "
                             "multiple of 32",
                             "te.mxfp8.quantize_32: W 2832 x 5120: rows (N) 2832 not a multiple "
                             "of 32")
    assert verdicts(in_proj(2848, "mxfp8")) == {g: "ok" for g in ("fprop", "dgrad", "wgrad")}
    # K (Fprop's and Wgrad's x) and T (Wgrad's reduction): 8176 tokens = 255.5 x 32.
    assert verdicts(in_proj(2848, "mxfp8", k=5136))["fprop"] == "fail"
    assert verdicts(in_proj(2848, "mxfp8"), tokens=8176)["wgrad"] == "fail"
    # Multiples of 16 that NVFP4 quantizes (its cast falls back at % 32, no more) MXFP8 refuses.
    assert verdicts(in_proj(2832, "nvfp4"), rht=False)["dgrad"] == "slower"


def test_te_mxfp8_sequence_parallel_quantizes_the_local_shard_of_a_column_parallel_input():
    """A column-parallel input is quantized on its T/tensor rows before the all-gather, whatever
    the recipe (v2.18 module/linear.py:342-372, layernorm_linear.py:233-252): 8 x 48 tokens are
    quantizable whole (384 = 12 x 32) but not per rank (48). A row-parallel dY whose shard is
    not quantizable is gathered in BF16 and quantized whole (distributed.py:1548-1566), so only
    the whole counts there."""
    sp = {"tensor": 8, "sequence_parallel": True}
    column = in_proj(2848, "mxfp8")
    assert verdicts(column, tokens=8 * 48, **sp)["fprop"] == "fail"
    assert reasons(column, tokens=8 * 48, **sp)["fprop"] == ["te.mxfp8.quantize_32"]
    assert verdicts(column, tokens=8 * 48, tensor=8)["fprop"] == "ok"  # no SP: 384 rows
    assert verdicts(column, tokens=8 * 64, **sp) == {g: "ok" for g in ("fprop", "dgrad", "wgrad")}
    row = Linear("layers.2.mixer.out_proj", "mxfp8", 1280, 5120, parallel="row")
    assert verdicts(row, tokens=8 * 48, **sp) == {g: "ok" for g in ("fprop", "dgrad", "wgrad")}
    # 36 rows per rank: that shard is gathered in BF16 and the 288 = 9 x 32 rows quantized whole
    assert verdicts(row, tokens=8 * 36, **sp) == {g: "ok" for g in ("fprop", "dgrad", "wgrad")}
    assert verdicts(row, tokens=8 * 38, **sp)["dgrad"] == "fail"  # 304 rows: not whole blocks


# -- TE FP8 block scaling --------------------------------------------------------------------------


def test_te_fp8_exec_dims():
    """TE v2.9 utils.py:438-446 assert_dim_for_fp8_exec (leading % 8, last % 16), called at
    module/linear.py:168 and layernorm_linear.py:150."""
    assert verdicts(in_proj(4096, "fp8", k=5128))["fprop"] == "fail"
    assert "te.fp8.exec_dims" in reasons(in_proj(4096, "fp8", k=5128))["fprop"]
    assert verdicts(in_proj(4096, "fp8"), tokens=8188)["fprop"] == "fail"  # T % 8


def test_te_fp8_block_gemm_leading_and_outer_dims():
    """TE v2.9 cublaslt_gemm.cu:195-201, 271-277: block-scaled GEMM operands need the reduction
    dimension % 16 and the outer one % 8. N = 2824 (% 8, not % 16) is the reduction of Dgrad
    only."""
    assert verdicts(in_proj(2824, "fp8")) == {"fprop": "ok", "dgrad": "fail", "wgrad": "ok"}
    assert verdicts(in_proj(2832, "fp8")) == {"fprop": "ok", "dgrad": "ok", "wgrad": "ok"}
    assert verdicts(in_proj(2836, "fp8"))["wgrad"] == "fail"  # outer N % 8


# -- the emulation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,ok_n,bad_n", [("nvfp4", 2832, 2824), ("mxfp4", 2848, 2832),
                                             ("mxfp8", 2848, 2832)])
def test_emulation_needs_whole_blocks_of_k_and_n(fmt, ok_n, bad_n):
    """nvfp4_recipe/operands.py:48-61 check_shapes: K and N multiples of 16 (NVFP4) / 32 (MX),
    checked once before Fprop; T is zero-padded (any number of tokens)."""
    import torch

    from nvfp4_recipe import MXFP4Config, NVFP4Config, quantized_linear
    from nvfp4_recipe.config import MXFP8Config

    config = {"nvfp4": NVFP4Config, "mxfp4": MXFP4Config, "mxfp8": MXFP8Config}[fmt]()
    assert verdicts(in_proj(ok_n, fmt, k=64), backend="emulated", tokens=7) == {
        "fprop": "ok", "dgrad": "ok", "wgrad": "ok"}
    assert verdicts(in_proj(bad_n, fmt, k=64), backend="emulated")["fprop"] == "fail"
    # The rule is what the emulation does.
    x = torch.randn(7, 64)
    quantized_linear(x, torch.randn(ok_n, 64), None, config)
    with pytest.raises(ValueError, match="not a multiple"):
        quantized_linear(x, torch.randn(bad_n, 64), None, config)
    # FP8 zero-pads a partial 128-block: nothing to check.
    assert verdicts(in_proj(2824, "fp8", k=100), backend="emulated")["fprop"] == "ok"


# -- known-bad devices and releases ----------------------------------------------------------------


def _device(**kw) -> DeviceSetting:
    base = dict(capability=(10, 0), te_version="2.9.0", formats=("nvfp4",))
    return DeviceSetting(**{**base, **kw})


def hit_ids(**kw) -> list[str]:
    return [h.id for h in known_bad_hits(_device(**kw))]


def test_known_bad_sm12x_stochastic_rounding_zero_gradients():
    """TE PR #3281: SR on sm_120/121 returns all-zero FP4 data; the fix (fc1fc0e) is not in
    v2.18 (checked in the mirror with git merge-base)."""
    entry = "te.sm12x_stochastic_rounding_zeros"
    assert entry in hit_ids(capability=(12, 0), te_version="2.18.0")
    assert entry in hit_ids(capability=(12, 1), te_version="2.8.0")
    assert entry not in hit_ids(capability=(12, 0), stochastic_rounding=False)
    assert entry not in hit_ids(capability=(10, 0))
    assert entry not in hit_ids(capability=(12, 0), te_version="2.19.0")
    assert entry not in hit_ids(capability=(12, 0), formats=("fp8",))


def test_known_bad_sm12x_rht_crash():
    """TE issue #3062 (open): the fused RHT kernel fails on sm_120 with RHT or SR on."""
    entry = "te.sm12x_rht_crash"
    assert entry in hit_ids(capability=(12, 0), te_version="2.16.0", stochastic_rounding=False)
    assert entry not in hit_ids(capability=(12, 0), te_version="2.16.0", rht=False,
                                stochastic_rounding=False)
    assert entry not in hit_ids(capability=(12, 0), te_version="2.12.0")
    assert entry not in hit_ids(capability=(10, 3), te_version="2.16.0")


def test_known_bad_te_2_12_tuned_cast_kernel_disabled():
    """TE PR #2615: v2.12 ships the tuned 1-D kernel commented out
    (quantize_transpose_nvfp4.cuh:1171-1174); v2.13 calls it again."""
    assert hit_ids(te_version="2.12.0") == ["te.2.12_tuned_cast_disabled"]
    assert hit_ids(te_version="2.13.0") == []
    assert hit_ids(te_version="2.11.0") == []


def test_known_bad_rht_needs_bf16_input():
    """TE v2.9 quantizer.cpp:1481-1483: 'RHT is only supported for bfloat16 input'."""
    assert hit_ids(activation_dtype="fp32") == ["te.rht_needs_bf16"]
    assert hit_ids(activation_dtype="fp32", rht=False) == []
    assert hit_ids() == []


# -- the 12B and the dry run -----------------------------------------------------------------------


def nvfp4(**kw) -> PrecisionConfig:
    return PrecisionConfig(name="nvfp4", format="nvfp4", **kw)


def cfg_12b(tensor: int, precision=None):
    return train_config("nemotron_h_12b", precision or nvfp4(), tensor=tensor, seq_length=8192,
                        micro_batch_size=1, global_batch_size=736)


def test_12b_layouts_at_tensor_1_2_4_8():
    """22,656 in_proj outputs per rank: 22,656 (TP 1, = 177 x 128), 11,328 (TP 2, not % 128),
    5,664 (TP 4, not % 64), 2,832 (TP 8, not % 32): only TP 1 runs every GEMM on TE's fast
    paths; the emulation runs all four; every other linear is clean at all four."""
    from training.preflight import preflight

    cfg = cfg_12b(8)
    report = preflight(cfg, precision_policy(cfg.model, cfg.precision), ("te", "emulated"))
    layouts = report.layouts
    assert {t: layouts[t]["te"]["verdict"] for t in (1, 2, 4, 8)} == {
        1: "ok", 2: "slower", 4: "slower", 8: "slower"}
    assert {t: layouts[t]["emulated"]["verdict"] for t in (1, 2, 4, 8)} == {
        t: "ok" for t in (1, 2, 4, 8)}
    for t in (2, 4, 8):
        bad = {n for n, v in layouts[t]["te"]["linears"].items() if v != "ok"}
        assert bad == {"mixer.in_proj"}, t
    # TP 8: Fprop, Dgrad and Wgrad of every NVFP4 in_proj (23 layers), TE only.
    slow = [c for c in report.checks if c.verdict != "ok"]
    assert {(c.backend, c.linear.split(".", 2)[2]) for c in slow} == {("te", "mixer.in_proj")}
    assert len(slow) == 3 * 23
    assert report.refusal() is None


def test_12b_dry_run_at_tensor_8_names_in_proj_and_a_clean_layout(parallel_context, tmp_path,
                                                                   capsys):
    from training.plan import dry_run

    cfg = cfg_12b(8)
    cfg.run.dir = str(tmp_path)
    assert dry_run(cfg, None) == 0  # slower, not failing: the plan is written, exit 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    pre = plan["preflight"]
    assert pre["verdict"] == "slower" and pre["tensor"] == 8 and pre["rows_per_gemm"] == 8192
    assert len(pre["gemms"]) == 2 * 3 * 104  # te + emulated, 3 GEMMs of each NVFP4 linear
    problems = [p for p in pre["problems"] if "mixer.in_proj" in p]
    assert problems and all(p.startswith("slower path on te: mixer.in_proj") for p in problems)
    dgrad = next(p for p in problems if " Dgrad " in p)
    assert "dY 8192 x 2832: columns (N) 2832 not a multiple of 32" in dgrad
    assert "runs clean: 1" in dgrad
    assert {t: v["te"]["verdict"] for t, v in pre["layouts"].items()} == {
        "1": "ok", "2": "slower", "4": "slower", "8": "slower"}
    assert "preflight: slower path on te: mixer.in_proj" in " ".join(out.split())
    assert {e["id"] for e in pre["known_bad"]} == {e.id for e in KNOWN_BAD}


def test_12b_mxfp4_at_tensor_8_would_fail_and_names_layouts_that_work(parallel_context,
                                                                      tmp_path, capsys):
    """MXFP4 runs emulated only (32-element blocks): 2,832 = 88.5 x 32 cannot be split into
    blocks at TP 8; TP 1, 2 and 4 work. The dry run writes the plan, then exits 2."""
    from training.plan import dry_run

    cfg = cfg_12b(8, PrecisionConfig(name="mxfp4", format="mxfp4"))
    cfg.run.dir = str(tmp_path)
    assert dry_run(cfg, None) == 2
    pre = json.loads((tmp_path / "plan.json").read_text())["preflight"]
    assert pre["verdict"] == "fail" and list(pre["counts"]) == ["emulated"]
    (line,) = [p for p in pre["problems"] if p.startswith("would fail")]
    assert line.startswith("would fail on emulated: mixer.in_proj Fprop (mxfp4) in layers ")
    assert "N (out_features) 2832 not a multiple of 32" in line
    assert "tensor sizes where mixer.in_proj works: 1, 2, 4," in line
    assert "++precision.overrides={*.mixer.in_proj:bf16}" in line
    assert "exit code 2" in capsys.readouterr().out


def mxfp8(**kw) -> PrecisionConfig:
    """recipes/precision/mxfp8.yaml: every pattern layer in MXFP8 (Bridge's bf16_with_mxfp8_mixed)."""
    return PrecisionConfig(name="mxfp8", format="mxfp8", bf16_first_layers=0, bf16_last_layers=0,
                           **kw)


@pytest.mark.parametrize("backend,checked", [("auto", ("te", "emulated")), ("te", ("te",)),
                                             ("emulated", ("emulated",))])
def test_12b_mxfp8_verdicts_per_backend_and_tensor_size(backend, checked):
    """MXFP8 has a TE recipe (MXFP8BlockScaling), so backend=auto checks TE and the emulation
    (MXFP4, without one, only the emulation). in_proj's 22,656 outputs make whole 32-blocks at
    tensor 1, 2 and 4 (708, 354, 177 blocks) and not at 8 (2,832 = 88.5 x 32): there TE fails
    every in_proj GEMM (N is a row or column of W and dY in each) and the emulation its Fprop
    (N % 32, checked once per call); every other 12B linear splits into 32-blocks at all four."""
    from training.preflight import preflight, preflight_backends

    precision = mxfp8(backend=backend)
    assert preflight_backends(precision, "auto") == checked
    cfg = cfg_12b(8, precision)
    report = preflight(cfg, precision_policy(cfg.model, precision), checked)
    assert {t: {b: report.layouts[t][b]["verdict"] for b in checked} for t in (1, 2, 4, 8)} == {
        t: {b: "fail" if t == 8 else "ok" for b in checked} for t in (1, 2, 4, 8)}
    failing = {(c.backend, c.linear.split(".", 2)[2], c.gemm) for c in report.checks
               if c.verdict == "fail"}
    want = {("te", "mixer.in_proj", g) for g in ("fprop", "dgrad", "wgrad") if "te" in checked}
    if "emulated" in checked:
        want.add(("emulated", "mixer.in_proj", "fprop"))
    assert failing == want
    assert {c.format for c in report.checks} == {"mxfp8"}
    assert len(report.checks) == 3 * 124 * len(checked)  # every linear of the 62 layers
    refusal = report.refusal()
    assert refusal.startswith("preflight: would fail on ")
    assert "mixer.in_proj" in refusal and "2832 not a multiple of 32" in refusal
    assert "tensor sizes where mixer.in_proj works: 1, 2, 4," in refusal


def test_start_up_lists_an_mxfp8_gemm_whose_reduction_dim_misses_32_before_training(
        tmp_path, data_cache, monkeypatch, caplog):
    """precision=mxfp8 with an MLP of 1,040 (32.5 x 32): linear_fc2's Fprop reduces over 1,040,
    so the start-up preflight (run in this process as train.py runs it, on this machine's
    backend: the emulation) names it with exit 2, and no run directory is made."""
    from hydra import compose, initialize_config_dir

    from train_helpers import FAST, RECIPES
    from training.config import register_configs
    from training.entry import run

    monkeypatch.setenv("NVFP4_CACHE", str(data_cache))
    run_dir = tmp_path / "run"
    register_configs()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        raw = compose(config_name="train", overrides=[
            *FAST, "precision=mxfp8", "model.ffn_hidden_size=1040", "trainer.max_steps=1",
            f"run.dir={run_dir}"])
    with caplog.at_level("ERROR", logger="nvfp4_pretrain"):
        assert run(raw) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("error:")]
    assert "would fail on emulated: mlp.linear_fc2 Fprop (mxfp8)" in line
    assert "K (in_features) 1040 not a multiple of 32" in line
    assert "would fail on emulated: mlp.linear_fc1 Fprop (mxfp8)" in line  # N = 1040
    assert "++precision.overrides={*.mlp.linear_fc2:bf16}" in line
    assert not run_dir.exists()


def test_override_to_bf16_makes_the_12b_clean_at_tensor_8():
    """The layout the TP-8 message points at, the other way round: keep in_proj in BF16."""
    from training.preflight import preflight

    cfg = cfg_12b(8, nvfp4(overrides={"*.mixer.in_proj": "bf16"}))
    report = preflight(cfg, precision_policy(cfg.model, cfg.precision), ("te",))
    assert report.verdict == "ok" and report.problems() == []
    assert not any("in_proj" in c.linear for c in report.checks)


def test_a_layout_megatron_cannot_split_would_fail():
    """megatron asserts mamba heads/groups % tensor (mc 0.16.1 ssm/mamba_mixer.py:249-258): the
    preflight says so first, and lists the layouts per tensor size."""
    from training.preflight import preflight

    cfg = train_config("demo", nvfp4(), tensor=4)
    report = preflight(cfg, precision_policy(cfg.model, cfg.precision), ("emulated",))
    assert report.verdict == "fail" and report.checks == []
    assert "model.mamba_num_groups=2 is not divisible by tensor parallel 4" in report.refusal()
    assert {t: v["emulated"]["verdict"] for t, v in report.layouts.items()} == {
        1: "ok", 2: "ok", 4: "fail", 8: "fail"}


def test_a_policy_of_another_config_is_refused_by_the_preflight_and_the_model():
    """The start-up hands its one precision policy on; one built from another precision config
    (an equal one included: the check is on the object the run holds) or another pattern would
    check or build a different model, so the preflight and build_model refuse it."""
    from model.build import build_model
    from training.preflight import preflight

    cfg = train_config("demo", nvfp4())
    other_precision = precision_policy(cfg.model, nvfp4())
    demo_12b = cfg_12b(1)
    other_model = precision_policy(demo_12b.model, cfg.precision)
    for policy in (other_precision, other_model):
        with pytest.raises(ValueError, match="built from another config"):
            preflight(cfg, policy, ("emulated",))
        with pytest.raises(ValueError, match="built from another config"):
            build_model(cfg.model, cfg.precision, vocab_size=256, backend="emulated",
                        policy=policy)
    own = precision_policy(cfg.model, cfg.precision)
    assert preflight(cfg, own, ("emulated",)).verdict == "ok"
