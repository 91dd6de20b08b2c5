"""Gradient health: per-layer gradient norms and non-finite fractions, and where a non-finite
step began.

Every parameter belongs to one group: `embedding`, `layer_NN.<kind>` (its global pattern index, so
a pipeline stage names its layers as one process does), `final_norm`, `output_layer`. The
statistics are read from the FP32 main grads after the data-parallel sync and before clipping
(what `grad_norm` measures), and summed over all ranks so that every element counts once:
tensor-parallel duplicates (norm weights) on tensor rank 0 only, data-parallel replicas on data
rank 0 only, or with the distributed optimizer each rank's own shard (the part whose reduced
gradient it holds).

Which layer went non-finite first. The backward runs from the output layer down to the
embedding (across pipeline stages: the last stage first), and a gradient only flows to shallower
layers, so the deepest group whose gradients are non-finite is where it began. A group is
flagged when its parameter gradients hold a non-finite value, or when the gradient its backward
produced for its input (the hidden state below it) does: a hook on that input runs one
`isfinite(amax)` reduction per layer and micro-batch and keeps the flag on the device, so a
NaN born in a layer's input gradient is pinned on that layer, not on the one below. The flags
are summed over all ranks with the statistics; reading them costs one pass over the gradients,
made only on steps that log gradient health or that went non-finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .cadence import Every
from .ddp_optimizer import BufferedDataParallel

OTHER = "other"  # a parameter outside the known groups (none in this model)


def layer_name(index: int, kinds: Sequence[str]) -> str:
    """`layer_07.mamba`: the global pattern index, zero-padded to the pattern's length."""
    width = max(2, len(str(len(kinds) - 1)))
    return f"layer_{index:0{width}d}.{kinds[index]}"


def group_names(kinds: Sequence[str]) -> list[str]:
    """Every group in forward order; the backward visits them in reverse (OTHER last)."""
    return [OTHER, "embedding", *(layer_name(i, kinds) for i in range(len(kinds))),
            "final_norm", "output_layer"]


def param_group(name: str, layer_offset: int, kinds: Sequence[str]) -> str:
    """The group of a parameter of the unwrapped model (`decoder.layers.3.mixer.in_proj.weight`)."""
    parts = name.split(".")
    if parts[0] in ("embedding", "output_layer"):
        return parts[0]
    if parts[:2] == ["decoder", "layers"]:
        return layer_name(layer_offset + int(parts[2]), kinds)
    if parts[:2] == ["decoder", "final_norm"]:
        return "final_norm"
    return OTHER


@dataclass
class GradStats:
    """One step's statistics, the same on every rank (lists in `names` order)."""

    names: list[str]
    norms: list[float]
    nonfinite: list[float]  # non-finite elements among the parameter gradients
    numels: list[float]
    input_nonfinite: list[bool]  # the gradient w.r.t. the group's input held NaN/Inf

    def metrics(self, norms: bool = True) -> dict[str, float]:
        """Flat keys for metrics.jsonl and W&B: grad/<group>/norm, grad/<group>/nonfinite_frac."""
        out = {}
        for name, norm, bad, n in zip(self.names, self.norms, self.nonfinite, self.numels):
            if n == 0:  # no parameters in this group (e.g. no final norm)
                continue
            if norms:
                out[f"grad/{name}/norm"] = norm
            out[f"grad/{name}/nonfinite_frac"] = bad / n
        return out

    def nonfinite_groups(self) -> list[str]:
        """Groups with a non-finite gradient, in backward order (the origin first)."""
        return [name for name, bad, flag in zip(reversed(self.names), reversed(self.nonfinite),
                                                reversed(self.input_nonfinite)) if bad or flag]

    def first_nonfinite(self) -> Optional[str]:
        groups = self.nonfinite_groups()
        return groups[0] if groups else None


