"""Sequence parallelism on the portable spec: TP=2 + SP computes what TP=2 computes.

Two gloo processes run one training step's forward and backward through the trainer's own
pieces (megatron's Float16Module, the data-parallel wrapper, the schedule twin and megatron's
finalize_model_grads) with parallel.sequence off and on, and compare the loss and every
parameter's main gradient. With SP, norms see half the sequence on each rank, so their weight
gradients are partial sums until finalize_model_grads all-reduces them over the tensor group:
the test also checks that this all-reduce happened (the partial sums differ from the result).
"""

from __future__ import annotations

import os

import torch

TOKENS = 64  # divisible by TP=2 and by the Mamba chunk (32)


def _step(sequence_parallel: bool, finalize: bool):
    from megatron.core.utils import get_model_config

    from model.build import build_model
    from compat import seed_model_parallel_rng
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training import schedules
    from training.config import TrainerConfig
    from training.distributed import ParallelContext  # noqa: F401  (the ctx type)
    from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model

    ctx = _step.ctx
    seed_model_parallel_rng(0, cuda=False)  # as the trainer does (on CPU: megatron's no-op RNG tracker)
    cfg = ModelConfig(vocab_size=256, mamba_chunk_size=32)
    core = build_model(cfg, PrecisionConfig(name="nvfp4", format="nvfp4"), vocab_size=256,
                       tensor_parallel=2, backend="emulated", params_dtype=PARAMS_DTYPE,
                       sequence_parallel=sequence_parallel).module
    model, _ = build_data_parallel_model(core, TrainerConfig(), ctx)
    tokens = torch.randint(0, 256, (2, TOKENS + 1), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": torch.ones(2, TOKENS)}
    torch.manual_seed(7)  # the stochastic-rounding stream: the same draws in both runs
    if finalize:
        loss = schedules.run_micro_batches(model, [batch], ctx, (TOKENS, 2, cfg.hidden_size))
    else:  # the schedule without megatron's finalize_model_grads: per-rank partial sums
        config = get_model_config(model)
        from compat import cpu_sequence_parallel_buffers

        with cpu_sequence_parallel_buffers(sequence_parallel, cuda=False):
            schedules._accumulate(model, [batch], schedules.make_forward_step(ctx), config, False)
        loss = None
    grads = {name: p.main_grad.clone() for name, p in core.named_parameters()}
    sp_names = {name for name, p in core.named_parameters()
                if getattr(p, "sequence_parallel", False)}
    return loss, grads, sp_names


def _worker(rank: int, port: int, result_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from training.distributed import init_distributed, shutdown

    _step.ctx = init_distributed(2, 1, "gloo")
    try:
        loss_tp, grads_tp, _ = _step(False, finalize=True)
        loss_sp, grads_sp, sp_names = _step(True, finalize=True)
        _, partial, _ = _step(True, finalize=False)
        torch.save({"loss_tp": loss_tp, "loss_sp": loss_sp, "grads_tp": grads_tp,
                    "grads_sp": grads_sp, "partial": partial, "sp_names": sorted(sp_names)},
                   f"{result_dir}/rank{rank}.pt")
    finally:
        shutdown()


def test_tp2_with_sequence_parallel_matches_tp2(tmp_path):
    import torch.multiprocessing as mp

    from helpers import free_port

    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # The same BF16 GEMMs on the same rows: the gathered activations are the full sequence.
        # What differs is where BF16 partial sums meet (a reduce-scatter instead of an
        # all-reduce), so the tolerance is BF16's, as for TP=2 against TP=1.
        assert abs(r["loss_sp"].item() - r["loss_tp"].item()) < 2e-3, r
        norms = r["sp_names"]
        # Every layer's norm of the pattern M-M*-M-M- (9 layers) and the final norm is marked.
        assert len(norms) == 10 and all("norm" in n for n in norms), norms
        for name, grad in r["grads_tp"].items():
            torch.testing.assert_close(r["grads_sp"][name], grad, atol=2e-3, rtol=5e-2,
                                       msg=name)
        # Without the tensor-group all-reduce a norm's gradient covers half the tokens.
        for name in norms:
            gap = (r["partial"][name] - r["grads_tp"][name]).abs().max()
            assert gap > 10 * (r["grads_sp"][name] - r["grads_tp"][name]).abs().max(), name
