"""The precision policy and the TE mapping: pure functions, no megatron or TE needed."""

import pytest

from nvfp4_recipe.policy import PrecisionConfig, PrecisionPolicy, SwitchToBF16Config
from nvfp4_recipe.te_mapping import te_recipe_spec, te_supports

PATTERN_12B = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"
KINDS_12B = [{"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in PATTERN_12B]


def nvfp4(**overrides) -> PrecisionConfig:
    return PrecisionConfig(name="nvfp4", format="nvfp4", **overrides)


def test_12b_nvfp4_keeps_first_2_and_last_8_layers_in_bf16():
    policy = PrecisionPolicy(nvfp4(), KINDS_12B, model_first=2, model_last=8)
    bf16 = [d.index for d in policy.layers() if d.format == "bf16"]
    assert bf16 == [0, 1, *range(54, 62)]
    # two linears per pattern layer: 20 of 124 in BF16
    assert 2 * len(bf16) == 20 and 2 * len(policy.layers()) == 124


def test_bf16_last_layers_override_moves_exactly_those_layers():
    policy = PrecisionPolicy(nvfp4(bf16_last_layers=4), KINDS_12B, model_first=2, model_last=8)
    bf16 = [d.index for d in policy.layers() if d.format == "bf16"]
    assert bf16 == [0, 1, 58, 59, 60, 61]


def test_bf16_recipe_has_no_low_precision_layer():
    policy = PrecisionPolicy(PrecisionConfig(), KINDS_12B, model_first=2, model_last=8)
    assert {d.format for d in policy.layers()} == {"bf16"}


@pytest.mark.parametrize(
    "first,last,message",
    [(-1, 2, "bf16_first_layers=-1 is negative"),
     (2, 63, "bf16_last_layers=63 is larger than the model depth (62 layers)"),
     (40, 30, "overlap")],
)
def test_bf16_layer_counts_are_range_checked(first, last, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PrecisionPolicy(nvfp4(bf16_first_layers=first, bf16_last_layers=last), KINDS_12B)


@pytest.mark.parametrize(
    "overrides,key",
    [({"format": "fp6"}, "precision.format='fp6'"),
     ({"backend": "cuda"}, "precision.backend='cuda'"),
     ({"switch_to_bf16": SwitchToBF16Config(at_fraction=1.5)}, "at_fraction=1.5"),
     ({"switch_to_bf16": SwitchToBF16Config(passes="backward")}, "passes='backward'")],
)
def test_bad_values_name_the_key(overrides, key):
    cfg = PrecisionConfig(**{"format": "nvfp4", **overrides})
    with pytest.raises(ValueError) as err:
        PrecisionPolicy(cfg, KINDS_12B)
    assert key in str(err.value)


@pytest.mark.parametrize(
    "rht,sr,two_d",
    [(True, True, True), (False, True, True), (True, False, True), (True, True, False),
     (False, False, False)],
)
def test_te_mapping_inverts_each_switch(rht, sr, two_d):
    spec = te_recipe_spec(nvfp4(rht=rht, stochastic_rounding=sr, weight_2d=two_d))
    assert spec == {
        "recipe": "NVFP4BlockScaling",
        "kwargs": {"disable_rht": not rht, "disable_stochastic_rounding": not sr,
                   "disable_2d_quantization": not two_d},
    }


def test_te_mapping_of_other_formats():
    assert te_recipe_spec(PrecisionConfig()) is None
    assert te_recipe_spec(PrecisionConfig(format="fp8"))["recipe"] == "Float8BlockScaling"
    assert te_recipe_spec(PrecisionConfig(format="mxfp4")) is None


def test_te_support_names_the_missing_capability():
    ok, why = te_supports(nvfp4(), (9, 0))
    assert not ok and why == "NVFP4 TE GEMMs need compute capability 10.x, found 9.0"
    assert te_supports(nvfp4(), (10, 0)) == (True, "")
    assert te_supports(nvfp4(), None)[0] is False
    assert te_supports(PrecisionConfig(format="fp8"), (9, 0))[0] is True
