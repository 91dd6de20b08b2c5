"""The dry-run planner (training/plan.py, with model/memory_model.py and model/flops.py): layer
precisions, parameter counts, the memory and FLOPs formulas, and plan.json; and the helpers of
its CPU measurement (benchmarks/memory.py). Everything builds on the meta device: seconds even at 12B."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:  # the repo is not installed into the venv
        sys.path.insert(0, _p)

from helpers import REPO, model_config, train_config  # noqa: E402

from model.memory_model import pipeline_stages  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from training.plan import PlanConfig, build_plan, dry_run, plan_world_size  # noqa: E402

pytestmark = pytest.mark.usefixtures("parallel_context")

P_12B = 12_310_001_152
H_12B = 5120
# Replicated (not TP-sharded) parameters of the 12B: one pre-norm per layer + the final norm.
REPLICATED_12B = 62 * H_12B + H_12B


def nvfp4(**kw) -> PrecisionConfig:
    return PrecisionConfig(format="nvfp4", name="nvfp4", **kw)


def bf16_layers(plan) -> list[int]:
    return [row["index"] for row in plan["layers"] if row["precision"] == "bf16"]


@pytest.fixture(scope="module")
def plan_12b_nvfp4(parallel_context):
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


def test_12b_bf16_last_4_moves_layers_54_to_57(parallel_context, plan_12b_nvfp4):
    cfg = train_config("nemotron_h_12b", nvfp4(bf16_last_layers=4), tensor=4)
    plan = build_plan(cfg)
    assert bf16_layers(plan) == [0, 1, 58, 59, 60, 61]
    # 4 layers x 2 linears move: 104 + 8 = 112 NVFP4, 20 - 8 = 12 BF16 (not 108 / 16).
    assert plan["linear_counts"] == {"nvfp4": 112, "bf16": 12}
    before = {r["index"]: r["precision"] for r in plan_12b_nvfp4["layers"]}
    moved = [i for i, r in enumerate(plan["layers"]) if r["precision"] != before[i]]
    assert moved == [54, 55, 56, 57]


def test_bf16_and_fp8_plans(parallel_context):
    plan = build_plan(train_config("nemotron_h_12b", PrecisionConfig()))
    assert plan["linear_counts"] == {"bf16": 124}
    fp8 = PrecisionConfig(format="fp8", name="fp8", bf16_first_layers=1, bf16_last_layers=2)
    plan = build_plan(train_config("nemotron_h_12b", fp8))
    assert bf16_layers(plan) == [0, 60, 61]
    assert plan["linear_counts"] == {"bf16": 6, "fp8": 118}


def test_12b_mxfp8_te_weight_cache_is_one_byte_and_a_scale_per_32(parallel_context):
    """precision=mxfp8 (every layer MXFP8) on TE: each GEMM weight cached row- and column-wise,
    1 B per element + one E8M0 scale byte per 32 each, / tensor 4: what quantize_mxfp8 stores
    too. NVFP4 on the same linears caches 2 x (0.5 + 1/16) B: MXFP8's cache is 11/6 of it."""
    from model.memory_model import QUANTIZED_BYTES_PER_ELEMENT
    from nvfp4_recipe import quantize_mxfp8

    q = quantize_mxfp8(torch.randn(64, 256))
    stored = q.data.numel() * q.data.element_size() + q.scales.numel() * q.scales.element_size()
    assert stored / (64 * 256) == QUANTIZED_BYTES_PER_ELEMENT["mxfp8"] == 1 + 1 / 32

    kw = dict(tensor=4, seq_length=8192, micro_batch_size=1, global_batch_size=16)
    every = dict(bf16_first_layers=0, bf16_last_layers=0)
    mx = build_plan(train_config("nemotron_h_12b", PrecisionConfig(name="mxfp8", format="mxfp8",
                                                                   **every), **kw),
                    PlanConfig(backend="te"))
    assert mx["linear_counts"] == {"mxfp8": 124}
    # 28 Mamba (in_proj + out_proj), 28 MLP (fc1 + fc2), 6 attention (qkv + proj) layers
    weights = (28 * (115_998_720 + 10_240 * 5_120) + 28 * 2 * 5_120 * 20_480
               + 6 * (5_120 * 7_168 + 5_120 * 5_120))
    (stage,) = mx["memory"]["stages"]
    assert stage["te_weight_cache_bytes"] == round(weights / 4 * 2 * (1 + 1 / 32))
    (nv_stage,) = build_plan(train_config("nemotron_h_12b", nvfp4(**every), **kw),
                             PlanConfig(backend="te"))["memory"]["stages"]
    assert nv_stage["te_weight_cache_bytes"] == round(weights / 4 * 2 * (0.5 + 1 / 16))
    # The activations differ by the linears' saved inputs, which TE keeps quantized (one
    # column-wise copy, no sequence parallelism here): (1 + 1/32) - (0.5 + 1/16) B per element of
    # in_proj's and fc1's and qkv's inputs (h), out_proj's (d_inner / 4), fc2's (f / 4) and the
    # attention output projection's (40 x 128 / 4, a copy beside the BF16 attention output).
    saved_inputs = (28 * (5_120 + 10_240 / 4) + 28 * (5_120 + 20_480 / 4)
                    + 6 * (5_120 + 40 * 128 / 4))
    assert stage["kept_per_micro_batch_bytes"] - nv_stage["kept_per_micro_batch_bytes"] == \
        8192 * saved_inputs * ((1 + 1 / 32) - (0.5 + 1 / 16))
    assert stage["static_bytes"] - nv_stage["static_bytes"] == \
        stage["te_weight_cache_bytes"] - nv_stage["te_weight_cache_bytes"]
    # MXFP4 has no TE recipe: a TE plan of it is refused, naming the way out.
    with pytest.raises(ValueError, match="mxfp4 linears do not run on TE"):
        build_plan(train_config("nemotron_h_12b", PrecisionConfig(name="mxfp4", format="mxfp4"),
                                **kw), PlanConfig(backend="te"))


