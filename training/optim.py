"""AdamW on FP32 master weights and the warmup-stable-decay schedule."""

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


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig):
    """AdamW with no weight decay on norms, biases and the 1-D Mamba parameters."""
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
