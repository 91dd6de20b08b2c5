"""A format per GEMM pass: the config syntax (a name, or a map of passes with `forward` and
`backward` as shorthands), its refusals, and the formats the policy gives each linear."""

from __future__ import annotations

import pickle

import pytest

from nvfp4_recipe.passes import PassFormats, parse_pass_map, pass_formats
from nvfp4_recipe.policy import (SWITCHED_PASSES, PrecisionConfig, PrecisionPolicy,
                                 RuntimePrecisionState, low_precision_formats)

KINDS = ["mamba", "attention", "mlp", "mamba", "mlp"]
NAMES = {"mamba": ("mixer.in_proj", "mixer.out_proj"),
         "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
         "mlp": ("mlp.linear_fc1", "mlp.linear_fc2")}


def policy(first=1, last=1, **kw) -> PrecisionPolicy:
    return PrecisionPolicy(PrecisionConfig(name="x", **kw), KINDS, first, last, linear_names=NAMES)


# -- PassFormats ------------------------------------------------------------------------------------


def test_pass_formats_read_as_one_name_where_the_passes_agree():
    same = PassFormats("nvfp4")
    assert same == "nvfp4" and same.formats == ("nvfp4",) * 3 and same.uniform == "nvfp4"
    mixed = PassFormats("mxfp8", "nvfp4", "nvfp4")
    assert mixed == "mxfp8/nvfp4/nvfp4" and mixed.uniform is None
    assert (mixed.fprop, mixed.dgrad, mixed.wgrad) == ("mxfp8", "nvfp4", "nvfp4")
    assert PassFormats(str(mixed)) == mixed and PassFormats(str(mixed)).dgrad == "nvfp4"
    again = pickle.loads(pickle.dumps(mixed))
    assert again == mixed and again.formats == mixed.formats
    assert PassFormats("bf16", "bf16", "bf16") == "bf16" and not PassFormats("bf16").low_precision
    assert PassFormats("bf16", "fp8", "bf16").low_precision
    assert mixed.quantized_formats() == ["mxfp8", "nvfp4"]


def test_the_switch_to_bf16_is_a_change_of_the_pass_formats():
    nvfp4 = PassFormats("nvfp4")
    assert nvfp4.with_bf16(SWITCHED_PASSES["forward"]) == "bf16/nvfp4/nvfp4"
    assert nvfp4.with_bf16(SWITCHED_PASSES["all"]) == "bf16"
    state = RuntimePrecisionState()
    assert state.formats(nvfp4) is nvfp4
    state.bf16_passes = SWITCHED_PASSES["forward"]
    assert state.formats(PassFormats("mxfp8", "nvfp4", "bf16")) == "bf16/nvfp4/bf16"


# -- the config syntax ------------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [
    ("nvfp4", {"fprop": "nvfp4", "dgrad": "nvfp4", "wgrad": "nvfp4"}),
    ({"forward": "mxfp8", "backward": "nvfp4"}, {"fprop": "mxfp8", "dgrad": "nvfp4", "wgrad": "nvfp4"}),
    ({"backward": "bf16"}, {"dgrad": "bf16", "wgrad": "bf16"}),
    ({"fprop": "fp8", "wgrad": "mxfp8"}, {"fprop": "fp8", "wgrad": "mxfp8"}),
    ({"forward": "nvfp4", "dgrad": "mxfp8"}, {"fprop": "nvfp4", "dgrad": "mxfp8"}),
])
def test_a_value_names_a_format_for_the_passes_it_names(value, expected):
    assert parse_pass_map(value, "k") == expected


@pytest.mark.parametrize("value,message", [
    ("fp6", "k='fp6': choose one of bf16, nvfp4, fp8, mxfp4, mxfp8, or a map {pass: format} "
            "with passes fprop, dgrad, wgrad, forward (= fprop), backward (= dgrad + wgrad)"),
    ({"upward": "nvfp4"}, "k: 'upward' is not a GEMM pass; use fprop, dgrad, wgrad, forward "
                          "(= fprop), backward (= dgrad + wgrad)"),
    ({"forward": "fp6"}, "k.forward='fp6': choose one of bf16, nvfp4, fp8, mxfp4, mxfp8"),
    ({"backward": "nvfp4", "wgrad": "bf16"}, "k: 'backward' and 'wgrad' both name wgrad"),
    ({}, "k={} names no GEMM pass"),
    (4, "k=4: a format (bf16, nvfp4, fp8, mxfp4, mxfp8) or a map"),
])
def test_bad_values_name_the_allowed_values(value, message):
    with pytest.raises(ValueError) as err:
        parse_pass_map(value, "k")
    assert message in str(err.value)


def test_passes_a_map_does_not_name_keep_their_format():
    assert pass_formats({"forward": "mxfp8"}, "k") == "mxfp8/bf16/bf16"  # precision.format: BF16
    assert pass_formats({"forward": "mxfp8"}, "k", PassFormats("nvfp4")) == "mxfp8/nvfp4/nvfp4"
    assert pass_formats("fp8", "k", PassFormats("nvfp4")) == "fp8"


