"""The warmup-stable-decay learning-rate schedule.

The optimizer itself (FP32 master weights of BF16 models) is built in `training.ddp_optimizer`,
by the trainer and by the memory bench (benchmarks/memory.py).
"""

from __future__ import annotations

from .config import TrainerConfig


def wsd_lr_factor(step: int, cfg: TrainerConfig) -> float:
    """lr / peak lr at a step: linear warmup, constant, linear decay to min_lr over the tail."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = round(cfg.decay_fraction * cfg.max_steps)
    decay_start = cfg.max_steps - decay_steps
    floor = cfg.min_lr / cfg.lr
    if decay_steps == 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1.0 - floor) * progress


class WSDScheduler:
    """Sets each param group's `lr` and `weight_decay` as megatron's OptimizerParamScheduler does
    (`optimizer_param_scheduler.py:292-294`, core 0.16.1): the weight decay x the group's
    `wd_mult` (0 for biases and 1-D parameters; megatron's optimizer leaves the decay of such
    groups to the scheduler). step() after each optimizer step."""

    def __init__(self, optimizer, cfg: TrainerConfig):
        self.optimizer, self.cfg = optimizer, cfg
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        factor = wsd_lr_factor(self.last_step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * factor
            group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
