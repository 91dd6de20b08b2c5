"""Mixed precision and data parallelism the Megatron way: BF16 weights, FP32 grads and master weights.

What every device runs (Megatron-LM's `--bf16` with its DDP and optimizer):
- parameters and activations in BF16 (megatron's `Float16Module` casts the model; it runs on CPU);
- each parameter's gradient accumulated over the step's micro-batches in an FP32 `main_grad`,
  a view into one contiguous buffer, averaged over data-parallel ranks at the end of the step;
- FP32 master weights and Adam moments in the optimizer; with `trainer.distributed_optimizer`
  each data-parallel rank owns 1/DP of them (reduce-scatter of the grads, all-gather of the
  updated BF16 weights), so optimizer memory per rank falls by the data-parallel size.

On CUDA these are megatron-core's own `DistributedDataParallel` and `get_megatron_optimizer`
(`build_data_parallel_model`). They hard-code CUDA (`param_and_grad_buffer.py:768-806`,
`optimizer.py:473-485`, `clip_grads.py:90`, core 0.16.1), so on CPU the classes below are their
twins: the same interface (zero_grad_buffer / finish_grad_sync, prepare_grads / get_grad_norm /
clip_grad_norm / step_with_ready_grads, sharded_state_dict / load_state_dict) and semantics.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# The dtypes of a training run, on every device (the policy, not a per-layer choice).
PARAMS_DTYPE = torch.bfloat16  # model weights and activations: what every GEMM receives
MAIN_GRADS_DTYPE = torch.float32  # gradient accumulation and data-parallel reduction
MAIN_PARAMS_DTYPE = torch.float32  # master weights and Adam moments
# Optimizer state kept per master weight (megatron's names, so checkpoints read alike).
OPTIMIZER_STATE_KEYS = ("fp32_param", "exp_avg", "exp_avg_sq")


def uses_megatron_ddp(device: torch.device) -> bool:
    """megatron-core's DDP and optimizer where they run (CUDA); the twins elsewhere."""
    return device.type == "cuda"


def optimizer_checkpoint_format(device: torch.device, distributed_optimizer: bool) -> str:
    """The layout a run writes its optimizer state in; only the same layout can be loaded.

    The CPU twin writes one layout with or without sharding; megatron's two optimizers write
    their own (`distrib_optimizer.py` and `optimizer.py` sharded_state_dict, core 0.16.1), which
    differ from each other and from the twin's in keys and structure.
    """
    if not uses_megatron_ddp(device):
        return "cpu-twin"
    return "megatron-distributed" if distributed_optimizer else "megatron"


def is_no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """megatron's default rule: no weight decay on biases and 1-D parameters (norms, A, D, dt)."""
    return name.endswith(".bias") or param.ndim < 2


