"""The warmup-stable-decay schedule, and plain AdamW for the memory planner's FP32 measurement.

Training builds its optimizer in `training.mixed_precision` (FP32 master weights of BF16 models).
"""

from __future__ import annotations

import torch

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


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig):
    """Plain AdamW over the model's own parameters (the planner's FP32 measurement), no weight
    decay on norms, biases and the 1-D Mamba parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
        foreach=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: wsd_lr_factor(step, cfg)
    )
    return optimizer, scheduler
