"""train.py's entry: the start-up checks in the order of their cost, then the Trainer.

A refused start should cost seconds: the config's own checks and those across groups and files
run before megatron-core is imported (~3 s of a 2-core machine's ~6 s start), then the checks
that need the process group and the machine, then the run directory, then training.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

from errors import ConfigError, ExitCode, ProjectError
from nvfp4_recipe.megatron.te_mapping import te_environment_refusal, te_formats

from . import run_dir as run_dir_lib
from .config import TrainConfig, validate
from .distributed import group_joined, init_distributed, launched_world_size, shutdown
from .downstream import prepare_tasks
from .metrics import setup_logging
from .plan import dry_run, plan_world_size
from .preflight import run_preflight
from .run_dir import UnsafeFile, release_run_dir
from .signals import StopSignal

log = logging.getLogger("nvfp4_pretrain")


@contextlib.contextmanager
def _config_errors():
    """Around the calls that check the config and nothing else: a ValueError they raise (the
    recipe's pure rules, which ship without this project's errors, or a dataclass's own
    check) is a config error, exit 2. Everywhere else, the rest of the start-up included (the
    process group, the preflight, the evaluation tasks), a ValueError is a bug and exits 1 with
    its traceback."""
    try:
        yield
    except ProjectError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _start_up(raw):
    """The config checked against itself, the world and the machine, before anything is
    written: (config, parallel context, precision policy, GEMM preflight); the preflight is None
    for a dry run. The policy is built once, by the config's checks, and handed on."""
    with _config_errors():
        cfg: TrainConfig = OmegaConf.to_object(raw)
    if cfg.run.dry_run:  # plans the configured layout from one process, on the meta device
        with _config_errors():
            world = plan_world_size(cfg)
            policy = validate(cfg, world)
        return cfg, init_distributed(1, 1, cfg.parallel.backend), policy, None
    with _config_errors():  # every group, data files included, before anything is written
        policy = validate(cfg, launched_world_size())
    ctx = init_distributed(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.backend,
                           timeout_minutes=cfg.parallel.timeout_minutes,
                           expert_parallel=cfg.parallel.expert_model_parallel_size,
                           expert_tensor_parallel=cfg.parallel.expert_tensor_parallel_size)
    # deferred: model.build imports megatron (~3 s); the checks above refuse a bad config first
    from model.build import choose_backend
    from model.moe import te_moe_refusal

    with _config_errors():  # the config against this machine
        backend = choose_backend(cfg.precision, cfg.model.spec, ctx.hardware)[0]
        ctx.hardware.gemm_compute(cfg.precision.gemm_compute)  # refuses fp32 on a GPU
    if backend == "te":
        refusal = (te_moe_refusal(cfg.model)
                   or te_environment_refusal(os.environ, te_formats(cfg.precision)))
        if refusal:
            raise ConfigError(refusal)
    preflight = run_preflight(cfg, policy, backend, ctx.hardware)
    refusal = preflight.refusal()  # also: an override matching nothing
    if refusal:
        raise ConfigError(refusal)
    if cfg.evaluation.tasks:  # an unknown task (exit 2), a dataset not here offline (3)
        prepare_tasks(list(cfg.evaluation.tasks))
    return cfg, ctx, policy, preflight


def run(raw) -> int:
    """Entry point behind train.py: returns the process exit code (errors.ExitCode).

    A refusal the project foresaw (errors.ProjectError) is one `error:` line and its code; any
    other exception propagates with its traceback (exit 1).
    """
    ctx = None
    stop = StopSignal()
    run_dir = Path(str(raw.run.dir))
    # A start-up refused after joining the process group returns no context: the group this
    # call joined is still left, so the next run in this process (a test's) starts clean.
    joins_group = not group_joined()
    try:
        cfg, ctx, policy, preflight = _start_up(raw)
        if cfg.run.dry_run:
            return dry_run(cfg, ctx, policy)
        from .trainer import Trainer, prepare_run_dir  # deferred: megatron, as in _start_up

        prepare_run_dir(cfg, ctx)
        setup_logging(run_dir, ctx.is_main)
        return Trainer(cfg, ctx, stop, preflight, policy).fit()
    except UnsafeFile as exc:  # metrics.jsonl, train.log planted as a link
        log.error(f"error: run.dir={run_dir}: {exc}")
        return exc.code
    except ProjectError as exc:
        log.error(f"error: {exc}")
        return exc.code
    except KeyboardInterrupt:
        log.error("error: interrupted (a second SIGINT): stopped at once without a checkpoint; "
                  "run again to continue from the last one")
        return ExitCode.INTERRUPTED
    except OSError as exc:  # only an OSError on run.dir or data.cache_dir: the disk's refusal
        where = run_dir_lib.unwritable_key(exc, (("run.dir", raw.run.dir),
                                                     ("data.cache_dir", raw.data.cache_dir)))
        if where is None:
            raise
        log.error(f"error: {run_dir_lib.unwritable_message(*where, exc)}")
        return ExitCode.UNWRITABLE
    finally:
        if ctx is not None:
            release_run_dir(run_dir)  # if this process took it
        if ctx is not None or (joins_group and group_joined()):
            shutdown()
        stop.restore()
