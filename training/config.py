"""The run's typed configuration: one dataclass per Hydra group, composed into `TrainConfig`.

Registered with Hydra's ConfigStore as the schema of `recipes/train.yaml`, so every YAML
file and command-line override is checked in struct mode: an unknown key, a wrong type or a
value outside a choice's fails at start-up with the key's full name (exit 1). Each group's
schema then checks its own fields in `__post_init__`, which `OmegaConf.to_object` runs: a numeric
field's range is declared on the field (`field_ranges`). `validate` holds the checks across groups
(and over the world size), then those that read files; all before anything is written (exit 2,
exit 3 for a missing file).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.config import DataConfig, check_files_exist, check_runnable
from errors import ConfigError
from field_ranges import above, at_least, check_fields, within
from model.config import ModelConfig, precision_policy
from model.hf import check_init_from
from model.memory_model import pipeline_stages
from model.recompute import GRANULARITIES, METHODS, RecomputeConfig
from nvfp4_recipe.policy import USER_KEYS, PrecisionConfig, PrecisionPolicy, resolve_bf16_layers

from .distributed import DEFAULT_TIMEOUT_MINUTES, data_parallel_size
from .init_from import check_run_init, is_run_dir
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


class OnAnomaly(StrEnum):
    off = "off"
    replay = "replay"


# "continue" is a Python keyword: the functional form names the member by its YAML spelling.
AnomalyAction = StrEnum("AnomalyAction", [("continue", "continue"), ("stop", "stop")])


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

    def __post_init__(self) -> None:
        check_fields(self, "run")
        if not str(self.dir).strip():
            raise ConfigError("run.dir='' : give the directory for the run's files (default "
                              "runs/${run.name}); an empty one would be the working directory")


@dataclass
class ParallelConfig:
    tensor: int = field(default=1, metadata=at_least(1))
    pipeline: int = field(default=1, metadata=at_least(1))
    # Layers in the first/last pipeline stage when the pattern does not split evenly.
    first_stage_layers: Optional[int] = field(default=None, metadata=at_least(1))
    last_stage_layers: Optional[int] = field(default=None, metadata=at_least(1))
    sequence: bool = False
    # MoE layers (model.moe): the routed experts split over this many ranks (megatron's
    # expert_model_parallel_size), each expert over expert_tensor_parallel_size ranks (null: the
    # tensor size, megatron's default). ETP x EP x pipeline must divide the world size.
    expert_model_parallel_size: int = field(default=1, metadata=at_least(1))
    expert_tensor_parallel_size: Optional[int] = field(
        default=None, metadata=at_least(1, "or null: parallel.tensor"))
    # auto: gloo on CPU, nccl on GPUs.
    backend: ProcessGroupBackend = ProcessGroupBackend.auto
    # Minutes a rank waits in a collective for the others before the job fails (every process
    # group). Long enough for the slowest rank's share of a checkpoint write and its hashing
    # (docs/benchmarks/checkpoint-scaling.md), short enough that a hang does not idle the job
    # for hours. NCCL's own default, 10 minutes, is shorter than a large save.
    timeout_minutes: int = field(default=DEFAULT_TIMEOUT_MINUTES, metadata=within(1, 24 * 60))

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        if self.sequence and self.tensor == 1:
            raise ConfigError("parallel.sequence=true needs parallel.tensor > 1 (it splits the "
                              "sequence over the tensor-parallel ranks)")


@dataclass
class TrainerConfig:
    max_steps: int = field(default=200, metadata=at_least(1))
    global_batch_size: int = field(default=8, metadata=at_least(1))
    micro_batch_size: int = field(default=4, metadata=at_least(1))
    seq_length: int = field(default=256, metadata=at_least(1))
    lr: float = field(default=3e-3, metadata=above(0))
    # At most lr (checked in __post_init__).
    min_lr: float = field(default=3e-5, metadata=at_least(0))
    warmup_steps: int = field(default=20, metadata=at_least(0))
    # Warmup-stable-decay: the lr decays over this last fraction of the steps.
    decay_fraction: float = field(default=0.2, metadata=within(0, 1))
    weight_decay: float = field(default=0.1, metadata=at_least(0))
    adam_beta1: float = field(default=0.9, metadata=within(0, 1, high_open=True))
    adam_beta2: float = field(default=0.95, metadata=within(0, 1, high_open=True))
    adam_eps: float = field(default=1e-8, metadata=above(0))
    grad_clip: float = field(default=1.0, metadata=at_least(0, "0: no clipping"))
    # torch and numpy take any seed below 2**32; 2**31 leaves room for the per-rank offsets.
    seed: int = field(default=1234, metadata=within(0, 2**31, high_open=True))
    log_every: int = field(default=1, metadata=at_least(1))
    eval_every: int = field(default=50, metadata=at_least(1))
    eval_batches: int = field(default=4, metadata=at_least(1))
    save_every: int = field(default=100, metadata=at_least(1))
    keep_last: int = field(default=3, metadata=at_least(0, "0 keeps every checkpoint"))
    # What a NaN/Inf loss does: "stop" (exit code 4, no checkpoint) or "skip" the step.
    on_nan: OnNan = OnNan.stop
    # With on_nan=skip: this many skipped steps in a row stop the run (exit code 4).
    max_consecutive_skips: int = field(default=3, metadata=at_least(1))
    # What an anomalous step does (training/forensics.py, docs/precision-forensics.md): off, or
    # replay: at a non-finite loss / grad norm, or a grad norm more than anomaly_zscore standard
    # deviations above the mean of the previous anomaly_window finite ones, the trainer bisects
    # the step in process (its GEMMs switched to BF16 in sets, from the step's own weights, batch
    # and RNG) before the optimizer update, writes run.dir/replay/step-N/replay.json and an
    # `anomaly` event, then saves a checkpoint after the step and continues or stops
    # (anomaly_action; stop exits with code 4). With on_nan=stop a non-finite step still stops
    # the run after the bisect, without a checkpoint.
    on_anomaly: OnAnomaly = OnAnomaly.off
    anomaly_window: int = field(default=20, metadata=within(2, 10_000))
    anomaly_zscore: float = field(default=6.0, metadata=above(0))
    anomaly_action: AnomalyAction = AnomalyAction["continue"]
    # The bisect's thresholds: relative loss / grad-norm deviation from the all-BF16 replay of
    # the step beyond which a set of low-precision GEMMs explains the anomaly.
    anomaly_loss_threshold: float = field(default=0.02, metadata=above(0))
    anomaly_grad_norm_threshold: float = field(default=0.25, metadata=above(0))
    # Every N steps: each layer's gradient norm and non-finite fraction -> metrics.jsonl/W&B
    # grad/<layer>/..., and a console line (0 = off). A non-finite step is always reported with
    # the first layer (in backward order) whose gradients went non-finite.
    grad_health_every: int = field(default=100, metadata=at_least(0, "0: off"))
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
    recompute_layers: int = field(default=1, metadata=at_least(1))

    def __post_init__(self) -> None:
        check_fields(self, "trainer")
        if self.min_lr > self.lr:
            raise ConfigError(f"trainer.min_lr={self.min_lr} must be in [0, trainer.lr={self.lr}]")


@dataclass
class LoggerConfig:
    # W&B: offline (default, no account needed), online, or disabled.
    mode: LoggerMode = LoggerMode.offline
    project: str = "nvfp4-pretrain"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_fields(self, "logger")


@dataclass
class EvaluationConfig:
    """Downstream tasks in the loop (lm-evaluation-harness; training/downstream.py)."""

    # lm-eval task names (data/eval_tasks/ ships offline demo tasks), groups, tags, or paths to
    # task YAMLs. Empty: no downstream evaluation, and lm-eval is never imported.
    tasks: list[str] = field(default_factory=list)
    # Every N optimizer steps, and at the last step. The step's checkpoint is written before the
    # evaluation, so a run killed during one resumes it without training again.
    every: int = field(default=100, metadata=at_least(1))
    # Samples per task (null: all of them).
    limit: Optional[int] = field(default=None, metadata=at_least(1, "or null: every sample"))
    # Requests per forward (each a row of up to trainer.seq_length tokens).
    batch_size: int = field(default=8, metadata=at_least(1))

    def __post_init__(self) -> None:
        check_fields(self, "evaluation")
        for task in self.tasks:
            if not str(task).strip():
                raise ConfigError("evaluation.tasks: an empty task name")


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
    cs.store(name="train_schema", node=_schema(TrainConfig))
    for group, node in (("model", ModelConfig), ("precision", PrecisionConfig),
                        ("data", DataConfig), ("parallel", ParallelConfig),
                        ("trainer", TrainerConfig), ("logger", LoggerConfig),
                        ("evaluation", EvaluationConfig),
                        ("plan", PlanConfig)):
        cs.store(group=group, name=f"{group}_schema", node=_schema(node))


def _schema(cls) -> DictConfig:
    """A schema as the ConfigStore's node, its dicts of user keys (field metadata USER_KEYS:
    precision.overrides' module-name patterns) open to new keys. Hydra's struct mode refuses a
    key the schema does not name, right for a field and wrong for a user's own names, where the
    command line would need `++` to add one (`precision.overrides={...}` merges into the
    recipe's)."""
    node = OmegaConf.structured(cls)
    _open_user_keys(node, cls)
    return node


def _open_user_keys(node: DictConfig, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(USER_KEYS):
            OmegaConf.set_struct(node[f.name], False)
        elif dataclasses.is_dataclass(hints[f.name]):
            _open_user_keys(node[f.name], hints[f.name])


def validate(cfg: TrainConfig, world_size: int) -> PrecisionPolicy:
    """The checks across groups and over `world_size` processes, then those that read files,
    before anything is written; each error names a key. Every group checked its own fields when
    it was built (`__post_init__`). ConfigError (exit 2); a run's missing data file or tokenizer
    is a MissingDataError (exit 3), an unusable model.init_from an HFError (a Hugging Face
    directory) or a RunDirError (a run directory); a dry run plans without the data files.
    Returns the precision policy the checks built, which the start-up hands to the preflight,
    the plan and the model."""
    policy = check_across_groups(cfg, world_size)
    if cfg.model.init_from is not None:
        check_init_from(cfg.model)  # a Hugging Face directory: config.json and the file list
        if is_run_dir(cfg.model.init_from):  # its shape and a usable checkpoint, read-only
            check_run_init(cfg.model)
    if not cfg.run.dry_run:
        check_files_exist(cfg.data)
    check_runnable(cfg.data)  # after the files: a missing tokenizer is reported as missing
    return policy


def check_expert_parallel(model: ModelConfig, par: ParallelConfig, world_size: int) -> None:
    """The expert-parallel layout against the model and the world size (ConfigError), before
    megatron's parallel_state would refuse it with a RuntimeError (parallel_state.py:786-795 in
    mc 0.16.1) or MoELayer with a bare assert (moe_layer.py:101)."""
    ep = par.expert_model_parallel_size
    etp = par.tensor if par.expert_tensor_parallel_size is None else par.expert_tensor_parallel_size
    if model.moe is None:
        if ep > 1 or par.expert_tensor_parallel_size is not None:
            raise ConfigError(f"parallel.expert_model_parallel_size={ep}, "
                              f"parallel.expert_tensor_parallel_size="
                              f"{par.expert_tensor_parallel_size}: model.pattern="
                              f"{model.pattern!r} has no MoE layer ('E') to split")
        return
    if par.tensor > 1 and not par.sequence:
        raise ConfigError(f"parallel.tensor={par.tensor} with MoE layers ('E' in model.pattern) "
                          "needs parallel.sequence=true: each tensor-parallel rank routes its "
                          "own part of the sequence (megatron's MoELayer refuses to train "
                          "without, moe_layer.py:379-383 in mc 0.16.1)")
    if ep == 1 and etp != par.tensor:
        raise ConfigError(
            f"parallel.expert_tensor_parallel_size={etp} differs from parallel.tensor="
            f"{par.tensor} at parallel.expert_model_parallel_size=1: megatron marks expert "
            "weights expert-parallel only at EP > 1 (tensor_parallel/layers.py:886 in mc 0.16.1), "
            "so their gradients would be summed over the data-parallel ranks alone, not over the "
            "tensor-parallel ranks that route other tokens to the same experts; set it to null "
            "or use EP > 1")
    if model.moe.num_experts % ep:
        raise ConfigError(f"model.moe.num_experts={model.moe.num_experts} is not divisible by "
                          f"parallel.expert_model_parallel_size={ep}")
    grid = etp * ep * par.pipeline
    if world_size % grid:
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} x expert tensor parallel {etp} x "
            f"parallel.pipeline={par.pipeline} = {grid} does not divide the world size "
            f"({world_size} processes): EP x ETP x PP x expert data parallel must equal it")