# -- memory -------------------------------------------------------------------------------------


def elements_12b(kind: str, t: int, sp: bool) -> float:
    """Hand count of the BF16 activation elements per token one 12B layer keeps (model/memory_model.py):
    the h-wide norm input and first-linear input are / t only with sequence parallelism."""
    h = 2 * H_12B / (t if sp else 1)
    inner = {"mamba": (2 * 10240 + 2 * 8 * 128 + 128) + (10240 + 2 * 8 * 128) + 10240 + 10240,
             "attention": (40 + 2 * 8) * 128 + 40 * 128,
             "mlp": 2 * 20480}[kind]
    return h + inner / t


def test_memory_scales_with_tensor_parallel(parallel_context):
    kw = dict(seq_length=8192, micro_batch_size=1, global_batch_size=8)
    t1 = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=1, **kw),
                    PlanConfig(backend="te"))
    t4 = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=4, **kw),
                    PlanConfig(backend="te"))
    # Weights: TP-sharded parameters exactly / 4, the replicated norms whole.
    assert t1["parameters_per_rank"] == P_12B
    assert t4["parameters_per_rank"] == (P_12B - REPLICATED_12B) // 4 + REPLICATED_12B
    assert (P_12B - REPLICATED_12B) % 4 == 0
    m1, m4 = t1["memory"], t4["memory"]
    # megatron's 18 B/param without the distributed optimizer: BF16 weights 2, FP32 grads 4,
    # FP32 master + Adam 12 (theoretical_memory_usage.py:293-296).
    assert m1["weights_bf16_gib"] == pytest.approx(2 * P_12B / 2**30, abs=1e-3)
    assert m1["main_grads_fp32_gib"] == pytest.approx(4 * P_12B / 2**30, abs=1e-3)
    assert m1["optimizer_fp32_gib"] == pytest.approx(12 * P_12B / 2**30, abs=1e-3)
    for key in ("weights_bf16_gib", "main_grads_fp32_gib", "optimizer_fp32_gib",
                "te_weight_cache_gib", "logits_gib"):
        assert m4[key] == pytest.approx(m1[key] / 4, rel=2e-3), key
    # Without sequence parallelism only the TP-sharded activations are / 4.
    assert not m4["sequence_parallel"]
    for kind in ("mamba", "attention", "mlp"):
        for plan, t in ((t1, 1), (t4, 4)):
            expected = elements_12b(kind, t, sp=False) * 8192 * 2 / 2**30
            assert plan["memory"]["activations_per_layer_gib"][kind] == pytest.approx(
                expected, abs=1e-3), (kind, t)
    assert t4["memory_per_rank_gib"] < t1["memory_per_rank_gib"] / 3