@pytest.mark.parametrize("key,value,message", [
    ("format", {"forwards": "nvfp4"}, "precision.format: 'forwards' is not a GEMM pass"),
    ("format", "nvfp5", "precision.format='nvfp5': choose one of"),
    ("overrides", {"*.in_proj": {"backward": "fp4"}},
     "precision.overrides['*.in_proj'].backward='fp4': choose one of"),
    ("overrides", {"*.in_proj": {"fwd": "nvfp4"}},
     "precision.overrides['*.in_proj']: 'fwd' is not a GEMM pass"),
])
def test_the_schema_refuses_a_bad_format_or_pass_naming_the_key(key, value, message):
    with pytest.raises(ValueError) as err:
        PrecisionConfig(**{key: value})
    assert message in str(err.value)


# -- the policy -------------------------------------------------------------------------------------


def test_a_format_map_for_the_whole_model():
    p = policy(format={"forward": "mxfp8", "backward": "bf16"})
    assert [str(d.format) for d in p.layers()] == ["bf16", *["mxfp8/bf16/bf16"] * 3, "bf16"]
    assert p.recipe()["format"] == "mxfp8/bf16/bf16"
    assert low_precision_formats(p.cfg) == ["mxfp8"]
    assert p.precision_map()["mixer.out_proj"] == {"bf16": "0", "mxfp8/bf16/bf16": "3"}
    assert p.precision_map()["mlp.linear_fc1"] == {"mxfp8/bf16/bf16": "2", "bf16": "4"}


def test_an_override_map_changes_only_the_passes_it_names():
    p = policy(format="nvfp4", overrides={"*.mixer.out_proj": {"forward": "mxfp8"},
                                          "layers.2.mlp.*": {"backward": "fp8"}})
    formats = p.linear_formats()
    # In NVFP4 layers the unnamed passes keep NVFP4; in the BF16 first/last layers, BF16.
    assert formats["layers.3.mixer.out_proj"] == "mxfp8/nvfp4/nvfp4"
    assert formats["layers.0.mixer.out_proj"] == "mxfp8/bf16/bf16"
    assert formats["layers.3.mixer.in_proj"] == "nvfp4"
    assert formats["layers.2.mlp.linear_fc1"] == "nvfp4/fp8/fp8"
    assert formats["layers.3.mixer.out_proj"].dgrad == "nvfp4"
    assert p.describe_map().startswith(
        "mixer.in_proj: bf16 at 0; nvfp4 at 3 | mixer.out_proj: mxfp8/bf16/bf16 at 0; "
        "mxfp8/nvfp4/nvfp4 at 3 |")
    assert low_precision_formats(p.cfg) == ["nvfp4", "fp8", "mxfp8"]


def test_overrides_can_leave_the_bf16_layers_alone():
    """overrides_in_bf16_layers=false: megatron-core's default for its per-module config (a
    layer outside the quantized autocast is not quantized by a matcher)."""
    over = {"*.mixer.out_proj": "mxfp8"}
    assert policy(format="nvfp4", overrides=over).linear_formats()["layers.0.mixer.out_proj"] == "mxfp8"
    p = policy(format="nvfp4", overrides=over, overrides_in_bf16_layers=False)
    assert p.linear_formats()["layers.0.mixer.out_proj"] == "bf16"
    assert p.linear_formats()["layers.3.mixer.out_proj"] == "mxfp8"


def test_two_patterns_giving_one_linear_different_pass_maps_are_an_error():
    with pytest.raises(ValueError, match=r"layers.3.mixer.out_proj matches '\*.out_proj' "
                                         r"\(fprop=mxfp8\) and 'layers.3.\*' \(bf16\)"):
        policy(format="nvfp4", overrides={"*.out_proj": {"forward": "mxfp8"}, "layers.3.*": "bf16"})
    # The same passes and formats from two patterns are one value.
    p = policy(format="nvfp4", overrides={"*.out_proj": {"forward": "mxfp8"},
                                          "layers.3.*proj": {"fprop": "mxfp8"}})
    assert p.linear_formats()["layers.3.mixer.in_proj"] == "mxfp8/nvfp4/nvfp4"


@pytest.mark.parametrize("fraction,layers,last", [
    (0.15, 62, 10), (0.15, 9, 2), (0.15, 20, 3), (0.2, 10, 2), (0.0, 62, 0), (1.0, 5, 5),
])
def test_the_bf16_end_layers_as_a_fraction_round_up(fraction, layers, last):
    p = PrecisionPolicy(PrecisionConfig(format="nvfp4", bf16_last_fraction=fraction,
                                        bf16_first_layers=0), ["mlp"] * layers, 2, 8)
    assert (p.first, p.last) == (0, last)


def test_the_bf16_end_layers_are_a_count_or_a_fraction():
    with pytest.raises(ValueError, match="bf16_last_layers=3 and precision.bf16_last_fraction=0.15 "
                                         "both set the trailing BF16 layers"):
        PrecisionConfig(format="nvfp4", bf16_last_layers=3, bf16_last_fraction=0.15)
    with pytest.raises(ValueError, match="bf16_last_fraction=1.5 is not a fraction"):
        PrecisionConfig(format="nvfp4", bf16_last_fraction=1.5)
