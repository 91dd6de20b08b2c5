"""The component study (studies/components/).

Its GEMMs are the recipe's (bit for bit against `quantized_linear`), its quantizers agree with the
independent reference on captured tensors, its capture records what the GEMMs saw, and on small
tensors captured from the demo model each effect that theory guarantees points the right way.
The command itself, trained and measured end to end: tests/system/test_study_commands.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from studies.components import capture, gemms, measure, passes, stats, study
from nvfp4_recipe import MXFP4Config, MXFP8Config, NVFP4Config, quantized_linear
from train_helpers import REPO

SEQ, BATCH, VOCAB = 64, 2, 256


@pytest.fixture(scope="module", autouse=True)
def eager_quantizers():
    """The same bits as the compiled kernels (nvfp4_recipe.kernels), without compiling them here."""
    saved, gemms.KERNELS = gemms.KERNELS, "eager"
    yield
    gemms.KERNELS = saved


@pytest.fixture(scope="module")
def demo(parallel_context):
    """The demo model's layers, one of each kind (pattern M*-, BF16 as the study trains), after one
    forward/backward of 2 x 64 tokens, with every linear's x, W and dY captured."""
    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training.config import TrainerConfig
    from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model
    from training.schedules import run_micro_batches

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, pattern="M*-")
    core = build_model(cfg, PrecisionConfig(), vocab_size=VOCAB, backend="emulated",
                       params_dtype=PARAMS_DTYPE).module
    model, _ = build_data_parallel_model(core, TrainerConfig(), parallel_context)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(BATCH, SEQ)}
    modules = capture.precision_linears(core)
    recorder = capture.Capture(modules)
    recorder.active = True
    model.zero_grad_buffer()
    run_micro_batches(model, [batch], parallel_context, (SEQ, BATCH, cfg.hidden_size))
    recorder.active = False
    tensors = recorder.take()
    recorder.remove()
    grads = {n: m.weight.main_grad.clone() for n, m in modules.items()}
    model.zero_grad_buffer()
    return SimpleNamespace(cfg=cfg, model=model, ctx=parallel_context, modules=modules, batch=batch,
                           tensors=tensors, grads=grads,
                           activation_shape=(SEQ, BATCH, cfg.hidden_size))


@pytest.fixture(scope="module")
def measured(demo):
    """measure_linear on every captured linear (a few seconds with eager quantizers)."""
    return {n: measure.measure_linear(r["x"], r["w"], r["dy"], n) for n, r in demo.tensors.items()}