@dataclass(frozen=True)
class ShardLayout:
    """Where each parameter lives in the flat buffers, and which slice this rank's optimizer owns.

    Parameters are laid out one after another; the buffer is padded to a multiple of the number
    of shards (the data-parallel size with the distributed optimizer, else 1), and shard r is the
    contiguous range [r * shard_size, (r + 1) * shard_size), as megatron's distributed optimizer
    divides its buffers.
    """

    offsets: tuple[int, ...]  # start of each parameter
    numels: tuple[int, ...]
    num_shards: int
    shard_index: int

    @classmethod
    def build(cls, numels: list[int], num_shards: int, shard_index: int) -> "ShardLayout":
        offsets, start = [], 0
        for n in numels:
            offsets.append(start)
            start += n
        return cls(tuple(offsets), tuple(numels), num_shards, shard_index)

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def padded_total(self) -> int:
        return -(-self.total // self.num_shards) * self.num_shards

    @property
    def shard_size(self) -> int:
        return self.padded_total // self.num_shards

    @property
    def shard_range(self) -> tuple[int, int]:
        lo = self.shard_index * self.shard_size
        return lo, lo + self.shard_size

    def owned(self, index: int) -> Optional[tuple[int, int]]:
        """The part [start, end) of parameter `index` (in its own flat numbering) this shard owns."""
        lo, hi = self.shard_range
        start, end = self.offsets[index], self.offsets[index] + self.numels[index]
        a, b = max(start, lo), min(end, hi)
        return (a - start, b - start) if a < b else None


class FlatBuffer:
    """One contiguous BF16 weight buffer and its FP32 gradient buffer over `params`, reduced over
    `group` (its size: `size`) and, with the distributed optimizer, sharded over it.

    megatron's DDP keeps two: one for the dense parameters over the data-parallel group, one for
    the expert-parallel parameters (`allreduce=False`, experts.py:203-204 and SequentialMLP's
    experts) over the expert data-parallel group (distributed_data_parallel.py:106-126, 295-302
    in core 0.16.1), as each expert lives on 1/EP of the data-parallel ranks."""

    def __init__(self, params: list[torch.nn.Parameter], group, sharded: bool, expert: bool):
        self.params, self.group, self.expert = params, group, expert
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.sharded = sharded and self.size > 1
        self.layout = ShardLayout.build([p.numel() for p in params],
                                        self.size if sharded else 1, rank if sharded else 0)
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"one parameter dtype expected for the flat buffer, found {dtypes}")
        self.param_data = torch.zeros(self.layout.padded_total, dtype=dtypes.pop())
        self.grad_data = torch.zeros(self.layout.padded_total, dtype=MAIN_GRADS_DTYPE)
        for p, start, n in zip(params, self.layout.offsets, self.layout.numels):
            self.param_data[start:start + n].copy_(p.data.view(-1))
            p.data = self.param_data[start:start + n].view(p.shape)
            p.main_grad = self.grad_data[start:start + n].view(p.shape)
            p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)

    def reduce(self, scale: float, force_all_reduce: bool) -> None:
        """Scale, then sum over the group: into this rank's shard, or everywhere."""
        if scale != 1.0:
            self.grad_data.mul_(scale)
        if self.size == 1:
            return
        if self.sharded and not force_all_reduce:
            lo, hi = self.layout.shard_range
            shard = torch.empty(hi - lo, dtype=self.grad_data.dtype)
            dist.reduce_scatter_tensor(shard, self.grad_data, group=self.group)
            self.grad_data[lo:hi].copy_(shard)
        else:
            dist.all_reduce(self.grad_data, group=self.group)

    def gather(self) -> None:
        """After the optimizer updated this rank's shard: every rank of the group gets every
        BF16 weight."""
        if self.sharded:
            lo, hi = self.layout.shard_range
            dist.all_gather_into_tensor(self.param_data, self.param_data[lo:hi].clone(),
                                        group=self.group)


