"""TE decisions as pure functions, run through the real stack.

Transformer Engine is not installed here: a fake autocast records which recipe each layer's
forward ran under, and a fake TE wrapper stands for megatron's, whose `is_first_microbatch`
contract is checked in megatron's installed source against TE's forward signature.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from nvfp4_recipe.linear_protocol import HeldLinear, PrecisionLinear
from nvfp4_recipe.megatron.te_runtime import TEPrecisionLinear, te_layer_recipe
from nvfp4_recipe.policy import SWITCHED_PASSES, LayerPrecision, RuntimePrecisionState

RECIPE = object()  # stands for NVFP4BlockScaling(...)
FORWARD_BF16 = object()  # stands for the CustomRecipe of BF16 Fprop, NVFP4 Dgrad and Wgrad
RECIPES = {"nvfp4": RECIPE, "bf16/nvfp4/nvfp4": FORWARD_BF16}
LOW = LayerPrecision(index=3, kind="mamba", format="nvfp4")
BF16 = LayerPrecision(index=0, kind="mamba", format="bf16")


def te_stand_ins(monkeypatch, build_recipe) -> list:
    """build_model's TE backend without TE: a fake autocast that records each recipe a layer's
    forward enters (the list returned), `build_recipe(formats, cfg)` for TE's recipe builder, and
    the portable layers under the TE contexts (the TE layer specs need TE)."""
    from contextlib import contextmanager

    from model import build as build_module
    from nvfp4_recipe.policy import PrecisionConfig

    entered = []

    @contextmanager
    def fake_autocast(recipe):
        entered.append(recipe)
        yield

    monkeypatch.setattr(build_module.compat, "te_autocast", fake_autocast)
    monkeypatch.setattr(build_module, "build_te_recipe", build_recipe)
    monkeypatch.setattr(build_module, "te_layer_spec",
                        lambda d, model: build_module.portable_layer_spec(
                            d, PrecisionConfig(), build_module.RuntimePrecisionState(), model))
    return entered


@pytest.mark.parametrize("switched, low, bf16", [
    (None, RECIPE, None),  # before the switch: the policy's low-precision layers quantize
    ("all", None, None),  # after it: every GEMM in BF16
    ("forward", FORWARD_BF16, None),  # after it: the recipe of the formats the switch leaves
])
def test_recipe_per_layer_before_and_after_the_switch(switched, low, bf16):
    state = RuntimePrecisionState(bf16_passes=SWITCHED_PASSES[switched] if switched else ())
    assert te_layer_recipe(LOW, state, RECIPES) is low
    assert te_layer_recipe(BF16, state, RECIPES) is bf16


def test_formats_without_a_built_recipe_are_an_error_not_bf16():
    with pytest.raises(KeyError, match="no TE recipe was built for mxfp8"):
        te_layer_recipe(LayerPrecision(index=3, kind="mamba", format="mxfp8"),
                        RuntimePrecisionState(), RECIPES)


@pytest.mark.parametrize("env, formats, refused", [
    ({}, ["nvfp4", "fp8"], None),
    ({"NVTE_BACKWARD_OVERRIDE": "dequantized"}, ["nvfp4"], "NVTE_BACKWARD_OVERRIDE"),
    ({"NVTE_BACKWARD_OVERRIDE": "high_precision"}, ["fp8"], "NVTE_BACKWARD_OVERRIDE"),
    ({"NVTE_BACKWARD_OVERRIDE": "dequantized"}, ["bf16"], None),  # no TE recipe runs
    ({"NVTE_NVFP4_ROW_SCALED_ACTIVATION": "1"}, ["nvfp4"], "NVTE_NVFP4_ROW_SCALED_ACTIVATION"),
    ({"NVTE_NVFP4_ROW_SCALED_ACTIVATION": "0"}, ["nvfp4"], None),  # TE's own default
    ({"NVTE_NVFP4_4OVER6": "all"}, ["nvfp4"], "NVTE_NVFP4_4OVER6"),
    ({"NVTE_NVFP4_4OVER6": "none"}, ["nvfp4"], None),
    ({"NVTE_NVFP4_4OVER6": "weights"}, ["fp8"], None),  # an NVFP4 field; no NVFP4 linear
    ({"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}, ["bf16", "fp8"], "FP32_SCALES"),
    ({"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}, ["nvfp4"], None),
    ({"NVTE_BACKWARD_OVERRIDE": ""}, ["nvfp4"], "NVTE_BACKWARD_OVERRIDE"),  # TE asserts on ""
    ({"NVTE_USE_FAST_MATH": "1"}, ["nvfp4"], "NVTE_USE_FAST_MATH"),
    ({"NVTE_USE_FAST_MATH": ""}, ["nvfp4"], None),  # getenv<bool>: empty is the default, off
    ({"NVTE_USE_FAST_MATH": "0"}, ["nvfp4"], None),
    ({"NVTE_USE_FAST_MATH": "1"}, ["fp8"], None),  # read by the NVFP4 quantizer only
    # the fields this project passes itself (registry._nvfp4_te_recipe): the variable is moot
    ({"NVTE_NVFP4_DISABLE_RHT": "1"}, ["nvfp4"], None),
])
def test_a_te_recipe_field_set_from_the_environment_is_refused(env, formats, refused):
    """TE's recipe dataclasses take these fields' defaults from the environment at import
    (release_v2.19 common/recipe/__init__.py:429-443, 558-574) and its NVFP4 quantizer reads
    NVTE_USE_FAST_MATH (pytorch/csrc/quantizer.cpp:2679-2690): set, TE would compute something
    other than the run's recipe, silently."""
    from nvfp4_recipe.megatron.te_mapping import te_environment_refusal

    refusal = te_environment_refusal(env, formats)
    if refused is None:
        assert refusal is None
    else:
        assert refused in refusal and "unset it" in refusal