def test_t_quantiles_and_intervals():
    # Student-t 0.975 quantiles from tables
    for df, want in ((1, 12.706), (2, 4.303), (11, 2.201), (30, 2.042)):
        assert stats.t_quantile(0.975, df) == pytest.approx(want, abs=1e-3)
    ci = stats.interval([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["hi"] - 2.0 == pytest.approx(4.303 * 1.0 / math.sqrt(3), abs=1e-3)
    assert not stats.excludes_zero(ci) and stats.excludes_zero(stats.interval([2.0, 2.1, 1.9]))
    neg = stats.negated(ci)
    assert (neg["lo"], neg["mean"], neg["hi"]) == (-ci["hi"], -2.0, -ci["lo"])
    assert stats.interval([5.0])["lo"] is None  # no interval from one value


@pytest.mark.parametrize("fmt,rht,sr,weight_2d", [
    ("nvfp4", True, True, True), ("nvfp4", False, True, False), ("nvfp4", True, False, False),
    ("nvfp4", False, False, True), ("mxfp4", False, False, False), ("mxfp8", False, False, False)])
def test_study_gemms_are_the_recipes_gemms(fmt, rht, sr, weight_2d):
    """Fprop, Dgrad and Wgrad composed from the public quantizers equal quantized_linear's output
    and gradients bit for bit (FP32 GEMM), SR draws included: the study measures the recipe."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 64, generator=gen).bfloat16()  # T = 48: Wgrad pads T for MXFP4's 32
    w = (torch.randn(96, 64, generator=gen) * 0.05).bfloat16()
    dy = (torch.randn(3, 16, 96, generator=gen) * 1e-3).bfloat16()
    config = {"nvfp4": lambda: NVFP4Config(rht=rht, stochastic_rounding=sr, weight_2d=weight_2d,
                                           gemm="exact", kernels="eager"),
              "mxfp4": lambda: MXFP4Config(gemm="exact"),
              "mxfp8": lambda: MXFP8Config(gemm="exact")}[fmt]()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_linear(xr, wr, None, config, torch.Generator().manual_seed(5))
    y.backward(dy)

    study_gemms = gemms.Gemms(fmt, rht, sr, weight_2d)
    x2d, dy2d = x.reshape(-1, 64), dy.reshape(-1, 96)
    draws = torch.Generator().manual_seed(5)  # the backward draws Dgrad's SR first, then Wgrad's
    assert torch.equal(study_gemms.fprop(x2d, w).bfloat16(), y.reshape(-1, 96))
    assert torch.equal(study_gemms.dgrad(dy2d, w, draws).bfloat16(), xr.grad.reshape(-1, 64))
    assert torch.equal(study_gemms.wgrad(dy2d, x2d, draws).bfloat16(), wr.grad)


def test_capture_records_what_each_gemm_saw(demo):
    assert len(demo.tensors) == 6  # 3 pattern layers x 2 linears
    for name, rec in demo.tensors.items():
        module = demo.modules[name]
        assert rec["x"].shape == (SEQ, BATCH, module.weight.shape[1]), name
        assert rec["dy"].shape == (SEQ, BATCH, module.weight.shape[0]), name
        assert torch.equal(rec["w"], module.weight.detach().bfloat16()), name
        # the weight's own gradient (a BF16 GEMM, FP32 main grad) is dY^T x of what was captured
        dw = rec["dy"].reshape(-1, rec["dy"].shape[-1]).float().t() @ \
            rec["x"].reshape(-1, rec["x"].shape[-1]).float()
        assert gemms.rel(demo.grads[name], dw) < 1e-2, name  # within BF16 rounding of the GEMM


def test_quantizers_agree_with_the_reference_on_captured_slices(demo):
    ref = measure.load_reference()
    assert ref is not None
    rows = []
    for name in ("layers.0.mixer.in_proj", "layers.1.self_attention.linear_proj"):
        for role in ("x", "w", "dy"):
            t = demo.tensors[name][role]
            rows += measure.reference_check(ref, t.reshape(-1, t.shape[-1])[:32, :64], f"{name} {role}")
    assert len(rows) == 18 and all(r["max_abs_diff"] == 0.0 for r in rows), rows


def test_stochastic_rounding_bias_shrinks_with_draws_while_nearest_stays(measured):
    """E[SR(v)] = v: the mean of N independent draws approaches the exact operand as 1/sqrt(N);
    nearest rounding returns the same tensor every time, so its bias cannot shrink. A single SR
    draw errs more than nearest (per element (v - lo)(hi - v) >= min(v - lo, hi - v)^2)."""
    for name, m in measured.items():
        nearest = [m[f"repeat/nearest/{n}"] for n in measure.REPEAT_NS]
        assert len(set(nearest)) == 1 and nearest[0] > 0, name
        sr_1, sr_32 = m["repeat/sr/1"], m["repeat/sr/32"]
        assert sr_1 > nearest[0], name
        assert sr_32 < 0.35 * sr_1, name  # 1/sqrt(32) = 0.18, with room for sampling
        assert sr_32 < nearest[0], name


def test_2d_weights_give_fprop_and_dgrad_one_weight(measured):
    """16x16 tiles are transpose-symmetric: Dgrad uses Fprop's weight exactly. Two 1x16 copies
    (along K, along N) round differently, so the 1x16 Dgrad output departs further from the
    gradient of what Fprop computed (same dY draws in both). The price: a tile's scale is the max
    of 16 rows' block scales, so the 16x16 copy is the coarser one."""
    for name, m in measured.items():
        assert m["w_mismatch/2d"] == 0.0, name
        assert m["w_mismatch/1d"] > 0.05, name
        assert m["dx_consistency/2d"] < m["dx_consistency/1d"], name
        assert m["w_err/2d"] > m["w_err/fprop_1d"], name


def test_nvfp4_quantizes_every_operand_more_accurately_than_mxfp4(measured):
    """Half the block (16 vs 32) and an E4M3 scale fitted to each block's max (MXFP4's power-of-
    two scale, rounded up, wastes up to a binade of the 4-bit grid)."""
    for name, m in measured.items():
        for role in ("x", "w", "dy"):
            assert m[f"operand_err/{role}/nvfp4"] < m[f"operand_err/{role}/mxfp4"], (name, role)


def test_mxfp8_quantizes_every_operand_and_gemm_more_accurately_than_nvfp4(measured):
    """E4M3's 3 mantissa bits against E2M1's 1: every operand's error falls several-fold even with
    MXFP8's larger (32) block and power-of-two scale (measured 2.8-3.6x on these tensors), and
    each GEMM's output more (3.6-4.7x: NVFP4's recipe adds 16x16 weights and SR on dY); MXFP8's
    operand errors sit at E4M3's rounding of these values, 2.6-2.7 %."""
    for name, m in measured.items():
        for role in ("x", "w", "dy"):
            mx8, nv = m[f"operand_err/{role}/mxfp8"], m[f"operand_err/{role}/nvfp4"]
            assert 0.02 < mx8 < 0.035 and mx8 < nv / 2.5, (name, role, mx8, nv)
        for gemm in ("y_err", "dx_err", "wgrad_err"):
            assert m[f"{gemm}/mxfp8"] < m[f"{gemm}/nvfp4"] / 3, (name, gemm)


def test_rht_changes_nothing_but_the_quantization_and_spreads_outliers(demo):
    """H is orthogonal (block-diagonal over runs of 16 tokens), so unquantized the RHT leaves dW
    unchanged; on operands with outlier tokens it mixes each outlier into its block, lowering the
    kurtosis along T and the share of small values flushed to zero."""
    rec = demo.tensors["layers.0.mixer.in_proj"]
    x2d, dy2d = rec["x"].reshape(-1, rec["x"].shape[-1]), rec["dy"].reshape(-1, rec["dy"].shape[-1])
    g = gemms.Gemms()
    exact = dy2d.float().t() @ x2d.float()
    assert gemms.rel(g.wgrad_source(dy2d) @ g.wgrad_source(x2d).t(), exact) < 1e-5

    gen = torch.Generator().manual_seed(3)
    t = torch.randn(256, 64, generator=gen)
    t[::16] *= 30.0  # one outlier token per 16-run, as attention-sink / rare-token gradients are
    plain, rht = gemms.Gemms(rht=False).wgrad_source(t), g.wgrad_source(t)
    assert gemms.kurtosis_rows(rht) < 0.5 * gemms.kurtosis_rows(plain)
    flushed_plain = gemms.flushed(plain, gemms.nvfp4_operand(plain))
    flushed_rht = gemms.flushed(rht, gemms.nvfp4_operand(rht))
    assert flushed_plain > 0.3 and flushed_rht < 0.5 * flushed_plain
    # The report's reading of its RHT result: when the energy sits in the outlier tokens, which a
    # block scale fitted to them keeps almost exact, spreading them costs Wgrad accuracy.
    x = torch.randn(256, 32, generator=gen)
    errors = [gemms.rel(gemms.Gemms(rht=on, sr=False).wgrad(t, x), t.t() @ x) for on in (False, True)]
    assert errors[1] > 1.1 * errors[0]


def test_recipe_maps_and_one_layer_quantized_alone(demo):
    """The BF16 first/last layers come from the recipes' own policy (the demo's 9 layers);
    quantizing one layer of the model perturbs its gradient, and leaving the context restores
    BF16 exactly."""
    from model.config import ModelConfig

    nine = ModelConfig(vocab_size=VOCAB)
    recipe = passes.recipe_configs("nvfp4", nine)
    assert sorted({capture.layer_index(n) for n, c in recipe.items() if c is None}) == [0, 7, 8]
    assert all(c is not None for c in passes.recipe_configs("nvfp4_no_bf16_layers", nine).values())
    assert all(isinstance(c, MXFP4Config) for n, c in passes.recipe_configs("mxfp4", nine).items()
               if capture.layer_index(n) not in (0, 7, 8))

    base_loss, base_grad = passes.loss_and_grad(demo, demo.batch, 0)
    attention = {n: NVFP4Config(kernels="eager") for n in demo.modules if capture.layer_index(n) == 1}
    with passes.gemm_configs(demo.modules, attention):
        assert all((m.gemm_config is not None) == (capture.layer_index(n) == 1)
                   for n, m in demo.modules.items())
        loss, grad = passes.loss_and_grad(demo, demo.batch, 0)
    assert loss != base_loss and gemms.rel(grad, base_grad) > 1e-3
    assert all(m.gemm_config is None for m in demo.modules.values())
    again_loss, again_grad = passes.loss_and_grad(demo, demo.batch, 0)
    assert again_loss == base_loss and torch.equal(again_grad, base_grad)


def test_a_linear_with_a_format_per_pass_gets_its_pass_configs():
    """A recipe whose override gives a linear one format per pass ("mxfp8/nvfp4/nvfp4") studies
    it under those passes, as training runs it, not under one format."""
    from nvfp4_recipe.config import PassConfigs
    from nvfp4_recipe.policy import PrecisionConfig

    pcfg = PrecisionConfig(format="nvfp4")
    mixed = passes._config_of("mxfp8/nvfp4/nvfp4", pcfg)
    assert isinstance(mixed, PassConfigs) and isinstance(mixed.fprop, MXFP8Config)
    assert isinstance(mixed.dgrad, NVFP4Config) and mixed.dgrad is mixed.wgrad
    assert isinstance(passes._config_of("nvfp4", pcfg), NVFP4Config)
    assert passes._config_of("bf16", pcfg) is None
    x = torch.randn(4, 64, requires_grad=True)
    quantized_linear(x, torch.randn(64, 64), None, mixed).sum().backward()
    assert x.grad is not None


def test_the_committed_report_is_its_results_rendered():
    """docs/components/README.md is the template filled from docs/components/results.json: the
    prose lives in studies/templates/, the numbers in the results (a drift in either shows)."""
    from studies.components import report
    from studies.components.summary import summarize

    docs = REPO / "docs" / "components"
    results = report.read_results(docs)
    assert report.render_readme(results, summarize(results)) == (docs / "README.md").read_text()


def test_the_report_shows_mxfp8_where_the_results_measured_it():
    """A results.json from before MXFP8 was measured (the committed one with MXFP8's metrics
    taken out) renders the 4-column format table and no mxfp8 variant; with MXFP8's metrics (here
    MXFP8's errors set to a third of NVFP4's) the table gains its two columns, the reading its
    line and section 6 the `mxfp8` recipe. The committed report (2026-12-03) measured MXFP8."""
    import copy

    from studies.components import report
    from studies.components.summary import summarize

    committed = report.read_results(REPO / "docs" / "components")
    assert "| reduction by NVFP4 | MXFP8 | reduction by MXFP8 vs NVFP4 |\n" in report.render_readme(
        committed, summarize(committed))
    before = copy.deepcopy(committed)
    for record in [m for batch in before["batches"] for m in batch["linears"].values()] + before["model"]:
        for key in [k for k in record if k.endswith("/mxfp8")]:
            del record[key]
    old = report.render_readme(before, summarize(before))
    assert "| quantity | NVFP4 | MXFP4 | reduction by NVFP4 |\n" in old
    assert "MXFP8" not in old and "`mxfp8`" not in old

    results = copy.deepcopy(before)
    for batch in results["batches"]:
        for m in batch["linears"].values():
            for metric in ("operand_err/x", "operand_err/w", "operand_err/dy", "y_err", "dx_err",
                           "wgrad_err"):
                m[f"{metric}/mxfp8"] = m[f"{metric}/nvfp4"] / 3
    for record in results["model"]:
        record["dloss/mxfp8"], record["grad_err/mxfp8"] = 0.0, record["grad_err/nvfp4"] / 3
    s = summarize(results)
    readme = report.render_readme(results, s)
    assert "| reduction by NVFP4 | MXFP8 | reduction by MXFP8 vs NVFP4 |\n" in readme
    row = next(line for line in readme.splitlines() if line.startswith("| x (activation) |"))
    assert row.endswith(f"| {report.pct(s['formats']['operand_err/x']['mxfp8'], 100, '.2f')} | "
                        f"{report.pct(s['formats']['operand_err/x']['mxfp8_reduction'])} |")
    assert s["formats"]["operand_err/x"]["mxfp8_reduction"]["mean"] == pytest.approx(2 / 3)
    assert "- **MXFP8** (8 bits, TE's default Blackwell recipe) removes +66.7 %" in readme
    assert "| `mxfp8` |" in readme and list(s["variants"])[-1] == "mxfp8"


def test_a_batchs_tokens_come_from_the_runs_shapes():
    from studies.components import report

    overrides = ["precision=bf16", "trainer.seq_length=64", "trainer.global_batch_size=4"]
    assert report.tokens_per_batch({"overrides": overrides}) == 256
    assert report.tokens_per_batch({"overrides": overrides, "tokens_per_batch": 512}) == 512


def test_bad_arguments_are_one_line_and_their_exit_code(tmp_path, capsys):
    from errors import ConfigError, ExitCode
    from studies.components.__main__ import main

    assert main(["--report-only", "--out", str(tmp_path / "none")]) == ExitCode.MISSING
    assert capsys.readouterr().err.strip() == (
        f"error: --out {tmp_path / 'none'}: no results.json to rebuild the report from")
    with pytest.raises(ConfigError, match="--steps 10 is too short .* --batches 6 steps"):
        study.capture_steps(10, 6)
    assert study.capture_steps(12, 1) == [[2], [6], [12]]