def test_sequence_parallel_divides_every_activation(parallel_context):
    """Korthikanti et al. 2022: with sequence parallelism the norm inputs and the first linear's
    input are sharded over the TP ranks too, so every activation term is / t."""
    kw = dict(tensor=4, seq_length=8192, micro_batch_size=1, global_batch_size=8)
    plain = build_plan(train_config("nemotron_h_12b", nvfp4(), **kw), PlanConfig(backend="te"))
    cfg = train_config("nemotron_h_12b", nvfp4(), **kw)
    cfg.parallel.sequence = True
    sp = build_plan(cfg, PlanConfig(backend="te"))
    assert sp["memory"]["sequence_parallel"]
    for kind in ("mamba", "attention", "mlp"):
        expected = elements_12b(kind, 4, sp=True) * 8192 * 2 / 2**30
        assert sp["memory"]["activations_per_layer_gib"][kind] == pytest.approx(expected,
                                                                                abs=1e-3)
    # Per layer its norm's input (h, BF16) and its norm-fused first linear's (h): 3/4 of 2 B
    # each saved on the 10 BF16 layers and the final-norm / output-layer inputs; on the 52 NVFP4
    # layers TE keeps that linear's input as one column-wise NVFP4 copy of h without sequence
    # parallelism, two copies (row-wise too, for the all-gather) of h / 4 with it.
    n = 0.5 + 1 / 16
    saved = ((10 + 1) * 2 * H_12B * 0.75 * 2
             + 52 * (H_12B * 0.75 * 2 + H_12B * (n - 2 * n / 4))) * 8192 / 2**30
    assert plain["memory"]["activations_gib"] - sp["memory"]["activations_gib"] == \
        pytest.approx(saved, abs=2e-3)
    assert sp["memory"]["static_gib"] == plain["memory"]["static_gib"]
    # At tensor 1 sequence parallelism changes nothing (megatron turns it off there).
    one = train_config("nemotron_h_12b", nvfp4(), tensor=1, seq_length=8192, micro_batch_size=1)
    one.parallel.sequence = True
    assert not build_plan(one)["memory"]["sequence_parallel"]


