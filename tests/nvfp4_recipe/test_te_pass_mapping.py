"""How TE runs a linear whose GEMM passes have different formats, per release: pure functions,
and the recipe objects built from them against a stand-in for TE (not installed here)."""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass

import pytest

from nvfp4_recipe.megatron.te_mapping import (build_te_recipe, during_run, te_formats_recipe_spec,
                                              te_pass_formats, te_pass_mode, te_pass_rule,
                                              te_recipe_spec, te_supports)
from nvfp4_recipe.passes import PassFormats
from nvfp4_recipe.policy import PrecisionConfig, SwitchToBF16Config

NVFP4 = PrecisionConfig(name="nvfp4", format="nvfp4")
BLACKWELL = ((10, 0), "12.9")


def nvfp4_quantizer(rht=False, sr=False, two_d=False):
    return {"quantizer": "NVFP4Quantizer", "kwargs": {
        "fp4_dtype": "kFloat4E2M1", "with_rht": rht, "with_post_rht_amax": rht,
        "with_2d_quantization": two_d, "stochastic_rounding": sr, "with_random_sign_mask": True}}


MXFP8 = {"quantizer": "MXFP8Quantizer", "kwargs": {"fp8_dtype": "kFloat8E4M3"}}
IDENTITY = {"quantizer": "IdentityQuantizer", "kwargs": {}}


@pytest.mark.parametrize("formats,mode", [
    ("bf16", "bf16"), ("nvfp4", "recipe"), ("mxfp8/bf16/bf16", "high_precision_backward"),
    ("mxfp8/nvfp4/nvfp4", "hybrid"), ("bf16/nvfp4/nvfp4", "hybrid"), ("nvfp4/nvfp4/bf16", "hybrid"),
])
def test_the_way_te_runs_each_kind_of_pass_map(formats, mode):
    assert te_pass_mode(PassFormats(formats)) == mode


def test_one_format_is_that_formats_recipe():
    assert te_formats_recipe_spec(PassFormats("mxfp8"), NVFP4) == {
        "recipe": "MXFP8BlockScaling", "kwargs": {"fp8_format": "E4M3"}}
    assert te_formats_recipe_spec(PassFormats("bf16"), NVFP4) is None
    assert te_formats_recipe_spec(PassFormats("mxfp4"), NVFP4) is None  # no TE recipe


def test_a_bf16_backward_is_the_forward_formats_recipe_with_backward_override():
    cfg = PrecisionConfig(name="x", format={"forward": "nvfp4"}, rht=False)
    assert te_recipe_spec(cfg) == {"recipe": "NVFP4BlockScaling", "kwargs": {
        "disable_rht": True, "disable_stochastic_rounding": False,
        "disable_2d_quantization": False, "backward_override": "high_precision"}}


def test_other_maps_are_a_custom_recipe_of_hybrid_quantizers_per_tensor():
    """x: rowwise for Fprop, columnwise for Wgrad; W: Fprop / Dgrad; dY: Dgrad / Wgrad. NVFP4's
    own ingredients per role: RHT on the input's and gradient's copies (TE applies it to the
    columnwise, Wgrad, copy), 16x16 weight tiles, stochastic rounding on the gradient."""
    spec = te_formats_recipe_spec(PassFormats("mxfp8", "nvfp4", "nvfp4"), NVFP4)
    assert spec == {"recipe": "CustomRecipe", "kwargs": {}, "quantizers": {
        "input": {"rowwise": MXFP8, "columnwise": nvfp4_quantizer(rht=True)},
        "weight": {"rowwise": MXFP8, "columnwise": nvfp4_quantizer(two_d=True)},
        "grad_output": {"rowwise": nvfp4_quantizer(rht=True, sr=True),
                        "columnwise": nvfp4_quantizer(rht=True, sr=True)}}}
    # After a forward-only switch: Fprop's copies are TE's identity (high precision).
    switched = te_formats_recipe_spec(PassFormats("bf16", "nvfp4", "nvfp4"), NVFP4)["quantizers"]
    assert switched["input"]["rowwise"] == switched["weight"]["rowwise"] == IDENTITY
    fp8 = te_formats_recipe_spec(PassFormats("fp8", "fp8", "mxfp8"), NVFP4)["quantizers"]
    assert fp8["weight"]["rowwise"]["kwargs"]["block_scaling_dim"] == 2
    assert fp8["input"]["rowwise"]["kwargs"]["block_scaling_dim"] == 1
    assert fp8["input"]["columnwise"] == fp8["grad_output"]["columnwise"] == MXFP8
    assert te_formats_recipe_spec(PassFormats("mxfp4", "nvfp4", "nvfp4"), NVFP4) is None