def test_switch_reaches_layers_built_before_it(parallel_context, monkeypatch):
    """G: the stack enters each layer's context at every forward, so flipping the runtime state
    after the model was built changes what the next forward runs under."""
    from model import build as build_module
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig

    entered = te_stand_ins(monkeypatch, lambda formats, cfg: RECIPE)
    cfg = ModelConfig(vocab_size=256)
    built = build_module.build_model(cfg, PrecisionConfig(name="nvfp4", format="nvfp4"),
                                     vocab_size=256, backend="te")
    low = sum(d.low_precision for d in built.policy.layers())
    assert 0 < low < cfg.num_layers
    tokens = torch.randint(0, 256, (1, 32))
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered == [RECIPE] * low
    built.runtime_state.bf16_passes = SWITCHED_PASSES["all"]  # what the trainer does at the switch
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered == []


def test_a_forward_only_switch_enters_the_recipe_of_the_formats_it_leaves(parallel_context,
                                                                          monkeypatch):
    """The switch is a change of every linear's pass formats: with passes=forward configured,
    build_model builds the recipe of BF16 Fprop with the recipe's Dgrad and Wgrad too (a
    CustomRecipe on TE 2.19), and after the switch every low-precision layer enters it."""
    from model import build as build_module
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig, SwitchToBF16Config

    built_for = []
    entered = te_stand_ins(monkeypatch,
                           lambda formats, cfg: built_for.append(formats) or f"{formats} recipe")
    precision = PrecisionConfig(name="nvfp4", format="nvfp4", switch_to_bf16=SwitchToBF16Config(
        at_fraction=0.8, passes="forward"))
    built = build_module.build_model(ModelConfig(vocab_size=256), precision, vocab_size=256,
                                     backend="te")
    assert built_for == ["nvfp4", "bf16/nvfp4/nvfp4"]
    low = sum(d.low_precision for d in built.policy.layers())
    tokens = torch.randint(0, 256, (1, 32))
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered == ["nvfp4 recipe"] * low
    built.runtime_state.bf16_passes = SWITCHED_PASSES["forward"]
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered == ["bf16/nvfp4/nvfp4 recipe"] * low


# TE's linears' forward as TE v2.9 defines it (TE is not installed here; read in its source at tag
# v2.9): transformer_engine/pytorch/module/linear.py:1371-1377 (Linear.forward) and
# layernorm_linear.py:1484-1490 (LayerNormLinear.forward), the same parameters. The weight is
# quantized anew when is_first_microbatch is None or True (linear.py:253), kept while False.
def _te_v2_9_linear_forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    raise NotImplementedError  # a signature only


def te_linear_forward_signature() -> inspect.Signature:
    """The installed TE's Linear.forward signature, or TE v2.9's as read in its source."""
    try:
        from transformer_engine.pytorch import Linear
    except ImportError:
        return inspect.signature(_te_v2_9_linear_forward)
    return inspect.signature(Linear.forward)


def _method(module_ast: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in module_ast.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found in megatron's TE extension")


def _assigns_flag(fn: ast.FunctionDef, value: bool) -> list[int]:
    """Lines where `fn` sets self.is_first_microbatch = value."""
    return [node.lineno for node in ast.walk(fn) if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == "is_first_microbatch"
                    for t in node.targets)
            and isinstance(node.value, ast.Constant) and node.value.value is value]


