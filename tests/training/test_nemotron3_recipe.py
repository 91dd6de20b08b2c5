"""precision=nvfp4_nemotron3, the Nemotron 3 map on this hybrid: every linear of the 12B model
checked layer by layer against the rule (the last 15 % of the layers, rounded up, in BF16;
elsewhere attention in BF16, the Mamba out_proj in MXFP8, the rest the paper's NVFP4), in the
policy and in the dry run's plan and printed map."""

from __future__ import annotations

import json
import math

from helpers import train_config
from model.config import LINEAR_NAMES, precision_policy
from nvfp4_recipe.registry import gemm_config_for
from train_helpers import compose_train


def expected(kind: str, name: str, index: int, num_layers: int) -> str:
    """The Nemotron 3 rule for one linear."""
    if index >= num_layers - math.ceil(0.15 * num_layers):
        return "bf16"
    if kind == "attention":
        return "bf16"
    if name == "mixer.out_proj":
        return "mxfp8"
    return "nvfp4"


def nemotron3(model: str = "nemotron_h_12b"):
    return compose_train("precision=nvfp4_nemotron3", f"model={model}")


def test_the_recipe_composes_the_papers_nvfp4_with_the_nemotron3_map():
    cfg = nemotron3().precision
    assert (cfg.format, cfg.rht, cfg.stochastic_rounding, cfg.weight_2d) == ("nvfp4", True, True,
                                                                            True)
    assert (cfg.bf16_first_layers, cfg.bf16_last_layers, cfg.bf16_last_fraction) == (0, None, 0.15)
    assert not cfg.overrides_in_bf16_layers


def test_the_12b_map_layer_by_layer():
    cfg = nemotron3()
    policy = precision_policy(cfg.model, cfg.precision)
    kinds = cfg.model.layer_kinds()
    assert len(kinds) == 62 and (policy.first, policy.last) == (0, 10)  # ceil(9.3)
    formats = policy.linear_formats()
    assert len(formats) == 124
    for index, kind in enumerate(kinds):
        for name in LINEAR_NAMES[kind]:
            fmt = formats[f"layers.{index}.{name}"]
            assert fmt == expected(kind, name, index, 62), (index, name, fmt)
            assert fmt.uniform is not None  # one format for Fprop, Dgrad and Wgrad
    counts = {f: sum(v == f for v in formats.values()) for f in ("nvfp4", "mxfp8", "bf16")}
    # Layers 0-51 quantized: 24 Mamba (in_proj NVFP4, out_proj MXFP8), 23 MLP (NVFP4), 5 attention
    # (BF16); layers 52-61 (attention, then 4 Mamba and 5 MLP) in BF16.
    assert counts == {"nvfp4": 24 + 2 * 23, "mxfp8": 24, "bf16": 2 * 5 + 2 * 10}
    # The emulated configs: the paper's NVFP4 (RHT, SR, 16x16 tiles) and MXFP8.
    nvfp4 = gemm_config_for("nvfp4", cfg.precision)
    assert (nvfp4.rht, nvfp4.stochastic_rounding, nvfp4.weight_2d) == (True, True, True)


def test_on_te_each_linear_runs_one_formats_recipe():
    """No linear's passes differ: TE runs the map with the per-linear contexts of overrides (the
    NVFP4 recipe, MXFP8's for out_proj, none for attention) from the release NVFP4 needs."""
    from nvfp4_recipe.megatron.te_mapping import te_pass_formats, te_supports

    precision = nemotron3().precision
    assert te_pass_formats(precision) == ["nvfp4", "mxfp8"]
    assert te_supports(precision, (10, 0), "12.9", "2.8.0") == (True, "")
    assert "NVFP4BlockScaling needs transformer_engine >= 2.8" in te_supports(
        precision, (10, 0), "12.9", "2.7.0")[1]


def test_the_demo_map_keeps_the_other_recipes_demo_behaviour_apart():
    """On the demo's 9 layers the end is the last 2 (ceil(1.35)), as the demo's own default; the
    first layer is quantized (no leading BF16 layers). precision=nvfp4 is unchanged."""
    cfg = nemotron3("demo")
    policy = precision_policy(cfg.model, cfg.precision)
    assert (policy.first, policy.last) == (0, 2)
    nvfp4 = compose_train("precision=nvfp4")
    plain = precision_policy(nvfp4.model, nvfp4.precision)
    assert (plain.first, plain.last) == (1, 2) and plain.linear_formats()[
        "layers.0.mixer.out_proj"] == "bf16"
    assert policy.linear_formats()["layers.0.mixer.out_proj"] == "mxfp8"
    assert policy.linear_formats()["layers.7.mixer.out_proj"] == "bf16"  # an end layer


def test_the_dry_run_prints_and_records_the_map_per_layer(parallel_context, tmp_path, capsys):
    from training.distributed import ParallelContext
    from training.plan import dry_run

    cfg = train_config("nemotron_h_12b", nemotron3().precision, run_dir=tmp_path / "run")
    ctx = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                          pipeline_rank=0, data_rank=0, device=None)
    assert dry_run(cfg, ctx) == 0  # the preflight passes it
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    for row in plan["layers"]:
        for name, fmt in row["linears"].items():
            assert fmt == expected(row["kind"], name, row["index"], 62), (row["index"], name)
    assert plan["recipe"]["bf16_last_layers"] == 10 and plan["recipe"]["bf16_first_layers"] == 0
    assert plan["linear_counts"] == {"nvfp4": 70, "mxfp8": 24, "bf16": 30}
    assert plan["precision_map"]["mixer.out_proj"] == {"mxfp8": "0-51", "bf16": "54-60"}
    assert plan["precision_map"]["self_attention.linear_qkv"] == {"bf16": "7-52"}
    assert plan["precision_map"]["mlp.linear_fc1"] == {"nvfp4": "1-50", "bf16": "53-61"}
    # The printed table wraps its cells: compare the words.
    out = capsys.readouterr().out.replace("│", " ").split()
    assert " ".join(out).count("mixer.in_proj: nvfp4 at 0-51; bf16 at 54-60 | mixer.out_proj: "
                               "mxfp8 at 0-51; bf16 at 54-60") == 1
