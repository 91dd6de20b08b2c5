"""The weight cache through the trainer's pieces over whole steps: two steps of two micro-batches
quantize each weight once per step, with the same losses and gradients as quantizing at every call
(the cache itself, and the switch to BF16: tests/nvfp4_recipe/test_weight_cache.py)."""

from __future__ import annotations

import torch
from helpers import count_weight_quantizations


# two models, four steps: ~30 s on 2 idle cores
def test_trainer_protocol_quantizes_once_per_step_and_never_reuses_across_steps(parallel_context, monkeypatch):
    """Two steps of two micro-batches through the trainer's pieces: one quantization per weight
    per step, the same losses and gradients as quantizing at every call."""
    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training.config import TrainerConfig
    from training.ddp_optimizer import PARAMS_DTYPE, build_data_parallel_model
    from training.schedules import run_micro_batches

    calls = count_weight_quantizations(monkeypatch)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    batches = [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 64)}
               for t in tokens.split(2)]

    def train(cached: bool):
        torch.manual_seed(0)
        built = build_model(ModelConfig(vocab_size=256), PrecisionConfig(name="nvfp4",
                            format="nvfp4"), vocab_size=256, backend="emulated",
                            params_dtype=PARAMS_DTYPE)
        core = built.module
        model, optimizer = build_data_parallel_model(core, TrainerConfig(lr=1e-2), parallel_context)
        assert len(built.linears) == 18  # every layer's two linears (BF16 ones quantize nothing)
        losses, counts = [], []
        torch.manual_seed(5)
        for _ in range(2):
            if cached:  # what PrecisionController.before_step does
                for held in built.linears:
                    held.linear.refresh_weight_cache()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            calls.update(fprop=0, dgrad=0)
            losses.append(run_micro_batches(model, batches, parallel_context, (64, 2, 256)).item())
            counts.append(dict(calls))
            optimizer.step()
        params = torch.cat([p.detach().float().flatten() for p in core.parameters()])
        return losses, counts, params

    plain_losses, plain_counts, plain_params = train(cached=False)
    losses, counts, params = train(cached=True)
    nvfp4_linears = 12  # 9 layers, the first 1 and last 2 in BF16: 6 NVFP4 layers x 2 linears
    assert plain_counts[0]["fprop"] == 2 * nvfp4_linears  # two micro-batches each
    assert counts == [{"fprop": nvfp4_linears, "dgrad": nvfp4_linears}] * 2
    assert losses == plain_losses and torch.equal(params, plain_params)