@pytest.mark.parametrize("wrapper", ["TELinear", "TELayerNormColumnParallelLinear"])
def test_megatrons_te_wrappers_keep_the_contract_the_refresh_relies_on(wrapper):
    """What FakeTEWrapper stands for, checked in the installed megatron-core's source (its TE
    classes cannot be built without TE) against TE's forward signature: the wrapper starts with
    is_first_microbatch True, passes it to TE's forward by that keyword, and sets it False after."""
    import megatron.core.extensions.transformer_engine as te_extension
    from megatron.core.transformer.module import MegatronModule

    tree = ast.parse(Path(te_extension.__file__).read_text())
    assert _assigns_flag(_method(tree, wrapper, "__init__"), True)
    forward = _method(tree, wrapper, "forward")
    calls = [node for node in ast.walk(forward) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "forward"
             and isinstance(node.func.value, ast.Call)
             and getattr(node.func.value.func, "id", None) == "super"]
    assert len(calls) == 1
    call = calls[0]
    keywords = {k.arg for k in call.keywords}
    assert "is_first_microbatch" in keywords
    te_linear_forward_signature().bind(None, *call.args, **dict.fromkeys(keywords))  # or TypeError
    assert any(line > call.lineno for line in _assigns_flag(forward, False))
    # Why the trainer resets the flag itself: megatron's own reset is only for config.fp8 / fp4.
    source = inspect.getsource(MegatronModule.set_is_first_microbatch)
    assert "fp8" in source and list(inspect.signature(MegatronModule.set_is_first_microbatch).parameters) == ["self"]


class FakeTEWrapper(torch.nn.Module):
    """megatron's TE linear wrappers (the contract checked above): the flag goes False after each
    call; TE quantizes the weight only when it was True."""

    def __init__(self):
        super().__init__()
        self.is_first_microbatch = True
        self.quantized_at = []

    def forward(self, x, step):
        if self.is_first_microbatch:
            self.quantized_at.append(step)
        self.is_first_microbatch = False
        return x


def test_weights_are_quantized_once_per_step_never_reused_across_steps():
    modules = [FakeTEWrapper(), FakeTEWrapper()]
    linears = [TEPrecisionLinear(m) for m in modules]
    assert all(isinstance(linear, PrecisionLinear) for linear in linears)
    for step in range(3):
        for linear in linears:
            linear.refresh_weight_cache()
        for _micro_batch in range(4):
            for m in modules:
                m(None, step)
    assert all(m.quantized_at == [0, 1, 2] for m in modules)  # once per step, every step
    # TE's linears record neither diagnostics nor the input amax.
    assert linears[0].take_diagnostics() == {}
    assert not linears[0].record_input_amax(torch.zeros(()))


def test_a_linear_switched_at_run_time_enters_its_new_recipe_built_once_on_first_use():
    """The per-forward context of a TE linear reads the runtime state's switched map by the
    linear's policy name: no autocast of its own while it runs its layer's formats, the recipe of
    its new formats after a switch (built by the RecipeTable on first use, once), TE's autocast
    off for BF16; other linears are untouched."""
    from contextlib import nullcontext

    from nvfp4_recipe.megatron.te_runtime import RecipeTable, te_linear_context
    from nvfp4_recipe.passes import PassFormats

    made, entered = [], []
    recipes = RecipeTable({PassFormats("nvfp4"): RECIPE},
                          lambda formats: made.append(str(formats)) or ("recipe", str(formats)))
    state = RuntimePrecisionState()

    def context(name):
        return te_linear_context(PassFormats("nvfp4"), PassFormats("nvfp4"), state, recipes,
                                 lambda recipe: entered.append(recipe) or nullcontext(),
                                 lambda: entered.append("off") or nullcontext(), name=name)

    mine, other = context("layers.3.mixer.in_proj"), context("layers.3.mixer.out_proj")
    for _ in range(2):
        with mine(), other():
            pass
    assert entered == [] and made == []
    state.linear_formats["layers.3.mixer.in_proj"] = PassFormats("mxfp8/nvfp4/nvfp4")
    for _ in range(2):
        with mine(), other():
            pass
    assert entered == [("recipe", "mxfp8/nvfp4/nvfp4")] * 2 and made == ["mxfp8/nvfp4/nvfp4"]
    state.linear_formats["layers.3.mixer.in_proj"] = PassFormats("bf16")
    entered.clear()
    with mine():
        pass
    assert entered == ["off"]


