"""torch.distributed and megatron-core parallel state, for torchrun and for a plain `python`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from errors import ConfigError
from model.device import Hardware, cuda_present, probe_hardware


@dataclass(frozen=True)
class ParallelContext:
    world_size: int
    rank: int
    tensor: int
    pipeline: int
    data: int
    tensor_rank: int
    pipeline_rank: int
    data_rank: int
    device: torch.device
    # What `device` offers (model/device.py): every device-dependent choice reads it. Probed
    # from `device` when not given; tests state any machine here.
    hardware: Optional[Hardware] = None
    # The MoE layers' expert grid (parallel.expert_model_parallel_size and the expert tensor
    # parallel size megatron resolved: `tensor` unless set).
    expert: int = 1
    expert_tensor: Optional[int] = None

    def __post_init__(self):
        if self.expert_tensor is None:
            object.__setattr__(self, "expert_tensor", self.tensor)
        if self.hardware is None and self.device is not None:
            object.__setattr__(self, "hardware", probe_hardware(self.device))

    @property
    def expert_data(self) -> int:
        """The expert data-parallel size: the ranks holding the same experts."""
        return self.world_size // (self.expert * self.expert_tensor * self.pipeline)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_parallel_size(tensor: int, pipeline: int, world_size: int) -> int:
    """world size / (tensor x pipeline), or ConfigError when it does not divide: the config's
    `validate` checks it, and init_distributed before megatron splits the process group."""
    if world_size % (tensor * pipeline):
        raise ConfigError(
            f"parallel.tensor={tensor} x parallel.pipeline={pipeline} must divide the world size "
            f"({world_size} processes); data parallel = world size / (tensor x pipeline)"
        )
    return world_size // (tensor * pipeline)


def launched_world_size() -> int:
    """How many processes this run has, before joining their group (init_distributed): torchrun's
    and srun's WORLD_SIZE beside RANK, else one."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1


# How long a rank waits in a collective for the others before the job fails
# (`parallel.timeout_minutes`). torch's defaults are 10 minutes for NCCL and 30 for gloo
# (torch/distributed/constants.py); a 12B checkpoint keeps ranks waiting for the slowest writer
# longer than 10 minutes where one rank holds a large share (docs/benchmarks/checkpoint-scaling.md).
DEFAULT_TIMEOUT_MINUTES = 30


def init_distributed(tensor: int, pipeline: int, backend: str = "auto",
                     timeout_minutes: int = DEFAULT_TIMEOUT_MINUTES, expert_parallel: int = 1,
                     expert_tensor_parallel: Optional[int] = None) -> ParallelContext:
    """Join the process group torchrun set up (or make a one-process group) and split it; every
    group (the world's and megatron's) gives up on a collective after `timeout_minutes`.
    `expert_parallel`, `expert_tensor_parallel`: the MoE layers' expert groups
    (parallel.expert_model_parallel_size / expert_tensor_parallel_size; None: `tensor`)."""
    from megatron.core import parallel_state

    if backend == "auto":
        backend = "nccl" if cuda_present() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:  # torchrun / srun set the rendezvous
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # plain `python train.py`: a group of one. The environment is left untouched, so
            # processes this one starts (tests, launchers) do not inherit its rendezvous port.
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    data_parallel_size(tensor, pipeline, world)  # megatron's own refusal would be a RuntimeError
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(  # its groups' timeout (0.16.1 parallel_state.py:819, core_v0.19.0 :909)
            tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
            distributed_timeout_minutes=timeout_minutes,
            expert_model_parallel_size=expert_parallel,  # parallel_state.py:557-559, 786-795
            expert_tensor_parallel_size=expert_tensor_parallel,
        )
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    return ParallelContext(
        world_size=world,
        rank=dist.get_rank(),
        tensor=tensor,
        pipeline=pipeline,
        data=parallel_state.get_data_parallel_world_size(),
        tensor_rank=parallel_state.get_tensor_model_parallel_rank(),
        pipeline_rank=parallel_state.get_pipeline_model_parallel_rank(),
        data_rank=parallel_state.get_data_parallel_rank(),
        device=device,
        expert=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def stochastic_rounding_seed(seed: int, ctx: ParallelContext) -> int:
    """The seed of this rank's stochastic-rounding draws: distinct on every rank.

    Ranks that quantize different data must not share a stream: data-parallel replicas see other
    samples, tensor-parallel ranks other shards of the same GEMM (a shared stream would round
    both shards with the same draws), pipeline ranks other layers. One process keeps seed + 1.
    """
    index = ctx.data_rank + ctx.data * (ctx.tensor_rank + ctx.tensor * ctx.pipeline_rank)
    return seed + 1 + 1000 * index


def data_parallel_group():
    """megatron's data-parallel group (None before the parallel state is set up)."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_group()
            if parallel_state.model_parallel_is_initialized() else None)


def mean_over_data_parallel(t: torch.Tensor) -> torch.Tensor:
    """`t` averaged in place over the data-parallel ranks (a step's or a validation's loss)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return t


def step_loss_and_stop(loss: torch.Tensor, stop: bool, ctx: ParallelContext) -> tuple[float, bool]:
    """A step's loss averaged over the data-parallel ranks, and whether any rank of the world
    asked to `stop`, in one all-reduce and one device-to-host copy (the one reading the loss
    needs anyway): the stop flag rides in the loss's reduction.

    The reduction runs over the whole world, so that tensor and pipeline ranks agree on the
    flag too; only the first tensor and pipeline rank of each replica adds its loss (the others
    hold copies: run_micro_batches gives every stage the loss), so the sum is the data-parallel
    sum. `loss` is a 0-dim tensor on the run's device."""
    if ctx.world_size == 1:
        return loss.item(), stop
    counted = loss if ctx.tensor_rank == 0 and ctx.pipeline_rank == 0 else torch.zeros_like(loss)
    # new_full writes the flag on the device (a fill kernel): no host-to-device copy
    both = torch.stack([counted, loss.new_full((), float(stop))])
    dist.all_reduce(both)
    both[0] /= ctx.data
    total, stops = both.tolist()
    return total, stops > 0


def any_rank(flag: bool, ctx: ParallelContext) -> bool:
    """Whether `flag` holds on any rank: one all-reduce, every rank gets the answer. The flag is
    a fill on the device, not a host-to-device copy (NCCL needs it on the device)."""
    if ctx.world_size == 1:
        return flag
    box = torch.full((), float(flag), device=ctx.device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def group_joined() -> bool:
    """Whether this process is in a process group (init_distributed ran and shutdown did not)."""
    return dist.is_initialized()


def shutdown() -> None:
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
