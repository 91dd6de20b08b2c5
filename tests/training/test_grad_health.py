"""Gradient health: per-layer norms that match the gradients, and the layer a NaN began in (in
one process; over pipeline stages, tensor parallelism and sharded gradients:
tests/system/test_grad_health_layouts.py)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from nan_injection import NaNGradient, inject
from train_helpers import GROUPS, HEALTH_KEYS, KINDS
from training.cadence import Every
from training.grad_health import group_names, layer_name, param_group
from training.metrics import MetricsSink, grad_health_line, read_metrics, wandb_key


def test_group_names_are_global_pattern_indices():
    assert layer_name(7, KINDS) == "layer_07.mamba"
    assert layer_name(3, ["mlp"] * 120) == "layer_003.mlp"
    assert group_names(KINDS)[1:] == GROUPS
    # a pipeline stage holding layers 5..8 numbers its local layer 2 as pattern layer 7
    assert param_group("decoder.layers.2.mixer.in_proj.weight", 5, KINDS) == "layer_07.mamba"
    assert param_group("embedding.word_embeddings.weight", 5, KINDS) == "embedding"
    assert param_group("decoder.final_norm.weight", 0, KINDS) == "final_norm"
    assert param_group("output_layer.weight", 0, KINDS) == "output_layer"
    assert wandb_key("grad/layer_07.mamba/norm") == "grad/layer_07.mamba/norm"


def _reference(core) -> tuple[dict, dict]:
    """Per group, torch.linalg.norm of all its main grads and its non-finite fraction."""
    grads = defaultdict(list)
    for name, p in core.named_parameters():
        grads[param_group(name, 0, KINDS)].append(p.main_grad.detach().reshape(-1).double())
    flat = {g: torch.cat(v) for g, v in grads.items()}
    return ({g: torch.linalg.norm(v).item() for g, v in flat.items()},
            {g: (~torch.isfinite(v)).double().mean().item() for g, v in flat.items()})


def test_every_layer_norm_matches_its_gradients(make_trainer):
    trainer = make_trainer("trainer.grad_health_every=1", "trainer.grad_clip=0")  # no clipping:
    result = trainer.train_step(trainer.data.train.next_global_batch())  # main grads kept as is
    norms, fracs = _reference(trainer.core)
    assert sorted(norms) == sorted(GROUPS)
    assert set(result.health) == HEALTH_KEYS
    for group in GROUPS:
        got = result.health[f"grad/{group}/norm"]
        assert math.isfinite(got) and got > 0, group
        assert got == pytest.approx(norms[group], rel=1e-9), group
        assert result.health[f"grad/{group}/nonfinite_frac"] == fracs[group] == 0.0
    # the groups partition the model: their norms make up the step's gradient norm
    total = math.sqrt(sum(v * v for v in norms.values()))
    assert total == pytest.approx(result.grad_norm, rel=1e-5)
    line = grad_health_line(result.health)
    assert line.startswith("grad health: largest norms ") and line.endswith("all finite")
    # every 2 steps: step 2 is measured, step 3 is not
    trainer.grad_health.due = Every(2)  # trainer.grad_health_every=2: the component's cadence
    for trainer.step, due in ((1, True), (2, False)):
        assert bool(trainer.train_step(trainer.data.train.next_global_batch()).health) == due


def test_nan_in_a_layers_backward_names_that_layer(make_trainer, tmp_path):
    trainer = make_trainer("trainer.on_nan=skip", "trainer.grad_health_every=0")
    inject(trainer.core, layer=7)  # layer 7's backward receives NaN: layers 7..0 go NaN
    sink = MetricsSink(tmp_path, enabled=True)
    result = trainer.train_step(trainer.data.train.next_global_batch(), sink)
    assert result.skipped
    (event,) = [m for m in read_metrics(tmp_path) if m.get("event") == "nonfinite"]
    assert event["first_layer"] == "layer_07.mamba" and event["step"] == 1
    assert event["nonfinite_layers"] == 9  # layers 7..0 and the embedding
    # a non-finite step records each group's non-finite fraction (norms only when due)
    fracs = {k.split("/")[1]: v for k, v in result.health.items()}
    assert set(fracs) == set(GROUPS) and not any(k.endswith("/norm") for k in result.health)
    assert [g for g in GROUPS if fracs[g] > 0] == GROUPS[:9]  # embedding, layers 0..7
    assert "non-finite in 9 of 12 layers" in grad_health_line(result.health)


def test_nan_born_in_an_input_gradient_is_pinned_on_the_layer_not_the_one_below(make_trainer):
    """Layer 5's backward returns NaN for its input while its own weight grads stay finite:
    the parameters tell only that layer 4 and below went NaN; the input-gradient hook names 5."""
    trainer = make_trainer("trainer.on_nan=stop", "trainer.grad_health_every=1")
    trainer.grad_health  # its hooks first: they see the input before the injection wraps it

    def nan_input_grad(_module, args, kwargs):
        if torch.is_grad_enabled():
            kwargs["hidden_states"] = NaNGradient.apply(kwargs["hidden_states"])
        return args, kwargs

    trainer.core.decoder.layers[5].register_forward_pre_hook(nan_input_grad, with_kwargs=True)
    from errors import ProjectError

    with pytest.raises(ProjectError) as err:
        trainer.train_step(trainer.data.train.next_global_batch())
    assert err.value.code == 4
    assert "first non-finite gradient in backward order: layer_05.mamba" in str(err.value)
    stats = trainer.grad_health.collect()
    bad = dict(zip(stats.names, stats.nonfinite))
    assert bad["layer_05.mamba"] == 0 and bad["layer_04.mlp"] > 0  # layer 5's weights: finite
    assert stats.nonfinite_groups()[:2] == ["layer_05.mamba", "layer_04.mlp"]


def test_hooks_change_no_gradient(make_trainer):
    """The statistics read the gradients; the step is the one without them, bit for bit."""
    trainer = make_trainer("trainer.grad_health_every=1", "trainer.grad_clip=0")
    batch = trainer.data.train.next_global_batch()
    weights = [p.detach().clone() for p in trainer.core.parameters()]
    first = trainer.train_step(batch)
    grads = [p.main_grad.clone() for p in trainer.core.parameters()]
    for p, w in zip(trainer.core.parameters(), weights):  # the same step again, unwatched
        p.data.copy_(w)
    trainer.grad_health.remove()
    trainer.cfg.trainer.grad_health_every = 0
    trainer.step = 0
    from training.schedules import run_micro_batches

    trainer.model.zero_grad_buffer()
    loss = run_micro_batches(trainer.model, batch, trainer.ctx, trainer.activation_shape)
    assert loss.item() == first.loss
    assert all(torch.equal(p.main_grad, g) for p, g in zip(trainer.core.parameters(), grads))