def test_the_controller_switches_a_te_linear_of_a_built_model(parallel_context, monkeypatch):
    """build_model gives every quantized TE linear a context that reads its formats per
    forward, so PrecisionController.apply_formats reaches it at the next forward (the portable
    layers stand in for TE's, as above)."""
    from model import build as build_module
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training.precision import PrecisionController

    entered = te_stand_ins(monkeypatch, lambda formats, cfg: ("recipe", str(formats)))
    precision = PrecisionConfig(name="nvfp4", format="nvfp4")
    built = build_module.build_model(ModelConfig(vocab_size=256), precision, vocab_size=256,
                                     backend="te")
    held = {h.name: h.linear for h in built.linears}
    assert held["layers.2.mixer.in_proj"].switchable
    assert not held["layers.0.mixer.in_proj"].switchable  # a BF16 layer's: nothing to switch
    controller = PrecisionController(precision, built, 1, 1)
    tokens = torch.randint(0, 256, (1, 32))
    controller.apply_formats({"layers.2.mixer.in_proj": "mxfp8/nvfp4/nvfp4"})
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered.count(("recipe", "mxfp8/nvfp4/nvfp4")) == 1
    assert entered.count(("recipe", "nvfp4")) == sum(d.low_precision for d in built.policy.layers())
    with pytest.raises(RuntimeError, match="without a run-time format switch"):
        held["layers.0.mixer.in_proj"].set_formats("nvfp4")


def test_the_adaptive_fallback_acts_on_te_linears(parallel_context, monkeypatch):
    """The TE path's telemetry is measured beside each quantized linear (te_telemetry.py): a
    planted outlier channel on one linear shows in its statistics, the fallback moves exactly
    that linear, and its next forward enters the recipe of the formats it moved to."""
    import sys

    from model import build as build_module
    from model.config import ModelConfig
    from nvfp4_recipe.policy import (AdaptiveConfig, AdaptiveThresholds, PrecisionConfig,
                                     TelemetryConfig)
    from training.precision import PrecisionController, parse_underflow_key

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from outlier_injection import plant_outlier

    entered = te_stand_ins(monkeypatch, lambda formats, cfg: ("recipe", str(formats)))
    precision = PrecisionConfig(name="nvfp4", format="nvfp4", telemetry=TelemetryConfig(every=1),
                                adaptive=AdaptiveConfig(
                                    enabled=True, patience=1, passes="forward",
                                    # as tests/system/test_adaptive_runs.py watches it
                                    thresholds=AdaptiveThresholds(flush=None, scale_underflow=0.5)))
    built = build_module.build_model(ModelConfig(vocab_size=256), precision, vocab_size=256,
                                     backend="te")
    target = "layers.2.mixer.in_proj"
    handle = plant_outlier(built.module, target, channel=0, value=1e6)
    controller = PrecisionController(precision, built, 1, 1)
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    controller.before_step(0)
    built.module(tokens, None, None, labels=tokens).sum().backward()
    metrics = controller.after_step(0)
    measured = {parse_underflow_key(k)[0] for k in metrics if parse_underflow_key(k)}
    low = {h.name for h in built.linears if h.format != "bf16"}
    assert measured == low  # every quantized TE linear reported, from its own hooks
    events = controller.decide(1)
    assert [(f["module"], f["pass"]) for _, f in events] == [(target, "fprop")]
    moved = controller.current_formats()[target]
    assert moved.fprop == "mxfp8"
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered.count(("recipe", str(moved))) == 1
    handle.remove()


# Last in the file: make_trainer sets up and tears down its own process group and megatron's
# parallel state, which also ends the module's `parallel_context` the tests above share.
def test_trainer_refreshes_before_every_step_and_evaluation(make_trainer):
    """B: the trainer resets every TE weight cache at the start of a step and of an evaluation
    (before this, nothing did: megatron only resets when config.fp8/fp4 is set)."""
    trainer = make_trainer("trainer.max_steps=1", "trainer.eval_every=1")
    fake = FakeTEWrapper()
    trainer.core.add_module("fake_te_linear", fake)
    trainer.precision.linears = [*trainer.precision.linears,
                                 HeldLinear("layers.0.fake", "nvfp4", TEPrecisionLinear(fake))]
    fake.is_first_microbatch = False
    trainer.train_step(trainer.data.train.next_global_batch())
    assert fake.is_first_microbatch is True
    fake.is_first_microbatch = False
    trainer.validator.loss()
    assert fake.is_first_microbatch is True
