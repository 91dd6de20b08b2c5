"""The dry-run planner (model/plan.py): layer precisions, parameter counts, the memory and FLOPs
formulas, and plan.json. Everything builds on the meta device: seconds even at 12B."""

from __future__ import annotations

import json
import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:  # the repo is not installed into the venv
        sys.path.insert(0, _p)

from plan_fixtures import REPO, plan_process_group, train_config  # noqa: E402,F401

from model.plan import (  # noqa: E402
    PlanConfig,
    build_plan,
    dry_run,
    pipeline_stages,
    plan_world_size,
)
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("plan_process_group")

P_12B = 12_310_001_152
H_12B = 5120
# Replicated (not TP-sharded) parameters of the 12B: one pre-norm per layer + the final norm.
REPLICATED_12B = 62 * H_12B + H_12B


def nvfp4(**kw) -> PrecisionConfig:
    return PrecisionConfig(format="nvfp4", name="nvfp4", **kw)


def bf16_layers(plan) -> list[int]:
    return [row["index"] for row in plan["layers"] if row["precision"] == "bf16"]


@pytest.fixture(scope="module")
def plan_12b_nvfp4(plan_process_group):
    cfg = train_config("nemotron_h_12b", nvfp4(), tensor=4, seq_length=8192, micro_batch_size=1,
                       global_batch_size=736)
    return build_plan(cfg, PlanConfig(gpus=736, total_tokens=10**13))


# -- precision of every linear ------------------------------------------------------------------


def test_12b_nvfp4_layers(plan_12b_nvfp4):
    plan = plan_12b_nvfp4
    assert plan["parameters"] == P_12B
    assert sum(row["parameters"] for row in plan["layers"]) + plan["embedding_parameters"] + \
        plan["output_layer_parameters"] + plan["final_norm_parameters"] == P_12B
    assert len(plan["layers"]) == 62
    assert bf16_layers(plan) == [0, 1, *range(54, 62)]
    assert plan["linear_counts"] == {"nvfp4": 104, "bf16": 20}
    for row in plan["layers"]:
        assert set(row["linears"].values()) == {row["precision"]}
        assert len(row["linears"]) == 2
    assert [r["kind"] for r in plan["layers"]].count("mamba") == 28
    assert [r["kind"] for r in plan["layers"]].count("attention") == 6
    # The note's hand count of one Mamba layer (in_proj, conv1d + bias, out_proj, A/D/dt, norms).
    mamba = next(r for r in plan["layers"] if r["kind"] == "mamba")
    assert mamba["parameters"] == (115_998_720 + 12_288 * 4 + 12_288 + 10_240 * 5_120
                                   + 3 * 128 + 10_240 + 5_120)
    assert plan["recipe"]["bf16_first_layers"] == 2 and plan["recipe"]["bf16_last_layers"] == 8
    assert plan["backend"] in ("te", "emulated")


def test_12b_bf16_last_4_moves_layers_54_to_57(plan_process_group, plan_12b_nvfp4):
    cfg = train_config("nemotron_h_12b", nvfp4(bf16_last_layers=4), tensor=4)
    plan = build_plan(cfg)
    assert bf16_layers(plan) == [0, 1, 58, 59, 60, 61]
    # 4 layers x 2 linears move: 104 + 8 = 112 NVFP4, 20 - 8 = 12 BF16 (not 108 / 16).
    assert plan["linear_counts"] == {"nvfp4": 112, "bf16": 12}
    before = {r["index"]: r["precision"] for r in plan_12b_nvfp4["layers"]}
    moved = [i for i, r in enumerate(plan["layers"]) if r["precision"] != before[i]]
    assert moved == [54, 55, 56, 57]


def test_bf16_and_fp8_plans(plan_process_group):
    plan = build_plan(train_config("nemotron_h_12b", PrecisionConfig()))
    assert plan["linear_counts"] == {"bf16": 124}
    fp8 = PrecisionConfig(format="fp8", name="fp8", bf16_first_layers=1, bf16_last_layers=2)
    plan = build_plan(train_config("nemotron_h_12b", fp8))
    assert bf16_layers(plan) == [0, 60, 61]
    assert plan["linear_counts"] == {"bf16": 6, "fp8": 118}


# -- memory -------------------------------------------------------------------------------------


