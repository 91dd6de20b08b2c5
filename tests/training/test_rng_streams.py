"""Stochastic-rounding streams: one per rank that quantizes different data, so no two
shards are rounded with the same draws."""

from __future__ import annotations

import itertools

import torch

from training.distributed import ParallelContext, stochastic_rounding_seed


def _ctx(dp, tp, pp, d, t, p) -> ParallelContext:
    return ParallelContext(world_size=dp * tp * pp, rank=0, tensor=tp, pipeline=pp, data=dp,
                           tensor_rank=t, pipeline_rank=p, data_rank=d,
                           device=torch.device("cpu"))


def test_every_rank_of_a_layout_draws_its_own_stream():
    for dp, tp, pp in [(2, 2, 2), (4, 2, 1), (1, 8, 1), (3, 1, 4)]:
        seeds = [stochastic_rounding_seed(1234, _ctx(dp, tp, pp, d, t, p))
                 for d, t, p in itertools.product(range(dp), range(tp), range(pp))]
        assert len(set(seeds)) == dp * tp * pp, (dp, tp, pp)


def test_tensor_parallel_shards_are_not_rounded_with_the_same_draws():
    """Before: seed + 1000 * data_rank + 1, the same on both TP ranks."""
    a = stochastic_rounding_seed(1234, _ctx(1, 2, 1, 0, 0, 0))
    b = stochastic_rounding_seed(1234, _ctx(1, 2, 1, 0, 1, 0))
    assert a != b
    draws = [torch.rand(16, generator=torch.Generator().manual_seed(s)) for s in (a, b)]
    assert not torch.equal(*draws)


def test_one_process_and_pure_data_parallel_keep_their_streams():
    """Golden runs and DP-only checkpoints resume with the streams they were written with."""
    assert stochastic_rounding_seed(1234, _ctx(1, 1, 1, 0, 0, 0)) == 1235
    assert stochastic_rounding_seed(1234, _ctx(4, 1, 1, 3, 0, 0)) == 1234 + 1000 * 3 + 1