def check_across_groups(cfg: TrainConfig, world_size: int) -> PrecisionPolicy:
    """The pure checks that involve more than one group, or the world size (ConfigError).
    Returns the precision policy, built here to check the precision config against the model."""
    t, p = cfg.parallel.tensor, cfg.parallel.pipeline
    dp = data_parallel_size(t, p, world_size)
    check_expert_parallel(cfg.model, cfg.parallel, world_size)
    tr = cfg.trainer
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise ConfigError(
            f"trainer.global_batch_size={tr.global_batch_size} must be a multiple of "
            f"trainer.micro_batch_size={tr.micro_batch_size} x data parallel {dp}"
        )
    if tr.seq_length > cfg.model.max_sequence_length:
        raise ConfigError(
            f"trainer.seq_length={tr.seq_length} exceeds model.max_sequence_length="
            f"{cfg.model.max_sequence_length}"
        )
    if cfg.parallel.sequence and tr.seq_length % t:
        raise ConfigError(f"trainer.seq_length={tr.seq_length} must be divisible by "
                          f"parallel.tensor={t} with parallel.sequence=true")
    try:  # nvfp4_recipe and the memory model refuse with plain ValueErrors (the wheel's floor)
        if cfg.precision.format != "bf16":
            resolve_bf16_layers(cfg.precision, cfg.model.num_layers, cfg.model.bf16_first_layers,
                                cfg.model.bf16_last_layers)
        pipeline_stages(cfg.model.num_layers, p, cfg.parallel.first_stage_layers,
                        cfg.parallel.last_stage_layers)
        return precision_policy(cfg.model, cfg.precision)  # e.g. an override matching no linear
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
