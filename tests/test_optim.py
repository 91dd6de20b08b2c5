"""The warmup-stable-decay schedule, the paper's shape."""

import pytest

from training.config import TrainerConfig
from training.optim import wsd_lr_factor


def test_wsd_warmup_constant_then_linear_decay_to_min_lr():
    cfg = TrainerConfig(max_steps=100, warmup_steps=10, decay_fraction=0.2, lr=1e-3, min_lr=1e-5)
    factors = [wsd_lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(f == 1.0 for f in factors[10:80])  # stable phase
    assert factors[80] < 1.0 and factors[99] == pytest.approx(0.01)  # min_lr / lr
    decay = factors[80:]
    assert all(a > b for a, b in zip(decay, decay[1:]))
