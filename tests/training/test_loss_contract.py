"""One loss contract: every schedule's loss goes through megatron's `forward_step_calc_loss`.

megatron-core runs that function on CPU, so these tests exercise the exact code its GPU schedules
(no pipelining, 1F1B) apply to our loss function. The gradients it gives across micro-batch counts
and pipeline stages, trained: tests/system/test_pipeline_schedule.py.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
from megatron.core.transformer.transformer_config import TransformerConfig

from training.schedules import REPORT_KEY, loss_func, mean_micro_batch_loss


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
