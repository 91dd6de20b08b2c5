"""The run's typed configuration: one dataclass per Hydra group, composed into `TrainConfig`.

Registered with Hydra's ConfigStore as the schema of `recipes/train.yaml`, so every YAML
file and command-line override is checked in struct mode: an unknown key, a wrong type or a
value outside a choice's fails at start-up with the key's full name (exit 1). `validate` then runs
every group's own checks before anything is written (exit 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from hydra.core.config_store import ConfigStore

from data.config import DataConfig, validate_config
from model.config import ModelConfig
from model.memory_model import pipeline_stages
from model.recompute import GRANULARITIES, METHODS, RecomputeConfig
from nvfp4_recipe.policy import PrecisionConfig, resolve_bf16_layers, validate_precision

from .plan import PlanConfig


# Choice fields are StrEnums: OmegaConf refuses any other value at composition, naming the key and
# the allowed values. Members are named by their YAML spelling (OmegaConf matches a string to a
# member's name), and a member equals its string, so code compares with plain strings.


class Resume(StrEnum):
    auto = "auto"
    never = "never"
    restart = "restart"


class ProcessGroupBackend(StrEnum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class OnNan(StrEnum):
    stop = "stop"
    skip = "skip"


class CheckpointLayout(StrEnum):
    """megatron's distributed-optimizer checkpoint layouts (training/checkpoint.py)."""
    dp_reshardable = "dp_reshardable"
    fully_reshardable = "fully_reshardable"


Recompute = StrEnum("Recompute", [(name, name) for name in GRANULARITIES])
RecomputeMethod = StrEnum("RecomputeMethod", [(name, name) for name in METHODS])