class BufferedDataParallel(torch.nn.Module):
    """CPU twin of `megatron.core.distributed.DistributedDataParallel`.

    Each parameter's `.data` and `.main_grad` are views into flat buffers (BF16 weights, FP32
    grads): one for the dense parameters, one for the experts' (`FlatBuffer`). A post-accumulate
    hook moves every micro-batch's gradient into `main_grad` in FP32 and frees `.grad`, as
    megatron's backward hook does (`distributed_data_parallel.py`, `_make_backward_post_hook`).
    `finish_grad_sync` scales every gradient by 1 / data-parallel size and sums the dense ones
    over the data-parallel group, the experts' over the expert data-parallel group (megatron's
    average_in_collective=False, distributed_data_parallel.py:259-289): an expert's gradient
    already holds every token the EP group sent it, so summing its EDP copies counts each of
    the DP ranks' tokens once. With the distributed optimizer each sum is a reduce-scatter into
    this rank's shard of that buffer.

    `params` lists every trained parameter, the dense ones first, then the experts'.
    """

    def __init__(self, module: torch.nn.Module, *, data_parallel_group=None,
                 expert_data_parallel_group=None, use_distributed_optimizer: bool = False):
        from megatron.core.distributed import DistributedDataParallelConfig

        super().__init__()
        self.module = module
        # What megatron's finalize_model_grads reads from a DDP model chunk.
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer)
        self.dp_group = data_parallel_group
        self.dp_size = dist.get_world_size(data_parallel_group) if dist.is_initialized() else 1
        self.use_distributed_optimizer = use_distributed_optimizer
        trained = [p for p in module.parameters() if p.requires_grad]
        dense = [p for p in trained if getattr(p, "allreduce", True)]
        experts = [p for p in trained if not getattr(p, "allreduce", True)]
        if experts and expert_data_parallel_group is None and dist.is_initialized() \
                and self.dp_size > 1:
            raise ValueError("expert-parallel parameters need the expert data-parallel group")
        self.buffers = [FlatBuffer(dense, data_parallel_group, use_distributed_optimizer, False)]
        if experts:
            self.buffers.append(FlatBuffer(experts, expert_data_parallel_group,
                                           use_distributed_optimizer, True))
        self.params = dense + experts
        # parameter index in self.params -> (its buffer, its index there)
        self.location = [(b, i) for b in self.buffers for i in range(len(b.params))]

    def owned(self, index: int) -> Optional[tuple[int, int]]:
        """The part [start, end) of parameter `index` this rank's optimizer owns (None: none)."""
        buffer, i = self.location[index]
        return buffer.layout.owned(i)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.grad_data.zero_()
        for p in self.params:
            p.grad = None

    @contextmanager
    def no_sync(self):
        """Gradients are reduced once per step, in finish_grad_sync: nothing to suspend."""
        yield

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        if self.dp_size == 1:
            return
        for buffer in self.buffers:  # megatron's gradient_scaling_factor = 1 / DP for both
            buffer.reduce(1.0 / self.dp_size, force_all_reduce)

    def gather_params(self) -> None:
        """After the optimizer updated this rank's shards: every rank gets every BF16 weight."""
        if self.use_distributed_optimizer:
            for buffer in self.buffers:
                buffer.gather()


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class MixedPrecisionOptimizer:
    """CPU twin of megatron's `Float16OptimizerWithFloat16Params` / `DistributedOptimizer`
    (a ChainedOptimizer of a dense one and an expert one when the model has experts).

    AdamW on FP32 master copies of the part of each parameter this rank owns (all of it without
    the distributed optimizer). The grad norm counts every element once: the dense parameters'
    squares summed over the model-parallel ranks, the experts' over the expert tensor x model x
    pipeline ranks (megatron's two grad_stats_parallel_group, optimizer/__init__.py:446-466 and
    :640-680 in core 0.16.1), each over every rank when its buffer is sharded; the norm is the
    root of the sum of both (ChainedOptimizer.get_grad_norm, optimizer.py:1270-1287). Clipping
    is megatron's `max_norm / (norm + 1e-6)`.
    """

    def __init__(self, model: BufferedDataParallel, *, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, model_parallel_group=None,
                 expert_model_parallel_group=None):
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        self.model = model
        names = {id(p): n for n, p in model.module.named_parameters()}
        # (model param index, its owned range) and the FP32 master slice of each owned piece.
        self.pieces: list[tuple[int, int, int, torch.nn.Parameter]] = []
        decay, no_decay = [], []
        self.counts_in_norm: list[bool] = []
        self.is_expert: list[bool] = []
        for i, p in enumerate(model.params):
            owned = model.owned(i)
            if owned is None:
                continue
            a, b = owned
            master = torch.nn.Parameter(p.detach().view(-1)[a:b].to(MAIN_PARAMS_DTYPE))
            self.pieces.append((i, a, b, master))
            self.counts_in_norm.append(bool(param_is_not_tensor_parallel_duplicate(p)))
            self.is_expert.append(model.location[i][0].expert)
            (no_decay if is_no_weight_decay(names[id(p)], p) else decay).append(master)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        # The scheduler sets each group's lr and weight decay (x its wd_mult), as megatron's.
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                      eps=eps, weight_decay=weight_decay, foreach=True)
        # Where each kind's squares are summed: every element is owned by one rank of it.
        dense_sharded = model.buffers[0].sharded
        expert_sharded = len(model.buffers) > 1 and model.buffers[1].sharded
        self.norm_groups = {False: None if dense_sharded else model_parallel_group,
                            True: None if expert_sharded else expert_model_parallel_group}

    @property
    def param_groups(self):
        return self.adam.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for *_, master in self.pieces:
            master.grad = None

    def flat_slice(self, index: int, a: int, b: int, grads: bool) -> torch.Tensor:
        """The slice [a, b) of parameter `index`'s main grad or BF16 weight (views into the
        model's flat buffers)."""
        p = self.model.params[index]
        return (p.main_grad if grads else p.data).view(-1)[a:b]

    def prepare_grads(self) -> bool:
        """Point each master slice's .grad at its FP32 main grad; False: nothing found amiss."""
        for i, a, b, master in self.pieces:
            master.grad = self.flat_slice(i, a, b, grads=True)
        return False

    def get_grad_norm(self) -> float:
        squares = {False: torch.zeros((), dtype=torch.float32),
                   True: torch.zeros((), dtype=torch.float32)}
        for (*_, master), counted, expert in zip(self.pieces, self.counts_in_norm,
                                                 self.is_expert):
            if counted:
                squares[expert] += master.grad.pow(2).sum()
        if dist.is_initialized():
            groups = self.norm_groups
            experts = len(self.model.buffers) > 1
            if not experts or groups[False] is groups[True]:  # one reduction for both
                total = squares[False] + squares[True]
                if dist.get_world_size(groups[False]) > 1:
                    dist.all_reduce(total, group=groups[False])
            else:
                for expert in (False, True):
                    if dist.get_world_size(groups[expert]) > 1:
                        dist.all_reduce(squares[expert], group=groups[expert])
                total = squares[False] + squares[True]
        else:
            total = squares[False] + squares[True]
        return math.sqrt(total.item()) if torch.isfinite(total) else float("nan")

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = self.get_grad_norm()
        coeff = max_norm / (norm + 1.0e-6)
        if coeff < 1.0:
            for *_, master in self.pieces:
                master.grad.mul_(coeff)
        return norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.adam.step()
        for i, a, b, master in self.pieces:
            self.flat_slice(i, a, b, grads=False).copy_(master)
        self.model.gather_params()
        return True

    def step(self, clip_grad: float = 0.0):
        """megatron's step(): (update applied, grad norm, zeros counted (not counted: None))."""
        self.prepare_grads()
        norm = self.clip_grad_norm(clip_grad) if clip_grad > 0 else self.get_grad_norm()
        return self.step_with_ready_grads(), norm, None

    # -- checkpoints --------------------------------------------------------------------------
    def _state_value(self, master: torch.nn.Parameter, key: str) -> Optional[torch.Tensor]:
        return master if key == "fp32_param" else self.adam.state[master].get(key)

    def _gathered_state(self) -> list[dict[str, torch.Tensor]]:
        """Per model parameter, its full FP32 master weight and Adam moments (each buffer's
        shards gathered over its group)."""
        pieces = {i: (a, b, master) for i, a, b, master in self.pieces}
        state: list[dict[str, torch.Tensor]] = [{} for _ in self.model.params]
        first = 0  # index in model.params of the buffer's first parameter
        for buffer in self.model.buffers:
            layout = buffer.layout
            lo, hi = layout.shard_range
            for key in OPTIMIZER_STATE_KEYS:
                shard = torch.zeros(hi - lo, dtype=MAIN_PARAMS_DTYPE)
                for local in range(len(buffer.params)):
                    if first + local not in pieces:
                        continue
                    a, b, master = pieces[first + local]
                    value = self._state_value(master, key)
                    if value is not None:
                        start = layout.offsets[local] + a - lo
                        shard[start:start + b - a].copy_(value.detach())
                if layout.num_shards > 1:
                    flat = torch.empty(layout.padded_total, dtype=MAIN_PARAMS_DTYPE)
                    dist.all_gather_into_tensor(flat, shard, group=buffer.group)
                else:
                    flat = shard
                for local, (p, start, n) in enumerate(zip(buffer.params, layout.offsets,
                                                          layout.numels)):
                    state[first + local][key] = flat[start:start + n].view(p.shape)
            first += len(buffer.params)
        return state

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """The optimizer state as megatron ShardedTensors, in megatron's layout
        `metadata["distrib_optim_sharding_type"]` (default "fully_reshardable"):

        - fully_reshardable: master weights and moments keyed like the model's tensors, each with
          its parameter's shape, written once (by the rank whose replica id is the model
          tensor's main one), read whole by every rank, which keeps its own slice. Loads at any
          TP/PP/DP/EP and on either spec (keys translate, model/hf.py:spec_key): an expert's
          state is keyed by its global expert index, as its weights are. With the sharded
          optimizer the save gathers every rank's shard into full tensors on every rank.
        - dp_reshardable: each rank writes and reads only its own contiguous shard of each flat
          buffer, one 1-D tensor per state over the unpadded buffer (`dp_flat_shards`), as
          megatron's distributed optimizer keys its buckets (distrib_optimizer.py:1539-1687,
          core 0.16.1). No gather, no full tensors; loads at any data-parallel size (the flat
          layout does not depend on it) but only at the same TP/PP/EP and parameter order.
        """
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        layout = (metadata or {}).get("distrib_optim_sharding_type", "fully_reshardable")
        if layout == "dp_reshardable":
            return {"optimizer_steps": self._optimizer_steps(),
                    "param_state": self.dp_flat_shards(is_loading)}
        if layout != "fully_reshardable":
            raise ValueError(f"optimizer checkpoint layout {layout!r}: the CPU twin writes "
                             "fully_reshardable or dp_reshardable")
        # {index of the parameter in self.model.params: its model ShardedTensor (or factory)}
        by_index = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.model.params)
        if is_loading:
            state = [{key: torch.zeros(p.shape, dtype=MAIN_PARAMS_DTYPE)
                      for key in OPTIMIZER_STATE_KEYS} for p in self.model.params]
        else:
            state = self._gathered_state()
        return {"optimizer_steps": self._optimizer_steps(), "param_state": {
            key: {str(i): make_sharded_optimizer_tensor(by_index[i], tensors[key],
                                                        f"optimizer.state.{key}")
                  for i, tensors in enumerate(state)}
            for key in OPTIMIZER_STATE_KEYS}}

    @staticmethod
    def _owned_span(buffer: FlatBuffer) -> tuple[int, int]:
        """[lo, hi) of the buffer's unpadded flat range this rank's optimizer owns (empty:
        lo == hi)."""
        lo, hi = buffer.layout.shard_range
        hi = min(hi, buffer.layout.total)
        return min(lo, hi), hi

    def dp_flat_shards(self, is_loading: bool) -> dict:
        """{"dense" | "expert": {state key: ShardedTensor of this rank's span of that flat FP32
        buffer}}: the dp_reshardable layout. Keyed per tensor/pipeline rank, and the experts' per
        expert tensor/model-parallel rank too (their buffers hold other parameters); global
        shape the unpadded buffer, so another data-parallel size reads other spans of the same
        tensors."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        pieces = {i: (a, b, master) for i, a, b, master in self.pieces}
        pp = (f"pp{ps.get_pipeline_model_parallel_rank()}of"
              f"{ps.get_pipeline_model_parallel_world_size()}")
        out, first = {}, 0
        for buffer in self.model.buffers:
            if buffer.expert:
                domain = (f"expert.etp{ps.get_expert_tensor_parallel_rank()}of"
                          f"{ps.get_expert_tensor_parallel_world_size()}."
                          f"ep{ps.get_expert_model_parallel_rank()}of"
                          f"{ps.get_expert_model_parallel_world_size()}.{pp}")
            else:
                domain = (f"tp{ps.get_tensor_model_parallel_rank()}of"
                          f"{ps.get_tensor_model_parallel_world_size()}.{pp}")
            lo, hi = self._owned_span(buffer)
            shards = {}
            for key in OPTIMIZER_STATE_KEYS if lo < hi else ():  # lo == hi: owns nothing
                flat = torch.empty(hi - lo, dtype=MAIN_PARAMS_DTYPE)
                if not is_loading:
                    for local in range(len(buffer.params)):
                        if first + local not in pieces:
                            continue
                        a, b, master = pieces[first + local]
                        value = self._state_value(master, key)
                        start = buffer.layout.offsets[local] + a - lo
                        if value is None:  # before the first step Adam has no moments
                            flat[start:start + b - a].zero_()
                        else:
                            flat[start:start + b - a].copy_(value.detach())
                shards[key] = ShardedTensor(
                    key=f"optimizer.dp_reshardable.{domain}.{key}", data=flat, dtype=flat.dtype,
                    local_shape=(hi - lo,), global_shape=(buffer.layout.total,),
                    global_offset=(lo,), axis_fragmentations=None,
                    replica_id=0)  # a span no other rank holds
            out["expert" if buffer.expert else "dense"] = shards
            first += len(buffer.params)
        return out

    def _optimizer_steps(self) -> int:
        """Adam's step count (the same for every parameter; skipped steps do not count)."""
        for *_, master in self.pieces:
            if "step" in self.adam.state[master]:
                return int(self.adam.state[master]["step"])
        return 0

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Take this rank's part of the loaded state (from sharded_state_dict(is_loading)): its
        slices of full tensors (fully_reshardable) or its spans of the flat buffers
        (dp_reshardable)."""
        params, optimizer_steps = state_dict["param_state"], state_dict["optimizer_steps"]
        flat = "dense" in params
        for i, a, b, master in self.pieces:
            if flat:
                buffer, local = self.model.location[i]
                spans = params["expert" if buffer.expert else "dense"]
                start = buffer.layout.offsets[local] + a - self._owned_span(buffer)[0]
                part = {key: spans[key][start:start + b - a] for key in OPTIMIZER_STATE_KEYS}
            else:
                part = {key: params[key][str(i)].reshape(-1)[a:b] for key in OPTIMIZER_STATE_KEYS}
            master.copy_(part["fp32_param"])
            self.adam.state[master] = {
                "step": torch.tensor(float(optimizer_steps)),
                **{key: part[key].clone() for key in ("exp_avg", "exp_avg_sq")}}
            self.flat_slice(i, a, b, grads=False).copy_(master)
        self.model.gather_params()


def build_data_parallel_model(module: torch.nn.Module, trainer_cfg, ctx):
    """Cast the model to BF16, wrap it for data parallelism and build its optimizer.

    Returns (model, optimizer) with one interface on every device; sets the hooks megatron's
    schedules call (`config.finalize_model_grads_func`, and on GPUs `no_sync_func` and
    `grad_sync_func`, as Megatron-LM's `training.py` does).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    config = module.config
    module = Float16Module(config, module)  # BF16 params; fp32 outputs on the last stage
    distributed = trainer_cfg.distributed_optimizer
    if uses_megatron_ddp(ctx.device):
        model, optimizer = _megatron_ddp_and_optimizer(module, config, trainer_cfg)
    else:
        model = BufferedDataParallel(
            module, data_parallel_group=ps.get_data_parallel_group(),
            expert_data_parallel_group=ps.get_expert_data_parallel_group(),
            use_distributed_optimizer=distributed)
        optimizer = MixedPrecisionOptimizer(
            model, lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay,
            betas=(trainer_cfg.adam_beta1, trainer_cfg.adam_beta2), eps=trainer_cfg.adam_eps,
            model_parallel_group=ps.get_model_parallel_group(),
            expert_model_parallel_group=ps.get_expert_tensor_model_pipeline_parallel_group())
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def _megatron_ddp_and_optimizer(module, config, trainer_cfg):
    """megatron-core's DistributedDataParallel and optimizer, configured as Megatron-LM's --bf16."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed = trainer_cfg.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=trainer_cfg.lr, min_lr=trainer_cfg.min_lr,
            weight_decay=trainer_cfg.weight_decay, adam_beta1=trainer_cfg.adam_beta1,
            adam_beta2=trainer_cfg.adam_beta2, adam_eps=trainer_cfg.adam_eps,
            clip_grad=trainer_cfg.grad_clip, bf16=True, params_dtype=PARAMS_DTYPE,
            use_distributed_optimizer=distributed),
        [model])
    # As Megatron-LM's training.py: the schedule defers the grad reduction to the last
    # micro-batch and starts it in buckets while the backward runs.
    config.no_sync_func = model.no_sync
    config.grad_sync_func = model.start_grad_sync
    config.grad_scale_func = optimizer.scale_loss  # 1.0 in BF16 (no loss scaler)
    return model, optimizer


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of FP32 master weights and Adam's two FP32 moments this rank holds.

    Counted from the optimizer's parameter groups (the master copies, or this rank's shards of
    them under the distributed optimizer), so it does not depend on Adam's lazy allocation.
    """
    numel = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    return numel * 4 * len(OPTIMIZER_STATE_KEYS)
