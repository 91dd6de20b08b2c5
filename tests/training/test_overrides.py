"""precision.overrides: per-linear formats through the one precision policy. They change the
precision map, the plan, the emulated losses (exactly as if those linears' layers were BF16) and,
on the TE spec, the context each linear's forward runs in; a pattern that matches nothing is an
error (exit 2). The emulated losses over training steps: tests/system/test_overrides_training.py;
train.py's start-up with overrides (the refusal, the precision map it logs):
tests/system/test_start_up.py."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from nvfp4_recipe.policy import PrecisionConfig, PrecisionPolicy, RuntimePrecisionState
from helpers import model_config, nvfp4, train_config

PATTERN_12B = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"
KINDS_12B = [{"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in PATTERN_12B]
NAMES = {"mamba": ("mixer.in_proj", "mixer.out_proj"),
         "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
         "mlp": ("mlp.linear_fc1", "mlp.linear_fc2")}


def policy_12b(**kw) -> PrecisionPolicy:
    return PrecisionPolicy(nvfp4(**kw), KINDS_12B, 2, 8, linear_names=NAMES)


# -- the policy and the precision map --------------------------------------------------------------


def test_overrides_change_exactly_the_matched_linears():
    base, over = policy_12b().linear_formats(), policy_12b(
        overrides={"*.mixer.in_proj": "bf16", "layers.1?.mlp.*": "fp8"}).linear_formats()
    changed = {n for n in base if base[n] != over[n]}
    in_proj_low = {n for n, f in base.items() if n.endswith("mixer.in_proj") and f == "nvfp4"}
    mlp_1x = {n for n in base if n.split(".")[1] in {str(i) for i in range(10, 20)}
              and ".mlp." in n}
    assert changed == in_proj_low | mlp_1x and len(in_proj_low) == 23
    assert {over[n] for n in in_proj_low} == {"bf16"} and {over[n] for n in mlp_1x} == {"fp8"}
    # The layer-level decision (which layers run under the recipe) is unchanged.
    assert [d.format for d in policy_12b().layers()] == [
        d.format for d in policy_12b(overrides={"*.mixer.in_proj": "bf16"}).layers()]


def test_override_beats_the_bf16_first_and_last_layers():
    policy = policy_12b(overrides={"layers.0.mixer.in_proj": "nvfp4"})
    assert policy.layer(0).format == "bf16"  # layer 0 is one of the first two BF16 layers
    assert policy.layer(0).linear_format("mixer.in_proj") == "nvfp4"
    assert policy.layer(0).linear_format("mixer.out_proj") == "bf16"
    # A BF16 recipe with one low-precision linear: that format is in use.
    from nvfp4_recipe.policy import low_precision_formats

    bf16 = PrecisionConfig(overrides={"layers.3.*": "fp8"})
    assert low_precision_formats(bf16) == ["fp8"]
    assert PrecisionPolicy(bf16, ["mamba"] * 4, linear_names=NAMES).linear_formats() == {
        "layers.0.mixer.in_proj": "bf16", "layers.0.mixer.out_proj": "bf16",
        "layers.1.mixer.in_proj": "bf16", "layers.1.mixer.out_proj": "bf16",
        "layers.2.mixer.in_proj": "bf16", "layers.2.mixer.out_proj": "bf16",
        "layers.3.mixer.in_proj": "fp8", "layers.3.mixer.out_proj": "fp8"}


def test_precision_map_is_runs_of_the_layers_that_have_the_linear():
    policy = policy_12b(overrides={"*.mixer.in_proj": "bf16", "layers.3.mlp.*": "fp8"})
    pmap = policy.precision_map()
    mamba = [i for i, k in enumerate(KINDS_12B) if k == "mamba"]
    assert pmap["mixer.in_proj"] == {"bf16": f"{mamba[0]}-{mamba[-1]}"}
    # Mamba layers 0, 2, ..., 51, 54, ..., 60; BF16 layers 0, 1 and 54-61 (first 2 / last 8).
    assert pmap["mixer.out_proj"] == {"bf16": "0,54-60", "nvfp4": "2-51"}
    assert pmap["mlp.linear_fc1"] == {"bf16": "1,55-61", "fp8": "3", "nvfp4": "5-53"}
    assert pmap["self_attention.linear_qkv"] == {"nvfp4": "7-52"}
    assert policy.describe_map().startswith(
        "mixer.in_proj: bf16 at 0-60 | mixer.out_proj: bf16 at 0,54-60; nvfp4 at 2-51 | "
        "mlp.linear_fc1: bf16 at 1,55-61; fp8 at 3; nvfp4 at 5-53 |")


@pytest.mark.parametrize("overrides,message", [
    ({"*.mixer.inproj": "bf16"}, "'*.mixer.inproj' matches no linear of this model; names look "
                                 "like layers.0.mixer.in_proj"),
    ({"layers.62.*": "bf16"}, "'layers.62.*' matches no linear"),
    ({"*.in_proj": "bf16", "layers.2.*": "fp8"},
     "layers.2.mixer.in_proj matches '*.in_proj' (bf16) and 'layers.2.*' (fp8)"),
    ({"*.in_proj": "fp4"}, "precision.overrides['*.in_proj']='fp4': choose one of"),
])
def test_bad_overrides_are_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        policy_12b(overrides=overrides)
    assert message in str(err.value)


def test_same_format_from_two_patterns_is_fine():
    policy = policy_12b(overrides={"*.in_proj": "bf16", "layers.2.*": "bf16"})
    assert policy.layer(2).linear_format("mixer.out_proj") == "bf16"


# -- the plan --------------------------------------------------------------------------------------


def test_overrides_change_the_plan(parallel_context):
    from training.plan import build_plan

    plain = build_plan(train_config("nemotron_h_12b", nvfp4(), tensor=4))
    over = build_plan(train_config("nemotron_h_12b", nvfp4(overrides={"*.mixer.in_proj": "bf16"}),
                                   tensor=4))
    assert plain["linear_counts"] == {"nvfp4": 104, "bf16": 20}
    assert over["linear_counts"] == {"nvfp4": 104 - 23, "bf16": 20 + 23}
    assert over["recipe"]["overrides"] == {"*.mixer.in_proj": "bf16"}
    assert over["precision_map"]["mixer.in_proj"] == {"bf16": "0-60"}
    assert plain["precision_map"]["mixer.in_proj"] == {"bf16": "0,54-60", "nvfp4": "2-51"}
    row = over["layers"][2]
    assert row["linears"] == {"mixer.in_proj": "bf16", "mixer.out_proj": "nvfp4"}
    assert row["precision"] == "mixed"
    # The preflight checks only the low-precision GEMMs: in_proj's are gone.
    assert plain["preflight"]["verdict"] == "slower" and over["preflight"]["verdict"] == "ok"
    assert len(over["preflight"]["gemms"]) == len(plain["preflight"]["gemms"]) - 2 * 3 * 23


# -- the TE spec: the context each linear runs in --------------------------------------------------


def test_te_linears_overridden_run_in_their_own_context(parallel_context, monkeypatch):
    """On TE a linear whose format differs from its layer's gets its own context, entered at every
    forward inside the layer's: TE's autocast turned off for a BF16 linear in an NVFP4 layer, the
    FP8 recipe for an FP8 linear in a BF16 layer; after the switch to BF16, none. (Every other
    low-precision linear has one too, entering nothing while it runs its layer's formats.) TE is not
    installed here: the portable layers stand in for TE's (same submodule layout) and fake
    autocasts record what was entered."""
    from model import build as build_module

    entered = []

    @contextmanager
    def fake_autocast(recipe):
        entered.append(recipe)
        yield

    @contextmanager
    def fake_no_autocast():
        entered.append("off")
        yield

    recipes_built = []

    def fake_recipe(formats, cfg):
        recipes_built.append(formats)
        return f"{formats} recipe"

    monkeypatch.setattr(build_module.compat, "te_autocast", fake_autocast)
    monkeypatch.setattr(build_module.compat, "te_no_autocast", fake_no_autocast)
    monkeypatch.setattr(build_module, "build_te_recipe", fake_recipe)
    monkeypatch.setattr(build_module, "te_layer_spec",
                        lambda d, model: build_module.portable_layer_spec(
                            d, PrecisionConfig(), RuntimePrecisionState(), model))
    cfg = model_config("demo")  # M-M*-M-M-: layers 0, 7, 8 BF16
    precision = nvfp4(overrides={"layers.2.mixer.in_proj": "bf16",
                                 "layers.8.mlp.linear_fc2": "fp8"})
    built = build_module.build_model(cfg, precision, vocab_size=256, backend="te")
    assert recipes_built == ["nvfp4", "fp8"]
    wrapped = {n.removeprefix("decoder."): type(m).__name__ for n, m in built.module.named_modules()
               if hasattr(m, "gemm_context")}
    # every low-precision linear reads its formats per forward (the run may switch it:
    # PrecisionController.apply_formats), and so does one overridden to BF16 in an NVFP4 layer
    low = {n for n, f in built.policy.linear_formats().items() if f.low_precision}
    assert set(wrapped) == low | {"layers.2.mixer.in_proj"} and "layers.0.mixer.in_proj" not in low
    assert wrapped["layers.2.mixer.in_proj"] == "PrecisionColumnParallelLinearWithGemmContext"
    assert wrapped["layers.8.mlp.linear_fc2"] == "PrecisionRowParallelLinearWithGemmContext"

    tokens = torch.randint(0, 256, (1, 32))
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    low_layers = [d.index for d in built.policy.layers() if d.low_precision]
    assert low_layers == [1, 2, 3, 4, 5, 6]
    # Layer order: 1 (recipe), 2 (recipe, then its in_proj off), 3-6 (recipe), 8's fc2 (FP8).
    assert entered == ["nvfp4 recipe", "nvfp4 recipe", "off", *["nvfp4 recipe"] * 4,
                       "fp8 recipe"]
    built.runtime_state.bf16_passes = ("fprop", "dgrad", "wgrad")  # the switch, passes=all
    entered.clear()
    built.module(tokens, None, None, labels=tokens)
    assert entered == []


def test_te_spec_linear_class_is_wrapped_with_its_context():
    """megatron's TE hybrid spec names the linear classes directly (mc 0.16.1
    models/mamba/mamba_layer_specs.py: in_proj=TELayerNormColumnParallelLinear, ...): the class
    becomes a spec of its context-entering subclass; the other linear is untouched."""
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from model.specs import MambaMixerSubmodules, with_linear_contexts

    class FakeTELinear(torch.nn.Module):  # megatron's wrappers return (output, bias)
        def __init__(self, size, **kwargs):
            super().__init__()
            self.kwargs = kwargs

        def forward(self, x):
            return x * 2, None

    class FakeTERow(FakeTELinear):
        pass

    layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        mixer=ModuleSpec(module=torch.nn.Module, submodules=MambaMixerSubmodules(
            in_proj=FakeTELinear, out_proj=FakeTERow))))
    entered = []

    @contextmanager
    def context():
        entered.append("in")
        yield

    wrapped = with_linear_contexts(layer, {"mixer.in_proj": context})
    mixer = wrapped.submodules.mixer.submodules
    assert mixer.out_proj is FakeTERow and layer.submodules.mixer.submodules.in_proj is FakeTELinear
    assert mixer.in_proj.params == {"gemm_context": context}
    linear = build_module(mixer.in_proj, 4, config=None)
    assert isinstance(linear, FakeTELinear) and linear.kwargs == {"config": None}
    out, _ = linear(torch.ones(2))
    assert entered == ["in"] and out.tolist() == [2.0, 2.0]


def test_te_is_asked_for_every_format_an_override_uses():
    """An override to MXFP4 (no TE recipe) or to FP8 where TE cannot run it keeps the run off TE
    (backend=auto: emulated; backend=te: refused with this reason); the dry run then checks the
    emulated backend only."""
    from training.preflight import preflight_backends
    from nvfp4_recipe.megatron.te_mapping import te_formats, te_supports

    mx = nvfp4(overrides={"*.mlp.*": "mxfp4"})
    assert te_formats(mx) == ["nvfp4", "mxfp4"]
    assert te_supports(mx, (10, 0), "12.9", "2.9.0") == (False, "TE has no MXFP4 training recipe")
    assert preflight_backends(mx, "auto") == ("emulated",)
    assert preflight_backends(nvfp4(), "auto") == ("te", "emulated")
    fp8 = PrecisionConfig(overrides={"*.mlp.*": "fp8"})  # a BF16 recipe with FP8 MLPs
    assert te_formats(fp8) == ["fp8"]  # BF16 needs no TE recipe
    assert te_supports(fp8, (10, 0), "12.9", "2.9.0") == (True, "")
    assert te_supports(fp8, (10, 0), "12.9", "2.8.0")[1].startswith(
        "transformer_engine 2.8.0 runs FP8 block scaling on compute capability 9.x only")
