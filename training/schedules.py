"""Forward and backward over the micro-batches of one step, through megatron's loss contract.

Every path hands its loss to megatron-core's `forward_step_calc_loss`, the function its schedules
use (`pipeline_parallel/schedules.py:218-270`, 0.16.1): our loss function returns the 3-tuple
(sum of token losses, number of tokens, report), and megatron divides by the tokens and by the
number of micro-batches — once. Then `config.finalize_model_grads_func` (megatron's
`finalize_model_grads`: the data-parallel gradient sync) runs, as at the end of its schedules.

- On CUDA the whole step is megatron's schedule (`get_forward_backward_func()`: no pipelining,
  or 1F1B across stages).
- On CPU those schedules allocate on CUDA (`schedules.py:596`, `p2p_communication.py:190`), so
  their twins run here: plain accumulation over micro-batches, and with several stages a GPipe
  order (every forward, then every backward) with send/recv over megatron's pipeline group.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from compat import cpu_sequence_parallel_buffers
from nvfp4_recipe.compute import GemmCompute

from .distributed import ParallelContext

REPORT_KEY = "lm loss"


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """megatron's 3-tuple loss contract (as `pretrain_mamba.py`'s): (loss sum, tokens, report)."""
    mask = loss_mask.reshape(-1).float()
    total = (per_token_loss.reshape(-1).float() * mask).sum()
    tokens = mask.sum().to(torch.int)
    return total, tokens, {REPORT_KEY: torch.stack([total.detach(), mask.sum()])}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the run's device without waiting for the GPU: a blocking host-to-device
    copy synchronizes the stream (PyTorch aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda ->
    memcpy_and_sync), and an asynchronous one from pageable memory may too (the driver stages it
    through pinned memory, CUDA runtime API, "API synchronization behavior"). So: pinned, then
    non_blocking, as torch's DataLoader(pin_memory=True) does; the caching host allocator keeps
    the pinned block until the copy is done. A CPU run gets the tensor itself."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def make_forward_step(ctx: ParallelContext) -> Callable:
    """megatron's `forward_step_func(data_iterator, model) -> (output, loss_func)`."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        tokens = to_device(batch["tokens"], ctx.device)
        if ctx.last_stage:
            output = model(tokens, None, None, labels=to_device(batch["labels"], ctx.device))
        else:
            output = model(tokens, None, None)
        return output, partial(loss_func, to_device(batch["loss_mask"], ctx.device))

    return forward_step


def mean_micro_batch_loss(reports: list[dict], n: int, device) -> torch.Tensor:
    """The mean over micro-batches of each one's mean token loss: what the gradient is of."""
    total = torch.zeros((), device=device)
    for report in reports:
        loss_sum, tokens = report[REPORT_KEY]
        total += loss_sum / tokens.clamp(min=1)
    return total / n


def run_micro_batches(model: torch.nn.Module, micro_batches: list[dict], ctx: ParallelContext,
                      activation_shape: tuple[int, ...], forward_only: bool = False,
                      gemm: Optional[GemmCompute] = None) -> torch.Tensor:
    """One step's forward (and backward) with gradients synced; the loss on every stage.

    Its GEMMs compute as `gemm` says (default: this device's `auto` policy): on a CPU without
    BF16 instructions, in FP32 on the BF16 values (nvfp4_recipe/compute.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    n = len(micro_batches)
    reports = run_schedule(model, micro_batches, ctx, activation_shape, make_forward_step(ctx),
                           forward_only, gemm)
    if not forward_only and ctx.device.type != "cuda" and config.finalize_model_grads_func:
        config.finalize_model_grads_func([model])  # megatron's schedules end with this
    total = mean_micro_batch_loss(reports, n, ctx.device) if ctx.last_stage else (
        torch.zeros((), device=ctx.device))
    if ctx.pipeline > 1:  # only the last stage computed the loss
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return total


def run_schedule(model: torch.nn.Module, micro_batches: list[dict], ctx: ParallelContext,
                 activation_shape: tuple[int, ...], forward_step: Callable, forward_only: bool,
                 gemm: Optional[GemmCompute] = None) -> list[dict]:
    """`forward_step`'s loss reports (the last stage's; empty elsewhere) from megatron's schedule
    on CUDA or its CPU twin, under the GEMM compute policy: what run_micro_batches runs, and what
    the downstream evaluation (training/lm_eval_model.py) runs with its own forward step."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    gemm = gemm or ctx.hardware.gemm_compute()
    if ctx.device.type == "cuda":
        return _megatron_schedule(model, micro_batches, forward_step, activation_shape,
                                  forward_only)
    # megatron's first-dim all-gather / reduce-scatter allocate on torch.cuda.current_device()
    # (tensor_parallel/mappings.py:141): sequence parallelism uses them, and so does the MoE
    # all-to-all token dispatcher whenever it spans ranks, expert-parallel or expert
    # tensor-parallel (its token counts' gather, token_dispatcher.py:538-541, its TP gather,
    # :696, and its all-to-all-v's output, mappings.py:442), as in an evaluation at TP=2 without
    # sequence parallelism (expert TP defaults to TP, parallel_state.py:786-787)
    experts_span = config.num_moe_experts is not None and (
        config.expert_model_parallel_size * (config.expert_tensor_parallel_size or 1) > 1)
    gathers = config.sequence_parallel or experts_span
    with cpu_sequence_parallel_buffers(gathers, cuda=False), gemm.context():
        if ctx.pipeline == 1:
            return _accumulate(model, micro_batches, forward_step, config, forward_only)
        return _gpipe(model, micro_batches, ctx, forward_step, config,
                      stage_tensor_shape(activation_shape, config), forward_only)


