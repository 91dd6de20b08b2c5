"""The warmup-stable-decay schedule, the paper's shape, and its state across a resume."""

import pytest
import torch

from training.config import TrainerConfig
from training.lr_schedule import WSDScheduler, wsd_lr_factor


def test_wsd_warmup_constant_then_linear_decay_to_min_lr():
    cfg = TrainerConfig(max_steps=100, warmup_steps=10, decay_fraction=0.2, lr=1e-3, min_lr=1e-5)
    factors = [wsd_lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(f == 1.0 for f in factors[10:80])  # stable phase
    assert factors[80] < 1.0 and factors[99] == pytest.approx(0.01)  # min_lr / lr
    decay = factors[80:]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_scheduler_loaded_from_its_state_dict_sets_the_same_lr_and_weight_decay():
    """A resumed run's optimizer gets the saved step's lr at once, before its first step."""
    cfg = TrainerConfig(max_steps=10, warmup_steps=4, decay_fraction=0.5, lr=1e-3, min_lr=1e-5,
                        weight_decay=0.1)

    def adam():
        groups = [{"params": [torch.nn.Parameter(torch.ones(2, 2))], "wd_mult": 1.0},
                  {"params": [torch.nn.Parameter(torch.ones(2))], "wd_mult": 0.0}]
        return torch.optim.AdamW(groups)

    saved = WSDScheduler(adam(), cfg)
    for _ in range(7):  # into the decay
        saved.step()
    resumed = WSDScheduler(adam(), cfg)
    resumed.load_state_dict(saved.state_dict())

    def settings(scheduler):
        return [(g["lr"], g["weight_decay"]) for g in scheduler.optimizer.param_groups]

    assert settings(resumed) == settings(saved)
    assert settings(resumed)[0] == (pytest.approx(1e-3 * wsd_lr_factor(7, cfg)), 0.1)
    assert settings(resumed)[1][1] == 0.0  # wd_mult 0: no decay on 1-D parameters
    for scheduler in (saved, resumed):
        scheduler.step()
    assert settings(resumed) == settings(saved)
