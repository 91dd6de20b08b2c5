"""MoE layers (`E` in model.pattern, model/moe.py): the schema's refusals, the built layer against
a reference written from the routing rule (sigmoid scores, expert bias for the choice only, top-k
normalised and scaled, squared-ReLU experts, a shared expert), the expert bias moving against the
load, every expert linear in the precision policy (names, overrides by glob, the held list), the
router in FP32, the TE spec's refusal, and Nemotron 3 Nano's parameter counts against
transformers' NemotronH and the published numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from errors import ConfigError
from helpers import model_config
from model.config import ModelConfig, MoEConfig, linear_names, precision_policy
from nvfp4_recipe.policy import PrecisionConfig

MOE = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=64, shared_expert_ffn_hidden_size=32,
                score_function="sigmoid", topk_scaling_factor=2.5, expert_bias=True,
                load_balancing="seq_aux_loss", aux_loss_coeff=1e-2)
# 16 Mamba heads: the in_proj width (592) is a multiple of NVFP4's 16-element block.
TINY = ModelConfig(pattern="ME*E", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=16, mamba_head_dim=16,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=256,
                   bf16_first_layers=0, bf16_last_layers=0, spec="portable", moe=MOE)
NVFP4 = PrecisionConfig(name="nvfp4", format="nvfp4")


def _build(model: ModelConfig = TINY, precision: PrecisionConfig = PrecisionConfig(), seed=0):
    from model.build import build_model

    torch.manual_seed(seed)
    return build_model(model, precision, vocab_size=256, backend="emulated")


# -- the schema ------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    (dict(moe=None), "model.pattern='ME*E' has MoE layers ('E') but model.moe is not set"),
    (dict(pattern="M-*-"), "model.moe is set (num_experts=4) but model.pattern='M-*-' has no "
                           "MoE layer ('E')"),
])
def test_e_and_the_moe_fields_come_together(change, message):
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(TINY, **change)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("fields,message", [
    (dict(num_experts=4, topk=5), "model.moe.topk=5 is above model.moe.num_experts=4"),
    (dict(num_experts=0), "model.moe.num_experts=0 must be >= 1"),
    (dict(aux_loss_coeff=-1.0), "model.moe.aux_loss_coeff=-1.0 must be >= 0"),
    (dict(shared_expert_ffn_hidden_size=0), "model.moe.shared_expert_ffn_hidden_size=0 must be"),
    (dict(expert_bias=True, score_function="softmax"),
     "model.moe.expert_bias=true needs model.moe.score_function=sigmoid (got softmax)"),
    (dict(score_function="relu"), "model.moe.score_function='relu': choose one of"),
])
def test_moe_fields_out_of_range_are_refused_naming_them(fields, message):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**fields)
    assert str(err.value).startswith(message)


def test_recipes_compose_with_their_moe_fields():
    from train_helpers import compose_train

    cfg = compose_train("model=demo_moe")
    assert cfg.model.moe.num_experts == 8 and cfg.model.pattern.count("E") == 4
    assert compose_train().model.moe is None  # the dense demo


# -- the layer against the routing rule -----------------------------------------------------------


def _linear_bf16(x, w):
    """An emulated linear in BF16: BF16 operands, the product rounded to BF16 (parallel_linear.py
    computes in COMPUTE_DTYPE and returns the input's dtype)."""
    return F.linear(x.bfloat16(), w.bfloat16()).float()


def reference_moe(layer, x: torch.Tensor) -> torch.Tensor:
    """Nemotron 3's MoE from the rule (transformers' NemotronHTopkRouter/NemotronHMoE state it the
    same way): FP32 logits, sigmoid scores, the experts chosen on scores + expert bias, their
    scores normalised to sum 1 and scaled, each expert fc2(relu(fc1 x)^2), plus the shared
    expert."""
    moe = layer.mlp
    tokens = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(tokens @ moe.router.weight.float().t())
    chosen = torch.topk(scores + moe.router.expert_bias, MOE.topk, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * MOE.topk_scaling_factor
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(moe.experts.local_experts):
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        hidden = torch.relu(_linear_bf16(tokens[rows], expert.linear_fc1.weight)) ** 2
        out[rows] += _linear_bf16(hidden * weights[rows, slot, None],
                                  expert.linear_fc2.weight)
    shared = moe.shared_experts
    out += _linear_bf16(torch.relu(_linear_bf16(tokens, shared.linear_fc1.weight)) ** 2,
                        shared.linear_fc2.weight)
    return out.reshape(x.shape)


def test_the_moe_layer_routes_as_the_rule(parallel_context):
    built = _build()
    layer = built.module.decoder.layers[1]
    with torch.no_grad():  # a bias that changes which experts win
        layer.mlp.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(16, 2, 64)
    with torch.no_grad():
        ours, _ = layer.mlp(x)
        theirs = reference_moe(layer, x)
    # BF16 GEMMs on both sides; the routing weight is applied before fc2 in megatron's expert
    # (one more BF16 rounding of fc2's input): a few BF16 ulps of the output's scale.
    scale = theirs.abs().max()
    assert torch.allclose(ours, theirs, atol=2e-2 * scale, rtol=0)
    # The bias matters: without it other experts win for some tokens and the output moves.
    with torch.no_grad():
        layer.mlp.router.expert_bias.zero_()
        moved = (reference_moe(layer, x) - theirs).abs().max()
    assert moved > 10 * 2e-2 * scale


def test_the_tokens_go_through_megatrons_all_to_all_dispatcher_on_cpu(parallel_context):
    """The dispatcher a GPU runs (megatron's all-to-all, its stages and split bookkeeping), here
    over the CPU: built without a CUDA stream (compat item 11), its device-to-host step the
    portable one (model/moe.py), and the same output as the all-gather dispatcher's."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                                MoEAlltoAllTokenDispatcher)

    from model.moe import PortableAlltoAllTokenDispatcher

    built = _build()
    layer = built.module.decoder.layers[1].mlp
    assert layer.config.moe_token_dispatcher_type == "alltoall"
    assert type(layer.token_dispatcher) is PortableAlltoAllTokenDispatcher
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None or torch.cuda.is_available()
    x = torch.randn(16, 2, 64)
    dispatcher, points = layer.token_dispatcher, []
    portable_step = dispatcher._maybe_dtoh_and_synchronize

    def recorded(point, tokens_per_expert=None):
        points.append(point)
        return portable_step(point, tokens_per_expert)

    dispatcher._maybe_dtoh_and_synchronize = recorded
    with torch.no_grad():
        ours, _ = layer(x)
        # megatron's four device-to-host points of a dispatch and its combine (mc 0.16.1
        # token_dispatcher.py:629, 663, 704, 740)
        assert points == ["before_permutation_1", "before_ep_alltoall", "before_permutation_2",
                          "before_finish"]
        layer.token_dispatcher = MoEAllGatherTokenDispatcher(
            layer.num_local_experts, layer.local_expert_indices, config=layer.config,
            pg_collection=get_default_pg_collection())
        gathered, _ = layer(x)
    # at EP = TP = 1 both permute the tokens by expert the same way (the all-to-all's sort by
    # expert is the identity): the same arithmetic, bit for bit
    assert torch.equal(ours, gathered)


def test_the_portable_device_to_host_step_leaves_what_megatrons_copies_leave():
    """At the copy point megatron turns the all-to-all split sizes into numpy arrays
    (maybe_move_tensor_to_cpu(as_numpy=True), mc 0.16.1 token_dispatcher.py:879-887) and keeps
    the token counts as CPU tensors; on CPU tensors the portable step does the same, and nothing
    at the other points (EP = TP = 1 leaves the splits None: the EP=2 system tests run this)."""
    import numpy as np

    from model.moe import PortableAlltoAllTokenDispatcher

    dispatcher = _build().module.decoder.layers[1].mlp.token_dispatcher
    assert isinstance(dispatcher, PortableAlltoAllTokenDispatcher)
    dispatcher.routing_map = torch.zeros(4, 4, dtype=torch.bool)
    splits = {"input_splits": torch.tensor([3, 5]), "output_splits": torch.tensor([4, 6]),
              "output_splits_tp": torch.tensor([10])}
    for name, value in splits.items():
        setattr(dispatcher, name, value)
    counts = torch.tensor([1, 2, 3, 4])
    other = next(p for p in dispatcher.cuda_sync_point_priority if p != dispatcher.cuda_dtoh_point)
    assert dispatcher._maybe_dtoh_and_synchronize(other, counts) is counts
    assert all(torch.is_tensor(getattr(dispatcher, name)) for name in splits)
    assert dispatcher._maybe_dtoh_and_synchronize(dispatcher.cuda_dtoh_point, counts) is counts
    for name, value in splits.items():
        converted = getattr(dispatcher, name)
        assert isinstance(converted, np.ndarray) and converted.tolist() == value.tolist()


def test_expert_bias_moves_against_the_load(parallel_context):
    """Aux-loss-free balancing: after a step, megatron's update (finalize_model_grads ->
    get_updated_expert_bias) lowers the bias of the experts above the mean load and raises the
    others, by bias_update_rate."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    built = _build()
    router = built.module.decoder.layers[1].mlp.router
    tokens = torch.randint(0, 256, (2, 32))
    loss = built.module(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).mean()
    loss.backward()
    load = router.local_tokens_per_expert.clone()
    assert load.sum() == 2 * 32 * MOE.topk  # every token counted at each of its experts
    new = get_updated_expert_bias(load.clone(), router.expert_bias, MOE.bias_update_rate)
    expected = -torch.sign(load - load.mean()) * MOE.bias_update_rate
    assert torch.equal(new, expected)
    assert router.weight.dtype == torch.float32 and router.weight.grad is not None


# -- the precision policy over the experts ---------------------------------------------------------


def test_every_expert_linear_is_held_and_named_by_the_policy(parallel_context):
    built = _build(precision=NVFP4)
    names = [h.name for h in built.linears]
    experts = [f"layers.{i}.mlp.experts.local_experts.{e}.linear_fc{k}"
               for i in (1, 3) for e in range(4) for k in (1, 2)]
    shared = [f"layers.{i}.mlp.shared_experts.linear_fc{k}" for i in (1, 3) for k in (1, 2)]
    assert set(experts + shared) <= set(names)
    assert len(names) == 2 + 2 + 2 * (8 + 2)  # Mamba, attention, two MoE layers
    assert names == built.policy.names()  # pattern order, as the controller walks them
    held = {h.name: h.linear for h in built.linears}
    layer = built.module.decoder.layers[3]
    assert held["layers.3.mlp.experts.local_experts.2.linear_fc2"] is (
        layer.mlp.experts.local_experts[2].linear_fc2)
    assert all(str(h.format) == "nvfp4" for h in built.linears)
    assert not any("router" in n for n in names)  # the router stays FP32, outside the policy


def test_an_override_glob_reaches_one_expert(parallel_context):
    precision = dataclasses.replace(
        NVFP4, overrides={"layers.*.mlp.experts.local_experts.2.linear_fc1": "bf16",
                          "layers.3.mlp.shared_experts.*": "mxfp8"})
    built = _build(precision=precision)
    formats = {h.name: str(h.format) for h in built.linears}
    assert formats["layers.1.mlp.experts.local_experts.2.linear_fc1"] == "bf16"
    assert formats["layers.3.mlp.experts.local_experts.2.linear_fc1"] == "bf16"
    assert formats["layers.3.mlp.experts.local_experts.1.linear_fc1"] == "nvfp4"
    assert formats["layers.3.mlp.shared_experts.linear_fc2"] == "mxfp8"
    # The built linear runs what the policy says: no config for BF16, the MXFP8 one for MXFP8.
    held = {h.name: h.linear for h in built.linears}
    assert held["layers.3.mlp.experts.local_experts.2.linear_fc1"].gemm_config is None
    assert held["layers.3.mlp.experts.local_experts.1.linear_fc1"].gemm_config is not None
    assert str(held["layers.3.mlp.shared_experts.linear_fc1"].gemm_format) == "mxfp8"
    # ...and in the forward: the BF16 expert's output is its BF16 product, the NVFP4 one's not.
    x = torch.randn(32, 64)
    with torch.no_grad():
        for name, quantized in (("layers.3.mlp.experts.local_experts.2.linear_fc1", False),
                                ("layers.3.mlp.experts.local_experts.1.linear_fc1", True)):
            lin = held[name]
            out, _ = lin(x)
            exact = _linear_bf16(x, lin.weight)
            assert torch.equal(out, exact) != quantized


def test_an_nvfp4_moe_model_trains_a_step_in_the_emulation(parallel_context):
    """Forward and backward through emulated NVFP4 experts: every expert that received tokens
    gets a gradient, the loss is finite and close to the BF16 model's (same weights)."""
    losses = {}
    for name, precision in (("bf16", PrecisionConfig()), ("nvfp4", NVFP4)):
        built = _build(precision=precision, seed=3)
        torch.manual_seed(4)
        tokens = torch.randint(0, 256, (2, 64))
        loss = built.module(tokens, torch.arange(64).expand(2, 64), None, labels=tokens).mean()
        loss.backward()
        losses[name] = loss.item()
        router = built.module.decoder.layers[1].mlp.router
        for e, expert in enumerate(built.module.decoder.layers[1].mlp.experts.local_experts):
            got = router.local_tokens_per_expert[e] > 0
            assert (expert.linear_fc1.weight.grad is not None) == bool(got)
    assert abs(losses["nvfp4"] - losses["bf16"]) < 0.05 * losses["bf16"]
    assert losses["nvfp4"] != losses["bf16"]


# -- the TE spec -----------------------------------------------------------------------------------


def test_the_te_spec_refuses_moe_layers_naming_what_is_missing(parallel_context):
    from model.build import build_model
    from model.moe import te_moe_refusal

    message = te_moe_refusal(TINY)
    assert "TEGroupedMLP" in message and "#2971" in message and "model.spec=portable" in message
    assert "\n" not in message
    assert te_moe_refusal(dataclasses.replace(TINY, pattern="M*", moe=None)) is None
    with pytest.raises(ValueError, match="TEGroupedMLP"):
        build_model(dataclasses.replace(TINY, spec="auto"), NVFP4, vocab_size=256, backend="te")


def test_the_preflight_checks_every_expert_gemm(parallel_context):
    from helpers import train_config
    from training.preflight import preflight

    cfg = train_config("demo_moe", NVFP4)
    report = preflight(cfg, None, ("emulated",))
    names = {c.linear for c in report.checks}
    policy = precision_policy(cfg.model, cfg.precision)
    lowp = {n for n, f in policy.linear_formats().items() if f != "bf16"}
    assert {n for n in lowp if ".experts." in n} <= names
    assert report.refusal() is None
    # The TE spec does not build MoE layers: a dry run that could use TE plans the emulation.
    both = preflight(cfg, None, ("te", "emulated"))
    assert {c.backend for c in both.checks} == {"emulated"}


def test_the_plan_splits_routed_experts_and_counts_the_all_to_all(parallel_context, tmp_path):
    """demo_moe on 4 GPUs: its 4 MoE layers hold 8 routed experts of 2 x 256 x 256 weights each
    (4,194,304 in all); at expert parallel 4 a rank keeps a quarter of them, the distributed
    optimizer shards them over their own data-parallel group (4 / 4 = 1), and each micro-batch's
    tokens cross the ranks four times per MoE layer (dispatch and combine, forward and backward),
    3/4 of their top-2 copies to other ranks."""
    from helpers import train_config
    from training.plan import PlanConfig, build_plan

    cfg = train_config("demo_moe", PrecisionConfig(), micro_batch_size=2, global_batch_size=16,
                       run_dir=tmp_path)
    cfg.trainer.distributed_optimizer = True
    whole = build_plan(cfg, PlanConfig(gpus=4))
    cfg.parallel.expert_model_parallel_size = 4
    split = build_plan(cfg, PlanConfig(gpus=4))
    routed = 4 * 8 * 2 * 256 * 256
    assert whole["experts"]["expert_parameters_per_rank"] == routed
    assert split["experts"]["expert_parameters_per_rank"] == routed // 4
    assert whole["parameters_per_rank"] - split["parameters_per_rank"] == routed * 3 // 4
    assert split["parameters"] == whole["parameters"]  # the model is the same
    row_whole, row_split = whole["memory"]["stages"][0], split["memory"]["stages"][0]
    dense = whole["parameters_per_rank"] - routed
    assert row_whole["optimizer_elements_per_rank"] == -(-dense // 4) + -(-routed // 4)
    assert row_split["optimizer_elements_per_rank"] == -(-dense // 4) + routed // 4
    assert (split["experts"]["expert_data_parallel"], whole["experts"]["expert_data_parallel"]) \
        == (1, 4)
    tokens, micro_batches = 2 * cfg.trainer.seq_length, 16 // (2 * 4)
    want = 4 * tokens * 2 * 256 * 2 * 3 // 4 * 4 * micro_batches
    assert row_split["all_to_all_bytes_per_step"] == want
    assert row_whole["all_to_all_bytes_per_step"] == 0
    # a layout the experts cannot split into is refused naming the values
    with pytest.raises(ValueError, match=r"plan.gpus=2 is not a multiple of expert parallel 4"):
        build_plan(cfg, PlanConfig(gpus=2))


# -- Nemotron 3 Nano -------------------------------------------------------------------------------

# Published: 31.6B parameters, 3.2B active per token, 3.6B with embeddings (the model card of
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 and the Nemotron 3 Nano technical report). The
# exact counts below are the built model's (meta device) and transformers' NemotronH of the same
# config; "active" leaves out the routed experts a token is not sent to (122 of 128 per MoE
# layer) and, for the 3.2B, the input embedding table (a lookup, not a GEMM).
NANO_TOTAL = 31_577_937_344
NANO_ACTIVE = 3_580_073_408
NANO_EMBEDDING = 131072 * 2688


def test_nemotron3_nano_parameter_counts_match_transformers_and_the_card(parallel_context):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from model.build import build_model
    from model.flops import inactive_parameters

    cfg = dataclasses.replace(model_config("nemotron3_nano"), spec="portable")
    assert (cfg.pattern.count("M"), cfg.pattern.count("E"), cfg.pattern.count("*")) == (23, 23, 6)
    with torch.device("meta"):
        ours = build_model(cfg, PrecisionConfig(), vocab_size=131072, initialize=False,
                           backend="emulated").module
        # transformers' NemotronH with the published config's fields (Megatron-Bridge's
        # NemotronH test config, tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py, and
        # the MoE fields of its Nano recipe, recipes/nemotronh/h100/nemotron_3_nano.py)
        theirs = NemotronHForCausalLM(NemotronHConfig(
            hybrid_override_pattern=cfg.pattern, num_hidden_layers=52, vocab_size=131072,
            hidden_size=2688, intermediate_size=1856, num_attention_heads=32,
            num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
            ssm_state_size=128, n_groups=8, chunk_size=128, n_routed_experts=128,
            num_experts_per_tok=6, moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712, n_shared_experts=1,
            routed_scaling_factor=2.5, n_group=1, topk_group=1, tie_word_embeddings=False,
            use_conv_bias=True, mlp_hidden_act="relu2"))
    total = sum(p.numel() for p in ours.parameters())
    assert total == sum(p.numel() for p in theirs.parameters()) == NANO_TOTAL
    active = total - inactive_parameters(cfg)
    assert active == NANO_ACTIVE
    assert round(total / 1e9, 1) == 31.6
    assert round(active / 1e9, 1) == 3.6
    assert round((active - NANO_EMBEDDING) / 1e9, 1) == 3.2


def test_nemotron3_nano_policy_names_every_expert(parallel_context):
    cfg = model_config("nemotron3_nano")
    names = linear_names(cfg)["moe"]
    assert len(names) == 128 * 2 + 2
    policy = precision_policy(cfg, NVFP4)
    assert len(policy.names()) == 23 * 2 + 6 * 2 + 23 * 258


# -- bad input: refused with one line naming the values, before anything is written ---------------


def _moe_train(world_overrides: dict, moe: MoEConfig = MOE):
    from helpers import train_config

    cfg = train_config("demo_moe")
    cfg.model = dataclasses.replace(cfg.model, moe=moe)
    cfg.parallel = dataclasses.replace(cfg.parallel, **world_overrides)
    return cfg


@pytest.mark.parametrize("parallel,world,message", [
    (dict(expert_model_parallel_size=3), 3,
     "model.moe.num_experts=4 is not divisible by parallel.expert_model_parallel_size=3"),
    (dict(expert_model_parallel_size=4), 2,
     "parallel.expert_model_parallel_size=4 x expert tensor parallel 1 x parallel.pipeline=1 = 4 "
     "does not divide the world size (2 processes)"),
    (dict(expert_model_parallel_size=2, tensor=2, sequence=True), 2,
     "parallel.expert_model_parallel_size=2 x expert tensor parallel 2 x parallel.pipeline=1 = 4 "
     "does not divide the world size (2 processes)"),
    (dict(expert_model_parallel_size=2, tensor=2, sequence=True, expert_tensor_parallel_size=1),
     2, None),
    # megatron's MoELayer refuses to train at TP > 1 without sequence parallelism (a ValueError
    # at the first forward): said before the start
    (dict(tensor=2), 2, "parallel.tensor=2 with MoE layers ('E' in model.pattern) needs "
                        "parallel.sequence=true"),
    (dict(tensor=2, sequence=True, expert_tensor_parallel_size=1), 2,
     "parallel.expert_tensor_parallel_size=1 differs from parallel.tensor=2 at "
     "parallel.expert_model_parallel_size=1: megatron marks expert weights expert-parallel only "
     "at EP > 1"),
    (dict(expert_model_parallel_size=2), 4, None),
])
def test_the_expert_parallel_layout_is_checked_against_the_world(parallel, world, message):
    from training.config import check_across_groups

    cfg = _moe_train(parallel)
    cfg.trainer.global_batch_size = 8 * world
    if message is None:
        check_across_groups(cfg, world)
        return
    with pytest.raises(ConfigError) as err:
        check_across_groups(cfg, world)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_expert_parallel_without_moe_layers_is_refused():
    from helpers import train_config
    from training.config import check_across_groups

    cfg = train_config("demo")
    cfg.parallel.expert_model_parallel_size = 2
    with pytest.raises(ConfigError, match=r"^parallel.expert_model_parallel_size=2, .*"
                                          r"model.pattern='M-M\*-M-M-' has no MoE layer"):
        check_across_groups(cfg, 2)


@pytest.mark.parametrize("override,message", [
    ("model.pattern=MEM*", "model.pattern='MEM*' has MoE layers ('E') but model.moe is not set"),
    ("model.moe.topk=9", "model.moe.topk=9 is above model.moe.num_experts=8"),
])
def test_train_py_refuses_bad_moe_input_before_writing(tmp_path, override, message):
    """Through Hydra's composition and the schema, as train.py builds its config: exit 2."""
    from train_helpers import compose_train

    base = "model=demo" if override.startswith("model.pattern") else "model=demo_moe"
    with pytest.raises(ConfigError) as err:
        compose_train(base, override, f"run.dir={tmp_path / 'run'}")
    assert str(err.value).startswith(message) and err.value.code == 2
    assert not (tmp_path / "run").exists()


def test_a_te_start_refuses_an_moe_model(parallel_context, monkeypatch, tmp_path, data_cache):
    """On a GPU where TE would run (the backend stated): exit 2 naming what the TE path lacks,
    before anything is written."""
    from hydra import compose, initialize_config_dir

    from training import entry
    from training.config import register_configs
    from train_helpers import REPO

    monkeypatch.setenv("NVFP4_CACHE", str(data_cache))
    monkeypatch.setattr("model.build.choose_backend", lambda *a, **k: ("te", "stated"))
    run_dir = tmp_path / "run"
    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        raw = compose("train", overrides=["trainer=fast", "logger=disabled", f"run.dir={run_dir}",
                                          "precision=nvfp4", "model=demo_moe"])
    with pytest.raises(ConfigError, match="TEGroupedMLP") as err:
        entry._start_up(raw)
    assert err.value.code == 2
    assert not run_dir.exists()


def test_the_nemotron3_precision_map_covers_the_moe_layers():
    """precision=nvfp4_nemotron3 on Nano: the last 15 % of the 52 layers (8, rounded up) BF16,
    every expert and shared-expert linear elsewhere the recipe's NVFP4 (no override names them),
    attention in BF16 and the Mamba out_proj in MXFP8 as on the dense hybrids."""
    from train_helpers import compose_train

    cfg = compose_train("precision=nvfp4_nemotron3", "model=nemotron3_nano")
    formats = {n: str(f) for n, f in precision_policy(cfg.model, cfg.precision)
               .linear_formats().items()}
    for name, fmt in formats.items():
        index = int(name.split(".")[1])
        if index >= 52 - 8:
            assert fmt == "bf16", name
        elif ".experts." in name or ".shared_experts." in name:
            assert fmt == "nvfp4", name
    assert sum(".experts." in n for n in formats) == 23 * 256



# -- what users watch: expert load ---------------------------------------------------------------


def test_expert_load_metrics_count_training_tokens_per_expert(parallel_context):
    from model.moe import expert_load_line, moe_routers, take_expert_load

    built = _build()
    module = built.module
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    for _ in range(2):  # two micro-batches of a step
        module(tokens, positions, None, labels=tokens).mean().backward()
    with torch.no_grad():  # an evaluation forward is not counted
        module(tokens, positions, None, labels=tokens)
    routers = {i: m.mlp.router for i, m in enumerate(module.decoder.layers) if i in (1, 3)}
    loads = {i: r.load_seen.clone() for i, r in routers.items()}
    assert all(not r.load_seen.is_floating_point() for r in routers.values())  # BF16-proof
    metrics = take_expert_load(moe_routers(module), micro_batches=2)
    for i, load in loads.items():
        assert load.sum() == 2 * 64 * MOE.topk  # each token counted at each of its top-k
        assert [metrics[f"moe/{i}/tokens/{e}"] for e in range(4)] == load.tolist()
        assert metrics[f"moe/{i}/max_over_mean"] == pytest.approx(
            (load.max() / load.float().mean()).item())
        assert metrics[f"moe/{i}/aux_loss"] > 0  # seq_aux_loss, unscaled, per micro-batch
        assert metrics[f"moe/{i}/expert_bias_max"] == 0.0  # no update has run yet
        assert routers[i].load_seen.sum() == 0  # taken: the next step starts from zero
    line = expert_load_line(metrics)
    assert line.startswith("expert load: max/mean ") and "aux loss mean" in line
    assert take_expert_load(moe_routers(
        _build(dataclasses.replace(TINY, pattern="M*", moe=None)).module)) == {}


def test_an_nvfp4_expert_without_tokens_is_skipped(parallel_context):
    """Routing may leave an expert idle in a micro-batch: its NVFP4 GEMMs are not called (a
    zero-row operand cannot be quantized), the others' outputs are unchanged, and the idle
    expert's weights get no gradient."""
    built = _build(precision=NVFP4)
    experts = built.module.decoder.layers[1].mlp.experts
    torch.manual_seed(5)
    hidden = torch.randn(48, 64, requires_grad=True)
    probs = torch.rand(48)
    counts = torch.tensor([20, 0, 28, 0])
    out, _ = experts(hidden, counts, probs)
    out.sum().backward()
    assert out.shape == (48, 64)
    first, _ = experts.local_experts[0](hidden[:20].detach(), probs[:20])
    assert torch.equal(out[:20].detach(), first.detach())
    assert experts.local_experts[1].linear_fc1.weight.grad is None
    assert experts.local_experts[2].linear_fc1.weight.grad is not None


def test_the_bias_update_counts_stay_exact_under_bf16_weights(parallel_context):
    """Float16Module casts every floating buffer to BF16 (8 significant bits): the router's load
    for the bias update is counted in FP32 again, as megatron keeps the bias itself."""
    from megatron.core.transformer.module import Float16Module

    from model.build import build_model

    torch.manual_seed(0)
    built = build_model(TINY, PrecisionConfig(), vocab_size=256, backend="emulated",
                        params_dtype=torch.bfloat16)
    model = Float16Module(built.module.config, built.module)
    router = built.module.decoder.layers[1].mlp.router
    assert router.local_tokens_per_expert.dtype == torch.bfloat16  # as the cast leaves it
    tokens = torch.randint(0, 256, (8, 128))
    model(tokens, torch.arange(128).expand(8, 128), None, labels=tokens).float().mean().backward()
    counts = router.local_tokens_per_expert
    assert counts.dtype == torch.float32 and counts.sum() == 8 * 128 * MOE.topk
    assert torch.equal(counts.long(), router.load_seen)  # ~512 per expert: exact


@pytest.mark.parametrize("flags,averaged", [
    ({"reduce_group_has_dp": False}, True),   # mc 0.16-0.17's key
    ({"reduce_group_has_dp": True}, False),
    ({"needs_dp_avg": True}, True),           # core 0.18+'s key, the opposite sense
    ({"needs_dp_avg": False}, False),
])
def test_aux_losses_are_averaged_over_data_parallel_ranks_as_the_release_says(
        parallel_context, monkeypatch, flags, averaged):
    """The tracker's reduction (megatron's reduce_aux_losses_tracker_across_ranks): summed over
    the loss's reduce group, then averaged over the data-parallel ranks unless the entry says
    its group spans them already, in either release's words."""
    from megatron.core import parallel_state as ps

    from model import moe

    reduce_group, dp_group, reduced = object(), object(), []
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda: dp_group)
    monkeypatch.setattr(moe.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(moe.dist, "all_reduce",
                        lambda values, group=None: reduced.append(group) or values.mul_(2))
    tracker = {"load_balancing_loss": {"values": torch.tensor([1.0, 3.0]),
                                       "reduce_group": reduce_group, "avg_group": None, **flags}}
    moe._reduce_aux_losses(tracker)
    assert reduced == ([reduce_group, dp_group] if averaged else [reduce_group])
    # a sum over 2 ranks holding the same values; a mean over 2 more leaves it (sum, then / 2)
    assert tracker["load_balancing_loss"]["values"].tolist() == [2.0, 6.0]
