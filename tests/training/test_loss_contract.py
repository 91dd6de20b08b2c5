"""One loss contract: every schedule's loss goes through megatron's `forward_step_calc_loss`.

megatron-core runs that function on CPU, so these tests exercise the exact code its GPU schedules
(no pipelining, 1F1B) apply to our loss function.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
from megatron.core.transformer.transformer_config import TransformerConfig

from training.schedules import REPORT_KEY, loss_func, mean_micro_batch_loss
from train_helpers import FAST, RESUMABLE, TWO_STAGES, run_train, train_in_process
from training.metrics import read_metrics


def _through_megatron(reduce, n):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    store = []
    out, _ = forward_step_calc_loss(None, torch.tensor([0.0]), reduce, config, None, False, n,
                                    store, cp_group_size=1, is_last_stage=True)
    return out, store


@pytest.mark.parametrize("n", [1, 2, 4])
def test_megatron_divides_our_loss_once_per_micro_batch(n):
    per_token = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the masked token does not count
    out, store = _through_megatron(lambda _o: loss_func(mask, per_token), n)
    assert out.item() == pytest.approx(2.0 / n)  # the micro-batch's mean token loss / n
    assert mean_micro_batch_loss(store * n, n, "cpu").item() == pytest.approx(2.0)
    loss_sum, tokens = store[0][REPORT_KEY]
    assert (loss_sum.item(), tokens.item()) == (6.0, 3.0)


def test_the_old_two_tuple_reduce_was_divided_twice():
    """What `_megatron_1f1b` returned before: (loss / n, ...). megatron divides again: 1/n^2."""
    n, loss = 4, torch.tensor(1.0)
    out, _ = _through_megatron(lambda _o: (loss / n, {"loss": loss / n}), n)
    assert out.item() == pytest.approx(1 / 16)  # 0.0625, where the gradient needs 0.25


@pytest.mark.slow
def test_gradients_agree_across_micro_batches_and_pipeline_stages(tmp_path, data_cache,
                                                                    shared_runs):
    """Step 1's loss and grad norm (same weights, same 4 samples) for n = 1, 2, 4 micro-batches
    in one process and through the 2-stage GPipe schedule (train.py on two processes). A gradient
    scaled by 1/n or 1/n^2 would move the norm by 2x or more; BF16 GEMMs over other micro-batch
    shapes differ by ~1e-3 relative. Step 1 is before any update: how many steps a run has and
    when it saves do not change it, so n = 2 at two stages is the shared RESUMABLE run's."""
    base = [*FAST, "trainer.max_steps=1", "trainer.eval_every=100", "trainer.save_every=100",
            "trainer.global_batch_size=4", "precision=bf16"]
    runs = {}
    for micro in (4, 2, 1):
        (step,) = train_in_process(tmp_path / f"mb{micro}-pp1", data_cache, *base,
                                   f"trainer.micro_batch_size={micro}")
        runs[(4 // micro, 1)] = (step.loss, step.grad_norm)
        if micro == 2:  # the fast trainer's own: global batch 4 of micro-batches of 2, BF16
            run_dir, _ = shared_runs.get(*RESUMABLE, *TWO_STAGES, nproc=2)
        else:
            run_dir = tmp_path / f"mb{micro}-pp2"
            proc = run_train(run_dir, *base, f"trainer.micro_batch_size={micro}", *TWO_STAGES,
                             nproc=2, cache_dir=data_cache)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        first = next(m for m in read_metrics(run_dir) if "loss" in m)
        assert first["step"] == 1
        runs[(4 // micro, 2)] = (first["loss"], first["grad_norm"])
    ref_loss, ref_norm = runs[(1, 1)]
    for key, (loss, norm) in runs.items():
        assert math.isclose(loss, ref_loss, rel_tol=2e-3), (key, runs)
        assert math.isclose(norm, ref_norm, rel_tol=2e-2), (key, runs)
