"""Every difference between megatron-core releases, and every CUDA assumption we patch around.

A top-level module below model/, training/ and benchmarks/, which all use it; it imports
nothing of this project. Where a whole megatron component assumes CUDA, its CPU twin lives beside
its user instead: model/attention.py (core attention), training/ddp_optimizer.py (DDP and
optimizer), training/schedules.py (the schedules).

One module, each item named (see tests/test_compat.py, which fails if upstream changes):
1. `hybrid_model_class`: `MambaModel` (<= 0.17) became `HybridModel` (>= 0.18: first tagged in
   core_v0.18.0, commit 15e07a2). `hybrid_override_pattern` became `hybrid_layer_pattern`
   (`hybrid_model_kwargs` picks the keywords), and the stack gets `layer_type_list`/
   `pp_layer_offset`, already in 0.17 (core_v0.17.1 models/mamba/mamba_model.py:91-94,
   ssm/mamba_block.py:79-80).
2. `base_stack_class`: the stack we extend (`ssm.mamba_block.MambaStack` (<= 0.17) ->
   `models.hybrid.hybrid_block.HybridStack` (>= 0.18)); releases >= 0.17 pass the stage's layer
   list and offset to the stack, older ones let it slice the pattern itself (model/stack.py
   takes both).
3. `te_autocast`: `te.autocast(recipe=...)` exists from TE 2.9 (v2.9 quantization.py:790); TE 2.8
   has only `te.fp8_autocast(fp8_recipe=...)` (v2.8 fp8.py:646), kept in 2.9+ as a deprecated
   wrapper; `te_no_autocast` is the same choice with the autocast off.
4. `seed_model_parallel_rng`: megatron's `model_parallel_cuda_manual_seed` reads the CUDA RNG
   (`random.py:235`, 0.16.1); on CPU we seed torch's RNG only (CPU initialisation draws full
   weights, identical on every TP rank, and dropout is 0) and install megatron's own no-op
   tracker (`initialize_rng_tracker(inference_rng_tracker=True)`, random.py:286-342; same API in
   core_v0.19.0 random.py:354), whose `fork()` is a null context: the sequence-parallel
   embedding forks the tracker around its dropout (language_model_embedding.py:145).
5. `cpu_dist_checkpoint_save`: a patch. megatron's distributed-checkpoint save calls
   `torch.cuda.synchronize()` after staging tensors (`filesystem_async.py:230`) and allocates a
   status flag on `torch.cuda.current_device()` (`state_dict_saver.py:252`). For a CPU run (a
   gloo run on a machine with a GPU too), and only for the duration of a save, those two names
   become "nothing to wait for" and "the CPU".
6. `cpu_sequence_parallel_buffers`: a patch. megatron's sequence-parallel communication
   allocates its gather / reduce-scatter outputs on `torch.cuda.current_device()`
   (tensor_parallel/mappings.py:141,181, layers.py:559, utils.py:631 in 0.16.1). For a CPU run,
   and only while a step's forward and backward run with sequence parallelism,
   that name returns "cpu"; the gloo collectives themselves run on CPU tensors.
7. `fully_parallel_save`, `fully_parallel_load` and `cpu_fully_parallel_load`: megatron's fully-parallel save and
   load wrappers (dist_checkpointing/strategies/fully_parallel.py: `FullyParallelSaveStrategyWrapper`
   :48 and `FullyParallelLoadStrategyWrapper` :141 in 0.16.1, :46 and :142 in core_v0.19.0). Their
   constructors differ (0.19 adds `backend`/`version` and drops the strategy base classes; its
   `load` passes `async_strategy` on to the wrapped strategy, fully_parallel.py:258-266), so they
   are built here. The load wrapper's exchange is CUDA-only: `exchange_loaded_tensors_broadcast`
   moves every tensor `.cuda()` (exchange_utils.py:499 in 0.16.1, :506 in 0.19.0) and makes empty
   ones with `init_data("cuda")` (:98-110 / :97-109), and `load` calls `torch.cuda.synchronize()`
   (fully_parallel.py:272,281 / :287,296). For a CPU run, and only for the duration of a load,
   `cpu_fully_parallel_load` gives fully_parallel.py a CPU twin of the broadcast exchange (the
   same loop on CPU tensors over gloo) and a no-op synchronize.
8. `mamba_ssm_triton_kernels`: mamba_ssm's Triton SSD scan and gated RMSNorm without the
   package's `__init__` when that fails. mamba_ssm's `__init__` imports its compiled selective-scan
   extension (mamba v2.3.2.post1 mamba_ssm/__init__.py:3 -> ops/selective_scan_interface.py:20
   `import selective_scan_cuda`), which a wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE lacks; the
   Triton modules need only torch, triton, einops, packaging and mamba_ssm.utils
   (ops/triton/ssd_combined.py:6-50, causal_conv1d guarded at :21-28, the `selective_scan`
   imports at :530 and :737 inside reference functions never called; layernorm_gated.py:7-15).
   They are imported under an unexecuted stand-in for the top-level package, and `sys.modules` is
   put back as it was, so nobody else sees the stand-in (megatron's own mixer, which imports
   mamba_ssm normally, still cannot: the TE spec needs the whole package).
9. `te_fuse_wgrad_accumulation`: turns on Transformer Engine's `fuse_wgrad_accumulation` in the
   TE linears of a built model whose config keeps megatron's `gradient_accumulation_fusion` off
   (model/build.py: the output layer would refuse it without apex). TE stores the flag at
   construction and reads it at every forward (TE v2.8 module/linear.py:1121, 1458,
   layernorm_linear.py:1185, 1570; v2.18 layernorm_linear.py:1313, 1745, linear.py:1520, 1979;
   v2.19 layernorm_linear.py:1342, 1774, linear.py:1595, 2054);
   megatron's wrappers pass the config's value there and nothing else reads it (mc 0.16.1
   extensions/transformer_engine.py:626, 828; the fused-MLP ops read the module's attribute,
   :1982, 2016). An attribute of the built modules, no library global.
10. `quiet_cpu_fallback_warnings`: megatron-core warns at import, on every machine without TE and
   Apex, that it falls back to torch (e.g. mc 0.16.1 optimizer/__init__.py:24, clip_grads.py:29):
   every CPU run's expected set-up, not news. A process-wide warnings filter, so only the entry
   points call it (train.py, the export and evaluation commands, the benches, the component
   study), never an import.
11. `cpu_alltoall_dispatcher_construction`: a patch. megatron's all-to-all token dispatcher makes
   one CUDA stream for its device-to-host copies when the first one is built, into a class
   attribute (`MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`, token_dispatcher.py:444-445 in
   0.16.1, :468-469 in core_v0.19.0), which a torch without CUDA cannot make. For the duration
   of building a model for a CPU run, that attribute holds a placeholder, so none is made; it is
   None again afterwards (a GPU model built later makes its stream as usual). The copies
   themselves are model/moe.py's (`PortableAlltoAllTokenDispatcher`, a subclass: on CPU tensors
   there is nothing to copy).
12. `reset_moe_metrics_tracker`: megatron's process-wide MoE aux-loss tracker sizes each metric's
   per-layer row by the first model that records into it (mc 0.16.1 moe_utils.py:893-897; core
   0.18+ `MoEMetricsTracker.record`, core_v0.19.0 moe_logging.py:121-122), so a deeper model built
   later in the same process would index past it. 0.16-0.17 keep a module dict, emptied here
   (`get_moe_layer_wise_logging_tracker().clear()`); from core_v0.18.0 that function returns a
   fresh copy of the new tracker's entries (core_v0.19.0 moe_utils.py:1085-1096) and the tracker
   itself is dropped by megatron's `destroy_moe_metrics_tracker` (moe_logging.py:63). Called when
   an MoE model is built and after each step's expert-load metrics have read the tracker.
Items 1-4, 8 and 9 select, replace or load; they never edit a library's globals. Item 12 empties
megatron's process-wide tracker through megatron's own functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import warnings
from contextlib import contextmanager

import torch


def hybrid_model_class():
    try:  # megatron-core >= 0.18. Its package __init__ re-exports nothing (core_v0.18.0 and
        # core_v0.19.x models/hybrid/__init__.py), and models.mamba.MambaModel stays as a
        # deprecated subclass: import the module.
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel
    except ImportError:
        from megatron.core.models.mamba import MambaModel  # megatron-core <= 0.17

        return MambaModel


def base_stack_class():
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack  # >= 0.18

        return HybridStack
    except ImportError:
        from megatron.core.ssm.mamba_block import MambaStack  # <= 0.17

        return MambaStack


def hybrid_model_kwargs(stack_spec, pattern: str) -> dict:
    """The constructor keywords that carry the stack spec and the pattern, by release."""
    params = inspect.signature(hybrid_model_class().__init__).parameters
    spec_key = "hybrid_stack_spec" if "hybrid_stack_spec" in params else "mamba_stack_spec"
    pattern_key = "hybrid_layer_pattern" if "hybrid_layer_pattern" in params else "hybrid_override_pattern"
    return {spec_key: stack_spec, pattern_key: pattern}


def te_autocast(recipe):
    """Transformer Engine's low-precision autocast for one layer (GPU only)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):  # TE >= 2.9
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # TE 2.8


