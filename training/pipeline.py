"""Forward and backward over the micro-batches of one step, with or without pipeline stages.

With one stage this is plain gradient accumulation. With several, the portable schedule is
GPipe-style (every forward, then every backward), passing activations and their gradients
between neighbouring stages with torch.distributed send/recv over megatron-core's pipeline
group. megatron-core's own schedules allocate their buffers and counters on CUDA
(`schedules.py:596`, `p2p_communication.py:190`, 0.16.1), so on GPUs we hand the step to
`get_forward_backward_func()` (1F1B) and keep this schedule as its CPU twin.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .distributed import ParallelContext

LossFn = Callable[[torch.nn.Module, dict], torch.Tensor]


def _pipeline_neighbours() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_prev_rank(),
            ps.get_pipeline_model_parallel_next_rank())


def run_micro_batches(model: torch.nn.Module, micro_batches: list[dict], ctx: ParallelContext,
                      loss_fn: LossFn, activation_shape: tuple[int, ...],
                      forward_only: bool = False) -> torch.Tensor:
    """Sum over micro-batches of loss / len(micro_batches), the same value on every stage."""
    n = len(micro_batches)
    if ctx.pipeline == 1:
        total = torch.zeros((), device=ctx.device)
        for batch in micro_batches:
            loss = loss_fn(model, batch) / n
            if not forward_only:
                loss.backward()
            total += loss.detach()
        return total
    if ctx.device.type == "cuda":
        return _megatron_1f1b(model, micro_batches, ctx, loss_fn, activation_shape, forward_only)
    return _gpipe(model, micro_batches, ctx, loss_fn, activation_shape, forward_only)


def _gpipe(model, micro_batches, ctx, loss_fn, shape, forward_only) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    prev_rank, next_rank = _pipeline_neighbours()
    n = len(micro_batches)
    inputs, outputs = [], []
    total = torch.zeros((), device=ctx.device)
    for batch in micro_batches:
        received = None
        if not ctx.first_stage:
            received = torch.empty(shape, device=ctx.device)
            dist.recv(received, src=prev_rank)
            received.requires_grad_(not forward_only)
            model.set_input_tensor(received)
        with torch.set_grad_enabled(not forward_only):
            if ctx.last_stage:
                out = loss_fn(model, batch) / n
                total += out.detach()
            else:
                out = model(batch["tokens"].to(ctx.device), None, None)
                dist.send(out.detach().contiguous(), dst=next_rank)
        inputs.append(received)
        outputs.append(out)
    if not forward_only:
        for received, out in zip(reversed(inputs), reversed(outputs)):
            if ctx.last_stage:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=next_rank)
                torch.autograd.backward(out, grad)
            if not ctx.first_stage:
                dist.send(received.grad.contiguous(), dst=prev_rank)
    # Only the last stage computed the loss: share it with the other stages.
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return total


def _megatron_1f1b(model, micro_batches, ctx, loss_fn, shape, forward_only) -> torch.Tensor:
    """megatron-core's interleaving schedule (GPU): it drives the same model and loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(micro_batches)
    batches = iter(micro_batches)

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        output = loss_fn(module, batch) if ctx.last_stage else module(
            batch["tokens"].to(ctx.device), None, None)

        def reduce(loss):
            return loss / n, {"loss": loss.detach() / n}

        return output, reduce

    seq, micro, _hidden = shape
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=[model],
        num_microbatches=n, seq_length=seq, micro_batch_size=micro, forward_only=forward_only)
    total = torch.zeros((), device=ctx.device)
    if ctx.last_stage:
        total += sum(r["loss"] for r in results)
    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return total
