"""The validation loss: the held-out batches, forward only, every `trainer.eval_every` steps and
after the last one."""

from __future__ import annotations

import torch

from .cadence import Every
from .distributed import mean_over_data_parallel
from .schedules import run_micro_batches


class Validator:
    def __init__(self, model, batches: list, ctx, activation_shape, gemm, before, due: Every):
        """`before()`: the precision controller's switch to evaluation (weights re-quantized
        without stochastic rounding); `due`: this component's cadence."""
        self.model, self.batches, self.ctx = model, batches, ctx
        self.activation_shape, self.gemm, self.before = activation_shape, gemm, before
        self.due = due

    @torch.no_grad()
    def loss(self) -> float:
        """The mean token loss over the validation batches, averaged over data-parallel ranks."""
        self.model.eval()
        self.before()
        loss = run_micro_batches(self.model, self.batches, self.ctx, self.activation_shape,
                                 forward_only=True, gemm=self.gemm)
        return mean_over_data_parallel(loss).item()