def test_memory_scales_with_tensor_parallel(plan_process_group, plan_12b_nvfp4):
    kw = dict(seq_length=8192, micro_batch_size=1, global_batch_size=8)
    t1 = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=1, **kw))
    t4 = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=4, **kw))
    # Weights: TP-sharded parameters exactly / 4, the replicated norms whole.
    assert t1["parameters_per_rank"] == P_12B
    assert t4["parameters_per_rank"] == (P_12B - REPLICATED_12B) // 4 + REPLICATED_12B
    assert (P_12B - REPLICATED_12B) % 4 == 0
    m1, m4 = t1["memory"], t4["memory"]
    for key in ("weights_fp32_gib", "grads_fp32_gib", "adam_fp32_gib"):
        assert m4[key] == pytest.approx(m1[key] / 4, rel=1e-4)
    assert m1["weights_fp32_gib"] == pytest.approx(4 * P_12B / 2**30, abs=1e-3)
    assert m1["adam_fp32_gib"] == pytest.approx(8 * P_12B / 2**30, abs=1e-3)
    # BF16 copies: GEMM weights only (linears + output layer), all TP-sharded.
    assert m1["weights_bf16_working_gib"] == pytest.approx(2 * t1["gemm_parameters"] / 2**30,
                                                           abs=2e-3)
    assert m4["weights_bf16_working_gib"] == pytest.approx(m1["weights_bf16_working_gib"] / 4,
                                                           abs=2e-3)
    # Activations: every term but the h-wide replicated ones (norm in, first linear in) / 4.
    for kind, per_token_1 in (("mlp", 2 * H_12B + 2 * 20480), ("attention",
                              2 * H_12B + (40 + 16) * 128 + 40 * 128)):
        b1 = per_token_1 * 8192 * 2 / 2**30
        assert m1["activations_per_layer_gib"][kind] == pytest.approx(b1, abs=1e-3)
        b4 = (2 * H_12B + (per_token_1 - 2 * H_12B) / 4) * 8192 * 2 / 2**30
        assert m4["activations_per_layer_gib"][kind] == pytest.approx(b4, abs=1e-3)
    assert m4["logits_gib"] == pytest.approx(m1["logits_gib"] / 4, abs=1e-3)
    assert t4["memory_per_rank_gib"] < t1["memory_per_rank_gib"] / 3
    # The 10T plan fits a GB200 (186 GB = 173 GiB) at TP=4 and has the documented breakdown.
    plan = plan_12b_nvfp4
    mem = plan["memory"]
    static = (mem["weights_fp32_gib"] + mem["grads_fp32_gib"] + mem["adam_fp32_gib"]
              + mem["weights_bf16_working_gib"])
    assert plan["memory_per_rank_gib"] == pytest.approx(
        static + max(mem["activations_gib"] + mem["logits_gib"], mem["transient_gib"]), abs=0.01)
    assert 60 < plan["memory_per_rank_gib"] < 173


def test_recompute_pipeline_and_data_parallel(plan_process_group):
    kw = dict(seq_length=8192, micro_batch_size=1, global_batch_size=16)
    cfg = train_config("nemotron_h_12b", nvfp4(), tensor=4, **kw)
    plain = build_plan(cfg, PlanConfig())
    recompute = build_plan(cfg, PlanConfig(activation_recompute=True))
    # Recompute keeps each layer's input (h x s x 2 B) plus one full layer (the largest, Mamba).
    kept = 62 * H_12B * 8192 * 2 / 2**30 + plain["memory"]["activations_per_layer_gib"]["mamba"]
    assert recompute["memory"]["activations_gib"] == pytest.approx(kept, abs=2e-3)
    assert recompute["memory"]["activations_gib"] < plain["memory"]["activations_gib"] / 3
    # Data parallel adds the flattened FP32 gradient buffer to the optimizer-step transient.
    dp = build_plan(cfg, PlanConfig(gpus=8))
    assert dp["time"]["data"] == 2
    assert dp["memory"]["transient_gib"] == pytest.approx(2 * plain["memory"]["transient_gib"],
                                                          abs=2e-3)
    # Pipeline 2 (62 layers split 31/31): the first stage holds 2 micro-batches in flight.
    pp = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=4, pipeline=2, **kw))
    stages = pp["memory"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 30], [31, 61]]
    assert [s["in_flight_micro_batches"] for s in stages] == [2, 1]
    assert pp["parameters_per_rank"] < plain["parameters_per_rank"] * 0.6
    with pytest.raises(ValueError, match="plan.gpus"):
        build_plan(cfg, PlanConfig(gpus=6))
    with pytest.raises(ValueError, match="global_batch_size"):
        build_plan(cfg, PlanConfig(gpus=4 * 32))


def test_pipeline_stages_mirror_megatron():
    assert pipeline_stages(62, 1) == [range(62)]
    assert pipeline_stages(62, 2) == [range(0, 31), range(31, 62)]
    assert pipeline_stages(62, 4, first=14, last=18) == [range(0, 14), range(14, 29),
                                                         range(29, 44), range(44, 62)]
    with pytest.raises(ValueError, match="first_stage_layers"):
        pipeline_stages(62, 4)


# -- FLOPs and time -----------------------------------------------------------------------------


