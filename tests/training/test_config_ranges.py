"""Every numeric key has a range, declared on its schema's field and checked when the schema is
built (OmegaConf.to_object runs __post_init__), before anything is written; a value outside a
choice's values is refused when Hydra composes the config, before the run starts (train.py
refusing both from the command line: tests/system/test_start_up.py)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf
from train_helpers import compose_train

from data.config import DataConfigError
from errors import ConfigError
from field_ranges import RANGE, at_least
from nvfp4_recipe.policy import (AdaptiveConfig, AdaptiveThresholds, PrecisionConfig,
                                 SwitchToBF16Config, TelemetryConfig)
from training.config import TrainConfig, validate
from training.distributed import data_parallel_size

# (key, a value out of its range); each must be refused with a message naming the key.
BAD = [
    ("trainer.save_every", 0), ("trainer.eval_every", 0), ("trainer.log_every", 0),
    ("trainer.micro_batch_size", 0), ("trainer.global_batch_size", 0),
    ("trainer.seq_length", 0), ("trainer.max_steps", 0), ("trainer.eval_batches", 0),
    ("trainer.max_consecutive_skips", 0), ("trainer.warmup_steps", -5),
    ("trainer.grad_health_every", -1),
    ("trainer.keep_last", -1), ("trainer.seed", -1), ("trainer.lr", -1.0), ("trainer.lr", 0.0),
    ("trainer.lr", float("nan")), ("trainer.lr", float("inf")), ("trainer.min_lr", -1e-5),
    ("trainer.min_lr", 1.0), ("trainer.decay_fraction", 1.5), ("trainer.weight_decay", -0.1),
    ("trainer.grad_clip", -1.0), ("trainer.adam_beta1", 1.0), ("trainer.adam_beta2", -0.1),
    ("trainer.adam_eps", 0.0), ("parallel.tensor", 0), ("parallel.pipeline", -1),
    ("parallel.first_stage_layers", 0), ("parallel.timeout_minutes", 0),
    ("parallel.timeout_minutes", 24 * 60 + 1), ("parallel.expert_model_parallel_size", 0),
    ("parallel.expert_tensor_parallel_size", 0),
    ("model.hidden_size", 0), ("model.num_attention_heads", 0), ("model.num_query_groups", 0),
    ("model.mamba_num_groups", 0), ("model.mamba_chunk_size", 0), ("model.kv_channels", -1),
    ("model.vocab_size", 0), ("model.vocab_multiple", 0), ("model.max_sequence_length", 0),
    ("model.init_method_std", 0.0), ("model.layernorm_epsilon", -1e-5),
    ("model.bf16_first_layers", -1), ("precision.diagnostics_every", -1),
    ("precision.input_amax_steps", -1),
    ("plan.gpus", 0), ("plan.mfu", 0.0), ("plan.peak_tflops", -1.0), ("plan.total_tokens", 0),
]


def _with(cfg: TrainConfig, key: str, value) -> TrainConfig:
    group, field = key.split(".")
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group),
                                                                  **{field: value})})


DEMO = compose_train()  # the default composition: a valid config


def test_the_default_composition_passes():
    validate(DEMO, world_size=1)


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_a_value_out_of_range_is_refused_naming_the_key(key, value):
    with pytest.raises(ValueError) as err:
        validate(_with(DEMO, key, value), world_size=1)
    message = str(err.value)
    assert message.startswith(key + "="), message
    assert "\n" not in message


def test_validate_runs_the_data_groups_checks():
    no_phases = dataclasses.replace(DEMO, data=dataclasses.replace(DEMO.data, phases=[]))
    with pytest.raises(DataConfigError, match=r"^data.phases is empty"):
        validate(no_phases, world_size=1)


@pytest.mark.parametrize("key,value", [("trainer.keep_last", 0), ("trainer.warmup_steps", 0),
                                       ("trainer.grad_clip", 0.0), ("trainer.min_lr", 0.0),
                                       ("trainer.adam_beta1", 0.0), ("trainer.weight_decay", 0.0)])
def test_the_edges_of_a_range_are_accepted(key, value):
    validate(_with(DEMO, key, value), world_size=1)


# -- the schemas check themselves: no list of keys ----------------------------------------------

# Schemas that do not declare their ranges on their fields, and why.
NOT_DECLARED = {
    PrecisionConfig: "nvfp4_recipe ships alone in its wheel, without field_ranges: "
                     "validate_precision checks its numeric fields by hand (tested below)",
    SwitchToBF16Config: "nested in PrecisionConfig, checked by validate_precision",
    TelemetryConfig: "nested in PrecisionConfig, checked by validate_precision (validate_adaptive: "
                     "tests/training/test_adaptive_precision.py)",
    AdaptiveConfig: "the same",
    AdaptiveThresholds: "the same",
}


def _schemas(cls=TrainConfig, prefix="") -> list[tuple[str, type]]:
    """(key, schema class) of every dataclass group and nested group under TrainConfig."""
    found = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        # an optional group (model.moe: Optional[MoEConfig]) is a group too
        if typing.get_origin(hint) is typing.Union:
            hint = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
        if dataclasses.is_dataclass(hint):
            key = f"{prefix}{f.name}"
            found += [(key, hint), *_schemas(hint, key + ".")]
    return found


SCHEMAS = [(key, cls) for key, cls in _schemas() if cls not in NOT_DECLARED]


def _numeric(cls) -> list[dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls)
            if {t for t in (hints[f.name], *typing.get_args(hints[f.name]))} & {int, float}
            and hints[f.name] is not bool]


def test_the_walk_finds_every_group():
    assert {key for key, _ in _schemas()} >= {"run", "model", "precision", "data", "data.demo",
                                              "parallel", "trainer", "logger", "evaluation",
                                              "plan", "precision.switch_to_bf16", "model.moe"}


@pytest.mark.parametrize("key,cls", SCHEMAS, ids=[key for key, _ in SCHEMAS])
def test_every_numeric_field_declares_its_range(key, cls):
    undeclared = [f.name for f in _numeric(cls) if RANGE not in f.metadata]
    assert not undeclared, f"{key}: {undeclared}"


@pytest.mark.parametrize("key,cls", SCHEMAS, ids=[key for key, _ in SCHEMAS])
def test_a_value_just_outside_each_declared_range_is_refused_by_the_schema(key, cls):
    for f in _numeric(cls):
        bounds = f.metadata[RANGE]
        outside = [bounds.low if bounds.low_open else bounds.low - 1]
        if bounds.high is not None:
            outside.append(bounds.high if bounds.high_open else bounds.high + 1)
        for value in outside:
            with pytest.raises(ConfigError) as err:
                cls(**{f.name: value})
            assert str(err.value).startswith(f"{key}.{f.name}={value} must be"), err.value


@pytest.mark.parametrize("key,cls", SCHEMAS, ids=[key for key, _ in SCHEMAS])
def test_a_field_added_to_a_schema_is_refused_by_the_schema_alone(key, cls):
    """A new field with a bad value is refused by its schema, through the path Hydra's
    config takes (OmegaConf.to_object), with no key list to extend."""
    grown = dataclasses.make_dataclass(
        f"Grown{cls.__name__}", [("added_every", int, dataclasses.field(default=1,
                                                                       metadata=at_least(1)))],
        bases=(cls,))
    # Alone, a group's interpolations of other groups (run.dir's ${run.name}) have no root.
    plain = {f.name: "x" for f in dataclasses.fields(cls)
             if isinstance(f.default, str) and "${" in f.default}
    assert isinstance(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(grown), plain)),
                      grown)
    with pytest.raises(ConfigError, match=rf"^{key}\.added_every=0 must be >= 1$"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(grown),
                                            {**plain, "added_every": 0}))


@pytest.mark.parametrize("name", [f.name for f in _numeric(PrecisionConfig)])
def test_precisions_hand_checks_cover_every_numeric_field(name):
    with pytest.raises(ValueError, match=rf"^precision\.{name}=-1 "):
        PrecisionConfig(**{name: -1})


def test_a_choice_set_in_python_is_refused_by_its_schema():
    from training.config import TrainerConfig

    with pytest.raises(ConfigError, match=r"^trainer\.recompute='partial': choose one of none, "
                                          r"selective, full$"):
        TrainerConfig(recompute="partial")


def test_the_layout_check_is_one_function():
    assert data_parallel_size(2, 2, 8) == 2
    with pytest.raises(ConfigError, match=r"^parallel\.tensor=2 x parallel\.pipeline=2 must "
                                          r"divide the world size \(6 processes\)"):
        data_parallel_size(2, 2, 6)