@pytest.mark.parametrize("formats,te,ok,needs", [
    ("nvfp4", "2.8.0", True, None),
    ("mxfp8/bf16/bf16", "2.14.1", False, "transformer_engine >= 2.15, found 2.14.1"),
    ("mxfp8/bf16/bf16", "2.15.0", True, None),
    ("mxfp8/nvfp4/nvfp4", "2.18.0", False, "transformer_engine >= 2.19, found 2.18.0"),
    ("bf16/nvfp4/nvfp4", "2.17.1", False, "HybridQuantizer, transformer_engine >= 2.19"),
    ("mxfp8/nvfp4/nvfp4", "2.19.0", True, None),
    ("mxfp8/nvfp4/nvfp4", "2.20.0.dev0+abc", True, None),
])
def test_each_way_needs_its_release(formats, te, ok, needs):
    verdict, why = te_pass_rule(PassFormats(formats), te)
    assert verdict is ok
    if needs:
        assert needs in why and formats in why and "precision.backend=emulated" in why


def test_the_start_up_check_names_the_release_a_map_needs():
    """te_supports is what backend=auto / te asks (model/backend.py): a map the installed TE
    cannot run keeps auto on the emulation and refuses backend=te (exit 2) with this reason."""
    hp_backward = PrecisionConfig(name="x", format={"forward": "mxfp8", "backward": "bf16"})
    assert te_supports(hp_backward, *BLACKWELL, "2.15.0") == (True, "")
    assert "transformer_engine >= 2.15, found 2.14.1" in te_supports(hp_backward, *BLACKWELL,
                                                                      "2.14.1")[1]
    out_proj = PrecisionConfig(name="x", format="nvfp4", overrides={
        "*.mixer.out_proj": {"forward": "mxfp8", "backward": "nvfp4"}})
    assert te_supports(out_proj, *BLACKWELL, "2.19.0") == (True, "")
    assert "mxfp8/nvfp4/nvfp4 (Fprop/Dgrad/Wgrad)" in te_supports(out_proj, *BLACKWELL, "2.18.0")[1]
    # An override's map over the BF16 first/last layers' formats is checked too.
    forward_only = PrecisionConfig(name="x", format="nvfp4",
                                   overrides={"*.mixer.out_proj": {"forward": "mxfp8"}})
    assert te_pass_formats(forward_only) == ["nvfp4", "mxfp8/nvfp4/nvfp4", "mxfp8/bf16/bf16"]
    forward_only.overrides_in_bf16_layers = False  # then only over the recipe's formats
    assert te_pass_formats(forward_only) == ["nvfp4", "mxfp8/nvfp4/nvfp4"]


def test_the_late_switch_is_a_map_te_must_run_too():
    """passes=forward leaves BF16 Fprop with NVFP4 Dgrad/Wgrad: a HybridQuantizer map, TE 2.19;
    passes=all leaves nothing quantized, any release."""
    forward = PrecisionConfig(name="x", format="nvfp4",
                              switch_to_bf16=SwitchToBF16Config(at_fraction=0.8, passes="forward"))
    assert during_run([PassFormats("nvfp4"), PassFormats("bf16")], forward) == [
        "nvfp4", "bf16/nvfp4/nvfp4"]
    assert te_supports(forward, *BLACKWELL, "2.19.0") == (True, "")
    assert "bf16/nvfp4/nvfp4 (Fprop/Dgrad/Wgrad)" in te_supports(forward, *BLACKWELL, "2.18.0")[1]
    every = PrecisionConfig(name="x", format="nvfp4",
                            switch_to_bf16=SwitchToBF16Config(at_fraction=0.8, passes="all"))
    assert te_supports(every, *BLACKWELL, "2.9.0") == (True, "")
    never = PrecisionConfig(name="x", format="nvfp4",
                            switch_to_bf16=SwitchToBF16Config(at_fraction=None, passes="forward"))
    assert te_supports(never, *BLACKWELL, "2.9.0") == (True, "")  # never switches


# -- the recipe objects, against a stand-in for TE ------------------------------------------------