def test_12b_paper_layout_every_term(parallel_context):
    """The experiment recipe as Hydra composes it (tensor 4 + sequence parallel + distributed
    optimizer over 184 data-parallel ranks, TE GEMMs): each term of the per-rank plan by hand."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train",
                                          overrides=["experiment=nemotron_h_12b_nvfp4_10t"]))
    assert (cfg.parallel.tensor, cfg.parallel.sequence, cfg.trainer.distributed_optimizer,
            cfg.trainer.recompute, cfg.plan.gpus, cfg.plan.backend) == (4, True, True, "none",
                                                                        736, "te")
    plan = build_plan(cfg)
    mem = plan["memory"]
    pr = (P_12B - REPLICATED_12B) // 4 + REPLICATED_12B
    gib = 2**30
    assert mem["weights_bf16_gib"] == pytest.approx(2 * pr / gib, abs=1e-3)
    assert mem["main_grads_fp32_gib"] == pytest.approx(4 * pr / gib, abs=1e-3)
    # 12 B over the 184 data-parallel ranks: 0.19 GiB instead of 34.4.
    assert mem["optimizer_fp32_gib"] == pytest.approx(12 * math.ceil(pr / 184) / gib, abs=1e-3)
    # TE's NVFP4 weight copies: 23 Mamba + 23 MLP + 6 attention layers are NVFP4 (2-53), each
    # weight element 2 x (0.5 + 1/16) B (row- and column-wise FP4 + E4M3 block scales), / 4.
    nvfp4_weights = (23 * (115_998_720 + 10_240 * 5_120) + 23 * 2 * 5_120 * 20_480
                     + 6 * (5_120 * 7_168 + 5_120 * 5_120))
    assert mem["te_weight_cache_gib"] == pytest.approx(nvfp4_weights / 4 * 1.125 / gib, abs=1e-3)
    # Activations, one micro-batch in flight (pipeline 1): every layer + the final-norm and
    # output-layer inputs, all / 4; logits 8192 x 131072 / 4 x (2 B BF16 + 4 B FP32). BF16
    # elements (2 B) but for the NVFP4 layers' linear inputs, which TE keeps quantized: the
    # norm-fused in_proj / fc1 / qkv input (h / 4) as two NVFP4 copies (sequence parallel),
    # out_proj's (d_inner / 4) and fc2's (f / 4) as one, and the attention output projection's
    # (40 x 128 / 4) as one beside the BF16 attention output.
    n = 0.5 + 1 / 16
    nvfp4_bytes = {
        "mamba": 2 * elements_12b("mamba", 4, True) - (2 - 2 * n) * 1_280 - (2 - n) * 2_560,
        "mlp": 2 * elements_12b("mlp", 4, True) - (2 - 2 * n) * 1_280 - (2 - n) * 5_120,
        "attention": 2 * elements_12b("attention", 4, True) - (2 - 2 * n) * 1_280 + n * 1_280,
    }
    per_token_bytes = (5 * 2 * elements_12b("mamba", 4, True) + 5 * 2 * elements_12b("mlp", 4, True)
                       + 23 * nvfp4_bytes["mamba"] + 23 * nvfp4_bytes["mlp"]
                       + 6 * nvfp4_bytes["attention"] + 2 * 2 * H_12B / 4)
    assert mem["activations_gib"] == pytest.approx(per_token_bytes * 8192 / gib, abs=2e-3)
    assert mem["logits_gib"] == pytest.approx(8192 * 131072 / 4 * 6 / gib, abs=1e-3)
    assert mem["transient_gib"] == 0  # TE's FusedAdam steps in place
    assert mem["peak_phase"] == "end of forward"
    assert plan["memory_per_rank_gib"] == pytest.approx(
        mem["static_gib"] + mem["activations_gib"] + mem["logits_gib"], abs=0.01)
    assert 30 < plan["memory_per_rank_gib"] < 40  # 31.95 GiB: the README and the recipe say so


def test_recompute_accounting_by_hand():
    """Five layers of 10..50 bytes, an input of 1 byte: what each split keeps and its peak."""
    from model.memory_model import stage_activation_bytes
    from model.recompute import RecomputeConfig

    layers = [10, 20, 30, 40, 50]
    assert stage_activation_bytes(layers, 1, RecomputeConfig("none")) == {
        "kept": 150, "recompute_peak": 0}
    # Selective changes nothing here: the counted kernels keep only their inputs already.
    assert stage_activation_bytes(layers, 1, RecomputeConfig("selective")) == {
        "kept": 150, "recompute_peak": 0}
    # uniform 2: chunks [0,2) [2,4) [4,5) keep 1 byte each; chunk [2,4)'s backward holds the
    # input of chunk [0,2) + its own 30 + 40: 71 (the last chunk: 2 + 50 = 52).
    assert stage_activation_bytes(layers, 1, RecomputeConfig("full", "uniform", 2)) == {
        "kept": 3, "recompute_peak": 71}
    # block 2: layers 0 and 1 keep their inputs, 2-4 everything (120); by the time layer 1 is
    # recomputed the later layers are freed: 1 (layer 0's input) + 20.
    assert stage_activation_bytes(layers, 1, RecomputeConfig("full", "block", 2)) == {
        "kept": 122, "recompute_peak": 21}


def test_recompute_pipeline_and_data_parallel(parallel_context):
    kw = dict(seq_length=8192, micro_batch_size=1, global_batch_size=16)
    cfg = train_config("nemotron_h_12b", nvfp4(), tensor=4, **kw)
    plain = build_plan(cfg, PlanConfig(backend="te"))
    cfg.trainer.recompute = "full"  # uniform, 1 layer per chunk
    full = build_plan(cfg, PlanConfig(backend="te"))
    mem, per_layer = full["memory"], plain["memory"]["activations_per_layer_gib"]
    layer_input = 8192 * H_12B * 2 / 2**30
    # Kept: each of the 62 layers' input + the final-norm / output-layer inputs (2 h).
    assert mem["activations_gib"] == pytest.approx(64 * layer_input, abs=2e-3)
    # The most alive during a layer's recompute: the inputs of the layers before it + its full
    # activations. Layer 61 (MLP, 2h + 2f/4 = 20,480 per token) with 61 inputs beats layer 60
    # (Mamba, 24,096) with 60: 61 x 0.078 + 0.3125 = 5.078 GiB.
    assert per_layer["mlp"] + layer_input > per_layer["mamba"]
    assert mem["recompute_peak_gib"] == pytest.approx(61 * layer_input + per_layer["mlp"],
                                                      abs=2e-3)
    assert mem["activations_gib"] < plain["memory"]["activations_gib"] / 3
    assert full["memory_per_rank_gib"] < plain["memory_per_rank_gib"]
    # The emulated backend's optimizer step: torch's foreach AdamW allocates 4 B per optimizer
    # element; the distributed optimizer divides those elements by the data-parallel size.
    emu = build_plan(cfg, PlanConfig(gpus=8, backend="emulated"))
    pr = emu["memory"]["parameters_per_rank"]
    assert emu["memory"]["transient_gib"] == pytest.approx(4 * pr / 2**30, abs=1e-3)
    cfg.trainer.distributed_optimizer = True
    sharded = build_plan(cfg, PlanConfig(gpus=8, backend="emulated"))
    assert sharded["memory"]["optimizer_sharded_over"] == 2
    assert sharded["memory"]["transient_gib"] == pytest.approx(4 * pr / 2 / 2**30, abs=1e-3)
    assert sharded["memory"]["optimizer_fp32_gib"] == pytest.approx(12 * pr / 2 / 2**30, abs=1e-3)
    # The emulated NVFP4 linears save their quantized BF16 weight for Dgrad, per micro-batch:
    # 2 B x the 9,074,769,920 NVFP4 GEMM weights (test_12b_paper_layout_every_term) / 4; and
    # their BF16 inputs where TE keeps NVFP4 copies (0.5 + 1/16 B; no sequence parallelism):
    # in_proj + out_proj (5,120 + 2,560), fc1 + fc2 (5,120 + 5,120) and qkv (5,120) per token,
    # less the attention projection's input copy TE keeps on top (1,280).
    cfg.trainer.recompute = "none"
    emu = build_plan(cfg, PlanConfig(backend="emulated"))
    n = 0.5 + 1 / 16
    inputs = 8192 * ((2 - n) * (23 * 7_680 + 23 * 10_240 + 6 * 5_120) - n * 6 * 1_280)
    assert emu["memory"]["activations_gib"] - plain["memory"]["activations_gib"] == \
        pytest.approx((2 * 9_074_769_920 / 4 + inputs) / 2**30, abs=2e-3)
    assert emu["memory"]["te_weight_cache_gib"] == 0
    # Pipeline 2 (62 layers split 31/31): the first stage holds 2 micro-batches in flight.
    pp = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=4, pipeline=2, **kw))
    stages = pp["memory"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 30], [31, 61]]
    assert [s["in_flight_micro_batches"] for s in stages] == [2, 1]
    assert stages[0]["activation_bytes"] == 2 * stages[0]["kept_per_micro_batch_bytes"]
    assert pp["parameters_per_rank"] < plain["parameters_per_rank"] * 0.6
    with pytest.raises(ValueError, match="plan.gpus"):
        build_plan(cfg, PlanConfig(gpus=6))
    with pytest.raises(ValueError, match="global_batch_size"):
        build_plan(cfg, PlanConfig(gpus=4 * 32))
    with pytest.raises(ValueError, match="trainer.recompute"):
        cfg.trainer.recompute = "layers"
        build_plan(cfg)


def test_pipeline_stages_mirror_megatron():
    assert pipeline_stages(62, 1) == [range(62)]
    assert pipeline_stages(62, 2) == [range(0, 31), range(31, 62)]
    assert pipeline_stages(62, 4, first=14, last=18) == [range(0, 14), range(14, 29),
                                                         range(29, 44), range(44, 62)]
    with pytest.raises(ValueError, match="first_stage_layers"):
        pipeline_stages(62, 4)


# -- FLOPs and time -----------------------------------------------------------------------------


def test_flops_hand_count_of_a_tiny_model():
    """model/flops.py against a count by hand: pattern M*-, h 16, f 32, 2 query heads / 1 KV
    head of 8, 4 Mamba heads of 8 (d_inner 32), state 4, 2 groups, chunk 8, vocab 128, s 64."""
    from model.config import ModelConfig
    from model.flops import flops_per_token, flops_per_token_terms

    m = ModelConfig(pattern="M*-", hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                    num_query_groups=1, kv_channels=8, mamba_num_heads=4, mamba_head_dim=8,
                    mamba_state_dim=4, mamba_num_groups=2, mamba_chunk_size=8)
    # GEMM weights: Mamba in_proj 16 x (2*32 + 2*2*4 + 4) = 1344, out_proj 32 x 16 = 512;
    # attention qkv 16 x (16 + 2*8) = 512, proj 16 x 16 = 256; MLP 2 x 16 x 32 = 1024;
    # output layer 16 x 128 = 2048. Sum 5696, x 6 = 34,176.
    # Attention: 6 x 2 heads x 8 x 64 = 6,144.
    # SSD scan: 3 x [2*2*8*4 (C B^T) + 4 x (2*8*8 (scores x) + 4*4*8 (states, read-out))]
    #         = 3 x (128 + 4 x 256) = 3,456.
    # conv1d: 3 x 2 x 4 x (32 + 2*2*4) = 1,152.
    assert flops_per_token_terms(m, 64, 128) == {"gemm": 34_176.0, "attention": 6_144.0,
                                                 "ssd_scan": 3_456.0, "conv1d": 1_152.0,
                                                 "total": 44_928.0}
    assert flops_per_token(m, 64, 128) == 44_928.0


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
    # 6 attention layers x 6 x 40 heads x 128 x 8192.
    assert plan["flops"]["attention_per_token"] == 6 * 6 * 40 * 128 * 8192
    # The bench's MFU counts the same FLOPs (one function, model/flops.py).
    from benchmarks.hardware import flops_per_token as bench_flops_per_token

    assert bench_flops_per_token(model_config("nemotron_h_12b"), 8192, 131072) == \
        plan["flops_per_token"]
    tm = plan["time"]
    assert tm["gpus"] == 736 and tm["data"] == 184
    expected = plan["flops_per_token"] * 1e13 / (736 * 2500e12 * 0.4)
    assert tm["seconds"] == pytest.approx(expected, rel=1e-6)
    assert 10 < tm["days"] < 13


# -- plan.json and dry_run ----------------------------------------------------------------------


def test_dry_run_writes_plan_json_and_nothing_else(parallel_context, tmp_path, capsys):
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
    from training.plan import PlanConfig as Plan

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


# -- the CPU measurement's helpers (python -m benchmarks.memory --measure) -------------------------


def test_saved_activation_bytes_counts_each_storage_once():
    """Layer 0 (a linear on a 3 x 4 FP32 input) saves its input, 48 B; layer 1 (ReLU) its 3 x 8
    output, 96 B; the head's linear saves that same output again (not counted twice) and its
    weight (a parameter, not counted); the loss's square saves the 3 x 2 output, 24 B."""
    import torch

    from benchmarks.memory import saved_activation_bytes

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8, bias=False),
                                               torch.nn.ReLU()])
            self.head = torch.nn.Linear(8, 2, bias=False)

        def forward(self, tokens, _a, _b, labels):
            for layer in self.layers:
                tokens = layer(tokens)
            return (self.head(tokens) ** 2).sum()

    saved = saved_activation_bytes(Tiny(), ["mlp", "mamba"],
                                   {"tokens": torch.randn(3, 4), "labels": None})
    assert saved == {"per_layer_by_kind": {"mlp": 48, "mamba": 96}, "head": 24, "total": 168}


