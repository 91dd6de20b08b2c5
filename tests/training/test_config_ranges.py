"""Every numeric key has a range, checked by validate() before anything is written; a value outside
a choice's values is refused when Hydra composes the config, before the run starts."""

from __future__ import annotations

import dataclasses

import pytest
from train_helpers import FAST, compose_train, run_train

from data.config import DataConfigError
from training.config import TrainConfig, validate

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
    ("parallel.first_stage_layers", 0),
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


@pytest.mark.parametrize("overrides,key", [
    (["trainer.save_every=0"], "trainer.save_every"), (["trainer.lr=-1"], "trainer.lr"),
    (["precision=nvfp4", "precision.bf16_first_layers=20"], "precision.bf16_first_layers"),
], ids=["trainer.save_every", "trainer.lr", "precision.bf16_first_layers"])
def test_a_run_refused_for_a_bad_value_writes_nothing(tmp_path, data_cache, overrides, key):
    """Exit 2 with one line naming the key, and no run directory (not even an empty one)."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, *overrides, cache_dir=data_cache, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}="), out
    assert "Traceback" not in out, out
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))


def test_a_run_refused_for_a_choice_outside_its_values_writes_nothing(tmp_path):
    """Hydra refuses it while composing (exit 1), naming the key, the value and the choices."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, "trainer.on_nan=sometimes", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Invalid value 'sometimes', expected one of [stop, skip]" in out, out
    assert "full_key: trainer.on_nan" in out and "Traceback" not in out, out
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))
