"""The training loop: build everything from the config, step, evaluate, checkpoint, resume."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from compat import seed_model_parallel_rng
from errors import ConfigError, ExitCode, ProjectError
from data import build_data
from data.demo import ensure_demo_corpus
from data.tokenizer import load_tokenizer_spec
from model.build import build_model, choose_backend, padded_vocab_size
from model.hf import load_hf_weights
from model.moe import expert_load_line, moe_routers, routing_group, take_expert_load
from model.specs import linear_shapes

from . import checkpoint as ckpt
from . import run_dir as run_dir_lib
from .cadence import Every
from .config import TrainConfig, recompute_config
from .ddp_optimizer import (PARAMS_DTYPE, build_data_parallel_model, optimizer_checkpoint_format,
                            optimizer_state_bytes, uses_megatron_ddp)
from .distributed import (ParallelContext, step_loss_and_stop,
                          stochastic_rounding_seed)
from .downstream import DownstreamEvaluator, run_tokenizer
from .forensics import (AnomalyWatch, Thresholds, bisect, bisect_table, capture_rng,
                        code_version, write_replay_json)
from .grad_health import GradHealth
from .init_from import is_run_dir, load_run_weights
from .lr_schedule import WSDScheduler
from .metrics import (MetricsSink, check_wandb_online, data_line, grad_health_line, render,
                      start_wandb, status_line)
from .precision import PrecisionController, diagnostics_summary
from .preflight import run_preflight
from .schedules import run_micro_batches
from .signals import StopSignal
from .validation import Validator

log = logging.getLogger("nvfp4_pretrain")


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float  # the learning rate this step used
    skipped: bool
    health: dict[str, float] = field(default_factory=dict)  # grad/<layer>/... when measured
    # quant/<layer>/... and underflow/<layer>/... when measured
    precision: dict[str, float] = field(default_factory=dict)
    stop: bool = False  # a rank was signalled (agreed by every rank in the loss's reduction)


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, stop: Optional[StopSignal] = None,
                 preflight=None, policy=None):
        """`preflight`: entry.run()'s run_preflight result, so start-up checks the GEMMs once;
        `policy`: the precision policy its config check built (training.config.validate), so
        start-up builds it once (None: build_model builds it)."""
        self.cfg, self.ctx = cfg, ctx
        self.stop = stop or StopSignal()
        tr = cfg.trainer
        self.run_dir = Path(cfg.run.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.tokens_per_step = tr.global_batch_size * tr.seq_length
        self.total_tokens = tr.max_steps * self.tokens_per_step
        self.micro_batches = tr.global_batch_size // (tr.micro_batch_size * ctx.data)

        seed_model_parallel_rng(tr.seed, ctx.hardware.cuda)  # megatron's CUDA RNG tracker on GPUs
        self.data = build_data(
            cfg.data, seq_length=tr.seq_length, micro_batch_size=tr.micro_batch_size,
            global_batch_size=tr.global_batch_size, total_tokens=self.total_tokens,
            seed=tr.seed, dp_rank=ctx.data_rank, dp_size=ctx.data, show_progress=ctx.is_main,
        )
        backend, reason = choose_backend(cfg.precision, cfg.model.spec, ctx.hardware)
        # What BF16 GEMMs compute in on this device (nvfp4_recipe/compute.py).
        self.gemm = ctx.hardware.gemm_compute(cfg.precision.gemm_compute)
        self.built = build_model(
            cfg.model, cfg.precision, vocab_size=self.data.vocab_size,
            tensor_parallel=ctx.tensor, pipeline_parallel=ctx.pipeline, backend=backend,
            pre_process=ctx.first_stage, post_process=ctx.last_stage,
            num_layers_in_first_stage=cfg.parallel.first_stage_layers,
            num_layers_in_last_stage=cfg.parallel.last_stage_layers,
            params_dtype=PARAMS_DTYPE, recompute=recompute_config(tr),
            sequence_parallel=cfg.parallel.sequence,
            # GPU: initialise there, megatron's fused Mamba path and Wgrad fusion where they run
            cuda=ctx.hardware.cuda, main_grads=uses_megatron_ddp(ctx.device), policy=policy,
        )
        # What flows between pipeline stages: [sequence, micro-batch, hidden] activations.
        self.activation_shape = (tr.seq_length, tr.micro_batch_size, cfg.model.hidden_size)
        self.core = self.built.module.to(ctx.device)  # the unwrapped megatron model
        if cfg.model.init_from:  # a NemotronH directory's or a run's weights, before the optimizer
            # copied in (a resume below still wins)
            if is_run_dir(cfg.model.init_from):
                load_run_weights(self.core, cfg.model)
            else:
                load_hf_weights(self.core, cfg.model, self.data.vocab_size, self.data.tokenizer)
        # BF16 weights, FP32 main grads and master weights (megatron's DDP and optimizer on GPUs).
        self.model, self.optimizer = build_data_parallel_model(self.core, tr, ctx)
        self.optimizer_format = optimizer_checkpoint_format(ctx.device, tr.distributed_optimizer)
        self.checkpoint_layout = ckpt.optimizer_layout(str(tr.checkpoint_layout),
                                                       tr.distributed_optimizer)
        self.scheduler = WSDScheduler(self.optimizer, tr)
        self.precision = PrecisionController(
            cfg.precision, self.built, self.tokens_per_step, self.total_tokens,
            Every(cfg.precision.diagnostics_every), Every(cfg.precision.telemetry.every),
            gemm_shapes={name: (s["in"], s["out"])
                         for name, s in linear_shapes(cfg.model, ctx.tensor).items()})
        # This rank's MoE routers, whose expert load each step reports (none in a dense model).
        self.moe_routers = moe_routers(self.core)
        # Each rank draws its own stochastic-rounding stream (saved with its checkpoint).
        torch.manual_seed(stochastic_rounding_seed(tr.seed, ctx))

        self.step = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0  # skipped steps in a row, up to trainer.max_consecutive_skips
        self.skipped_at_last_save = 0  # skipped_steps when the previous checkpoint was written
        self.wandb_id: Optional[str] = None
        self.resumed_from: Optional[Path] = None  # the checkpoint resume() loaded
        # What trained this run's checkpoints, in their trainer.pt: a replay (tools/replay.py)
        # rebuilds the step from this config and warns when the code differs.
        self.provenance = {"code": code_version(),
                           "config": OmegaConf.to_yaml(OmegaConf.structured(cfg))}
        # trainer.on_anomaly=replay: the trigger, and whether the last anomaly asked to stop.
        self.anomaly = (AnomalyWatch(tr.anomaly_window, tr.anomaly_zscore)
                        if tr.on_anomaly == "replay" else None)
        self.anomaly_at: Optional[int] = None  # the step of an anomaly not yet checkpointed
        # Each periodic action has one cadence (training/cadence.py), held by the part of the
        # loop that acts: the validator, the downstream evaluator, the gradient health, the
        # precision controller's diagnostics; the trainer's own two, checkpoints and the status line.
        self.validator = Validator(self.model, self.data.validation_batches(tr.eval_batches),
                                   ctx, self.activation_shape, self.gemm,
                                   self.precision.before_evaluation,
                                   due=Every(tr.eval_every, last=tr.max_steps))
        self.save_due = Every(tr.save_every, last=tr.max_steps)
        self.status_due = Every(tr.log_every)
        evaluation = cfg.evaluation
        self.downstream = DownstreamEvaluator(
            evaluation, Every(evaluation.every, last=tr.max_steps), self._downstream_lm,
            self.run_dir, ctx.is_main)
        for line in self.precision.describe(backend, reason, ctx.device):
            log.info(line)
        log.info(f"device: {ctx.hardware.describe()}; {self.gemm.describe()}")
        log.info(f"model paths: {self.built.paths}")
        if self.precision.quantizes:
            for line in (preflight or run_preflight(cfg, self.built.policy, backend,
                                                    ctx.hardware)).summary():
                log.info(line)
        log.info(render(self.data.train.describe_schedule()))
        log.info(f"parallel: world {ctx.world_size} = tensor {ctx.tensor} x pipeline "
                 f"{ctx.pipeline} x data {ctx.data}; {self.micro_batches} micro-batches/step"
                 + (f"; experts: expert {ctx.expert} x expert tensor {ctx.expert_tensor} x "
                    f"expert data {ctx.expert_data}" if self.moe_routers else ""))
        log.info(f"mixed precision: BF16 weights, FP32 main grads; FP32 master weights + Adam "
                 f"{optimizer_state_bytes(self.optimizer) / 2**20:.2f} MiB on this rank"
                 + (f" (sharded over {ctx.data} data-parallel ranks)"
                    if tr.distributed_optimizer and ctx.data > 1 else ""))

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint's trainer.pt holds: the loop's counters and W&B id, and the state
        of the scheduler and the data stream (consumed_tokens is for readers; step implies it)."""
        return {"step": self.step, "scheduler": self.scheduler.state_dict(),
                "data": self.data.train.state_dict(), "wandb_id": self.wandb_id,
                "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                "consumed_tokens": self.consumed_tokens,
                "input_amax": self.precision.input_amax.state_dict(),
                # the adaptive fallback's map and windows (training/precision.py)
                "precision": self.precision.state_dict(),
                "evaluation": self.downstream.state_dict(), "provenance": self.provenance,
                "anomaly": self.anomaly.state_dict() if self.anomaly else None}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.train.load_state_dict(state["data"])
        self.step, self.wandb_id = state["step"], state["wandb_id"]
        self.skipped_steps = self.skipped_at_last_save = state["skipped_steps"]
        # checkpoints written before max_consecutive_skips existed have no such counter
        self.consecutive_skips = state.get("consecutive_skips", 0)
        if "input_amax" in state:  # checkpoints written before it existed start an empty window
            self.precision.input_amax.load_state_dict(state["input_amax"])
        # checkpoints written before the adaptive precision have none: the policy's map
        self.precision.load_state_dict(state.get("precision"))
        self.downstream.load_state_dict(state.get("evaluation"))
        if self.anomaly is not None:  # its window, so a resumed run triggers as one that was not
            self.anomaly.load_state_dict(state.get("anomaly"))

    @property
    def consumed_tokens(self) -> int:
        return self.step * self.tokens_per_step

    def save(self) -> None:
        finite = all_finite(list(self.core.parameters()), self.ctx.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank must agree to write
        if not finite.item():  # the one host sync of the check
            log.error("not writing a checkpoint: the weights contain NaN/Inf")
            return
        self.precision.input_amax.all_reduce()  # every rank's linears and batches, for rank 0
        # The file system's refusal (disk full, quota, read-only) is CheckpointNotWritten: exit 8.
        path = ckpt.save_checkpoint(
            self.ckpt_root, self.step, self.ctx, model=self.core, optimizer=self.optimizer,
            optimizer_format=self.optimizer_format, optimizer_layout=self.checkpoint_layout,
            spec=self.built.spec,
            trainer_state=self.state_dict(), keep_last=self.cfg.trainer.keep_last,
            skipped_since_previous=self.skipped_steps - self.skipped_at_last_save)
        self.skipped_at_last_save = self.skipped_steps
        log.info(f"saved checkpoint {path}")

    def resume(self) -> None:
        """Continue from the newest intact checkpoint. Refused: none usable, or one that would
        run code (exit 6), or one written for another model (exit 2)."""
        path = ckpt.find_resume_checkpoint(self.ckpt_root, self.ctx)
        if path is None:
            return
        state = ckpt.load_checkpoint(path, self.ctx, self.core, self.optimizer,
                                     self.optimizer_format, spec=self.built.spec)
        self.load_state_dict(state["trainer"])
        self.resumed_from = path
        if state["resharded"]:
            t, p, e, w = state["layout"]
            log.info(f"resharded from tensor {t} x pipeline {p} x expert {e} ({w} processes) to "
                     f"tensor {self.ctx.tensor} x pipeline {self.ctx.pipeline} x expert "
                     f"{self.ctx.expert} ({self.ctx.world_size})")
        log.info(f"resumed from {path} at step {self.step}")
        if self.precision.switched_formats():
            log.info(f"precision map (with the run's fallbacks): {self.precision.describe_map()}")

    # -- one step ---------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict],
                   sink: Optional[MetricsSink] = None) -> StepResult:
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for name, fields in self.precision.before_step(self.step):
            if sink is not None:
                sink.event(self.step, name, **fields)
        self.grad_health.begin_step()
        # on_anomaly=replay re-runs this step from the RNG state its rounding draws from, under
        # the precision map it ran with (an adaptive decision after it switches linears)
        if self.anomaly is not None:
            rng, step_map = capture_rng(self.ctx), self.precision.current_formats()
        # Forward, backward and the data-parallel gradient sync (megatron's finalize_model_grads).
        total = run_micro_batches(self.model, micro_batches, self.ctx, self.activation_shape,
                                  gemm=self.gemm)
        precision_metrics = self.precision.after_step(self.step)
        # The adaptive fallback decides on this step's telemetry (reduced over the ranks, so
        # every rank the same) and switches from the next step on.
        for name, fields in self.precision.decide(self.step + 1):
            if sink is not None:
                sink.event(self.step + 1, name, **fields)
        # the stop flag rides in the loss's reduction: no collective or host sync of its own
        loss, stop = step_loss_and_stop(total, self.stop.requested, self.ctx)
        # Per-layer gradient health when due: the synced main grads, before clipping scales them.
        health = self.grad_health.collect() if self.grad_health.due(self.step + 1) else None
        # megatron's optimizer.step(), split so that a non-finite norm can skip the update.
        self.optimizer.prepare_grads()
        clip = self.cfg.trainer.grad_clip
        grad_norm = float(self.optimizer.clip_grad_norm(clip) if clip > 0
                          else self.optimizer.get_grad_norm())
        lr = self.optimizer.param_groups[0]["lr"]
        if self.anomaly is not None:  # before the update: the weights are the step's own
            why = self.anomaly.check(loss, grad_norm)
            if why is not None:
                self._on_anomaly(why, micro_batches, rng, step_map, sink)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # (Collected after clipping, its non-finite counts hold; its norms may not.)
            stats = health or self.grad_health.collect()
            where = self._report_nonfinite(stats, loss, sink)
            if self.cfg.trainer.on_nan == "stop":
                raise ProjectError(
                    f"loss {loss} / grad-norm {grad_norm} at step {self.step + 1} is not finite "
                    f"({where}); stopping without a checkpoint (trainer.on_nan=skip skips such "
                    "steps)", ExitCode.DIVERGED)
            self.skipped_steps += 1
            self.consecutive_skips += 1
            limit = self.cfg.trainer.max_consecutive_skips
            if self.consecutive_skips >= limit:
                raise ProjectError(
                    f"loss {loss} / grad-norm {grad_norm} at step {self.step + 1} is not finite, "
                    f"{self.consecutive_skips} steps in a row (trainer.max_consecutive_skips="
                    f"{limit}): the run diverged; stopping without a checkpoint (the newest clean "
                    "one is kept)", ExitCode.DIVERGED)
            self.optimizer.zero_grad()
            self.scheduler.step()
            return StepResult(loss, grad_norm, lr, skipped=True,
                              health=stats.metrics(norms=health is not None),
                              precision=precision_metrics, stop=stop)
        self.consecutive_skips = 0
        self.optimizer.step_with_ready_grads()
        self.scheduler.step()
        return StepResult(loss, grad_norm, lr, skipped=False,
                          health=health.metrics() if health else {}, precision=precision_metrics,
                          stop=stop)

    @cached_property
    def grad_health(self) -> GradHealth:
        """Per-layer gradient statistics and the input-gradient hooks (training/grad_health.py)."""
        return GradHealth(self.core, self.model, self.optimizer, self.cfg.model.layer_kinds(),
                          self.ctx.device, due=Every(self.cfg.trainer.grad_health_every))

    def _report_nonfinite(self, stats, loss: float, sink: Optional[MetricsSink]) -> str:
        """Name the first layer, in backward order, whose gradients went non-finite."""
        first = stats.first_nonfinite()
        if sink is not None:
            # The step's own record carries its loss and grad norm (one "loss" per step).
            sink.event(self.step + 1, "nonfinite", first_layer=first,
                       nonfinite_layers=len(stats.nonfinite_groups()))
        if first is None:
            return "no gradient element is non-finite: the norm overflowed"
        return (f"first non-finite gradient in backward order: {first}"
                + ("; the loss itself is not finite: the forward pass went non-finite"
                   if not math.isfinite(loss) else ""))

    def _on_anomaly(self, why: str, micro_batches: list[dict], rng: dict, step_map: dict,
                    sink: Optional[MetricsSink]) -> None:
        """trainer.on_anomaly=replay: bisect this step's precision in process, from its weights
        (not yet updated), batch and RNG state; the bisect ends by computing the step as it ran
        once more, so the update that follows is the one the step would have made."""
        tr, step = self.cfg.trainer, self.step + 1
        log.warning(f"anomaly at step {step}: {why}; bisecting its precision "
                    "(trainer.on_anomaly=replay)")
        found = bisect(self, micro_batches, rng, step, step_map,
                       Thresholds(tr.anomaly_loss_threshold, tr.anomaly_grad_norm_threshold),
                       log=log.info)
        path = self.run_dir / "replay" / f"step-{step}" / "replay.json"
        if self.ctx.is_main:
            write_replay_json(path, {"run_dir": str(self.run_dir), "step": step,
                                     "trigger": why, "in_process": True,
                                     "bisect": found.to_json()})
            log.info(render(bisect_table(found)))
        if sink is not None:
            sink.event(step, "anomaly", trigger=why, action=str(tr.anomaly_action),
                       culprits=[f"{m}/{p}" for m, p in found.culprits], replay=str(path))
        self.anomaly_at = step

    def _downstream_lm(self):
        """lm-eval's model over this trainer's model (training/lm_eval_model.py)."""
        # deferred: lm-eval is optional and costly to import; only a run with evaluation.tasks
        # gets here, after the start-up's prepare_tasks refused its absence (exit 3)
        from .lm_eval_model import ProjectLM

        return ProjectLM(self.model, run_tokenizer(self.cfg.data), self.ctx,
                         hidden_size=self.cfg.model.hidden_size,
                         # as tools.evaluate: the same scores in the loop and afterwards
                         max_length=self.cfg.model.max_sequence_length,
                         vocab_size=self.cfg.model.vocab_size,
                         batch_size=self.cfg.evaluation.batch_size, gemm=self.gemm,
                         before=self.precision.before_evaluation)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> int:
        cfg, tr = self.cfg, self.cfg.trainer
        if self.stop.agreed(self.ctx):  # preempted while starting: nothing new to save
            log.warning("stopped before the first step; resume by running again")
            return ExitCode.PREEMPTED
        set_aside = None
        if cfg.run.resume == "auto":
            self.resume()
        elif cfg.run.resume == "restart":  # an explicit fresh start: old checkpoints kept aside
            set_aside = ckpt.set_aside_for_restart(self.ckpt_root, self.ctx)
        wandb_run = None
        if self.ctx.is_main:
            wandb_run = start_wandb(
                self.run_dir, cfg.logger.mode, cfg.logger.project, cfg.logger.entity,
                cfg.run.name, cfg.logger.tags,
                OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True), self.wandb_id)
            self.wandb_id = wandb_run.id if wandb_run is not None else None
        sink = MetricsSink(self.run_dir, self.ctx.is_main, wandb_run)
        if cfg.run.resume == "restart":  # metrics.jsonl: the steps that follow start over
            sink.event(0, "restart", set_aside=str(set_aside) if set_aside else None)
        if self.resumed_from is not None:  # the steps after it may be logged a second time
            sink.event(self.step, "resume", checkpoint=self.resumed_from.name)
        self.downstream.resume_pending(self.ctx, sink)  # an evaluation a kill interrupted
        if self.step >= tr.max_steps:
            log.info(f"run already complete ({self.step}/{tr.max_steps} steps)")
        start_step, t_start = self.step, time.perf_counter()
        try:
            while self.step < tr.max_steps:
                t0 = time.perf_counter()
                result = self.train_step(self.data.train.next_global_batch(), sink)
                self.step += 1
                metrics = self._step_metrics(result, time.perf_counter() - t0)
                if self.validator.due(self.step):
                    metrics["val_loss"] = self.validator.loss()
                elapsed = time.perf_counter() - t_start
                self._report(metrics, result,
                             eta=elapsed / (self.step - start_step) * (tr.max_steps - self.step))
                sink.log(self.step, metrics)
                anomaly, self.anomaly_at = self.anomaly_at, None
                if self._after_step(sink, result.stop, anomaly is not None):
                    sink.event(self.step, "preempted", signal=self.stop.name or "peer")
                    return ExitCode.PREEMPTED
                if anomaly is not None and tr.anomaly_action == "stop":
                    log.error(f"error: stopped after the anomaly at step {anomaly} "
                              "(trainer.anomaly_action=stop); its bisect is in "
                              f"{self.run_dir / 'replay' / f'step-{anomaly}'}, and "
                              f"{ckpt.step_dir_name(anomaly)} resumes the run")
                    return ExitCode.DIVERGED
        finally:
            sink.close()
        return ExitCode.OK

    def _step_metrics(self, result: StepResult, seconds: float) -> dict:
        return {"consumed_tokens": self.consumed_tokens, "loss": result.loss, "lr": result.lr,
                "grad_norm": result.grad_norm, "tokens_per_sec": self.tokens_per_step / seconds,
                "skipped_steps": self.skipped_steps, **self.data.train.metrics(),
                **result.health, **result.precision,
                # MoE layers: tokens per expert, imbalance, aux loss, expert bias (model/moe.py)
                **take_expert_load(self.moe_routers, self.micro_batches,
                                   routing_group(self.cfg.parallel.sequence))}

    def _report(self, metrics: dict, result: StepResult, eta: float) -> None:
        """The console: one status line per `trainer.log_every` steps and with each validation,
        and the diagnostics / gradient-health lines of the steps that measured them."""
        if any(key.startswith("quant/") for key in result.precision):
            log.info(diagnostics_summary(result.precision))
        if result.health:
            log.info(grad_health_line(result.health))
        if self.status_due(self.step) or "val_loss" in metrics:
            log.info(status_line(self.step, self.cfg.trainer.max_steps, metrics, eta))
        if "val_loss" in metrics:
            log.info(data_line(metrics))
            line = expert_load_line(metrics)
            if line:
                log.info(line)

    def _after_step(self, sink: MetricsSink, stop: bool, anomaly: bool = False) -> bool:
        """Checkpoint and downstream evaluation when due, or when a stop signal came (`stop`:
        agreed in the step's loss reduction) or on_anomaly bisected the step (`anomaly`); True
        to stop (preempted: everything up to this step is in the checkpoint)."""
        evaluate = self.downstream.begin_if_due(self.step)  # its step's checkpoint comes first
        if stop or evaluate or anomaly or self.save_due(self.step):
            self.save()
            # a signal that came during this save: stop now, not after another step and a
            # second checkpoint (the grace period is short at scale)
            stop = stop or (self.step < self.cfg.trainer.max_steps and self.stop.agreed(self.ctx))
        if evaluate and not stop:  # preempted: the checkpoint holds it as pending
            self.downstream.run(self.step, sink)
            stop = self.stop.agreed(self.ctx)
        return stop


