"""Typed configuration of the hybrid model (Hydra group `model/`).

The schema checks its own fields when it is built (`__post_init__`; a numeric field's range is
declared on the field, `field_ranges`). Nothing here reads a file: model.init_from's directory is
checked by `model.hf.check_init_from`, which training's `validate` runs after the pure checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from errors import ConfigError
from field_ranges import above, at_least, check_fields
from nvfp4_recipe.policy import PrecisionConfig, PrecisionPolicy

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
    hidden_size: int = field(default=256, metadata=at_least(1))
    ffn_hidden_size: int = field(default=1024, metadata=at_least(1))
    num_attention_heads: int = field(default=8, metadata=at_least(1))
    num_query_groups: int = field(default=2, metadata=at_least(1))
    kv_channels: int = field(default=32, metadata=at_least(1))
    mamba_num_heads: int = field(default=32, metadata=at_least(1))
    mamba_head_dim: int = field(default=16, metadata=at_least(1))
    mamba_state_dim: int = field(default=64, metadata=at_least(1))
    mamba_num_groups: int = field(default=2, metadata=at_least(1))
    mamba_chunk_size: int = field(default=64, metadata=at_least(1))
    # None: the tokenizer's vocabulary, padded to a multiple of `vocab_multiple` x TP.
    vocab_size: Optional[int] = field(default=None, metadata=at_least(1, "or null: the tokenizer's"))
    vocab_multiple: int = field(default=128, metadata=at_least(1))
    max_sequence_length: int = field(default=256, metadata=at_least(1))
    init_method_std: float = field(default=0.02, metadata=above(0))
    layernorm_epsilon: float = field(default=1e-5, metadata=above(0))
    # How many leading/trailing pattern layers a low-precision recipe keeps in BF16 by default
    # for this depth (the paper: first 2 / last 8 at 12B). A precision recipe may override them.
    bf16_first_layers: int = field(default=1, metadata=at_least(0))
    bf16_last_layers: int = field(default=2, metadata=at_least(0))
    # auto: the TE spec where TE runs the precision's recipe and mamba_ssm imports, else the
    # portable spec; portable: always (GEMMs emulated); te: the TE spec or a ValueError.
    # Decided by model/backend.py.
    spec: LayerSpec = LayerSpec.auto
    # Continued pretraining: a Hugging Face NemotronH directory (config.json + *.safetensors) whose
    # weights a new run starts from instead of a random init, at any TP/PP (model/hf.py). Its
    # config.json must match the fields above; a run that has checkpoints resumes from them.
    init_from: Optional[str] = None

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if not self.pattern:
            raise ConfigError("model.pattern='' is empty: give one character per layer, 'M' "
                              "(Mamba-2), '*' (attention) or '-' (MLP), e.g. "
                              "model.pattern='M-M*-M-M-'")
        bad = sorted({c for c in self.pattern if c not in LAYER_SYMBOLS})
        if bad:
            raise ConfigError(
                f"model.pattern={self.pattern!r} has unknown layer character(s) {bad}: use only "
                "'M' (Mamba-2), '*' (attention) and '-' (MLP), e.g. model.pattern='M-M*-M-M-'"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_query_groups={self.num_query_groups} (GQA)"
            )
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ConfigError(
                f"model.mamba_num_heads={self.mamba_num_heads} must be a multiple of "
                f"model.mamba_num_groups={self.mamba_num_groups}"
            )
        if self.init_from is not None and not str(self.init_from).strip():
            raise ConfigError("model.init_from='' : give a Hugging Face model directory, "
                              "or null for a random init")

    # Callers that change a built config re-check it (a dataclass's fields can be reassigned).
    validate = __post_init__

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def layer_kinds(self) -> list[str]:
        return [LAYER_SYMBOLS[c] for c in self.pattern]


# The linears of each layer kind, by their names inside the layer (megatron's).
LINEAR_NAMES = {
    "mamba": ("mixer.in_proj", "mixer.out_proj"),
    "attention": ("self_attention.linear_qkv", "self_attention.linear_proj"),
    "mlp": ("mlp.linear_fc1", "mlp.linear_fc2"),
}


def precision_policy(cfg: ModelConfig, precision: PrecisionConfig) -> PrecisionPolicy:
    """The one precision policy of a model: every linear's format (raises ValueError for a bad
    `precision` key, e.g. an override pattern that matches no linear)."""
    return PrecisionPolicy(precision, cfg.layer_kinds(), cfg.bf16_first_layers,
                           cfg.bf16_last_layers, linear_names=LINEAR_NAMES)


def policy_for(cfg: ModelConfig, precision: PrecisionConfig,
               policy: Optional[PrecisionPolicy] = None) -> PrecisionPolicy:
    """`policy`, the one the start-up built, checked to be this model's and this `precision`
    object's (a policy of another config would build or check a different model); None builds
    it (`precision_policy`), for a caller that has none."""
    if policy is None:
        return precision_policy(cfg, precision)
    if policy.cfg is not precision or policy.layer_kinds != cfg.layer_kinds():
        raise ValueError("the precision policy handed in was built from another config: "
                         "pass the policy of this model and precision config")
    return policy
