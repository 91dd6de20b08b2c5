"""Typed configuration of the hybrid model (Hydra group `model/`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

LAYER_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp"}


class LayerSpec(StrEnum):
    """`model.spec`; a member is named by its YAML spelling and equals it (see training/config.py)."""

    auto = "auto"
    portable = "portable"
    te = "te"


@dataclass
class ModelConfig:
    """Shape of a hybrid Mamba-Transformer. One pattern character is one layer."""

    name: str = "demo"
    # M = Mamba-2, * = self-attention, - = MLP (the Nemotron-H notation).
    pattern: str = "M-M*-M-M-"
    hidden_size: int = 256
    ffn_hidden_size: int = 1024
    num_attention_heads: int = 8
    num_query_groups: int = 2
    kv_channels: int = 32
    mamba_num_heads: int = 32
    mamba_head_dim: int = 16
    mamba_state_dim: int = 64
    mamba_num_groups: int = 2
    mamba_chunk_size: int = 64
    # None: the tokenizer's vocabulary, padded to a multiple of `vocab_multiple` x TP.
    vocab_size: Optional[int] = None
    vocab_multiple: int = 128
    max_sequence_length: int = 256
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # How many leading/trailing pattern layers a low-precision recipe keeps in BF16 by default
    # for this depth (the paper: first 2 / last 8 at 12B). A precision recipe may override them.
    bf16_first_layers: int = 1
    bf16_last_layers: int = 2
    # auto: the TE spec where TE runs the precision's recipe and mamba_ssm imports, else the
    # portable spec; portable: always (GEMMs emulated); te: the TE spec or a ValueError.
    # Decided by model/backend.py.
    spec: LayerSpec = LayerSpec.auto
    # Continued pretraining: a Hugging Face NemotronH directory (config.json + *.safetensors) whose
    # weights a new run starts from instead of a random init, at any TP/PP (model/hf.py). Its
    # config.json must match the fields above; a run that has checkpoints resumes from them.
    init_from: Optional[str] = None

    def validate(self) -> None:
        for key in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "mamba_num_heads", "mamba_head_dim", "mamba_state_dim",
                    "mamba_num_groups", "mamba_chunk_size", "vocab_multiple",
                    "max_sequence_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be >= 1 (or null: the "
                             "tokenizer's)")
        for key in ("init_method_std", "layernorm_epsilon"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.{key}={value} must be a finite number > 0")
        for key in ("bf16_first_layers", "bf16_last_layers"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be >= 0")
        if not self.pattern:
            raise ValueError("model.pattern='' is empty: give one character per layer, 'M' "
                             "(Mamba-2), '*' (attention) or '-' (MLP), e.g. "
                             "model.pattern='M-M*-M-M-'")
        bad = sorted({c for c in self.pattern if c not in LAYER_SYMBOLS})
        if bad:
            raise ValueError(
                f"model.pattern={self.pattern!r} has unknown layer character(s) {bad}: use only "
                "'M' (Mamba-2), '*' (attention) and '-' (MLP), e.g. model.pattern='M-M*-M-M-'"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_query_groups={self.num_query_groups} (GQA)"
            )
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ValueError(
                f"model.mamba_num_heads={self.mamba_num_heads} must be a multiple of "
                f"model.mamba_num_groups={self.mamba_num_groups}"
            )
        if self.init_from is not None:
            if not str(self.init_from).strip():
                raise ValueError("model.init_from='' : give a Hugging Face model directory, "
                                 "or null for a random init")
            from .hf import check_init_from  # reads config.json and the file list only

            check_init_from(self)

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def layer_kinds(self) -> list[str]:
        return [LAYER_SYMBOLS[c] for c in self.pattern]