class LoggerMode(StrEnum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class RunConfig:
    name: str = "demo"
    # Everything a run writes lives here: config.yaml, train.log, metrics.jsonl,
    # checkpoints/, wandb/, plan.json. All ranks must agree on it (the default is derived
    # from the name only, never a timestamp).
    dir: str = "runs/${run.name}"
    # auto: continue from the latest complete checkpoint in run.dir if there is one; when
    # run.dir holds checkpoints and none is usable, stop (exit 6) rather than start over;
    # never: refuse a run.dir that already holds a run (nothing is overwritten);
    # restart: train from step 0 in this run.dir, its checkpoints moved (not deleted) to
    # checkpoints/abandoned-<UTC time>/ and metrics.jsonl appended to.
    resume: Resume = Resume.auto
    # Build on the meta device, print and write plan.json, train nothing.
    dry_run: bool = False

    def validate(self) -> None:
        if not str(self.dir).strip():
            raise ValueError("run.dir='' : give the directory for the run's files (default "
                             "runs/${run.name}); an empty one would be the working directory")


@dataclass
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    # Layers in the first/last pipeline stage when the pattern does not split evenly.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    sequence: bool = False
    # auto: gloo on CPU, nccl on GPUs.
    backend: ProcessGroupBackend = ProcessGroupBackend.auto


@dataclass
class TrainerConfig:
    max_steps: int = 200
    global_batch_size: int = 8
    micro_batch_size: int = 4
    seq_length: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-5
    warmup_steps: int = 20
    # Warmup-stable-decay: the lr decays over this last fraction of the steps.
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    log_every: int = 1
    eval_every: int = 50
    eval_batches: int = 4
    save_every: int = 100
    keep_last: int = 3
    # What a NaN/Inf loss does: "stop" (exit code 4, no checkpoint) or "skip" the step.
    on_nan: OnNan = OnNan.stop
    # With on_nan=skip: this many skipped steps in a row stop the run (exit code 4).
    max_consecutive_skips: int = 3
    # Every N steps: each layer's gradient norm and non-finite fraction -> metrics.jsonl/W&B
    # grad/<layer>/..., and a console line (0 = off). A non-finite step is always reported with
    # the first layer (in backward order) whose gradients went non-finite.
    grad_health_every: int = 100
    # Shard the FP32 master weights and Adam moments over the data-parallel ranks (megatron's
    # distributed optimizer): optimizer memory per rank / data-parallel size.
    distributed_optimizer: bool = False
    # How the distributed optimizer's state is checkpointed: dp_reshardable (each rank writes and
    # reads its own shard; resumes at any data-parallel size, at the same tensor/pipeline layout
    # and spec) or fully_reshardable (gathered per parameter: resumes at any layout, on either
    # spec, at the cost of every shard in every rank's memory at save and load). Without the
    # distributed optimizer the state is per parameter anyway (fully_reshardable).
    checkpoint_layout: CheckpointLayout = CheckpointLayout.dp_reshardable
    # Activation recompute (megatron's meaning, model/recompute.py): none, selective (core
    # attention and the portable Mamba scan) or full (whole layers; recompute_method uniform:
    # chunks of recompute_layers layers, block: the first recompute_layers layers per stage).
    recompute: Recompute = Recompute.none
    recompute_method: RecomputeMethod = RecomputeMethod.uniform
    recompute_layers: int = 1


@dataclass
class LoggerConfig:
    # W&B: offline (default, no account needed), online, or disabled.
    mode: LoggerMode = LoggerMode.offline
    project: str = "nvfp4-pretrain"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class EvaluationConfig:
    """Downstream tasks in the loop (lm-evaluation-harness; training/downstream.py)."""

    # lm-eval task names (data/eval_tasks/ ships offline demo tasks), groups, tags, or paths to
    # task YAMLs. Empty: no downstream evaluation, and lm-eval is never imported.
    tasks: list[str] = field(default_factory=list)
    # Every N optimizer steps, and at the last step. The step's checkpoint is written before the
    # evaluation, so a run killed during one resumes it without training again.
    every: int = 100
    # Samples per task (null: all of them).
    limit: Optional[int] = None
    # Requests per forward (each a row of up to trainer.seq_length tokens).
    batch_size: int = 8

    def validate(self) -> None:
        for key in ("every", "batch_size"):
            value = getattr(self, key)
            if not (_number(value) and value >= 1):
                raise ValueError(f"evaluation.{key}={value} must be >= 1")
        if self.limit is not None and not (_number(self.limit) and self.limit >= 1):
            raise ValueError(f"evaluation.limit={self.limit} must be >= 1 (or null: every sample)")
        for task in self.tasks:
            if not str(task).strip():
                raise ValueError("evaluation.tasks: an empty task name")


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    # The dry run's memory/time assumptions (training/plan.py).
    plan: PlanConfig = field(default_factory=PlanConfig)


def recompute_config(tr: TrainerConfig) -> RecomputeConfig:
    """The model's activation recompute, from trainer.recompute*."""
    return RecomputeConfig(tr.recompute, tr.recompute_method, tr.recompute_layers)


def register_configs() -> None:
    """Schemas for `recipes/`: the root and one per group option family."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, node in (("model", ModelConfig), ("precision", PrecisionConfig),
                        ("data", DataConfig), ("parallel", ParallelConfig),
                        ("trainer", TrainerConfig), ("logger", LoggerConfig),
                        ("evaluation", EvaluationConfig),
                        ("plan", PlanConfig)):
        cs.store(group=group, name=f"{group}_schema", node=node)


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Every group's checks that Hydra's types cannot express (ranges, cross-field rules, the
    layout over `world_size` processes), before anything is written; each error names the key.
    A run's data files and tokenizer must exist (MissingDataError); a dry run plans without them."""
    cfg.run.validate()
    check_ranges(cfg)
    cfg.evaluation.validate()
    cfg.model.validate()
    if cfg.model.init_from is not None:
        from .init_from import check_run_init, is_run_dir

        if is_run_dir(cfg.model.init_from):  # its shape and a usable checkpoint, read-only
            check_run_init(cfg.model)
    validate_config(cfg.data, check_files=not cfg.run.dry_run)
    t, p = cfg.parallel.tensor, cfg.parallel.pipeline
    if t < 1 or p < 1 or world_size % (t * p):
        raise ValueError(
            f"parallel.tensor={t} x parallel.pipeline={p} must divide the world size "
            f"({world_size} processes); data parallel = world size / (tensor x pipeline)"
        )
    dp = world_size // (t * p)
    tr = cfg.trainer
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise ValueError(
            f"trainer.global_batch_size={tr.global_batch_size} must be a multiple of "
            f"trainer.micro_batch_size={tr.micro_batch_size} x data parallel {dp}"
        )
    if tr.seq_length > cfg.model.max_sequence_length:
        raise ValueError(
            f"trainer.seq_length={tr.seq_length} exceeds model.max_sequence_length="
            f"{cfg.model.max_sequence_length}"
        )
    if cfg.parallel.sequence and t == 1:
        raise ValueError("parallel.sequence=true needs parallel.tensor > 1 (it splits the "
                         "sequence over the tensor-parallel ranks)")
    if cfg.parallel.sequence and tr.seq_length % t:
        raise ValueError(f"trainer.seq_length={tr.seq_length} must be divisible by "
                         f"parallel.tensor={t} with parallel.sequence=true")
    recompute_config(tr).validate()
    validate_precision(cfg.precision)
    if cfg.precision.format != "bf16":
        resolve_bf16_layers(cfg.precision, cfg.model.num_layers, cfg.model.bf16_first_layers,
                            cfg.model.bf16_last_layers)
    pipeline_stages(cfg.model.num_layers, p, cfg.parallel.first_stage_layers,
                    cfg.parallel.last_stage_layers)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(key: str, value, ok: bool, rule: str) -> None:
    if not (_number(value) and ok):
        raise ValueError(f"{key}={value} {rule}")


def check_ranges(cfg: TrainConfig) -> None:
    """Every numeric key of the trainer, parallel and plan groups within its range (the model's,
    data's and precision's own validators check theirs); run before anything is written."""
    tr = cfg.trainer
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "seq_length", "log_every",
                "eval_every", "eval_batches", "save_every", "max_consecutive_skips",
                "recompute_layers"):
        value = getattr(tr, key)
        _check(f"trainer.{key}", value, value >= 1, "must be >= 1")
    _check("trainer.warmup_steps", tr.warmup_steps, tr.warmup_steps >= 0, "must be >= 0")
    _check("trainer.grad_health_every", tr.grad_health_every, tr.grad_health_every >= 0,
           "must be >= 0 (0: off)")
    _check("trainer.keep_last", tr.keep_last, tr.keep_last >= 0,
           "must be >= 0 (0 keeps every checkpoint)")
    _check("trainer.seed", tr.seed, 0 <= tr.seed < 2**31, "must be in [0, 2**31)")
    _check("trainer.lr", tr.lr, tr.lr > 0, "must be a finite number > 0")
    _check("trainer.min_lr", tr.min_lr, 0 <= tr.min_lr <= tr.lr,
           f"must be in [0, trainer.lr={tr.lr}]")
    _check("trainer.decay_fraction", tr.decay_fraction, 0 <= tr.decay_fraction <= 1,
           "must be in [0, 1]")
    _check("trainer.weight_decay", tr.weight_decay, tr.weight_decay >= 0, "must be >= 0")
    _check("trainer.grad_clip", tr.grad_clip, tr.grad_clip >= 0, "must be >= 0 (0: no clipping)")
    for key in ("adam_beta1", "adam_beta2"):
        value = getattr(tr, key)
        _check(f"trainer.{key}", value, 0 <= value < 1, "must be in [0, 1)")
    _check("trainer.adam_eps", tr.adam_eps, tr.adam_eps > 0, "must be a finite number > 0")
    par = cfg.parallel
    for key in ("tensor", "pipeline"):
        value = getattr(par, key)
        _check(f"parallel.{key}", value, value >= 1, "must be >= 1")
    for key in ("first_stage_layers", "last_stage_layers"):
        value = getattr(par, key)
        if value is not None:
            _check(f"parallel.{key}", value, value >= 1, "must be >= 1 (or null)")
    plan = cfg.plan
    if plan.gpus is not None:
        _check("plan.gpus", plan.gpus, plan.gpus >= 1, "must be >= 1 (or null)")
    if plan.total_tokens is not None:
        _check("plan.total_tokens", plan.total_tokens, plan.total_tokens >= 1,
               "must be >= 1 (or null)")
    _check("plan.peak_tflops", plan.peak_tflops, plan.peak_tflops > 0, "must be > 0")
    _check("plan.mfu", plan.mfu, 0 < plan.mfu <= 1, "must be in (0, 1]")
