"""The training loop: build everything from the config, step, evaluate, checkpoint, resume."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from compat import seed_model_parallel_rng
from data import MissingDataError, build_data
from model.build import build_model, choose_backend
from nvfp4_recipe.megatron.controller import PrecisionController, diagnostics_summary
from nvfp4_recipe.megatron.te_runtime import check_te_switch

from . import checkpoint as ckpt
from .config import TrainConfig, recompute_config, validate
from .downstream import DownstreamEvaluator
from .distributed import ParallelContext, init_distributed, shutdown, stochastic_rounding_seed
from .grad_health import GradHealth
from .metrics import (MetricsSink, WandbUnavailable, check_wandb_online, data_line,
                      grad_health_line, render, setup_logging, start_wandb, status_line)
from .ddp_optimizer import (PARAMS_DTYPE, build_data_parallel_model,
                              optimizer_checkpoint_format, optimizer_state_bytes,
                              uses_megatron_ddp)
from .lr_schedule import WSDScheduler
from .schedules import run_micro_batches
from .preflight import run_preflight
from .run_dir import (RunDirBusy, UnsafeFile, create_run_file, lock_run_dir, read_run_file,
                      release_run_dir, remove_stale_checkpoint_temporaries)

log = logging.getLogger("nvfp4_pretrain")


class ExitCode:
    """Process exit codes (documented in the README)."""

    OK = 0
    CONFIG = 2  # an invalid value or combination of values
    MISSING_DATA = 3  # a data path that does not exist
    DIVERGED = 4  # NaN/Inf loss with on_nan=stop, or max_consecutive_skips with on_nan=skip
    RUN_DIR_IN_USE = 5  # run.resume=never and run.dir holds a run, or another trainer holds it
    NO_USABLE_CHECKPOINT = 6  # run.dir holds checkpoints and none can be resumed from
    # run.dir (or data.cache_dir) cannot be created or written, a checkpoint cannot be written
    # (disk full), or a file the run writes there is a link or another user's (UnsafeFile)
    RUN_DIR_UNWRITABLE = 8
    WANDB_UNAVAILABLE = 9  # logger.mode=online without an API key or an answering server
    PREEMPTED = 75  # SIGTERM/SIGUSR1/first SIGINT: checkpointed, resumable (EX_TEMPFAIL)
    INTERRUPTED = 130  # a second SIGINT (Ctrl-C): stopped at once, no checkpoint


class TrainingError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopSignal:
    """SIGTERM/SIGUSR1 (preemption) or a first SIGINT (Ctrl-C) recorded, to be acted on at the
    end of the current step; a second SIGINT raises KeyboardInterrupt at once (exit 130).

    Installed first thing in `run()`, so a signal during start-up is not fatal either.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.name: Optional[str] = None
        self.interrupted = False  # a SIGINT arrived: the next one stops at once
        self.previous = {sig: signal.signal(sig, self._record) for sig in self.SIGNALS}

    def restore(self) -> None:
        """The handlers from before (for a caller that goes on after `run()`)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _record(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt
            self.interrupted = True
        self.name = signal.Signals(signum).name
        log.warning(f"{self.name} received: finishing this step, then checkpointing"
                    + (" (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""))

    def agreed(self, ctx: ParallelContext) -> bool:
        """Whether any rank was signalled: all ranks must stop at the same step."""
        flag = torch.tensor(float(self.name is not None), device=ctx.device)
        if ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float  # the learning rate this step used
    skipped: bool
    health: dict[str, float] = field(default_factory=dict)  # grad/<layer>/... when measured
    precision: dict[str, float] = field(default_factory=dict)  # quant/<layer>/... when measured


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, stop: Optional[StopSignal] = None,
                 preflight=None):
        """`preflight`: run()'s run_preflight result, so start-up checks the GEMMs once."""
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
            cuda=ctx.hardware.cuda, main_grads=uses_megatron_ddp(ctx.device),
        )
        # What flows between pipeline stages: [sequence, micro-batch, hidden] activations.
        self.activation_shape = (tr.seq_length, tr.micro_batch_size, cfg.model.hidden_size)
        self.core = self.built.module.to(ctx.device)  # the unwrapped megatron model
        if cfg.model.init_from:  # a NemotronH directory's or a run's weights, before the optimizer
            from model.hf import load_hf_weights  # copies them (a resume below still wins)

            from .init_from import is_run_dir, load_run_weights

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
        self.precision = PrecisionController(cfg.precision, self.built, self.tokens_per_step,
                                             self.total_tokens)
        # Each rank draws its own stochastic-rounding stream (saved with its checkpoint).
        torch.manual_seed(stochastic_rounding_seed(tr.seed, ctx))

        self.step = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0  # skipped steps in a row, up to trainer.max_consecutive_skips
        self.skipped_at_last_save = 0  # skipped_steps when the previous checkpoint was written
        self.wandb_id: Optional[str] = None
        self.resumed_from: Optional[Path] = None  # the checkpoint resume() loaded
        self.val_batches = self.data.validation_batches(tr.eval_batches)
        self.downstream = DownstreamEvaluator(cfg.evaluation, tr.max_steps, self._downstream_lm,
                                              self.run_dir, ctx.is_main)
        for line in self.precision.describe(backend, reason, ctx.device):
            log.info(line)
        log.info(f"device: {ctx.hardware.describe()}; {self.gemm.describe()}")
        log.info(f"model paths: {self.built.paths}")
        if self.precision.quantizes:
            for line in (preflight or run_preflight(cfg, backend, ctx.hardware)).summary():
                log.info(line)
        log.info(render(self.data.train.describe_schedule()))
        log.info(f"parallel: world {ctx.world_size} = tensor {ctx.tensor} x pipeline "
                 f"{ctx.pipeline} x data {ctx.data}; {self.micro_batches} micro-batches/step")
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
                "evaluation": self.downstream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.train.load_state_dict(state["data"])
        self.step, self.wandb_id = state["step"], state["wandb_id"]
        self.skipped_steps = self.skipped_at_last_save = state["skipped_steps"]
        # checkpoints written before max_consecutive_skips existed have no such counter
        self.consecutive_skips = state.get("consecutive_skips", 0)
        if "input_amax" in state:  # checkpoints written before it existed start an empty window
            self.precision.input_amax.load_state_dict(state["input_amax"])
        self.downstream.load_state_dict(state.get("evaluation"))

    @property
    def consumed_tokens(self) -> int:
        return self.step * self.tokens_per_step

    def save(self) -> None:
        finite = torch.tensor(float(all(torch.isfinite(p).all() for p in self.core.parameters())),
                              device=self.ctx.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank must agree to write
        if not finite.item():
            log.error("not writing a checkpoint: the weights contain NaN/Inf")
            return
        self.precision.input_amax.all_reduce()  # every rank's linears and batches, for rank 0
        try:
            path = ckpt.save_checkpoint(
                self.ckpt_root, self.step, self.ctx, model=self.core, optimizer=self.optimizer,
                optimizer_format=self.optimizer_format, optimizer_layout=self.checkpoint_layout,
                spec=self.built.spec,
                trainer_state=self.state_dict(), keep_last=self.cfg.trainer.keep_last,
                skipped_since_previous=self.skipped_steps - self.skipped_at_last_save)
        except ckpt.CheckpointNotWritten as exc:  # disk full, quota, read-only
            raise TrainingError(str(exc), ExitCode.RUN_DIR_UNWRITABLE) from None
        self.skipped_at_last_save = self.skipped_steps
        log.info(f"saved checkpoint {path}")

    def resume(self) -> None:
        """Continue from the newest intact checkpoint; refuse (exit 6) when none is usable."""
        try:
            path = ckpt.find_resume_checkpoint(self.ckpt_root, self.ctx)
            if path is None:
                return
            state = ckpt.load_checkpoint(path, self.ctx, self.core, self.optimizer,
                                         self.optimizer_format, spec=self.built.spec)
        except (ckpt.NoUsableCheckpoint, ckpt.CheckpointRefused) as exc:
            raise TrainingError(str(exc), ExitCode.NO_USABLE_CHECKPOINT) from None
        except ckpt.CheckpointMismatch as exc:
            raise TrainingError(str(exc), ExitCode.CONFIG) from None
        self.load_state_dict(state["trainer"])
        self.resumed_from = path
        if state["resharded"]:
            t, p, w = state["layout"]
            log.info(f"resharded from tensor {t} x pipeline {p} ({w} processes) to tensor "
                     f"{self.ctx.tensor} x pipeline {self.ctx.pipeline} ({self.ctx.world_size})")
        log.info(f"resumed from {path} at step {self.step}")

    # -- one step ---------------------------------------------------------------------------
    def _all_reduce_mean(self, t: torch.Tensor, group) -> torch.Tensor:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
            t /= dist.get_world_size(group)
        return t

    def train_step(self, micro_batches: list[dict],
                   sink: Optional[MetricsSink] = None) -> StepResult:
        from megatron.core import parallel_state

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for name, fields in self.precision.before_step(self.step):
            if sink is not None:
                sink.event(self.step, name, **fields)
        self.grad_health.begin_step()
        # Forward, backward and the data-parallel gradient sync (megatron's finalize_model_grads).
        total = run_micro_batches(self.model, micro_batches, self.ctx, self.activation_shape,
                                  gemm=self.gemm)
        precision_metrics = self.precision.after_step(self.step)
        loss = self._all_reduce_mean(total, parallel_state.get_data_parallel_group()).item()
        # Per-layer gradient health when due: the synced main grads, before clipping scales them.
        health = self.grad_health.collect() if self._grad_health_due() else None
        # megatron's optimizer.step(), split so that a non-finite norm can skip the update.
        self.optimizer.prepare_grads()
        clip = self.cfg.trainer.grad_clip
        grad_norm = float(self.optimizer.clip_grad_norm(clip) if clip > 0
                          else self.optimizer.get_grad_norm())
        lr = self.optimizer.param_groups[0]["lr"]
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # (Collected after clipping, its non-finite counts hold; its norms may not.)
            stats = health or self.grad_health.collect()
            where = self._report_nonfinite(stats, loss, sink)
            if self.cfg.trainer.on_nan == "stop":
                raise TrainingError(
                    f"loss {loss} / grad-norm {grad_norm} at step {self.step + 1} is not finite "
                    f"({where}); stopping without a checkpoint (trainer.on_nan=skip skips such "
                    "steps)", ExitCode.DIVERGED)
            self.skipped_steps += 1
            self.consecutive_skips += 1
            limit = self.cfg.trainer.max_consecutive_skips
            if self.consecutive_skips >= limit:
                raise TrainingError(
                    f"loss {loss} / grad-norm {grad_norm} at step {self.step + 1} is not finite, "
                    f"{self.consecutive_skips} steps in a row (trainer.max_consecutive_skips="
                    f"{limit}): the run diverged; stopping without a checkpoint (the newest clean "
                    "one is kept)", ExitCode.DIVERGED)
            self.optimizer.zero_grad()
            self.scheduler.step()
            return StepResult(loss, grad_norm, lr, skipped=True,
                              health=stats.metrics(norms=health is not None),
                              precision=precision_metrics)
        self.consecutive_skips = 0
        self.optimizer.step_with_ready_grads()
        self.scheduler.step()
        return StepResult(loss, grad_norm, lr, skipped=False,
                          health=health.metrics() if health else {}, precision=precision_metrics)

    @cached_property
    def grad_health(self) -> GradHealth:
        """Per-layer gradient statistics and the input-gradient hooks (training/grad_health.py)."""
        return GradHealth(self.core, self.model, self.optimizer, self.cfg.model.layer_kinds(),
                          self.ctx.device)

    def _grad_health_due(self) -> bool:
        every = self.cfg.trainer.grad_health_every
        return every > 0 and (self.step + 1) % every == 0

    def _report_nonfinite(self, stats, loss: float, sink: Optional[MetricsSink]) -> str:
        """Name the first layer, in backward order, whose gradients went non-finite."""
        groups = stats.nonfinite_groups()
        first = groups[0] if groups else None
        if sink is not None:
            # The step's own record carries its loss and grad norm (one "loss" per step).
            sink.event(self.step + 1, "nonfinite", first_layer=first,
                       nonfinite_layers=len(groups))
        if first is None:
            return "no gradient element is non-finite: the norm overflowed"
        return (f"first non-finite gradient in backward order: {first}"
                + ("; the loss itself is not finite: the forward pass went non-finite"
                   if not math.isfinite(loss) else ""))

    @torch.no_grad()
    def evaluate(self) -> float:
        from megatron.core import parallel_state

        self.model.eval()
        self.precision.before_evaluation()
        loss = run_micro_batches(self.model, self.val_batches, self.ctx, self.activation_shape,
                                 forward_only=True, gemm=self.gemm)
        return self._all_reduce_mean(loss, parallel_state.get_data_parallel_group()).item()

    def _downstream_lm(self):
        """lm-eval's model over this trainer's model (training/lm_eval_model.py)."""
        from .downstream import run_tokenizer
        from .lm_eval_model import ProjectLM

        return ProjectLM(self.model, run_tokenizer(self.cfg.data), self.ctx,
                         hidden_size=self.cfg.model.hidden_size,
                         max_length=self.cfg.trainer.seq_length,
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
                micro_batches = self.data.train.next_global_batch()
                result = self.train_step(micro_batches, sink)
                self.step += 1
                dt = time.perf_counter() - t0
                metrics = {"consumed_tokens": self.consumed_tokens, "loss": result.loss,
                           "lr": result.lr, "grad_norm": result.grad_norm,
                           "tokens_per_sec": self.tokens_per_step / dt,
                           "skipped_steps": self.skipped_steps,
                           **self.data.train.metrics(), **result.health}
                if self.step % tr.eval_every == 0 or self.step == tr.max_steps:
                    metrics["val_loss"] = self.evaluate()
                if result.precision:
                    metrics.update(result.precision)
                    log.info(diagnostics_summary(result.precision))
                if result.health:
                    log.info(grad_health_line(result.health))
                elapsed = time.perf_counter() - t_start
                eta = elapsed / (self.step - start_step) * (tr.max_steps - self.step)
                if self.step % tr.log_every == 0 or "val_loss" in metrics:
                    log.info(status_line(self.step, tr.max_steps, metrics, eta))
                if "val_loss" in metrics:
                    log.info(data_line(metrics))
                sink.log(self.step, metrics)
                stop = self.stop.agreed(self.ctx)
                evaluate = self.downstream.due(self.step)  # its step's checkpoint comes first
                if (stop or evaluate or self.step % tr.save_every == 0
                        or self.step == tr.max_steps):
                    self.save()
                    # a signal that came during this save: stop now, not after another step
                    # and a second checkpoint (the grace period is short at scale)
                    stop = stop or (self.step < tr.max_steps and self.stop.agreed(self.ctx))
                if evaluate and not stop:  # preempted: the checkpoint holds it as pending
                    self.downstream.run(self.step, sink)
                    stop = self.stop.agreed(self.ctx)
                if stop:
                    sink.event(self.step, "preempted", signal=self.stop.name or "peer")
                    return ExitCode.PREEMPTED
        finally:
            sink.close()
        return ExitCode.OK


def prepare_run_dir(cfg: TrainConfig, ctx: ParallelContext) -> Path:
    """Rank 0 checks, locks run.dir and writes config.yaml once; every rank gets the outcome.

    Nothing is written before the checks that can refuse the run (a model.vocab_size smaller
    than the tokenizer's, run.resume=never on a run, W&B online without a key or server); then
    run.dir/.lock is taken (training/run_dir.py) before anything else is written, and a second
    trainer on the same run.dir is turned away.
    """
    run_dir = Path(cfg.run.dir)
    refusal = None
    if ctx.is_main:
        try:
            _prepare_on_main(cfg, run_dir)
        except TrainingError as exc:
            refusal = (str(exc), exc.code)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)  # every rank stops with rank 0's code
        refusal = box[0]
    if refusal is not None:
        raise TrainingError(*refusal)
    return run_dir


def _holds_a_run(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()


def _tokenizer_vocab_size(cfg: TrainConfig) -> tuple[int, str]:
    """The size of the run's tokenizer and where it is (rank 0; the demo corpus, whose tokenizer
    it is, is built into data.cache_dir first if it is not there yet, as build_data would)."""
    from data.tokenizer import load_tokenizer_spec

    path = cfg.data.tokenizer
    if path is None:
        from data.demo import ensure_demo_corpus

        cache_dir = os.path.abspath(os.path.expanduser(cfg.data.cache_dir))
        path = ensure_demo_corpus(cache_dir, cfg.data.demo, show_progress=True).tokenizer_path
    try:
        return load_tokenizer_spec(path).tokenizer.get_vocab_size(), path
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise TrainingError(f"data.tokenizer = {path!r}: cannot load it: {exc}",
                            ExitCode.CONFIG) from None


def _check_vocab(cfg: TrainConfig) -> None:
    """model.vocab_size, padded as the model pads it, must hold every id the tokenizer gives
    (else an IndexError at step 1 on a CPU, a device assert on a GPU)."""
    if cfg.model.vocab_size is None:
        return
    from model.build import padded_vocab_size

    size, where = _tokenizer_vocab_size(cfg)
    padded = padded_vocab_size(cfg.model.vocab_size, cfg.model.vocab_multiple,
                               cfg.parallel.tensor)
    if padded < size:
        raise TrainingError(
            f"model.vocab_size={cfg.model.vocab_size} (padded to {padded}) is smaller than the "
            f"tokenizer's vocabulary of {size} tokens ({where}): ids up to {size - 1} would "
            f"index past the embedding; set model.vocab_size >= {size}, or null for the "
            "tokenizer's own", ExitCode.CONFIG)


def _prepare_on_main(cfg: TrainConfig, run_dir: Path) -> None:
    _check_vocab(cfg)
    never = (f"run.dir={run_dir} already holds a run and run.resume=never; choose another "
             "run.dir or set run.resume=auto to continue it")
    if cfg.run.resume == "never" and _holds_a_run(run_dir):
        raise TrainingError(never, ExitCode.RUN_DIR_IN_USE)
    if cfg.logger.mode == "online":
        try:
            check_wandb_online()
        except WandbUnavailable as exc:
            raise TrainingError(str(exc), ExitCode.WANDB_UNAVAILABLE) from None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        locked = lock_run_dir(run_dir)
    except RunDirBusy as exc:
        raise TrainingError(
            f"run.dir={run_dir} is in use by another trainer: {exc}; wait for it to end or stop "
            "it (its lock goes with the process), or choose another run.dir",
            ExitCode.RUN_DIR_IN_USE) from None
    except UnsafeFile as exc:
        raise TrainingError(f"run.dir={run_dir}: {exc}", ExitCode.RUN_DIR_UNWRITABLE) from None
    except OSError as exc:
        raise TrainingError(_unwritable_message("run.dir", run_dir, exc),
                            ExitCode.RUN_DIR_UNWRITABLE) from None
    if not locked:
        log.warning(f"run.dir={run_dir}: the file system does not support locks; nothing "
                    "stops a second trainer from writing into this run directory")
    if cfg.run.resume == "never" and _holds_a_run(run_dir):  # a run that ended meanwhile
        raise TrainingError(never, ExitCode.RUN_DIR_IN_USE)
    if locked:  # no other writer: a temporary checkpoint here belongs to a dead one
        for name in remove_stale_checkpoint_temporaries(run_dir / "checkpoints"):
            log.warning(f"removed {run_dir / 'checkpoints' / name}: an unfinished checkpoint "
                        "of a process that died")
    config_path = run_dir / "config.yaml"
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    try:  # created, never written through an existing name (a link included)
        if not os.path.lexists(config_path):
            create_run_file(config_path, text)
        elif read_run_file(config_path) != text:  # a resume with another config: keep both
            n = 1
            while os.path.lexists(run_dir / f"config.resume-{n}.yaml"):
                n += 1
            create_run_file(run_dir / f"config.resume-{n}.yaml", text)
    except UnsafeFile as exc:
        raise TrainingError(f"run.dir={run_dir}: {exc}", ExitCode.RUN_DIR_UNWRITABLE) from None
    except OSError as exc:
        raise TrainingError(_unwritable_message("run.dir", run_dir, exc),
                            ExitCode.RUN_DIR_UNWRITABLE) from None


def _unwritable_message(key: str, directory, exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return (f"{key}={directory} cannot be written: {exc.strerror or exc}{where}; it must be a "
            "writable directory (or a path where one can be created)")


def _unwritable_key(exc: OSError, cfg) -> Optional[tuple[str, str]]:
    """(key, directory) when an OSError concerns run.dir or data.cache_dir, else None."""
    if not exc.filename:
        return None
    path = os.path.abspath(os.fsdecode(exc.filename))
    for key, directory in (("run.dir", cfg.run.dir), ("data.cache_dir", cfg.data.cache_dir)):
        root = os.path.abspath(str(directory))
        if path == root or path.startswith(root + os.sep):
            return key, str(directory)
    return None


def run(cfg) -> int:
    """Entry point behind train.py: returns the process exit code."""
    ctx = None
    stop = StopSignal()
    try:
        cfg: TrainConfig = OmegaConf.to_object(cfg)
        if cfg.run.dry_run:  # plans the configured layout from one process, on the meta device
            from .plan import dry_run, plan_world_size

            ctx = init_distributed(1, 1, cfg.parallel.backend)
            validate(cfg, plan_world_size(cfg))
            return dry_run(cfg, ctx)
        ctx = init_distributed(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.backend)
        validate(cfg, ctx.world_size)  # every group, data files included: before anything is written
        backend = choose_backend(cfg.precision, cfg.model.spec, ctx.hardware)[0]
        ctx.hardware.gemm_compute(cfg.precision.gemm_compute)  # refuses fp32 on a GPU (exit 2)
        if backend == "te":
            switch = cfg.precision.switch_to_bf16
            check_te_switch(switch.passes, switch.at_fraction)
        preflight = run_preflight(cfg, backend, ctx.hardware)
        refusal = preflight.refusal()  # also: an override matching nothing
        if refusal:
            raise ValueError(refusal)
        if cfg.evaluation.tasks:  # an unknown task (exit 2), a dataset not here offline (3)
            from .downstream import TaskUnavailable, UnknownTask, prepare_tasks

            try:
                prepare_tasks(list(cfg.evaluation.tasks))
            except UnknownTask as exc:
                raise TrainingError(str(exc), ExitCode.CONFIG) from None
            except TaskUnavailable as exc:
                raise TrainingError(str(exc), ExitCode.MISSING_DATA) from None
        run_dir = prepare_run_dir(cfg, ctx)
        setup_logging(run_dir, ctx.is_main)
        return Trainer(cfg, ctx, stop, preflight).fit()
    except TrainingError as exc:
        log.error(f"error: {exc}")
        return exc.code
    except MissingDataError as exc:  # only the data's own check: never any FileNotFoundError
        log.error(f"error: {exc}")
        return ExitCode.MISSING_DATA
    except WandbUnavailable as exc:
        log.error(f"error: {exc}")
        return ExitCode.WANDB_UNAVAILABLE
    except UnsafeFile as exc:  # metrics.jsonl, train.log planted as a link
        log.error(f"error: run.dir={cfg.run.dir}: {exc}")
        return ExitCode.RUN_DIR_UNWRITABLE
    except KeyboardInterrupt:
        log.error("error: interrupted (a second SIGINT): stopped at once without a checkpoint; "
                  "run again to continue from the last one")
        return ExitCode.INTERRUPTED
    except OSError as exc:
        where = _unwritable_key(exc, cfg)
        if where is None:
            raise
        log.error(f"error: {_unwritable_message(*where, exc)}")
        return ExitCode.RUN_DIR_UNWRITABLE
    except ValueError as exc:
        log.error(f"error: {exc}")
        return ExitCode.CONFIG
    finally:
        if ctx is not None:
            release_run_dir(Path(cfg.run.dir))  # if this process took it
            shutdown()
        stop.restore()