def all_finite(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (a 0-dim float tensor on `device`) if every element of every tensor is finite, else
    0.0; computed on the device without a host sync (the caller reads it once)."""
    if not tensors:
        return torch.ones((), device=device)
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all().float()


def prepare_run_dir(cfg: TrainConfig, ctx: ParallelContext) -> Path:
    """run.dir checked, locked and its config.yaml written (training/run_dir.py), after this
    run's own refusals that must come before anything is written: a model.vocab_size smaller
    than the tokenizer's, W&B online without a key or a server."""
    def refusals() -> None:
        _check_vocab(cfg)
        if cfg.logger.mode == "online":
            check_wandb_online()

    return run_dir_lib.prepare_run_dir(
        Path(cfg.run.dir), ctx.is_main, resume=cfg.run.resume,
        config_text=OmegaConf.to_yaml(OmegaConf.structured(cfg)), refusals=refusals)


def _tokenizer_vocab_size(cfg: TrainConfig) -> tuple[int, str]:
    """The size of the run's tokenizer and where it is (rank 0; the demo corpus, whose tokenizer
    it is, is built into data.cache_dir first if it is not there yet, as build_data would)."""
    path = cfg.data.tokenizer
    if path is None:
        cache_dir = os.path.abspath(os.path.expanduser(cfg.data.cache_dir))
        path = ensure_demo_corpus(cache_dir, cfg.data.demo, show_progress=True).tokenizer_path
    try:
        return load_tokenizer_spec(path).tokenizer.get_vocab_size(), path
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise ConfigError(f"data.tokenizer = {path!r}: cannot load it: {exc}") from None


def _check_vocab(cfg: TrainConfig) -> None:
    """model.vocab_size, padded as the model pads it, must hold every id the tokenizer gives
    (else an IndexError at step 1 on a CPU, a device assert on a GPU)."""
    if cfg.model.vocab_size is None:
        return
    size, where = _tokenizer_vocab_size(cfg)
    padded = padded_vocab_size(cfg.model.vocab_size, cfg.model.vocab_multiple,
                               cfg.parallel.tensor)
    if padded < size:
        raise ProjectError(
            f"model.vocab_size={cfg.model.vocab_size} (padded to {padded}) is smaller than the "
            f"tokenizer's vocabulary of {size} tokens ({where}): ids up to {size - 1} would "
            f"index past the embedding; set model.vocab_size >= {size}, or null for the "
            "tokenizer's own", ExitCode.CONFIG)
