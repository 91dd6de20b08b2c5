"""Every numeric key has a range, checked by validate() before anything is written."""

from __future__ import annotations

import dataclasses

import pytest
from train_helpers import FAST, run_train
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
    ("parallel.context", 0), ("parallel.first_stage_layers", 0),
    ("model.hidden_size", 0), ("model.num_attention_heads", 0), ("model.num_query_groups", 0),
    ("model.mamba_num_groups", 0), ("model.mamba_chunk_size", 0), ("model.kv_channels", -1),
    ("model.vocab_size", 0), ("model.vocab_multiple", 0), ("model.max_sequence_length", 0),
    ("model.init_method_std", 0.0), ("model.layernorm_epsilon", -1e-5),
    ("model.bf16_first_layers", -1), ("precision.diagnostics_every", -1),
    ("plan.gpus", 0), ("plan.mfu", 0.0), ("plan.peak_tflops", -1.0), ("plan.total_tokens", 0),
]


def _with(cfg: TrainConfig, key: str, value) -> TrainConfig:
    group, field = key.split(".")
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group),
                                                                  **{field: value})})


def test_the_defaults_pass():
    validate(TrainConfig(), world_size=1)


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_a_value_out_of_range_is_refused_naming_the_key(key, value):
    with pytest.raises(ValueError) as err:
        validate(_with(TrainConfig(), key, value), world_size=1)
    message = str(err.value)
    assert message.startswith(key + "="), message
    assert "\n" not in message


@pytest.mark.parametrize("key,value", [("trainer.keep_last", 0), ("trainer.warmup_steps", 0),
                                       ("trainer.grad_clip", 0.0), ("trainer.min_lr", 0.0),
                                       ("trainer.adam_beta1", 0.0), ("trainer.weight_decay", 0.0)])
def test_the_edges_of_a_range_are_accepted(key, value):
    validate(_with(TrainConfig(), key, value), world_size=1)


@pytest.mark.parametrize("override,key", [("trainer.save_every=0", "trainer.save_every"),
                                          ("trainer.lr=-1", "trainer.lr")])
def test_a_run_refused_for_a_bad_value_writes_nothing(tmp_path, data_cache, override, key):
    """Exit 2 with one line naming the key, and no run directory (not even an empty one)."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *FAST, override, cache_dir=data_cache, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"error: {key}=" in out and "Traceback" not in out, out
    assert not run_dir.exists(), sorted(run_dir.rglob("*"))
