"""Evaluate any checkpoint of a run on lm-eval tasks, with the model as training builds it.

    python -m tools.evaluate RUN_DIR [--step N] --tasks demo_arith_choice,... [--limit N]
        [--batch-size B] [--output results.json [--log-samples] [--overwrite]] [--tensor T --pipeline P
        [--first-stage-layers F] [--last-stage-layers L]]

Reads the run's config.yaml (model, precision, tokenizer) and its newest intact checkpoint (or
--step N), builds the model as the trainer does (the run's precision: emulated NVFP4 on a CPU,
TE on Blackwell), loads the weights into any tensor/pipeline layout (under torchrun, --tensor and
--pipeline split the processes), and runs lm-eval's `simple_evaluate` over `ProjectLM`
(training/lm_eval_model.py). Prints lm-eval's table; --output gets lm-eval's results (scores,
stderr, configs) and the flat `eval/<task>/<metric>` values, and with --log-samples lm-eval's
per-sample records (each request's log-likelihood).

Tasks: names from data/eval_tasks/ (the shipped, offline demo tasks), lm-eval's own catalogue,
or paths to task YAMLs. Offline by design: a task whose dataset is not local or cached is
refused before anything runs. Exit codes (errors.ExitCode): 2 a bad argument (run directory,
step, an unknown task, a layout that does not fit, an --output inside the run directory, through
a link, or existing without --overwrite), 3 a task's dataset is not
available offline (or lm-eval is not installed) or the tokenizer is missing, 6 the checkpoint is
torn, corrupt or refused, 8 --output cannot be written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from compat import quiet_cpu_fallback_warnings
from data.demo import ensure_demo_corpus
from data.tokenizer import load_tokenizer_spec
from errors import ConfigError, ExitCode, MissingError, ProjectError
from model.hf import load_full_tensors
from model.memory_model import pipeline_stages
from nvfp4_recipe.megatron.te_mapping import te_environment_refusal, te_formats
from training.ddp_optimizer import PARAMS_DTYPE
from training.distributed import init_distributed, shutdown
from training.downstream import evaluate, flat_metrics, prepare_tasks, summary_line, timed
from training.run_dir import check_output_file, write_output_file
from training.run_reader import RunDirError, pick_checkpoint, read_checkpoint_weights, read_run

log = logging.getLogger("nvfp4_pretrain")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tools.evaluate",
                                description="Evaluate a run's checkpoint on lm-eval tasks.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task names or task YAML paths")
    p.add_argument("--limit", type=int, default=None, help="samples per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--output", type=Path, default=None,
                   help="write the results as JSON (never inside RUN_DIR or through a link)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="layers in the first pipeline stage when the pattern does not split "
                        "evenly (as parallel.first_stage_layers)")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="layers in the last pipeline stage (as parallel.last_stage_layers)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-samples", action="store_true",
                   help="put lm-eval's per-sample records (each choice's log-likelihood, the "
                        "metrics) into --output")
    return p.parse_args(argv)


def check_args(args) -> list[str]:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks: give at least one task")
    for key in ("limit", "batch_size", "tensor", "pipeline", "first_stage_layers",
                "last_stage_layers"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ConfigError(f"--{key.replace('_', '-')}={value}: must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's
    if world % (args.tensor * args.pipeline):
        raise ConfigError(f"--tensor={args.tensor} x --pipeline={args.pipeline} does not divide "
                          f"the {world} processes")
    if args.log_samples and args.output is None:
        raise ConfigError("--log-samples: the samples go into --output; give --output FILE")
    if args.output is not None:
        out = args.output.expanduser()
        if out.is_dir():
            raise ConfigError(f"--output={out}: is a directory; give a file name")
        check_output_file(out, args.run_dir, overwrite=args.overwrite)
        if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise ProjectError(f"--output={out}: its directory does not exist or cannot be "
                               "written", ExitCode.UNWRITABLE)
    return tasks


def load_model(run_dir: Path, step: Optional[int], ctx, first_stage_layers=None,
               last_stage_layers=None):
    """(built model on this rank with the checkpoint's weights, run files, checkpoint path)."""
    # deferred: model.build imports megatron (~3 s); main refuses bad arguments and tasks first
    from model.build import build_model, choose_backend

    files = read_run(run_dir)  # RunDirError: a ProjectError with its own code
    checkpoint = pick_checkpoint(run_dir, step)
    try:
        pipeline_stages(files.model.num_layers, ctx.pipeline, first_stage_layers,
                        last_stage_layers)
    except ValueError:
        raise ConfigError(
            f"--pipeline={ctx.pipeline}: the run's {files.model.num_layers}-layer pattern does "
            f"not split into {ctx.pipeline} stages with --first-stage-layers="
            f"{first_stage_layers} --last-stage-layers={last_stage_layers}") from None
    path = files.tokenizer or ensure_demo_corpus(
        os.path.abspath(os.path.expanduser(files.cache_dir)), files.demo).tokenizer_path
    try:
        tokenizer = load_tokenizer_spec(path)
    except (OSError, ValueError) as exc:
        raise MissingError(f"the run's tokenizer: {exc}") from None
    backend, _ = choose_backend(files.precision, files.model.spec, ctx.hardware)
    if backend == "te":  # as train.py's start-up: TE would evaluate another recipe
        refusal = te_environment_refusal(os.environ, te_formats(files.precision))
        if refusal:
            raise ConfigError(refusal)
    built = build_model(files.model, files.precision,
                        vocab_size=tokenizer.tokenizer.get_vocab_size(),
                        tensor_parallel=ctx.tensor, pipeline_parallel=ctx.pipeline,
                        backend=backend, pre_process=ctx.first_stage,
                        post_process=ctx.last_stage, params_dtype=PARAMS_DTYPE,
                        num_layers_in_first_stage=first_stage_layers,
                        num_layers_in_last_stage=last_stage_layers,
                        cuda=ctx.hardware.cuda)
    module = built.module.to(ctx.device)
    weights = read_checkpoint_weights(checkpoint)

    def tensor_for(key, shape):
        if key not in weights:
            raise RunDirError(f"{checkpoint.name} has no {key}", ExitCode.NO_USABLE_CHECKPOINT)
        return weights[key]

    load_full_tensors(module, tensor_for)
    return built, files, tokenizer, checkpoint


def precision_at(built, files, checkpoint, run_dir: Path):
    """The precision controller in the state of the checkpoint's step (a run past its switch to
    BF16 is evaluated in BF16), its weight caches refreshed from the loaded weights."""
    from omegaconf import OmegaConf

    # deferred: both import megatron (~3 s), as model.build in load_model
    from training.precision import PrecisionController
    from training import checkpoint as ckpt

    step = ckpt.named_step(checkpoint)
    trainer = OmegaConf.load(run_dir / "config.yaml").get("trainer", {})
    per_step = int(trainer.get("global_batch_size", 1)) * int(trainer.get("seq_length", 1))
    controller = PrecisionController(files.precision, built, per_step,
                                     files.total_tokens or per_step)
    controller.before_step(step)
    return controller, step


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_cpu_fallback_warnings()
    args = parse_args(argv)
    ctx = None
    try:
        tasks = check_args(args)
        # an unknown task (exit 2), a dataset not here offline (3): before any model is built
        manager = prepare_tasks(tasks)
        ctx = init_distributed(args.tensor, args.pipeline)
        return run(args, tasks, manager, ctx)
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    finally:
        if ctx is not None:
            shutdown()


def run(args, tasks, manager, ctx) -> int:
    from lm_eval.utils import make_table

    # deferred: lm-eval is optional and costly to import; prepare_tasks (in main) refuses its
    # absence with exit 3 first
    from training.lm_eval_model import ProjectLM

    built, files, tokenizer, checkpoint = load_model(
        args.run_dir.expanduser(), args.step, ctx, args.first_stage_layers,
        args.last_stage_layers)
    controller, step = precision_at(built, files, checkpoint, args.run_dir.expanduser())
    lm = ProjectLM(built.module, tokenizer, ctx, hidden_size=files.model.hidden_size,
                   max_length=files.model.max_sequence_length, batch_size=args.batch_size,
                   vocab_size=files.model.vocab_size,
                   gemm=ctx.hardware.gemm_compute(files.precision.gemm_compute))
    controller.before_evaluation()
    results, seconds = timed(evaluate, lm, tasks, manager, limit=args.limit, seed=args.seed,
                             log_samples=args.log_samples)
    if ctx.is_main:  # lm-eval returns the results on the first process only
        metrics = flat_metrics(results)
        print(f"{checkpoint} (step {step})")
        print(make_table(results))
        print(summary_line(step, metrics, seconds))
        if args.output is not None:
            record = {"run_dir": str(args.run_dir), "checkpoint": str(checkpoint), "step": step,
                      "metrics": metrics, "results": results.get("results", {}),
                      "n-samples": results.get("n-samples", {}),
                      "configs": results.get("configs", {}), "versions": results.get("versions")}
            if args.log_samples:
                record["samples"] = results.get("samples", {})
            try:
                write_output_file(args.output.expanduser(),
                                  json.dumps(record, indent=2, default=str),
                                  overwrite=args.overwrite)
            except OSError as exc:
                raise ProjectError(f"--output={args.output}: {exc.strerror or exc}",
                                   ExitCode.UNWRITABLE) from None
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