class GradHealth:
    """Watches one model's gradients; `collect()` is a collective: every rank calls it."""

    def __init__(self, core: torch.nn.Module, model, optimizer, layer_kinds: Sequence[str],
                 device: torch.device, due: Every):
        """`due(step)`: whether optimizer step `step` (from 1) collects: this component's cadence."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        self.names = group_names(layer_kinds)
        self.device, self.due = device, due
        index = {name: i for i, name in enumerate(self.names)}
        decoder = getattr(core, "decoder", None)
        offset = getattr(decoder, "layer_offset", 0)
        owned = _owned_ranges(model, optimizer)  # None: every rank holds the reduced grads
        # Without sharding, the first rank of each gradient's reduction group counts it: the
        # data-parallel group's, or for an expert's (allreduce=False) the expert data-parallel
        # group's, whose ranks hold the same experts.
        counts_dense = owned is not None or ps.get_data_parallel_rank() == 0
        counts_experts = owned is not None or ps.get_expert_data_parallel_rank() == 0
        # (parameter, start, end, group) of each gradient slice this rank counts.
        self.pieces: list[tuple[torch.nn.Parameter, int, int, int]] = []
        for name, p in core.named_parameters():
            counts_here = counts_dense if getattr(p, "allreduce", True) else counts_experts
            if not (p.requires_grad and counts_here and param_is_not_tensor_parallel_duplicate(p)):
                continue
            start, end = (0, p.numel()) if owned is None else owned.get(id(p), (0, 0))
            if start < end:
                self.pieces.append((p, start, end, index[param_group(name, offset, layer_kinds)]))
        self.piece_groups = torch.tensor([g for *_, g in self.pieces], dtype=torch.long,
                                         device=device)
        self.numels = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        for _p, start, end, g in self.pieces:
            self.numels[g] += end - start
        self.input_nonfinite = torch.zeros(len(self.names), dtype=torch.bool, device=device)
        watched = [(layer_name(offset + i, layer_kinds), layer)
                   for i, layer in enumerate(getattr(decoder, "layers", []))]
        watched += [(name, module) for name, module in (
            ("final_norm", getattr(decoder, "final_norm", None)),
            ("output_layer", getattr(core, "output_layer", None))) if module is not None]
        self.handles = [module.register_forward_pre_hook(partial(self._watch, index[name]),
                                                         with_kwargs=True)
                        for name, module in watched]

    def begin_step(self) -> None:
        self.input_nonfinite.zero_()

    def _watch(self, group: int, _module, args, kwargs) -> None:
        """Before a group's forward: hook the gradient its backward will produce for its input."""
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(partial(self._check_input_grad, group))

    def _check_input_grad(self, group: int, grad: torch.Tensor) -> None:
        if grad.numel():  # amax propagates NaN; one reduction, no copy, no host sync
            amax = torch.linalg.vector_norm(grad, float("inf"))
            self.input_nonfinite[group].logical_or_(~torch.isfinite(amax))

    @torch.no_grad()
    def collect(self) -> GradStats:
        """Norms and non-finite counts of every group's main grads, over all ranks."""
        stats = torch.zeros(len(self.names), 4, dtype=torch.float64, device=self.device)
        if self.pieces:
            grads = [p.main_grad.view(-1)[a:b] for p, a, b, _ in self.pieces]
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
            stats[:, 0].index_add_(0, self.piece_groups, norms.square())
            bad = ~torch.isfinite(norms)
            if bad.any():  # count the non-finite elements only where there are some
                for i in bad.nonzero().flatten().tolist():
                    stats[self.pieces[i][3], 1] += (~torch.isfinite(grads[i])).sum()
        stats[:, 2] = self.numels
        stats[:, 3] = self.input_nonfinite.to(torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)  # layers of other stages, shards of other ranks
        squares, bad, numels, flags = stats.cpu().T.tolist()
        return GradStats(list(self.names), [s ** 0.5 for s in squares], bad, numels,
                         [f > 0 for f in flags])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _owned_ranges(model, optimizer) -> Optional[dict[int, tuple[int, int]]]:
    """With the distributed optimizer over several data-parallel ranks: {id(param): the range of
    its flattened gradient this rank holds reduced}; None when every rank holds all of it."""
    if isinstance(model, BufferedDataParallel):  # the CPU twin
        if not (model.use_distributed_optimizer and model.dp_size > 1):
            return None
        return {id(p): model.owned(i) or (0, 0) for i, p in enumerate(model.params)}
    from megatron.core import parallel_state as ps

    if not (model.ddp_config.use_distributed_optimizer
            and ps.get_data_parallel_world_size() > 1):
        return None
    owned = {}  # megatron's DistributedOptimizer: the range each rank's main params cover
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for p in model.module.parameters():
            try:
                r = opt._get_model_param_range_map(p)["param"]
            except (KeyError, AttributeError):
                continue
            owned[id(p)] = (r.start, r.end)
    return owned