def test_calibrated_activations_apply_the_plan_formulas():
    """Pattern M- saving 2 and 1 MiB, head 0.5 MiB, 1 x 4 tokens of h 8 (a layer input 64 B),
    vocabulary 16 (BF16 logits 128 B)."""
    from benchmarks.memory import calibrated_activations_gib

    mib, gib = 2**20, 2**30
    none = {"saved_per_layer_mib": {"mamba": 2.0, "mlp": 1.0}, "saved_head_mib": 0.5}

    def result(recompute):
        return {"config": {"pattern": "M-", "micro_batch_size": 1, "seq_length": 4,
                           "hidden_size": 8, "vocab_size": 16, "recompute": recompute}}

    # none: both layers kept + the head at the end of the forward.
    assert calibrated_activations_gib(result("none"), none) * gib == 3.5 * mib + 128
    # full: the layers keep 64 B inputs; recomputing the Mamba layer holds its 2 MiB.
    assert calibrated_activations_gib(result("full"), none) * gib == 2 * mib
    # selective keeping 0.25 MiB of the Mamba layer: kept 1.25 + head 0.5 MiB + 128 B is less
    # than the 2 MiB the Mamba layer holds again while its backward runs.
    sel = {"saved_per_layer_mib": {"mamba": 0.25, "mlp": 1.0}}
    assert calibrated_activations_gib(result("selective"), none, sel) * gib == 2 * mib


