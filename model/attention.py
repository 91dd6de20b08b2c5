"""Core attention for the portable spec: causal GQA through `F.scaled_dot_product_attention`.

megatron-core's local `DotProductAttention` allocates its score buffer on
`torch.cuda.current_device()` (0.16.1, `utils.py:631`), so on CPU we own this component.

q, k and v go to SDPA in their own dtype (BF16 in training), with grouped heads left to SDPA
(`enable_gqa=True`, torch >= 2.5) instead of copied per query head: on a GPU SDPA can then take
its flash or cuDNN kernels, which compute the softmax in FP32 and accumulate both GEMMs in FP32,
as TE's BF16 attention on the TE spec does (an FP32 upcast turned them off, and a
repeat_interleave wrote heads/groups copies of K and V). On a CPU, SDPA with `enable_gqa` runs
`_scaled_dot_product_flash_attention_for_cpu` (FP32 softmax and accumulation; checked in
tests/model/test_attention.py), which the GEMM compute policy computes in FP32 where the CPU
has no BF16 instructions (nvfp4_recipe/compute.py).
Under selective recompute (megatron's `recompute_modules=["core_attn"]`) it recomputes itself,
with the checkpoint of the device (model/recompute.py); `PortableSelfAttention` keeps megatron's
Attention from checkpointing it a second time with its CUDA-only checkpoint.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .recompute import checkpoint_implementation, recompute


def recomputes_core_attention(config: TransformerConfig) -> bool:
    """megatron's test for selective core-attention recompute (mc 0.16.1 attention.py:328-331)."""
    return (config.recompute_granularity == "selective"
            and "core_attn" in (config.recompute_modules or ()))


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's core attention: q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np*hn]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError(
                "context parallelism is not supported with the portable attention; "
                "this project builds context_parallel_size=1 (use the TE spec for context parallelism)"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"only causal self-attention is supported, got {attn_mask_type}")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.recompute = recomputes_core_attention(config)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias need the TE spec")
        if self.recompute and self.training and torch.is_grad_enabled():
            implementation = checkpoint_implementation(cuda=query.is_cuda, te_layers=False)
            return recompute(self._attention, query, key, value, implementation=implementation)
        return self._attention(query, key, value)

    def _attention(self, query, key, value):
        seq, batch, heads, head_dim = query.shape
        groups = key.shape[2]
        # [s, b, n, d] -> [b, n, s, d]; query head h attends with KV group h // (heads / groups),
        # the grouping repeat_interleave gave and megatron's attention uses.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=groups != heads,
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)


class PortableSelfAttention(SelfAttention):
    """megatron's SelfAttention whose core attention (SDPACoreAttention) does its own selective
    recompute: megatron's `_checkpointed_attention_forward` calls `tensor_parallel.checkpoint`,
    which needs CUDA (mc 0.16.1 attention.py:415; tensor_parallel/random.py:55)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_core_attention = False  # read at forward: attention.py:1134 (0.16.1)