def te_no_autocast():
    """TE's autocast turned off for one region (a BF16 linear inside a low-precision layer)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=False)
    return te.fp8_autocast(enabled=False)


def seed_model_parallel_rng(seed: int, cuda: bool) -> None:
    """Seed RNGs as megatron does: a common stream, plus per-TP-rank streams on a CUDA run
    (`cuda`: the run's device is a GPU, not merely present)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    # On CPU there is nothing more to seed: use_cpu_initialization draws each full master
    # weight from the common stream (identical on every TP rank) and dropout is 0.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@contextmanager
def cpu_dist_checkpoint_save(cuda: bool):
    """Let megatron's dist_checkpointing.save run for a CPU run (see item 5); `cuda`: the run's
    device is a GPU."""
    if cuda:
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


@contextmanager
def cpu_sequence_parallel_buffers(sequence_parallel: bool, cuda: bool):
    """Let megatron's sequence-parallel mappings run for a CPU run (see item 6); `cuda`: the
    run's device is a GPU."""
    if not sequence_parallel or cuda:
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def fully_parallel_save(base, group):
    """megatron's FullyParallelSaveStrategyWrapper around the save strategy `base`, over `group`
    (the data-parallel group: the ranks holding replicas of the same shards): each replicated
    tensor is written by one rank of the group, the writes spread evenly (item 7)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    return FullyParallelSaveStrategyWrapper(base, group)


def fully_parallel_load(base, group):
    """megatron's FullyParallelLoadStrategyWrapper around the load strategy `base`, over `group`:
    each rank reads its part of what the group shares and the parts are broadcast (item 7)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    return FullyParallelLoadStrategyWrapper(base, group, exchange_algo="broadcast")


def _cpu_exchange_by_distribution(loaded_tensors, unloaded_shards, shard_distribution,
                                  parallelization_group=None, exchange_algo="broadcast"):
    """megatron's `exchange_loaded_tensors_broadcast` (exchange_utils.py:454-535, 0.16.1) on CPU
    tensors: each shard that more than one rank needs is broadcast from the rank that read it."""
    import torch.distributed as dist

    main_rank_for_shard, _, shard_to_metadata, all_ranks_for_shard = shard_distribution
    local_rank = dist.get_rank(group=parallelization_group)
    all_loaded = dict(loaded_tensors)
    for shard_id, rank in main_rank_for_shard.items():
        if len(all_ranks_for_shard[shard_id]) == 1:
            continue  # only the reading rank needs it
        if rank == local_rank:
            tensor = all_loaded[shard_id]
        else:
            needed = unloaded_shards.get(shard_id)
            meta = needed if needed is not None else shard_to_metadata[shard_id]
            tensor = torch.empty(meta.local_shape, dtype=meta.dtype)
            if needed is not None:
                all_loaded[shard_id] = tensor
        src = (rank if parallelization_group is None
               else dist.get_global_rank(parallelization_group, rank))
        dist.broadcast(tensor, src=src, group=parallelization_group)
    return all_loaded


@contextmanager
def cpu_fully_parallel_load(cuda: bool):
    """Let megatron's FullyParallelLoadStrategyWrapper run for a CPU run (item 7); `cuda`: the
    run's device is a GPU (nothing is replaced)."""
    if cuda:
        yield
        return
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    saved = fully_parallel.exchange_by_distribution, torch.cuda.synchronize
    fully_parallel.exchange_by_distribution = _cpu_exchange_by_distribution
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fully_parallel.exchange_by_distribution, torch.cuda.synchronize = saved


# The kernels the portable Mamba mixer and model/ssd_check.py take from mamba_ssm: name -> module.
MAMBA_TRITON_KERNELS = {
    "mamba_chunk_scan_combined": "mamba_ssm.ops.triton.ssd_combined",
    "rmsnorm_fn": "mamba_ssm.ops.triton.layernorm_gated",
}


def _mamba_modules() -> dict:
    return {k: v for k, v in sys.modules.items() if k == "mamba_ssm" or k.startswith("mamba_ssm.")}


def _import_kernels() -> dict:
    return {name: getattr(importlib.import_module(module), name)
            for name, module in MAMBA_TRITON_KERNELS.items()}


def _import_kernels_without_package_init() -> dict:
    spec = importlib.util.find_spec("mamba_ssm")  # locates the package, runs nothing
    saved = _mamba_modules()  # incl. submodules a failed `import mamba_ssm` left behind
    for name in saved:
        del sys.modules[name]
    sys.modules["mamba_ssm"] = importlib.util.module_from_spec(spec)  # __path__ set, not executed
    try:
        return _import_kernels()
    finally:  # leave sys.modules as it was: other code must not see the stand-in
        for name in _mamba_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def mamba_ssm_triton_kernels() -> tuple[dict, bool, str]:
    """(kernels {name: callable} of MAMBA_TRITON_KERNELS, whether the mamba_ssm package itself
    imports, how they were loaded or why not); ({}, False, why) when they cannot be loaded. See
    item 8. Never raises; loads afresh at every call (callers keep the result)."""
    try:
        installed = importlib.util.find_spec("mamba_ssm") is not None
    except ValueError:  # in sys.modules without a spec (put there by hand): try the import
        installed = True
    if not installed:
        return {}, False, "mamba_ssm is not installed"
    try:
        return _import_kernels(), True, "mamba_ssm imported"
    except Exception as exc:  # ImportError of the CUDA extension, or a broken build
        first = f"{type(exc).__name__}: {exc}"
    try:
        kernels = _import_kernels_without_package_init()
    except Exception as exc:
        return {}, False, (f"mamba_ssm does not import ({first}), nor its Triton kernels without "
                           f"the package __init__ ({type(exc).__name__}: {exc})")
    return kernels, False, f"Triton kernels loaded without mamba_ssm/__init__.py, whose import fails ({first})"


def te_fuse_wgrad_accumulation(model: torch.nn.Module) -> int:
    """Set `fuse_wgrad_accumulation` on every Transformer Engine module of `model` that has it
    (item 9); returns how many. Its weights need a `main_grad` (megatron's DDP gives them one)."""
    count = 0
    for module in model.modules():
        if type(module).__module__.startswith(("transformer_engine", "megatron.core.extensions")) \
                and isinstance(getattr(module, "fuse_wgrad_accumulation", None), bool):
            module.fuse_wgrad_accumulation = True
            count += 1
    return count


# What item 11 holds in the dispatcher's stream attribute while a model is built for a CPU run.
NO_CUDA_STREAM = "no CUDA stream: a CPU run (compat.cpu_alltoall_dispatcher_construction)"


@contextmanager
def cpu_alltoall_dispatcher_construction(cuda: bool):
    """Build megatron's all-to-all token dispatcher for a CPU run (item 11); `cuda`: the run's
    device is a GPU, where megatron makes its stream."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if cuda or MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None:
        yield
        return
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = NO_CUDA_STREAM
    try:
        yield
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


def reset_moe_metrics_tracker() -> None:
    """Start megatron's MoE aux-loss tracker afresh for a newly built model (item 12)."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # core <= 0.17
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def quiet_cpu_fallback_warnings() -> None:
    """Item 10: hide megatron's "Transformer Engine and Apex are not installed" import warnings."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
