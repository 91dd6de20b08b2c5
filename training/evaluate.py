"""Evaluate any checkpoint of a run on lm-eval tasks, with the model as training builds it.

    python -m training.evaluate RUN_DIR [--step N] --tasks demo_arith_choice,... [--limit N]
        [--batch-size B] [--output results.json] [--tensor T --pipeline P]

Reads the run's config.yaml (model, precision, tokenizer) and its newest intact checkpoint (or
--step N), builds the model as the trainer does (the run's precision: emulated NVFP4 on a CPU,
TE on Blackwell), loads the weights into any tensor/pipeline layout (under torchrun, --tensor and
--pipeline split the processes), and runs lm-eval's `simple_evaluate` over `ProjectLM`
(training/lm_eval_model.py). Prints lm-eval's table; --output gets lm-eval's results (scores,
stderr, configs) and the flat `eval/<task>/<metric>` values.

Tasks: names from data/eval_tasks/ (the shipped, offline demo tasks), lm-eval's own catalogue,
or paths to task YAMLs. Offline by design: a task whose dataset is not local or cached is
refused before anything runs. Exit codes as the trainer's: 2 a bad argument (run directory,
step, an unknown task, --output), 3 a task's dataset is not available offline (or lm-eval is not
installed) or the tokenizer is missing,
6 the checkpoint is torn, corrupt or refused, 8 --output cannot be written.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger("nvfp4_pretrain")

EXIT_CONFIG, EXIT_MISSING, EXIT_NO_CHECKPOINT, EXIT_UNWRITABLE = 2, 3, 6, 8


class EvaluateError(Exception):
    def __init__(self, message: str, code: int = EXIT_CONFIG):
        super().__init__(message)
        self.code = code


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m training.evaluate",
                                description="Evaluate a run's checkpoint on lm-eval tasks.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task names or task YAML paths")
    p.add_argument("--limit", type=int, default=None, help="samples per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def check_args(args) -> list[str]:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise EvaluateError("--tasks: give at least one task")
    for key in ("limit", "batch_size", "tensor", "pipeline"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise EvaluateError(f"--{key.replace('_', '-')}={value}: must be >= 1")
    if args.output is not None:
        out = args.output.expanduser()
        if out.is_dir():
            raise EvaluateError(f"--output={out}: is a directory; give a file name")
        if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise EvaluateError(f"--output={out}: its directory does not exist or cannot be "
                                "written", EXIT_UNWRITABLE)
    return tasks


def load_model(run_dir: Path, step: Optional[int], ctx):
    """(built model on this rank with the checkpoint's weights, run files, checkpoint path)."""
    from data.demo import ensure_demo_corpus
    from data.tokenizer import load_tokenizer_spec
    from model.build import build_model, choose_backend
    from model.hf import HFError, load_full_tensors

    from .hf_export import pick_checkpoint, read_checkpoint_weights, read_run
    from .ddp_optimizer import PARAMS_DTYPE

    try:
        files = read_run(run_dir)
        checkpoint = pick_checkpoint(run_dir, step)
    except HFError as exc:
        raise EvaluateError(str(exc), exc.code) from None
    path = files.tokenizer or ensure_demo_corpus(
        os.path.abspath(os.path.expanduser(files.cache_dir)), files.demo).tokenizer_path
    try:
        tokenizer = load_tokenizer_spec(path)
    except (OSError, ValueError) as exc:
        raise EvaluateError(f"the run's tokenizer: {exc}", EXIT_MISSING) from None
    backend, _ = choose_backend(files.precision, files.model.spec, ctx.hardware)
    built = build_model(files.model, files.precision,
                        vocab_size=tokenizer.tokenizer.get_vocab_size(),
                        tensor_parallel=ctx.tensor, pipeline_parallel=ctx.pipeline,
                        backend=backend, pre_process=ctx.first_stage,
                        post_process=ctx.last_stage, params_dtype=PARAMS_DTYPE,
                        cuda=ctx.hardware.cuda)
    module = built.module.to(ctx.device)
    try:
        weights = read_checkpoint_weights(checkpoint)

        def tensor_for(key, shape):
            if key not in weights:
                raise HFError(f"{checkpoint.name} has no {key}", EXIT_NO_CHECKPOINT)
            return weights[key]

        load_full_tensors(module, tensor_for)
    except HFError as exc:
        raise EvaluateError(str(exc), exc.code) from None
    return built, files, tokenizer, checkpoint


def precision_at(built, files, checkpoint, run_dir: Path):
    """The precision controller in the state of the checkpoint's step (a run past its switch to
    BF16 is evaluated in BF16), its weight caches refreshed from the loaded weights."""
    from omegaconf import OmegaConf

    from nvfp4_recipe.megatron.controller import PrecisionController

    from . import checkpoint as ckpt

    step = ckpt.named_step(checkpoint)
    trainer = OmegaConf.load(run_dir / "config.yaml").get("trainer", {})
    per_step = int(trainer.get("global_batch_size", 1)) * int(trainer.get("seq_length", 1))
    controller = PrecisionController(files.precision, built, per_step,
                                     files.total_tokens or per_step)
    controller.before_step(step)
    return controller, step


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    ctx = None
    try:
        tasks = check_args(args)
        from .downstream import TaskUnavailable, UnknownTask, prepare_tasks

        try:
            manager = prepare_tasks(tasks)  # refused here, before any model is built
        except UnknownTask as exc:
            raise EvaluateError(str(exc), EXIT_CONFIG) from None
        except TaskUnavailable as exc:
            raise EvaluateError(str(exc), EXIT_MISSING) from None
        from .distributed import init_distributed, shutdown

        ctx = init_distributed(args.tensor, args.pipeline)
        return run(args, tasks, manager, ctx)
    except EvaluateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    finally:
        if ctx is not None:
            shutdown()


def run(args, tasks, manager, ctx) -> int:
    from lm_eval.utils import make_table

    from .downstream import evaluate, flat_metrics, summary_line, timed
    from .lm_eval_model import ProjectLM

    built, files, tokenizer, checkpoint = load_model(args.run_dir.expanduser(), args.step, ctx)
    controller, step = precision_at(built, files, checkpoint, args.run_dir.expanduser())
    lm = ProjectLM(built.module, tokenizer, ctx, hidden_size=files.model.hidden_size,
                   max_length=files.model.max_sequence_length, batch_size=args.batch_size,
                   gemm=ctx.hardware.gemm_compute(files.precision.gemm_compute))
    controller.before_evaluation()
    results, seconds = timed(evaluate, lm, tasks, manager, limit=args.limit, seed=args.seed)
    metrics = flat_metrics(results)
    if ctx.is_main:
        print(f"{checkpoint} (step {step})")
        print(make_table(results))
        print(summary_line(step, metrics, seconds))
        if args.output is not None:
            record = {"run_dir": str(args.run_dir), "checkpoint": str(checkpoint), "step": step,
                      "metrics": metrics, "results": results.get("results", {}),
                      "n-samples": results.get("n-samples", {}),
                      "configs": results.get("configs", {}), "versions": results.get("versions")}
            try:
                args.output.expanduser().write_text(json.dumps(record, indent=2, default=str))
            except OSError as exc:
                raise EvaluateError(f"--output={args.output}: {exc.strerror or exc}",
                                    EXIT_UNWRITABLE) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
