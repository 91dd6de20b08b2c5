"""What a checkpoint restores: a run continues from it exactly as if it had never stopped.

In-process, one rank: the trainer's own objects (BF16 model, FP32 masters and Adam moments,
the WSD scheduler) are saved, rebuilt from another seed, loaded, and stepped on.
"""

from __future__ import annotations

import torch

from model.build import build_model
from model.config import ModelConfig
from nvfp4_recipe.policy import PrecisionConfig
from training import ddp_optimizer as mp
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import TrainerConfig
from training.lr_schedule import WSDScheduler

TRAINER = TrainerConfig(lr=1e-3, warmup_steps=2, max_steps=10, grad_clip=1.0)
VOCAB = 256


def _built(seed: int, ctx):
    """The unwrapped megatron model (what checkpoints read), its BF16 data-parallel wrapper,
    optimizer and scheduler, as the trainer builds them; weights drawn from `seed`."""
    torch.manual_seed(seed)
    module = build_model(ModelConfig(vocab_size=VOCAB), PrecisionConfig(name="bf16", format="bf16"),
                         vocab_size=VOCAB, backend="emulated", params_dtype=mp.PARAMS_DTYPE).module
    model, optimizer = mp.build_data_parallel_model(module, TRAINER, ctx)
    return module, model, optimizer, WSDScheduler(optimizer, TRAINER)


def _step(model, optimizer, scheduler, tokens: torch.Tensor) -> None:
    model.zero_grad_buffer()
    model(tokens, None, None, labels=tokens).mean().backward()
    optimizer.step(TRAINER.grad_clip)
    scheduler.step()


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def test_a_loaded_checkpoint_steps_on_bit_for_bit(tmp_path, parallel_context):
    batches = [torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    core, model, optimizer, scheduler = _built(0, parallel_context)
    for tokens in batches[:2]:  # Adam's moments and the schedule are past their start
        _step(model, optimizer, scheduler, tokens)
    trainer_state = {"step": 2, "scheduler": scheduler.state_dict()}
    format_ = mp.optimizer_checkpoint_format(parallel_context.device, False)
    path = save_checkpoint(tmp_path, 2, parallel_context, model=core, optimizer=optimizer,
                           optimizer_format=format_, trainer_state=trainer_state, keep_last=0)
    draws_after_save = torch.rand(4)  # the stochastic-rounding stream goes on from here
    _step(model, optimizer, scheduler, batches[2])

    restored_core, restored, restored_optimizer, restored_scheduler = _built(1, parallel_context)
    loaded = load_checkpoint(path, parallel_context, restored_core, restored_optimizer, format_)
    assert torch.equal(torch.rand(4), draws_after_save)
    assert loaded["trainer"] == trainer_state and not loaded["resharded"]
    restored_scheduler.load_state_dict(loaded["trainer"]["scheduler"])
    _step(restored, restored_optimizer, restored_scheduler, batches[2])
    for got, expected in zip(_weights(restored), _weights(model), strict=True):
        assert torch.equal(got, expected)
    assert [g["lr"] for g in restored_optimizer.param_groups] == [
        g["lr"] for g in optimizer.param_groups]