def test_memory_benchmark_refuses_a_bad_setting_before_it_starts_a_run(capsys):
    """`python -m benchmarks.memory`: without --measure it prints its help (exit 2); a bad
    --recompute in a list fails at once, before any setting's subprocess runs."""
    from benchmarks.memory import main

    assert main([]) == 2
    assert "--measure" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--recompute='sometimes'"):
        main(["--measure", "--recompute", "none,sometimes"])


def _demo_kept_bytes(precision: PrecisionConfig, backend: str, tensor: int = 1,
                     sequence: bool = False) -> int:
    cfg = train_config("demo", precision, tensor=tensor, seq_length=256, micro_batch_size=1,
                       global_batch_size=8)
    cfg.parallel.sequence = sequence
    (stage,) = build_plan(cfg, PlanConfig(backend=backend))["memory"]["stages"]
    return stage["kept_per_micro_batch_bytes"]


def test_te_plan_counts_the_quantized_inputs_te_saves_for_wgrad(parallel_context):
    """The demo model (h 256, f 1024, 32 Mamba heads x 16 = d_inner 512, 2 groups x state 64,
    8 query heads of 32 with 2 KV groups; 4 Mamba, 4 MLP, 1 attention layer), 256 tokens, no
    recompute, every layer low precision, counted by hand. TE keeps each quantized linear's
    input as its Wgrad copy (model/memory_model.py): 1 + 1/32 B per element in MXFP8, 0.5 + 1/16
    in NVFP4, twice for the norm-fused linears under sequence parallelism; the emulation keeps
    BF16 inputs (2 B)."""
    every = dict(bf16_first_layers=0, bf16_last_layers=0)
    tokens, head = 256, 2 * 256 * 256 * 2  # the final-norm and output-layer inputs, BF16
    # BF16 elements per token: norm in, in_proj in, in_proj out, conv out, scan out, out_proj in
    mamba = [256, 256, 2 * 512 + 256 + 32, 512 + 256, 512, 512]
    mlp = [256, 256, 1024, 1024]  # norm in, fc1 in, fc1 out, activation out = fc2 in
    attention = [256, 256, (8 + 4) * 32, 8 * 32]  # norm in, qkv in, qkv out, context = proj in

    def kept(per_token_bytes: dict[str, float]) -> int:
        return round(tokens * (4 * per_token_bytes["mamba"] + 4 * per_token_bytes["mlp"]
                               + per_token_bytes["attention"])) + head

    bf16 = {"mamba": 2 * sum(mamba), "mlp": 2 * sum(mlp), "attention": 2 * sum(attention)}
    assert bf16 == {"mamba": 7_232, "mlp": 5_120, "attention": 2_304}
    assert _demo_kept_bytes(PrecisionConfig(), "te") == kept(bf16)

    q = 1 + 1 / 32  # MXFP8
    mxfp8 = {"mamba": 2 * sum(mamba) - (2 - q) * (256 + 512),  # in_proj in, out_proj in
             "mlp": 2 * sum(mlp) - (2 - q) * (256 + 1024),  # fc1 in, fc2 in
             # qkv in quantized; the projection's quantized input beside attention's BF16 output
             "attention": 2 * sum(attention) - (2 - q) * 256 + q * 256}
    assert mxfp8 == {"mamba": 6_488, "mlp": 3_880, "attention": 2_320}
    mx = PrecisionConfig(name="mxfp8", format="mxfp8", **every)
    assert _demo_kept_bytes(mx, "te") == kept(mxfp8)
    assert _demo_kept_bytes(mx, "emulated") == kept(bf16)  # nvfp4_recipe/linear.py keeps BF16 x

    # NVFP4, tensor 2 with sequence parallelism: h-wide terms / 2 as well; in_proj and fc1 and
    # qkv (norm fused) keep the row-wise NVFP4 copy too, for the all-gather.
    n = 0.5 + 1 / 16
    mamba_sp = [128, 128, 1312 / 2, 768 / 2, 512 / 2, 512 / 2]
    mlp_sp, attention_sp = [128, 128, 512, 512], [128, 128, 384 / 2, 256 / 2]
    nvfp4_sp = {"mamba": 2 * sum(mamba_sp) - (2 - 2 * n) * 128 - (2 - n) * 256,
                "mlp": 2 * sum(mlp_sp) - (2 - 2 * n) * 128 - (2 - n) * 512,
                "attention": 2 * sum(attention_sp) - (2 - 2 * n) * 128 + n * 128}
    sp_head = 2 * 256 * 128 * 2
    nv = PrecisionConfig(name="nvfp4", format="nvfp4", **every)
    assert _demo_kept_bytes(nv, "te", tensor=2, sequence=True) == \
        kept(nvfp4_sp) - head + sp_head