@pytest.fixture
def fake_te(monkeypatch):
    """transformer_engine's recipe module and quantizer classes as plain records of their
    arguments, at the module paths TE 2.19 defines them."""

    def record(name):
        return type(name, (), {"__init__": lambda self, **kw: self.__dict__.update(kw),
                               "__repr__": lambda self: f"{name}({self.__dict__})"})

    modules = {name: types.ModuleType(name) for name in (
        "transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe",
        "transformer_engine.pytorch", "transformer_engine.pytorch.constants",
        "transformer_engine.pytorch.tensor", "transformer_engine.pytorch.tensor.nvfp4_tensor",
        "transformer_engine.pytorch.tensor.mxfp8_tensor",
        "transformer_engine.pytorch.tensor.float8_blockwise_tensor",
        "transformer_engine.pytorch.tensor.identity_tensor",
        "transformer_engine.pytorch.tensor.hybrid_tensor")}
    recipe = modules["transformer_engine.common.recipe"]
    recipe.Format = enum.Enum("Format", ["E4M3", "HYBRID"])
    for name in ("NVFP4BlockScaling", "MXFP8BlockScaling", "Float8BlockScaling", "CustomRecipe"):
        setattr(recipe, name, record(name))
    modules["transformer_engine.common"].recipe = recipe
    modules["transformer_engine.pytorch.constants"].DType = enum.Enum(
        "DType", ["kFloat4E2M1", "kFloat8E4M3"])
    for module, name in (("nvfp4_tensor", "NVFP4Quantizer"), ("mxfp8_tensor", "MXFP8Quantizer"),
                         ("float8_blockwise_tensor", "Float8BlockQuantizer"),
                         ("identity_tensor", "IdentityQuantizer"),
                         ("hybrid_tensor", "HybridQuantizer")):
        setattr(modules[f"transformer_engine.pytorch.tensor.{module}"], name, record(name))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules


@dataclass(frozen=True)
class Role:  # TE 2.19's QuantizerRole (quantization.py:57-96)
    module_type: str = ""
    tensor_type: str = ""
    name: str = ""


def test_the_custom_recipes_factory_builds_each_tensors_quantizers(fake_te):
    recipe = build_te_recipe(PassFormats("mxfp8", "nvfp4", "nvfp4"), NVFP4)
    assert type(recipe).__name__ == "CustomRecipe"
    dtype = fake_te["transformer_engine.pytorch.constants"].DType
    x = recipe.qfactory(Role("linear", "input", "fc1"))
    assert type(x).__name__ == "HybridQuantizer" and x.columnwise_source == "original"
    assert type(x.rowwise_quantizer).__name__ == "MXFP8Quantizer"
    assert x.rowwise_quantizer.fp8_dtype is dtype.kFloat8E4M3
    assert type(x.columnwise_quantizer).__name__ == "NVFP4Quantizer"
    assert x.columnwise_quantizer.with_rht and not x.columnwise_quantizer.stochastic_rounding
    w = recipe.qfactory(Role("linear", "weight", "fc1"))
    assert w.columnwise_quantizer.with_2d_quantization and not w.columnwise_quantizer.with_rht
    # dY is NVFP4 both ways: one quantizer, not a hybrid of two.
    dy = recipe.qfactory(Role("linear", "grad_output", "fc1"))
    assert type(dy).__name__ == "NVFP4Quantizer" and dy.stochastic_rounding
    assert dy.fp4_dtype is dtype.kFloat4E2M1
    # A fresh quantizer per call: a HybridQuantizer owns its children.
    assert recipe.qfactory(Role("linear", "input")).rowwise_quantizer is not x.rowwise_quantizer
    for other in (Role("linear", "output"), Role("linear", "grad_input"), Role("dpa", "qkv"), None):
        assert type(recipe.qfactory(other)).__name__ == "IdentityQuantizer"


def test_a_bf16_backward_builds_the_recipe_with_backward_override(fake_te):
    recipe = build_te_recipe(PassFormats("mxfp8", "bf16", "bf16"), NVFP4)
    assert type(recipe).__name__ == "MXFP8BlockScaling"
    assert recipe.backward_override == "high_precision"
    assert recipe.fp8_format is fake_te["transformer_engine.common.recipe"].Format.E4M3
    assert build_te_recipe(PassFormats("bf16"), NVFP4) is None
