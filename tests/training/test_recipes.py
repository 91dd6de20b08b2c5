"""Every file under recipes/ composes against the schemas; struct mode catches bad keys/types."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError
from train_helpers import RECIPES, compose_train

from nvfp4_recipe.megatron.te_mapping import te_recipe_spec
from training.config import TrainConfig


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (RECIPES / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in ("model", "precision", "data", "parallel", "trainer", "logger")
     for o in group_options(g)] + [("experiment", o) for o in group_options("experiment")],
)
def test_every_recipe_composes(group, option):
    cfg = compose_train(f"{group}={option}")
    assert isinstance(cfg, TrainConfig)
    if group != "experiment":
        assert getattr(cfg, group).name == option if hasattr(getattr(cfg, group), "name") else True


def test_default_composition_is_the_cpu_demo():
    cfg = compose_train()
    assert (cfg.model.name, cfg.precision.name, cfg.data.name) == ("demo", "bf16", "demo")
    assert cfg.run.dir == "runs/demo" and cfg.logger.mode == "offline"


def test_12b_experiment_is_the_papers_run():
    cfg = compose_train("experiment=nemotron_h_12b_nvfp4_10t")
    tr = cfg.trainer
    assert (tr.seq_length, tr.global_batch_size, tr.lr, tr.min_lr) == (8192, 736, 4.5e-4, 4.5e-6)
    assert (tr.adam_beta1, tr.adam_beta2, tr.weight_decay, tr.decay_fraction) == (0.9, 0.95, 0.1, 0.2)
    assert tr.max_steps * tr.global_batch_size * tr.seq_length >= 10e12
    assert cfg.precision.format == "nvfp4" and cfg.precision.switch_to_bf16.at_fraction == 0.82
    assert cfg.model.name == "nemotron_h_12b" and cfg.data.name == "phased_10t"


EXPECTED_INGREDIENTS = {
    "nvfp4": dict(rht=True, stochastic_rounding=True, weight_2d=True),
    "nvfp4_no_rht": dict(rht=False, stochastic_rounding=True, weight_2d=True),
    "nvfp4_no_sr": dict(rht=True, stochastic_rounding=False, weight_2d=True),
    "nvfp4_no_2d": dict(rht=True, stochastic_rounding=True, weight_2d=False),
    "nvfp4_naive": dict(rht=False, stochastic_rounding=False, weight_2d=False),
}


@pytest.mark.parametrize("option", sorted(EXPECTED_INGREDIENTS))
def test_each_ablation_switches_exactly_its_ingredient_and_maps_to_te(option):
    p = compose_train(f"precision={option}").precision
    flags = dict(rht=p.rht, stochastic_rounding=p.stochastic_rounding, weight_2d=p.weight_2d)
    assert flags == EXPECTED_INGREDIENTS[option]
    assert te_recipe_spec(p)["kwargs"] == {
        "disable_rht": not p.rht, "disable_stochastic_rounding": not p.stochastic_rounding,
        "disable_2d_quantization": not p.weight_2d}


def test_bf16_layer_overrides_of_the_ablations():
    assert compose_train("precision=nvfp4").precision.bf16_first_layers is None  # model's default
    no_layers = compose_train("precision=nvfp4_no_bf16_layers").precision
    assert (no_layers.bf16_first_layers, no_layers.bf16_last_layers) == (0, 0)
    fp8 = compose_train("precision=fp8").precision
    assert (fp8.bf16_first_layers, fp8.bf16_last_layers) == (1, 2)
    assert te_recipe_spec(fp8)["recipe"] == "Float8BlockScaling"
    assert te_recipe_spec(compose_train("precision=mxfp4").precision) is None
    # MXFP8 as Megatron-Bridge's bf16_with_mxfp8_mixed runs it: every layer, E4M3 throughout
    mxfp8 = compose_train("precision=mxfp8").precision
    assert (mxfp8.format, mxfp8.bf16_first_layers, mxfp8.bf16_last_layers) == ("mxfp8", 0, 0)
    assert te_recipe_spec(mxfp8) == {"recipe": "MXFP8BlockScaling", "kwargs": {"fp8_format": "E4M3"}}
    assert compose_train("precision=nvfp4_switch").precision.switch_to_bf16.at_fraction == 0.8


def test_unknown_key_is_rejected_by_name():
    with pytest.raises(ConfigCompositionException) as err:
        compose_train("precision.rhtt=false")
    assert "rhtt" in str(err.value) + str(err.value.__cause__)


def test_wrong_type_names_the_key_and_the_type():
    with pytest.raises(ConfigCompositionException) as err:
        compose_train("trainer.global_batch_size=big")
    text = str(err.value) + str(err.value.__cause__)
    assert "global_batch_size" in text and "int" in text.lower()


def test_a_group_file_cannot_add_unknown_keys(tmp_path):
    schema = OmegaConf.structured(TrainConfig)
    with pytest.raises((ConfigKeyError, ValidationError)):
        OmegaConf.merge(schema, {"trainer": {"max_stepz": 3}})


# Every closed choice of the schemas, with its values as YAML and the command line spell them.
CHOICES = {
    "run.resume": ["auto", "never", "restart"],
    "parallel.backend": ["auto", "gloo", "nccl"],
    "trainer.on_nan": ["stop", "skip"],
    "trainer.recompute": ["none", "selective", "full"],
    "trainer.recompute_method": ["uniform", "block"],
    "logger.mode": ["online", "offline", "disabled"],
    "model.spec": ["auto", "portable", "te"],
}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_choice_outside_its_values_is_refused_naming_them(key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(f"{key}=sometimes")
    text = str(err.value.__cause__)
    assert f"Invalid value 'sometimes', expected one of [{', '.join(CHOICES[key])}]" in text, text
    assert f"full_key: {key}" in text, text


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_value_of_a_choice_composes_and_keeps_its_spelling(key):
    """Code compares the values with plain strings, and config.yaml (which a resume compares with
    the run's) spells them as before."""
    group, field = key.split(".")
    for value in CHOICES[key]:
        cfg = compose_train(f"{key}={value}")
        assert getattr(getattr(cfg, group), field) == value
        assert f"{field}: {value}\n" in OmegaConf.to_yaml(OmegaConf.structured(cfg))

