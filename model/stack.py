"""The hybrid layer stack: megatron-core's MambaStack, with one spec per pattern layer.

megatron's stack builds every layer of a kind from one shared spec and hard-wires a TE final
norm (`mamba_block.py:166`, 0.16.1). Our stack takes the per-layer specs the precision policy
produced, a per-layer context (TE autocast for low-precision layers on Blackwell, none
otherwise) and a portable final norm (sequence-parallel aware), and does megatron's full
activation recompute (model/recompute.py) with the checkpoint of its device and layers. Pipeline slicing and sharded checkpoint keys are
megatron's (inherited), so checkpoints stay compatible with its layout.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from compat import base_stack_class

from .config import LAYER_SYMBOLS
from .recompute import (RecomputeConfig, checkpoint_implementation, checkpointed_chunks,
                        recompute)
from .specs import TorchNorm

KIND_TO_SYMBOL = {kind: symbol for symbol, kind in LAYER_SYMBOLS.items()}


class HybridStack(base_stack_class()):  # megatron-core's MambaStack / HybridStack
    def __init__(
        self,
        config,
        submodules=None,
        *,
        layer_specs: Sequence[ModuleSpec],
        layer_kinds: Sequence[str],
        layer_contexts: Optional[Sequence[Callable]] = None,
        final_norm: ModuleSpec | type = TorchNorm,
        residual_in_fp32: bool = False,
        pre_process: bool = True,
        post_layer_norm: bool = True,
        post_process: bool = True,
        pg_collection=None,
        layer_type_list=None,
        pp_layer_offset=None,
        recompute_config: RecomputeConfig = RecomputeConfig(),
        te_layers: bool = False,
        **_megatron_kwargs,  # hybrid ratios / pattern: the layer specs already fix the layers
    ) -> None:
        MegatronModule.__init__(self, config=config)
        if len(layer_specs) != config.num_layers or len(layer_kinds) != config.num_layers:
            raise ValueError(
                f"{len(layer_specs)} layer specs for a {config.num_layers}-layer pattern"
            )
        self.residual_in_fp32 = residual_in_fp32
        self.recompute_config = recompute_config  # config.recompute_* carry the same (megatron's)
        self.te_layers = te_layers  # Transformer Engine layers recompute under TE's checkpoint
        self.pre_process, self.post_process = pre_process, post_process
        self.post_layer_norm = post_layer_norm
        self.pp_group, self.tp_group = pg_collection.pp, pg_collection.tp
        self.input_tensor = None  # set by pipeline schedules

        symbols = [KIND_TO_SYMBOL[kind] for kind in layer_kinds]
        offset = 0
        if layer_type_list is not None:  # megatron-core >= 0.17 picked this stage's layers
            offset, symbols = pp_layer_offset or 0, list(layer_type_list)
        elif self.pp_group.size() > 1:  # 0.16: the stack slices the pattern itself
            offset, symbols = self._select_layers_for_pipeline_parallel(symbols)
        self.layer_type_list = symbols
        self.layer_offset = offset
        contexts = layer_contexts or [nullcontext] * config.num_layers
        self.layer_contexts = list(contexts[offset : offset + len(symbols)])

        layers = []
        base_seed = torch.initial_seed()
        for i, kind in enumerate(layer_kinds[offset : offset + len(symbols)]):
            spec = layer_specs[offset + i]
            # Each layer draws its initial weights from its own seed, so a pipeline stage that
            # builds only some layers starts from exactly the weights one process would have.
            torch.manual_seed(base_seed + 1 + offset + i)
            with self.layer_contexts[i]():
                if kind == "mamba":
                    # residual_in_fp32 left MambaLayer in core_v0.17.1 (ssm/mamba_layer.py:67-74);
                    # 0.16.1's default (False) is what every release does without it.
                    extra = {"residual_in_fp32": True} if residual_in_fp32 else {}
                    layer = build_module(
                        spec, config=config, layer_number=offset + i + 1,
                        pp_layer_offset=offset, pg_collection=pg_collection, **extra,
                    )
                else:
                    # TransformerLayer adds the pipeline offset to layer_number itself.
                    layer = build_module(
                        spec, config=config, layer_number=i + 1, pg_collection=pg_collection
                    )
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.num_layers_per_pipeline_rank = len(self.layers)
        if post_process and post_layer_norm:
            self.final_norm = build_module(
                final_norm, config=config, hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )

    def forward(self, hidden_states, attention_mask=None, inference_context=None,
                rotary_pos_emb=None, *, inference_params=None, packed_seq_params=None,
                padding_mask=None, **_unused):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("inference contexts are not supported by this trainer")
        if not self.pre_process:
            hidden_states = self.input_tensor  # from the previous pipeline stage
        recomputing = self.training and torch.is_grad_enabled()
        chunks = checkpointed_chunks(len(self.layers), self.recompute_config if recomputing
                                     else RecomputeConfig())
        for start, end, checkpointed in chunks:
            run = self._layers_forward(start, end, attention_mask, packed_seq_params)
            if checkpointed:
                # Only the chunk's input hidden state is kept, as in megatron's full recompute
                # (the mask, None for causal attention, needs no gradient).
                implementation = checkpoint_implementation(cuda=hidden_states.is_cuda,
                                                           te_layers=self.te_layers)
                hidden_states = recompute(run, hidden_states, implementation=implementation,
                                          tp_group=self.tp_group)
            else:
                hidden_states = run(hidden_states)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_norm(hidden_states)
        return make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )

    def _layers_forward(self, start: int, end: int, attention_mask, packed_seq_params):
        """The forward of layers [start, end) as a function of the hidden state alone."""
        def run(hidden_states):
            for i in range(start, end):
                layer, context = self.layers[i], self.layer_contexts[i]
                with context():  # entered on the recompute too: the same recipe
                    if isinstance(layer, TransformerLayer):
                        hidden_states, _ = layer(hidden_states=hidden_states,
                                                 attention_mask=attention_mask,
                                                 packed_seq_params=packed_seq_params)
                    else:
                        hidden_states = layer(hidden_states=hidden_states,
                                              attention_mask=attention_mask,
                                              packed_seq_params=packed_seq_params)
            return hidden_states

        return run
