"""Activation recompute, with megatron-core's meaning.

- ``none``: every activation a layer's backward needs is kept.
- ``selective``: the cheap-to-recompute, memory-heavy parts are recomputed in the backward:
  megatron's core attention (``recompute_modules=["core_attn"]``, transformer/attention.py) and,
  on the portable spec, the Mamba mixer's conv1d + SSD scan (the pure-PyTorch scan keeps its
  chunk intermediates; mamba_ssm's fused scan saves only its inputs, so the TE spec needs none).
- ``full``: whole layers are recomputed; only each checkpointed chunk's input is kept.
  ``method=uniform`` checkpoints chunks of ``num_layers`` consecutive layers, ``method=block``
  checkpoints the first ``num_layers`` layers of each pipeline stage and keeps the rest
  (megatron's ``recompute_method`` / ``recompute_num_layers``; HybridStack does the same in
  core_v0.19.0 megatron/core/recompute.py:139-190).
"""

from __future__ import annotations

from dataclasses import dataclass

GRANULARITIES = ("none", "selective", "full")
METHODS = ("uniform", "block")


@dataclass(frozen=True)
class RecomputeConfig:
    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def validate(self, prefix: str = "trainer.recompute") -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{prefix}={self.granularity!r}: choose none, selective or full")
        if self.method not in METHODS:
            raise ValueError(f"{prefix}_method={self.method!r}: choose uniform or block")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) \
                or self.num_layers < 1:
            raise ValueError(f"{prefix}_layers={self.num_layers} must be an integer >= 1")

    def megatron_fields(self) -> dict:
        """The TransformerConfig fields of this setting (transformer_config.py:383-421, mc 0.16.1)."""
        if self.granularity == "none":
            return {"recompute_granularity": None}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


# -- which checkpoint recomputes a region, and running it -------------------------------------------

def checkpoint_implementation(*, cuda: bool, te_layers: bool) -> str:
    """Which checkpoint recomputes a region (a pure decision, tested on CPU):
    - "te": Transformer Engine layers. TE's checkpoint marks the recomputed forward
      (`activation_recompute_forward(..., recompute_phase=True)`, TE v2.9
      pytorch/distributed.py:420) so quantization state is not updated twice; megatron uses it for
      FP8/FP4 layers too (`te_checkpoint`, mc 0.16.1 transformer_block.py:505-517). The autocast
      each layer enters inside the region is honoured from TE 2.19 (distributed.py:258-286, PR
      #3284); 2.18 froze the flag at entry and re-quantized the cached weight: same bits.
    - "megatron": any other layer on CUDA: `tensor_parallel.checkpoint`, which restores the CPU,
      CUDA and model-parallel RNG-tracker states before recomputing (mc 0.16.1
      tensor_parallel/random.py:496-570).
    - "torch": the CPU twin. megatron's reads the CUDA RNG (random.py:55) and cannot run without
      CUDA; torch's reentrant checkpoint has the same contract on CPU: inputs saved, forward under
      no_grad, and in backward the CPU RNG state restored for the recompute only
      (torch/utils/checkpoint.py, `CheckpointFunction`)."""
    if te_layers:
        if not cuda:
            raise ValueError("Transformer Engine layers need CUDA")
        return "te"
    return "megatron" if cuda else "torch"


def recompute(function, *args, implementation: str, tp_group=None):
    """`function(*args)` with its activations dropped and recomputed in the backward.

    Every implementation recomputes under the RNG state of the first forward and runs the
    region's backward after restoring the backward's own state, so stochastic-rounding draws
    (made in the backward, from the default generator) are the ones a run without recompute
    makes (tests/model/test_recompute.py, tests/system/test_recompute_steps.py)."""
    if implementation == "te":
        from megatron.core.extensions.transformer_engine import te_checkpoint
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return te_checkpoint(function, False, get_cuda_rng_tracker, tp_group, *args)
    if implementation == "megatron":
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(function, False, *args)
    if implementation == "torch":
        import torch.utils.checkpoint

        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True,
                                                 preserve_rng_state=True)
    raise ValueError(f"unknown checkpoint implementation {implementation!r}")


def checkpointed_chunks(num_layers: int, config: RecomputeConfig) -> list[tuple[int, int, bool]]:
    """[(start, end, checkpointed)] over one stage's layers: megatron's uniform / block split
    (mc 0.16.1 transformer_block.py:531-562; core_v0.19.0 recompute.py:157-182)."""
    if config.granularity != "full":
        return [(i, i + 1, False) for i in range(num_layers)]
    n = config.num_layers
    if config.method == "uniform":
        return [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]
    return [(i, i + 1, i < n) for i in range(num_layers)]