def test_12b_flops_and_time(plan_12b_nvfp4):
    plan = plan_12b_nvfp4
    ratio = plan["flops_per_token"] / (6 * P_12B)
    # Below 6P: the embedding (5.5% of P) is a lookup, not a GEMM, and the norms/conv/scan
    # parameters are not GEMM weights; above it: attention scores (~2.0%) and the SSD scan
    # (~0.9%) add FLOPs that no parameter accounts for. Net 0.975.
    assert 0.95 < ratio < 1.0
    assert plan["flops"]["gemm_per_token"] == 6 * plan["gemm_parameters"]
    assert plan["gemm_parameters"] == P_12B - plan["embedding_parameters"] - 28 * (
        12_288 * 5 + 3 * 128 + 10_240 + 5_120) - 34 * 5_120 - 5_120
    tm = plan["time"]
    assert tm["gpus"] == 736 and tm["data"] == 184
    expected = plan["flops_per_token"] * 1e13 / (736 * 2500e12 * 0.4)
    assert tm["seconds"] == pytest.approx(expected, rel=1e-6)
    assert 10 < tm["days"] < 13


# -- plan.json and dry_run ----------------------------------------------------------------------


def test_dry_run_writes_plan_json_and_nothing_else(plan_process_group, tmp_path, capsys):
    from training.distributed import ParallelContext

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    others = {"config.yaml": "a: 1\n", "metrics.jsonl": '{"step": 1}\n', "train.log": "x\n"}
    for name, text in others.items():
        (run_dir / name).write_text(text)
    (run_dir / "plan.json").write_text('{"stale": true}\n')
    before = {n: (run_dir / n).stat().st_mtime_ns for n in others}

    cfg = train_config("demo", nvfp4(), run_dir=run_dir)  # vocab_size null: the demo tokenizer's
    ctx = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                          pipeline_rank=0, data_rank=0, device=None)
    assert dry_run(cfg, ctx) == 0
    assert "plan.json" in capsys.readouterr().out

    # plan.json is derived data: rewritten; every other file untouched, nothing added.
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*others, "plan.json"])
    for name, text in others.items():
        assert (run_dir / name).read_text() == text
        assert (run_dir / name).stat().st_mtime_ns == before[name]
    plan = json.loads((run_dir / "plan.json").read_text())
    for key in ("parameters", "layers", "linear_counts", "recipe", "backend",
                "memory_per_rank_gib", "memory", "flops_per_token", "time"):
        assert key in plan
    assert "stale" not in plan
    assert plan["vocab_size"] == cfg.data.demo.vocab_size
    assert plan["vocab_size_padded"] % 128 == 0
    assert set(plan["layers"][0]) >= {"index", "kind", "precision", "linears", "parameters"}
    assert plan["layers"][0]["linears"] == {"mixer.in_proj": "bf16", "mixer.out_proj": "bf16"}
    assert plan["linear_counts"] == {"bf16": 6, "nvfp4": 12}  # demo: first 1 / last 2 BF16
    assert plan["recipe"]["format"] == "nvfp4"
    assert plan["backend"] in ("te", "emulated")
    assert isinstance(plan["memory_per_rank_gib"], float)

    # A fresh run.dir is created.
    cfg.run.dir = str(tmp_path / "new" / "run")
    assert dry_run(cfg, ctx) == 0
    assert sorted(p.name for p in (tmp_path / "new" / "run").iterdir()) == ["plan.json"]


def test_world_size_for_validation():
    cfg = train_config("nemotron_h_12b", nvfp4(), tensor=4)
    assert plan_world_size(cfg) == 4
    cfg.plan = PlanConfig(gpus=736)
    assert plan_world_size(cfg) == 736


def test_experiment_recipe_matches_the_schemas():
    """Each section of the 12B experiment merges into its dataclass (unknown keys fail)."""
    import math

    from omegaconf import OmegaConf

    from training.config import ParallelConfig, RunConfig, TrainerConfig
    from model.plan import PlanConfig as Plan

    path = REPO / "recipes" / "experiment" / "nemotron_h_12b_nvfp4_10t.yaml"
    assert path.read_text().startswith("# @package _global_")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    defaults = raw.pop("defaults")
    assert {"override /model": "nemotron_h_12b"} in defaults
    assert {"override /precision": "nvfp4"} in defaults
    assert {"override /data": "phased_10t"} in defaults
    schemas = {"run": RunConfig, "parallel": ParallelConfig, "trainer": TrainerConfig,
               "precision": PrecisionConfig, "plan": Plan}
    merged = {k: OmegaConf.merge(OmegaConf.structured(schemas[k]), v)
              for k, v in raw.items() if k in schemas}  # raises on an unknown key or bad type
    assert set(raw) <= set(schemas) | {"logger"}
    tr = merged["trainer"]
    assert tr.max_steps == math.ceil(10**13 / (736 * 8192))
    assert tr.warmup_steps == math.ceil(8 * 10**9 / (736 * 8192))
    assert tr.global_batch_size % (tr.micro_batch_size * merged["plan"].gpus
                                   // merged["parallel"].tensor) == 0
    assert merged["precision"].switch_to_bf16.at_fraction == 0.82