def test_te_saved_input_bytes_follow_the_wgrad_pass():
    """The saved input is the Wgrad operand: a per-pass map keeps its Wgrad format's copy, a BF16
    Wgrad the BF16 input; only NVFP4's norm-fused linears keep two copies under sequence
    parallelism (MXFP8 and FP8 block gather column-wise data: layernorm_linear.py)."""
    from model.memory_model import te_saved_input_bytes

    assert te_saved_input_bytes("mxfp8", False, False) == 1 + 1 / 32
    assert te_saved_input_bytes("mxfp8/nvfp4/nvfp4", False, False) == 0.5 + 1 / 16
    assert te_saved_input_bytes("nvfp4/nvfp4/bf16", True, True) == 2
    assert te_saved_input_bytes("bf16", True, True) == 2
    assert te_saved_input_bytes("nvfp4", True, True) == 2 * (0.5 + 1 / 16)
    assert te_saved_input_bytes("nvfp4", False, True) == 0.5 + 1 / 16  # row-parallel
    assert te_saved_input_bytes("mxfp8", True, True) == 1 + 1 / 32
    assert te_saved_input_bytes("fp8", True, True) == 1.0


def test_the_emulated_plan_counts_fprops_weight_copy_only_where_dgrad_keeps_it():
    """nvfp4_recipe/linear.py keeps Fprop's weight copy for Dgrad only where Dgrad reads it
    (tests/nvfp4_recipe/test_linear_passes.py checks the saved tensors): NVFP4 with 16x16 tiles
    and FP8 blocks, under one format for both passes; never MX formats or 1x16 NVFP4."""
    from model.memory_model import emulated_keeps_weight_copy

    assert emulated_keeps_weight_copy("nvfp4", weight_2d=True)
    assert emulated_keeps_weight_copy("fp8", weight_2d=False)
    assert not emulated_keeps_weight_copy("nvfp4", weight_2d=False)
    assert not any(emulated_keeps_weight_copy(f, True) for f in ("mxfp8", "mxfp4"))
    assert not emulated_keeps_weight_copy("mxfp8/nvfp4/nvfp4", True)  # Dgrad is another format
    assert emulated_keeps_weight_copy("nvfp4/nvfp4/bf16", True)