def stage_tensor_shape(activation_shape: tuple[int, ...], config) -> tuple[int, ...]:
    """What one pipeline stage sends the next: [s, b, h], the sequence split over the tensor
    group under sequence parallelism (megatron's `get_tensor_shapes`, mc 0.16.1
    pipeline_parallel/schedules.py:1965-1966; the CUDA path passes the full shape to it)."""
    seq, *rest = activation_shape
    if config.sequence_parallel:
        seq //= config.tensor_model_parallel_size
    return (seq, *rest)


def _calc_loss(model, output, loss_fn, config, n, reports):
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    loss, _tokens = forward_step_calc_loss(model, output, loss_fn, config, None, False, n,
                                           reports, cp_group_size=1, is_last_stage=True)
    return loss


def _accumulate(model, micro_batches, forward_step, config, forward_only) -> list[dict]:
    """Twin of megatron's `forward_backward_no_pipelining`."""
    reports: list[dict] = []
    batches = iter(micro_batches)
    for _ in micro_batches:
        with torch.set_grad_enabled(not forward_only):
            output, loss_fn = forward_step(batches, model)
            loss = _calc_loss(model, output, loss_fn, config, len(micro_batches), reports)
        if not forward_only:
            loss.backward()
    return reports


def _gpipe(model, micro_batches, ctx, forward_step, config, shape, forward_only) -> list[dict]:
    """The CPU stand-in for megatron's 1F1B schedule, in GPipe order (every forward, then every
    backward, the last micro-batch's first): the same computation in another order, holding
    every micro-batch's activations at once."""
    from megatron.core import parallel_state as ps

    prev_rank = ps.get_pipeline_model_parallel_prev_rank()
    next_rank = ps.get_pipeline_model_parallel_next_rank()
    n = len(micro_batches)
    batches = iter(micro_batches)
    inputs, outputs, reports = [], [], []
    for _ in micro_batches:
        received = None
        if not ctx.first_stage:
            received = torch.empty(shape, device=ctx.device, dtype=config.pipeline_dtype)
            dist.recv(received, src=prev_rank)
            received.requires_grad_(not forward_only)
            model.set_input_tensor(received)
        with torch.set_grad_enabled(not forward_only):
            out, loss_fn = forward_step(batches, model)
            if ctx.last_stage:
                out = _calc_loss(model, out, loss_fn, config, n, reports)
            else:
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
    return reports


def _megatron_schedule(model, micro_batches, forward_step, shape, forward_only) -> list[dict]:
    """megatron-core's schedule (GPU): `forward_backward_no_pipelining`, or with several stages
    `forward_backward_pipelining_without_interleaving`: 1F1B with one model chunk per stage (no
    virtual pipeline size is set, so never the interleaved schedule)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq, micro, _hidden = shape
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=micro,
        forward_only=forward_only)
