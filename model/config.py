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

LAYER_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class LayerSpec(StrEnum):
    """`model.spec`; a member is named by its YAML spelling and equals it (see training/config.py)."""

    auto = "auto"
    portable = "portable"
    te = "te"


class RouterScore(StrEnum):
    """`model.moe.score_function`: megatron's moe_router_score_function."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class LoadBalancing(StrEnum):
    """`model.moe.load_balancing`: megatron's moe_router_load_balancing_type (the auxiliary loss
    over the micro-batch or per sequence; none: no auxiliary loss). Not global_aux_loss: its
    router buffers are CUDA-only (router.py:185-200 in mc 0.16.1)."""

    aux_loss = "aux_loss"
    seq_aux_loss = "seq_aux_loss"
    none = "none"


@dataclass
class MoEConfig:
    """The Mixture-of-Experts layers (`E` in model.pattern): megatron-core's MoELayer, dropless
    (no capacity factor: every token reaches its top-k experts), routed in FP32
    (moe_router_dtype=fp32) whatever the precision recipe. Nemotron 3 Nano's values are in
    recipes/model/nemotron3_nano.yaml (sigmoid scores, expert bias, seq_aux_loss 1e-4)."""

    num_experts: int = field(default=8, metadata=at_least(1))
    # Experts each token is routed to (megatron's moe_router_topk; transformers'
    # num_experts_per_tok).
    topk: int = field(default=2, metadata=at_least(1))
    # Hidden width of each routed expert's MLP (moe_ffn_hidden_size; transformers'
    # moe_intermediate_size). The experts are squared-ReLU MLPs without a gate, as the dense MLP.
    ffn_hidden_size: int = field(default=512, metadata=at_least(1))
    # One shared expert every token passes through, of this width
    # (moe_shared_expert_intermediate_size); null: none.
    shared_expert_ffn_hidden_size: Optional[int] = field(
        default=None, metadata=at_least(1, "or null: no shared expert"))
    score_function: RouterScore = RouterScore.softmax
    # The routing weights of the chosen experts are multiplied by this (Nemotron 3: 2.5;
    # transformers' routed_scaling_factor); null: 1.
    topk_scaling_factor: Optional[float] = field(default=None, metadata=above(0, "or null: 1"))
    # Aux-loss-free balancing (arXiv 2408.15664): a per-expert bias added to the scores for the
    # choice only, moved by `bias_update_rate` towards the mean load after every step (megatron's
    # finalize_model_grads). Needs score_function=sigmoid, as megatron requires.
    expert_bias: bool = False
    bias_update_rate: float = field(default=1e-3, metadata=at_least(0))
    load_balancing: LoadBalancing = LoadBalancing.aux_loss
    aux_loss_coeff: float = field(default=0.0, metadata=at_least(0, "0: no auxiliary loss"))

    def __post_init__(self) -> None:
        check_fields(self, "model.moe")
        if self.topk > self.num_experts:
            raise ConfigError(f"model.moe.topk={self.topk} is above model.moe.num_experts="
                              f"{self.num_experts}: a token cannot go to more experts than exist")
        if self.expert_bias and self.score_function != RouterScore.sigmoid:
            raise ConfigError(f"model.moe.expert_bias=true needs model.moe.score_function=sigmoid "
                              f"(got {self.score_function}), as megatron's router requires")


@dataclass
class ModelConfig:
    """Shape of a hybrid Mamba-Transformer. One pattern character is one layer."""

    name: str = "demo"
    # M = Mamba-2, * = self-attention, - = MLP, E = Mixture-of-Experts (the Nemotron-H notation).
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
    # The MoE layers' fields: set exactly when the pattern has an `E` (MoEConfig).
    moe: Optional[MoEConfig] = None

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if not self.pattern:
            raise ConfigError("model.pattern='' is empty: give one character per layer, 'M' "
                              "(Mamba-2), '*' (attention), '-' (MLP) or 'E' (MoE), e.g. "
                              "model.pattern='M-M*-M-M-'")
        bad = sorted({c for c in self.pattern if c not in LAYER_SYMBOLS})
        if bad:
            raise ConfigError(
                f"model.pattern={self.pattern!r} has unknown layer character(s) {bad}: use only "
                "'M' (Mamba-2), '*' (attention), '-' (MLP) and 'E' (MoE), e.g. "
                "model.pattern='M-M*-M-M-'"
            )
        if isinstance(self.moe, dict):  # built from a plain mapping (tests, tools)
            self.moe = MoEConfig(**self.moe)
        if "E" in self.pattern and self.moe is None:
            raise ConfigError(f"model.pattern={self.pattern!r} has MoE layers ('E') but model.moe "
                              "is not set: give model.moe.num_experts, topk and ffn_hidden_size "
                              "(e.g. model=demo_moe)")
        if "E" not in self.pattern and self.moe is not None:
            raise ConfigError(f"model.moe is set (num_experts={self.moe.num_experts}) but "
                              f"model.pattern={self.pattern!r} has no MoE layer ('E'): add one "
                              "or set model.moe=null")
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

# An MoE layer's linears. Routed expert g (its global index, whatever the expert-parallel rank
# that holds it) is `mlp.experts.local_experts.<g>.linear_fc1|2`: megatron's module path at EP=1
# and the key its SequentialMLP writes to checkpoints at any EP (sharded_state_dict maps local to
# global indices, transformer/moe/experts.py). The shared expert is `mlp.shared_experts.*`. The
# router (`mlp.router`) is not a linear of the policy: it stays FP32.
def expert_linear_name(expert: int, linear: str) -> str:
    return f"mlp.experts.local_experts.{expert}.{linear}"


SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def linear_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The linears of each layer kind of `cfg`, by their names inside the layer: LINEAR_NAMES,
    and for an MoE model each routed expert's two linears then the shared expert's."""
    names = dict(LINEAR_NAMES)
    if cfg.moe is not None:
        names["moe"] = tuple(expert_linear_name(g, fc) for g in range(cfg.moe.num_experts)
                             for fc in ("linear_fc1", "linear_fc2"))
        if cfg.moe.shared_expert_ffn_hidden_size is not None:
            names["moe"] += SHARED_EXPERT_LINEARS
    return names


def precision_policy(cfg: ModelConfig, precision: PrecisionConfig) -> PrecisionPolicy:
    """The one precision policy of a model: every linear's format (raises ValueError for a bad
    `precision` key, e.g. an override pattern that matches no linear)."""
    return PrecisionPolicy(precision, cfg.layer_kinds(), cfg.bf16_first_layers,
                           cfg.bf16_last_layers, linear_names=linear_names(cfg))


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
