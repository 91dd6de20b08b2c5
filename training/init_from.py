"""`model.init_from=<a run directory>`: a new run starts from another run's weights alone.

The weights-only way to continue where a full resume cannot: a checkpoint whose optimizer state
this run cannot read (the CPU twin's into megatron's GPU optimizer or back, megatron's plain and
distributed optimizers, a dp_reshardable layout at another tensor/pipeline layout or spec). The
newest intact checkpoint of that run (verified against its manifest; read by
training/run_reader.py) gives every rank the full BF16 weights (any TP/PP layout and either spec
family it was written with: keys read in the portable spec's names, model/hf.py:canonical_key);
each rank keeps its own shard of them. The optimizer, schedule and data position start fresh, as
with a Hugging Face `model.init_from`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from model.config import ModelConfig
from model.hf import WEIGHT_SHAPE_FIELDS, load_full_tensors, refuse_non_finite

from .run_reader import RunDirError, pick_checkpoint, read_checkpoint_weights, read_run

log = logging.getLogger("nvfp4_pretrain")


def is_run_dir(path) -> bool:
    """A train.py run directory (config.yaml and checkpoints/), not a Hugging Face one."""
    path = Path(path).expanduser()
    return (path / "config.yaml").is_file() and (path / "checkpoints").is_dir()


def check_run_init(cfg: ModelConfig) -> Path:
    """model.init_from's run: its model shape against `cfg` and its newest intact checkpoint;
    raises RunDirError (exit 2) naming every mismatched field, or the missing checkpoint. Nothing
    is written. Returns the checkpoint."""
    run_dir = Path(cfg.init_from).expanduser()
    try:
        theirs = read_run(run_dir).model
        checkpoint = pick_checkpoint(run_dir, None)
    except RunDirError as exc:
        raise RunDirError(f"model.init_from={run_dir}: {exc}") from None
    # model.vocab_size is checked by the tensors' own shapes
    differ = [f"model.{key}={getattr(cfg, key)!r} but the run has {getattr(theirs, key)!r}"
              for key in WEIGHT_SHAPE_FIELDS if getattr(cfg, key) != getattr(theirs, key)]
    if differ:
        raise RunDirError(f"model.init_from={run_dir}: its model differs: {'; '.join(differ)}; "
                          "set model.* to the run's values (its config.yaml)")
    return checkpoint


def load_run_weights(module: torch.nn.Module, cfg: ModelConfig) -> None:
    """This rank's part of `module` (freshly built, any TP/PP, either spec) from the newest
    intact checkpoint of the run directory model.init_from names."""
    checkpoint = check_run_init(cfg)
    weights = read_checkpoint_weights(checkpoint)

    def tensor_for(key: str, shape):
        if key not in weights:
            raise RunDirError(f"model.init_from={cfg.init_from}: {checkpoint.name} has no {key}")
        refuse_non_finite(weights[key], f"model.init_from={cfg.init_from}: {key} of {checkpoint.name}")
        return weights[key]

    load_full_tensors(module, tensor_for)
    log.info(f"model.init_from: the weights of {checkpoint} (optimizer, schedule and data "
             "position start fresh)")
